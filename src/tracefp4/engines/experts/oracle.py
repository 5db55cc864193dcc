"""Which expert-GEMM backend runs a forward: the first of :data:`BACKENDS`, in priority order, whose
:meth:`~tracefp4.engines.experts.base.ExpertGEMM.supports` answers yes for the precision plan,
device, dtype and whether the forward needs gradients (asked once per such combination).

* ``cpu_fp4`` first: an FP4 rollout on the CPU with bf16 activations, where our C kernel is built.
* ``triton_fp4``: an FP4 rollout on CUDA with bf16 activations, where triton is installed (our
  Triton kernel on the packed weights, no host synchronisation). Checked bit for bit in Triton's
  interpreter on the CPU; ``scripts/gpu_check.py`` checks it on a device. vLLM's Marlin W4A16 and
  the CUTLASS NVFP4 grouped GEMMs (SM100+) could sit beside it; they are not written.
* ``triton_bf16``: a BF16 rollout on CUDA, the same kernel over the bf16 weights (no host
  synchronisation; the baseline of FP4 speed on a GPU).
* ``dense`` last, which runs every forward: BF16 on the CPU, FP8 weights (W8A8), the trainer
  (gradients: straight-through QAT), FP4 on CUDA without triton, and the CPU without the C kernel.
  It synchronises with the host once per GEMM (one matmul per expert), so a decode step through it
  cannot be captured in a CUDA graph.

``TRACEFP4_EXPERTS_BACKEND=dense|cpu_fp4|triton_fp4|triton_bf16`` forces a backend for rollouts (benchmarks, tests); a
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
from tracefp4.engines.experts.triton_fp4 import TritonBF16GEMM, TritonFP4GEMM
from tracefp4.engines.plan import PrecisionPlan

__all__ = ["BACKENDS", "choose_gemm", "first_supporting", "gemm_named"]

#: name -> backend, in priority order (the first that supports a forward runs it).
BACKENDS: dict[str, ExpertGEMM] = {g.name: g for g in (PackedCPUGEMM(), TritonFP4GEMM(), TritonBF16GEMM(), DenseGEMM())}


def gemm_named(name: str) -> ExpertGEMM:
    """The backend of that name (``cpu_fp4``, ``triton_fp4``, ``triton_bf16``, ``dense``)."""
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
