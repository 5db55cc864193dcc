"""NVFP4 quantization of bf16 rows in C: a rollout site's codes, scales and dequantized values in one
pass (``csrc/site_quant.h``).

The same float32 operations as the numba kernel (:func:`tracefp4.formats.kernels.nvfp4_quantize`)
and the readable reference, so the same bits (the conformance test checks them, atol=0); vectorised
with AVX-512 where the CPU has it (a decode step's site is a few microseconds of work, where the numba
kernel's per-element code and its dispatch cost about 1 ns an element and 7 us a call). The dispatch
(:mod:`tracefp4.formats.dispatch`) sends bf16 CPU input with a per-row or given amax here (what every
rollout site quantizes); a per-tensor amax, other dtypes and machines without the library take the
numba kernels.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tracefp4.formats.clib.call import NOT_RUN, Impl, call, first_bad, impl_name, impl_of, threads_for, tracing
from tracefp4.formats.clib.loader import library
from tracefp4.formats.constants import NVFP4_BLOCK
from tracefp4.formats.containers import NVFP4
from tracefp4.formats.rows import per_row_values
from tracefp4.formats.validation import raise_non_finite

__all__ = ["GRAIN_BYTES", "nvfp4_rows", "quantize_into", "quantize_nvfp4", "supports_nvfp4"]

#: Bytes of input per thread before a call splits its rows over threads. The OpenMP threads are
#: PyTorch's, awake from the GEMM before the site, so a fork costs a few microseconds: at the mid
#: preset's decode step the expert sites ([64, 512], [256, 256] bf16) run on two threads, K/V rows
#: ([256, 64]) on one (in a vLLM generation, 32 KiB gave 0.20 s of expert sites where 1 MiB gave 0.23 s).
GRAIN_BYTES = 32 << 10


def nvfp4_rows(x: torch.Tensor, amax: torch.Tensor | None, *, values: bool, threads: int | None = None,
               impl: Impl | str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                   np.ndarray]:
    """Rows ``x`` bf16 ``[R, K]`` (contiguous, CPU, K a multiple of 16) -> ``(codes [R, K/2] uint8,
    scale bytes [R, K/16] uint8 (E4M3 patterns), amax [R] float32, values [R, K] bf16 or None, bad [R]
    bool)``. ``amax``: float32 ``[R]`` per-row global amaxes, or None to use each row's own. ``bad``
    flags rows holding a NaN or Inf (their outputs are garbage; the caller refuses them).
    ``threads``: default torch's intra-op count, used only from :data:`GRAIN_BYTES` a thread.
    Raises RuntimeError when the library is unavailable, ValueError on operands it cannot take."""
    if tracing():
        codes, scales, row_amax, out, bad = torch.ops.tracefp4.nvfp4_rows(x, amax, threads or 0, impl_name(impl))
        return codes, scales, row_amax, out if values else None, bad.numpy()
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


#: The entry point of each input dtype (float32 rows: codes and scales, no values, as the numba kernel).
_ENTRY = {torch.bfloat16: "nvfp4_quantize", torch.float32: "nvfp4_quantize_f32"}


def _fits(x: torch.Tensor, amax: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
          values: torch.Tensor | None) -> bool:
    k = x.shape[-1] if x.dim() else 0
    r = x.numel() // k if k else 0
    outs = (amax, codes, scales) if values is None else (amax, codes, scales, values)
    return not (x.dtype not in _ENTRY or (x.dtype == torch.float32 and values is not None) or not k
                or k % NVFP4_BLOCK or not x.is_contiguous() or not x.is_cpu
                or not all(t.is_cpu and t.is_contiguous() for t in outs) or amax.numel() != r
                or codes.numel() != r * k // 2 or scales.numel() != r * k // NVFP4_BLOCK or scales.element_size() != 1
                or amax.dtype != torch.float32 or (values is not None and values.numel() != r * k))


def quantize_into(x: torch.Tensor, amax: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  values: torch.Tensor | None, *, own_amax: bool, threads: int | None = None,
                  impl: Impl | str = "auto") -> bool:
    """The pass of :func:`nvfp4_rows` into tensors the caller made, in whatever shapes it wants them
    (a site's ``[..., K/2]`` codes, ``[..., K/16]`` scales of any one-byte dtype, ``[..., 1]`` amax:
    the hot path then needs no views): all contiguous on the CPU, ``x`` bf16 (or float32, without
    ``values``) with K (its last dim) a multiple of 16, holding R rows' worth of elements each
    (``amax`` R, read unless ``own_amax``).
    Returns whether some row held a NaN or Inf (its outputs are garbage; the caller refuses it)."""
    impl = impl_of("nvfp4_rows", impl)
    if not _fits(x, amax, codes, scales, values):
        raise ValueError(f"quantize_into: operands do not fit bf16 (or float32, no values) rows of "
                         f"{x.shape[-1] if x.dim() else 0} elements (x {x.dtype} {tuple(x.shape)}, amax "
                         f"{tuple(amax.shape)}, codes {tuple(codes.shape)}, scales {tuple(scales.shape)})")
    return _run(x, amax, codes, scales, values, own_amax, threads, impl)


def _run(x: torch.Tensor, amax: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor | None,
         own_amax: bool, threads: int | None, impl: Impl) -> bool:
    """The C pass on operands that fit (:func:`quantize_into`'s checks, or made to fit by the caller)."""
    k = x.shape[-1]
    r = x.numel() // k
    bad = first_bad()
    out = () if x.dtype == torch.float32 else (None if values is None else values.data_ptr(),)
    call(_ENTRY[x.dtype], x.data_ptr(), r, k, amax.data_ptr(), int(own_amax), codes.data_ptr(), scales.data_ptr(),
         *out, threads_for(threads, x.element_size() * r * k, GRAIN_BYTES), impl.value, ctypes.byref(bad),
         messages=NOT_RUN, name="nvfp4_rows", what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return bad.value >= 0


def supports_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool) -> bool:
    """Whether :func:`quantize_nvfp4` takes this input: bf16 or float32 CPU rows, each with its own or a
    given amax (a per-tensor amax needs a pass over the whole tensor first:
    :func:`tracefp4.formats.clib.quant.quantize_nvfp4`), and the library built."""
    return (x.dtype in _ENTRY and x.device.type == "cpu" and x.shape[-1] > 0
            and (per_row or amax is not None) and library() is not None)


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool, values: bool
                   ) -> tuple[NVFP4, torch.Tensor | None]:
    """The dispatch's C entry for NVFP4 (validated ``x``; ``amax`` validated, or None for each row's
    own): the outputs made in their final shapes and dtypes, so no view is needed after the pass (a
    decode step's site is a few microseconds of work, and every tensor op here costs one). float32
    input gives no values (as the numba kernel)."""
    values = values and x.dtype == torch.bfloat16
    lead, k = x.shape[:-1], x.shape[-1]
    q = NVFP4(codes=torch.empty(*lead, k // 2, dtype=torch.uint8),
              scales=torch.empty(*lead, k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn),
              global_amax=torch.empty(*lead, 1, dtype=torch.float32) if amax is None else amax)
    out = torch.empty(x.shape, dtype=torch.bfloat16) if values else None
    xd = x.detach().contiguous()
    row_amax = q.global_amax if amax is None else per_row_values(amax, x.shape)
    # the outputs are made to fit here and x is validated bf16: no operand check on the hot path
    if _run(xd, row_amax, q.codes, q.scales, out, amax is None, None, Impl.AUTO):
        raise_non_finite(xd, ~torch.isfinite(xd.reshape(-1, k)).all(dim=1))
    return q, out
