"""A compact record's spec: its three knobs, parsed, named and tagged here and nowhere else."""

from __future__ import annotations

import dataclasses
import functools
import re

from tracefp4.formats.constants import Format, HintMode
from tracefp4.guidance.compact.amax import AmaxCodec
from tracefp4.guidance.compact.elements import ElementCodec, SparseElements
from tracefp4.guidance.compact.registry import CODECS, codec_class, make_codec, parse_rate, takes_rate
from tracefp4.guidance.compact.scales import ParityScales, ScaleCodec

__all__ = ["GuidanceSpec", "parse_hint_mode", "mode_name", "elements_knob", "unsupported_knob"]


@dataclasses.dataclass(frozen=True)
class GuidanceSpec:
    """What a compact record keeps; see :mod:`tracefp4.guidance.compact` for each knob.

    ``elements``/``scales``/``amax`` are knob names (``amax`` also ``lo<b>``); ``delta`` the sparse
    threshold, ``rate``/``scale_rate``/``amax_rate`` the d of an ldpc knob's rate 1/d.
    """

    elements: str = "lsb"
    delta: float | None = None
    rate: int | None = None
    scales: str = "full"
    scale_rate: int | None = None
    amax: str = "fp32"
    amax_rate: int | None = None

    def __post_init__(self) -> None:
        self.codecs  # noqa: B018 (builds and so validates every knob)

    @functools.cached_property
    def codecs(self) -> tuple[AmaxCodec, ScaleCodec, ElementCodec]:
        """The codecs of the three fields, in the record's packing order (amax, scales, elements)."""
        elements = make_codec("elements", self.elements, self.delta if self.rate is None else self.rate)
        if self.delta is not None and self.rate is not None:
            raise ValueError("a spec has a sparse delta or an ldpc rate, not both")
        return make_codec("amax", self.amax, self.amax_rate), make_codec("scales", self.scales, self.scale_rate), \
            elements

    @property
    def amax_codec(self) -> AmaxCodec:
        return self.codecs[0]

    @property
    def scale_codec(self) -> ScaleCodec:
        return self.codecs[1]

    @property
    def element_codec(self) -> ElementCodec:
        return self.codecs[2]

    @property
    def plain_mode(self) -> HintMode | None:
        """The :class:`HintMode` this spec is, when it is one of the two existing Hint modes."""
        a, s, e = self.codecs
        return e.hint_mode if a.plain and s.plain else None

    @property
    def full_scales(self) -> bool:
        """Whether the block scales are recorded in full (the others are rebuilt from the trainer's own)."""
        return self.scale_codec.plain

    @property
    def uses_ldpc(self) -> bool:
        return any(c.ldpc for c in self.codecs)

    @property
    def name(self) -> str:
        a, s, e = self.codecs
        return e.name_part() + s.name_part() + a.name_part()

    def __str__(self) -> str:
        return self.name

    @property
    def tag(self) -> str:
        """The spec spelled for a tensor name (``[A-Za-z0-9_]``): ``<elements>__s<scales>__a<amax>``."""
        a, s, e = self.codecs
        return f"{e.tag_part()}__{s.tag_part()}__{a.tag_part()}"

    @classmethod
    def from_tag(cls, tag: str) -> GuidanceSpec:
        m = re.fullmatch(r"([a-z][a-z0-9]*?)(?:_(\d+p?\d*))?__s([a-z]+)(?:_(\d+))?__a([a-z0-9]+?)(?:_(\d+))?", tag)
        if m is None:
            raise ValueError(f"not a compact guidance tag: {tag!r}")
        e, e_arg, s, s_rate, a, a_rate = m.groups()
        delta = rate = None
        if e_arg is not None:
            if codec_class("elements", e) is SparseElements:
                delta = float(e_arg.replace("p", "."))
            else:
                rate = int(e_arg)
        as_int = lambda v: None if v is None else int(v)  # noqa: E731
        return cls(e, delta, rate, s, as_int(s_rate), a, as_int(a_rate))

    @classmethod
    def parse(cls, name: str) -> GuidanceSpec:
        """Parse a name (see :mod:`tracefp4.guidance.compact`); ``sparse+parity(0.02)`` means ``sparse(0.02)+parity``."""
        parts = [p.strip() for p in name.strip().split("+")]
        head = re.fullmatch(r"(\w+)(?:\((.*)\))?", parts[0])
        if head is None or head.group(1) not in CODECS["elements"]:
            raise ValueError(f"guidance mode {name!r}: unknown elements {parts[0]!r} (one of {tuple(CODECS['elements'])})")
        elements, arg = head.group(1), head.group(2)
        knobs: dict[str, tuple[str, int | None]] = {"scales": ("full", None), "amax": ("fp32", None)}
        for part in parts[1:]:
            m = re.fullmatch(r"([\w:]+)(?:\((.*)\))?", part)
            if m is None:
                raise ValueError(f"guidance mode {name!r}: cannot parse {part!r}")
            key, parg = m.group(1), m.group(2)
            # a bare knob is the one scales knob written without its field, ``parity``
            field, _, knob = key.partition(":") if ":" in key else ("scales", "", key)
            if ":" not in key and knob != ParityScales.knob:
                raise ValueError(f"guidance mode {name!r}: unknown part {part!r}")
            try:
                kind = codec_class(field, knob)
            except ValueError:
                raise ValueError(f"guidance mode {name!r}: unknown part {part!r}") from None
            if kind is ParityScales and parg is not None:  # the brief's spelling sparse+parity(delta)
                if arg is not None:
                    raise ValueError(f"guidance mode {name!r}: two argument lists")
                arg, parg = parg, None
            if not takes_rate(kind) and parg is not None:
                raise ValueError(f"guidance mode {name!r}: unknown part {part!r}")
            knobs[field] = (knob, parse_rate(parg, name) if takes_rate(kind) else None)
        return cls(elements, *_element_arg(elements, arg, name), *knobs["scales"], *knobs["amax"])


def _element_arg(elements: str, arg: str | None, name: str) -> tuple[float | None, int | None]:
    """(delta, rate) of the elements knob from its written argument."""
    kind = codec_class("elements", elements)
    if kind is SparseElements:
        if arg is None:
            raise ValueError(f"guidance mode {name!r}: sparse needs a delta, e.g. sparse(0.02)")
        return float(arg), None
    if takes_rate(kind):
        return None, parse_rate(arg, name)
    if arg is not None:
        raise ValueError(f"guidance mode {name!r}: {elements} takes no argument")
    return None, None


def parse_hint_mode(mode: HintMode | GuidanceSpec | str) -> HintMode | GuidanceSpec:
    """``full``/``lsb`` (and specs equal to them) as a :class:`HintMode`, anything else as a spec."""
    if isinstance(mode, HintMode):
        return mode
    spec = mode if isinstance(mode, GuidanceSpec) else GuidanceSpec.parse(str(mode))
    return spec.plain_mode or spec


def mode_name(mode: HintMode | GuidanceSpec) -> str:
    return mode.value if isinstance(mode, HintMode) else mode.name


def elements_knob(mode: HintMode | GuidanceSpec) -> str:
    """The elements knob of a mode (``full``/``lsb`` for a Hint mode): its family in the reports."""
    return mode.value if isinstance(mode, HintMode) else mode.element_codec.knob


def unsupported_knob(mode: HintMode | GuidanceSpec, fmt: Format, *, four_over_six: bool = False) -> str | None:
    """Why ``mode`` cannot guide a site quantized to ``fmt`` (with Four over Six block scales where
    ``four_over_six``), naming the knob at fault; None where it can. Callers with a precision plan use
    :func:`tracefp4.engines.plan.check_supported`, which says which plan field put ``fmt`` there.

    ``full`` and ``lsb`` guide every format: their record holds the rollout's grid whole. A compact knob
    instead has the trainer rebuild part of that grid from its own value, by NVFP4's standard recipe
    (E4M3 block scales near ``amax_b / 6`` on ``S_enc``, one global amax per row). So:

    * an FP8 E4M3 site has no E2M1 codes, block scales or NVFP4 amax for a compact knob to code; the
      one exception is ``mod4`` on its row scale recorded in full: its rule needs only adjacent codes
      on the signed line, which E4M3's are (its residues are of E4M3 positions -126..126);
    * MXFP4's block scales are E8M0 exponents, not E4M3 codes (``parity``, ``scales:ldpc`` and
      ``scales:own`` would decode a scale of the wrong format), and it has no global amax for an amax
      knob; compact elements on full scales decode on the recorded scale and are fine;
    * under Four over Six, a block that chose 4 has scale ``amax_b / 4``, 1.5x (several E4M3 steps)
      from the ``amax_b / 6`` the scale knobs rebuild around, and their one-step correction then
      silently picks a wrong scale: with the trainer's input equal to the rollout's, ``lsb+parity``
      got about 27% of the block scales and 10% of the codes wrong on random rows (``scales:own`` and
      ``scales:ldpc`` alike, every LDPC block failing). The amax knobs are unaffected (Four over Six
      keeps ``S_enc``), and so are compact elements (they decode on the recorded scales).
    """
    if isinstance(mode, HintMode):
        return None
    amax, scales, _ = mode.codecs
    if not fmt.fp4 and not (mode.element_codec.takes_fp8 and mode.full_scales and amax.plain):
        return (f"the compact modes are FP4's (their knobs code E2M1 bits, E4M3 block scales and NVFP4's amax): "
                f"{mode.name!r} cannot guide an {fmt.value} site, which takes 'full', 'lsb' or 'mod4'")
    if fmt is Format.MXFP4 and not mode.full_scales:
        return (f"{scales.name_part()!r} codes E4M3 block scales and MXFP4's are E8M0: MXFP4 sites take compact "
                "elements with the block scales recorded in full")
    if fmt is Format.MXFP4 and not amax.plain:
        return f"{amax.name_part()!r} codes NVFP4's global amax and an MXFP4 site has none"
    if four_over_six and not mode.full_scales:
        return (f"{scales.name_part()!r} rebuilds each block scale around the trainer's amax_b / 6, and a Four "
                "over Six block may have taken amax_b / 4: Four over Six needs the block scales recorded in full")
    return None
