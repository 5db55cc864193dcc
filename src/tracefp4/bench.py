"""Side-by-side timings: every figure is measured in one process, in one run, and reported as a ratio.

These machines are noisy, so absolute times mean little across runs; ratios against a same-size
tensor copy and against torchao, measured interleaved in the same run, are what the targets use.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .guidance import encode_hint, guided_quantize
from .numerics import dequantize_nvfp4, quantize_nvfp4


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


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


def bench_numerics(rows: int = 4096, cols: int = 4096, repeats: int = 5, seed: int = 0) -> dict:
    """Time the numerics on a ``rows x cols`` bf16 tensor; returns seconds and ratios."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    y = (x.float() * (1 + 1e-3 * torch.randn(rows, cols, generator=g))).to(torch.bfloat16)
    q = quantize_nvfp4(x)
    hint = encode_hint(q, "lsb")
    out = {
        "shape": [rows, cols],
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "copy_s": _time(lambda: x.clone(), repeats),
        "nvfp4_quantize_s": _time(lambda: quantize_nvfp4(x), repeats),
        "nvfp4_dequantize_s": _time(lambda: dequantize_nvfp4(q), repeats),
        "encode_hint_s": _time(lambda: encode_hint(q, "lsb"), repeats),
        "guided_quantize_s": _time(lambda: guided_quantize(y, hint), repeats),
    }
    ao = torchao_nvfp4()
    if ao is not None:
        pts = x.float().abs().amax() / (448.0 * 6.0)
        out["torchao_nvfp4_quantize_s"] = _time(lambda: ao(x, per_tensor_scale=pts), max(2, repeats // 2))
        ours = quantize_nvfp4(x, global_amax=torch.tensor(448.0 * 6.0))
        ao_scales, ao_codes = ao(x)  # single-level: equal to ours with S_enc = 1
        out["torchao_bit_exact"] = bool(torch.equal(ao_codes, ours.codes)) and bool(
            torch.equal(ao_scales.view(torch.uint8), ours.scales.view(torch.uint8))
        )
    else:
        out["torchao_nvfp4_quantize_s"] = None
    return out


def format_numerics(res: dict) -> str:
    copy = res["copy_s"]
    ao = res.get("torchao_nvfp4_quantize_s")
    rows = [
        ("tensor copy", "copy_s"),
        ("quantize_nvfp4", "nvfp4_quantize_s"),
        ("dequantize_nvfp4", "nvfp4_dequantize_s"),
        ("encode_hint(lsb)", "encode_hint_s"),
        ("guided_quantize(lsb)", "guided_quantize_s"),
        ("torchao nvfp4_quantize", "torchao_nvfp4_quantize_s"),
    ]
    shape = "x".join(map(str, res["shape"]))
    lines = [
        f"numerics on a {shape} {res['dtype']} tensor, {res['threads']} threads (median of repeats)",
        f"{'operation':<26}{'ms':>10}{'x copy':>10}{'x torchao':>11}{'x quantize':>12}",
    ]
    for label, key in rows:
        t = res.get(key)
        if t is None:
            lines.append(f"{label:<26}{'n/a (torchao not installed)':>43}")
            continue
        vs_ao = f"{t / ao:>11.3f}" if ao else f"{'-':>11}"
        lines.append(
            f"{label:<26}{t * 1e3:>10.2f}{t / copy:>10.1f}{vs_ao}{t / res['nvfp4_quantize_s']:>12.2f}"
        )
    if ao:
        lines.append(
            f"quantize_nvfp4 is {ao / res['nvfp4_quantize_s']:.1f}x faster than torchao "
            f"(bit-exact with torchao single-level: {res['torchao_bit_exact']})"
        )
    return "\n".join(lines)
