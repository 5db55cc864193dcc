"""Every kernel, CPU or GPU, sees a tensor ``[..., K]`` as 2-D rows ``[R, K]``; per-row quantities are ``[R]``."""

from __future__ import annotations

import math

import numpy as np
import torch

from tracefp4.formats import kernels

__all__ = ["as_rows", "chunks", "kernel_rows", "numpy_of", "per_row_values", "row_count"]


def row_count(shape) -> int:
    """Number of rows of a tensor of ``shape``: the product of its leading dims (1 for a vector)."""
    return math.prod(shape[:-1])


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` as contiguous rows ``[R, K]`` on its own device (no copy when contiguous)."""
    return t.detach().contiguous().reshape(row_count(t.shape), t.shape[-1])


def per_row_values(t: torch.Tensor, shape) -> torch.Tensor:
    """A scalar or ``[..., 1]`` tensor as float32 ``[R]`` for a tensor of ``shape``, on t's device."""
    return t.to(torch.float32).expand(*shape[:-1], 1).reshape(row_count(shape)).contiguous()


def numpy_of(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array (no copy when contiguous)."""
    return t.detach().contiguous().numpy()


#: The numba kernels' view of each input dtype: 16-bit formats travel as their bit patterns, and the
#: integer dtype tells the kernel which widening to compile (see :mod:`tracefp4.formats.kernels`).
_KERNEL_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def kernel_rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as 2-D rows for the numba kernels, without a copy when ``x`` is contiguous.

    float32 stays float32; bfloat16 and float16 are passed as their bits and widened in the kernels,
    so no float32 temporary of the input is ever made.
    """
    return as_rows(x).view(_KERNEL_VIEW[x.dtype]).numpy()


def chunks(rows: np.ndarray) -> int:
    """How many row chunks a numba kernel splits ``rows`` into (one per grain of bytes)."""
    return kernels.row_chunks(rows.shape[0], rows.nbytes)
