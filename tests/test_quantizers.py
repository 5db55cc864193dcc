"""The quantizer objects: each one's five operations on CPU, bit for bit equal to the functional ops
and to the readable reference; the functional ``quantize``/``fake_quant`` built on them."""

from __future__ import annotations

import pytest
import torch

import tracefp4 as tf
import tracefp4.formats as formats
from tracefp4.formats import reference as ref
from tracefp4.formats.quantizers import FP8Quantizer, Grid, MXFP4Quantizer, NVFP4Quantizer, quantizer_for

from fp4data import bits, make_data, rollout_and_trainer

MODES = ["lsb", "full"]


def _same_nvfp4(a: tf.NVFP4, b: tf.NVFP4) -> bool:
    return (
        torch.equal(a.codes, b.codes)
        and torch.equal(bits(a.scales), bits(b.scales))
        and torch.equal(bits(a.global_amax), bits(b.global_amax))
    )


def _guided_ref(fmt, x, q, mode):
    rc = tf.unpack_fp4(q.codes)
    kw = {"rollout_codes": rc} if mode == "full" else {"rollout_lsb": rc & 1}
    if fmt == "nvfp4":
        return ref.guided_quantize_nvfp4(x, q.scales, q.global_amax, **kw)
    return ref.guided_quantize_mxfp4(x, q.scales, **kw)


def _hint_kw(q, mode):
    return {"codes": q.codes} if mode == "full" else {"lsb": tf.encode_hint(q, "lsb").data}


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_quantizer_five_ops(scope, dtype):
    x_roll, x_train = rollout_and_trainer(1, 12, 160, 0.05, dtype)
    qz = NVFP4Quantizer(scope)
    assert (qz.fmt, qz.block, qz.guidable) == ("nvfp4", 16, True)
    per_row = scope == "row"
    # quantize == functional == reference
    q = qz.quantize(x_roll)
    assert _same_nvfp4(q, tf.quantize_nvfp4(x_roll, per_row=per_row))
    codes, s8, amax = ref.quantize_nvfp4(x_roll, per_row=per_row)
    assert torch.equal(tf.unpack_fp4(q.codes), codes) and torch.equal(bits(q.scales), bits(s8))
    assert torch.equal(bits(q.global_amax), bits(amax))
    # dequantize
    assert torch.equal(bits(qz.dequantize(q)), bits(ref.dequantize_nvfp4(codes, s8, amax)))
    # grid
    g = qz.grid(q)
    assert g.scales is q.scales and g.global_amax is q.global_amax
    # guided_quantize on the rollout's grid
    for mode in MODES:
        got = qz.guided_quantize(x_train, g, **_hint_kw(q, mode))
        assert torch.equal(tf.unpack_fp4(got.codes), _guided_ref("nvfp4", x_train, q, mode))
        assert _same_nvfp4(got, tf.guided_quantize(x_train, tf.encode_hint(q, mode)))
    # fake_quant: forward equals dequantize(quantize) in x's dtype, identity gradient
    xg = x_roll.clone().requires_grad_(True)
    y = qz.fake_quant(xg)
    assert y.dtype == dtype and torch.equal(y, qz.dequantize(q).to(dtype))
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(xg.grad, grad)


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mxfp4_quantizer_five_ops(scale_mode):
    x_roll, x_train = rollout_and_trainer(2, 12, 128, 0.05)
    qz = MXFP4Quantizer(scale_mode)
    assert (qz.fmt, qz.block, qz.guidable) == ("mxfp4", 32, True)
    q = qz.quantize(x_roll)
    fn = tf.quantize_mxfp4(x_roll, scale_mode=scale_mode)
    assert torch.equal(q.codes, fn.codes) and torch.equal(q.scales, fn.scales)
    codes, scales = ref.quantize_mxfp4(x_roll, scale_mode)
    assert torch.equal(tf.unpack_fp4(q.codes), codes) and torch.equal(q.scales, scales)
    assert torch.equal(bits(qz.dequantize(q)), bits(ref.dequantize_mxfp4(codes, scales)))
    g = qz.grid(q)
    assert g.scales is q.scales and g.global_amax is None
    for mode in MODES:
        got = qz.guided_quantize(x_train, g, **_hint_kw(q, mode))
        assert torch.equal(tf.unpack_fp4(got.codes), _guided_ref("mxfp4", x_train, q, mode))
        assert torch.equal(got.codes, tf.guided_quantize(x_train, tf.encode_hint(q, mode)).codes)
    xg = x_roll.clone().requires_grad_(True)
    y = qz.fake_quant(xg)
    assert torch.equal(y, qz.dequantize(q).to(y.dtype))
    y.sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(xg))


def test_fp8_quantizer_five_ops():
    x = make_data("heavy_tailed", torch.bfloat16, 6, 64)
    qz = FP8Quantizer()
    assert (qz.fmt, qz.block, qz.guidable) == ("fp8", 1, True)
    q = qz.quantize(x)
    fn = formats.quantize_fp8(x)
    assert torch.equal(bits(q.data), bits(fn.data)) and torch.equal(q.scale, fn.scale)
    codes, scale = ref.quantize_fp8(x)
    assert torch.equal(q.codes, codes) and torch.equal(bits(q.scale), bits(scale))
    assert torch.equal(qz.dequantize(q), formats.dequantize_fp8(fn))
    assert qz.grid(q).scales is q.scale
    x_train = (x.float() * 1.01).to(x.dtype)
    got = qz.guided_quantize(x_train, qz.grid(q), lsb=formats.fp8_lsb_bits(q.codes))
    assert torch.equal(got.codes, ref.guided_quantize_fp8(x_train, q.scale, rollout_lsb=q.codes & 1))
    y = qz.fake_quant(x.clone().requires_grad_(True))
    assert y.dtype == x.dtype and torch.equal(y, qz.dequantize(q).to(x.dtype))


def test_expert_scope_gives_one_amax_per_expert():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 64, generator=g) * torch.tensor([1.0, 30.0, 0.01]).reshape(3, 1, 1)
    q = NVFP4Quantizer("expert").quantize(x)
    assert q.global_amax.shape == (3, 5, 1)
    per_expert = x.abs().amax(dim=(1, 2))
    for e in range(3):
        assert torch.equal(q.global_amax[e], per_expert[e].expand(5, 1))
    # each expert's slice is quantized exactly as a tensor of its own
    for e in range(3):
        alone = tf.quantize_nvfp4(x[e])
        assert torch.equal(q.codes[e], alone.codes) and torch.equal(bits(q.scales[e]), bits(alone.scales))
    codes, s8, _ = ref.quantize_nvfp4(x, global_amax=per_expert.reshape(3, 1, 1).expand(3, 5, 1))
    assert torch.equal(tf.unpack_fp4(q.codes), codes) and torch.equal(bits(q.scales), bits(s8))
    with pytest.raises(ValueError, match="expert"):
        NVFP4Quantizer("expert").quantize(torch.randn(64))
    bad = x.clone()
    bad[2, 1, 7] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite input at index \(2, 1, 7\)"):
        NVFP4Quantizer("expert").quantize(bad)


def test_amax_scope_is_checked_and_given_amax_wins():
    with pytest.raises(ValueError, match="amax_scope"):
        NVFP4Quantizer("layer")
    x = make_data("saturating", torch.float32, 4, 32)
    q = NVFP4Quantizer("row", global_amax=torch.tensor(2.0)).quantize(x)
    assert _same_nvfp4(q, tf.quantize_nvfp4(x, global_amax=torch.tensor(2.0)))


def test_guided_needs_the_nvfp4_amax():
    x = torch.randn(2, 32)
    q = tf.quantize_nvfp4(x)
    with pytest.raises(ValueError, match="global_amax"):
        NVFP4Quantizer().guided_quantize(x, Grid(q.scales), codes=q.codes)


def test_quantizer_grid_validates_the_container():
    q = tf.quantize_nvfp4(torch.randn(2, 32), per_row=True)
    with pytest.raises(ValueError, match="scales"):
        NVFP4Quantizer().grid(tf.NVFP4(q.codes, q.scales[:, :1], q.global_amax))
    m = tf.quantize_mxfp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match="codes"):
        MXFP4Quantizer().grid(tf.MXFP4(m.codes.to(torch.int16), m.scales))
    with pytest.raises(ValueError, match="expected an MXFP4"):
        MXFP4Quantizer().grid(q)


# --- the functional forms ------------------------------------------------------------------------


def test_quantize_and_fake_quant_refuse_other_formats_options():
    x = torch.randn(4, 64)
    for fn in (tf.quantize, tf.fake_quant):
        with pytest.raises(ValueError, match="per_row: an NVFP4 option"):
            fn(x, "mxfp4", per_row=True)
        with pytest.raises(ValueError, match="global_amax: an NVFP4 option"):
            fn(x, "mxfp4", global_amax=torch.tensor(1.0))
        with pytest.raises(ValueError, match="scale_mode: 'rceil' is an MXFP4 option"):
            fn(x, "nvfp4", scale_mode="rceil")
        with pytest.raises(ValueError):
            fn(x, "mxfp4", scale_mode="ceil")


def test_quantize_and_fake_quant_pass_the_options_through():
    x = make_data("heavy_tailed", torch.float32, 4, 64)
    q = tf.quantize(x, "mxfp4", scale_mode="rceil")
    r = tf.quantize_mxfp4(x, scale_mode="rceil")
    assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales)
    assert not torch.equal(q.scales, tf.quantize_mxfp4(x).scales), "the data must tell rceil from floor"
    assert torch.equal(tf.fake_quant(x, "mxfp4", scale_mode="rceil"), tf.dequantize(r))
    amax = torch.tensor(3.0)
    assert _same_nvfp4(tf.quantize(x, "nvfp4", global_amax=amax), tf.quantize_nvfp4(x, global_amax=amax))
    assert _same_nvfp4(tf.quantize(x, per_row=True), tf.quantize_nvfp4(x, per_row=True))
    assert torch.equal(tf.fake_quant(x, per_row=True), tf.dequantize(tf.quantize_nvfp4(x, per_row=True)))
    assert isinstance(quantizer_for("mxfp4", scale_mode="rceil"), MXFP4Quantizer)
