"""The C site quantizer (``formats/csite.py``, ``csrc/site_quant.h``) against the numba kernel and the
readable reference, bit for bit (atol=0), and the C top-k combine against torch's expression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4data import KINDS, make_data
from tracefp4.formats import cgemm, csite, kernels, numerics
from tracefp4.formats import reference as ref

pytestmark = pytest.mark.skipif(not csite.available(), reason=f"CPU kernel unavailable: {cgemm.unavailable_reason()}")

IMPLS = ["portable"] + (["avx512"] if csite.available() and cgemm.has_avx512_bf16() else [])
#: K: one block; three; a K/V head row; an expert row; 257 blocks (more than one chunk of the AVX path)
WIDTHS = [16, 48, 64, 512, 4112]


def numba_rows(x: torch.Tensor, amax: torch.Tensor | None):
    """The numba kernel's (codes, scale bytes, amax, bf16 values, bad) of bf16 rows ``x``."""
    rows = numerics.kernel_rows(x)
    n, k = rows.shape
    own = amax is None
    a = np.empty(n, np.float32) if own else amax.numpy().copy()
    codes, scales = np.empty((n, k // 2), np.uint8), np.empty((n, k // 16), np.uint8)
    values, bad = np.empty((n, k // 2), np.uint32), np.zeros(n, np.bool_)
    kernels.nvfp4_quantize.serial(rows, a, own, np.empty((0, 0), np.uint32), codes, scales, values, bad, 1)
    return codes, scales, a, values.view(np.uint16).reshape(n, k), bad


def data(kind: str, rows: int, k: int) -> torch.Tensor:
    return make_data(kind, torch.float32, rows=rows, cols=k).to(torch.bfloat16)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("given", [False, True], ids=["own_amax", "given_amax"])
def test_equals_the_numba_kernel_bit_for_bit(impl, kind, k, given):
    x = data(kind, 9, k)
    # a given amax below the rows' own saturates blocks; zero rows keep amax 0 (S_enc 1)
    amax = (x.float().abs().amax(dim=1) * 0.75) if given else None
    codes, scales, a, values, bad = csite.nvfp4_rows(x, amax, values=True, impl=impl)
    want = numba_rows(x, amax)
    assert np.array_equal(codes.numpy(), want[0]) and np.array_equal(scales.numpy(), want[1])
    assert np.array_equal(a.numpy().view(np.uint32), want[2].view(np.uint32))
    assert np.array_equal(values.view(torch.uint16).numpy(), want[3]) and np.array_equal(bad, want[4])
    assert not bad.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference(impl, kind):
    """Codes, scales and amax against the readable float32 reference; values against its dequantize."""
    x = data(kind, 12, 64)
    codes, scales, amax, values, _ = csite.nvfp4_rows(x, None, values=True, impl=impl)
    rc, rs, ra = ref.quantize_nvfp4(x, per_row=True)
    unpacked = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(x.shape)
    assert torch.equal(unpacked, rc.to(torch.uint8))
    assert torch.equal(scales, rs.view(torch.uint8)) and torch.equal(amax, ra.reshape(-1))
    assert torch.equal(values.view(torch.int16), ref.dequantize_nvfp4(rc, rs, ra).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_scales_divide_every_value(impl):
    """Blocks whose scale over S_enc is below 2^-124 (bf16 values near float32's subnormals) take the
    division for every value instead of the power-of-two shortcut; both give the numba kernel's bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g) * torch.exp2(torch.randint(-133, -118, (16, 64), generator=g).float())
    x[:, 0] = 3e38  # a huge amax: S_enc tiny, so scale / S_enc is large, the other extreme
    x[::2, 0] = 1e-37
    x = x.to(torch.bfloat16)
    for amax in (None, torch.full((16,), 3e38)):
        got = csite.nvfp4_rows(x, amax, values=True, impl=impl)
        want = numba_rows(x, amax)
        assert np.array_equal(got[0].numpy(), want[0]) and np.array_equal(got[3].view(torch.uint16).numpy(), want[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_rows_are_flagged_and_refused(impl):
    x = data("randn", 40, 48)
    x[3, 7], x[9, 47], x[31, 0] = float("nan"), float("inf"), float("-inf")
    bad = csite.nvfp4_rows(x, None, values=True, impl=impl)[4]
    assert np.nonzero(bad)[0].tolist() == [3, 9, 31]
    with pytest.raises(ValueError, match=r"non-finite input at index \(3, 7\)"):
        numerics.quantize_dequantize_nvfp4(x, per_row=True)


def test_the_thread_count_does_not_change_the_bits():
    x = data("heavy_tailed", 1024, 1024)  # 2 MiB: splits over threads
    outs = [csite.nvfp4_rows(x, None, values=True, threads=t) for t in (1, 2, 5)]
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0][:4], o[:4]))


def test_numerics_takes_the_c_kernel_for_bf16_sites_and_agrees_with_numba(monkeypatch):
    """``quantize_dequantize_nvfp4`` on bf16 rows goes to C; with the library disabled it takes numba:
    the same container and values either way (a leading shape is kept)."""
    x = data("zero_blocks", 24, 256).reshape(4, 6, 256)
    q, v = numerics.quantize_dequantize_nvfp4(x, per_row=True)
    calls = []
    monkeypatch.setattr(csite, "available", lambda: calls.append(1) or False)
    q2, v2 = numerics.quantize_dequantize_nvfp4(x, per_row=True)
    assert calls  # the numba run really was asked
    assert torch.equal(q.codes, q2.codes) and torch.equal(q.scales.view(torch.uint8), q2.scales.view(torch.uint8))
    assert torch.equal(q.global_amax, q2.global_amax) and q.global_amax.shape == (4, 6, 1)
    assert torch.equal(v.view(torch.int16), v2.view(torch.int16)) and v.shape == x.shape


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="expected CPU bf16"):
        csite.nvfp4_rows(torch.zeros(2, 16), None, values=False)
    with pytest.raises(ValueError, match="multiple of 16"):
        csite.nvfp4_rows(torch.zeros(2, 24, dtype=torch.bfloat16), None, values=False)
    with pytest.raises(ValueError, match="amax"):
        csite.nvfp4_rows(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(3), values=False)
    with pytest.raises(ValueError, match="impl"):
        csite.nvfp4_rows(torch.zeros(2, 16, dtype=torch.bfloat16), None, values=False, impl="sse")


# --- the top-k combine -----------------------------------------------------------------------------

COMBINE_IMPLS = ["portable"] + (["avx512"] if cgemm.has_avx512_bf16() else [])


@pytest.mark.parametrize("impl", COMBINE_IMPLS + ["auto"])
@pytest.mark.parametrize("shape", [(64, 4, 512), (8, 8, 2048), (3, 2, 20), (1, 1, 16), (0, 4, 32), (300, 8, 64)])
def test_combine_equals_torch_bit_for_bit(impl, shape):
    """Signed zeros included: an all-(-0) sum is +0 in torch (its sum starts from +0), and here."""
    n, k, h = shape
    g = torch.Generator().manual_seed(n + k + h)
    out = (torch.randn(n, k, h, generator=g) * torch.exp2(torch.randint(-30, 30, (n, k, h), generator=g).float()))
    out = out.to(torch.bfloat16)
    w = torch.rand(n, k, generator=g)
    if n:
        out[0], w[0, 0] = -0.0, 0.0
        out[-1, :, : min(h, 5)] = 0.0
    want = (out.to(torch.float32) * w.to(torch.float32).unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    got = cgemm.topk_combine(out, w, impl=impl)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(cgemm.topk_combine(out, w, impl=impl, threads=1).view(torch.int16), want.view(torch.int16))


def test_combine_refuses_bad_operands():
    with pytest.raises(ValueError, match="expected CPU bf16 out"):
        cgemm.topk_combine(torch.zeros(2, 4, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="expected CPU bf16 out"):
        cgemm.topk_combine(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 3))
