"""A GRPO run killed with a real SIGKILL at several moments and resumed each time ends with the same
weights, bit for bit, as an uninterrupted run, and with exactly one metrics row per step.

The kills are placed with crash points (:mod:`tracefp4.faults`): mid-rollout, with a store writer
half done, right after a step is sealed, after an update (weights moved in memory only), and with a
checkpoint half written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
CONFIG = """
task = "reverse"
arms = ["qat", "trace"]
steps = 3
prompts_per_step = 2
group_size = 2
max_new_tokens = 4
updates_per_step = 2
warm_start_steps = 2
warm_start_batch = 8
eval_every = 1
eval_size = 4
threads = 1
[model]
hidden = 32
layers = 2
moe_intermediate = 16
"""
KILLS = ["rollout:2", "store-write:3", "sealed:2", "checkpoint:2", "updated:1"]


def _train_argv(cfg: Path, *extra: str, crash: str | None = None) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEFP4_CRASH_AT", "TRACEFP4_DEBUG")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    if crash:
        env["TRACEFP4_CRASH_AT"] = crash
    return [sys.executable, "-m", "tracefp4", "train", "--config", str(cfg), *extra], env


def _train(cfg: Path, *extra: str, crash: str | None = None) -> subprocess.CompletedProcess:
    argv, env = _train_argv(cfg, *extra, crash=crash)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def _final(run: Path) -> dict[str, bytes]:
    out = {}
    for arm in ("qat", "trace"):
        ck = run / "checkpoints" / arm / "step-00000003"
        for name in ("model.safetensors", "optimizer.safetensors"):
            out[f"{arm}/{name}"] = (ck / name).read_bytes()
    return out


def _rows(run: Path, arm: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.slow
@pytest.mark.subprocess
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path):
    # the uninterrupted run shares nothing with the killed one (its own config file and run folder; one
    # thread each), so it runs beside the kills instead of before them
    ref_cfg = tmp_path / "ref.toml"
    ref_cfg.write_text(f'out = "{tmp_path}"\nrun_name = "ref"\n' + CONFIG)
    argv, env = _train_argv(ref_cfg)
    ref_log = tmp_path / "ref.stderr"  # a file, not a pipe: nothing reads it until the kills are done
    with ref_log.open("w") as err, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err) as ref:
        try:
            cfg = tmp_path / "run.toml"
            cfg.write_text(f'out = "{tmp_path}"\nrun_name = "killed"\n' + CONFIG)
            run = tmp_path / "killed"
            for i, crash in enumerate(KILLS):
                proc = _train(cfg, *(["--resume", str(run)] if i else []), crash=crash)
                assert proc.returncode == -signal.SIGKILL, (crash, proc.returncode, proc.stderr[-2000:])
            done = _train(cfg, "--resume", str(run))
            assert done.returncode == 0, done.stderr[-2000:]
            ref.wait(timeout=600)
        finally:
            if ref.poll() is None:  # a failed kill above: the reference run is not waited for
                ref.kill()
    assert ref.returncode == 0, ref_log.read_text()[-2000:]

    assert _final(run) == _final(tmp_path / "ref")
    for arm in ("qat", "trace"):
        rows = _rows(run, arm)
        assert [r["step"] for r in rows if r["kind"] == "train"] == [0, 1, 2]
        assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2, 3]
        assert rows == _rows(tmp_path / "ref", arm)
    assert not list((run / "store").rglob("*.lock"))  # nothing a dead writer left survives
