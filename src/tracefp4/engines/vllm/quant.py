"""The ``tracefp4`` quantization config and its routed-experts method: our numerics inside vLLM.

* Routed experts (``RoutedExperts`` layers): :class:`TraceFP4MoEMethod`. Weights keep vLLM's plain
  layout (``w13_weight [E, 2I, H]`` = HF ``gate_up_proj``, ``w2_weight [E, H, I]`` = ``down_proj``);
  after every weight load (``process_weights_after_loading``, which ``reload_weights`` runs too) they
  are quantized once with ``plan.weight_quantizer`` (NVFP4: one global amax per expert) and the
  dequantized values are kept for the GEMMs, as our transformers path does. ``apply`` quantizes
  ``expert_in`` and ``expert_mid`` per row with ``plan.quantizer(site)`` through
  :func:`tracefp4.engines.model.quantize_site`, the very function our engine calls, records the
  routing (``topk_ids``) and sums the top-k outputs in float32 like our path.
* Every other linear layer (attention projections, router, shared experts, lm_head) stays
  unquantized; attention gets no quant method (the cache stays in the model dtype, K/V are FP4
  values written by :mod:`.plugin`'s wrapper).

The plan comes from the config's ``plan`` entry (``PrecisionPlan.to_dict()``), e.g.
``hf_overrides={"quantization_config": {"quant_method": "tracefp4", "plan": plan.to_dict()}}``;
a :class:`~tracefp4.engines.vllm.engine.VLLMEngine` call may run another plan (or BF16) per call.
"""

from __future__ import annotations

from tracefp4.engines.vllm.process import prepare_process

prepare_process()  # before numba: a spawned worker unpickles this config before its start-up scan

from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllm.model_executor.layers.fused_moe import RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from vllm.model_executor.utils import set_weight_attrs  # noqa: E402

from tracefp4.engines.capture import RolloutCapture  # noqa: E402
from tracefp4.engines.model import ForwardState, grouped_linear, quantize_site  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.vllm.runtime import RUNTIME, layer_index  # noqa: E402
from tracefp4.guidance.names import Site, layer_tag  # noqa: E402

__all__ = ["QUANT_METHOD", "TraceFP4Config", "TraceFP4MoEMethod", "expert_forward"]

QUANT_METHOD = "tracefp4"


@register_quantization_config(QUANT_METHOD)
class TraceFP4Config(QuantizationConfig):
    """``{"quant_method": "tracefp4", "plan": {...PrecisionPlan.to_dict()...} | null}`` (no plan
    entry: the default W4A4 NVFP4 plan; ``null``: BF16 unless a call says otherwise)."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = dict(config or {})
        plan = self.config.get("plan", PrecisionPlan().to_dict())
        self.plan = None if plan is None else PrecisionPlan(**plan)
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
            return TraceFP4MoEMethod(layer.moe_config, prefix, self.plan)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None


def _gate(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU-gated ``[gate; up]`` (Qwen3-MoE's experts, transformers' ``_apply_gate``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_forward(
    state: ForwardState,
    layer: int,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts on ``x [N, H]`` with GEMM weights ``w13 [E, 2I, H]``/``w2 [E, H, I]`` (already
    quantized as the plan says), the sites quantized and recorded exactly as
    :func:`tracefp4.engines.model.tracefp4_experts_forward` does."""
    n, k = topk_ids.shape
    n_experts = w13.shape[0]
    topk_ids = topk_ids.to(torch.long)
    if n and int(topk_ids.max()) >= n_experts:
        raise ValueError(f"{layer_tag(layer)}: expert index {int(topk_ids.max())} out of range [0, {n_experts})")
    if isinstance(state.path, RolloutCapture):
        state.path.record_routing(layer, topk_ids)
    xq = quantize_site(state, layer, Site.EXPERT_IN, x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    mid_sorted = _gate(grouped_linear(xq[order // k], w13, counts))
    mid = quantize_site(state, layer, Site.EXPERT_MID, mid_sorted[inverse].reshape(n, k, -1))
    down_sorted = grouped_linear(mid.reshape(n * k, -1)[order], w2, counts)
    down = down_sorted[inverse].reshape(n, k, -1)
    out = (down.to(torch.float32) * topk_weights.to(torch.float32).unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)


class TraceFP4MoEMethod(FusedMoEMethodBase):
    """Routed experts computed with tracefp4's numerics (see the module docstring)."""

    def __init__(self, moe, prefix: str, plan: PrecisionPlan | None = PrecisionPlan()) -> None:
        super().__init__(moe)
        self.prefix = prefix
        self.config_plan = plan
        self.layer_index = layer_index(prefix)
        # plan's weight quantizer -> (w13, w2) dequantized; emptied on every weight load
        self._weights: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

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
        """Keep the plain layout (no CPU prepack: it would not survive ``reload_weights``); quantize
        the new weights once for the config's plan."""
        self._weights.clear()
        if self.config_plan is not None:
            self.weights(layer, self.config_plan)

    def weights(self, layer, plan: PrecisionPlan | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the plan's GEMMs see them: dequantized FP4 in the parameters' dtype."""
        if plan is None:
            return layer.w13_weight, layer.w2_weight
        quantizer = plan.weight_quantizer
        hit = self._weights.get(quantizer)
        if hit is None:
            out = []
            for name in ("w13_weight", "w2_weight"):
                w = getattr(layer, name)
                try:
                    out.append(quantizer.dequantize(quantizer.quantize(w.detach())).to(w.dtype))
                except ValueError as e:
                    raise ValueError(f"{self.prefix}.{name}: {e}") from e
            hit = self._weights[quantizer] = (out[0], out[1])
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
        w13, w2 = self.weights(layer, state.plan)
        return expert_forward(state, self.layer_index, RUNTIME.site_input(x), w13, w2, topk_weights, topk_ids)
