"""The policy update: the arm's loss over a collected batch, in minibatches.

One pass over a fixed permutation of the batch, ``updates_per_step`` minibatches, one optimizer step
each. The GRPO loss (every arm but the Score Centering ones): the PPO ratio is trainer-to-trainer
(``pi / pi_old``); the train-rollout mismatch is corrected by a token-level importance weight
``pi_old / pi_rollout`` truncated at ``is_cap``. Score Centering's loss is in
:mod:`tracefp4.rl.score_centering` (:class:`~tracefp4.rl.grpo.PolicyLoss` states both).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from tracefp4.engines.trainer import TrainerOutput
from tracefp4.rl import engine
from tracefp4.rl.arms import Arm
from tracefp4.rl.collect import Batch
from tracefp4.rl.config import RLConfig
from tracefp4.rl.grpo import PolicyLoss, grpo_loss, pad_right
from tracefp4.rl.score_centering import score_centering_loss, trainer_scores
from tracefp4.rl.optim import MasterWeightAdamW


def update(model: PreTrainedModel, opt: MasterWeightAdamW, arm: Arm, cfg: RLConfig, batch: Batch) -> dict[str, float]:
    """Apply the step's updates to ``model``; return the mean loss statistics and gradient norm."""
    order = torch.randperm(len(batch.token_ids), generator=torch.Generator().manual_seed(cfg.seed + batch.step))
    stats: dict[str, float] = {}
    norms = []
    model.train()
    for mb in order.chunk(cfg.updates_per_step):
        idx = mb.tolist()
        loss, st = minibatch_loss(model, arm, cfg, batch, idx)
        loss.backward()
        norms.append(opt.step())
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v / cfg.updates_per_step
    model.eval()
    return {"grad_norm": sum(norms) / len(norms), **stats}


def minibatch_loss(model: PreTrainedModel, arm: Arm, cfg: RLConfig, batch: Batch, idx: list[int]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The arm's loss (:class:`~tracefp4.rl.grpo.PolicyLoss`) over trajectories ``idx``, with gradient,
    and its statistics."""
    new = _trainer(model, arm, cfg, batch, idx)
    logp_new, mask = pad_right(new.logprobs, batch.width)
    common = (logp_new, batch.logp_old[idx], batch.logp_rollout[idx], batch.advantages[idx], mask)
    if arm.loss is PolicyLoss.SCORE_CENTERING:
        if batch.top_ids is None:
            raise ValueError(f"arm {arm.name!r}: Score Centering needs the sampler's top-k log-probs in the batch")
        top, tail = trainer_scores(new.logprob_rows, batch.top_ids[idx])
        return score_centering_loss(*common, top, tail, batch.top_logp_rollout[idx], is_cap=cfg.sc_is_cap,
                                    agg=cfg.loss_agg, max_new_tokens=cfg.max_new_tokens)
    return grpo_loss(*common, clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, agg=cfg.loss_agg,
                     max_new_tokens=cfg.max_new_tokens)


def minibatch_logprobs(model: PreTrainedModel, arm: Arm, cfg: RLConfig, batch: Batch, idx: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The current policy's log-probs (with gradient) of trajectories ``idx``, padded to the batch's
    width, and their mask."""
    return pad_right(_trainer(model, arm, cfg, batch, idx).logprobs, batch.width)


def _trainer(model: PreTrainedModel, arm: Arm, cfg: RLConfig, batch: Batch, idx: list[int]) -> TrainerOutput:
    return engine.trainer_logprobs(
        model, [batch.token_ids[b] for b in idx], [batch.prompt_lens[b] for b in idx],
        [batch.records[b] for b in idx], arm, temperature=cfg.temperature,
    )
