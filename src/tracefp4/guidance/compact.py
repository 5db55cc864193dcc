"""Guidance smaller than the paper's compact cache: what the rollout keeps, and how the trainer reads it.

The paper's compact cache (``lsb``) keeps, per guided site, 1 bit per element plus the 8-bit E4M3
block scale of every 16 elements and a 4-byte FP32 global amax per row. Most of that is information
the trainer already has: it computes the same site from the same weights and differs from the rollout
only at BF16 level, so its own block scales, amax and round-to-nearest codes agree with the
rollout's almost everywhere. A :class:`CompactRecord` keeps only what the trainer cannot recompute,
and decodes, *given the trainer's own value x*, into an ordinary lsb :class:`~tracefp4.guidance.Hint`
(so the fast guided kernel is unchanged). Three independent knobs, named in a :class:`GuidanceSpec`:

**Global amax** (per row; it fixes ``S_enc`` and so the whole grid, and must be exact):
    ``fp32`` 4 bytes; ``bf16`` 2 bytes (exact: a row's amax is one of its BF16 elements);
    ``lo<b>`` the low b bits of its BF16 bit pattern: the trainer takes the BF16 value nearest its
    own amax with those low bits (exact while the two differ by less than 2^(b-1) BF16 ulps);
    ``amax:ldpc(1/d)`` a syndrome of the Gray-coded low 3 bits of that pattern (one BF16 ulp of
    drift flips exactly one Gray bit; see ``ldpc`` below), decoded like ``lo3``;
    ``own`` nothing, the trainer's own amax.

**Block scales** (8-bit E4M3 codes; adjacent codes alternate in their low bit):
    ``full`` 8 bits; ``parity`` the low bit: the trainer rounds its own unrounded scale (on the
    rollout's ``S_enc``) and, if the low bit disagrees, takes the neighbour on the side its unrounded
    scale leans to (exact for any one-step disagreement); ``scales:ldpc(1/d)`` a syndrome of those low
    bits (see below); ``own`` nothing.

**Elements** (on the rollout's grid, reconstructed from the two knobs above):
    ``full`` the 4-bit code; ``lsb`` its low bit; ``sparse(delta)`` the low bit only where the
    rollout's ``z`` sat within ``delta`` of a rounding midpoint (``|z - m| < delta``, z in grid
    units), as a Rice-coded list of position gaps; elsewhere the trainer rounds to nearest;
    ``ldpc(1/d)`` a syndrome (Slepian-Wolf coding): one check bit per d elements, each the XOR of
    the rollout's low bits over a fixed pseudo-random set of about 3d elements. The trainer computes
    the same checks over its own round-to-nearest low bits; where they differ, belief propagation
    finds the most likely set of flipped elements, using how close each of its own values sits to a
    rounding midpoint (only near-ties flip). No positions are stored at all.

Names (``GuidanceSpec.name``): ``<elements>[+parity|+scales:ldpc(1/d)|+scales:own][+amax:<knob>]``,
e.g. ``lsb+parity+amax:lo3``, ``sparse(0.02)+parity+amax:lo3``, ``ldpc(1/16)+scales:ldpc(1/4)+amax:lo3``
(``sparse+parity(0.02)`` is accepted too). Plain ``full`` and ``lsb`` (full scales, fp32 amax) are the
existing :class:`~tracefp4.guidance.Hint` modes.

Record layout (the store's ``L{layer:02d}.{site}.{field}``, every tensor with leading dim T):
    ``.scales`` float8_e4m3fn ``[T, *lead, K/16]`` (scales ``full``; MXFP4: uint8 E8M0);
    ``.global_amax`` float32 or bfloat16 ``[T, *lead, 1]`` (amax ``fp32``/``bf16``);
    ``.packed__<tag>__g<shape>`` uint8 ``[T, ceil(bits/8)]``: per token, the sub-byte fields bit-packed
    (bit i of the token's string is bit i%8 of byte i//8) in this order: amax bits (b per row for
    ``lo<b>``, ``ceil(3 rows/d)`` checks for ``amax:ldpc``), scale bits (1 per block for ``parity``,
    ``ceil(blocks/d)`` checks for ``scales:ldpc``), element bits (4 per element for ``full``, 1 for
    ``lsb``, ``ceil(elements/d)`` checks for ``ldpc``);
    ``.stream__<tag>__g<shape>`` uint8 ``[T, W]`` (``sparse`` only): one stream per trajectory and
    site: LEB128 entry count, one byte Rice parameter k, then per recorded element (in flattened
    token-major order) the gap to the previous one Rice-coded (unary quotient, k remainder bits) and
    its low bit; zero-padded to a multiple of T bytes and laid out as ``[T, W]``.
    ``<tag>`` spells the spec and ``g<shape>`` the per-token site shape (e.g. ``g2x32``), so a record
    names everything needed to decode it. Exact bytes per token and site are therefore
    ``byte fields + ceil(packed bits / 8)`` plus, for ``sparse``, the stream's ``T * W`` bytes over T.

Decode failures (decisions): a record that cannot be decoded is never silent. Only the ``ldpc`` knobs
can fail (every other field is read exactly); :meth:`CompactRecord.decode` returns the hint and a
:class:`DecodeReport`, and :func:`decode_record` does the same for either kind of record (a plain
:class:`~tracefp4.guidance.Hint` with an empty report), so the trainer sums the reports of its sites
(``failed_blocks`` into its decode-failure count). A code block whose checks belief propagation leaves
unsatisfied after ``LDPC_ITERATIONS`` iterations is *failed*, and every value it covers takes what the
trainer computes on its own, on the grid decoded so far; no half-converged iterate is ever used (it
is not a codeword, and it can be further from the rollout's choice than the trainer's own value):
    * ``amax:ldpc``: the rows of a failed block take the trainer's own global amax (its FP32 row
      maximum, exactly as ``amax:own``), and so its ``S_enc``; the scales of those rows are then
      decoded on that ``S_enc``.
    * ``scales:ldpc``: the block scales of a failed block take the trainer's own E4M3 code (its
      unrounded scale rounded to nearest on the decoded ``S_enc``, exactly as ``scales:own``).
    * ``ldpc`` elements: the elements of a failed block take the trainer's round-to-nearest low bit on
      the decoded grid, so the guided quantizer gives them the trainer's round-to-nearest codes there
      (the rollout's grid wherever amax and scales decoded).
The knobs are decoded in that order (amax, scales, elements), each on the result of the one before,
and each counts its own failed blocks (``failed_amax`` rows, ``failed_scales`` blocks,
``failed_elements``). A block whose checks are all satisfied is accepted: a wrong flip pattern that
happens to satisfy every check cannot be told from the right one, so it is not counted. The decoder
keeps no state between calls: the counts live only in the reports.

Trajectory scope: ``ldpc`` checks and ``sparse`` streams are computed over a whole trajectory (code
blocks of consecutive tokens, so that a tiny model's few elements per token still make long codes);
read them with :meth:`StoreReader.get` without ``positions``. A record read back knows its
trajectory lengths (``segments``) and decodes batches of concatenated trajectories.

This module holds the specs (:class:`GuidanceSpec`, parsing and names), the records
(:class:`CompactRecord`: encode on the rollout side, store layout, decode on the trainer side, with
the drift priors ``ELEMENT_PRIOR``/``SCALE_PRIOR``/``AMAX_PRIOR``, and its :class:`DecodeReport`), the
record-level helpers (:func:`encode_record`, :func:`read_record`, :func:`decode_record`,
:func:`record_cat`), the byte formulas (:func:`site_bytes_per_token`) and the named configurations
(:class:`GuidedMode`, :data:`STANDARD_MODES`). How the bits themselves are coded (bit packing, Gray codes, the LDPC
parity-check graph, syndromes and belief-propagation decoder, Rice/LEB128 position streams) is
:mod:`tracefp4.guidance.coding`; ``rice_bits_per_entry`` and the ``LDPC_*`` constants are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracefp4.formats import reference as ref
from tracefp4.guidance.coding import (
    LDPC_BLOCK,
    LDPC_COLUMN_WEIGHT,
    LDPC_ITERATIONS,
    LDPC_SEED,
    bits_int,
    bp_flips,
    gray_bits,
    gray_decode,
    int_bits,
    ldpc_checks,
    ldpc_layout,
    ldpc_syndrome,
    pack_bits,
    prior_llr,
    rice_bits_per_entry,
    stream_decode,
    stream_encode,
    unpack_bits,
)
from tracefp4.formats.constants import E2M1_MAX, E2M1_MIDPOINTS, E4M3_MAX, NVFP4_BLOCK, Format, HintMode
from tracefp4.guidance.hints import Hint, encode_hint, hint_cat
from tracefp4.guidance.names import deeper_half, last_layers
from tracefp4.formats.numerics import MXFP4, NVFP4, mx_scale_values, pack_fp4, unpack_fp4

__all__ = [
    "GuidanceSpec",
    "CompactRecord",
    "parse_hint_mode",
    "mode_name",
    "encode_record",
    "read_record",
    "record_cat",
    "site_bytes_per_token",
    "rice_bits_per_entry",
    "DecodeReport",
    "decode_record",
    "LDPC_SEED",
    "LDPC_COLUMN_WEIGHT",
    "LDPC_BLOCK",
    "LDPC_ITERATIONS",
    "GuidedMode",
    "LAYER_SETS",
    "STANDARD_MODES",
]

_ELEMENTS = ("full", "lsb", "sparse", "ldpc")
_SCALES = ("full", "parity", "ldpc", "own")
_AMAX_RE = re.compile(r"fp32|bf16|own|ldpc|lo([1-8])")
#: Gray-coded low bits of the BF16 amax pattern that ``amax:ldpc`` protects (resolves |drift| <= 3 ulps).
AMAX_LDPC_BITS = 3

#: Prior probability that an element's low bit differs from the trainer's round-to-nearest one:
#: ``p0 * exp(-r / sigma)``, r = distance of the trainer's z to the nearest midpoint (grid units).
#: Fitted on the tiny model's drift with every layer guided: p ~ 0.08-0.1 at r ~ 0, ~1e-3 at r = 0.04.
ELEMENT_PRIOR = (0.1, 0.01)
#: The same for a block scale code, r = distance of the unrounded scale to E4M3's rounding
#: midpoint in code steps.
SCALE_PRIOR = (0.1, 0.05)
#: Prior flip probability of a Gray bit of the amax residue: (a bit one ulp of drift would flip, any
#: other bit). One row in 20 differs by one ulp on the tiny model with every layer guided.
AMAX_PRIOR = (0.03, 0.002)


# --- the spec ------------------------------------------------------------------------------------


def _fmt_float(v: float) -> str:
    return np.format_float_positional(v, trim="-")


@dataclasses.dataclass(frozen=True)
class GuidanceSpec:
    """What a compact record keeps; see the module docstring for each knob."""

    elements: str = "lsb"
    delta: float | None = None
    rate: int | None = None
    scales: str = "full"
    scale_rate: int | None = None
    amax: str = "fp32"
    amax_rate: int | None = None

    def __post_init__(self) -> None:
        if self.elements not in _ELEMENTS:
            raise ValueError(f"elements must be one of {_ELEMENTS}, got {self.elements!r}")
        if self.scales not in _SCALES:
            raise ValueError(f"scales must be one of {_SCALES}, got {self.scales!r}")
        if _AMAX_RE.fullmatch(self.amax) is None:
            raise ValueError(f"amax must be fp32, bf16, own, ldpc or lo1..lo8, got {self.amax!r}")
        if (self.elements == "sparse") != (self.delta is not None):
            raise ValueError("sparse elements need a delta (and only they)")
        if self.delta is not None and not (math.isfinite(self.delta) and 0 < self.delta <= E2M1_MAX):
            raise ValueError(f"sparse delta must be in (0, 6], got {self.delta}")
        if (self.elements == "ldpc") != (self.rate is not None):
            raise ValueError("ldpc elements need a rate 1/d (and only they)")
        if (self.scales == "ldpc") != (self.scale_rate is not None):
            raise ValueError("ldpc scales need a rate 1/d (and only they)")
        if (self.amax == "ldpc") != (self.amax_rate is not None):
            raise ValueError("an ldpc amax needs a rate 1/d (and only it)")
        for r in (self.rate, self.scale_rate, self.amax_rate):
            if r is not None and not (isinstance(r, int) and 1 <= r <= 4096):
                raise ValueError(f"an ldpc rate is 1/d with an integer d in [1, 4096], got d={r!r}")

    @property
    def amax_bits(self) -> int:
        """Bits per row of an ``lo<b>`` amax (0 otherwise)."""
        m = _AMAX_RE.fullmatch(self.amax)
        return int(m.group(1)) if m and m.group(1) else 0

    @property
    def plain_mode(self) -> HintMode | None:
        """The :class:`HintMode` this spec is, when it is one of the two existing Hint modes."""
        if self.elements in ("full", "lsb") and self.scales == "full" and self.amax == "fp32":
            return HintMode(self.elements)
        return None

    @property
    def uses_ldpc(self) -> bool:
        return "ldpc" in (self.elements, self.scales, self.amax)

    @property
    def name(self) -> str:
        e = {
            "sparse": f"sparse({_fmt_float(self.delta or 0.0)})",
            "ldpc": f"ldpc(1/{self.rate})",
        }.get(self.elements, self.elements)
        s = {"parity": "+parity", "ldpc": f"+scales:ldpc(1/{self.scale_rate})", "own": "+scales:own"}.get(
            self.scales, ""
        )
        a = {"fp32": "", "ldpc": f"+amax:ldpc(1/{self.amax_rate})"}.get(self.amax, f"+amax:{self.amax}")
        return e + s + a

    def __str__(self) -> str:
        return self.name

    @property
    def tag(self) -> str:
        """The spec spelled for a tensor name (``[A-Za-z0-9_]``): ``<elements>__s<scales>__a<amax>``."""
        e = {
            "sparse": f"sparse_{_fmt_float(self.delta or 0.0).replace('.', 'p')}",
            "ldpc": f"ldpc_{self.rate}",
        }.get(self.elements, self.elements)
        s = f"sldpc_{self.scale_rate}" if self.scales == "ldpc" else f"s{self.scales}"
        a = f"aldpc_{self.amax_rate}" if self.amax == "ldpc" else f"a{self.amax}"
        return f"{e}__{s}__{a}"

    @classmethod
    def from_tag(cls, tag: str) -> GuidanceSpec:
        elements = r"(full|lsb|sparse_(\d+p?\d*)|ldpc_(\d+))"
        m = re.fullmatch(elements + r"__s(full|parity|own|ldpc_(\d+))__a(fp32|bf16|own|lo\d|ldpc_(\d+))", tag)
        if m is None:
            raise ValueError(f"not a compact guidance tag: {tag!r}")
        elements = m.group(1).split("_")[0]
        delta = float(m.group(2).replace("p", ".")) if m.group(2) else None
        rate = int(m.group(3)) if m.group(3) else None
        scales = m.group(4).split("_")[0]
        scale_rate = int(m.group(5)) if m.group(5) else None
        amax_rate = int(m.group(7)) if m.group(7) else None
        return cls(elements, delta, rate, scales, scale_rate, m.group(6).split("_")[0], amax_rate)

    @classmethod
    def parse(cls, name: str) -> GuidanceSpec:
        """Parse a name (see the module docstring); ``sparse+parity(0.02)`` means ``sparse(0.02)+parity``."""
        parts = [p.strip() for p in name.strip().split("+")]
        head = re.fullmatch(r"(\w+)(?:\((.*)\))?", parts[0])
        if head is None or head.group(1) not in _ELEMENTS:
            raise ValueError(f"guidance mode {name!r}: unknown elements {parts[0]!r} (one of {_ELEMENTS})")
        elements, arg = head.group(1), head.group(2)
        scales, scale_rate, amax, amax_rate = "full", None, "fp32", None
        for part in parts[1:]:
            m = re.fullmatch(r"([\w:]+)(?:\((.*)\))?", part)
            if m is None:
                raise ValueError(f"guidance mode {name!r}: cannot parse {part!r}")
            key, parg = m.group(1), m.group(2)
            if key == "parity":
                scales = "parity"
                if parg is not None:
                    if arg is not None:
                        raise ValueError(f"guidance mode {name!r}: two argument lists")
                    arg = parg  # the brief's spelling sparse+parity(delta)
            elif key in ("scales:full", "scales:own"):
                scales = key.split(":")[1]
            elif key == "scales:ldpc":
                scales, scale_rate = "ldpc", _rate(parg, name)
            elif key == "amax:ldpc":
                amax, amax_rate = "ldpc", _rate(parg, name)
            elif key.startswith("amax:") and parg is None:
                amax = key.split(":", 1)[1]
            else:
                raise ValueError(f"guidance mode {name!r}: unknown part {part!r}")
        delta = rate = None
        if elements == "sparse":
            if arg is None:
                raise ValueError(f"guidance mode {name!r}: sparse needs a delta, e.g. sparse(0.02)")
            delta = float(arg)
        elif elements == "ldpc":
            rate = _rate(arg, name)
        elif arg is not None:
            raise ValueError(f"guidance mode {name!r}: {elements} takes no argument")
        return cls(elements, delta, rate, scales, scale_rate, amax, amax_rate)


def _rate(arg: str | None, name: str) -> int:
    m = re.fullmatch(r"\s*(?:1\s*/\s*)?(\d+)\s*", arg or "")
    if m is None:
        raise ValueError(f"guidance mode {name!r}: an ldpc rate is written 1/d, e.g. ldpc(1/16)")
    return int(m.group(1))


def parse_hint_mode(mode: HintMode | GuidanceSpec | str) -> HintMode | GuidanceSpec:
    """``full``/``lsb`` (and specs equal to them) as a :class:`HintMode`, anything else as a spec."""
    if isinstance(mode, HintMode):
        return mode
    spec = mode if isinstance(mode, GuidanceSpec) else GuidanceSpec.parse(str(mode))
    return spec.plain_mode or spec


def mode_name(mode: HintMode | GuidanceSpec) -> str:
    return mode.value if isinstance(mode, HintMode) else mode.name


# --- the rollout's grid --------------------------------------------------------------------------

_MIDS = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32)
# Midpoints whose tie goes up (to the even code above): 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0.
_TIES_UP = _MIDS[1::2].clone()


def grid_z(x: torch.Tensor, fmt: Format, scales: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    """float32 ``clamp(x * enc, +-6)`` on the grid ``(scales, amax)``, exactly as the kernels compute it."""
    block = fmt.block
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, block)
    if fmt is Format.NVFP4:
        enc = ref.nvfp4_encode_factor(scales, ref.nvfp4_global_encode_scale(amax))
    else:
        enc = torch.tensor(1.0) / mx_scale_values(scales)
    return torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).reshape(x.shape)


def rtn_codes(z: torch.Tensor) -> torch.Tensor:
    """Unpacked round-to-nearest codes of float32 ``z`` (clamped); ties to the even code, sign = signbit."""
    a = z.abs()
    mag = torch.bucketize(a, _MIDS, right=False) + torch.isin(a, _TIES_UP).to(torch.int64)
    return (mag + torch.signbit(z).to(torch.int64) * 8).to(torch.uint8)


def midpoint_distance(z: torch.Tensor) -> torch.Tensor:
    """``|(|z|) - m|`` for the nearest rounding midpoint m (grid units): how near z is to a tie."""
    a = z.abs()
    i = torch.bucketize(a, _MIDS).clamp(max=len(E2M1_MIDPOINTS) - 1)
    below = _MIDS[(i - 1).clamp(min=0)]
    return torch.minimum((a - _MIDS[i]).abs(), (a - below).abs())


# --- E4M3 scale codes and BF16 amax patterns -----------------------------------------------------

#: The largest finite E4M3 code (0x7E = 448; 0x7F is NaN in float8_e4m3fn): a scale never rounds up past
#: it. Derived from ``E4M3_MAX`` because :mod:`tracefp4.formats.constants` names values, not codes.
_E4M3_MAX_CODE = int(torch.tensor(E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))


def _e4m3_value(code: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _unrounded_block_scale(x: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """``clamp(amax_b * (S_enc * (1/6)), 448)`` before the E4M3 cast (the reference's operation order)."""
    block_amax = x.to(torch.float32).abs().reshape(*x.shape[:-1], -1, NVFP4_BLOCK).amax(dim=-1)
    one_sixth = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E2M1_MAX, dtype=torch.float32)
    return torch.clamp(block_amax * (s_enc * one_sixth), max=E4M3_MAX)


def _scale_candidates(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For unrounded scales u: (own code, the neighbour u leans to, distance to the rounding midpoint
    in code steps). A u exactly on a code leans down (up from code 0)."""
    own = u.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    value = _e4m3_value(own)
    up = ((u > value) | (own == 0)) & (own < _E4M3_MAX_CODE)
    other = torch.where(up, own + 1, own - 1)
    step = (_e4m3_value(other) - value).abs()
    frac = torch.where(step > 0, (u - value).abs() / step, torch.zeros_like(u))
    return own, other, (0.5 - frac).clamp(min=0.0)


def _bf16_pattern(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.bfloat16).view(torch.int16).to(torch.int64)


def _nearest_with_residue(mine: torch.Tensor, residue: torch.Tensor, m: int) -> torch.Tensor:
    """The float32 value of the BF16 pattern nearest ``mine`` that is ``residue`` mod ``m``."""
    low = mine - ((mine - residue) % m)
    high = low + m
    pattern = torch.where(((high - mine) < (mine - low)) | (low < 0), high, low)
    return pattern.to(torch.int16).view(torch.bfloat16).to(torch.float32)


def _check_bf16_exact(amax: torch.Tensor, knob: str) -> None:
    if not torch.equal(amax.to(torch.bfloat16).to(torch.float32), amax.to(torch.float32)):
        raise ValueError(
            f"amax:{knob} keeps the global amax as BF16, but this site's amax is not a BF16 value "
            "(non-BF16 activations?); use amax:fp32"
        )


# --- the record ----------------------------------------------------------------------------------


def _geometry(shape: Sequence[int]) -> str:
    return "g" + "x".join(str(int(d)) for d in shape)


def _parse_geometry(g: str) -> tuple[int, ...]:
    if re.fullmatch(r"g\d+(x\d+)*", g) is None:
        raise ValueError(f"not a site geometry: {g!r}")
    return tuple(int(d) for d in g[1:].split("x"))


@dataclasses.dataclass
class CompactRecord:
    """One site's compact guidance over T token rows (see the module docstring).

    site_shape: per-token shape ``(*lead, K)`` of the site tensor (the record covers ``[T, *site_shape]``).
    amax: float32/bfloat16 values or uint8 ``lo<b>`` residues ``[T, *lead, 1]``; None for ``own`` and MXFP4.
    scales: e4m3 (or E8M0 uint8) ``[T, *lead, K/block]`` for ``full``; the low bits of the E4M3
        codes (uint8 0/1, same shape) for ``parity`` and, before compression, ``ldpc``; the check bits
        ``[T, checks]`` of a compressed ``ldpc``; None for ``own``.
    elements: unpacked codes (``full``) or low bits (``lsb``, ``ldpc`` before compression) ``[T, *lead, K]``;
        int8 ``sparse`` plane (-1 where nothing is recorded, else the low bit); check bits
        ``[T, checks]`` of a compressed ``ldpc``.
    segments: trajectory lengths, set when read from tensors (``ldpc`` checks and ``sparse`` streams
        are per trajectory). None for a record fresh from the rollout (uncompressed, any rows).
    """

    spec: GuidanceSpec
    fmt: Format
    site_shape: tuple[int, ...]
    amax: torch.Tensor | None
    scales: torch.Tensor | None
    elements: torch.Tensor
    segments: tuple[int, ...] | None = None

    # -- sizes --

    @property
    def rows(self) -> int:
        return int(self.elements.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, *self.site_shape))

    @property
    def _per_token(self) -> tuple[int, int, int]:
        """(rows of the site per token, blocks per token, elements per token)."""
        lead = int(np.prod(self.site_shape[:-1], dtype=np.int64))
        k = self.site_shape[-1]
        return lead, lead * (k // self.fmt.block), lead * k

    @property
    def compressed(self) -> bool:
        return self.segments is not None and self.spec.uses_ldpc

    @property
    def nbytes(self) -> int:
        """Bytes this record occupies in the store (the sum over its trajectories)."""
        return sum(t.nbytes for seg in self._split() for t in seg.to_tensors("L00.k").values())

    # -- rollout side --

    @classmethod
    def encode(cls, x: torch.Tensor, q: NVFP4 | MXFP4, spec: GuidanceSpec) -> CompactRecord:
        """What the rollout keeps of site value ``x`` (``[T, *lead, K]``), quantized as ``q``."""
        if tuple(x.shape) != tuple(q.shape) or x.dim() < 2:
            raise ValueError(f"compact encode: x {tuple(x.shape)} vs quantized {tuple(q.shape)} (need [T, ..., K])")
        fmt = Format(q.fmt)
        if not fmt.fp4:
            raise ValueError(f"{spec.name}: the compact modes are FP4's (their knobs code E2M1 bits, E4M3 block scales "
                             f"and NVFP4's amax); an {fmt.value} site takes full or lsb guidance")
        if fmt is Format.MXFP4 and (spec.scales != "full" or spec.amax != "fp32"):
            raise ValueError(f"{spec.name}: MXFP4 sites support compact elements with full scales only")
        codes = unpack_fp4(q.codes)
        if spec.elements == "full":
            elements = codes
        elif spec.elements == "sparse":
            near = midpoint_distance(grid_z(x, fmt, q.scales, getattr(q, "global_amax", None))) < spec.delta
            elements = torch.where(near, (codes & 1).to(torch.int8), torch.full_like(codes, -1, dtype=torch.int8))
        else:
            elements = codes & 1
        scales: torch.Tensor | None = None
        if spec.scales == "full":
            scales = q.scales.clone()
        elif spec.scales in ("parity", "ldpc"):
            scales = q.scales.view(torch.uint8) & 1
        amax: torch.Tensor | None = None
        if fmt is Format.NVFP4:
            a = q.global_amax.to(torch.float32).expand(*q.shape[:-1], 1).clone()
            if spec.amax == "fp32":
                amax = a
            elif spec.amax == "bf16":
                _check_bf16_exact(a, spec.amax)
                amax = a.to(torch.bfloat16)
            elif spec.amax_bits or spec.amax == "ldpc":
                _check_bf16_exact(a, spec.amax)
                amax = (_bf16_pattern(a) & ((1 << _residue_bits(spec)) - 1)).to(torch.uint8)
        return cls(spec, fmt, tuple(int(d) for d in x.shape[1:]), amax, scales, elements)

    def select(self, index) -> CompactRecord:
        """Rows ``index`` (token positions) of an uncompressed record."""
        if self.segments is not None:
            raise ValueError("select() needs a record fresh from the rollout; records read back are per trajectory")
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return dataclasses.replace(self, amax=pick(self.amax), scales=pick(self.scales), elements=self.elements[index])

    # -- storage --

    def _packed_bits(self, checks: dict[str, np.ndarray]) -> np.ndarray:
        """Per token, the sub-byte fields as one bit string ``[T, nbits]`` (``checks``: ldpc fields)."""
        t = self.rows
        parts = []
        if self.spec.amax_bits:
            parts.append(int_bits(self.amax.reshape(t, -1).numpy(), self.spec.amax_bits))
        elif self.spec.amax == "ldpc":
            parts.append(checks["amax"])
        if self.spec.scales == "parity":
            parts.append(self.scales.reshape(t, -1).numpy().astype(np.uint8))
        elif self.spec.scales == "ldpc":
            parts.append(checks["scales"])
        if self.spec.elements == "full":
            parts.append(int_bits(self.elements.reshape(t, -1).numpy(), 4))
        elif self.spec.elements == "lsb":
            parts.append(self.elements.reshape(t, -1).numpy().astype(np.uint8))
        elif self.spec.elements == "ldpc":
            parts.append(checks["elements"])
        return np.concatenate(parts, axis=1) if parts else np.zeros((t, 0), dtype=np.uint8)

    def _split_packed(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """Inverse of :meth:`_packed_bits` on one token bit string per row."""
        rows, blocks, elems = self._per_token
        widths = {
            "amax": _amax_bits(self.spec, rows),
            "scales": _scale_bits(self.spec, blocks),
            "elements": _element_bits(self.spec, elems),
        }
        out, i = {}, 0
        for k, w in widths.items():
            out[k] = packed[:, i : i + w]
            i += w
        return out

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors for the store, treating the record as one trajectory (compressing ``ldpc``)."""
        if self.segments is not None and len(self.segments) != 1:
            raise ValueError(f"{prefix}: a record of {len(self.segments)} trajectories is written one at a time")
        t = self.rows
        lead, blocks, elems = self._per_token
        suffix = f"{self.spec.tag}__{_geometry(self.site_shape)}"
        out: dict[str, torch.Tensor] = {}
        if self.spec.scales == "full":
            out[f"{prefix}.scales"] = self.scales
        if self.spec.amax in ("fp32", "bf16") and self.amax is not None:
            out[f"{prefix}.global_amax"] = self.amax
        checks = {}
        if self.spec.amax == "ldpc":
            plane = self.amax if self.compressed else gray_bits(self.amax.reshape(t, -1), AMAX_LDPC_BITS)
            checks["amax"] = self._checks_of(plane, lead * AMAX_LDPC_BITS, self.spec.amax_rate)
        if self.spec.scales == "ldpc":
            checks["scales"] = self._checks_of(self.scales, blocks, self.spec.scale_rate)
        if self.spec.elements == "ldpc":
            checks["elements"] = self._checks_of(self.elements, elems, self.spec.rate)
        bits = self._packed_bits(checks)
        if bits.shape[1]:
            out[f"{prefix}.packed__{suffix}"] = torch.from_numpy(pack_bits(bits))
        if self.spec.elements == "sparse":
            plane = self.elements.reshape(-1).numpy()
            pos = np.flatnonzero(plane >= 0)
            data = stream_encode(pos, plane[pos].astype(np.uint8))
            width = max(1, -(-len(data) // t))
            buf = np.zeros(t * width, dtype=np.uint8)
            buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            out[f"{prefix}.stream__{suffix}"] = torch.from_numpy(buf.reshape(t, width))
        return out

    def _checks_of(self, plane: torch.Tensor, per_token: int, rate: int | None) -> np.ndarray:
        if self.compressed:
            return plane.numpy().astype(np.uint8)
        cpt = ldpc_checks(per_token, rate)
        layout = ldpc_layout([self.rows], per_token, cpt)
        return ldpc_syndrome(layout, plane.reshape(-1).numpy().astype(np.uint8)).reshape(self.rows, cpt)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> CompactRecord:
        """One trajectory's record from the store's tensors (inverse of :meth:`to_tensors`)."""
        tagged = [k for k in tensors if k.startswith(f"{prefix}.packed__") or k.startswith(f"{prefix}.stream__")]
        if not tagged:
            raise ValueError(f"no compact record named {prefix!r} (have: {sorted(tensors)})")
        suffixes = {k.split("__", 1)[1] for k in tagged}
        if len(suffixes) != 1:
            raise ValueError(f"{prefix}: compact fields of different specs/shapes: {sorted(tagged)}")
        tag, geom = next(iter(suffixes)).rsplit("__", 1)
        spec, site_shape = GuidanceSpec.from_tag(tag), _parse_geometry(geom)
        any_t = tensors[tagged[0]]
        t = int(any_t.shape[0])
        scales_t = tensors.get(f"{prefix}.scales")
        fmt = Format.MXFP4 if scales_t is not None and scales_t.dtype == torch.uint8 else Format.NVFP4
        rec = cls(spec, fmt, site_shape, None, None, torch.empty(0), (t,))
        lead, blocks, elems = rec._per_token
        block_shape = (t, *site_shape[:-1], site_shape[-1] // fmt.block)
        elem_shape = (t, *site_shape)
        where = f"{prefix} ({spec.name})"

        def expect(name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
            v = tensors.get(name)
            if v is None or tuple(v.shape) != shape or v.dtype not in dtypes:
                got = "missing" if v is None else f"{v.dtype} {tuple(v.shape)}"
                raise ValueError(f"{where}: {name} should be {dtypes[0]} {shape}, got {got}")
            return v

        if spec.scales == "full":
            rec.scales = expect(f"{prefix}.scales", block_shape, (torch.float8_e4m3fn, torch.uint8))
        if fmt is Format.NVFP4 and spec.amax in ("fp32", "bf16"):
            dt = torch.float32 if spec.amax == "fp32" else torch.bfloat16
            rec.amax = expect(f"{prefix}.global_amax", (*elem_shape[:-1], 1), (dt,))
        suffix = f"{tag}__{geom}"
        nbits = rec._packed_bits_width()
        if nbits:
            packed = expect(f"{prefix}.packed__{suffix}", (t, -(-nbits // 8)), (torch.uint8,))
            fields = rec._split_packed(unpack_bits(packed.numpy(), nbits))
            if spec.amax_bits:
                rec.amax = torch.from_numpy(bits_int(fields["amax"], spec.amax_bits).astype(np.uint8)).reshape(
                    *elem_shape[:-1], 1
                )
            elif spec.amax == "ldpc":
                rec.amax = torch.from_numpy(fields["amax"].copy())
            if spec.scales == "parity":
                rec.scales = torch.from_numpy(fields["scales"].copy()).reshape(block_shape)
            elif spec.scales == "ldpc":
                rec.scales = torch.from_numpy(fields["scales"].copy())
            if spec.elements == "full":
                rec.elements = torch.from_numpy(bits_int(fields["elements"], 4).astype(np.uint8)).reshape(elem_shape)
            elif spec.elements == "lsb":
                rec.elements = torch.from_numpy(fields["elements"].copy()).reshape(elem_shape)
            elif spec.elements == "ldpc":
                rec.elements = torch.from_numpy(fields["elements"].copy())
        if spec.elements == "sparse":
            stream = tensors[f"{prefix}.stream__{suffix}"]
            if stream.dtype != torch.uint8 or stream.dim() != 2 or stream.shape[0] != t:
                raise ValueError(f"{where}: stream should be uint8 [T, W], got {stream.dtype} {tuple(stream.shape)}")
            pos, bits = stream_decode(stream.numpy().tobytes(), t * elems, where)
            plane = np.full(t * elems, -1, dtype=np.int8)
            plane[pos] = bits.astype(np.int8)
            rec.elements = torch.from_numpy(plane).reshape(elem_shape)
        return rec

    def _packed_bits_width(self) -> int:
        lead, blocks, elems = self._per_token
        return _packed_bits_per_token(self.spec, lead, blocks, elems)

    def _split(self) -> list[CompactRecord]:
        """One record per trajectory (a fresh rollout record is one)."""
        if self.segments is None or len(self.segments) == 1:
            return [self]
        out, start = [], 0
        for length in self.segments:
            part = {}
            for f in ("amax", "scales", "elements"):
                v = getattr(self, f)
                part[f] = None if v is None else v[start : start + length]
            out.append(dataclasses.replace(self, segments=(length,), **part))
            start += length
        return out

    # -- trainer side --

    def decode(self, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
        """The lsb (or full) Hint this record means, given the trainer's own value ``x`` of the site,
        and what could not be decoded (a failed LDPC block takes the trainer's own values; see the
        module docstring, "Decode failures")."""
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(
                f"compact record {self.spec.name}: x has shape {tuple(x.shape)} but the record covers "
                f"{tuple(self.shape)}"
            )
        if self.spec.uses_ldpc and not self.compressed:
            raise ValueError(f"{self.spec.name}: an ldpc record decodes only once compressed (to_tensors/from_tensors)")
        x = x.detach()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("non-finite input; NaN/Inf is a bug upstream and is never encoded")
        lead, blocks, elems = self._per_token
        amax = None
        report = DecodeReport()
        if self.fmt is Format.NVFP4:
            amax, r_amax = self._decode_amax(x)
            scales, r_scales = self._decode_scales(x, ref.nvfp4_global_encode_scale(amax), blocks)
            report = r_amax + r_scales
        else:
            scales = self.scales
        if self.spec.elements == "full":
            return Hint(HintMode.FULL, self.fmt, pack_fp4(self.elements.to(torch.uint8)), scales, amax), report
        z = grid_z(x, self.fmt, scales, amax)
        own = rtn_codes(z) & 1
        if self.spec.elements == "lsb":
            bits = self.elements.to(torch.uint8)
        elif self.spec.elements == "sparse":
            bits = torch.where(self.elements >= 0, self.elements.to(torch.uint8), own)
        else:
            layout = ldpc_layout(self.segments, elems, ldpc_checks(elems, self.spec.rate))
            own_np = own.reshape(-1).numpy().astype(np.uint8)
            syn = self.elements.reshape(-1).numpy().astype(np.uint8) ^ ldpc_syndrome(layout, own_np)
            llr = prior_llr(midpoint_distance(z).reshape(-1).numpy().astype(np.float64), ELEMENT_PRIOR)
            flips, solved = bp_flips(layout, syn, llr)
            bits = torch.from_numpy((own_np ^ flips.astype(np.uint8)).reshape(tuple(self.shape)))
            failed = ~solved
            report = report + DecodeReport(
                blocks=layout.n_blocks,
                failed_blocks=int(failed.sum()),
                failed_elements=int(failed[layout.var_block].sum()),
            )
        data = torch.from_numpy(pack_bits(bits.numpy().astype(np.uint8)))
        return Hint(HintMode.LSB, self.fmt, data, scales, amax), report

    def _decode_amax(self, x: torch.Tensor) -> tuple[torch.Tensor, DecodeReport]:
        if self.spec.amax in ("fp32", "bf16"):
            return self.amax.to(torch.float32), DecodeReport()
        own = x.to(torch.float32).abs().amax(dim=-1, keepdim=True)
        if self.spec.amax == "own":
            return own, DecodeReport()
        m = 1 << _residue_bits(self.spec)
        mine = _bf16_pattern(own)
        if self.spec.amax_bits:
            return _nearest_with_residue(mine, self.amax.to(torch.int64), m), DecodeReport()
        residue, failed_rows, report = self._decode_amax_residue(mine)
        return torch.where(failed_rows, own, _nearest_with_residue(mine, residue, m)), report

    def _decode_amax_residue(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DecodeReport]:
        """The rollout's amax residue mod 8 from its Gray-bit syndrome and the trainer's own pattern,
        the rows of failed blocks (bool, ``mine``'s shape) and the report."""
        rows = self._per_token[0]
        m = 1 << AMAX_LDPC_BITS
        own = (mine % m).reshape(self.rows, rows)
        own_gray = gray_bits(own, AMAX_LDPC_BITS)  # [T, rows * 3]
        # the Gray bits one ulp either way would flip are the likely ones
        near = gray_bits((own + 1) % m, AMAX_LDPC_BITS) ^ own_gray | gray_bits((own - 1) % m, AMAX_LDPC_BITS) ^ own_gray
        p_near, p_far = AMAX_PRIOR
        llr = np.where(near.numpy().reshape(-1) == 1, math.log((1 - p_near) / p_near), math.log((1 - p_far) / p_far))
        per_token = rows * AMAX_LDPC_BITS
        layout = ldpc_layout(self.segments, per_token, ldpc_checks(per_token, self.spec.amax_rate))
        own_np = own_gray.reshape(-1).numpy().astype(np.uint8)
        syn = self.amax.reshape(-1).numpy().astype(np.uint8) ^ ldpc_syndrome(layout, own_np)
        flips, solved = bp_flips(layout, syn, llr)
        gray = torch.from_numpy(own_np ^ flips.astype(np.uint8)).reshape(self.rows, rows, -1)
        # a row's Gray bits are consecutive variables of one token, so of one block
        failed_rows = torch.from_numpy(~solved[layout.var_block]).reshape(self.rows, rows, -1)[..., 0]
        report = DecodeReport(
            blocks=layout.n_blocks, failed_blocks=int((~solved).sum()), failed_amax=int(failed_rows.sum())
        )
        return gray_decode(gray, AMAX_LDPC_BITS).reshape(mine.shape), failed_rows.reshape(mine.shape), report

    def _decode_scales(self, x: torch.Tensor, s_enc: torch.Tensor, blocks: int) -> tuple[torch.Tensor, DecodeReport]:
        if self.spec.scales == "full":
            return self.scales, DecodeReport()
        own, other, dist = _scale_candidates(_unrounded_block_scale(x, s_enc))
        report = DecodeReport()
        if self.spec.scales == "own":
            code = own
        elif self.spec.scales == "parity":
            code = torch.where((own & 1) == self.scales.to(torch.int64), own, other)
        else:
            layout = ldpc_layout(self.segments, blocks, ldpc_checks(blocks, self.spec.scale_rate))
            own_np = (own & 1).reshape(-1).numpy().astype(np.uint8)
            syn = self.scales.reshape(-1).numpy().astype(np.uint8) ^ ldpc_syndrome(layout, own_np)
            flips, solved = bp_flips(layout, syn, prior_llr(dist.reshape(-1).numpy().astype(np.float64), SCALE_PRIOR))
            code = torch.where(torch.from_numpy(flips).reshape(own.shape), other, own)
            failed = ~solved
            report = DecodeReport(
                blocks=layout.n_blocks,
                failed_blocks=int(failed.sum()),
                failed_scales=int(failed[layout.var_block].sum()),
            )
        return code.to(torch.uint8).view(torch.float8_e4m3fn), report


@dataclasses.dataclass(frozen=True)
class DecodeReport:
    """What a decode could not recover (see the module docstring, "Decode failures").

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


def _scale_bits(spec: GuidanceSpec, blocks: int) -> int:
    if spec.scales == "parity":
        return blocks
    return ldpc_checks(blocks, spec.scale_rate) if spec.scales == "ldpc" else 0


def _element_bits(spec: GuidanceSpec, elems: int) -> int:
    if spec.elements == "ldpc":
        return ldpc_checks(elems, spec.rate)
    return {"full": 4 * elems, "lsb": elems}.get(spec.elements, 0)


def _amax_bits(spec: GuidanceSpec, rows: int) -> int:
    if spec.amax == "ldpc":
        return ldpc_checks(rows * AMAX_LDPC_BITS, spec.amax_rate)
    return rows * spec.amax_bits


def _residue_bits(spec: GuidanceSpec) -> int:
    return AMAX_LDPC_BITS if spec.amax == "ldpc" else spec.amax_bits


def _packed_bits_per_token(spec: GuidanceSpec, rows: int, blocks: int, elems: int) -> int:
    return _amax_bits(spec, rows) + _scale_bits(spec, blocks) + _element_bits(spec, elems)


# --- record-level helpers (what the model, rollout and trainer call) -----------------------------


def encode_record(x: torch.Tensor, q: NVFP4 | MXFP4, mode: HintMode | GuidanceSpec) -> Hint | CompactRecord:
    """What the rollout records at a site: a :class:`Hint` for ``full``/``lsb``, else a compact record."""
    if isinstance(mode, HintMode):
        return encode_hint(q, mode)
    return CompactRecord.encode(x, q, mode)


def read_record(tensors: Mapping[str, torch.Tensor], prefix: str) -> Hint | CompactRecord:
    """A site's record from a trajectory's tensors, whichever kind it is."""
    if any(k.startswith(f"{prefix}.packed__") or k.startswith(f"{prefix}.stream__") for k in tensors):
        return CompactRecord.from_tensors(tensors, prefix)
    return Hint.from_tensors(dict(tensors), prefix)


def decode_record(record: Hint | CompactRecord, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
    """The Hint a site's record means given the trainer's own value ``x``, and what could not be decoded
    (an empty report for a plain :class:`Hint`, which needs no decoding): the trainer's one call for both."""
    if isinstance(record, Hint):
        return record, DecodeReport()
    return record.decode(x)


def record_cat(records: Sequence[Hint | CompactRecord]) -> Hint | CompactRecord:
    """Concatenate the records of one site along the token dim (trajectories of a batch, or steps)."""
    if not records:
        raise ValueError("record_cat: no records given")
    if all(isinstance(r, Hint) for r in records):
        return hint_cat(list(records))
    if not all(isinstance(r, CompactRecord) for r in records):
        raise ValueError("record_cat: mixing Hints and compact records of one site")
    r0 = records[0]
    for r in records[1:]:
        if (r.spec, r.fmt, r.site_shape) != (r0.spec, r0.fmt, r0.site_shape):
            raise ValueError(f"record_cat: {r.spec.name} {r.site_shape} vs {r0.spec.name} {r0.site_shape}")
        if (r.segments is None) != (r0.segments is None):
            raise ValueError("record_cat: mixing fresh rollout records with records read back")
    cat = lambda f: None if getattr(r0, f) is None else torch.cat([getattr(r, f) for r in records])  # noqa: E731
    segments = None if r0.segments is None else tuple(s for r in records for s in r.segments)
    return dataclasses.replace(r0, amax=cat("amax"), scales=cat("scales"), elements=cat("elements"), segments=segments)


# --- byte formulas (the planner's, checked against the records' own accounting) -----------------


def site_bytes_per_token(
    mode: HintMode | GuidanceSpec | str,
    site_shape: Sequence[int],
    fmt: Format | str = Format.NVFP4,
    density: float | None = None,
) -> float:
    """Record bytes per token of one site with per-token shape ``(*lead, K)``.

    Exact for every mode but ``sparse``, whose stream is ``density * elements * rice_bits_per_entry /
    8`` in expectation (the few header bytes and the padding to a multiple of T are left out).
    """
    mode = parse_hint_mode(mode)
    fmt = Format(fmt)
    rows = int(np.prod(tuple(site_shape[:-1]), dtype=np.int64))
    k = int(site_shape[-1])
    blocks, elems = rows * (k // fmt.block), rows * k
    amax_bytes = 4 * rows if fmt is Format.NVFP4 else 0
    if isinstance(mode, HintMode):
        return elems // (2 if mode is HintMode.FULL else 8) + blocks + amax_bytes
    total = float(blocks if mode.scales == "full" else 0)
    if fmt is Format.NVFP4:
        total += {"fp32": 4 * rows, "bf16": 2 * rows}.get(mode.amax, 0)
    total += -(-_packed_bits_per_token(mode, rows, blocks, elems) // 8)
    if mode.elements == "sparse":
        if density is None:
            raise ValueError(f"{mode.name}: the size of a sparse record depends on its density; give one")
        if density > 0:
            total += density * elems * rice_bits_per_entry(density) / 8
    return total


# --- named configurations: a mode and the layers it guides ---------------------------------------

LAYER_SETS = ("all", "deeper", "last<n>")
_LAST_RE = re.compile(r"last([1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class GuidedMode:
    """A guidance mode on a set of layers, named ``<mode>[@all|@deeper|@last<n>]``.

    Without a suffix, ``full`` guides every layer (the paper's full-information baseline) and every
    other mode the deeper half (the paper's default for its compact cache, so ``lsb`` *is* the
    paper's compact mode); a suffix is written only where it differs from that default.
    ``@last<n>`` (n >= 1) guides the last n layers only (the layer ablation); n must not exceed the
    model's layers (checked by :meth:`layer_indices`, the one place a model's depth is known).
    """

    mode: HintMode | GuidanceSpec
    layers: str

    def __post_init__(self) -> None:
        if self.layers not in LAYER_SETS[:2] and _LAST_RE.fullmatch(self.layers) is None:
            raise ValueError(f"layers must be one of {LAYER_SETS} (n >= 1), got {self.layers!r}")

    @staticmethod
    def default_layers(mode: HintMode | GuidanceSpec) -> str:
        return "all" if mode is HintMode.FULL else "deeper"

    @property
    def name(self) -> str:
        base = mode_name(self.mode)
        return base if self.layers == self.default_layers(self.mode) else f"{base}@{self.layers}"

    @classmethod
    def parse(cls, name: str) -> GuidedMode:
        base, _, layers = name.strip().partition("@")
        mode = parse_hint_mode(base)
        return cls(mode, layers or cls.default_layers(mode))

    def layer_indices(self, n_layers: int) -> frozenset[int]:
        """``all``: every layer; ``deeper``: :func:`tracefp4.guidance.names.deeper_half`; ``last<n>``:
        :func:`tracefp4.guidance.names.last_layers` (a ValueError if n > n_layers)."""
        if self.layers == "all":
            return frozenset(range(n_layers))
        if self.layers == "deeper":
            return deeper_half(n_layers)
        n = int(_LAST_RE.fullmatch(self.layers).group(1))
        try:
            return last_layers(n_layers, n)
        except ValueError as e:
            raise ValueError(f"guidance {self.name!r}: {e}") from None


#: The modes ``tracefp4 mismatch --sweep`` measures and ``tracefp4 plan`` sizes, references first.
STANDARD_MODES: tuple[str, ...] = (
    # the paper's two reference points, and each on the other layer set
    "full",
    "lsb",
    "lsb@all",
    "full@deeper",
    # the per-row amax and the block scales, one knob at a time (elements: 1 bit)
    "lsb+amax:bf16",
    "lsb+amax:lo2",
    "lsb+amax:lo3",
    "lsb+amax:own",
    "lsb+parity",
    "lsb+scales:own",
    "lsb+parity+amax:lo3",
    "lsb+parity+amax:lo3@all",
    # sparse near-tie hints, as the brief names them, then with the cheap scales and amax
    "sparse(0.05)",
    "sparse(0.05)+parity",
    *(f"sparse({d})+parity+amax:lo3{at}" for at in ("", "@all") for d in ("0.01", "0.02", "0.05", "0.1")),
    # syndromes of the low-bit plane
    *(f"ldpc(1/{d})+parity+amax:lo3{at}" for at in ("", "@all") for d in (2, 4, 8, 16, 32)),
    *(f"ldpc(1/{d})+scales:ldpc(1/4)+amax:lo3@all" for d in (8, 16, 32)),
    "ldpc(1/16)+scales:ldpc(1/4)+amax:lo2@all",
    "ldpc(1/8)+scales:ldpc(1/4)+amax:ldpc(1/2)@all",
)
