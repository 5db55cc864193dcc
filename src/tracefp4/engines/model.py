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

What each forward does is set per call with :func:`quant_context` and a :class:`QuantContext`:
BF16, FP4 round-to-nearest (optionally recording guidance and routing), or FP4 guided by records.

Quantization granularity (DESIGN.md section 2): routed-expert weights per expert (one global scale per
expert), activations per token (``expert_in``: rows of ``[T, H]``; ``expert_mid``: rows of
``[T, top_k, I]``, i.e. per token and selected expert), KV per token and KV head (rows of
``[T, n_kv, head_dim]``). Because every activation scale is per row, a token's codes never depend on
what else shares its batch, which is what lets records move between differently batched paths.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from tracefp4.guidance.compact import CompactRecord, GuidanceSpec, encode_record, parse_hint_mode
from tracefp4.formats.constants import Format, HintMode, ScaleMode, Site
from tracefp4.guidance.hints import Hint, guided_quantize
from tracefp4.formats.numerics import MXFP4, NVFP4, dequantize, quantize_mxfp4, quantize_nvfp4

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "ActivationFormat",
    "PrecisionPlan",
    "QuantMode",
    "Recorder",
    "QuantContext",
    "MoELayer",
    "FP4KVLayer",
    "FP4KVCache",
    "prepare_model",
    "from_config",
    "load_model",
    "moe_layers",
    "model_layers",
    "default_guided_layers",
    "quant_context",
    "record_prefix",
    "routing_key",
    "tiny_config",
]

#: Name under which our experts forward is registered in transformers' ExpertsInterface.
EXPERTS_IMPLEMENTATION = "tracefp4"

ActivationFormat = Literal["nvfp4", "mxfp4", "fp8"]

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


def record_prefix(layer: int, site: Site | str) -> str:
    """``L{layer:02d}.{site}``: the prefix of a site's record tensors (``.bits``/``.codes``/...)."""
    return f"L{layer:02d}.{Site(site).value}"


def routing_key(layer: int) -> str:
    """``L{layer:02d}.routing``: the routed expert indices of a layer, ``[T, top_k]``."""
    return f"L{layer:02d}.routing"


# --- precision plan ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """Which tensors are FP4, and in which format. Everything not named here stays BF16
    (attention projections, shared experts, router, embeddings, norms, lm_head).

    weights: routed-expert weights (NVFP4 with one global scale per expert, or MXFP4).
    activations: the routed-expert GEMM inputs ``expert_in``/``expert_mid`` (NVFP4 with a global
        scale per row, MXFP4, or FP8 E4M3 with a per-row scale = W4A8). FP8 sites carry no
        guidance: the hints are FP4 codewords.
    kv_cache: keys and values as the cache stores them (NVFP4 per token and KV head, or MXFP4).
    mx_scale_mode: E8M0 scale rule of every MXFP4 tensor.
    """

    weights: Format = Format.NVFP4
    activations: ActivationFormat = "nvfp4"
    kv_cache: Format = Format.NVFP4
    mx_scale_mode: ScaleMode = ScaleMode.FLOOR

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", Format(self.weights))
        object.__setattr__(self, "kv_cache", Format(self.kv_cache))
        object.__setattr__(self, "mx_scale_mode", ScaleMode(self.mx_scale_mode))
        if self.activations not in ("nvfp4", "mxfp4", "fp8"):
            raise ValueError(f"activations must be 'nvfp4', 'mxfp4' or 'fp8', got {self.activations!r}")

    @classmethod
    def w4a4(cls) -> PrecisionPlan:
        """NVFP4 weights, activations and KV cache (the default)."""
        return cls()

    @classmethod
    def w4a8(cls) -> PrecisionPlan:
        """NVFP4 weights and KV cache, FP8 E4M3 expert activations."""
        return cls(activations="fp8")

    @classmethod
    def mxfp4(cls, scale_mode: ScaleMode | str = ScaleMode.FLOOR) -> PrecisionPlan:
        """MXFP4 throughout."""
        return cls(Format.MXFP4, "mxfp4", Format.MXFP4, ScaleMode(scale_mode))

    def site_format(self, site: Site) -> str:
        """``"nvfp4"``, ``"mxfp4"`` or ``"fp8"`` for an activation or KV site."""
        if site in (Site.K, Site.V):
            return self.kv_cache.value
        return self.activations

    def guidable(self, site: Site) -> bool:
        return self.site_format(site) != "fp8"


# --- per-forward context -------------------------------------------------------------------------


class QuantMode(str, enum.Enum):
    BF16 = "bf16"
    """No quantization anywhere (the model's own numerics)."""
    RTN = "rtn"
    """FP4 round-to-nearest at every site (rollout engine, vanilla QAT)."""
    GUIDED = "guided"
    """FP4, rounding toward the rollout's codeword where a hint exists, round-to-nearest elsewhere."""


@dataclasses.dataclass
class Recorder:
    """What one forward recorded, over that forward's flattened rows (batch-major, ``b*S + s``).

    hints: ``record_prefix(layer, site)`` -> the whole site tensor's quantized value (NVFP4/MXFP4, for
        ``full``/``lsb`` hints, which the rollout encodes once at the end) or its compact record.
    routing: layer -> ``[rows, top_k]`` int64 routed expert indices.
    """

    hints: dict[str, NVFP4 | MXFP4 | CompactRecord] = dataclasses.field(default_factory=dict)
    routing: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def take(self) -> Recorder:
        """Hand over what was recorded and start empty (one call per forward)."""
        out = Recorder(self.hints, self.routing)
        self.hints, self.routing = {}, {}
        return out


@dataclasses.dataclass
class QuantContext:
    """How the model computes during one forward (set with :func:`quant_context`).

    mode: see :class:`QuantMode`.
    plan: the precision plan; both paths must use the same one.
    guided_layers: layers whose FP4 sites record hints (rollout, with ``record``) or whose codes are
        captured (trainer, with ``capture_codes``). ``None``: the deeper half of the model's layers,
        resolved by :func:`quant_context`.
    hint_mode: what a hint keeps per element (``lsb`` 1 bit, ``full`` 4 bits), or a compact
        :class:`~tracefp4.guidance.compact.GuidanceSpec` (a name such as ``"ldpc(1/16)+parity"`` is parsed).
    record: rollout only. If set, routing of every MoE layer and hints of ``guided_layers`` land here.
    guidance: trainer only (``GUIDED``): ``record_prefix(layer, site)`` -> Hint, or a
        :class:`~tracefp4.guidance.compact.CompactRecord` that decodes into one given this path's own value.
    routing_replay: trainer only: layer -> ``[rows, top_k]`` indices to use instead of the router's.
    reuse_quantized_weights: rollout only: keep quantized expert weights across forwards, keyed on the
        parameter's storage and version counter (an optimizer step bumps it). The trainer re-quantizes
        every forward so the master weights get straight-through gradients.
    capture_codes: trainer metrics: keep this path's packed FP4 codes at the sites of ``guided_layers``
        in ``codes`` (same key as ``guidance``), and the grid they are on (block scales, global amax or
        None) in ``grids``.
    router_flips: filled under replay: layer -> (tokens whose own top-k set differs from the replayed
        one, tokens).
    """

    mode: QuantMode = QuantMode.BF16
    plan: PrecisionPlan = dataclasses.field(default_factory=PrecisionPlan)
    guided_layers: frozenset[int] | None = None
    hint_mode: HintMode | GuidanceSpec = HintMode.LSB
    record: Recorder | None = None
    guidance: Mapping[str, Hint | CompactRecord] | None = None
    routing_replay: Mapping[int, torch.Tensor] | None = None
    reuse_quantized_weights: bool = False
    capture_codes: bool = False
    codes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grids: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=dict)
    router_flips: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mode = QuantMode(self.mode)
        self.hint_mode = parse_hint_mode(self.hint_mode)
        if self.guided_layers is not None:
            self.guided_layers = frozenset(int(i) for i in self.guided_layers)
        if self.guidance is not None and self.mode is not QuantMode.GUIDED:
            raise ValueError(f"guidance is only used in mode 'guided', not {self.mode.value!r}")

    # -- activation and KV sites --

    def quantize_site(self, layer: int, site: Site, x: torch.Tensor) -> torch.Tensor:
        """The value the next op sees at ``site``: ``x`` quantized per row (last dim), in x's dtype,
        with a straight-through gradient."""
        if self.mode is QuantMode.BF16:
            return x
        name = record_prefix(layer, site)
        fmt = self.plan.site_format(site)
        if fmt == "fp8":
            return _straight_through(x, _fp8_rows(x.detach(), name))  # plain torch: any device
        hint = self.guidance.get(name) if self.guidance is not None else None
        xh = _host(x)
        try:
            if hint is not None:
                if hint.fmt.value != fmt:
                    raise ValueError(f"the record is {hint.fmt.value} but the precision plan says {fmt}")
                # a compact record needs this path's own value to say which codes it means
                q = guided_quantize(xh, hint if isinstance(hint, Hint) else hint.decode(xh))
            else:
                q = self._quantize(xh, fmt)
        except ValueError as e:
            raise ValueError(f"site {name}: {e}") from e
        if self.guided_layers is not None and layer in self.guided_layers:
            if self.record is not None:
                # full/lsb hints are encoded once per rollout from the raw codes (rollout._assemble_records),
                # not once per decode step: the per-call overhead is what recording costs at small batch
                raw = isinstance(self.hint_mode, HintMode)
                self.record.hints[name] = q if raw else encode_record(xh, q, self.hint_mode)
            if self.capture_codes:
                self.codes[name] = q.codes
                self.grids[name] = (q.scales, getattr(q, "global_amax", None))
        return _straight_through(x, dequantize(q))

    def quantize_kv(self, layer: int, site: Site, states: torch.Tensor) -> torch.Tensor:
        """``states [B, n_kv, S, D]`` as the cache stores them; rows are (token, KV head)."""
        if self.mode is QuantMode.BF16:
            return states
        b, h, s, d = states.shape
        rows = states.transpose(1, 2).reshape(b * s, h, d)
        out = self.quantize_site(layer, site, rows)
        return out.reshape(b, s, h, d).transpose(1, 2)

    def _quantize(self, x: torch.Tensor, fmt: str) -> NVFP4 | MXFP4:
        if fmt == Format.NVFP4.value:
            return quantize_nvfp4(x, per_row=True)
        return quantize_mxfp4(x, scale_mode=self.plan.mx_scale_mode.value)

    # -- routed-expert weights --

    def expert_weight(self, experts: nn.Module, name: str) -> torch.Tensor:
        """Routed-expert weight ``[E, N, K]`` as this path's GEMM sees it."""
        w: torch.Tensor = getattr(experts, name)
        if self.mode is QuantMode.BF16:
            return w
        if not self.reuse_quantized_weights:
            return _straight_through(w, self._dequantized_weight(w, name))
        # data_ptr and _version change when the weight is replaced or updated in place.
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, self.plan.weights, self.plan.mx_scale_mode)
        cache: dict[str, tuple[Any, torch.Tensor]] = experts.__dict__.setdefault("_tracefp4_weight_cache", {})
        hit = cache.get(name)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, self._dequantized_weight(w, name).to(device=w.device, dtype=w.dtype))
            cache[name] = hit
        return hit[1]

    def _dequantized_weight(self, w: torch.Tensor, name: str) -> torch.Tensor:
        x = _host(w)
        try:
            if self.plan.weights is Format.NVFP4:
                # One global scale per expert: the per-expert amax, repeated over its rows.
                amax = x.abs().amax(dim=(1, 2), keepdim=True).to(torch.float32).expand(*x.shape[:-1], 1)
                return dequantize(quantize_nvfp4(x, global_amax=amax))
            return dequantize(quantize_mxfp4(x, scale_mode=self.plan.mx_scale_mode.value))
        except ValueError as e:
            raise ValueError(f"expert weight {name}: {e}") from e


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value; backward: the gradient passes to x unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _host(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, on the CPU: the FP4 kernels of :mod:`tracefp4.formats.numerics` are CPU kernels."""
    return x.detach().cpu()


def _straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    value = value.to(device=x.device, dtype=x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return value
    return _StraightThrough.apply(x, value)


def _fp8_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize with one float32 scale ``amax/448`` per row (W4A8)."""
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(f"site {name}: non-finite input; NaN/Inf is a bug upstream and is never encoded")
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    # Clamp before the cast: older CPU casts turn overflow into NaN instead of saturating.
    q = (xf / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale


# --- the model's runtime state -------------------------------------------------------------------


class _Runtime:
    """Shared by every patched module of one model: the context of the forward in progress."""

    def __init__(self, n_layers: int, moe: tuple[int, ...]) -> None:
        self.context: QuantContext | None = None
        self.n_layers = n_layers
        self.moe_layers = moe


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One sparse MoE block of the model, as found by :func:`prepare_model`."""

    index: int
    block: nn.Module
    experts: nn.Module
    router: nn.Module


_NO_CONTEXT = QuantContext()


def _context(runtime: _Runtime) -> QuantContext:
    return runtime.context if runtime.context is not None else _NO_CONTEXT


def _runtime(model: PreTrainedModel) -> _Runtime:
    rt = model.__dict__.get("_tracefp4_runtime")
    if rt is None:
        raise ValueError("model is not prepared for tracefp4: call tracefp4.engines.model.prepare_model(model) first")
    return rt


# --- seam 1: the experts forward -----------------------------------------------------------------


def _grouped_linear(x_sorted: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
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
    ctx = _context(runtime)
    n, k = top_k_index.shape
    n_experts = self.gate_up_proj.shape[0]
    if n and int(top_k_index.max()) >= n_experts:
        raise ValueError(f"L{layer:02d}: expert index {int(top_k_index.max())} out of range [0, {n_experts})")

    x = ctx.quantize_site(layer, Site.EXPERT_IN, hidden_states)
    w_gate_up = ctx.expert_weight(self, "gate_up_proj")
    w_down = ctx.expert_weight(self, "down_proj")

    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=n_experts).tolist()

    mid_sorted = self._apply_gate(_grouped_linear(x[order // k], w_gate_up, counts))
    mid = ctx.quantize_site(layer, Site.EXPERT_MID, mid_sorted[inverse].reshape(n, k, -1))
    down_sorted = _grouped_linear(mid.reshape(n * k, -1)[order], w_down, counts)
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
    ctx = runtime.context
    if ctx is None:
        return None
    logits, weights, indices = output
    if ctx.routing_replay is not None:
        if layer not in ctx.routing_replay:
            raise ValueError(f"routing replay: no recorded routing for MoE layer {layer}")
        replay = ctx.routing_replay[layer].to(device=indices.device, dtype=torch.long)
        if replay.shape != indices.shape:
            raise ValueError(
                f"routing replay L{layer:02d}: recorded indices {tuple(replay.shape)} but the router "
                f"produced {tuple(indices.shape)}"
            )
        with torch.no_grad():
            own, rec = indices.sort(dim=-1).values, replay.sort(dim=-1).values
            ctx.router_flips[layer] = (int((own != rec).any(dim=-1).sum()), int(indices.shape[0]))
        # Probabilities from the trainer's own logits, gathered at the rollout's experts: the
        # selection is replayed, the router weight still gets gradients.
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        weights_new = probs.gather(-1, replay)
        if _renormalises(router):
            weights_new = weights_new / weights_new.sum(dim=-1, keepdim=True)
        output = (logits, weights_new.to(weights.dtype), replay)
    if ctx.record is not None:
        ctx.record.routing[layer] = output[2].detach()
    return output


# --- seam 3: the KV cache ------------------------------------------------------------------------


class FP4KVLayer(DynamicLayer):
    """A ``DynamicLayer`` whose entries are FP4 (per token and KV head) under an FP4 context.

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
        ctx = _context(self._runtime)
        key_states = ctx.quantize_kv(self.layer_idx, Site.K, key_states)
        value_states = ctx.quantize_kv(self.layer_idx, Site.V, value_states)
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
        layout = {k: getattr(experts, k, None) for k in _EXPECTED_EXPERTS_LAYOUT}
        if layout != _EXPECTED_EXPERTS_LAYOUT:
            raise NotImplementedError(f"layer {i}: unsupported experts layout {layout}")
        _renormalises(router)
        found.append(MoELayer(i, block, experts, router))
    return found


def default_guided_layers(n_layers: int) -> frozenset[int]:
    """The deeper half: ``layers >= n_layers // 2`` (DESIGN.md section 4)."""
    return frozenset(range(n_layers // 2, n_layers))


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Route the model's experts, routers and (via :class:`FP4KVCache`) KV cache through tracefp4.

    Idempotent. Without an active :func:`quant_context` the prepared model computes in BF16 exactly
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


def load_model(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A prepared model from a local folder (``config.json`` + safetensors); never touches the network."""
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype, local_files_only=True)
    return prepare_model(model.to(device).eval())


@contextlib.contextmanager
def quant_context(model: PreTrainedModel, ctx: QuantContext) -> Iterator[QuantContext]:
    """Run the enclosed forward(s) of a prepared model under ``ctx``."""
    runtime = _runtime(model)
    if runtime.context is not None:
        raise RuntimeError("a tracefp4 quant_context is already active on this model")
    if ctx.guided_layers is None:
        ctx.guided_layers = default_guided_layers(runtime.n_layers)
    runtime.context = ctx
    try:
        yield ctx
    finally:
        runtime.context = None


def model_layers(model: PreTrainedModel) -> tuple[int, tuple[int, ...]]:
    """(number of decoder layers, indices of the MoE layers) of a prepared model."""
    rt = _runtime(model)
    return rt.n_layers, rt.moe_layers
