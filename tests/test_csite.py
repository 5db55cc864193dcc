"""The C site quantizer (``formats/clib/site.py``, ``csrc/site_quant.h``) against the numba kernel and the
readable reference, bit for bit (atol=0), and the C top-k combine and SiLU gate against torch's
expressions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4data import KINDS, make_data
import tracefp4.formats as formats
from tracefp4.formats import clib, dispatch, kernels, rows
from tracefp4.formats import reference as ref

pytestmark = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

IMPLS = ["portable"] + (["avx512"] if clib.available() and clib.has_avx512_bf16() else [])
#: K: one block; three; a K/V head row; an expert row; 257 blocks (more than one chunk of the AVX path)
WIDTHS = [16, 48, 64, 512, 4112]


def numba_rows(x: torch.Tensor, amax: torch.Tensor | None):
    """The numba kernel's (codes, scale bytes, amax, bf16 values, bad) of bf16 rows ``x``."""
    r = rows.kernel_rows(x)
    n, k = r.shape
    own = amax is None
    a = np.empty(n, np.float32) if own else amax.numpy().copy()
    codes, scales = np.empty((n, k // 2), np.uint8), np.empty((n, k // 16), np.uint8)
    values, bad = np.empty((n, k // 2), np.uint32), np.zeros(n, np.bool_)
    kernels.nvfp4_quantize.serial(r, a, own, np.empty((0, 0), np.uint32), codes, scales, values, bad, 1)
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
    codes, scales, a, values, bad = clib.nvfp4_rows(x, amax, values=True, impl=impl)
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
    codes, scales, amax, values, _ = clib.nvfp4_rows(x, None, values=True, impl=impl)
    rc, rs, ra = ref.quantize_nvfp4(x, per_row=True)
    unpacked = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(x.shape)
    assert torch.equal(unpacked, rc.to(torch.uint8))
    assert torch.equal(scales, rs.view(torch.uint8)) and torch.equal(amax, ra.reshape(-1))
    assert torch.equal(values.view(torch.int16), ref.dequantize_nvfp4(rc, rs, ra).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("amax", [None, 1.0, 448.0 * 6, 3e38, 1e-30], ids=["own", "one", "max_scale", "huge", "tiny"])
def test_every_bf16_pattern_codes_only(impl, amax):
    """Every finite bf16 pattern, both signs, codes and scales only (the AVX path's two-blocks-a-load
    loop, which values=True does not take): each row a run of consecutive patterns, so every E2M1
    tie, binade edge and subnormal meets many encode factors; an odd block count leaves one block
    for the single-block tail."""
    pats = torch.arange(0, 0x7F80, dtype=torch.int32)
    pats = torch.cat([pats, pats | 0x8000]).to(torch.int16)
    x = pats[: pats.numel() // 48 * 48].view(torch.bfloat16).reshape(-1, 48)
    given = None if amax is None else torch.full((x.shape[0],), amax)
    codes, scales, a, values, bad = clib.nvfp4_rows(x, given, values=False, impl=impl)
    want = numba_rows(x, given)
    assert values is None and not bad.any()
    assert np.array_equal(codes.numpy(), want[0]) and np.array_equal(scales.numpy(), want[1])
    assert np.array_equal(a.numpy().view(np.uint32), want[2].view(np.uint32))


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
        got = clib.nvfp4_rows(x, amax, values=True, impl=impl)
        want = numba_rows(x, amax)
        assert np.array_equal(got[0].numpy(), want[0]) and np.array_equal(got[3].view(torch.uint16).numpy(), want[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_rows_are_flagged_and_refused(impl):
    x = data("randn", 40, 48)
    x[3, 7], x[9, 47], x[31, 0] = float("nan"), float("inf"), float("-inf")
    bad = clib.nvfp4_rows(x, None, values=True, impl=impl)[4]
    assert np.nonzero(bad)[0].tolist() == [3, 9, 31]
    with pytest.raises(ValueError, match=r"non-finite input at index \(3, 7\)"):
        formats.quantize_dequantize_nvfp4(x, per_row=True)


def test_the_thread_count_does_not_change_the_bits():
    x = data("heavy_tailed", 1024, 1024)  # 2 MiB: splits over threads
    outs = [clib.nvfp4_rows(x, None, values=True, threads=t) for t in (1, 2, 5)]
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0][:4], o[:4]))


def test_numerics_takes_the_c_kernel_for_bf16_sites_and_agrees_with_numba(monkeypatch):
    """``quantize_dequantize_nvfp4`` on bf16 rows goes to C; with the C backend declining it takes numba:
    the same container and values either way (a leading shape is kept)."""
    x = data("zero_blocks", 24, 256).reshape(4, 6, 256)
    op = dispatch.Op.QUANTIZE_NVFP4
    assert dispatch.implementation(op, x, None, True, True) is dispatch.TABLES[op][dispatch.Backend.C]
    q, v = formats.quantize_dequantize_nvfp4(x, per_row=True)
    calls = []
    monkeypatch.setattr(clib.site, "supports_nvfp4", lambda *a: calls.append(1) and False)
    assert dispatch.implementation(op, x, None, True, True) is dispatch.TABLES[op][dispatch.Backend.NUMBA]
    q2, v2 = formats.quantize_dequantize_nvfp4(x, per_row=True)
    assert calls  # the C backend really was asked
    assert torch.equal(q.codes, q2.codes) and torch.equal(q.scales.view(torch.uint8), q2.scales.view(torch.uint8))
    assert torch.equal(q.global_amax, q2.global_amax) and q.global_amax.shape == (4, 6, 1)
    assert torch.equal(v.view(torch.int16), v2.view(torch.int16)) and v.shape == x.shape


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="expected CPU bf16"):
        clib.nvfp4_rows(torch.zeros(2, 16), None, values=False)
    with pytest.raises(ValueError, match="multiple of 16"):
        clib.nvfp4_rows(torch.zeros(2, 24, dtype=torch.bfloat16), None, values=False)
    with pytest.raises(ValueError, match="amax"):
        clib.nvfp4_rows(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(3), values=False)
    with pytest.raises(ValueError, match="impl"):
        clib.nvfp4_rows(torch.zeros(2, 16, dtype=torch.bfloat16), None, values=False, impl="sse")


# --- the top-k combine -----------------------------------------------------------------------------

COMBINE_IMPLS = ["portable"] + (["avx512"] if clib.has_avx512_bf16() else [])


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
    got = clib.topk_combine(out, w, impl=impl)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(clib.topk_combine(out, w, impl=impl, threads=1).view(torch.int16), want.view(torch.int16))


def test_combine_refuses_bad_operands():
    with pytest.raises(ValueError, match="expected CPU bf16 out"):
        clib.topk_combine(torch.zeros(2, 4, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="expected CPU bf16 out"):
        clib.topk_combine(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 3))


# --- the SiLU gate ---------------------------------------------------------------------------------

ALL_BF16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_silu_table_is_torchs_silu_in_its_vectorised_and_scalar_loops():
    """The table is made with torch's vectorised kernel; torch's scalar loop (a strided input) gives the
    same bits on every finite input, so the table is torch's SiLU whichever loop torch would run."""
    table = clib.silu_table()
    assert table.dtype == torch.int16 and table.shape == (65537,) and int(table[-1]) == 0
    spaced = torch.zeros(2 << 16, dtype=torch.bfloat16)
    spaced[::2] = ALL_BF16
    scalar = torch.nn.functional.silu(spaced[::2]).view(torch.int16)
    vector = torch.nn.functional.silu(ALL_BF16.clone()).view(torch.int16)
    finite = torch.isfinite(ALL_BF16.float())
    assert torch.equal(table[:-1][finite], scalar[finite]) and torch.equal(table[:-1][finite], vector[finite])


@pytest.mark.parametrize("impl", COMBINE_IMPLS + ["auto"])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("rows,inter", [(256, 256), (64, 1024), (7, 40), (1, 16), (3, 1), (0, 32)])
def test_silu_gate_equals_torch_bit_for_bit(impl, threads, rows, inter):
    """``F.silu(gate) * up`` with the gates running through every bf16 pattern (inf, nan, subnormals
    and signed zeros among them) and random ups of every magnitude; 40 and 1 leave a tail to the
    portable loop. NaN results are compared as NaN (torch's vectorised and scalar loops write
    different NaN bits; a site refuses NaN either way)."""
    g = torch.Generator().manual_seed(rows * 7 + inter)
    n = rows * inter
    gate = ALL_BF16[torch.randperm(1 << 16, generator=g)[:n]]  # n <= 2^16: distinct patterns, all of them at 2^16
    up = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())).to(torch.bfloat16)
    x = torch.cat([gate.reshape(rows, inter), up.reshape(rows, inter)], dim=1)
    gate_half, up_half = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate_half) * up_half
    got = clib.silu_gate(x, impl=impl, threads=threads)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_silu_gate_refuses_bad_operands():
    with pytest.raises(ValueError, match=r"silu_gate: expected CPU bf16 \[R, 2I\], got torch.float32"):
        clib.silu_gate(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"expected CPU bf16 \[R, 2I\], got torch.bfloat16 \(2, 7\)"):
        clib.silu_gate(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="silu_gate impl"):
        clib.silu_gate(torch.zeros(2, 8, dtype=torch.bfloat16), impl="sse")


def test_the_packed_backend_gates_in_c_and_every_backend_takes_a_function():
    from tracefp4.engines.experts.base import SILU_GATE, silu_gate
    from tracefp4.engines.experts.cpu_fp4 import PackedCPUGEMM
    from tracefp4.engines.experts.dense import DenseGEMM

    x = (torch.randn(24, 64) * 3).to(torch.bfloat16)
    want = silu_gate(x).view(torch.int16)
    for gemm in (PackedCPUGEMM(), DenseGEMM()):
        assert torch.equal(gemm.activate(x, SILU_GATE).view(torch.int16), want)
        assert torch.equal(gemm.activate(x, lambda t: t[:, :32] * 2), x[:, :32] * 2)
        with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
            gemm.activate(x, "gelu")


def test_qwen3_moe_experts_gate_by_name_and_other_gates_run_as_they_are():
    from tracefp4.engines.experts.base import SILU_GATE
    from tracefp4.engines.model import TinyMoESpec, experts_gate, from_config

    model = from_config(TinyMoESpec(layers=1).config(), seed=0)
    experts = model.model.layers[0].mlp.experts
    assert experts_gate(experts) == SILU_GATE
    experts.act_fn = torch.nn.GELU()  # another activation: the module's own gate, applied as it is
    assert experts_gate(experts) == experts._apply_gate
