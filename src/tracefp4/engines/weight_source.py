"""One GEMM's weight as a seam hands it to the path's expert-weights hook and the rollout's cache.

A :data:`WeightSource` is an ``[E, N, K]`` tensor (routed-expert weights), or parts ``[E, N_i, K]``
that the GEMM multiplies as their concatenation along N: a dense MLP's ``gate_proj`` and ``up_proj``,
which the GEMM takes as one ``[gate; up]`` weight on one global scale, as vLLM's merged
``gate_up_proj`` holds them. Kept in parts so that a cache keys on the parameters themselves (their
storage and version counters) and joins them only when it prepares them.
"""

from __future__ import annotations

import torch

__all__ = ["WeightSource", "joined_weight"]

WeightSource = torch.Tensor | tuple[torch.Tensor, ...]


def joined_weight(w: WeightSource) -> torch.Tensor:
    """The ``[E, N, K]`` weight a :data:`WeightSource` stands for (parts concatenated along N: a copy,
    which carries gradients back to each part)."""
    return w if isinstance(w, torch.Tensor) else torch.cat(w, dim=1)
