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

from tracefp4.engines.experts import ExpertGEMM, PreparedWeight, choose_gemm, routed_experts  # noqa: E402
from tracefp4.engines.experts.base import SILU_GATE  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.vllm.kv_layout import KVStore, resolve_kv_store  # noqa: E402
from tracefp4.engines.vllm.runtime import RUNTIME, layer_index  # noqa: E402
from tracefp4.formats.quantizers import Quantizer  # noqa: E402

__all__ = ["QUANT_METHOD", "TraceFP4Config", "TraceFP4MoEMethod"]

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
            return UnquantizedLinearMethod()
        if isinstance(layer, Attention) and self.kv_store is KVStore.PACKED:
            from tracefp4.engines.vllm.kv_backend import install_packed_attention

            install_packed_attention(layer, self.plan.kv_cache)
        return None


_PARTS = ("w13", "w2")


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
        return self.gemm.from_parameters({n: getattr(layer, f"{part}_{n}") for n in names}, spec)


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
        parts = {}
        for part, p in zip(_PARTS, prepared):
            held = gemm.to_parameters(p)
            for field, t in held.tensors.items():
                name = f"{part}_{field}"
                if name in layer._parameters:
                    del layer._parameters[name]
                layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
            parts[part] = (tuple(held.tensors), held.spec)
        self._in_layer = _Held(gemm, quantizer, parts)

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
            if plan is None or plan.weight_quantizer != held.quantizer:
                want = "BF16" if plan is None else f"weights quantized by {plan.weight_quantizer}"
                raise ValueError(f"{self.prefix}: this engine holds only its plan's prepared expert weights "
                                 f"({held.quantizer}); a call asking for {want} needs an engine built with "
                                 "keep_bf16=True")
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
