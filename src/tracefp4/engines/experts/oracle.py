"""Which expert-GEMM backend runs a forward: the first of :data:`BACKENDS`, in priority order, whose
:meth:`~tracefp4.engines.experts.base.ExpertGEMM.supports` answers yes for the precision plan,
device, dtype and whether the forward needs gradients (asked once per such combination).

* ``cpu_fp4`` first: an FP4 rollout on the CPU with bf16 activations, where our C kernel is built.
* ``dense`` last, which runs every forward: BF16 (no plan), FP8 weights (W8A8), the trainer
  (gradients: straight-through QAT), CUDA (the site quantizers run as Triton kernels) and the CPU
  without the C kernel. The GPU GEMM backends this seam is built for (vLLM's Marlin W4A16 FP4 MoE on
  SM80/SM90 with our ``expert_mid`` quantizer in its activation hook; the CUTLASS NVFP4 grouped GEMM
  on SM100+) would sit before it; they are not written yet: no GPU was available to check them, and
  an unchecked kernel would be worse than none.

``TRACEFP4_EXPERTS_BACKEND=dense|cpu_fp4`` forces a backend for rollouts (benchmarks, tests); a
backend that cannot run the forward then raises instead of falling back.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

from tracefp4.engines.experts.base import ExpertGEMM
from tracefp4.engines.experts.cpu_fp4 import PackedCPUGEMM
from tracefp4.engines.experts.dense import DenseGEMM
from tracefp4.engines.plan import PrecisionPlan

__all__ = ["BACKENDS", "choose_gemm", "first_supporting", "gemm_named"]

#: name -> backend, in priority order (the first that supports a forward runs it).
BACKENDS: dict[str, ExpertGEMM] = {g.name: g for g in (PackedCPUGEMM(), DenseGEMM())}


def gemm_named(name: str) -> ExpertGEMM:
    """The backend of that name (``cpu_fp4``, ``dense``)."""
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


def first_supporting(backends: Iterable[ExpertGEMM], plan: PrecisionPlan | None, device: torch.device | str,
                     dtype: torch.dtype, *, gradients: bool) -> ExpertGEMM:
    """The first of ``backends`` whose ``supports`` answers yes for the forward."""
    asked = []
    for gemm in backends:
        if gemm.supports(plan, device, dtype, gradients=gradients):
            return gemm
        asked.append(gemm.name)
    raise ValueError(f"no expert GEMM backend runs plan {plan} on {device} with {dtype} activations"
                     f"{' and gradients' if gradients else ''} (asked: {', '.join(asked) or 'none'})")


@functools.lru_cache(maxsize=None)
def _choose(plan: PrecisionPlan | None, device: str, dtype: torch.dtype, gradients: bool) -> ExpertGEMM:
    return first_supporting(BACKENDS.values(), plan, device, dtype, gradients=gradients)
