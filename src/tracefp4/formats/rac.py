"""NVFP4 with residual activation compensation (QUADS, arXiv 2607.15810): the residual of the first
pass re-quantized on the channels with the largest first-pass error and added back."""

from __future__ import annotations

import numpy as np
import torch

from tracefp4.formats.containers import CompensatedNVFP4
from tracefp4.formats.dequant import dequantize_nvfp4
from tracefp4.formats.nvfp4 import quantize_nvfp4
from tracefp4.formats.rows import as_rows
from tracefp4.formats.validation import expect

__all__ = ["dequantize_nvfp4_rac", "quantize_nvfp4_rac", "rac_channel_count"]


def rac_channel_count(k: int, fraction: float) -> int:
    """Channels of a row of ``k`` that are compensated: ``ceil(fraction * k)``, fraction in (0, 1]."""
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1):
        raise ValueError(f"compensation fraction: expected a number in (0, 1], got {fraction!r}")
    return int(np.ceil(fraction * k))


def quantize_nvfp4_rac(x: torch.Tensor, fraction: float = 0.5) -> CompensatedNVFP4:
    """NVFP4 per row, plus the residual re-quantized on the ``ceil(fraction * K)`` channels of each
    row with the largest first-pass error ``|x - x_hat|`` (ties to the lower channel index), on x's
    device; :func:`tracefp4.formats.reference_composite.quantize_nvfp4_rac` is the readable form."""
    n = rac_channel_count(x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0, fraction)
    first = quantize_nvfp4(x, per_row=True)
    residual = as_rows(x.detach().to(torch.float32) - dequantize_nvfp4(first))
    chosen = torch.argsort(residual.abs(), dim=-1, descending=True, stable=True)[:, :n]
    mask = torch.zeros(residual.shape, dtype=torch.bool, device=residual.device).scatter_(1, chosen, True)
    kept = torch.where(mask, residual, torch.zeros_like(residual)).reshape(x.shape)
    return CompensatedNVFP4(first, quantize_nvfp4(kept, per_row=True))


def dequantize_nvfp4_rac(q: CompensatedNVFP4) -> torch.Tensor:
    """float32 ``dequantize(first) + dequantize(residual)``: what the compensated GEMM multiplies."""
    expect(q, CompensatedNVFP4)
    return dequantize_nvfp4(q.first) + dequantize_nvfp4(q.residual)
