"""Plan x guidance combinations the library cannot run are refused before any work, at every entry
(both engines' ``generate``, the trainer forward, ``RLConfig``, the arms, ``TraceGRPOConfig``), by the
one check :func:`tracefp4.engines.plan.check_supported`; each error names the plan field and the
guidance knob at fault. The supported neighbours of each refused cell run.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from tracefp4.engines.model import from_config, tiny_config
from tracefp4.engines.plan import PrecisionPlan, check_supported
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine, generate
from tracefp4.engines.trainer import forward_logprobs, forward_rollout
from tracefp4.formats.quantizers import Grid, NVFP4Quantizer
from tracefp4.guidance.compact import CompactRecord, GuidanceSpec, GuidedMode
from tracefp4.pipeline import arms
from tracefp4.pipeline.arms import integration_arm, make_arm
from tracefp4.rl.config import ModelSpec, RLConfig

torch.set_num_threads(1)

FOUR_OVER_SIX = "nvfp4_scale = '4over6'"
#: (trace_plan name, guidance, the plan field the error names, the guidance knob it names)
REFUSED = [
    ("4over6", "lsb+parity", FOUR_OVER_SIX, "'+parity'"),
    ("4over6", "lsb+scales:own", FOUR_OVER_SIX, "'+scales:own'"),
    ("4over6", "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all", FOUR_OVER_SIX, "'+scales:ldpc(1/4)'"),
    ("mxfp4", "lsb+parity", "activations = 'mxfp4'", "'+parity'"),
    ("mxfp4", "sparse(0.02)+scales:ldpc(1/4)", "activations = 'mxfp4'", "'+scales:ldpc(1/4)'"),
    ("mxfp4", "lsb+amax:lo3", "activations = 'mxfp4'", "'+amax:lo3'"),
    ("w4a8", "lsb+parity", "activations = 'fp8'", "'lsb+parity'"),
    ("fp8", "ldpc(1/8)@all", "activations = 'fp8'", "'ldpc(1/8)'"),
]
#: Each refused cell's supported neighbours: the same plan with the scales recorded in full, and the
#: same compact knob under standard NVFP4 scales.
SUPPORTED = [
    ("4over6", "lsb"), ("4over6", "full"), ("4over6", "lsb+amax:lo3"), ("4over6", "ldpc(1/8)"),
    ("mxfp4", "lsb"), ("mxfp4", "full@all"), ("mxfp4", "sparse(0.02)"), ("mxfp4", "ldpc(1/8)"),
    ("nvfp4", "lsb+parity"), ("nvfp4", "lsb+scales:own"), ("nvfp4", "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all"),
    ("w4a8", "lsb"), ("fp8", "full@all"), ("fp8", "lsb@all"),
]
REFUSED_IDS = [f"{p}-{g}" for p, g, _, _ in REFUSED]
SUPPORTED_IDS = [f"{p}-{g}" for p, g in SUPPORTED]


def names(*parts: str) -> str:
    """A regex that matches a message containing every one of ``parts``, in this order."""
    return ".*".join(re.escape(p) for p in parts)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # widths of 32: MXFP4's blocks (head_dim too, for its K/V sites)
    return from_config(tiny_config(layers=2, experts=4, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                                   head_dim=32, vocab=32, init_std=0.1, max_positions=64, norm_topk_prob=True),
                       seed=0)


PROMPTS = [[3, 5, 7, 9], [4, 6, 8]]
SAMPLING = SamplingParams(max_new_tokens=3, seed=0)


# --- the check itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("plan, guidance, plan_knob, knob", REFUSED, ids=REFUSED_IDS)
def test_check_names_the_field_the_plan_and_the_knob(plan: str, guidance: str, plan_knob: str, knob: str) -> None:
    for mode in (guidance, GuidedMode.parse(guidance), GuidedMode.parse(guidance).mode):
        with pytest.raises(ValueError, match=names("my_field = ", plan_knob, knob)):
            check_supported(PrecisionPlan.named(plan), mode, field="my_field")


@pytest.mark.parametrize("plan, guidance", SUPPORTED, ids=SUPPORTED_IDS)
def test_check_passes_the_supported_neighbours(plan: str, guidance: str) -> None:
    check_supported(PrecisionPlan.named(plan), guidance)


def test_nothing_to_check_without_a_plan_or_guidance() -> None:
    check_supported(None, "lsb+parity")  # a BF16 rollout (generate refuses its guidance itself)
    check_supported(PrecisionPlan.four_over_six(), None)  # routing only
    check_supported(PrecisionPlan.w4a16(), "lsb+parity")  # QUADS' trainer: no guidable site at all


# --- why: what the codecs do under Four over Six --------------------------------------------------


def four_over_six_site() -> tuple[torch.Tensor, object, NVFP4Quantizer]:
    """A BF16 site (amax knobs need BF16 values) whose blocks take both scales, and its Four over Six codes."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=gen) * torch.rand(64, 256, generator=gen) ** 3).to(torch.bfloat16)
    quantizer = NVFP4Quantizer("row", block_max="4over6")
    return x, quantizer.quantize(x), quantizer


def decoded(x: torch.Tensor, q, guidance: str):
    """The hint the trainer decodes with an input equal to the rollout's, the record through the store."""
    record = CompactRecord.encode(x, q, GuidanceSpec.parse(guidance))
    return CompactRecord.from_tensors(record.to_tensors("L00.expert_in"), "L00.expert_in").decode(x)


@pytest.mark.parametrize("guidance", ["lsb+amax:lo3", "lsb+amax:bf16", "sparse(0.3)+amax:lo3", "ldpc(1/8)+amax:lo3"])
def test_four_over_six_takes_compact_elements_and_amax_knobs(guidance: str) -> None:
    """The supported neighbours: Four over Six keeps S_enc (the amax knobs rebuild it exactly) and the
    elements decode on the recorded scales, so the trainer gets back every rollout code."""
    x, q, quantizer = four_over_six_site()
    hint, report = decoded(x, q, guidance)
    assert report.failed_blocks == 0 and torch.equal(hint.scales.view(torch.uint8), q.scales.view(torch.uint8))
    got = quantizer.guided_quantize(x, Grid(hint.scales, hint.global_amax), lsb=hint.data)
    assert torch.equal(got.codes, q.codes)


@pytest.mark.parametrize("guidance", ["lsb+parity", "lsb+scales:own", "lsb+scales:ldpc(1/4)"])
def test_four_over_six_scale_knobs_would_pick_wrong_scales(guidance: str) -> None:
    """What the refusal prevents (the codec level, below every entry's check): the scale knobs rebuild
    the amax_b / 6 scale, so every block that chose 4 decodes to a wrong scale, silently unless an
    LDPC block happens to fail."""
    x, q, _ = four_over_six_site()
    six = NVFP4Quantizer("row").quantize(x)
    chose_four = (q.scales.view(torch.uint8) != six.scales.view(torch.uint8)).float().mean().item()
    hint, _ = decoded(x, q, guidance)
    wrong = (hint.scales.view(torch.uint8) != q.scales.view(torch.uint8)).float().mean().item()
    assert chose_four > 0.2 and wrong > 0.2


# --- our engine and the trainer forward ----------------------------------------------------------


@pytest.mark.parametrize("plan, guidance, plan_knob, knob", REFUSED, ids=REFUSED_IDS)
def test_home_engine_generate_refuses(model, plan: str, guidance: str, plan_knob: str, knob: str) -> None:
    mode = GuidedMode.parse(guidance)
    with pytest.raises(ValueError, match=names("guidance = ", plan_knob, knob)):
        HomeEngine(model).generate(PROMPTS, SAMPLING, plan=PrecisionPlan.named(plan), guidance=mode)
    with pytest.raises(ValueError, match=names(plan_knob, knob)):
        generate(model, PROMPTS, SAMPLING, plan=PrecisionPlan.named(plan), guidance=mode)


@pytest.mark.parametrize("plan, guidance", [("4over6", "lsb"), ("mxfp4", "lsb"), ("nvfp4", "lsb+parity")])
def test_supported_neighbours_roll_out_and_guide_the_trainer(model, plan: str, guidance: str) -> None:
    out = HomeEngine(model).generate(PROMPTS, SAMPLING, plan=PrecisionPlan.named(plan), guidance=GuidedMode.parse(guidance))
    assert out.plan == PrecisionPlan.named(plan) and all(any(".expert_in." in k for k in r) for r in out.records)
    got = forward_rollout(model, out, mode="trace", temperature=SAMPLING.temperature)
    assert got.decode.failed_blocks == 0
    for lp, ref in zip(got.logprobs, out.logprobs):
        assert torch.isfinite(lp).all() and lp.shape == ref.shape


@pytest.mark.parametrize("guidance, knob", [("lsb+parity", "'+parity'"), ("lsb+scales:own", "'+scales:own'"),
                                            ("ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all", "'+scales:ldpc(1/4)'")])
def test_trainer_refuses_records_its_plan_cannot_decode(model, guidance: str, knob: str) -> None:
    """Records of a standard NVFP4 rollout (from a store, say) given to a Four over Six trainer: its
    scale knobs would rebuild the trainer's own amax_b / 6 scales, not the rollout's, so the forward
    refuses them; the same records under the rollout's own plan, and lsb records, are guided."""
    out = generate(model, PROMPTS, SAMPLING, plan=PrecisionPlan(), guidance=GuidedMode.parse(guidance))
    batch = (model, out.token_ids, out.prompt_lens, out.records)
    with pytest.raises(ValueError, match=names("recorded guidance = ", FOUR_OVER_SIX, knob)):
        forward_logprobs(*batch, mode="trace", plan=PrecisionPlan.four_over_six())
    assert forward_logprobs(*batch, mode="trace", plan=PrecisionPlan()).decode.failed_blocks == 0
    forward_logprobs(*batch, mode="qat", plan=PrecisionPlan.four_over_six())  # qat reads no guidance
    lsb = generate(model, PROMPTS, SAMPLING, plan=PrecisionPlan(), guidance=GuidedMode.parse("lsb"))
    forward_logprobs(model, lsb.token_ids, lsb.prompt_lens, lsb.records, mode="trace",
                     plan=PrecisionPlan.four_over_six())


# --- the run config and the arms -----------------------------------------------------------------

TINY = dict(steps=1, warm_start_steps=0, prompts_per_step=2, group_size=2, updates_per_step=1,
            model=ModelSpec(hidden=32, layers=2, experts=4, top_k=2, moe_intermediate=32, heads=2, kv_heads=1,
                            head_dim=32))


@pytest.mark.parametrize("plan, guidance, plan_knob, knob", REFUSED, ids=REFUSED_IDS)
def test_run_config_and_arms_refuse(monkeypatch, plan: str, guidance: str, plan_knob: str, knob: str) -> None:
    """No arm of the table pairs the configured guidance with a fixed non-standard plan today, so the
    config's check is shown on an arm that does: what a new table row would get."""
    monkeypatch.setitem(arms.ARMS, "trace-x", dataclasses.replace(arms.ARMS["trace"], plan=plan))
    with pytest.raises(ValueError, match=names(f"guidance = {guidance!r}", "arm 'trace-x'", plan_knob, knob)):
        RLConfig(arms=("trace-x",), guidance=guidance, **TINY).validate()
    with pytest.raises(ValueError, match=names("arm 'trace-x'", plan_knob, knob)):
        make_arm("trace-x", guidance=guidance, n_layers=2)
    with pytest.raises(ValueError, match=names("arm 'trace'", plan_knob, knob)):  # the run's own plan
        make_arm("trace", guidance=guidance, n_layers=2, plan=PrecisionPlan.named(plan))
    with pytest.raises(ValueError, match=names(f"trace_plan = {plan!r}", "trace_guidance = ", plan_knob, knob)):
        integration_arm(plan, "trace", guidance, "all", 2)


@pytest.mark.parametrize("plan, guidance", SUPPORTED, ids=SUPPORTED_IDS)
def test_run_config_and_arms_pass_the_neighbours(monkeypatch, plan: str, guidance: str) -> None:
    monkeypatch.setitem(arms.ARMS, "trace-x", dataclasses.replace(arms.ARMS["trace"],
                                                                  plan="run" if plan == "nvfp4" else plan))
    RLConfig(arms=("trace-x",), guidance=guidance, **TINY).validate()
    assert make_arm("trace-x", guidance=guidance, n_layers=2).guidance == GuidedMode.parse(guidance)
    assert integration_arm(plan, "trace", guidance, "all", 2).plan == PrecisionPlan.named(plan)


def test_the_qat_arms_carry_no_guidance_to_refuse() -> None:
    RLConfig(arms=("qat-4over6", "qat-mxfp4", "qat-w4a8", "trace-4over6", "trace-mxfp4"), guidance="lsb+parity",
             **TINY).validate()
    assert integration_arm("4over6", "qat", "lsb+parity", "all", 2).guidance is None


# --- TRL's config --------------------------------------------------------------------------------


def trl_config(tmp_path, **over):
    pytest.importorskip("trl", reason="TRL is not installed (make setup installs trl==1.16.0)")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from tracefp4.integrations.trl import TraceGRPOConfig

    return TraceGRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", use_cpu=True, **over)


@pytest.mark.parametrize("plan, guidance, plan_knob, knob", REFUSED, ids=REFUSED_IDS)
def test_trace_grpo_config_refuses(tmp_path, plan: str, guidance: str, plan_knob: str, knob: str) -> None:
    with pytest.raises(ValueError, match=names(f"trace_plan = {plan!r}", f"trace_guidance = {guidance!r}",
                                               plan_knob, knob)):
        trl_config(tmp_path, trace_plan=plan, trace_guidance=guidance)


def test_trace_grpo_config_passes_the_neighbours(tmp_path) -> None:
    for plan, guidance in SUPPORTED:
        assert trl_config(tmp_path, trace_plan=plan, trace_guidance=guidance).trace_guidance == guidance
    # qat and bf16 record no guidance: an unsupported trace_guidance is unused there
    assert trl_config(tmp_path, trace_plan="4over6", trace_guidance="lsb+parity", trace_mode="qat").trace_mode == "qat"


# --- vLLM's engine -------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_generate_refuses(tmp_path) -> None:
    """Refused before anything reaches vLLM (a request failing inside a forward stays scheduled)."""
    pytest.importorskip("vllm")
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                 "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(k, v)
    from tracefp4.engines.vllm import VLLMEngine

    torch.manual_seed(0)
    from_config(tiny_config(layers=2, experts=4, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                            head_dim=32, vocab=32, init_std=0.1, max_positions=64, norm_topk_prob=True),
                seed=0).save_pretrained(tmp_path / "ckpt")
    with VLLMEngine(str(tmp_path / "ckpt"), plan=PrecisionPlan(), keep_bf16=True, max_model_len=32,
                    max_num_seqs=2) as engine:
        for plan, guidance, plan_knob, knob in REFUSED:
            with pytest.raises(ValueError, match=names("guidance = ", plan_knob, knob)):
                engine.generate(PROMPTS, SAMPLING, plan=PrecisionPlan.named(plan), guidance=GuidedMode.parse(guidance))
        out = engine.generate(PROMPTS, SAMPLING, plan=PrecisionPlan.four_over_six(), guidance=GuidedMode.parse("lsb"))
        assert all(any(".expert_in." in k for k in r) for r in out.records)
