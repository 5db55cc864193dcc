"""The global-amax codecs (``fp32``, ``amax:bf16``, ``amax:lo<b>``, ``amax:ldpc(1/d)``, ``amax:own``), NVFP4 only.

A row's amax fixes ``S_enc`` and so its whole grid, so it must decode exactly: a BF16 row's amax is
one of its BF16 elements, and the trainer's own amax differs from it by a few BF16 ulps at most, so the
low bits of its BF16 pattern name it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracefp4.formats.constants import Format
from tracefp4.guidance.coding import bits_int, gray_bits, gray_decode, int_bits, ldpc_checks
from tracefp4.guidance.compact.codec import Codec, Expect, Geometry, check_rate, ldpc_correct, ldpc_encode
from tracefp4.guidance.compact.grid import bf16_pattern, check_bf16_exact, nearest_with_residue
from tracefp4.guidance.report import DecodeReport

__all__ = ["AMAX_PRIOR", "AMAX_LDPC_BITS", "AmaxCodec", "Fp32Amax", "Bf16Amax", "LowBitsAmax", "LdpcAmax",
           "OwnAmax"]

#: Gray-coded low bits of the BF16 amax pattern that ``amax:ldpc`` protects (resolves |drift| <= 3 ulps).
AMAX_LDPC_BITS = 3
#: Prior flip probability of a Gray bit of the amax residue: (a bit one ulp of drift would flip, any
#: other bit). One row in 20 differs by one ulp on the tiny model with every layer guided.
AMAX_PRIOR = (0.03, 0.002)


class AmaxCodec(Codec):
    field = "amax"

    def encode(self, amax: torch.Tensor) -> torch.Tensor | None:
        """What the rollout keeps of its float32 per-row amax ``[T, *lead, 1]``."""
        return None

    def decode(self, value: torch.Tensor | None, x: torch.Tensor, segments: Sequence[int] | None,
               geom: Geometry) -> tuple[torch.Tensor, DecodeReport]:
        """The float32 per-row global amax (the trainer's own FP32 row maximum by default)."""
        return x.to(torch.float32).abs().amax(dim=-1, keepdim=True), DecodeReport()


class Fp32Amax(AmaxCodec):
    knob, plain, dtype = "fp32", True, torch.float32

    def name_part(self) -> str:
        return ""

    def encode(self, amax):
        return amax

    def byte_count(self, geom: Geometry) -> int:
        return geom.rows * self.dtype.itemsize if geom.fmt is Format.NVFP4 else 0

    def stored(self, value, prefix, suffix, t):
        return {} if value is None else {f"{prefix}.global_amax": value}

    def read(self, tensors: Mapping[str, torch.Tensor], prefix: str, suffix: str, geom: Geometry, t: int,
             expect: Expect, where: str) -> torch.Tensor:
        return expect(f"{prefix}.global_amax", geom.row_shape(t), (self.dtype,))

    def decode(self, value, x, segments, geom):
        return value.to(torch.float32), DecodeReport()


class Bf16Amax(Fp32Amax):
    knob, plain, dtype = "bf16", False, torch.bfloat16

    def name_part(self) -> str:
        return "+amax:bf16"

    def encode(self, amax):
        check_bf16_exact(amax, self.knob)
        return amax.to(torch.bfloat16)


class LowBitsAmax(AmaxCodec):
    """``lo<b>``: the low b bits of the BF16 pattern; the trainer takes the pattern nearest its own."""

    knob = "lo"

    def __init__(self, bits: int | None = None) -> None:
        if not (isinstance(bits, int) and 1 <= bits <= 8):
            raise ValueError(f"amax must be fp32, bf16, own, ldpc or lo1..lo8, got 'lo{bits}'")
        self.residue_bits = bits

    def name_part(self) -> str:
        return f"+amax:lo{self.residue_bits}"

    def tag_part(self) -> str:
        return f"alo{self.residue_bits}"

    def encode(self, amax):
        check_bf16_exact(amax, f"lo{self.residue_bits}")
        return (bf16_pattern(amax) & ((1 << self.residue_bits) - 1)).to(torch.uint8)

    def bits(self, geom: Geometry) -> int:
        return geom.rows * self.residue_bits

    def pack(self, value, geom, t, compressed):
        return int_bits(value.reshape(t, -1).numpy(), self.residue_bits)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(bits_int(fields, self.residue_bits).astype(np.uint8)).reshape(geom.row_shape(t))

    def decode(self, value, x, segments, geom):
        mine = bf16_pattern(x.to(torch.float32).abs().amax(dim=-1, keepdim=True))
        return nearest_with_residue(mine, value.to(torch.int64), 1 << self.residue_bits), DecodeReport()


class LdpcAmax(AmaxCodec):
    """A syndrome of the Gray-coded low ``AMAX_LDPC_BITS`` bits of the BF16 pattern, decoded like ``lo3``."""

    knob, ldpc = "ldpc", True

    def __init__(self, rate: int | None = None) -> None:
        if rate is None:
            raise ValueError("an ldpc amax needs a rate 1/d (and only it)")
        self.rate = check_rate(rate)

    def name_part(self) -> str:
        return f"+amax:ldpc(1/{self.rate})"

    def tag_part(self) -> str:
        return f"aldpc_{self.rate}"

    def encode(self, amax):
        check_bf16_exact(amax, self.knob)
        return (bf16_pattern(amax) & ((1 << AMAX_LDPC_BITS) - 1)).to(torch.uint8)

    def bits(self, geom: Geometry) -> int:
        return ldpc_checks(geom.rows * AMAX_LDPC_BITS, self.rate)

    def pack(self, value, geom, t, compressed):
        plane = value if compressed else gray_bits(value.reshape(t, -1), AMAX_LDPC_BITS)
        return ldpc_encode(plane, t, geom.rows * AMAX_LDPC_BITS, self.rate, compressed)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(fields.copy())

    def decode(self, value, x, segments, geom):
        own = x.to(torch.float32).abs().amax(dim=-1, keepdim=True)
        mine = bf16_pattern(own)
        residue, failed_rows, report = self._residue(value, mine, segments, geom)
        m = 1 << AMAX_LDPC_BITS
        return torch.where(failed_rows, own, nearest_with_residue(mine, residue, m)), report

    def _residue(self, value, mine, segments, geom) -> tuple[torch.Tensor, torch.Tensor, DecodeReport]:
        """The rollout's amax residue mod 8 from its Gray-bit syndrome and the trainer's own pattern,
        the rows of failed blocks (bool, ``mine``'s shape) and the report."""
        t, rows, m = int(mine.shape[0]), geom.rows, 1 << AMAX_LDPC_BITS
        own = (mine % m).reshape(t, rows)
        own_gray = gray_bits(own, AMAX_LDPC_BITS)  # [T, rows * 3]
        # the Gray bits one ulp either way would flip are the likely ones
        near = gray_bits((own + 1) % m, AMAX_LDPC_BITS) ^ own_gray | gray_bits((own - 1) % m, AMAX_LDPC_BITS) ^ own_gray
        p_near, p_far = AMAX_PRIOR
        llr = np.where(near.numpy().reshape(-1) == 1, math.log((1 - p_near) / p_near), math.log((1 - p_far) / p_far))
        own_np = own_gray.reshape(-1).numpy().astype(np.uint8)
        fix = ldpc_correct(value, own_np, llr, segments, rows * AMAX_LDPC_BITS, self.rate)
        gray = torch.from_numpy(own_np ^ fix.flips.astype(np.uint8)).reshape(t, rows, -1)
        # a row's Gray bits are consecutive variables of one token, so of one block
        failed_rows = torch.from_numpy(fix.failed).reshape(t, rows, -1)[..., 0]
        report = DecodeReport(blocks=fix.blocks, failed_blocks=fix.failed_blocks, failed_amax=int(failed_rows.sum()))
        return gray_decode(gray, AMAX_LDPC_BITS).reshape(mine.shape), failed_rows.reshape(mine.shape), report


class OwnAmax(AmaxCodec):
    knob = "own"
