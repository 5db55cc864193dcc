"""The one way Python calls the C library: operand checks, the implementation enum, the thread count,
the call and its return code."""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable

import numpy as np
import torch

from tracefp4.formats.clib.loader import library, unavailable_reason
from tracefp4.formats.constants import E4M3_VALUES, E8M0_VALUES, Format

__all__ = ["Impl", "NOT_RUN", "SCALE_TABLES", "VECTOR_IMPLS", "call", "check_cpu", "describe", "first_bad", "impl_name",
           "impl_of", "threads_for", "tracing"]


class Impl(enum.Enum):
    """Which code path of an entry point runs (the C side's ``impl`` argument)."""

    AUTO = 0
    """The best this CPU runs (AMX for GEMM panels, AVX-512 where the CPU has it, else portable)."""

    PORTABLE = 1
    """Plain C: every CPU; the path the vector ones are tested against."""

    AVX512 = 2
    """AVX-512 (the GEMMs: AVX-512 BF16); an error where the CPU lacks it."""

    AMX = 3
    """AMX tiles: the GEMMs' panels layout only."""


_NAMES = {"auto": Impl.AUTO, "portable": Impl.PORTABLE, "avx512": Impl.AVX512, "avx512_bf16": Impl.AVX512,
          "amx": Impl.AMX}
#: The entry points without an AMX path.
VECTOR_IMPLS = (Impl.AUTO, Impl.PORTABLE, Impl.AVX512)

#: float32 value of every scale byte, the table the C kernels decode block scales with.
SCALE_TABLES = {Format.NVFP4: np.ascontiguousarray(E4M3_VALUES, dtype=np.float32),
                Format.MXFP4: np.ascontiguousarray(E8M0_VALUES, dtype=np.float32)}


def impl_of(entry: str, impl: Impl | str, allowed: tuple[Impl, ...] = VECTOR_IMPLS) -> Impl:
    """``impl`` as an :class:`Impl` the entry point has, or ValueError naming the entry and the choices."""
    chosen = impl if isinstance(impl, Impl) else _NAMES.get(impl)
    if chosen not in allowed:
        names = sorted(n for n, i in _NAMES.items() if i in allowed)
        raise ValueError(f"{entry} impl: expected one of {names}, got {impl!r}")
    return chosen


def impl_name(impl: Impl | str) -> str:
    """``impl`` as the name a custom op takes (:mod:`tracefp4.formats.clib.ops`)."""
    return impl.name.lower() if isinstance(impl, Impl) else impl


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing: the entry points then call their custom op (one graph
    node with a fake implementation) instead of the library."""
    return torch.compiler.is_compiling()


def describe(t: object) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_cpu(entry: str, name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Refuse an operand that is not a CPU tensor of ``dtype`` and ``shape``, naming it."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu":
        raise ValueError(f"{entry} {name}: expected a CPU {dtype} tensor of shape {shape}, got {describe(t)}")


def threads_for(threads: int | None, work: int = 0, grain: int = 0) -> int:
    """The thread count of a call: ``threads`` (default torch's intra-op count), one below ``grain``
    units of ``work`` (a fork costs more than so little work), at most one per ``grain``."""
    t = int(threads or torch.get_num_threads())
    if grain:
        t = 1 if work < grain else max(1, min(t, work // grain))
    return t


def call(entry: str, *args, messages: dict[int, str] | None = None,
         explain: dict[int, Callable[[int], str]] | None = None, index: ctypes.c_int64 | None = None,
         what: Callable[[], str] = str, name: str | None = None) -> None:
    """Run ``tfp4_<entry>`` on ``args``. RuntimeError without the library; ValueError on a nonzero
    return code: worded by ``explain[rc](index.value)`` where the kernel wrote the offending index to
    ``index`` (a :func:`first_bad` int64 passed among ``args`` by reference), else by ``messages`` (this
    entry's codes) or the codes every entry shares, with ``what()`` naming the operands (called only
    then: formatting them costs a decode step's site a microsecond) and ``name`` the Python function
    (default: the entry)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the tracefp4 CPU kernel library is unavailable: {unavailable_reason()}")
    rc = getattr(lib, f"tfp4_{entry}")(*args)
    if rc == 0:
        return
    if explain and rc in explain:
        raise ValueError(explain[rc](index.value))
    why = {**_COMMON, **(messages or {})}.get(rc, f"error {rc}")
    raise ValueError(f"{name or entry}: {why} ({what()})")


#: The code of an entry point asked for a path this CPU lacks.
NOT_RUN = {-1: "implementation not run by this CPU"}
_COMMON = {-1: "shapes or an implementation this CPU or layout lacks", -3: "out of memory",
           -4: "thread start failed"}


def first_bad() -> ctypes.c_int64:
    """The ``int64_t`` a kernel writes the first offending index to (-1: none); pass ``byref``."""
    return ctypes.c_int64(-1)
