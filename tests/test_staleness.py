"""The asynchronous loop (tracefp4.rl.staleness): max_staleness 0 is the synchronous loop, bit for bit;
the fixed schedule trains step s on a rollout of the weights of version max(0, s - k), falls back to
nearest beyond the guidance lag bound, carries its pending batches through checkpoints, and a run
killed with SIGKILL at any moment resumes to the same weights and rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from killed_run import killed_and_reference, metric_rows
from rl_tiny import TINY, setup_arm

from tracefp4.engines.model import load_model
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutOutput
from tracefp4.engines.trainer import TrainerMode
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import make_arm
from tracefp4.pipeline.metrics import Name
from tracefp4.rl import loop
from tracefp4.rl.checkpoint import latest_checkpoint
from tracefp4.rl.collect import ArmSetup, collect
from tracefp4.rl.config import RLConfig
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.staleness import Pending, behaviour_version, decode_pending, encode_pending
from tracefp4.rl.tasks import Reverse
from tracefp4.rl.update import lag_arm, update


def _trajectories(step_dir: Path) -> dict:
    """What a store step holds, by trajectory: length, prompt length, tensor shapes and dtypes, and the
    sha256 of its tensor bytes (the shard files' own bytes are not compared: safetensors writes the
    header's metadata table in a random order)."""
    out = {}
    for m in sorted(step_dir.glob("*.manifest.json")):
        doc = json.loads(m.read_text())
        assert doc["step"] == int(step_dir.name.split("-")[1])
        out.update({tid: {**t, "shard": None, "policy_version": doc["policy_version"]}
                    for tid, t in doc["trajectories"].items()})
    return out


def _comparable(extra: dict[str, bytes]) -> dict:
    """A checkpoint's extra files with each store step's files replaced by its trajectories (see
    :func:`_trajectories`): what two runs that computed the same things have equal."""
    out: dict = {k: v for k, v in extra.items() if not k.startswith("store/")}
    for k, v in extra.items():
        if k.startswith("store/") and k.endswith(".manifest.json"):
            doc = json.loads(v)
            out[k] = {tid: {**t, "shard": None} for tid, t in doc["trajectories"].items()}
            out[k + ":version"] = (doc["step"], doc["policy_version"])
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _arm_setup(cfg: RLConfig, name: str, model, store: Path) -> ArmSetup:
    task = Reverse()
    arm = make_arm(name, guidance=cfg.guidance, n_layers=cfg.model.layers, plan=PrecisionPlan(),
                   quads_fraction=cfg.quads_fraction)
    return ArmSetup(name, arm, model, task, task.make_tokenizer(), cfg, store, steps.model_signature(model, arm.plan))


def test_lag_0_is_the_synchronous_loop(tmp_path, monkeypatch):
    """max_staleness = 0 runs the loop it ran before: each step collect (rollout, store, read back,
    score) then update, on the same weights. The run's train rows, its store steps and final weights
    equal those of that loop written out here from collect and update."""
    stored: dict[int, dict] = {}
    discard = loop.discard_step

    def capture(root, step):  # the loop discards each consumed store step: keep what it held first
        if (Path(root) / f"step-{step:08d}").is_dir():
            stored[step] = _trajectories(Path(root) / f"step-{step:08d}")
        return discard(root, step)

    monkeypatch.setattr(loop, "discard_step", capture)
    cfg = RLConfig(out=str(tmp_path), run_name="r", arms=("trace",), **{**TINY, "steps": 3})
    assert cfg.max_staleness == 0
    run_dir = loop.run(cfg)
    rows = metric_rows(run_dir, "trace")
    assert not any(k.startswith("staleness/") for r in rows for k in r)  # the rows of before: no new keys

    model = load_model(latest_checkpoint(loop.warm_start_dir(run_dir)).model_path)
    s = _arm_setup(cfg, "trace", model, tmp_path / "ref-store")
    opt = MasterWeightAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    ref_rows, ref_stored = [], {}
    for step in range(cfg.steps):
        batch = collect(s, step, step)
        ref_stored[step] = _trajectories(s.store_root / f"step-{step:08d}")
        stats = update(model, opt, s.arm, cfg, batch)
        ref_rows.append({"kind": "train", "step": step, "policy_version": step + 1, **batch.metrics, **stats})
    assert rows == ref_rows
    assert stored == ref_stored and len(stored) == cfg.steps
    final = load_model(latest_checkpoint(run_dir / "checkpoints" / "trace").model_path)
    mine = _weights(final)
    assert all(torch.equal(mine[k], v) for k, v in _weights(model).items())


def test_fixed_schedule_trains_on_the_rollouts_of_older_weights(tmp_path):
    """k = 2: steps 0, 1, 2 train on rollouts of the warm-start weights (their rollout-side metrics equal
    those of a rollout of step s with the warm-start weights), step 3 on those of version 1; lags
    0, 1, 2, 2; with guidance_max_lag = 1 the guided trainer falls back to nearest at lag 2."""
    k = 2
    cfg = RLConfig(out=str(tmp_path), run_name="r", arms=("trace",),
                   **{**TINY, "steps": 4, "eval_every": 2, "max_staleness": k, "guidance_max_lag": 1})
    run_dir = loop.run(cfg)
    rows = metric_rows(run_dir, "trace")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    lags = [min(s, k) for s in range(4)]
    assert [r[Name.LAG_MEAN] for r in rows] == lags and [r[Name.LAG_MAX] for r in rows] == lags
    n = cfg.prompts_per_step * cfg.group_size
    for r, lag in zip(rows, lags):
        generated = round(r["response_length"] * n)
        assert r[Name.LAG_GUIDED] + r[Name.LAG_FALLBACK] == generated > 0
        assert r[Name.LAG_FALLBACK] == (generated if lag > 1 else 0)

    base = load_model(latest_checkpoint(loop.warm_start_dir(run_dir)).model_path)
    s = _arm_setup(cfg, "trace", base, tmp_path / "ref-store")
    for step in range(k + 1):  # behaviour version 0: what the warm-start weights sample for step s
        assert behaviour_version(step, k) == 0
        ref = collect(s, step, 0).metrics
        for key in ("reward_mean", "response_length", "entropy", Name.GUIDANCE_BYTES):
            assert rows[step][key] == ref[key], (step, key)

    state = latest_checkpoint(run_dir / "checkpoints" / "trace").state
    assert state["pending"] == [[4, 2], [5, 3]]  # steps 4 and 5 were rolled out by versions 2 and 3


def test_a_run_extended_through_its_pending_batches_equals_the_longer_run(tmp_path):
    """A 2-step run's checkpoint carries the batches of steps 2 and 3 (rolled out by versions 0 and
    1); extending it to 4 steps trains on those very batches: the same rows and weights as 4 steps
    at once."""
    fields = {**TINY, "arms": ("qat", "trace-full"), "max_staleness": 2, "eval_every": 2}
    long = loop.run(RLConfig(out=str(tmp_path), run_name="long", **{**fields, "steps": 4}))
    short = loop.run(RLConfig(out=str(tmp_path), run_name="short", **{**fields, "steps": 2}))
    loop.run(RLConfig(out=str(tmp_path), run_name="short", resume=str(short), **{**fields, "steps": 4}))
    for arm in ("qat", "trace-full"):
        assert metric_rows(short, arm) == metric_rows(long, arm)
        assert metric_rows(short, arm, "eval") == metric_rows(long, arm, "eval")
        a, b = (latest_checkpoint(d / "checkpoints" / arm) for d in (short, long))
        assert a.step == b.step == 4 and a.state == b.state and _comparable(a.extra) == _comparable(b.extra)
        assert (a.path / "model.safetensors").read_bytes() == (b.path / "model.safetensors").read_bytes()
    assert metric_rows(long, "trace-full")[3][Name.CODE_MISMATCH] >= 0  # full codes read back from the restored store


def test_pending_batch_round_trip_is_exact(tmp_path):
    s = setup_arm(tmp_path, "trace-full")
    out = steps.rollout_step(s.serving, [[5, 6, 7], [8, 9]], _sampling(), s.arm, tmp_path / "store", read_back=False)
    p = Pending(7, 3, out.rollout, out.diagnostics)
    assert p.diagnostics is not None and p.diagnostics[0]
    back = decode_pending(encode_pending(p), s.arm, "here")
    assert (back.step, back.version) == (7, 3)
    r, q = p.rollout, back.rollout
    assert r.prompt_lens == q.prompt_lens and r.finish_reasons == q.finish_reasons
    assert len(r.top_ids) == len(q.top_ids) == 2
    pairs = [*zip(r.token_ids, q.token_ids), *zip(r.logprobs, q.logprobs), *zip(r.top_ids, q.top_ids),
             *zip(r.top_logprobs, q.top_logprobs)]
    for a, b in pairs:
        assert a.dtype == b.dtype and torch.equal(a, b)
    for da, db in zip(p.diagnostics, back.diagnostics):
        assert da.keys() == db.keys() and all(torch.equal(da[n], db[n]) for n in da)
    with pytest.raises(ValueError, match="here: not a pending batch"):
        decode_pending(safetensors.torch.save({"x": torch.zeros(1)}), s.arm, "here")


def _sampling():
    from tracefp4.engines.protocol import SamplingParams

    return SamplingParams(max_new_tokens=3, seed=0, top_logprobs=3)  # the sampler's top-k too (Score Centering)


def test_lag_arm_falls_back_to_nearest_beyond_the_bound():
    trace = make_arm("trace", guidance="lsb", n_layers=2)
    assert lag_arm(trace, 0, 0, 0) is trace and lag_arm(trace, 7, 4, 3) is trace
    fallback = lag_arm(trace, 8, 4, 3)
    assert fallback.trainer is TrainerMode.QAT
    assert dataclasses.replace(fallback, trainer=TrainerMode.TRACE) == trace  # nothing else changes
    qat = make_arm("qat", guidance="lsb", n_layers=2)
    assert lag_arm(qat, 9, 0, 0) is qat
    with pytest.raises(ValueError, match="trainer version 2 behind rollout version 3"):
        lag_arm(trace, 2, 3, 0)


def test_staleness_config_is_checked():
    assert RLConfig(max_staleness=3).guidance_lag_bound == 3
    assert RLConfig(max_staleness=3, guidance_max_lag=1).guidance_lag_bound == 1
    with pytest.raises(ValueError, match=r"guidance_max_lag = 4: expected at most max_staleness = 3"):
        RLConfig(max_staleness=3, guidance_max_lag=4).validate()
    with pytest.raises(ValueError, match=r"max_staleness = -1: expected a value >= 0"):
        RLConfig(max_staleness=-1).validate()
    with pytest.raises(ValueError, match=r"staleness_schedule = 'eager': expected one of 'fixed'"):
        RLConfig(staleness_schedule="eager").validate()
    with pytest.raises(ValueError, match=r"max_staleness = 1: expected 0 with trainer_world_size > 1"):
        RLConfig(max_staleness=1, trainer_world_size=2).validate()


FIELDS = """arms = ["trace"]
steps = 4
eval_every = 2
max_staleness = 2
"""
# Each resumed process counts its crash points from zero; in order: after step 2's update (the
# checkpoint of step 2 holds the batches of steps 2 and 3), with one of those two written back into
# the store, mid-rollout of step 4's batch, right after step 5's batch is sealed, mid-checkpoint.
KILLS = ["updated:3", "restored:1", "rollout:1", "sealed:2", "checkpoint:1"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_killed_fixed_schedule_run_resumes_to_the_same_weights(tmp_path):
    run, ref = killed_and_reference(tmp_path, FIELDS, KILLS)
    a, b = (latest_checkpoint(d / "checkpoints" / "trace") for d in (run, ref))
    assert a.step == b.step == 4 and a.state == b.state and _comparable(a.extra) == _comparable(b.extra)
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes()
    assert metric_rows(run, "trace") == metric_rows(ref, "trace")
    assert [r["step"] for r in metric_rows(run, "trace", "eval")] == [0, 2, 4]
    assert not list((run / "store").rglob("*.lock")) and not list((run / "store").rglob(".restore-*"))


def test_rollout_output_fields_are_the_ones_a_pending_batch_keeps():
    """A pending batch keeps every field of a rollout the scoring reads; a new RolloutOutput field must
    be decided on here (kept, or not needed after the store has the records)."""
    kept = {"token_ids", "prompt_lens", "logprobs", "finish_reasons", "top_ids", "top_logprobs"}
    # diagnostics: Pending's own; versions: the store keeps them beside the records (read back with them)
    not_needed = {"records", "diagnostics", "plan", "guidance", "timings", "stored", "versions"}
    assert {f.name for f in dataclasses.fields(RolloutOutput)} == kept | not_needed
