"""GRPO's arithmetic as pure functions: advantages, the clipped surrogate with truncated importance
weights against the rollout, and loss aggregation. (The train–rollout mismatch metrics are
:func:`tracefp4.pipeline.metrics.logprob_gap`; the arm's loss choice is
:class:`tracefp4.pipeline.arms.PolicyLoss`.)

Conventions: per-token tensors are ``[B, T]`` over completion tokens, with ``mask`` 1 where a token
was generated (0 for padding after the stop token).

Three policies, decoupled as in AReaL (arXiv 2505.24298): the **behaviour** policy ``pi_rollout`` is
what the rollout engine sampled with and reported (``logp_rollout``: its own numerics, and in the
asynchronous loop its older weights); the **proximal** policy ``pi_old`` is the trainer's forward, with
the weights of the step that consumes the batch, before that step's updates (``logp_old``, no
gradient); ``pi`` is the trainer's current forward (``logp``, with gradient). The PPO ratio
``pi / pi_old`` is clipped against the proximal policy, and the importance weight (:class:`ISMode`) is
proximal / behaviour. In the synchronous loop the weights of the two coincide and the weight corrects
the train-rollout numerics alone; with ``max_staleness = k`` (:mod:`tracefp4.rl.staleness`) it
corrects the k versions of staleness too, and guidance, which can only bring the trainer's numerics
to the rollout's, never moves the proximal weights toward the behaviour ones: it cannot hide
staleness inside the weight.
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


class ISMode(str, enum.Enum):
    """How the train–rollout mismatch is corrected: the detached weight ``w_t`` each generated token's
    loss is multiplied by, from the token ratio ``rho_t = pi_old / pi_rollout`` (``c = is_cap``) or the
    sequence ratio ``R_b = prod_t rho_t`` over the completion (:func:`importance_weights`)."""

    TOKEN_TRUNCATE = "token-truncate"
    """``w_t = min(rho_t, c)``: truncated importance sampling per token (the paper's setup, the default)."""

    OFF = "off"
    """``w_t = 1``: rollout samples treated as on-policy, as a plain GRPO implementation does."""

    TOKEN_MASK = "token-mask"
    """``w_t = rho_t`` if ``1/c <= rho_t <= c`` else ``0``: tokens outside the band dropped (IcePop)."""

    SEQUENCE_TRUNCATE = "sequence-truncate"
    """``w_t = min(R_b, c)`` for every token of sequence ``b``: sequence-level truncated IS."""

    SEQUENCE_MASK = "sequence-mask"
    """``w_t = R_b`` if ``1/c <= R_b <= c`` else ``0``: whole sequences outside the band dropped."""


SEQUENCE_STATS = ("is_seq_truncated_frac", "is_seq_masked_frac")
"""The statistics of :func:`importance_weights` that are shares of sequences (the rest: of tokens)."""


def importance_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                       mode: ISMode | str = ISMode.TOKEN_TRUNCATE, cap: float = 5.0
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached per-token weights ``[B, T]`` of :class:`ISMode` ``mode`` and what they cut: the
    share of generated tokens whose weight was truncated (``is_truncated_frac``) or zeroed
    (``is_masked_frac``), and of sequences with such a token (``is_seq_truncated_frac``,
    ``is_seq_masked_frac``; for the sequence modes, the sequences truncated or dropped).

    The sequence ratio is summed in log space in float64 over the generated tokens only (``mask``), so
    padding never enters it and a 10K-token completion does not overflow before the band is applied."""
    mode = ISMode(mode)
    if cap <= 1.0 and mode in (ISMode.TOKEN_MASK, ISMode.SEQUENCE_MASK):
        raise ValueError(f"importance_weights: is_mode {mode.value!r} keeps ratios in [1/cap, cap]; "
                         f"cap must be > 1, got {cap}")
    m = mask.bool()
    log_rho = (logp_old - logp_rollout).detach()
    truncated = torch.zeros_like(m)
    masked = torch.zeros_like(m)
    if mode is ISMode.TOKEN_TRUNCATE:
        rho = torch.exp(log_rho)
        w = rho.clamp(max=cap)
        truncated = (rho > cap) & m
    elif mode is ISMode.OFF:
        w = torch.ones_like(log_rho)
    elif mode is ISMode.TOKEN_MASK:
        rho = torch.exp(log_rho)
        masked = ((rho < 1.0 / cap) | (rho > cap)) & m
        w = torch.where(masked, torch.zeros_like(rho), rho)
    else:
        log_r = torch.where(m, log_rho.double(), 0.0).sum(dim=1, keepdim=True)  # [B, 1]
        log_c = torch.tensor(cap, dtype=torch.float64).log()
        if mode is ISMode.SEQUENCE_TRUNCATE:
            truncated = (log_r > log_c) & m
            w_seq = torch.exp(log_r.clamp(max=log_c))
        else:
            masked = (log_r.abs() > log_c) & m
            w_seq = torch.where(log_r.abs() > log_c, torch.zeros_like(log_r), torch.exp(log_r))
        w = w_seq.to(log_rho.dtype).expand_as(log_rho)
    n_tok = m.sum().clamp_min(1)
    has = m.any(dim=1)
    n_seq = has.sum().clamp_min(1)
    stats = {
        "is_weight_mean": float(w[m].mean()) if m.any() else 1.0,
        "is_truncated_frac": float(truncated.sum() / n_tok),
        "is_masked_frac": float(masked.sum() / n_tok),
        "is_seq_truncated_frac": float((truncated.any(dim=1) & has).sum() / n_seq),
        "is_seq_masked_frac": float((masked.any(dim=1) & has).sum() / n_seq),
    }
    return w, stats


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
    is_mode: ISMode | str = ISMode.TOKEN_TRUNCATE,
    agg: LossAgg | str = LossAgg.TOKEN_MEAN,
    max_new_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with an importance weight against the rollout (token-level truncated by default).

    ``logp`` is the trainer's current log-prob (with gradient), ``logp_old`` the proximal policy's (the
    trainer's, with the weights that consume the batch, before this step's updates, no gradient),
    ``logp_rollout`` the behaviour policy's, as the rollout engine reported it (the module docstring).
    The PPO ratio is ``pi/pi_old`` (both trainer-side); the mismatch between the proximal and the
    behaviour policy (numerics, and in the asynchronous loop staleness) is corrected by the detached
    weight of ``is_mode`` (:func:`importance_weights`), by default ``w = min(pi_old/pi_rollout, is_cap)``
    (truncated importance sampling), as in the paper's setup.
    """
    ratio = torch.exp(logp - logp_old)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    w, is_stats = importance_weights(logp_old, logp_rollout, mask, is_mode, is_cap)
    loss = aggregate(-w * surrogate, mask, agg, max_new_tokens)
    m = mask.bool()
    with torch.no_grad():
        stats = {"clip_frac": float(((unclipped != clipped) & m).float().sum() / m.sum().clamp_min(1)), **is_stats}
    return loss, stats
