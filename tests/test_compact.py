"""Compact guidance records: names, exact sizes, round trips through the store, and decoding.

The central property: a compact record, decoded with the trainer's own value of the site, names the
same grid (block scales, global amax) and the same codeword choices as the information it replaced,
whenever the trainer's value is within the drift the mode is built for; and what goes through the
store comes back bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracefp4.formats import reference
from tracefp4.guidance import coding, compact
from tracefp4.guidance.compact import (
    STANDARD_MODES,
    CompactRecord,
    GuidanceSpec,
    GuidedMode,
    encode_record,
    parse_hint_mode,
    read_record,
    record_cat,
    site_bytes_per_token,
)
from tracefp4.guidance.compact.grid import bf16_pattern, scale_candidates
from tracefp4.formats.constants import Format, HintMode
from tracefp4.guidance.hints import Hint, encode_hint, guided_quantize
from tracefp4.guidance.record import SiteRecord
from tracefp4.formats import quantize_mxfp4, quantize_nvfp4, unpack_fp4
from tracefp4.guidance.store import StoreReader, StoreWriter, seal_step
from test_coding import unsatisfiable_check

torch.set_num_threads(1)

SPECS = [
    "full+parity+amax:lo3",
    "lsb+amax:bf16",
    "lsb+amax:lo2",
    "lsb+parity",
    "lsb+parity+amax:lo3",
    "lsb+scales:own+amax:own",
    "sparse(0.05)",
    "sparse(0.02)+parity+amax:lo3",
    "ldpc(1/8)+parity+amax:lo3",
    "ldpc(1/16)+scales:ldpc(1/4)+amax:lo3",
    "ldpc(1/4)+scales:ldpc(1/2)+amax:lo4",
    "ldpc(1/8)+scales:ldpc(1/4)+amax:ldpc(1/2)",
]
SHAPES = [(5, 64), (7, 2, 32), (3, 2, 16)]  # [T, *lead, K]: expert_in, expert_mid, k/v of the tiny model


def site_value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-ish tails and a few zero blocks, as activations have
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))
    x[..., :16] *= (torch.rand(shape[:-1] + (1,), generator=g) > 0.2).float()
    return x.to(torch.bfloat16)


def nudged(x: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """x with a share of its elements moved by one BF16 ulp, as the trainer's BF16-level drift does."""
    g = torch.Generator().manual_seed(seed)
    bits = x.view(torch.int16).clone()
    pick = (torch.rand(x.shape, generator=g) < share) & (x != 0)
    step = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1, 1).to(torch.int16)
    return torch.where(pick, bits + step, bits).view(torch.bfloat16)


def stored(rec: SiteRecord, prefix: str = "L01.k") -> SiteRecord:
    return read_record(rec.to_tensors(prefix), prefix)


def same_hint(a: Hint, b: Hint) -> None:
    assert a.mode == b.mode and a.fmt == b.fmt
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert (a.global_amax is None) == (b.global_amax is None)
    if a.global_amax is not None:
        assert torch.equal(a.global_amax.float(), b.global_amax.float())


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STANDARD_MODES)
def test_standard_mode_names_round_trip(name: str) -> None:
    g = GuidedMode.parse(name)
    assert g.name == name and GuidedMode.parse(g.name) == g
    if isinstance(g.mode, GuidanceSpec):
        assert GuidanceSpec.from_tag(g.mode.tag) == g.mode
        assert all(c.isalnum() or c == "_" for c in g.mode.tag)


def test_names_defaults_and_the_briefs_spelling() -> None:
    assert parse_hint_mode("lsb") is HintMode.LSB and parse_hint_mode("full") is HintMode.FULL
    assert parse_hint_mode("lsb+scales:full+amax:fp32") is HintMode.LSB  # the paper's compact, spelled out
    assert GuidanceSpec.parse("sparse+parity(0.02)") == GuidanceSpec.parse("sparse(0.02)+parity")
    assert GuidanceSpec.parse("ldpc(16)") == GuidanceSpec.parse("ldpc(1/16)")
    assert GuidedMode.parse("full").layers == "all" and GuidedMode.parse("lsb").layers == "deeper"
    assert GuidedMode.parse("lsb@all").layer_indices(4) == {0, 1, 2, 3}
    assert GuidedMode.parse("lsb").layer_indices(5) == {2, 3, 4}
    # the layer ablation: the last n layers
    assert GuidedMode.parse("lsb@last1").layer_indices(4) == {3} and GuidedMode.parse("lsb@last1").name == "lsb@last1"
    assert GuidedMode.parse("full@last3").layer_indices(3) == GuidedMode.parse("lsb@all").layer_indices(3)
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        GuidedMode.parse("lsb@last3").layer_indices(2)
    for bad in ("lsb@last0", "lsb@last", "lsb@last01", "lsb@first2"):
        with pytest.raises(ValueError, match="layers must be one of"):
            GuidedMode.parse(bad)
    for bad in ("sparse", "ldpc(1/0)", "lsb(3)", "lsb+amax:lo9", "lsb+parity+bogus", "nope", "sparse(-1)"):
        with pytest.raises(ValueError):
            GuidanceSpec.parse(bad)


# --- the rollout's grid --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-7, 7, width=32), min_size=1, max_size=64), st.booleans())
def test_rtn_codes_equal_the_reference(values: list[float], add_midpoints: bool) -> None:
    z = torch.tensor(values, dtype=torch.float32)
    if add_midpoints:  # every tie, both signs, and both zeros
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0])
        z = torch.cat([z, mids, -mids])
    z = z.clamp(-6, 6)
    assert torch.equal(compact.rtn_codes(z), reference.round_to_e2m1(z))
    d = compact.midpoint_distance(z)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.equal(d, (z.abs().unsqueeze(-1) - mids).abs().amin(-1))


@pytest.mark.parametrize("shape", SHAPES)
def test_grid_z_is_the_quantizers_grid(shape: tuple[int, ...]) -> None:
    x = site_value(shape, 1)
    q = quantize_nvfp4(x, per_row=True)
    z = compact.grid_z(x, Format.NVFP4, q.scales, q.global_amax)
    assert torch.equal(compact.rtn_codes(z), unpack_fp4(q.codes))


# --- sizes ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([s for s in SPECS if "sparse" not in s] + ["lsb@all"]),
    st.integers(1, 9),
    st.sampled_from([(), (1,), (3,), (2, 2)]),
    st.sampled_from([16, 32, 48, 128]),
)
def test_fixed_size_records_take_exactly_the_formula(name: str, t: int, lead: tuple, k: int) -> None:
    mode = GuidedMode.parse(name).mode
    x = site_value((t, *lead, k), t + k)
    rec = encode_record(x, quantize_nvfp4(x, per_row=True), mode)
    tensors = rec.to_tensors("L03.expert_mid")
    assert sum(v.nbytes for v in tensors.values()) == rec.nbytes == t * site_bytes_per_token(mode, (*lead, k))
    assert all(v.shape[0] == t for v in tensors.values())  # the store's contract: leading dim T


def test_byte_formulas_by_hand() -> None:
    # expert_mid of the tiny model: 2 rows of 32 -> 64 elements, 4 blocks, 2 rows per token
    shape = (2, 32)
    assert site_bytes_per_token("full", shape) == 32 + 4 + 8  # codes + e4m3 scales + fp32 amax
    assert site_bytes_per_token("lsb", shape) == 8 + 4 + 8
    assert site_bytes_per_token("lsb+amax:bf16", shape) == 8 + 4 + 4
    assert site_bytes_per_token("lsb+parity+amax:lo3", shape) == math.ceil((2 * 3 + 4 + 64) / 8)
    # 2 x 3 amax bits + ceil(4/4) scale checks + ceil(64/16) element checks = 11 bits -> 2 bytes
    assert site_bytes_per_token("ldpc(1/16)+scales:ldpc(1/4)+amax:lo3", shape) == 2
    # Qwen3-30B-A3B expert_in: 2048 elements, 128 blocks: 3 + 32 + 128 = 163 bits -> 21 bytes
    assert site_bytes_per_token("ldpc(1/16)+scales:ldpc(1/4)+amax:lo3", (2048,)) == 21
    # sparse: byte fields + the stream's expectation
    d = 0.05
    expect = 64 * d * compact.rice_bits_per_entry(d) / 8 + 4 + 8
    assert site_bytes_per_token("sparse(0.05)", shape, density=d) == pytest.approx(expect)
    with pytest.raises(ValueError, match="density"):
        site_bytes_per_token("sparse(0.05)", shape)


def test_sparse_stream_is_exactly_its_bits_and_padding() -> None:
    x = site_value((6, 2, 32), 3)
    rec = CompactRecord.encode(x, quantize_nvfp4(x, per_row=True), GuidanceSpec.parse("sparse(0.2)"))
    plane = rec.elements.reshape(-1).numpy()
    pos = np.flatnonzero(plane >= 0)
    gaps = np.diff(pos, prepend=-1) - 1
    k = coding.best_rice_k(gaps)
    length = len(coding.leb128(pos.size)) + 1 + math.ceil(int(((gaps >> k) + k + 2).sum()) / 8)
    stream = next(v for n, v in rec.to_tensors("L00.k").items() if ".stream__" in n)
    assert stream.shape == (6, math.ceil(length / 6))


# --- decoding ------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SPECS), st.sampled_from(SHAPES), st.integers(0, 10_000))
def test_same_value_decodes_to_the_rollouts_own_choice(name: str, shape: tuple, seed: int) -> None:
    """No drift at all: every mode reproduces the rollout's quantization exactly."""
    x = site_value(shape, seed)
    q = quantize_nvfp4(x, per_row=True)
    rec = stored(CompactRecord.encode(x, q, GuidanceSpec.parse(name)))
    hint, report = rec.decode(x)
    assert report == compact.DecodeReport(blocks=report.blocks) and report.ok  # nothing failed
    g = guided_quantize(x, hint)
    assert torch.equal(g.codes, q.codes)
    assert torch.equal(g.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(g.global_amax, q.global_amax)


@pytest.mark.parametrize("name", ["lsb+parity+amax:lo3", "lsb+amax:bf16", "lsb+parity+amax:lo2"])
@pytest.mark.parametrize("seed", range(4))
def test_one_ulp_drift_decodes_to_the_lsb_hint(name: str, seed: int) -> None:
    """Cheap scales and amax recover the rollout's grid exactly under one-ulp drift, so the decoded hint
    *is* the paper's lsb hint."""
    x = site_value((16, 2, 64), seed)
    q = quantize_nvfp4(x, per_row=True)
    y = nudged(x, 0.05, seed)
    decoded, report = stored(CompactRecord.encode(x, q, GuidanceSpec.parse(name))).decode(y)
    assert report == compact.DecodeReport()  # no ldpc knob: nothing to fail
    same_hint(decoded, encode_hint(q, "lsb"))


@pytest.mark.parametrize(
    "name",
    ["sparse(0.05)+parity+amax:lo3", "ldpc(1/4)+parity+amax:lo3", "ldpc(1/8)+scales:ldpc(1/4)+amax:lo3",
     "ldpc(1/4)+parity+amax:ldpc(1/2)"],
)  # fmt: skip
def test_drift_within_the_modes_reach_gives_the_rollouts_codes(name: str) -> None:
    """Sparse hints cover every element one ulp can flip (|dz| < 0.05 here); the syndrome finds the few
    flipped low bits among the near-ties (rate 1/4 and 1/8 against 1% drifting elements)."""
    x = site_value((64, 2, 64), 7)
    q = quantize_nvfp4(x, per_row=True)
    y = nudged(x, 0.01, 8)
    assert not torch.equal(quantize_nvfp4(y, global_amax=q.global_amax).codes, q.codes)  # RTN alone flips
    hint, report = stored(CompactRecord.encode(x, q, GuidanceSpec.parse(name))).decode(y)
    assert report.ok and (report.blocks > 0) == ("ldpc" in name)
    g = guided_quantize(y, hint)
    assert torch.equal(g.codes, q.codes)
    assert torch.equal(g.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(g.global_amax, q.global_amax)


@settings(max_examples=40, deadline=None)
@given(st.floats(1e-3, 1e3), st.integers(-3, 3), st.integers(2, 5))
def test_amax_low_bits_resolve_drift_below_half_their_period(a: float, drift: int, b: int) -> None:
    amax = torch.tensor([[a]]).to(torch.bfloat16).float()
    own = (amax.to(torch.bfloat16).view(torch.int16) + drift).view(torch.bfloat16).float()
    spec = GuidanceSpec(elements="lsb", amax=f"lo{b}")
    rec = CompactRecord(spec, Format.NVFP4, (16,), None, None, torch.zeros(1, 16, dtype=torch.uint8))
    rec.amax = (bf16_pattern(amax) & ((1 << b) - 1)).to(torch.uint8)
    x = torch.full((1, 16), float(own)).to(torch.bfloat16)
    got, _ = spec.amax_codec.decode(rec.amax, x, None, rec.geometry)
    if abs(drift) < 2 ** (b - 1):
        assert torch.equal(got, amax)


def test_scale_parity_takes_the_neighbour_the_trainers_scale_leans_to() -> None:
    # E4M3 codes 0x38 (1.0) and 0x39 (1.125): midpoint 1.0625
    u_roll = torch.tensor([1.07, 1.05])  # rounds to 1.125 and 1.0
    u_train = torch.tensor([1.06, 1.065])  # just across the midpoint: rounds to 1.0 and 1.125
    own, other, dist = scale_candidates(u_train)
    assert own.tolist() == [0x38, 0x39] and other.tolist() == [0x39, 0x38]
    assert dist.tolist() == pytest.approx([0.02, 0.02], abs=1e-5)  # float32 arithmetic on values near 1: < 1e-6
    roll = u_roll.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    picked = torch.where((own & 1) == (roll & 1), own, other)
    assert picked.tolist() == roll.tolist()


# --- storage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECS)
def test_store_round_trip_equals_the_direct_path(name: str, tmp_path) -> None:
    """encode -> store write/read -> decode -> guided quantize, for a batch of two trajectories, equals
    the direct path (records straight from to_tensors, decoded one trajectory at a time)."""
    spec = GuidanceSpec.parse(name)
    xs = [site_value((t, 2, 16), t) for t in (5, 9)]
    qs = [quantize_nvfp4(x, per_row=True) for x in xs]
    records = [CompactRecord.encode(x, q, spec).to_tensors("L02.v") for x, q in zip(xs, qs)]
    with StoreWriter(tmp_path, 0, "w0", model_signature="sig", policy_version=3, contract=name) as w:
        for i, rec in enumerate(records):
            w.add(f"t{i}", {**rec, "L02.routing": torch.zeros(rec[next(iter(rec))].shape[0], 2, dtype=torch.uint8)},
                  prompt_len=1)  # fmt: skip
    seal_step(tmp_path, 0, ["w0"])
    with StoreReader(tmp_path, 0, model_signature="sig", policy_version=3) as r:
        back = [read_record({k: v.clone() for k, v in r.get(f"t{i}").items()}, "L02.v") for i in range(2)]
    ys = [nudged(x, 0.02, 1) for x in xs]
    batch, report = record_cat(back).decode(torch.cat(ys))
    direct, reports = zip(*(read_record(rec, "L02.v").decode(y) for rec, y in zip(records, ys)))
    assert report == sum(reports, compact.DecodeReport())
    g_batch = guided_quantize(torch.cat(ys), batch)
    g_direct = [guided_quantize(y, h) for y, h in zip(ys, direct)]
    assert torch.equal(g_batch.codes, torch.cat([g.codes for g in g_direct]))
    assert torch.equal(g_batch.scales.view(torch.uint8), torch.cat([g.scales for g in g_direct]).view(torch.uint8))
    for rec, b in zip(records, back):  # bit for bit, and the same object once read
        assert all(torch.equal(v, b.to_tensors("L02.v")[k]) for k, v in rec.items())


def test_rollout_records_select_and_cat_like_hints() -> None:
    """The rollout assembles a trajectory from per-step records with select + cat."""
    x = site_value((12, 64), 5)
    q = quantize_nvfp4(x, per_row=True)
    spec = GuidanceSpec.parse("ldpc(1/8)+parity+amax:lo3")
    whole = CompactRecord.encode(x, q, spec)
    parts = record_cat([CompactRecord.encode(x[:5], quantize_nvfp4(x[:5], per_row=True), spec),
                        CompactRecord.encode(x[5:], quantize_nvfp4(x[5:], per_row=True), spec)])  # fmt: skip
    picked = whole.select(torch.arange(12))
    for a, b in ((whole, parts), (whole, picked)):
        assert all(torch.equal(v, b.to_tensors("L00.k")[k]) for k, v in a.to_tensors("L00.k").items())


def test_mismatches_are_errors() -> None:
    x = site_value((4, 32), 0)
    q = quantize_nvfp4(x, per_row=True)
    rec = stored(CompactRecord.encode(x, q, GuidanceSpec.parse("ldpc(1/8)+parity+amax:lo3")))
    with pytest.raises(ValueError, match="shape"):
        rec.decode(x[:, :16])
    with pytest.raises(ValueError, match="compressed"):
        CompactRecord.encode(x, q, GuidanceSpec.parse("ldpc(1/8)")).decode(x)
    with pytest.raises(ValueError, match="non-finite"):
        rec.decode(torch.full_like(x, float("nan")))
    with pytest.raises(ValueError, match="MXFP4"):
        CompactRecord.encode(x, quantize_mxfp4(x), GuidanceSpec.parse("lsb+parity"))
    with pytest.raises(ValueError, match="BF16"):
        CompactRecord.encode(x.float() * 1.001, quantize_nvfp4(x.float() * 1.001, per_row=True),
                             GuidanceSpec.parse("lsb+amax:lo3"))  # fmt: skip
    x = site_value((40, 2, 32), 0)
    sparse = CompactRecord.encode(x, quantize_nvfp4(x, per_row=True), GuidanceSpec.parse("sparse(0.3)"))
    sliced = {k: v[5:30] for k, v in sparse.to_tensors("L00.k").items()}  # what get(positions=5:30) returns
    with pytest.raises(ValueError, match="sparse stream"):  # a stream covers its whole trajectory
        read_record(sliced, "L00.k")
    with pytest.raises(ValueError, match="record_cat"):
        record_cat([encode_hint(q, "lsb"), rec])


def test_mxfp4_sites_take_compact_elements() -> None:
    x = site_value((6, 64), 2)
    q = quantize_mxfp4(x)
    for name in ("sparse(0.05)", "ldpc(1/4)"):
        rec = stored(CompactRecord.encode(x, q, GuidanceSpec.parse(name)))
        assert rec.fmt is Format.MXFP4
        assert torch.equal(guided_quantize(x, rec.decode(x)[0]).codes, q.codes)


@pytest.mark.parametrize("seed", range(3))
def test_amax_syndrome_recovers_one_ulp_drift_of_the_row_maximum(seed: int) -> None:
    x = site_value((96, 2, 32), seed)
    q = quantize_nvfp4(x, per_row=True)
    g = torch.Generator().manual_seed(seed)
    rows = x.reshape(-1, 32)
    top = rows.abs().float().argmax(-1)
    bits = rows.view(torch.int16).clone()
    moved = torch.rand(rows.shape[0], generator=g) < 0.1
    step = torch.where(torch.rand(rows.shape[0], generator=g) < 0.5, -1, 1).to(torch.int16)
    idx = torch.arange(rows.shape[0])
    bits[idx[moved], top[moved]] += step[moved]
    y = bits.view(torch.bfloat16).reshape(x.shape)
    assert not torch.equal(y.float().abs().amax(-1, keepdim=True), q.global_amax)
    rec = stored(CompactRecord.encode(x, q, GuidanceSpec.parse("lsb+amax:ldpc(1/2)")))
    hint, report = rec.decode(y)
    assert torch.equal(hint.global_amax, q.global_amax) and report.blocks == 1 and report.ok
    # per token: 4 E4M3 scales + ceil((3 checks for 2 rows x 3 Gray bits + 64 low bits) / 8)
    assert rec.nbytes == 96 * (4 + math.ceil((math.ceil(2 * 3 / 2) + 64) / 8))


# --- decode failures -----------------------------------------------------------------------------


def two_trajectories(spec: str, shape: tuple[int, ...]) -> tuple[list, list, list[CompactRecord]]:
    """Two trajectories (seeds 1, 2) of site value ``shape``: values, quantized, records read back."""
    xs = [site_value(shape, s) for s in (1, 2)]
    qs = [quantize_nvfp4(x, per_row=True) for x in xs]
    return xs, qs, [stored(CompactRecord.encode(x, q, GuidanceSpec.parse(spec))) for x, q in zip(xs, qs)]


def test_an_undecodable_element_block_is_rounded_to_nearest_on_the_rollouts_grid_and_counted() -> None:
    """Trajectory 0 drifted far beyond what a rate-1/8 syndrome resolves (about 30% of its low bits
    differ): its block fails, is counted, and its elements get exactly the trainer's round-to-nearest
    codes on the rollout's grid, not BP's best half-converged iterate (which differs there). Trajectory
    1, within reach, still decodes to the rollout's codes."""
    xs, qs, recs = two_trajectories("ldpc(1/8)", (48, 2, 32))
    g = torch.Generator().manual_seed(0)
    y0 = (xs[0].float() * (1 + 0.2 * torch.randn(xs[0].shape, generator=g))).to(torch.bfloat16)
    ys = [y0, nudged(xs[1], 0.01, 3)]
    hint, report = compact.decode_record(record_cat(recs), torch.cat(ys))
    assert report == compact.DecodeReport(blocks=2, failed_blocks=1, failed_elements=48 * 2 * 32)
    codes = unpack_fp4(guided_quantize(torch.cat(ys), hint).codes)
    rtn = compact.rtn_codes(compact.grid_z(y0, Format.NVFP4, qs[0].scales, qs[0].global_amax))
    assert not torch.equal(rtn, unpack_fp4(qs[0].codes))
    assert torch.equal(codes[:48], rtn)
    assert torch.equal(codes[48:], unpack_fp4(qs[1].codes))


def test_an_undecodable_scale_block_takes_the_trainers_own_scales_and_is_counted() -> None:
    """One corrupted check bit (no flip pattern can produce it) fails trajectory 0's scale block: its
    block scales are the trainer's own E4M3 codes on the rollout's S_enc (the trainer's values are 3%
    larger, so several differ from the rollout's); trajectory 1's decode."""
    xs, qs, recs = two_trajectories("lsb+scales:ldpc(1/1)", (8, 2, 32))
    recs[0].scales.view(-1)[unsatisfiable_check(8 * 4, 8 * 4)] ^= 1
    ys = [(xs[0].float() * 1.03).to(torch.bfloat16), nudged(xs[1], 0.05, 3)]
    hint, report = compact.decode_record(record_cat(recs), torch.cat(ys))
    assert report == compact.DecodeReport(blocks=2, failed_blocks=1, failed_scales=8 * 4)
    own = quantize_nvfp4(ys[0], global_amax=qs[0].global_amax).scales.view(torch.uint8)
    assert not torch.equal(own, qs[0].scales.view(torch.uint8))
    assert torch.equal(hint.scales[:8].view(torch.uint8), own)
    assert torch.equal(hint.scales[8:].view(torch.uint8), qs[1].scales.view(torch.uint8))


def test_an_undecodable_amax_block_takes_the_trainers_own_amax_and_is_counted() -> None:
    """The same for the amax syndrome: every other row's maximum drifts up one ulp in both
    trajectories; trajectory 0's block fails and its rows take the trainer's own amax, trajectory 1's
    recovers the rollout's."""
    xs, qs, recs = two_trajectories("lsb+amax:ldpc(1/1)", (8, 2, 32))
    recs[0].amax.view(-1)[unsatisfiable_check(8 * 2 * 3, 8 * 2 * 3)] ^= 1

    def bump(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        top = rows.abs().float().argmax(-1)
        bits = rows.view(torch.int16).clone()
        bits[torch.arange(0, rows.shape[0], 2), top[::2]] += 1  # sign-magnitude: one ulp larger
        return bits.view(torch.bfloat16).reshape(x.shape)

    ys = [bump(x) for x in xs]
    hint, report = compact.decode_record(record_cat(recs), torch.cat(ys))
    assert report == compact.DecodeReport(blocks=2, failed_blocks=1, failed_amax=8 * 2)
    own = ys[0].float().abs().amax(-1, keepdim=True)
    assert not torch.equal(own, qs[0].global_amax)
    assert torch.equal(hint.global_amax[:8], own)
    assert torch.equal(hint.global_amax[8:], qs[1].global_amax)


def test_decode_record_takes_plain_hints_and_reports_add_up() -> None:
    x = site_value((4, 32), 0)
    h = encode_hint(quantize_nvfp4(x, per_row=True), "lsb")
    hint, report = compact.decode_record(h, x)
    assert hint is h and report == compact.DecodeReport() and report.ok
    a = compact.DecodeReport(blocks=3, failed_blocks=1, failed_elements=10)
    b = compact.DecodeReport(blocks=2, failed_blocks=1, failed_scales=4, failed_amax=1)
    assert sum([a, b], compact.DecodeReport()) == compact.DecodeReport(5, 2, 10, 4, 1) and not (a + b).ok
    # no process-wide decode state anywhere in guidance
    assert not hasattr(compact, "decode_stats") and not hasattr(coding, "decode_stats")


# --- the codec registry and the site-record protocol ---------------------------------------------


def test_every_knob_value_has_a_codec_and_unknown_knobs_are_named() -> None:
    from tracefp4.guidance.compact.registry import CODECS, codec_class, make_codec

    args = {"ldpc": 4, "sparse": 0.05, "lo": None}
    for field, table in CODECS.items():
        for knob, cls in table.items():
            assert codec_class(field, knob) is cls and cls.field == field and cls.knob == knob
            codec = make_codec(field, "lo3" if knob == "lo" else knob, args.get(knob))
            assert type(codec) is cls
    assert set(CODECS) == {"amax", "scales", "elements"}
    assert set(CODECS["elements"]) == {"full", "lsb", "mod4", "sparse", "ldpc"}
    assert set(CODECS["scales"]) == {"full", "parity", "ldpc", "own"}
    assert set(CODECS["amax"]) == {"fp32", "bf16", "own", "ldpc", "lo"}
    # every spec of the standard modes is made of registered codecs, in packing order
    for name in STANDARD_MODES:
        mode = GuidedMode.parse(name).mode
        if isinstance(mode, GuidanceSpec):
            assert [c.field for c in mode.codecs] == list(CODECS)
    for field, knob in (("elements", "bogus"), ("scales", "halves"), ("amax", "fp16")):
        with pytest.raises(ValueError, match=f"{field} knob '{knob}' is unknown"):
            codec_class(field, knob)
    with pytest.raises(ValueError, match="scales knob 'halves' is unknown"):
        GuidanceSpec(scales="halves")
    with pytest.raises(ValueError, match="no compact field 'bits'"):
        codec_class("bits", "full")
    with pytest.raises(ValueError, match="lo9"):
        GuidanceSpec(amax="lo9")


@pytest.mark.parametrize("kind", ["hint", "raw", "compact", "sparse"])
def test_every_record_kind_is_a_site_record(kind: str) -> None:
    """Hints, the rollout's raw capture and compact records answer the same calls, with the same meaning:
    bytes (stored = nbytes = T * bytes per token, the planner's formula), select, cat, to_tensors, decode."""
    from tracefp4.engines.capture import RawCapture

    x = site_value((12, 2, 32), 1)
    q = quantize_nvfp4(x, per_row=True)
    mode = {"hint": "lsb", "raw": "full", "compact": "lsb+parity+amax:lo3", "sparse": "sparse(0.2)"}[kind]
    rec = {"hint": lambda: encode_hint(q, "lsb"), "raw": lambda: RawCapture(q, HintMode.FULL)}.get(
        kind, lambda: CompactRecord.encode(x, q, GuidanceSpec.parse(mode)))()
    for member in [m for m in vars(SiteRecord) if not m.startswith("_")]:
        assert hasattr(rec, member), member
    stored = rec.to_tensors("L00.k")
    assert sum(t.nbytes for t in stored.values()) == rec.nbytes == 12 * rec.bytes_per_token()
    if kind != "sparse":
        assert rec.bytes_per_token() == site_bytes_per_token(mode, (2, 32))
        assert rec.kept_elements() is None
    else:
        kept, total = rec.kept_elements()
        assert total == 12 * 2 * 32 and kept == int((rec.elements >= 0).sum())
    both = record_cat([rec.select(slice(0, 5)), rec.select(slice(5, 12))])
    assert {k: v.view(torch.uint8).tolist() for k, v in both.to_tensors("L00.k").items()} == \
        {k: v.view(torch.uint8).tolist() for k, v in stored.items()}
    hint, report = read_record(stored, "L00.k").decode(x)
    assert report == compact.DecodeReport()
    assert torch.equal(guided_quantize(x, hint).codes, q.codes)  # its own value decodes to its own codes
