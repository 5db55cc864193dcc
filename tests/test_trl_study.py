"""The TRL short-form study's summary (tracefp4.reports.trl_study) on hand-computed log histories."""

from __future__ import annotations

import json

import pytest

from tracefp4.reports.trl_study import arm_of, format_trl_study, load_runs, run_figures, setting_of, summarise_runs
from tracefp4.pipeline.metrics import Name, trl_name


def _history(rewards, gaps=None, maxes=None):
    rows = []
    for i, r in enumerate(rewards):
        row = {"step": 2 * i + 1, "reward": r, "entropy": 0.5}
        if gaps is not None:
            row[trl_name(Name.GAP_MEAN)] = gaps[i]
            row[trl_name(Name.GAP_MAX)] = maxes[i]
            row[trl_name(Name.CODE_MISMATCH)] = 0.1
        rows.append(row)
        rows.append({"step": 2 * i + 2, "loss": 0.0})  # the second update of a generation: no reward
    return rows


def _run(mode, seed, rewards, *, guidance=None, level="token", correction=True, gaps=None, maxes=None):
    meta = {"mode": mode, "guidance": guidance, "seed": seed, "engine": "vllm", "task": "reverse", "plan": "nvfp4",
            "max_steps": 2 * len(rewards), "importance_sampling_level": level,
            "vllm_importance_sampling_correction": correction}
    return {"run": meta, "log_history": _history(rewards, gaps, maxes), "path": f"{mode}-{seed}"}


def test_setting_and_arm_names():
    assert setting_of({"vllm_importance_sampling_correction": False, "importance_sampling_level": "sequence"}) == "off"
    assert setting_of({"vllm_importance_sampling_correction": True, "importance_sampling_level": "sequence"}) == "sequence"
    assert setting_of({}) == "token"
    assert arm_of({"mode": "trace", "guidance": "full"}) == "trace-full"
    assert arm_of({"mode": "qat", "guidance": None}) == "qat"
    assert arm_of({"mode": "trace", "guidance": "lsb"}) == "trace"  # the default guidance: the table's trace


def test_run_figures_quarters_and_growth():
    # 8 generations: quarters are the first and last two
    rewards = [0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.6, 0.8]
    gaps = [0.01, 0.03, 0.02, 0.02, 0.02, 0.02, 0.04, 0.04]
    maxes = [0.5, 0.2, 0.2, 0.9, 0.1, 0.1, 0.1, 0.1]
    f = run_figures(_history(rewards, gaps, maxes))
    assert f["reward_first"] == pytest.approx(0.2, abs=1e-15)
    assert f["reward_last"] == pytest.approx(0.7, abs=1e-15)
    assert f[Name.GAP_MEAN] == pytest.approx(0.025, abs=1e-15)
    assert f[Name.GAP_MAX] == 0.9
    assert f["gap_growth"] == pytest.approx(0.04 / 0.02, rel=1e-12)
    assert f[Name.CODE_MISMATCH] == pytest.approx(0.1, abs=1e-15)
    bf16 = run_figures(_history(rewards))
    assert bf16[Name.GAP_MEAN] is None and bf16["gap_growth"] is None


def test_run_without_rewards_is_refused():
    with pytest.raises(ValueError, match="qat-s0.json: no log row carries 'reward'"):
        run_figures([{"loss": 0.1}], "qat-s0.json")


def test_summary_pairs_seed_by_seed():
    gaps, maxes = [0.02] * 4, [0.3] * 4
    runs = [
        _run("qat", 0, [0.4, 0.4, 0.4, 0.5], correction=False, gaps=gaps, maxes=maxes),
        _run("qat", 1, [0.4, 0.4, 0.4, 0.7], correction=False, gaps=gaps, maxes=maxes),
        _run("trace", 0, [0.4, 0.4, 0.4, 0.6], guidance="full", correction=False, gaps=gaps, maxes=maxes),
        _run("trace", 1, [0.4, 0.4, 0.4, 0.6], guidance="full", correction=False, gaps=gaps, maxes=maxes),
        _run("bf16", 0, [0.4, 0.4, 0.4, 0.6], correction=False),
    ]
    s = summarise_runs(runs, environment={"cpu_model": "AMD EPYC"})
    off = s["settings"]["off"]
    assert set(off) == {"qat", "trace-full", "bf16"}
    d = off["qat"]["reward_last_minus_trace-full"]  # -0.1 and +0.1: mean 0, t(1) = 12.706 x sd 0.1414 / sqrt 2
    assert d["mean"] == pytest.approx(0.0, abs=1e-12) and d["n"] == 2
    assert d["ci95"][1] == pytest.approx(12.706 * 0.1, rel=1e-9)
    assert off["qat"]["reward_last_minus_bf16"]["n"] == 1  # bf16 ran seed 0 only
    assert off["qat"]["reward_last_minus_bf16"]["mean"] == pytest.approx(-0.1, abs=1e-12)
    assert "reward_last_minus_trace-full" not in off["trace-full"]
    assert s["environment"]["cpu_model"] == "AMD EPYC"
    table = format_trl_study(s)
    assert "### setting `off`" in table and "| qat | 2 |" in table


def test_duplicate_run_is_refused():
    r = _run("qat", 0, [0.5])
    with pytest.raises(ValueError, match="both are setting token, arm qat, seed 0"):
        summarise_runs([r, dict(r, path="other.json")])


def test_load_runs_names_a_foreign_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="x.json: expected the JSON of examples/trl_grpo_trace.py"):
        load_runs([p])
