"""How every benchmark times: interleaved rounds, paired ratios, runs of steps, medians and spreads.

These machines are shared and drift (by up to 2x over minutes), so no figure compares two stretches
of time: each round calls every operation once, so that a burst of load from elsewhere slows every
operation of that round alike; a ratio is taken within each round and reported as the median over
rounds with its spread (min, max); a stepped engine alternates its modes in runs of consecutive
steps (:func:`run_lengths`) and reports the median run's rate. The one median of the package is here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Spread", "interleave", "median", "median_rate", "paired", "run_lengths", "time_rounds", "timed"]


@dataclasses.dataclass(frozen=True)
class Spread:
    """A figure over rounds: the median and the (min, max) it comes from."""

    median: float
    lo: float
    hi: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread of no values: no round was timed")
        return cls(statistics.median(values), min(values), max(values), len(values))

    @property
    def span(self) -> tuple[float, float]:
        return self.lo, self.hi


def median(values: Sequence[float]) -> float:
    return Spread.of(values).median


def interleave(calls: Mapping[str, Callable[[], float]], repeats: int, limits: Mapping[str, int] | None = None,
               say: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per name: the seconds each call reports over ``repeats`` rounds, every call once per round in a
    fixed order. A call times itself (in this process, or in a server that times its own work);
    ``limits`` caps the rounds of slow calls so they do not dominate the run."""
    limits = limits or {}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for rnd in range(repeats):
        for name, call in calls.items():
            if rnd >= limits.get(name, repeats):
                continue
            samples[name].append(call())
            if say:
                label = " ".join(name) if isinstance(name, tuple) else name  # (engine, mode) keys read as words
                say(f"round {rnd + 1}/{repeats}: {label} {samples[name][-1]:.1f}s")
    return samples


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` as a call of :func:`interleave`: it runs ``fn`` and reports the seconds it took (the one
    clock reading of the package)."""

    def call() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return call


def time_rounds(fns: Mapping[str, Callable[[], object]], repeats: int,
                limits: Mapping[str, int] | None = None) -> dict[str, list[float]]:
    """:func:`interleave` of callables timed here, after one warm-up call each (compilation, weight caches)."""
    for fn in fns.values():
        fn()
    return interleave({name: timed(fn) for name, fn in fns.items()}, repeats, limits)


def paired(samples: Mapping[str, Sequence[float]], num: str, den: str) -> Spread:
    """The per-round ratio ``num / den`` (each round timed both once), over rounds."""
    return Spread.of([a / b for a, b in zip(samples[num], samples[den])])


def run_lengths(n: int, repeats: int) -> list[int]:
    """The steps of each of ``repeats`` runs that alternate the modes of a cell: ``n // repeats``
    each, the last taking the remainder."""
    size = n // repeats
    return [size] * (repeats - 1) + [n - size * (repeats - 1)]


def median_rate(step_times: Sequence[float], tokens_per_step: int, repeats: int) -> float:
    """Tokens/s of ``repeats`` equal runs of consecutive steps, median."""
    size = len(step_times) // repeats
    runs = [step_times[i * size:(i + 1) * size] for i in range(repeats)]
    return median([tokens_per_step * len(r) / sum(r) for r in runs])
