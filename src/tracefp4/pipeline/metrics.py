"""The metrics vocabulary: every train-rollout mismatch metric by one name, what it measures, its
formula, and the summary functions that compute it.

A metric's ``name`` is its key in every output: the RL loop's ``metrics/<arm>.jsonl``, the mismatch,
sweep and scaling reports' JSON, the experiment and TRL-study summaries. It has no other spelling; the
TRL integration only puts :data:`TRL_PREFIX` before it (:func:`trl_name`), since TRL's logs mix in its
own metrics. A name is written in :class:`Name` once: the code that writes or reads a metric spells it
``Name.X`` (a literal elsewhere fails ``tests/test_metrics.py``).

Notation: over the completion tokens t of a step's trajectories, d_t = logp_rollout(t) - logp_train(t);
a "site" is one quantized tensor of one layer (``docs/contracts.md`` section 5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tracefp4.engines.trainer import SiteMismatch
from tracefp4.formats import reference as ref
from tracefp4.formats.constants import Format
from tracefp4.formats.packing import unpack_fp4
from tracefp4.guidance.hints import record_format
from tracefp4.guidance.store import parse_name

__all__ = [
    "Metric", "METRICS", "Name", "TRL_PREFIX", "trl_name", "metric", "label", "share",
    "mismatch_summary", "mismatch_by", "at_sites", "gap_quantile", "logprob_gap", "sequence_gap", "router_flip_rate",
    "guidance_bytes_per_token", "BracketMiss", "bracket_distances", "bracket_miss", "bracket_miss_summary",
    "reference_markdown",
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
    BRACKET_MISS = "guidance_bracket_miss_rate"
    SEQ_GAP_SUM = "seq_logprob_abs_diff_sum"
    SEQ_GAP_SUM_P95 = "seq_logprob_abs_diff_sum_p95"
    SEQ_LOG_RATIO = "seq_log_ratio_abs"
    SEQ_LOG_RATIO_P95 = "seq_log_ratio_abs_p95"


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric: its name, a column label, one line of what it measures, and its formula."""

    name: str
    label: str
    measures: str
    formula: str


def _m(name: str, label: str, measures: str, formula: str) -> tuple[str, Metric]:
    return name, Metric(name, label, measures, formula)


#: The registry, keyed by name, in the order of the reference page.
METRICS: dict[str, Metric] = dict([
    _m(Name.GAP_MEAN, "mean |Δlogp|",
       "mean log-prob gap between the trainer and the rollout over the completion tokens",
       "mean_t |d_t|"),
    _m(Name.GAP_MAX, "max |Δlogp|",
       "largest log-prob gap of one completion token (QUADS's metric)",
       "max_t |d_t|"),
    _m(Name.KL, "KL", "the rollout-vs-trainer KL estimate (as verl logs it)",
       "mean_t d_t"),
    _m(Name.K3_KL, "k3 KL", "the k3 (non-negative, low-variance) KL estimate",
       "mean_t (r_t - log r_t - 1), r_t = exp(-d_t)"),
    _m(Name.LOG_PPL_DIFF, "log-ppl diff", "log-perplexity under the rollout minus under the trainer",
       "mean over sequences of (mean_t -logp_rollout - mean_t -logp_train)"),
    _m(Name.CODE_MISMATCH, "code mismatch",
       "share of the trainer's quantized codes (diagnostics sites) that differ from the rollout's",
       "sum_sites mismatched / sum_sites codes (signed code line: +0 and -0 are one code)"),
    _m(Name.ONE_APART, "one apart",
       "share of the mismatched codes exactly one codeword apart (what a 1-bit hint can correct)",
       "sum_sites one_apart / sum_sites mismatched"),
    _m(Name.ROUTER_FLIPS, "router flips",
       "share of (token, MoE layer) pairs whose top-k expert set differs between the rollout and a trainer "
       "following its own router", "mean over MoE layers of flipped pairs / pairs"),
    _m(Name.GUIDANCE_BYTES, "guidance B/token",
       "bytes of guidance (routing excluded) that reached the store per generated token",
       "sum of guidance tensor bytes / generated tokens"),
    _m(Name.DECODE_FAILURES, "decode failures",
       "guidance blocks the trainer could not decode (rounded to nearest on the rollout's grid instead)",
       "count of failed blocks"),
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
    _m(Name.BRACKET_MISS, "bracket miss",
       "share of elements (diagnostics sites) whose rollout code is neither codeword bracketing the trainer's "
       "value on the rollout's grid: where no guidance can land on the rollout's code",
       "sum_sites (bracket_distance > 0) / sum_sites elements (formats.reference.bracket_distance)"),
    # Per sequence: what decides a collapse is the gap summed over a sequence (sequence-level correction
    # masks on exp(sum_t d_t); token-level correction's bias grows with T), not its per-token mean.
    _m(Name.SEQ_GAP_SUM, "seq. Σ|Δlogp|",
       "log-prob gap summed over one completion, mean over the step's sequences", "mean_b sum_t |d_t|"),
    _m(Name.SEQ_GAP_SUM_P95, "seq. Σ|Δlogp| p95",
       "95th percentile over the step's sequences of the log-prob gap summed over one completion",
       "p95_b sum_t |d_t|"),
    _m(Name.SEQ_LOG_RATIO, "|seq. log-ratio|",
       "magnitude of the sequence log-ratio log(pi_rollout / pi_train) of one completion (what a sequence-level "
       "importance weight exponentiates), mean over the step's sequences (the scaling report's seq_abs_mean)",
       "mean_b |sum_t d_t|"),
    _m(Name.SEQ_LOG_RATIO_P95, "|seq. log-ratio| p95",
       "95th percentile over the step's sequences of the sequence log-ratio's magnitude", "p95_b |sum_t d_t|"),
])


def metric(name: str) -> Metric:
    """The registry entry of ``name``; a KeyError names the unknown metric and lists the registry."""
    try:
        return METRICS[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; the registry: {', '.join(METRICS)}") from None


def trl_name(name: str) -> str:
    """The name the TRL integration logs metric ``name`` under: ``trace/`` + its name."""
    return TRL_PREFIX + metric(name).name


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


def at_sites(counts: Mapping[str, Any], keep: Callable[[int, str], bool]) -> list[Any]:
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


def sequence_gap(logp_rollout: torch.Tensor, logp_train: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The per-sequence gap metrics over the ``[B, T]`` completion tokens of ``mask``: per sequence b,
    ``sum_t |d_t|`` and ``|sum_t d_t|`` (d = logp_rollout - logp_train), each summarised over the B
    sequences by its mean and its 95th percentile (linear interpolation between order statistics, as
    ``torch.quantile``). The log-ratio is reported by its magnitude: a sequence weight exp(-sum_t d_t)
    leaves [1/c, c] when ``|sum_t d_t| > log c``, whichever its sign (the scaling report's
    ``seq_abs_mean``). In float64; a sequence with no token counts 0 in both."""
    m = mask.bool()
    if not m.any():
        raise ValueError("sequence_gap: the mask selects no tokens")
    d = (logp_rollout.detach().double() - logp_train.detach().double()) * m
    gap_sum, log_ratio = d.abs().sum(1), d.sum(1).abs()
    return {
        Name.SEQ_GAP_SUM: float(gap_sum.mean()),
        Name.SEQ_GAP_SUM_P95: float(torch.quantile(gap_sum, 0.95)),
        Name.SEQ_LOG_RATIO: float(log_ratio.mean()),
        Name.SEQ_LOG_RATIO_P95: float(torch.quantile(log_ratio, 0.95)),
    }


def router_flip_rate(flips: Mapping[object, float]) -> float:
    """``router_flip_rate``: the mean of the per-layer flip shares (0.0 with no MoE layer)."""
    return sum(flips.values()) / max(len(flips), 1)


def guidance_bytes_per_token(guidance_bytes: int, generated: int) -> float:
    """``guidance_bytes_per_token``: guidance bytes / generated tokens (at least one token)."""
    return guidance_bytes / max(generated, 1)


# --- bracket misses ------------------------------------------------------------------------------
# Guidance can only pick between the two codewords around the trainer's own value on the rollout's grid
# (its bracket; one codeword where the value sits on it). Where the rollout's code is neither, every
# guidance mode is wrong at that element: ``lsb`` silently (it names a bracket member), ``mod4``
# detectably up to two codewords out, ``full`` too (it takes the nearer member). The bracket is the
# one every guided trainer uses, the rollout's grid, also for a QAT arm whose own grid differs: its
# bracket-miss rate says where guidance would not have helped it.


@dataclasses.dataclass
class BracketMiss:
    """Elements of one site whose rollout code lies outside the trainer's bracket, by distance."""

    misses: int  # codewords outside: >= 1
    one_out: int  # exactly one codeword outside (the misses an adjacent-code hint would have named)
    total: int

    def add(self, distance: torch.Tensor) -> None:
        self.misses += int((distance > 0).sum())
        self.one_out += int((distance == 1).sum())
        self.total += distance.numel()


def bracket_distances(values: torch.Tensor, record: Mapping[str, torch.Tensor], prefix: str, what: str = ""
                      ) -> torch.Tensor:
    """How many codewords the full codes of ``record`` (``{prefix}.codes``, ``.scales``, ``.global_amax``:
    a rollout's diagnostics) lie outside the bracket of ``values`` (the trainer's, ``[n, ..., K]``)
    on the record's own grid, per element: :func:`tracefp4.formats.reference.bracket_distance` of the
    reference's z (``nvfp4_z``, ``mxfp4_z``, ``fp8_z``). ``what`` names the record in errors."""
    where = f"{what}{prefix}"
    for fld in ("codes", "scales"):
        if f"{prefix}.{fld}" not in record:
            raise ValueError(f"{where}: the rollout kept no full {fld} (run it with this layer in diagnostics)")
    fmt = record_format(record[f"{prefix}.scales"], where)
    codes, scales = record[f"{prefix}.codes"].cpu(), record[f"{prefix}.scales"].cpu()
    x = values.detach().cpu()
    if fmt.fp4:
        codes = unpack_fp4(codes)
    if tuple(codes.shape) != tuple(x.shape):
        raise ValueError(f"{where}: the trainer's values {tuple(x.shape)} vs the rollout's codes {tuple(codes.shape)}")
    if fmt is Format.NVFP4:
        if f"{prefix}.global_amax" not in record:
            raise ValueError(f"{where}: an NVFP4 record without its global amax")
        z = ref.nvfp4_z(x, scales, record[f"{prefix}.global_amax"].cpu())
    elif fmt is Format.MXFP4:
        z = ref.mxfp4_z(x, scales)
    else:
        z = ref.fp8_z(x, scales)
    return ref.bracket_distance(z, codes, "e2m1" if fmt.fp4 else "e4m3")


def bracket_miss(trainer_values: Sequence[Mapping[str, torch.Tensor]],
                 diagnostics: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, BracketMiss]:
    """Per site (``L07.k``), the elements whose rollout code (``diagnostics``: full codes per trajectory)
    lies outside the bracket of the trainer's value (``TrainerOutput.values``: a forward with
    ``capture_values``), summed over the trajectories (:func:`bracket_distances`)."""
    if len(trainer_values) != len(diagnostics):
        raise ValueError(f"{len(trainer_values)} trajectories of values for {len(diagnostics)} of the rollout's")
    out: dict[str, BracketMiss] = {}
    for b, (mine, rec) in enumerate(zip(trainer_values, diagnostics)):
        for name, x in mine.items():
            out.setdefault(name, BracketMiss(0, 0, 0)).add(bracket_distances(x, rec, name, f"trajectory {b}, "))
    return out


def bracket_miss_summary(counts: Iterable[BracketMiss], *, empty_rate: float | None = None) -> dict[str, Any]:
    """The bracket-miss summary of ``counts`` (sites, or a selection: :func:`at_sites` takes these too):
    ``bracket_misses``, ``bracket_one_out`` and ``bracket_elements`` summed, and
    ``guidance_bracket_miss_rate`` (misses / elements; ``empty_rate`` for no element)."""
    mis = one = tot = 0
    for c in counts:
        mis, one, tot = mis + c.misses, one + c.one_out, tot + c.total
    return {"bracket_misses": mis, "bracket_one_out": one, "bracket_elements": tot,
            Name.BRACKET_MISS: share(mis, tot, empty_rate)}


def reference_markdown() -> str:
    """The registry as a markdown reference page (one table: name, what it measures, formula)."""
    lines = [
        "# Metrics", "",
        "Generated from `tracefp4.pipeline.metrics.METRICS`. The name is the metric's key in every output "
        "(the RL loop's `metrics/<arm>.jsonl`, the reports' and summaries' JSON); the TRL integration logs it "
        f"with the `{TRL_PREFIX}` prefix.", "",
        "| name | measures | formula |", "|---|---|---|",
    ]  # fmt: skip
    for m in METRICS.values():
        # a bare | would end the table cell, also inside backticks (GitHub's tables)
        lines.append(f"| `{m.name}` | {m.measures} | `{m.formula.replace('|', chr(92) + '|')}` |")
    return "\n".join(lines) + "\n"
