"""NVFP4 "Four over Six" block scales (arXiv 2512.02010): the readable reference on hand-made blocks,
the fast path bit for bit against it, the quantizer and plan option, and guided rounding on its grid."""

from __future__ import annotations

import pytest
import torch

import tracefp4 as tf
from tracefp4.engines.plan import PrecisionPlan
import tracefp4.formats as formats
from tracefp4.formats import torch_ops
from tracefp4.formats import reference as ref
from tracefp4.formats.quantizers import NVFP4Quantizer

from fp4data import KINDS, S_ENC_ONE, bits, make_data

ONE = 0x38  # the E4M3 byte of 1.0


def _block(*head: float) -> list[float]:
    return [*head, *[0.0] * (16 - len(head))]


def test_reference_golden_blocks():
    # S_enc == 1: the 6-scale of a block is e4m3(amax_b / 6), its 4-scale e4m3(amax_b / 4)
    x = torch.tensor([
        _block(4, -3, 2, 1.5, -1, 0.5),  # 4 wins: its scale 1.0 makes every value a codeword (6: 0.6875)
        _block(6, -1),  # 6 wins: scale 1.0 exact; with 4 (scale 1.5) the 1 lands on 0.75
        _block(6, 3),  # both exact (6: 1.0; 4: 1.5): a tie keeps 6
    ])
    codes, s8, _ = ref.quantize_nvfp4_4over6(x, global_amax=S_ENC_ONE)
    assert s8.view(torch.uint8)[:, 0].tolist() == [ONE, ONE, ONE]  # block 0 is 4's 1.0, blocks 1 and 2 are 6's
    assert codes[0, :6].tolist() == [6, 8 + 5, 4, 3, 8 + 2, 1]
    assert codes[1, :2].tolist() == [7, 8 + 2] and codes[2, :2].tolist() == [7, 5]
    six, s6, _ = ref.quantize_nvfp4(x, global_amax=S_ENC_ONE)
    assert s6.view(torch.uint8)[:, 0].tolist() == [0x33, ONE, ONE]  # 0x33 = 0.6875: block 0 differs from standard NVFP4
    assert torch.equal(ref.dequantize_nvfp4(codes, s8, S_ENC_ONE)[0], x[0])  # 4 is exact where 6 is not
    assert not torch.equal(ref.dequantize_nvfp4(six, s6, S_ENC_ONE)[0], x[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scope", ["tensor", "row", "given"])
def test_fast_equals_reference(kind, dtype, scope):
    x = make_data(kind, dtype, rows=8, cols=128)
    kw = {"global_amax": torch.tensor(3.0) if kind == "saturating" else S_ENC_ONE} if scope == "given" else \
        {"per_row": scope == "row"}
    codes, s8, amax = ref.quantize_nvfp4_4over6(x, **kw)
    q = formats.quantize_nvfp4_4over6(x, **kw)
    assert torch.equal(tf.unpack_fp4(q.codes), codes)
    assert torch.equal(bits(q.scales), bits(s8))
    assert torch.equal(bits(q.global_amax.float()), bits(amax.float()))


def test_fast_path_in_chunks_of_rows(monkeypatch):
    x = make_data("heavy_tailed", torch.bfloat16, rows=12, cols=64).reshape(3, 4, 64)
    whole = formats.quantize_nvfp4_4over6(x)
    monkeypatch.setattr(torch_ops, "_4OVER6_CHUNK", 100)  # one row of 64 per chunk
    chunked = formats.quantize_nvfp4_4over6(x)
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(bits(chunked.scales), bits(whole.scales))
    assert chunked.codes.shape == (3, 4, 32) and chunked.scales.shape == (3, 4, 4)


def test_fast_path_mixes_both_choices_and_lowers_the_error():
    x = make_data("randn", torch.float32, rows=32, cols=256)
    q4, q6 = formats.quantize_nvfp4_4over6(x, per_row=True), formats.quantize_nvfp4(x, per_row=True)
    differs = (bits(q4.scales) != bits(q6.scales)).float().mean()
    # seeded data, elementwise arithmetic: the same on every machine; on Gaussian blocks either map
    # (max -> 4 or -> 6) wins often, so both must appear in a clear share of the 512 blocks
    assert 0.05 < differs < 0.95
    err = lambda q: ((formats.dequantize_nvfp4(q) - x) ** 2).sum()  # noqa: E731
    assert err(q4) < err(q6)
    with pytest.raises(ValueError, match="not finite|non-finite|NaN|nan|inf"):
        formats.quantize_nvfp4_4over6(torch.tensor([[float("nan")] * 16]))


def test_quantizer_and_plan_option():
    plan = PrecisionPlan.four_over_six()
    assert plan.quantizer("k") == NVFP4Quantizer("row", block_max="4over6")
    assert plan.weight_quantizer == NVFP4Quantizer("expert", block_max="4over6")
    assert PrecisionPlan(**plan.to_dict()) == plan and PrecisionPlan().nvfp4_scale == "6"
    with pytest.raises(ValueError, match="nvfp4_scale"):
        PrecisionPlan(nvfp4_scale="5")
    with pytest.raises(ValueError, match="block_max"):
        NVFP4Quantizer("row", block_max=4)
    w = make_data("heavy_tailed", torch.float32, rows=8, cols=64).reshape(2, 4, 64)
    q = NVFP4Quantizer("expert", block_max="4over6").quantize(w)
    amax = w.abs().amax(dim=(1, 2), keepdim=True).expand(2, 4, 1)
    codes, s8, _ = ref.quantize_nvfp4_4over6(w, global_amax=amax)
    assert torch.equal(tf.unpack_fp4(q.codes), codes) and torch.equal(bits(q.scales), bits(s8))


@pytest.mark.parametrize("kind", ["randn", "heavy_tailed", "zero_blocks"])
def test_guided_on_the_rollouts_grid_reproduces_its_codes(kind):
    """The trainer quantizes on the rollout's grid (its recorded block scales hold the 4-or-6 choice):
    with the identical input, lsb and full guidance give back the rollout's codes exactly."""
    quantizer = NVFP4Quantizer("row", block_max="4over6")
    x = make_data(kind, torch.bfloat16, rows=8, cols=128)
    q = quantizer.quantize(x)
    grid = quantizer.grid(q)
    for hint in ({"lsb": formats.lsb_bits(q.codes)}, {"codes": q.codes}):
        g = quantizer.guided_quantize(x, grid, **hint)
        assert torch.equal(g.codes, q.codes) and torch.equal(bits(g.scales), bits(q.scales))
    # round-to-nearest on the standard grid would not: the choice lives in the recorded scales
    assert not torch.equal(NVFP4Quantizer("row").quantize(x).codes, q.codes)
