"""The Triton kernels against the readable reference at atol=0, and the bit-level helpers they share
with the CPU kernels checked exhaustively.

The kernels are reached through the public ops (``tf.quantize_nvfp4`` ...), the path a CUDA tensor
takes: on a GPU with CUDA tensors, without one with CPU tensors routed to the Triton kernels by
:func:`tracefp4.formats.dispatch.use_backend` (the one dispatch point).

Without a CUDA device the Triton kernels run under Triton's CPU interpreter. The interpreter must be
switched on (``TRITON_INTERPRET=1``) before triton is first imported, since triton's own library
functions are built at import; when another test module got there first (torchao imports triton),
the Triton tests here are skipped in this process and run again, whole, in a fresh one by
:func:`test_triton_kernels_in_a_fresh_interpreter_process`. ``scripts/gpu_check.py`` repeats the
comparison on a GPU at realistic sizes and measures bandwidth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

import contextlib

import fp4data
from fresh_interpreter import run_in_fresh_interpreter
import tracefp4 as tf
import tracefp4.formats as formats
from tracefp4.formats import kernels
from tracefp4.formats import reference as ref

_CHILD_FLAG = "TRACEFP4_TRITON_FRESH_PROCESS"
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import, see the module docstring

try:
    import triton
    import triton.language as tl
except ImportError as e:  # triton is a test extra; without it only the CPU helper checks run
    triton = None
    _SKIP_REASON = f"triton is not installed ({e}); pip install -e '.[test]' brings it"
    _FRESH_PROCESS = False
else:
    _interpreter_ready = type(tl.standard.sum).__name__ == "InterpretedFunction"
    _FRESH_PROCESS = not torch.cuda.is_available() and not _interpreter_ready
    _SKIP_REASON = (
        "triton was imported before its interpreter could be enabled; these tests run in a fresh "
        "process instead (test_triton_kernels_in_a_fresh_interpreter_process)"
        if _FRESH_PROCESS
        else ""
    )

tk = None
if triton is not None and not _FRESH_PROCESS:
    from tracefp4.formats import triton_device as td
    from tracefp4.formats import triton_kernels as tk

needs_triton = pytest.mark.skipif(tk is None, reason=_SKIP_REASON or "triton kernels unavailable")
# The interpreter evaluates with numpy, which warns about the x/0 that the recipes cap at FLT_MAX.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# Tests that never touch Triton (the numba helpers' sweeps and the CPU dispatch, the last in a child
# process without TRITON_INTERPRET): this process runs them, and the fresh one would only repeat them
# (the e4m3 sweep alone is a quarter of its time), so it leaves them out, by name: the child's count of
# deselected tests (these and the fresh-process test itself) says every name still names a test.
_NO_TRITON = ("test_cpu_e4m3_rounding_matches_torch_cast", "test_cpu_e2m1_bit_tricks_match_comparisons",
              "test_cpu_e2m1_values_match_the_table", "test_cpu_tensors_go_to_numba_and_never_import_triton")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.triton
@pytest.mark.skipif(not _FRESH_PROCESS, reason="the Triton tests run in this process")
def test_triton_kernels_in_a_fresh_interpreter_process():
    proc = run_in_fresh_interpreter(__file__, _CHILD_FLAG, timeout=1800, ran_here=_NO_TRITON)
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]
    assert f" {len(_NO_TRITON) + 1} deselected" in summary, summary


S_ENC_ONE = fp4data.S_ENC_ONE
DEVICE = "cuda" if tk is not None and not tk.interpreting() else "cpu"


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def triton_path():
    """The public ops on the Triton kernels: CUDA tensors go there anyway; CPU tensors (under the
    interpreter) are routed there inside this context."""
    return formats.use_backend("triton") if DEVICE == "cpu" else contextlib.nullcontext()


def make_data(kind: str, dtype: torch.dtype, rows: int = 12, cols: int = 96, seed: int = 0) -> torch.Tensor:
    return fp4data.make_data(kind, dtype, rows, cols, seed)


KINDS = ["randn", "heavy_tailed", "zero_blocks", "subnormal_scales", "tiny"]
DTYPES = fp4data.DTYPES


# --- bit-level helpers (CPU kernels; the Triton helpers use the same formulas) ---------------------


@numba.njit(parallel=True)
def _cpu_e4m3(x, codes, values):
    for i in numba.prange(x.shape[0]):
        c, v = kernels._e4m3_round(x[i])
        codes[i] = np.uint8(c)
        values[i] = v


def _e4m3_probe(step: int = 1) -> np.ndarray:
    """Every 5th float32 in [0, 448], and every float32 within 64 ulps of each E4M3 value and midpoint;
    ``step``: every step-th of those, the same values as ``_e4m3_probe()[::step]`` without building
    the 228M of the whole probe first (seconds of allocation)."""
    top = int(np.float32(448.0).view(np.uint32))
    strided = np.arange(0, top + 1, 5 * step, dtype=np.uint32)
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    anchors = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2]).astype(np.float32).view(np.uint32).astype(np.int64)
    near = (anchors[:, None] + np.arange(-64, 65)[None, :]).ravel()
    near = near[(near >= 0) & (near <= top)].astype(np.uint32)
    # [::step] of the whole probe continues into `near` where the strided part's count leaves off
    near = near[-(top // 5 + 1) % step::step]
    return np.concatenate([strided, near]).view(np.float32)


def test_cpu_e4m3_rounding_matches_torch_cast():
    # the full sweep (all 1.14e9 float32 in [0, 448]) was run once offline; this is a dense sample
    x = _e4m3_probe()
    codes = np.empty(x.shape[0], np.uint8)
    values = np.empty(x.shape[0], np.float32)
    _cpu_e4m3(x, codes, values)
    cast = torch.from_numpy(x).to(torch.float8_e4m3fn)
    assert np.array_equal(codes, cast.view(torch.uint8).numpy())
    assert np.array_equal(values.view(np.uint32), cast.float().numpy().view(np.uint32))


@numba.njit(parallel=True)
def _cpu_e2m1_mismatches(start, stop, step):
    bad = 0
    for i in numba.prange((stop - start + step - 1) // step):
        m = kernels.f32_from_bits(np.uint32(start + i * step))
        if kernels._rtn_mag_bits(m) != kernels._rtn_mag(m):
            bad += 1
        mc = min(m, kernels._SIX)
        lo, inexact = kernels._floor_mag_bits(mc)
        if lo != kernels._floor_mag(mc) or lo + inexact != kernels._ceil_mag(mc):
            bad += 1
    return bad


def test_cpu_e2m1_bit_tricks_match_comparisons():
    # every non-negative float32 up to 6.5 with a stride, then every one around the codewords and
    # midpoints; the two formulations agree on all 2^31 non-negative patterns (checked offline)
    six_half = int(np.float32(6.5).view(np.uint32))
    assert _cpu_e2m1_mismatches(0, six_half, 3) == 0
    for v in [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]:
        b = int(np.float32(v).view(np.uint32))
        assert _cpu_e2m1_mismatches(b - 4096, b + 4096, 1) == 0, v
    inf = int(np.float32(np.inf).view(np.uint32))
    assert _cpu_e2m1_mismatches(six_half, inf + 1, 997) == 0  # saturation, up to +inf


def test_cpu_e2m1_values_match_the_table():
    @numba.njit
    def values():
        out = np.empty(16, np.uint32)
        for c in range(16):
            out[c] = kernels.bits_from_f32(kernels._e2m1_value(np.uint32(c)))
        return out

    assert np.array_equal(values(), ref.e2m1_table().view(torch.int32).numpy().view(np.uint32))


# --- Triton device helpers -------------------------------------------------------------------------

if tk is not None:  # defined only where the kernels can run (see the module docstring)

    @triton.jit
    def _helpers_kernel(x_ptr, e4m3_code_ptr, e4m3_value_ptr, mags_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        code, value = td.e4m3_round(tl.minimum(x, 448.0))
        tl.store(e4m3_code_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(e4m3_value_ptr + offs, value, mask=mask)
        m = tl.minimum(x, 6.0)
        packed = td.rtn_mag(x) | (td.floor_mag(m) << 4) | (td.ceil_mag(m) << 8)
        tl.store(mags_ptr + offs, packed.to(tl.int32), mask=mask)


@needs_triton
def test_triton_helpers_match_cpu_helpers():
    x = np.concatenate([_e4m3_probe(step=50), np.linspace(0, 8, 20001, dtype=np.float32), np.float32([np.inf])])
    n = x.shape[0]
    xt = on_device(torch.from_numpy(x))
    code = on_device(torch.empty(n, dtype=torch.uint8))
    value = on_device(torch.empty(n, dtype=torch.float32))
    mags = on_device(torch.empty(n, dtype=torch.int32))
    block = 1 << 16
    _helpers_kernel[(triton.cdiv(n, block),)](xt, code, value, mags, n, BLOCK=block)
    cast = torch.from_numpy(np.minimum(x, np.float32(448))).to(torch.float8_e4m3fn)
    assert torch.equal(code.cpu(), cast.view(torch.uint8))
    assert torch.equal(value.cpu().view(torch.int32), cast.float().view(torch.int32))
    m = torch.from_numpy(np.minimum(x, np.float32(6)))
    expect = ref.round_to_e2m1(m).to(torch.int32)
    lo, hi = ref.bracket(m)
    expect = expect | (lo.to(torch.int32) << 4) | (hi.to(torch.int32) << 8)
    assert torch.equal(mags.cpu(), expect)


# --- Triton kernels == reference, through the public ops ------------------------------------------


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_triton_nvfp4_equals_reference(kind, dtype, per_row):
    x = make_data(kind, dtype)
    with triton_path():
        q = tf.quantize_nvfp4(on_device(x), per_row=per_row)
        deq = tf.dequantize_nvfp4(q)
    assert q.codes.device.type == DEVICE and deq.device.type == DEVICE
    codes, s8, amax = ref.quantize_nvfp4(x, per_row=per_row)
    assert torch.equal(tf.unpack_fp4(q.codes.cpu()), codes)
    assert torch.equal(q.scales.cpu().view(torch.uint8), s8.view(torch.uint8))
    assert torch.equal(q.global_amax.cpu().view(torch.int32), amax.view(torch.int32))
    assert torch.equal(deq.cpu().view(torch.int32), ref.dequantize_nvfp4(codes, s8, amax).view(torch.int32))
    if kind == "subnormal_scales":
        assert bool((q.scales.view(torch.uint8) < 8).any()), "test data must reach subnormal scales"


@needs_triton
@pytest.mark.parametrize("kind", KINDS + ["saturating"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_triton_mxfp4_equals_reference(kind, dtype, scale_mode):
    x = fp4data.make_data(kind, dtype, 12, 128)
    with triton_path():
        q = tf.quantize_mxfp4(on_device(x), scale_mode=scale_mode)
        deq = tf.dequantize_mxfp4(q)
    assert q.codes.device.type == DEVICE and deq.device.type == DEVICE
    codes, scales = ref.quantize_mxfp4(x, scale_mode)
    assert torch.equal(tf.unpack_fp4(q.codes.cpu()), codes)
    assert torch.equal(q.scales.cpu(), scales)
    assert torch.equal(deq.cpu().view(torch.int32), ref.dequantize_mxfp4(codes, scales).view(torch.int32))


def _mx_probe_amaxes() -> torch.Tensor:
    """Block amaxes at every E8M0 decision point: powers of two and 6 * powers of two across the whole
    float32 range (subnormals included), and the float32s either side of each."""
    exps = torch.arange(-149, 128, dtype=torch.float64)
    anchors = torch.cat([2.0**exps, 6.0 * 2.0**exps]).to(torch.float32)
    anchors = anchors[torch.isfinite(anchors) & (anchors > 0)]
    up = torch.nextafter(anchors, torch.full_like(anchors, float("inf")))
    down = torch.nextafter(anchors, torch.zeros_like(anchors))
    probe = torch.cat([anchors, up, down, torch.tensor([0.0, float(np.finfo(np.float32).max)])])
    return probe[torch.isfinite(probe)]


@needs_triton
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_triton_mxfp4_exponents_at_every_decision_point(scale_mode):
    # the Triton kernel reads block exponents off float32 bits, the CPU kernel uses frexp: every block
    # holds one probe amax (with a few smaller elements), so each row checks 4 decision points
    amax = _mx_probe_amaxes()
    pad = (-amax.numel()) % 4
    amax = torch.cat([amax, torch.zeros(pad)]).reshape(-1, 4)
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(amax.shape[0], 4, 32, generator=g) * 2 - 1) * amax[..., None]
    x[..., 7] = amax
    x = x.reshape(amax.shape[0], 128)
    cpu = tf.quantize_mxfp4(x, scale_mode=scale_mode)
    with triton_path():
        fast = tf.quantize_mxfp4(on_device(x), scale_mode=scale_mode)
    assert torch.equal(fast.scales.cpu(), cpu.scales)
    assert torch.equal(fast.codes.cpu(), cpu.codes)


@needs_triton
def test_triton_nvfp4_given_amax_saturates_and_leading_dims():
    x = make_data("randn", torch.bfloat16, rows=6, cols=64) * 50
    with triton_path():
        q = tf.quantize_nvfp4(on_device(x), global_amax=torch.tensor(2.0))
    codes, s8, _ = ref.quantize_nvfp4(x, global_amax=torch.tensor(2.0))
    assert torch.equal(tf.unpack_fp4(q.codes.cpu()), codes)
    assert bool((q.scales.cpu().view(torch.uint8) == 0x7E).any()), "the data must saturate the scale"
    x3 = make_data("heavy_tailed", torch.float32, rows=6, cols=48).reshape(2, 3, 48)
    with triton_path():
        q3 = tf.quantize_nvfp4(on_device(x3), per_row=True)
    cpu = tf.quantize_nvfp4(x3, per_row=True)
    assert q3.codes.shape == cpu.codes.shape and q3.global_amax.shape == cpu.global_amax.shape
    assert torch.equal(q3.codes.cpu(), cpu.codes)
    assert torch.equal(q3.scales.cpu().view(torch.uint8), cpu.scales.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["lsb", "full"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_guided_equals_reference(fmt, mode, dtype):
    g = torch.Generator().manual_seed(3)
    cols = 160 if fmt == "nvfp4" else 128  # 160: a K % 32 == 16 row, as the CPU kernels special-case
    x_roll = (torch.randn(8, cols, generator=g) * torch.rand(8, 1, generator=g) * 10).to(dtype)
    x_train = (x_roll.float() * (1 + 0.05 * torch.randn(8, cols, generator=g))).to(dtype)
    q = tf.quantize_nvfp4(x_roll, per_row=True) if fmt == "nvfp4" else tf.quantize_mxfp4(x_roll)
    hint = tf.encode_hint(q, mode)  # CPU tensors: the hint may live elsewhere than x
    with triton_path():
        fast = tf.guided_quantize(on_device(x_train), hint)
    assert fast.codes.device.type == DEVICE and fast.scales.device.type == DEVICE
    rc = tf.unpack_fp4(q.codes)
    kw = {"rollout_codes": rc} if mode == "full" else {"rollout_lsb": rc & 1}
    if fmt == "nvfp4":
        expect = ref.guided_quantize_nvfp4(x_train, q.scales, q.global_amax, **kw)
    else:
        expect = ref.guided_quantize_mxfp4(x_train, q.scales, **kw)
    assert torch.equal(tf.unpack_fp4(fast.codes.cpu()), expect)
    assert torch.equal(fast.codes.cpu(), tf.guided_quantize(x_train, hint).codes)


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_triton_lsb_hint_packing(fmt):
    x = make_data("heavy_tailed", torch.bfloat16, rows=5, cols=96 if fmt == "nvfp4" else 128)
    q = tf.quantize_nvfp4(x) if fmt == "nvfp4" else tf.quantize_mxfp4(x)
    if fmt == "nvfp4":
        dq = tf.NVFP4(on_device(q.codes), on_device(q.scales), on_device(q.global_amax))
    else:
        dq = tf.MXFP4(on_device(q.codes), on_device(q.scales))
    for mode in ("lsb", "full"):
        with triton_path():
            fast = tf.encode_hint(dq, mode)
        cpu = tf.encode_hint(q, mode)
        assert torch.equal(fast.data.cpu(), cpu.data)
        assert fast.mode is cpu.mode and fast.fmt is cpu.fmt
    with triton_path():
        bits = formats.lsb_bits(on_device(q.codes))
    assert torch.equal(bits.cpu(), tf.encode_hint(q, "lsb").data)


@needs_triton
def test_triton_refuses_non_finite_and_bad_input():
    x = torch.ones(3, 32)
    x[2, 17] = float("nan")
    q = tf.quantize_nvfp4(torch.ones(3, 32), per_row=True)
    with triton_path():
        with pytest.raises(ValueError, match=r"non-finite input at index \(2, 17\)"):
            tf.quantize_nvfp4(on_device(x))
        with pytest.raises(ValueError, match=r"non-finite input at index \(2, 17\)"):
            tf.quantize_nvfp4(on_device(x), global_amax=torch.tensor(1.0))
        with pytest.raises(ValueError, match=r"non-finite input at index \(2, 17\)"):
            tf.quantize_mxfp4(on_device(x))
        with pytest.raises(ValueError, match=r"non-finite input at index \(2, 17\)"):
            tf.guided_quantize(on_device(x), tf.encode_hint(q, "lsb"))
        with pytest.raises(ValueError, match="not a multiple of the block size 16"):
            tf.quantize_nvfp4(on_device(torch.ones(2, 24)))
        with pytest.raises(ValueError, match="hint shape mismatch"):
            tf.guided_quantize(on_device(torch.ones(3, 64)), tf.encode_hint(q, "lsb"))
        bad = tf.NVFP4(on_device(q.codes), on_device(q.scales[:, :1]), on_device(q.global_amax))
        with pytest.raises(ValueError, match="scales"):
            tf.dequantize(bad)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 32)])
def test_empty_batches(shape):
    # an expert that no token was routed to still gets quantized: zero rows in, zero rows out (a
    # per-tensor amax of nothing is 0, so S_enc is 1), on the CPU and on the Triton path alike
    x = torch.zeros(*shape, dtype=torch.bfloat16)
    paths = [(contextlib.nullcontext, "cpu")] + ([(triton_path, DEVICE)] if tk is not None else [])
    for path, device in paths:
        with path():
            xd = x.to(device)
            for per_row in (False, True):
                q = tf.quantize_nvfp4(xd, per_row=per_row)
                assert q.codes.shape == (*shape[:-1], shape[-1] // 2) and q.shape == x.shape
                assert q.global_amax.shape == ((*shape[:-1], 1) if per_row else ())
                assert tf.dequantize_nvfp4(q).shape == x.shape
                for mode in ("lsb", "full"):
                    assert tf.guided_quantize(xd, tf.encode_hint(q, mode)).codes.shape == q.codes.shape
            m = tf.quantize_mxfp4(xd)
            assert m.scales.shape == (*shape[:-1], shape[-1] // 32) and tf.dequantize_mxfp4(m).shape == x.shape


def test_cpu_tensors_go_to_numba_and_never_import_triton():
    # the dispatch point sends CPU tensors to the numba kernels: triton stays unimported
    code = (
        "import sys, torch, tracefp4 as tf\n"
        "import tracefp4.formats as formats\n"
        "x = torch.randn(4, 64)\n"
        "assert formats.backend(x) == 'numba'\n"
        "q = tf.quantize_nvfp4(x, per_row=True); tf.dequantize(q)\n"
        "m = tf.quantize_mxfp4(x); tf.dequantize(m)\n"
        "tf.guided_quantize(x, tf.encode_hint(q, 'lsb')); tf.guided_quantize(x, tf.encode_hint(m, 'full'))\n"
        "tf.fake_quant(x, 'mxfp4', scale_mode='rceil')\n"
        "assert 'triton' not in sys.modules, 'triton was imported for CPU tensors'\n"
        "assert 'tracefp4.formats.triton_kernels' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_backend_choice_and_override():
    x = torch.zeros(2, 32)
    assert formats.backend(x) == "numba"
    with formats.use_backend("triton"):
        assert formats.backend(x) == "triton"
    assert formats.backend(x) == "numba"
    with pytest.raises(ValueError, match="backend"):
        with formats.use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match="meta"):
        tf.quantize_nvfp4(torch.zeros(2, 32, device="meta"))


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_triton_rows_spanning_several_programs(fmt):
    # 2080 elements: three programs per row, the last one partly masked
    x = make_data("heavy_tailed", torch.bfloat16, rows=3, cols=2080)
    y = (x.float() * 1.01).to(torch.bfloat16)
    quantize = (lambda t: tf.quantize_nvfp4(t, per_row=True)) if fmt == "nvfp4" else tf.quantize_mxfp4
    cpu = quantize(x)
    with triton_path():
        fast = quantize(on_device(x))
        deq = tf.dequantize(fast)
        guided = tf.guided_quantize(on_device(y), tf.encode_hint(cpu, "lsb"))
        hint = tf.encode_hint(fast, "lsb")
    assert torch.equal(fast.codes.cpu(), cpu.codes)
    assert torch.equal(fast.scales.cpu().view(torch.uint8), cpu.scales.view(torch.uint8))
    assert torch.equal(deq.cpu().view(torch.int32), tf.dequantize(cpu).view(torch.int32))
    assert torch.equal(guided.codes.cpu(), tf.guided_quantize(y, tf.encode_hint(cpu, "lsb")).codes)
    assert torch.equal(hint.data.cpu(), tf.encode_hint(cpu, "lsb").data)
