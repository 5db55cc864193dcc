"""The quantization sites of one forward: what the next op sees at each, given the forward's state.

A :class:`ForwardState` names the precision plan of the forward in progress (None: BF16) and the path
it runs for (a :class:`~tracefp4.engines.path.ForwardPath`: a rollout's
:class:`~tracefp4.engines.capture.RolloutCapture`, the trainer's
:class:`~tracefp4.engines.guidance.TrainerGuidance`, or the plain path). :func:`quantize_site` is the
one function every seam calls at an activation or KV site (our transformers seams and the vLLM plugin
alike), so both engines quantize and record exactly the same way; what the code is, and what is kept
of it, is the path's site hook.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tracefp4.engines.path import PLAIN, ForwardPath
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats import FP8, MXFP4, NVFP4, CompensatedNVFP4, straight_through
from tracefp4.formats.quantizers import Quantizer
from tracefp4.guidance.names import Site, record_prefix

__all__ = ["BF16", "ForwardState", "quantize_kv", "quantize_site", "site_code", "site_regions"]


@dataclasses.dataclass(frozen=True)
class ForwardState:
    """How the forward in progress computes: ``plan`` (None: BF16, the model's own numerics) and the
    path it runs for (None: the plain path)."""

    plan: PrecisionPlan | None = None
    path: ForwardPath = PLAIN

    def __post_init__(self) -> None:
        if self.path is None:
            object.__setattr__(self, "path", PLAIN)

    @property
    def rollout(self) -> bool:
        """A rollout forward (weights may be prepared once and kept; no gradients)."""
        return self.path.rollout


#: The state outside any tracefp4 forward: BF16, no path.
BF16 = ForwardState()


def _code(state: ForwardState, layer: int, site: Site, x: torch.Tensor, quantizer: Quantizer
          ) -> tuple[NVFP4 | MXFP4 | FP8 | CompensatedNVFP4, torch.Tensor | None]:
    """The code of ``x`` at ``site`` and its value where the path gives one (None: the caller
    dequantizes), recorded by the path: the one place a site is quantized."""
    name = record_prefix(layer, site)
    if not _regions:
        return _run_site(state, layer, name, x, quantizer)
    with torch.profiler.record_function("tracefp4::site"):
        return _run_site(state, layer, name, x, quantizer)


def _run_site(state: ForwardState, layer: int, name: str, x: torch.Tensor, quantizer):
    try:
        if not quantizer.guidable:  # compensated NVFP4 (QUADS): two passes, nothing recorded or guided
            return quantizer.quantize(x.detach()), None
        return state.path.site(layer, name, x, quantizer)
    except ValueError as e:
        raise ValueError(f"site {name}: {e}") from e


#: Whether each site runs inside a ``tracefp4::site`` profiler region (:func:`site_regions`). Off by
#: default: a region costs microseconds per site even with no profiler running, on every decode step.
_regions = False


@contextlib.contextmanager
def site_regions():
    """Mark every site as a ``tracefp4::site`` profiler region inside the block (in every thread:
    vLLM's engine steps run the model where the caller does not), for a profile of where decode time
    goes (``bench rollout --preset long``)."""
    global _regions
    saved, _regions = _regions, True
    try:
        yield
    finally:
        _regions = saved


def quantize_site(state: ForwardState, layer: int, site: Site, x: torch.Tensor) -> torch.Tensor:
    """The value the next op sees at ``site``: ``x`` quantized per row (last dim) by the plan's
    quantizer, rounded toward the rollout's codeword where the trainer has a hint, in x's dtype with a
    straight-through gradient."""
    quantizer = None if state.plan is None else state.plan.quantizer(site)
    if quantizer is None:  # BF16: no plan, or a site the plan leaves unquantized (W4A16)
        return x
    q, value = _code(state, layer, site, x, quantizer)
    return straight_through(x, quantizer.dequantize(q) if value is None else value)


def site_code(state: ForwardState, layer: int, site: Site, x: torch.Tensor
              ) -> NVFP4 | MXFP4 | FP8 | CompensatedNVFP4 | None:
    """The code (not the value) the plan gives ``x`` at ``site``, recorded by the forward's path
    exactly as :func:`quantize_site` records it; None where the plan leaves the site in BF16. A cache
    that stores codes calls this: each row is quantized once, and the record is the stored code."""
    quantizer = None if state.plan is None else state.plan.quantizer(site)
    return None if quantizer is None else _code(state, layer, site, x, quantizer)[0]


def quantize_kv(state: ForwardState, layer: int, site: Site, states: torch.Tensor) -> torch.Tensor:
    """``states [B, n_kv, S, D]`` as the cache stores them; rows are (token, KV head)."""
    if state.plan is None or state.plan.quantizer(site) is None:
        return states
    b, h, s, d = states.shape
    rows = states.transpose(1, 2).reshape(b * s, h, d)
    out = quantize_site(state, layer, site, rows)
    return out.reshape(b, s, h, d).transpose(1, 2)
