"""One quantizer object per format and tensor role (Transformer Engine's pattern).

A :class:`Quantizer` knows one element format and how one kind of tensor is scaled in it; the
precision plan (:class:`tracefp4.engines.plan.PrecisionPlan`) picks one per quantization site, so no
caller ever branches on the format. Every quantizer offers the same five operations:

* ``quantize(x)``: round-to-nearest, returning the format's container (:class:`NVFP4`, :class:`MXFP4`,
  :class:`FP8`);
* ``dequantize(q)``: float32 values of a container;
* ``guided_quantize(x, grid, codes=... | lsb=...)``: ``x`` on someone else's grid (the rollout's
  block scales and global amax), each element rounded to the member of its bracket that the rollout's
  packed codes (full information) or packed low bits name (rollout-guided rounding);
* ``grid(q)``: the grid a container sits on (what a rollout has to record besides the elements);
* ``fake_quant(x)``: ``dequantize(quantize(x))`` in x's dtype with a straight-through gradient.

FP8 E4M3 (the activations of W4A8) has no codeword bracket to guide, so its quantizer is not
``guidable`` and refuses ``guided_quantize``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import torch

from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK, Format, ScaleMode
from tracefp4.formats.numerics import (
    FP8,
    MXFP4,
    NVFP4,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    guided_codes,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    straight_through,
)

__all__ = [
    "Grid",
    "Quantizer",
    "NVFP4Quantizer",
    "MXFP4Quantizer",
    "FP8Quantizer",
    "AmaxScope",
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
    """One format, one scaling rule; see the module docstring for the five operations."""

    fmt: str
    block: int
    guidable: bool = True

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor) -> NVFP4 | MXFP4 | FP8: ...

    @abc.abstractmethod
    def dequantize(self, q) -> torch.Tensor: ...

    def guided_quantize(
        self, x: torch.Tensor, grid: Grid, *, codes: torch.Tensor | None = None, lsb: torch.Tensor | None = None
    ) -> NVFP4 | MXFP4:
        raise ValueError(f"{self.fmt} has no FP4 codeword bracket to guide")

    @abc.abstractmethod
    def grid(self, q) -> Grid: ...

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Round-to-nearest quantize-dequantize in x's dtype, identity gradient to ``x``."""
        return straight_through(x, self.dequantize(self.quantize(x.detach())))


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 (blocks of 16, E4M3 block scales, FP32 global amax over ``amax_scope``)."""

    amax_scope: AmaxScope = "row"
    fmt = Format.NVFP4.value
    block = NVFP4_BLOCK

    def _amax(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.amax_scope == "expert":
            if x.dim() < 2:
                raise ValueError(f"amax_scope 'expert' needs [E, ..., K], got shape {tuple(x.shape)}")
            dims = tuple(range(1, x.dim()))
            amax = x.detach().abs().amax(dim=dims, keepdim=True).to(torch.float32)
            return amax.expand(*x.shape[:-1], 1)
        return None

    def quantize(self, x: torch.Tensor) -> NVFP4:
        amax = self._amax(x)
        if amax is not None:
            return quantize_nvfp4(x, global_amax=amax)
        return quantize_nvfp4(x, per_row=self.amax_scope == "row")

    def dequantize(self, q: NVFP4) -> torch.Tensor:
        return dequantize_nvfp4(q)

    def guided_quantize(self, x, grid, *, codes=None, lsb=None) -> NVFP4:
        if grid.global_amax is None:
            raise ValueError("an NVFP4 grid needs its global_amax")
        return guided_codes(x, Format.NVFP4, grid.scales, grid.global_amax, codes=codes, lsb=lsb)

    def grid(self, q: NVFP4) -> Grid:
        return Grid(q.scales, q.global_amax)


@dataclasses.dataclass(frozen=True)
class MXFP4Quantizer(Quantizer):
    """MXFP4 (blocks of 32, E8M0 block exponents chosen by ``scale_mode``)."""

    scale_mode: ScaleMode = ScaleMode.FLOOR
    fmt = Format.MXFP4.value
    block = MXFP4_BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale_mode", ScaleMode(self.scale_mode))

    def quantize(self, x: torch.Tensor) -> MXFP4:
        return quantize_mxfp4(x, scale_mode=self.scale_mode.value)

    def dequantize(self, q: MXFP4) -> torch.Tensor:
        return dequantize_mxfp4(q)

    def guided_quantize(self, x, grid, *, codes=None, lsb=None) -> MXFP4:
        return guided_codes(x, Format.MXFP4, grid.scales, None, codes=codes, lsb=lsb)

    def grid(self, q: MXFP4) -> Grid:
        return Grid(q.scales)


@dataclasses.dataclass(frozen=True)
class FP8Quantizer(Quantizer):
    """FP8 E4M3 with one float32 scale ``amax / 448`` per row (the activations of W4A8)."""

    fmt = "fp8"
    block = 1
    guidable = False

    def quantize(self, x: torch.Tensor) -> FP8:
        return quantize_fp8(x)

    def dequantize(self, q: FP8) -> torch.Tensor:
        return dequantize_fp8(q)

    def grid(self, q: FP8) -> Grid:
        return Grid(q.scale)

