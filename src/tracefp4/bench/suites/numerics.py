"""Side-by-side timings: every figure is measured in one process, in one run, and reported as a ratio.

These machines are noisy (and shared), so absolute times mean little across runs; ratios against a
same-size tensor copy and against torchao, measured in the same run, are what the targets use. The
operations are timed in interleaved rounds (one call of each per round, then the median over
rounds), so a burst of load from elsewhere slows every operation of a round alike instead of
landing on one of them.

Sections: ``bench all`` runs every section in :data:`SECTIONS` and merges their figures into one
flat JSON object. ``numerics`` is one section; training, rollout and store sections (figures such as
``train_step_trace_over_qat``, ``rollout_record_over_plain``, store MB/s) register themselves with
:func:`register_section` from their own modules.

Memory (``--memory``): peak resident memory of each operation beyond its input and output, measured
in a fresh subprocess from the kernel's own high-water mark (``VmHWM`` after a reset through
``/proc/self/clear_refs``; ``ru_maxrss`` where that is unavailable). tracemalloc would miss it: the
buffers are numpy/torch allocations it does not see.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Callable

import torch

from tracefp4.files import atomic_write_json
from tracefp4.provenance import environment
from tracefp4.formats.constants import NVFP4_GLOBAL_NUMERATOR
from tracefp4.formats import dequantize_nvfp4, quantize_nvfp4
from tracefp4.guidance.hints import encode_hint, guided_quantize
from tracefp4.reports.timing import time_rounds

# --- helpers -------------------------------------------------------------------------------------


def torchao_nvfp4():
    """torchao's ``nvfp4_quantize`` when torchao is importable, else None."""
    import logging

    # torchao's import chatters about torch.compile registrations; that is not our output
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except Exception:  # torchao is optional; any import failure means "not available"
        return None
    return nvfp4_quantize


def _numba_threads() -> int:
    from tracefp4.formats.kernels import numba_threads

    return numba_threads()


# --- numerics section ----------------------------------------------------------------------------

#: (label, key) of each timed operation, in table order.
NUMERICS_ROWS = [
    ("tensor copy (x.clone())", "copy_s"),
    ("copy into a buffer", "copy_into_s"),
    ("float32 write (fill a buffer)", "float32_write_s"),
    ("quantize_nvfp4", "nvfp4_quantize_s"),
    ("quantize_nvfp4 per_row", "nvfp4_quantize_per_row_s"),
    ("dequantize_nvfp4", "nvfp4_dequantize_s"),
    ("dequantize_nvfp4 to bf16", "nvfp4_dequantize_bf16_s"),
    ("encode_hint(lsb)", "encode_hint_s"),
    ("guided_quantize(lsb)", "guided_quantize_s"),
    ("guided_quantize(full)", "guided_quantize_full_s"),
    ("torchao nvfp4_quantize", "torchao_nvfp4_quantize_s"),
]

#: The shape and dtype the numerics targets are set for (other shapes are measured without targets).
TARGET_SHAPE = (4096, 4096)

#: What a quantizer can reach, as (ratio key, bound, "max" or "min"), set for a 4096x4096 bf16 tensor
#: on 2 threads. The limit is the copy: quantizing reads 2 bytes and writes 0.56 per element, a copy
#: reads 2 and writes 2, so a one-pass quantizer runs at or below a copy's time and a per-tensor one (an
#: amax pass, then the quantize pass) at about 1.5x. A dequantization to bf16 reads 0.56 and writes 2,
#: so it too runs at or below a copy's time; to float32 it writes 4 bytes an element (and reads each
#: written line first), twice the copy's writes, which bounds it near 1.4x a copy by bytes alone: its
#: row is measured against the same 1.1 and reads as the bound it is, beside the floor it cannot beat,
#: only writing a float32 tensor of the same elements into a buffer (``float32_write_over_copy``).
#: They are written into each result (``targets``) beside the ratios measured in the same run.
NUMERICS_TARGETS = {
    "quantize_per_row_over_copy": (1.1, "max"),
    "quantize_over_copy": (1.6, "max"),
    "dequantize_over_copy": (1.1, "max"),
    "dequantize_bf16_over_copy": (1.1, "max"),
    "guided_over_copy": (1.5, "max"),
    "guided_full_over_copy": (1.5, "max"),
    "encode_hint_over_copy": (0.3, "max"),
    "torchao_over_quantize": (80.0, "min"),
}


def _numerics_fns(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The timed operations on ``x`` (guided rounding of ``y``, a perturbed ``x``, on ``x``'s grid)."""
    q = quantize_nvfp4(x)
    hint = encode_hint(q, "lsb")
    hint_full = encode_hint(q, "full")
    buffer = torch.empty_like(x)
    f32 = torch.empty(x.shape, dtype=torch.float32)
    return {
        "copy_s": lambda: x.clone(),
        "copy_into_s": lambda: buffer.copy_(x),
        "float32_write_s": lambda: f32.fill_(1.0),  # a float32 dequantization's writes alone: its floor
        "nvfp4_quantize_s": lambda: quantize_nvfp4(x),
        "nvfp4_quantize_per_row_s": lambda: quantize_nvfp4(x, per_row=True),
        "nvfp4_dequantize_s": lambda: dequantize_nvfp4(q),
        "nvfp4_dequantize_bf16_s": lambda: dequantize_nvfp4(q, torch.bfloat16),
        "encode_hint_s": lambda: encode_hint(q, "lsb"),
        "guided_quantize_s": lambda: guided_quantize(y, hint),
        "guided_quantize_full_s": lambda: guided_quantize(y, hint_full),
    }


def _torchao_bit_exact(ao, x: torch.Tensor) -> bool:
    """torchao single-level NVFP4 equals ours with ``S_enc = 1`` (the global amax at the numerator)."""
    ours = quantize_nvfp4(x, global_amax=torch.tensor(NVFP4_GLOBAL_NUMERATOR))
    ao_scales, ao_codes = ao(x)
    return bool(torch.equal(ao_codes, ours.codes)) and bool(
        torch.equal(ao_scales.view(torch.uint8), ours.scales.view(torch.uint8))
    )


def _add_ratios(out: dict) -> None:
    # the reference copy is the faster of the two measured in this run: a copy's limit is its memory
    # bandwidth, and the page faults of a fresh 32 MB allocation come and go with the allocator's state
    # (one run measured x.clone() at 11.3 ms against 1.5 ms into a buffer, the next 2.0 and 2.2)
    quant = out["nvfp4_quantize_s"]
    copy = out["copy_ref_s"] = min(out["copy_s"], out["copy_into_s"])
    out["quantize_over_copy"] = quant / copy
    out["quantize_over_copy_into"] = quant / out["copy_into_s"]
    out["quantize_per_row_over_copy"] = out["nvfp4_quantize_per_row_s"] / copy
    out["dequantize_over_copy"] = out["nvfp4_dequantize_s"] / copy
    out["dequantize_bf16_over_copy"] = out["nvfp4_dequantize_bf16_s"] / copy
    out["float32_write_over_copy"] = out["float32_write_s"] / copy
    out["guided_over_copy"] = out["guided_quantize_s"] / copy
    out["guided_full_over_copy"] = out["guided_quantize_full_s"] / copy
    out["encode_hint_over_copy"] = out["encode_hint_s"] / copy
    out["guided_over_quantize"] = out["guided_quantize_s"] / quant
    out["encode_hint_over_quantize"] = out["encode_hint_s"] / quant
    ao = out["torchao_nvfp4_quantize_s"]
    out["torchao_over_quantize"] = ao / quant if ao is not None else None


def _targets(out: dict) -> list[dict]:
    """Each :data:`NUMERICS_TARGETS` entry with the value measured in this run and whether it is met;
    none away from :data:`TARGET_SHAPE` (the bounds are set for it)."""
    if tuple(out["shape"]) != TARGET_SHAPE:
        return []
    rows = []
    for key, (bound, kind) in NUMERICS_TARGETS.items():
        value = out.get(key)
        met = None if value is None else (value >= bound if kind == "min" else value <= bound)
        rows.append({"ratio": key, "bound": bound, "kind": kind, "value": value, "met": met})
    return rows


def bench_numerics(rows: int = 4096, cols: int = 4096, repeats: int = 5, seed: int = 0) -> dict:
    """Time the numerics on a ``rows x cols`` bf16 tensor; returns seconds and ratios."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    y = (x.float() * (1 + 1e-3 * torch.randn(rows, cols, generator=g))).to(torch.bfloat16)
    fns = _numerics_fns(x, y)
    ao = torchao_nvfp4()
    limits = {}
    if ao is not None:
        pts = x.float().abs().amax() / NVFP4_GLOBAL_NUMERATOR
        fns["torchao_nvfp4_quantize_s"] = lambda: ao(x, per_tensor_scale=pts)
        limits["torchao_nvfp4_quantize_s"] = max(2, repeats // 2)
    samples = time_rounds(fns, repeats, limits)
    out = {
        "shape": [rows, cols],
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "numba_threads": _numba_threads(),
        "repeats": repeats,
        "timing": "median over interleaved rounds",
        **{key: statistics.median(s) for key, s in samples.items()},
        "min_s": {key: min(s) for key, s in samples.items()},
    }
    if ao is not None:
        out["torchao_bit_exact"] = _torchao_bit_exact(ao, x)
    else:
        out["torchao_nvfp4_quantize_s"] = None
    _add_ratios(out)
    out["targets"] = _targets(out)
    return out


def format_numerics(res: dict) -> str:
    copy = res.get("copy_ref_s", res["copy_s"])  # "x copy": against the faster of the two copies
    ao = res.get("torchao_nvfp4_quantize_s")
    quant = res["nvfp4_quantize_s"]
    shape = "x".join(map(str, res["shape"]))
    lines = [
        f"numerics on a {shape} {res['dtype']} tensor, {res['threads']} torch / "
        f"{res.get('numba_threads', '?')} numba threads ({res.get('timing', 'median of repeats')})",
        f"{'operation':<26}{'ms':>10}{'x copy':>10}{'x torchao':>11}{'x quantize':>12}",
    ]
    for label, key in NUMERICS_ROWS:
        t = res.get(key)
        if key not in res:
            continue
        if t is None:
            lines.append(f"{label:<26}{'n/a (torchao not installed)':>43}")
            continue
        vs_ao = f"{t / ao:>11.3f}" if ao else f"{'-':>11}"
        lines.append(f"{label:<26}{t * 1e3:>10.2f}{t / copy:>10.2f}{vs_ao}{t / quant:>12.2f}")
    if ao:
        lines.append(
            f"quantize_nvfp4 is {ao / quant:.1f}x faster than torchao "
            f"(bit-exact with torchao single-level: {res['torchao_bit_exact']})"
        )
    checks = [f"{t['ratio']} {t['value']:.2f} ({'>=' if t['kind'] == 'min' else '<='} {t['bound']}: "
              f"{'ok' if t['met'] else 'MISSED'})" for t in res.get("targets", []) if t["value"] is not None]
    if checks:
        lines.append("targets (set for 4096x4096 bf16, 2 threads): " + "; ".join(checks))
    elif tuple(res["shape"]) != TARGET_SHAPE:
        lines.append(f"no targets (they are set for {TARGET_SHAPE[0]}x{TARGET_SHAPE[1]} bf16)")
    if "memory" in res:
        lines.append(format_memory(res["memory"]))
    return "\n".join(lines)


# --- memory --------------------------------------------------------------------------------------

#: Operations the memory probe knows, as (what it runs, input dtype).
MEMORY_OPS = {
    "quantize_nvfp4/bf16": ("quantize", torch.bfloat16),
    "quantize_nvfp4/fp16": ("quantize", torch.float16),
    "quantize_nvfp4/fp32": ("quantize", torch.float32),
    "quantize_nvfp4_per_row/bf16": ("quantize_per_row", torch.bfloat16),
    "guided_quantize_lsb/bf16": ("guided_lsb", torch.bfloat16),
    "guided_quantize_full/bf16": ("guided_full", torch.bfloat16),
    "guided_quantize_lsb/fp16": ("guided_lsb", torch.float16),
    # calibration: a float32 temporary of the input (what a hidden .float() would cost) must show up
    "calibration: quantize(x.float())/bf16": ("quantize_via_float32", torch.bfloat16),
}
#: Bound of the issue: extra peak memory at most this multiple of the input's size.
MEMORY_BOUND = 1.5


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back, so that a later allocation shows up in RSS."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _nbytes(obj) -> int:
    fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return sum(t.nbytes for t in fields if isinstance(t, torch.Tensor))


def _memory_inputs(kind: str, dtype: torch.dtype, rows: int, cols: int, seed: int):
    """(callable to measure, input bytes); inputs are made directly in their dtype (no float32 detour)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=dtype)
    if kind == "quantize":
        return (lambda: quantize_nvfp4(x)), x.nbytes
    if kind == "quantize_per_row":
        return (lambda: quantize_nvfp4(x, per_row=True)), x.nbytes
    if kind == "quantize_via_float32":
        return (lambda: quantize_nvfp4(x.float())), x.nbytes
    hint = encode_hint(quantize_nvfp4(x, per_row=True), "lsb" if kind == "guided_lsb" else "full")
    return (lambda: guided_quantize(x, hint)), x.nbytes


def memory_probe(rows: int, cols: int, ops: list[str], seed: int = 0) -> dict:
    """Measure ``ops`` in this process (see the module docstring); each op after a peak reset.

    Returns per op: input, output, peak growth and extra (growth beyond the output) in bytes.
    """
    import resource

    import numpy as np

    warm = torch.randn(32, 256).to(torch.bfloat16)  # compile/load the kernels, start the thread pool
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = warm.to(dtype)
        for per_row in (False, True):
            quantize_nvfp4(w, per_row=per_row)
        for mode in ("lsb", "full"):
            guided_quantize(w, encode_hint(quantize_nvfp4(w, per_row=True), mode))
    np.empty(1)
    out = {}
    for name in ops:
        kind, dtype = MEMORY_OPS[name]
        fn, in_bytes = _memory_inputs(kind, dtype, rows, cols, seed)
        _release_free_memory()
        resettable = _reset_peak()
        before = _proc_status_kb("VmRSS") if resettable else None
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = fn()
        if resettable:
            growth = (_proc_status_kb("VmHWM") - before) * 1024
            method = "VmHWM after clear_refs"
        else:  # only exact in a fresh process whose peak so far is its current size
            growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before) * 1024
            method = "ru_maxrss before/after"
        out_bytes = _nbytes(result)
        out[name] = {
            "input_bytes": in_bytes,
            "output_bytes": out_bytes,
            "peak_growth_bytes": growth,
            "extra_bytes": growth - out_bytes,
            "extra_over_input": (growth - out_bytes) / in_bytes,
            "method": method,
        }
        del fn, result
    return out


def measure_memory(rows: int = 4096, cols: int = 4096, ops: list[str] | None = None, timeout: float = 600) -> dict:
    """Run :func:`memory_probe` in fresh subprocesses (one per op where the peak cannot be reset)."""
    ops = list(MEMORY_OPS) if ops is None else ops
    unknown = sorted(set(ops) - set(MEMORY_OPS))
    if unknown:
        raise ValueError(f"unknown memory ops {unknown}; known: {sorted(MEMORY_OPS)}")
    groups = [ops] if _reset_peak() else [[op] for op in ops]
    res: dict = {"shape": [rows, cols], "bound_extra_over_input": MEMORY_BOUND, "ops": {}}
    for group in groups:
        cmd = [sys.executable, "-m", "tracefp4.reports.bench", "memory-probe", "--rows", str(rows), "--cols", str(cols)]
        cmd += ["--ops", ",".join(group)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        res["ops"].update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return res


def format_memory(res: dict) -> str:
    mb = 1024.0**2
    shape = "x".join(map(str, res["shape"]))
    lines = [
        f"peak memory beyond input and output, {shape} tensors, fresh process (bound: "
        f"{res['bound_extra_over_input']} x input)",
        f"{'operation':<40}{'input MB':>10}{'output MB':>11}{'peak +MB':>10}{'extra MB':>10}{'x input':>9}",
    ]
    for name, m in res["ops"].items():
        lines.append(
            f"{name:<40}{m['input_bytes'] / mb:>10.1f}{m['output_bytes'] / mb:>11.1f}"
            f"{m['peak_growth_bytes'] / mb:>10.1f}{m['extra_bytes'] / mb:>10.1f}{m['extra_over_input']:>9.2f}"
        )
    return "\n".join(lines)


# --- sections and commands -----------------------------------------------------------------------


@dataclasses.dataclass
class Section:
    """One part of ``bench all``: ``run(args) -> dict`` of flat figures and ``format(dict) -> str``."""

    run: Callable[[argparse.Namespace], dict]
    format: Callable[[dict], str]
    help: str = ""


SECTIONS: dict[str, Section] = {}


def register_section(name: str, section: Section) -> None:
    """Add a section to ``bench all`` (its figures must not reuse another section's keys)."""
    SECTIONS[name] = section


def set_threads(n: int | None) -> None:
    """Use ``n`` threads in torch and in the numba kernels (None: leave both as they are)."""
    if n:
        import numba

        torch.set_num_threads(n)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def _run_numerics(args: argparse.Namespace) -> dict:
    set_threads(getattr(args, "threads", None))
    res = bench_numerics(rows=args.rows, cols=args.cols, repeats=args.repeats)
    if getattr(args, "memory", False):
        res["memory"] = measure_memory(rows=args.rows, cols=args.cols)
    return res


register_section("numerics", Section(_run_numerics, format_numerics, "FP4 numerics vs a tensor copy and torchao"))


def _run_system(args: argparse.Namespace) -> dict:
    from tracefp4.reports.bench_system import bench_system

    set_threads(getattr(args, "threads", None))
    return bench_system(repeats=args.repeats)


def _format_system(res: dict) -> str:
    from tracefp4.reports.bench_system import format_system

    return format_system(res)


register_section("system", Section(_run_system, _format_system, "guidance cost on the tiny MoE: rollout, train, store"))


def bench_all(args: argparse.Namespace, names: list[str] | None = None) -> dict:
    """Run the sections and merge their figures into one flat dict (``sections`` lists who gave what)."""
    merged: dict = {"sections": {}, "environment": environment()}  # the machine the figures belong to
    for name in names or list(SECTIONS):
        res = SECTIONS[name].run(args)
        clash = sorted(set(res) & set(merged))
        if clash:
            raise RuntimeError(f"bench section {name!r} reuses keys {clash}")
        merged["sections"][name] = sorted(res)
        merged.update(res)
    return merged


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        atomic_write_json(path, payload)
        print(f"wrote {path}")


def cmd_numerics(args: argparse.Namespace) -> int:
    res = _run_numerics(args)
    print(format_numerics(res))
    _write_json(args.json, res)
    return 0


def cmd_all(args: argparse.Namespace) -> int:
    res = bench_all(args)
    for name in res["sections"]:
        print(SECTIONS[name].format(res))
    _write_json(args.json, res)
    return 0


def _add_size_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median reported)")
    p.add_argument("--threads", type=int, help="threads for torch and the kernels (default: as configured)")
    p.add_argument("--memory", action="store_true", help="also measure peak memory per op (fresh subprocess)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")


def add_bench_commands(bsub) -> None:
    """Add ``numerics``, ``all``, ``rollout`` and ``attention`` to a ``bench`` subparsers object (the ``tracefp4`` CLI's)."""
    bn = bsub.add_parser(
        "numerics",
        help="quantize / dequantize / hints / guided rounding vs a tensor copy and torchao",
        description="Times the FP4 numerics on one bf16 tensor in one process and prints ratios.",
    )
    _add_size_args(bn)
    bn.set_defaults(func=cmd_numerics)
    ba = bsub.add_parser(
        "all",
        help="every benchmark section, merged into one table and one JSON",
        description="Runs every registered section (" + ", ".join(SECTIONS) + ") and merges their figures.",
    )
    _add_size_args(ba)
    ba.set_defaults(func=cmd_all)
    from tracefp4.reports.bench_attention import add_attention_command
    from tracefp4.reports.bench_rollout import add_rollout_command

    add_rollout_command(bsub, _write_json)
    add_attention_command(bsub, _write_json)


def main(argv: list[str] | None = None) -> int:
    """``python -m tracefp4.reports.bench``: the bench commands, plus the memory probe the subprocesses run."""
    p = argparse.ArgumentParser(prog="python -m tracefp4.reports.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_bench_commands(sub)
    mp = sub.add_parser("memory-probe", help="(internal) measure peak memory in this process, print JSON")
    mp.add_argument("--rows", type=int, required=True)
    mp.add_argument("--cols", type=int, required=True)
    mp.add_argument("--ops", required=True, help="comma-separated names from MEMORY_OPS")
    mp.set_defaults(func=lambda a: print(json.dumps(memory_probe(a.rows, a.cols, a.ops.split(",")))) or 0)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
