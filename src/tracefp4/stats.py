"""The statistics every summary reports, in one place: a mean with its 95% interval over seeds, paired
differences against a reference seed by seed, and their ``mean [lo, hi]`` text.

The intervals are Student-t intervals over independent runs (seeds): with a handful of seeds the
normal quantile would understate them by a factor of up to 6 (``t_{0.975,1}`` = 12.7).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["t_quantile_975", "mean_ci95", "paired_differences", "format_ci", "format_mean_ci"]

_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width factor of a two-sided 95% interval."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci95(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "ci95": [lo, hi], "n"}``; one value gives a zero-width interval."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_ci95: no values")
    mean = statistics.fmean(vals)
    half = 0.0 if len(vals) < 2 else t_quantile_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(vals)}


def paired_differences(values: Mapping[Any, float], reference: Mapping[Any, float]) -> dict[str, Any] | None:
    """:func:`mean_ci95` of ``values[s] - reference[s]`` over the seeds ``s`` both have, in ``values``'
    order (the same warm start and prompts per seed: the seed-to-seed spread, which dominates the plain
    intervals, cancels in the difference); None where they share no seed."""
    diffs = [v - reference[s] for s, v in values.items() if s in reference]
    return mean_ci95(diffs) if diffs else None


def format_ci(d: Mapping[str, Any] | None, spec: str = ".3f") -> str:
    """``[lo, hi]`` of a :func:`mean_ci95` result, each bound formatted by ``spec``; ``-`` for None."""
    return f"[{d['ci95'][0]:{spec}}, {d['ci95'][1]:{spec}}]" if d else "-"


def format_mean_ci(d: Mapping[str, Any] | None, spec: str = ".3f") -> str:
    """``mean [lo, hi]`` of a :func:`mean_ci95` result, each figure formatted by ``spec``; ``-`` for None."""
    return f"{d['mean']:{spec}} {format_ci(d, spec)}" if d else "-"
