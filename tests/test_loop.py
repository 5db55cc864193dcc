"""The GRPO loop on a tiny model: the run folder, its metrics, checkpoints and resume, Ray rollout
workers, and one collect-then-update step."""

from __future__ import annotations

import json

import pytest
import torch
from rl_tiny import TINY, setup_arm

from tracefp4.engines.model import from_config
from tracefp4.rl.collect import Batch, collect
from tracefp4.rl.config import RLConfig
from tracefp4.rl.loop import run
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.tasks import CharTokenizer
from tracefp4.rl.update import update

REQUIRED = [
    "reward_mean", "accuracy", "response_length", "entropy", "rollout_corr/kl", "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_diff", "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max",
    "guidance_bytes_per_token", "guidance/decode_failures", "router_flip_rate", "grad_norm", "clip_frac",
    "time/rollout_s", "time/store_write_s", "time/store_read_s", "time/train_s",
]



@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cfg = RLConfig(out=str(out), run_name="t", arms=("bf16", "qat", "trace", "trace-full"), **TINY)
    threads = torch.get_num_threads()
    run_dir = run(cfg)
    assert torch.get_num_threads() == threads  # the library leaves the process's threads alone
    return run_dir



def test_run_folder_contents(tiny_run):
    for name in ["config.json", "summary.md", "plots/logprob_gap_max.png", "plots/reward.png",
                 "plots/eval_accuracy.png", "checkpoints/warm_start/step-00000000/config.json"]:
        assert (tiny_run / name).exists(), name
    for arm in ["bf16", "qat", "trace", "trace-full"]:
        rows = [json.loads(x) for x in (tiny_run / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        assert [r["step"] for r in train] == [0, 1]
        assert [r["step"] for r in evals] == [0, 1, 2]
        for key in REQUIRED:
            assert key in train[0], (arm, key)
        ck = tiny_run / "checkpoints" / arm / "step-00000002"
        assert (ck / "model.safetensors").exists() and (ck / "optimizer.safetensors").exists()
        assert json.loads((ck / "trainer_state.json").read_text())["state"]["policy_version"] == 2
    summary = (tiny_run / "summary.md").read_text()
    assert "| trace-full |" in summary and "max |Δlogp|" in summary



def test_arms_guidance_and_code_mismatch(tiny_run):
    def last(arm):
        rows = [json.loads(x) for x in (tiny_run / "metrics" / f"{arm}.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "train"][-1]

    assert last("bf16")["guidance_bytes_per_token"] == 0 and "code_mismatch_rate" not in last("bf16")
    assert last("qat")["guidance_bytes_per_token"] == 0  # vanilla QAT sends no guidance
    # trace-full: full hints on all layers > lsb hints on the deeper half
    assert last("trace-full")["guidance_bytes_per_token"] > last("trace")["guidance_bytes_per_token"] > 0
    # every layer guided with full information: the trainer reproduces every rollout code
    assert last("trace-full")["code_mismatch_rate"] == 0.0
    # the rollout's full codes (diagnostics, never stored) measure every FP4 arm's code mismatch
    assert last("qat")["code_mismatch_rate"] >= last("trace")["code_mismatch_rate"]
    assert all(last(a)["guidance/decode_failures"] == 0 for a in ["bf16", "qat", "trace", "trace-full"])



def test_same_prompts_and_samples_across_arms(tiny_run):
    # same seeds: the bf16 and fp4 arms see the same prompts; the fp4 arms sample identically at step 0
    rows = {a: [json.loads(x) for x in (tiny_run / "metrics" / f"{a}.jsonl").read_text().splitlines()]
            for a in ["qat", "trace", "trace-full"]}
    first = {a: [r for r in rs if r["kind"] == "train"][0] for a, rs in rows.items()}
    assert first["qat"]["reward_mean"] == first["trace"]["reward_mean"] == first["trace-full"]["reward_mean"]
    assert first["qat"]["response_length"] == first["trace"]["response_length"]



def test_resume_continues_from_checkpoints(tiny_run):
    cfg = RLConfig(resume=str(tiny_run), arms=("trace",), **{**TINY, "steps": 3})
    run(cfg)
    rows = [json.loads(x) for x in (tiny_run / "metrics" / "trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [0, 1, 2]
    state = json.loads((tiny_run / "checkpoints" / "trace" / "step-00000003" / "trainer_state.json").read_text())["state"]
    assert state["step"] == 3 and state["policy_version"] == 3



def test_master_weight_optimizer_round_trip():
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    opt = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    model(input_ids=torch.tensor([[1, 5, 6]]), labels=torch.tensor([[1, 5, 6]])).loss.backward()
    before = next(model.parameters()).detach().clone()
    opt.step()
    assert not torch.equal(before, next(model.parameters()))
    assert next(model.parameters()).dtype == torch.bfloat16 and opt.master[0].dtype == torch.float32
    state = opt.state_tensors()
    opt2 = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    opt2.load_state_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(opt.master, opt2.master))



@pytest.mark.slow
@pytest.mark.ray
def test_ray_rollout_workers(tmp_path):
    # two worker processes write their own shards; the driver seals; the trainer reads the store
    pytest.importorskip("ray", reason="ray not installed")
    cfg = RLConfig(out=str(tmp_path), run_name="ray", arms=("trace-full",), rollout_workers=2,
                   **{**TINY, "steps": 1, "eval_every": 5})
    run_dir = run(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics" / "trace-full.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1
    assert train[0]["code_mismatch_rate"] == 0.0  # full records came through the store from two writers
    assert train[0]["guidance_bytes_per_token"] > 0



def test_collect_then_update(tmp_path):
    s = setup_arm(tmp_path, "trace-full")
    batch = collect(s, step=0, version=0)
    assert isinstance(batch, Batch)
    n = s.cfg.prompts_per_step * s.cfg.group_size
    assert len(batch.token_ids) == len(batch.records) == n and batch.rewards.shape == batch.advantages.shape == (n,)
    assert batch.logp_old.shape == batch.logp_rollout.shape == batch.mask.shape == (n, batch.width)
    assert batch.metrics["code_mismatch_rate"] == 0.0 and batch.metrics["guidance_bytes_per_token"] > 0
    assert {"time/rollout_s", "time/store_write_s", "time/store_read_s"} <= set(batch.timings)
    batch.advantages = torch.tensor([1.0, -1.0] * (n // 2))  # an untrained policy's rewards tie: give it signal
    opt = MasterWeightAdamW(s.model, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    before = [p.detach().clone() for p in s.model.parameters()]
    stats = update(s.model, opt, s.arm, s.cfg, batch)
    assert {"grad_norm", "clip_frac", "is_weight_mean"} <= set(stats)
    assert any(not torch.equal(a, b) for a, b in zip(before, s.model.parameters()))

