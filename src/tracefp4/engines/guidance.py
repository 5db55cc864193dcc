"""What the trainer's forward reads from the rollout and reports back (the trainer side of the seams).

A :class:`TrainerGuidance` holds, for one teacher-forced forward:

* inputs: the rollout's record per guided site (a :class:`~tracefp4.guidance.record.SiteRecord`:
  a :class:`~tracefp4.guidance.hints.Hint`, or a :class:`~tracefp4.guidance.compact.CompactRecord`
  that decodes into one given the trainer's own value), the routing to replay per MoE layer, the layers whose codes to capture, and the
  :class:`~tracefp4.engines.rows.RowMap` of the forward's rows; records and replay are in record
  order (the trajectories' covered positions, concatenated), the map says which rows they belong to
  (None: the rows are the records' rows, a packed batch); ``stale``, in record order, marks the rows
  whose record is too many policy versions behind the trainer to guide it (they round to nearest on
  the trainer's own grid; None: none is);
* outputs: the trainer's packed FP4 codes and their grid at the capture layers (in record order),
  per-layer router flips under replay (over real rows), how many compact-record blocks failed to
  decode, and the sum of every record's :class:`~tracefp4.guidance.report.DecodeReport`
  (``decode_report``: also the ``mod4`` records' detected bracket misses, the counts a
  ``guidance_bracket_miss_rate`` is made of).

Padding rows are rounded to nearest on their own grid and keep the router's own experts.

It is the trainer's :class:`~tracefp4.engines.path.ForwardPath`: the site hook rounds toward the
record, the routing hook replays, and the expert weights are prepared every forward with
straight-through gradients (the plain path's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from tracefp4.engines.path import ForwardPath
from tracefp4.engines.rows import RowMap, scatter_rows, select_rows
from tracefp4.formats.constants import HintMode
from tracefp4.formats import FP8, MXFP4, NVFP4
from tracefp4.formats.quantizers import Grid, Quantizer
from tracefp4.guidance.hints import Hint
from tracefp4.guidance.names import layer_tag
from tracefp4.guidance.record import SiteRecord
from tracefp4.guidance.report import DecodeReport

__all__ = ["TrainerGuidance", "guided"]


@dataclasses.dataclass
class TrainerGuidance(ForwardPath):
    """See the module docstring. ``hints`` keys are ``record_prefix(layer, site)``."""

    hints: Mapping[str, SiteRecord] = dataclasses.field(default_factory=dict)
    routing_replay: Mapping[int, torch.Tensor] | None = None
    capture_layers: frozenset[int] = frozenset()
    rows: RowMap | None = None
    stale: torch.Tensor | None = None
    codes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, init=False)
    grids: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=dict, init=False)
    router_flips: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict, init=False)
    decode_failures: int = dataclasses.field(default=0, init=False)
    decode_report: DecodeReport = dataclasses.field(default_factory=DecodeReport, init=False)

    def hint(self, name: str, x: torch.Tensor) -> Hint | None:
        """The rollout's hint for site ``name`` given this path's own value ``x``, or None."""
        record = self.hints.get(name)
        if record is None:
            return None
        hint, report = record.decode(x.detach())
        self.decode_failures += report.failed_blocks
        self.decode_report += report
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

    # --- the path's hooks ---------------------------------------------------------------------

    def _mapped(self) -> RowMap | None:
        """The row map, or None where the forward's rows are the records' rows."""
        return None if self.rows is None or self.rows.dense else self.rows

    def _check_rows(self, what: str, n: int) -> None:
        if self.rows is not None and n != self.rows.n_rows:
            raise ValueError(f"{what}: the forward has {n} rows but its row map {self.rows.shape} has "
                             f"{self.rows.n_rows} (one trainer_forward per model forward)")

    def site(self, layer: int, name: str, x: torch.Tensor, quantizer: Quantizer
             ) -> tuple[NVFP4 | MXFP4, torch.Tensor]:
        q = self._code(layer, name, x, quantizer)
        return q, quantizer.dequantize(q)

    def _code(self, layer: int, name: str, x: torch.Tensor, quantizer: Quantizer) -> NVFP4 | MXFP4:
        self._check_rows(name, x.shape[0])
        rows = self._mapped()
        if rows is None:
            q = self._record_rows(name, x.detach(), quantizer)
            self.capture_site(layer, name, q, quantizer.grid(q))
            return q
        if name not in self.hints and layer not in self.capture_layers:
            return quantizer.quantize(x.detach())
        real = rows.real.to(x.device)
        qr = self._record_rows(name, x.detach()[real], quantizer)
        self.capture_site(layer, name, qr, quantizer.grid(qr))
        pad = rows.pad.to(x.device)
        parts = [(real, qr)] + ([(pad, quantizer.quantize(x.detach()[pad]))] if pad.numel() else [])
        return scatter_rows(x.shape[0], parts)

    def _record_rows(self, name: str, x: torch.Tensor, quantizer: Quantizer) -> NVFP4 | MXFP4 | FP8:
        """``x``'s rows (the records' rows, in record order) rounded toward the rollout's record where the
        site has one, except the stale rows, which (like every row of a site without one) round to nearest."""
        stale = self.stale if name in self.hints else None
        if stale is not None and bool(stale.all()):
            return quantizer.quantize(x)  # nothing to decode: no row takes the record
        hint = self.hint(name, x)
        if hint is None:
            return quantizer.quantize(x)
        q = guided(quantizer, x, hint)
        if stale is None or not bool(stale.any()):
            return q
        # every scale is per row, so the stale rows quantized apart are what quantizing all rows gives there
        old, fresh = stale.nonzero().squeeze(-1).to(x.device), (~stale).nonzero().squeeze(-1).to(x.device)
        return scatter_rows(x.shape[0], [(fresh, select_rows(q, fresh)), (old, quantizer.quantize(x[old]))])

    def route(self, layer: int, weights: torch.Tensor, indices: torch.Tensor, logits: torch.Tensor | None = None,
              renormalises: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing replay (R3): the rollout's experts, with probabilities from this path's own
        ``logits`` (softmax, gathered at the replayed experts, renormalised as the router does), so the
        selection is replayed and the router weight still gets gradients. Padding rows keep the
        router's own choice."""
        replay = self.replay(layer)
        if replay is None:
            return weights, indices
        if logits is None or renormalises is None:
            raise ValueError(f"routing replay {layer_tag(layer)}: needs the router's logits and renormalisation")
        self._check_rows(f"routing replay {layer_tag(layer)}", indices.shape[0])
        rows = self._mapped()
        real = None if rows is None else rows.real.to(indices.device)
        own = indices if real is None else indices[real]
        replay = replay.to(device=indices.device, dtype=torch.long)
        if replay.shape != own.shape:
            raise ValueError(
                f"routing replay {layer_tag(layer)}: recorded indices {tuple(replay.shape)} but the router "
                f"produced {tuple(own.shape)}" + ("" if real is None else " on the real rows")
            )
        with torch.no_grad():
            mine, rec = own.sort(dim=-1).values, replay.sort(dim=-1).values
            self.note_flips(layer, int((mine != rec).any(dim=-1).sum()), int(own.shape[0]))
        probs = torch.softmax((logits if real is None else logits[real]).to(torch.float32), dim=-1)
        chosen = probs.gather(-1, replay)
        if renormalises:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        chosen = chosen.to(weights.dtype)
        if real is None:
            return chosen, replay
        return weights.index_put((real,), chosen), indices.index_put((real,), replay)


def guided(quantizer: Quantizer, x: torch.Tensor, hint: Hint) -> NVFP4 | MXFP4 | FP8:
    """``x`` quantized on the hint's grid, each element rounded to the bracket member it names."""
    if hint.fmt is not quantizer.fmt:
        raise ValueError(f"the record is {hint.fmt.value} but the precision plan says {quantizer.fmt.value}")
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
