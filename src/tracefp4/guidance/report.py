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
