"""A GRPO run killed with a real SIGKILL at several moments and resumed each time ends with the same
weights, bit for bit, as an uninterrupted run, and with exactly one metrics row per step.

The kills are placed with crash points (:mod:`tracefp4.faults`): mid-rollout, with a store writer
half done, right after a step is sealed, after an update (weights moved in memory only), and with a
checkpoint half written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from killed_run import killed_and_reference, metric_rows

FIELDS = """arms = ["qat", "trace"]
steps = 3
eval_every = 1
"""
KILLS = ["rollout:2", "store-write:3", "sealed:2", "checkpoint:2", "updated:1"]


def _final(run: Path) -> dict[str, bytes]:
    out = {}
    for arm in ("qat", "trace"):
        ck = run / "checkpoints" / arm / "step-00000003"
        for name in ("model.safetensors", "optimizer.safetensors"):
            out[f"{arm}/{name}"] = (ck / name).read_bytes()
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path):
    run, ref = killed_and_reference(tmp_path, FIELDS, KILLS)

    assert _final(run) == _final(ref)
    for arm in ("qat", "trace"):
        rows = metric_rows(run, arm, None)
        assert [r["step"] for r in rows if r["kind"] == "train"] == [0, 1, 2]
        assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2, 3]
        assert rows == metric_rows(ref, arm, None)
    assert not list((run / "store").rglob("*.lock"))  # nothing a dead writer left survives
