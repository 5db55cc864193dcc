"""NVFP4 quantization (Transformer Engine's operation order; the formula is stated on
:class:`tracefp4.formats.constants.Format`), standard and "Four over Six", on x's device."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import NVFP4_BLOCK
from tracefp4.formats.containers import NVFP4
from tracefp4.formats.dequant import dequantize_nvfp4
from tracefp4.formats.dispatch import Op, implementation
from tracefp4.formats.validation import check_global_amax, check_input

__all__ = ["quantize_dequantize_nvfp4", "quantize_nvfp4", "quantize_nvfp4_4over6"]


def quantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """Quantize ``x [..., K]`` (K % 16 == 0) to NVFP4, on x's device.

    ``global_amax=None`` takes the amax of the whole tensor, or of each row with ``per_row=True``;
    a tensor passed in (a scalar, or ``[..., 1]``) is used as is.
    """
    return _quantize(x, global_amax, per_row, values=False)[0]


def quantize_dequantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False
                              ) -> tuple[NVFP4, torch.Tensor]:
    """``q = quantize_nvfp4(x)`` and ``dequantize_nvfp4(q).to(x.dtype)``, bit for bit; a bf16 ``x`` on
    the CPU gets both from one pass of the kernel (what a rollout's site needs: its codes and the
    value its next op sees, without a second pass, a float32 copy and its cast)."""
    q, values = _quantize(x, global_amax, per_row, values=True)
    return q, (dequantize_nvfp4(q).to(x.dtype) if values is None else values)


def _quantize(x: torch.Tensor, global_amax, per_row: bool, *, values: bool) -> tuple[NVFP4, torch.Tensor | None]:
    check_input(x, NVFP4_BLOCK)
    amax = None if global_amax is None else check_global_amax(global_amax, x.shape).to(x.device)
    return implementation(Op.QUANTIZE_NVFP4, x, amax, per_row, values)(x, amax, per_row, values)


def quantize_nvfp4_4over6(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """NVFP4 with the "Four over Six" block scales (arXiv 2512.02010): each block of 16 takes the E4M3
    scale mapping its maximum to 4 or to 6, whichever gives the smaller sum of squared errors (float64,
    accumulated in element order; a tie keeps 6). Same arguments and container as :func:`quantize_nvfp4`.
    """
    check_input(x, NVFP4_BLOCK)
    amax = None if global_amax is None else check_global_amax(global_amax, x.shape).to(x.device)
    return implementation(Op.QUANTIZE_NVFP4_4OVER6, x, amax, per_row)(x, amax, per_row)
