"""The lag-k replay: what rollouts k policy versions behind the trainer do to guided rounding.

``tracefp4 mismatch --lag 0,1,3 [--config RUN.toml] [--lrs 5e-5,2e-4] [--json PATH] [--plot PATH]``
trains a short GRPO run (the loop's own step: :class:`tracefp4.rl.loop.ArmRunner`, i.e. collect and
:func:`tracefp4.rl.update.update`) from the run config's warm start, once per learning rate, keeping
the weights of versions v-k for every lag k (v: the last version). It then rolls out step v's
prompts at θ_(v-k) in every arm of :data:`REPLAY_ARMS` (through the store,
:func:`tracefp4.pipeline.measure.run_arms`, full codes kept in memory at every layer) and runs each
arm's trainer at θ_v on what the store returned. Per (learning rate, lag, arm) a cell holds, under the
registry's names (:mod:`tracefp4.pipeline.metrics`):

* ``code_mismatch_rate`` and ``code_mismatch_one_apart_share``: the trainer's codes against the
  rollout's;
* ``guidance_bracket_miss_rate``: the share of elements whose rollout code is neither codeword around
  the trainer's value on the rollout's grid (:func:`tracefp4.pipeline.metrics.bracket_miss`), with
  the counts and how many misses are one codeword out;
* the log-prob gap (``train_rollout_logprob_abs_diff[_max]``, ``rollout_corr/k3_kl``, ...): at lag
  k > 0 it holds the staleness itself, which no guidance removes;
* ``guidance_bytes_per_token``, from the store's accounting;
* ``guided_layers``: code mismatch and bracket misses at the layers the ``lsb`` and ``mod4`` arms
  guide (the deeper half), the same layers in every arm, and ``agreement`` there (1 - code mismatch);
* for ``mod4``: the misses its trainer detected (``DecodeReport.bracket_checked`` / ``bracket_misses``)
  and its agreement minus ``lsb``'s at the same lag.

Decisions (and why)
    * **One end version, every lag from it.** Lag k compares θ_(v-k) with the same θ_v on the same
      prompts (step v's, as the loop would draw them) and sampling seed, so the lags differ only in
      how far the weights moved. ``--steps`` (default: the largest lag) sets v; at v = k the rollout
      runs the warm start.
    * **The trajectory is one arm's** (``--train-arm``, default ``trace-full``: the arm whose trainer
      is exact at lag 0, so the weights move as an FP4 TRACE run's do). Every replay arm is measured
      on that trajectory: what differs between arms is only what the rollout records and how the
      trainer rounds.
    * **Metrics over every layer**: each replay arm keeps full codes at all layers (diagnostics change
      nothing the rollout computes), so the all-sites figures of every arm cover the same elements;
      ``guided_layers`` gives the like-for-like figures where ``lsb`` and ``mod4`` guide.
    * **Guidance at every lag.** The trainer is given no record versions, so it guides every row as
      the records ask (no ``guidance_max_lag`` fallback): the replay measures what guidance does at
      lag k, which is what such a bound should be chosen from.
    * **The bracket is the rollout's grid's** for every arm (the grid a guided trainer rounds on; for
      ``qat``, whose trainer rounds on its own grid, the rate says where guidance would have failed).
    * **The FP4 rollouts of one lag must be one rollout**: same tokens and routing in every arm
      (recording changes nothing the model computes), checked and recorded as
      ``fp4_rollouts_identical``; the report refuses to go on otherwise.
    * **Not resumable beyond the warm start**: the whole replay is a few minutes; with ``--store-dir``
      the warm start's checkpoint is kept there and reused, the rest is recomputed (same numbers on the
      same machine and thread count). The JSON and the PNG are written whole or not at all.
    * The command owns the process: torch runs the run config's ``threads``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tracefp4.engines.model import model_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.trainer import code_mismatch
from tracefp4.files import atomic_write_bytes
from tracefp4.pipeline.arms import Arm, arm_style, make_arm
from tracefp4.pipeline.measure import (config_signature, gap, mlp_text, model_section, run_arms, same_rollout,
                                       store_bytes, store_root)
from tracefp4.pipeline.metrics import (
    METRICS,
    Name,
    at_sites,
    bracket_miss,
    bracket_miss_summary,
    label,
    mismatch_summary,
)
from tracefp4.provenance import environment, weights_digest
from tracefp4.reports.publish import publish
from tracefp4.rl.collect import step_prompts, step_sampling
from tracefp4.rl.config import RLConfig, read_table
from tracefp4.rl.experiment import ExperimentConfig
from tracefp4.rl.loop import ArmRunner, warm_start_model
from tracefp4.rl.tasks import make_task

__all__ = ["KIND", "REPLAY_ARMS", "ReplayConfig", "parse_lags", "parse_lrs", "load_run_config", "replay_report",
           "format_replay", "plot_replay", "add_arguments", "run_cli"]

#: The results file's ``kind`` (what :mod:`tracefp4.gendocs` renders it by).
KIND = "staleness-replay"

#: The replay's arms: key -> (the arm table's name, the guidance mode its rollout records; None: the
#: table's own). ``lsb`` and ``mod4`` guide the same layers (the table's default: the deeper half).
REPLAY_ARMS: dict[str, tuple[str, str | None]] = {
    "qat": ("qat", None),
    "trace-lsb": ("trace", "lsb"),
    "trace-full": ("trace-full", None),
    "trace-mod4": ("trace", "mod4"),
}


# --- inputs ---------------------------------------------------------------------------------------


def parse_lags(text: str) -> tuple[int, ...]:
    """``"0,1,3"`` -> ``(0, 1, 3)``: distinct whole numbers >= 0, ascending; a ValueError says which
    entry is wrong and why."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"{text!r}: give one or more lags, e.g. 0,1,3")
    lags: list[int] = []
    for p in parts:
        if not p:
            raise ValueError(f"{text!r}: an empty entry (two commas, or one at an end)")
        if not p.lstrip("-").isdigit():
            raise ValueError(f"{text!r}: {p!r} is not a whole number of policy versions")
        k = int(p)
        if k < 0:
            raise ValueError(f"{text!r}: lag {k} is negative (a rollout cannot be ahead of the trainer)")
        if k in lags:
            raise ValueError(f"{text!r}: lag {k} is given twice")
        lags.append(k)
    return tuple(sorted(lags))


def parse_lrs(text: str) -> tuple[float, ...]:
    """``"5e-5,2e-4"`` -> learning rates, each a finite number > 0, distinct, in the order given."""
    out: list[float] = []
    for p in (p.strip() for p in str(text).split(",")):
        try:
            lr = float(p)
        except ValueError:
            raise ValueError(f"{text!r}: {p!r} is not a number") from None
        if not (lr > 0 and lr < float("inf")):
            raise ValueError(f"{text!r}: learning rate {p} must be a finite number > 0")
        if lr in out:
            raise ValueError(f"{text!r}: learning rate {p} is given twice")
        out.append(lr)
    return tuple(out)


def load_run_config(path: str | None) -> RLConfig:
    """The run the trajectory follows: a run config file (``tracefp4 train --config``), an experiment
    file (its ``[run]`` table at its first seed, its ``warm_start`` folder if it names one), or None:
    :class:`RLConfig`'s defaults."""
    if path is None:
        return RLConfig()
    if not Path(path).is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        table = read_table(path)
    except ValueError as e:
        raise ValueError(f"--config {path}: {e}") from None
    if "run" not in table:
        return RLConfig.from_file(path)
    exp = ExperimentConfig.from_file(path)
    seed = exp.seeds[0]
    fields: dict[str, Any] = {**exp.run, "seed": seed}
    if exp.warm_start is not None:
        fields.update(checkpoint=exp.warm_start.replace("{seed}", str(seed)), warm_start_steps=0)
    try:
        return RLConfig.from_dict(fields)
    except ValueError as e:
        raise ValueError(f"{path}: [run] {e}") from None


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """What a replay runs; :meth:`validate` checks every field before any work starts."""

    run: RLConfig  # the GRPO run the trajectory follows (task, model, warm start, batch, seed, threads)
    lags: tuple[int, ...]  # policy versions between the rollout and the trainer, distinct, ascending
    lrs: tuple[float, ...] = ()  # one trajectory per learning rate (empty: the run's own lr)
    steps: int | None = None  # GRPO steps of each trajectory, the end version v (None: the largest lag)
    train_arm: str = "trace-full"  # the arm whose GRPO steps make the trajectory (a name of the arm table)

    @property
    def learning_rates(self) -> tuple[float, ...]:
        return self.lrs or (self.run.lr,)

    @property
    def end_version(self) -> int:
        return max(self.lags) if self.steps is None else self.steps

    def validate(self) -> None:
        self.run.validate()
        # the trajectory and the replay run our engine and the trainer in this process
        for name, value, alone in (("engine", self.run.engine, "home"), ("rollout_workers", self.run.rollout_workers, 0),
                                   ("trainer_world_size", self.run.trainer_world_size, 1)):
            if value != alone:
                raise ValueError(f"run config {name} = {value!r}: the replay runs our engine and the trainer in one "
                                 f"process; set {name} = {alone!r}")
        if not self.lags or list(self.lags) != sorted(set(self.lags)) or min(self.lags) < 0:
            raise ValueError(f"lags = {self.lags!r}: expected distinct whole numbers >= 0, ascending")
        if self.steps is not None and self.steps < max(self.lags):
            raise ValueError(f"steps = {self.steps}: the trajectory must reach the largest lag, {max(self.lags)} "
                             "(lag k rolls out at version v - k)")
        if any(not lr > 0 for lr in self.lrs):
            raise ValueError(f"lrs = {self.lrs!r}: every learning rate must be > 0")
        try:
            make_arm(self.train_arm, guidance=self.run.guidance, n_layers=self.run.model.layers)
        except ValueError as e:
            raise ValueError(f"train_arm = {self.train_arm!r}: {e}") from None


def replay_arms(n_layers: int, plan: PrecisionPlan) -> dict[str, Arm]:
    """:data:`REPLAY_ARMS` resolved for an ``n_layers``-layer model under ``plan``, each keeping full
    codes at every layer (the rollout's diagnostics; the trainer captures its own codes there)."""
    every = frozenset(range(n_layers))
    out = {}
    for key, (name, mode) in REPLAY_ARMS.items():
        arm = make_arm(name, guidance=mode or "lsb", n_layers=n_layers, plan=plan)
        out[key] = dataclasses.replace(arm, diagnostics=every)
    return out


def _guided_layers(arms: Mapping[str, Arm], n_layers: int) -> frozenset[int]:
    """The layers the ``lsb`` arm guides (``mod4``'s too: checked)."""
    lsb, mod4 = arms["trace-lsb"].guidance, arms["trace-mod4"].guidance
    assert lsb is not None and mod4 is not None
    layers = lsb.layer_indices(n_layers)
    if mod4.layer_indices(n_layers) != layers:
        raise RuntimeError("the lsb and mod4 arms guide different layers: their agreement is not comparable")
    return layers


# --- the trajectory -------------------------------------------------------------------------------


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trajectory(base, task, tok, cfg: RLConfig, rc: ReplayConfig, lr: float, work: Path,
                say: Callable[[str], None]) -> tuple[ArmRunner, dict[int, dict[str, torch.Tensor]], list[dict]]:
    """GRPO from ``base`` at ``lr`` for the replay's steps; the runner (its model at θ_v), the weights of
    every version v - k, and each step's record."""
    v = rc.end_version
    keep = {v - k for k in rc.lags}
    model = copy.deepcopy(base)
    runner = ArmRunner(rc.train_arm, model, task, tok, dataclasses.replace(cfg, lr=lr), work)
    versions = {0: _snapshot(model)} if 0 in keep else {}
    rows = []
    try:
        while runner.version < v:
            rec = runner.train_step()
            rows.append({k: rec[k] for k in ("step", "policy_version", "reward_mean", "grad_norm", Name.GAP_MEAN)
                         if k in rec})
            if runner.version in keep:
                versions[runner.version] = _snapshot(model)
            say(f"lr {lr:g}: step {rec['step']} reward {rec['reward_mean']:.3f} grad norm {rec['grad_norm']:.3g}")
    finally:
        runner.close()
    return runner, versions, rows


# --- one lag --------------------------------------------------------------------------------------


def _scoped(trainer, rollout, keep: Callable[[int, str], bool]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Code mismatch and bracket misses of one arm's trainer against its rollout's full codes, at every
    site and at the sites ``keep`` selects (each site's counts computed once, summarised twice)."""
    codes = code_mismatch(trainer.codes, rollout.diagnostics)
    brackets = bracket_miss(trainer.values, rollout.diagnostics)
    every = {**mismatch_summary(list(codes.values())), **bracket_miss_summary(list(brackets.values()))}
    return every, {**mismatch_summary(at_sites(codes, keep)), **bracket_miss_summary(at_sites(brackets, keep))}


def _cells(lr: float, lag: int, v: int, runs, guided: frozenset[int], root: Path, signature: str
           ) -> list[dict[str, Any]]:
    """One cell per arm of one (learning rate, lag)."""
    cells = []
    for key, run in runs.items():
        name = REPLAY_ARMS[key][0]
        every, inside = _scoped(run.trainer, run.rollout, lambda layer, site: layer in guided)
        cell: dict[str, Any] = {
            "lr": lr, "lag": lag, "arm": key, "arm_name": name, "guidance": None if run.arm.guidance is None
            else run.arm.guidance.name, "rollout_version": v - lag, "trainer_version": v,
            **every,
            **{k: x for k, x in gap(run.rollout, run.trainer).items() if k != "tokens"},
            Name.GUIDANCE_BYTES: store_bytes(root, run.step, signature)["guidance"],
        }
        inside["agreement"] = None if inside[Name.CODE_MISMATCH] is None else 1.0 - inside[Name.CODE_MISMATCH]
        cell["guided_layers"] = inside
        d = run.trainer.decode
        if d.bracket_checked:
            cell["detected"] = {"bracket_checked": d.bracket_checked, "bracket_misses": d.bracket_misses,
                                "rate": d.bracket_miss_rate}
        cells.append(cell)
    lsb = next(c for c in cells if c["arm"] == "trace-lsb")["guided_layers"]["agreement"]
    for c in cells:
        if c["arm"] == "trace-mod4":
            c["agreement_minus_lsb"] = None if lsb is None or c["guided_layers"]["agreement"] is None \
                else c["guided_layers"]["agreement"] - lsb
    return cells


# --- the report -----------------------------------------------------------------------------------


def replay_report(rc: ReplayConfig, *, store_dir: str | None = None, progress: Callable[[str], None] | None = None,
                  command: str | None = None) -> dict[str, Any]:
    """Train the trajectories, replay every lag in every arm; the report as a JSON-ready dict."""
    rc.validate()
    say = progress or (lambda msg: None)
    cfg = rc.run
    t_start = time.perf_counter()
    task = make_task(cfg.task, **cfg.task_kwargs)
    tok = task.make_tokenizer()
    v = rc.end_version
    cells: list[dict[str, Any]] = []
    trajectories: dict[str, list[dict]] = {}
    identical: dict[str, dict[str, bool]] = {}
    with store_root(store_dir, "tracefp4-replay-") as root:
        say(f"warm start ({cfg.warm_start_steps} steps)" if not cfg.checkpoint else f"loading {cfg.checkpoint}")
        base = warm_start_model(cfg, task, tok, root / "warm_start")
        n_layers = model_layers(base)[0]
        arms = replay_arms(n_layers, PrecisionPlan())
        guided = _guided_layers(arms, n_layers)
        signature = config_signature("replay", base.config)
        for i, lr in enumerate(rc.learning_rates):
            work = root / f"lr-{i}"
            runner, versions, trajectories[f"{lr:g}"] = _trajectory(base, task, tok, cfg, rc, lr, work, say)
            prompts = [tok.encode(e.prompt) for e in step_prompts(runner.setup, v)]
            sampling = step_sampling(runner.setup, v)
            for j, lag in enumerate(rc.lags):
                rollout_model = copy.deepcopy(runner.model)
                rollout_model.load_state_dict(versions[v - lag])
                say(f"lr {lr:g}, lag {lag}: rollouts at version {v - lag}, trainers at {v}")
                runs = run_arms(rollout_model, prompts, sampling, arms, work / "replay", signature,
                                first_step=j * len(arms), trainer_model=runner.model, values=True)
                fp4 = [r.rollout for r in runs.values()]
                same = all(same_rollout(fp4[0], r) for r in fp4[1:])
                if not same:
                    raise RuntimeError(f"lr {lr:g}, lag {lag}: the arms' FP4 rollouts sampled different tokens or "
                                       "routing; recording changed the numerics, the arms are not comparable")
                identical.setdefault(f"{lr:g}", {})[str(lag)] = same
                cells += _cells(lr, lag, v, runs, guided, work / "replay", signature)
        digest = weights_digest(base.state_dict())
    return {
        "kind": KIND,
        "command": command,
        "model": model_section(base),
        "run": dataclasses.asdict(cfg),
        "train_arm": rc.train_arm,
        "steps": v,
        "lags": list(rc.lags),
        "lrs": list(rc.learning_rates),
        "warm_start_sha256": digest,
        "arms": {key: {"arm": a.name, "guidance": None if a.guidance is None else a.guidance.name,
                       "guided_layers": sorted(a.guidance.layer_indices(n_layers)) if a.guidance else []}
                 for key, a in arms.items()},
        "guided_layers": sorted(guided),
        "replay_batch": {"trajectories": len(prompts), "sampling_seed": sampling.seed, "prompt_step": v},
        "fp4_rollouts_identical": identical,
        "trajectory": trajectories,
        "cells": cells,
        "environment": environment(),
        "seconds": time.perf_counter() - t_start,
    }


# --- presentation ---------------------------------------------------------------------------------


def _pct(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3%}"


def format_replay(rep: Mapping[str, Any]) -> str:
    """The report as a text table: one row per (learning rate, lag, arm)."""
    m = rep["model"]
    lines = [
        f"staleness replay: {m['layers']}-layer model ({mlp_text(m)}, hidden {m['hidden']}), "
        f"task {rep['run']['task']}, trajectory of arm {rep['train_arm']} over {rep['steps']} GRPO steps; "
        f"rollout at version v-k, trainer at v = {rep['steps']}, {rep['replay_batch']['trajectories']} trajectories",
        f"  guided layers of trace-lsb and trace-mod4: {rep['guided_layers']}; all figures over every layer "
        "unless marked (guided)",
        f"{'lr':>8}{'lag':>4}  {'arm':<11}{label(Name.CODE_MISMATCH):>14}{label(Name.BRACKET_MISS):>14}"
        f"{'1 out':>8}{'miss (guided)':>15}{'agree (guided)':>16}{label(Name.GAP_MEAN):>14}{label(Name.GAP_MAX):>12}"
        f"{label(Name.K3_KL):>11}{'B/token':>9}  detected (mod4)",
    ]
    for c in rep["cells"]:
        one = c["bracket_one_out"] / c["bracket_misses"] if c["bracket_misses"] else None
        g = c["guided_layers"]
        det = c.get("detected")
        extra = "" if det is None else f"{det['bracket_misses']}/{det['bracket_checked']}"
        if "agreement_minus_lsb" in c and c["agreement_minus_lsb"] is not None:
            extra += f"  (agreement {c['agreement_minus_lsb']:+.2e} vs lsb)"
        lines.append(
            f"{c['lr']:>8.0e}{c['lag']:>4}  {c['arm']:<11}{_pct(c[Name.CODE_MISMATCH], 14)}"
            f"{_pct(c[Name.BRACKET_MISS], 14)}{_pct(one, 8)}{_pct(g[Name.BRACKET_MISS], 15)}"
            f"{_pct(g['agreement'], 16)}{c[Name.GAP_MEAN]:>14.5f}{c[Name.GAP_MAX]:>12.4f}{c[Name.K3_KL]:>11.2e}"
            f"{c[Name.GUIDANCE_BYTES]:>9.1f}  {extra}")
    lines.append("  1 out: share of the bracket misses one codeword outside; detected: the mod4 trainer's own count")
    if rep.get("command"):
        lines.append(f"  command: {rep['command']}")
    return "\n".join(line.rstrip() for line in lines)


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "none"


def plot_replay(rep: Mapping[str, Any], path: str | Path) -> None:
    """Bracket-miss rate and code mismatch against lag at the guided layers (where ``lsb`` and ``mod4``
    guide: the same elements in every arm; over every layer the unguided half would hide their
    difference), one line per arm, one row of panels per learning rate; written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = rep["lrs"]
    fig, axes = plt.subplots(len(lrs), 2, figsize=(12, 4.2 * len(lrs)), squeeze=False)
    markers = {"trace-lsb": "o", "trace-mod4": "s", "trace-full": "^", "qat": "D"}
    # mod4 is the trace arm with another record: the table's style would draw it on top of lsb's
    own = {"trace-mod4": {"color": "navy", "linestyle": "--"}}
    for row, lr in zip(axes, lrs):
        for ax, metric in zip(row, (Name.BRACKET_MISS, Name.CODE_MISMATCH)):
            for key, (name, _) in REPLAY_ARMS.items():
                pts = [(c["lag"], c["guided_layers"][metric]) for c in rep["cells"] if c["arm"] == key and c["lr"] == lr]
                style = own.get(key) or arm_style(name) or {}
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(key, "o"), label=key,
                        color=style.get("color"), linestyle=style.get("linestyle"))
            ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_xlabel("lag k (policy versions between rollout and trainer)")
            ax.set_ylabel(f"{METRICS[metric].label} (layers {_span(rep['guided_layers'])})")
            ax.set_title(f"lr {lr:g}: {METRICS[metric].label}", fontsize=10)
            ax.set_xticks(rep["lags"])
            ax.grid(True, alpha=0.3)
        row[0].legend(fontsize=8)
    m = rep["model"]
    fig.suptitle(f"lag-k replay of a GRPO trajectory ({rep['train_arm']}, {m['layers']} layers, task "
                 f"{rep['run']['task']}): rollout at v-k, trainer at v = {rep['steps']}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# --- command line (``tracefp4 mismatch --lag``, assembled in tracefp4.reports.commands) ----------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The replay's options on the ``mismatch`` parser."""
    g = p.add_argument_group("lag-k replay (--lag)")
    g.add_argument("--lag", metavar="K1,K2", help="instead of the report: train a short GRPO run and replay it with "
                   "rollouts K policy versions behind the trainer, e.g. 0,1,3 (distinct whole numbers >= 0)")
    g.add_argument("--config", metavar="PATH", help="with --lag: the run the trajectory follows, a run config "
                   "(tracefp4 train --config) or an experiment file (its [run] at its first seed); default: "
                   "tracefp4 train's defaults")
    g.add_argument("--lrs", metavar="LR1,LR2", help="with --lag: one trajectory per learning rate (default: the "
                   "run's lr)")
    g.add_argument("--steps", type=int, metavar="N", help="with --lag: GRPO steps of each trajectory, the "
                   "trainer's version v (default: the largest lag)")
    g.add_argument("--train-arm", default="trace-full", metavar="ARM",
                   help="with --lag: the arm whose GRPO steps make the trajectory (default trace-full)")


def replay_config(args: argparse.Namespace) -> ReplayConfig:
    """The replay the command line asks for; a ValueError names the option and what is wrong."""
    try:
        lags = parse_lags(args.lag)
    except ValueError as e:
        raise ValueError(f"--lag {e}") from None
    try:
        lrs = parse_lrs(args.lrs) if args.lrs is not None else ()
    except ValueError as e:
        raise ValueError(f"--lrs {e}") from None
    if args.steps is not None and args.steps < max(lags):
        raise ValueError(f"--steps {args.steps}: the trajectory must reach the largest lag, {max(lags)}")
    rc = ReplayConfig(load_run_config(args.config), lags, lrs, args.steps, args.train_arm)
    rc.validate()
    return rc


def command_line(args: argparse.Namespace) -> str:
    """The ``tracefp4 mismatch --lag`` command that computes what ``args`` asks for (the options that
    change a number, and the outputs), as the results file records it."""
    parts = ["tracefp4", "mismatch", "--lag", ",".join(map(str, parse_lags(args.lag)))]
    for opt, value in (("--config", args.config), ("--lrs", args.lrs), ("--steps", args.steps),
                       ("--train-arm", None if args.train_arm == "trace-full" else args.train_arm),
                       ("--json", args.json), ("--plot", args.plot)):
        if value is not None:
            parts += [opt, str(value)]
    return " ".join(parts)


def run_cli(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """Run the replay the arguments name; print it, write ``--json`` and ``--plot``."""
    rc = replay_config(args)
    torch.set_num_threads(rc.run.threads)  # the command owns the process
    rep = replay_report(rc, store_dir=args.store_dir, progress=say, command=command_line(args))
    publish(rep, format_replay(rep), args.json, args.plot, plot_replay)
    return 0
