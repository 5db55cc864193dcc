"""The packed-FP4 CPU backend: weights held as FP4 codes two per byte, a scale byte per block and a
divisor per expert (0.5625 bytes per parameter for NVFP4), multiplied by our C kernel
(:mod:`tracefp4.formats.clib`: AMX where the CPU and OS run it, AVX-512 BF16 where the CPU has it,
portable C elsewhere; the codes held in the layout the CPU multiplies fastest), one call per GEMM per
layer, parallel over (expert, output columns) on torch's thread count.

It runs FP4 rollouts (an FP4 weight quantizer, no gradients) on the CPU with bf16 activations, where
the C kernel is built (:func:`tracefp4.formats.clib.available`, which warns once when it is not).
Held as parameters: ``weight`` (the codes), ``weight_scale`` (the scale bytes) and ``divisor``; the
spec is ``(fmt, layout)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping

import torch

from tracefp4.engines.experts.base import (SILU_GATE, Activation, ExpertGEMM, Routing, WeightParameters,
                                           check_parameter_names)
from tracefp4.engines.experts.dense import expert_divisor
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats import clib
from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK, Format
from tracefp4.formats.quantizers import Quantizer

__all__ = ["PackedCPUGEMM", "PackedWeight", "pack"]


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """``codes`` and ``scales`` uint8 in ``layout`` (the quantizer's codes and its E4M3 or E8M0 scale
    bytes, :func:`tracefp4.formats.clib.kernel_layout` and :func:`~tracefp4.formats.clib.kernel_scales`),
    ``divisor`` float32 ``[E]``, ``fmt``: what the packed kernels multiply."""

    codes: torch.Tensor
    scales: torch.Tensor
    divisor: torch.Tensor
    fmt: Format
    layout: clib.Layout = clib.Layout.TILES

    @property
    def block(self) -> int:
        return NVFP4_BLOCK if self.fmt is Format.NVFP4 else MXFP4_BLOCK

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, N, K)`` of the weight (from the scales' shape: read per call, so no copy)."""
        if self.layout is clib.Layout.PANELS:
            e, panels, nb, _ = self.scales.shape
            return (e, 16 * panels, nb * self.block)
        e, n, nb = self.scales.shape
        return (e, n, nb * self.block)

    def standard_codes(self) -> torch.Tensor:
        """The codes in the standard layout ``[E, N, K/2]`` (what the quantizer returned)."""
        return clib.standard_layout(self.codes, self.shape[2], self.block, self.layout)

    def standard_scales(self) -> torch.Tensor:
        """The scale bytes in the standard layout ``[E, N, K/block]``."""
        return clib.standard_scales(self.scales, self.layout)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.divisor.nbytes


def pack(weight: torch.Tensor, quantizer: Quantizer, layout: clib.Layout | None = None) -> PackedWeight:
    """``weight [E, N, K]`` quantized by ``quantizer`` (the plan's weight quantizer: the codes are
    the ones it produces) as a :class:`PackedWeight` in ``layout`` (default: the one this CPU
    multiplies fastest, :func:`tracefp4.formats.clib.preferred_layout`)."""
    if not quantizer.fp4:
        raise ValueError(f"packed experts need an FP4 weight quantizer, got {quantizer.fmt.value}")
    if weight.dim() != 3 or weight.shape[1] % 4:
        raise ValueError(f"packed experts: expected [E, N, K] weights with N a multiple of 4, got {tuple(weight.shape)}")
    layout = clib.preferred_layout(weight.shape[1]) if layout is None else clib.Layout(layout)
    try:
        q = quantizer.quantize(weight.detach())
    except ValueError as e:
        raise ValueError(f"expert weight: {e}") from e
    scales = q.scales.view(torch.uint8) if q.scales.dtype == torch.float8_e4m3fn else q.scales
    return PackedWeight(clib.kernel_layout(q.codes, quantizer.block, layout), clib.kernel_scales(scales, layout),
                        expert_divisor(q), quantizer.fmt, layout)


class PackedCPUGEMM(ExpertGEMM):
    name = "cpu_fp4"

    def supports(self, plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                 gradients: bool = False) -> bool:
        # the kernel's availability asked last: it builds the library (and warns) on first use
        return (plan is not None and not gradients and plan.weight_quantizer.fp4
                and torch.device(device).type == "cpu" and dtype == torch.bfloat16 and clib.available())

    def to_parameters(self, weight: PackedWeight) -> WeightParameters:
        return WeightParameters({"weight": weight.codes, "weight_scale": weight.scales, "divisor": weight.divisor},
                                (weight.fmt, weight.layout))

    def from_parameters(self, tensors: Mapping[str, torch.Tensor], spec: Hashable) -> PackedWeight:
        check_parameter_names(self.name, tensors, ("weight", "weight_scale", "divisor"))
        if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], Format)
                and isinstance(spec[1], clib.Layout)):
            raise ValueError(f"the cpu_fp4 expert GEMM's spec is (Format, clib.Layout), got {spec!r}")
        return PackedWeight(tensors["weight"], tensors["weight_scale"], tensors["divisor"], *spec)

    def prepare(self, weight, quantizer: Quantizer | None, *, gradients: bool = False, copy: bool = False
                ) -> PackedWeight:
        if quantizer is None or gradients:
            raise ValueError("the packed FP4 backend holds quantized weights without gradients (use 'dense')")
        return pack(weight, quantizer)

    def matmul(self, x: torch.Tensor, weight: PackedWeight, routing: Routing, *, per_token: bool) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the packed FP4 CPU kernel takes bf16 activations, got {x.dtype}")
        # the kernel groups the pairs by expert and reads / writes rows in place (no sort or gathers here)
        return clib.routed_gemm(x, routing.ids, weight.codes, weight.scales, weight.divisor, weight.fmt,
                                 per_token=per_token, layout=weight.layout)

    def activate(self, gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
        # the SiLU gate in one C pass, bit for bit torch's F.silu(gate) * up (tests/test_csite.py)
        if act == SILU_GATE and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return clib.silu_gate(gate_up)
        return super().activate(gate_up, act)

    def combine(self, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # one C pass, bit for bit the base class's five tensor ops (tests/test_fp4_gemm.py)
        return clib.topk_combine(out, weights)
