"""``tracefp4 mismatch --lag``: the lag-k replay of a short GRPO run, at toy size.

The JSON holds every (lag, arm) cell with the registry's metric names; at lag 0 the full-code trainer
reproduces every rollout code and no rollout code leaves its bracket; the ``mod4`` trainer's own
count of misses lies between the exact one-codeword-out count and the exact miss count at its guided
layers (a miss one codeword out is always detected, three or more can alias); the command refuses
bad ``--lag`` values and options the run config owns, naming them.
"""

from __future__ import annotations

import json

import pytest
import torch

from tracefp4.cli import main
from tracefp4.pipeline.metrics import METRICS, Name
from tracefp4.reports.replay import REPLAY_ARMS, KIND, format_replay, parse_lags

torch.set_num_threads(1)

TINY_RUN = """
task = "reverse"
warm_start_steps = 3
prompts_per_step = 2
group_size = 2
max_new_tokens = 6
updates_per_step = 1
threads = 1
lr = 1e-3
[model]
hidden = 32
layers = 4
experts = 4
top_k = 2
moe_intermediate = 32
heads = 2
kv_heads = 1
"""
LAGS = (0, 1, 2)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("replay-config") / "tiny.toml"
    path.write_text(TINY_RUN)
    return str(path)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, config: str) -> dict:
    out = tmp_path_factory.mktemp("replay")
    argv = ["mismatch", "--lag", ",".join(map(str, LAGS)), "--config", config, "--json", str(out / "r.json"),
            "--plot", str(out / "r.png"), "--quiet"]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["r.json", "r.png"]  # written whole, nothing beside
    return json.loads((out / "r.json").read_text())


@pytest.mark.slow  # the toy replay: a warm start, two GRPO steps, twelve rollouts (~25 s on 2 cores)
def test_every_lag_and_arm_has_a_cell_with_registry_names(report: dict) -> None:
    assert report["kind"] == KIND and report["lags"] == list(LAGS) and report["steps"] == max(LAGS)
    cells = {(c["lag"], c["arm"]): c for c in report["cells"]}
    assert set(cells) == {(k, a) for k in LAGS for a in REPLAY_ARMS}
    for c in cells.values():
        for name in (Name.BRACKET_MISS, Name.CODE_MISMATCH, Name.GAP_MEAN, Name.GAP_MAX, Name.K3_KL,
                     Name.GUIDANCE_BYTES):
            assert name in METRICS and isinstance(c[name], float), (c["lag"], c["arm"], name)
        assert 0.0 <= c[Name.BRACKET_MISS] <= 1.0 and 0.0 <= c[Name.CODE_MISMATCH] <= 1.0
        # where the trainer is guided its code is a bracket member, so a rollout code outside is a mismatch
        guided = c if c["arm"] == "trace-full" else c["guided_layers"]
        if c["arm"] != "qat":
            assert guided["bracket_misses"] <= guided["mismatched"]
        assert c["rollout_version"] == report["steps"] - c["lag"] and c["trainer_version"] == report["steps"]
    assert report["environment"]["cpu_model"] and report["command"].startswith("tracefp4 mismatch --lag 0,1,2 --config")
    assert all(report["fp4_rollouts_identical"][f"{report['lrs'][0]:g}"].values())


@pytest.mark.slow  # the toy replay: a warm start, two GRPO steps, twelve rollouts (~25 s on 2 cores)
def test_lag_zero_full_codes_are_exact(report: dict) -> None:
    # (lsb and mod4 guide the deeper half only: the unguided layers before it drift, so their guided
    # layers can see misses even at lag 0, as the count3-8l replay shows; nothing exact to claim there)
    full = next(c for c in report["cells"] if c["lag"] == 0 and c["arm"] == "trace-full")
    assert full[Name.CODE_MISMATCH] == 0.0 and full[Name.BRACKET_MISS] == 0.0 and full["bracket_elements"] > 0
    assert full["guided_layers"][Name.BRACKET_MISS] == 0.0 and full["bracket_one_out"] == 0


@pytest.mark.slow  # the toy replay: a warm start, two GRPO steps, twelve rollouts (~25 s on 2 cores)
def test_mod4_detects_what_the_exact_count_says(report: dict) -> None:
    for c in report["cells"]:
        if c["arm"] != "trace-mod4":
            assert "detected" not in c
            continue
        g, det = c["guided_layers"], c["detected"]
        assert det["bracket_checked"] == g["bracket_elements"]  # every element of every guided site
        assert g["bracket_one_out"] <= det["bracket_misses"] <= g["bracket_misses"]


@pytest.mark.slow  # the toy replay: a warm start, two GRPO steps, twelve rollouts (~25 s on 2 cores)
def test_guidance_bytes_order(report: dict) -> None:
    by_arm = {c["arm"]: c[Name.GUIDANCE_BYTES] for c in report["cells"] if c["lag"] == 0}
    assert by_arm["qat"] == 0.0 < by_arm["trace-lsb"] < by_arm["trace-mod4"] < by_arm["trace-full"]


@pytest.mark.slow  # the toy replay: a warm start, two GRPO steps, twelve rollouts (~25 s on 2 cores)
def test_the_table_has_a_row_per_cell(report: dict) -> None:
    text = format_replay(report)
    rows = [line.split() for line in text.splitlines() if line.split()[2:3] == ["trace-mod4"]]
    assert [int(r[1]) for r in rows] == list(LAGS)


@pytest.mark.parametrize("lag, message", [
    ("0,x", r"'x' is not a whole number"),
    ("-1", r"lag -1 is negative"),
    ("1,1", r"lag 1 is given twice"),
    ("0,,3", r"an empty entry"),
    ("", r"give one or more lags"),
])  # fmt: skip
def test_bad_lags_are_refused(lag: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["mismatch", "--lag", lag, "--quiet"])
    with pytest.raises(ValueError, match=message):
        parse_lags(lag)


@pytest.mark.parametrize("extra, message", [
    (["--steps", "1"], r"--steps 1: the trajectory must reach the largest lag, 3"),
    (["--lrs", "0"], r"--lrs '0': learning rate 0 must be a finite number > 0"),
    (["--train-arm", "nope"], r"train_arm = 'nope': unknown arm 'nope'"),
    (["--sweep"], r"--lag and --sweep are two different measurements"),
    (["--layers", "2", "--batch", "3"], r"--layers, --batch set what the run config sets"),
    (["--config", "/no/such.toml"], r"--config /no/such.toml: no such file"),
])  # fmt: skip
def test_options_the_replay_cannot_take_are_refused(extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["mismatch", "--lag", "0,1,3", *extra, "--quiet"])


def test_replay_options_need_lag() -> None:
    with pytest.raises(SystemExit, match=r"--steps, --train-arm go with --lag"):
        main(["mismatch", "--steps", "3", "--train-arm", "qat", "--quiet"])


def test_a_run_config_on_other_processes_is_refused(tmp_path) -> None:
    path = tmp_path / "workers.toml"
    path.write_text(TINY_RUN.replace("threads = 1", "threads = 1\nrollout_workers = 2"))
    with pytest.raises(SystemExit, match=r"rollout_workers = 2: the replay runs our engine and the trainer in one"):
        main(["mismatch", "--lag", "0,1", "--config", str(path), "--quiet"])
