"""Rollout-guided rounding: golden cases, fast == reference, and the properties guided rounding promises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracefp4 as tf
from fp4data import S_ENC_ONE, bits, rollout_and_trainer
from tracefp4.formats import reference as ref



def signed(codes_packed: torch.Tensor) -> torch.Tensor:
    return ref.signed_index(tf.unpack_fp4(codes_packed))


# --- golden --------------------------------------------------------------------------------------


def guided_codes(train_values, rollout_values, mode):
    """Guided codes for trainer values on a grid with scale 1 (rollout block amax = 6)."""
    pad = 16 - len(train_values)
    x_roll = torch.tensor(rollout_values + [6.0] * pad)
    x_train = torch.tensor(train_values + [6.0] * pad)
    q = tf.quantize_nvfp4(x_roll, global_amax=S_ENC_ONE)
    assert q.scales.to(torch.float32).item() == 1.0
    return tf.unpack_fp4(tf.guided_quantize(x_train, tf.encode_hint(q, mode)).codes)[: len(train_values)].tolist()


@pytest.mark.parametrize("mode", ["lsb", "full"])
def test_golden_guided_choices(mode):
    # trainer 1.26 sits just above the 1.25 midpoint (RTN: 1.5, code 3); rollout had 1.24 -> 1.0 (code 2)
    assert guided_codes([1.26], [1.24], mode) == [0x2]
    # the bracket of -0.3 is {-0.5, -0}; rollout had -0.2 -> -0 (code 8): the guided zero keeps the sign
    assert guided_codes([-0.3], [-0.2], mode) == [0x8]
    # across zero: trainer -0.1 (bracket {-0.5, -0}), rollout +0.3 -> 0.5 (code 1)
    assert guided_codes([-0.1], [0.3], mode) == ([0x8] if mode == "full" else [0x9])
    # an exact codeword has a one-member bracket: the hint cannot move it
    assert guided_codes([3.0], [3.6], mode) == [0x5]
    # saturation: 7 clamps to 6, bracket {6}
    assert guided_codes([7.0], [5.5], mode) == [0x7]


def test_full_and_lsb_differ_only_when_rollout_is_outside_the_bracket():
    # trainer 2.9 (bracket {2, 3} = codes 4, 5); rollout 4.1 -> 4 (code 6), two codewords away.
    # full information picks 3 (nearer to 4); the low bit of code 6 is 0 and names 2 (code 4).
    assert guided_codes([2.9], [4.1], "full") == [0x5]
    assert guided_codes([2.9], [4.1], "lsb") == [0x4]


# --- fast path == reference ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["lsb", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drift", [1e-3, 3e-2, 0.5])
def test_guided_fast_equals_reference(fmt, mode, dtype, drift):
    x_roll, x_train = rollout_and_trainer(7, 16, 256, drift, dtype)
    if fmt == "nvfp4":
        q = tf.quantize_nvfp4(x_roll, per_row=True)
    else:
        q = tf.quantize_mxfp4(x_roll)
    hint = tf.encode_hint(q, mode)
    fast = tf.unpack_fp4(tf.guided_quantize(x_train, hint).codes)
    rc = tf.unpack_fp4(q.codes)
    kw = {"rollout_codes": rc} if mode == "full" else {"rollout_lsb": rc & 1}
    if fmt == "nvfp4":
        expect = ref.guided_quantize_nvfp4(x_train, q.scales, q.global_amax, **kw)
    else:
        expect = ref.guided_quantize_mxfp4(x_train, q.scales, **kw)
    assert torch.equal(fast, expect)


def test_lsb_hint_bit_layout():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 9] + [0] * 8, dtype=torch.uint8)  # low bits 1,0,1,0,1,0,1,1
    q = tf.NVFP4(tf.pack_fp4(codes), torch.ones(1, dtype=torch.float8_e4m3fn), torch.tensor(1.0))
    h = tf.encode_hint(q, "lsb")
    assert h.data.tolist() == [0b1101_0101, 0b0000_0000]
    assert h.nbytes == 2 + 1 + 4


def test_hint_sizes():
    x = torch.randn(32, 1024)
    q = tf.quantize_nvfp4(x, per_row=True)
    lsb, full = tf.encode_hint(q, "lsb"), tf.encode_hint(q, "full")
    # lsb: 1 bit/elem + 8-bit scale per 16 = 1.5 bits/elem; full: 4 + 0.5 = 4.5 bits/elem; + 4 B amax/row
    assert lsb.nbytes == 32 * (1024 // 8 + 1024 // 16 + 4)
    assert full.nbytes == 32 * (1024 // 2 + 1024 // 16 + 4)
    m = tf.encode_hint(tf.quantize_mxfp4(x), "lsb")
    assert m.nbytes == 32 * (1024 // 8 + 1024 // 32)


@pytest.mark.parametrize("mode", ["lsb", "full"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_site_bytes_per_token_is_what_the_hint_packs(fmt, mode):
    """The planner's bytes per token of a full/lsb site are the Hint's own store bytes, FP8 included
    (its data is one byte per element for full, and its grid one float32 scale per row)."""
    from tracefp4.formats import quantize_fp8
    from tracefp4.guidance.compact import site_bytes_per_token

    x = torch.randn(6, 3, 64)
    q = {"nvfp4": lambda: tf.quantize_nvfp4(x, per_row=True), "mxfp4": lambda: tf.quantize_mxfp4(x),
         "fp8": lambda: quantize_fp8(x)}[fmt]()
    hint = tf.encode_hint(q, mode)
    stored = sum(t.nbytes for t in hint.to_tensors("L00.k").values())
    assert stored == hint.nbytes == 6 * hint.bytes_per_token() == 6 * site_bytes_per_token(mode, (3, 64), fmt)
    if fmt == "fp8":
        assert hint.bytes_per_token() == 3 * ((64 if mode == "full" else 64 // 8) + 4)


def test_hint_select_cat_and_tensor_round_trip():
    x = torch.randn(10, 2, 64)
    q = tf.quantize_nvfp4(x, per_row=True)
    h = tf.encode_hint(q, "lsb")
    parts = [h.select(slice(0, 4)), h.select(slice(4, 10))]
    again = tf.hint_cat(parts)
    assert torch.equal(again.data, h.data) and torch.equal(bits(again.scales), bits(h.scales))
    back = tf.Hint.from_tensors(h.to_tensors("L03.k"), "L03.k")
    assert back.mode is h.mode and back.fmt is h.fmt and back.shape == h.shape
    y = x * 1.01
    assert torch.equal(tf.guided_quantize(y, back).codes, tf.guided_quantize(y, h).codes)


def test_hint_shape_mismatch_raises():
    q = tf.quantize_nvfp4(torch.randn(4, 64), per_row=True)
    h = tf.encode_hint(q, "lsb")
    with pytest.raises(ValueError, match=r"hint shape mismatch: x has shape \(4, 32\).*\(4, 64\)"):
        tf.guided_quantize(torch.randn(4, 32), h)
    with pytest.raises(ValueError, match=r"hint shape mismatch"):
        tf.guided_quantize(torch.randn(5, 64), h)
    with pytest.raises(ValueError, match="non-finite"):
        tf.guided_quantize(torch.full((4, 64), float("nan")), h)


# --- properties ----------------------------------------------------------------------------------

PROFILE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def two_paths(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rows = draw(st.integers(1, 6))
    cols = 16 * draw(st.integers(1, 8))
    drift = draw(st.sampled_from([1e-4, 1e-3, 1e-2, 0.1, 1.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return rollout_and_trainer(seed, rows, cols, drift, dtype)


@PROFILE
@given(two_paths())
def test_full_guidance_never_farther_than_rtn(paths):
    # the full-hint promise, per element: |q_guided - q_roll| <= |q_rtn - q_roll|, with q_rtn the trainer's
    # round-to-nearest on the rollout's grid (the grid both are compared on)
    x_roll, x_train = paths
    q = tf.quantize_nvfp4(x_roll, per_row=True)
    roll = signed(q.codes)
    guided = signed(tf.guided_quantize(x_train, tf.encode_hint(q, "full")).codes)
    rtn = ref.signed_index(grid_rtn(x_train, q))
    assert bool(((guided - roll).abs() <= (rtn - roll).abs()).all())


def grid_rtn(x, q):
    """Round-to-nearest of x on q's grid (the reference's z, rounded)."""
    s_enc = ref.nvfp4_global_encode_scale(q.global_amax)
    enc = ref.nvfp4_encode_factor(q.scales, s_enc)
    xb = x.float().reshape(*x.shape[:-1], -1, 16)
    z = torch.clamp(xb * enc.unsqueeze(-1), -6, 6).reshape(x.shape)
    return ref.round_to_e2m1(z)


@PROFILE
@given(two_paths())
def test_lsb_equals_full_when_rollout_code_in_bracket(paths):
    x_roll, x_train = paths
    q = tf.quantize_nvfp4(x_roll, per_row=True)
    roll = signed(q.codes)
    full = signed(tf.guided_quantize(x_train, tf.encode_hint(q, "full")).codes)
    lsb = signed(tf.guided_quantize(x_train, tf.encode_hint(q, "lsb")).codes)
    # the bracket of the trainer's value on the rollout's grid
    s_enc = ref.nvfp4_global_encode_scale(q.global_amax)
    enc = ref.nvfp4_encode_factor(q.scales, s_enc)
    z = torch.clamp(x_train.float().reshape(*x_train.shape[:-1], -1, 16) * enc.unsqueeze(-1), -6, 6)
    z = z.reshape(x_train.shape)
    lo, hi = ref.bracket(z)
    neg = torch.signbit(z)
    q_minus, q_plus = torch.where(neg, -hi, lo), torch.where(neg, -lo, hi)
    in_bracket = (roll == q_minus) | (roll == q_plus)
    assert torch.equal(lsb[in_bracket], full[in_bracket])
    assert torch.equal(lsb[in_bracket], roll[in_bracket])  # and both then reproduce the rollout


@PROFILE
@given(two_paths(), st.sampled_from(["lsb", "full"]), st.sampled_from(["nvfp4", "mxfp4"]))
def test_hint_from_x_itself_reproduces_codes(paths, mode, fmt):
    x, _ = paths
    if fmt == "mxfp4":
        x = torch.cat([x, x], dim=-1) if x.shape[-1] % 32 else x
        q = tf.quantize_mxfp4(x)
    else:
        q = tf.quantize_nvfp4(x, per_row=True)
    again = tf.guided_quantize(x, tf.encode_hint(q, mode))
    assert torch.equal(again.codes, q.codes)


@PROFILE
@given(two_paths(), st.sampled_from(["lsb", "full"]))
def test_guided_ste_gradient_is_identity(paths, mode):
    x_roll, x_train = paths
    q = tf.quantize_nvfp4(x_roll, per_row=True)
    x = x_train.clone().requires_grad_(True)
    y = tf.guided_fake_quant(x, tf.encode_hint(q, mode))
    assert y.dtype == x.dtype
    assert torch.equal(y, tf.dequantize_nvfp4(tf.guided_quantize(x_train, tf.encode_hint(q, mode))).to(x.dtype))
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_guidance_reduces_mismatch_on_drifted_activations():
    x_roll, x_train = rollout_and_trainer(3, 64, 512, 1e-2)
    q = tf.quantize_nvfp4(x_roll, per_row=True)
    rtn = (tf.unpack_fp4(tf.quantize_nvfp4(x_train, per_row=True).codes) != tf.unpack_fp4(q.codes)).float().mean()
    lsb = (tf.unpack_fp4(tf.guided_quantize(x_train, tf.encode_hint(q, "lsb")).codes) != tf.unpack_fp4(q.codes))
    # Seeded data and elementwise arithmetic only: the same numbers on every machine. A drift of 1e-2 of
    # each value is 1/25 to 1/50 of an E2M1 step (1/4 to 1/2 of the value), so a few percent of values
    # cross a rounding midpoint; lsb hints reproduce every code whose two values lie within half a step
    # of each other, i.e. all but a tail (values within 1e-2 of a codeword's bracket end), far below.
    assert rtn > 0.01
    assert lsb.float().mean() < rtn / 10


# --- hint validation: every malformed hint is a ValueError naming the field ----------------------


def _nvfp4_hint(mode="lsb", rows=4, cols=64):
    return tf.encode_hint(tf.quantize_nvfp4(torch.randn(rows, cols), per_row=True), mode)


def _replace(h, **kw):
    fields = {"mode": h.mode, "fmt": h.fmt, "data": h.data, "scales": h.scales, "global_amax": h.global_amax}
    return tf.Hint(**{**fields, **kw})


def _bad_hints():
    h = _nvfp4_hint()
    nan_amax = h.global_amax.clone()
    nan_amax[1] = float("nan")
    nan_scale = h.scales.view(torch.uint8).clone()
    nan_scale[2, 1] = 0x7F
    m = tf.encode_hint(tf.quantize_mxfp4(torch.randn(4, 64)), "full")
    m_nan = m.scales.clone()
    m_nan[0, 0] = 255
    return h, [
        (_replace(h, global_amax=nan_amax), "hint global_amax: must be finite"),
        (_replace(h, global_amax=torch.tensor(-1.0)), "hint global_amax: must be finite and non-negative"),
        (_replace(h, global_amax=None), r"hint global_amax: expected float32.*got None"),
        (_replace(h, global_amax=torch.ones(3, 1)), r"hint global_amax: expected float32, a scalar or of shape \(4, 1\)"),
        (_replace(h, global_amax=h.global_amax.double()), "hint global_amax: expected float32"),
        (_replace(h, scales=nan_scale.view(torch.float8_e4m3fn)), r"hint scales: NaN scale code 0x7F at index \(2, 1\)"),
        (_replace(h, scales=h.scales.view(torch.uint8)), "hint scales: expected float8_e4m3fn"),
        (_replace(h, data=h.data[:, :-1]), r"hint (data|lsb): expected uint8 of shape \(4, 8\)"),
        (_replace(h, mode=tf.HintMode.FULL), r"hint (data|codes): expected uint8 of shape \(4, 32\)"),
        (_replace(h, mode="lsb"), "hint: mode and fmt must be HintMode and Format"),
        (_replace(m, scales=m_nan), "hint scales: NaN scale code 0xFF"),
        (_replace(m, global_amax=torch.tensor(1.0)), "hint global_amax: expected None for mxfp4"),
        (_replace(m, fmt=tf.Format.NVFP4), "hint scales: expected float8_e4m3fn|hint shape mismatch"),
    ]


def test_malformed_hints_raise_value_errors_everywhere():
    good, cases = _bad_hints()
    x = torch.randn(4, 64)
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            bad.check()
        with pytest.raises(ValueError, match=match):
            tf.guided_quantize(x, bad)
        with pytest.raises(ValueError, match=match):
            tf.guided_fake_quant(x, bad)
        if bad.fmt is good.fmt and bad.mode is good.mode:
            with pytest.raises(ValueError, match=match):
                tf.hint_cat([good, bad])
    assert good.check() is good


def test_nan_amax_and_nan_scale_never_reach_the_kernels():
    # before validation these gave NaN output (amax) or garbage (scale 0x7F / 0xFF / E8M0 255)
    q = tf.quantize_nvfp4(torch.randn(2, 32), per_row=True)
    for code in (0x7F, 0xFF):
        s = q.scales.view(torch.uint8).clone()
        s[0, 0] = code
        bad = tf.NVFP4(q.codes, s.view(torch.float8_e4m3fn), q.global_amax)
        with pytest.raises(ValueError, match=f"NVFP4 scales: NaN scale code 0x{code:02X}"):
            tf.encode_hint(bad, "lsb")
    with pytest.raises(ValueError, match="expected an NVFP4, MXFP4 or FP8 tensor"):
        tf.encode_hint(q.codes, "lsb")


def test_guided_codes_validates_grid_and_hint_data():
    from tracefp4.formats import guided_codes

    x = torch.randn(4, 64)
    q = tf.quantize_nvfp4(x, per_row=True)
    with pytest.raises(ValueError, match=r"grid lsb: expected uint8 of shape \(4, 8\)"):
        guided_codes(x, "nvfp4", q.scales, q.global_amax, lsb=q.codes)
    with pytest.raises(ValueError, match=r"grid scales: expected float8_e4m3fn of shape \(4, 4\)"):
        guided_codes(x, "nvfp4", q.scales[:, :2], q.global_amax, codes=q.codes)
    with pytest.raises(ValueError, match="exactly one"):
        guided_codes(x, "nvfp4", q.scales, q.global_amax)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_checked_scale_copy_is_a_clone_and_refuses_nan_as_check_grid(fmt):
    """The one-pass copy and NaN check of a grid's scales: the same bytes and dtype in fresh memory, and
    a NaN code refused with check_grid's words (naming the first)."""
    from tracefp4.formats.validation import check_grid, checked_scale_copy

    x = torch.randn(5, 64)
    q = tf.quantize_nvfp4(x, per_row=True) if fmt == "nvfp4" else tf.quantize_mxfp4(x)
    copy = checked_scale_copy(fmt, q.scales, "grid")
    assert copy.dtype == q.scales.dtype and copy.data_ptr() != q.scales.data_ptr()
    assert torch.equal(copy.view(torch.uint8), q.scales.view(torch.uint8))
    raw = q.scales.view(torch.uint8).clone()
    raw[3, 1], raw[4, 0] = (0xFF, 0x7F) if fmt == "nvfp4" else (0xFF, 0xFF)
    bad = raw if fmt == "mxfp4" else raw.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError) as want:
        check_grid(fmt, bad, q.global_amax if fmt == "nvfp4" else None, x.shape, "grid")
    with pytest.raises(ValueError) as got:
        checked_scale_copy(fmt, bad, "grid")
    assert str(got.value) == str(want.value) and "(3, 1)" in str(got.value)
