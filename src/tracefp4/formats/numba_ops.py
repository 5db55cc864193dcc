"""The numba backend of each op (:mod:`tracefp4.formats.kernels`): CPU tensors, every dtype, every
amax scope. Inputs arrive validated; each function has the signature of its op's table in
:mod:`tracefp4.formats.dispatch`."""

from __future__ import annotations

import numpy as np
import torch

from tracefp4.formats import kernels
from tracefp4.formats.constants import E4M3_VALUES, E8M0_VALUES, MXFP4_BLOCK, NVFP4_BLOCK, Format
from tracefp4.formats.containers import MXFP4, NVFP4
from tracefp4.formats.rows import chunks, kernel_rows, numpy_of, per_row_values
from tracefp4.formats.validation import raise_non_finite

__all__ = ["dequantize", "guided_codes", "lsb_bits", "quantize_mxfp4", "quantize_nvfp4"]

_NO_BLOCK_MAX = np.empty((0, 0), dtype=np.uint32)
_SCALE_VALUES = {Format.NVFP4: E4M3_VALUES, Format.MXFP4: E8M0_VALUES}


def _tensor_amax(x: torch.Tensor, rows: np.ndarray, bad: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """A per-tensor amax needs the whole tensor before the first scale: a first pass keeps the block
    amaxes (1/8 of a bf16 input's size) so the second only has to code. Returns the amax, the amax
    per row (all equal) and the block amaxes."""
    n, k = rows.shape
    row_amax = np.empty(n, dtype=np.float32)
    block_max = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint32)
    kernels.nvfp4_block_amax(rows, block_max, row_amax, bad, chunks(rows))
    raise_non_finite(x, bad)
    amax = torch.from_numpy(row_amax).amax() if n else torch.zeros((), dtype=torch.float32)
    row_amax[:] = amax.item()
    return amax, row_amax, block_max


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool, values: bool
                   ) -> tuple[NVFP4, torch.Tensor | None]:
    """NVFP4 of ``x`` with the given ``amax``, or each row's own (``per_row``), or the tensor's; the
    dequantized bf16 values from the same pass when ``values`` (bf16 input only)."""
    values = values and x.dtype == torch.bfloat16
    rows = kernel_rows(x)
    n, k = rows.shape
    bad = np.zeros(n, dtype=np.bool_)
    block_max = _NO_BLOCK_MAX
    own_amax = amax is None and per_row
    if amax is not None:
        row_amax = per_row_values(amax, x.shape).numpy()  # read only: written back only with own_amax
    elif per_row:
        row_amax = np.empty(n, dtype=np.float32)  # the kernel finds each row's amax in its own pass
    else:
        amax, row_amax, block_max = _tensor_amax(x, rows, bad)
    codes = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint8)
    out = np.empty((n, k // 2), dtype=np.uint32) if values else _NO_BLOCK_MAX  # empty u32: no values wanted
    kernels.nvfp4_quantize(rows, row_amax, own_amax, block_max, codes, scales, out, bad, chunks(rows))
    raise_non_finite(x, bad)
    if own_amax:
        amax = torch.from_numpy(row_amax).reshape(*x.shape[:-1], 1)
    q = NVFP4.from_rows(torch.from_numpy(codes), torch.from_numpy(scales), amax, x.shape[:-1])
    return q, torch.from_numpy(out).view(torch.bfloat16).reshape(x.shape) if values else None


def quantize_mxfp4(x: torch.Tensor, rceil: bool) -> MXFP4:
    rows = kernel_rows(x)
    n, k = rows.shape
    codes = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // MXFP4_BLOCK), dtype=np.uint8)
    bad = np.zeros(n, dtype=np.bool_)
    kernels.mxfp4_quantize(rows, rceil, codes, scales, bad, chunks(rows))
    raise_non_finite(x, bad)
    return MXFP4.from_rows(torch.from_numpy(codes), torch.from_numpy(scales), x.shape[:-1])


def dequantize(rows: torch.Tensor, scale_rows: torch.Tensor, fmt: Format, row_div: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """float32 ``(value(code) * scale) / row_div[row]`` of packed code rows ``[R, K/2]``, cast to
    ``dtype`` (bfloat16: rounded to nearest even, which is the op's definition)."""
    out = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.float32)
    nchunks = kernels.row_chunks(rows.shape[0], out.nbytes)
    kernels.dequantize(rows.numpy(), scale_rows.numpy(), _SCALE_VALUES[fmt], numpy_of(row_div), fmt.block, out, nchunks)
    return torch.from_numpy(out).to(dtype)


def guided_codes(x: torch.Tensor, fmt: Format, scale_rows: torch.Tensor, s_dec: torch.Tensor, hint_rows: torch.Tensor,
                 full: bool) -> tuple[torch.Tensor, np.ndarray]:
    """Packed code rows of ``x`` on the grid, each element the bracket member the hint names, and the
    per-row non-finite flags. The kernels rebuild each block's encode factor from the stored scale
    byte, as the reference does."""
    rows = kernel_rows(x)
    n, k = rows.shape
    out = np.empty((n, k // 2), dtype=np.uint8)
    bad = np.zeros(n, dtype=np.bool_)
    guided = kernels.guided_full if full else kernels.guided_lsb
    guided(rows, scale_rows.numpy(), _SCALE_VALUES[fmt], s_dec.numpy(), hint_rows.numpy(), fmt.block, out, bad,
           chunks(rows))
    return torch.from_numpy(out), bad


def lsb_bits(rows: torch.Tensor) -> torch.Tensor:
    """Packed code rows ``[R, K/2]`` -> their low magnitude bits, eight per byte ``[R, K/8]``."""
    out = np.empty((rows.shape[0], rows.shape[1] // 4), dtype=np.uint8)
    # a few bit operations per byte: one thread keeps up with memory until the codes are large
    nchunks = kernels.row_chunks(rows.shape[0], rows.nbytes, grain=16 * kernels.GRAIN_BYTES)
    kernels.pack_lsb(rows.numpy(), out, nchunks)
    return torch.from_numpy(out)
