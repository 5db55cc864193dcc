"""What a forward is run for, as the model's seams see it: one interface for the rollout and the trainer.

Every seam (the quantization sites, the router, the routed-expert weights; our transformers seams and
the vLLM plugin alike) calls the three hooks of the forward's :class:`ForwardPath` and never asks
which kind of path it has:

* :meth:`ForwardPath.site`: the FP4 code a guidable site takes for its input (round to nearest, or
  toward a rollout's record) and its value, and whatever the path keeps of it (a rollout's records,
  a trainer's codes);
* :meth:`ForwardPath.route`: the experts a token goes to and their weights, given the router's own
  choice (kept and recorded by a rollout, replayed from the records by a trainer);
* :meth:`ForwardPath.expert_weights`: a routed-expert weight as this forward's GEMM takes it (kept
  across forwards by a rollout, prepared anew with straight-through gradients by a trainer).

The base class is the plain path: round to nearest, the router's own experts, weights prepared per
forward. :class:`~tracefp4.engines.capture.RolloutCapture` and
:class:`~tracefp4.engines.guidance.TrainerGuidance` override what they change.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from tracefp4.formats import MXFP4, NVFP4
from tracefp4.engines.weight_source import WeightSource, joined_weight
from tracefp4.formats.quantizers import Quantizer

if TYPE_CHECKING:  # the experts package imports the sites, which import this module
    from tracefp4.engines.experts.base import ExpertGEMM, PreparedWeight
    from tracefp4.engines.experts.cache import PreparedCache

__all__ = ["ForwardPath", "PLAIN", "weights_may_be_freed"]



def weights_may_be_freed() -> bool:
    """Whether a parameter seen inside a forward may lose its storage after its layer: in a process of
    a ``torch.distributed`` group any sharding wrapper (FSDP1 or FSDP2, ours or accelerate's or
    torchtitan's, DeepSpeed ZeRO-3) frees the gathered weights once the layer has run, so the trainer
    quantizes a copy of them there (the CPU kernels' numpy view of an input would pin its size)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class ForwardPath:
    """The plain path (see the module docstring); subclasses override what they change.

    ``rollout``: a rollout forward (no gradients; prepared expert weights may be kept across forwards).
    """

    rollout: bool = False
    #: where the path keeps checks the device makes without reading them back (a rollout's
    #: :class:`~tracefp4.engines.device_sites.StepChecks`); None: checked at once
    checks = None

    def site(self, layer: int, name: str, x: torch.Tensor, quantizer: Quantizer
             ) -> tuple[NVFP4 | MXFP4, torch.Tensor]:
        """The code of guidable site ``name`` (``record_prefix(layer, site)``) for input ``x``, on the
        plan's ``quantizer``, and its dequantized value (in any float dtype: the caller's
        straight-through wrapper casts it to x's); ``x`` is detached by that wrapper."""
        return quantizer.quantize_values(x.detach())

    def route(self, layer: int, weights: torch.Tensor, indices: torch.Tensor, logits: torch.Tensor | None = None,
              renormalises: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(weights, indices) [rows, top_k]`` MoE layer ``layer`` uses, given the router's own; a
        path that recomputes weights needs the router's ``logits [rows, E]`` and whether it
        renormalises its top-k probabilities."""
        return weights, indices

    def expert_weights(self, cache: PreparedCache, owner: Hashable, name: str, w: WeightSource,
                       quantizer: Quantizer | None, gemm: ExpertGEMM) -> PreparedWeight:
        """GEMM weight ``name`` (``w``: ``[E, N, K]`` routed-expert weights, or a dense MLP's as one
        expert, :data:`~tracefp4.engines.weight_source.WeightSource`) of ``owner`` as ``gemm`` takes it; ``cache`` is the prepared
        model's cache of kept weights. Plain: prepared every forward with a straight-through gradient
        to ``w``."""
        return gemm.prepare(joined_weight(w), quantizer, gradients=True, copy=weights_may_be_freed())


#: The path of a forward that records nothing and is guided by nothing.
PLAIN = ForwardPath()
