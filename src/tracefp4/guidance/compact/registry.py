"""The codec of every knob value, by field: the one place a knob's name is looked up."""

from __future__ import annotations

import re

from tracefp4.guidance.compact.amax import Bf16Amax, Fp32Amax, LdpcAmax, LowBitsAmax, OwnAmax
from tracefp4.guidance.compact.codec import Codec
from tracefp4.guidance.compact.elements import FullElements, LdpcElements, LsbElements, Mod4Elements, SparseElements
from tracefp4.guidance.compact.scales import FullScales, LdpcScales, OwnScales, ParityScales

__all__ = ["CODECS", "codec_class", "make_codec", "parse_rate", "takes_rate"]

#: field -> knob -> codec class, in the order the record packs the fields (amax, scales, elements).
CODECS: dict[str, dict[str, type[Codec]]] = {
    "amax": {c.knob: c for c in (Fp32Amax, Bf16Amax, OwnAmax, LdpcAmax, LowBitsAmax)},
    "scales": {c.knob: c for c in (FullScales, ParityScales, LdpcScales, OwnScales)},
    "elements": {c.knob: c for c in (FullElements, LsbElements, Mod4Elements, SparseElements, LdpcElements)},
}
#: ``lo<b>`` carries its argument in the knob's own spelling.
_LOW_BITS = re.compile(r"lo([0-9]+)")
_RATE_ARG = {LdpcAmax, LdpcScales, LdpcElements}


def codec_class(field: str, knob: str) -> type[Codec]:
    """The codec class of ``knob`` (``lo<b>`` is the ``lo`` amax codec); a ValueError naming an unknown one."""
    table = CODECS.get(field)
    if table is None:
        raise ValueError(f"no compact field {field!r} (one of {tuple(CODECS)})")
    m = _LOW_BITS.fullmatch(knob) if LowBitsAmax in table.values() else None
    cls = table.get("lo" if m else knob)
    if cls is None:
        raise ValueError(f"{field} knob {knob!r} is unknown (one of {tuple(table)}; the amax also lo1..lo8)")
    return cls


def make_codec(field: str, knob: str, arg: int | float | None = None) -> Codec:
    """The codec of one knob value: ``arg`` is an ldpc rate's d or a sparse delta (None for the others)."""
    cls = codec_class(field, knob)
    m = _LOW_BITS.fullmatch(knob)
    if cls is LowBitsAmax:
        if arg is not None:
            raise ValueError(f"amax:{knob} takes no argument, got {arg!r}")
        return cls(int(m.group(1)))
    return cls(arg)


def parse_rate(arg: str | None, name: str) -> int:
    """An ldpc rate written ``1/d`` (or ``d``) in mode ``name``."""
    m = re.fullmatch(r"\s*(?:1\s*/\s*)?(\d+)\s*", arg or "")
    if m is None:
        raise ValueError(f"guidance mode {name!r}: an ldpc rate is written 1/d, e.g. ldpc(1/16)")
    return int(m.group(1))


def takes_rate(cls: type[Codec]) -> bool:
    return cls in _RATE_ARG
