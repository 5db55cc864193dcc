"""Score Centering (Marek and Ryabinin, arXiv 2609.20807): the policy gradient without the drift a
mismatched sampler adds, from the sampler's top-k log-probs. Pure functions, like :mod:`tracefp4.rl.grpo`.

Under a train-rollout mismatch the expected policy gradient at a prefix, sampled from the rollout's
``q`` rather than the trainer's ``p``, splits into ``E_q[A] E_q[grad log p]`` (a drift: with
``q != p`` the expected score is not zero, and it pulls ``p`` toward ``q``) plus
``Cov_q(A, grad log p)``. Score Centering subtracts the sampler-expected score from each sampled
token's score, ``sum_v q_v grad log p_v``, evaluated over the sampler's top-k tokens ``K`` (which the
rollout engine returns, ``SamplingParams.top_logprobs``) with the tail outside ``K`` modelled as ``p``
rescaled to the sampler's tail mass ``1 - Q``:
``sum_{v not in K} (1 - Q) p_v / (1 - P) grad log p_v = (1 - Q) grad log(1 - P)``.
The formula is :attr:`tracefp4.rl.grpo.PolicyLoss.SCORE_CENTERING`; the reference loss drops PPO's
ratio clip (REINFORCE times the advantage plus the additive correction) and weights each token by
the truncated ``min(p / q, 2)`` (``p``: the trainer's policy before the step's updates).

Decisions: ``k`` is the run's ``sc_top_k`` (the paper's 128) or the vocabulary if smaller; when
``K`` covers the vocabulary there is no tail term. The head mass ``Q`` (the share of the sampler's
probability inside its top-k) is logged per step (``sc/head_mass_mean``, ``sc/head_mass_min``): the
tail model matters only where it is well below 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tracefp4.rl.grpo import ISMode, LossAgg, aggregate, importance_weights

__all__ = ["top_k_for", "pad_top", "trainer_scores", "score_centering_loss", "head_mass_metrics"]


def top_k_for(configured: int, vocab: int) -> int:
    """The sampler top-k Score Centering asks the engine for: the configured k, at most the vocabulary."""
    if configured < 1:
        raise ValueError(f"sc_top_k must be >= 1, got {configured}")
    return min(configured, vocab)


def pad_top(values: Sequence[torch.Tensor], width: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-trajectory ``[C_b, k]`` tensors as ``[B, width, k]``, zero-padded after each completion."""
    out = torch.zeros(len(values), width, k, dtype=dtype)
    for b, v in enumerate(values):
        if v.shape[-1] != k:
            raise ValueError(f"trajectory {b}: {v.shape[-1]} sampler top log-probs per token, expected {k}")
        out[b, : v.shape[0]] = v.to(dtype)
    return out


def trainer_scores(rows: Sequence[torch.Tensor], top_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs at the sampler's top-k tokens ``[B, T, k]`` and of the tail outside them
    ``log(1 - P)`` ``[B, T]`` (0 where the top-k covers the vocabulary), both differentiable, from its
    whole log-prob rows ``rows[b] [C_b, V]`` (:attr:`~tracefp4.engines.trainer.TrainerOutput.logprob_rows`)
    and the padded top-k ids ``[B, T, k]``; zero after each completion."""
    b_n, width, k = top_ids.shape
    if len(rows) != b_n:
        raise ValueError(f"{len(rows)} trajectories of log-prob rows for {b_n} of top-k ids")
    top, tail = [], []
    for b, r in enumerate(rows):
        c, vocab = r.shape
        ids = top_ids[b, :c].to(device=r.device, dtype=torch.long)
        top.append(F.pad(r.gather(-1, ids), (0, 0, 0, width - c)))
        if k < vocab:
            rest = torch.logsumexp(r.scatter(-1, ids, float("-inf")), dim=-1)
        else:
            rest = r.new_zeros(c)
        tail.append(F.pad(rest, (0, width - c)))
    return torch.stack(top), torch.stack(tail)


def score_centering_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    top_logp: torch.Tensor,
    tail_logp: torch.Tensor,
    top_logp_rollout: torch.Tensor,
    *,
    is_cap: float = 2.0,
    is_mode: ISMode | str = ISMode.TOKEN_TRUNCATE,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The Score Centering loss (:attr:`tracefp4.rl.grpo.PolicyLoss.SCORE_CENTERING`).

    ``logp`` ``[B, T]``: the trainer's current log-probs of the sampled tokens (with gradient);
    ``logp_old``/``logp_rollout``: the trainer's before this step's updates and the rollout's;
    ``top_logp``/``tail_logp`` (:func:`trainer_scores`, with gradient) and ``top_logp_rollout``
    ``[B, T, k]``: the trainer's and the sampler's log-probs at the sampler's top-k tokens.
    """
    w, is_stats = importance_weights(logp_old, logp_rollout, mask, is_mode, is_cap)
    q = torch.exp(top_logp_rollout.detach().to(torch.float32))
    head = q.sum(dim=-1)
    # the sampler's tail mass (float rounding can make the head sum exceed 1); where the top-k is the
    # whole vocabulary ``tail_logp`` is 0 (trainer_scores), so there is no tail term
    tail_mass = (1.0 - head).clamp(min=0.0)
    centering = (q * top_logp).sum(dim=-1) + tail_mass * tail_logp
    per_token = -w * advantages.unsqueeze(1) * (logp - centering)
    loss = aggregate(per_token, mask, agg, max_new_tokens)
    m = mask.bool()
    with torch.no_grad():
        stats = {
            **is_stats,
            "sc/centering_abs_mean": float((logp - centering).detach()[m].abs().mean()) if m.any() else 0.0,
        }
    return loss, stats


def head_mass_metrics(top_logp_rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The sampler's probability mass inside its top-k over the generated tokens: mean and minimum."""
    m = mask.bool()
    if not m.any():
        raise ValueError("head_mass_metrics: the mask selects no tokens")
    head = torch.exp(top_logp_rollout.double()).sum(dim=-1)[m].clamp(max=1.0)
    return {"sc/head_mass_mean": float(head.mean()), "sc/head_mass_min": float(head.min())}
