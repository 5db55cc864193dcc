"""FP4 codes two per byte (element 2i in the low nibble), and codes as positions on the signed line."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import E2M1_SIGN_BIT, E4M3_SIGN_BIT, Format
from tracefp4.formats.validation import shape_tuple

__all__ = ["code_positions", "pack_fp4", "signed_index", "unpack_fp4"]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """One 4-bit code per uint8 ``[..., K]`` -> two per byte ``[..., K//2]`` (element 2i low nibble)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4: expected uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {shape_tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("pack_fp4: codes must be 4-bit values 0..15")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two codes per byte ``[..., N]`` -> one per uint8 ``[..., 2N]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _signed(codes: torch.Tensor, sign: int) -> torch.Tensor:
    c = codes.long()
    return torch.where(c >= sign, -(c - sign), c)


def signed_index(codes: torch.Tensor) -> torch.Tensor:
    """int64 position of each unpacked 4-bit code on the signed line -7..7 (both zeros at 0)."""
    return _signed(codes, E2M1_SIGN_BIT)


def code_positions(codes: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """int64 position of each stored code on its format's signed line (both zeros at 0): FP4 codes
    packed two per byte ``[..., K//2]`` (-7..7), FP8 E4M3 codes ``[..., K]`` (-126..126). Codes one
    position apart are adjacent codewords."""
    fmt = Format(fmt)
    if fmt.fp4:
        return signed_index(unpack_fp4(codes))
    return _signed(codes, E4M3_SIGN_BIT)
