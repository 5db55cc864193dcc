"""The C library's CPU quantizers besides the site kernel (``formats/clib/quant.py``,
``csrc/cpu_quant.h``): the per-tensor NVFP4 quantize, dequantize, guided rounding and the low-bit
hint's packing, against the numba kernels bit for bit (atol=0; tests/test_conformance.py holds each
to the readable reference), on both code paths, whatever the thread count, with NaN/Inf refused as
the numba path refuses them and the inputs the C entries do not take falling back to numba."""

from __future__ import annotations

import pytest
import torch

from fp4data import KINDS, bits, make_data
import tracefp4.formats as formats
from tracefp4.formats import clib, dispatch
from tracefp4.formats.clib import quant
from tracefp4.formats.dispatch import TABLES, Backend, Op

pytestmark = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

IMPLS = ["portable"] + (["avx512"] if clib.available() and clib.has_avx512_bf16() else [])
#: The dispatch takes the C entries where the library runs its AVX-512 paths (quant.runs_vector).
needs_vector = pytest.mark.skipif(not (clib.available() and quant.runs_vector()),
                                  reason="the dispatch keeps numba where the C library runs only portable C")
#: K: one NVFP4 block; three (K % 32 == 16); an MXFP4-able row; a wide one
WIDTHS = [16, 48, 64, 1056]
FORMATS = ["nvfp4", "mxfp4"]


def _data(kind: str, k: int, rows: int = 9, dtype=torch.bfloat16) -> torch.Tensor:
    return make_data(kind, torch.float32, rows=rows, cols=k).to(dtype)


def _numba(fn, *args, **kw):
    with formats.use_backend(Backend.NUMBA):
        return fn(*args, **kw)


def _quantized(kind: str, k: int, fmt: str):
    x = _data(kind, k)
    return _numba(formats.quantize_nvfp4, x) if fmt == "nvfp4" else _numba(formats.quantize_mxfp4, x)


def _s_dec(q) -> torch.Tensor:
    if q.fmt.value == "nvfp4":
        return (1.0 / formats.nvfp4_global_encode_scale(q.global_amax)).expand(q.shape[0]).contiguous()
    return torch.ones(q.shape[0])


def _low_bits(q) -> torch.Tensor:
    return _numba(formats.lsb_bits, q.codes)


# --- the per-tensor NVFP4 quantize ---------------------------------------------------------------


@needs_vector
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", WIDTHS)
def test_per_tensor_quantize_equals_numba(kind, k):
    x = _data(kind, k)
    assert dispatch.implementation(Op.QUANTIZE_NVFP4, x, None, False, True) is TABLES[Op.QUANTIZE_NVFP4][Backend.C]
    q, values = formats.quantize_dequantize_nvfp4(x)
    want, want_values = _numba(formats.quantize_dequantize_nvfp4, x)
    assert torch.equal(q.codes, want.codes) and torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert torch.equal(bits(q.global_amax), bits(want.global_amax)) and q.global_amax.shape == want.global_amax.shape
    assert torch.equal(values.view(torch.int16), want_values.view(torch.int16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [16, 48, 4112])
def test_per_tensor_paths_and_threads_equal_numba(impl, dtype, kind, k):
    """Both passes on each code path and 1, 2 and 5 threads (the block amaxes of pass one feed pass two)."""
    x = _data(kind, k, rows=23, dtype=dtype)
    want, want_values = _numba(formats.quantize_dequantize_nvfp4, x)
    for threads in (1, 2, 5):
        q, values = quant.quantize_nvfp4_tensor(x, values=True, threads=threads, impl=impl)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scales.view(torch.uint8),
                                                                 want.scales.view(torch.uint8))
        assert torch.equal(bits(q.global_amax), bits(want.global_amax))
        if dtype == torch.bfloat16:
            assert torch.equal(values.view(torch.int16), want_values.view(torch.int16))
        else:
            assert values is None


def test_all_zero_tensor_has_amax_zero():
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    x[1, 5] = -0.0
    q = formats.quantize_nvfp4(x)
    want = _numba(formats.quantize_nvfp4, x)
    assert float(q.global_amax) == 0.0 and torch.equal(q.codes, want.codes)
    assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 31, 33, 255, 4097, 70001])
def test_abs_max_equals_torch(impl, dtype, n):
    """Every length: the vector loop, its masked tail, and splits over threads."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 100).to(dtype)
    want = x.abs().amax().to(torch.float32) if n else torch.zeros((), dtype=torch.float32)
    for threads in (1, 2, 5):
        assert torch.equal(bits(quant.tensor_amax(x, threads=threads, impl=impl)), bits(want))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_abs_max_flags_nan_and_inf(impl, bad):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(1000, dtype=dtype)
        x[777] = bad
        amax, flagged = quant.amax_pass(x, impl=impl)
        assert bool(flagged) and float(amax) == torch.finfo(dtype).max


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_per_tensor_quantize_refuses_non_finite_as_numba(bad):
    x = _data("randn", 64)
    x[4, 17] = bad
    with pytest.raises(ValueError) as c_err:
        formats.quantize_nvfp4(x)
    with pytest.raises(ValueError) as numba_err:
        _numba(formats.quantize_nvfp4, x)
    assert str(c_err.value) == str(numba_err.value) and "(4, 17)" in str(c_err.value)


def test_inputs_the_c_entries_do_not_take_fall_back_to_numba():
    """float16 quantizes, and float16 and float32 guided-round, on the numba kernels."""
    x = _data("randn", 32, dtype=torch.float16)
    for amax, per_row in ((None, False), (None, True)):
        assert dispatch.implementation(Op.QUANTIZE_NVFP4, x, amax, per_row, False) is numba_quantize()
    for dtype in (torch.float16, torch.float32):
        x = _data("randn", 32, dtype=dtype)
        assert dispatch.implementation(Op.GUIDED, x) is TABLES[Op.GUIDED][Backend.NUMBA]
        q = formats.quantize_nvfp4(x)
        assert torch.equal(formats.guided_codes(x, "nvfp4", q.scales, q.global_amax, codes=q.codes).codes, q.codes)


def numba_quantize():
    return TABLES[Op.QUANTIZE_NVFP4][Backend.NUMBA]


def test_without_the_vector_paths_the_dispatch_keeps_numba(monkeypatch):
    """Where the library runs only portable C (slower than numba), the new NVFP4/MXFP4 C entries
    decline; the sites' per-row bf16 NVFP4 stays in C, as before, and FP8 too (faster than torch's ops)."""
    monkeypatch.setattr(quant, "_vector_paths", lambda: False)
    x = _data("randn", 64)
    q = _numba(formats.quantize_nvfp4, x)
    assert dispatch.implementation(Op.QUANTIZE_NVFP4, x, None, True, True) is TABLES[Op.QUANTIZE_NVFP4][Backend.C]
    assert dispatch.implementation(Op.QUANTIZE_NVFP4, x, None, False, True) is numba_quantize()
    assert dispatch.implementation(Op.QUANTIZE_NVFP4, x.float(), None, True, True) is numba_quantize()
    assert dispatch.implementation(Op.QUANTIZE_MXFP4, x, False) is TABLES[Op.QUANTIZE_MXFP4][Backend.NUMBA]
    assert dispatch.implementation(Op.GUIDED, x) is TABLES[Op.GUIDED][Backend.NUMBA]
    assert dispatch.implementation(Op.DEQUANTIZE, q.codes) is TABLES[Op.DEQUANTIZE][Backend.NUMBA]
    assert dispatch.implementation(Op.LSB_BITS, q.codes) is TABLES[Op.LSB_BITS][Backend.NUMBA]
    assert dispatch.implementation(Op.QUANTIZE_FP8, x) is TABLES[Op.QUANTIZE_FP8][Backend.C]
    assert dispatch.implementation(Op.DEQUANTIZE_FP8, q.codes) is TABLES[Op.DEQUANTIZE_FP8][Backend.C]


# --- float32 rows on the site kernel ------------------------------------------------------------


def _c_rows32(x: torch.Tensor, amax: torch.Tensor | None, impl: str):
    """The site kernel's (codes, scale bytes, amax) of float32 rows, on one code path."""
    r, k = x.shape
    a = torch.empty(r) if amax is None else amax.clone()
    codes, scales = torch.empty(r, k // 2, dtype=torch.uint8), torch.empty(r, k // 16, dtype=torch.uint8)
    bad = clib.quantize_into(x, a, codes, scales, None, own_amax=amax is None, impl=impl)
    return codes, scales, a, bad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", WIDTHS + [4112])
@pytest.mark.parametrize("scope", ["own", "given"])
def test_float32_rows_equal_numba(impl, kind, k, scope):
    x = _data(kind, k, dtype=torch.float32)
    amax = x.abs().amax(dim=1) * 0.75 if scope == "given" else None
    codes, scales, a, bad = _c_rows32(x, amax, impl)
    want = _numba(formats.quantize_nvfp4, x, global_amax=None if amax is None else amax.unsqueeze(1),
                  per_row=amax is None)
    assert torch.equal(codes, want.codes) and torch.equal(scales, want.scales.view(torch.uint8)) and not bad
    assert torch.equal(bits(a), bits(want.global_amax.reshape(-1)))


@needs_vector
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
def test_float32_quantize_goes_to_c_and_equals_numba(kind, per_row):
    x = _data(kind, 96, dtype=torch.float32)
    assert dispatch.implementation(Op.QUANTIZE_NVFP4, x, None, per_row, True) is TABLES[Op.QUANTIZE_NVFP4][Backend.C]
    q, values = formats.quantize_dequantize_nvfp4(x, per_row=per_row)
    want, want_values = _numba(formats.quantize_dequantize_nvfp4, x, per_row=per_row)
    assert torch.equal(q.codes, want.codes) and torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert torch.equal(bits(q.global_amax), bits(want.global_amax)) and q.global_amax.shape == want.global_amax.shape
    assert torch.equal(bits(values), bits(want_values))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_float32_rows_flag_non_finite(impl, bad):
    x = _data("randn", 64, dtype=torch.float32)
    x[5, 9] = bad
    assert _c_rows32(x, None, impl)[3]
    with pytest.raises(ValueError) as c_err:
        formats.quantize_nvfp4(x, per_row=True)
    with pytest.raises(ValueError) as numba_err:
        _numba(formats.quantize_nvfp4, x, per_row=True)
    assert str(c_err.value) == str(numba_err.value) and "(5, 9)" in str(c_err.value)


# --- MXFP4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [32, 96, 1056])
def test_mxfp4_equals_numba(impl, dtype, kind, k):
    x = _data(kind, k, dtype=dtype)
    for mode in ("floor", "rceil"):
        want = _numba(formats.quantize_mxfp4, x, scale_mode=mode)
        for threads in (1, 2, 5):
            codes, scales, bad = quant.mxfp4_rows(x, mode == "rceil", threads=threads, impl=impl)
            assert torch.equal(codes, want.codes) and torch.equal(scales, want.scales) and not bad.any()
        chosen = dispatch.implementation(Op.QUANTIZE_MXFP4, x, mode == "rceil")
        assert chosen is TABLES[Op.QUANTIZE_MXFP4][Backend.C if quant.runs_vector() else Backend.NUMBA]
        q = formats.quantize_mxfp4(x, scale_mode=mode)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scales, want.scales)


@pytest.mark.parametrize("impl", IMPLS)
def test_mxfp4_extreme_exponents_equal_numba(impl):
    """Block amaxes from float32 subnormals (exponent clamped at -127, 2^127 encode factors) to the
    largest floats (+127), and exact powers of two at the RCEIL boundary (amax / 6 a power of two)."""
    x = torch.zeros(6, 64)
    x[0] = torch.logspace(-45, -38, 64)
    x[1] = torch.logspace(30, 38, 64) * 3.0
    x[2, :32] = 6.0 * 2.0 ** torch.arange(-16, 16).float()
    x[3, 32:] = -1e-40
    x[4] = 3e38  # bf16 rounds it to 2.99e38: finite
    x[5, 7] = -0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for rceil in (False, True):
            want = _numba(formats.quantize_mxfp4, xd, scale_mode="rceil" if rceil else "floor")
            codes, scales, _ = quant.mxfp4_rows(xd, rceil, impl=impl)
            assert torch.equal(codes, want.codes) and torch.equal(scales, want.scales), (dtype, rceil)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mxfp4_refuses_non_finite_as_numba(bad):
    x = _data("randn", 64)
    x[2, 40] = bad
    with pytest.raises(ValueError) as c_err:
        formats.quantize_mxfp4(x)
    with pytest.raises(ValueError) as numba_err:
        _numba(formats.quantize_mxfp4, x)
    assert str(c_err.value) == str(numba_err.value) and "(2, 40)" in str(c_err.value)
    assert dispatch.implementation(Op.QUANTIZE_MXFP4, x.half(), False) is TABLES[Op.QUANTIZE_MXFP4][Backend.NUMBA]


# --- FP8 E4M3 ------------------------------------------------------------------------------------


def _torch(fn, *args, **kw):
    with formats.use_backend(Backend.TORCH):
        return fn(*args, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [16, 48, 1056, 8, 1063])
def test_fp8_equals_torch(impl, dtype, kind, k):
    """Codes and row scales as torch's ops make them (the vector loop, its scalar tail, zero rows,
    E4M3 subnormals), on 1, 2 and 5 threads; the dequantize of every result too."""
    x = _data(kind if k % 16 == 0 else "heavy_tailed", k, dtype=dtype)  # some kinds need whole blocks
    want = _torch(formats.quantize_fp8, x)
    for threads in (1, 2, 5):
        codes, scale, bad = quant.fp8_rows(x, threads=threads, impl=impl)
        assert torch.equal(codes, want.data.view(torch.uint8)) and torch.equal(bits(scale), bits(want.scale.reshape(-1)))
        got = quant.fp8_dequantize_rows(codes, scale, threads=threads, impl=impl)
        assert torch.equal(bits(got), bits(_torch(formats.dequantize, want))) and not bad.any()
    assert dispatch.implementation(Op.QUANTIZE_FP8, x) is TABLES[Op.QUANTIZE_FP8][Backend.C]
    q = formats.quantize_fp8(x)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and q.scale.shape == want.scale.shape
    assert torch.equal(bits(formats.dequantize(q)), bits(_torch(formats.dequantize, q)))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_dequantize_takes_every_code(impl):
    """All 256 bytes, NaN codes included, as torch widens them."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    scale = torch.tensor([1.0, 0.5, 3.0, 1e-30, 7.0, 1e30, 0.1, 2.0**-140])
    want = codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(1)
    assert torch.equal(bits(quant.fp8_dequantize_rows(codes, scale, impl=impl)), bits(want))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_fp8_refuses_non_finite_as_torch(bad):
    x = _data("randn", 64)
    x[3, 3] = bad
    with pytest.raises(ValueError) as c_err:
        formats.quantize_fp8(x)
    with pytest.raises(ValueError) as torch_err:
        _torch(formats.quantize_fp8, x)
    assert str(c_err.value) == str(torch_err.value)
    assert dispatch.implementation(Op.QUANTIZE_FP8, x.half()) is TABLES[Op.QUANTIZE_FP8][Backend.TORCH]


# --- dequantize, guided rounding, the low-bit hint ------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [32, 96, 1056])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dequantize_equals_numba(impl, fmt, kind, k, dtype):
    q = _quantized(kind, k, fmt)
    div = _s_dec(q) if fmt == "mxfp4" else formats.nvfp4_global_encode_scale(q.global_amax).expand(q.shape[0])
    got = quant.dequantize_rows(q.codes, q.scales.view(torch.uint8), fmt, div.contiguous(), dtype=dtype, impl=impl)
    # bf16: written from the registers, equal to torch's rounding of the float32 values
    assert got.dtype == dtype and torch.equal(bits(got), bits(_numba(formats.dequantize, q).to(dtype)))
    assert torch.equal(bits(formats.dequantize(q, dtype)), bits(got))  # the dispatch's C entry


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_bf16_every_scale_byte_and_divisor_change(impl, fmt):
    """The bf16 path's per-thread tables (one per scale byte and row divisor): every one of the 256 scale
    bytes (negative, subnormal, NaN included), an odd number of 16-code groups, divisors that repeat
    (tables kept), change (rebuilt) and return, zero and a negative one; equal to torch's rounding of
    the float32 definition, bit for bit, where that is a number. NaN (a NaN scale byte, which a
    container's check refuses, or 0 / 0) comes out as the canonical 0x7FC0 (torch's scalar cast; its
    vectorised cast may keep a NaN's sign and payload)."""
    from tracefp4.formats.clib.quant import SCALE_TABLES
    from tracefp4.formats.constants import Format

    f = Format(fmt)
    k = 3 * f.block if f.block == 16 else 2 * f.block  # NVFP4: 3 groups of 16 (odd), MXFP4: 4
    g = torch.Generator().manual_seed(7)
    rows = 256 * f.block // k + 1
    scale_rows = (torch.arange(rows * (k // f.block)) % 256).to(torch.uint8).reshape(rows, -1)
    codes = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=g)
    div = torch.tensor([3.0, 3.0, 0.1, 3.0, -2.0, 0.0, 1e-30, 1e30] * rows)[:rows].to(torch.float32)
    lut = torch.from_numpy(SCALE_TABLES[f]).to(torch.float32)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(rows, k).long()
    want = (e2m1[nib] * lut[scale_rows.long()].repeat_interleave(f.block, dim=1)) / div.unsqueeze(1)
    expect = torch.where(want.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), want.to(torch.bfloat16).view(torch.int16))
    assert want.isnan().any() and not want.isnan().all()
    for threads in (1, 2, 5):
        got = quant.dequantize_rows(codes, scale_rows, fmt, div, dtype=torch.bfloat16, threads=threads, impl=impl)
        assert torch.equal(got.view(torch.int16), expect), threads


def test_dequantize_refuses_other_dtypes():
    q = _quantized("randn", 32, "nvfp4")
    with pytest.raises(ValueError, match="dequantize_nvfp4 dtype: expected torch.float32 or torch.bfloat16, got "
                                         "torch.float16"):
        formats.dequantize(q, torch.float16)
    with pytest.raises(ValueError, match="dequantize_rows dtype"):
        quant.dequantize_rows(q.codes, q.scales.view(torch.uint8), "nvfp4", torch.ones(q.shape[0]), dtype=torch.int8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("full", [False, True], ids=["lsb", "full"])
def test_guided_equals_numba(impl, fmt, kind, full):
    q = _quantized(kind, 96, fmt)
    g = torch.Generator().manual_seed(KINDS.index(kind))
    x = (formats.dequantize(q) * (1 + 0.3 * torch.randn(q.shape, generator=g))).to(torch.bfloat16)
    hint = {"codes": q.codes} if full else {"lsb": _low_bits(q)}
    amax = q.global_amax if fmt == "nvfp4" else None
    want = _numba(formats.guided_codes, x, fmt, q.scales, amax, **hint).codes
    got, bad = quant.guided_rows(x, q.scales.view(torch.uint8), fmt, _s_dec(q), next(iter(hint.values())), full,
                                 impl=impl)
    assert torch.equal(got, want) and not bad.any()
    assert torch.equal(formats.guided_codes(x, fmt, q.scales, amax, **hint).codes, want)  # the dispatch's C entry


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("full", [False, True], ids=["lsb", "full"])
def test_guided_every_bf16_pattern_equals_numba(impl, fmt, full):
    """Every finite bf16 pattern, both signs, on its own per-row grid with random hints (every
    bracket, exact code value, 0.25 and 6 meets both hint bits and rollout codes of both signs).
    NVFP4 rows of 3 groups of 16: the AVX path's two-groups-a-load loop and its single-group tail."""
    k = 48 if fmt == "nvfp4" else 64
    pats = torch.arange(0, 0x7F80, dtype=torch.int32)
    pats = torch.cat([pats, pats | 0x8000]).to(torch.int16)
    x = pats[: pats.numel() // k * k].view(torch.bfloat16).reshape(-1, k)
    g = torch.Generator().manual_seed(5)
    hint = torch.randint(0, 256, (x.shape[0], k // 2 if full else k // 8), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":
        q = _numba(formats.quantize_nvfp4, x, per_row=True)
        s_dec = (1.0 / formats.nvfp4_global_encode_scale(q.global_amax)).reshape(-1).contiguous()
        amax = q.global_amax
    else:
        q, s_dec, amax = _numba(formats.quantize_mxfp4, x), torch.ones(x.shape[0]), None
    want = _numba(formats.guided_codes, x, fmt, q.scales, amax, **({"codes": hint} if full else {"lsb": hint})).codes
    got, bad = quant.guided_rows(x, q.scales.view(torch.uint8), fmt, s_dec, hint, full, impl=impl)
    assert torch.equal(got, want) and not bad.any()


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
@pytest.mark.parametrize("full", [False, True], ids=["lsb", "full"])
def test_guided_refuses_non_finite_as_numba(bad, full):
    q = _quantized("randn", 64, "nvfp4")
    x = formats.dequantize(q).to(torch.bfloat16)
    x[7, 3] = bad
    hint = {"codes": q.codes} if full else {"lsb": _low_bits(q)}
    with pytest.raises(ValueError) as c_err:
        formats.guided_codes(x, "nvfp4", q.scales, q.global_amax, **hint)
    with pytest.raises(ValueError) as numba_err:
        _numba(formats.guided_codes, x, "nvfp4", q.scales, q.global_amax, **hint)
    assert str(c_err.value) == str(numba_err.value) and "(7, 3)" in str(c_err.value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 4), (3, 8), (5, 12), (7, 528)])
def test_lsb_bits_equal_numba(impl, shape):
    codes = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(shape[1])).to(torch.uint8)
    want = _numba(formats.lsb_bits, codes)
    for threads in (1, 2, 5):
        assert torch.equal(quant.lsb_rows(codes, threads=threads, impl=impl), want)
    assert torch.equal(formats.lsb_bits(codes), want)


# --- the thread count and the code path do not change a bit ----------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_same_bits_whatever_the_thread_count(threads):
    """Large enough to split (several grains a thread): every op through the dispatch under torch's
    thread count, against the numba kernels on one thread."""
    x = _data("heavy_tailed", 2048, rows=257)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want_q, want_v = _numba(formats.quantize_dequantize_nvfp4, x)
        want_d = _numba(formats.dequantize, want_q)
        want_l = _numba(formats.lsb_bits, want_q.codes)
        want_g = _numba(formats.guided_codes, x, "nvfp4", want_q.scales, want_q.global_amax, lsb=want_l).codes
        torch.set_num_threads(threads)
        q, v = formats.quantize_dequantize_nvfp4(x)
        assert torch.equal(q.codes, want_q.codes) and torch.equal(v.view(torch.int16), want_v.view(torch.int16))
        assert torch.equal(bits(formats.dequantize(q)), bits(want_d))
        assert torch.equal(formats.lsb_bits(q.codes), want_l)
        assert torch.equal(formats.guided_codes(x, "nvfp4", q.scales, q.global_amax, lsb=want_l).codes, want_g)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(len(IMPLS) < 2, reason="this CPU runs only the portable path")
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_portable_and_avx512_paths_agree(threads):
    x = _data("subnormal_scales", 1056, rows=130)
    q = _numba(formats.quantize_nvfp4, x)
    s8 = q.scales.view(torch.uint8)
    div = formats.nvfp4_global_encode_scale(q.global_amax).expand(q.shape[0]).contiguous()
    lsb = _low_bits(q)
    out = {}
    for impl in IMPLS:
        kw = dict(threads=threads, impl=impl)
        out[impl] = (quant.abs_max(x, **kw), quant.dequantize_rows(q.codes, s8, "nvfp4", div, **kw),
                     quant.guided_rows(x, s8, "nvfp4", _s_dec(q), lsb, False, **kw)[0],
                     quant.guided_rows(x, s8, "nvfp4", _s_dec(q), q.codes, True, **kw)[0], quant.lsb_rows(q.codes, **kw))
    a, b = out.values()
    assert a[0] == b[0] and all(torch.equal(bits(u), bits(v)) for u, v in zip(a[1:], b[1:]))


# --- the rollout's recording path ---------------------------------------------------------------


@needs_vector
@pytest.mark.parametrize("mode", ["lsb", "full"])
def test_recording_encodes_hints_on_the_c_kernels(monkeypatch, mode):
    """A captured site's hint (engines/capture.py: RawCapture, encoded when the records are assembled)
    packs its low bits on the C kernel through the dispatch, with numba's bytes; guided rounding from
    it runs in C too."""
    from tracefp4.engines.capture import RawCapture
    from tracefp4.formats.constants import HintMode
    from tracefp4.guidance.hints import guided_quantize

    x = _data("heavy_tailed", 64, rows=12)
    q = formats.quantize_nvfp4(x, per_row=True)
    calls = []
    for name in ("lsb_rows", "guided_rows"):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    hint = RawCapture(q, HintMode(mode)).hint()
    assert calls == (["lsb_rows"] if mode == "lsb" else [])
    want = _numba(lambda: RawCapture(q, HintMode(mode)).hint())
    assert torch.equal(hint.data, want.data)
    assert torch.equal(guided_quantize(x, hint).codes, q.codes) and calls[-1] == "guided_rows"
