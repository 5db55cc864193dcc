"""``tracefp4 experiment``: seeds as run folders, per-arm means with Student-t 95% intervals, resumable."""

from __future__ import annotations

import json
import math

import pytest

from tracefp4.cli import main
from tracefp4.rl.experiment import ExperimentConfig, collapse_step, run_experiment, run_job
from tracefp4.stats import format_mean_ci, mean_ci95, paired_differences, t_quantile_975
from tracefp4.pipeline.metrics import Name
from rl_tiny import EXPERIMENT_RUN as RUN



def test_mean_ci95_golden():
    ci = mean_ci95([0.5, 0.7, 0.9])  # mean 0.7, sd 0.2, t(2) = 4.303
    half = 4.303 * 0.2 / math.sqrt(3)
    assert ci["mean"] == pytest.approx(0.7) and ci["ci95"] == pytest.approx([0.7 - half, 0.7 + half])
    assert mean_ci95([0.25])["ci95"] == [0.25, 0.25]
    assert t_quantile_975(1) == 12.706 and t_quantile_975(100) == 1.96
    with pytest.raises(ValueError):
        mean_ci95([])


def test_paired_differences_and_their_text():
    d = paired_differences({0: 0.75, 1: 0.5, 2: 1.0}, {0: 0.5, 1: 0.5, 5: 0.0})  # seed 2 has no pair
    assert d == mean_ci95([0.25, 0.0]) and paired_differences({0: 1.0}, {1: 1.0}) is None
    assert format_mean_ci({"mean": 0.5, "ci95": [0.25, 0.75]}, "+.2f") == "+0.50 [+0.25, +0.75]"
    assert format_mean_ci(None) == "-"


@pytest.mark.parametrize(
    ("accs", "expected"),
    [
        ([0.2, 0.6, 0.5, 0.7], None),  # never below half of the running max
        ([0.2, 0.6, 0.2, 0.1, 0.05], (20, 2)),  # below 0.3 from step 20 on
        ([0.2, 0.6, 0.2, 0.4, 0.1], (40, 0)),  # recovered at step 30 (0.4 >= 0.3): only the last one counts
        ([0.8, 0.3, 0.35, 0.39], (10, 2)),  # 0.39 < 0.8 / 2: still collapsed
        ([0.8, 0.3, 0.35, 0.40], None),  # 0.40 is half of 0.8, not below it: recovered
        ([0.0, 0.0, 0.0], None),  # nothing to collapse from
        ([], None),
    ],
)
def test_collapse_step(accs, expected):
    assert collapse_step([(10 * i, a) for i, a in enumerate(accs)]) == expected


def test_bad_experiment_config(tmp_path):
    (tmp_path / "x.toml").write_text('name = "x"\nseeds = [0, 0]\n' + RUN)
    with pytest.raises(ValueError, match="distinct"):
        ExperimentConfig.from_file(str(tmp_path / "x.toml"))
    (tmp_path / "y.toml").write_text('name = "y"\nseeds = [0]\n' + RUN.replace("steps = 1", 'steps = "one"'))
    with pytest.raises(ValueError, match="steps = 'one'"):
        ExperimentConfig.from_file(str(tmp_path / "y.toml"))


@pytest.mark.slow
def test_experiment_runs_seeds_and_resumes(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text(f'name = "tiny"\nseeds = [0, 1]\nout = "{tmp_path / "runs"}"\n' + RUN)
    argv = ["experiment", "--config", str(cfg), "--results", str(tmp_path / "res"), "--plots", str(tmp_path / "img")]
    assert main(argv) == 0
    res = json.loads((tmp_path / "res" / "tiny.json").read_text())
    assert set(res) >= {"name", "task", "model", "steps", "engine", "arms"} and res["steps"] == 1
    for arm in ("bf16", "trace"):
        e = res["arms"][arm]
        assert e["seeds"] == [0, 1] and len(e["final_eval_accuracy_per_seed"]) == 2
        acc = e["final_eval_accuracy"]
        assert acc["ci95"][0] <= acc["mean"] <= acc["ci95"][1]
        for key in (Name.GAP_MEAN, Name.GAP_MAX, Name.GUIDANCE_BYTES):
            assert e[key] is not None
    assert res["arms"]["bf16"]["guidance_bytes_per_token"] == 0 < res["arms"]["trace"]["guidance_bytes_per_token"]
    # post-hoc FP4 inference of the BF16-trained policy: from the bf16 arm's evaluations only
    for key in ("final_eval_accuracy_fp4", "final_eval_accuracy_fp4_4over6"):
        post = res["arms"]["bf16"][key]
        assert post["n"] == 2 and post["ci95"][0] <= post["mean"] <= post["ci95"][1]
        assert key not in res["arms"]["trace"]
    # the trace arm against bf16, seed by seed
    paired = res["arms"]["trace"]["final_eval_accuracy_minus_bf16"]
    b, t = res["arms"]["bf16"]["final_eval_accuracy_per_seed"], res["arms"]["trace"]["final_eval_accuracy_per_seed"]
    assert paired["n"] == 2 and paired["mean"] == pytest.approx(sum(x - y for x, y in zip(t, b)) / 2, abs=1e-12)
    assert "final_eval_accuracy_minus_bf16" not in res["arms"]["bf16"]
    for arm, e in res["arms"].items():  # each seed's own evaluations, and the collapse statistic on them
        for s in ("0", "1"):
            series = list(zip(e["per_seed"][s]["eval_step"], e["per_seed"][s]["eval_accuracy"]))
            c = collapse_step(series)
            assert e["collapse"]["per_seed"][s] == (None if c is None else {"step": c[0], "evals_after": c[1]})
        assert e["collapse"]["share"] == e["collapse"]["seeds_collapsed"] / 2
        assert set(e["curves"]) >= {"eval_accuracy", "reward_mean", Name.GAP_MEAN, "is_truncated_frac"}
        assert e["response_length"] > 0
    for plot in ("eval_accuracy", "reward_mean", "is_truncated_frac"):
        assert (tmp_path / "img" / f"tiny_{plot}.png").exists()
    # a second invocation resumes the finished seeds (nothing is run again) and gives the same summary
    before = (tmp_path / "runs" / "tiny" / "seed-0" / "metrics" / "trace.jsonl").read_text()
    assert main(argv) == 0
    assert (tmp_path / "runs" / "tiny" / "seed-0" / "metrics" / "trace.jsonl").read_text() == before
    assert json.loads((tmp_path / "res" / "tiny.json").read_text()) == res


@pytest.mark.slow
def test_warm_start_from_another_experiment_reproduces_it(tmp_path):
    """``warm_start`` starts each seed from saved weights: a matrix re-run from the first one's
    warm-start checkpoints starts from the very same weights (same digest, no SFT) and, on the same
    machine and thread count, reproduces every metric row; each seed's environment is recorded."""
    first = tmp_path / "a.toml"
    first.write_text(f'name = "a"\nseeds = [0]\nout = "{tmp_path / "runs"}"\n' + RUN)
    warm = tmp_path / "runs" / "a" / "seed-{seed}" / "checkpoints" / "warm_start" / "step-00000000"
    again = tmp_path / "b.toml"
    again.write_text(f'name = "b"\nseeds = [0]\nout = "{tmp_path / "runs"}"\nwarm_start = "{warm}"\n' + RUN)
    for cfg in (first, again):
        assert main(["experiment", "--config", str(cfg), "--results", str(tmp_path / "res"),
                     "--plots", str(tmp_path / "img")]) == 0
    a, b = (json.loads((tmp_path / "res" / f"{n}.json").read_text())["provenance"] for n in "ab")
    assert a["warm_starts"][0]["weights_sha256"] == b["warm_starts"][0]["weights_sha256"]
    assert b["per_seed"]["0"]["warm_start"]["warm_start_steps"] == 0
    assert b["per_seed"]["0"]["warm_start"]["source"] == str(warm).replace("{seed}", "0")
    env = b["per_seed"]["0"]["environment"]
    assert env["cpu_capability"] and env["torch_threads"] >= 1 and "torch" in env["packages"]
    assert b["per_seed"]["0"]["resumed_elsewhere"] == []
    for arm in ("bf16", "trace"):
        rows = [(tmp_path / "runs" / n / "seed-0" / "metrics" / f"{arm}.jsonl").read_text().splitlines() for n in "ab"]
        strip = [[{k: v for k, v in json.loads(r).items() if not k.startswith("time/")} for r in rs] for rs in rows]
        assert strip[0] == strip[1], arm


@pytest.mark.slow
@pytest.mark.subprocess
def test_workers_run_the_jobs_in_parallel_processes_with_the_same_numbers(tmp_path, monkeypatch):
    """``--workers 2``: the warm start, then the two arms in two ``--job`` processes at once (job locks:
    the folder shared, each arm exclusive); every metric row equals the sequential run's, and the
    results file is written the same way; the seed is recorded as soon as its last arm's job ends. A bad
    ``--job`` names what it expected."""
    import sys

    import tracefp4.rl.experiment as experiment

    archived_by, archive = [], experiment.archive_seed

    def spy(cfg, seed, results_dir):  # who recorded the seed: run_jobs, as soon as its last arm ended
        path = archive(cfg, seed, results_dir)
        archived_by.append((cfg.name, sys._getframe(1).f_code.co_name, path is not None))
        return path

    monkeypatch.setattr(experiment, "archive_seed", spy)
    rows = {}
    for name, workers in (("seq", "1"), ("par", "2")):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f'name = "{name}"\nseeds = [0]\nout = "{tmp_path / "runs"}"\n' + RUN)
        assert main(["experiment", "--config", str(cfg), "--workers", workers, "--results", str(tmp_path / "res"),
                     "--plots", str(tmp_path / "img")]) == 0
        assert (tmp_path / "res" / f"{name}.json").exists()
        rows[name] = {arm: [{k: v for k, v in json.loads(r).items() if not k.startswith("time/")}
                            for r in (tmp_path / "runs" / name / "seed-0" / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
                      for arm in ("bf16", "trace")}
    assert ("par", "run_jobs", True) in archived_by and ("seq", "run_experiment", True) in archived_by
    assert rows["par"] == rows["seq"]
    assert main(["experiment", "--config", str(tmp_path / "par.toml"), "--job", "7:bf16"]) == 2
    assert main(["experiment", "--config", str(tmp_path / "par.toml"), "--job", "0:quads"]) == 2


def test_bad_warm_start_config(tmp_path):
    (tmp_path / "x.toml").write_text('name = "x"\nseeds = [0]\nwarm_start = 3\n' + RUN)
    with pytest.raises(ValueError, match="warm_start = 3: expected a folder path"):
        ExperimentConfig.from_file(str(tmp_path / "x.toml"))
    (tmp_path / "y.toml").write_text('name = "y"\nseeds = [0]\nwarm_start = "w"\n' + RUN.replace("[run]\n", '[run]\ncheckpoint = "c"\n'))
    with pytest.raises(ValueError, match="give one"):
        ExperimentConfig.from_file(str(tmp_path / "y.toml"))


def test_shipped_experiment_configs_parse():
    """Every ``configs/experiment-*.toml`` is a valid experiment (all its seeds' run configs validate);
    the issue-20 config carries the nine arms over three seeds with the addition experiment's settings."""
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("experiment-*.toml"))
    by_name = {p.name: ExperimentConfig.from_file(str(p)) for p in configs}
    nine, base = by_name["experiment-addition-9arms.toml"], by_name["experiment-addition.toml"]
    assert nine.seeds == [0, 1, 2] and nine.run["arms"] == [
        "bf16", "qat", "trace", "trace-full", "quads", "score-centering", "trace-sc", "qat-fp8", "trace-fp8"]
    same = {k: v for k, v in base.run.items() if k != "arms"}
    assert {k: nine.run[k] for k in same} == same


def test_summary_headline_metric_and_collapses_on_each_held_out_figure():
    """``metric = "eval_reward"``: the table and ``collapse`` use the mean reward, while every held-out
    figure keeps its own final value, paired difference and collapse (synthetic rows, exact arithmetic)."""
    from tracefp4.rl.config import RLConfig
    from tracefp4.rl.experiment import format_summary, summarise

    def rows(acc, rew):
        train = [{"kind": "train", "step": s, "train_rollout_logprob_abs_diff": 0.01,
                  "train_rollout_logprob_abs_diff_max": 0.1, "guidance_bytes_per_token": 0.0,
                  "response_length": 33.0} for s in range(len(acc))]
        evals = [{"kind": "eval", "step": s, "eval_accuracy": a, "eval_reward": r}
                 for s, (a, r) in enumerate(zip(acc, rew))]
        return train + evals

    cfg = RLConfig.from_dict({"task": "count", "arms": ["bf16", "qat"], "steps": 4})
    metrics = {0: {"bf16": rows([0.0] * 4, [0.25, 0.5, 0.5, 0.75]),
                   "qat": rows([0.0] * 4, [0.25, 0.5, 0.125, 0.125])}}  # qat's reward falls below half of 0.5
    out = summarise("m", metrics, cfg, metric="eval_reward")
    assert out["metric"] == "eval_reward"
    qat = out["arms"]["qat"]
    assert qat["collapse"] == qat["collapse_by"]["eval_reward"]
    assert qat["collapse"]["per_seed"]["0"] == {"step": 2, "evals_after": 1}
    assert qat["collapse_by"]["eval_accuracy"]["seeds_collapsed"] == 0  # accuracy 0 throughout: nothing to fall from
    assert qat["final_eval_reward_minus_bf16"]["mean"] == 0.125 - 0.75
    assert qat["final_eval_accuracy_minus_bf16"]["mean"] == 0.0
    assert qat["per_seed"]["0"]["eval_reward"] == [0.25, 0.5, 0.125, 0.125]
    table = format_summary(out)
    assert "final reward" in table and "1/1 @2" in table


def test_summary_per_sequence_mismatch_beside_the_scaling_fit():
    """Each seed's mean over its steps of the four per-sequence figures, mean over seeds; beside it the
    scaling fit refitted from a report's points at the run's layers, hidden size and mean completion
    length (here exact power laws, so the prediction is the law's value), for the arms the scaling
    study runs (fp4-rollout it does not)."""
    from tracefp4.pipeline.arms import SCALING_ARMS
    from tracefp4.pipeline.metrics import Name
    from tracefp4.reports.scaling import SEQ_ABS_MEAN, grid, predict_at
    from tracefp4.rl.config import RLConfig
    from tracefp4.rl.experiment import format_summary, summarise

    def rows(seq_sum, ratio):
        train = [{"kind": "train", "step": s, "train_rollout_logprob_abs_diff": 0.01,
                  "train_rollout_logprob_abs_diff_max": 0.1, "guidance_bytes_per_token": 0.0, "response_length": 512.0,
                  Name.SEQ_GAP_SUM: seq_sum * (s + 1), Name.SEQ_GAP_SUM_P95: 2 * seq_sum,
                  Name.SEQ_LOG_RATIO: ratio, Name.SEQ_LOG_RATIO_P95: 4 * ratio} for s in range(2)]
        return train + [{"kind": "eval", "step": 0, "eval_accuracy": 0.0, "eval_reward": 0.5}]

    c, a, b, g = 0.003, 0.5, -0.75, 0.75
    points = [{"engine": "home", "point": {"layers": p.layers, "hidden": p.hidden, "new_tokens": p.new_tokens,
                                           "weights": "trained"},
               "arms": {arm: {Name.GAP_MEAN: c * p.layers**a * p.hidden**b * p.new_tokens**(g - 1),
                              SEQ_ABS_MEAN: c * p.layers**a * p.hidden**b * p.new_tokens**g} for arm in SCALING_ARMS}}
              for p in grid(("trained",))]
    cfg = RLConfig.from_dict({"task": "count", "arms": ["qat", "trace-full", "fp4-rollout"], "steps": 2,
                              "model": {"layers": 8, "hidden": 96}})
    metrics = {s: {arm: rows(0.25 * (s + 1), 0.125) for arm in cfg.arms} for s in (0, 1)}
    out = summarise("m", metrics, cfg, metric="eval_reward", scaling={"points": points})
    qat = out["arms"]["qat"]
    # seed 0: steps 0.25, 0.5 (mean 0.375); seed 1: 0.5, 1.0 (mean 0.75)
    assert qat[Name.SEQ_GAP_SUM]["mean"] == (0.375 + 0.75) / 2
    assert qat[Name.SEQ_GAP_SUM_P95]["mean"] == (0.5 + 1.0) / 2
    assert qat[Name.SEQ_LOG_RATIO]["mean"] == 0.125 and qat[Name.SEQ_LOG_RATIO_P95]["mean"] == 0.5
    pred = qat["seq_scaling_prediction"]
    assert (pred["scaling_arm"], pred["layers"], pred["hidden"], pred["new_tokens"]) == ("qat", 8, 96, 512.0)
    want = c * 8**a * 96**b * 512.0**g
    assert pred[Name.SEQ_LOG_RATIO]["predicted"] == pytest.approx(want, rel=1e-8)  # least squares: ulps
    assert pred[Name.SEQ_LOG_RATIO] == predict_at({"points": points}, "qat", SEQ_ABS_MEAN, layers=8, hidden=96,
                                                  new_tokens=512.0)
    assert pred[Name.SEQ_GAP_SUM]["predicted"] == pytest.approx(want, rel=1e-8)  # T x mean |dlogp| = T^g
    assert out["arms"]["trace-full"]["seq_scaling_prediction"]["scaling_arm"] == "trace-full"
    assert out["arms"]["fp4-rollout"]["seq_scaling_prediction"] is None
    table = format_summary(out)
    assert "per-sequence mismatch" in table and "fit |log-ratio|" in table
    with pytest.raises(ValueError, match="predict_at: key must be one of"):
        predict_at({"points": points}, "qat", "seq_sum", layers=8, hidden=96, new_tokens=512)


def test_unknown_headline_metric_is_refused(tmp_path):
    (tmp_path / "m.toml").write_text('name = "m"\nseeds = [0]\nmetric = "reward"\n' + RUN)
    with pytest.raises(ValueError, match="metric = 'reward': expected one of 'eval_accuracy', 'eval_reward'"):
        ExperimentConfig.from_file(str(tmp_path / "m.toml"))


def test_summary_dynamics_growth_gain_and_pairing_with_trace_full():
    """Issue 37's endpoints on synthetic rows (exact in binary fractions): the gain over each seed's own
    step-0 evaluation, the mismatch growth (mean of the last 50 steps over the first 50), step means of
    the update's statistics, the is_mode recorded, and every arm paired with trace-full as with bf16."""
    from tracefp4.rl.config import RLConfig
    from tracefp4.rl.experiment import SLOPE_WINDOW, summarise

    n = 2 * SLOPE_WINDOW

    def rows(k3_first, k3_last, rew):
        train = [{"kind": "train", "step": s, "train_rollout_logprob_abs_diff": 0.25,
                  "train_rollout_logprob_abs_diff_max": 1.0, "guidance_bytes_per_token": 0.0,
                  "response_length": 33.0, "rollout_corr/k3_kl": k3_first if s < SLOPE_WINDOW else k3_last,
                  "entropy": 0.5, "grad_norm": 2.0, "is_masked_frac": 0.25 if s % 2 else 0.0}
                 for s in range(n)]
        evals = [{"kind": "eval", "step": s, "eval_accuracy": 0.0, "eval_reward": r} for s, r in zip((0, n), rew)]
        return train + evals

    cfg = RLConfig.from_dict({"task": "count", "arms": ["qat", "trace-full"], "steps": n, "is_mode": "token-mask"})
    metrics = {s: {"qat": rows(0.25, 1.0, [0.5, 0.25 + s / 8]), "trace-full": rows(0.5, 0.5, [0.5, 0.75])}
               for s in (0, 1)}
    out = summarise("m", metrics, cfg, metric="eval_reward")
    assert out["is_mode"] == "token-mask" and out["is_cap"] == cfg.is_cap
    qat, full = out["arms"]["qat"], out["arms"]["trace-full"]
    assert qat["growth_k3_kl"]["mean"] == 4.0 and full["growth_k3_kl"]["mean"] == 1.0
    assert qat["growth_train_rollout_logprob_abs_diff_max"]["mean"] == 1.0
    assert qat["gain_eval_reward"]["mean"] == (-0.25 + -0.125) / 2
    assert full["gain_eval_reward"]["mean"] == 0.25
    assert qat["final_eval_reward_minus_trace-full"]["mean"] == ((0.25 - 0.75) + (0.375 - 0.75)) / 2
    assert "final_eval_reward_minus_trace-full" not in full
    assert qat["mean_entropy"]["mean"] == 0.5 and qat["mean_grad_norm"]["mean"] == 2.0
    assert qat["mean_is_masked_frac"]["mean"] == 0.125
    assert qat["mean_is_seq_masked_frac"] is None  # not logged: absent, not zero
    from tracefp4.rl.experiment import format_summary

    table = format_summary(out)
    assert "is_mode token-mask" in table and "minus trace-full, paired" in table


@pytest.mark.parametrize(("change", "message"), [
    ({"name": "a/b"}, "name = 'a/b': expected a non-empty string without '/'"),
    ({"seeds": [0, True]}, r"seeds = \[0, True\]: expected a list of distinct integers"),
    ({"seeds": []}, r"seeds = \[\]: expected a list of distinct integers"),
    ({"out": 3}, "out = 3: expected a string"),
    ({"warm_start": ""}, "warm_start = '': expected a folder path"),
    ({"metric": "reward"}, "metric = 'reward': expected one of 'eval_accuracy', 'eval_reward'"),
    ({"run": {"steps": 1, "seed": 4}}, r"run = \{'steps': 1, 'seed': 4\}: expected a table of RLConfig fields without"),
    ({"run": ["steps"]}, r"run = \['steps'\]: expected a table \(mapping\)"),
    ({"run": {"steps": -1}}, r"\[run\] steps = -1: expected a value >= 0"),
])
def test_experiment_config_built_in_python_is_validated_like_a_run_config(tmp_path, change, message):
    """An ExperimentConfig made in Python, not read from a file, is refused with the field, its value and
    what was expected, by validate() and by the entries that run it, before any run folder exists."""
    fields = {"name": "e", "seeds": [0, 1], "run": {"steps": 1}, "out": str(tmp_path / "runs")} | change
    cfg = ExperimentConfig(**fields)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):
        ExperimentConfig.from_dict(fields)
    with pytest.raises(ValueError, match=message):
        run_experiment(cfg, tmp_path / "res", tmp_path / "img")
    with pytest.raises(ValueError, match=message):
        run_job(cfg, "0:bf16")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "res").exists()


def test_experiment_config_from_dict_names_unknown_and_missing_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['seed'\]; known: name, seeds, run, out, warm_start, metric"):
        ExperimentConfig.from_dict({"name": "e", "seed": 0, "seeds": [0], "run": {}})
    with pytest.raises(ValueError, match="missing 'run'"):
        ExperimentConfig.from_dict({"name": "e", "seeds": [0]})


def test_an_experiment_file_names_its_base_instead_of_copying_it(tmp_path):
    (tmp_path / "a.toml").write_text('name = "a"\nseeds = [0, 1]\nmetric = "eval_reward"\n' + RUN)
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.toml").write_text('base = "../a.toml"\nname = "b"\n[run]\nmax_staleness = 1\n[run.model]\nlayers = 3\n')
    a, b = (ExperimentConfig.from_file(str(p)) for p in (tmp_path / "a.toml", sub / "b.toml"))
    assert (b.name, b.seeds, b.metric) == ("b", [0, 1], "eval_reward")
    assert b.run == {**a.run, "max_staleness": 1, "model": {**a.run["model"], "layers": 3}} != a.run
    (sub / "c.toml").write_text('base = "../a.toml"\n[run]\nmax_staleness = 1\n')
    with pytest.raises(ValueError, match=r"c.toml: base = '../a.toml': expected a name of its own"):
        ExperimentConfig.from_file(str(sub / "c.toml"))
    (sub / "d.toml").write_text('base = "d.toml"\nname = "d"\n')
    with pytest.raises(ValueError, match=r"base = 'd.toml': expected a file that does not lead back"):
        ExperimentConfig.from_file(str(sub / "d.toml"))
    (sub / "e.toml").write_text('base = "missing.toml"\nname = "e"\n')
    with pytest.raises(ValueError, match=r"e.toml: base .*missing.toml: .*No such file"):
        ExperimentConfig.from_file(str(sub / "e.toml"))
