"""The precision plan: which tensors are FP4, and the quantizer each site uses.

Both paths (rollout engine and trainer) must run the same plan; the rollout's ``RolloutOutput.plan``
is what the trainer is given. Callers never branch on a format: they ask the plan for the site's
quantizer (:mod:`tracefp4.formats.quantizers`) and call it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tracefp4.formats.constants import Format, ScaleMode
from tracefp4.formats.quantizers import FP8Quantizer, MXFP4Quantizer, NVFP4Quantizer, Quantizer
from tracefp4.guidance.names import Site

__all__ = ["ActivationFormat", "PrecisionPlan"]

ActivationFormat = Literal["nvfp4", "mxfp4", "fp8"]
NVFP4Scale = Literal["6", "4over6"]


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
    nvfp4_scale: what every NVFP4 tensor's block scale maps the block maximum to: ``"6"`` (the
        standard recipe) or ``"4over6"`` ("Four over Six": 4 or 6 per block, whichever has the smaller
        squared error; see :class:`~tracefp4.formats.quantizers.NVFP4Quantizer`).

    Every activation and KV scale is per row (token, or token x expert slot, or token x KV head), so
    a token's codes never depend on what else shares its batch: records move between differently
    batched paths.
    """

    weights: Format = Format.NVFP4
    activations: ActivationFormat = "nvfp4"
    kv_cache: Format = Format.NVFP4
    mx_scale_mode: ScaleMode = ScaleMode.FLOOR
    nvfp4_scale: NVFP4Scale = "6"

    def __post_init__(self) -> None:
        if self.nvfp4_scale not in ("6", "4over6"):
            raise ValueError(f"nvfp4_scale must be '6' or '4over6', got {self.nvfp4_scale!r}")
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

    @classmethod
    def four_over_six(cls) -> PrecisionPlan:
        """NVFP4 weights, activations and KV cache with "Four over Six" block scales."""
        return cls(nvfp4_scale="4over6")

    def _fp4(self, fmt: Format, amax_scope: str) -> Quantizer:
        if fmt is Format.NVFP4:
            return NVFP4Quantizer(amax_scope, block_max=6 if self.nvfp4_scale == "6" else "4over6")
        return MXFP4Quantizer(self.mx_scale_mode)

    def quantizer(self, site: Site | str) -> Quantizer:
        """The quantizer of an activation or KV site; every one scales per row (last dim)."""
        site = Site(site)
        if site in (Site.K, Site.V):
            return self._fp4(self.kv_cache, "row")
        if self.activations == "fp8":
            return FP8Quantizer()
        return self._fp4(Format(self.activations), "row")

    @property
    def weight_quantizer(self) -> Quantizer:
        """The routed-expert weights' quantizer: NVFP4 with one global amax per expert, or MXFP4."""
        return self._fp4(self.weights, "expert")

    def site_format(self, site: Site | str) -> str:
        """``"nvfp4"``, ``"mxfp4"`` or ``"fp8"`` for an activation or KV site."""
        return self.quantizer(site).fmt

    def guidable(self, site: Site | str) -> bool:
        return self.quantizer(site).guidable

    def to_dict(self) -> dict[str, str]:
        """JSON-ready; ``PrecisionPlan(**plan.to_dict())`` rebuilds it."""
        return {
            "weights": self.weights.value,
            "activations": self.activations,
            "kv_cache": self.kv_cache.value,
            "mx_scale_mode": self.mx_scale_mode.value,
            "nvfp4_scale": self.nvfp4_scale,
        }
