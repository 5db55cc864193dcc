"""The benchmarks' targets, read from one data file (``targets.toml`` beside this module), in one shape.

A :class:`Target` is a bound on one figure or on the ratio of two (their records named by metric and
fields, :meth:`tracefp4.bench.result.Run.value`), set for the runs whose configuration matches
``when``; ``over`` judges it at every cell the run measured. :func:`judge` gives a run's
:class:`~tracefp4.bench.result.Judgement` list and the targets it did not measure.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tracefp4.bench.result import SUITES, Judgement, Run

__all__ = ["TARGETS_FILE", "Target", "judge", "judged", "targets"]

TARGETS_FILE = Path(__file__).with_name("targets.toml")
_FIELDS = ("engine", "mode")


@dataclasses.dataclass(frozen=True)
class Target:
    label: str
    suite: str
    num: Mapping[str, Any]
    bound: float
    kind: str
    den: Mapping[str, Any] | None = None
    when: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    over: tuple[str, ...] = ()

    def applies(self, run: Run) -> bool:
        return run.suite == self.suite and all(run.config.get(k) == v for k, v in self.when.items())

    def cells(self, run: Run) -> list[dict[str, Any]]:
        """The ``over`` coordinates at which the run measured the numerator ([{}] without ``over``)."""
        if not self.over:
            return [{}]
        metric, fields = _query(self.num)
        found = run.find(metric, fields.pop("engine", None), fields.pop("mode", None), **fields)
        keys = {tuple((k, r.engine if k == "engine" else r.mode if k == "mode" else r.shape.get(k)) for k in self.over)
                for r in found}
        # in the order of their coordinates (contexts and batches as numbers, engines as names)
        return [dict(k) for k in sorted(keys, key=lambda k: [(str(type(v)), v) for _, v in k])
                if all(v is not None for _, v in k)]

    def judge(self, run: Run, cell: Mapping[str, Any]) -> Judgement | None:
        a = _value(run, self.num, cell)
        b = 1.0 if self.den is None else _value(run, self.den, cell)
        if a is None or b is None or not b:
            return None
        value = a / b
        met = value >= self.bound if self.kind == "min" else value <= self.bound
        return Judgement(self.label.format(**cell), value, self.bound, self.kind, bool(met))


def _query(q: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    fields = dict(q)
    return fields.pop("metric"), fields


def _value(run: Run, q: Mapping[str, Any], cell: Mapping[str, Any]):
    metric, fields = _query({**q, **cell})
    return run.value(metric, fields.pop("engine", None), fields.pop("mode", None), **fields)


def _target(d: Mapping[str, Any], where: str) -> Target:
    known = {f.name for f in dataclasses.fields(Target)}
    unknown, missing = sorted(set(d) - known), sorted({"label", "suite", "num", "bound", "kind"} - set(d))
    if unknown or missing:
        raise ValueError(f"{where}: unknown field(s) {unknown}, missing field(s) {missing}")
    if d["suite"] not in SUITES or d["kind"] not in ("min", "max") or "metric" not in d["num"]:
        raise ValueError(f"{where}: suite must be one of {SUITES}, kind min or max, num name a metric")
    if d.get("den") is not None and "metric" not in d["den"]:
        raise ValueError(f"{where}: den must name a metric")
    return Target(**{**d, "bound": float(d["bound"]), "over": tuple(d.get("over", ()))})


@functools.cache
def targets(path: Path = TARGETS_FILE) -> tuple[Target, ...]:
    """Every target of the data file, in its order; a ValueError names a malformed entry."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return tuple(_target(d, f"{path}: target {i} ({d.get('label')!r})") for i, d in enumerate(data.get("target", [])))


def judge(run: Run, path: Path = TARGETS_FILE) -> tuple[list[Judgement], list[str]]:
    """The run's judgements (each target set for it, at each cell it measured) and the labels of the
    targets set for it whose figures it did not measure."""
    done, not_run = [], []
    for t in targets(path):
        if not t.applies(run):
            continue
        got = [j for j in (t.judge(run, c) for c in t.cells(run)) if j is not None]
        done += got
        if not got and not t.over:
            not_run.append(t.label)
    return done, not_run


def judged(run: Run) -> Run:
    """``run`` with its targets judged (its own judgements replaced)."""
    run.targets, run.targets_not_run = judge(run)
    return run

