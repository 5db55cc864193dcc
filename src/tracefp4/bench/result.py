"""What a benchmark run reports: typed records in a versioned JSON file, and their formatting.

A figure is a :class:`Record`: which suite measured it (``name``), the quantity (``metric``, e.g.
``rollout_tokens_per_s``), the engine and mode it ran (``vllm``/``fp4``: the committed results keep
those labels as data), the cell it was measured at (``shape``: batch, context, tensor size, ...), its
value, spread and unit, and the CPU (``machine``). A run is a :class:`Run`: one suite's records, the
configuration it ran with, its target judgements and the machine's full description. A results file
holds runs under ``schema_version`` :data:`SCHEMA_VERSION`; :func:`load` validates it and names the
file and the field of anything wrong, and :func:`save` writes it whole or not at all.

Readers (``gendocs``, ``scripts/gpu_check.py``, the suites' formatters) ask a run for a figure by its
fields (:meth:`Run.value`), never by parsing a key. The one formatting, for the terminal and the
generated pages: :func:`figure_text` (a figure, ``-`` where the run has none, with its target's mark),
:func:`spread_text` (a figure's spread over runs), :func:`target_line` (a target's judgement) and
:func:`table` (a markdown table of such cells).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tracefp4.files import atomic_write_json

__all__ = ["SCHEMA_VERSION", "SUITES", "Judgement", "Record", "ResultError", "Run", "figure_text", "load", "load_runs",
           "save", "spread_text", "table", "target_line", "verdict"]

#: The results schema. Version 1: runs of records (this module); the flat dotted-key dicts before it
#: were migrated once, when this package was made.
SCHEMA_VERSION = 1
#: The suites a run may come from (``tracefp4 bench all`` runs each).
SUITES = ("numerics", "system", "attention", "rollout", "long")

Value = float | int | None
ShapeValue = int | str


class ResultError(ValueError):
    """A results file that does not follow the schema; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One figure. ``shape`` holds the cell's coordinates (``batch``, ``context``, ``rows``, ``cols``,
    ``region``, ``op``...); ``spread`` the (min, max) over rounds where the run kept them (either may
    be None: a committed run that recorded only its minimum)."""

    name: str
    metric: str
    value: Value
    unit: str = ""
    engine: str | None = None
    mode: str | None = None
    shape: Mapping[str, ShapeValue] = dataclasses.field(default_factory=dict)
    spread: tuple[Value, Value] | None = None
    machine: str = ""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = dict(self.shape)
        out["spread"] = None if self.spread is None else list(self.spread)
        return out

    def matches(self, metric: str, engine: str | None, mode: str | None, shape: Mapping[str, ShapeValue]) -> bool:
        return (self.metric == metric and (engine is None or self.engine == engine)
                and (mode is None or self.mode == mode) and all(self.shape.get(k) == v for k, v in shape.items()))


@dataclasses.dataclass(frozen=True)
class Judgement:
    """A target judged on a run: ``value`` against ``bound`` (``kind`` ``min``: at least, ``max``: at most)."""

    target: str
    value: float
    bound: float
    kind: str
    met: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Run:
    """One suite's run: its records, the configuration it ran with (preset, model, cells, command...),
    the machine's description (:func:`tracefp4.provenance.environment`, or what a transcription
    recorded), its target judgements and the targets whose figures it did not measure."""

    suite: str
    records: list[Record]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    targets: list[Judgement] = dataclasses.field(default_factory=list)
    targets_not_run: list[str] = dataclasses.field(default_factory=list)

    def find(self, metric: str, engine: str | None = None, mode: str | None = None,
             **shape: ShapeValue) -> list[Record]:
        """The records of ``metric`` whose fields equal those given (a field not given matches any)."""
        return [r for r in self.records if r.matches(metric, engine, mode, shape)]

    def record(self, metric: str, engine: str | None = None, mode: str | None = None,
               **shape: ShapeValue) -> Record | None:
        """The one record so named, None if the run has none; a ValueError if the fields given leave several."""
        found = self.find(metric, engine, mode, **shape)
        if len(found) > 1:
            raise ValueError(f"{self.suite} run: {len(found)} records of {metric} engine={engine} mode={mode} "
                             f"{shape}: name the cell")
        return found[0] if found else None

    def value(self, metric: str, engine: str | None = None, mode: str | None = None, **shape: ShapeValue) -> Value:
        """:meth:`record`'s value (None where the run has no such record)."""
        r = self.record(metric, engine, mode, **shape)
        return None if r is None else r.value

    def values(self, metric: str, key: str, engine: str | None = None, mode: str | None = None,
               **shape: ShapeValue) -> list[ShapeValue]:
        """The sorted distinct ``key`` coordinates (a shape key, or ``engine``/``mode``) of ``metric``'s records."""
        found = self.find(metric, engine, mode, **shape)
        got = {getattr(r, key) if key in ("engine", "mode") else r.shape.get(key) for r in found}
        return sorted(v for v in got if v is not None)

    @property
    def cpu(self) -> str:
        return str(self.machine.get("cpu_model") or "")

    def to_json(self) -> dict[str, Any]:
        return {"suite": self.suite, "config": self.config, "machine": self.machine,
                "records": [r.to_json() for r in self.records], "targets": [t.to_json() for t in self.targets],
                "targets_not_run": list(self.targets_not_run)}


# --- the file --------------------------------------------------------------------------------------


def save(path: str | os.PathLike[str], runs: Sequence[Run], **provenance: Any) -> None:
    """Write ``runs`` as one results file (whole or not at all: a temporary file renamed over it).
    ``provenance``: what a transcription records about where its figures came from."""
    payload: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "runs": [r.to_json() for r in runs]}
    if provenance:
        payload["provenance"] = provenance
    atomic_write_json(path, payload)


def load(path: str | os.PathLike[str]) -> tuple[list[Run], dict[str, Any]]:
    """The runs of a results file and its provenance; a :class:`ResultError` names the file and field
    of anything that does not follow the schema."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: not a readable JSON file: {e}") from None
    where = str(path)
    _expect(isinstance(data, dict), where, "the top level must be an object")
    version = data.get("schema_version")
    _expect(version == SCHEMA_VERSION, where, f"schema_version = {version!r}: expected {SCHEMA_VERSION} (a file "
            "from before the bench package: its figures were migrated once, in the commit that made it)")
    runs = data.get("runs")
    _expect(isinstance(runs, list) and runs, where, "runs: expected a non-empty list")
    provenance = data.get("provenance", {})
    _expect(isinstance(provenance, dict), where, "provenance: expected an object")
    return [_run(r, f"{where}: runs[{i}]") for i, r in enumerate(runs)], provenance


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> list[Run]:
    """Every run of every file, in order."""
    return [run for p in paths for run in load(p)[0]]


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ResultError(f"{where}: {what}")


def _is_value(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _run(d: Any, where: str) -> Run:
    _expect(isinstance(d, dict), where, "expected an object")
    unknown = sorted(set(d) - {"suite", "config", "machine", "records", "targets", "targets_not_run"})
    _expect(not unknown, where, f"unknown field(s) {unknown}")
    _expect(d.get("suite") in SUITES, where, f"suite = {d.get('suite')!r}: expected one of {', '.join(SUITES)}")
    for field in ("config", "machine"):
        _expect(isinstance(d.get(field, {}), dict), where, f"{field}: expected an object")
    recs = d.get("records")
    _expect(isinstance(recs, list), where, "records: expected a list")
    targets = d.get("targets", [])
    _expect(isinstance(targets, list), where, "targets: expected a list")
    not_run = d.get("targets_not_run", [])
    _expect(isinstance(not_run, list) and all(isinstance(x, str) for x in not_run), where,
            "targets_not_run: expected a list of target names")
    return Run(d["suite"], [_record(r, f"{where}.records[{i}]") for i, r in enumerate(recs)], d.get("config", {}),
               d.get("machine", {}), [_judgement(t, f"{where}.targets[{i}]") for i, t in enumerate(targets)], not_run)


_RECORD_FIELDS = {f.name for f in dataclasses.fields(Record)}


def _record(d: Any, where: str) -> Record:
    _expect(isinstance(d, dict), where, "expected an object")
    unknown, missing = sorted(set(d) - _RECORD_FIELDS), sorted({"name", "metric", "value"} - set(d))
    _expect(not unknown, where, f"unknown field(s) {unknown}")
    _expect(not missing, where, f"missing field(s) {missing}")
    for field in ("name", "metric", "unit", "machine"):
        _expect(isinstance(d.get(field, ""), str), where, f"{field}: expected a string")
    for field in ("engine", "mode"):
        _expect(d.get(field) is None or isinstance(d[field], str), where, f"{field}: expected a string or null")
    _expect(_is_value(d["value"]), where, f"value = {d['value']!r}: expected a number or null")
    shape = d.get("shape", {})
    _expect(isinstance(shape, dict) and all(isinstance(v, (int, str)) for v in shape.values()), where,
            "shape: expected an object of integers and strings")
    spread = d.get("spread")
    _expect(spread is None or (isinstance(spread, list) and len(spread) == 2 and all(map(_is_value, spread))), where,
            "spread: expected null or [min, max]")
    return Record(**{**d, "shape": dict(shape), "spread": None if spread is None else tuple(spread)})


def _judgement(d: Any, where: str) -> Judgement:
    _expect(isinstance(d, dict) and set(d) == {"target", "value", "bound", "kind", "met"}, where,
            "expected an object of target, value, bound, kind, met")
    _expect(d["kind"] in ("min", "max"), where, f"kind = {d['kind']!r}: expected min or max")
    return Judgement(**d)


# --- formatting, for the terminal and the generated pages -----------------------------------------


def figure_text(value: Value, fmt: str = ".2f", target: Judgement | None = None) -> str:
    """A figure as a cell: ``value`` in ``fmt`` (``-`` where the run has none), then ✓ or ✗ where a
    ``target`` judged it."""
    if value is None:
        return "-"
    return format(value, fmt) + ("" if target is None else (" ✓" if target.met else " ✗"))


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, a line per row (each row as many cells as ``head``;
    a ValueError names the row that has not)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        if len(row) != len(head):
            raise ValueError(f"table row {i}: {len(row)} cells for {len(head)} columns ({', '.join(head)})")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def spread_text(values: Sequence[float], fmt: str = ".2f", unit: str = "x") -> str:
    """``lo–hi`` of the values as shown (one value where they print alike), the unit after it; a
    ``%`` format shows shares as 18–20%."""
    if fmt.endswith("%"):
        values, fmt, unit = [100 * v for v in values], fmt[:-1] + "f", "%" + unit
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def verdict(t: Judgement) -> str:
    """``<= 1.05: ok``: a target's bound and whether the run met it."""
    return f"{'>=' if t.kind == 'min' else '<='} {t.bound}: {'ok' if t.met else 'MISSED'}"


def target_line(t: Judgement) -> str:
    """One target's judgement, as every suite prints it."""
    return f"target {t.target}: {t.value:.3f} ({verdict(t)})"
