"""The pieces every consumer of the pipeline shares: the seed helper and trajectory ids, the engine
factory, the rollout step into the store and the grouped code-mismatch count."""

from __future__ import annotations

import pytest
import torch

from tracefp4.engines.model import from_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine
from tracefp4.engines.sink import StoreTarget
from tracefp4.engines.trainer import code_mismatch
from tracefp4.formats import pack_fp4
from tracefp4.guidance.store import StoreWriter, discard_step
from tracefp4.pipeline import steps
from tracefp4.pipeline.arms import make_arm
from tracefp4.pipeline.factory import EngineKind, make_engine, supports
from tracefp4.rl.tasks import CharTokenizer
from tracefp4.seeds import Stream, TrajectoryIds, derive, trajectory_ids

from rl_tiny import TINY


@pytest.mark.parametrize("seed", [0, 1, 17, 2**20])
def test_derive_keeps_every_stream_formula(seed):
    # the formulas the call sites used before the helper existed: a run's prompts, samples and
    # minibatch order must not change with it
    for step in (0, 1, 99):
        assert derive(seed, Stream.PROMPTS, step) == seed * 1_000_003 + step
        assert derive(seed, Stream.SAMPLING, step) == seed * 7_919 + step
        assert derive(seed, Stream.WORKER, step) == seed * 1009 + step
        assert derive(seed, Stream.MINIBATCH, step) == seed + step
        for rank in (0, 3):
            assert derive(seed, Stream.GENERATION, step, rank) == (seed * 1_000_003 + step * 7_919 + rank * 104_729) % 2**31
    assert derive(seed, Stream.WARM_START) == seed + 7919


def test_derive_refuses_the_wrong_number_of_keys():
    with pytest.raises(ValueError, match="seed stream generation: expected 2 integer key"):
        derive(0, Stream.GENERATION, 5)
    with pytest.raises(ValueError, match="seed stream warm_start: expected 0"):
        derive(0, Stream.WARM_START, 1)


def test_trajectory_ids_per_scheme():
    assert trajectory_ids(TrajectoryIds.LOOP, 2, step=7) == ["s000007-0000", "s000007-0001"]
    assert trajectory_ids(TrajectoryIds.TRL, 2, step=3, rank=1) == ["g000003-r1-00000", "g000003-r1-00001"]
    assert trajectory_ids(TrajectoryIds.REPORT, 1) == ["traj-00000"]


def test_engine_kind_and_factory():
    assert EngineKind.parse("home") is EngineKind.HOME and EngineKind.parse(EngineKind.VLLM) is EngineKind.VLLM
    with pytest.raises(ValueError, match=r"trace_engine = 'sglang': expected one of home, vllm"):
        EngineKind.parse("sglang", "trace_engine")
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    home = make_engine("home", model, pad_token_id=0)
    assert isinstance(home, HomeEngine) and home.model is model and home.pad_token_id == 0
    # one kind per engine class; the benchmarks' vLLM baselines serve no plan, and a run offers the two that serve arms
    assert EngineKind.names() == ("home", "vllm", "vllm-bf16", "vllm-fp8kv", "vllm-per-plan")
    assert EngineKind.names(serving=True) == ("home", "vllm")
    with pytest.raises(ValueError, match=r"engine = 'vllm-bf16': expected one of home, vllm$"):
        EngineKind.parse("vllm-bf16", serving=True)
    fp4 = PrecisionPlan()
    assert supports("vllm", fp4) and supports("home", fp4) and supports("vllm-per-plan", fp4)
    assert not supports("vllm-bf16", fp4) and not supports("vllm-fp8kv", fp4) and supports("vllm-bf16", None)
    with pytest.raises(ValueError, match=r"engine 'vllm-fp8kv' serves vLLM's own numerics, not the precision plan"):
        make_engine("vllm-fp8kv", checkpoint=".", plan=fp4)
    with pytest.raises(ValueError, match="engine 'home' runs on the model object"):
        make_engine("home")


def test_rollout_step_discards_seals_and_reads_back(tmp_path):
    """What comes back from the store is the engine's own records, bit for bit; a stale, unsealed
    step left by an interrupted run is discarded first."""
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    arm = make_arm("trace-full", guidance="lsb", n_layers=TINY["model"].layers)
    in_memory, diagnostics = steps.rollout(HomeEngine(model), prompts, sampling, arm)
    # an interrupted writer of the same name: its lock would refuse the new writer
    stale = StoreWriter(tmp_path, 2, "w0", model_signature="other", policy_version=0,  # noqa: F841 (never closed)
                        contract="other")
    target = StoreTarget(str(tmp_path), 2, "w0", ("a", "b"), "sig", 5)
    out = steps.rollout_step(HomeEngine(model), prompts, sampling, arm, target)
    assert out.rollout.records == [] and set(out.timings) == {"time/rollout_s", "time/store_write_s", "time/store_read_s"}
    assert all(torch.equal(x, y) for x, y in zip(out.rollout.token_ids, in_memory.token_ids))
    for got, want in zip(out.records, in_memory.records):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for got, want in zip(out.diagnostics, diagnostics):
        assert all(torch.equal(got[k], want[k]) for k in want)
    # an engine on a model whose version it was never told: its rows are at the target's version
    assert [v.tolist() for v in out.versions] == [[5] * t.numel() for t in out.rollout.token_ids]
    assert discard_step(tmp_path, 2)  # sealed: the step is there


def test_rollout_step_of_a_plan_and_a_guidance_mode_is_the_arms(tmp_path):
    """``rollout_step(plan=, guidance=, target=folder)``: the records of the table's arm of that plan and
    guidance, in step 0 of the folder; an arm and a plan at once are refused."""
    model = from_config(TINY["model"].hf_config(CharTokenizer()), seed=0)
    prompts, sampling = [[1, 5, 6, 7], [1, 8, 9]], SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    arm = make_arm("trace", guidance="lsb", n_layers=TINY["model"].layers)
    by_arm = steps.rollout_step(HomeEngine(model), prompts, sampling, arm, StoreTarget(
        str(tmp_path / "a"), 0, "w0", trajectory_ids(TrajectoryIds.REPORT, 2), "sig", 0))
    by_plan = steps.rollout_step(make_engine("home", model), prompts, sampling, plan=PrecisionPlan(), guidance="lsb",
                                 target=tmp_path / "b")
    assert steps.step_arm(PrecisionPlan(), "lsb").trainer == arm.trainer == "trace"
    for got, want in zip(by_plan.records, by_arm.records):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert discard_step(tmp_path / "b", 0)  # sealed: the step is there
    with pytest.raises(ValueError, match="arm 'trace' names its plan"):
        steps.rollout_step(make_engine("home", model), prompts, sampling, arm, tmp_path / "c", plan=PrecisionPlan())


def test_code_mismatch_grouped_by_layer_and_position():
    # two sites, rows are positions; FP4 codes 0..7 positive, 8..15 negative (signed line -7..7)
    mine = torch.tensor([[1, 2, 3, 4], [0, 0, 9, 2]], dtype=torch.uint8)  # 9 is -1
    ref = torch.tensor([[1, 3, 3, 6], [0, 8, 1, 2]], dtype=torch.uint8)  # 8 is -0, the same codeword as +0
    scales = torch.ones(2, 1).to(torch.float8_e4m3fn)  # an NVFP4 record's block scales (one block per row)
    codes = [{"L00.k": pack_fp4(mine), "L01.v": pack_fp4(ref)}]
    diag = [{"L00.k.codes": pack_fp4(ref), "L00.k.scales": scales, "L01.v.codes": pack_fp4(ref), "L01.v.scales": scales}]
    by_site = code_mismatch(codes, diag)
    assert (by_site["L00.k"].mismatched, by_site["L00.k"].one_apart, by_site["L00.k"].total) == (3, 1, 8)
    assert by_site["L01.v"].mismatched == 0
    grouped = code_mismatch(codes, diag, by=("layer", "position"), prompt_lens=[1],
                            position_key=lambda pos, plen: "prompt" if pos < plen else "completion")
    layer, pos = grouped["layer"], grouped["position"]
    assert (layer["L00"].mismatched, layer["L00"].total, layer["L01"].mismatched) == (3, 8, 0)
    # row 0 of L00.k differs at 2 and 4 (one apart: 2 vs 3), row 1 at -1 vs 1 (two apart)
    assert (pos["prompt"].mismatched, pos["prompt"].one_apart, pos["prompt"].total) == (2, 1, 8)
    assert (pos["completion"].mismatched, pos["completion"].one_apart, pos["completion"].total) == (1, 0, 8)
    with pytest.raises(ValueError, match="needs prompt_lens and position_key"):
        code_mismatch(codes, diag, by="position")
    with pytest.raises(ValueError, match="'token' is not a valid MismatchKey"):
        code_mismatch(codes, diag, by="token")
