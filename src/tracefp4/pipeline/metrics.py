"""The metrics vocabulary: every train-rollout mismatch metric by one name, what it measures, its
formula, the other spellings it goes by, and the summary functions that compute it.

A metric's ``name`` is the key the RL loop writes to ``metrics/<arm>.jsonl`` (the records: they do not
change). The reports, the experiment summary and the TRL integration spell some of them otherwise
(``aliases``: where -> spelling); each of those spellings maps onto the registry's name through
:func:`canonical`. The TRL integration logs a metric as ``trace/`` + its TRL alias (:data:`TRL_PREFIX`).

Notation: over the completion tokens t of a step's trajectories, d_t = logp_rollout(t) - logp_train(t);
a "site" is one quantized tensor of one layer (``docs/contracts.md`` section 5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tracefp4.engines.trainer import SiteMismatch
from tracefp4.guidance.store import parse_name

__all__ = [
    "Metric", "METRICS", "Name", "TRL_PREFIX", "alias", "canonical", "trl_name", "metric", "label", "share",
    "mismatch_summary", "mismatch_by", "at_sites", "gap_quantile", "logprob_gap", "router_flip_rate",
    "guidance_bytes_per_token", "reference_markdown",
]  # fmt: skip

#: The prefix the TRL integration puts before its metric names in TRL's logs.
TRL_PREFIX = "trace/"


class Name:
    """The registry's record names, for the code that writes or reads a metric: a name is spelled here
    once (a literal one elsewhere fails ``tests/test_metrics.py``)."""

    GAP_MEAN = "train_rollout_logprob_abs_diff"
    GAP_MAX = "train_rollout_logprob_abs_diff_max"
    KL = "rollout_corr/kl"
    K3_KL = "rollout_corr/k3_kl"
    LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
    CODE_MISMATCH = "code_mismatch_rate"
    ONE_APART = "code_mismatch_one_apart_share"
    ROUTER_FLIPS = "router_flip_rate"
    GUIDANCE_BYTES = "guidance_bytes_per_token"
    DECODE_FAILURES = "guidance/decode_failures"
    LAG_MEAN = "staleness/lag_mean"
    LAG_MAX = "staleness/lag_max"
    LAG_GUIDED = "guidance/lag_guided_tokens"
    LAG_FALLBACK = "guidance/lag_fallback_tokens"


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric: its record name, a column label, one line of what it measures, its formula, and its
    other spellings (where -> name)."""

    name: str
    label: str
    measures: str
    formula: str
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _m(name: str, label: str, measures: str, formula: str, **aliases: str) -> tuple[str, Metric]:
    return name, Metric(name, label, measures, formula, aliases)


#: The registry, keyed by record name. Aliases: ``reports`` (the mismatch, scaling and sweep reports'
#: JSON keys: :func:`tracefp4.pipeline.measure.gap`), ``sweep`` (the sweep's rows), ``experiment`` (the
#: multi-seed summary), ``trl`` (logged as ``trace/<alias>``), ``loop`` (the progress line).
METRICS: dict[str, Metric] = dict([
    _m(Name.GAP_MEAN, "mean |Δlogp|",
       "mean log-prob gap between the trainer and the rollout over the completion tokens",
       "mean_t |d_t|", reports="mean_abs", sweep="logprob_gap_mean_abs", experiment="logprob_gap_mean",
       trl="logprob_gap_mean", loop="dlogp"),
    _m(Name.GAP_MAX, "max |Δlogp|",
       "largest log-prob gap of one completion token (QUADS's metric)",
       "max_t |d_t|", reports="max_abs", sweep="logprob_gap_max_abs", experiment="logprob_gap_max",
       trl="logprob_gap_max"),
    _m(Name.KL, "KL", "the rollout-vs-trainer KL estimate (as verl logs it)",
       "mean_t d_t", reports="kl"),
    _m(Name.K3_KL, "k3 KL", "the k3 (non-negative, low-variance) KL estimate",
       "mean_t (r_t - log r_t - 1), r_t = exp(-d_t)", reports="k3_kl", sweep="k3_kl"),
    _m(Name.LOG_PPL_DIFF, "log-ppl diff", "log-perplexity under the rollout minus under the trainer",
       "mean over sequences of (mean_t -logp_rollout - mean_t -logp_train)", reports="log_ppl_diff"),
    _m(Name.CODE_MISMATCH, "code mismatch",
       "share of the trainer's quantized codes (diagnostics sites) that differ from the rollout's",
       "sum_sites mismatched / sum_sites codes (signed code line: +0 and -0 are one code)",
       reports="code_mismatch", experiment="code_mismatch", trl="code_mismatch"),
    _m(Name.ONE_APART, "one apart",
       "share of the mismatched codes exactly one codeword apart (what a 1-bit hint can correct)",
       "sum_sites one_apart / sum_sites mismatched", reports="adjacent_share", trl="code_mismatch_one_apart"),
    _m(Name.ROUTER_FLIPS, "router flips",
       "share of (token, MoE layer) pairs whose top-k expert set differs between the rollout and a trainer "
       "following its own router", "mean over MoE layers of flipped pairs / pairs", trl="router_flip_rate"),
    _m(Name.GUIDANCE_BYTES, "guidance B/token",
       "bytes of guidance (routing excluded) that reached the store per generated token",
       "sum of guidance tensor bytes / generated tokens", experiment="guidance_bytes_per_token",
       trl="guidance_bytes_per_token"),
    _m(Name.DECODE_FAILURES, "decode failures",
       "guidance blocks the trainer could not decode (rounded to nearest on the rollout's grid instead)",
       "count of failed blocks", reports="decode_failures", trl="decode_failures"),
    # the asynchronous loop's (tracefp4.rl.staleness; logged only when max_staleness > 0)
    _m(Name.LAG_MEAN, "mean lag",
       "policy versions between the weights a step trains (before its update) and those that generated "
       "its samples, averaged over the step's samples", "mean_b (v_train - v_rollout(b))"),
    _m(Name.LAG_MAX, "max lag", "the largest lag of one of the step's samples", "max_b (v_train - v_rollout(b))"),
    _m(Name.LAG_GUIDED, "lag-guided tokens",
       "generated tokens the trainer read guidance for, their lag at most guidance_max_lag (guided arms)",
       "count of tokens"),
    _m(Name.LAG_FALLBACK, "lag-fallback tokens",
       "generated tokens of a guided arm whose lag exceeds guidance_max_lag: rounded to nearest instead",
       "count of tokens"),
])

_BY_ALIAS = {a: m.name for m in METRICS.values() for a in m.aliases.values()}


def canonical(name: str) -> str:
    """The registry name of ``name``: a record name, an alias, or a TRL name (``trace/...``); a
    KeyError names the unknown metric."""
    bare = name.removeprefix(TRL_PREFIX)
    if bare in METRICS:
        return bare
    if bare in _BY_ALIAS:
        return _BY_ALIAS[bare]
    raise KeyError(f"unknown metric {name!r}; the registry: {', '.join(METRICS)}")


def trl_name(name: str) -> str:
    """The name the TRL integration logs metric ``name`` under: ``trace/`` + its TRL alias."""
    return TRL_PREFIX + alias(name, "trl")


def alias(name: str, where: str) -> str:
    """How output ``where`` (a key of :attr:`Metric.aliases`) spells metric ``name``; its record name
    where that output has no spelling of its own."""
    return metric(name).aliases.get(where, metric(name).name)


def metric(name: str) -> Metric:
    """The registry entry of ``name`` (any spelling :func:`canonical` accepts)."""
    return METRICS[canonical(name)]


def label(name: str) -> str:
    """The column label of metric ``name``."""
    return metric(name).label


# --- summary functions ---------------------------------------------------------------------------


def share(num: float, den: float, empty: float | None = None) -> float | None:
    """``num / den``; ``empty`` for an empty denominator (the reports: None, a JSON ``null``; the loop
    keeps its records' values: 0.0 for the mismatch rate, 1.0 for the one-apart share)."""
    return num / den if den else empty


def mismatch_summary(counts: Iterable[SiteMismatch], *, empty_rate: float | None = None,
                     empty_share: float | None = None) -> dict[str, Any]:
    """The code-mismatch summary of ``counts``, every output's one way to count it: the counts of one
    grouping of :func:`~tracefp4.engines.trainer.code_mismatch` (sites, layers or positions, or a
    selection of them: :func:`at_sites`) summed into ``mismatched``, ``one_apart`` and ``total``, and
    ``code_mismatch_rate`` (mismatched / total) and ``code_mismatch_one_apart_share`` (one apart /
    mismatched) over the sums. An empty denominator gives ``empty_rate`` / ``empty_share`` (the reports:
    None, a JSON ``null``; the loop keeps its records' values: 0.0 and 1.0)."""
    mis = one = tot = 0
    for c in counts:
        mis, one, tot = mis + c.mismatched, one + c.one_apart, tot + c.total
    return {
        "mismatched": mis,
        "one_apart": one,
        "total": tot,
        Name.CODE_MISMATCH: share(mis, tot, empty_rate),
        Name.ONE_APART: share(one, mis, empty_share),
    }


def mismatch_by(groups: Mapping[str, SiteMismatch]) -> dict[str, dict[str, Any]]:
    """:func:`mismatch_summary` of each group (a site, a layer or a position key) on its own."""
    return {key: mismatch_summary([c]) for key, c in groups.items()}


def at_sites(counts: Mapping[str, SiteMismatch], keep: Callable[[int, str], bool]) -> list[SiteMismatch]:
    """The counts of the sites (``code_mismatch``'s default grouping: ``L07.k`` -> counts) whose
    (layer, site) ``keep`` selects."""
    return [c for name, c in counts.items() if keep(*parse_name(name + ".codes")[:2])]


def gap_quantile(q: float) -> str:
    """The key :func:`logprob_gap` gives the ``q``-quantile of |delta logp| (``..._abs_diff_p99``: 0.99)."""
    return f"{Name.GAP_MEAN}_p{100 * q:g}"


def logprob_gap(logp_rollout: torch.Tensor, logp_train: torch.Tensor, mask: torch.Tensor,
                quantiles: Sequence[float] = ()) -> dict[str, float]:
    """The five log-prob gap metrics over the generated tokens of ``mask`` (names as verl logs them),
    and the ``quantiles`` of |delta logp| (:func:`gap_quantile` names them).

    ``rollout_corr/kl`` = mean(logp_rollout - logp_train); ``rollout_corr/k3_kl`` = mean(r - log r - 1)
    with r = pi_train/pi_rollout; ``rollout_corr/log_ppl_diff`` = mean over sequences of
    (log-perplexity under the rollout - under the trainer); ``train_rollout_logprob_abs_diff[_max]``:
    mean and max |delta logp|. Computed in float64 so that a small gap is not lost to rounding.
    """
    m = mask.bool()
    if not m.any():
        raise ValueError("logprob_gap: the mask selects no tokens")
    lr, lt = logp_rollout.detach().double(), logp_train.detach().double()
    d = (lr - lt)[m]
    log_r = (lt - lr)[m]
    k3 = torch.exp(log_r) - log_r - 1
    n = mask.sum(1).clamp_min(1).double()
    ppl_r = -(lr * mask).sum(1) / n
    ppl_t = -(lt * mask).sum(1) / n
    return {
        Name.KL: float(d.mean()),
        Name.K3_KL: float(k3.mean()),
        Name.LOG_PPL_DIFF: float((ppl_r - ppl_t)[mask.sum(1) > 0].mean()),
        Name.GAP_MEAN: float(d.abs().mean()),
        Name.GAP_MAX: float(d.abs().max()),
        **{gap_quantile(q): float(torch.quantile(d.abs(), q)) for q in quantiles},
    }


def router_flip_rate(flips: Mapping[object, float]) -> float:
    """``router_flip_rate``: the mean of the per-layer flip shares (0.0 with no MoE layer)."""
    return sum(flips.values()) / max(len(flips), 1)


def guidance_bytes_per_token(guidance_bytes: int, generated: int) -> float:
    """``guidance_bytes_per_token``: guidance bytes / generated tokens (at least one token)."""
    return guidance_bytes / max(generated, 1)


def reference_markdown() -> str:
    """The registry as a markdown reference page (one table: name, what it measures, formula, aliases)."""
    lines = [
        "# Metrics", "",
        "Generated from `tracefp4.pipeline.metrics.METRICS`. The name is the RL loop's record key "
        f"(`metrics/<arm>.jsonl`); the TRL integration logs its alias with the `{TRL_PREFIX}` prefix.", "",
        "| name | measures | formula | also called |", "|---|---|---|---|",
    ]  # fmt: skip
    for m in METRICS.values():
        also = ", ".join(f"`{a}` ({where})" for where, a in m.aliases.items()) or "-"
        # a bare | would end the table cell, also inside backticks (GitHub's tables)
        lines.append(f"| `{m.name}` | {m.measures} | `{m.formula.replace('|', chr(92) + '|')}` | {also} |")
    return "\n".join(lines) + "\n"
