"""Resident memory, and the fresh processes it is measured in.

:class:`ResidentProbe` is the one reading of a process's memory: growth of the resident set since a
baseline, either what stays resident (freed memory handed back first) or the peak (the kernel's
high-water mark ``VmHWM`` after a reset through ``/proc/self/clear_refs``; ``ru_maxrss`` where that
is unavailable, exact only in a fresh process). tracemalloc would miss it: the buffers are numpy,
torch and vLLM allocations it does not see. What a process has already loaded counts as its own, so
every probe runs in a fresh one: :func:`run_child` runs a function of this package there, its keyword
arguments and its answer crossing as JSON files (never pickle), the answer written whole or not at all.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracefp4.files import atomic_write_json

__all__ = ["ResidentProbe", "peak_growth", "rss_bytes", "run_child", "run_children"]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is None:
        raise RuntimeError("no VmRSS in /proc/self/status: resident memory is measured on Linux only")
    return kb * 1024


def _release() -> None:
    """Collect garbage and hand freed heap pages back, so that RSS shows what is held, not what was."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class ResidentProbe:
    """Resident growth of this process from now on. ``peak``: the high-water mark's growth (what an
    operation needed at its worst, its temporaries included); otherwise what is still resident at
    each :meth:`growth` (freed memory handed back first)."""

    def __init__(self, peak: bool = False) -> None:
        _release()
        self.peak = peak
        self.resettable = peak and _reset_peak()
        self.base_kb = _status_kb("VmRSS") if self.resettable or not peak else None
        self.maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    @property
    def method(self) -> str:
        if not self.peak:
            return "VmRSS after release"
        return "VmHWM after clear_refs" if self.resettable else "ru_maxrss before/after"

    def growth(self) -> int:
        if not self.peak:
            _release()
            return (_status_kb("VmRSS") - self.base_kb) * 1024
        if self.resettable:
            return (_status_kb("VmHWM") - self.base_kb) * 1024
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.maxrss_kb) * 1024

    @staticmethod
    def peak_resettable() -> bool:
        """Whether one process can measure several peaks (else one fresh process per peak)."""
        return _reset_peak()


def peak_growth(fn: Callable[[], Any]) -> tuple[int, Any, str]:
    """One call of ``fn`` in this process: the peak resident growth it caused (its temporaries included),
    its result, and how the peak was read (:attr:`ResidentProbe.method`)."""
    probe = ResidentProbe(peak=True)
    result = fn()
    return probe.growth(), result, probe.method


# --- fresh processes ----------------------------------------------------------------------------------

_CALLABLE_PREFIX = "tracefp4.bench."


def _resolve(call: str):
    module, _, name = call.partition(":")
    if not module.startswith(_CALLABLE_PREFIX) or not name:
        raise ValueError(f"child call {call!r}: expected 'tracefp4.bench.<module>:<function>'")
    return getattr(importlib.import_module(module), name)


def run_child(call: str, kwargs: Mapping[str, Any], *, timeout: float, env: Mapping[str, str] | None = None) -> Any:
    """``call`` (``module:function`` of this package) with ``kwargs`` in a fresh Python process; its
    JSON answer. A RuntimeError quotes the child's stderr when it fails or writes no answer."""
    _resolve(call)  # a bad name fails here, not in the child
    with tempfile.TemporaryDirectory(prefix="tracefp4-child-") as tmp:
        spec, answer = os.path.join(tmp, "call.json"), os.path.join(tmp, "answer.json")
        atomic_write_json(spec, {"call": call, "kwargs": dict(kwargs), "answer": answer})
        proc = subprocess.run([sys.executable, "-m", "tracefp4.bench.memory", spec], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
        if proc.returncode != 0 or not os.path.exists(answer):
            raise RuntimeError(f"{call} in a fresh process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(answer) as f:
            return json.load(f)


def run_children(jobs: Sequence[tuple[str, Mapping[str, Any]]], *, timeout: float, parallel: bool,
                 env: Mapping[str, str] | None = None) -> list[Any]:
    """:func:`run_child` of each job, in order; side by side where ``parallel`` (each reads only its
    own process's memory, so no figure depends on the others)."""
    if not parallel or len(jobs) < 2:
        return [run_child(c, kw, timeout=timeout, env=env) for c, kw in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: run_child(job[0], job[1], timeout=timeout, env=env), jobs))


def main(argv: Sequence[str] | None = None) -> int:
    """The child side of :func:`run_child`: ``python -m tracefp4.bench.memory CALL_JSON``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m tracefp4.bench.memory CALL_JSON (written by tracefp4.bench.memory.run_child)",
              file=sys.stderr)
        return 2
    with open(args[0]) as f:
        spec = json.load(f)
    atomic_write_json(spec["answer"], _resolve(spec["call"])(**spec["kwargs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
