"""The one interface every site record implements.

A site record is what the rollout keeps of one guided site over T token rows: a
:class:`~tracefp4.guidance.hints.Hint` (FP4 or FP8 ``full``/``lsb``), a
:class:`~tracefp4.guidance.compact.CompactRecord`, or the rollout's raw capture of a ``full``/``lsb``
site (:class:`~tracefp4.engines.capture.RawCapture`, encoded into a Hint when stored). Callers
(the rollout's assembly, the trainer, the reports) use only :class:`SiteRecord`, never the kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tracefp4.guidance.hints import Hint
from tracefp4.guidance.report import DecodeReport

__all__ = ["SiteRecord"]


class SiteRecord(Protocol):
    """One guided site's record over T token rows (leading dim T of every tensor)."""

    @property
    def rows(self) -> int:
        """T, the token rows the record covers."""

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
