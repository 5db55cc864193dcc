"""FP4 tensors (NVFP4, MXFP4) and FP8: containers, quantize, dequantize, pack, straight-through, guided
rounding on either grid, and NVFP4 with residual activation compensation.

NVFP4 follows Transformer Engine's operation order and MXFP4 the OCP MX v1.0 recipe; the formulas
are stated on :class:`tracefp4.formats.constants.Format` and :class:`ScaleMode`. The package is split
by concern:

* :mod:`~tracefp4.formats.constants`: every numeric constant and the format enums;
* :mod:`~tracefp4.formats.containers`: the quantized tensors; :mod:`~tracefp4.formats.validation`:
  the checks of what enters an op; :mod:`~tracefp4.formats.rows`: tensors as kernel rows;
* the ops: :mod:`~tracefp4.formats.nvfp4`, :mod:`~tracefp4.formats.mxfp4`, :mod:`~tracefp4.formats.fp8`,
  :mod:`~tracefp4.formats.dequant`, :mod:`~tracefp4.formats.guided`, :mod:`~tracefp4.formats.packing`,
  :mod:`~tracefp4.formats.rac`, :mod:`~tracefp4.formats.straight_through`;
* :mod:`~tracefp4.formats.grid`: the torch grid (encode scales, ``z``, the one round-to-nearest);
* :mod:`~tracefp4.formats.dispatch`: one table per op of its backends (numba, C, Triton, torch) and
  the one choice among them; the backends :mod:`~tracefp4.formats.numba_ops` (over
  :mod:`~tracefp4.formats.kernels`), :mod:`~tracefp4.formats.triton_ops` (over
  :mod:`~tracefp4.formats.triton_kernels`, imported only when needed), :mod:`~tracefp4.formats.torch_ops`
  and :mod:`tracefp4.formats.clib` (the C library: GEMMs, site quantize, K/V attention, MoE combine);
* :mod:`~tracefp4.formats.quantizers`: one quantizer object per format and tensor role.

:mod:`tracefp4.formats.reference` is the readable oracle the tests hold all of it against; no
production module imports it.
"""

from tracefp4.formats.constants import Format, HintMode, ScaleMode
from tracefp4.formats.containers import FP8, MXFP4, NVFP4, CompensatedNVFP4
from tracefp4.formats.dequant import (
    dequantize,
    dequantize_blocks,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    global_divisor,
)
from tracefp4.formats.dispatch import Backend, backend, use_backend
from tracefp4.formats.fp8 import fp8_lsb_bits, guided_fp8, quantize_fp8
from tracefp4.formats.grid import mx_scale_values, nvfp4_global_encode_scale
from tracefp4.formats.guided import guided_codes, lsb_bits
from tracefp4.formats.mxfp4 import quantize_mxfp4
from tracefp4.formats.nvfp4 import quantize_dequantize_nvfp4, quantize_nvfp4, quantize_nvfp4_4over6
from tracefp4.formats.packing import code_positions, pack_fp4, signed_index, unpack_fp4
from tracefp4.formats.quantizers import (
    CompensatedNVFP4Quantizer,
    FP8Quantizer,
    Grid,
    MXFP4Quantizer,
    NVFP4Quantizer,
    Quantizer,
    fake_quant,
    quantize,
    quantizer_for,
)
from tracefp4.formats.rac import dequantize_nvfp4_rac, quantize_nvfp4_rac, rac_channel_count
from tracefp4.formats.rows import as_rows, per_row_values, row_count
from tracefp4.formats.straight_through import straight_through
from tracefp4.formats.validation import check_global_amax, check_grid, check_input, raise_non_finite

import tracefp4.formats.clib.ops  # noqa: E402,F401 - registers the C entry points as torch custom ops

__all__ = [
    "NVFP4", "MXFP4", "FP8", "CompensatedNVFP4", "Format", "HintMode", "ScaleMode",
    "Backend", "backend", "use_backend",
    "check_input", "check_global_amax", "check_grid", "raise_non_finite", "row_count", "as_rows", "per_row_values",
    "quantize_nvfp4", "quantize_dequantize_nvfp4", "quantize_nvfp4_4over6", "dequantize_nvfp4",
    "quantize_mxfp4", "dequantize_mxfp4", "dequantize", "dequantize_blocks", "global_divisor", "mx_scale_values",
    "pack_fp4", "unpack_fp4", "code_positions", "signed_index", "nvfp4_global_encode_scale",
    "quantize_fp8", "dequantize_fp8", "guided_fp8", "fp8_lsb_bits",
    "rac_channel_count", "quantize_nvfp4_rac", "dequantize_nvfp4_rac",
    "guided_codes", "lsb_bits", "straight_through",
    "Quantizer", "Grid", "NVFP4Quantizer", "MXFP4Quantizer", "FP8Quantizer", "CompensatedNVFP4Quantizer",
    "quantizer_for", "quantize", "fake_quant",
]
