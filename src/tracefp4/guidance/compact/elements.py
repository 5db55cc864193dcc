"""The element codecs (``full``, ``lsb``, ``mod4``, ``sparse(delta)``, ``ldpc(1/d)``): the rollout's codeword choices.

Each codes the rollout's E2M1 codes of a site on the rollout's grid; ``decode`` turns the record's
field and the trainer's own ``z`` on the decoded grid into the Hint data: unpacked codes for the
codecs whose ``decodes_to`` is ``full`` (``mod4``; ``full`` itself needs no decoding), else the
low-bit plane.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracefp4.formats.constants import E2M1_MAX, E2M1_SIGN_BIT, E4M3_SIGN_BIT, Format, HintMode
from tracefp4.formats.fp8 import mod4_e4m3
from tracefp4.formats.grid import mod4_e2m1
from tracefp4.guidance.coding import bits_int, int_bits, ldpc_checks, prior_llr, rice_bits_per_entry, stream_decode, \
    stream_encode
from tracefp4.guidance.compact.codec import Codec, Expect, Geometry, check_rate, ldpc_correct, ldpc_encode
from tracefp4.guidance.compact.grid import midpoint_distance
from tracefp4.guidance.report import DecodeReport

__all__ = ["ELEMENT_PRIOR", "ElementCodec", "FullElements", "LsbElements", "Mod4Elements", "SparseElements",
           "LdpcElements"]

#: Prior probability that an element's low bit differs from the trainer's round-to-nearest one:
#: ``p0 * exp(-r / sigma)``, r = distance of the trainer's z to the nearest midpoint (grid units).
#: Fitted on the tiny model's drift with every layer guided: p ~ 0.08-0.1 at r ~ 0, ~1e-3 at r = 0.04.
ELEMENT_PRIOR = (0.1, 0.01)


def _fmt_float(v: float) -> str:
    return np.format_float_positional(v, trim="-")


class ElementCodec(Codec):
    field = "elements"
    #: the Hint mode :meth:`decode`'s result is data for: the low-bit plane (lsb) or unpacked codes (full)
    decodes_to: HintMode = HintMode.LSB
    #: whether the codec codes E4M3 codes too (decodes on an FP8 site's row scale): its rule uses only
    #: the signed line and the bracket, not E2M1's midpoints or NVFP4's scale recipe
    takes_fp8: bool = False

    def name_part(self) -> str:
        return self.knob

    def tag_part(self) -> str:
        return self.knob

    def encode(self, codes: torch.Tensor, z: torch.Tensor | None, fmt: Format = Format.NVFP4) -> torch.Tensor:
        """What the rollout keeps of its unpacked codes (``z``: its own z, for ``sparse`` only; ``fmt``:
        the element format, for the codecs whose record differs between E2M1 and E4M3 codes)."""
        return codes & 1

    def needs_z(self) -> bool:
        return False

    def stream_bytes(self, geom: Geometry, density: float | None, name: str) -> float:
        """Expected bytes per token outside the packed bits (``sparse``'s stream; 0 for the others)."""
        return 0.0

    def kept(self, value: torch.Tensor) -> tuple[int, int] | None:
        return None

    def decode(self, value: torch.Tensor, own: torch.Tensor, z: torch.Tensor, segments: Sequence[int] | None,
               geom: Geometry) -> tuple[torch.Tensor, DecodeReport]:
        """The low-bit plane (``own``: the trainer's round-to-nearest low bits on the decoded grid)."""
        return value.to(torch.uint8), DecodeReport()


class FullElements(ElementCodec):
    knob, hint_mode = "full", HintMode.FULL

    def encode(self, codes: torch.Tensor, z: torch.Tensor | None, fmt: Format = Format.NVFP4) -> torch.Tensor:
        return codes

    def bits(self, geom: Geometry) -> int:
        return 4 * geom.elems

    def pack(self, value, geom, t, compressed):
        return int_bits(value.reshape(t, -1).numpy(), 4)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(bits_int(fields, 4).astype(np.uint8)).reshape(geom.elem_shape(t))


class LsbElements(ElementCodec):
    knob, hint_mode = "lsb", HintMode.LSB

    def bits(self, geom: Geometry) -> int:
        return geom.elems

    def pack(self, value, geom, t, compressed):
        return value.reshape(t, -1).numpy().astype(np.uint8)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(fields.copy()).reshape(geom.elem_shape(t))


class Mod4Elements(ElementCodec):
    """The code's position on the signed line mod 4 (two bits per element): exact wherever the rollout's
    code is in the trainer's bracket, a counted miss wherever it is 1 or 2 codewords outside.

    The trainer's bracket is two adjacent positions (one on a codeword, as the reference's
    :func:`~tracefp4.formats.reference.bracket` has it). Two of the four residues name its members;
    the other two can only be positions one or two steps beyond it, on either side (one step above
    the upper member is two below the lower one, mod 4): the side is unknown, so the element falls
    back to round to nearest on the rollout's grid and is counted in
    :attr:`~tracefp4.guidance.report.DecodeReport.bracket_misses` (every element in ``bracket_checked``).
    A miss of 3 or 4 steps (any multiple of 4 at a codeword) has a bracket member's residue and is
    decoded as that member, undetected: ``lsb``'s blind spot starts at 1 step (one step beyond the
    bracket has the far member's low bit, two steps the near one's, and both decode silently).
    Decodes to full codes (``decodes_to``), so the trainer's guided quantizer lands on them exactly.
    """

    knob = "mod4"
    decodes_to = HintMode.FULL
    takes_fp8 = True

    def encode(self, codes: torch.Tensor, z: torch.Tensor | None, fmt: Format = Format.NVFP4) -> torch.Tensor:
        sign = E4M3_SIGN_BIT if fmt is Format.FP8 else E2M1_SIGN_BIT
        c = codes.to(torch.int64)
        position = torch.where(c >= sign, sign - c, c)  # the signed line, both zeros at 0
        return (position & 3).to(torch.uint8)  # & 3 of a negative position is its floor mod 4

    def bits(self, geom: Geometry) -> int:
        return 2 * geom.elems

    def pack(self, value, geom, t, compressed):
        return int_bits(value.reshape(t, -1).numpy(), 2)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(bits_int(fields, 2).astype(np.uint8)).reshape(geom.elem_shape(t))

    def decode(self, value, own, z, segments, geom):
        """Unpacked codes on the decoded grid (E4M3 codes at an FP8 site), and the bracket misses among them."""
        codes, miss = (mod4_e4m3 if geom.fmt is Format.FP8 else mod4_e2m1)(z, value.to(z.device))
        return codes, DecodeReport(bracket_checked=miss.numel(), bracket_misses=int(miss.sum()))


class SparseElements(ElementCodec):
    """The low bit where the rollout's z sat within ``delta`` of a midpoint, as a Rice-coded stream."""

    knob = "sparse"

    def __init__(self, delta: float | None = None) -> None:
        if delta is None:
            raise ValueError("sparse elements need a delta (and only they)")
        if not (math.isfinite(delta) and 0 < delta <= E2M1_MAX):
            raise ValueError(f"sparse delta must be in (0, 6], got {delta}")
        self.delta = delta

    def name_part(self) -> str:
        return f"sparse({_fmt_float(self.delta)})"

    def tag_part(self) -> str:
        return f"sparse_{_fmt_float(self.delta).replace('.', 'p')}"

    def needs_z(self) -> bool:
        return True

    def encode(self, codes: torch.Tensor, z: torch.Tensor | None, fmt: Format = Format.NVFP4) -> torch.Tensor:
        near = midpoint_distance(z) < self.delta
        return torch.where(near, (codes & 1).to(torch.int8), torch.full_like(codes, -1, dtype=torch.int8))

    def stream_bytes(self, geom: Geometry, density: float | None, name: str) -> float:
        if density is None:
            raise ValueError(f"{name}: the size of a sparse record depends on its density; give one")
        return density * geom.elems * rice_bits_per_entry(density) / 8 if density > 0 else 0.0

    def kept(self, value: torch.Tensor) -> tuple[int, int] | None:
        return int((value >= 0).sum()), value.numel()

    def stored(self, value, prefix, suffix, t):
        plane = value.reshape(-1).numpy()
        pos = np.flatnonzero(plane >= 0)
        data = stream_encode(pos, plane[pos].astype(np.uint8))
        width = max(1, -(-len(data) // t))
        buf = np.zeros(t * width, dtype=np.uint8)
        buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return {f"{prefix}.stream__{suffix}": torch.from_numpy(buf.reshape(t, width))}

    def read(self, tensors: Mapping[str, torch.Tensor], prefix: str, suffix: str, geom: Geometry, t: int,
             expect: Expect, where: str) -> torch.Tensor:
        stream = tensors[f"{prefix}.stream__{suffix}"]
        if stream.dtype != torch.uint8 or stream.dim() != 2 or stream.shape[0] != t:
            raise ValueError(f"{where}: stream should be uint8 [T, W], got {stream.dtype} {tuple(stream.shape)}")
        pos, bits = stream_decode(stream.numpy().tobytes(), t * geom.elems, where)
        plane = np.full(t * geom.elems, -1, dtype=np.int8)
        plane[pos] = bits.astype(np.int8)
        return torch.from_numpy(plane).reshape(geom.elem_shape(t))

    def decode(self, value, own, z, segments, geom):
        return torch.where(value >= 0, value.to(torch.uint8), own), DecodeReport()


class LdpcElements(ElementCodec):
    """A syndrome of the low-bit plane: ``ceil(elements/d)`` checks per token."""

    knob, ldpc = "ldpc", True

    def __init__(self, rate: int | None = None) -> None:
        if rate is None:
            raise ValueError("ldpc elements need a rate 1/d (and only they)")
        self.rate = check_rate(rate)

    def name_part(self) -> str:
        return f"ldpc(1/{self.rate})"

    def tag_part(self) -> str:
        return f"ldpc_{self.rate}"

    def bits(self, geom: Geometry) -> int:
        return ldpc_checks(geom.elems, self.rate)

    def pack(self, value, geom, t, compressed):
        return ldpc_encode(value, t, geom.elems, self.rate, compressed)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(fields.copy())

    def decode(self, value, own, z, segments, geom):
        own_np = own.reshape(-1).numpy().astype(np.uint8)
        llr = prior_llr(midpoint_distance(z).reshape(-1).numpy().astype(np.float64), ELEMENT_PRIOR)
        fix = ldpc_correct(value, own_np, llr, segments, geom.elems, self.rate)
        bits = torch.from_numpy((own_np ^ fix.flips.astype(np.uint8)).reshape(tuple(z.shape)))
        return bits, DecodeReport(blocks=fix.blocks, failed_blocks=fix.failed_blocks,
                                  failed_elements=int(fix.failed.sum()))

