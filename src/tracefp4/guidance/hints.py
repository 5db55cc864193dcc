"""Rollout-guided rounding: what the rollout records, and how the trainer uses it.

The rollout quantizes a site and keeps a :class:`Hint`: its block scales, global amax, and per
element either the whole 4-bit code (``full``) or the low bit of the code's magnitude (``lsb``). The
trainer quantizes its own, slightly different, value of the same site *on the rollout's grid* and,
of the two codewords bracketing it, picks the one the hint names: with ``full``, the member nearer
the rollout's code on the signed code line (so the trainer's code is never farther from the
rollout's than its own round-to-nearest code); with ``lsb``, the member whose low magnitude bit
matches (adjacent codewords alternate in it). An element that sits on a codeword keeps it.

FP8 E4M3 sites are guided the same way (their adjacent codes alternate in the lowest code bit too):
an FP8 hint's grid is the per-row float32 scale, ``full`` keeps the 8-bit code of each element and
``lsb`` its lowest bit.

Every hint is validated where it enters (:meth:`Hint.check`): a malformed one is a ValueError,
never NaN output or a read past a buffer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tracefp4.formats.constants import Format, HintMode
from tracefp4.formats import (
    FP8,
    MXFP4,
    NVFP4,
    check_grid,
    dequantize,
    fp8_lsb_bits,
    guided_codes,
    guided_fp8,
    lsb_bits,
    straight_through,
)
from tracefp4.formats.validation import checked_scale_copy
from tracefp4.guidance.report import DecodeReport

__all__ = ["Hint", "encode_hint", "guided_quantize", "guided_fake_quant", "hint_cat", "record_format",
           "elements_per_byte", "lsb_of_codes", "hint_site_bytes"]

#: The format a stored grid belongs to, told by its scales' dtype (E4M3 block scales: NVFP4; E8M0
#: bytes: MXFP4; a float32 row scale: FP8).
_FORMAT_OF_SCALES = {torch.float8_e4m3fn: Format.NVFP4, torch.uint8: Format.MXFP4, torch.float32: Format.FP8}


def record_format(scales: torch.Tensor, what: str = "record") -> Format:
    """The element format of a record from the dtype of its ``.scales`` tensor."""
    fmt = _FORMAT_OF_SCALES.get(getattr(scales, "dtype", None))
    if fmt is None:
        raise ValueError(f"{what} scales: dtype {getattr(scales, 'dtype', type(scales).__name__)} is no known grid "
                         "(float8_e4m3fn: NVFP4, uint8: MXFP4, float32: FP8)")
    return fmt


def elements_per_byte(fmt: Format, mode: HintMode) -> int:
    """Elements per byte of a hint's data: 8 for lsb; a full code per nibble (FP4) or per byte (FP8)."""
    if mode is HintMode.LSB:
        return 8
    return 2 if fmt.fp4 else 1


def hint_site_bytes(mode: HintMode, fmt: Format, site_shape: Sequence[int]) -> int:
    """Store bytes per token of a hint of a site with per-token shape ``(*lead, K)``: its data, its
    scales (one E4M3/E8M0 byte per block of FP4; FP8's float32 row scale) and NVFP4's float32 row amax."""
    rows, k = math.prod(int(d) for d in site_shape[:-1]), int(site_shape[-1])
    data = rows * k // elements_per_byte(fmt, mode)
    scales = rows * torch.float32.itemsize if fmt is Format.FP8 else rows * (k // fmt.block)
    amax = rows * torch.float32.itemsize if fmt is Format.NVFP4 else 0
    return data + scales + amax


def lsb_of_codes(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The lsb hint data of full codes (packed FP4 ``[..., K//2]`` or FP8 ``[..., K]``)."""
    return lsb_bits(codes) if fmt.fp4 else fp8_lsb_bits(codes)


@dataclasses.dataclass
class Hint:
    """What the rollout recorded at one quantization site, for a tensor of logical shape ``shape``.

    data: uint8. ``lsb``: low magnitude bit of each code, eight per byte (element 8j+i in bit i),
        ``[..., K//8]``. ``full``: the packed 4-bit codes, ``[..., K//2]`` (FP8: the 8-bit codes, ``[..., K]``).
    scales: the block scales (float8_e4m3fn for NVFP4, biased E8M0 uint8 for MXFP4), or FP8's float32
        row scale ``[..., 1]``.
    global_amax: float32 scalar or ``[..., 1]`` (NVFP4), None for MXFP4 and FP8.
    """

    mode: HintMode
    fmt: Format
    data: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        if self.fmt is Format.FP8:  # one scale per row: the row length is the data's
            return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * elements_per_byte(self.fmt, self.mode)))
        return torch.Size((*self.scales.shape[:-1], self.scales.shape[-1] * self.fmt.block))

    def data_shape(self, shape) -> tuple[int, ...]:
        """The shape this hint's data has for a tensor of logical ``shape``."""
        return (*tuple(shape[:-1]), shape[-1] // elements_per_byte(self.fmt, self.mode))

    def check(self) -> "Hint":
        """Raise ValueError unless mode, format, data, scales and global amax agree.

        data: uint8 ``[..., K//8]`` (lsb) or ``[..., K//2]`` (full); scales and global amax as in
        :func:`tracefp4.formats.validation.check_grid` (no NaN scale codes; NVFP4 needs a finite
        non-negative float32 amax, MXFP4 has none).
        """
        shape = self._check_kind()
        check_grid(self.fmt, self.scales, self.global_amax, shape, "hint")
        expect = self.data_shape(shape)
        data = self.data
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != expect:
            found = f"{data.dtype} of shape {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"hint data: expected uint8 of shape {expect} for {self.mode.value} hints, got {found}")
        return self

    def _check_kind(self) -> torch.Size:
        """Mode, format and scales' rank, so that :attr:`shape` means something; returns it."""
        if not isinstance(self.mode, HintMode) or not isinstance(self.fmt, Format):
            raise ValueError(f"hint: mode and fmt must be HintMode and Format, got {self.mode!r}, {self.fmt!r}")
        if not isinstance(self.scales, torch.Tensor) or self.scales.dim() == 0:
            raise ValueError(f"hint scales: expected a tensor of shape [..., K/{self.fmt.block}], got {self.scales!r}")
        if self.fmt is Format.FP8 and (not isinstance(self.data, torch.Tensor) or self.data.dim() == 0):
            raise ValueError(f"hint data: expected a uint8 tensor [..., K or K/8] for an FP8 hint, got {self.data!r}")
        return self.shape

    @property
    def rows(self) -> int:
        """Token rows (the leading dim) of a record's hint."""
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the rollout has to keep for this site."""
        extra = self.global_amax.nbytes if self.global_amax is not None else 0
        return self.data.nbytes + self.scales.nbytes + extra

    def bytes_per_token(self) -> int:
        return hint_site_bytes(self.mode, self.fmt, tuple(self.shape)[1:])

    def kept_elements(self) -> None:
        return None  # a hint records every element

    def decode(self, x: torch.Tensor) -> tuple["Hint", DecodeReport]:
        """A hint needs no decoding: itself and an empty report."""
        return self, DecodeReport()

    def cat(self, others: Sequence["Hint"]) -> "Hint":
        return hint_cat([self, *others])

    def select(self, index) -> "Hint":
        """The hint for ``x[index]`` where ``index`` indexes leading dims only (e.g. token positions).

        A per-tensor global amax is shared by every slice.
        """
        amax = self.global_amax
        if amax is not None and amax.dim() > 0:
            amax = amax[index]
        return Hint(self.mode, self.fmt, self.data[index], self.scales[index], amax)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors for storage (``{prefix}.bits`` or ``.codes``, ``.scales``, ``.global_amax``)."""
        field = "bits" if self.mode is HintMode.LSB else "codes"
        out = {f"{prefix}.{field}": self.data, f"{prefix}.scales": self.scales}
        if self.global_amax is not None:
            out[f"{prefix}.global_amax"] = self.global_amax
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "Hint":
        """Inverse of :meth:`to_tensors`; format and mode follow from the names and dtypes."""
        mode = HintMode.LSB if f"{prefix}.bits" in tensors else HintMode.FULL
        data_key = f"{prefix}.bits" if mode is HintMode.LSB else f"{prefix}.codes"
        if data_key not in tensors or f"{prefix}.scales" not in tensors:
            raise ValueError(f"no hint named {prefix!r} (have: {sorted(tensors)})")
        scales = tensors[f"{prefix}.scales"]
        fmt = record_format(scales, f"hint {prefix!r}")
        amax = tensors.get(f"{prefix}.global_amax")
        if fmt is Format.NVFP4 and amax is None:
            raise ValueError(f"NVFP4 hint {prefix!r} lacks its global_amax")
        return cls(mode, fmt, tensors[data_key], scales, amax).check()


def hint_cat(hints: list[Hint], dim: int = 0) -> Hint:
    """Concatenate hints of the same mode and format along a leading dim (per-row global amax only)."""
    if not hints:
        raise ValueError("hint_cat: no hints given")
    for h in hints:
        if not isinstance(h, Hint):
            raise ValueError(f"hint_cat: expected Hints, got {type(h).__name__}")
        h.check()
    h0 = hints[0]
    for h in hints[1:]:
        if (h.mode, h.fmt) != (h0.mode, h0.fmt):
            raise ValueError(f"hint_cat: mixing {h.mode.value}/{h.fmt.value} with {h0.mode.value}/{h0.fmt.value}")
    amax = None
    if h0.global_amax is not None:
        if any(h.global_amax.dim() == 0 for h in hints):
            raise ValueError("hint_cat: hints with a per-tensor global amax cannot be concatenated")
        amax = torch.cat([h.global_amax for h in hints], dim=dim)
    return Hint(
        h0.mode,
        h0.fmt,
        torch.cat([h.data for h in hints], dim=dim),
        torch.cat([h.scales for h in hints], dim=dim),
        amax,
    )


def encode_hint(q: NVFP4 | MXFP4 | FP8, mode: str | HintMode = "lsb") -> Hint:
    """What the rollout records for a quantized site (see :class:`Hint`), on the container's device."""
    mode = HintMode(mode)
    if isinstance(q, FP8):
        q.check()
        data = fp8_lsb_bits(q.codes) if mode is HintMode.LSB else q.codes.clone()
        return Hint(mode, Format.FP8, data, q.scale.clone())
    if not isinstance(q, (NVFP4, MXFP4)):
        raise ValueError(f"encode_hint: expected an NVFP4, MXFP4 or FP8 tensor, got {type(q).__name__}")
    q.check(scan_scales=False)
    scales = checked_scale_copy(q.fmt, q.scales, type(q).__name__)  # NaN codes refused before any kernel
    data = lsb_bits(q.codes) if mode is HintMode.LSB else q.codes.clone()
    amax = q.global_amax.clone() if isinstance(q, NVFP4) else None
    return Hint(mode, q.fmt, data, scales, amax)


def guided_quantize(x: torch.Tensor, hint: Hint) -> NVFP4 | MXFP4 | FP8:
    """Quantize ``x`` on the hint's grid, each element rounded to the bracket member the hint names.

    The result is on x's device (the hint's tensors may live elsewhere and are moved to it).
    """
    if not isinstance(hint, Hint):
        raise ValueError(f"expected a Hint, got {type(hint).__name__}")
    hint._check_kind()  # the grid and data are checked against x by guided_codes, in one pass
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(hint.shape):
        found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"hint shape mismatch: x has shape {found} but the hint was recorded for shape "
            f"{tuple(hint.shape)} ({hint.fmt.value}, {hint.mode.value})"
        )
    full = hint.mode is HintMode.FULL
    data = {"codes": hint.data} if full else {"lsb": hint.data}
    if hint.fmt is Format.FP8:
        if hint.global_amax is not None:
            raise ValueError("hint global_amax: an FP8 hint has none (its grid is the row scale)")
        return guided_fp8(x, hint.scales, owner="hint", **data)
    return guided_codes(x, hint.fmt, hint.scales, hint.global_amax, owner="hint", **data)


def guided_fake_quant(x: torch.Tensor, hint: Hint) -> torch.Tensor:
    """Guided quantize-dequantize in x's dtype, with a straight-through (identity) gradient."""
    return straight_through(x, dequantize(guided_quantize(x.detach(), hint)))
