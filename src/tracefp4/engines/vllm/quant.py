"""The ``tracefp4`` quantization config and its routed-experts method: our numerics inside vLLM.

* Routed experts (``RoutedExperts`` layers): :class:`TraceFP4MoEMethod`. vLLM loads the weights in
  its plain layout (``w13_weight [E, 2I, H]`` = HF ``gate_up_proj``, ``w2_weight [E, H, I]`` =
  ``down_proj``); after every weight load (``process_weights_after_loading``, which vLLM's in-place
  ``reload_weights`` runs too, layer by layer) they are quantized with ``plan.weight_quantizer``
  and prepared for the expert-GEMM backend of the config's plan (:mod:`tracefp4.engines.experts`),
  whose parameters (``ExpertGEMM.to_parameters``, held as ``w13_<name>``/``w2_<name>``) replace
  the BF16 ones, so no BF16 or dequantized copy stays resident: on the CPU packed FP4 (codes two
  per byte in ``w13_weight``/``w2_weight``, scale bytes in ``*_weight_scale``, one FP32 divisor per
  expert in ``*_divisor``; 0.5625 bytes per parameter for NVFP4). Every call rebuilds the backend's
  weights from the layer's parameters (``ExpertGEMM.from_parameters``), naming no backend's
  fields. With ``keep_bf16`` (an engine that must also serve BF16 or other weight formats, e.g. one engine for
  every arm of a run) the BF16 parameters stay and the prepared weights are kept beside them, one
  set per weight quantizer. ``apply`` runs :func:`tracefp4.engines.experts.routed_experts`, the very
  function our engine calls: ``expert_in`` and ``expert_mid`` quantized per row with
  ``plan.quantizer(site)``, the routing recorded, the top-k outputs summed in float32.
* A dense model's MLP linears (no routed experts in the model: ``mlp.gate_up_proj``, vLLM's merged
  ``[gate; up]``, and ``mlp.down_proj``): :class:`TraceFP4DenseMLPMethod`, vLLM's linear-method
  hook. Each linear is one expert with every row, as in our engine
  (:func:`tracefp4.engines.experts.dense_gemm`): its input quantized at ``mlp_in`` / ``mlp_mid`` and
  recorded, its weight ``[1, N, K]`` prepared for the plan's backend after every load and, without
  ``keep_bf16``, held packed in place of the BF16 one (``weight``, ``weight_scale``, ``divisor``).
  The gate between the two (vLLM's ``SiluAndMul``) is vLLM's own kernel; a BF16 call runs vLLM's own
  linear method. The dense layers of a MoE model stay BF16, as in our engine.
* Every other linear layer (attention projections, router, shared experts, lm_head) stays
  unquantized. Attention gets no quant method; with ``kv_store`` ``packed`` its layers get the packed
  FP4 KV backend (:mod:`.kv_backend`), with ``values`` the cache stays in the model dtype and holds
  the FP4 values :mod:`.plugin`'s wrapper writes (:class:`~.kv_layout.KVStore`).

The config: ``{"quant_method": "tracefp4", "plan": PrecisionPlan.to_dict() | null, "keep_bf16": bool,
"kv_store": "packed" | "values"}`` (no plan entry: the default W4A4 NVFP4 plan; ``null``: BF16 unless
a call says otherwise; no kv_store: :func:`~.kv_layout.resolve_kv_store`'s default), e.g.
``hf_overrides={"quantization_config": {...}}``; a :class:`~tracefp4.engines.vllm.engine.VLLMEngine`
call may run another plan (or BF16) per call where the weights it needs are held.
"""

from __future__ import annotations

from tracefp4.engines.vllm.process import prepare_process

prepare_process()  # before numba: a spawned worker unpickles this config before its start-up scan

import dataclasses  # noqa: E402
from collections.abc import Hashable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.fused_moe import RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from vllm.model_executor.utils import set_weight_attrs  # noqa: E402

from tracefp4.engines.experts import ExpertGEMM, PreparedWeight, choose_gemm, dense_gemm, routed_experts  # noqa: E402
from tracefp4.engines.experts.base import SILU_GATE  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan, routed_expert_count  # noqa: E402
from tracefp4.engines.vllm.kv_layout import KVStore, resolve_kv_store  # noqa: E402
from tracefp4.engines.vllm.runtime import RUNTIME, layer_index  # noqa: E402
from tracefp4.formats.quantizers import Quantizer  # noqa: E402
from tracefp4.guidance.names import Site  # noqa: E402

__all__ = ["QUANT_METHOD", "TraceFP4Config", "TraceFP4DenseMLPMethod", "TraceFP4MoEMethod"]

QUANT_METHOD = "tracefp4"


@register_quantization_config(QUANT_METHOD)
class TraceFP4Config(QuantizationConfig):
    """``{"quant_method": "tracefp4", "plan": {...PrecisionPlan.to_dict()...} | null, "keep_bf16": bool}``
    (no plan entry: the default W4A4 NVFP4 plan; ``null``: BF16 unless a call says otherwise;
    ``keep_bf16``: keep the BF16 expert weights beside the prepared ones, see the module docstring)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = dict(config or {})
        plan = self.config.get("plan", PrecisionPlan().to_dict())
        self.plan = None if plan is None else PrecisionPlan(**plan)
        self.keep_bf16 = bool(self.config.get("keep_bf16", False))
        self.kv_store = resolve_kv_store(self.plan, self.keep_bf16, self.config.get("kv_store"))
        RUNTIME.config_plan = self.plan

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TraceFP4Config:
        return cls(config)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # Also here: in a spawned worker this config arrives unpickled (no __init__), and this is
        # called there while the model is built.
        RUNTIME.config_plan = self.plan
        if isinstance(layer, RoutedExperts):
            return TraceFP4MoEMethod(layer.moe_config, prefix, self.plan, keep_bf16=self.keep_bf16)
        if isinstance(layer, LinearBase):
            site = _dense_mlp_site(prefix)
            if site is not None:
                return TraceFP4DenseMLPMethod(prefix, site, self.plan, keep_bf16=self.keep_bf16)
            return UnquantizedLinearMethod()
        if isinstance(layer, Attention) and self.kv_store is KVStore.PACKED:
            from tracefp4.engines.vllm.kv_backend import install_packed_attention

            install_packed_attention(layer, self.plan.kv_cache)
        return None


_PARTS = ("w13", "w2")
#: A dense MLP's linear layers by the end of their vLLM prefix, and the site of their input.
_DENSE_LINEARS = {".mlp.gate_up_proj": Site.MLP_IN, ".mlp.down_proj": Site.MLP_MID}


def _dense_mlp_site(prefix: str) -> Site | None:
    """The site of a dense model's MLP linear ``prefix`` (``model.layers.N.mlp.gate_up_proj`` or
    ``...down_proj``); None for any other linear, and for every linear of a model with routed experts
    (whose dense-layer MLPs stay BF16, as its shared experts do)."""
    site = next((s for end, s in _DENSE_LINEARS.items() if prefix.endswith(end)), None)
    if site is None:
        return None
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or vllm_config.model_config is None:
        raise RuntimeError(f"tracefp4: {prefix} built outside a vLLM config: cannot tell a dense model from a MoE")
    cfg = vllm_config.model_config.hf_text_config
    return site if routed_expert_count(cfg) == 0 else None


@dataclasses.dataclass(frozen=True)
class _Held:
    """The prepared weights a layer holds as its parameters in place of the BF16 ones: the backend,
    the weight quantizer and, per part, the backend's parameter names (held as ``{part}_{name}``) and
    spec. No tensor: vLLM's layer-wise reload copies new values into the layer's parameters, so the
    weights are read from the layer at every call."""

    gemm: ExpertGEMM
    quantizer: Quantizer
    parts: dict[str, tuple[tuple[str, ...], Hashable]]

    def weight(self, layer, part: str) -> PreparedWeight:
        names, spec = self.parts[part]
        return self.gemm.from_parameters({n: getattr(layer, _held_name(part, n)) for n in names}, spec)


def _held_name(part: str, field: str) -> str:
    """The layer parameter a prepared weight's ``field`` is held as: ``{part}_{field}`` (the experts'
    ``w13``/``w2``), or the field itself for a linear layer's one weight (part ``""``)."""
    return f"{part}_{field}" if part else field


def _hold(layer, gemm: ExpertGEMM, quantizer: Quantizer, prepared: dict[str, PreparedWeight]) -> _Held:
    """Register the backend's parameters of each prepared part in place of the layer's BF16 ones,
    under names vLLM's layer-wise reload copies back by."""
    parts = {}
    for part, p in prepared.items():
        held = gemm.to_parameters(p)
        for field, t in held.tensors.items():
            name = _held_name(part, field)
            if name in layer._parameters:
                del layer._parameters[name]
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        parts[part] = (tuple(held.tensors), held.spec)
    return _Held(gemm, quantizer, parts)


def _refuse_unheld(prefix: str, held: _Held, plan: PrecisionPlan | None, what: str) -> None:
    if plan is None or plan.weight_quantizer != held.quantizer:
        want = "BF16" if plan is None else f"weights quantized by {plan.weight_quantizer}"
        raise ValueError(f"{prefix}: this engine holds only its plan's prepared {what} ({held.quantizer}); a "
                         f"call asking for {want} needs an engine built with keep_bf16=True")


class TraceFP4MoEMethod(FusedMoEMethodBase):
    """Routed experts computed with tracefp4's numerics (see the module docstring)."""

    def __init__(self, moe, prefix: str, plan: PrecisionPlan | None = PrecisionPlan(), *, keep_bf16: bool = False) -> None:
        super().__init__(moe)
        self.prefix = prefix
        self.config_plan = plan
        self.keep_bf16 = keep_bf16 or plan is None
        self.layer_index = layer_index(prefix)
        # keep_bf16: weight quantizer -> (backend, (w13, w2) prepared); emptied on every weight load
        self._prepared: dict[Any, tuple[ExpertGEMM, tuple[PreparedWeight, PreparedWeight]]] = {}
        self._in_layer: _Held | None = None  # without keep_bf16: what the layer's parameters hold

    def create_weights(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra_weight_attrs
    ) -> None:
        w13 = torch.nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size, dtype=params_dtype),
            requires_grad=False,
        )
        layer.register_parameter("w13_weight", w13)
        set_weight_attrs(w13, extra_weight_attrs)
        w2 = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        layer.register_parameter("w2_weight", w2)
        set_weight_attrs(w2, extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        return FusedMoEQuantConfig.make()

    def process_weights_after_loading(self, layer) -> None:
        """After every load: prepare the new BF16 weights for the config's plan (no CPU prepack of
        vLLM's: it would not survive ``reload_weights``). Without ``keep_bf16`` the backend's
        parameters replace the BF16 ones, under names vLLM's layer-wise reload copies back by."""
        self._prepared.clear()
        plan = self.config_plan
        if plan is None:
            return
        quantizer = plan.weight_quantizer
        w13 = layer.w13_weight
        gemm = choose_gemm(plan, w13.device, w13.dtype, gradients=False)
        prepared = self._prepare(layer, gemm, quantizer)
        if self.keep_bf16:
            self._prepared[quantizer] = (gemm, prepared)
            return
        self._in_layer = _hold(layer, gemm, quantizer, dict(zip(_PARTS, prepared)))

    def _prepare(self, layer, gemm: ExpertGEMM, quantizer) -> tuple[PreparedWeight, PreparedWeight]:
        out = []
        for part in _PARTS:
            try:
                out.append(gemm.prepare(getattr(layer, f"{part}_weight"), quantizer))
            except ValueError as e:
                raise ValueError(f"{self.prefix}.{part}_weight: {e}") from e
        return out[0], out[1]

    def weights(self, layer, plan: PrecisionPlan | None) -> tuple[ExpertGEMM, tuple[PreparedWeight, PreparedWeight]]:
        """The backend and (w13, w2) as the plan's GEMMs take them."""
        held = self._in_layer
        if held is not None:
            _refuse_unheld(self.prefix, held, plan, "expert weights")
            return held.gemm, (held.weight(layer, "w13"), held.weight(layer, "w2"))
        if plan is None:
            gemm = choose_gemm(None, layer.w13_weight.device, layer.w13_weight.dtype, gradients=False)
            return gemm, (gemm.prepare(layer.w13_weight, None), gemm.prepare(layer.w2_weight, None))
        quantizer = plan.weight_quantizer
        hit = self._prepared.get(quantizer)
        if hit is None:
            gemm = choose_gemm(plan, layer.w13_weight.device, layer.w13_weight.dtype, gradients=False)
            hit = self._prepared[quantizer] = (gemm, self._prepare(layer, gemm, quantizer))
        return hit

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if getattr(layer, "expert_map", None) is not None:
            raise NotImplementedError("tracefp4: expert parallelism (expert_map) is not supported")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError("tracefp4: apply_router_weight_on_input is not supported")
        act = getattr(layer, "activation", None)
        if getattr(act, "value", act) != "silu":
            raise NotImplementedError(f"tracefp4: routed experts with activation {act} (SiLU-gated only)")
        state = RUNTIME.state()
        gemm, (w13, w2) = self.weights(layer, state.plan)
        # vLLM's router has run: the path's routing hook sees its choice (a rollout records it)
        topk_weights, topk_ids = state.path.route(self.layer_index, topk_weights, topk_ids.to(torch.long))
        return routed_experts(state, self.layer_index, RUNTIME.site_input(x), topk_ids, topk_weights, w13, w2, gemm,
                              SILU_GATE)


class TraceFP4DenseMLPMethod(UnquantizedLinearMethod):
    """A dense model's MLP linear (``gate_up_proj`` or ``down_proj``) as one FP4 expert with every row
    (see the module docstring). The BF16 weight is created and loaded as vLLM's unquantized method
    does; after loading it is prepared (and, without ``keep_bf16``, replaced) as the MoE method
    prepares expert weights, and kept as it is otherwise: vLLM's CPU processing of an unquantized
    weight would replace it by a oneDNN handle that nothing else can read, so a BF16 call of a
    ``keep_bf16`` engine multiplies the weight itself (``F.linear``), as the MoE method's BF16 calls do."""

    def __init__(self, prefix: str, site: Site, plan: PrecisionPlan | None, *, keep_bf16: bool = False) -> None:
        super().__init__()
        self.prefix, self.site = prefix, site
        self.config_plan = plan
        self.keep_bf16 = keep_bf16 or plan is None
        self.layer_index = layer_index(prefix)
        self._prepared: dict[Any, tuple[ExpertGEMM, PreparedWeight]] = {}  # keep_bf16: per weight quantizer
        self._in_layer: _Held | None = None  # without keep_bf16: what the layer's parameters hold

    def _prepare(self, layer, plan: PrecisionPlan) -> tuple[ExpertGEMM, PreparedWeight]:
        gemm = choose_gemm(plan, layer.weight.device, layer.weight.dtype, gradients=False)
        try:
            return gemm, gemm.prepare(layer.weight[None], plan.weight_quantizer)
        except ValueError as e:
            raise ValueError(f"{self.prefix}.weight: {e}") from e

    def process_weights_after_loading(self, layer) -> None:
        """After every load: the new BF16 weight ``[N, K]`` prepared as a ``[1, N, K]`` expert for the
        config's plan; without ``keep_bf16`` its parameters replace the BF16 one."""
        self._prepared.clear()
        plan = self.config_plan
        if plan is None:
            return
        gemm, prepared = self._prepare(layer, plan)
        if self.keep_bf16:
            self._prepared[plan.weight_quantizer] = (gemm, prepared)
        else:
            self._in_layer = _hold(layer, gemm, plan.weight_quantizer, {"": prepared})

    def _weight(self, layer, plan: PrecisionPlan) -> tuple[ExpertGEMM, PreparedWeight]:
        held = self._in_layer
        if held is not None:
            _refuse_unheld(self.prefix, held, plan, "MLP weights")
            return held.gemm, held.weight(layer, "")
        hit = self._prepared.get(plan.weight_quantizer)
        if hit is None:
            hit = self._prepared[plan.weight_quantizer] = self._prepare(layer, plan)
        return hit

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None:
            raise NotImplementedError(f"tracefp4: {self.prefix} has a bias; the FP4 MLP GEMMs have none")
        state = RUNTIME.state()
        if state.plan is None:
            if self._in_layer is not None:
                _refuse_unheld(self.prefix, self._in_layer, None, "MLP weights")
            return torch.nn.functional.linear(x, layer.weight)
        if torch.compiler.is_compiling():  # the experts hide in vLLM's custom op; a linear has none
            raise NotImplementedError(f"tracefp4: {self.prefix}: a dense model's FP4 MLP runs in eager mode only "
                                      "(VLLMEngine(compilation='none'))")
        gemm, weight = self._weight(layer, state.plan)
        rows = RUNTIME.site_input(x).reshape(-1, x.shape[-1])
        return dense_gemm(state, self.layer_index, self.site, rows, weight, gemm).reshape(*x.shape[:-1], -1)
