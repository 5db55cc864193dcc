"""The GRPO loop on a tiny model: collect/update, run folder, metrics, checkpoints, resume, config
files and their validation, the guidance mode, a task bringing its own tokenizer."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine
from tracefp4.rl import engine
from tracefp4.rl.arms import make_arm
from tracefp4.rl.collect import ArmSetup, Batch, collect
from tracefp4.rl.config import ModelSpec, RLConfig
from tracefp4.rl.loop import model_signature, run
from tracefp4.rl.optim import MasterWeightAdamW
from tracefp4.rl.tasks import TASKS, CharTokenizer, Example, Reverse
from tracefp4.rl.update import update

TINY = dict(
    steps=2, warm_start_steps=3, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=1,
    eval_size=4, updates_per_step=2, threads=3,
    model=ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1),
)

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


def test_each_arm_records_only_what_it_uses():
    """bf16 and qat store routing only; trace stores its own mode's records (the real lsb recording
    path); the full codes that measure the code mismatch stay in memory as diagnostics."""
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    n_layers = TINY["model"].layers
    for name in ("bf16", "qat", "trace", "trace-full"):
        arm = make_arm(name, guidance="lsb", n_layers=n_layers)
        roll, diagnostics = engine.rollout(HomeEngine(model), prompts, sampling, arm)
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


def test_config_files(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('task = "addition"\narms = ["bf16", "trace"]\nsteps = 5\n[model]\nhidden = 32\n')
    cfg = RLConfig.from_file(str(p))
    assert cfg.task == "addition" and cfg.arms == ("bf16", "trace") and cfg.model.hidden == 32
    p.write_text('stepz = 5\n')
    with pytest.raises(ValueError, match=r"c.toml: unknown config keys \['stepz'\]"):
        RLConfig.from_file(str(p))
    p.write_text('arms = ["fp3"]\n')
    with pytest.raises(ValueError, match="unknown arm 'fp3'"):
        RLConfig.from_file(str(p))
    p.write_text('steps = "ten"\n')
    with pytest.raises(ValueError, match=r"c.toml: steps = 'ten': expected an integer"):
        RLConfig.from_file(str(p))
    p.write_text('guidance = "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"\n')
    assert RLConfig.from_file(str(p)).guidance == "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"model": {"hidden": 32, "depth": 3}}))
    with pytest.raises(ValueError, match=r"unknown model keys \['depth'\]"):
        RLConfig.from_file(str(j))


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


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml", reason="PyYAML not installed")
    p = tmp_path / "c.yaml"
    p.write_text("task: reverse\narms: [qat]\nmodel: {hidden: 32}\n")
    cfg = RLConfig.from_file(str(p))
    assert cfg.arms == ("qat",) and cfg.model.hidden == 32


@pytest.mark.parametrize("field, value, expected", [
    ("steps", "ten", "expected an integer"),
    ("steps", -1, "expected a value >= 0"),
    ("steps", True, "expected an integer"),
    ("lr", "fast", "expected a number"),
    ("lr", 0, "expected a value > 0"),
    ("eval_every", 0, "expected a value >= 1"),
    ("threads", 0, "expected a value >= 1"),
    ("prompts_per_step", 0, "expected a value >= 1"),
    ("group_size", 1, "expected a value >= 2"),
    ("top_p", 1.5, "expected a value <= 1"),
    ("arms", "bf16", "expected a list of strings"),
    ("arms", (), "expected at least one of"),
    ("arms", ("bf16", "bf16"), "each arm at most once"),
    ("task", "sorting", "expected a registered task"),
    ("task_kwargs", {"digitz": 2}, "expected keyword arguments of task 'reverse'"),
    ("guidance", "lsbx", "expected a guidance mode"),
    ("guidance", "lsb@some", "expected a guidance mode"),
    ("loss_agg", "mean", "expected one of"),
    ("normalize_std", 1, "expected true or false"),
    ("run_name", 5, "expected a string or null"),
    ("updates_per_step", 3, "expected a divisor of prompts_per_step"),
    ("model.hidden", 40, "expected a multiple of 16"),
    ("model.head_dim", 8, "expected a value >= 16"),
    ("model.moe_intermediate", 24, "expected a multiple of 16"),
    ("model.top_k", 9, "expected at most model.experts"),
    ("model.kv_heads", 3, "expected a divisor of model.heads"),
])
def test_config_validation_names_field_value_and_expectation(field, value, expected):
    cfg = RLConfig()
    if field.startswith("model."):
        cfg.model = dataclasses.replace(cfg.model, **{field[len("model."):]: value})
    else:
        setattr(cfg, field, value)
    with pytest.raises(ValueError) as e:
        cfg.validate()
    msg = str(e.value)
    assert msg.startswith(f"{field} = {value!r}: ") and expected in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="expected"):  # run() checks before any work: no run folder
        run(dataclasses.replace(cfg, out="/nonexistent/never-created"))
    assert not Path("/nonexistent/never-created").exists()


def test_config_accepts_ints_for_floats_and_every_documented_field():
    cfg = RLConfig.from_dict({"lr": 1, "arms": ["trace"], "guidance": "lsb+parity+amax:lo3"})
    assert cfg.lr == 1 and cfg.arms == ("trace",)
    for f in [*dataclasses.fields(RLConfig), *dataclasses.fields(ModelSpec)]:
        assert f.metadata.get("help"), f.name


class CopyTask:
    """A task over letters that the default character tokenizer does not know."""

    name = "copy"

    def make_tokenizer(self):
        return CharTokenizer("abc=")

    def sample(self, rng, n):
        return [Example(s + "=", s) for s in ("".join(rng.choice("abc") for _ in range(3)) for _ in range(n))]

    def reward(self, example, completion):
        return float(completion == example.answer)

    def eval_set(self, n=128):
        return self.sample(random.Random(1), n)


def test_a_task_brings_its_own_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "copy", CopyTask)
    cfg = RLConfig(out=str(tmp_path), run_name="copy", task="copy", arms=("trace",),
                   **{**TINY, "steps": 1, "eval_every": 1})
    run_dir = run(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics" / "trace.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["eval", "train", "eval"]


def _setup(tmp_path, arm: str, guidance: str = "lsb") -> ArmSetup:
    cfg = RLConfig(**{**TINY, "guidance": guidance})
    task = Reverse()
    tok = task.make_tokenizer()
    model = from_config(cfg.model.hf_config(tok), seed=0)
    a = make_arm(arm, guidance=cfg.guidance, n_layers=cfg.model.layers)
    return ArmSetup(arm, a, model, task, tok, cfg, tmp_path / "store", model_signature(model, a.plan), None)


def test_collect_then_update(tmp_path):
    s = _setup(tmp_path, "trace-full")
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


def test_trace_arm_records_in_its_configured_mode(tmp_path):
    lsb = collect(_setup(tmp_path / "a", "trace", "lsb"), step=0, version=0)
    compact = collect(_setup(tmp_path / "b", "trace", "lsb+parity+amax:lo3"), step=0, version=0)
    assert any(k.endswith(".bits") for k in lsb.records[0])
    assert set(compact.records[0]) != set(lsb.records[0])  # the compact record reached the trainer as is
    assert 0 < compact.metrics["guidance_bytes_per_token"]
    assert torch.equal(compact.rewards, lsb.rewards)  # what is recorded does not change what is sampled


# --- every baseline and ablation of the paper as an arm -------------------------------------------

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
        assert train[0]["guidance/decode_failures"] == 0, arm
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
    roll, diagnostics = engine.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1), arm)
    guided = {int(k[1:3]) for k in roll.records[0] if not k.endswith(".routing")}
    routed = {int(k[1:3]) for k in roll.records[0] if k.endswith(".routing")}
    assert guided == {1} and routed == {0, 1}
    assert {int(k[1:3]) for k in diagnostics[0]} == {1}
    # W4A8: the FP8 expert activations are guided too (E4M3 codes), beside the NVFP4 KV cache
    arm = make_arm("trace-w4a8", guidance="lsb", n_layers=TINY["model"].layers)
    roll, _ = engine.rollout(HomeEngine(model), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1), arm)
    rec = roll.records[0]
    assert {k.split(".")[1] for k in rec if not k.endswith(".routing")} == {"k", "v", "expert_in", "expert_mid"}
    assert rec["L01.expert_in.scales"].dtype == torch.float32 and rec["L01.k.scales"].dtype == torch.float8_e4m3fn
