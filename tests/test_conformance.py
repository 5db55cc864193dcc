"""Every backend of every op against the readable reference, atol=0: the dispatch tables' entries,
and every code path (:class:`tracefp4.formats.clib.Impl`) of the C entry points this CPU runs.

The cases walk :data:`tracefp4.formats.dispatch.TABLES`: one test per (op, backend) entry, so a
backend added to a table is tested here or the coverage check below fails. Each case forces the
backend (:func:`tracefp4.formats.dispatch.use_backend`), checks that the dispatch really chose it,
and compares the public op's output with :mod:`tracefp4.formats.reference` bit for bit.

Triton runs on CPU tensors through its interpreter (``TRITON_INTERPRET=1``, switched on before
triton's first import, as in tests/test_triton.py); where triton is missing, or was imported
before the interpreter could be switched on, its cases skip with the reason. The C cases skip
where the library is not built, and fail there under ``TRACEFP4_REQUIRE_CLIB=1`` (CI).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import

import tracefp4.formats as formats  # noqa: E402
from tracefp4.formats import clib, dispatch  # noqa: E402
from tracefp4.formats.clib import quant  # noqa: E402
from tracefp4.formats.grid import nvfp4_global_encode_scale  # noqa: E402
from tracefp4.formats import reference as ref  # noqa: E402
from tracefp4.formats import reference_composite as refc  # noqa: E402
from tracefp4.formats.dispatch import TABLES, Backend, Op  # noqa: E402

from fp4data import bits, make_data  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's x/0 (capped at FLT_MAX)


def _triton_skip() -> str | None:
    try:
        import triton.language as tl
    except ImportError as e:
        return f"triton is not installed ({e})"
    if not torch.cuda.is_available() and type(tl.standard.sum).__name__ != "InterpretedFunction":
        return "triton was imported before its interpreter could be enabled (tests/test_triton.py runs it apart)"
    return None


def _skip_reason(b: Backend) -> str | None:
    if b is Backend.TRITON:
        return _triton_skip()
    if b is Backend.C and not quant.runs_vector():
        return "the dispatch takes the C entries where the library runs its AVX-512 paths (quant.runs_vector)"
    return None


def _x(fmt_block: int, dtype=torch.bfloat16, rows: int = 6) -> torch.Tensor:
    """Rows with zeros, negative zeros and magnitudes from 1e-6 to 1e6 (subnormal E4M3 scales)."""
    x = make_data("heavy_tailed", torch.float32, rows=rows, cols=3 * fmt_block)
    x = x * torch.logspace(-6, 6, rows).unsqueeze(1)
    x[1] = 0.0
    x[2, :fmt_block] = -0.0
    return x.to(dtype)


def _chose(op: Op, b: Backend, x: torch.Tensor, *args) -> None:
    assert dispatch.implementation(op, x, *args) is TABLES[op][b]


def _check_nvfp4(q, codes, s8, amax) -> None:
    assert torch.equal(formats.unpack_fp4(q.codes), codes)
    assert torch.equal(q.scales.view(torch.uint8), s8.view(torch.uint8))
    assert torch.equal(bits(q.global_amax), bits(torch.as_tensor(amax, dtype=torch.float32)))


def case_quantize_nvfp4(b: Backend) -> None:
    for x in (_x(16), _x(16, torch.float32)):
        for kw in (dict(per_row=True), dict(global_amax=torch.full((6, 1), 3.0)), {}):
            amax = kw.get("global_amax")
            _chose(Op.QUANTIZE_NVFP4, b, x, amax, kw.get("per_row", False), True)
            q, values = formats.quantize_dequantize_nvfp4(x, **kw)
            codes, s8, want_amax = ref.quantize_nvfp4(x, global_amax=amax, per_row=kw.get("per_row", False))
            _check_nvfp4(q, codes, s8, want_amax)
            want = ref.dequantize_nvfp4(codes, s8.to(torch.float32), want_amax).to(x.dtype)
            assert torch.equal(bits(values), bits(want))


def case_quantize_nvfp4_4over6(b: Backend) -> None:
    x = _x(16, torch.float32)
    for kw in (dict(per_row=True), {}):
        _chose(Op.QUANTIZE_NVFP4_4OVER6, b, x, None, kw.get("per_row", False))
        _check_nvfp4(formats.quantize_nvfp4_4over6(x, **kw), *ref.quantize_nvfp4_4over6(x, **kw))


def case_quantize_mxfp4(b: Backend) -> None:
    for x in (_x(32), _x(32, torch.float32)):
        for mode in ("floor", "rceil"):
            _chose(Op.QUANTIZE_MXFP4, b, x, mode == "rceil")
            q = formats.quantize_mxfp4(x, scale_mode=mode)
            codes, biased = ref.quantize_mxfp4(x, scale_mode=mode)
            assert torch.equal(formats.unpack_fp4(q.codes), codes) and torch.equal(q.scales, biased)


def _quantized():
    """An NVFP4 and an MXFP4 container of the same rows, made by the numba backend."""
    with formats.use_backend(Backend.NUMBA):
        return formats.quantize_nvfp4(_x(16), per_row=True), formats.quantize_mxfp4(_x(32))


def case_dequantize(b: Backend) -> None:
    nv, mx = _quantized()
    _chose(Op.DEQUANTIZE, b, nv.codes)
    s8 = nv.scales.to(torch.float32)
    want_nv = ref.dequantize_nvfp4(formats.unpack_fp4(nv.codes), s8, nv.global_amax)
    want_mx = ref.dequantize_mxfp4(formats.unpack_fp4(mx.codes), mx.scales)
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: the float32 values rounded by torch's cast
        assert torch.equal(bits(formats.dequantize(nv, dtype)), bits(want_nv.to(dtype)))
        assert torch.equal(bits(formats.dequantize(mx, dtype)), bits(want_mx.to(dtype)))


def _low_bits(q) -> torch.Tensor:
    """The readable low-bit hint: bit i of byte j is the low magnitude bit of element 8j + i."""
    low = (formats.unpack_fp4(q.codes) & 1).reshape(*q.codes.shape[:-1], -1, 8).long()
    return (low << torch.arange(8)).sum(dim=-1).to(torch.uint8)


def case_lsb_bits(b: Backend) -> None:
    for q in _quantized():
        _chose(Op.LSB_BITS, b, q.codes)
        assert torch.equal(formats.lsb_bits(q.codes), _low_bits(q))


def case_guided(b: Backend) -> None:
    nv, mx = _quantized()
    g = torch.Generator().manual_seed(5)
    for q, fmt in ((nv, "nvfp4"), (mx, "mxfp4")):
        x = (formats.dequantize(q) * (1 + 0.3 * torch.randn(q.shape, generator=g))).to(torch.bfloat16)
        amax = q.global_amax if fmt == "nvfp4" else None
        rollout = formats.unpack_fp4(q.codes)
        _chose(Op.GUIDED, b, x)
        for hint in ("codes", "lsb"):
            given = {"codes": q.codes} if hint == "codes" else {"lsb": _low_bits(q)}
            got = formats.guided_codes(x, fmt, q.scales, amax, **given)
            want_hint = dict(rollout_codes=rollout) if hint == "codes" else dict(rollout_lsb=rollout & 1)
            if fmt == "nvfp4":
                want = ref.guided_quantize_nvfp4(x, q.scales, amax, **want_hint)
            else:
                want = ref.guided_quantize_mxfp4(x, q.scales, **want_hint)
            assert torch.equal(formats.unpack_fp4(got.codes), want), (fmt, hint)


def case_quantize_fp8(b: Backend) -> None:
    for x in (_x(16), _x(16, torch.float32)):
        _chose(Op.QUANTIZE_FP8, b, x)
        q = formats.quantize_fp8(x)
        codes, scale = ref.quantize_fp8(x)
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(bits(q.scale), bits(scale))


def case_dequantize_fp8(b: Backend) -> None:
    q = formats.quantize_fp8(_x(16))
    _chose(Op.DEQUANTIZE_FP8, b, q.data.view(torch.uint8))
    want = ref.dequantize_fp8(q.data.view(torch.uint8), q.scale)
    assert torch.equal(bits(formats.dequantize(q)), bits(want))


CASES = {
    Op.QUANTIZE_NVFP4: case_quantize_nvfp4,
    Op.QUANTIZE_NVFP4_4OVER6: case_quantize_nvfp4_4over6,
    Op.QUANTIZE_MXFP4: case_quantize_mxfp4,
    Op.DEQUANTIZE: case_dequantize,
    Op.GUIDED: case_guided,
    Op.LSB_BITS: case_lsb_bits,
    Op.QUANTIZE_FP8: case_quantize_fp8,
    Op.DEQUANTIZE_FP8: case_dequantize_fp8,
}
ENTRIES = [(op, b) for op, table in TABLES.items() for b in table]


def test_every_op_has_a_case():
    assert set(CASES) == set(Op)


# the C entries need the library: without it they skip, or fail under CI (tests/conftest.py's needs_clib)
@pytest.mark.parametrize(("op", "backend"),
                         [pytest.param(op, b, marks=[pytest.mark.needs_clib] if b is Backend.C else []) for op, b in ENTRIES],
                         ids=[f"{op.value}-{b.value}" for op, b in ENTRIES])
def test_backend_equals_the_reference(op: Op, backend: Backend):
    reason = _skip_reason(backend)
    if reason:
        pytest.skip(reason)
    with formats.use_backend(backend):
        CASES[op](backend)


# --- the C entry points, every implementation this CPU runs -------------------------------------
# The C-only ops have one backend and several code paths (:class:`tracefp4.formats.clib.Impl`); each
# path is held to the reference at atol=0 where the op's contract is exact: the site quantize always,
# the GEMM on dyadic operands (every product and partial sum exact in float32; on other operands
# its contract is a bound, tests/test_fp4_gemm.py), the combine and SiLU gate against torch's own
# expression (their contract: torch's bits).


def _impls(*extra: clib.Impl) -> list[clib.Impl]:
    # portable C is every build's: its cases exist without the library too, for needs_clib to skip or fail
    if not clib.available():
        return [clib.Impl.PORTABLE]
    return [clib.Impl.PORTABLE, *([clib.Impl.AVX512] if clib.has_avx512_bf16() else []),
            *[i for i in extra if i is clib.Impl.AMX and clib.has_amx()]]


def c_nvfp4_rows(impl: clib.Impl) -> None:
    x = _x(16)
    codes, scales, amax, values, _ = clib.nvfp4_rows(x, None, values=True, impl=impl)
    want_codes, s8, want_amax = ref.quantize_nvfp4(x, per_row=True)
    assert torch.equal(formats.unpack_fp4(codes), want_codes) and torch.equal(scales, s8.view(torch.uint8))
    assert torch.equal(bits(amax), bits(want_amax.reshape(-1)))
    want = ref.dequantize_nvfp4(want_codes, s8.to(torch.float32), want_amax).to(torch.bfloat16)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))


def c_grouped_gemm(impl: clib.Impl) -> None:
    g = torch.Generator().manual_seed(2)
    e, n, k = 3, 32, 64
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g).to(torch.uint8)
    scales = torch.tensor([0x30, 0x38, 0x40], dtype=torch.uint8)[torch.randint(0, 3, (e, n, k // 16), generator=g)]
    divisor = torch.tensor([1.0, 2.0, 0.5])  # E4M3 bytes of 0.5, 1, 2 and powers of two: exact
    offsets = torch.tensor([0, 3, 3, 7])
    x = (torch.randint(-8, 9, (7, k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    want = refc.grouped_gemm_reference(x, offsets, codes, scales, divisor, "nvfp4")
    layouts = [clib.Layout.PANELS] if impl is clib.Impl.AMX else list(clib.Layout)
    for layout in layouts:
        kc, ks = clib.kernel_layout(codes, 16, layout), clib.kernel_scales(scales, layout)
        got = clib.grouped_gemm(x, offsets, kc, ks, divisor, "nvfp4", layout=layout, impl=impl)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), layout
        ids = torch.tensor([0, 0, 0, 2, 2, 2, 2])  # the same rows routed: the same numbers in pair order
        routed = clib.routed_gemm(x, ids, kc, ks, divisor, "nvfp4", per_token=False, layout=layout, impl=impl)
        assert torch.equal(routed.view(torch.int16), want.view(torch.int16)), layout


def c_topk_combine(impl: clib.Impl) -> None:
    g = torch.Generator().manual_seed(4)
    out = torch.randn(9, 4, 48, generator=g).to(torch.bfloat16)
    w = torch.rand(9, 4, generator=g)
    want = (out.to(torch.float32) * w.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    assert torch.equal(clib.topk_combine(out, w, impl=impl).view(torch.int16), want.view(torch.int16))


def c_silu_gate(impl: clib.Impl) -> None:
    x = (torch.randn(7, 96, generator=torch.Generator().manual_seed(6)) * 4).to(torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(clib.silu_gate(x, impl=impl).view(torch.int16), want.view(torch.int16))


def c_nvfp4_rows_float32(impl: clib.Impl) -> None:
    x = _x(16, torch.float32)
    amax = torch.empty(x.shape[0])
    codes, scales = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8), torch.empty(6, 3, dtype=torch.uint8)
    assert not clib.quantize_into(x, amax, codes, scales, None, own_amax=True, impl=impl)
    want_codes, s8, want_amax = ref.quantize_nvfp4(x, per_row=True)
    assert torch.equal(formats.unpack_fp4(codes), want_codes) and torch.equal(scales, s8.view(torch.uint8))
    assert torch.equal(bits(amax), bits(want_amax.reshape(-1)))


def c_tensor_amax(impl: clib.Impl) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(16, dtype, rows=37)
        want = x.abs().amax().to(torch.float32)
        assert torch.equal(bits(quant.tensor_amax(x, impl=impl)), bits(want))


def c_dequantize_rows(impl: clib.Impl) -> None:
    for q in _quantized():
        div = torch.logspace(-3, 3, q.codes.shape[0]).to(torch.float32)  # row divisors other than S_enc
        nv = q.fmt.value == "nvfp4"
        scale = q.scales.to(torch.float32) if nv else ref.mx_scale(q.scales)
        want = ref.e2m1_value(formats.unpack_fp4(q.codes)) * scale.repeat_interleave(q.fmt.block, dim=-1)
        for dtype in (torch.float32, torch.bfloat16):
            got = quant.dequantize_rows(q.codes, q.scales.view(torch.uint8), q.fmt, div, dtype=dtype, impl=impl)
            assert torch.equal(bits(got), bits((want / div.unsqueeze(1)).to(dtype))), (q.fmt, dtype)


def c_guided_rows(impl: clib.Impl) -> None:
    for q in _quantized():
        x = (formats.dequantize(q) * 1.3).to(torch.bfloat16)
        x[0, :5] = -x[0, :5]  # signs against the rollout's
        rollout = formats.unpack_fp4(q.codes)
        nv = q.fmt.value == "nvfp4"
        s_dec = (1.0 / nvfp4_global_encode_scale(q.global_amax)).reshape(-1) if nv else torch.ones(q.shape[0])
        for hint, want_hint in ((q.codes, dict(rollout_codes=rollout)), (_low_bits(q), dict(rollout_lsb=rollout & 1))):
            want = (ref.guided_quantize_nvfp4(x, q.scales, q.global_amax, **want_hint) if nv
                    else ref.guided_quantize_mxfp4(x, q.scales, **want_hint))
            got, bad = quant.guided_rows(x, q.scales.view(torch.uint8), q.fmt, s_dec, hint, hint is q.codes, impl=impl)
            assert torch.equal(formats.unpack_fp4(got), want) and not bad.any(), q.fmt


def c_mxfp4_rows(impl: clib.Impl) -> None:
    for x in (_x(32), _x(32, torch.float32)):
        for mode in ("floor", "rceil"):
            codes, biased, bad = quant.mxfp4_rows(x, mode == "rceil", impl=impl)
            want_codes, want_biased = ref.quantize_mxfp4(x, scale_mode=mode)
            assert torch.equal(formats.unpack_fp4(codes), want_codes) and torch.equal(biased, want_biased)
            assert not bad.any()


def c_fp8_rows(impl: clib.Impl) -> None:
    for x in (_x(16), _x(16, torch.float32)):
        codes, scale, bad = quant.fp8_rows(x, impl=impl)
        want_codes, want_scale = ref.quantize_fp8(x)
        assert torch.equal(codes, want_codes.view(torch.uint8)) and torch.equal(bits(scale), bits(want_scale.reshape(-1)))
        assert torch.equal(bits(quant.fp8_dequantize_rows(codes, scale, impl=impl)),
                           bits(ref.dequantize_fp8(want_codes, want_scale)))
        assert not bad.any()


def c_lsb_rows(impl: clib.Impl) -> None:
    for q in _quantized():
        assert torch.equal(quant.lsb_rows(q.codes, impl=impl), _low_bits(q))


C_CASES = [(c_nvfp4_rows, i) for i in _impls()] + [(c_grouped_gemm, i) for i in _impls(clib.Impl.AMX)]
C_CASES += [(c_topk_combine, i) for i in _impls()] + [(c_silu_gate, i) for i in _impls()]
C_CASES += [(c, i) for c in (c_nvfp4_rows_float32, c_mxfp4_rows, c_fp8_rows, c_tensor_amax, c_dequantize_rows, c_guided_rows, c_lsb_rows) for i in _impls()]


@pytest.mark.needs_clib
@pytest.mark.parametrize(("case", "impl"), C_CASES, ids=[f"{c.__name__[2:]}-{i.name.lower()}" for c, i in C_CASES])
def test_c_entry_point_equals_the_reference(case, impl):
    case(impl)
