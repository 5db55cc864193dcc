"""GRPO's arithmetic as pure functions: advantages, the clipped surrogate with truncated importance
weights against the rollout, loss aggregation, and the train–rollout mismatch metrics (verl's names).

Conventions: per-token tensors are ``[B, T]`` over completion tokens, with ``mask`` 1 where a token
was generated (0 for padding after the stop token).
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch


class LossAgg(str, enum.Enum):
    """How per-token losses become one scalar."""

    TOKEN_MEAN = "token-mean"
    """sum over all tokens / number of tokens in the batch (DAPO)."""

    SEQ_MEAN = "seq-mean"
    """mean over sequences of each sequence's token mean (original GRPO)."""

    DR_GRPO = "dr-grpo"
    """sum over all tokens / (B * max_new_tokens): no length normalisation bias (Dr. GRPO)."""


class PolicyLoss(str, enum.Enum):
    """The policy-gradient loss an arm's trainer minimises, per generated token t of trajectory b
    (advantage ``A_b``; ``w_t = min(pi_old / pi_rollout, cap)``, detached)."""

    GRPO = "grpo"
    """``-w_t * min(r_t A_b, clip(r_t, 1 - clip_low, 1 + clip_high) A_b)`` with ``r_t = pi / pi_old`` and
    ``cap = is_cap`` (:func:`grpo_loss`)."""

    SCORE_CENTERING = "score-centering"
    """Score Centering (arXiv 2609.20807): REINFORCE with the sampler-expected score subtracted,
    ``-w_t * A_b * (log p(y_t) - c_t)`` with ``c_t = sum_{v in K_t} q_v log p_v + (1 - Q_t) log(1 - P_t)``
    over the sampler's top-k tokens ``K_t`` (``q`` the sampler's probabilities, ``Q_t``/``P_t`` the
    sampler's and the trainer's mass on ``K_t``, the tail outside ``K_t`` modelled as ``p`` rescaled to
    the sampler's tail mass), no ratio clip, ``cap = sc_is_cap`` (default 2)
    (:func:`tracefp4.rl.score_centering.score_centering_loss`). The gradient of ``c_t`` is
    ``E_q[grad log p]`` (exactly so when ``q`` is ``p`` on the tail), the drift term of a mismatched
    sampler, which the centering removes; only ``Cov_q(A, grad log p)`` is left."""


def pad_right(values: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence 1-d tensors as float32 ``[B, width]``, zero-padded on the right, and the bool mask
    of real entries."""
    out = torch.zeros(len(values), width)
    mask = torch.zeros(len(values), width, dtype=torch.bool)
    for b, v in enumerate(values):
        out[b, : v.numel()] = v
        mask[b, : v.numel()] = True
    return out, mask


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6):
    """Group-relative advantages: reward minus its group's mean, divided by the group's std if asked.

    ``rewards`` is ``[B]`` with consecutive groups of ``group_size`` samples of the same prompt.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards: expected [B] with B a multiple of group_size={group_size}, got {tuple(rewards.shape)}")
    g = rewards.float().reshape(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.reshape(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg | str, max_new_tokens: int | None = None):
    agg = LossAgg(agg)
    mask = mask.to(per_token.dtype)
    if agg is LossAgg.TOKEN_MEAN:
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if agg is LossAgg.SEQ_MEAN:
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    denom = per_token.shape[0] * (max_new_tokens or per_token.shape[1])
    return (per_token * mask).sum() / denom


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float = 5.0,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with a token-level truncated importance weight against the rollout.

    ``logp`` is the trainer's current log-prob (with gradient), ``logp_old`` the trainer's log-prob of
    the policy that generated the batch (before this step's updates, no gradient), ``logp_rollout``
    what the rollout engine reported. The PPO ratio is ``pi/pi_old`` (both trainer-side); the
    train–rollout mismatch is corrected by ``w = min(pi_old/pi_rollout, is_cap)`` (truncated importance
    sampling, detached), as in the paper's setup.
    """
    ratio = torch.exp(logp - logp_old)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    w = torch.exp(logp_old - logp_rollout).clamp(max=is_cap).detach()
    loss = aggregate(-w * surrogate, mask, agg, max_new_tokens)
    m = mask.bool()
    with torch.no_grad():
        stats = {
            "clip_frac": float(((unclipped != clipped) & m).float().sum() / m.sum().clamp_min(1)),
            "is_weight_mean": float(w[m].mean()) if m.any() else 1.0,
            "is_truncated_frac": float((torch.exp(logp_old - logp_rollout)[m] > is_cap).float().mean()) if m.any() else 0.0,
        }
    return loss, stats


def mismatch_metrics(logp_rollout: torch.Tensor, logp_train: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Train–rollout mismatch over generated tokens (names as verl logs them).

    ``rollout_corr/kl`` = mean(logp_rollout - logp_train); ``rollout_corr/k3_kl`` = mean(r - log r - 1)
    with r = pi_train/pi_rollout; ``rollout_corr/log_ppl_diff`` = mean over sequences of
    (log-perplexity under the rollout - under the trainer); plus max and mean |delta logp|.
    """
    m = mask.bool()
    if not m.any():
        raise ValueError("mismatch_metrics: the mask selects no tokens")
    lr, lt = logp_rollout.detach().double(), logp_train.detach().double()
    d = (lr - lt)[m]
    log_r = (lt - lr)[m]
    k3 = torch.exp(log_r) - log_r - 1
    n = mask.sum(1).clamp_min(1).double()
    ppl_r = -(lr * mask).sum(1) / n
    ppl_t = -(lt * mask).sum(1) / n
    return {
        "rollout_corr/kl": float(d.mean()),
        "rollout_corr/k3_kl": float(k3.mean()),
        "rollout_corr/log_ppl_diff": float((ppl_r - ppl_t)[mask.sum(1) > 0].mean()),
        "train_rollout_logprob_abs_diff": float(d.abs().mean()),
        "train_rollout_logprob_abs_diff_max": float(d.abs().max()),
    }
