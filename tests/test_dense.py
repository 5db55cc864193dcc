"""Dense models (Qwen3, Llama, Mistral): the gated MLP as one FP4 expert with every row, sites
``mlp_in`` and ``mlp_mid``, through prepare_model, our engine, the trainer forward and the store."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tracefp4.engines.capture import RolloutCapture
from tracefp4.engines.experts import Routing, choose_gemm, gemm_named
from tracefp4.engines.guidance import TrainerGuidance
from tracefp4.engines.model import (DenseMLPForward, ForwardState, TinyDenseSpec, TinyMoESpec, dense_layers,
                                    forward_state, from_config, load_model, mlp_weights, model_layers, model_state,
                                    prepare_model, tiny_dense_config)
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import HomeEngine, generate
from tracefp4.engines.trainer import code_mismatch, forward_logprobs
from tracefp4.formats import clib, dequantize, dequantize_blocks, quantize_nvfp4
from tracefp4.formats import reference as ref
from tracefp4.formats import reference_composite as refc
from tracefp4.formats.constants import HintMode
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import KV_SITES, MLP_SITES, deeper_half, parse_name, record_prefix
from tracefp4.pipeline.steps import rollout_step

torch.set_num_threads(1)

FAMILIES = ("qwen3", "llama", "mistral")
#: Peaked init (0.1) where a test needs codes and logits far from uniform; the tiny default (0.02) where
#: it measures guidance (see test_lsb_guidance_removes_most_of_qats_mismatch).
DIMS = dict(layers=4, hidden=64, intermediate=64, heads=4, kv_heads=2, head_dim=16, vocab=32, init_std=0.1)
EVERY = frozenset(range(4))


def dense(family: str = "qwen3", **over) -> torch.nn.Module:
    return from_config(tiny_dense_config(**{**DIMS, "family": family, **over}), seed=0)


def packed_codes(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked reference codes ``[..., K]`` -> two per byte, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return dense()


# --- the seam ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_prepared_dense_model_is_the_transformers_model(family: str) -> None:
    """Outside a forward with a plan the prepared model runs transformers' own MLP forward: bit for bit
    an untouched twin's logits; the state dict and config are untouched; every layer is a dense MLP
    layer and none is MoE."""
    model = dense(family)
    config = model.config
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=model.dtype).eval()
    twin.load_state_dict(model.state_dict())
    assert list(twin.state_dict()) == list(model.state_dict())
    assert model_layers(model) == (4, ()) and model_state(model).dense_layers == (0, 1, 2, 3)
    assert all(type(layer.mlp.forward) is DenseMLPForward for layer in model.model.layers)
    assert not isinstance(twin.model.layers[0].mlp.forward, DenseMLPForward)
    ids = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits.view(torch.int16), twin(ids).logits.view(torch.int16))


def test_non_gated_or_biased_mlps_are_refused() -> None:
    biased = AutoModelForCausalLM.from_config(LlamaConfig(**{
        "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mlp_bias": True}))
    with pytest.raises(NotImplementedError, match=r"layer 0: mlp.gate_proj, mlp.up_proj, mlp.down_proj has a bias"):
        dense_layers(biased)
    with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM: no sparse MoE block found, and not a dense"):
        prepare_model(biased)
    plain = AutoModelForCausalLM.from_config(tiny_dense_config(**{**DIMS, "layers": 2}))
    plain.model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(NotImplementedError, match=r"layer 1: the MLP \(Identity\) is not a gated .*no nn.Linear gate_proj"):
        prepare_model(plain)


def test_a_deep_copy_is_an_independent_prepared_model(model: torch.nn.Module) -> None:
    twin = copy.deepcopy(model)
    mlp = twin.model.layers[2].mlp
    assert mlp.forward.mlp is mlp and model.model.layers[2].mlp.forward.mlp is model.model.layers[2].mlp
    with forward_state(twin, PrecisionPlan()):  # the copy's forward runs in the copy's state only
        with forward_state(model, None):
            pass


# --- sites ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _KeepInputs(RolloutCapture):
    """A rollout capture that also keeps each site's input (what the reference quantizes)."""

    inputs: dict = dataclasses.field(default_factory=dict)

    def site(self, layer, name, x, quantizer):
        self.inputs[name] = x.detach().clone()
        return super().site(layer, name, x, quantizer)


@dataclasses.dataclass
class _TrainerInputs(TrainerGuidance):
    inputs: dict = dataclasses.field(default_factory=dict)

    def site(self, layer, name, x, quantizer):
        self.inputs[name] = x.detach().clone()
        return super().site(layer, name, x, quantizer)


def _reference_codes(plan_name: str, x: torch.Tensor) -> torch.Tensor:
    if plan_name == "mxfp4":
        return packed_codes(ref.quantize_mxfp4(x)[0])
    return packed_codes(ref.quantize_nvfp4(x, per_row=True)[0])


@pytest.mark.parametrize("plan_name", ["nvfp4", "mxfp4"])
def test_every_site_is_the_readable_reference_on_both_paths(plan_name: str) -> None:
    """One forward of each path records, at every dense-MLP and K/V site of every layer, the readable
    reference's codes of that site's input, per row (atol=0); ``mlp_in`` is a token's hidden state
    ``[T, H]``, ``mlp_mid`` its down-projection input ``[T, I]``; a dense model's records have no
    routing."""
    over = dict(head_dim=32, hidden=64, intermediate=64) if plan_name == "mxfp4" else {}
    model = dense(**over)
    plan = PrecisionPlan.named(plan_name)
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    capture = _KeepInputs(HintMode.FULL, guided_layers=EVERY)
    with forward_state(model, plan, capture), torch.no_grad():
        model(ids, use_cache=False)
    rec = capture.take()
    assert set(rec.guidance) == {record_prefix(i, s) for i in EVERY for s in (*MLP_SITES, *KV_SITES)}
    assert rec.routing == {}
    assert rec.guidance["L01.mlp_in"].q.shape == (14, 64) and rec.guidance["L01.mlp_mid"].q.shape == (14, 64)
    for name, raw in rec.guidance.items():
        assert torch.equal(raw.q.codes, _reference_codes(plan_name, capture.inputs[name])), name
    trainer = _TrainerInputs(capture_layers=EVERY)
    with forward_state(model, plan, trainer):
        model(ids, use_cache=False)
    assert set(trainer.codes) == set(rec.guidance)
    for name, codes in trainer.codes.items():
        assert torch.equal(codes, _reference_codes(plan_name, trainer.inputs[name])), name


def test_mlp_weights_are_one_expert_per_gemm_with_straight_through_gradients(model: torch.nn.Module) -> None:
    """The trainer's MLP weights: ``[gate; up]`` on one global scale (one amax over both, as vLLM's
    merged weight has it), ``down`` on its own, each the exact block values over its divisor; a GEMM
    through them passes each linear's weight the gradient of ``x @ w.T``."""
    mlp = model.model.layers[1].mlp
    gemm = gemm_named("dense")
    gate_up, down = mlp_weights(ForwardState(PrecisionPlan(), TrainerGuidance()), mlp, gemm)
    for got, w in ((gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), (down, mlp.down_proj.weight)):
        w = w.detach()
        q = quantize_nvfp4(w, global_amax=w.abs().amax().float())
        assert got.shape == (1, *w.shape)
        assert torch.equal(got.values[0].detach(), dequantize_blocks(q))
        assert torch.equal(got.values[0].detach() / got.divisor[0], dequantize(q))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    one = Routing(torch.zeros(5, 1, dtype=torch.long), 1)
    gemm.matmul(x, gate_up, one, per_token=True).float().sum().backward()
    want = x.float().sum(0).expand(64, -1)
    # through (g / divisor) * divisor in float32 (two roundings of 2^-24), stored in the bf16 parameter
    # (one rounding, 2^-8 relative): within 2^-7 relative of x's column sums
    for linear in (mlp.gate_proj, mlp.up_proj):
        torch.testing.assert_close(linear.weight.grad.float(), want, rtol=2**-7, atol=0)
        linear.weight.grad = None


def _bound(exact: torch.Tensor, accumulation: torch.Tensor) -> torch.Tensor:
    """|kernel - exact| for any order of the float32 additions (tests/test_fp4_gemm.py's bound): the
    order's error, then the float32 division and the bf16 rounding (2^-8 relative)."""
    return (2.0**-8 + 2.0**-24 + 2.0**-32) * (exact.abs() + accumulation) + accumulation + 2.0**-133


@pytest.mark.needs_clib
@pytest.mark.parametrize("plan_name", ["nvfp4", "mxfp4"])
def test_packed_gemm_serves_a_dense_layer_as_one_expert(model: torch.nn.Module, plan_name: str) -> None:
    """An FP4 rollout of a dense model runs the packed CPU kernel: each MLP GEMM is the routed GEMM of
    one expert with every row, within the any-order bound of the exact product of the quantizer's
    codes; the weights it keeps are the packed ones, at most 0.8 bytes per MLP parameter (NVFP4:
    0.5625, MXFP4: 0.53125, and a divisor per GEMM)."""
    plan = PrecisionPlan.named(plan_name)
    gemm = choose_gemm(plan, "cpu", torch.bfloat16, gradients=False)
    assert gemm.name == "cpu_fp4"
    mlp = model.model.layers[3].mlp
    gate_up, down = mlp_weights(ForwardState(plan, RolloutCapture()), mlp, gemm)
    fmt = plan.weight_quantizer.fmt.value
    g = torch.Generator().manual_seed(5)
    for w, k in ((gate_up, 64), (down, 64)):
        x = torch.randn(9, k, generator=g).to(torch.bfloat16)
        out = gemm.matmul(x, w, Routing(torch.zeros(9, 1, dtype=torch.long), 1), per_token=True)
        offsets = torch.tensor([0, 9])
        codes, scales = w.standard_codes(), w.standard_scales()
        exact = refc.grouped_gemm_exact(x, offsets, codes, scales, w.divisor, fmt)
        acc = clib.accumulation_bound(x, offsets, refc.expert_weights(codes, scales, fmt), w.divisor)
        assert bool(((out.to(torch.float64) - exact).abs() <= _bound(exact, acc)).all())
    # K a multiple of 512 (the tiles layout pads K up to 256 for NVFP4, 512 for MXFP4; real widths are)
    fresh = dense(layers=1, hidden=512, intermediate=512, head_dim=32)
    generate(fresh, [[3, 4, 5]], SamplingParams(max_new_tokens=2), plan=plan)
    params = sum(p.numel() for layer in fresh.model.layers for p in layer.mlp.parameters())
    kept = model_state(fresh).weights.nbytes
    assert 0.5 <= kept / params <= 0.8, kept / params


def test_rollout_weight_cache_follows_in_place_updates() -> None:
    model = dense()
    mlp = model.model.layers[0].mlp
    plan = PrecisionPlan()
    gemm = choose_gemm(plan, "cpu", torch.bfloat16, gradients=False)
    rollout = ForwardState(plan, RolloutCapture())
    first = mlp_weights(rollout, mlp, gemm)
    assert all(a is b for a, b in zip(mlp_weights(rollout, mlp, gemm), first))  # kept across forwards
    with torch.no_grad():
        mlp.up_proj.weight.mul_(3.0)  # one part of [gate; up] changes: that weight is prepared again
    again = mlp_weights(rollout, mlp, gemm)
    assert again[0] is not first[0] and again[1] is first[1]


# --- both paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family,plan_name", [(f, "nvfp4") for f in FAMILIES] + [
    ("qwen3", "mxfp4"), ("llama", "mxfp4"), ("qwen3", "w4a8"), ("qwen3", "fp8"), ("qwen3", "4over6")])
def test_trace_full_reproduces_every_code_and_records_have_no_routing(family: str, plan_name: str) -> None:
    """A generated rollout (quantized K/V cache, incremental decode) and the trainer's packed forward,
    under every plan: with full hints at every layer the trainer picks the rollout's codeword at every
    site (it lies in the trainer's bracket: the paths differ at BF16 level, far below a codeword step;
    an FP8 full hint is taken as it is), with routing replay on (the default) and nothing to replay;
    vanilla QAT does not."""
    model = dense(family, **({"head_dim": 32} if plan_name == "mxfp4" else {}))
    plan = PrecisionPlan.named(plan_name)
    prompts = [[3, 4, 5, 6], [6, 7, 8, 9, 10], [1, 2]]
    roll = generate(model, prompts, SamplingParams(max_new_tokens=10, seed=1), plan=plan,
                    guidance=GuidedMode.parse("full@all"), diagnostics=EVERY)
    assert not any(parse_name(k).is_routing for k in roll.records[0])
    out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode="trace", plan=plan,
                           capture_codes=EVERY)
    stats = code_mismatch(out.codes, roll.diagnostics)
    assert set(stats) == {record_prefix(i, s) for i in EVERY for s in (*MLP_SITES, *KV_SITES)}
    assert sum(s.mismatched for s in stats.values()) == 0, stats
    qat = forward_logprobs(model, roll.token_ids, roll.prompt_lens, None, mode="qat", plan=plan, capture_codes=EVERY)
    assert sum(s.mismatched for s in code_mismatch(qat.codes, roll.diagnostics).values()) > 0


def test_lsb_guidance_removes_most_of_qats_mismatch() -> None:
    """The paper's compact cache (lsb on the deeper half) on a tiny dense model (TinyDenseSpec's
    defaults: the tiny MoE's active twin, init 0.02): at the guided sites the trainer's code mismatch
    is at most a tenth of vanilla QAT's (measured: 0 here against 16% for QAT; with the peaked 0.1
    init the two paths drift further apart upstream of the guided layers and the ratio is 0.15-0.21,
    see docs/guides/your-model.md)."""
    model = from_config(TinyDenseSpec.active_twin(TinyMoESpec(moe_intermediate=32)).config(), seed=0)
    prompts = [[3, 4, 5, 6], [6, 7, 8, 9, 10], [1, 2]]
    guided = deeper_half(4)
    roll = generate(model, prompts, SamplingParams(max_new_tokens=12, seed=0), plan=PrecisionPlan(),
                    guidance=GuidedMode.parse("lsb"), diagnostics=EVERY)
    assert {parse_name(k).layer for k in roll.records[0]} == guided
    rates = {}
    for mode in ("qat", "trace"):
        out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode=mode, capture_codes=guided)
        stats = code_mismatch(out.codes, roll.diagnostics)
        rates[mode] = sum(s.mismatched for s in stats.values()) / sum(s.total for s in stats.values())
    assert rates["qat"] > 0.01 and rates["trace"] <= 0.1 * rates["qat"], rates


# --- store, save and load ------------------------------------------------------------------------


def test_a_bf16_rollout_of_a_dense_model_goes_through_the_store(tmp_path, model: torch.nn.Module) -> None:
    """A BF16 rollout of a dense model records nothing (no sites, no routing): the store holds its
    trajectories with their lengths and gives back empty records."""
    step = rollout_step(HomeEngine(model), [[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=3, seed=0),
                        plan=None, target=tmp_path / "store")
    assert step.records == [{}, {}]
    assert [t.numel() for t in step.rollout.token_ids] == [6, 5]


def test_save_pretrained_and_load_back(tmp_path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path)
    assert "tracefp4" not in (tmp_path / "config.json").read_text()
    loaded = load_model(tmp_path)
    assert model_state(loaded).dense_layers == (0, 1, 2, 3)
    sampling = SamplingParams(max_new_tokens=4, seed=3)
    a = generate(model, [[3, 4, 5]], sampling, plan=PrecisionPlan(), guidance=GuidedMode.parse("lsb"))
    b = generate(loaded, [[3, 4, 5]], sampling, plan=PrecisionPlan(), guidance=GuidedMode.parse("lsb"))
    assert torch.equal(a.token_ids[0], b.token_ids[0]) and torch.equal(a.logprobs[0], b.logprobs[0])
    assert a.records[0].keys() == b.records[0].keys() and all(torch.equal(a.records[0][k], b.records[0][k])
                                                              for k in a.records[0])


def test_active_twin_has_the_moes_active_mlp_width() -> None:
    moe = TinyMoESpec(hidden=96, layers=8, experts=8, top_k=2, moe_intermediate=96)
    twin = TinyDenseSpec.active_twin(moe)
    assert (twin.hidden, twin.layers, twin.intermediate, twin.heads, twin.kv_heads, twin.head_dim) == \
        (96, 8, 192, moe.heads, moe.kv_heads, moe.head_dim)
    with pytest.raises(ValueError, match="family must be one of qwen3, llama, mistral, got 'gpt2'"):
        tiny_dense_config(**{**DIMS, "family": "gpt2"})
    with pytest.raises(ValueError, match="intermediate must be a positive multiple of 16"):
        tiny_dense_config(**{**DIMS, "intermediate": 40})


def test_the_dense_experiment_config_builds_the_moes_active_twin() -> None:
    """configs/experiment-count3-8l-dense.toml: count3-8l's run with ``model.dense``: a dense Qwen3 of
    the MoE's 8 layers and widths whose MLP is top_k x moe_intermediate wide, prepared as a dense model."""
    from pathlib import Path

    from tracefp4.rl.experiment import ExperimentConfig
    from tracefp4.rl.tasks import make_task

    root = Path(__file__).resolve().parents[1]
    dense_cfg = ExperimentConfig.from_file(str(root / "configs/experiment-count3-8l-dense.toml"))
    moe_cfg = ExperimentConfig.from_file(str(root / "configs/experiment-count3-8l.toml"))
    assert dense_cfg.name == "count3-8l-dense" and dense_cfg.seeds == moe_cfg.seeds
    run, moe_run = dense_cfg.run_config(0), moe_cfg.run_config(0)
    assert run.model.dense and not moe_run.model.dense
    assert dataclasses.replace(run.model, dense=False) == moe_run.model  # the same dims otherwise
    # and the same run (but for the folder the results go to)
    assert dataclasses.replace(run, model=moe_run.model, out=moe_run.out) == moe_run
    tok = make_task(run.task, **run.task_kwargs).make_tokenizer()
    config = run.model.hf_config(tok)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == \
        ("qwen3", 8, 96, 2 * 96)
    net = from_config(config, seed=0)
    assert model_layers(net) == (8, ()) and model_state(net).dense_layers == tuple(range(8))


def test_mismatch_report_on_the_dense_twin(tmp_path) -> None:
    """``tracefp4 mismatch --dense``: the report on the tiny MoE's dense twin, per dense-MLP and K/V site,
    trace-full reproducing every code, no router to flip."""
    import json

    from tracefp4.cli import main

    path = tmp_path / "report.json"
    argv = ["mismatch", "--dense", "--layers", "4", "--hidden", "32", "--top-k", "2", "--moe-intermediate", "16",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "32", "--batch", "4", "--new-tokens", "12",
            "--prompt-len", "8", "--json", str(path), "--quiet"]
    assert main(argv) == 0
    rep = json.loads(path.read_text())
    assert sorted(rep["per_site"]) == ["k", "mlp_in", "mlp_mid", "v"]
    assert rep["config"]["intermediate"] == 32 and rep["config"]["moe_layers"] == []
    assert rep["mismatch_counts"]["trace-full"]["mismatched"] == 0 < rep["mismatch_counts"]["qat"]["mismatched"]
    assert rep["router_flip"]["qat"]["rate"] is None
    dense(layers=1).save_pretrained(tmp_path / "ck")
    with pytest.raises(SystemExit, match=r"--checkpoint fixes the model; drop \['dense'\]"):
        main(["mismatch", "--dense", "--checkpoint", str(tmp_path / "ck")])
