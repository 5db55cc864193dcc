"""Interleaved timing: one call of each operation per round, so that a burst of load from elsewhere
on a shared machine slows every operation of that round alike instead of landing on one of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

__all__ = ["time_rounds"]


def time_rounds(
    fns: Mapping[str, Callable[[], object]], repeats: int, limits: Mapping[str, int] | None = None
) -> dict[str, list[float]]:
    """Per name: call times (s) over ``repeats`` interleaved rounds, after one warm-up call each
    (compilation, weight caches). ``limits`` caps the rounds of slow callables so they do not
    dominate the run."""
    limits = limits or {}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(repeats):
        for name, fn in fns.items():
            if rnd >= limits.get(name, repeats):
                continue
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples
