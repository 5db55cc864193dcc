"""The ``mod4`` guidance mode (issue 48, Deliver 3): the code's signed-line position mod 4, two bits per
element with the block scales and amax in full.

Its contract, checked here on planted cases (every codeword and every bracket, every rollout code 0, 1
and 2 codewords outside the trainer's bracket on both sides): a rollout code inside the trainer's
bracket decodes exactly; one 1 or 2 codewords outside is detected, rounded to nearest on the rollout's
grid and counted (``DecodeReport.bracket_misses``); 3 or more can alias and are not claimed. Then the
vectorised decode against the readable reference (atol=0), the record through the store, the bytes
against ``lsb``, the plans that take it, and the tiny model end to end: the rollout records ``mod4``,
the trainer at the same weights reproduces every code, and at moved weights it counts the misses
that ``lsb`` decodes silently to the wrong codeword.
"""

from __future__ import annotations

import pytest
import torch

from tracefp4.formats import reference as ref
from tracefp4.formats import (FP8, MXFP4, NVFP4, pack_fp4, quantize_fp8, quantize_mxfp4, quantize_nvfp4,
                              quantize_nvfp4_4over6, unpack_fp4)
from tracefp4.formats.constants import E2M1_VALUES, Format, HintMode
from tracefp4.formats.fp8 import fp8_grid_z, mod4_e4m3
from tracefp4.formats.grid import grid_z, mod4_e2m1
from tracefp4.guidance.compact import (
    CompactRecord,
    DecodeReport,
    GuidanceSpec,
    GuidedMode,
    read_record,
    site_bytes_per_token,
)
from tracefp4.guidance.compact.elements import Mod4Elements
from tracefp4.guidance.hints import encode_hint, guided_quantize

torch.set_num_threads(1)

#: every signed-line position of E2M1, -6 .. 6
POSITIONS = range(-7, 8)


def signed_value(p: int) -> float:
    return E2M1_VALUES[abs(p)] * (1 if p >= 0 else -1)


def planted_brackets() -> list[tuple[float, int, int]]:
    """(z, q-, q+) for every codeword (a one-member bracket) and three points inside every open
    bracket (near each member and the midpoint, so round to nearest takes either member)."""
    out = [(signed_value(p), p, p) for p in POSITIONS]
    out.append((-0.0, 0, 0))
    for p in range(-7, 7):
        a, b = signed_value(p), signed_value(p + 1)
        for w in (0.1, 0.5, 0.9):
            out.append((a + w * (b - a), p, p + 1))
    return out


def test_planted_cases_decode_exactly_or_detect_the_miss_reference() -> None:
    """The readable reference's rule, case by case: inside the bracket the rollout's position; 1 or 2
    codewords outside (either side) a detected miss that keeps round to nearest. Also pins down what
    is NOT detected, so the docstring's "3 or more can alias" is a fact and not a hope."""
    seen = {"in": 0, 1: 0, 2: 0, "aliased": 0}
    for z, q_minus, q_plus in planted_brackets():
        zt = torch.tensor([z], dtype=torch.float32)
        lo, hi = ref.bracket(zt)
        assert sorted((q_minus, q_plus)) == sorted(
            (int(torch.where(torch.signbit(zt), -hi, lo)), int(torch.where(torch.signbit(zt), -lo, hi))))
        rtn = int(ref.signed_index(ref.round_to_e2m1(zt)))
        for r in POSITIONS:
            d = max(q_minus - r, 0) + max(r - q_plus, 0)
            for code in ([0, 8] if r == 0 else [r if r > 0 else 8 - r]):  # position 0: both zeros
                rollout = torch.tensor([code], dtype=torch.uint8)
                residue = ref.mod4_residue(rollout)
                assert int(residue) == r % 4
                got, miss = ref.guided_round_mod4(zt, residue)
                assert int(ref.bracket_distance(zt, rollout)) == d
                pos = int(ref.signed_index(got))
                assert int(got) >> 3 == int(torch.signbit(zt))  # the sign bit is the trainer's z's
                if d == 0:
                    assert pos == r and not miss, (z, r)
                    seen["in"] += 1
                elif d <= 2:
                    assert bool(miss) and pos == rtn, (z, r)
                    seen[d] += 1
                else:
                    # 3 steps beyond a two-member bracket (or 4 beyond a codeword) is another member's
                    # residue: decoded as that member, undetected; otherwise still detected
                    assert q_minus <= pos <= q_plus
                    seen["aliased"] += not bool(miss)
                    if bool(miss):
                        assert pos == rtn
                    elif q_minus < q_plus:
                        assert d % 4 in (0, 3)
                    else:
                        assert d % 4 == 0
    # every kind of case occurred, on both sides (1 and 2 steps below -6 or above +6 do not exist, so
    # these counts are the planted set's, not a floor)
    assert seen["in"] > 0 and seen[1] > 0 and seen[2] > 0 and seen["aliased"] > 0, seen


def test_lsb_decodes_one_and_two_steps_out_silently_to_a_wrong_code() -> None:
    """What mod4 adds over lsb: a rollout code 1 or 2 codewords beyond the bracket decodes with lsb to a
    bracket member (every time: there is nothing else it can return), never the rollout's code, and
    lsb has no way to say so. mod4 returns round to nearest and flags every one."""
    for z, q_minus, q_plus in planted_brackets():
        if q_minus == q_plus:
            continue
        zt = torch.tensor([z], dtype=torch.float32)
        for r in (q_minus - 2, q_minus - 1, q_plus + 1, q_plus + 2):
            if not -7 <= r <= 7:
                continue
            code = torch.tensor([r if r >= 0 else 8 - r], dtype=torch.uint8)
            lsb = ref.guided_round(zt, None, code & 1)
            assert int(ref.signed_index(lsb)) in (q_minus, q_plus) and int(ref.signed_index(lsb)) != r
            _, miss = ref.guided_round_mod4(zt, ref.mod4_residue(code))
            assert bool(miss)


def test_e4m3_reference_obeys_the_same_rule() -> None:
    """The E4M3 line (126 magnitudes, adjacent codes one apart) under the same rule, every code."""
    mags = ref.e4m3_magnitudes()
    for p in list(range(0, 127, 5)) + [126]:
        for sign in (1.0, -1.0):
            for w in (0.0, 0.3, 0.7):
                v = float(mags[p]) if w == 0.0 or p == 126 else float(mags[p] + w * (mags[p + 1] - mags[p]))
                z = torch.tensor([sign * v], dtype=torch.float32)
                lo, hi = ref.bracket_e4m3(z)
                q_minus = int(torch.where(torch.signbit(z), -hi, lo))
                q_plus = int(torch.where(torch.signbit(z), -lo, hi))
                rtn = int(ref.signed_index_e4m3(ref.round_to_e4m3(z)))
                for r in range(q_minus - 2, q_plus + 3):
                    if not -126 <= r <= 126:
                        continue
                    code = torch.tensor([r if r >= 0 else 128 - r], dtype=torch.uint8)
                    got, miss = ref.guided_round_mod4_e4m3(z, ref.mod4_residue(code, "e4m3"))
                    d = int(ref.bracket_distance(z, code, "e4m3"))
                    assert d == max(q_minus - r, 0) + max(r - q_plus, 0)
                    pos = int(ref.signed_index_e4m3(got))
                    assert (pos, bool(miss)) == ((r, False) if d == 0 else (rtn, True)), (z, r)



# --- the vectorised decode against the reference --------------------------------------------------


def hard_z(n: int, seed: int) -> torch.Tensor:
    """Clamped float32 z with every codeword, midpoint and signed zero among random values."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor(E2M1_VALUES)
    special = torch.cat([mags, (mags[1:] + mags[:-1]) / 2, torch.tensor([1e-30, 5.999, 6.0])])
    special = torch.cat([special, -special])
    rand = (torch.rand(n, generator=g) * 12 - 6)
    return torch.cat([special, torch.tensor([0.0, -0.0]), rand]).float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_decode_equals_the_reference(seed: int) -> None:
    z = hard_z(4000, seed)
    for residue in range(4):
        r = torch.full(z.shape, residue, dtype=torch.uint8)
        got, miss = mod4_e2m1(z, r)
        want, want_miss = ref.guided_round_mod4(z, r)
        assert torch.equal(got, want) and torch.equal(miss, want_miss)
    # the rollout's residue is the codec's own encoding of every code
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(Mod4Elements().encode(codes, None), ref.mod4_residue(codes))


def test_vectorised_e4m3_decode_equals_the_reference() -> None:
    mags = ref.e4m3_magnitudes()
    g = torch.Generator().manual_seed(5)
    mids = (mags[1:] + mags[:-1]) / 2
    special = torch.cat([mags, mids, torch.tensor([0.0, 447.9, 448.0, 1e-30])])
    z = torch.cat([special, -special, (torch.rand(3000, generator=g) * 2 - 1) * 448,
                   (torch.rand(3000, generator=g) * 2 - 1) * 0.05]).float()
    for residue in range(4):
        r = torch.full(z.shape, residue, dtype=torch.uint8)
        got, miss = mod4_e4m3(z, r)
        want, want_miss = ref.guided_round_mod4_e4m3(z, r)
        assert torch.equal(got, want) and torch.equal(miss, want_miss)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN codes
    assert torch.equal(Mod4Elements().encode(codes, None, Format.FP8), ref.mod4_residue(codes, "e4m3"))


# --- the record: planted rollout codes on real grids ----------------------------------------------


def site_value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))
    return x.to(torch.bfloat16)


def planted(x: torch.Tensor, fmt: str, seed: int) -> tuple[NVFP4 | MXFP4, torch.Tensor, torch.Tensor]:
    """The trainer's value ``x`` and a rollout on the same grid whose codes were moved off the trainer's
    bracket on purpose: per element a random offset of 0, 1 or 2 codewords beyond the bracket, below or
    above (each kept on the line -7..7), a zero's sign bit random. Returns (the rollout's quantized
    site, its unpacked codes, each element's planted distance)."""
    if fmt == "nvfp4":
        q = quantize_nvfp4(x, per_row=True)
    elif fmt == "4over6":
        q = quantize_nvfp4_4over6(x, per_row=True)
    else:
        q = quantize_mxfp4(x)
    z = grid_z(x, Format(q.fmt), q.scales, getattr(q, "global_amax", None))
    lo, hi = ref.bracket(z)
    neg = torch.signbit(z)
    q_minus, q_plus = torch.where(neg, -hi, lo), torch.where(neg, -lo, hi)
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(0, 3, z.shape, generator=g)
    below = torch.rand(z.shape, generator=g) < 0.5
    member = torch.where(torch.rand(z.shape, generator=g) < 0.5, q_minus, q_plus)
    r = torch.where(d == 0, member, torch.where(below, q_minus - d, q_plus + d))
    r = torch.where(r > 7, q_minus - d, torch.where(r < -7, q_plus + d, r))  # the other side where one is off the line
    zero_sign = torch.rand(z.shape, generator=g) < 0.5
    codes = torch.where(r > 0, r, torch.where(r < 0, 8 - r, zero_sign.long() * 8)).to(torch.uint8)
    fields = {"codes": pack_fp4(codes), "scales": q.scales}
    rollout = NVFP4(**fields, global_amax=q.global_amax) if isinstance(q, NVFP4) else MXFP4(**fields)
    return rollout, codes, ref.bracket_distance(z, codes)


def rtn_on(x: torch.Tensor, rollout) -> torch.Tensor:
    z = grid_z(x, Format(rollout.fmt), rollout.scales, getattr(rollout, "global_amax", None))
    return ref.round_to_e2m1(z)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "4over6"])
@pytest.mark.parametrize("shape", [(6, 64), (5, 2, 32)])
def test_planted_record_decodes_exactly_or_counts_the_miss(fmt: str, shape: tuple[int, ...]) -> None:
    """Through the record, the store and the trainer's guided quantizer: every element planted in the
    bracket gets the rollout's code, every element planted 1 or 2 codewords out gets round to nearest
    on the rollout's grid and is counted, and the count is exactly those elements. The same rollout
    recorded as lsb gets a wrong code at every planted miss and reports nothing."""
    x = site_value(shape, seed=len(shape))
    rollout, codes, d = planted(x, fmt, seed=3)
    assert int((d == 0).sum()) > 0 and int((d == 1).sum()) > 0 and int((d == 2).sum()) > 0
    record = CompactRecord.encode(x, rollout, GuidanceSpec.parse("mod4"))
    back = read_record(record.to_tensors("L01.expert_in"), "L01.expert_in")
    for rec in (record, back):
        hint, report = rec.decode(x)
        assert hint.mode is HintMode.FULL
        got = unpack_fp4(guided_quantize(x, hint).codes)
        inside = d == 0
        assert torch.equal(ref.signed_index(got)[inside], ref.signed_index(codes)[inside])
        assert torch.equal(got[~inside], rtn_on(x, rollout)[~inside])  # the sign of zeros included
        assert report == DecodeReport(bracket_checked=x.numel(), bracket_misses=int((~inside).sum()))
        assert report.bracket_miss_rate == int((~inside).sum()) / x.numel()
    lsb_hint, lsb_report = encode_hint(rollout, "lsb").decode(x)
    lsb_got = unpack_fp4(guided_quantize(x, lsb_hint).codes)
    assert lsb_report == DecodeReport()
    assert not bool((ref.signed_index(lsb_got) == ref.signed_index(codes))[~inside].any())


@pytest.mark.parametrize("shape", [(6, 64), (5, 2, 32)])
def test_planted_fp8_record_decodes_exactly_or_counts_the_miss(shape: tuple[int, ...]) -> None:
    """The same on an FP8 E4M3 site (per-row float32 scale, the E4M3 signed line -126..126)."""
    x = site_value(shape, seed=7)
    q = quantize_fp8(x)
    z = fp8_grid_z(x, q.scale)
    lo, hi = ref.bracket_e4m3(z)
    neg = torch.signbit(z)
    q_minus, q_plus = torch.where(neg, -hi, lo), torch.where(neg, -lo, hi)
    g = torch.Generator().manual_seed(8)
    d = torch.randint(0, 3, z.shape, generator=g)
    below = torch.rand(z.shape, generator=g) < 0.5
    member = torch.where(torch.rand(z.shape, generator=g) < 0.5, q_minus, q_plus)
    r = torch.where(d == 0, member, torch.where(below, q_minus - d, q_plus + d))
    r = torch.where(r > 126, q_minus - d, torch.where(r < -126, q_plus + d, r))
    zero_sign = torch.rand(z.shape, generator=g) < 0.5
    codes = torch.where(r > 0, r, torch.where(r < 0, 128 - r, zero_sign.long() * 128)).to(torch.uint8)
    dist = ref.bracket_distance(z, codes, "e4m3")
    assert all(int((dist == k).sum()) > 0 for k in (0, 1, 2)) and int(dist.max()) == 2
    rollout = FP8(codes.view(torch.float8_e4m3fn), q.scale)
    record = CompactRecord.encode(x, rollout, GuidanceSpec.parse("mod4"))
    back = read_record(record.to_tensors("L01.k"), "L01.k")
    assert back.fmt is Format.FP8 and torch.equal(back.elements, record.elements)
    inside = dist == 0
    for rec in (record, back):
        hint, report = rec.decode(x)
        got = guided_quantize(x, hint).codes
        assert torch.equal(ref.signed_index_e4m3(got)[inside], ref.signed_index_e4m3(codes)[inside])
        assert torch.equal(got[~inside], ref.round_to_e4m3(z)[~inside])
        assert report == DecodeReport(bracket_checked=x.numel(), bracket_misses=int((~inside).sum()))
    lsb_got = guided_quantize(x, encode_hint(rollout, "lsb")).codes
    assert not bool((ref.signed_index_e4m3(lsb_got) == ref.signed_index_e4m3(codes))[~inside].any())


def test_same_grid_same_value_is_the_rollouts_own_codes() -> None:
    """No drift: the trainer's value is the rollout's, so every code is in its bracket (it is the
    trainer's own round to nearest) and mod4 reproduces all of them with no miss."""
    x = site_value((7, 64), seed=9)
    q = quantize_nvfp4(x, per_row=True)
    hint, report = CompactRecord.encode(x, q, GuidanceSpec.parse("mod4")).decode(x)
    assert torch.equal(guided_quantize(x, hint).codes, q.codes)
    assert report == DecodeReport(bracket_checked=x.numel(), bracket_misses=0)


# --- names, bytes, plans -------------------------------------------------------------------------


def test_names_and_layer_selectors() -> None:
    for name, layers in (("mod4", "deeper"), ("mod4@all", "all"), ("mod4@deeper", "deeper"), ("mod4@last2", "last2")):
        mode = GuidedMode.parse(name)
        assert isinstance(mode.mode, GuidanceSpec) and mode.mode.element_codec.knob == "mod4"
        assert mode.layers == layers and GuidedMode.parse(mode.name) == mode
        assert mode.name == name.replace("@deeper", "")
    spec = GuidanceSpec.parse("mod4+parity+amax:lo3")
    assert GuidanceSpec.from_tag(spec.tag) == spec and spec.name == "mod4+parity+amax:lo3"
    assert GuidanceSpec.from_tag(GuidanceSpec.parse("mod4").tag).name == "mod4"
    with pytest.raises(ValueError, match="takes no argument"):
        GuidanceSpec.parse("mod4(2)")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
@pytest.mark.parametrize("site_shape", [(64,), (2, 32), (8, 2, 32)])
def test_bytes_per_token_are_lsbs_plus_one_bit_per_element(fmt: str, site_shape: tuple[int, ...]) -> None:
    elems = 1
    for s in site_shape:
        elems *= s
    lsb, mod4 = site_bytes_per_token("lsb", site_shape, fmt), site_bytes_per_token("mod4", site_shape, fmt)
    assert mod4 == lsb + elems / 8
    x = site_value((5, *site_shape), seed=1)
    q = {"nvfp4": lambda: quantize_nvfp4(x, per_row=True), "mxfp4": lambda: quantize_mxfp4(x),
         "fp8": lambda: quantize_fp8(x)}[fmt]()
    record = CompactRecord.encode(x, q, GuidanceSpec.parse("mod4"))
    assert record.nbytes == 5 * mod4 and record.bytes_per_token() == mod4


def test_plans_that_take_mod4() -> None:
    from tracefp4.engines.plan import PrecisionPlan, check_supported

    for plan in (PrecisionPlan(), PrecisionPlan.four_over_six(), PrecisionPlan(activations="mxfp4", kv_cache="mxfp4"),
                 PrecisionPlan(activations="fp8", kv_cache="fp8")):
        check_supported(plan, "mod4")  # the scales and amax are recorded in full, as lsb's
    # scale and amax knobs: under Four over Six and at FP8 sites refused, as for every compact element knob
    with pytest.raises(ValueError, match="Four over Six"):
        check_supported(PrecisionPlan.four_over_six(), "mod4+parity")
    with pytest.raises(ValueError, match="kv_cache = 'fp8'.*'mod4\\+amax:lo3'"):
        check_supported(PrecisionPlan(kv_cache="fp8"), "mod4+amax:lo3@all")
    with pytest.raises(ValueError, match="kv_cache = 'fp8'.*takes 'full', 'lsb' or 'mod4'"):
        check_supported(PrecisionPlan(kv_cache="fp8"), "lsb+parity")


# --- end to end on the tiny model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """The tiny MoE of tests/tiny_moe.py, and its rollouts recorded as mod4 and as lsb on
    every layer (with the full codes and grids as diagnostics, what the trainer is checked against)."""
    from tiny_moe import ALL, CONFIG, PROMPTS, SAMPLING

    from tracefp4.engines.model import from_config
    from tracefp4.engines.plan import PrecisionPlan
    from tracefp4.engines.rollout import generate

    model = from_config(CONFIG, seed=0)
    plans = {"fp4": PrecisionPlan(), "fp8kv": PrecisionPlan(kv_cache="fp8")}  # the second: E4M3 K/V, NVFP4 experts
    rollouts = {(name, plan): generate(model, PROMPTS, SAMPLING, plan=plans[plan], guidance=GuidedMode.parse(f"{name}@all"),
                                       diagnostics=ALL) for name in ("mod4", "lsb") for plan in plans}
    return model, rollouts


def trainer_at(model, roll):
    """The trainer's guided forward of ``roll``: its output, its own input of every guided site per
    trajectory (what each record is decoded against) and the sum of its decode reports."""
    from tracefp4.engines.guidance import TrainerGuidance
    from tracefp4.engines.trainer import TrainerSpec, forward_logprobs

    inputs, paths = {}, []
    hint = TrainerGuidance.hint

    def keeping(self, name, x):
        inputs[name] = x.detach().clone()  # the packed batch's rows, in record order
        if self not in paths:
            paths.append(self)
        return hint(self, name, x)

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(TrainerGuidance, "hint", keeping)
        out = forward_logprobs(model, roll.token_ids, roll.prompt_lens, roll.records,
                               TrainerSpec("trace", capture_codes=frozenset(range(4)), plan=roll.plan))
    assert len(paths) == 1  # one forward, one path: its report is the whole forward's
    assert out.decode == paths[0].decode_report  # what forward_logprobs hands its caller
    counts = [len(t) for t in roll.token_ids]
    return out, {name: x.split(counts) for name, x in inputs.items()}, paths[0].decode_report


def moved(model, eps: float):
    """A copy of ``model`` whose every weight is scaled by ``1 + eps * N(0, 1)``: the trainer some
    optimizer steps after the rollout, far enough for codes to leave its bracket by 1 or 2 codewords."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(48)
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(1 + eps * torch.randn(p.shape, generator=g).to(p.dtype))
    return out


def site_outcomes(out, roll, inputs):
    """Per guided element of the forward: the rollout's code, the trainer's code, the rollout code's
    distance from the trainer's bracket on the rollout's grid, and the reference mod4 decode
    (codes, miss), all flattened over sites and trajectories."""
    parts = {k: [] for k in ("rollout", "got", "distance", "want", "miss", "fp8")}
    for name, xs in inputs.items():
        for b, x in enumerate(xs):
            d = roll.diagnostics[b]
            fp8 = d[f"{name}.scales"].dtype == torch.float32  # an FP8 site's grid is its float32 row scale
            if fp8:
                z, codes, got = fp8_grid_z(x, d[f"{name}.scales"]), d[f"{name}.codes"], out.codes[b][name]
                want, miss = ref.guided_round_mod4_e4m3(z, ref.mod4_residue(codes, "e4m3"))
                # the rest is compared on the signed line, where E4M3 and E2M1 positions mean the same
                codes, got, want = (ref.signed_index_e4m3(c) for c in (codes, got, want))
                distance = ref.bracket_distance(z, d[f"{name}.codes"], "e4m3")
            else:
                z = grid_z(x, Format.NVFP4, d[f"{name}.scales"], d[f"{name}.global_amax"])
                codes, got = unpack_fp4(d[f"{name}.codes"]), unpack_fp4(out.codes[b][name])
                want, miss = ref.guided_round_mod4(z, ref.mod4_residue(codes))
                distance = ref.bracket_distance(z, codes)
                codes, got, want = (ref.signed_index(c) for c in (codes, got, want))
            for key, v in (("rollout", codes), ("got", got), ("distance", distance), ("want", want), ("miss", miss),
                           ("fp8", torch.full(codes.shape, fp8))):
                parts[key].append(v.reshape(-1))
    return {k: torch.cat(v) for k, v in parts.items()}


@pytest.mark.parametrize("plan", ["fp4", "fp8kv"])
def test_same_weights_reproduce_every_rollout_code_in_the_bracket(tiny, plan: str) -> None:
    """The trainer at the rollout's weights: its values differ from the rollout's by BF16 op order
    only. At the FP4 sites that keeps every rollout code in the trainer's bracket
    (tests/test_rollout_trainer.py asserts the same for full records), and mod4, like lsb, lands on
    every one of them with no miss counted. E4M3's grid is far finer than FP4's, and at the FP8 K/V
    sites the drift between incremental decode and the packed forward puts some rollout codes outside
    the bracket already at lag 0 (the reference's ``guided_round_e4m3`` says so too): lsb takes a
    wrong code there and says nothing, mod4 counts them (every one 1-2 codewords out) and otherwise
    decodes exactly as the reference does."""
    model, rollouts = tiny
    roll, lsb = rollouts["mod4", plan], rollouts["lsb", plan]
    assert torch.equal(torch.cat(roll.token_ids), torch.cat(lsb.token_ids))  # recording changes nothing
    assert all(any("packed__mod4__" in k for k in r) for r in roll.records)
    for name, r in (("mod4", roll), ("lsb", lsb)):
        out, inputs, report = trainer_at(model, r)
        s = site_outcomes(out, r, inputs)
        assert s["got"].numel() > 0 and bool(s["fp8"].any()) == (plan == "fp8kv")
        fp4, inside = ~s["fp8"], s["distance"] == 0
        assert bool(inside[fp4].all()) and torch.equal(s["got"][inside], s["rollout"][inside]), name
        if name == "mod4":
            assert torch.equal(s["got"], s["want"])
            assert report == DecodeReport(bracket_checked=s["got"].numel(), bracket_misses=int(s["miss"].sum()))
            assert bool(s["miss"][(s["distance"] >= 1) & (s["distance"] <= 2)].all())
        else:
            assert report == DecodeReport()
            assert not bool((s["got"] == s["rollout"])[~inside].any())  # lsb: wrong wherever out, uncounted
        if plan == "fp4":
            assert report == (DecodeReport(bracket_checked=s["got"].numel()) if name == "mod4" else DecodeReport())
    # the bytes: one more bit per element than lsb, scales and amax alike (FP8 codes: one per byte)
    elements = sum(v.numel() * (2 if v.dtype == torch.uint8 and d[k.replace(".codes", ".scales")].dtype != torch.float32
                                else 1)
                   for d in roll.diagnostics for k, v in d.items() if k.endswith(".codes"))
    assert roll.guidance_bytes() - lsb.guidance_bytes() == elements // 8


@pytest.mark.parametrize("plan", ["fp4", "fp8kv"])
def test_moved_weights_mod4_counts_the_misses_lsb_decodes_silently(tiny, plan: str) -> None:
    """The trainer at weights moved by 1% (relative, per weight): a few percent of rollout codes leave
    the trainer's bracket, most by one codeword. With mod4 every code the trainer takes is the
    reference's mod4 decode of its own value (exact), the count is exactly the reference's misses,
    and it holds every element 1 or 2 codewords out. With lsb the same kind of element gets a wrong
    code, and the report says nothing."""
    model, rollouts = tiny
    trainer_model = moved(model, 0.01)
    out, inputs, report = trainer_at(trainer_model, rollouts["mod4", plan])
    s = site_outcomes(out, rollouts["mod4", plan], inputs)
    near_miss = (s["distance"] >= 1) & (s["distance"] <= 2)
    assert int(near_miss.sum()) > 0  # the weights moved far enough to test anything
    if plan == "fp8kv":
        assert int((near_miss & s["fp8"]).sum()) > 0  # at the E4M3 sites too
    assert torch.equal(s["got"], s["want"])  # positions on the signed line (zeros' sign bits differ freely)
    assert report == DecodeReport(bracket_checked=s["got"].numel(), bracket_misses=int(s["miss"].sum()))
    assert bool(s["miss"][near_miss].all())
    inside = s["distance"] == 0
    assert torch.equal(s["got"][inside], s["rollout"][inside])

    out, inputs, report = trainer_at(trainer_model, rollouts["lsb", plan])
    s = site_outcomes(out, rollouts["lsb", plan], inputs)
    near_miss = (s["distance"] >= 1) & (s["distance"] <= 2)
    assert int(near_miss.sum()) > 0 and report == DecodeReport()
    # lsb takes a bracket member for every element, so a rollout code outside the bracket is always lost
    assert not bool((s["got"] == s["rollout"])[near_miss].any())
