"""tracefp4: stable FP4 reinforcement learning of Mixture-of-Experts LLMs (TRACE).

Exact NVFP4/MXFP4/FP8 numerics, rollout-guided rounding, the compact guidance cache, an MoE model on an
FP4 rollout path and a QAT trainer path, and GRPO on top.

The user API of an FP4 rollout feeding a trainer: :func:`prepare_model` (your MoE model),
:class:`PrecisionPlan` and :class:`GuidedMode` (what the rollout computes and records),
:func:`make_engine` and :func:`rollout_step` (a rollout through the guidance store, in one call), and
:func:`trainer_forward` with a :class:`RowMap` (the trainer's forward on the rollout's codes).
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

# The user API is imported on first use: it pulls in transformers (seconds), which the numerics above
# and every ``tracefp4 ... --help`` do without.
_USER_API = {
    "prepare_model": "tracefp4.engines.model",
    "PrecisionPlan": "tracefp4.engines.plan",
    "GuidedMode": "tracefp4.guidance.compact",
    "make_engine": "tracefp4.pipeline.factory",
    "rollout_step": "tracefp4.pipeline.steps",
    "trainer_forward": "tracefp4.engines.trainer",
    "RowMap": "tracefp4.engines.rows",
}


def __getattr__(name: str):
    if name not in _USER_API:
        raise AttributeError(f"module 'tracefp4' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_USER_API[name]), name)
    globals()[name] = value
    return value

__all__ = [
    "prepare_model",
    "PrecisionPlan",
    "GuidedMode",
    "make_engine",
    "rollout_step",
    "trainer_forward",
    "RowMap",
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
