"""An experiment: the same run config over several seeds, summarised per arm with confidence intervals.

``tracefp4 experiment --config FILE`` reads a TOML, YAML or JSON file::

    name = "addition-4l"            # the results file is <results>/<name>.json
    seeds = [0, 1, 2]
    out = "runs/experiments"        # run folders: <out>/<name>/seed-<s>/ (default runs/experiments)
    warm_start = "elsewhere/seed-{seed}/checkpoints/warm_start/step-00000000"   # optional, see below
    [run]                           # any RLConfig field (tracefp4.rl.config), the same for every seed
    task = "addition"
    arms = ["bf16", "qat", "trace", "trace-full"]
    steps = 200

An experiment that varies another in a few fields names it instead of copying it: ``base =
"experiment-count3-8l.toml"`` (a path relative to this file) reads that file first, and this file's
keys replace its keys, table by table (``[run]`` and its ``[run.model]`` key by key; a list, such as
``arms``, as a whole). ``name`` must be given again: two experiments never share a results file.

Each seed is one ordinary run folder (all arms of that seed, the same warm start), so the matrix is
resumable the way a run is: a seed whose folder exists is resumed (the saved config must agree), a
finished one is only read. The summary (:func:`summarise`) is a pure function of the seeds' metrics.

Results that survive a move to a new machine: run folders (checkpoints, the guidance store) stay on
the machine, so each seed, as soon as every one of its arms has finished, is also recorded in the
results tree, ``<results>/records/<name>/seed-<s>/`` (:mod:`tracefp4.rl.seedrecord`: the arms' metrics
logs, environment.json, the run config and the warm start's digest, a few small text files written
whole or not at all, with a manifest of their sha256), for the caller to commit. The unit is the seed,
never the arm: the summary pairs the arms of a seed, which started from one warm start, and a lone
arm could not be completed elsewhere from the same weights. A seed without a run folder whose record
is there is read from the record and not run (its saved config must agree with the experiment's as a
resume's must, at the same steps and with every arm); a torn or edited record is refused, naming the
file. :func:`read_seed` is the one reader (the run folder when it holds the finished seed, else the
record), and the summary says which for each seed (``provenance.per_seed[s].from_record``).
``tracefp4 experiment --summary-only`` (:func:`write_results` with ``partial``) runs nothing: it
records every finished seed and writes the results file from the finished ones, marked ``partial:
true`` with ``seeds_missing`` when some are not; the plain file is only ever written from every seed.

Reproducibility: a seed's numbers are bit-identical when it is re-run on the same machine type,
library set and thread count, not across CPUs (:mod:`tracefp4.provenance`): a seed's outcome can
swing with the machine's matmul kernels, and its warm start most of all. ``warm_start`` (a folder
path, ``{seed}`` replaced by the seed) starts each seed from a saved warm-start checkpoint (any
Hugging Face model folder, e.g. another machine's ``checkpoints/warm_start/step-00000000``) instead
of building and fine-tuning a model: a matrix re-run elsewhere then starts from the very same
weights. The summary records each seed's environment and the digest of its warm-start weights, and
groups the seeds by it (``warm_starts``): seeds in one group started from identical weights.

Per arm, over seeds: the final held-out accuracy (the last evaluation of each seed) with its mean and a
95% confidence interval from Student's t (``mean ± t_{0.975, n-1} * sd / sqrt(n)``; with one seed the
interval is the point), and the means over seeds of each seed's mean and max |Δlogp| over all steps,
its code mismatch and its guidance bytes per token; for the bf16 arm also the final accuracy of its
policy under post-hoc FP4 inference (``final_eval_accuracy_fp4``, ``..._fp4_4over6``), and for every
other arm its final accuracy minus the bf16 arm's, paired by seed (``final_eval_accuracy_minus_bf16``,
mean and 95% interval over seeds). Curves (eval accuracy and the per-step max gap
against steps) are drawn with the mean over seeds and a band of ±t·sd/sqrt(n); the summary also keeps
each seed's own evaluation series (``per_seed``), so any statistic of them can be recomputed from the
results file alone.

The held-out figures are the exact-answer accuracy and the mean reward (:data:`HELD_OUT`), both
reported; ``metric = "eval_reward"`` in the file makes the mean reward the headline (the table, the
``collapse`` entry): for tasks with per-position credit, such as ``count``'s 32-digit answers, whose
exact accuracy stays near 0 at our scale.

**Collapse** (:func:`collapse_step`): a seed collapses at the first evaluation from which its held-out
accuracy stays below half of its running maximum for the rest of the run,
``min{t : acc_u < max_{v<=u} acc_v / 2 for every evaluation u >= t}`` (a seed whose best accuracy is 0
cannot collapse). Per arm the summary gives the share of seeds that collapse and each seed's step
(``collapse``): the paper's phenomenon is a collapse, and a rate of collapses can separate arms where
a mean final accuracy cannot. A fall at the very last evaluation counts (nothing came after it to
recover); ``evals_after`` says how many evaluations confirmed each collapse.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tracefp4.files import atomic_write_json
from tracefp4.pipeline.arms import arm_style
from tracefp4.pipeline.metrics import Name
from tracefp4.rl.config import RLConfig, check_fields, option, read_table, reject
from tracefp4.rl.evaluate import POST_HOC_PLANS, post_hoc_metric
from tracefp4.rl.runfolder import CONFIG_NAME, ENVIRONMENT_NAME, config_differences
from tracefp4.rl.runlog import read_metrics, rows_of_kind
from tracefp4.rl.seedrecord import (MANIFEST_NAME, RECORDS, read_seed_record, record_dir, warm_start_info,
                                    write_seed_record)
from tracefp4.stats import format_ci, format_mean_ci, mean_ci95, paired_differences

__all__ = [
    "ExperimentConfig",
    "run_experiment",
    "write_results",
    "read_seed",
    "archive_seed",
    "SeedResult",
    "run_jobs",
    "run_job",
    "summarise",
    "format_summary",
    "collapse_step",
    "plot_experiment",
]

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond 30 the normal's 1.96
# is within 2%.
def collapse_step(series: Sequence[tuple[int, float]]) -> tuple[int, int] | None:
    """``(step, evals_after)`` of the collapse of one seed's ``(step, accuracy)`` evaluations (in step
    order), or None: the first evaluation from which the accuracy stays below half of its running
    maximum to the end; ``evals_after`` counts the evaluations after that one."""
    below, best = [], 0.0
    for _, acc in series:
        best = max(best, acc)
        below.append(best > 0 and acc < best / 2)
    start = len(below)
    while start > 0 and below[start - 1]:
        start -= 1
    if start == len(below):
        return None
    return series[start][0], len(below) - 1 - start


#: The held-out figures every summary reports per arm (final value, paired difference, curves, each
#: seed's series, collapses): ``eval_accuracy`` (share of examples answered exactly) and
#: ``eval_reward`` (mean reward: per-position credit on the count task, where an exact 32-digit
#: answer is rare at our scale and the accuracy would sit near 0 in every arm).
HELD_OUT = ("eval_accuracy", "eval_reward")

#: The fields a run config of an experiment may not set: each seed's run sets them itself.
_PER_SEED = ("seed", "out", "run_name", "resume")


@dataclasses.dataclass
class ExperimentConfig:
    """An experiment file (the module docstring); :meth:`validate` checks it as :meth:`RLConfig.validate`
    checks a run's, every seed's run config included, before anything runs."""

    name: str = option(help="the results file is <results>/<name>.json, the run folders <out>/<name>/seed-<s>/")
    seeds: list[int] = option(help="the seeds, each one run folder of every arm")
    run: dict[str, Any] = option(help="RLConfig fields, the same for every seed (not " + ", ".join(_PER_SEED) + ")")
    out: str = option("runs/experiments", help="parent folder of the experiment's run folders")
    warm_start: str | None = option(None, help="a model folder per seed ({seed} in the path): skip building and SFT")
    metric: str = option("eval_accuracy", help="the held-out figure of the headline, the paired test and collapses",
                         choices=HELD_OUT)

    @classmethod
    def from_dict(cls, d: dict) -> ExperimentConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: {', '.join(known)}")
        for key in ("name", "seeds", "run"):
            if key not in d:
                raise ValueError(f"missing {key!r}")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> ExperimentConfig:
        try:
            return cls.from_dict(read_experiment_table(path))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def validate(self) -> None:
        """Raise a one-line ValueError naming the first bad field, its value and what is expected
        (``[run] ...`` for a field of the seeds' run config)."""
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            reject("name", self.name, "a non-empty string without '/'")
        if (not isinstance(self.seeds, list) or not self.seeds
                or any(not isinstance(s, int) or isinstance(s, bool) for s in self.seeds)
                or len(set(self.seeds)) != len(self.seeds)):
            reject("seeds", self.seeds, "a list of distinct integers")
        if self.warm_start is not None and (not isinstance(self.warm_start, str) or not self.warm_start):
            reject("warm_start", self.warm_start, "a folder path (with {seed} for the seed)")
        check_fields(self)
        if set(_PER_SEED) & set(self.run):
            reject("run", self.run, f"a table of RLConfig fields without {'/'.join(_PER_SEED)} (each seed sets them)")
        if self.warm_start is not None and "checkpoint" in self.run:
            reject("warm_start", self.warm_start, "no [run] checkpoint beside it: both name the starting weights, "
                   "give one")
        for s in self.seeds:
            try:
                self.run_config(s)  # RLConfig.from_dict validates
            except (TypeError, ValueError) as e:
                raise ValueError(f"[run] {e}") from None

    def run_dir(self, seed: int) -> Path:
        return Path(self.out) / self.name / f"seed-{seed}"

    def run_config(self, seed: int) -> RLConfig:
        run_dir = self.run_dir(seed)
        fields = {**self.run, "seed": seed, "out": str(run_dir.parent), "run_name": run_dir.name}
        if self.warm_start is not None:  # the saved weights are the warm start: no build, no SFT
            fields.update(checkpoint=self.warm_start.replace("{seed}", str(seed)), warm_start_steps=0)
        if (run_dir / "config.json").exists():
            fields["resume"] = str(run_dir)
        return RLConfig.from_dict(fields)


def read_experiment_table(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """An experiment file as a dict, its ``base`` file (the module docstring) read first and
    overridden by it."""
    d = read_table(str(path))
    if "base" not in d:
        return d
    base = d.pop("base")
    if "name" not in d:
        raise ValueError(f"base = {base!r}: expected a name of its own beside it (the base's results file is the base's)")
    if not isinstance(base, str) or not base:
        reject("base", base, "the path of another experiment file, relative to this one")
    base_path = (Path(path).parent / base).resolve()
    if base_path in _seen or base_path == Path(path).resolve():
        reject("base", base, "a file that does not lead back to this one")
    try:
        return _override(read_experiment_table(base_path, (*_seen, Path(path).resolve())), d)
    except (OSError, TypeError, ValueError) as e:
        raise ValueError(f"base {base_path}: {e}") from None


def _override(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _override(out[key], value) if both else value
    return out


#: The scaling study's results in the results folder: the per-sequence mismatch is put beside its fit.
SCALING_RESULTS = "scaling.json"


def run_experiment(cfg: ExperimentConfig, results_dir: str | Path = "docs/results",
                   plots_dir: str | Path = "docs/img", *, workers: int = 1,
                   config_path: str | Path | None = None) -> dict[str, Any]:
    """Run (or resume) every seed, then write ``<results_dir>/<name>.json`` and the plots.

    Each seed, once finished, is recorded under ``<results_dir>/records/<name>/`` (:func:`archive_seed`);
    a seed whose run folder is absent and whose record is there is read from the record, not run. A
    seed whose run folder holds it finished is not resumed (a resume that runs nothing would only add
    an entry to its environment.json, and so change its record): its report is redrawn.
    ``workers > 1`` runs the jobs (each seed's warm start, then each (seed, arm)) in that many
    ``tracefp4 experiment --job`` processes reading ``config_path`` (:func:`run_jobs`); each seed's
    report is then written here."""
    from tracefp4.rl.loop import run
    from tracefp4.rl.report import write_report

    cfg.validate()  # a config built in Python, not read from a file, is checked before any seed runs too
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers > 1:
        if config_path is None:
            raise ValueError("workers > 1 needs config_path: the worker processes read the experiment file")
        run_jobs(cfg, config_path, workers, results_dir=results_dir)
    for i, seed in enumerate(cfg.seeds):
        if _recorded(cfg, seed, results_dir):
            print(f"experiment {cfg.name}: seed {seed} ({i + 1}/{len(cfg.seeds)}) read from its record "
                  f"{record_dir(results_dir, cfg.name, seed)}", file=sys.stderr, flush=True)
            continue
        print(f"experiment {cfg.name}: seed {seed} ({i + 1}/{len(cfg.seeds)})", file=sys.stderr, flush=True)
        run_cfg = cfg.run_config(seed)
        if _seed_done(cfg.run_dir(seed), run_cfg):
            read_seed(cfg, seed, results_dir)  # its saved config must agree, as a resume's must
            write_report(cfg.run_dir(seed))
        else:
            run(run_cfg)
        archive_seed(cfg, seed, results_dir)
    return write_results(cfg, results_dir, plots_dir)


def write_results(cfg: ExperimentConfig, results_dir: str | Path = "docs/results", plots_dir: str | Path = "docs/img",
                  *, partial: bool = False) -> dict[str, Any]:
    """Write ``<results_dir>/<name>.json`` and the plots from the finished seeds (each from its run
    folder or its record, :func:`read_seed`; a finished run folder is recorded first). Every seed
    must be finished unless ``partial``: then the summary covers the finished ones and says so
    (``partial: true``, ``seeds_missing``); with none finished nothing is written."""
    cfg.validate()
    found = {}
    for seed in cfg.seeds:
        archive_seed(cfg, seed, results_dir)
        if (result := read_seed(cfg, seed, results_dir)) is not None:
            found[seed] = result
    missing = [s for s in cfg.seeds if s not in found]
    where = f"no finished run folder under {Path(cfg.out) / cfg.name}, no record under " \
            f"{Path(results_dir) / RECORDS / cfg.name}"
    if not found:
        raise ValueError(f"experiment {cfg.name}: no seed is finished ({where}): nothing to summarise")
    if missing and not partial:
        raise ValueError(f"experiment {cfg.name}: seeds {missing} are not finished ({where}); the results file "
                         "needs every seed (--summary-only writes a partial one)")
    scaling_file = Path(results_dir) / SCALING_RESULTS
    scaling = json.loads(scaling_file.read_text()) if scaling_file.is_file() else None
    summary = summarise(cfg.name, {s: r.metrics for s, r in found.items()}, cfg.run_config(cfg.seeds[0]),
                        {s: r.provenance for s, r in found.items()}, metric=cfg.metric, scaling=scaling,
                        seeds_missing=missing)
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(results_dir) / f"{cfg.name}.json", summary, sort_keys=False)
    plot_experiment(summary, Path(plots_dir))
    return summary


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """One finished seed as the summary reads it, from its run folder or from its record."""

    #: ``{arm: metrics rows}``
    metrics: dict[str, list[dict]]
    #: :func:`seed_provenance`
    provenance: dict[str, Any]


def read_seed(cfg: ExperimentConfig, seed: int, results_dir: str | Path = "docs/results") -> SeedResult | None:
    """The one reader of a seed's results: its run folder when that holds the finished seed, else its
    record under the results tree (:mod:`tracefp4.rl.seedrecord`, verified), else None (not finished).
    Either source must be this seed of this experiment: its saved run config must agree with the
    experiment's, as a resume's must (:func:`~tracefp4.rl.runfolder.config_differences`), with every
    arm at the experiment's steps; a ValueError naming the file otherwise."""
    run_dir, run_cfg = cfg.run_dir(seed), cfg.run_config(seed)
    if _seed_done(run_dir, run_cfg):
        config_file, env_file = run_dir / CONFIG_NAME, run_dir / ENVIRONMENT_NAME
        _check_same_seed(_json_file(config_file), run_cfg, config_file)
        env = _json_file(env_file) if env_file.is_file() else None
        return SeedResult(read_metrics(run_dir), seed_provenance(env, warm_start_info(run_dir), from_record=False))
    path = record_dir(results_dir, cfg.name, seed)
    if not path.exists():
        return None
    rec = read_seed_record(path, experiment=cfg.name, seed=seed)
    manifest = path / MANIFEST_NAME
    if rec.steps != run_cfg.steps:
        raise ValueError(f"{manifest}: the record of {rec.steps} steps per arm, the experiment asks {run_cfg.steps} "
                         "(a record cannot be extended: restore the seed's run folder, or delete the record to run "
                         "the seed again)")
    lacking = [a for a in run_cfg.arms if a not in rec.metrics]
    if lacking:
        raise ValueError(f"{manifest}: the record has no arm {lacking} (its arms: {sorted(rec.metrics)}); a new arm "
                         "must start from the seed's own warm start "
                         f"({rec.warm_start.get('weights_sha256')}): restore the seed's run folder, or delete the "
                         "record to run the seed again")
    _check_same_seed(rec.config, run_cfg, path / CONFIG_NAME)
    return SeedResult(rec.metrics, seed_provenance(rec.environment, rec.warm_start, from_record=True))


def archive_seed(cfg: ExperimentConfig, seed: int, results_dir: str | Path = "docs/results") -> Path | None:
    """Record the seed under the results tree (:mod:`tracefp4.rl.seedrecord`) if its run folder holds
    it finished (every arm at the experiment's steps); the record's path, or None when unfinished. An
    identical record is left as it is."""
    run_dir, run_cfg = cfg.run_dir(seed), cfg.run_config(seed)
    if not _seed_done(run_dir, run_cfg):
        return None
    dest = record_dir(results_dir, cfg.name, seed)
    if write_seed_record(run_dir, dest, experiment=cfg.name, seed=seed, arms=list(run_cfg.arms),
                         steps=run_cfg.steps):
        print(f"experiment {cfg.name}: seed {seed} recorded in {dest} (commit it: run folders do not survive a "
              "move to a new machine)", file=sys.stderr, flush=True)
    return dest


def _recorded(cfg: ExperimentConfig, seed: int, results_dir: str | Path) -> bool:
    """Whether the seed is to be read from its record, not run: no run folder, a record (verified here,
    so a torn or foreign one stops the experiment before anything runs)."""
    if cfg.run_dir(seed).exists() or not record_dir(results_dir, cfg.name, seed).exists():
        return False
    return read_seed(cfg, seed, results_dir) is not None


def _seed_done(run_dir: Path, run_cfg: RLConfig) -> bool:
    """Every arm of the run folder at the run's steps: its final checkpoint published (with 0 steps,
    its step-0 evaluation logged, the whole of such an arm)."""
    from tracefp4.rl.checkpoint import list_checkpoints
    from tracefp4.rl.loop import warm_start_dir

    if not (run_dir / CONFIG_NAME).is_file():
        return False
    if run_cfg.steps == 0:
        metrics = read_metrics(run_dir)
        return all(rows_of_kind(metrics.get(a, []), "eval") for a in run_cfg.arms)
    checkpoints = warm_start_dir(run_dir).parent  # the arms' checkpoints/<arm> beside the warm start's
    return all((ck := list_checkpoints(checkpoints / a)) and ck[-1][0] >= run_cfg.steps for a in run_cfg.arms)


def _json_file(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file}: malformed JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: not a JSON object")
    return value


def _check_same_seed(saved: Mapping[str, Any], run_cfg: RLConfig, where: Path) -> None:
    diffs = [d for d in config_differences(saved, dataclasses.asdict(run_cfg)) if not d.startswith("steps:")]
    if saved.get("steps") != run_cfg.steps:  # a finished seed of fewer steps is another seed's result
        diffs.append(f"steps: {saved.get('steps')} -> {run_cfg.steps}")
    if diffs:
        raise ValueError(f"{where}: this seed was run with another configuration than the experiment's: "
                         + "; ".join(diffs))


def run_jobs(cfg: ExperimentConfig, config_path: str | Path, workers: int, *,
             results_dir: str | Path = "docs/results") -> None:
    """Every job of the experiment over ``workers`` processes at once: first each seed's warm start
    (skipped where it is saved), then each (seed, arm) as soon as its seed's warm start is saved, in
    seed order. A worker is ``python -m tracefp4 experiment --config <config_path> --job <seed>:<job>``
    (its own process, its own thread count from the run config; nothing but the command line crosses
    over). Every job computes what the sequential run computes for it (an arm's steps depend on the
    warm start and the step number alone), so ``--workers`` changes the wall time, not a number.
    A seed read from its record (:func:`run_experiment`) has no jobs; a seed is recorded as soon as its
    last arm's job ends (:func:`archive_seed`), while other seeds' jobs still run.
    A failed job stops new ones from starting; the running ones finish, then this raises, naming it."""
    import subprocess

    from tracefp4.rl.checkpoint import latest_checkpoint
    from tracefp4.rl.loop import WARM_START_JOB, open_run_folder, warm_start_dir

    arms = {}
    seeds = [s for s in cfg.seeds if not _recorded(cfg, s, results_dir)]
    for seed in seeds:  # the folders are made here, once, before any worker opens them
        run_cfg = cfg.run_config(seed)
        if run_cfg.resume is None:
            open_run_folder(run_cfg)
        arms[seed] = list(run_cfg.arms)
    warm_done = {s: latest_checkpoint(warm_start_dir(cfg.run_dir(s))) is not None for s in seeds}
    todo = [(s, WARM_START_JOB) for s in seeds if not warm_done[s]] + [(s, a) for s in seeds for a in arms[s]]
    total, running, failed = len(todo), {}, []
    started = 0
    while todo or running:
        for job in [j for j, p in running.items() if p.poll() is not None]:
            rc = running.pop(job).returncode
            if rc != 0:
                failed.append((job, rc))
            elif job[1] == WARM_START_JOB:
                warm_done[job[0]] = True
            elif not any(j[0] == job[0] for j in [*todo, *running]):
                archive_seed(cfg, job[0], results_dir)  # its last arm: the seed is whole
        ready = [j for j in todo if j[1] == WARM_START_JOB or warm_done[j[0]]]
        while ready and len(running) < workers and not failed:
            job = ready.pop(0)
            todo.remove(job)
            started += 1
            print(f"experiment {cfg.name}: seed {job[0]} {job[1]} ({started}/{total}, {len(running) + 1} running)",
                  file=sys.stderr, flush=True)
            running[job] = subprocess.Popen([sys.executable, "-m", "tracefp4", "experiment", "--config",
                                             str(config_path), "--job", f"{job[0]}:{job[1]}",
                                             "--results", str(results_dir)])
        if failed and not running:
            break
        if running:
            time.sleep(0.5)
    if failed:
        (seed, job), rc = failed[0]
        raise RuntimeError(f"experiment {cfg.name}: job {job!r} of seed {seed} failed (exit code {rc}; its output is "
                           f"above); {len(todo)} jobs not started; rerun to resume")


def run_job(cfg: ExperimentConfig, spec: str, results_dir: str | Path = "docs/results") -> None:
    """The worker side of :func:`run_jobs`: ``spec`` is ``<seed>:<job>`` (``warm_start`` or an arm).
    A seed read from its record (no run folder) has no jobs: refused."""
    from tracefp4.rl.loop import run_job as run_one

    cfg.validate()
    seed_text, sep, job = spec.partition(":")
    if not sep or not seed_text.isdigit() or int(seed_text) not in cfg.seeds or not job:
        raise ValueError(f"--job {spec!r}: expected <seed>:<warm_start or arm> with a seed of {cfg.seeds}")
    if _recorded(cfg, int(seed_text), results_dir):
        raise ValueError(f"--job {spec!r}: seed {seed_text} is finished and recorded in "
                         f"{record_dir(results_dir, cfg.name, int(seed_text))}; nothing to run (delete the record "
                         "to run the seed again)")
    run_one(cfg.run_config(int(seed_text)), job)


#: Evaluations of the policy under post-hoc FP4 inference (vanilla NVFP4, Four over Six), reported
#: by the bf16 arm's evaluations.
POST_HOC = tuple(post_hoc_metric(name) for name in POST_HOC_PLANS)


#: The per-sequence mismatch (each step's mean and p95 over its sequences), summarised per arm.
SEQUENCE_GAPS = (Name.SEQ_GAP_SUM, Name.SEQ_GAP_SUM_P95, Name.SEQ_LOG_RATIO, Name.SEQ_LOG_RATIO_P95)


def _seed_figures(rows: Sequence[Mapping]) -> dict[str, float | None]:
    train, evals = rows_of_kind(rows, "train"), rows_of_kind(rows, "eval")
    gaps = [r[Name.GAP_MEAN] for r in train]
    codes = [r[Name.CODE_MISMATCH] for r in train if r.get(Name.CODE_MISMATCH) is not None]
    return {
        **{f"final_{m}": evals[-1].get(m) if evals else None for m in HELD_OUT},
        # post-hoc FP4 inference of the policy (the bf16 arm's evaluations carry them)
        **{f"final_{k}": evals[-1].get(k) if evals else None for k in POST_HOC},
        Name.GAP_MEAN: statistics.fmean(gaps) if gaps else None,
        Name.GAP_MAX: max(r[Name.GAP_MAX] for r in train) if train else None,
        Name.CODE_MISMATCH: statistics.fmean(codes) if codes else None,
        Name.GUIDANCE_BYTES: statistics.fmean(r[Name.GUIDANCE_BYTES] for r in train) if train else None,
        "steps": len(train),
        "response_length": statistics.fmean(r["response_length"] for r in train) if train else None,
        # the seed's mean over its steps (runs from before these metrics have none)
        **{key: statistics.fmean(v) if (v := [r[key] for r in train if r.get(key) is not None]) else None
           for key in SEQUENCE_GAPS},
    }


#: Curves of the summary: name -> (metrics key, row kind).
CURVES = {
    "eval_accuracy": ("eval_accuracy", "eval"),
    "eval_reward": ("eval_reward", "eval"),
    "reward_mean": ("reward_mean", "train"),
    Name.GAP_MEAN: (Name.GAP_MEAN, "train"),
    Name.GAP_MAX: (Name.GAP_MAX, "train"),
    "is_truncated_frac": ("is_truncated_frac", "train"),
}


def _collapses(seeds: Sequence[int], rows: Sequence[Sequence[Mapping]], metric: str) -> dict[str, Any]:
    """Per arm: which seeds collapse (:func:`collapse_step` on ``metric``), at which step, and the share."""
    per_seed: dict[str, Any] = {}
    for s, r in zip(seeds, rows):
        c = collapse_step([(e["step"], e[metric]) for e in rows_of_kind(r, "eval") if e.get(metric) is not None])
        per_seed[str(s)] = None if c is None else {"step": c[0], "evals_after": c[1]}
    n = sum(v is not None for v in per_seed.values())
    return {"seeds_collapsed": n, "share": n / len(seeds) if seeds else None, "per_seed": per_seed}


def _curve(per_seed: Sequence[Sequence[Mapping]], key: str, kind: str) -> dict[str, list[float]]:
    """Mean and 95% band over seeds at each step all seeds logged."""
    return _band([{r["step"]: r[key] for r in rows_of_kind(rows, kind) if r.get(key) is not None} for rows in per_seed])


def _band(series: Sequence[Mapping[int, float]]) -> dict[str, list[float]]:
    """``{step: value}`` per seed -> mean and 95% band at the steps every seed has."""
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    out: dict[str, list[float]] = {"step": [], "mean": [], "lo": [], "hi": []}
    for step in steps:
        ci = mean_ci95([s[step] for s in series])
        out["step"].append(step)
        out["mean"].append(ci["mean"])
        out["lo"].append(ci["ci95"][0])
        out["hi"].append(ci["ci95"][1])
    return out


def seed_provenance(environment: Mapping[str, Any] | None, warm_start: Mapping[str, Any], *,
                    from_record: bool) -> dict[str, Any]:
    """What determined a seed's numbers, from its ``environment.json`` (``{"created", "resumes"}``;
    None when absent) and its :func:`~tracefp4.rl.seedrecord.warm_start_info`: the environment it was
    created in, what differed in the environments it was resumed in (if anything), the digest and
    source of its warm-start weights, and whether it was read from its record (``from_record``) or
    from its run folder."""
    from tracefp4.provenance import environment_differences

    env = environment or {"created": None, "resumes": []}
    created = env["created"]
    elsewhere = sorted({"; ".join(d) for r in env["resumes"] if created and (d := environment_differences(created, r))})
    return {"environment": created, "resumed_elsewhere": elsewhere, "warm_start": dict(warm_start),
            "from_record": from_record}


def _provenance_summary(provenance: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[int]] = {}
    for seed, p in sorted(provenance.items()):
        groups.setdefault(str(p["warm_start"]["weights_sha256"]), []).append(seed)
    return {
        "per_seed": {str(s): p for s, p in sorted(provenance.items())},
        "warm_starts": [{"weights_sha256": k, "seeds": v} for k, v in groups.items()],
        "scope": "bit-identical on the same machine type, library set and thread count; not across CPUs",
    }


def summarise(name: str, metrics: Mapping[int, Mapping[str, Sequence[Mapping]]], run_cfg: RLConfig,
              provenance: Mapping[int, Mapping[str, Any]] | None = None, metric: str = "eval_accuracy",
              scaling: Mapping[str, Any] | None = None, seeds_missing: Sequence[int] = ()) -> dict[str, Any]:
    """The results file's content from each seed's metrics (``{seed: {arm: rows}}``) and, when given,
    each seed's :func:`seed_provenance`. Every figure of :data:`HELD_OUT` is reported; ``metric`` is the
    headline one: ``collapse`` is computed on it (``collapse_by`` has each) and the table shows it.
    ``scaling`` (a ``tracefp4 scaling`` report, docs/results/scaling.json) puts beside each arm's
    per-sequence mismatch the scaling fit's prediction at the run's depth, width and mean completion
    length (:func:`sequence_gap_prediction`). ``seeds_missing``: the experiment's seeds not finished
    yet; when there are any the summary says first that it is partial (``partial: true`` and the seeds)."""
    seeds = sorted(metrics)
    arms = [a for a in run_cfg.arms if all(a in metrics[s] for s in seeds)]
    out: dict[str, Any] = {
        "name": name,
        **({"partial": True, "seeds_missing": sorted(seeds_missing)} if seeds_missing else {}),
        "task": run_cfg.task,
        "model": dataclasses.asdict(run_cfg.model) if not run_cfg.checkpoint else {"checkpoint": run_cfg.checkpoint},
        "steps": run_cfg.steps,
        "engine": run_cfg.engine,
        "guidance": run_cfg.guidance,
        "is_mode": run_cfg.is_mode,
        "is_cap": run_cfg.is_cap,
        # the asynchronous loop's settings (0: the synchronous loop; tracefp4.rl.staleness)
        "max_staleness": run_cfg.max_staleness,
        "staleness_schedule": str(getattr(run_cfg.staleness_schedule, "value", run_cfg.staleness_schedule)),
        "guidance_max_lag": run_cfg.guidance_lag_bound,
        "metric": metric,
        "arms": {},
    }
    for arm in arms:
        figs = [_seed_figures(metrics[s][arm]) for s in seeds]
        entry: dict[str, Any] = {"seeds": seeds, "steps_done": [f["steps"] for f in figs]}
        for m in HELD_OUT:
            vals = [f[f"final_{m}"] for f in figs if f[f"final_{m}"] is not None]
            entry[f"final_{m}"] = mean_ci95(vals) if vals else None
            entry[f"final_{m}_per_seed"] = vals
        for key in POST_HOC:
            post = [f[f"final_{key}"] for f in figs if f[f"final_{key}"] is not None]
            if post:
                entry[f"final_{key}"] = mean_ci95(post)
        for key in (Name.GAP_MEAN, Name.GAP_MAX, Name.CODE_MISMATCH, Name.GUIDANCE_BYTES, "response_length"):
            vals = [f[key] for f in figs if f[key] is not None]
            entry[key] = statistics.fmean(vals) if vals else None
        for key in SEQUENCE_GAPS:  # mean and 95% interval over seeds of each seed's mean over steps
            vals = [f[key] for f in figs if f[key] is not None]
            entry[key] = mean_ci95(vals) if vals else None
        if scaling is not None:
            entry["seq_scaling_prediction"] = sequence_gap_prediction(scaling, arm, run_cfg, entry["response_length"])
        rows = [metrics[s][arm] for s in seeds]
        entry["curves"] = {key: _curve(rows, source, kind) for key, (source, kind) in CURVES.items()}
        entry["per_seed"] = {str(s): {"eval_step": [r["step"] for r in rows_of_kind(r_, "eval")],
                                      **{m: [r.get(m) for r in rows_of_kind(r_, "eval")] for m in HELD_OUT}}
                             for s, r_ in zip(seeds, rows)}
        entry.update(_dynamics(rows))
        entry["collapse_by"] = {m: _collapses(seeds, rows, m) for m in HELD_OUT}
        entry["collapse"] = entry["collapse_by"][metric]
        if arm != "bf16" and all("bf16" in metrics[s] for s in seeds):
            for m in HELD_OUT:
                entry["curves"][f"{m}_minus_bf16"] = _paired_curve(rows, [metrics[s]["bf16"] for s in seeds], m)
        out["arms"][arm] = entry
    for reference in PAIRED_WITH:
        for m in HELD_OUT:
            _paired_differences(out["arms"], reference, m)
    if provenance is not None:
        out["provenance"] = _provenance_summary(provenance)
    return out


def sequence_gap_prediction(scaling: Mapping[str, Any], arm: str, run_cfg: RLConfig, length: float | None
                            ) -> dict[str, Any] | None:
    """The scaling fit's prediction (:func:`tracefp4.reports.scaling.predict_at`, trained weights) of
    the per-sequence mismatch at the run's layers, hidden size and mean completion ``length``, for the
    arm's own column of the scaling study (None for an arm the study does not run, e.g. ``fp4-rollout``,
    a run from a checkpoint, or no length):

    * ``seq_log_ratio_abs``: the fit of the mean |sequence log-ratio| itself (the report's ``seq_abs_mean``);
    * ``seq_logprob_abs_diff_sum``: ``length`` x the fit of the mean |Δlogp| per token, interval scaled
      alike (the fit has no Σ_t |Δlogp| of its own; a sequence's sum has this mean at a mean-length sequence)."""
    from tracefp4.pipeline.arms import SCALING_ARMS
    from tracefp4.reports.scaling import SEQ_ABS_MEAN, predict_at

    if arm not in SCALING_ARMS or run_cfg.checkpoint or not length:
        return None
    key = arm
    shape = {"layers": run_cfg.model.layers, "hidden": run_cfg.model.hidden, "new_tokens": length}
    ratio = predict_at(scaling, key, SEQ_ABS_MEAN, **shape)
    per_token = predict_at(scaling, key, Name.GAP_MEAN, **shape)
    return {
        "scaling_arm": key, **shape,
        Name.SEQ_LOG_RATIO: ratio,
        Name.SEQ_GAP_SUM: None if per_token is None else {
            **per_token, "predicted": length * per_token["predicted"],
            "interval95": [length * v for v in per_token["interval95"]]},
    }


#: The arms every other arm's final held-out figures are paired with, seed by seed: the BF16 reference
#: and TRACE with full guidance (FP4 against FP4: what guidance changes at the same rollout precision).
PAIRED_WITH = ("bf16", "trace-full")

#: Per-step training statistics summarised per arm by :func:`_dynamics` (the seed's mean over its steps).
STEP_MEANS = ("entropy", "grad_norm", "is_weight_mean", "is_truncated_frac", "is_masked_frac",
              "is_seq_truncated_frac", "is_seq_masked_frac")

#: The mismatch whose growth :func:`_dynamics` measures: its mean over the last ``SLOPE_WINDOW`` steps
#: over its mean over the first ``SLOPE_WINDOW`` (> 1: the mismatch grew during training).
GROWTH = (Name.K3_KL, Name.GAP_MAX)
SLOPE_WINDOW = 50


def _dynamics(rows: Sequence[Sequence[Mapping]]) -> dict[str, Any]:
    """How each seed's training went, with means and 95% intervals over seeds: the gain of the held-out
    figures over the seed's own step-0 evaluation, the growth of the mismatch (:data:`GROWTH`), and the
    mean of each :data:`STEP_MEANS` statistic the run logged."""
    out: dict[str, Any] = {}
    for m in HELD_OUT:
        gains = []
        for r in rows:
            ev = [e[m] for e in rows_of_kind(r, "eval") if e.get(m) is not None]
            if len(ev) >= 2:
                gains.append(ev[-1] - ev[0])
        out[f"gain_{m}"] = mean_ci95(gains) if gains else None
    for key in GROWTH:
        growth = []
        for r in rows:
            v = [t[key] for t in rows_of_kind(r, "train") if t.get(key) is not None]
            if len(v) >= 2 * SLOPE_WINDOW and statistics.fmean(v[:SLOPE_WINDOW]) > 0:
                growth.append(statistics.fmean(v[-SLOPE_WINDOW:]) / statistics.fmean(v[:SLOPE_WINDOW]))
        out[f"growth_{_json_key(key)}"] = mean_ci95(growth) if growth else None
    for key in STEP_MEANS:
        vals = [statistics.fmean(v) for r in rows
                if (v := [t[key] for t in rows_of_kind(r, "train") if t.get(key) is not None])]
        out[f"mean_{key}"] = mean_ci95(vals) if vals else None
    return out


def _json_key(key: str) -> str:
    """A record name as a JSON key fragment (``rollout_corr/k3_kl`` -> ``k3_kl``)."""
    return key.rsplit("/", 1)[-1]


def _paired_differences(arms: dict[str, dict[str, Any]], reference: str, metric: str) -> None:
    """Each arm's final ``metric`` minus ``reference``'s, seed by seed (same warm start, same prompts),
    with a Student-t interval over seeds: the seed-to-seed spread of the warm start, which dominates
    the plain intervals, cancels in the difference."""
    ref = arms.get(reference)
    if ref is None or ref[f"final_{metric}"] is None or len(ref[f"final_{metric}_per_seed"]) != len(ref["seeds"]):
        return
    ref_val = dict(zip(ref["seeds"], ref[f"final_{metric}_per_seed"]))
    for arm, entry in arms.items():
        if arm == reference or len(entry[f"final_{metric}_per_seed"]) != len(entry["seeds"]):
            continue
        paired = paired_differences(dict(zip(entry["seeds"], entry[f"final_{metric}_per_seed"])), ref_val)
        if paired is not None:
            entry[f"final_{metric}_minus_{reference}"] = paired


def _paired_curve(per_seed: Sequence[Sequence[Mapping]], ref_seed: Sequence[Sequence[Mapping]],
                  metric: str) -> dict[str, list[float]]:
    """``metric`` minus the reference arm's, seed by seed, at every step both logged."""
    diffs = []
    for rows, ref in zip(per_seed, ref_seed):
        a = {r["step"]: r[metric] for r in rows_of_kind(rows, "eval") if r.get(metric) is not None}
        b = {r["step"]: r[metric] for r in rows_of_kind(ref, "eval") if r.get(metric) is not None}
        diffs.append({k: a[k] - b[k] for k in set(a) & set(b)})
    return _band(diffs)


def plot_experiment(summary: Mapping[str, Any], plots_dir: Path) -> list[Path]:
    """``<name>_<curve>.png`` for each curve of the summary (and the paired difference to bf16): the
    mean over seeds with a 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title, logy in (("eval_accuracy", "held-out greedy accuracy", False),
                             ("eval_accuracy_minus_bf16", "held-out accuracy minus bf16's, paired by seed", False),
                             ("eval_reward", "held-out greedy reward", False),
                             ("eval_reward_minus_bf16", "held-out reward minus bf16's, paired by seed", False),
                             ("reward_mean", "training reward", False),
                             (Name.GAP_MEAN, "mean |Δlogp| per step (trainer vs rollout)", True),
                             (Name.GAP_MAX, "max |Δlogp| per step (trainer vs rollout)", True),
                             ("is_truncated_frac", "share of tokens whose IS weight the cap truncates", False)):
        drawn = {arm: c for arm, entry in summary["arms"].items()
                 if (c := entry["curves"].get(key)) and c["step"] and not (logy and max(c["mean"]) <= 0)}
        if not drawn:  # e.g. the paired differences of a matrix without a bf16 arm: no empty figure
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for arm, c in drawn.items():
            entry = summary["arms"][arm]
            style = arm_style(arm) or {}
            ax.plot(c["step"], c["mean"], label=f"{arm} (n={len(entry['seeds'])})", linewidth=1.6, **style)
            # a t-interval of a positive quantity can reach below 0: on the log axis it is drawn from mean/10
            lo = [max(lo, m / 10) for lo, m in zip(c["lo"], c["mean"])] if logy else c["lo"]
            ax.fill_between(c["step"], lo, c["hi"], alpha=0.12, color=style.get("color"))
        partial = f" (partial: seeds {', '.join(map(str, summary['seeds_missing']))} missing)" \
            if summary.get("partial") else ""
        ax.set_title(f"{summary['name']}: {title}\nmean over seeds, 95% band{partial}", fontsize=10)
        ax.set_xlabel("GRPO step")
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots_dir / f"{summary['name']}_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _paired(d: Mapping[str, Any] | None) -> str:
    return format_mean_ci(d, "+.3f")


def _collapsed(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "-"
    steps = ",".join(str(v["step"]) for v in c["per_seed"].values() if v is not None)
    return f"{c['seeds_collapsed']}/{len(c['per_seed'])}" + (f" @{steps}" if steps else "")


def format_summary(summary: Mapping[str, Any]) -> str:
    """The paper-shaped table: arm, the final held-out metric ± CI, gap, code mismatch, guidance bytes."""
    metric = summary.get("metric", "eval_accuracy")
    headline = {"eval_accuracy": "final acc", "eval_reward": "final reward"}[metric]
    lines = [
        *([f"PARTIAL: seeds {', '.join(map(str, summary['seeds_missing']))} not finished; the figures below are "
           "of the finished seeds only"] if summary.get("partial") else []),
        f"{summary['name']}: task {summary['task']}, {summary['steps']} steps, engine {summary['engine']}",
        f"{'arm':<14}{'seeds':>6}{headline:>13}{'95% CI':>18}{'mean|dlogp|':>13}{'max|dlogp|':>12}"
        f"{'code mism.':>12}{'B/token':>9}{'minus bf16, paired':>26}{'collapsed':>11}",
    ]

    def num(v, fmt):
        return f"{v:{fmt}}" if v is not None else "-"

    for arm, e in summary["arms"].items():
        acc = e[f"final_{metric}"]
        ci = format_ci(acc)
        lines.append(
            f"{arm:<14}{len(e['seeds']):>6}{num(acc and acc['mean'], '.3f'):>13}{ci:>18}"
            f"{num(e[Name.GAP_MEAN], '.5f'):>13}{num(e[Name.GAP_MAX], '.3f'):>12}"
            f"{num(e[Name.CODE_MISMATCH], '.2e'):>12}{num(e[Name.GUIDANCE_BYTES], '.1f'):>9}"
            f"{_paired(e.get(f'final_{metric}_minus_bf16')):>26}{_collapsed(e.get('collapse')):>11}"
        )
        for key, label in (("final_eval_accuracy_fp4", "post-hoc NVFP4"), ("final_eval_accuracy_fp4_4over6", "post-hoc 4/6")):
            post = e.get(key)
            if post:
                ci = format_ci(post)
                lines.append(f"{'  ' + label:<14}{len(e['seeds']):>6}{post['mean']:>13.3f}{ci:>18}   (the {arm} policy, FP4 inference)")
    if "is_mode" in summary:  # summaries written since the importance correction became a knob
        lines += _dynamics_table(summary, metric)
    if any(e.get(key) for e in summary["arms"].values() for key in SEQUENCE_GAPS):
        lines += _sequence_table(summary)
    prov = summary.get("provenance")
    if prov:
        groups = "; ".join(f"seeds {', '.join(map(str, g['seeds']))}: {g['weights_sha256']}" for g in prov["warm_starts"])
        envs = {json.dumps({k: (p["environment"] or {}).get(k) for k in ("cpu_model", "cpu_capability", "torch_threads")},
                           sort_keys=True) for p in prov["per_seed"].values()}
        lines.append(f"warm starts (seeds in one group started from identical weights): {groups}")
        lines.append(f"environments: {len(envs)} distinct ({prov['scope']})")
    return "\n".join(lines)


def _sequence_table(summary: Mapping[str, Any]) -> list[str]:
    """The per-sequence mismatch per arm (mean over seeds of each step's mean and p95 over its
    sequences) beside the scaling fit's prediction at the run's shape, with its 95% interval."""
    def mean(d):
        return f"{d['mean']:.3g}" if d else "-"

    def fitted(p):
        return f"{p['predicted']:.3g} [{p['interval95'][0]:.2g}, {p['interval95'][1]:.2g}]" if p else "-"

    lines = ["per-sequence mismatch (each step's mean and p95 over its sequences, mean over seeds); the scaling "
             "fit at this depth, width and mean length, 95% prediction interval:",
             f"{'arm':<14}{'sum|dlogp|':>12}{'p95':>9}{'|log-ratio|':>13}{'p95':>9}{'fit |log-ratio|':>28}"
             f"{'fit sum|dlogp|':>28}"]
    for arm, e in summary["arms"].items():
        pred = e.get("seq_scaling_prediction") or {}
        lines.append(f"{arm:<14}{mean(e.get(Name.SEQ_GAP_SUM)):>12}{mean(e.get(Name.SEQ_GAP_SUM_P95)):>9}"
                     f"{mean(e.get(Name.SEQ_LOG_RATIO)):>13}{mean(e.get(Name.SEQ_LOG_RATIO_P95)):>9}"
                     f"{fitted(pred.get(Name.SEQ_LOG_RATIO)):>28}{fitted(pred.get(Name.SEQ_GAP_SUM)):>28}")
    return lines


def _dynamics_table(summary: Mapping[str, Any], metric: str) -> list[str]:
    """How training went per arm (:func:`_dynamics`): paired with trace-full, gain over step 0, the
    mismatch's growth, entropy, gradient norm and the share of tokens the correction truncated or masked."""
    def mean(d, fmt):
        return f"{d['mean']:{fmt}}" if d else "-"

    lines = [f"importance correction: is_mode {summary['is_mode']}, cap {summary['is_cap']}",
             f"{'arm':<14}{'minus trace-full, paired':>26}{'gain over step 0':>18}{'k3 growth':>11}"
             f"{'max|dlogp| growth':>19}{'entropy':>9}{'grad norm':>11}{'truncated':>11}{'masked':>9}"]
    for arm, e in summary["arms"].items():
        lines.append(
            f"{arm:<14}{_paired(e.get(f'final_{metric}_minus_trace-full')):>26}"
            f"{mean(e.get(f'gain_{metric}'), '+.3f'):>18}{mean(e.get('growth_k3_kl'), '.2f'):>11}"
            f"{mean(e.get('growth_train_rollout_logprob_abs_diff_max'), '.2f'):>19}"
            f"{mean(e.get('mean_entropy'), '.3f'):>9}{mean(e.get('mean_grad_norm'), '.3f'):>11}"
            f"{mean(e.get('mean_is_truncated_frac'), '.1e'):>11}{mean(e.get('mean_is_masked_frac'), '.1e'):>9}")
    return lines
