"""GRPO with FP4 rollouts, side by side: BF16 rollout, vanilla FP4 QAT, and TRACE.

One loop, read top to bottom: warm start once, then for every arm from the same weights, step after
step: :func:`~tracefp4.rl.collect.collect` (rollout -> store -> read back -> rewards, advantages, old
log-probs) and :func:`~tracefp4.rl.update.update` (clipped-surrogate minibatch updates), with a
held-out evaluation and a checkpoint every ``eval_every`` steps.

Crash safety: the run folder is refused if it already holds a run (unless resuming, when the saved
config must agree, :mod:`tracefp4.rl.runfolder`) and is locked while a process works in it;
checkpoints are written whole or not at all and verified on load (:mod:`tracefp4.rl.checkpoint`);
on resume each arm restarts from its last good checkpoint, the metrics log is cut back to it, and
every store step after it is discarded, so a run killed at any moment resumes to the same weights
and one metrics row per step. Every step is a function of the weights and the step number alone
(prompts, sampling seeds and minibatch order are seeded by step), which is what makes that true. The arms (same seeds, same prompts,
same sampling seeds) and what each records are in :mod:`tracefp4.pipeline.arms`; every field of the run
config in :mod:`tracefp4.rl.config`.

With ``max_staleness = k > 0`` step ``s`` trains on a batch rolled out ``k`` versions earlier
(:mod:`tracefp4.rl.staleness`, the fixed schedule): the runner rolls out the batch of step ``s + k``
before it trains on step ``s``'s, and its checkpoints carry the ``k`` batches rolled out ahead, so
the same resume guarantee holds (a step is then a function of the weights, the step number and the
batches its checkpoint carries).

With ``trainer_world_size = N > 1`` the update runs on N FSDP2 processes (:mod:`tracefp4.rl.distributed`,
started once per run, given each arm in turn); rollout, scoring, evaluation and checkpoints stay here,
and the new weights come back to this process's model after every step.

:func:`run` is a library function: it leaves process-wide settings (torch's thread count) to its
caller; the ``tracefp4`` command sets them from the config.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tracefp4.engines.model import from_config, load_model, model_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.faults import crash_point
from tracefp4.guidance.store import discard_step, discard_steps
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import Arm, make_arm
from tracefp4.pipeline.factory import EngineKind
from tracefp4.pipeline.metrics import Name
from tracefp4.provenance import environment, weights_digest
from tracefp4.rl import runfolder, runlog
from tracefp4.rl.checkpoint import Checkpoint, latest_checkpoint, save_checkpoint
from tracefp4.rl.collect import ArmSetup, collect
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.evaluate import evaluate
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.report import write_report
from tracefp4.rl.staleness import FixedSchedule
from tracefp4.rl.tasks import Task, Tokenizer, make_task
from tracefp4.rl.update import update
from tracefp4.rl.warm_start import warm_start

__all__ = ["ArmRunner", "ModelSpec", "RLConfig", "WARM_START_JOB", "open_run_folder", "run", "run_job",
           "warm_start_dir"]


class ArmRunner:
    """Runs GRPO for one arm; all state needed to resume lives in its checkpoint folder."""

    def __init__(self, name: str, model: PreTrainedModel, task: Task, tok: Tokenizer, cfg: RLConfig,
                 run_dir: Path, plan: PrecisionPlan | None = None, pool=None, resume_step: int = 0, group=None,
                 serving=None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.opt = MasterWeightAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
        arm = make_arm(name, guidance=cfg.guidance, n_layers=model_layers(model)[0], plan=plan or PrecisionPlan(),
                       quads_fraction=cfg.quads_fraction)
        self.plan = arm.plan or PrecisionPlan()  # the arm's own (a format variant's preset, or the run's)
        self.setup = ArmSetup(name, arm, model, task, tok, cfg, run_dir / "store" / name,
                              steps.model_signature(model, self.plan), pool, serving)
        self.version = 0  # policy version: optimizer steps taken so far, in whole GRPO steps
        self.step = 0
        self.log = runlog.MetricsLog(run_dir, name, resume_step=resume_step)
        # trainer_world_size > 1: the update runs on the processes of ``group`` (tracefp4.rl.distributed),
        # given this arm at the first step from this model and self.opt (which a resume has loaded by then)
        self.group = group
        self.group_ready = False
        # max_staleness > 0: the batches rolled out ahead of the steps that train on them
        self.schedule = FixedSchedule(self.setup, cfg.max_staleness, cfg.guidance_lag_bound) \
            if cfg.max_staleness > 0 else None
        self._restore: tuple[Any, dict[str, bytes], str] | None = None  # a loaded checkpoint's pending batches

    @property
    def name(self) -> str:
        return self.setup.name

    @property
    def arm(self) -> Arm:
        return self.setup.arm

    @property
    def model(self) -> PreTrainedModel:
        return self.setup.model

    def train_step(self) -> dict[str, Any]:
        """One GRPO step: collect (or, max_staleness > 0, take the step's batch generated ahead), update;
        returns the step's metrics record."""
        arm, staleness = self.arm, {}
        if self.schedule is None:
            batch = collect(self.setup, self.step, self.version)
        else:
            batch, arm, staleness = self.schedule.batch(self.step, self.version)
        t0 = time.perf_counter()
        if self.group is not None:
            stats = self._trainer_group().update(batch, self.setup.store_root, self.setup.signature, self.version,
                                                 self.model)  # the new weights are in self.model on return
        else:
            stats = update(self.model, self.opt, arm, self.cfg, batch)
        crash_point("updated")  # the weights moved in memory only
        self.version += 1
        rec = {
            "kind": "train", "step": self.step, "policy_version": self.version,
            **batch.metrics, **staleness, **stats, **batch.timings,
            "time/train_s": batch.score_s + time.perf_counter() - t0,
        }
        discard_step(self.setup.store_root, self.step)  # consumed
        self.step += 1
        return rec

    def _trainer_group(self):
        if not self.group_ready:
            self.group.setup(self.model, self.cfg, self.arm, self.opt.state_tensors())
            self.group_ready = True
        return self.group

    def close(self) -> None:
        self.log.close()

    def evaluate(self) -> dict[str, float]:
        s = self.setup
        steps.sync(s.serving, s.model, (s.name, self.version))
        return evaluate(s.serving, s.arm, s.task, s.tok, s.cfg)

    # The runner's whole state, saved and restored here only (model, optimizer, step, policy version).

    def save(self, arm_dir: Path) -> None:
        # with trainer processes: their FP32 masters and Adam state, gathered in full (same names, same format)
        tensors = self.group.optimizer_tensors() if self.group_ready else self.opt.state_tensors()
        state = {"arm": self.name, "step": self.step, "policy_version": self.version, "signature": self.setup.signature}
        extra = None
        if self.schedule is not None:  # the batches rolled out ahead travel with the weights they go with
            state["pending"], extra = self.schedule.state(), self.schedule.checkpoint_files()
        save_checkpoint(arm_dir, self.step, model=self.model, optimizer_tensors=tensors, state=state, extra=extra)

    def load(self, ck: Checkpoint) -> None:
        state = ck.state
        if state["arm"] != self.name:
            raise ValueError(f"{ck.path}: checkpoint of arm {state['arm']!r}, not {self.name!r}")
        if state["signature"] != self.setup.signature:
            raise ValueError(f"{ck.path}: model signature {state['signature']} differs from {self.setup.signature}")
        self.opt.load_state_tensors(ck.optimizer_tensors)
        self.step, self.version = int(state["step"]), int(state["policy_version"])
        if self.schedule is not None:
            if "pending" not in state:
                raise ValueError(f"{ck.path}: a checkpoint of a run without max_staleness (no pending batches)")
            self._restore = (state["pending"], ck.extra, str(ck.path))

    def discard_unconsumed_steps(self) -> None:
        """Store steps a killed attempt left behind (sealed, half-written, or with a stale writer lock);
        then, max_staleness > 0, the pending batches of the loaded checkpoint written back."""
        root = self.setup.store_root
        discard_steps(root)
        if self._restore is not None:
            self.schedule.restore(*self._restore)
            self._restore = None


def run(cfg: RLConfig) -> Path:
    """Warm start once, then GRPO for every arm from the same weights; returns the run folder."""
    task, tok, run_dir = _open(cfg)
    with runfolder.lock_run_folder(run_dir):
        _record_environment(run_dir)
        base = warm_start_model(cfg, task, tok, warm_start_dir(run_dir))
        with _arm_services(cfg, base, task, tok) as services:
            for name in cfg.arms:
                if services.pool is not None:
                    services.pool.version = None  # every arm starts from the warm-start weights: resync
                run_arm(name, base, task, tok, cfg, run_dir, **services.kwargs())
        write_report(run_dir)
    return run_dir


#: The job name of a run folder's warm start in :func:`run_job` (an arm is named by itself).
WARM_START_JOB = "warm_start"


def warm_start_dir(run_dir: Path) -> Path:
    """Where a run folder keeps its warm-start checkpoint (beside the arms' ``checkpoints/<arm>``)."""
    return run_dir / "checkpoints" / "warm_start"


def run_job(cfg: RLConfig, job: str) -> Path:
    """One job of a run, for a run split over processes (``tracefp4 experiment --workers N``): the
    warm start (``job = WARM_START_JOB``) or one arm, which needs the warm start done. The run folder
    must exist (:func:`open_run_folder`); the job holds it shared and itself exclusively
    (:func:`~tracefp4.rl.runfolder.lock_run_folder`), so the arms of one folder run in parallel.
    Each arm computes what :func:`run` computes for it: its steps depend on the warm start and the
    step number alone, never on the other arms. The run's report is left to a :func:`run` after the
    jobs (which finds every arm done and only reads)."""
    if job != WARM_START_JOB and job not in cfg.arms:  # before the folder is touched
        raise ValueError(f"job {job!r}: expected {WARM_START_JOB!r} or one of the run's arms {list(cfg.arms)}")
    task, tok, run_dir = _open(cfg)
    base_dir = warm_start_dir(run_dir)
    with runfolder.lock_run_folder(run_dir, job=job):
        if job == WARM_START_JOB:
            _record_environment(run_dir)
            warm_start_model(cfg, task, tok, base_dir)
            return run_dir
        if latest_checkpoint(base_dir) is None:
            raise runfolder.RunFolderError(f"{run_dir}: arm {job!r} needs the warm start first (job {WARM_START_JOB!r})")
        base = warm_start_model(cfg, task, tok, base_dir)
        with _arm_services(cfg, base, task, tok) as services:
            run_arm(job, base, task, tok, cfg, run_dir, **services.kwargs())
    return run_dir


def open_run_folder(cfg: RLConfig) -> Path:
    """The run folder of ``cfg``: created (``cfg.resume`` unset) or opened for resume (its saved config
    must agree, :func:`~tracefp4.rl.runfolder.open_for_resume`)."""
    config = dataclasses.asdict(cfg)
    if cfg.resume:
        return runfolder.open_for_resume(cfg.resume, config)
    return runfolder.create_run_folder(cfg.out, cfg.run_name, config)


def _open(cfg: RLConfig) -> tuple[Task, Tokenizer, Path]:
    cfg.validate()
    task = make_task(cfg.task, **cfg.task_kwargs)
    return task, task.make_tokenizer(), open_run_folder(cfg)


def _record_environment(run_dir: Path) -> None:
    differs = runfolder.record_environment(run_dir, environment())
    if differs:
        print(f"{run_dir}: resumed in another environment than it was created in ({'; '.join(differs)}); "
              "the steps from here are not the ones an uninterrupted run would have taken", file=sys.stderr)


@dataclasses.dataclass
class _ArmServices:
    """What a run's arms share besides the weights: the serving engine, the rollout pool, the trainer group."""

    serving: Any = None
    pool: Any = None
    group: Any = None

    def kwargs(self) -> dict[str, Any]:
        return {"pool": self.pool, "group": self.group, "serving": self.serving}


@contextlib.contextmanager
def _arm_services(cfg: RLConfig, base: PreTrainedModel, task: Task, tok: Tokenizer) -> Iterator[_ArmServices]:
    services = _ArmServices()
    try:
        if cfg.engine_kind is not EngineKind.HOME:  # one engine for the run, given each arm's weights in turn
            services.serving = steps.serving_engine(cfg.engine_kind, base, max_len=_max_len(cfg, task, tok))
        if cfg.rollout_workers > 0:  # the rollouts on engine actors (evaluation stays on this process's engine)
            from tracefp4.rl.workers import RolloutPool

            services.pool = RolloutPool(base, cfg.rollout_workers, engine=cfg.engine_kind,
                                        max_len=_max_len(cfg, task, tok), group_size=cfg.group_size)
        if cfg.trainer_world_size > 1:  # the update on N processes, started once, given each arm in turn
            from tracefp4.rl.distributed import TrainerGroup

            services.group = TrainerGroup(cfg.trainer_world_size)
        yield services
    finally:
        if services.pool is not None:
            services.pool.shutdown()
        if services.group is not None:
            services.group.close()
        if services.serving is not None and hasattr(services.serving, "close"):
            services.serving.close()  # deterministically: vLLM's shutdown resets process-wide state


def warm_start_model(cfg: RLConfig, task: Task, tok: Tokenizer, base_dir: Path) -> PreTrainedModel:
    """The shared starting point of every arm: loaded from ``base_dir`` when a run made it already,
    else built (or loaded from ``cfg.checkpoint``), warm-started and checkpointed there."""
    done = latest_checkpoint(base_dir)
    if done is not None:
        return load_model(done.model_path)
    if cfg.checkpoint:
        base = load_model(runfolder.check_model_folder(cfg.checkpoint, "checkpoint"))
        if base.config.vocab_size < tok.vocab_size:
            raise ValueError(f"checkpoint {cfg.checkpoint}: vocab {base.config.vocab_size} is smaller than the "
                             f"task tokenizer's {tok.vocab_size}")
    else:
        base = from_config(cfg.model.hf_config(tok), dtype=torch.bfloat16, seed=cfg.seed)
    if cfg.warm_start_steps > 0:
        with _progress(cfg.warm_start_steps, "warm start (SFT)") as bar:
            warm_start(base, task, tok, cfg, bar)
    # the digest names these weights wherever they came from: the experiment summary groups seeds by it
    save_checkpoint(base_dir, 0, model=base, optimizer_tensors={}, state={
        "warm_start_steps": cfg.warm_start_steps, "source": cfg.checkpoint or "built",
        "weights_sha256": weights_digest(base.state_dict()),
    })
    return base


def _max_len(cfg: RLConfig, task: Task, tok: Tokenizer) -> int:
    """The longest trajectory a run can make: a prompt (sampled or held out) plus the completion."""
    prompts = task.sample(random.Random(0), 256) + task.eval_set(cfg.eval_size)
    return max(len(tok.encode(e.prompt)) for e in prompts) + cfg.max_new_tokens + 8


def run_arm(name: str, base: PreTrainedModel, task: Task, tok: Tokenizer, cfg: RLConfig, run_dir: Path,
            pool=None, group=None, serving=None) -> None:
    """GRPO for one arm from the warm-start weights (or its own checkpoint, when resuming)."""
    ckpt = run_dir / "checkpoints" / name
    found = latest_checkpoint(ckpt)  # the newest that verifies; a damaged one falls back, with a warning
    model = load_model(found.model_path) if found is not None else copy.deepcopy(base)
    runner = ArmRunner(name, model, task, tok, cfg, run_dir, pool=pool, resume_step=found.step if found else 0,
                       group=group, serving=serving)
    if found is not None:
        runner.load(found)
    runner.discard_unconsumed_steps()
    try:
        if runner.step == 0:
            runner.log.log({"kind": "eval", "step": 0, **runner.evaluate()})
        with _progress(cfg.steps, f"GRPO {name:>10}") as bar:
            bar.update(runner.step)
            while runner.step < cfg.steps:
                rec = runner.train_step()
                runner.log.log(rec)
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.2f}",
                                dlogp=f"{rec[Name.GAP_MEAN]:.4f}")
                if runner.step % cfg.eval_every == 0 or runner.step == cfg.steps:
                    runner.log.log({"kind": "eval", "step": runner.step, **runner.evaluate()})
                    runner.save(ckpt)
    finally:
        runner.close()


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
