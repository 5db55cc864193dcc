"""The expert-GEMM interface: prepare one GEMM's routed-expert weights, multiply rows grouped by expert."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats.quantizers import Quantizer

__all__ = ["SILU_GATE", "Activation", "ExpertGEMM", "PreparedWeight", "Routing", "WeightParameters",
           "check_parameter_names", "silu_gate"]

#: The gate between the two GEMMs named rather than given as a function: SiLU-gated ``[gate; up]``
#: (Qwen3-MoE's experts, :func:`silu_gate`), which a backend may compute in a kernel of its own, bit
#: for bit that function.
SILU_GATE = "silu_gate"
#: What :meth:`ExpertGEMM.activate` takes: :data:`SILU_GATE` or a function of the gate-up output.
Activation = Callable[[torch.Tensor], torch.Tensor] | str


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-gated ``[gate; up]`` (transformers' default ``_apply_gate`` with a SiLU ``act_fn``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Routing:
    """The (token, slot) pairs of one routed-experts layer: ``ids [T, top_k]`` int64 names the expert of
    pair ``f = t * top_k + j`` (the router's order). Every GEMM of the layer returns its rows in pair
    order; how a backend groups the pairs by expert is its own (the packed kernel groups them itself;
    :attr:`grouped` is the torch form, computed once per layer, without a host synchronisation)."""

    def __init__(self, ids: torch.Tensor, n_experts: int) -> None:
        if ids.dim() != 2:
            raise ValueError(f"routing ids: expected [tokens, top_k], got shape {tuple(ids.shape)}")
        self.ids = ids
        self.n_experts = n_experts

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]

    @functools.cached_property
    def grouped(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``order`` (the pairs sorted by expert, stably), ``offsets [E + 1]`` (expert e's pairs are
        ``order[offsets[e]:offsets[e + 1]]``) and ``inverse`` (where each pair sits in ``order``)."""
        flat = self.ids.reshape(-1)
        ranked, order = torch.sort(flat, stable=True)
        # offsets by search, not bincount: CUDA's bincount reads the largest id back to size its output
        edges = torch.arange(self.n_experts + 1, dtype=flat.dtype, device=flat.device)
        offsets = torch.searchsorted(ranked, edges)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return order, offsets, inverse


class PreparedWeight(Protocol):
    """One GEMM's ``[E, N, K]`` routed-expert weights in the form a backend multiplies."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    @property
    def nbytes(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class WeightParameters:
    """A prepared weight as a module holds it: ``tensors`` by name (registered as the module's
    parameters in place of the source weight, as vLLM's layer holds them, where a weight reload copies
    new values into them in place) and ``spec``, what the tensors alone do not say (a packed weight's
    format and layout; None for dense), small and tensor-free so a holder keeps it without keeping the
    tensors. :meth:`ExpertGEMM.from_parameters` takes both back."""

    tensors: dict[str, torch.Tensor]
    spec: Hashable = None


def check_parameter_names(backend: str, tensors: Mapping[str, torch.Tensor], required: tuple[str, ...],
                          optional: tuple[str, ...] = ()) -> None:
    """Refuse parameters that are not the ones backend ``backend`` stores a weight in, naming both."""
    names = set(tensors)
    if not set(required) <= names or not names <= set(required) | set(optional):
        raise ValueError(f"the {backend} expert GEMM stores a weight as {sorted(required)}"
                         f"{f' (and optionally {sorted(optional)})' if optional else ''}, got {sorted(names)}")


class ExpertGEMM(abc.ABC):
    """A grouped-GEMM backend for routed experts (see :mod:`tracefp4.engines.experts`): it says which
    forwards it runs (:meth:`supports`), builds its own weight storage from the model's expert weights
    (:meth:`prepare`), gives that storage as module parameters and takes it back
    (:meth:`to_parameters`, :meth:`from_parameters`), and multiplies (:meth:`matmul`)."""

    name: str

    @abc.abstractmethod
    def supports(self, plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                 gradients: bool = False) -> bool:
        """Whether this backend runs a forward under ``plan`` (None: BF16) on ``device`` with activations
        of ``dtype``; ``gradients``: the forward needs a gradient to the weights (the trainer's QAT)."""

    @abc.abstractmethod
    def prepare(self, weight: torch.Tensor, quantizer: Quantizer | None, *, gradients: bool = False,
                copy: bool = False) -> PreparedWeight:
        """``weight [E, N, K]`` (the HF layout: row n of expert e multiplies the K inputs) quantized by
        ``quantizer`` (None: BF16, used as is) in the form :meth:`matmul` takes. ``gradients``: the
        result carries a straight-through gradient to ``weight`` (the trainer's QAT). ``copy``: quantize
        from a copy (an FSDP-gathered weight's storage is freed after its layer, and the CPU kernels'
        numpy view of an input would pin its size)."""

    @abc.abstractmethod
    def to_parameters(self, weight: PreparedWeight) -> WeightParameters:
        """``weight`` (from :meth:`prepare`) as the tensors a module holds, by name, and their spec; no
        copy: the tensors are the weight's own."""

    @abc.abstractmethod
    def from_parameters(self, tensors: Mapping[str, torch.Tensor], spec: Hashable) -> PreparedWeight:
        """The weight held in ``tensors`` as ``spec`` describes it: the inverse of :meth:`to_parameters`
        (the same tensors, not copies). Names other than those :meth:`to_parameters` gives are refused."""

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, weight: PreparedWeight, routing: Routing, *, per_token: bool) -> torch.Tensor:
        """Each (token, slot) pair's row times its expert's ``weight[e].T`` -> ``[pairs, N]`` in pair
        order and x's dtype. ``x`` holds one row per token (``[T, K]``, shared by the token's top-k
        pairs: ``per_token``, the gate-up GEMM) or one per pair (``[T * top_k, K]``, the down GEMM)."""

    def activate(self, gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
        """The gate between the GEMMs: the gate-up output ``[pairs, 2I]`` -> the down GEMM's input
        ``[pairs, I]``. ``act`` is :data:`SILU_GATE` (a backend may run a kernel of its own, bit for bit
        :func:`silu_gate`) or a function, applied as it is."""
        if isinstance(act, str):
            if act != SILU_GATE:
                raise ValueError(f"unknown expert activation {act!r}; expected {SILU_GATE!r} or a function")
            return silu_gate(gate_up)
        return act(gate_up)

    def combine(self, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The top-k sum: ``out [T, top_k, H]`` (each pair's expert output) weighted by ``weights
        [T, top_k]`` -> ``[T, H]`` in out's dtype, products and sum in float32 (transformers' grouped_mm
        path). A backend may compute it in a kernel of its own, bit for bit this expression."""
        return (out.to(torch.float32) * weights.to(torch.float32).unsqueeze(-1)).sum(dim=1).to(out.dtype)

    def __repr__(self) -> str:
        return f"<expert GEMM {self.name}>"
