"""Prepared weights kept across a rollout's forwards, refreshed when the source weights change."""

from __future__ import annotations

from typing import Any

import torch

from tracefp4.engines.experts.base import ExpertGEMM, PreparedWeight
from tracefp4.engines.weight_source import WeightSource, joined_weight
from tracefp4.formats.quantizers import Quantizer

__all__ = ["PreparedCache"]


class PreparedCache:
    """``(owner, name) -> prepared weight``, keyed on the source tensors' storage and version counters
    (an optimizer step or a weight load bumps them), shapes, dtypes, the quantizer and the backend, so
    a stale entry is never used (a weight given in parts, :data:`~tracefp4.engines.weight_source.WeightSource`,
    is keyed on every part and joined only when prepared). One entry per weight: a new key replaces
    the old one.

    An in-place update that does not bump the version counter is not seen: torch's fused AdamW
    (``fused=True``, transformers' default ``adamw_torch_fused``) writes the parameters without bumping
    it, so whoever steps such an optimizer on the weights a rollout caches calls :meth:`clear` after.
    """

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[tuple, PreparedWeight]] = {}

    def get(self, owner: Any, name: str, weight: WeightSource, quantizer: Quantizer | None, gemm: ExpertGEMM
            ) -> PreparedWeight:
        parts = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
        key = (tuple((p.data_ptr(), p._version, tuple(p.shape), p.dtype) for p in parts), quantizer, gemm.name)
        hit = self._entries.get((owner, name))
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, gemm.prepare(joined_weight(weight), quantizer))
            self._entries[(owner, name)] = hit
        return hit[1]

    def clear(self) -> None:
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the prepared weights (what an FP4 rollout keeps beside its source weights)."""
        return sum(p.nbytes for _, p in self._entries.values())
