"""The policy update: the arm's loss over a collected batch, in minibatches, written once.

One pass over a fixed permutation of the batch, ``updates_per_step`` minibatches, one optimizer step
each. The loss of a minibatch (:func:`minibatch_loss`) is the arm's :class:`~tracefp4.pipeline.arms.PolicyLoss`
(GRPO, or Score Centering in :mod:`tracefp4.rl.score_centering`) with the importance weight of
``is_mode`` against the rollout (:func:`~tracefp4.rl.grpo.importance_weights`). The same function runs
in one process (:func:`update`) and on each FSDP rank (:func:`tracefp4.rl.distributed.sharded_update`):
a :class:`Reducer` sums the counts the loss is normalised by over the processes, so every rank's loss
is its share of the minibatch's loss and every statistic is the minibatch's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from tracefp4.engines.trainer import TrainerMode, TrainerOutput
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import Arm, PolicyLoss
from tracefp4.rl.collect import Batch
from tracefp4.rl.config import RLConfig
from tracefp4.rl.grpo import SEQUENCE_STATS, LossAgg, grpo_loss, pad_right
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.score_centering import score_centering_loss, trainer_scores
from tracefp4.seeds import Stream, derive


class Reducer:
    """Sums floats over the trainer processes. This one is a single process: the sum is the value."""

    world_size = 1

    def sum(self, values: list[float]) -> list[float]:
        return list(values)


LOCAL = Reducer()


@dataclasses.dataclass(frozen=True)
class Minibatch:
    """This process's trajectories of one minibatch: what the loss reads (records already read back)."""

    token_ids: list[torch.Tensor]
    prompt_lens: list[int]
    records: list
    logp_old: torch.Tensor  # [b, width]
    logp_rollout: torch.Tensor  # [b, width]
    advantages: torch.Tensor  # [b]
    width: int  # the whole batch's completion width (every process pads to it)
    top_ids: torch.Tensor | None = None  # Score Centering: the sampler's top-k ids, [b, width, k]
    top_logp_rollout: torch.Tensor | None = None


def take(fields: Mapping[str, Any], idx: Sequence[int], records: list) -> Minibatch:
    """Trajectories ``idx`` of a batch given by its fields' names (a :class:`Batch`'s, or the job an
    FSDP rank receives, which carries the same names), with their ``records``; an absent or None
    per-token field (the Score Centering ones for other arms) stays None."""
    rows = list(idx)

    def pick(name: str) -> torch.Tensor | None:
        t = fields.get(name)
        return None if t is None else t[rows]

    return Minibatch([fields["token_ids"][b] for b in rows], [fields["prompt_lens"][b] for b in rows], records,
                     pick("logp_old"), pick("logp_rollout"), pick("advantages"), fields["mask"].shape[1],
                     pick("top_ids"), pick("top_logp_rollout"))


def select(batch: Batch, idx: Sequence[int], records: list | None = None) -> Minibatch:
    """Trajectories ``idx`` of ``batch`` (with ``records`` if given, else the batch's own)."""
    return take(vars(batch), idx, records if records is not None else [batch.records[b] for b in idx])


def update(model: PreTrainedModel, opt: MasterWeightAdamW, arm: Arm, cfg: RLConfig, batch: Batch) -> dict[str, float]:
    """Apply the step's updates to ``model``; return the mean loss statistics and gradient norm."""
    stats: dict[str, float] = {}
    norms = []
    model.train()
    for idx in minibatch_order(cfg, batch.step, len(batch.token_ids)):
        loss, st = minibatch_loss(model, arm, cfg, select(batch, idx))
        loss.backward()
        norms.append(opt.step())
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v / cfg.updates_per_step
    model.eval()
    return {"grad_norm": sum(norms) / len(norms), **stats}


def lag_arm(arm: Arm, trainer_version: int, rollout_version: int, guidance_max_lag: int) -> Arm:
    """The arm a trainer at policy ``trainer_version`` runs on samples that the weights of
    ``rollout_version`` generated: the arm itself while the lag (their difference) is at most
    ``guidance_max_lag``; beyond, a guided arm's trainer rounds to nearest on its own grid (vanilla
    QAT, routing still replayed), since records of weights that have moved on may no longer bracket
    the trainer's values. The one place the loop hands the trainer its version and lag bound (with
    records that carry a version per token, the trainer would take both and decide per token)."""
    lag = trainer_version - rollout_version
    if lag < 0 or guidance_max_lag < 0:
        raise ValueError(f"lag_arm: trainer version {trainer_version} behind rollout version {rollout_version}, "
                         f"or guidance_max_lag {guidance_max_lag} < 0")
    if lag <= guidance_max_lag or arm.trainer is not TrainerMode.TRACE:
        return arm
    return dataclasses.replace(arm, trainer=TrainerMode.QAT)


def minibatch_order(cfg: RLConfig, step: int, n: int) -> list[list[int]]:
    """The step's minibatches: ``updates_per_step`` chunks of one seeded permutation of the batch (the
    same on every process)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(derive(cfg.seed, Stream.MINIBATCH, step)))
    return [mb.tolist() for mb in order.chunk(cfg.updates_per_step)]


def minibatch_loss(model: PreTrainedModel, arm: Arm, cfg: RLConfig, mb: Minibatch, reducer: Reducer = LOCAL
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The arm's loss over this process's trajectories ``mb``, with gradient, as its share of the
    minibatch's loss over all processes (the loss itself in one process), and the minibatch's
    statistics (``loss`` among them)."""
    new = _trainer(model, arm, cfg, mb)
    logp_new, mask = pad_right(new.logprobs, mb.width)
    common = (logp_new, mb.logp_old, mb.logp_rollout, mb.advantages, mask)
    if arm.loss is PolicyLoss.SCORE_CENTERING:
        if mb.top_ids is None:
            raise ValueError(f"arm {arm.name!r}: Score Centering needs the sampler's top-k log-probs in the batch")
        top, tail = trainer_scores(new.logprob_rows, mb.top_ids)
        loss, st = score_centering_loss(*common, top, tail, mb.top_logp_rollout, is_cap=cfg.sc_is_cap,
                                        is_mode=cfg.is_mode, agg=cfg.loss_agg, max_new_tokens=cfg.max_new_tokens)
    else:
        loss, st = grpo_loss(*common, clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap,
                             is_mode=cfg.is_mode, agg=cfg.loss_agg, max_new_tokens=cfg.max_new_tokens)
    if reducer.world_size == 1:
        return loss, {"loss": float(loss), **st}
    return _share(loss, st, mask, LossAgg(cfg.loss_agg), reducer)


def _share(loss: torch.Tensor, st: dict[str, float], mask: torch.Tensor, agg: LossAgg, reducer: Reducer
           ) -> tuple[torch.Tensor, dict[str, float]]:
    # The aggregation's denominators are the minibatch's: token-mean divides by all processes' tokens,
    # seq-mean and dr-grpo by all their sequences. A statistic is a mean over tokens (or, the
    # SEQUENCE_STATS, over sequences): each process's weighted by its count.
    n_tok, n_seq = float(mask.sum()), float(mask.shape[0])
    tot_tok, tot_seq = reducer.sum([n_tok, n_seq])
    scale = n_tok / max(tot_tok, 1.0) if agg is LossAgg.TOKEN_MEAN else n_seq / tot_seq
    keys = sorted(st)
    weights = [n_seq if k in SEQUENCE_STATS else n_tok for k in keys]
    sums = reducer.sum([float(loss) * scale, *(st[k] * w for k, w in zip(keys, weights))])
    totals = [tot_seq if k in SEQUENCE_STATS else tot_tok for k in keys]
    stats = {"loss": sums[0], **{k: v / max(t, 1.0) for k, v, t in zip(keys, sums[1:], totals)}}
    return loss * scale, stats


def _trainer(model: PreTrainedModel, arm: Arm, cfg: RLConfig, mb: Minibatch) -> TrainerOutput:
    return steps.trainer_logprobs(model, mb.token_ids, mb.prompt_lens, mb.records, arm, temperature=cfg.temperature)
