"""The collapse study's TRL short form: runs of ``examples/trl_grpo_trace.py`` summarised per setting and arm.

A run is the JSON that script writes with ``--json``: ``{"run": {...}, "log_history": [...]}``, the run's
arguments and TRL's log history. Its *setting* is TRL's importance-correction knobs: ``off``
(``vllm_importance_sampling_correction = False``: rollout samples taken as on-policy), ``sequence``
(``importance_sampling_level = "sequence"``, TRL's own sequence-level correction on), or ``token`` (both at
TRL's defaults). Its *arm* is the trainer forward: ``bf16``, ``qat``, or the arm table's name of a guided
trainer (``trace`` for the default ``lsb`` guidance; ``trace-<guidance>`` otherwise, e.g. ``trace-full``).

Per run, over the log rows that carry a generation's metrics (those with ``reward``; with
``num_iterations = 2`` every other optimizer step), in order:

* ``reward_first`` / ``reward_last``: the mean training reward of the first and the last quarter of them
  (TRL logs no held-out evaluation: the rewards are of the rollouts' own samples);
* the registry's metrics (:mod:`tracefp4.pipeline.metrics`) under their names: ``train_rollout_logprob_abs_diff``
  (mean of TRL's ``trace/train_rollout_logprob_abs_diff``: the mean |log pi_train - log pi_rollout| per
  token), ``train_rollout_logprob_abs_diff_max`` (the largest logged), ``code_mismatch_rate`` (mean);
  ``entropy`` (mean);
* ``gap_growth``: the last quarter's mean logprob gap over the first quarter's (> 1: the mismatch grew).

Per setting and arm: each figure's mean and Student-t 95% interval over seeds; ``reward_last`` paired
seed by seed with ``trace-full`` (FP4 against FP4: same warm start, same prompts) and with ``bf16``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tracefp4.pipeline.arms import DEFAULT_GUIDANCE
from tracefp4.pipeline.metrics import Name, trl_name
from tracefp4.stats import mean_ci95, paired_differences

__all__ = ["FIGURES", "run_figures", "setting_of", "arm_of", "summarise_runs", "load_runs", "format_trl_study"]

#: The per-run figures, in table order.
FIGURES = ("reward_first", "reward_last", Name.GAP_MEAN, Name.GAP_MAX, "gap_growth", Name.CODE_MISMATCH, "entropy")
#: The arms each arm is paired with, seed by seed.
REFERENCES = ("trace-full", "bf16")


def setting_of(meta: Mapping[str, Any]) -> str:
    """``off``, ``sequence`` or ``token`` from a run's recorded TRL knobs (see the module docstring)."""
    if not meta.get("vllm_importance_sampling_correction", True):
        return "off"
    return "sequence" if meta.get("importance_sampling_level", "token") == "sequence" else "token"


def arm_of(meta: Mapping[str, Any]) -> str:
    """``bf16``, ``qat``, ``trace`` (the default guidance) or ``trace-<guidance>`` from a run's recorded mode."""
    mode = meta["mode"]
    if mode != "trace":
        return mode
    return "trace" if meta["guidance"] == DEFAULT_GUIDANCE else f"trace-{meta['guidance']}"


def _quarter_means(values: Sequence[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


def run_figures(log_history: Sequence[Mapping[str, Any]], where: str = "run") -> dict[str, float | None]:
    """The figures of one run's log history (module docstring); ValueError naming ``where`` if the run
    logged no generation."""
    rows = [r for r in log_history if r.get("reward") is not None]
    if not rows:
        raise ValueError(f"{where}: no log row carries 'reward' (did the run train?)")
    reward = [float(r["reward"]) for r in rows]
    gaps, maxes, codes = ([float(r[key]) for r in rows if r.get(key) is not None]
                          for key in map(trl_name, (Name.GAP_MEAN, Name.GAP_MAX, Name.CODE_MISMATCH)))
    ent = [float(r["entropy"]) for r in rows if r.get("entropy") is not None]
    first, last = _quarter_means(reward)
    out: dict[str, float | None] = {"reward_first": first, "reward_last": last,
                                    Name.GAP_MEAN: sum(gaps) / len(gaps) if gaps else None,
                                    Name.GAP_MAX: max(maxes) if maxes else None,
                                    Name.CODE_MISMATCH: sum(codes) / len(codes) if codes else None,
                                    "entropy": sum(ent) / len(ent) if ent else None, "gap_growth": None}
    if gaps:
        g0, g1 = _quarter_means(gaps)
        out["gap_growth"] = g1 / g0 if g0 > 0 else None
    return out


def load_runs(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The run JSONs, each checked for its two keys (ValueError naming the file)."""
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or "run" not in data or "log_history" not in data:
            raise ValueError(f"{p}: expected the JSON of examples/trl_grpo_trace.py --json (keys run, log_history)")
        runs.append({**data, "path": str(p)})
    return runs


def _pair(entries: dict[str, dict[str, Any]], seeds_figs: dict[str, dict[int, dict]], reference: str) -> None:
    ref = seeds_figs.get(reference)
    if ref is None:
        return
    ref_reward = {s: figs["reward_last"] for s, figs in ref.items()}
    for arm, per_seed in seeds_figs.items():
        paired = paired_differences({s: per_seed[s]["reward_last"] for s in sorted(per_seed)}, ref_reward)
        if arm != reference and paired is not None:
            entries[arm][f"reward_last_minus_{reference}"] = paired


def summarise_runs(runs: Sequence[Mapping[str, Any]], name: str = "collapse-trl",
                   environment: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The study's summary (module docstring) of runs loaded by :func:`load_runs`, with the machine's
    ``environment`` (:func:`tracefp4.provenance.environment`) if given; a run twice for one setting, arm
    and seed is refused (ValueError naming both files)."""
    grid: dict[str, dict[str, dict[int, dict]]] = {}
    seen: dict[tuple, str] = {}
    meta0: dict[str, Any] = {}
    for r in runs:
        meta = r["run"]
        key = (setting_of(meta), arm_of(meta), int(meta["seed"]))
        if key in seen:
            raise ValueError(f"{r.get('path', 'run')} and {seen[key]}: both are setting {key[0]}, arm {key[1]}, "
                             f"seed {key[2]}")
        seen[key] = r.get("path", "run")
        grid.setdefault(key[0], {}).setdefault(key[1], {})[key[2]] = run_figures(r["log_history"], seen[key])
        meta0 = {k: meta.get(k) for k in ("engine", "task", "plan", "max_steps")} if not meta0 else meta0
    settings: dict[str, Any] = {}
    for setting, arms in sorted(grid.items()):
        entries: dict[str, dict[str, Any]] = {}
        for arm, per_seed in sorted(arms.items()):
            seeds = sorted(per_seed)
            entry: dict[str, Any] = {"seeds": seeds}
            for fig in FIGURES:
                vals = [per_seed[s][fig] for s in seeds if per_seed[s][fig] is not None]
                entry[fig] = mean_ci95(vals) if vals else None
            entries[arm] = entry
        for ref in REFERENCES:
            _pair(entries, arms, ref)
        settings[setting] = entries
    return {"name": name, "kind": "trl-study", "runs": meta0, "settings": settings,
            "environment": dict(environment) if environment is not None else None}


def _cell(d: Mapping[str, Any] | None, digits: int = 3) -> str:
    if d is None:
        return "-"
    lo, hi = d["ci95"]
    return f"{d['mean']:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"


def format_trl_study(summary: Mapping[str, Any]) -> str:
    """The summary as markdown tables: one per setting, one row per arm."""
    runs = summary.get("runs", {})
    lines = [f"TRL `GRPOTrainer` through tracefp4's integration: engine {runs.get('engine')}, task "
             f"{runs.get('task')}, {runs.get('max_steps')} optimizer steps per run; mean [95% interval] over "
             "seeds; rewards are the training samples' (the first and last quarter of the generations)."]
    heads = ["arm", "seeds", "reward first", "reward last", "last - trace-full", "last - bf16", "|dlogp| mean",
             "|dlogp| max", "gap growth", "code mismatch"]
    for setting, arms in summary["settings"].items():
        lines += ["", f"### setting `{setting}`", "", "| " + " | ".join(heads) + " |",
                  "|" + "---|" * len(heads)]
        for arm, e in arms.items():
            cells = [arm, str(len(e["seeds"])), _cell(e["reward_first"]), _cell(e["reward_last"]),
                     _cell(e.get("reward_last_minus_trace-full")), _cell(e.get("reward_last_minus_bf16")),
                     _cell(e[Name.GAP_MEAN]), _cell(e[Name.GAP_MAX]), _cell(e["gap_growth"]),
                     _cell(e[Name.CODE_MISMATCH])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
