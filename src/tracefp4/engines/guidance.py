"""What the trainer's forward reads from the rollout and reports back (the trainer side of the seams).

A :class:`TrainerGuidance` holds, for one teacher-forced forward over a packed batch:

* inputs: the rollout's record per guided site (a :class:`~tracefp4.guidance.hints.Hint`, or a
  :class:`~tracefp4.guidance.compact.CompactRecord` that decodes into one given the trainer's own
  value), the routing to replay per MoE layer, and the layers whose codes to capture;
* outputs: the trainer's packed FP4 codes and their grid at the capture layers, per-layer router
  flips under replay, and how many compact-record blocks failed to decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from tracefp4.formats.constants import HintMode
from tracefp4.formats.numerics import FP8, MXFP4, NVFP4
from tracefp4.formats.quantizers import Grid, Quantizer
from tracefp4.guidance.compact import CompactRecord, decode_record
from tracefp4.guidance.hints import Hint

__all__ = ["TrainerGuidance", "guided"]


@dataclasses.dataclass
class TrainerGuidance:
    """See the module docstring. ``hints`` keys are ``record_prefix(layer, site)``."""

    hints: Mapping[str, Hint | CompactRecord] = dataclasses.field(default_factory=dict)
    routing_replay: Mapping[int, torch.Tensor] | None = None
    capture_layers: frozenset[int] = frozenset()
    codes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, init=False)
    grids: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=dict, init=False)
    router_flips: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict, init=False)
    decode_failures: int = dataclasses.field(default=0, init=False)

    def hint(self, name: str, x: torch.Tensor) -> Hint | None:
        """The rollout's hint for site ``name`` given this path's own value ``x``, or None."""
        record = self.hints.get(name)
        if record is None or isinstance(record, Hint):
            return record
        hint, report = decode_record(record, x.detach())
        self.decode_failures += report.failed_blocks
        return hint

    def capture_site(self, layer: int, name: str, q: NVFP4 | MXFP4 | FP8, grid: Grid) -> None:
        if layer in self.capture_layers:
            self.codes[name] = q.codes
            self.grids[name] = (grid.scales, grid.global_amax)

    def replay(self, layer: int) -> torch.Tensor | None:
        """The rollout's routing of ``layer`` (None: no replay in this forward)."""
        if self.routing_replay is None:
            return None
        if layer not in self.routing_replay:
            raise ValueError(f"routing replay: no recorded routing for MoE layer {layer}")
        return self.routing_replay[layer]

    def note_flips(self, layer: int, flipped: int, tokens: int) -> None:
        self.router_flips[layer] = (flipped, tokens)


def guided(quantizer: Quantizer, x: torch.Tensor, hint: Hint) -> NVFP4 | MXFP4 | FP8:
    """``x`` quantized on the hint's grid, each element rounded to the bracket member it names."""
    if hint.fmt.value != quantizer.fmt:
        raise ValueError(f"the record is {hint.fmt.value} but the precision plan says {quantizer.fmt}")
    if tuple(x.shape) != tuple(hint.shape):
        raise ValueError(
            f"hint shape mismatch: x has shape {tuple(x.shape)} but the hint was recorded for shape "
            f"{tuple(hint.shape)} ({hint.fmt.value}, {hint.mode.value})"
        )
    expect = hint.data_shape(x.shape)
    if tuple(hint.data.shape) != expect or hint.data.dtype != torch.uint8:
        raise ValueError(f"hint data: expected uint8 {expect}, got {hint.data.dtype} {tuple(hint.data.shape)}")
    full = hint.mode is HintMode.FULL
    return quantizer.guided_quantize(
        x, Grid(hint.scales, hint.global_amax), codes=hint.data if full else None, lsb=None if full else hint.data
    )
