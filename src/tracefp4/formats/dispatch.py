"""Which backend runs an op: one table per op, one choice for all.

Every public op validates its input and then asks :func:`implementation` for the function that runs
it on the input's device. CUDA tensors go to Triton (:mod:`tracefp4.formats.triton_ops`); CPU tensors
to the C library where it takes the input (:mod:`tracefp4.formats.clib.quant`: NVFP4 quantize of bf16
and float32 with any amax scope, MXFP4 of bf16 and float32, dequantize, guided rounding of bf16, the
low-bit hint's packing, FP8 E4M3 quantize of bf16 and float32 and dequantize; beyond the sites' bf16
NVFP4 and FP8, only where the library runs its AVX-512 paths), else to numba
(:mod:`tracefp4.formats.numba_ops`); an op with no kernel runs as torch on any device
(:mod:`tracefp4.formats.torch_ops`). All are bit for bit equal to the readable reference
(tests/test_conformance.py walks every entry of every table); nothing is copied to the host to be
quantized.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable

import torch

from tracefp4.formats import numba_ops, torch_ops, triton_ops
from tracefp4.formats.clib import quant as c_quant

__all__ = ["TABLES", "Backend", "Op", "backend", "implementation", "use_backend"]


class Backend(str, enum.Enum):
    """A family of kernels that runs ops."""

    NUMBA = "numba"
    """The numba CPU kernels (:mod:`tracefp4.formats.kernels`): every CPU op, every dtype."""

    C = "c"
    """The C library (:mod:`tracefp4.formats.clib`): where it is built and takes the input."""

    TRITON = "triton"
    """The Triton kernels: CUDA tensors (CPU tensors too under Triton's interpreter, for tests)."""

    TORCH = "torch"
    """Vectorised torch ops on any device: ops without a kernel."""


class Op(enum.Enum):
    """The ops with more than one way to run."""

    QUANTIZE_NVFP4 = "quantize_nvfp4"
    """``(x, amax | None, per_row, values) -> (NVFP4, bf16 values | None)``."""

    QUANTIZE_NVFP4_4OVER6 = "quantize_nvfp4_4over6"
    """``(x, amax | None, per_row) -> NVFP4`` with the Four over Six block scales."""

    QUANTIZE_MXFP4 = "quantize_mxfp4"
    """``(x, rceil) -> MXFP4``."""

    DEQUANTIZE = "dequantize"
    """``(code rows [R, K/2], scale rows [R, K/block] uint8, fmt, row divisor [R], dtype) -> dtype [R, K]``:
    the float32 values, or (bfloat16) those values rounded to nearest even, as torch's cast rounds."""

    GUIDED = "guided_codes"
    """``(x, fmt, scale rows, s_dec [R], hint rows, full) -> (code rows [R, K/2], bad [R])``."""

    LSB_BITS = "lsb_bits"
    """``(code rows [R, K/2]) -> bit rows [R, K/8]``."""

    QUANTIZE_FP8 = "quantize_fp8"
    """``(x) -> FP8`` (E4M3 codes, float32 ``amax/448`` per row); ValueError on NaN/Inf."""

    DEQUANTIZE_FP8 = "dequantize_fp8"
    """``(E4M3 code rows [R, K] uint8, scale [R] float32) -> float32 [R, K]``."""


TABLES: dict[Op, dict[Backend, Callable]] = {
    Op.QUANTIZE_NVFP4: {Backend.C: c_quant.quantize_nvfp4, Backend.NUMBA: numba_ops.quantize_nvfp4,
                        Backend.TRITON: triton_ops.quantize_nvfp4},
    Op.QUANTIZE_NVFP4_4OVER6: {Backend.TORCH: torch_ops.quantize_nvfp4_4over6},
    Op.QUANTIZE_MXFP4: {Backend.C: c_quant.quantize_mxfp4, Backend.NUMBA: numba_ops.quantize_mxfp4,
                        Backend.TRITON: triton_ops.quantize_mxfp4},
    Op.DEQUANTIZE: {Backend.C: c_quant.dequantize, Backend.NUMBA: numba_ops.dequantize,
                    Backend.TRITON: triton_ops.dequantize},
    Op.GUIDED: {Backend.C: c_quant.guided_codes, Backend.NUMBA: numba_ops.guided_codes,
                Backend.TRITON: triton_ops.guided_codes},
    Op.LSB_BITS: {Backend.C: c_quant.lsb_bits, Backend.NUMBA: numba_ops.lsb_bits, Backend.TRITON: triton_ops.lsb_bits},
    Op.QUANTIZE_FP8: {Backend.C: c_quant.quantize_fp8, Backend.TORCH: torch_ops.quantize_fp8},
    Op.DEQUANTIZE_FP8: {Backend.C: c_quant.dequantize_fp8, Backend.TORCH: torch_ops.dequantize_fp8},
}


#: Backends that take only some inputs of an op: a predicate over the op's arguments.
_TAKES: dict[tuple[Op, Backend], Callable[..., bool]] = {
    (Op.QUANTIZE_NVFP4, Backend.C): lambda x, amax, per_row, values: c_quant.supports_nvfp4(x, amax, per_row),
    (Op.QUANTIZE_MXFP4, Backend.C): c_quant.supports_mxfp4,
    (Op.DEQUANTIZE, Backend.C): c_quant.runs_vector,
    (Op.GUIDED, Backend.C): c_quant.supports_guided,
    (Op.LSB_BITS, Backend.C): c_quant.runs_vector,
    (Op.QUANTIZE_FP8, Backend.C): c_quant.supports_fp8,
    (Op.DEQUANTIZE_FP8, Backend.C): c_quant.built,
}
#: The CPU's order of preference (the first backend of an op's table that takes the input).
_CPU_ORDER = (Backend.C, Backend.NUMBA, Backend.TORCH)
_FORCED: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("tracefp4_cpu_backend", default=None)


@contextlib.contextmanager
def use_backend(name: Backend | str):
    """Send CPU tensors to the named backend inside the block (this thread/context only), for the ops
    it has; the others keep their own.

    For tests and benchmarks: ``"numba"`` keeps the C library out; with Triton's CPU interpreter
    (``TRITON_INTERPRET=1``) ``"triton"`` routes CPU tensors through the code path a CUDA tensor takes.
    """
    try:
        chosen = Backend(name)
    except ValueError:
        raise ValueError(f"backend: expected one of {[b.value for b in Backend]}, got {name!r}") from None
    token = _FORCED.set(chosen)
    try:
        yield
    finally:
        _FORCED.reset(token)


def backend(x: torch.Tensor, what: str = "x") -> Backend:
    """The kernel family of ``x``'s device: Triton for CUDA tensors, numba (or the one
    :func:`use_backend` names) for CPU tensors; ValueError naming ``what`` on any other device."""
    if x.device.type == "cuda":
        return Backend.TRITON
    if x.device.type == "cpu":
        return _FORCED.get() or Backend.NUMBA
    raise ValueError(f"{what}: tensors on {x.device} are not supported; expected a CPU or CUDA tensor")


def _takes(op: Op, b: Backend, args: tuple) -> bool:
    take = _TAKES.get((op, b))
    return take is None or take(*args)


_CUDA_ORDER = (Backend.TRITON, Backend.TORCH)


def implementation(op: Op, x: torch.Tensor, *args, what: str = "x") -> Callable:
    """The function that runs ``op`` on ``(x, *args)``: the first backend of the op's table, in the
    order of x's device, that takes the input (:data:`TABLES`). Asked once per op call, so kept to a
    few dictionary lookups (a decode step's site is a few microseconds of work)."""
    table = TABLES[op]
    device = x.device.type
    if device == "cpu":
        forced = _FORCED.get()
        if forced in table and _takes(op, forced, (x, *args)):
            return table[forced]
        order = _CPU_ORDER
    elif device == "cuda":
        order = _CUDA_ORDER
    else:
        backend(x, what)  # raises, naming the device
    for b in order:
        if b in table and _takes(op, b, (x, *args)):
            return table[b]
    raise ValueError(f"{op.value}: no backend runs it on {x.device}")
