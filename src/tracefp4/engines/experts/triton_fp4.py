"""The packed-FP4 GPU backend: weights held as FP4 codes two per byte, a scale byte per block and a
divisor per expert (0.5625 bytes per parameter for NVFP4), multiplied by our Triton kernel
(:mod:`tracefp4.engines.experts.triton_gemm`), one launch per GEMM per layer, with no host
synchronisation (the pairs are grouped by expert on the device, the grid sized from shapes), so a
decode step can be captured in a CUDA graph.

Layout: the standard one the quantizer returns, codes ``[E, N, K/2]`` (element 2i in the low nibble)
and scale bytes ``[E, N, K/block]``, K contiguous per output channel: a tile of output channels is
then rows of contiguous bytes, which a GPU loads coalesced and decodes in registers; the CPU
backend's tiles and panels layouts serve AVX-512 and AMX register shapes, not a GPU's loads. The
same layout also means preparing a weight is quantizing it, with no permutation.

Numerics: ``bf16(fl32(x @ w_blocks.T) / S_enc)``, the convention every backend shares (see
:mod:`tracefp4.engines.experts`), so only the order of the float32 additions differs from the CPU
backend; the SiLU gate and the top-k combine are the base class's torch expressions, which the CPU
backend's C passes equal bit for bit.

It runs FP4 rollouts (an FP4 weight quantizer, no gradients) on CUDA with bf16 activations where
triton is installed. Held as parameters: ``weight`` (the codes), ``weight_scale`` (the scale bytes)
and ``divisor``; the spec is the :class:`~tracefp4.formats.constants.Format`.

:class:`TritonBF16GEMM` (``triton_bf16``) is the same kernel over the bf16 weights themselves, for
BF16 rollouts on CUDA: no host synchronisation either (the dense backend's per-expert matmuls read the
counts back), and the baseline an FP4 rollout's speed is measured against on a GPU. Held as the
dense backend holds a BF16 weight (``weight``, spec None).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Hashable, Mapping

import torch

from tracefp4.engines.experts.base import ExpertGEMM, Routing, WeightParameters, check_parameter_names
from tracefp4.engines.experts.dense import DenseWeight, expert_divisor
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats.constants import Format
from tracefp4.formats.quantizers import Quantizer

__all__ = ["TritonBF16GEMM", "TritonFP4GEMM", "TritonWeight"]


@dataclasses.dataclass(frozen=True)
class TritonWeight:
    """``codes`` u8 ``[E, N, K/2]`` and ``scales`` u8 ``[E, N, K/block]`` (E4M3 or E8M0 bytes) in the
    quantizer's layout, ``divisor`` float32 ``[E]``, ``fmt``."""

    codes: torch.Tensor
    scales: torch.Tensor
    divisor: torch.Tensor
    fmt: Format

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.codes.shape
        return (e, n, 2 * half)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.divisor.nbytes


def _triton_rollout(device: torch.device | str, dtype: torch.dtype, gradients: bool) -> bool:
    """A forward without gradients on CUDA with bf16 activations, where triton is installed."""
    return (not gradients and torch.device(device).type == "cuda" and dtype == torch.bfloat16
            and importlib.util.find_spec("triton") is not None)  # found without importing it


class TritonFP4GEMM(ExpertGEMM):
    name = "triton_fp4"

    def supports(self, plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                 gradients: bool = False) -> bool:
        return plan is not None and plan.weight_quantizer.fp4 and _triton_rollout(device, dtype, gradients)

    def to_parameters(self, weight: TritonWeight) -> WeightParameters:
        return WeightParameters({"weight": weight.codes, "weight_scale": weight.scales, "divisor": weight.divisor},
                                weight.fmt)

    def from_parameters(self, tensors: Mapping[str, torch.Tensor], spec: Hashable) -> TritonWeight:
        check_parameter_names(self.name, tensors, ("weight", "weight_scale", "divisor"))
        if not isinstance(spec, Format) or not spec.fp4:
            raise ValueError(f"the triton_fp4 expert GEMM's spec is an FP4 Format, got {spec!r}")
        return TritonWeight(tensors["weight"], tensors["weight_scale"], tensors["divisor"], spec)

    def prepare(self, weight, quantizer: Quantizer | None, *, gradients: bool = False, copy: bool = False
                ) -> TritonWeight:
        if quantizer is None or gradients or not quantizer.fp4:
            raise ValueError("the Triton FP4 backend holds FP4-quantized weights without gradients (use 'dense')")
        if weight.dim() != 3:
            raise ValueError(f"triton_fp4 experts: expected [E, N, K] weights, got {tuple(weight.shape)}")
        try:
            q = quantizer.quantize(weight.detach().clone() if copy else weight.detach())
        except ValueError as e:
            raise ValueError(f"expert weight: {e}") from e
        scales = q.scales.view(torch.uint8) if q.scales.dtype == torch.float8_e4m3fn else q.scales
        divisor = expert_divisor(q).to(weight.device)
        return TritonWeight(q.codes.contiguous(), scales.contiguous(), divisor, Format(quantizer.fmt))

    def matmul(self, x: torch.Tensor, weight: TritonWeight, routing: Routing, *, per_token: bool) -> torch.Tensor:
        from tracefp4.engines.experts.triton_gemm import routed_fp4_gemm  # imports triton: only here

        order, offsets, _ = routing.grouped
        return routed_fp4_gemm(x, order, offsets, weight.codes, weight.scales, weight.divisor, weight.fmt,
                               fanout=routing.top_k if per_token else 1)


class TritonBF16GEMM(ExpertGEMM):
    name = "triton_bf16"

    def supports(self, plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                 gradients: bool = False) -> bool:
        return plan is None and _triton_rollout(device, dtype, gradients)

    def to_parameters(self, weight: DenseWeight) -> WeightParameters:
        return WeightParameters({"weight": weight.values})

    def from_parameters(self, tensors: Mapping[str, torch.Tensor], spec: Hashable) -> DenseWeight:
        check_parameter_names(self.name, tensors, ("weight",))
        if spec is not None:
            raise ValueError(f"the triton_bf16 expert GEMM's parameters say all there is (spec None), got {spec!r}")
        return DenseWeight(tensors["weight"])

    def prepare(self, weight, quantizer: Quantizer | None, *, gradients: bool = False, copy: bool = False
                ) -> DenseWeight:
        if quantizer is not None or gradients:
            raise ValueError("the Triton BF16 backend multiplies the bf16 weights as they are, without gradients")
        return DenseWeight(weight.detach().clone() if copy else weight.detach())

    def matmul(self, x: torch.Tensor, weight: DenseWeight, routing: Routing, *, per_token: bool) -> torch.Tensor:
        from tracefp4.engines.experts.triton_gemm import routed_bf16_gemm  # imports triton: only here

        order, offsets, _ = routing.grouped
        return routed_bf16_gemm(x, order, offsets, weight.values, fanout=routing.top_k if per_token else 1)
