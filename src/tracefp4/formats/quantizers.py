"""One quantizer object per format and tensor role (Transformer Engine's pattern).

A :class:`Quantizer` knows one element format and how one kind of tensor is scaled in it; the
precision plan (:class:`tracefp4.engines.plan.PrecisionPlan`) picks one per quantization site, so no
caller ever branches on the format. Every quantizer offers the same six operations:

* ``quantize(x)``: round-to-nearest, returning the format's container (:class:`NVFP4`, :class:`MXFP4`,
  :class:`FP8`);
* ``dequantize(q)``: float32 values of a container;
* ``quantize_values(x)``: ``quantize(x)`` and ``dequantize`` of it in x's dtype (what the next op
  sees), in one pass where the format's kernel can (NVFP4 on bf16 CPU input);
* ``guided_quantize(x, grid, codes=... | lsb=...)``: ``x`` on someone else's grid (the rollout's
  block scales and global amax), each element rounded to the member of its bracket that the rollout's
  packed codes (full information) or packed low bits name (rollout-guided rounding);
* ``grid(q)``: the grid a container sits on (what a rollout has to record besides the elements);
* ``fake_quant(x)``: ``dequantize(quantize(x))`` in x's dtype with a straight-through gradient.

FP8 E4M3 (W4A8 activations, the W8A8 plan) is guided the same way: adjacent E4M3 codes of one sign
differ in their lowest code bit exactly as adjacent E2M1 codes do, so the same ``full``/``lsb`` hints
name a bracket member on the E4M3 line (:func:`tracefp4.formats.fp8.guided_fp8`). The one
quantizer that is not ``guidable`` is :class:`CompensatedNVFP4Quantizer` (QUADS' residual activation
compensation: two passes, no single codeword to guide); it refuses ``guided_quantize`` and ``grid``.

Every operation runs on the input's device (see :mod:`tracefp4.formats.dispatch`) and
validates the containers and grids it is given. :func:`quantize` and :func:`fake_quant` are the
functional forms, one call per format, built on these objects.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import torch

from tracefp4.formats.constants import DEQUANTIZE_DTYPES, MXFP4_BLOCK, NVFP4_BLOCK, Format, ScaleMode
from tracefp4.formats.containers import FP8, MXFP4, NVFP4, CompensatedNVFP4
from tracefp4.formats.dequant import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4
from tracefp4.formats.fp8 import guided_fp8, quantize_fp8
from tracefp4.formats.guided import guided_codes
from tracefp4.formats.mxfp4 import quantize_mxfp4
from tracefp4.formats.nvfp4 import quantize_dequantize_nvfp4, quantize_nvfp4, quantize_nvfp4_4over6
from tracefp4.formats.rac import dequantize_nvfp4_rac, quantize_nvfp4_rac, rac_channel_count
from tracefp4.formats.rows import as_rows
from tracefp4.formats.straight_through import straight_through
from tracefp4.formats.validation import check_out_dtype, raise_non_finite

__all__ = [
    "Grid",
    "Quantizer",
    "NVFP4Quantizer",
    "MXFP4Quantizer",
    "FP8Quantizer",
    "CompensatedNVFP4Quantizer",
    "AmaxScope",
    "quantizer_for",
    "quantize",
    "fake_quant",
]

#: Which elements share one NVFP4 global amax: the whole tensor, each row (last dim), or each slice
#: along the first dim (one routed expert of an ``[E, N, K]`` weight).
AmaxScope = Literal["tensor", "row", "expert"]


@dataclasses.dataclass(frozen=True)
class Grid:
    """The grid a quantized tensor sits on: its block scales and, for NVFP4, its global amax
    (a scalar or ``[..., 1]``). Two paths that share a grid map the same value to the same bracket."""

    scales: torch.Tensor
    global_amax: torch.Tensor | None = None


class Quantizer(abc.ABC):
    """One format, one scaling rule; see the module docstring for the six operations."""

    fmt: Format
    block: int
    guidable: bool = True

    @property
    def fp4(self) -> bool:
        """4-bit codes two per byte (NVFP4, MXFP4): what the packed FP4 GEMM backends take."""
        return self.fmt.fp4

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor) -> NVFP4 | MXFP4 | FP8: ...

    @abc.abstractmethod
    def dequantize(self, q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float32 values of ``q``, or (``dtype`` bfloat16) those rounded to nearest even."""

    def _values(self, q, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(q)`` in ``dtype``: written in it where the dequantization writes it (no float32
        tensor between), else cast from float32; the same bits either way."""
        return self.dequantize(q, dtype if dtype in DEQUANTIZE_DTYPES else torch.float32).to(dtype)

    def quantize_values(self, x: torch.Tensor) -> tuple[NVFP4 | MXFP4 | FP8, torch.Tensor]:
        """``q = quantize(x)`` and ``dequantize(q)`` in x's dtype, bit for bit (a site's code and the
        value its next op sees)."""
        q = self.quantize(x)
        return q, self._values(q, x.dtype)

    def guided_quantize(
        self, x: torch.Tensor, grid: Grid, *, codes: torch.Tensor | None = None, lsb: torch.Tensor | None = None
    ) -> NVFP4 | MXFP4 | FP8:
        raise ValueError(f"{self!r} has no codeword bracket to guide")

    @abc.abstractmethod
    def grid(self, q) -> Grid: ...

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Round-to-nearest quantize-dequantize in x's dtype, identity gradient to ``x``."""
        return straight_through(x, self._values(self.quantize(x.detach()), x.dtype))


_AMAX_SCOPES = ("tensor", "row", "expert")
_BLOCK_MAX = (6, "4over6")


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 (blocks of 16, E4M3 block scales, FP32 global amax over ``amax_scope``).

    ``global_amax``, when given (a scalar or ``[..., 1]``, e.g. a calibrated amax), is used instead of
    measuring one over ``amax_scope``.

    ``block_max``: the value each block's maximum is mapped to by its E4M3 scale: ``6`` (the standard
    recipe) or ``"4over6"`` ("Four over Six", arXiv 2512.02010: per block, 4 or 6, whichever gives
    the smaller sum of squared errors, ties to 6; :func:`tracefp4.formats.reference.quantize_nvfp4_4over6`).
    Only round-to-nearest changes: the container, ``dequantize``, ``grid`` and ``guided_quantize``
    are the same, since the chosen block scale is stored as any block scale is (the 4-or-6 choice is
    implied by it; a guided path on that grid needs no extra bit).
    """

    amax_scope: AmaxScope = "row"
    global_amax: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    block_max: int | str = 6
    fmt = Format.NVFP4
    block = NVFP4_BLOCK

    def __post_init__(self) -> None:
        if self.amax_scope not in _AMAX_SCOPES:
            raise ValueError(f"amax_scope: expected one of {_AMAX_SCOPES}, got {self.amax_scope!r}")
        if self.block_max not in _BLOCK_MAX or isinstance(self.block_max, bool):
            raise ValueError(f"block_max: expected 6 or '4over6', got {self.block_max!r}")

    def _quantize(self, x: torch.Tensor, **kw) -> NVFP4:
        return (quantize_nvfp4_4over6 if self.block_max == "4over6" else quantize_nvfp4)(x, **kw)

    def _expert_amax(self, x: torch.Tensor) -> torch.Tensor:
        """One amax per slice along the first dim (one routed expert), as ``[..., 1]`` over x's rows."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"x: amax_scope 'expert' needs [E, ..., K], got {getattr(x, 'shape', type(x).__name__)}")
        amax = x.detach().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True).to(torch.float32)
        if not bool(torch.isfinite(amax).all()):  # name the bad element, as every quantize does
            raise_non_finite(x, ~torch.isfinite(as_rows(x)).all(dim=-1))
        return amax.expand(*x.shape[:-1], 1)

    def _amax(self, x: torch.Tensor) -> dict:
        if self.global_amax is not None:
            return {"global_amax": self.global_amax}
        if self.amax_scope == "expert":
            return {"global_amax": self._expert_amax(x)}
        return {"per_row": self.amax_scope == "row"}

    def quantize(self, x: torch.Tensor) -> NVFP4:
        return self._quantize(x, **self._amax(x))

    def quantize_values(self, x: torch.Tensor) -> tuple[NVFP4, torch.Tensor]:
        if self.block_max != 6:
            return super().quantize_values(x)
        return quantize_dequantize_nvfp4(x, **self._amax(x))

    def dequantize(self, q: NVFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(q, dtype)

    def guided_quantize(self, x, grid, *, codes=None, lsb=None) -> NVFP4:
        if grid.global_amax is None:
            raise ValueError("grid global_amax: an NVFP4 grid needs its global amax, got None")
        return guided_codes(x, Format.NVFP4, grid.scales, grid.global_amax, codes=codes, lsb=lsb)

    def grid(self, q: NVFP4) -> Grid:
        if not isinstance(q, NVFP4):
            raise ValueError(f"expected an NVFP4 tensor, got {type(q).__name__}")
        q.check()
        return Grid(q.scales, q.global_amax)


@dataclasses.dataclass(frozen=True)
class MXFP4Quantizer(Quantizer):
    """MXFP4 (blocks of 32, E8M0 block exponents chosen by ``scale_mode``)."""

    scale_mode: ScaleMode = ScaleMode.FLOOR
    fmt = Format.MXFP4
    block = MXFP4_BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale_mode", ScaleMode(self.scale_mode))

    def quantize(self, x: torch.Tensor) -> MXFP4:
        return quantize_mxfp4(x, scale_mode=self.scale_mode.value)

    def dequantize(self, q: MXFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(q, dtype)

    def guided_quantize(self, x, grid, *, codes=None, lsb=None) -> MXFP4:
        return guided_codes(x, Format.MXFP4, grid.scales, None, codes=codes, lsb=lsb)

    def grid(self, q: MXFP4) -> Grid:
        if not isinstance(q, MXFP4):
            raise ValueError(f"expected an MXFP4 tensor, got {type(q).__name__}")
        q.check()
        return Grid(q.scales)


@dataclasses.dataclass(frozen=True)
class FP8Quantizer(Quantizer):
    """FP8 E4M3 with one float32 scale per row of the last dim.

    The scale recipe: ``scale = amax / 448`` over the row (1 for an all-zero row), computed in float32,
    so the row's largest magnitude maps to E4M3's largest value 448 and nothing saturates; ``code =
    e4m3(clamp(x / scale, +-448))`` (round to nearest, ties to the even code), ``x_hat = value(code) *
    scale``. The row is the tensor's last dim wherever the plan puts FP8: an activation's token (or
    token x selected expert), a KV cache entry's token x KV head, and, for the routed-expert weights
    ``[E, N, K]``, each output channel n of each expert e (per-channel weight scales: one scale per
    ``[K]`` row). The grid a rollout records is the scale itself (4 bytes per row).
    """

    fmt = Format.FP8
    block = 1

    def quantize(self, x: torch.Tensor) -> FP8:
        return quantize_fp8(x)

    def dequantize(self, q: FP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(q, dtype)

    def guided_quantize(self, x, grid, *, codes=None, lsb=None) -> FP8:
        if grid.global_amax is not None:
            raise ValueError("grid global_amax: an FP8 grid is its row scale alone, got a global amax")
        return guided_fp8(x, grid.scales, codes=codes, lsb=lsb)

    def grid(self, q: FP8) -> Grid:
        if not isinstance(q, FP8):
            raise ValueError(f"expected an FP8 tensor, got {type(q).__name__}")
        q.check()
        return Grid(q.scale)


@dataclasses.dataclass(frozen=True)
class CompensatedNVFP4Quantizer(Quantizer):
    """NVFP4 per row with residual activation compensation (QUADS, arXiv 2607.15810): the residual of
    the first pass is quantized to NVFP4 again on the ``ceil(fraction * K)`` channels of each row with
    the largest first-pass error, and added back (:func:`tracefp4.formats.rac.quantize_nvfp4_rac`).
    ``fraction``: the compensated share of channels, in (0, 1] (QUADS' default 0.5)."""

    fraction: float = 0.5
    fmt = Format.NVFP4
    block = NVFP4_BLOCK
    guidable = False

    def __post_init__(self) -> None:
        rac_channel_count(NVFP4_BLOCK, self.fraction)  # validates the fraction

    def quantize(self, x: torch.Tensor) -> CompensatedNVFP4:
        return quantize_nvfp4_rac(x, self.fraction)

    def dequantize(self, q: CompensatedNVFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # the two passes' float32 sum, then one rounding (not a sum of two rounded values)
        return dequantize_nvfp4_rac(q).to(check_out_dtype(dtype, "dequantize"))

    def grid(self, q) -> Grid:
        raise ValueError("a compensated activation is two NVFP4 passes: it has no single grid to record or guide")


# --- functional forms ----------------------------------------------------------------------------


def quantizer_for(
    fmt: str | Format = "nvfp4", *, per_row: bool = False, global_amax=None, scale_mode: str = "floor"
) -> NVFP4Quantizer | MXFP4Quantizer:
    """The quantizer of :func:`quantize`'s arguments; an argument the format does not have is a
    ValueError (``per_row``/``global_amax`` are NVFP4's, a ``scale_mode`` other than floor MXFP4's)."""
    fmt = Format(fmt)
    mode = ScaleMode(scale_mode)
    if fmt is Format.NVFP4:
        if mode is not ScaleMode.FLOOR:
            raise ValueError(f"scale_mode: {mode.value!r} is an MXFP4 option; NVFP4 block scales are E4M3")
        return NVFP4Quantizer("row" if per_row else "tensor", global_amax=global_amax)
    if per_row or global_amax is not None:
        given = "per_row" if per_row else "global_amax"
        raise ValueError(f"{given}: an NVFP4 option; MXFP4 has no global amax (its E8M0 block scales are absolute)")
    return MXFP4Quantizer(mode)


def quantize(
    x: torch.Tensor, fmt: str | Format = "nvfp4", *, per_row: bool = False, global_amax=None, scale_mode: str = "floor"
) -> NVFP4 | MXFP4:
    """Round-to-nearest quantization in either format (see :func:`quantizer_for` for the options)."""
    return quantizer_for(fmt, per_row=per_row, global_amax=global_amax, scale_mode=scale_mode).quantize(x)


def fake_quant(
    x: torch.Tensor, fmt: str | Format = "nvfp4", *, per_row: bool = False, global_amax=None, scale_mode: str = "floor"
) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize with a straight-through gradient, in x's dtype."""
    return quantizer_for(fmt, per_row=per_row, global_amax=global_amax, scale_mode=scale_mode).fake_quant(x)

