"""What decoding a site record could not recover (the trainer sums these over sites, layers and steps)."""

from __future__ import annotations

import dataclasses

__all__ = ["DecodeReport"]


@dataclasses.dataclass(frozen=True)
class DecodeReport:
    """What a decode could not recover (see :mod:`tracefp4.guidance.compact`, "Decode failures").

    blocks / failed_blocks: LDPC code blocks decoded, over every ldpc knob of the record, and those whose
    checks belief propagation could not satisfy. failed_elements / failed_scales / failed_amax: the
    elements, block scales and amax rows those failed blocks cover, which took the trainer's own values.
    bracket_checked / bracket_misses: the elements of records that can tell whether the rollout's code
    lies in the trainer's bracket (``mod4``: every element it decodes), and those found outside it (a
    ``mod4`` residue naming neither bracket member: the rollout's code is 1 or 2 codewords away), which
    took the trainer's round-to-nearest code. ``bracket_misses / bracket_checked`` is the detected
    bracket-miss rate, what a ``mod4`` trainer knows without full codes: a lower bound on the registry's
    ``guidance_bracket_miss_rate`` (misses of 3 or more codewords can alias to a bracket member and are
    not in it; the registry's rate counts them, from full-code diagnostics:
    :func:`tracefp4.pipeline.metrics.bracket_miss`). Records that cannot tell (``full``, ``lsb``, the
    other compact elements) add nothing to either count, so the rate is never diluted by them.
    Reports add up (``sum(reports, DecodeReport())``) over sites, layers and steps.
    """

    blocks: int = 0
    failed_blocks: int = 0
    failed_elements: int = 0
    failed_scales: int = 0
    failed_amax: int = 0
    bracket_checked: int = 0
    bracket_misses: int = 0

    def __add__(self, other: DecodeReport) -> DecodeReport:
        if not isinstance(other, DecodeReport):
            return NotImplemented
        return DecodeReport(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def ok(self) -> bool:
        """Every LDPC block decoded (a detected bracket miss is a measurement, not a decode failure)."""
        return self.failed_blocks == 0

    @property
    def bracket_miss_rate(self) -> float | None:
        """``bracket_misses / bracket_checked``, None where no element was checked."""
        return self.bracket_misses / self.bracket_checked if self.bracket_checked else None
