"""FP8 E4M3 rollout-guided rounding: golden cases, fast == reference (atol=0), the guided-rounding
properties on the E4M3 line, FP8 hints in the store layout, the W8A8 plan on both paths, and the
mismatch report's FP8 check."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracefp4 as tf
from fp4data import DTYPES, KINDS, bits, make_data, rollout_and_trainer
from tracefp4.cli import main
from tracefp4.engines.experts.dense import DenseGEMM
from tracefp4.engines.model import from_config, tiny_config
from tracefp4.engines.plan import PrecisionPlan
from tracefp4.engines.protocol import SamplingParams
from tracefp4.engines.rollout import generate
from tracefp4.engines.trainer import code_mismatch, forward_logprobs
import tracefp4.formats as formats
from tracefp4.formats import reference as ref
from tracefp4.formats import code_positions, fp8_lsb_bits, guided_fp8
from tracefp4.formats.quantizers import FP8Quantizer, Grid
from tracefp4.guidance.compact import GuidanceSpec, GuidedMode, encode_record

torch.set_num_threads(1)


def fp8_codes(values: list[float]) -> list[int]:
    return torch.tensor(values).to(torch.float8_e4m3fn).view(torch.uint8).tolist()


# --- the E4M3 line -------------------------------------------------------------------------------


def test_e4m3_table_and_golden_rounding():
    mags = ref.e4m3_magnitudes()
    assert torch.equal(mags, torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float())
    assert (mags[0x01].item(), mags[0x08].item(), mags[0x38].item(), mags[0x7E].item()) == (2**-9, 2**-6, 1.0, 448.0)
    assert bool((mags[1:] > mags[:-1]).all())  # adjacent magnitude codes are adjacent values
    # ties go to the even code: 1.0625 between 1.0 (0x38) and 1.125 (0x39); 1.1875 between 0x39 and 0x3A
    z = torch.tensor([1.0625, 1.1875, -1.0625, -0.0, 2**-10, 3 * 2**-10, 448.0])  # 3*2^-10: between 0x01 and 0x02
    assert ref.round_to_e4m3(z).tolist() == [0x38, 0x3A, 0xB8, 0x80, 0x00, 0x02, 0x7E]
    assert ref.round_to_e4m3(z).tolist() == fp8_codes(z.tolist())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_equals_reference(kind, dtype):
    x = make_data(kind, dtype, 12, 64)
    q = tf.quantize_fp8(x)
    codes, scale = ref.quantize_fp8(x)
    assert torch.equal(q.codes, codes) and torch.equal(bits(q.scale), bits(scale))
    assert torch.equal(bits(formats.dequantize_fp8(q)), bits(ref.dequantize_fp8(codes, scale)))


def _guided(train, roll, mode):
    """Guided E4M3 codes for trainer values on a row whose scale is 1 (the rollout's row max is 448)."""
    x_roll, x_train = torch.tensor(roll + [448.0]), torch.tensor(train + [448.0])
    pad = (-x_roll.numel()) % 8
    x_roll, x_train = torch.cat([x_roll, torch.zeros(pad)]), torch.cat([x_train, torch.zeros(pad)])
    q = tf.quantize_fp8(x_roll)
    assert q.scale.item() == 1.0
    got = tf.guided_quantize(x_train, tf.encode_hint(q, mode)).codes[: len(train)].tolist()
    kw = {"rollout_codes": q.codes} if mode == "full" else {"rollout_lsb": q.codes & 1}
    assert got == ref.guided_quantize_fp8(x_train, q.scale, **kw)[: len(train)].tolist()
    return got


@pytest.mark.parametrize("mode", ["lsb", "full"])
def test_golden_guided_choices(mode):
    # trainer 1.07 rounds to 1.125 (0x39); the rollout had 1.05 -> 1.0 (0x38): the bracket's other member
    assert _guided([1.07], [1.05], mode) == [0x38]
    # across zero: trainer -2^-11 (bracket {-2^-9, -0}), rollout +2^-9 (0x01)
    assert _guided([-(2.0**-11)], [2.0**-9], mode) == ([0x01] if mode == "full" else [0x81])
    # a rollout zero of the other sign: the guided zero keeps the trainer's sign bit
    assert _guided([-(2.0**-12)], [0.0], mode) == [0x80]
    # saturation: 500 clamps to 448, a bracket of one member; the rollout's 400 (a tie: 384, 0x7C) is
    # outside it, which only full information names
    assert _guided([500.0], [400.0], mode) == ([0x7E] if mode == "lsb" else [0x7C])


def test_full_takes_the_rollout_code_lsb_stays_in_the_bracket():
    # trainer 1.07 (bracket {1.0, 1.125} = 0x38, 0x39); rollout 0.5 (0x30), far outside it. The full hint
    # is the rollout's code itself (E4M3's near-zero spacing is finer than BF16 noise of a cancelling sum);
    # the low bit of 0x30 is 0 and names 1.0 (0x38) within the bracket.
    assert _guided([1.07], [0.5], "full") == [0x30]
    assert _guided([1.07], [0.5], "lsb") == [0x38]


@pytest.mark.parametrize("mode", ["lsb", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drift", [1e-3, 3e-2, 0.5])
def test_guided_fast_equals_reference(mode, dtype, drift):
    x_roll, x_train = rollout_and_trainer(11, 8, 128, drift, dtype)
    q = tf.quantize_fp8(x_roll)
    fast = tf.guided_quantize(x_train, tf.encode_hint(q, mode))
    kw = {"rollout_codes": q.codes} if mode == "full" else {"rollout_lsb": q.codes & 1}
    assert torch.equal(fast.codes, ref.guided_quantize_fp8(x_train, q.scale, **kw))
    assert torch.equal(bits(fast.scale), bits(q.scale))


def test_guided_on_zero_and_subnormal_rows_equals_reference():
    for kind in ("zero_blocks", "heavy_tailed", "tiny"):
        x_roll = make_data(kind, torch.float32, 6, 64)
        x_train = x_roll * (1 + 0.02 * torch.randn(6, 64, generator=torch.Generator().manual_seed(3)))
        q = tf.quantize_fp8(x_roll)
        for mode in ("lsb", "full"):
            kw = {"rollout_codes": q.codes} if mode == "full" else {"rollout_lsb": q.codes & 1}
            got = tf.guided_quantize(x_train, tf.encode_hint(q, mode)).codes
            assert torch.equal(got, ref.guided_quantize_fp8(x_train, q.scale, **kw)), (kind, mode)


# --- properties ----------------------------------------------------------------------------------

PROFILE = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def two_paths(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rows = draw(st.integers(1, 6))
    cols = 8 * draw(st.integers(1, 16))
    drift = draw(st.sampled_from([1e-4, 1e-3, 1e-2, 0.1, 1.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return rollout_and_trainer(seed, rows, cols, drift, dtype)


@PROFILE
@given(two_paths())
def test_guided_never_farther_than_rtn_and_full_reproduces_every_code(paths):
    x_roll, x_train = paths
    q = tf.quantize_fp8(x_roll)
    r = code_positions(q.codes, "fp8")
    # round-to-nearest of the trainer's value on the rollout's grid: what the guided code is compared with
    rtn = code_positions(ref.round_to_e4m3(ref.fp8_z(x_train, q.scale)), "fp8")
    full = tf.guided_quantize(x_train, tf.encode_hint(q, "full")).codes
    lsb = tf.guided_quantize(x_train, tf.encode_hint(q, "lsb")).codes
    # the full-hint promise per element, |q_guided - q_roll| <= |q_rtn - q_roll|: here with equality to 0,
    # every code, bracketed or not
    assert bool(((code_positions(full, "fp8") - r).abs() <= (rtn - r).abs()).all())
    assert torch.equal(code_positions(full, "fp8"), r)
    # lsb reproduces every rollout code that lies in the trainer's bracket, and stays in the bracket
    z = ref.fp8_z(x_train, q.scale)
    lo, hi = ref.bracket_e4m3(z)
    neg = torch.signbit(z)
    q_minus, q_plus = torch.where(neg, -hi, lo), torch.where(neg, -lo, hi)  # the bracket on the signed line
    in_bracket = (r == q_minus) | (r == q_plus)
    got = code_positions(lsb, "fp8")
    assert torch.equal(got[in_bracket], r[in_bracket])
    assert bool(((got == q_minus) | (got == q_plus)).all())


@PROFILE
@given(two_paths(), st.sampled_from(["lsb", "full"]))
def test_guided_fake_quant_is_straight_through(paths, mode):
    x_roll, x_train = paths
    hint = tf.encode_hint(tf.quantize_fp8(x_roll), mode)
    x = x_train.clone().requires_grad_(True)
    y = tf.guided_fake_quant(x, hint)
    assert y.dtype == x.dtype and torch.equal(y, tf.dequantize(tf.guided_quantize(x_train, hint)).to(x.dtype))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


# --- hints, grids, errors ------------------------------------------------------------------------


def test_fp8_hint_layout_sizes_and_round_trip():
    codes = torch.tensor([[1, 2, 3, 0x84, 5, 6, 7, 0x89] + [0] * 8], dtype=torch.uint8)  # low bits 1,0,1,0,1,0,1,1
    assert fp8_lsb_bits(codes).tolist() == [[0b1101_0101, 0]]
    x = torch.randn(10, 2, 64)
    q = FP8Quantizer().quantize(x)
    lsb, full = tf.encode_hint(q, "lsb"), tf.encode_hint(q, "full")
    assert lsb.nbytes == 20 * (64 // 8 + 4) and full.nbytes == 20 * (64 + 4)  # bits or codes, a scale per row
    assert lsb.shape == full.shape == x.shape and lsb.fmt is tf.Format.FP8
    for h in (lsb, full):
        back = tf.Hint.from_tensors(h.to_tensors("L01.expert_mid"), "L01.expert_mid")
        assert (back.mode, back.fmt, back.shape) == (h.mode, h.fmt, h.shape)
        parts = tf.hint_cat([h.select(slice(0, 3)), h.select(slice(3, 10))])
        y = x * 1.01
        assert torch.equal(tf.guided_quantize(y, back).codes, tf.guided_quantize(y, parts).codes)


def test_fp8_grids_and_hints_are_validated():
    x = torch.randn(4, 32)
    q = tf.quantize_fp8(x)
    qz = FP8Quantizer()
    assert qz.guidable and qz.grid(q).scales is q.scale and qz.grid(q).global_amax is None
    with pytest.raises(ValueError, match=r"lsb: expected uint8 of shape \(4, 4\)"):
        qz.guided_quantize(x, qz.grid(q), lsb=torch.zeros(4, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"codes: expected uint8 of shape \(4, 32\)"):
        qz.guided_quantize(x, qz.grid(q), codes=torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="finite and positive"):
        guided_fp8(x, torch.zeros(4, 1), codes=q.codes)
    with pytest.raises(ValueError, match="finite and positive"):
        guided_fp8(x, torch.full((4, 1), float("nan")), codes=q.codes)
    with pytest.raises(ValueError, match=r"expected float32 of shape \(4, 1\)"):
        guided_fp8(x, torch.ones(4), codes=q.codes)
    with pytest.raises(ValueError, match="an FP8 grid is its row scale alone"):
        qz.guided_quantize(x, Grid(q.scale, torch.tensor(1.0)), codes=q.codes)
    with pytest.raises(ValueError, match="multiple of 8"):
        guided_fp8(torch.randn(4, 12), torch.ones(4, 1), lsb=torch.zeros(4, 1, dtype=torch.uint8))
    bad = x.clone()
    bad[2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite input at index \(2, 5\)"):
        guided_fp8(bad, q.scale, codes=q.codes)
    with pytest.raises(ValueError, match="not an FP4 format"):
        formats.guided_codes(x, "fp8", q.scale, None, codes=q.codes)
    with pytest.raises(ValueError, match="compact modes are FP4's"):
        encode_record(x[:, None], tf.quantize_fp8(x[:, None]), GuidanceSpec.parse("lsb+parity"))


# --- the W8A8 plan on both paths -----------------------------------------------------------------


def test_fp8_plan_quantizers_and_per_channel_weights():
    plan = PrecisionPlan.fp8()
    assert {plan.site_format(s) for s in tf.Site} == {"fp8"} and all(plan.guidable(s) for s in tf.Site)
    assert plan.weight_quantizer == FP8Quantizer() and PrecisionPlan(**plan.to_dict()) == plan
    w = torch.randn(3, 8, 32) * torch.tensor([1.0, 50.0, 1e-3]).reshape(3, 1, 1)
    q = plan.weight_quantizer.quantize(w)
    # one scale per output channel of each expert: amax over K / 448
    assert torch.equal(q.scale, w.abs().amax(dim=-1, keepdim=True) / 448.0)
    prepared = DenseGEMM().prepare(w.to(torch.bfloat16), plan.weight_quantizer)
    assert prepared.values.dtype == torch.float32 and torch.equal(prepared.divisor, torch.ones(3))
    assert torch.equal(prepared.values, formats.dequantize_fp8(plan.weight_quantizer.quantize(w.to(torch.bfloat16))))
    wg = w.clone().requires_grad_(True)
    trained = DenseGEMM().prepare(wg, plan.weight_quantizer, gradients=True)
    trained.values.sum().backward()
    assert torch.equal(wg.grad, torch.ones_like(w))  # straight-through to the master weight


def _model():
    config = tiny_config(layers=2, experts=4, top_k=2, hidden=32, moe_intermediate=32, heads=2, kv_heads=1,
                         head_dim=16, vocab=32, init_std=0.1)
    return from_config(config, seed=0)


@pytest.mark.parametrize("plan", [PrecisionPlan.fp8(), PrecisionPlan.w4a8()], ids=["fp8", "w4a8"])
def test_fp8_sites_are_recorded_and_full_hints_reproduce_every_code(plan):
    """Every activation and KV site is guided (W4A8's FP8 activations included), and a trainer with
    full hints on every layer picks every code the decoding rollout picked."""
    model = _model()
    prompts = [torch.randint(0, 32, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    every = frozenset(range(2))
    roll = generate(model, prompts, SamplingParams(max_new_tokens=8, seed=1), plan=plan,
                    guidance=GuidedMode.parse("full"), diagnostics=every)
    sites = {k.rsplit(".", 1)[0] for k in roll.records[0] if not k.endswith("routing")}
    assert sites == {f"L{i:02d}.{s}" for i in range(2) for s in ("expert_in", "expert_mid", "k", "v")}
    assert roll.records[0]["L00.expert_in.scales"].dtype == (torch.float32)  # an FP8 row scale
    out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode="trace", plan=plan,
                           capture_codes=every)
    stats = code_mismatch(out.codes, roll.diagnostics)
    assert len(stats) == 8 and sum(s.mismatched for s in stats.values()) == 0
    qat = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records, mode="qat", plan=plan,
                           capture_codes=every)
    assert sum(s.total for s in code_mismatch(qat.codes, roll.diagnostics).values()) == sum(
        s.total for s in stats.values())


def test_mismatch_report_fp8(tmp_path):
    """``tracefp4 mismatch --plan fp8``: E4M3 codes at every site; full hints reproduce every code and
    lsb hints on every layer leave at most a tenth of vanilla QAT's mismatch. Machine-specific as in
    test_mismatch.py: where decode and the packed forward do not drift, every arm agrees exactly."""
    path = tmp_path / "fp8.json"
    argv = ["mismatch", "--plan", "fp8", "--layers", "4", "--hidden", "32", "--moe-intermediate", "16",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "32", "--batch", "4",
            "--new-tokens", "12", "--prompt-len", "8", "--json", str(path), "--quiet"]
    assert main(argv) == 0
    rep = json.loads(path.read_text())
    assert rep["plan_name"] == "fp8" and rep["config"]["plan"] == {"weights": "fp8", "activations": "fp8",
                                                                   "kv_cache": "fp8"}
    assert rep["config"]["compact_layers"] == [0, 1, 2, 3]  # FP8's lsb arm guides every layer
    counts = rep["mismatch_counts"]
    assert counts["trace-full"]["mismatched"] == 0
    assert counts["trace"]["total"] == counts["qat"]["total"]
    assert counts["trace"]["mismatched"] <= 0.1 * counts["qat"]["mismatched"]
    with pytest.raises(SystemExit, match="--plan fp8 goes without it"):
        main(["mismatch", "--sweep", "--plan", "fp8"])
