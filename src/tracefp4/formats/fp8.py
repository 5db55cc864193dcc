"""FP8 E4M3 with a per-row scale (W4A8 activations, the KV cache, W8A8 weights): quantize, the low-bit
hint and rollout-guided rounding on a given row scale. The quantize runs as one C pass on the CPU
(:mod:`tracefp4.formats.clib.quant`) and as a handful of elementwise torch ops elsewhere; the hint and
the guided rounding are torch's ops on every device."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import (E4M3_MAG_MASK, E4M3_MAX, E4M3_MAX_CODE, E4M3_SIGN_BIT, E4M3_VALUES,
                                        SUPPORTED_DTYPES, Format)
from tracefp4.formats.containers import FP8
from tracefp4.formats.dispatch import Op, backend, implementation
from tracefp4.formats.grid import mod4_choice
from tracefp4.formats.rows import as_rows
from tracefp4.formats.validation import check_grid, check_hint, describe, raise_non_finite

__all__ = ["fp8_lsb_bits", "fp8_grid_z", "guided_fp8", "mod4_e4m3", "quantize_fp8"]


def quantize_fp8(x: torch.Tensor) -> FP8:
    """FP8 E4M3 with one float32 scale ``amax/448`` per row, on x's device (the C library's pass where it
    takes x, else torch's ops: the same bits)."""
    _check_x(x)
    return implementation(Op.QUANTIZE_FP8, x)(x)


def fp8_lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes ``[..., K]`` (K % 8 == 0) -> their lowest bits, eight per byte ``[..., K//8]``
    (element 8j+i in bit i, as :func:`lsb_bits` packs FP4's), on the codes' device."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 8:
        raise ValueError(f"fp8_lsb_bits codes: expected uint8 of shape [..., K] with K % 8 == 0, got {describe(codes)}")
    low = (codes & 1).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (low * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack_lsb(bits: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., K//8]`` packed bits -> int64 ``[..., K]`` (element 8j+i from bit i of byte j)."""
    shifts = torch.arange(8, device=bits.device)
    return ((bits.long().unsqueeze(-1) >> shifts) & 1).reshape(*bits.shape[:-1], k)


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES or x.dim() == 0:
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor of shape [..., K], got {describe(x)}")
    backend(x)  # the device check every op makes


def _lsb_member(z: torch.Tensor, bits: torch.Tensor, k: int) -> torch.Tensor:
    """Magnitude codes of ``z``: the member of its bracket whose lowest bit is the hint's. The
    round-to-nearest code (PyTorch's E4M3 cast) and its neighbour on the other side of ``|z|`` form
    the bracket (adjacent magnitude codes are adjacent values)."""
    mag = (z.to(torch.float8_e4m3fn).view(torch.uint8) & E4M3_MAG_MASK).long()
    value = torch.from_numpy(E4M3_VALUES[: E4M3_MAX_CODE + 1].copy()).to(z.device)[mag]
    a = z.abs()
    lo = torch.where(value <= a, mag, mag - 1)
    hi = torch.where(value >= a, mag, mag + 1)
    bit = _unpack_lsb(bits, k)
    return torch.where((lo == hi) | ((lo & 1) == bit), lo, hi).to(torch.uint8)


def fp8_grid_z(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``clamp(x / scale, +-448)`` on the per-row ``scale`` (on x's device), as :func:`guided_fp8`
    computes it: the value each E4M3 code rounds."""
    z = x.detach().to(torch.float32) / scale.to(x.device)
    return torch.clamp(z, -E4M3_MAX, E4M3_MAX)


def mod4_e4m3(z: torch.Tensor, residue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 codes, detected-miss bool) of clamped float32 ``z`` guided by ``mod4`` residues: the
    reference's :func:`~tracefp4.formats.reference.guided_round_mod4_e4m3`, vectorised (round to
    nearest is PyTorch's E4M3 cast, as in :func:`guided_fp8`)."""
    rtn = z.to(torch.float8_e4m3fn)
    return mod4_choice(z, rtn.view(torch.uint8), E4M3_SIGN_BIT, rtn.to(torch.float32), residue)


def guided_fp8(
    x: torch.Tensor, scale: torch.Tensor, *, codes: torch.Tensor | None = None, lsb: torch.Tensor | None = None,
    owner: str = "grid",
) -> FP8:
    """Quantize ``x`` to E4M3 on the per-row ``scale`` (the rollout's), guided by ``codes`` (uint8 E4M3
    codes ``[..., K]``, full information: the rollout's code is taken, a zero keeping x's sign bit) or
    ``lsb`` (lowest code bits, eight per byte, ``[..., K//8]``: the member of the bracket with that
    bit); exactly one of the two is given.

    The rule of :func:`tracefp4.formats.reference.guided_round_e4m3`, vectorised: the round-to-nearest
    code (PyTorch's E4M3 cast) and the neighbour on the other side of ``z`` form the bracket (adjacent
    magnitude codes are adjacent values). The result is on x's device; grid and hint may be elsewhere.
    """
    if (codes is None) == (lsb is None):
        raise ValueError("guided_fp8: give exactly one of codes (full) or lsb")
    _check_x(x)
    check_grid(Format.FP8, scale, None, x.shape, owner)
    k = x.shape[-1]
    if lsb is not None and k % 8:
        raise ValueError(f"{owner} lsb: FP8 lsb hints pack eight elements per byte; K = {k} is not a multiple of 8")
    check_hint(codes if codes is not None else lsb, "codes" if codes is not None else "lsb", owner, x,
               1 if codes is not None else 8)
    dev = x.device
    xf = x.detach().to(torch.float32)
    bad = ~torch.isfinite(as_rows(xf)).all(dim=-1)
    if bool(bad.any()):
        raise_non_finite(x, bad)
    s = scale.to(dev)
    z = torch.clamp(xf / s, -E4M3_MAX, E4M3_MAX)
    sign = torch.signbit(z).to(torch.uint8) << 7
    if codes is not None:  # the rollout's code; only a zero's sign is the trainer's
        r = codes.to(dev)
        out = torch.where((r & E4M3_MAG_MASK) == 0, sign, r)
    else:
        out = _lsb_member(z, lsb.to(dev), k) | sign
    return FP8(out.view(torch.float8_e4m3fn), s.clone())
