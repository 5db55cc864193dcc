"""The CPU quantizers on the C library besides the sites' per-row NVFP4 (``csrc/cpu_quant.h``): NVFP4
with a per-tensor amax (a block-amax pass, then the site kernel on that amax), MXFP4, dequantization
of NVFP4 and MXFP4 rows to float32, guided rounding from an ``lsb`` or ``full`` hint, the low-bit
hint's packing, and FP8 E4M3 quantize and dequantize.

Each is the numba kernel's float32 arithmetic, operation for operation (tests/test_cquant.py and
tests/test_conformance.py compare them bit for bit), AVX-512 where the CPU has it, portable C
elsewhere, on torch's OpenMP threads. The dispatch (:mod:`tracefp4.formats.dispatch`) sends CPU input
here where :func:`supports_nvfp4` / :func:`supports_mxfp4` / :func:`supports_guided` take it and the
library runs its AVX-512 paths (:func:`runs_vector`: the portable C is slower than numba); the row
functions (``*_rows``, :func:`abs_max`, :func:`quantize_nvfp4_tensor`) take ``threads`` and ``impl``
for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tracefp4.formats.clib import site
from tracefp4.formats.clib.call import SCALE_TABLES, Impl, call, impl_name, impl_of, threads_for, tracing
from tracefp4.formats.clib.loader import has_avx512_bf16, library
from tracefp4.formats.constants import MXFP4_BLOCK, NVFP4_BLOCK, Format
from tracefp4.formats.containers import FP8, MXFP4, NVFP4
from tracefp4.formats.rows import as_rows
from tracefp4.formats.validation import FP8_NON_FINITE, check_out_dtype, raise_non_finite

__all__ = ["GRAIN_BYTES", "abs_max", "amax_pass", "built", "dequantize", "dequantize_fp8", "dequantize_rows",
           "fp8_dequantize_rows", "fp8_rows", "guided_codes", "guided_rows", "lsb_bits", "lsb_rows", "mxfp4_rows",
           "quantize_fp8", "quantize_mxfp4", "quantize_nvfp4", "quantize_nvfp4_tensor", "runs_vector", "supports_fp8",
           "supports_guided", "supports_mxfp4", "supports_nvfp4", "tensor_amax"]

#: Bytes of input or output per thread before a call splits its work over threads (a fork of torch's
#: awake OpenMP threads costs a few microseconds; 64 KiB is tens of microseconds of work).
GRAIN_BYTES = 64 << 10

#: The largest finite abs pattern of each input dtype (above it: NaN or Inf), and the shift that makes
#: a pattern a float32's.
_LIMIT = {torch.bfloat16: (0x7F7F, 16), torch.float32: (0x7F7FFFFF, 0)}


#: numpy's dtype of each output dtype.
_NUMPY = {torch.uint8: np.uint8, torch.float32: np.float32, torch.bool: np.bool_, torch.bfloat16: np.uint16}


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An output tensor in numpy's memory: numpy asks the kernel for huge pages for a large array
    (madvise), torch's allocator does not, and a fresh 64 MB float32 output then costs a page fault
    every 4 KiB, more than the kernel's own work (the numba path's outputs are numpy's too)."""
    out = torch.from_numpy(np.empty(shape, dtype=_NUMPY[dtype]))
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


def runs_vector(*args) -> bool:
    """Whether the dispatch takes the NVFP4/MXFP4 entries here (any arguments: a predicate of the
    tables): where the library runs its AVX-512 paths. Its portable C is scalar code, up to 15 times
    slower than the numba kernels LLVM vectorises (one thread, 4096x4096 bf16: guided 100 ms against 7,
    MXFP4 110 against 16, dequantize 20 against 12), so elsewhere numba keeps those ops (the portable
    path stays for tests and ``impl="portable"``, with the same bits)."""
    return _vector_paths()


@functools.cache
def _vector_paths() -> bool:
    return library() is not None and has_avx512_bf16()


def _threads(threads: int | None, nbytes: int) -> int:
    return threads_for(threads, nbytes, GRAIN_BYTES)


def _amax_bits(top: int, dtype: torch.dtype) -> int:
    """float32 bits of the amax of an abs bit pattern of ``dtype`` (a NaN's or Inf's as the largest finite)."""
    limit, shift = _LIMIT[dtype]
    return min(top, limit) << shift


def _pattern_amax(top: int, dtype: torch.dtype) -> torch.Tensor:
    """float32 0-d amax of an abs bit pattern of ``dtype`` (see :func:`_amax_bits`)."""
    return torch.from_numpy(np.array([_amax_bits(top, dtype)], dtype=np.uint32).view(np.float32)).reshape(())


def abs_max(x: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto") -> int:
    """The largest abs bit pattern of a contiguous CPU bf16 or float32 tensor ``x`` (0 when empty):
    above the dtype's largest finite pattern where ``x`` holds a NaN or Inf."""
    impl = impl_of("abs_max", impl)
    if x.dtype not in _LIMIT or not x.is_cpu or not x.is_contiguous():
        raise ValueError(f"abs_max x: expected a contiguous CPU bf16 or float32 tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    top = ctypes.c_uint32(0)
    call("abs_max", x.data_ptr(), x.numel(), int(x.dtype == torch.float32), _threads(threads, x.nbytes), impl.value,
         ctypes.byref(top), what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return top.value


def amax_pass(x: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 max |x| (0-d; 0 when empty; NaN/Inf count as the largest finite value), bool 0-d:
    whether x holds a NaN or Inf)`` of a bf16 or float32 CPU tensor."""
    if tracing():
        return torch.ops.tracefp4.tensor_amax(x, threads or 0, impl_name(impl))
    top = abs_max(x.detach().contiguous(), threads=threads, impl=impl)
    return _pattern_amax(top, x.dtype), torch.tensor(top > _LIMIT[x.dtype][0])


def tensor_amax(x: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto") -> torch.Tensor:
    """float32 ``max |x|`` of a bf16 or float32 CPU tensor (0-d; 0 when empty), the amax of a per-tensor
    quantize; ValueError naming the first NaN or Inf, as every quantizer refuses them."""
    amax, bad = amax_pass(x, threads=threads, impl=impl)
    if bad:
        raise_non_finite(x, ~torch.isfinite(as_rows(x)).all(dim=1))
    return amax


def supports_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool) -> bool:
    """Whether :func:`quantize_nvfp4` takes this input: bf16 rows with their own or a given amax where
    the library is built (the sites' kernel, as before); float32 rows and per-tensor amaxes where it
    runs its AVX-512 paths (:func:`runs_vector`)."""
    if x.dtype == torch.bfloat16 and (per_row or amax is not None):
        return site.supports_nvfp4(x, amax, per_row)
    return site.supports_nvfp4(x, amax, True) and runs_vector()


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool, values: bool
                   ) -> tuple[NVFP4, torch.Tensor | None]:
    """The dispatch's C entry for NVFP4: the site kernel for each row's own or a given amax;
    :func:`quantize_nvfp4_tensor` for a per-tensor amax (``amax`` None, not ``per_row``)."""
    if amax is not None or per_row:
        return site.quantize_nvfp4(x, amax, per_row, values)
    return quantize_nvfp4_tensor(x, values=values)


def quantize_nvfp4_tensor(x: torch.Tensor, *, values: bool = False, threads: int | None = None,
                          impl: Impl | str = "auto") -> tuple[NVFP4, torch.Tensor | None]:
    """NVFP4 of a bf16 or float32 CPU tensor on its own amax, in two passes as the numba path: the
    blocks' amaxes and the largest (the global amax must be known before the first scale), then the
    site kernel on that amax reading the kept block amaxes (1/16 of the elements) instead of finding
    them again. The outputs live in numpy's memory (:func:`_empty`: a per-tensor quantize is the
    trainer's and the store's, of large tensors). ``values``: the dequantized bf16 (bf16 input only).
    ValueError naming the first NaN or Inf."""
    impl = impl_of("quantize_nvfp4_tensor", impl)
    xd = x.detach().contiguous()
    lead, k = x.shape[:-1], x.shape[-1]
    if xd.dtype not in _LIMIT or not xd.is_cpu or not k or k % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4_tensor x: expected CPU bf16 or float32 [..., K] with K a multiple of "
                         f"{NVFP4_BLOCK}, got {x.dtype} {tuple(x.shape)} on {x.device}")
    r, f32 = xd.numel() // k, int(xd.dtype == torch.float32)
    block_amax, top = np.empty(r * k // NVFP4_BLOCK, dtype=np.uint32), ctypes.c_uint32(0)
    n = _threads(threads, xd.nbytes)
    what = lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}"  # noqa: E731
    call("block_amax", xd.data_ptr(), f32, r, k, block_amax.ctypes.data, n, impl.value, ctypes.byref(top), what=what)
    if top.value > _LIMIT[xd.dtype][0]:
        raise_non_finite(xd, ~torch.isfinite(xd.reshape(r, k)).all(dim=1))
    # between the passes only numpy (the row amaxes: the amax's float32 bits, a row), the container
    # after the second: after a pass over a large tensor the interpreter's and torch's state is out of
    # cache, and the torch operations that made the row amaxes and the container here took 0.15 ms
    # (4096x4096 bf16, one thread; the quantize 0.03-0.1 ms faster end to end)
    row_amax = np.full(r, _amax_bits(top.value, xd.dtype), dtype=np.uint32).view(np.float32)
    codes, scales = _empty((*lead, k // 2), torch.uint8), _empty((*lead, k // NVFP4_BLOCK), torch.uint8)
    out = _empty(tuple(x.shape), torch.bfloat16) if values and not f32 else None
    call("nvfp4_quantize_blocks", xd.data_ptr(), f32, r, k, row_amax.ctypes.data,
         block_amax.ctypes.data, codes.data_ptr(), scales.data_ptr(), None if out is None else out.data_ptr(), n,
         impl.value, what=what)
    q = NVFP4(codes=codes, scales=scales.view(torch.float8_e4m3fn), global_amax=_pattern_amax(top.value, xd.dtype))
    return q, out


def mxfp4_rows(x: torch.Tensor, rceil: bool, *, threads: int | None = None, impl: Impl | str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 of bf16 or float32 rows ``x [R, K]`` (K a multiple of 32): ``(codes [R, K/2], biased E8M0
    exponents [R, K/32], bad [R] bool)``, ``bad`` flagging rows with a NaN or Inf (their outputs are
    garbage; the caller refuses them). ``rceil``: the RCEIL scale rule, else floor (see ScaleMode)."""
    if tracing():
        return torch.ops.tracefp4.mxfp4_rows(x, rceil, threads or 0, impl_name(impl))
    impl = impl_of("mxfp4_rows", impl)
    if (x.dtype not in _LIMIT or x.dim() != 2 or not x.shape[1] or x.shape[1] % MXFP4_BLOCK or not x.is_cpu
            or not x.is_contiguous()):
        raise ValueError(f"mxfp4_rows x: expected contiguous CPU bf16 or float32 [R, K] with K a positive multiple of "
                         f"{MXFP4_BLOCK}, got {x.dtype} {tuple(x.shape)} on {x.device}")
    r, k = x.shape
    codes, scales = _empty((r, k // 2), torch.uint8), _empty((r, k // MXFP4_BLOCK), torch.uint8)
    bad = _empty((r,), torch.bool)
    call("mxfp4_quantize", x.data_ptr(), int(x.dtype == torch.float32), r, k, int(rceil), codes.data_ptr(),
         scales.data_ptr(), bad.data_ptr(), _threads(threads, x.nbytes), impl.value,
         what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return codes, scales, bad


def supports_mxfp4(x: torch.Tensor, rceil: bool) -> bool:
    """Whether :func:`quantize_mxfp4` takes this input: bf16 or float32 on the CPU, where the library
    runs its AVX-512 paths (:func:`runs_vector`)."""
    return x.dtype in _LIMIT and x.device.type == "cpu" and runs_vector()


def quantize_mxfp4(x: torch.Tensor, rceil: bool) -> MXFP4:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.QUANTIZE_MXFP4` (validated x)."""
    codes, scales, bad = mxfp4_rows(as_rows(x), rceil)
    raise_non_finite(x, bad.numpy())
    return MXFP4.from_rows(codes, scales, x.shape[:-1])


def dequantize_rows(rows: torch.Tensor, scale_rows: torch.Tensor, fmt: Format | str, row_div: torch.Tensor, *,
                    dtype: torch.dtype = torch.float32, threads: int | None = None, impl: Impl | str = "auto"
                    ) -> torch.Tensor:
    """float32 ``(value(code) * scale) / row_div[row]`` of code rows uint8 ``[R, K/2]`` with scale bytes
    uint8 ``[R, K/block]`` (E4M3 for NVFP4, E8M0 for MXFP4) and float32 divisors ``[R]``: ``[R, K]``,
    or with ``dtype`` bfloat16 those values rounded to bfloat16 as torch's cast rounds them (written
    straight from the registers: half the bytes of the float32 rows and no second pass)."""
    fmt = Format(fmt)
    check_out_dtype(dtype, "dequantize_rows")
    if tracing():
        return torch.ops.tracefp4.dequantize_rows(rows, scale_rows, fmt.value, row_div, dtype == torch.bfloat16,
                                                  threads or 0, impl_name(impl))
    impl = impl_of("dequantize_rows", impl)
    r, k = _code_rows("dequantize_rows", rows, scale_rows, fmt)
    row_div = _row_floats("dequantize_rows", "row_div", row_div, r)
    out = _empty((r, k), dtype)
    call("dequantize", rows.data_ptr(), scale_rows.data_ptr(), SCALE_TABLES[fmt].ctypes.data, row_div.data_ptr(), r, k,
         fmt.block, out.data_ptr(), int(dtype == torch.bfloat16), _threads(threads, out.nbytes), impl.value,
         what=lambda: f"codes {tuple(rows.shape)}, impl {impl.name.lower()!r}")
    return out


def _code_rows(entry: str, rows: torch.Tensor, scale_rows: torch.Tensor, fmt: Format) -> tuple[int, int]:
    """``(R, K)`` of code rows and their scale rows, or ValueError naming the operand that does not fit."""
    if not fmt.fp4:
        raise ValueError(f"{entry} fmt: expected nvfp4 or mxfp4, got {fmt.value}")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_cpu or not rows.is_contiguous():
        raise ValueError(f"{entry} codes: expected contiguous CPU uint8 [R, K/2], got {rows.dtype} {tuple(rows.shape)}")
    r, k = rows.shape[0], 2 * rows.shape[1]
    if (scale_rows.dtype != torch.uint8 or tuple(scale_rows.shape) != (r, k // fmt.block) or k % fmt.block or not k
            or not scale_rows.is_cpu or not scale_rows.is_contiguous()):
        raise ValueError(f"{entry} scales: expected contiguous CPU uint8 [{r}, {k // fmt.block}] (K = {k} a positive "
                         f"multiple of {fmt.block}), got {scale_rows.dtype} {tuple(scale_rows.shape)}")
    return r, k


def _row_floats(entry: str, name: str, t: torch.Tensor, r: int) -> torch.Tensor:
    if t.dtype != torch.float32 or t.numel() != r or not t.is_cpu:
        raise ValueError(f"{entry} {name}: expected CPU float32 [{r}], got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t.contiguous()


def dequantize(rows: torch.Tensor, scale_rows: torch.Tensor, fmt: Format, row_div: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.DEQUANTIZE` (validated rows)."""
    return dequantize_rows(rows, scale_rows, fmt, row_div, dtype=dtype)


def guided_rows(x: torch.Tensor, scale_rows: torch.Tensor, fmt: Format | str, s_dec: torch.Tensor,
                hint_rows: torch.Tensor, full: bool, *, threads: int | None = None, impl: Impl | str = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Guided codes of bf16 rows ``x [R, K]`` on the grid ``(scale_rows [R, K/block] uint8, s_dec [R])``,
    each element the member of its bracket the hint names: ``hint_rows`` uint8 low bits ``[R, K/8]``,
    or the rollout's code rows ``[R, K/2]`` when ``full``. Returns ``(codes [R, K/2] uint8, bad [R]
    bool)``, ``bad`` flagging rows with a NaN or Inf (their codes are garbage; the caller refuses them)."""
    fmt = Format(fmt)
    if tracing():
        return torch.ops.tracefp4.guided_rows(x, scale_rows, fmt.value, s_dec, hint_rows, full, threads or 0,
                                              impl_name(impl))
    impl = impl_of("guided_rows", impl)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu or not x.is_contiguous():
        raise ValueError(f"guided_rows x: expected contiguous CPU bf16 [R, K], got {x.dtype} {tuple(x.shape)}")
    codes = _empty((x.shape[0], x.shape[1] // 2), torch.uint8)
    r, k = _code_rows("guided_rows", codes, scale_rows, fmt)
    s_dec = _row_floats("guided_rows", "s_dec", s_dec, r)
    hint_shape = (r, k // 2 if full else k // 8)
    if hint_rows.dtype != torch.uint8 or tuple(hint_rows.shape) != hint_shape or not hint_rows.is_contiguous():
        raise ValueError(f"guided_rows hint: expected contiguous uint8 {hint_shape}, got {hint_rows.dtype} "
                         f"{tuple(hint_rows.shape)}")
    bad = _empty((r,), torch.bool)
    call("guided", x.data_ptr(), scale_rows.data_ptr(), SCALE_TABLES[fmt].ctypes.data, s_dec.data_ptr(),
         hint_rows.data_ptr(), int(full), r, k, fmt.block, codes.data_ptr(), bad.data_ptr(),
         _threads(threads, x.nbytes), impl.value, what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return codes, bad


def supports_guided(x: torch.Tensor, *args) -> bool:
    """Whether :func:`guided_codes` takes this input: bf16 on the CPU, where the library runs its
    AVX-512 paths (:func:`runs_vector`)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and runs_vector()


def guided_codes(x: torch.Tensor, fmt: Format, scale_rows: torch.Tensor, s_dec: torch.Tensor, hint_rows: torch.Tensor,
                 full: bool) -> tuple[torch.Tensor, np.ndarray]:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.GUIDED` (validated operands)."""
    codes, bad = guided_rows(as_rows(x), scale_rows, fmt, s_dec, hint_rows.contiguous(), full)
    return codes, bad.numpy()


def lsb_rows(rows: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto") -> torch.Tensor:
    """Code rows uint8 ``[R, K/2]`` -> their low magnitude bits, eight per byte ``[R, K/8]``."""
    if tracing():
        return torch.ops.tracefp4.lsb_bits(rows, threads or 0, impl_name(impl))
    impl = impl_of("lsb_rows", impl)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % 4 or not rows.is_cpu or not rows.is_contiguous():
        raise ValueError(f"lsb_rows codes: expected contiguous CPU uint8 [R, K/2] with K/2 % 4 == 0, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    out = _empty((rows.shape[0], rows.shape[1] // 4), torch.uint8)
    # a few bit operations a byte: one thread keeps up with memory until the codes are large
    call("lsb_bits", rows.data_ptr(), rows.numel(), out.data_ptr(), threads_for(threads, rows.nbytes, 16 * GRAIN_BYTES),
         impl.value, what=lambda: f"codes {tuple(rows.shape)}, impl {impl.name.lower()!r}")
    return out


def lsb_bits(rows: torch.Tensor) -> torch.Tensor:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.LSB_BITS`."""
    return lsb_rows(rows)


#: float32 value of every E4M3 byte, as torch widens it (the FP8 dequantize's table).
_E4M3_FLOAT = np.ascontiguousarray(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())


def fp8_rows(x: torch.Tensor, *, threads: int | None = None, impl: Impl | str = "auto"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 E4M3 of bf16 or float32 rows ``x [R, K]``: ``(codes [R, K] uint8, scale [R] float32 (amax/448,
    1 for a zero row), bad [R] bool)``, ``bad`` flagging rows with a NaN or Inf (their outputs are
    garbage; the caller refuses them)."""
    if tracing():
        return torch.ops.tracefp4.fp8_rows(x, threads or 0, impl_name(impl))
    impl = impl_of("fp8_rows", impl)
    if x.dtype not in _LIMIT or x.dim() != 2 or not x.shape[1] or not x.is_cpu or not x.is_contiguous():
        raise ValueError(f"fp8_rows x: expected contiguous CPU bf16 or float32 [R, K], got {x.dtype} {tuple(x.shape)} "
                         f"on {x.device}")
    r, k = x.shape
    codes, scale, bad = _empty((r, k), torch.uint8), _empty((r,), torch.float32), _empty((r,), torch.bool)
    call("fp8_quantize", x.data_ptr(), int(x.dtype == torch.float32), r, k, codes.data_ptr(), scale.data_ptr(),
         bad.data_ptr(), _threads(threads, x.nbytes), impl.value,
         what=lambda: f"x {tuple(x.shape)}, impl {impl.name.lower()!r}")
    return codes, scale, bad


def supports_fp8(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_fp8` takes this input: bf16 or float32 on the CPU, and the library built
    (even its portable C is several times faster than torch's elementwise ops: one thread, 4096x4096
    bf16, 31 ms against 240)."""
    return x.dtype in _LIMIT and x.device.type == "cpu" and library() is not None


def quantize_fp8(x: torch.Tensor) -> FP8:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.QUANTIZE_FP8` (validated x); a NaN
    or Inf is refused with the torch path's words."""
    codes, scale, bad = fp8_rows(as_rows(x))
    if bad.numpy().any():
        raise ValueError(FP8_NON_FINITE)
    lead = (*x.shape[:-1], 1)
    return FP8(codes.view(torch.float8_e4m3fn).reshape(x.shape), scale.reshape(lead))


def fp8_dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, *, threads: int | None = None,
                        impl: Impl | str = "auto") -> torch.Tensor:
    """float32 ``value(code) * scale[row]`` of E4M3 code rows uint8 ``[R, K]`` (values as torch widens
    E4M3, NaN codes included) with float32 row scales ``[R]``."""
    if tracing():
        return torch.ops.tracefp4.fp8_dequantize_rows(rows, scale, threads or 0, impl_name(impl))
    impl = impl_of("fp8_dequantize_rows", impl)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.shape[1] or not rows.is_cpu or not rows.is_contiguous():
        raise ValueError(f"fp8_dequantize_rows codes: expected contiguous CPU uint8 [R, K], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    r, k = rows.shape
    scale = _row_floats("fp8_dequantize_rows", "scale", scale, r)
    out = _empty((r, k), torch.float32)
    call("fp8_dequantize", rows.data_ptr(), _E4M3_FLOAT.ctypes.data, scale.data_ptr(), r, k, out.data_ptr(),
         _threads(threads, out.nbytes), impl.value,
         what=lambda: f"codes {tuple(rows.shape)}, impl {impl.name.lower()!r}")
    return out


def dequantize_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dispatch's C entry for :data:`~tracefp4.formats.dispatch.Op.DEQUANTIZE_FP8`."""
    return fp8_dequantize_rows(rows, scale)


def built(*args) -> bool:
    """Whether the library is built (any arguments: a predicate of the dispatch tables)."""
    return library() is not None
