"""``tracefp4 scaling``: the grid, the per-point statistics, the fit, and a resumable run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tracefp4.cli import main
from tracefp4.pipeline.arms import SCALING_ARMS
from tracefp4.pipeline.metrics import Name
from tracefp4.reports.scaling import (CENTRE, CODE_DEEPER_HALF, CODE_GUIDED, DEPTHS, LENGTHS, P99, WIDTHS, Point, fit,
                                     grid, logprob_stats)


def test_grid_is_a_star_through_the_centre():
    pts = grid(("trained",))
    assert len(pts) == len(DEPTHS) + len(WIDTHS) + len(LENGTHS) - 2  # the centre lies on all three axes
    for p in pts:
        off = [k for k in ("layers", "hidden", "new_tokens") if getattr(p, k) != CENTRE[k]]
        assert len(off) <= 1
    assert max(p.layers for p in pts) >= 24 and max(p.new_tokens for p in pts) >= 512 and max(p.hidden for p in pts) >= 512
    assert Point.parse("L8-H128-T64-random") == Point(8, 128, 64, "random")
    assert Point.parse(pts[3].name) == pts[3]
    with pytest.raises(ValueError, match="L<layers>-H<hidden>-T<tokens>"):
        Point.parse("L8-H128-random")


def test_logprob_stats_golden():
    roll = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0])]
    train = [torch.tensor([-1.0 + math.log(3.0), -2.5, -0.5]), torch.tensor([-1.0 + 2.0])]
    s = logprob_stats(roll, train)
    # d = log pi_train - log pi_rollout = [log 3, -0.5, 0] and [2]; computed in float64 from float32
    # inputs, so each d carries the float32 rounding of the inputs (|err| <= 2^-24 * 2.5): rel 1e-6.
    d = [math.log(3.0), -0.5, 0.0, 2.0]
    assert s["tokens"] == 4 and s["sequences"] == 2
    assert s[Name.GAP_MEAN] == pytest.approx(sum(map(abs, d)) / 4, rel=1e-6)
    assert s[Name.GAP_MAX] == pytest.approx(2.0, rel=1e-6)
    assert s["seq_mean"] == pytest.approx((math.log(3.0) - 0.5 + 2.0) / 2, rel=1e-6)
    # the token weights 3, e^-0.5, 1, e^2: above 2 twice, above 5 once (e^2 = 7.39)
    assert s["tokens_truncated_cap2"] == 0.5 and s["tokens_truncated_cap5"] == 0.25
    # sequence weights 3 e^-0.5 = 1.82 and e^2 = 7.39: the second is masked at both caps, the first at neither
    assert s["sequences_masked_cap2"] == 0.5 and s["sequences_masked_cap5"] == 0.5
    assert s["sequences_outside_cap2"] == 0.5
    assert s["by_bucket"]["0-16"]["tokens"] == 4
    with pytest.raises(ValueError, match="at least one completion token"):
        logprob_stats([torch.tensor([])], [torch.tensor([])])


def test_fit_recovers_an_exact_power_law():
    a, b, g, c = 0.75, -0.25, 0.5, 0.003
    rows = []
    for p in grid(("trained",)):
        q = c * p.layers**a * p.hidden**b * p.new_tokens**g
        rows.append({"point": {"layers": p.layers, "hidden": p.hidden, "new_tokens": p.new_tokens},
                     "arms": {arm: {Name.CODE_MISMATCH: q, Name.GAP_MEAN: 2 * q, P99: q, Name.GAP_MAX: q,
                                    "seq_abs_mean": q} for arm in SCALING_ARMS}})  # fmt: skip
    f = fit(rows)["qat"][Name.GAP_MEAN]
    # exact data: least squares in float64 on a well-conditioned 14 x 4 design (logs of 16..512)
    # recovers the exponents to a few ulp of the normal equations' solution; 1e-9 leaves room.
    assert f["exponents"] == pytest.approx({"layers": a, "hidden": b, "new_tokens": g}, abs=1e-9)
    assert f["residual_sd"] == pytest.approx(0.0, abs=1e-9)
    for pred in f["predictions"]:
        want = 2 * c * pred["layers"] ** a * pred["hidden"] ** b * pred["new_tokens"] ** g
        assert pred["predicted"] == pytest.approx(want, rel=1e-8)
        assert pred["interval95"][0] <= pred["predicted"] <= pred["interval95"][1]


def test_fit_of_a_share_is_a_power_law_in_its_odds_and_predicts_a_share():
    """Shares are fitted on the logit scale: odds that follow a power law exactly are recovered (same
    conditioning argument as above), and a share whose odds grow past the grid is predicted below 1
    where a log-scale power law in the share itself would exceed it."""
    a, b, g, c = 0.75, -0.25, 0.5, 0.01
    rows = []
    for p in grid(("trained",)):
        odds = c * p.layers**a * p.hidden**b * p.new_tokens**g
        q = odds / (1 + odds)
        rows.append({"point": {"layers": p.layers, "hidden": p.hidden, "new_tokens": p.new_tokens},
                     "arms": {"qat": {Name.CODE_MISMATCH: q}}})  # fmt: skip
    f = fit(rows)["qat"][Name.CODE_MISMATCH]
    assert f["scale"] == "logit"
    assert f["exponents"] == pytest.approx({"layers": a, "hidden": b, "new_tokens": g}, abs=1e-9)
    for pred in f["predictions"]:
        odds = c * pred["layers"] ** a * pred["hidden"] ** b * pred["new_tokens"] ** g
        assert odds > 1  # past even odds at the targets: the log-scale fit would predict q > 0.5 growing without bound
        assert pred["predicted"] == pytest.approx(odds / (1 + odds), rel=1e-8)
        assert pred["interval95"][1] < 1.0


@pytest.mark.slow
def test_scaling_runs_resumes_and_reruns_a_point_identically(tmp_path, capsys):
    out = tmp_path / "rep.json"
    base = ["scaling", "--dir", str(tmp_path / "run"), "--batch", "2", "--quiet", "--sft-steps"]
    points = ["--only", "L2-H64-T8-random,L2-H64-T8-trained"]
    assert main([*base, "2", *points, "--json", str(out), "--plot", str(tmp_path / "img" / "s.png")]) == 0
    rep = json.loads(out.read_text())
    assert [r["name"] for r in rep["points"]] == ["L2-H64-T8-random", "L2-H64-T8-trained"]
    for r in rep["points"]:
        arms = r["arms"]
        assert set(arms) == set(SCALING_ARMS)
        assert Name.CODE_MISMATCH not in arms["bf16"]
        # guidance never does worse than vanilla QAT at the sites it guides; full codes on every
        # layer reproduce every code QAT would have got right and remove mismatches where it did not
        assert arms["trace-full"][Name.CODE_MISMATCH] <= arms["qat"][Name.CODE_MISMATCH]
        assert arms["trace"][CODE_GUIDED] <= arms["qat"][CODE_DEEPER_HALF]
        assert arms["trace"]["guided_layers"] == [1] and arms["trace-all"]["guided_layers"] == [0, 1]
        for arm in SCALING_ARMS:
            a = arms[arm]
            assert a["tokens"] == 2 * 8 and a[Name.GAP_MEAN] <= a[P99] <= a[Name.GAP_MAX]
            if arm != "bf16":
                assert set(a["code_by_bucket"]) == {"prompt", "0-16"} and set(a["code_by_layer"]) == {"L00", "L01"}
    assert rep["points"][1]["model"]["weights"] == "trained" and rep["points"][1]["model"]["sft"]["steps"] == 2
    assert (tmp_path / "img" / "s.png").exists() and (tmp_path / "img" / "s_layers.png").exists()
    assert rep["bytes_at_targets"]["bytes_per_token"]["full"] > rep["bytes_at_targets"]["bytes_per_token"]["lsb"]
    # resumed: nothing is measured again; forced: the same numbers (same seed, machine, threads)
    point_file = tmp_path / "run" / "points" / "L2-H64-T8-trained.json"
    before = point_file.read_text()
    assert main([*base, "2", *points]) == 0
    assert point_file.read_text() == before
    assert main([*base, "2", "--only", "L2-H64-T8-trained", "--force"]) == 0
    again = json.loads(point_file.read_text())
    first = json.loads(before)
    assert again["arms"] == first["arms"]
    # a model fine-tuned with other settings is not silently reused: a one-line error, exit code 2
    assert main([*base, "3", "--only", "L2-H64-T8-trained", "--force"]) == 2
    assert "fine-tuned with" in capsys.readouterr().err
