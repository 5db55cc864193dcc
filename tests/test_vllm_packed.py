"""vLLM with packed FP4 experts only (``VLLMEngine(keep_bf16=False)``, the engine users roll out with).

The routed experts are held as packed FP4 (codes two per byte in the kernel layout, E4M3 block
scales, one FP32 divisor per expert) in place of the BF16 parameters; what the engine computes and
records is exactly what an engine that keeps its BF16 weights too computes with the same packed
weights; a weight push repacks; a call the held weights cannot serve is refused, naming the option.
"""

from __future__ import annotations

import copy
import os

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from vllm_tiny import FP4, PROMPTS, SAMPLING, save_checkpoint, use_cpu_engine  # noqa: E402

use_cpu_engine()

import torch  # noqa: E402

from tracefp4.engines.experts import choose_gemm  # noqa: E402
from tracefp4.engines.model import load_model, tiny_config  # noqa: E402
from tracefp4.engines.plan import PrecisionPlan  # noqa: E402
from tracefp4.engines.trainer import code_mismatch, forward_rollout  # noqa: E402
from tracefp4.guidance.compact import GuidedMode  # noqa: E402
from tracefp4.formats import clib  # noqa: E402

LAYERS = 3
ALL = frozenset(range(LAYERS))
CONFIG = dict(layers=LAYERS, experts=8, top_k=2, hidden=256, moe_intermediate=256, heads=4, kv_heads=2, head_dim=64,
              vocab=256, init_std=0.08, max_positions=512, norm_topk_prob=True, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(tmp_path_factory.mktemp("vllm_packed") / "ckpt", tiny_config(**CONFIG), seed=1)


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
    that holds only packed experts, both with the packed K/V cache (the default without keep_bf16,
    asked of the other), and from a third whose cache holds the dequantized K/V values; built one after
    the other (vLLM keeps process-wide state). From the packed engine also one single-prompt rollout
    with the slots its layer-0 cache update wrote and what its cache holds there afterwards."""
    from tracefp4.engines.vllm import VLLMEngine
    from tracefp4.engines.vllm.kv_layout import KVStore

    out = {}
    for keep, store in ((True, "packed"), (False, None), ("values", "values")):
        with VLLMEngine(ckpt, plan=FP4, keep_bf16=keep is True, kv_store=store, max_model_len=64, max_num_seqs=4) as e:
            out[keep] = e.generate(PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
            if keep is False:
                assert e.kv_store is KVStore.PACKED
                out["held"] = _experts(e, lambda layers: [
                    {n: (str(p.dtype), tuple(p.shape)) for n, p in m.named_parameters(recurse=False)} for m in layers])
                out["cache"] = _cache_rows_written(e)
    return out


def _cache_rows_written(engine) -> tuple:
    """A one-prompt full-record rollout of the (in-process) packed engine, the slots its layer-0 cache
    updates wrote in order (one per position), and the K/V planes of layer 0's cache at those slots."""
    from tracefp4.engines.vllm.kv_backend import PackedKVImpl

    orig, slots = PackedKVImpl.do_kv_cache_update, []

    def spy(self, layer, key, value, kv_cache, slot_mapping):
        if self.layer_name.startswith("model.layers.0."):
            slots.append(slot_mapping.clone())
        return orig(self, layer, key, value, kv_cache, slot_mapping)

    PackedKVImpl.do_kv_cache_update = spy
    try:
        rollout = engine.generate(PROMPTS[:1], SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@all"))
    finally:
        PackedKVImpl.do_kv_cache_update = orig
    at = torch.cat(slots).long()

    def read(worker):
        model = worker.model_runner.get_model()
        attn = next(m for m in model.modules() if getattr(m, "layer_name", "").startswith("model.layers.0."))
        return [{f: getattr(p, f)[at].clone() for f in ("codes", "scales", "amax")} for p in attn.impl.planes(attn.kv_cache)]

    return rollout, engine.llm.collective_rpc(read)[0]


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
    FP32 global after the GEMM) and fake-quantizes K/V with the records as guidance: with full records
    on every layer no code of the packed-experts, packed-K/V engine differs (trace-full mismatch 0)."""
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
        with pytest.raises(ValueError, match="packed nvfp4 K/V rows; a call asking for mxfp4 K/V.*kv_store='values'"):
            e.generate(PROMPTS[:1], SAMPLING, plan=PrecisionPlan(kv_cache="mxfp4"), guidance=None)
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


def test_packed_kv_cache_holds_the_recorded_codes(both):
    """The packed cache's slots hold exactly the K/V codes, E4M3 scales and amaxes the rollout recorded
    (one quantization: the record is the stored row), at every position of the trajectory."""
    rollout, (k, v) = both["cache"]
    rec = rollout.records[0]
    assert k["codes"].shape[0] == rollout.token_ids[0].numel()
    for name, plane in (("k", k), ("v", v)):
        assert torch.equal(plane["codes"], rec[f"L00.{name}.codes"])
        assert torch.equal(plane["scales"], rec[f"L00.{name}.scales"].view(torch.uint8))
        assert torch.equal(plane["amax"], rec[f"L00.{name}.global_amax"].squeeze(-1))


def test_packed_kv_generation_matches_the_values_store(both):
    """Packed K/V (our C attention over the codes) against the dequantized-value cache (vLLM's CPU
    attention over the same bf16 K/V values): the arithmetic differs only in the order of the fp32
    additions and the exp, so each attention output agrees to within one bf16 rounding (the bound of
    tests/test_vllm_kv.py). One rounding can move a downstream FP4 code by one step at a rounding
    boundary, which no arithmetic bound excludes, and a moved code can move everything after it: so in
    each sequence the tokens are the same up to the first position where a recorded code, scale or amax
    differs (the token sampled there is downstream of it) and the log-probs there within 0.05 (the
    attention's one bf16 rounding, carried through three layers, moves a log-prob of this model by
    well under 1e-2); at most 0.1 % of the recorded codes differ (measured here: 0 codes differ)."""
    a, b = both[False], both["values"]
    total = differ = 0
    for ta, tb, la, lb, p, ra, rb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, a.prompt_lens,
                                         a.records, b.records):
        rows = min(len(ta), len(tb))
        moved = torch.zeros(rows, dtype=torch.bool)
        for key in (k for k in ra if k.endswith((".codes", ".scales", ".global_amax"))):
            n = min(rows, len(ra[key]), len(rb[key]))
            x, y = (r[key][:n].view(torch.uint8) if r[key].dtype == torch.float8_e4m3fn else r[key][:n] for r in (ra, rb))
            moved[:n] |= (x != y).flatten(1).any(1)
            if key.endswith(".codes"):
                total += ra[key].numel()
                differ += int((x != y).sum())
        first = int(moved.nonzero()[0]) if bool(moved.any()) else rows
        same = min(first + 1, len(ta), len(tb))  # positions 0..first: sampled before any moved code
        assert torch.equal(ta[:same], tb[:same]), (first, ta.tolist(), tb.tolist())
        if same > p:
            assert float((la[: same - p] - lb[: same - p]).abs().max()) <= 0.05
    assert total > 0 and differ <= 1e-3 * total



def test_packed_kv_cache_holds_3_3x_the_tokens_of_bf16(tmp_path_factory):
    """Head dim 128, the same VLLM_CPU_KVCACHE_SPACE (1 GiB): vLLM's own BF16 engine and ours with the
    packed NVFP4 cache. vLLM's reported capacity (blocks x block size) and the bytes per token of the
    engine's own cache tensors: 152 bytes per token, layer and KV head against 512 (0.297x), so
    512/152 = 3.37x the tokens, less at most one block of rounding."""
    from tracefp4.pipeline.factory import make_engine

    cfg = dict(CONFIG, layers=2, head_dim=128)
    path = save_checkpoint(tmp_path_factory.mktemp("vllm_kv128") / "ckpt", tiny_config(**cfg), seed=2)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    got = {}
    for name, kind, plan in (("bf16", "vllm-bf16", {}), ("packed", "vllm", {"plan": FP4})):  # over the checkpoint as it is
        with make_engine(kind, checkpoint=path, max_model_len=64, max_num_seqs=4, **plan) as e:
            kv = e.kv_cache_size()
            got[name] = (kv["tokens"], kv["bytes"] / kv["tokens"] / (cfg["layers"] * cfg["kv_heads"]),
                         e.llm.llm_engine.vllm_config.cache_config.block_size)
    (bf16, bf16_bytes, bs), (packed, packed_bytes, _) = got["bf16"], got["packed"]
    assert bf16_bytes == 2 * 128 * 2 and packed_bytes == 152
    assert packed / bf16 >= 512 / 152 - bs / bf16 and packed / bf16 >= 3.3


@pytest.mark.parametrize("make", [PrecisionPlan.mxfp4, PrecisionPlan.four_over_six, PrecisionPlan.quads],
                         ids=["mxfp4", "four_over_six", "quads"])
def test_every_fp4_kv_plan_runs_packed_and_trace_full_reproduces_it(ckpt, make):
    """MXFP4 (E8M0 scales, no amax), Four over Six and QUADS K/V go packed too (their K/V rows have
    the NVFP4 or MXFP4 layout); our trainer reproduces every code of their rollouts. QUADS' expert
    inputs are residual-compensated, not guidable, so its trainer drifts after layer 0 whatever the
    cache (the dequantized-value store gives the same mismatches): there only layer 0 is exact."""
    from tracefp4.engines.vllm import VLLMEngine
    from tracefp4.engines.vllm.kv_layout import KVStore

    plan = make()
    with VLLMEngine(ckpt, plan=plan, max_model_len=64, max_num_seqs=4) as e:
        assert e.kv_store is KVStore.PACKED
        out = e.generate(PROMPTS, SAMPLING, plan=plan, guidance=GuidedMode.parse("full@all"), diagnostics=ALL)
    with torch.no_grad():
        tr = forward_rollout(load_model(ckpt), out, mode="trace", capture_codes=ALL)
    stats = [v for k, v in code_mismatch(tr.codes, out.diagnostics).items()
             if plan.rac_fraction is None or k.startswith("L00.")]
    assert sum(s.total for s in stats) > 0 and sum(s.mismatched for s in stats) == 0
