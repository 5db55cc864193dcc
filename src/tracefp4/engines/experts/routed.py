"""The MLP forwards every engine and the trainer compute (one function per kind, both seams): a MoE
layer's routed experts, and a dense model's gated MLP as one expert that every row goes to."""

from __future__ import annotations

import torch

from tracefp4.engines.experts.base import Activation, ExpertGEMM, PreparedWeight, Routing
from tracefp4.engines.sites import ForwardState, quantize_site
from tracefp4.formats import backend
from tracefp4.guidance.names import Site, layer_tag

__all__ = ["dense_gemm", "dense_mlp", "routed_experts"]


def _check_expert_ids(state: ForwardState, layer: int, ids: torch.Tensor, n_experts: int) -> None:
    """Refuse an expert index outside ``[0, n_experts)``. On the Triton path (CUDA, or the interpreter)
    a rollout keeps the check as a device flag read after the rollout
    (:mod:`tracefp4.engines.device_sites`); elsewhere on the CPU it is free and made at once; a CUDA
    forward of no rollout (the trainer) leaves it to the device."""
    if state.path.checks is not None and backend(ids) == "triton":
        state.path.checks.note(layer_tag(layer), f"expert index out of range [0, {n_experts})",
                               (ids < 0) | (ids >= n_experts))
    elif ids.device.type == "cpu" and ids.numel() and int(ids.max()) >= n_experts:
        raise ValueError(f"{layer_tag(layer)}: expert index {int(ids.max())} out of range [0, {n_experts})")


def routed_experts(
    state: ForwardState,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: PreparedWeight,
    down: PreparedWeight,
    gemm: ExpertGEMM,
    act: Activation,
) -> torch.Tensor:
    """Routed experts on ``x [N, H]`` (flattened tokens) with ``topk_ids``/``topk_weights [N, top_k]``.

    ``gate_up`` (``[E, 2I, H]``) and ``down`` (``[E, H, I]``) are prepared by ``gemm``; ``act`` maps the
    gate-up output ``[rows, 2I]`` to the down projection's input: ``SILU_GATE`` (Qwen3-MoE's SiLU gate,
    which the backend computes, :meth:`ExpertGEMM.activate`) or a function. The
    ``expert_in`` site is quantized per token, ``expert_mid`` as one ``[N, top_k, I]`` tensor (rows:
    token x selected expert, so its record is addressed by token position like every other site).
    The top-k outputs are summed in float32, like transformers' grouped_mm path.
    """
    n, k = topk_ids.shape
    n_experts = gate_up.shape[0]
    topk_ids = topk_ids.to(torch.long)
    _check_expert_ids(state, layer, topk_ids, n_experts)
    xq = quantize_site(state, layer, Site.EXPERT_IN, x)
    routing = Routing(topk_ids, n_experts)
    mid = gemm.activate(gemm.matmul(xq, gate_up, routing, per_token=True), act)  # [N * top_k, I], (token, slot) order
    mid = quantize_site(state, layer, Site.EXPERT_MID, mid.reshape(n, k, -1))
    out = gemm.matmul(mid.reshape(n * k, -1), down, routing, per_token=False).reshape(n, k, -1)
    return gemm.combine(out, topk_weights).to(x.dtype)


def dense_mlp(
    state: ForwardState,
    layer: int,
    x: torch.Tensor,
    gate_up: PreparedWeight,
    down: PreparedWeight,
    gemm: ExpertGEMM,
    act: Activation,
) -> torch.Tensor:
    """A dense gated MLP on ``x [N, H]`` (flattened tokens): ``down(act(gate_up(x)))`` with the
    ``mlp_in`` and ``mlp_mid`` sites quantized per token (rows of ``[N, H]`` and ``[N, I]``).

    The layer is one expert with every row: ``gate_up`` (``[1, 2I, H]``, ``[gate; up]``) and ``down``
    (``[1, H, I]``) are prepared by ``gemm`` like routed-expert weights (one global scale per GEMM
    weight), and each GEMM is the backend's routed GEMM over a routing that sends every row to expert
    0, so the packed kernels serve dense layers as they serve experts. No top-k sum: a single expert
    of weight 1 is its own output (the sum of one float32 term, rounded back, is that term).
    """
    mid = gemm.activate(dense_gemm(state, layer, Site.MLP_IN, x, gate_up, gemm), act)  # [N, I]
    return dense_gemm(state, layer, Site.MLP_MID, mid, down, gemm).to(x.dtype)


def dense_gemm(state: ForwardState, layer: int, site: Site, x: torch.Tensor, weight: PreparedWeight,
               gemm: ExpertGEMM) -> torch.Tensor:
    """One GEMM of a dense MLP: ``x [N, K]`` quantized per row at ``site`` (``mlp_in`` or ``mlp_mid``),
    times ``weight`` (``[1, N_out, K]``, prepared by ``gemm``) as the routed GEMM of one expert that
    every row goes to -> ``[N, N_out]`` in x's dtype. :func:`dense_mlp` runs two; the vLLM plugin's
    linear method runs one per linear layer (vLLM computes the gate between them)."""
    xq = quantize_site(state, layer, site, x)
    routing = Routing(torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device), 1)
    return gemm.matmul(xq, weight, routing, per_token=True)
