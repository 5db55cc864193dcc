"""The Triton backend of each op (:mod:`tracefp4.formats.triton_kernels`, imported on first use: triton
and a GPU toolchain are needed only for CUDA tensors and the interpreter tests). Inputs arrive
validated; each function has the signature of its op's table in :mod:`tracefp4.formats.dispatch`."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import Format
from tracefp4.formats.containers import MXFP4, NVFP4
from tracefp4.formats.rows import as_rows, per_row_values
from tracefp4.formats.validation import raise_non_finite

__all__ = ["dequantize", "guided_codes", "lsb_bits", "quantize_mxfp4", "quantize_nvfp4"]


def _kernels():
    from tracefp4.formats import triton_kernels

    return triton_kernels


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool, values: bool
                   ) -> tuple[NVFP4, torch.Tensor | None]:
    """NVFP4 of ``x`` (see the numba backend); no fused values (the caller dequantizes)."""
    tk = _kernels()
    rows = as_rows(x)
    n = rows.shape[0]
    if amax is not None:
        by_row = per_row_values(amax, x.shape)
    else:
        by_row = tk.row_amax(rows)  # a NaN/Inf row gets a finite amax here; the quantize pass flags it
        if per_row:
            amax = by_row.reshape(*x.shape[:-1], 1)
        else:  # an empty tensor has amax 0 (S_enc 1), as on the CPU
            amax = by_row.amax() if n else torch.zeros((), dtype=torch.float32, device=x.device)
            by_row = amax.expand(n).contiguous()
    codes, scales, bad = tk.quantize_nvfp4(rows, by_row)
    raise_non_finite(x, bad)
    return NVFP4.from_rows(codes, scales, amax, x.shape[:-1]), None


def quantize_mxfp4(x: torch.Tensor, rceil: bool) -> MXFP4:
    codes, scales, bad = _kernels().quantize_mxfp4(as_rows(x), rceil)
    raise_non_finite(x, bad)
    return MXFP4.from_rows(codes, scales, x.shape[:-1])


def dequantize(rows: torch.Tensor, scale_rows: torch.Tensor, fmt: Format, row_div: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    return _kernels().dequantize(rows, scale_rows, fmt.value, row_div, fmt.block).to(dtype)


def guided_codes(x: torch.Tensor, fmt: Format, scale_rows: torch.Tensor, s_dec: torch.Tensor, hint_rows: torch.Tensor,
                 full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().guided_codes(as_rows(x), scale_rows, fmt.value, s_dec, hint_rows, fmt.block, full)


def lsb_bits(rows: torch.Tensor) -> torch.Tensor:
    return _kernels().lsb_bits(rows)
