"""Which expert-GEMM backend runs a forward: chosen once per precision plan, device, dtype and
whether the forward needs gradients.

* BF16 (no plan), FP8 weights (W8A8) and the trainer (gradients: straight-through QAT): ``dense``.
* An FP4 rollout on the CPU with bf16 activations: ``cpu_fp4`` where our C kernel is built
  (:func:`tracefp4.formats.cgemm.available`, which warns once when it is not), else ``dense``.
* An FP4 rollout on CUDA: ``dense`` (the site quantizers run as Triton kernels). The GPU GEMM
  backends this seam is built for (vLLM's Marlin W4A16 FP4 MoE on SM80/SM90 with our ``expert_mid``
  quantizer in its activation hook; the CUTLASS NVFP4 grouped GEMM on SM100+) are not written yet:
  no GPU was available to check them, and an unchecked kernel would be worse than none.

``TRACEFP4_EXPERTS_BACKEND=dense|cpu_fp4`` forces a backend for rollouts (benchmarks, tests); a
backend that cannot run the forward then raises instead of falling back.
"""

from __future__ import annotations

import functools
import os

import torch

from tracefp4.engines.experts.base import ExpertGEMM
from tracefp4.engines.experts.cpu_fp4 import PackedCPUGEMM
from tracefp4.engines.experts.dense import DenseGEMM
from tracefp4.engines.plan import PrecisionPlan

__all__ = ["BACKENDS", "choose_gemm", "gemm_named"]

BACKENDS: dict[str, ExpertGEMM] = {"dense": DenseGEMM(), "cpu_fp4": PackedCPUGEMM()}


def gemm_named(name: str) -> ExpertGEMM:
    """The backend of that name (``dense``, ``cpu_fp4``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown expert GEMM backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def choose_gemm(plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                gradients: bool) -> ExpertGEMM:
    """The backend for a forward (see the module docstring)."""
    forced = os.environ.get("TRACEFP4_EXPERTS_BACKEND")
    if forced and plan is not None and not gradients:
        return gemm_named(forced)
    return _choose(plan, torch.device(device).type, dtype, gradients)


@functools.lru_cache(maxsize=None)
def _choose(plan: PrecisionPlan | None, device: str, dtype: torch.dtype, gradients: bool) -> ExpertGEMM:
    dense = BACKENDS["dense"]
    if plan is None or gradients or not plan.weight_quantizer.fp4:
        return dense
    if device == "cpu" and dtype == torch.bfloat16:
        from tracefp4.formats import cgemm

        return BACKENDS["cpu_fp4"] if cgemm.available() else dense
    return dense
