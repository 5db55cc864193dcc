"""Guidance smaller than the paper's compact cache: what the rollout keeps, and how the trainer reads it.

The paper's compact cache (``lsb``) keeps, per guided site, 1 bit per element plus the 8-bit E4M3
block scale of every 16 elements and a 4-byte FP32 global amax per row. Most of that is information
the trainer already has: it computes the same site from the same weights and differs from the rollout
only at BF16 level, so its own block scales, amax and round-to-nearest codes agree with the
rollout's almost everywhere. A :class:`CompactRecord` keeps only what the trainer cannot recompute,
and decodes, *given the trainer's own value x*, into an ordinary lsb :class:`~tracefp4.guidance.hints.Hint`
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
    ``full`` the 4-bit code; ``lsb`` its low bit; ``mod4`` its position on the signed code line
    (-7..7, both zeros at 0) mod 4, two bits: the residue names the trainer's bracket member exactly,
    or says the rollout's code is 1 or 2 codewords outside the bracket (see "Bracket misses");
    ``sparse(delta)`` the low bit only where the
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
existing :class:`~tracefp4.guidance.hints.Hint` modes.

Record layout (the store's ``L{layer:02d}.{site}.{field}``, every tensor with leading dim T):
    ``.scales`` float8_e4m3fn ``[T, *lead, K/16]`` (scales ``full``; MXFP4: uint8 E8M0);
    ``.global_amax`` float32 or bfloat16 ``[T, *lead, 1]`` (amax ``fp32``/``bf16``);
    ``.packed__<tag>__g<shape>`` uint8 ``[T, ceil(bits/8)]``: per token, the sub-byte fields bit-packed
    (bit i of the token's string is bit i%8 of byte i//8) in this order: amax bits (b per row for
    ``lo<b>``, ``ceil(3 rows/d)`` checks for ``amax:ldpc``), scale bits (1 per block for ``parity``,
    ``ceil(blocks/d)`` checks for ``scales:ldpc``), element bits (4 per element for ``full``, 2 for
    ``mod4`` (the residue, least significant bit first), 1 for ``lsb``, ``ceil(elements/d)`` checks
    for ``ldpc``);
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
:class:`~tracefp4.guidance.hints.Hint` with an empty report), so the trainer sums the reports of its sites
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

Bracket misses (``mod4``; decisions): the trainer's bracket is what the reference's guided rounding
takes (:func:`tracefp4.formats.reference.bracket`): the two adjacent codewords around its value z on
the rollout's grid, or the one codeword z sits on. On the signed line the two members q and q+1 have
two of the four residues; the other two are q+2 = q-2 and q+3 = q-1 (mod 4), i.e. a rollout code one
or two codewords outside, on a side that cannot be told. So:
    * residue of a member: that member, exactly (the rollout's code whenever it is in the bracket);
    * any other residue: a *detected miss*: the element takes the trainer's round-to-nearest code on
      the rollout's grid (the nearer member; with the side unknown nothing better is justified) and
      is counted. On a codeword (one-member bracket) every other residue is a miss, 1, 2 or 3 steps;
    * undetectable: a code 3 or 4 codewords outside a two-member bracket (4, 8, ... on a codeword)
      has a member's residue and decodes to that member, uncounted. ``lsb`` is blind from 1 step on:
      one step beyond the bracket has the far member's low bit and two steps the near one's.
The count: :class:`DecodeReport` ``bracket_checked`` (every element a ``mod4`` record decodes) and
``bracket_misses`` (the detected misses); the trainer's forward sums them over sites in
:attr:`tracefp4.engines.guidance.TrainerGuidance.decode_report`. Their ratio over a step's forwards,
``sum(bracket_misses) / sum(bracket_checked)``, is the detected rate: the share of guided elements
whose rollout code is 1-2 codewords off the trainer's bracket, a lower bound on the registry's
``guidance_bracket_miss_rate`` (3-4 step aliases are missing; the lag-k replays saw most misses one
codeword out). Records that cannot tell (``full``, ``lsb`` and the other compact elements) add to
neither count, so mixing them in does not dilute the rate. The registry's rate itself is exact and
needs the rollout's full codes and the trainer's values: :func:`tracefp4.pipeline.metrics.bracket_miss`
(on :func:`tracefp4.formats.reference.bracket_distance`), as ``tracefp4 mismatch --lag`` measures it.
A detected miss is not a decode failure: ``failed_blocks`` and ``decode_failures`` stay LDPC's.

Trajectory scope: ``ldpc`` checks and ``sparse`` streams are computed over a whole trajectory (code
blocks of consecutive tokens, so that a tiny model's few elements per token still make long codes);
read them with :meth:`StoreReader.get` without ``positions``. A record read back knows its
trajectory lengths (``segments``) and decodes batches of concatenated trajectories.

The package: :mod:`~.spec` (the spec, parsed and named), :mod:`~.registry` (the codec of every knob
value), the codecs :mod:`~.amax`, :mod:`~.scales`, :mod:`~.elements` behind :class:`~.codec.Codec`
(with the one LDPC correction step, :func:`~.codec.ldpc_correct`), :mod:`~.grid` (the rollout's grid
as the trainer recomputes it), :mod:`~.record` (:class:`CompactRecord`, a composition of the three
codecs), :mod:`~.site` (the record-level helpers for every :class:`~tracefp4.guidance.record.SiteRecord`)
and :mod:`~.modes` (:class:`GuidedMode`, :data:`STANDARD_MODES`). How the bits themselves are coded is
:mod:`tracefp4.guidance.coding`.
"""

from tracefp4.guidance.coding import LDPC_BLOCK, rice_bits_per_entry
from tracefp4.guidance.compact.amax import AMAX_PRIOR
from tracefp4.guidance.compact.elements import ELEMENT_PRIOR
from tracefp4.guidance.compact.grid import grid_z, midpoint_distance, rtn_codes
from tracefp4.guidance.compact.modes import LAYER_SETS, STANDARD_MODES, GuidedMode
from tracefp4.guidance.compact.record import CompactRecord
from tracefp4.guidance.compact.scales import SCALE_PRIOR
from tracefp4.guidance.compact.site import decode_record, encode_record, read_record, record_cat, site_bytes_per_token
from tracefp4.guidance.compact.spec import GuidanceSpec, elements_knob, mode_name, parse_hint_mode
from tracefp4.guidance.report import DecodeReport

__all__ = [
    "GuidanceSpec",
    "CompactRecord",
    "parse_hint_mode",
    "mode_name",
    "elements_knob",
    "encode_record",
    "read_record",
    "record_cat",
    "decode_record",
    "site_bytes_per_token",
    "DecodeReport",
    "GuidedMode",
    "LAYER_SETS",
    "STANDARD_MODES",
    "ELEMENT_PRIOR",
    "SCALE_PRIOR",
    "AMAX_PRIOR",
    "LDPC_BLOCK",
    "rice_bits_per_entry",
    "grid_z",
    "rtn_codes",
    "midpoint_distance",
]
