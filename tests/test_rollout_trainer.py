"""The two FP4 paths end to end: rollout engine (incremental decode, FP4 KV cache) and trainer forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor
from tiny_moe import ALL, CONFIG, PROMPTS, SAMPLING
from transformers import AutoModelForCausalLM

from tracefp4.engines.contract import quantizer_contract
from tracefp4.engines.model import from_config, moe_layers
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import RolloutEngine, RolloutOutput, SamplingParams
from tracefp4.engines.rollout import HomeEngine, generate, sample
from tracefp4.engines.trainer import code_mismatch, forward_logprobs, forward_rollout
from tracefp4.formats import lsb_bits
from tracefp4.guidance.compact import GuidedMode
from tracefp4.guidance.names import EXPERT_SITES, KV_SITES, deeper_half, parse_name, record_prefix, routing_key

torch.set_num_threads(1)

FP4 = PrecisionPlan()
LSB = GuidedMode.parse("lsb")  # the paper's compact cache: lsb on the deeper half
DEEPER = deeper_half(4)


def hf_logprobs(model: torch.nn.Module, ids: torch.Tensor, prompt_len: int, temperature: float = 1.0) -> Tensor:
    """Completion log-probs from transformers' own forward of one unpadded sequence."""
    logits = model(ids[None]).logits[0].float() / temperature
    return torch.log_softmax(logits, -1)[prompt_len - 1 : -1].gather(-1, ids[prompt_len:, None]).squeeze(-1)


def mismatches(codes: list, records: list) -> tuple[int, int, int]:
    stats = code_mismatch(codes, records).values()
    return sum(s.mismatched for s in stats), sum(s.one_apart for s in stats), sum(s.total for s in stats)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return from_config(CONFIG, seed=0)


@pytest.fixture(scope="module")
def trace_full(model: torch.nn.Module) -> RolloutOutput:
    return generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@deeper"), diagnostics=DEEPER)


# --- the rollout engine --------------------------------------------------------------------------


def test_bf16_rollout_logprobs_equal_transformers_forward() -> None:
    """Quantization off: the engine's log-probs (batched, left-padded, incremental decode, a batch that
    shrinks as sequences stop) equal transformers' forward of each sequence alone.

    float32 proves the engine exact (positions, masks, cache, sampling bookkeeping): the two compute
    the same function in another reduction order, which moves a log-prob of magnitude ~3 by a few
    float32 ulps per op through four layers (~1e-6); 1e-5 leaves a 10x margin for other kernels,
    while a real bug (wrong position, leaked pad, stale cache) moves log-probs by O(1).

    In bfloat16 no fixed bound is derivable (how far two orders of BF16 rounding drift apart depends
    on the machine's kernels), but each is a BF16 evaluation of the same function from the same BF16
    weights, rounding the same ops at the same precision: measured against the float32 evaluation,
    the engine's error is of the size of transformers' own. We require it within 3x (max over tokens)
    and 2x (mean) of transformers' BF16 error on the same machine.
    """
    model32 = from_config(CONFIG, dtype=torch.float32, seed=0)
    twin32 = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), dtype=torch.float32).eval()
    twin32.load_state_dict(model32.state_dict())
    out32 = generate(model32, PROMPTS, SamplingParams(max_new_tokens=12, stop_token_ids=(3, 5), seed=1))
    assert "stop" in out32.finish_reasons and "length" in out32.finish_reasons  # ragged completions
    with torch.no_grad():
        diff = torch.cat([out32.logprobs[b] - hf_logprobs(twin32, ids, out32.prompt_lens[b])
                          for b, ids in enumerate(out32.token_ids)]).abs()
    assert diff.max() <= 1e-5, diff.max()

    model = from_config(CONFIG, dtype=torch.bfloat16, seed=0)
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), dtype=torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG), dtype=torch.float32).eval()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same BF16 weights, in fp32
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, stop_token_ids=(3, 5), seed=1))
    with torch.no_grad():
        exact = [hf_logprobs(ref, ids, out.prompt_lens[b]) for b, ids in enumerate(out.token_ids)]
        engine_err = torch.cat([out.logprobs[b] - e for b, e in enumerate(exact)]).abs()
        hf_err = torch.cat([hf_logprobs(twin, ids, out.prompt_lens[b]) - exact[b]
                            for b, ids in enumerate(out.token_ids)]).abs()
    assert engine_err.max() <= 3 * hf_err.max(), (engine_err.max(), hf_err.max())
    assert engine_err.mean() <= 2 * hf_err.mean(), (engine_err.mean(), hf_err.mean())


def test_logprobs_use_the_temperature_scaled_distribution() -> None:
    """logprob = log_softmax(logits / T)[token], before top-p truncation (checked in float32)."""
    model = from_config(CONFIG, dtype=torch.float32, seed=0)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, seed=4)
    out = generate(model, PROMPTS[:2], sampling)
    assert out.plan is None and all(set(r) == {routing_key(i) for i in range(4)} for r in out.records)
    with torch.no_grad():
        for b, ids in enumerate(out.token_ids):
            expect = hf_logprobs(model, ids, out.prompt_lens[b], 0.7)
            torch.testing.assert_close(out.logprobs[b], expect, atol=1e-5, rtol=0)
        got = forward_logprobs(model, out.token_ids, out.prompt_lens, out.records, mode="bf16", temperature=0.7)
    torch.testing.assert_close(torch.cat(got.logprobs), torch.cat(out.logprobs), atol=1e-5, rtol=0)


def test_sampler() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    greedy, lp = sample(logits, SamplingParams(temperature=0), None)
    assert greedy.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    gen = torch.Generator().manual_seed(0)
    top = torch.stack([sample(logits, SamplingParams(top_p=0.05), gen)[0] for _ in range(50)])
    assert (top == greedy).all()  # top-p that small keeps only the top token
    wide = torch.stack([sample(logits, SamplingParams(temperature=5.0), gen)[0] for _ in range(200)])
    assert len(set(wide[:, 0].tolist())) == 4


def test_rollout_output_and_record_layout(model: torch.nn.Module, trace_full: RolloutOutput) -> None:
    stops = (4, 9)
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=stops, seed=6), plan=FP4, guidance=LSB)
    assert out.diagnostics == [{}] * len(PROMPTS) and out.guidance == LSB and out.plan == FP4
    n_moe = len(moe_layers(model))
    for b, ids in enumerate(out.token_ids):
        p, t = out.prompt_lens[b], ids.numel()
        assert p == PROMPTS[b].numel() and torch.equal(ids[:p], PROMPTS[b])
        assert out.logprobs[b].shape == (t - p,) and (out.logprobs[b] <= 0).all()
        completion = out.completion(b).tolist()
        if out.finish_reasons[b] == "stop":
            assert completion[-1] in stops and not set(completion[:-1]) & set(stops)  # the stop token is kept
        else:
            assert len(completion) == 10 and not set(completion) & set(stops)
        rec = out.records[b]
        assert all(v.shape[0] == t for v in rec.values())  # every position, the last token included
        assert sum(k.endswith(".routing") for k in rec) == n_moe
        assert rec["L00.routing"].dtype == torch.uint8 and rec["L00.routing"].shape == (t, 2)
        assert {k.split(".")[0] for k in rec if not k.endswith("routing")} == {"L02", "L03"}  # deeper half
        assert rec["L02.expert_mid.bits"].shape == (t, 2, 4)  # lsb: one bit per element
        assert rec["L02.k.scales"].dtype == torch.float8_e4m3fn and rec["L02.k.global_amax"].shape == (t, 2, 1)
    assert len(set(out.finish_reasons)) == 2
    # full hints: 4 bits/element + scales; lsb: 1 bit/element + scales
    lsb = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=LSB)
    assert lsb.guidance_bytes() < 0.5 * trace_full.guidance_bytes()


def test_records_do_not_change_the_numerics(model: torch.nn.Module, trace_full: RolloutOutput) -> None:
    vanilla = generate(model, PROMPTS, SAMPLING, plan=FP4)
    lsb = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=LSB, diagnostics=ALL)
    for other in (vanilla, lsb):
        assert all(torch.equal(a, b) for a, b in zip(other.token_ids, trace_full.token_ids))
        assert all(torch.equal(a, b) for a, b in zip(other.logprobs, trace_full.logprobs))
        for a, b in zip(other.records, trace_full.records):
            assert torch.equal(a["L03.routing"], b["L03.routing"])
    assert all(set(r) == {routing_key(i) for i in range(4)} for r in vanilla.records)
    scored = generate(model, PROMPTS[:1], SamplingParams(max_new_tokens=0), plan=FP4, guidance=LSB)
    assert scored.logprobs[0].numel() == 0 and scored.records[0]["L02.k.bits"].shape[0] == PROMPTS[0].numel()


def test_fp4_rollout_differs_from_bf16(model: torch.nn.Module, trace_full: RolloutOutput) -> None:
    """Against the same BF16 teacher-forced reference, the FP4 engine is far off, the BF16 engine is not.

    What separates them is the precision: an E2M1 step is 1/4 to 1/2 of its value (a block scale
    maps each block's max to 6) against BF16's 2^-8, a 32-64x larger rounding at every FP4 site; we
    require a factor 5, an order of magnitude inside that ratio, so that another machine's BF16 drift
    cannot close it."""
    bf16 = generate(model, PROMPTS, SAMPLING)
    with torch.no_grad():
        ref_fp4 = forward_rollout(model, trace_full, mode="bf16").logprobs
        ref_bf16 = forward_rollout(model, bf16, mode="bf16").logprobs
    gap_fp4 = torch.cat([a - b for a, b in zip(trace_full.logprobs, ref_fp4)]).abs().mean()
    gap_bf16 = torch.cat([a - b for a, b in zip(bf16.logprobs, ref_bf16)]).abs().mean()
    assert gap_fp4 > 5 * gap_bf16, (gap_fp4, gap_bf16)


# --- the trainer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hint_mode", ["lsb", "full"])
def test_trace_reproduces_rollout_codes_on_identical_inputs(model: torch.nn.Module, hint_mode: str) -> None:
    """The engine scoring a sequence in one full-sequence step and the trainer on the same sequence see
    identical inputs at every site, so TRACE must land on the rollout's codeword everywhere."""
    for ids, p in zip(PROMPTS[1:3], (2, 4)):
        score = SamplingParams(max_new_tokens=0)
        rec = generate(model, [ids], score, plan=FP4, guidance=GuidedMode.parse(f"{hint_mode}@all")).records[0]
        full = generate(model, [ids], score, plan=FP4, diagnostics=ALL).diagnostics[0]
        with torch.no_grad():
            out = forward_logprobs(model, [ids], [p], [rec], mode="trace", capture_codes=ALL)
        assert set(out.codes[0]) == {record_prefix(i, s) for i in range(4) for s in (*EXPERT_SITES, *KV_SITES)}
        assert mismatches(out.codes, [full])[0] == 0


def test_routing_replay_uses_recorded_experts_and_router_learns(
    model: torch.nn.Module, trace_full: RolloutOutput
) -> None:
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        m.experts.register_forward_hook(lambda mod, args, out, i=m.index: seen.__setitem__(i, args[1].clone()))
        for m in moe_layers(model)
    ]
    try:
        out = forward_rollout(model, trace_full, mode="qat")
    finally:
        for h in hooks:
            h.remove()
    for layer, chosen in seen.items():
        recorded = torch.cat([r[routing_key(layer)] for r in trace_full.records]).long()
        assert torch.equal(chosen, recorded)
    # Drift can flip some of the trainer's own choices (replay overrides them, checked above). A flip
    # needs a token's k-th and (k+1)-th router logits within the FP4 drift of each other, which most
    # tokens' are not: a rate of one half would mean the two routers compute different functions.
    assert 0 <= max(out.router_flips.values()) < 0.5, out.router_flips
    model.zero_grad()
    (-torch.cat(out.logprobs).sum()).backward()
    for m in moe_layers(model):
        assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
        assert m.experts.gate_up_proj.grad.abs().sum() > 0  # straight-through to the master weights
    model.zero_grad()


def test_guidance_removes_code_mismatches_under_decode_drift(
    model: torch.nn.Module, trace_full: RolloutOutput
) -> None:
    """Incremental decode vs full-sequence forward: QAT's round-to-nearest picks other codewords at the
    guided sites, TRACE far fewer; guiding every layer removes them and closes the log-prob gap.

    What is guaranteed (tests/test_guided_rounding.py checks it exactly): guided rounding reproduces the
    rollout's code wherever the trainer's value lies in the bracket that holds it, i.e. within one
    grid step of it on the rollout's grid. With full records on every layer the only drift left is
    BF16 op ordering, far below an FP4 step, so no code differs (exactly 0, asserted). On the deeper
    half alone the unguided layers 0-1 leave FP4-level drift, and how many values it carries out of
    their bracket depends on the machine's kernels; the bounds below are about the mechanism, not a
    measurement: most QAT mismatches are one codeword apart (the drift is small against a step), so
    guidance must remove the bulk of them (we require 90%), and the log-prob gap must shrink with it."""
    with torch.no_grad():
        qat = forward_rollout(model, trace_full, mode="qat", capture_codes=DEEPER)
        trace = forward_rollout(model, trace_full, mode="trace", capture_codes=DEEPER)
        lsb = forward_logprobs(
            model, trace_full.token_ids, trace_full.prompt_lens,
            generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=LSB).records,
            mode="trace", capture_codes=DEEPER,
        )  # fmt: skip
    m_qat, m_trace, m_lsb = (mismatches(o.codes, trace_full.diagnostics) for o in (qat, trace, lsb))
    # (machine-specific: where incremental decode and the packed forward compute bit for bit alike,
    # e.g. eager attention under ATEN_CPU_CAPABILITY=avx2, there is no drift and every count is 0)
    assert m_trace[0] <= 0.1 * m_qat[0] and m_lsb[0] <= 0.1 * m_qat[0]
    assert m_qat[1] >= 0.5 * m_qat[0]  # most mismatches are one codeword apart

    everywhere = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full"), diagnostics=ALL)
    with torch.no_grad():
        qat_all = forward_rollout(model, everywhere, mode="qat", capture_codes=ALL)
        trace_all = forward_rollout(model, everywhere, mode="trace", capture_codes=ALL)
    assert mismatches(trace_all.codes, everywhere.diagnostics)[0] == 0
    gap = {
        name: torch.cat([a - b for a, b in zip(o.logprobs, everywhere.logprobs)]).abs().max()
        for name, o in (("qat", qat_all), ("trace", trace_all))
    }
    if mismatches(qat_all.codes, everywhere.diagnostics)[0] > 0:
        # with every code reproduced the gap is the BF16 pair's; QAT's carries every flipped codeword
        assert gap["trace"] < 0.5 * gap["qat"], gap
    else:  # no drift on this machine: both arms compute the rollout's codes, the same gap
        assert gap["trace"] == gap["qat"], gap


def test_packed_batch_equals_sequences_alone() -> None:
    """Packing isolates the trajectories (float32, BF16 mode)."""
    model = from_config(CONFIG, dtype=torch.float32, seed=0)
    tail = torch.randint(2, 32, (6,), generator=torch.Generator().manual_seed(0))
    seqs = [torch.cat([p, tail]) for p in PROMPTS]
    lens = [p.numel() for p in PROMPTS]
    with torch.no_grad():
        packed = forward_logprobs(model, seqs, lens, mode="bf16", replay_routing=False)
        for b, ids in enumerate(seqs):
            torch.testing.assert_close(packed.logprobs[b], hf_logprobs(model, ids, lens[b]), atol=1e-5, rtol=0)
    values, mask = packed.padded()
    assert values.shape == mask.shape == (4, 6) and mask.all()


def test_trainer_rejects_records_that_do_not_fit(model: torch.nn.Module, trace_full: RolloutOutput) -> None:
    ids, lens, recs = trace_full.token_ids[:2], trace_full.prompt_lens[:2], trace_full.records[:2]
    short = [dict(recs[0]), recs[1]]
    short[0]["L02.k.codes"] = short[0]["L02.k.codes"][:-1]
    with pytest.raises(ValueError, match="leading dim"):
        forward_logprobs(model, ids, lens, short)
    no_routing = [{k: v for k, v in r.items() if k != "L01.routing"} for r in recs]
    with pytest.raises(ValueError, match="routing replay"):
        forward_logprobs(model, ids, lens, no_routing, mode="qat")
    vanilla = [{k: v for k, v in r.items() if k.endswith("routing")} for r in recs]
    with pytest.raises(ValueError, match="trace mode needs guidance"):
        forward_logprobs(model, ids, lens, vanilla, mode="trace")
    with pytest.raises(ValueError, match="different tensors"):
        forward_logprobs(model, ids, lens, [recs[0], vanilla[1]], mode="qat")
    with pytest.raises(ValueError, match="unknown record name"):
        forward_logprobs(model, ids, lens, [{**r, "L2.k.codes": r["L02.k.codes"]} for r in recs])
    with pytest.raises(ValueError, match="L02.k.*mxfp4"):
        forward_logprobs(model, ids, lens, recs, plan=PrecisionPlan(kv_cache="mxfp4"))
    with pytest.raises(ValueError, match="needs the rollout's records"):
        forward_logprobs(model, ids, lens)


def test_records_travel_through_the_store(tmp_path, model: torch.nn.Module) -> None:
    """The rollout's per-trajectory dicts are the store's record format, and come back usable."""
    from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step

    rollout = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, seed=2), plan=FP4, guidance=LSB)
    ids = [f"t{b}" for b in range(len(PROMPTS))]
    with StoreWriter(tmp_path, 0, "w0", model_signature="tiny", policy_version=0,
                     contract=quantizer_contract(FP4, LSB)) as writer:
        for tid, rec, p in zip(ids, rollout.records, rollout.prompt_lens):
            writer.add(tid, rec, prompt_len=p)
    seal_step(tmp_path, 0, ["w0"])
    reader = StoreReader(tmp_path, 0, model_signature="tiny", policy_version=0)
    records = reader.batch(ids, [t.numel() for t in rollout.token_ids])
    reader.close()
    with torch.no_grad():
        direct = forward_rollout(model, rollout, mode="trace").logprobs
        stored = forward_logprobs(model, rollout.token_ids, rollout.prompt_lens, records, mode="trace").logprobs
    assert all(torch.equal(a, b) for a, b in zip(direct, stored))


def test_engine_writes_its_records_into_the_store_itself(tmp_path, model: torch.nn.Module) -> None:
    """generate(..., store=target): the engine's writer holds exactly the records generate returns
    without a target, and the rollout comes back without them (only tokens and log-probs)."""
    from tracefp4.engines.sink import StoreTarget
    from tracefp4.guidance.store import StoreReader, seal_step

    engine = HomeEngine(model)
    sampling = SamplingParams(max_new_tokens=8, seed=2)
    plain = engine.generate(PROMPTS, sampling, plan=FP4, guidance=LSB)
    ids = tuple(f"t{b}" for b in range(len(PROMPTS)))
    target = StoreTarget(str(tmp_path), 0, "w3", ids, "tiny", 5)
    stored = engine.generate(PROMPTS, sampling, plan=FP4, guidance=LSB, store=target)
    assert stored.records == [] and stored.stored == target and "store_write_s" in stored.timings
    assert all(torch.equal(a, b) for a, b in zip(stored.token_ids, plain.token_ids))
    seal_step(tmp_path, 0, ["w3"])
    with StoreReader(tmp_path, 0, model_signature="tiny", policy_version=5) as r:
        back = r.batch(list(ids), [t.numel() for t in plain.token_ids])
    for got, want in zip(back, plain.records):
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="names 2 trajectories"):
        engine.generate(PROMPTS, sampling, plan=FP4, guidance=LSB, store=target.slice(0, 2, "w4"))
    with pytest.raises(ValueError, match="repeat"):
        StoreTarget(str(tmp_path), 0, "w5", ("a", "a"), "tiny", 5)


# --- what each arm records -----------------------------------------------------------------------


def test_qat_rollout_records_only_routing_and_capture_needs_no_guidance(model: torch.nn.Module) -> None:
    """A qat arm's rollout: routing records only; its full codes (diagnostics) stay out of the records,
    and the trainer captures its own codes at any layers from routing-only records."""
    roll = generate(model, PROMPTS, SAMPLING, plan=FP4, diagnostics=DEEPER)
    assert all(set(r) == {routing_key(i) for i in range(4)} for r in roll.records)
    assert roll.guidance_bytes() == 0
    for diag in roll.diagnostics:
        assert {parse_name(k).layer for k in diag} == DEEPER and {parse_name(k).field for k in diag} == {
            "codes", "scales", "global_amax"
        }
    with torch.no_grad():
        qat = forward_rollout(model, roll, mode="qat", capture_codes=DEEPER)
    assert set(qat.codes[0]) == {record_prefix(i, s) for i in DEEPER for s in (*EXPERT_SITES, *KV_SITES)}
    mism, one, total = mismatches(qat.codes, roll.diagnostics)
    # two paths' BF16 drift flips some codes (none where this machine computes both bit for bit alike),
    # never most of them (a flip needs a value within the drift of a rounding midpoint; half flipped
    # would mean another function)
    assert total > 0 and 0 <= mism < 0.5 * total
    with pytest.raises(ValueError, match="diagnostics"):
        code_mismatch(forward_rollout(model, roll, mode="qat", capture_codes=ALL).codes, roll.diagnostics)
    with pytest.raises(ValueError, match="BF16"):
        forward_rollout(model, roll, mode="bf16", capture_codes=DEEPER)


def test_diagnostics_are_never_records(model: torch.nn.Module) -> None:
    roll = generate(model, PROMPTS[:2], SAMPLING, plan=FP4, guidance=LSB, diagnostics=ALL)
    for rec, diag in zip(roll.records, roll.diagnostics):
        assert not any(k.endswith(".codes") for k in rec)  # lsb records carry bits, never codes
        assert {parse_name(k).layer for k in rec if not parse_name(k).is_routing} == DEEPER
        assert {parse_name(k).layer for k in diag} == ALL


def test_lsb_recording_path_equals_the_lsb_bits_of_full_records(model: torch.nn.Module) -> None:
    """The lsb mode's own recording path (bits packed once per rollout) writes exactly the low bits,
    scales and amax of a full-mode rollout on the same prompts and seed."""
    lsb = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=LSB)
    full = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=GuidedMode.parse("full@deeper"))
    for rl, rf in zip(lsb.records, full.records):
        assert {k.replace(".bits", ".codes") for k in rl} == set(rf)
        for key, bits in rl.items():
            if key.endswith(".bits"):
                assert torch.equal(bits, lsb_bits(rf[key.replace(".bits", ".codes")]))
            elif key.endswith(".scales"):
                assert torch.equal(bits.view(torch.uint8), rf[key].view(torch.uint8))
            else:
                assert torch.equal(bits, rf[key])


def test_compact_mode_end_to_end(model: torch.nn.Module) -> None:
    """An ldpc record from the rollout decodes in the trainer and guides it (code mismatches drop)."""
    mode = GuidedMode.parse("ldpc(1/8)+scales:ldpc(1/4)+amax:lo3@all")
    roll = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=mode, diagnostics=ALL)
    assert roll.guidance == mode
    assert all(any("packed__" in k for k in r) for r in roll.records)
    lsb = generate(model, PROMPTS, SAMPLING, plan=FP4, guidance=LSB)
    assert roll.guidance_bytes() <= 0.25 * lsb.guidance_bytes()  # all layers at a quarter of lsb's deeper half
    with torch.no_grad():
        trace = forward_rollout(model, roll, mode="trace", capture_codes=ALL)
        qat = forward_rollout(model, roll, mode="qat", capture_codes=ALL)
    m_trace, m_qat = mismatches(trace.codes, roll.diagnostics), mismatches(qat.codes, roll.diagnostics)
    # With every layer guided the drift left is BF16 op ordering, so almost every syndrome block
    # decodes and its elements take the rollout's codes; a block that fails is rounded to nearest on
    # the rollout's grid (counted in decode_failures), i.e. mismatches at most like QAT's there. Unless
    # most blocks fail, guidance removes the bulk of QAT's mismatches (we require 90%).
    assert m_trace[0] <= 0.1 * m_qat[0], (m_trace, m_qat, trace.decode.failed_blocks)


def test_home_engine_is_a_rollout_engine(model: torch.nn.Module) -> None:
    engine = HomeEngine(copy.deepcopy(model))
    assert isinstance(engine, RolloutEngine)
    a = engine.generate(PROMPTS[:2], SAMPLING, plan=FP4, guidance=None)
    b = generate(model, PROMPTS[:2], SAMPLING, plan=FP4)
    assert all(torch.equal(x, y) for x, y in zip(a.token_ids, b.token_ids))
    assert set(a.timings) == {"prefill_s", "decode_s", "records_s"}
    state = {k: v * 0.5 if k.endswith("gate_up_proj") else v for k, v in model.state_dict().items()}
    engine.load_weights(state, 7)
    c = engine.generate(PROMPTS[:2], SAMPLING, plan=FP4, guidance=None)
    assert engine.version == 7 and not all(torch.equal(x, y) for x, y in zip(c.logprobs, a.logprobs))
    with pytest.raises(ValueError, match="do not fit"):
        engine.load_weights({"nope": torch.zeros(1)}, 8)
    with pytest.raises(ValueError, match="BF16"):
        generate(model, PROMPTS[:1], SAMPLING, guidance=LSB)
    with pytest.raises(ValueError, match="diagnostic layers"):
        generate(model, PROMPTS[:1], SAMPLING, plan=FP4, diagnostics=frozenset({4}))


@pytest.mark.parametrize("mode", ["lsb@all", "full", "sparse(0.02)+parity+amax:lo3@all"])
def test_records_equal_each_trajectorys_steps_recorded_alone(model: torch.nn.Module, mode: str) -> None:
    """The assembly (each site concatenated, gathered and encoded once, then cut per trajectory)
    gives every trajectory exactly what its own rows of each forward, in chronological order, make
    as one record; with a batch that shrinks (stop tokens) and diagnostics."""
    from tracefp4.engines.capture import RolloutCapture
    from tracefp4.engines.rollout import assemble_records, decode_n_tokens, prefill
    from tracefp4.guidance.compact import record_cat

    sampling = SamplingParams(max_new_tokens=24, seed=0, stop_token_ids=[4, 9, 17])
    capture = RolloutCapture.of(GuidedMode.parse(mode), DEEPER, 4)
    with torch.no_grad():
        st, logits = prefill(model, FP4, capture, PROMPTS, 0)
        decode_n_tokens(st, logits, sampling, torch.Generator().manual_seed(sampling.seed))
    lengths = [p + len(c) for p, c in zip(st.prompt_lens, st.completions)]
    assert len({len(c) for c in st.completions}) > 1  # the batch shrank
    records, diagnostics = assemble_records(st.steps, lengths, 8, capture)
    for b in range(len(PROMPTS)):
        mine = [(s, s.rows[s.traj == b]) for s in st.steps]
        want = {routing_key(layer): torch.cat([s.record.routing[layer][r] for s, r in mine]).to(torch.uint8)
                for layer in st.steps[0].record.routing}
        for name in st.steps[0].record.guidance:
            want.update(record_cat([s.record.guidance[name].select(r) for s, r in mine]).to_tensors(name))
        diag = {}
        for name in st.steps[0].record.diagnostics:
            diag.update(record_cat([s.record.diagnostics[name].select(r) for s, r in mine]).to_tensors(name))
        for got, expect in ((records[b], want), (diagnostics[b], diag)):
            assert list(got) == list(expect)
            for key, t in got.items():
                assert t.dtype == expect[key].dtype and t.shape[0] == lengths[b], key
                assert torch.equal(t.view(torch.uint8), expect[key].view(torch.uint8)), key
