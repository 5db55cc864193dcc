"""Each arm of the table on a tiny model: what its rollout records, what it keeps for diagnostics, and
one GRPO step of every baseline and ablation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from rl_tiny import TINY, setup_arm

from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import make_arm
from tracefp4.rl.collect import collect
from tracefp4.rl.config import RLConfig
from tracefp4.rl.loop import run
from tracefp4.rl.tasks import CharTokenizer


def test_each_arm_records_only_what_it_uses():
    """bf16 and qat store routing only; trace stores its own mode's records (the real lsb recording
    path); the full codes that measure the code mismatch stay in memory as diagnostics."""
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    n_layers = TINY["model"].layers
    for name in ("bf16", "qat", "trace", "trace-full"):
        arm = make_arm(name, guidance="lsb", n_layers=n_layers)
        roll, diagnostics = steps.rollout(HomeEngine(model), prompts, sampling, arm)
        kinds = {k.split(".", 2)[-1] if not k.endswith(".routing") else "routing" for k in roll.records[0]}
        expected = {"bf16": {"routing"}, "qat": {"routing"}, "trace": {"routing", "bits", "scales", "global_amax"},
                    "trace-full": {"routing", "codes", "scales", "global_amax"}}[name]
        assert kinds == expected, name
        assert (diagnostics is None) == (name == "bf16")
        if diagnostics is not None:
            layers = {int(k[1:3]) for k in diagnostics[0]}
            assert layers == set(arm.diagnostics) and all(not k.endswith(".routing") for k in diagnostics[0])



def test_arm_table():
    qat, trace = make_arm("qat", guidance="lsb", n_layers=4), make_arm("trace", guidance="lsb@all", n_layers=4)
    full, bf16 = make_arm("trace-full", guidance="lsb", n_layers=4), make_arm("bf16", guidance="lsb", n_layers=4)
    assert bf16.plan is None and bf16.guidance is None and bf16.diagnostics == frozenset()
    assert qat.guidance is None and qat.diagnostics == {2, 3} and qat.trainer == "qat"
    assert trace.guidance.name == "lsb@all" and trace.diagnostics == {0, 1, 2, 3}
    assert full.guidance.name == "full" and full.diagnostics == {0, 1, 2, 3}
    assert type(trace).from_dict(json.loads(json.dumps(trace.to_dict()))) == trace



def test_trace_arm_records_in_its_configured_mode(tmp_path):
    lsb = collect(setup_arm(tmp_path / "a", "trace", "lsb"), step=0, version=0)
    compact = collect(setup_arm(tmp_path / "b", "trace", "lsb+parity+amax:lo3"), step=0, version=0)
    assert any(k.endswith(".bits") for k in lsb.records[0])
    assert set(compact.records[0]) != set(lsb.records[0])  # the compact record reached the trainer as is
    assert 0 < compact.metrics["guidance_bytes_per_token"]
    assert torch.equal(compact.rewards, lsb.rewards)  # what is recorded does not change what is sampled



ALL_ARMS = ("bf16", "qat", "trace", "trace-full", "fp4-rollout", "qat-4over6", "trace-4over6", "trace-L1",
            "trace-ldpc", "qat-mxfp4", "trace-mxfp4", "qat-w4a8", "trace-w4a8")



def test_every_arm_runs_one_step(tmp_path):
    """The demo with every arm, one step each on a tiny model (head_dim 32: MXFP4 blocks are 32 wide)."""
    spec = dataclasses.replace(TINY["model"], head_dim=32)
    cfg = RLConfig(out=str(tmp_path), run_name="all", arms=ALL_ARMS, **{
        **TINY, "model": spec, "steps": 1, "warm_start_steps": 2, "updates_per_step": 1})
    run_dir = run(cfg)
    for arm in ALL_ARMS:
        rows = [json.loads(x) for x in (run_dir / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        assert len(train) == 1 and len(evals) == 2, arm
        bytes_per_token = train[0]["guidance_bytes_per_token"]
        assert (bytes_per_token > 0) == arm.startswith("trace"), (arm, bytes_per_token)
        # Only an ldpc knob can fail to decode (lsb, full, parity and the scales/amax fields are read
        # exactly). LDPC's syndrome resolves the rollout's bits from the trainer's own values, and no
        # bound keeps those on the rollout's side of every midpoint on every CPU's addition order: its
        # failed blocks are counted and fall back to round to nearest (tests/test_compact.py's
        # test_an_undecodable_*_block_* check the fallback and the count), so a count, not 0.
        failures = train[0]["guidance/decode_failures"]
        assert isinstance(failures, int) and (failures == 0 or "ldpc" in arm) and failures >= 0, (arm, failures)
        post_hoc = all("eval_accuracy_fp4" in e and "eval_accuracy_fp4_4over6" in e for e in evals)
        assert post_hoc == (arm == "bf16"), arm



def test_baseline_and_ablation_arms():
    n_layers = TINY["model"].layers  # 2
    l1 = make_arm("trace-L1", guidance="lsb", n_layers=n_layers)
    assert l1.guidance.name == "lsb@last1" and l1.diagnostics == {1} and l1.trainer == "trace"
    assert make_arm("trace-L2", guidance="lsb", n_layers=n_layers).guidance.layer_indices(n_layers) == {0, 1}
    fp4r = make_arm("fp4-rollout", guidance="lsb", n_layers=n_layers)
    assert fp4r.trainer == "bf16" and fp4r.plan is not None and fp4r.guidance is None and not fp4r.diagnostics
    assert make_arm("trace-4over6", guidance="lsb", n_layers=4).plan.nvfp4_scale == "4over6"
    assert make_arm("qat-w4a8", guidance="lsb", n_layers=4).plan.activations == "fp8"
    assert make_arm("trace-mxfp4", guidance="lsb", n_layers=4).plan.site_format("k") == "mxfp4"
    assert make_arm("trace-ldpc", guidance="lsb", n_layers=4).guidance.name == "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"
    for arm in ("trace-4over6", "trace-w4a8", "trace-L1"):
        a = make_arm(arm, guidance="lsb", n_layers=4)
        assert type(a).from_dict(json.loads(json.dumps(a.to_dict()))) == a
    with pytest.raises(ValueError, match="trace-L9"):
        make_arm("trace-L9", guidance="lsb", n_layers=n_layers)
    for bad in ("trace-L0", "trace-L01", "trace-Lx"):
        with pytest.raises(ValueError, match=bad):
            make_arm(bad, guidance="lsb", n_layers=n_layers)
    with pytest.raises(ValueError, match="trace-L9"):
        RLConfig(arms=("trace-L9",), **TINY).validate()
    with pytest.raises(ValueError, match="block scales recorded in full"):  # parity scales assume amax_b / 6
        make_arm("trace", guidance="lsb+parity", n_layers=4, plan=PrecisionPlan.four_over_six())
    with pytest.raises(ValueError, match="multiples of 32"):
        RLConfig(arms=("qat-mxfp4",), **TINY).validate()



def test_trace_l1_records_only_the_last_layer():
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    arm = make_arm("trace-L1", guidance="lsb", n_layers=TINY["model"].layers)
    roll, diagnostics = steps.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1), arm)
    guided = {int(k[1:3]) for k in roll.records[0] if not k.endswith(".routing")}
    routed = {int(k[1:3]) for k in roll.records[0] if k.endswith(".routing")}
    assert guided == {1} and routed == {0, 1}
    assert {int(k[1:3]) for k in diagnostics[0]} == {1}
    # W4A8: the FP8 expert activations are guided too (E4M3 codes), beside the NVFP4 KV cache
    arm = make_arm("trace-w4a8", guidance="lsb", n_layers=TINY["model"].layers)
    roll, _ = steps.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1), arm)
    rec = roll.records[0]
    assert {k.split(".")[1] for k in rec if not k.endswith(".routing")} == {"k", "v", "expert_in", "expert_mid"}
    assert rec["L01.expert_in.scales"].dtype == torch.float32 and rec["L01.k.scales"].dtype == torch.float8_e4m3fn

