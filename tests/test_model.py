"""The prepared transformers MoE model: seams, precision plan, site granularity, families, save/load."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
)
from tiny_moe import COMMON, qwen3_config

from tracefp4 import dequantize, quantize_nvfp4
from tracefp4.engines.capture import RolloutCapture
from tracefp4.engines.guidance import TrainerGuidance
from tracefp4.engines.model import (
    CACHE_KWARG,
    EXPERTS_IMPLEMENTATION,
    FP4KVCache,
    ForwardState,
    TinyMoESpec,
    expert_weights,
    forward_state,
    from_config,
    load_model,
    moe_layers,
    prepare_model,
    quantize_site,
)
from tracefp4.engines.experts import Routing, choose_gemm, gemm_named
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.engines.trainer import code_mismatch, forward_logprobs
from tracefp4.formats.constants import Format, HintMode
from tracefp4.formats.quantizers import CompensatedNVFP4Quantizer, FP8Quantizer, MXFP4Quantizer, NVFP4Quantizer
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import EXPERT_SITES, KV_SITES, Site, deeper_half, parse_name, record_prefix, routing_key

torch.set_num_threads(1)

FAMILIES = {
    "qwen3_moe": qwen3_config,
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8
    ),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=8, pad_token_id=0, eos_token_id=1, bos_token_id=None),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8, head_dim=16),
}


def plain_twin(model: torch.nn.Module, config: object) -> torch.nn.Module:
    """The same weights in an untouched transformers model (default experts implementation)."""
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=model.dtype).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return from_config(qwen3_config(), seed=0)


# --- seams ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prepared_model_is_the_transformers_model(family: str) -> None:
    """Without a quant context the prepared model computes what transformers computes (float32 so the
    comparison is tight: only the order of the top-k sum differs)."""
    config = FAMILIES[family]()
    model = from_config(config, dtype=torch.float32, seed=0)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert [m.index for m in moe_layers(model)] == [0, 1, 2, 3]
    twin = plain_twin(model, config)
    assert twin.config._experts_implementation != EXPERTS_IMPLEMENTATION
    ids = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(0))
    # float32: per MoE layer one rounding of the 2-term top-k sum differs (2^-24 relative of O(1) values),
    # carried through 4 layers and lm_head to logits of magnitude < 1: ~1e-7; 2e-6 is 10x that, while
    # any real difference in the function (layout, routing, gate order) is O(1e-2) or more
    torch.testing.assert_close(model(ids).logits, twin(ids).logits, atol=2e-6, rtol=0)


def test_prepare_is_idempotent_and_leaves_state_dict_alone(model: torch.nn.Module) -> None:
    keys = list(model.state_dict())
    hooks = [len(m.router._forward_hooks) for m in moe_layers(model)]
    assert prepare_model(model) is model
    assert list(model.state_dict()) == keys
    assert [len(m.router._forward_hooks) for m in moe_layers(model)] == hooks == [1] * 4


def test_sliding_window_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="sliding"):
        from_config(qwen3_config(use_sliding_window=True, sliding_window=8))


def test_deeper_half_is_one_rule() -> None:
    assert deeper_half(4) == {2, 3}
    assert deeper_half(48) == frozenset(range(24, 48))
    assert GuidedMode.parse("lsb").layer_indices(48) == deeper_half(48)
    assert GuidedMode.parse("full").layer_indices(5) == frozenset(range(5))


def test_record_names() -> None:
    assert record_prefix(3, Site.K) == "L03.k" and routing_key(12) == "L12.routing"
    assert parse_name("L03.expert_mid.bits") == (3, "expert_mid", "bits")
    assert parse_name("L100.routing").is_routing
    for bad in ("L3.k.bits", "L003.k.bits", "L03.q.bits", "L03.k", "L03.routing.x"):
        with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
            parse_name(bad)


def test_tiny_spec_defaults_are_the_rl_demo() -> None:
    from tracefp4.rl.config import ModelSpec

    tiny, spec = dataclasses.asdict(TinyMoESpec()), dataclasses.asdict(ModelSpec())
    assert all(tiny[k] == spec[k] for k in tiny.keys() & spec.keys())  # one set of defaults
    # the RL config's own fields: its runs' sequence limit (128, what every run folder saved before it) and
    # whether it builds the MoE's dense twin instead (off: every run folder before it is a MoE)
    assert set(spec) - set(tiny) == {"max_positions", "dense"} and spec["max_positions"] == 128 and not spec["dense"]
    cfg = TinyMoESpec().config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.vocab_size) == (64, 4, 8, 32)


def test_precision_plan() -> None:
    assert PrecisionPlan() == PrecisionPlan.w4a4()
    assert PrecisionPlan.w4a8().site_format(Site.EXPERT_IN) == "fp8"
    assert PrecisionPlan.w4a8().site_format(Site.K) == "nvfp4"
    assert PrecisionPlan.w4a8().guidable(Site.EXPERT_MID)  # E4M3 codes are guided too
    fp8 = PrecisionPlan.fp8()
    assert (fp8.weights, fp8.kv_cache, fp8.site_format(Site.EXPERT_IN)) == (Format.FP8, Format.FP8, "fp8")
    w4a16 = PrecisionPlan.w4a16()  # QUADS' trainer: BF16 activation and KV sites (no quantizer)
    assert [w4a16.quantizer(s) for s in Site] == [None] * len(Site) and w4a16.site_format(Site.K) == "bf16"
    assert w4a16.weight_quantizer == NVFP4Quantizer("expert") and not w4a16.guidable(Site.V)
    quads = PrecisionPlan.quads(0.25)  # QUADS' rollout: compensated NVFP4 expert inputs, NVFP4 KV
    assert quads.quantizer(Site.EXPERT_IN) == CompensatedNVFP4Quantizer(0.25) and not quads.guidable(Site.EXPERT_MID)
    assert quads.quantizer(Site.K) == NVFP4Quantizer("row") and quads.guidable(Site.K)
    for p in (fp8, w4a16, quads):
        assert PrecisionPlan(**p.to_dict()) == p
    # plans without the compensation keep their text (the store's model signature hashes it)
    assert "rac_fraction" not in repr(PrecisionPlan()) and "rac_fraction=0.25" in repr(quads)
    with pytest.raises(ValueError, match="rac_fraction"):
        PrecisionPlan(activations="fp8", rac_fraction=0.5)
    with pytest.raises(ValueError, match=r"fraction: expected a number in \(0, 1\]"):
        PrecisionPlan.quads(0.0)
    mx = PrecisionPlan.mxfp4("rceil")
    assert (mx.weights, mx.kv_cache, mx.site_format(Site.EXPERT_MID)) == (Format.MXFP4, Format.MXFP4, "mxfp4")
    # one quantizer per site, chosen by the plan
    assert PrecisionPlan().quantizer(Site.EXPERT_IN) == NVFP4Quantizer("row")
    assert PrecisionPlan().weight_quantizer == NVFP4Quantizer("expert")
    assert PrecisionPlan.w4a8().quantizer(Site.EXPERT_MID) == FP8Quantizer()
    assert mx.quantizer(Site.V) == mx.weight_quantizer == MXFP4Quantizer("rceil")
    assert PrecisionPlan(**mx.to_dict()) == mx
    with pytest.raises(ValueError, match="activations"):
        PrecisionPlan(activations="int4")  # type: ignore[arg-type]


# --- sites ---------------------------------------------------------------------------------------


def test_one_forward_records_every_site_with_its_granularity(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    capture = RolloutCapture(HintMode.FULL, guided_layers={1, 3}, diagnostic_layers={0})
    with forward_state(model, PrecisionPlan(), capture), torch.no_grad():
        model(ids, **{CACHE_KWARG: FP4KVCache(model)}, use_cache=True)
    rec = capture.take()
    n = ids.numel()
    assert set(rec.guidance) == {record_prefix(i, s) for i in (1, 3) for s in (*EXPERT_SITES, *KV_SITES)}
    assert set(rec.diagnostics) == {record_prefix(0, s) for s in (*EXPERT_SITES, *KV_SITES)}
    assert rec.guidance["L01.expert_in"].q.shape == (n, 64)  # per token
    assert rec.guidance["L01.expert_mid"].q.shape == (n, 2, 32)  # per token and selected expert
    assert rec.guidance["L03.k"].q.shape == rec.guidance["L03.v"].q.shape == (n, 2, 16)  # per token and KV head
    assert rec.guidance["L03.k"].q.global_amax.shape == (n, 2, 1)  # one global scale per row
    assert sorted(rec.routing) == [0, 1, 2, 3] and rec.routing[0].shape == (n, 2)
    assert capture.take().guidance == {}


def test_activation_codes_do_not_depend_on_the_batch() -> None:
    """Per-row global scales: a token's codes are the same alone or next to a much larger token."""
    capture = RolloutCapture(HintMode.FULL, guided_layers={0})
    state = ForwardState(PrecisionPlan(), capture)
    x = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    quantize_site(state, 0, Site.EXPERT_MID, x)
    alone = capture.take().guidance["L00.expert_mid"].q.codes  # full guidance keeps the raw quantized value
    quantize_site(state, 0, Site.EXPERT_MID, torch.cat([x, 100 * torch.randn(4, 2, 32, dtype=torch.bfloat16)]))
    assert torch.equal(capture.take().guidance["L00.expert_mid"].q.codes[:3], alone)


def test_expert_weights_per_expert_scale_with_straight_through_gradient(model: torch.nn.Module) -> None:
    """The trainer's expert weights: each expert's exact block values on its own global scale (the
    packed kernels' convention, ``dequantize == blocks / divisor`` in float32), and a GEMM through them
    passes the weight the gradient of ``x @ w.T``."""
    from tracefp4.formats import dequantize_blocks

    experts = moe_layers(model)[0].experts
    dense = gemm_named("dense")
    w_hat = expert_weights(ForwardState(PrecisionPlan(), TrainerGuidance()), experts, "down_proj", dense)
    w = experts.down_proj.detach()
    for e in (0, 5):  # each expert on its own global scale
        q = quantize_nvfp4(w[e], global_amax=w[e].abs().amax().float())
        assert torch.equal(w_hat.values[e].detach(), dequantize_blocks(q))
        assert torch.equal(w_hat.values[e].detach() / w_hat.divisor[e], dequantize(q))
    x = torch.randn(5, w.shape[2], dtype=torch.bfloat16)
    routing = Routing(torch.tensor([[0], [1], [1], [1], [1]]), w.shape[0])  # row 0: expert 0; rows 1-4: expert 1
    dense.matmul(x, w_hat, routing, per_token=False).float().sum().backward()
    want = torch.zeros_like(w, dtype=torch.float32)
    want[0] = x[:1].float().sum(0).expand(w.shape[1], -1)
    want[1] = x[1:].float().sum(0).expand(w.shape[1], -1)
    # the gradient goes through (g / divisor) * divisor in float32 (two roundings of 2^-24) and is stored
    # in the bf16 parameter's dtype (one rounding, 2^-8 relative): within 2^-7 relative of x's column sums
    torch.testing.assert_close(experts.down_proj.grad.float(), want, rtol=2**-7, atol=0)
    experts.down_proj.grad = None


def test_rollout_weight_cache_follows_in_place_updates() -> None:
    model = from_config(qwen3_config(), seed=0)
    experts = moe_layers(model)[1].experts
    rollout = ForwardState(PrecisionPlan(), RolloutCapture())
    gemm = choose_gemm(PrecisionPlan(), "cpu", torch.bfloat16, gradients=False)
    first = expert_weights(rollout, experts, "gate_up_proj", gemm)
    assert expert_weights(rollout, experts, "gate_up_proj", gemm) is first  # cached
    trainer = ForwardState(PrecisionPlan(), TrainerGuidance())
    assert expert_weights(trainer, experts, "gate_up_proj", gemm_named("dense")) is not first  # prepared anew
    with torch.no_grad():
        experts.gate_up_proj.mul_(1.5)  # what an optimizer step does
    again = expert_weights(rollout, experts, "gate_up_proj", gemm)
    # a scaled weight has the same codes (one amax per expert scales along) but another global scale
    assert again is not first and not torch.equal(again.divisor, first.divisor)


def test_non_finite_input_names_the_site() -> None:
    x = torch.zeros(2, 2, 16)
    x[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"L07\.k"):
        quantize_site(ForwardState(PrecisionPlan()), 7, Site.K, x)
    with pytest.raises(ValueError, match=r"L02\.expert_in"):
        quantize_site(ForwardState(PrecisionPlan.w4a8()), 2, Site.EXPERT_IN, torch.full((1, 32), float("inf")))


def test_a_deep_copy_is_an_independent_prepared_model(model: torch.nn.Module) -> None:
    """E.g. a GRPO reference policy: its hooks and experts must follow its own context."""
    twin = copy.deepcopy(model)
    rollout = generate(model, [[3, 4, 5, 6]], SamplingParams(max_new_tokens=3), plan=PrecisionPlan())
    out = forward_logprobs(twin, rollout.token_ids, rollout.prompt_lens, rollout.records, mode="qat")
    assert sorted(out.router_flips) == [0, 1, 2, 3]  # replay ran in the copy's routers
    with torch.no_grad():
        ref = forward_logprobs(model, rollout.token_ids, rollout.prompt_lens, rollout.records, mode="qat")
    assert torch.equal(out.logprobs[0].detach(), ref.logprobs[0])


def test_forward_state_does_not_nest(model: torch.nn.Module) -> None:
    with forward_state(model, None), pytest.raises(RuntimeError, match="already active"):
        with forward_state(model, PrecisionPlan(), RolloutCapture()):
            pass


# --- both paths, every family and plan -----------------------------------------------------------

_PLANS = {"w4a4": PrecisionPlan.w4a4(), "w4a8": PrecisionPlan.w4a8(), "mxfp4": PrecisionPlan.mxfp4()}


@pytest.mark.parametrize(
    "family,plan",
    [(f, "w4a4") for f in sorted(FAMILIES)] + [("qwen3_moe", "w4a8"), ("qwen3_moe", "mxfp4")],
)
def test_identical_inputs_give_identical_codes(family: str, plan: str) -> None:
    """The engine scoring one sequence (one full-sequence prefill) and the trainer on the same sequence
    compute the same thing, so both QAT and TRACE reproduce every recorded code. K/V stay BF16 here:
    with a quantized cache the engine attends over its stored codes in float32 (ckv's kernel), the
    trainer with the model's own attention, a real difference (tests/test_kv_cache.py has those sites:
    the stored rows are the trainer's, and trace-full reproduces every K/V code)."""
    config = qwen3_config(head_dim=32) if plan == "mxfp4" else FAMILIES[family]()  # MXFP4 blocks are 32
    model = from_config(config, seed=0)
    seq = torch.randint(2, 32, (19,), generator=torch.Generator().manual_seed(2))
    every = frozenset(range(4))
    p = dataclasses.replace(_PLANS[plan], kv_cache="bf16")
    roll = generate(model, [seq], SamplingParams(max_new_tokens=0), plan=p, guidance=GuidedMode.parse("lsb"),
                    diagnostics=every)
    rec, diag = roll.records[0], roll.diagnostics[0]
    sites = {k.rsplit(".", 1)[0] for k in rec if not k.endswith("routing")}
    experts = {"L02.expert_in", "L02.expert_mid", "L03.expert_in", "L03.expert_mid"}
    assert sites == experts  # W4A8's FP8 activations are guided on the E4M3 line
    for mode in ("qat", "trace"):
        out = forward_logprobs(model, [seq], [4], [rec], mode=mode, plan=p, capture_codes=every)
        stats = code_mismatch(out.codes, [diag])
        assert {k for k in stats if int(k[1:3]) >= 2} == sites and len(stats) == 2 * len(sites)
        assert sum(s.mismatched for s in stats.values()) == 0, (mode, stats)


# --- save / load ---------------------------------------------------------------------------------


def test_save_pretrained_and_load_back(tmp_path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and list(tmp_path.glob("*.safetensors"))
    assert EXPERTS_IMPLEMENTATION not in (tmp_path / "config.json").read_text()
    loaded = load_model(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.config._experts_implementation == EXPERTS_IMPLEMENTATION
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    sampling = SamplingParams(max_new_tokens=4, seed=3)
    a, b = generate(model, prompts, sampling), generate(loaded, prompts, sampling)
    assert all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    for ra, rb in zip(a.records, b.records):
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
