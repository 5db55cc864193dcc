"""NVFP4 quantization of bf16 rows in C: a rollout site's codes, scales and dequantized values in one
pass (``csrc/site_quant.h``, in the library :mod:`tracefp4.formats.cgemm` builds).

The same float32 operations as the numba kernel (:func:`tracefp4.formats.kernels.nvfp4_quantize`)
and the readable reference, so the same bits (tests/test_csite.py checks all three against each
other, atol=0); vectorised with AVX-512 where the CPU has it (a decode step's site is a few
microseconds of work, where the numba kernel's per-element code and its dispatch cost about 1 ns an
element and 7 us a call). :func:`tracefp4.formats.numerics.quantize_nvfp4` calls it for bf16 CPU
input with a per-row or given amax (what every rollout site quantizes); a per-tensor amax, other
dtypes and machines without the library take the numba kernels.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tracefp4.formats import cgemm
from tracefp4.formats.constants import NVFP4_BLOCK

__all__ = ["IMPLS", "available", "nvfp4_rows", "quantize_into"]

#: ``impl`` values of :func:`nvfp4_rows`: the best the CPU runs, portable C, AVX-512.
IMPLS = {"auto": 0, "portable": 1, "avx512": 2}
#: Bytes of input per thread before a call splits its rows over threads. The OpenMP threads are
#: PyTorch's, awake from the GEMM before the site, so a fork costs a few microseconds: at the mid
#: preset's decode step the expert sites ([64, 512], [256, 256] bf16) run on two threads, K/V rows
#: ([256, 64]) on one (in a vLLM generation, 32 KiB gave 0.20 s of expert sites where 1 MiB gave 0.23 s).
GRAIN_BYTES = 32 << 10


def available() -> bool:
    """Whether the C kernel is loaded (no warning: the numba kernels are the fallback)."""
    return cgemm.library() is not None


def nvfp4_rows(x: torch.Tensor, amax: torch.Tensor | None, *, values: bool, threads: int | None = None,
               impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, np.ndarray]:
    """Rows ``x`` bf16 ``[R, K]`` (contiguous, CPU, K a multiple of 16) -> ``(codes [R, K/2] uint8,
    scale bytes [R, K/16] uint8 (E4M3 patterns), amax [R] float32, values [R, K] bf16 or None, bad [R]
    bool)``. ``amax``: float32 ``[R]`` per-row global amaxes, or None to use each row's own. ``bad``
    flags rows holding a NaN or Inf (their outputs are garbage; the caller refuses them).
    ``threads``: default torch's intra-op count, used only from :data:`GRAIN_BYTES` a thread.
    Raises RuntimeError when the library is unavailable, ValueError on operands it cannot take."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % NVFP4_BLOCK or not x.is_cpu:
        raise ValueError(f"nvfp4_rows x: expected CPU bf16 [R, K] with K a multiple of {NVFP4_BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    r, k = x.shape
    own = amax is None
    if own:
        amax = torch.empty(r, dtype=torch.float32)
    elif amax.dtype != torch.float32 or tuple(amax.shape) != (r,) or amax.device.type != "cpu":
        raise ValueError(f"nvfp4_rows amax: expected CPU float32 [{r}], got {amax.dtype} {tuple(amax.shape)}")
    else:
        amax = amax.contiguous()
    codes = torch.empty(r, k // 2, dtype=torch.uint8)
    scales = torch.empty(r, k // NVFP4_BLOCK, dtype=torch.uint8)
    out = torch.empty(r, k, dtype=torch.bfloat16) if values else None
    any_bad = quantize_into(x, amax, codes, scales, out, own_amax=own, threads=threads, impl=impl)
    bad = ~torch.isfinite(x).all(dim=1).numpy() if any_bad else np.zeros(r, dtype=np.bool_)
    return codes, scales, amax, out, bad


def quantize_into(x: torch.Tensor, amax: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  values: torch.Tensor | None, *, own_amax: bool, threads: int | None = None, impl: str = "auto") -> bool:
    """The pass of :func:`nvfp4_rows` into tensors the caller made, in whatever shapes it wants them
    (a site's ``[..., K/2]`` codes, ``[..., K/16]`` scales of any one-byte dtype, ``[..., 1]`` amax:
    the hot path then needs no views): all contiguous on the CPU, ``x`` bf16 with K (its last dim) a
    multiple of 16, holding R rows' worth of elements each (``amax`` R, read unless ``own_amax``).
    Returns whether some row held a NaN or Inf (its outputs are garbage; the caller refuses it)."""
    lib = cgemm.library()
    if lib is None:
        raise RuntimeError(f"the tracefp4 CPU kernel library is unavailable: {cgemm.unavailable_reason()}")
    if impl not in IMPLS:
        raise ValueError(f"nvfp4_rows impl: expected one of {sorted(IMPLS)}, got {impl!r}")
    k = x.shape[-1] if x.dim() else 0
    r = x.numel() // k if k else 0
    outs = (amax, codes, scales) if values is None else (amax, codes, scales, values)
    if (x.dtype != torch.bfloat16 or not k or k % NVFP4_BLOCK or not x.is_contiguous() or not x.is_cpu
            or not all(t.is_cpu and t.is_contiguous() for t in outs) or amax.numel() != r
            or codes.numel() != r * k // 2 or scales.numel() != r * k // NVFP4_BLOCK or scales.element_size() != 1
            or amax.dtype != torch.float32 or (values is not None and values.numel() != r * k)):
        raise ValueError(f"quantize_into: operands do not fit bf16 rows of {k} elements (x {x.dtype} "
                         f"{tuple(x.shape)}, amax {tuple(amax.shape)}, codes {tuple(codes.shape)}, scales "
                         f"{tuple(scales.shape)})")
    nbytes = 2 * r * k
    t = 1 if nbytes < 2 * GRAIN_BYTES else max(1, min(int(threads or torch.get_num_threads()), nbytes // GRAIN_BYTES))
    first_bad = ctypes.c_int64(-1)
    rc = lib.tfp4_nvfp4_quantize(x.data_ptr(), r, k, amax.data_ptr(), int(own_amax), codes.data_ptr(), scales.data_ptr(),
                                 None if values is None else values.data_ptr(), t, IMPLS[impl], ctypes.byref(first_bad))
    if rc != 0:
        why = "out of memory" if rc == -3 else f"implementation {impl!r} not run by this CPU"
        raise ValueError(f"nvfp4_rows: {why} (x {tuple(x.shape)})")
    return first_bad.value >= 0
