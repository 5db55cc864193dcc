"""MXFP4 quantization (OCP MX v1.0; the formula is stated on :class:`tracefp4.formats.constants.Format`)."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import MXFP4_BLOCK, ScaleMode
from tracefp4.formats.containers import MXFP4
from tracefp4.formats.dispatch import Op, implementation
from tracefp4.formats.validation import check_input

__all__ = ["quantize_mxfp4"]


def quantize_mxfp4(x: torch.Tensor, *, scale_mode: ScaleMode | str = ScaleMode.FLOOR) -> MXFP4:
    """Quantize ``x [..., K]`` (K % 32 == 0) to MXFP4 with E8M0 block scales (see ScaleMode), on x's device."""
    rceil = ScaleMode(scale_mode) is ScaleMode.RCEIL
    check_input(x, MXFP4_BLOCK)
    return implementation(Op.QUANTIZE_MXFP4, x, rceil)(x, rceil)
