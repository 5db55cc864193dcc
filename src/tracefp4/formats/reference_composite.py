"""The readable reference of the recipes built on the element formats of
:mod:`tracefp4.formats.reference`: residual activation compensation (QUADS) and the packed-FP4
grouped GEMM. The oracle of tests only, written for reading as that module is.
"""

from __future__ import annotations

import math

import torch

from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK
from tracefp4.formats.reference import dequantize_nvfp4, e2m1_value, mx_scale, quantize_nvfp4

_F32 = torch.float32


# --- Residual activation compensation (QUADS, arXiv 2607.15810) ----------------------------------
# The activation is quantized to NVFP4 (a global amax per row); the residual x - x_hat1 is kept on
# the ``ceil(fraction * K)`` channels of each row with the largest |residual| (the first pass's
# error; a tie goes to the lower channel index), zero elsewhere, and quantized to NVFP4 a second time
# (its own per-row amax). The GEMM consumes x_hat1 + x_hat2 (float32 sum of the two dequantized passes).


def rac_channels(x: torch.Tensor, residual: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool ``[..., K]``: the compensated channels of each row."""
    k = x.shape[-1]
    n = math.ceil(fraction * k)
    flat = residual.reshape(-1, k)
    mask = torch.zeros(flat.shape, dtype=torch.bool)
    for row in range(flat.shape[0]):
        err = [abs(float(v)) for v in flat[row]]
        for j in sorted(range(k), key=lambda j: (-err[j], j))[:n]:
            mask[row, j] = True
    return mask.reshape(x.shape)


def quantize_nvfp4_rac(x: torch.Tensor, fraction: float):
    """Reference compensated NVFP4: ``((codes, s8, amax) of the first pass, (codes, s8, amax) of the
    residual pass, channel mask)``; unpacked codes as :func:`quantize_nvfp4` returns them."""
    first = quantize_nvfp4(x, per_row=True)
    residual = x.to(_F32) - dequantize_nvfp4(*first)
    mask = rac_channels(x, residual, fraction)
    second = quantize_nvfp4(torch.where(mask, residual, torch.zeros_like(residual)), per_row=True)
    return first, second, mask


def dequantize_nvfp4_rac(first, second) -> torch.Tensor:
    """float32 ``x_hat1 + x_hat2``."""
    return dequantize_nvfp4(*first) + dequantize_nvfp4(*second)


# --- the packed-FP4 grouped GEMM (tracefp4.formats.clib.gemm) ------------------------------------


def expert_weights(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 ``[E, N, K]``: value(code) * block scale of packed ``codes`` ``[E, N, K/2]`` (element 2i
    in the low nibble) and scale bytes ``scales`` ``[E, N, K/block]``, without any global scale."""
    unpacked = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    if fmt == "nvfp4":
        block, scale = NVFP4_BLOCK, scales.view(torch.float8_e4m3fn).to(torch.float64)
    else:
        block, scale = MXFP4_BLOCK, mx_scale(scales).to(torch.float64)
    return e2m1_value(unpacked).to(torch.float64) * scale.repeat_interleave(block, dim=-1)


def grouped_gemm_exact(x: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       divisor: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 ``[R, N]``: each row of expert e times expert e's exact weights, over its divisor. Every
    product is exact in float64 and, for the shapes tested, so is every sum."""
    w = expert_weights(codes, scales, fmt)
    out = torch.zeros(x.shape[0], codes.shape[1], dtype=torch.float64)
    for e in range(codes.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = x[lo:hi].to(torch.float64) @ w[e].T / float(divisor[e])
    return out


def grouped_gemm_reference(x: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           divisor: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernel's contract with the exact sum: ``bf16( fl32(sum) / divisor )`` (float32 division,
    round-to-nearest-even to bf16). Equal to the kernel bit for bit wherever its float32 additions are
    exact (the sum and every partial sum representable), e.g. small dyadic operands."""
    w = expert_weights(codes, scales, fmt)
    out = torch.zeros(x.shape[0], codes.shape[1], dtype=torch.float32)
    for e in range(codes.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = (x[lo:hi].to(torch.float64) @ w[e].T).to(torch.float32) / divisor[e].to(torch.float32)
    return out.to(torch.bfloat16)
