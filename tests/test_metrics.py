"""The metrics registry: one name per metric and no other spelling, the summary functions equal to the
formulas the loop and the reports computed them with."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tracefp4.engines.trainer import SiteMismatch
from tracefp4.pipeline.metrics import (
    METRICS,
    TRL_PREFIX,
    Name,
    at_sites,
    gap_quantile,
    guidance_bytes_per_token,
    label,
    logprob_gap,
    metric,
    mismatch_by,
    mismatch_summary,
    reference_markdown,
    router_flip_rate,
    sequence_gap,
    trl_name,
)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tracefp4"


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(Name).items() if not k.startswith("_")}


def test_every_name_is_one_registry_entry() -> None:
    names = _names()
    assert len(set(names.values())) == len(names), "two Name attributes spell one metric"
    assert set(names.values()) == set(METRICS) and all(METRICS[n].name == n for n in METRICS)
    # one spelling: the former aliases of the mean gap are no metric
    for spelling in ("mean_abs", "logprob_gap_mean", "logprob_gap_mean_abs", "dlogp", f"{TRL_PREFIX}logprob_gap_mean"):
        with pytest.raises(KeyError, match=f"unknown metric '{spelling}'"):
            metric(spelling)
    assert all(trl_name(n) == TRL_PREFIX + n for n in METRICS)


def test_the_loop_metrics_keep_their_record_names() -> None:
    lp_r = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    lp_t = torch.tensor([[-1.25, -1.5, -0.5], [-0.2, -2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    gap = logprob_gap(lp_r, lp_t, mask)
    assert set(gap) <= set(METRICS)
    assert gap["train_rollout_logprob_abs_diff_max"] == 1.0
    # the quantiles of |delta logp| over the same five tokens (|d| = 0.25, 0.5, 0, 0.1, 1)
    q = logprob_gap(lp_r, lp_t, mask, quantiles=(0.5, 0.99))
    assert q[gap_quantile(0.5)] == pytest.approx(0.25)
    abs_d = torch.tensor([0.25, 0.5, 0.0, 0.1, 1.0], dtype=torch.float64)
    assert q[gap_quantile(0.99)] == pytest.approx(float(torch.quantile(abs_d, 0.99)))
    assert {k: q[k] for k in gap} == gap and gap_quantile(0.99) == Name.GAP_MEAN + "_p99"


def test_sequence_gap_sums_each_sequence_then_summarises_over_sequences() -> None:
    """Per sequence sum_t |d_t| and |sum_t d_t| over its own tokens (a masked position's value, 5.0
    here, is not one of them), then mean and p95 over the sequences; dyadic values, so every sum is exact."""
    lp_r = torch.tensor([[-1.0, -2.0, -0.5], [-0.125, -3.0, 0.0]])
    lp_t = torch.tensor([[-1.25, -1.5, -0.5], [-0.25, -2.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    g = sequence_gap(lp_r, lp_t, mask)
    assert set(g) <= set(METRICS) and len(g) == 4
    sums, ratios = [0.25 + 0.5 + 0.0, 0.125 + 1.0], [abs(0.25 - 0.5), abs(0.125 - 1.0)]
    assert g[Name.SEQ_GAP_SUM] == 0.9375 == sum(sums) / 2
    assert g[Name.SEQ_LOG_RATIO] == 0.5625 == sum(ratios) / 2
    assert g[Name.SEQ_GAP_SUM_P95] == float(torch.quantile(torch.tensor(sums, dtype=torch.float64), 0.95))
    assert g[Name.SEQ_LOG_RATIO_P95] == float(torch.quantile(torch.tensor(ratios, dtype=torch.float64), 0.95))
    with pytest.raises(ValueError, match="sequence_gap: the mask selects no tokens"):
        sequence_gap(lp_r, lp_t, torch.zeros_like(mask))


def test_summary_functions() -> None:
    sites = [SiteMismatch(mismatched=3, total=10, one_apart=2), SiteMismatch(mismatched=1, total=6, one_apart=1)]
    s = mismatch_summary(sites)
    assert (s["mismatched"], s["one_apart"], s["total"]) == (4, 3, 16)
    assert s[Name.CODE_MISMATCH] == 4 / 16 and s[Name.ONE_APART] == 3 / 4
    # the reports' empty value is None (JSON null); the loop records 0.0 and 1.0 (mism / max(total, 1),
    # one / mism if mism else 1.0)
    empty = [SiteMismatch(mismatched=0, total=0, one_apart=0)]
    assert mismatch_summary(empty)[Name.CODE_MISMATCH] is None and mismatch_summary(empty)[Name.ONE_APART] is None
    loop = mismatch_summary(empty, empty_rate=0.0, empty_share=1.0)
    assert loop[Name.CODE_MISMATCH] == 0.0 and loop[Name.ONE_APART] == 1.0
    # by group, and a selection of sites by (layer, site)
    by_site = dict(zip(("L00.k", "L03.expert_in"), sites))
    assert mismatch_by(by_site)["L03.expert_in"][Name.CODE_MISMATCH] == 1 / 6
    assert at_sites(by_site, lambda layer, site: layer >= 1) == [sites[1]]
    assert at_sites(by_site, lambda layer, site: site == "k") == [sites[0]]
    assert router_flip_rate({0: 0.25, 1: 0.5}) == 0.375 and router_flip_rate({}) == 0.0
    assert guidance_bytes_per_token(96, 32) == 3.0 and guidance_bytes_per_token(0, 0) == 0.0


def test_reference_page_lists_every_metric() -> None:
    page = reference_markdown()
    for m in METRICS.values():
        assert f"| `{m.name}` |" in page
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(METRICS)
    # each row has exactly the three cells (an unescaped | in a formula would add one)
    assert all(line.replace("\\|", "").count("|") == 4 for line in rows)
    assert label(Name.CODE_MISMATCH) == "code mismatch"


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module, docstrings left out (they name metrics to explain them)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


#: Where a metric name may not be written as a literal: the library, its scripts and its examples.
CHECKED = (SRC, ROOT / "scripts", ROOT / "examples")


def _spelled(text: str, names: set[str]) -> bool:
    """Whether ``text`` spells a registry name: the name itself, a TRL name, or a key built on the name
    (``code_mismatch_rate_deeper_half``, ``train_rollout_logprob_abs_diff_p99``)."""
    return any(text == n or text.startswith(n + "_") for n in names)


def test_no_metric_name_is_spelled_outside_the_registry() -> None:
    """A record name, a TRL name or a key built on either, written as a literal outside
    tracefp4.pipeline.metrics, fails: code that writes or reads a metric takes its name from ``Name`` (and
    ``trl_name``, ``gap_quantile``). Every :class:`Name` is checked."""
    names = set(_names().values()) | {trl_name(n) for n in _names().values()}
    registry = SRC / "pipeline" / "metrics.py"
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for root in CHECKED for p in sorted(root.rglob("*.py"))
             if p != registry for line, text in _string_literals(p) if _spelled(text, names)]
    assert not found, "metric names spelled outside the registry:\n" + "\n".join(found)


def test_the_literal_check_sees_a_literal(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""mentions code_mismatch_rate in a docstring"""\nx = {"code_mismatch_rate": 1}\n')
    assert _string_literals(module) == [(2, "code_mismatch_rate")]
    names = {Name.CODE_MISMATCH, trl_name(Name.CODE_MISMATCH)}
    assert _spelled("code_mismatch_rate", names) and _spelled("trace/code_mismatch_rate", names)
    assert _spelled("code_mismatch_rate_deeper_half", names) and not _spelled("code_mismatch", names)
