"""The quantized tensors: :class:`NVFP4`, :class:`MXFP4`, :class:`FP8` and :class:`CompensatedNVFP4`.

Each holds its fields as they are stored (packed codes, raw scale bytes, float32 amax or scale) and
checks them on request (:meth:`check`, what every op does with a container it is given).
"""

from __future__ import annotations

import dataclasses

import torch

from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK, Format
from tracefp4.formats.validation import check_codes, check_grid, describe, shape_tuple

__all__ = ["FP8", "MXFP4", "NVFP4", "CompensatedNVFP4"]


class _PackedFP4:
    """Codes two per byte: the logical shape is the codes' with the last dim doubled."""

    codes: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))


@dataclasses.dataclass
class NVFP4(_PackedFP4):
    """An NVFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]``, two 4-bit codes per byte, element 2i in the low nibble.
    scales: torch.float8_e4m3fn ``[..., K//16]``, one block scale per 16 elements.
    global_amax: float32, a scalar (per tensor) or ``[..., 1]`` (per row), finite and non-negative.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor

    fmt = Format.NVFP4

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.global_amax.nbytes

    @classmethod
    def from_rows(cls, codes: torch.Tensor, scales: torch.Tensor, global_amax: torch.Tensor, lead) -> "NVFP4":
        """A container of a kernel's 2-D outputs (codes ``[R, K/2]``, scale bytes ``[R, K/16]``) for a
        tensor with leading dims ``lead``."""
        return cls(codes.reshape(*lead, codes.shape[-1]),
                   scales.view(torch.float8_e4m3fn).reshape(*lead, scales.shape[-1]), global_amax)

    def check(self, *, scan_scales: bool = True) -> "NVFP4":
        """Raise ValueError unless codes, scales and global amax agree (see :func:`check_grid`, which
        takes ``scan_scales``)."""
        check_codes(self.codes, NVFP4_BLOCK, "NVFP4")
        check_grid(Format.NVFP4, self.scales, self.global_amax, self.shape, "NVFP4", device=self.codes.device,
                   scan_scales=scan_scales)
        return self


@dataclasses.dataclass
class MXFP4(_PackedFP4):
    """An MXFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]`` packed as in :class:`NVFP4`.
    scales: uint8 ``[..., K//32]``, biased E8M0 exponents (value ``2^(s - 127)``; 255 is NaN).
    """

    codes: torch.Tensor
    scales: torch.Tensor

    fmt = Format.MXFP4

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    @classmethod
    def from_rows(cls, codes: torch.Tensor, scales: torch.Tensor, lead) -> "MXFP4":
        """A container of a kernel's 2-D outputs for a tensor with leading dims ``lead``."""
        return cls(codes.reshape(*lead, codes.shape[-1]), scales.reshape(*lead, scales.shape[-1]))

    def check(self, *, scan_scales: bool = True) -> "MXFP4":
        """Raise ValueError unless codes and scales agree (see :func:`check_grid`, which takes
        ``scan_scales``)."""
        check_codes(self.codes, MXFP4_BLOCK, "MXFP4")
        check_grid(Format.MXFP4, self.scales, None, self.shape, "MXFP4", device=self.codes.device, scan_scales=scan_scales)
        return self


@dataclasses.dataclass
class FP8:
    """An FP8 E4M3 tensor with one float32 scale per row (activations, KV cache, W8A8 weights).

    data: torch.float8_e4m3fn ``[..., K]``; scale: float32 ``[..., 1]`` (``amax / 448``, 1 for a zero row).
    """

    data: torch.Tensor
    scale: torch.Tensor

    fmt = Format.FP8

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def codes(self) -> torch.Tensor:
        """The E4M3 codes as uint8 ``[..., K]`` (a view): bit 7 the sign, bits 0..6 the magnitude code."""
        return self.data.view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def check(self) -> "FP8":
        """Raise ValueError unless data and scale have the documented dtypes and shapes."""
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float8_e4m3fn or self.data.dim() == 0:
            raise ValueError(f"FP8 data: expected float8_e4m3fn of shape [..., K], got {describe(self.data)}")
        expect = (*shape_tuple(self.data.shape[:-1]), 1)
        if (
            not isinstance(self.scale, torch.Tensor)
            or self.scale.dtype != torch.float32
            or shape_tuple(self.scale.shape) != expect
        ):
            raise ValueError(f"FP8 scale: expected float32 of shape {expect}, got {describe(self.scale)}")
        return self


@dataclasses.dataclass
class CompensatedNVFP4:
    """An activation quantized twice (QUADS' residual activation compensation): ``first`` is the
    NVFP4 quantization of x (a global amax per row), ``residual`` that of ``x - dequantize(first)`` kept
    on the compensated channels of each row and zero elsewhere. Its value is the float32 sum of both."""

    first: NVFP4
    residual: NVFP4

    fmt = Format.NVFP4

    @property
    def shape(self) -> torch.Size:
        return self.first.shape

    @property
    def nbytes(self) -> int:
        return self.first.nbytes + self.residual.nbytes
