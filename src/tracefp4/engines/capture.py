"""What the rollout engine records during one forward (the rollout side of the seams).

A :class:`RolloutCapture` is handed to the model's seams for every forward of one rollout. It keeps,
over that forward's flattened rows (batch-major, ``b*S + s``):

* the routed expert indices of every MoE layer (always: routing replay needs them also after a
  BF16 rollout);
* at the guided layers, in the capture's guidance mode: for ``full``/``lsb`` a :class:`RawCapture`
  of the site's quantized value (encoded into a Hint only when the records are assembled: encoding
  per decode step would cost more than the recording itself at small batch), for a compact mode the
  :class:`~tracefp4.guidance.compact.CompactRecord` of this forward (it needs this forward's input);
* at the diagnostic layers, a ``full`` :class:`RawCapture` (full codes, for code-mismatch metrics;
  they are kept in memory only and never reach the store).

Both kinds are :class:`~tracefp4.guidance.record.SiteRecord` records, so the rollout assembles them alike.

Recording never changes what the forward computes. The capture is the rollout's
:class:`~tracefp4.engines.path.ForwardPath`: the site hook records, the routing hook records, and
the expert weights are kept across forwards in the prepared model's cache. On the device its checks
(NaN/Inf inputs, expert indices) are kept as device flags in :attr:`RolloutCapture.checks` and read
once, when the rollout's records are assembled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from tracefp4.engines.device_sites import StepChecks, site_values
from tracefp4.engines.path import ForwardPath
from tracefp4.engines.weight_source import WeightSource
from tracefp4.engines.rows import take_rows
from tracefp4.formats.constants import HintMode
from tracefp4.formats import FP8, MXFP4, NVFP4
from tracefp4.formats.quantizers import Quantizer
from tracefp4.guidance.compact import CompactRecord, GuidanceSpec, GuidedMode
from tracefp4.guidance.hints import Hint, encode_hint
from tracefp4.guidance.record import SiteRecord
from tracefp4.guidance.report import DecodeReport

if TYPE_CHECKING:
    from tracefp4.engines.experts.base import ExpertGEMM, PreparedWeight
    from tracefp4.engines.experts.cache import PreparedCache

__all__ = ["ForwardRecord", "RawCapture", "RolloutCapture", "trajectory_tensors"]


@dataclasses.dataclass
class RawCapture:
    """A ``full``/``lsb`` site as the rollout captured it: the quantized value, a :class:`Hint` once
    stored or decoded (every tensor of ``q`` is per row, so rows select and concatenate before encoding)."""

    q: NVFP4 | MXFP4 | FP8
    mode: HintMode

    def hint(self) -> Hint:
        return encode_hint(self.q, self.mode)

    @property
    def rows(self) -> int:
        return int(self.q.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return self.hint().nbytes

    def bytes_per_token(self) -> float:
        return self.hint().bytes_per_token()

    def select(self, index) -> RawCapture:
        if isinstance(index, torch.Tensor):
            index = index.to(self.q.codes.device)
        return RawCapture(type(self.q)(**{f.name: take_rows(getattr(self.q, f.name), index)
                                          for f in dataclasses.fields(self.q)}), self.mode)

    def cat(self, others: list[RawCapture]) -> RawCapture:
        """Concatenated along rows, on the host (records go to the store from there)."""
        parts = [self.q, *(o.q for o in others)]
        fields = dataclasses.fields(self.q)
        return RawCapture(type(self.q)(**{f.name: torch.cat([getattr(p, f.name) for p in parts]).cpu()
                                          for f in fields}), self.mode)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return self.hint().to_tensors(prefix)

    def decode(self, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
        return self.hint().decode(x)

    def kept_elements(self) -> None:
        return None


def trajectory_tensors(record: SiteRecord, prefix: str, counts: list[int]) -> list[dict[str, torch.Tensor]]:
    """The store's tensors of each trajectory of ``record``, whose rows hold ``counts`` rows of each
    trajectory in turn. A :class:`RawCapture` is encoded once and its Hint's tensors, every one per
    row, are cut into views (encoding it per trajectory cost a rollout's assembly more than all the
    rest); any other record is cut first (a compact record's streams and syndromes are per trajectory)."""
    if isinstance(record, RawCapture):
        pieces = {key: t.split(counts) for key, t in record.to_tensors(prefix).items()}
        return [{key: p[b] for key, p in pieces.items()} for b in range(len(counts))]
    out, start = [], 0
    for c in counts:
        out.append(record.select(slice(start, start + c)).to_tensors(prefix))
        start += c
    return out


@dataclasses.dataclass
class ForwardRecord:
    """What one forward recorded; keys are ``record_prefix(layer, site)`` (sites) or layers (routing)."""

    guidance: dict[str, SiteRecord] = dataclasses.field(default_factory=dict)
    diagnostics: dict[str, RawCapture] = dataclasses.field(default_factory=dict)
    routing: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RolloutCapture(ForwardPath):
    """What a rollout records; see the module docstring.

    mode: the guidance mode (``None``: routing only, no guidance at any layer).
    guided_layers: where ``mode`` records (empty when ``mode`` is None).
    diagnostic_layers: where full codes are kept for metrics.
    """

    mode: HintMode | GuidanceSpec | None = None
    guided_layers: frozenset[int] = frozenset()
    diagnostic_layers: frozenset[int] = frozenset()
    _current: ForwardRecord = dataclasses.field(default_factory=ForwardRecord, init=False, repr=False)
    #: checks the device keeps during the rollout (see :mod:`tracefp4.engines.device_sites`), read once
    #: when the records are assembled
    checks: StepChecks = dataclasses.field(default_factory=StepChecks, init=False, repr=False, compare=False)
    rollout = True  # a class attribute (no annotation): the path's kind, not a field

    def __post_init__(self) -> None:
        self.guided_layers = frozenset(int(i) for i in self.guided_layers)
        self.diagnostic_layers = frozenset(int(i) for i in self.diagnostic_layers)
        if self.mode is None and self.guided_layers:
            raise ValueError("guided layers without a guidance mode")

    @classmethod
    def of(cls, guidance: GuidedMode | None, diagnostics: frozenset[int], n_layers: int) -> RolloutCapture:
        """The capture of a rollout on a model with ``n_layers`` decoder layers."""
        bad = sorted(i for i in diagnostics if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"diagnostic layers {bad} outside [0, {n_layers})")
        if guidance is None:
            return cls(None, frozenset(), frozenset(diagnostics))
        return cls(guidance.mode, guidance.layer_indices(n_layers), frozenset(diagnostics))

    def record_site(self, layer: int, name: str, x: torch.Tensor, q: NVFP4 | MXFP4) -> None:
        """A guidable site of ``layer`` quantized ``x`` (this forward's input) to ``q``: a compact mode
        encodes this forward's input, ``full``/``lsb`` keep the raw codes."""
        if layer in self.guided_layers:
            self._current.guidance[name] = CompactRecord.encode(x.detach(), q, self.mode) \
                if isinstance(self.mode, GuidanceSpec) else RawCapture(q, self.mode)
        if layer in self.diagnostic_layers:
            self._current.diagnostics[name] = RawCapture(q, HintMode.FULL)

    def record_routing(self, layer: int, indices: torch.Tensor) -> None:
        self._current.routing[layer] = indices.detach()

    # --- the path's hooks ---------------------------------------------------------------------

    def site(self, layer: int, name: str, x: torch.Tensor, quantizer: Quantizer
             ) -> tuple[NVFP4 | MXFP4, torch.Tensor]:
        # one pass on the CPU (codes and values); on the device without reading the NaN check back
        q, values = site_values(quantizer, x.detach(), self.checks, name)
        self.record_site(layer, name, x, q)
        return q, values

    def route(self, layer: int, weights: torch.Tensor, indices: torch.Tensor, logits: torch.Tensor | None = None,
              renormalises: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.record_routing(layer, indices)
        return weights, indices

    def expert_weights(self, cache: PreparedCache, owner: Hashable, name: str, w: WeightSource,
                       quantizer: Quantizer | None, gemm: ExpertGEMM) -> PreparedWeight:
        """Kept in ``cache`` across forwards, keyed on the weight's storage and version counter (an
        optimizer step or a weight load bumps it); BF16 weights are used as they are."""
        if quantizer is None:
            return super().expert_weights(cache, owner, name, w, quantizer, gemm)
        return cache.get(owner, name, w, quantizer, gemm)

    def take(self) -> ForwardRecord:
        """Hand over what the last forward recorded and start empty (one call per forward)."""
        out, self._current = self._current, ForwardRecord()
        return out
