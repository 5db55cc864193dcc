"""Routed experts: one forward for every engine and the trainer, the GEMM behind a backend seam.

* :func:`routed.routed_experts` is the routed-experts computation both seams call (our transformers
  experts implementation and the vLLM plugin's MoE method): the ``expert_in`` site, the gate-up GEMM,
  the gate, the ``expert_mid`` site, the down GEMM, the top-k sum in float32, every tensor in the
  router's (token, slot) order. :func:`routed.dense_mlp` is a dense model's gated MLP as one expert
  that every row goes to (sites ``mlp_in`` and ``mlp_mid``), on the same backends.
* A backend (:class:`~tracefp4.engines.experts.base.ExpertGEMM`) says which forwards it runs
  (``supports(plan, device, dtype)``), owns its weight storage: it builds it from one GEMM's expert
  weights (``prepare``) and gives it as named tensors a module can hold as parameters, and takes it
  back (``to_parameters``, ``from_parameters``: the vLLM method holds them so, naming no backend's
  fields); and it multiplies each (token, slot) pair's row with its expert's
  weights (``matmul`` over a :class:`~tracefp4.engines.experts.base.Routing`), one call per GEMM per
  layer; grouping the pairs by expert is the backend's business (the dense one sorts and gathers in
  torch, the packed kernel groups them itself, with no gather or scatter around the call). One file
  per backend: :mod:`.dense` (dequantized weights, torch matmuls: BF16, the trainer's QAT path with
  straight-through gradients, CUDA, and the fallback) and :mod:`.cpu_fp4` (packed FP4 weights, our
  AVX-512 BF16 C kernel) and :mod:`.triton_fp4` (packed FP4 weights, our Triton kernel on CUDA,
  :mod:`.triton_gemm`).
* :mod:`.oracle` picks the backend once per precision plan, device and dtype: the first, in priority
  order, that supports the forward.

The weight convention every backend shares (and the trainer adopts): an FP4 weight is
``bf16(value(code) * block scale)`` (exact) and the expert's FP32 global scale divides the GEMM's
float32 result, ``out = bf16(fl32(x @ w_blocks.T) / S_enc)``; backends differ only in the order of
the float32 additions.
"""

from tracefp4.engines.experts.base import ExpertGEMM, PreparedWeight, Routing
from tracefp4.engines.experts.cache import PreparedCache
from tracefp4.engines.experts.oracle import choose_gemm, gemm_named
from tracefp4.engines.experts.routed import dense_gemm, dense_mlp, routed_experts

__all__ = [
    "ExpertGEMM",
    "PreparedCache",
    "PreparedWeight",
    "Routing",
    "choose_gemm",
    "dense_gemm",
    "dense_mlp",
    "gemm_named",
    "routed_experts",
]
