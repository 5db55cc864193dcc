"""The expert-GEMM interface: prepare one GEMM's routed-expert weights, multiply rows grouped by expert."""

from __future__ import annotations

import abc
import dataclasses
from typing import Protocol

import torch

from tracefp4.formats.quantizers import Quantizer

__all__ = ["ExpertGEMM", "Groups", "PreparedWeight"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """Rows sorted by expert: expert e owns rows ``offsets[e]:offsets[e+1]`` (int64, on the rows'
    device). Built without a host synchronisation; :meth:`counts` synchronises (dense backend only)."""

    offsets: torch.Tensor

    @classmethod
    def of(cls, expert_ids: torch.Tensor, n_experts: int) -> Groups:
        counts = torch.bincount(expert_ids, minlength=n_experts)
        return cls(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))

    @property
    def n_experts(self) -> int:
        return self.offsets.numel() - 1

    def counts(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()


class PreparedWeight(Protocol):
    """One GEMM's ``[E, N, K]`` routed-expert weights in the form a backend multiplies."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    @property
    def nbytes(self) -> int: ...


class ExpertGEMM(abc.ABC):
    """A grouped-GEMM backend for routed experts (see :mod:`tracefp4.engines.experts`)."""

    name: str

    @abc.abstractmethod
    def prepare(self, weight: torch.Tensor, quantizer: Quantizer | None, *, gradients: bool = False,
                copy: bool = False) -> PreparedWeight:
        """``weight [E, N, K]`` (the HF layout: row n of expert e multiplies the K inputs) quantized by
        ``quantizer`` (None: BF16, used as is) in the form :meth:`matmul` takes. ``gradients``: the
        result carries a straight-through gradient to ``weight`` (the trainer's QAT). ``copy``: quantize
        from a copy (an FSDP-gathered weight's storage is freed after its layer, and the CPU kernels'
        numpy view of an input would pin its size)."""

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, weight: PreparedWeight, groups: Groups) -> torch.Tensor:
        """``x [R, K]`` (rows grouped by expert as ``groups`` says) times each row's expert's
        ``weight[e].T`` -> ``[R, N]`` in x's dtype."""

    def __repr__(self) -> str:
        return f"<expert GEMM {self.name}>"
