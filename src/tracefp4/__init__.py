"""tracefp4: stable FP4 reinforcement learning of Mixture-of-Experts LLMs (TRACE).

Exact NVFP4/MXFP4/FP8 numerics, rollout-guided rounding, the compact guidance cache, an MoE model on an
FP4 rollout path and a QAT trainer path, and GRPO on top.
"""

from tracefp4.formats.constants import Format, HintMode, ScaleMode
from tracefp4.guidance.names import Site
from tracefp4.guidance.hints import Hint, encode_hint, guided_fake_quant, guided_quantize, hint_cat
from tracefp4.formats import (
    FP8,
    MXFP4,
    NVFP4,
    dequantize,
    dequantize_mxfp4,
    dequantize_nvfp4,
    pack_fp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)
from tracefp4.formats.quantizers import (
    CompensatedNVFP4Quantizer,
    FP8Quantizer,
    Grid,
    MXFP4Quantizer,
    NVFP4Quantizer,
    fake_quant,
    quantize,
)

__version__ = "0.1.0"

__all__ = [
    "Format",
    "HintMode",
    "ScaleMode",
    "Site",
    "Hint",
    "encode_hint",
    "guided_fake_quant",
    "guided_quantize",
    "hint_cat",
    "FP8",
    "MXFP4",
    "NVFP4",
    "dequantize",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "fake_quant",
    "pack_fp4",
    "quantize",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_fp4",
    "CompensatedNVFP4Quantizer",
    "FP8Quantizer",
    "Grid",
    "MXFP4Quantizer",
    "NVFP4Quantizer",
]
