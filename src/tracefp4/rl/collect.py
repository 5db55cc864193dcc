"""One step's experience: rollout -> store -> read back -> rewards, advantages, old log-probs.

:func:`collect` is the synchronous loop's step; the asynchronous loop (:mod:`tracefp4.rl.staleness`)
calls its two halves apart: :func:`roll_out` when the batch is generated, :func:`read_records` and
:func:`score` when a later step consumes it.

The records cross from the rollout to the trainer through the guidance store, as they would between
processes: written by the engine that recorded them (this process's engine, a vLLM worker, or each
rollout worker: one writer each), sealed by the driver, and read back with the policy version and
model signature checked. What the trainer then reads is only what
reached the store.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tracefp4.engines.protocol import RolloutOutput, SamplingParams, StoreTarget
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.store import StoreReader
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import Arm, PolicyLoss
from tracefp4.pipeline.factory import EngineKind, make_engine
from tracefp4.pipeline.metrics import Name, logprob_gap, router_flip_rate, sequence_gap
from tracefp4.rl.config import RLConfig
from tracefp4.rl.grpo import group_advantages, pad_right
from tracefp4.rl.score_centering import head_mass_metrics, pad_top, top_k_for
from tracefp4.rl.tasks import Example, Task, Tokenizer
from tracefp4.seeds import Stream, TrajectoryIds, derive, trajectory_ids

Records = steps.Records


@dataclasses.dataclass
class ArmSetup:
    """What every step of one arm shares: the policy, the arm, the task and where its records go."""

    name: str
    arm: Arm
    model: PreTrainedModel
    task: Task
    tok: Tokenizer
    cfg: RLConfig
    store_root: Path
    signature: str  # the model signature the store checks on every read
    pool: Any = None  # a tracefp4.rl.workers.RolloutPool, or None: roll out in this process
    serving: Any = None  # the RolloutEngine of this process (None: our engine over ``model``)

    def __post_init__(self) -> None:
        if self.serving is None:
            self.serving = make_engine(EngineKind.HOME, self.model)


@dataclasses.dataclass
class Batch:
    """A step's trajectories with everything the update needs, and the step's rollout-side metrics.

    Per-token tensors are ``[B, T]`` over completion tokens, ``T`` the longest completion; ``mask``
    is True where a token was generated.
    """

    step: int
    token_ids: list[torch.Tensor]  # prompt then completion, per trajectory
    prompt_lens: list[int]
    records: Records  # as read back from the store: what the trainer is given
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B], group-relative
    logp_rollout: torch.Tensor  # what the rollout engine reported: the behaviour policy
    logp_old: torch.Tensor  # the trainer's, with the weights that consume the batch, before this step's updates
    # (no gradient): the proximal policy (tracefp4.rl.grpo)
    mask: torch.Tensor
    metrics: dict[str, float]  # reward, mismatch, guidance bytes, code mismatch, ...
    timings: dict[str, float]  # time/rollout_s, time/store_write_s, time/store_read_s
    score_s: float  # seconds spent scoring (rewards and old log-probs): part of time/train_s
    traj_ids: list[str] = dataclasses.field(default_factory=list)  # the store's names of the trajectories
    # Score Centering arms: the sampler's top-k tokens at each generated position and their log-probs,
    # [B, T, k] (None for every other arm)
    top_ids: torch.Tensor | None = None
    top_logp_rollout: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.mask.shape[1]


def collect(s: ArmSetup, step: int, version: int) -> Batch:
    """Roll out step ``step`` with policy ``version`` and score it (the synchronous loop's step)."""
    out = roll_out(s, step, version)
    return score(s, step, out.rollout, out.records, out.diagnostics, out.timings)


def step_prompts(s: ArmSetup, step: int) -> list[Example]:
    """Step ``step``'s prompts, each ``group_size`` times: a function of the seed and the step alone
    (same prompts for every arm, and for a resumed run)."""
    rng = random.Random(derive(s.cfg.seed, Stream.PROMPTS, step))
    return [e for e in s.task.sample(rng, s.cfg.prompts_per_step) for _ in range(s.cfg.group_size)]


def step_traj_ids(s: ArmSetup, step: int) -> list[str]:
    """The store's names of step ``step``'s trajectories."""
    return trajectory_ids(TrajectoryIds.LOOP, s.cfg.prompts_per_step * s.cfg.group_size, step=step)


def roll_out(s: ArmSetup, step: int, version: int, *, read_back: bool = True) -> steps.StepRollout:
    """The rollout of step ``step`` with policy ``version`` (the weights in ``s.model`` now), written to
    the store as that step; with ``read_back``, its records read back (else ``records`` is None and
    :func:`read_records` reads them when the step is consumed)."""
    group = step_prompts(s, step)
    return _rollout_to_store(s, step, version, [s.tok.encode(e.prompt) for e in group], step_traj_ids(s, step),
                             read_back)


def read_records(s: ArmSetup, step: int, version: int, roll: RolloutOutput) -> tuple[Records, float]:
    """Step ``step``'s records as the rollout of policy ``version`` wrote them (signature and version
    checked by the store), and the seconds the read took."""
    t0 = time.perf_counter()
    with StoreReader(s.store_root, step, model_signature=s.signature, policy_version=version) as r:
        records = r.batch(step_traj_ids(s, step), [t.numel() for t in roll.token_ids])
    return records, time.perf_counter() - t0


def score(s: ArmSetup, step: int, roll: RolloutOutput, records: Records, diagnostics: Records | None,
          timings: dict[str, float], arm: Arm | None = None) -> Batch:
    """Rewards, advantages and the trainer's log-probs under the weights in ``s.model`` now (the
    proximal policy, before this step's update) of step ``step``'s rollout ``roll``; ``arm`` replaces
    the setup's for the trainer's forward (a guidance fallback, :func:`tracefp4.rl.update.lag_arm`)."""
    if diagnostics is None and _stored_full_codes(s.arm):
        diagnostics = records  # from worker processes: the full codes that reached the store
    t0 = time.perf_counter()
    batch = _score(s, step, step_prompts(s, step), roll, records, diagnostics, arm or s.arm)
    batch.timings, batch.score_s, batch.traj_ids = timings, time.perf_counter() - t0, step_traj_ids(s, step)
    return batch


def step_sampling(s: ArmSetup, step: int) -> SamplingParams:
    """How step ``step``'s rollout samples: the run's length, temperature and top-p, the step's seed."""
    cfg = s.cfg
    return SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, (s.tok.EOS,),
                          seed=derive(cfg.seed, Stream.SAMPLING, step), top_logprobs=sampler_top_k(s))


def _rollout_to_store(s: ArmSetup, step: int, version: int, prompts: list[list[int]], ids: list[str],
                      read_back: bool = True) -> steps.StepRollout:
    """The step's rollout through the store, on the worker pool (each worker writes its own shards) or
    on this process's engine, given the policy's weights first."""
    sampling = step_sampling(s, step)
    t0 = time.perf_counter()
    if s.pool is not None:
        s.pool.sync_weights(s.model, version)
    else:
        steps.sync(s.serving, s.model, (s.name, version))
    t_sync = time.perf_counter() - t0
    target = StoreTarget(str(s.store_root), step, "w0", tuple(ids), s.signature, version)
    out = steps.rollout_step(s.pool if s.pool is not None else s.serving, prompts, sampling, s.arm, target,
                             read_back=read_back)
    out.timings["time/weight_sync_s"] = t_sync
    return out


def sampler_top_k(s: ArmSetup) -> int:
    """The sampler top-k the arm's loss needs (Score Centering: ``sc_top_k`` or the vocabulary), else 0."""
    if s.arm.loss is PolicyLoss.GRPO:
        return 0
    return top_k_for(s.cfg.sc_top_k, int(s.model.config.vocab_size))


def _stored_full_codes(arm: Arm) -> bool:
    """Whether the store holds the rollout's full codes at every diagnostics layer."""
    return arm.guidance is not None and arm.guidance.mode is HintMode.FULL and bool(arm.diagnostics)


def _score(s: ArmSetup, step: int, group: list[Example], roll: RolloutOutput, records: Records,
           diagnostics: Records | None, arm: Arm) -> Batch:
    """Rewards, advantages and the trainer's log-probs before the update, with the step's metrics."""
    cfg = s.cfg
    completions = [s.tok.decode(roll.completion(b).tolist()) for b in range(len(group))]
    rewards = torch.tensor([s.task.reward(e, c) for e, c in zip(group, completions)])
    adv = group_advantages(rewards, cfg.group_size, normalize_std=cfg.normalize_std)
    measure = arm.plan is not None and diagnostics is not None  # code mismatch: FP4 arms with full codes
    with torch.no_grad():  # the policy before this step's updates, with the codes it picks
        old = steps.trainer_logprobs(s.model, roll.token_ids, roll.prompt_lens, records, arm,
                                      temperature=cfg.temperature, diagnostics=diagnostics if measure else None)
    width = max(lp.numel() for lp in roll.logprobs)
    logp_roll, mask = pad_right(roll.logprobs, width)
    logp_old, _ = pad_right([lp.detach() for lp in old.logprobs], width)
    generated = int(mask.sum())
    metrics = {
        "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards == 1.0).float().mean()),
        "response_length": generated / len(group),
        # Monte Carlo entropy estimate over the sampled tokens: mean of -log pi_rollout
        "entropy": float(-(logp_roll[mask]).mean()),
        Name.GUIDANCE_BYTES: guidance_bytes_per_token(records, generated),
        Name.ROUTER_FLIPS: router_flip_rate(old.router_flips),
        **logprob_gap(logp_roll, logp_old, mask),
        **sequence_gap(logp_roll, logp_old, mask),
        **(steps.code_mismatch_metrics(old, diagnostics) if measure else {}),
        Name.DECODE_FAILURES: steps.decode_failures(old),
    }
    top_ids = top_logp = None
    if roll.top_ids:  # Score Centering: the sampler's top-k, padded like every per-token tensor
        k = roll.top_ids[0].shape[-1]
        top_ids = pad_top(roll.top_ids, width, k, torch.long)
        top_logp = pad_top(roll.top_logprobs, width, k, torch.float32)
        metrics.update(head_mass_metrics(top_logp, mask))
    return Batch(step, roll.token_ids, roll.prompt_lens, records, rewards, adv, logp_roll, logp_old, mask,
                 metrics, {}, 0.0, top_ids=top_ids, top_logp_rollout=top_logp)


def guidance_bytes_per_token(records: Records, generated: int) -> float:
    """Bytes of guidance (routing excluded) that reached the store, per generated token."""
    total = sum(t.nbytes for r in records for k, t in r.items() if not k.endswith(".routing"))
    return total / max(generated, 1)
