"""A tiny GRPO run killed with a real SIGKILL at crash points (:mod:`tracefp4.faults`) and resumed each
time, beside the same run left alone (tests/test_crash_resume.py, tests/test_staleness.py): their
config, the ``tracefp4 train`` processes, and the metrics rows the two runs are compared by."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: the fields every killed run shares; a test adds its own (arms, steps, ...) between the two
TOP = """task = "reverse"
prompts_per_step = 2
group_size = 2
max_new_tokens = 4
updates_per_step = 2
warm_start_steps = 2
warm_start_batch = 8
eval_size = 4
threads = 1
"""
MODEL = """[model]
hidden = 32
layers = 2
moe_intermediate = 16
"""


def train_argv(cfg: Path, *extra: str, crash: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The ``tracefp4 train --config cfg`` command and its environment, one thread, killed at ``crash``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEFP4_CRASH_AT", "TRACEFP4_DEBUG")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    if crash:
        env["TRACEFP4_CRASH_AT"] = crash
    return [sys.executable, "-m", "tracefp4", "train", "--config", str(cfg), *extra], env


def train(cfg: Path, *extra: str, crash: str | None = None) -> subprocess.CompletedProcess:
    """:func:`train_argv` run to its end (or its kill)."""
    argv, env = train_argv(cfg, *extra, crash=crash)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def killed_and_reference(tmp_path: Path, fields: str, kills: Sequence[str]) -> tuple[Path, Path]:
    """The run of :data:`TOP` + ``fields`` + :data:`MODEL` twice under ``tmp_path``: ``killed``, killed at
    each crash point of ``kills`` in turn (each resumed process counts its crash points from zero) and
    then resumed to its end, and ``ref``, left alone. Returns (killed, ref) once both have finished;
    asserts every kill was a SIGKILL and both runs ended with status 0."""
    config = TOP + fields + MODEL
    # the uninterrupted run shares nothing with the killed one (its own config file and run folder; one
    # thread each), so it runs beside the kills instead of before them
    ref_cfg = tmp_path / "ref.toml"
    ref_cfg.write_text(f'out = "{tmp_path}"\nrun_name = "ref"\n' + config)
    argv, env = train_argv(ref_cfg)
    ref_log = tmp_path / "ref.stderr"  # a file, not a pipe: nothing reads it until the kills are done
    with ref_log.open("w") as err, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err) as ref:
        try:
            cfg = tmp_path / "run.toml"
            cfg.write_text(f'out = "{tmp_path}"\nrun_name = "killed"\n' + config)
            run = tmp_path / "killed"
            for i, crash in enumerate(kills):
                proc = train(cfg, *(["--resume", str(run)] if i else []), crash=crash)
                assert proc.returncode == -signal.SIGKILL, (crash, proc.returncode, proc.stderr[-2000:])
            done = train(cfg, "--resume", str(run))
            assert done.returncode == 0, done.stderr[-2000:]
            ref.wait(timeout=600)
        finally:
            if ref.poll() is None:  # a failed kill above: the reference run is not waited for
                ref.kill()
    assert ref.returncode == 0, ref_log.read_text()[-2000:]
    return run, tmp_path / "ref"


def metric_rows(run: Path, arm: str, kind: str | None = "train") -> list[dict]:
    """The rows of ``kind`` (every row: None) in ``arm``'s metrics file, without their timings (``time/*``:
    the one thing two runs that computed the same differ in)."""
    rows = [json.loads(line) for line in (run / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if kind in (None, r["kind"])]
