"""A run folder: per-step metrics as JSONL (and TensorBoard when installed), plots, a summary table.

Layout of ``runs/<timestamp>/``::

    config.json            the resolved configuration of the run
    metrics/<arm>.jsonl    one JSON object per step (and per evaluation) of each arm
    checkpoints/<arm>/     safetensors checkpoints
    plots/*.png            log-prob gap, reward and evaluation accuracy vs step, all arms on one chart
    summary.md             the markdown summary table
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Iterable, Mapping

from tracefp4.files import atomic_write_bytes
from tracefp4.pipeline.arms import CHART_ORDER, arm_style


class MetricsLog:
    """Appends one JSON line per record (flushed and fsynced); mirrors scalars to TensorBoard when installed.

    Resuming (``resume_step=N``, the step of the checkpoint the arm continues from, 0 when it starts
    over) first rewrites the file so that it holds exactly what the run had logged when that
    checkpoint was saved, so the finished file has one row per step:

    * train rows with ``step < N`` (the train row of step ``s`` is logged after step ``s`` ran;
      checkpoint ``N`` is saved after step ``N-1``);
    * eval rows with ``step <= N`` when ``N > 0``: the evaluation at step ``N`` is logged right
      before checkpoint ``N`` is saved and is not repeated on resume. With ``N == 0`` there is no
      checkpoint, the arm starts over and logs its step-0 evaluation again, so nothing is kept;
    * rows without a ``step`` are kept.

    The rewrite is atomic (kept rows to a temp file, fsync, rename, fsync the folder): a kill during
    it leaves the old file, and the next resume rewrites it again. A torn last line (a kill or power
    loss during a write) is dropped; an unreadable line anywhere else is an error. TensorBoard events
    from ``N`` on are purged (``purge_step``) and the kept rows at ``N`` mirrored again.
    """

    def __init__(self, run_dir: Path, arm: str, tensorboard: bool = True, *, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics" / f"{arm}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = self._prepare(resume_step)
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard" / arm), purge_step=resume_step)
            except Exception:  # tensorboard is optional
                self._tb = None
        if resume_step is not None:
            for row in kept:
                if isinstance(row.get("step"), int) and row["step"] >= resume_step:
                    self._mirror(row)

    def _prepare(self, resume_step: int | None) -> list[dict]:
        """Drop a torn tail and, when resuming, the rows logged after the checkpoint; returns the kept rows."""
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        rows = parse_metrics_lines(raw.decode("utf-8", errors="replace"), self.path)
        kept = rows if resume_step is None else [r for r in rows if _logged_by(r, resume_step)]
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
        if text.encode("utf-8") != raw:
            atomic_write_bytes(self.path, text.encode("utf-8"))
        return kept

    def log(self, record: Mapping) -> None:
        self._f.write(json.dumps(dict(record), sort_keys=True) + "\n")
        self._f.flush()
        # Durable before the checkpoint that follows it: a checkpoint must never outlive its rows.
        os.fsync(self._f.fileno())
        self._mirror(record)

    def _mirror(self, record: Mapping) -> None:
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _logged_by(row: Mapping, resume_step: int) -> bool:
    """Whether ``row`` was logged before the checkpoint at ``resume_step`` was saved (see MetricsLog)."""
    step = row.get("step")
    if not isinstance(step, int):
        return True
    if row.get("kind", "train") == "eval":
        return step <= resume_step if resume_step > 0 else False
    return step < resume_step


def parse_metrics_lines(text: str, path: str | os.PathLike = "<metrics>") -> list[dict]:
    """The JSON objects of a metrics JSONL text; a torn last line is dropped, any other bad line raises."""
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if all(not rest.strip() for rest in lines[i + 1 :]):
                break  # the last line, torn by a kill in the middle of a write
            raise ValueError(f"{path}:{i + 1}: unreadable metrics row ({e})") from None
        rows.append(row)
    return rows


def read_metrics(run_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for p in sorted((Path(run_dir) / "metrics").glob("*.jsonl")):
        out[p.stem] = parse_metrics_lines(p.read_bytes().decode("utf-8", errors="replace"), p)
    return out


def _series(rows: Iterable[dict], key: str, kind: str = "train"):
    xs, ys = [], []
    for r in rows:
        if r.get("kind", "train") == kind and key in r and r[key] is not None:
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def _rolling_mean(ys: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        chunk = ys[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _arm_order(metrics: dict[str, list[dict]]) -> list[str]:
    known = [a for a in CHART_ORDER if a in metrics]
    return known + sorted(a for a in metrics if a not in CHART_ORDER)


def plot_metric(metrics: dict[str, list[dict]], key: str, path: Path, *, title: str, ylabel: str,
                kind: str = "train", logy: bool = False, smooth: int = 5) -> Path:
    """All arms on one chart; train curves drawn faintly per step with a ``smooth``-step rolling mean
    on top (per-step maxima are noisy), evaluation points as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in _arm_order(metrics):
        xs, ys = _series(metrics[arm], key, kind)
        if not xs:
            continue
        style = arm_style(arm) or {}
        if kind == "eval" or smooth <= 1:
            ax.plot(xs, ys, label=arm, marker="o", markersize=3, **style)
        else:
            ax.plot(xs, ys, alpha=0.25, linewidth=0.8, **style)
            ax.plot(xs, _rolling_mean(ys, smooth), label=f"{arm} ({smooth}-step mean)", linewidth=2, **style)
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rows_of_kind(rows: Iterable[Mapping], kind: str) -> list[Mapping]:
    """The rows of one kind, ``train`` (a row without a kind is a train row) or ``eval``."""
    return [r for r in rows if r.get("kind", "train") == kind]


def summary_rows(metrics: dict[str, list[dict]], keys: list[tuple[str, str]], tail: int = 5) -> list[dict]:
    """Per arm: the mean of each key over the last ``tail`` train steps, and the last evaluation."""
    rows = []
    for arm in _arm_order(metrics):
        recs = metrics[arm]
        train, evals = rows_of_kind(recs, "train"), rows_of_kind(recs, "eval")
        row = {"arm": arm, "steps": len(train)}
        for key, _ in keys:
            vals = [r[key] for r in train[-tail:] if r.get(key) is not None]
            row[key] = sum(vals) / len(vals) if vals else None
        row["eval_accuracy"] = evals[-1]["eval_accuracy"] if evals else None
        row["eval_accuracy_first"] = evals[0]["eval_accuracy"] if evals else None
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(label for _, label in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            if v is None:
                cells.append("–")
            elif isinstance(v, float):
                cells.append(f"{v:.4g}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
