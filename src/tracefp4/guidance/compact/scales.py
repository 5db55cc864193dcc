"""The block-scale codecs (``full``, ``parity``, ``scales:ldpc(1/d)``, ``scales:own``) of NVFP4's E4M3 scales.

Adjacent E4M3 codes alternate in their low bit, so the low bit and the side the trainer's unrounded
scale leans to name the rollout's code whenever the two differ by at most one step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracefp4.formats.constants import Format
from tracefp4.guidance.coding import ldpc_checks, prior_llr
from tracefp4.guidance.compact.codec import Codec, Expect, Geometry, check_rate, ldpc_correct, ldpc_encode
from tracefp4.guidance.compact.grid import scale_candidates, unrounded_block_scale
from tracefp4.guidance.report import DecodeReport

__all__ = ["SCALE_PRIOR", "ScaleCodec", "FullScales", "ParityScales", "LdpcScales", "OwnScales"]

#: Prior flip probability of a block scale code, as ``ELEMENT_PRIOR`` with r = distance of the
#: unrounded scale to E4M3's rounding midpoint in code steps.
SCALE_PRIOR = (0.1, 0.05)


class ScaleCodec(Codec):
    field = "scales"

    def tag_part(self) -> str:
        return f"s{self.knob}"

    def encode(self, scales: torch.Tensor) -> torch.Tensor | None:
        """What the rollout keeps of its block scales (the low bits of the E4M3 codes by default)."""
        return scales.view(torch.uint8) & 1

    def decode(self, value: torch.Tensor | None, x: torch.Tensor, s_enc: torch.Tensor,
               segments: Sequence[int] | None, geom: Geometry) -> tuple[torch.Tensor, DecodeReport]:
        """The E4M3 block scales on the decoded ``S_enc``, from the trainer's own unrounded scales."""
        own, other, dist = scale_candidates(unrounded_block_scale(x, s_enc))
        code, report = self.choose(value, own, other, dist, segments, geom)
        return code.to(torch.uint8).view(torch.float8_e4m3fn), report

    def choose(self, value, own, other, dist, segments, geom) -> tuple[torch.Tensor, DecodeReport]:
        """Per block, the trainer's own code or the neighbour it leans to."""
        return own, DecodeReport()


class FullScales(ScaleCodec):
    knob, plain = "full", True

    def name_part(self) -> str:
        return ""

    def encode(self, scales):
        return scales.clone()

    def byte_count(self, geom: Geometry) -> int:
        if geom.fmt is Format.FP8:
            return geom.blocks * torch.float32.itemsize  # FP8's float32 row scale
        return geom.blocks  # one E4M3 (or E8M0) byte per block

    def stored(self, value, prefix, suffix, t):
        return {f"{prefix}.scales": value}

    def read(self, tensors: Mapping[str, torch.Tensor], prefix: str, suffix: str, geom: Geometry, t: int,
             expect: Expect, where: str) -> torch.Tensor:
        return expect(f"{prefix}.scales", geom.block_shape(t), (torch.float8_e4m3fn, torch.uint8, torch.float32))

    def decode(self, value, x, s_enc, segments, geom):
        return value, DecodeReport()


class ParityScales(ScaleCodec):
    knob = "parity"

    def name_part(self) -> str:
        return "+parity"

    def bits(self, geom: Geometry) -> int:
        return geom.blocks

    def pack(self, value, geom, t, compressed):
        return value.reshape(t, -1).numpy().astype(np.uint8)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(fields.copy()).reshape(geom.block_shape(t))

    def choose(self, value, own, other, dist, segments, geom):
        return torch.where((own & 1) == value.to(torch.int64), own, other), DecodeReport()


class LdpcScales(ScaleCodec):
    knob, ldpc = "ldpc", True

    def __init__(self, rate: int | None = None) -> None:
        if rate is None:
            raise ValueError("ldpc scales need a rate 1/d (and only they)")
        self.rate = check_rate(rate)

    def name_part(self) -> str:
        return f"+scales:ldpc(1/{self.rate})"

    def tag_part(self) -> str:
        return f"sldpc_{self.rate}"

    def bits(self, geom: Geometry) -> int:
        return ldpc_checks(geom.blocks, self.rate)

    def pack(self, value, geom, t, compressed):
        return ldpc_encode(value, t, geom.blocks, self.rate, compressed)

    def unpack(self, fields, geom, t):
        return torch.from_numpy(fields.copy())

    def choose(self, value, own, other, dist, segments, geom):
        own_np = (own & 1).reshape(-1).numpy().astype(np.uint8)
        llr = prior_llr(dist.reshape(-1).numpy().astype(np.float64), SCALE_PRIOR)
        fix = ldpc_correct(value, own_np, llr, segments, geom.blocks, self.rate)
        code = torch.where(torch.from_numpy(fix.flips).reshape(own.shape), other, own)
        return code, DecodeReport(blocks=fix.blocks, failed_blocks=fix.failed_blocks,
                                  failed_scales=int(fix.failed.sum()))


class OwnScales(ScaleCodec):
    knob = "own"

    def encode(self, scales):
        return None
