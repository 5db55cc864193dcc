"""The numerics suite: quantize, dequantize, hints and guided rounding against a tensor copy and torchao.

Every figure is measured in one process and reported as a ratio: these machines are noisy (and
shared), so absolute times mean little across runs; ratios against a same-size tensor copy and
against torchao, measured in the same run, are what the targets use (``targets.toml``). They are set
for a 4096x4096 bf16 tensor on 2 threads. The limit is the copy: quantizing reads 2 bytes and writes
0.56 per element, a copy reads 2 and writes 2, so a one-pass quantizer runs at or below a copy's time
and a per-tensor one (an amax pass, then the quantize pass) at about 1.5x. A dequantization to bf16
reads 0.56 and writes 2, so it too runs at or below a copy's time; to float32 it writes 4 bytes an
element (and reads each written line first), twice the copy's writes, which bounds it near 1.4x a
copy by bytes alone: its row is measured against the same 1.1 and reads as the bound it is, beside
the floor it cannot beat, only writing a float32 tensor of the same elements into a buffer
(``float32_write_over_copy``).

Memory (``--memory``): each operation's peak resident memory beyond its input and output, in a
fresh process (:mod:`tracefp4.bench.memory`), bounded at 1.5x the input.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

from collections.abc import Callable

import torch

from tracefp4.bench.harness import Spread, time_rounds
from tracefp4.bench.memory import ResidentProbe, peak_growth, run_child
from tracefp4.bench.result import Record, Run, target_line
from tracefp4.bench.targets import judged
from tracefp4.formats import dequantize_nvfp4, quantize_nvfp4
from tracefp4.formats.constants import NVFP4_GLOBAL_NUMERATOR
from tracefp4.guidance.hints import encode_hint, guided_quantize
from tracefp4.provenance import environment

__all__ = ["MEMORY_OPS", "NUMERICS_ROWS", "bench_numerics", "format_numerics", "measure_memory", "numerics_run",
           "peak_memory"]

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



#: (ratio metric, numerator, denominator) of each ratio reported; ``copy_ref_s`` is the faster of the two
#: copies measured in this run: a copy's limit is its memory bandwidth, and the page faults of a fresh 32 MB
#: allocation come and go with the allocator's state (one run measured x.clone() at 11.3 ms against 1.5 ms
#: into a buffer, the next 2.0 and 2.2)
RATIOS = (
    ("quantize_over_copy", "nvfp4_quantize_s", "copy_ref_s"),
    ("quantize_over_copy_into", "nvfp4_quantize_s", "copy_into_s"),
    ("quantize_per_row_over_copy", "nvfp4_quantize_per_row_s", "copy_ref_s"),
    ("dequantize_over_copy", "nvfp4_dequantize_s", "copy_ref_s"),
    ("dequantize_bf16_over_copy", "nvfp4_dequantize_bf16_s", "copy_ref_s"),
    ("float32_write_over_copy", "float32_write_s", "copy_ref_s"),
    ("guided_over_copy", "guided_quantize_s", "copy_ref_s"),
    ("guided_full_over_copy", "guided_quantize_full_s", "copy_ref_s"),
    ("encode_hint_over_copy", "encode_hint_s", "copy_ref_s"),
    ("guided_over_quantize", "guided_quantize_s", "nvfp4_quantize_s"),
    ("encode_hint_over_quantize", "encode_hint_s", "nvfp4_quantize_s"),
    ("torchao_over_quantize", "torchao_nvfp4_quantize_s", "nvfp4_quantize_s"),
)


def _machine() -> tuple[dict, str]:
    env = environment()
    return env, env.get("cpu_model", "")


def bench_numerics(rows: int = 4096, cols: int = 4096, repeats: int = 5, seed: int = 0) -> Run:
    """Time the numerics on a ``rows x cols`` bf16 tensor in interleaved rounds: seconds and ratios."""
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
    times = {key: Spread.of(s) for key, s in time_rounds(fns, repeats, limits).items()}
    config = {"shape": [rows, cols], "dtype": "bfloat16", "threads": torch.get_num_threads(),
              "numba_threads": _numba_threads(), "repeats": repeats, "timing": "median over interleaved rounds",
              # a check, not a figure: torchao's codes and scales equal ours (None: torchao absent)
              "torchao_bit_exact": _torchao_bit_exact(ao, x) if ao is not None else None}
    return numerics_run(times, config)


def numerics_run(times: dict[str, Spread], config: dict) -> Run:
    """The run of these operation times (seconds over rounds, by the keys of :data:`NUMERICS_ROWS`):
    their records, the ratios against the copy and the targets judged."""
    env, cpu = _machine()
    rows, cols = config["shape"]
    rec = functools.partial(Record, "numerics", shape={"rows": rows, "cols": cols}, machine=cpu)
    times = {**times, "copy_ref_s": min(times["copy_s"], times["copy_into_s"], key=lambda t: t.median)}
    records = [rec(key, t.median, "s", spread=t.span) for key, t in times.items()]
    for metric, num, den in RATIOS:
        if num in times:
            records.append(rec(metric, times[num].median / times[den].median, "x"))
    return judged(Run("numerics", records, config, env))


def format_numerics(run: Run) -> str:
    c, v = run.config, run.value
    copy, ao, quant = v("copy_ref_s") or v("copy_s"), v("torchao_nvfp4_quantize_s"), v("nvfp4_quantize_s")
    lines = []
    if quant is not None:
        lines += [
            f"numerics on a {'x'.join(map(str, c['shape']))} {c['dtype']} tensor, {c['threads']} torch / "
            f"{c.get('numba_threads', '?')} numba threads ({c.get('timing', 'median of repeats')})",
            f"{'operation':<26}{'ms':>10}{'x copy':>10}{'x torchao':>11}{'x quantize':>12}"]
        for label, key in NUMERICS_ROWS:
            t = v(key)
            if t is None:
                if key == "torchao_nvfp4_quantize_s":
                    lines.append(f"{label:<26}{'n/a (torchao not installed)':>43}")
                continue
            vs_ao = f"{t / ao:>11.3f}" if ao else f"{'-':>11}"
            lines.append(f"{label:<26}{t * 1e3:>10.2f}{t / copy:>10.2f}{vs_ao}{t / quant:>12.2f}")
        if ao:
            lines.append(f"quantize_nvfp4 is {ao / quant:.1f}x faster than torchao "
                         f"(bit-exact with torchao single-level: {c.get('torchao_bit_exact')})")
    timed = [t for t in run.targets if not t.target.startswith("extra memory")]
    lines += [target_line(t) for t in timed]
    if quant is not None and not timed:
        lines.append("no targets (they are set for 4096x4096 bf16, 2 threads)")
    if run.find("extra_over_input"):
        lines.append(format_memory(run))
    return "\n".join(lines)


# --- memory ------------------------------------------------------------------------------------------------

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


def peak_memory(rows: int, cols: int, ops: list[str], seed: int = 0) -> dict:
    """In this (fresh) process: each of ``ops``'s input, output, peak growth and extra (growth beyond
    the output) in bytes, each op after a peak reset (the kernels compiled and loaded first)."""
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
        growth, result, method = peak_growth(fn)
        out_bytes = _nbytes(result)
        out[name] = {"input_bytes": in_bytes, "output_bytes": out_bytes, "peak_growth_bytes": growth,
                     "extra_bytes": growth - out_bytes, "extra_over_input": (growth - out_bytes) / in_bytes,
                     "method": method}
        del fn, result
    return out


def measure_memory(rows: int = 4096, cols: int = 4096, ops: list[str] | None = None,
                   timeout: float = 600) -> list[Record]:
    """:func:`peak_memory` in fresh processes (one per op where the peak cannot be reset), as records."""
    ops = list(MEMORY_OPS) if ops is None else ops
    unknown = sorted(set(ops) - set(MEMORY_OPS))
    if unknown:
        raise ValueError(f"unknown memory ops {unknown}; known: {sorted(MEMORY_OPS)}")
    groups = [ops] if ResidentProbe.peak_resettable() else [[op] for op in ops]
    cpu = environment().get("cpu_model", "")
    records = []
    for group in groups:
        got = run_child("tracefp4.bench.suites.numerics:peak_memory", {"rows": rows, "cols": cols, "ops": group},
                        timeout=timeout)
        for op, m in got.items():
            for metric, unit in (("input_bytes", "B"), ("output_bytes", "B"), ("peak_growth_bytes", "B"),
                                 ("extra_bytes", "B"), ("extra_over_input", "x")):
                records.append(Record("numerics", metric, m[metric], unit, shape={"rows": rows, "cols": cols, "op": op},
                                      machine=cpu))
    return records


def format_memory(run: Run) -> str:
    mb = 1024.0**2
    ops = run.values("extra_over_input", "op")
    first = run.find("extra_over_input")[0].shape
    lines = [f"peak memory beyond input and output, {first['rows']}x{first['cols']} tensors, fresh process "
             f"(bound: 1.5 x input)",
             f"{'operation':<40}{'input MB':>10}{'output MB':>11}{'peak +MB':>10}{'extra MB':>10}{'x input':>9}"]
    for op in ops:
        m = {k: run.value(k, op=op) for k in ("input_bytes", "output_bytes", "peak_growth_bytes", "extra_bytes",
                                             "extra_over_input")}
        lines.append(f"{op:<40}{m['input_bytes'] / mb:>10.1f}{m['output_bytes'] / mb:>11.1f}"
                     f"{m['peak_growth_bytes'] / mb:>10.1f}{m['extra_bytes'] / mb:>10.1f}{m['extra_over_input']:>9.2f}")
    lines += [target_line(t) for t in run.targets if t.target.startswith("extra memory") and not t.met]
    return "\n".join(lines)


# --- the suite ---------------------------------------------------------------------------------------------


def set_threads(n: int | None) -> None:
    """Use ``n`` threads in torch and in the numba kernels (None: leave both as they are)."""
    if n:
        import numba

        torch.set_num_threads(n)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median reported)")
    p.add_argument("--threads", type=int, help="threads for torch and the kernels (default: as configured)")
    p.add_argument("--memory", action="store_true", help="also measure peak memory per op (fresh subprocess)")


def run(args: argparse.Namespace) -> Run:
    set_threads(args.threads)
    res = bench_numerics(rows=args.rows, cols=args.cols, repeats=args.repeats)
    if args.memory:
        res.records += measure_memory(rows=args.rows, cols=args.cols)
        judged(res)
    return res
