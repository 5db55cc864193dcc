"""The one interface every site record implements, and what a decode could not recover.

A site record is what the rollout keeps of one guided site over T token rows: a
:class:`~tracefp4.guidance.hints.Hint` (FP4 or FP8 ``full``/``lsb``), a
:class:`~tracefp4.guidance.compact.CompactRecord`, or the rollout's raw capture of a ``full``/``lsb``
site (:class:`~tracefp4.engines.capture.RawCapture`, encoded into a Hint when stored). Callers
(the rollout's assembly, the trainer, the reports) use only :class:`SiteRecord`, never the kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tracefp4.guidance.hints import Hint

__all__ = ["DecodeReport", "SiteRecord"]


@dataclasses.dataclass(frozen=True)
class DecodeReport:
    """What a decode could not recover (see :mod:`tracefp4.guidance.compact`, "Decode failures").

    blocks / failed_blocks: LDPC code blocks decoded, over every ldpc knob of the record, and those whose
    checks belief propagation could not satisfy. failed_elements / failed_scales / failed_amax: the
    elements, block scales and amax rows those failed blocks cover, which took the trainer's own values.
    Reports add up (``sum(reports, DecodeReport())``) over sites, layers and steps.
    """

    blocks: int = 0
    failed_blocks: int = 0
    failed_elements: int = 0
    failed_scales: int = 0
    failed_amax: int = 0

    def __add__(self, other: DecodeReport) -> DecodeReport:
        if not isinstance(other, DecodeReport):
            return NotImplemented
        return DecodeReport(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def ok(self) -> bool:
        return self.failed_blocks == 0


class SiteRecord(Protocol):
    """One guided site's record over T token rows (leading dim T of every tensor)."""

    @property
    def nbytes(self) -> int:
        """Bytes the record occupies in the store."""

    def bytes_per_token(self) -> float:
        """Store bytes per token of this record's kind at its site shape and format (the planner's
        formula, :func:`tracefp4.guidance.compact.site_bytes_per_token`; exact for all but ``sparse``,
        where it is this record's own bytes over its tokens)."""

    def select(self, index) -> SiteRecord:
        """The record of token rows ``index``."""

    def cat(self, others: Sequence[SiteRecord]) -> SiteRecord:
        """This record followed by ``others`` (records of the same site) along the token dim."""

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors for the store (one trajectory)."""

    def decode(self, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
        """The Hint this record means given the trainer's own value ``x`` of the site, and what could
        not be decoded (empty for a record that needs no decoding)."""

    def kept_elements(self) -> tuple[int, int] | None:
        """(elements recorded, elements covered) where only some are recorded (``sparse``), else None."""
