"""vLLM with packed FP4 experts only (``VLLMEngine(keep_bf16=False)``, the engine users roll out with).

The routed experts are held as packed FP4 (codes two per byte in the kernel layout, E4M3 block
scales, one FP32 divisor per expert) in place of the BF16 parameters; what the engine computes and
records is exactly what an engine that keeps its BF16 weights too computes with the same packed
weights; a weight push repacks; a call the held weights cannot serve is refused, naming the option.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from tracefp4.engines.experts import choose_gemm  # noqa: E402
from tracefp4.engines.model import load_model, tiny_config  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.protocol import SamplingParams  # noqa: E402
from tracefp4.engines.trainer import code_mismatch, forward_rollout  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402
from tracefp4.formats import clib  # noqa: E402

torch.set_num_threads(1)

LAYERS = 3
ALL = frozenset(range(LAYERS))
FP4 = PrecisionPlan()
CONFIG = dict(layers=LAYERS, experts=8, top_k=2, hidden=256, moe_intermediate=256, heads=4, kv_heads=2, head_dim=64,
              vocab=256, init_std=0.08, max_positions=512, norm_topk_prob=True, tie_word_embeddings=False)
PROMPTS = [[5, 17, 33, 81, 9, 100, 7], [42, 11, 250, 3], [7, 7, 19, 200, 31, 64, 128, 1, 2, 90, 11]]
SAMPLING = SamplingParams(max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("vllm_packed") / "ckpt"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config(**CONFIG), dtype=torch.bfloat16).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return str(path)


def _experts(engine, fn):
    def get(worker):
        from tracefp4.engines.vllm.quant import TraceFP4MoEMethod

        model = worker.model_runner.get_model()
        layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), TraceFP4MoEMethod)]
        return fn(layers)

    return engine.llm.collective_rpc(get)[0]


@pytest.fixture(scope="module")
def both(ckpt):
    """The same rollouts (full records on every layer) from an engine that keeps BF16 weights and one
    that holds only packed experts, built one after the other (vLLM keeps process-wide state)."""
    from tracefp4.engines.vllm import VLLMEngine

    out = {}
    for keep in (True, False):
        with VLLMEngine(ckpt, plan=FP4, keep_bf16=keep, max_model_len=64, max_num_seqs=4) as e:
            out[keep] = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
            if not keep:
                out["held"] = _experts(e, lambda layers: [
                    {n: (str(p.dtype), tuple(p.shape)) for n, p in m.named_parameters(recurse=False)} for m in layers])
    return out


def test_packed_engine_holds_no_bf16_experts(both, ckpt):
    """Every routed-experts layer holds uint8 codes, uint8 scales and a float32 divisor per expert,
    about 0.56 bytes per parameter (NVFP4; widths that are multiples of 256, so the kernel layout
    needs no padding), and no BF16 or dequantized copy."""
    e, i, h = CONFIG["experts"], CONFIG["moe_intermediate"], CONFIG["hidden"]
    for params in both["held"]:
        assert {dtype for dtype, _ in params.values()} == {"torch.uint8", "torch.float32"}, params
        assert params["w13_divisor"] == ("torch.float32", (e,))
        layout = clib.preferred_layout(2 * i)  # the layout this CPU's kernel multiplies fastest
        assert params["w13_weight_scale"] == ("torch.uint8", tuple(clib.kernel_scales(
            torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8), layout).shape)), layout
        held = sum(torch.Size(shape).numel() * (4 if "float32" in d else 1) for d, shape in params.values())
        assert held / (e * 3 * i * h) < 0.6


def test_packed_engine_computes_and_records_what_the_bf16_keeping_one_does(both):
    """The same packed weights behind both: tokens, log-probs and every record bit for bit."""
    a, b = both[True], both[False]
    assert all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    for ra, rb in zip(a.records + a.diagnostics, b.records + b.diagnostics):
        assert sorted(ra) == sorted(rb)
        assert all(torch.equal(ra[k].view(torch.uint8) if ra[k].dtype == torch.float8_e4m3fn else ra[k],
                               rb[k].view(torch.uint8) if rb[k].dtype == torch.float8_e4m3fn else rb[k]) for k in ra)


def test_trainer_reproduces_every_code_of_the_packed_engine(both, ckpt):
    """Our trainer's QAT forward adopts the packed kernels' weight convention (bf16 block values, the
    FP32 global after the GEMM): with full records on every layer no rollout code differs."""
    hf = load_model(ckpt)
    with torch.no_grad():
        out = forward_rollout(hf, both[False], mode="trace", capture_codes=ALL)
    stats = code_mismatch(out.codes, both[False].diagnostics).values()
    assert sum(s.total for s in stats) > 0 and sum(s.mismatched for s in stats) == 0


def test_refused_calls_name_keep_bf16_and_a_push_repacks(ckpt):
    """A packed-only engine serves plans with its weight quantizer (another activation format is fine)
    and refuses BF16 or another weight format, naming keep_bf16; load_weights repacks the pushed
    weights (the held codes become those of the new weights, and the generation follows them)."""
    from tracefp4.engines.vllm import VLLMEngine

    hf = load_model(ckpt)
    with VLLMEngine(ckpt, plan=FP4, max_model_len=64, max_num_seqs=4) as e:
        e.generate(PROMPTS[:1], SAMPLING, plan=PrecisionPlan.w4a8(), guidance=None)  # same NVFP4 weights
        for plan in (None, PrecisionPlan.mxfp4()):
            with pytest.raises(ValueError, match="keep_bf16=True"):
                e.generate(PROMPTS[:1], SAMPLING, plan=plan, guidance=None)
        before = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=None)
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        moved = copy.deepcopy(state)
        key = "model.layers.0.mlp.experts.gate_up_proj"
        moved[key] = (moved[key].float() * -1.7).to(torch.bfloat16)
        e.load_weights(moved, version=1)
        gemm = choose_gemm(FP4, "cpu", torch.bfloat16, gradients=False)
        want = gemm.to_parameters(gemm.prepare(moved[key], FP4.weight_quantizer)).tensors
        held = _experts(e, lambda layers: {n: p.detach().clone() for n, p in layers[0].named_parameters(recurse=False)
                                           if n.startswith("w13_")})
        assert held.keys() == {f"w13_{n}" for n in want}
        assert all(torch.equal(held[f"w13_{n}"], t) for n, t in want.items())
        after = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=None)
        assert any(not torch.equal(x, y) for x, y in zip(before.logprobs, after.logprobs))
        e.load_weights(state, version=2)
        again = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=None)
        assert all(torch.equal(x, y) for x, y in zip(before.logprobs, again.logprobs))
