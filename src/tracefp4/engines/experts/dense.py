"""The dense backend: weights as values in memory, one torch matmul per expert with rows.

BF16 (no quantizer): the parameter itself, ``F.linear`` in the model's dtype. FP4: the exact block
values ``value(code) * scale`` (:func:`~tracefp4.formats.dequant.dequantize_blocks`, exact in bf16)
and the expert's global divisor, multiplied in float32 and divided after the sum, so the result is
the packed kernels' up to the order of the float32 additions (see :mod:`tracefp4.engines.experts`).
FP8 (W8A8, one scale per output channel): the dequantized weight ``value(code) * scale`` in float32
(not exact in bf16, so kept in float32 on both paths) with divisor 1, multiplied in float32.
With ``gradients`` (the trainer's QAT forward) the block values are a straight-through stand-in for
``weight * divisor``, so the gradient reaching the weight is that of ``x @ weight.T``.

It runs every forward (any plan, device, dtype, with or without gradients): the oracle's fallback.
Held as parameters: ``weight`` (the values) and, where there is one, ``divisor``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping

import torch
import torch.nn.functional as F

from tracefp4.engines.experts.base import ExpertGEMM, Routing, WeightParameters, check_parameter_names
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.formats import FP8, dequantize_blocks, dequantize_fp8, global_divisor, straight_through
from tracefp4.formats.quantizers import Quantizer

__all__ = ["DenseGEMM", "DenseWeight", "expert_divisor"]


@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """``values [E, N, K]`` (the weight itself for BF16; FP4 block values, bf16 or with gradients
    float32) and ``divisor [E]`` float32 (None: no global scale)."""

    values: torch.Tensor
    divisor: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.divisor is None else self.divisor.nbytes)


def expert_divisor(q) -> torch.Tensor:
    """float32 ``[E]``: the one global divisor of each expert of an ``[E, N, K]`` quantized weight
    (NVFP4 with one amax per expert; 1 for MXFP4). A quantizer that scaled rows of one expert
    differently is refused."""
    rows = global_divisor(q)  # [E, N, 1]
    per_expert = rows[:, :1, :]
    if not bool((rows == per_expert).all()):
        raise ValueError("expert weights: the quantizer gave rows of one expert different global scales "
                         "(expected one global scale per expert: amax_scope 'expert')")
    return per_expert.reshape(-1).contiguous()


class DenseGEMM(ExpertGEMM):
    name = "dense"

    def supports(self, plan: PrecisionPlan | None, device: torch.device | str, dtype: torch.dtype, *,
                 gradients: bool = False) -> bool:
        return True  # torch matmuls on values: whatever the plan, device, dtype or gradients

    def to_parameters(self, weight: DenseWeight) -> WeightParameters:
        tensors = {"weight": weight.values}
        if weight.divisor is not None:
            tensors["divisor"] = weight.divisor
        return WeightParameters(tensors)

    def from_parameters(self, tensors: Mapping[str, torch.Tensor], spec: Hashable) -> DenseWeight:
        check_parameter_names(self.name, tensors, ("weight",), ("divisor",))
        if spec is not None:
            raise ValueError(f"the dense expert GEMM's parameters say all there is (spec None), got spec {spec!r}")
        return DenseWeight(tensors["weight"], tensors.get("divisor"))

    def prepare(self, weight, quantizer: Quantizer | None, *, gradients: bool = False, copy: bool = False
                ) -> DenseWeight:
        if quantizer is None:
            return DenseWeight(weight if gradients else weight.detach())
        try:
            q = quantizer.quantize(weight.detach().clone() if copy else weight.detach())
        except ValueError as e:
            raise ValueError(f"expert weight: {e}") from e
        if isinstance(q, FP8):  # per-channel scales: the float32 weight itself, no per-expert divisor
            blocks, divisor = dequantize_fp8(q), torch.ones(q.shape[0], dtype=torch.float32)
        else:
            blocks, divisor = dequantize_blocks(q), expert_divisor(q)
        if gradients:
            stand_in = weight.to(torch.float32) * divisor.to(weight.device)[:, None, None]
            return DenseWeight(straight_through(stand_in, blocks), divisor.to(weight.device))
        exact = torch.bfloat16 if quantizer.fp4 else torch.float32  # FP4 block values are exact in bf16
        return DenseWeight(blocks.to(device=weight.device, dtype=exact), divisor.to(weight.device))

    def matmul(self, x: torch.Tensor, weight: DenseWeight, routing: Routing, *, per_token: bool) -> torch.Tensor:
        if routing.n_experts == 1 and routing.top_k == 1:  # a dense MLP: every row, in order, to the one expert
            return self._linear(x, weight, 0)
        order, offsets, inverse = routing.grouped
        rows = x[order // routing.top_k] if per_token else x[order]
        counts = (offsets[1:] - offsets[:-1]).tolist()  # a host synchronisation: one matmul per expert
        chunks = torch.split(rows, counts, dim=0)
        outs = [self._linear(c, weight, e) for e, c in enumerate(chunks) if counts[e]]
        grouped = torch.cat(outs) if outs else x.new_zeros(0, weight.values.shape[1])
        return grouped[inverse]

    @staticmethod
    def _linear(rows: torch.Tensor, weight: DenseWeight, e: int) -> torch.Tensor:
        """``rows`` times expert ``e``'s weight, in rows' dtype: BF16 as it is; a quantized weight in
        float32, divided by the expert's divisor after the sum."""
        w = weight.values[e]
        if weight.divisor is None:
            return F.linear(rows, w)
        return (F.linear(rows.to(torch.float32), w.to(torch.float32)) / weight.divisor[e]).to(rows.dtype)
