"""The torch backend: ops written as vectorised torch on any device, where no kernel of ours exists
(NVFP4 with the "Four over Six" block scales; FP8 E4M3 where the CPU library does not run it).
Each function has the signature of its op's table in :mod:`tracefp4.formats.dispatch`."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import E2M1_MAX, E2M1_VALUES, E4M3_MAX, NVFP4_BLOCK
from tracefp4.formats.containers import FP8, NVFP4
from tracefp4.formats.grid import block_scale_unrounded, encode_factor, nvfp4_global_encode_scale, rtn_e2m1
from tracefp4.formats.packing import pack_fp4
from tracefp4.formats.rows import as_rows, per_row_values
from tracefp4.formats.validation import FP8_NON_FINITE, raise_non_finite

__all__ = ["dequantize_fp8", "quantize_fp8", "quantize_nvfp4_4over6"]

_F32 = torch.float32
_E2M1_SIGNED = tuple(E2M1_VALUES) + tuple(-v for v in E2M1_VALUES)  # value of codes 0..15
_4OVER6_CHUNK = 1 << 20  # elements per chunk of rows: bounded temporaries


def quantize_nvfp4_4over6(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool) -> NVFP4:
    """Four over Six NVFP4 of validated ``x`` with the given ``amax``, each row's own or the tensor's:
    both candidates at once, rounding by midpoints, in the reference's operation order."""
    bad = ~torch.isfinite(as_rows(x.detach())).all(dim=-1)
    if bool(bad.any()):
        raise_non_finite(x, bad)
    dev = x.device
    xf = x.detach().to(_F32)
    if amax is None:
        if per_row:
            amax = xf.abs().amax(dim=-1, keepdim=True)
        else:
            amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=_F32, device=dev)
    s_enc = per_row_values(nvfp4_global_encode_scale(amax).to(dev), x.shape).unsqueeze(-1)  # [R, 1]
    rows = as_rows(xf)
    step = max(1, _4OVER6_CHUNK // max(rows.shape[1], 1))
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=dev)
    scales = torch.empty((rows.shape[0], rows.shape[1] // NVFP4_BLOCK), dtype=torch.uint8, device=dev)
    for r in range(0, rows.shape[0], step):
        codes[r:r + step], scales[r:r + step] = _4over6_rows(rows[r:r + step], s_enc[r:r + step])
    return NVFP4.from_rows(pack_fp4(codes), scales, amax, x.shape[:-1])


def _4over6_rows(xr: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked codes ``[R, K]`` and E4M3 scale bytes ``[R, K/16]`` of float32 rows ``xr`` with their
    ``S_enc`` ``[R, 1]``: both candidates at once, in the reference's operation order."""
    dev = xr.device
    xb = xr.reshape(xr.shape[0], -1, NVFP4_BLOCK)  # [R, nb, 16]
    one_sixth = torch.tensor(1.0, dtype=_F32, device=dev) / torch.tensor(E2M1_MAX, dtype=_F32, device=dev)
    per_max = torch.stack([one_sixth, torch.tensor(0.25, dtype=_F32, device=dev)])  # candidates 6, 4
    s8 = block_scale_unrounded(xb.abs().amax(dim=-1).unsqueeze(-1), s_enc.unsqueeze(-1), per_max)  # [R, nb, 2]
    s8 = s8.to(torch.float8_e4m3fn)
    s_enc_c = s_enc.unsqueeze(-1)  # [R, 1, 1]
    enc = encode_factor(s8, s_enc_c)
    z = torch.clamp(xb.unsqueeze(-2) * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)  # [R, nb, 2, 16]
    codes = rtn_e2m1(z)
    values = torch.tensor(_E2M1_SIGNED, dtype=_F32, device=dev)[codes.long()]
    deq = values * s8.to(_F32).unsqueeze(-1) / s_enc_c.unsqueeze(-1)
    sq = (xb.unsqueeze(-2).double() - deq.double()) ** 2
    err = torch.zeros(sq.shape[:-1], dtype=torch.float64, device=dev)
    for j in range(NVFP4_BLOCK):  # in element order, as the reference
        err = err + sq[..., j]
    four_wins = err[..., 1] < err[..., 0]  # a tie keeps 6
    s8u = s8.view(torch.uint8)
    scales = torch.where(four_wins, s8u[..., 1], s8u[..., 0])
    chosen = torch.where(four_wins.unsqueeze(-1), codes[..., 1, :], codes[..., 0, :])
    return chosen.reshape(xr.shape), scales


def quantize_fp8(x: torch.Tensor) -> FP8:
    """FP8 E4M3 of validated ``x`` with one float32 scale ``amax/448`` per row (1 for a zero row)."""
    xf = x.detach().to(_F32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(FP8_NON_FINITE)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # Clamp before the cast: older CPU casts turn overflow into NaN instead of saturating.
    return FP8((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale)


def dequantize_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``value(code) * scale[row]`` of E4M3 code rows uint8 ``[R, K]``."""
    return rows.view(torch.float8_e4m3fn).to(_F32) * scale.unsqueeze(-1)
