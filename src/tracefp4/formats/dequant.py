"""Dequantization of the FP4 containers (and of any container, :func:`dequantize`), on the codes' device."""

from __future__ import annotations

import torch

from tracefp4.formats.constants import Format
from tracefp4.formats.containers import FP8, MXFP4, NVFP4
from tracefp4.formats.dispatch import Op, implementation
from tracefp4.formats.grid import nvfp4_global_encode_scale
from tracefp4.formats.rows import as_rows, per_row_values, row_count
from tracefp4.formats.validation import check_out_dtype, expect

__all__ = ["dequantize", "dequantize_blocks", "dequantize_fp8", "dequantize_mxfp4", "dequantize_nvfp4",
           "global_divisor"]


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: Format, row_div: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(value(code) * scale) / row_div[row]`` in float32 (then ``dtype``) of a validated container,
    on the codes' device."""
    rows = as_rows(codes)
    scale_rows = as_rows(scales.view(torch.uint8))
    row_div = row_div.to(codes.device)  # a global amax may be kept elsewhere than the codes
    out = implementation(Op.DEQUANTIZE, codes, what="codes")(rows, scale_rows, fmt, row_div, dtype)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize_nvfp4(q: NVFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * float(s8) / S_enc``, on the codes' device; ``dtype``
    bfloat16: those values rounded to nearest even (equal to ``.to(torch.bfloat16)`` of the float32)."""
    check_out_dtype(dtype, "dequantize_nvfp4")
    expect(q, NVFP4).check()
    s_enc = per_row_values(nvfp4_global_encode_scale(q.global_amax), q.shape)
    return _dequantize(q.codes, q.scales, Format.NVFP4, s_enc, dtype)


def dequantize_blocks(q: NVFP4 | MXFP4) -> torch.Tensor:
    """float32 ``value(code) * block scale``, without NVFP4's global scale: the operand a packed FP4
    GEMM multiplies (exact, and exact in bf16: an E2M1 value has 2 significant bits, an E4M3 scale 4,
    an E8M0 one 1). ``dequantize(q)`` is exactly ``dequantize_blocks(q) / global_divisor(q)`` in float32."""
    if isinstance(q, NVFP4):
        q.check()
        fmt = Format.NVFP4
    elif isinstance(q, MXFP4):
        q.check()
        fmt = Format.MXFP4
    else:
        raise ValueError(f"dequantize_blocks: expected an NVFP4 or MXFP4 tensor, got {type(q).__name__}")
    ones = torch.ones(row_count(q.codes.shape), dtype=torch.float32, device=q.codes.device)
    return _dequantize(q.codes, q.scales, fmt, ones)


def global_divisor(q: NVFP4 | MXFP4) -> torch.Tensor:
    """float32 ``[..., 1]``: what :func:`dequantize_blocks` is divided by per row (S_enc; 1 for MXFP4)."""
    lead = (*q.codes.shape[:-1], 1)
    if isinstance(q, NVFP4):
        return per_row_values(nvfp4_global_encode_scale(q.global_amax), q.shape).reshape(lead)
    return torch.ones(lead, dtype=torch.float32, device=q.codes.device)


def dequantize_fp8(q: FP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 ``value(code) * scale`` of an FP8 container, on its device (``dtype`` bfloat16: rounded
    to nearest even)."""
    check_out_dtype(dtype, "dequantize_fp8")
    expect(q, FP8).check()
    rows = as_rows(q.data.view(torch.uint8))
    scale = q.scale.to(torch.float32).reshape(rows.shape[0]).contiguous()
    out = implementation(Op.DEQUANTIZE_FP8, rows, what="data")(rows, scale)
    return out.reshape(q.data.shape).to(dtype)


def dequantize_mxfp4(q: MXFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * 2^(s - 127)``, on the codes' device (``dtype`` bfloat16:
    rounded to nearest even)."""
    check_out_dtype(dtype, "dequantize_mxfp4")
    expect(q, MXFP4).check()
    # x / 1 == x: the NVFP4 formula with S_enc 1
    ones = torch.ones(row_count(q.codes.shape), dtype=torch.float32, device=q.codes.device)
    return _dequantize(q.codes, q.scales, Format.MXFP4, ones, dtype)


def dequantize(q: NVFP4 | MXFP4 | FP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 (or ``dtype`` bfloat16, rounded to nearest even) values of an NVFP4, MXFP4 or FP8 container."""
    if isinstance(q, NVFP4):
        return dequantize_nvfp4(q, dtype)
    if isinstance(q, MXFP4):
        return dequantize_mxfp4(q, dtype)
    if isinstance(q, FP8):
        return dequantize_fp8(q, dtype)
    raise ValueError(f"dequantize: expected an NVFP4, MXFP4 or FP8 tensor, got {type(q).__name__}")
