"""The precision plan: which tensors are FP4 (or FP8), and the quantizer each site uses.

Both paths (rollout engine and trainer) must run the same plan; the rollout's ``RolloutOutput.plan``
is what the trainer is given. Callers never branch on a format: they ask the plan for the site's
quantizer (:mod:`tracefp4.formats.quantizers`) and call it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal

from tracefp4.formats.constants import NVFP4_BLOCK, Format, HintMode, ScaleMode
from tracefp4.formats import rac_channel_count
from tracefp4.formats.quantizers import (
    CompensatedNVFP4Quantizer,
    FP8Quantizer,
    MXFP4Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from tracefp4.guidance.compact.modes import GuidedMode
from tracefp4.guidance.compact.spec import GuidanceSpec, mode_name, unsupported_knob
from tracefp4.guidance.names import Site

__all__ = ["ActivationFormat", "BF16_SITE", "PLAN_NAMES", "PrecisionPlan", "check_supported", "routed_expert_count"]

ActivationFormat = Literal["nvfp4", "mxfp4", "fp8", "bf16"]

#: The config keys that give a MoE model's routed experts per layer, by family (Qwen/OLMoE, Mixtral,
#: DeepSeek-style).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routed_expert_count(config: Mapping[str, Any] | object) -> int:
    """A model config's routed experts per MoE layer (a transformers config or its dict), 0 for a dense
    model: where the plan's weights and activations apply to the experts, or to the dense MLP."""
    get = config.get if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    return max(int(get(k) or 0) for k in EXPERT_COUNT_KEYS)
NVFP4Scale = Literal["6", "4over6"]
#: A site left in BF16 by a plan (``activations``/``kv_cache`` = ``"bf16"``: the W4A16 trainer of QUADS).
BF16_SITE = "bf16"


@dataclasses.dataclass(frozen=True, repr=False)
class PrecisionPlan:
    """Which tensors are quantized, and in which format. Everything not named here stays BF16
    (attention projections, shared experts, router, embeddings, norms, lm_head; in a MoE model also
    the MLP of a dense layer, as its shared experts are).

    weights: routed-expert weights (NVFP4 with one global scale per expert, MXFP4, or FP8 E4M3 with one
        scale per output channel of each expert: the W8A8 plan); in a dense model (no MoE layer) the
        MLP's weights, quantized as one expert per GEMM (``[gate; up]`` on one global scale, ``down``
        on another).
    activations: the GEMM inputs: a MoE layer's routed-expert ``expert_in``/``expert_mid``, a dense
        model's MLP ``mlp_in``/``mlp_mid`` (NVFP4 with a global scale per row, MXFP4, FP8 E4M3 with a
        per-row scale = W4A8 / W8A8, or ``"bf16"``: left unquantized, the W4A16 trainer of QUADS).
        FP8 sites are guided like FP4 ones (E4M3 codes).
    kv_cache: keys and values as the cache stores them (NVFP4 per token and KV head, MXFP4, FP8 E4M3
        per token and KV head, or ``"bf16"``).
    mx_scale_mode: E8M0 scale rule of every MXFP4 tensor.
    nvfp4_scale: what every NVFP4 tensor's block scale maps the block maximum to: ``"6"`` (the
        standard recipe) or ``"4over6"`` ("Four over Six": 4 or 6 per block, whichever has the smaller
        squared error; see :class:`~tracefp4.formats.quantizers.NVFP4Quantizer`).
    rac_fraction: None, or QUADS' residual activation compensation at the expert GEMM inputs (NVFP4
        activations only): the share of each row's channels whose first-pass residual is quantized
        again and added back (:class:`~tracefp4.formats.quantizers.CompensatedNVFP4Quantizer`).

    Every activation and KV scale is per row (token, or token x expert slot, or token x KV head), so
    a token's codes never depend on what else shares its batch: records move between differently
    batched paths.
    """

    weights: Format = Format.NVFP4
    activations: ActivationFormat = "nvfp4"
    kv_cache: Format | Literal["bf16"] = Format.NVFP4
    mx_scale_mode: ScaleMode = ScaleMode.FLOOR
    nvfp4_scale: NVFP4Scale = "6"
    rac_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.nvfp4_scale not in ("6", "4over6"):
            raise ValueError(f"nvfp4_scale must be '6' or '4over6', got {self.nvfp4_scale!r}")
        object.__setattr__(self, "weights", Format(self.weights))
        if self.kv_cache != BF16_SITE:
            object.__setattr__(self, "kv_cache", Format(self.kv_cache))
        object.__setattr__(self, "mx_scale_mode", ScaleMode(self.mx_scale_mode))
        if self.activations not in ("nvfp4", "mxfp4", "fp8", BF16_SITE):
            raise ValueError(f"activations must be 'nvfp4', 'mxfp4', 'fp8' or 'bf16', got {self.activations!r}")
        if self.rac_fraction is not None:
            rac_channel_count(NVFP4_BLOCK, self.rac_fraction)
            if self.activations != "nvfp4" or self.nvfp4_scale != "6":
                raise ValueError("rac_fraction: residual activation compensation is defined for standard NVFP4 "
                                 f"activations, not {self.activations!r} with nvfp4_scale {self.nvfp4_scale!r}")

    def __repr__(self) -> str:
        # rac_fraction is named only when set, so that every plan without it keeps the text (and so the
        # store's model signature, :func:`tracefp4.pipeline.steps.model_signature`) it had before the field existed
        shown = [f for f in dataclasses.fields(self) if f.name != "rac_fraction" or self.rac_fraction is not None]
        return f"PrecisionPlan({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @classmethod
    def w4a4(cls) -> PrecisionPlan:
        """NVFP4 weights, activations and KV cache (the default)."""
        return cls()

    @classmethod
    def w4a8(cls) -> PrecisionPlan:
        """NVFP4 weights and KV cache, FP8 E4M3 expert activations."""
        return cls(activations="fp8")

    @classmethod
    def fp8(cls) -> PrecisionPlan:
        """W8A8 FP8: E4M3 routed-expert weights (a scale per output channel), E4M3 expert activations
        (a scale per row) and KV cache (a scale per token and KV head); the recipe of
        :class:`~tracefp4.formats.quantizers.FP8Quantizer`."""
        return cls(Format.FP8, "fp8", Format.FP8)

    @classmethod
    def mxfp4(cls, scale_mode: ScaleMode | str = ScaleMode.FLOOR) -> PrecisionPlan:
        """MXFP4 throughout."""
        return cls(Format.MXFP4, "mxfp4", Format.MXFP4, ScaleMode(scale_mode))

    @classmethod
    def four_over_six(cls) -> PrecisionPlan:
        """NVFP4 weights, activations and KV cache with "Four over Six" block scales."""
        return cls(nvfp4_scale="4over6")

    @classmethod
    def quads(cls, fraction: float = 0.5) -> PrecisionPlan:
        """QUADS' rollout: NVFP4 W4A4 and KV cache, residual activation compensation on ``fraction`` of
        each expert GEMM input row's channels."""
        return cls(rac_fraction=fraction)

    @classmethod
    def w4a16(cls) -> PrecisionPlan:
        """QUADS' trainer: NVFP4 routed-expert weights, every activation and the KV cache in BF16."""
        return cls(activations=BF16_SITE, kv_cache=BF16_SITE)

    @classmethod
    def named(cls, name: str, *, quads_fraction: float = 0.5) -> PrecisionPlan:
        """The plan of one of :data:`PLAN_NAMES` (the one vocabulary of plans: arm rows, the reports'
        ``--plan``, TRL's ``trace_plan``, the post-hoc evaluations): ``nvfp4`` the default W4A4 plan,
        ``quads`` compensating ``quads_fraction`` of the channels; a ValueError names the plan and the
        choices for any other name."""
        if name == "quads":
            return cls.quads(quads_fraction)
        try:
            make = _NAMED[name]
        except KeyError:
            raise ValueError(f"plan {name!r}: expected one of {', '.join(PLAN_NAMES)}") from None
        return make()

    def _element(self, fmt: Format, amax_scope: str) -> Quantizer:
        if fmt is Format.FP8:
            return FP8Quantizer()
        if fmt is Format.NVFP4:
            return NVFP4Quantizer(amax_scope, block_max=6 if self.nvfp4_scale == "6" else "4over6")
        return MXFP4Quantizer(self.mx_scale_mode)

    def quantizer(self, site: Site | str) -> Quantizer | None:
        """The quantizer of an activation or KV site (every one scales per row, the last dim); None
        where the plan leaves the site in BF16. (Asked at every site of every forward: the plan and
        its quantizers are immutable, so the answer is kept.)"""
        return _site_quantizer(self, Site(site))

    def _quantizer(self, site: Site) -> Quantizer | None:
        if site in (Site.K, Site.V):
            return None if self.kv_cache == BF16_SITE else self._element(self.kv_cache, "row")
        if self.activations == BF16_SITE:
            return None
        if self.rac_fraction is not None:
            return CompensatedNVFP4Quantizer(self.rac_fraction)
        return self._element(Format(self.activations), "row")

    @property
    def weight_quantizer(self) -> Quantizer:
        """The routed-expert weights' quantizer: NVFP4 with one global amax per expert, MXFP4, or FP8
        with one scale per output channel."""
        return self._element(self.weights, "expert")

    def site_format(self, site: Site | str) -> str:
        """``"nvfp4"``, ``"mxfp4"``, ``"fp8"`` or ``"bf16"`` for an activation or KV site."""
        q = self.quantizer(site)
        return BF16_SITE if q is None else q.fmt.value

    def guidable(self, site: Site | str) -> bool:
        q = self.quantizer(site)
        return q is not None and q.guidable

    def to_dict(self) -> dict[str, str]:
        """JSON-ready; ``PrecisionPlan(**plan.to_dict())`` rebuilds it."""
        out = {
            "weights": self.weights.value,
            "activations": self.activations,
            "kv_cache": getattr(self.kv_cache, "value", self.kv_cache),
            "mx_scale_mode": self.mx_scale_mode.value,
            "nvfp4_scale": self.nvfp4_scale,
        }
        if self.rac_fraction is not None:
            out["rac_fraction"] = self.rac_fraction
        return out


#: The named plans of :meth:`PrecisionPlan.named`, by name.
_NAMED = {"nvfp4": PrecisionPlan.w4a4, "4over6": PrecisionPlan.four_over_six, "mxfp4": PrecisionPlan.mxfp4,
          "w4a8": PrecisionPlan.w4a8, "fp8": PrecisionPlan.fp8, "quads": PrecisionPlan.quads, "w4a16": PrecisionPlan.w4a16}
#: The names :meth:`PrecisionPlan.named` accepts.
PLAN_NAMES: tuple[str, ...] = tuple(_NAMED)


@functools.lru_cache(maxsize=256)
def _site_quantizer(plan: PrecisionPlan, site: Site) -> Quantizer | None:
    return plan._quantizer(site)


#: The plan field that sets each guided site's format (what an error names as the cause).
_SITE_FIELD = {Site.EXPERT_IN: "activations", Site.EXPERT_MID: "activations", Site.MLP_IN: "activations",
               Site.MLP_MID: "activations", Site.K: "kv_cache", Site.V: "kv_cache"}


def check_supported(plan: PrecisionPlan | None, guidance: GuidedMode | HintMode | GuidanceSpec | str | None, *,
                    field: str = "guidance") -> None:
    """Refuse a guidance mode that ``plan`` cannot carry: the one check of every entry (both engines'
    ``generate``, the trainer forward, ``RLConfig``, ``TraceGRPOConfig``, the arms), so that no
    rollout starts on a combination that would fail mid-run or, worse, decode wrong block scales
    silently (Four over Six with ``parity``, ``scales:ldpc`` or ``scales:own``).

    The refused combinations, and why, are :func:`~tracefp4.guidance.compact.spec.unsupported_knob`'s:
    compact knobs at FP8 sites; scale and amax knobs at MXFP4 sites; scale knobs under Four over Six.
    The ValueError names ``field`` (the caller's name for the guidance knob, e.g. ``trace_guidance``)
    with its value, the plan field that makes the combination unsupported and the knob at fault. None
    for either argument (a BF16 rollout, or routing only) passes.
    """
    if plan is None or guidance is None:
        return
    if isinstance(guidance, str):
        guidance = GuidedMode.parse(guidance)
    mode, name = (guidance.mode, guidance.name) if isinstance(guidance, GuidedMode) else (guidance, mode_name(guidance))
    for site in Site:
        if not plan.guidable(site):
            continue  # BF16, or QUADS' compensated activations: nothing recorded there
        fmt = Format(plan.site_format(site))
        refused, cause = unsupported_knob(mode, fmt), f"{_SITE_FIELD[site]} = {fmt.value!r}"
        if refused is None and fmt is Format.NVFP4 and plan.nvfp4_scale == "4over6":
            refused, cause = unsupported_knob(mode, fmt, four_over_six=True), "nvfp4_scale = '4over6' (Four over Six)"
        if refused is not None:
            raise ValueError(f"{field} = {name!r} with the precision plan's {cause}: {refused}")
