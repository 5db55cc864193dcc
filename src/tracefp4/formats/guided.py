"""Rollout-guided rounding on a given FP4 grid, and the low-bit hint a rollout records for it."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import Format
from tracefp4.formats.containers import MXFP4, NVFP4
from tracefp4.formats.dispatch import Op, implementation
from tracefp4.formats.grid import nvfp4_global_encode_scale
from tracefp4.formats.rows import as_rows, per_row_values, row_count
from tracefp4.formats.validation import (check_grid, check_hint, check_input, checked_scale_copy, describe,
                                        raise_non_finite)

__all__ = ["guided_codes", "lsb_bits"]


def lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K//2]`` -> bit-packed low magnitude bits ``[..., K//8]``, on the codes' device."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 4:
        raise ValueError(f"lsb_bits codes: expected uint8 of shape [..., K/2] with K/2 % 4 == 0, got {describe(codes)}")
    rows = as_rows(codes)
    bits = implementation(Op.LSB_BITS, codes, what="codes")(rows)
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] // 4)


def _decode_divisors(x: torch.Tensor, fmt: Format, global_amax: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[R]``: ``1 / S_enc`` per row for NVFP4, 1 for MXFP4, on x's device."""
    dev = x.device
    if fmt is Format.NVFP4:
        s_dec = torch.tensor(1.0, dtype=torch.float32, device=dev) / nvfp4_global_encode_scale(global_amax.to(dev))
        return per_row_values(s_dec, x.shape)
    return torch.ones(row_count(x.shape), dtype=torch.float32, device=dev)


def guided_codes(
    x: torch.Tensor,
    fmt: Format | str,
    scales: torch.Tensor,
    global_amax: torch.Tensor | None,
    *,
    codes: torch.Tensor | None = None,
    lsb: torch.Tensor | None = None,
    owner: str = "grid",
) -> NVFP4 | MXFP4:
    """Quantize ``x`` on the grid ``(scales, global_amax)``, each element rounded to the member of its
    bracket that ``codes`` (packed 4-bit codes ``[..., K//2]``, full information) or ``lsb`` (low
    magnitude bits, eight per byte, ``[..., K//8]``) names. Exactly one of the two is given.

    The grid and the hint are validated against x (:func:`check_grid`; ``owner`` names them in the
    errors); they may live on another device than x and are moved to it. The result is on x's device.
    """
    fmt = Format(fmt)
    if not fmt.fp4:
        raise ValueError(f"guided_codes: {fmt.value} is not an FP4 format (FP8 is guided by guided_fp8)")
    if (codes is None) == (lsb is None):
        raise ValueError("guided_codes: give exactly one of codes (full) or lsb")
    check_input(x, fmt.block)
    check_grid(fmt, scales, global_amax, x.shape, owner, scan_scales=False)
    full = codes is not None
    hint = codes if full else lsb
    check_hint(hint, "codes" if full else "lsb", owner, x, 2 if full else 8)
    dev = x.device
    # the result's scales: copied with the NaN check in one pass, before the kernel reads them
    scales = checked_scale_copy(fmt, scales.to(dev), owner)
    if fmt is Format.NVFP4:
        global_amax = global_amax.to(dev)
    s_dec = _decode_divisors(x, fmt, global_amax)
    scale_rows = as_rows(scales.view(torch.uint8))
    hint_rows = as_rows(hint.to(dev))
    out, bad = implementation(Op.GUIDED, x)(x, fmt, scale_rows, s_dec, hint_rows, full)
    raise_non_finite(x, bad)
    codes_t = out.reshape(*x.shape[:-1], out.shape[-1])
    if fmt is Format.NVFP4:
        return NVFP4(codes_t, scales, global_amax.clone())
    return MXFP4(codes_t, scales)
