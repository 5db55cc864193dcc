"""FP4 numerics: golden per-value tests, and the fast kernels against the readable reference at atol=0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracefp4 as tf
from tracefp4.formats import reference as ref

from fp4data import DTYPES, S_ENC_ONE, bits, make_data

KINDS = ["randn", "heavy_tailed", "zero_blocks", "subnormal_scales", "saturating"]


def mx_codes(values: list[float]) -> list[int]:
    """Unpacked MXFP4 codes of values in a 32-block whose amax (6 or 7.5) gives scale 2^0."""
    x = torch.tensor(values + [6.0] * (32 - len(values)), dtype=torch.float32)
    q = tf.quantize_mxfp4(x)
    assert q.scales.tolist() == [127], "the block scale must be 2^0 for this golden test"
    return tf.unpack_fp4(q.codes)[: len(values)].tolist()


# --- golden values -------------------------------------------------------------------------------

GOLDEN_E2M1 = [
    # (value, code): every codeword, every tie (ties go to the even code), around every midpoint
    (0.0, 0x0), (0.5, 0x1), (1.0, 0x2), (1.5, 0x3), (2.0, 0x4), (3.0, 0x5), (4.0, 0x6), (6.0, 0x7),
    (0.25, 0x0), (0.75, 0x2), (1.25, 0x2), (1.75, 0x4), (2.5, 0x4), (3.5, 0x6), (5.0, 0x6),
    (0.2500001, 0x1), (0.7499999, 0x1), (1.2500001, 0x3), (1.7499999, 0x3),
    (2.5000002, 0x5), (3.4999998, 0x5), (5.0000005, 0x7),
    (-0.5, 0x9), (-1.0, 0xA), (-1.5, 0xB), (-2.0, 0xC), (-3.0, 0xD), (-4.0, 0xE), (-6.0, 0xF),
    (-0.75, 0xA), (-5.0, 0xE), (-2.5, 0xC),
    (-0.0, 0x8), (-0.1, 0x8), (-0.25, 0x8), (1e-30, 0x0),
    (7.5, 0x7), (-7.5, 0xF),  # saturation at +-6
]


@pytest.mark.parametrize("value,code", GOLDEN_E2M1)
def test_golden_e2m1_codes(value, code):
    assert mx_codes([value]) == [code]
    # the reference's codeword search agrees
    assert ref.round_to_e2m1(torch.tensor([max(-6.0, min(6.0, value))])).tolist() == [code]


def test_golden_packed_byte_layout():
    # element 2i in the low nibble, 2i+1 in the high nibble
    codes = torch.tensor([0b0001, 0b0010, 0b1111, 0b1000], dtype=torch.uint8)
    assert tf.pack_fp4(codes).tolist() == [0b0010_0001, 0b1000_1111]
    assert torch.equal(tf.unpack_fp4(tf.pack_fp4(codes)), codes)
    x = torch.tensor([6.0, 0.5, -1.0, -0.0] + [0.0] * 12)
    q = tf.quantize_nvfp4(x, global_amax=S_ENC_ONE)
    assert q.scales.view(torch.uint8).tolist() == [0b0_0111_000]  # E4M3 1.0: block amax 6 -> scale 1
    assert q.codes[:2].tolist() == [0b0001_0111, 0b1000_1010]


def test_golden_nvfp4_block_scales():
    # S_enc = 1: scale = e4m3(amax / 6)
    cases = {
        6.0: 0x38,  # 1.0
        448.0 * 6: 0x7E,  # 448, the largest finite E4M3
        1e6: 0x7E,  # saturates (clamped before the cast, never NaN)
        6 * 3 * 2.0**-9: 0x03,  # E4M3 subnormal 3 * 2^-9
        6 * 2.0**-9: 0x01,  # smallest subnormal
        6 * 2.0**-11: 0x00,  # rounds to a zero scale
        6 * 1.0625: 0x38,  # a tie between 1.0 and 1.125 rounds to even (1.0)
        6 * 1.1875: 0x3A,  # a tie between 1.125 and 1.25 rounds to even (1.25)
    }
    for amax, expect in cases.items():
        x = torch.zeros(16)
        x[3] = amax
        q = tf.quantize_nvfp4(x, global_amax=S_ENC_ONE)
        assert q.scales.view(torch.uint8).item() == expect, amax
        c, s8, _ = ref.quantize_nvfp4(x, global_amax=S_ENC_ONE)
        assert s8.view(torch.uint8).item() == expect, amax


def test_golden_nvfp4_global_scale_and_dequant():
    x = torch.tensor([1.0, -2.0, 3.0, 0.25] * 4)
    q = tf.quantize_nvfp4(x)
    assert q.global_amax.item() == 3.0
    # S_enc = 896; block amax 3 -> e4m3(3 * 896 / 6) = 448; enc = 1/(448/896) = 2
    assert q.scales.to(torch.float32).item() == 448.0
    assert tf.unpack_fp4(q.codes)[:4].tolist() == [0x4, 0xE, 0x7, 0x1]  # 2, -4, 6, 0.5
    assert tf.dequantize_nvfp4(q)[:4].tolist() == [1.0, -2.0, 3.0, 0.25]


def test_zero_tensor_and_signed_zero():
    x = torch.tensor([0.0, -0.0] * 8)
    q = tf.quantize_nvfp4(x)
    assert q.global_amax.item() == 0.0
    assert q.scales.view(torch.uint8).tolist() == [0]
    assert tf.unpack_fp4(q.codes).tolist() == [0x0, 0x8] * 8
    d = tf.dequantize_nvfp4(q)
    assert torch.equal(torch.signbit(d), torch.tensor([False, True] * 8))


def test_zero_block_scale_with_nonzero_values():
    # a block so small that its E4M3 scale rounds to zero: enc is capped at FLT_MAX, codes saturate,
    # and the dequantized block is exactly zero (TE's behaviour)
    x = torch.zeros(32)
    x[0] = 2688.0
    x[16:] = 1e-7
    q = tf.quantize_nvfp4(x)
    assert q.scales.view(torch.uint8)[1].item() == 0
    assert tf.unpack_fp4(q.codes)[16:].tolist() == [0x7] * 16
    assert torch.equal(tf.dequantize_nvfp4(q)[16:], torch.zeros(16))


def test_golden_mxfp4_scales():
    def exp_of(amax, mode):
        x = torch.zeros(32)
        x[0] = amax
        return tf.quantize_mxfp4(x, scale_mode=mode).scales.item() - 127

    assert exp_of(6.0, "floor") == 0  # floor(log2 6) - 2
    assert exp_of(8.0, "floor") == 1
    assert exp_of(0.0, "floor") == -127
    assert exp_of(6.0, "rceil") == 0  # 6/6 = 1 = 2^0
    assert exp_of(6.1, "rceil") == 1
    assert exp_of(3.0, "rceil") == -1
    assert exp_of(2.0**-140, "floor") == -127  # clamped to the E8M0 range
    assert exp_of(3e38, "floor") == 125


# --- fast path == reference, bit for bit ---------------------------------------------------------




@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_nvfp4_fast_equals_reference(kind, dtype, per_row):
    x = make_data(kind, dtype)
    amax = torch.tensor(2.0) if kind == "saturating" and not per_row else None
    q = tf.quantize_nvfp4(x, global_amax=amax, per_row=per_row)
    codes, s8, ref_amax = ref.quantize_nvfp4(x, global_amax=amax, per_row=per_row)
    assert torch.equal(tf.unpack_fp4(q.codes), codes)
    assert torch.equal(bits(q.scales), bits(s8))
    assert torch.equal(bits(q.global_amax), bits(ref_amax))
    assert torch.equal(bits(tf.dequantize_nvfp4(q)), bits(ref.dequantize_nvfp4(codes, s8, ref_amax)))
    if kind == "subnormal_scales":
        assert bool((q.scales.view(torch.uint8) < 8).any()), "test data must reach subnormal scales"
    if kind == "saturating" and not per_row:
        assert bool((q.scales.view(torch.uint8) == 0x7E).any()), "test data must saturate the scale"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_mxfp4_fast_equals_reference(kind, dtype, scale_mode):
    x = make_data(kind, dtype)
    q = tf.quantize_mxfp4(x, scale_mode=scale_mode)
    codes, scales = ref.quantize_mxfp4(x, scale_mode)
    assert torch.equal(tf.unpack_fp4(q.codes), codes)
    assert torch.equal(q.scales, scales)
    assert torch.equal(bits(tf.dequantize_mxfp4(q)), bits(ref.dequantize_mxfp4(codes, scales)))


def test_e4m3_cast_exhaustive_against_torch():
    # every E4M3 value, every midpoint between neighbours, and points just either side of them
    vals = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2
    probe = torch.cat([vals, mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 1e9))])
    probe = probe[probe <= 448]
    for v in probe.tolist():
        x = torch.zeros(16)
        x[0] = v * 6  # S_enc = 1: the scale is e4m3(v * 6 * fl(1/6))
        q = tf.quantize_nvfp4(x, global_amax=S_ENC_ONE)
        _, s8, _ = ref.quantize_nvfp4(x, global_amax=S_ENC_ONE)
        assert bits(q.scales).item() == bits(s8).item(), v


def test_shapes_and_leading_dims():
    x = torch.randn(2, 3, 5, 64)
    q = tf.quantize_nvfp4(x, per_row=True)
    assert q.codes.shape == (2, 3, 5, 32) and q.scales.shape == (2, 3, 5, 4)
    assert q.global_amax.shape == (2, 3, 5, 1) and q.shape == x.shape
    assert tf.dequantize_nvfp4(q).shape == x.shape
    m = tf.quantize_mxfp4(x)
    assert m.codes.shape == (2, 3, 5, 32) and m.scales.shape == (2, 3, 5, 2)


def test_per_row_codes_independent_of_batch():
    x = torch.randn(8, 64)
    alone = tf.quantize_nvfp4(x[3:4], per_row=True)
    batch = tf.quantize_nvfp4(x * torch.tensor([100.0] + [1.0] * 7).unsqueeze(1), per_row=True)
    assert torch.equal(alone.codes, batch.codes[3:4])


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,x,match",
    [
        (tf.quantize_nvfp4, torch.randn(4, 24), "not a multiple of the block size 16"),
        (tf.quantize_mxfp4, torch.randn(4, 48), "not a multiple of the block size 32"),
        (tf.quantize_nvfp4, torch.randn(4, 16, dtype=torch.float64), "dtype torch.float64 is not supported"),
        (tf.quantize_nvfp4, torch.tensor([1.0] * 15 + [float("nan")]), r"non-finite input at index \(15,\)"),
        (tf.quantize_mxfp4, torch.tensor([[1.0] * 32, [1.0] * 31 + [float("inf")]]), r"index \(1, 31\)"),
    ],
)
def test_bad_input_raises(fn, x, match):
    with pytest.raises(ValueError, match=match):
        fn(x)


def test_bad_global_amax_raises():
    with pytest.raises(ValueError, match="global_amax: shape"):
        tf.quantize_nvfp4(torch.randn(4, 16), global_amax=torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite and non-negative"):
        tf.quantize_nvfp4(torch.randn(4, 16), global_amax=torch.tensor(float("inf")))


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match="4-bit"):
        tf.pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        tf.pack_fp4(torch.tensor([1, 2, 3], dtype=torch.uint8))


# --- straight-through fake quantization ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_forward_and_identity_gradient(fmt, dtype):
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    y = tf.fake_quant(x, fmt, per_row=(fmt == "nvfp4"))
    assert y.dtype == dtype
    expect = tf.dequantize(tf.quantize(x.detach(), fmt, per_row=(fmt == "nvfp4"))).to(dtype)
    assert torch.equal(y, expect)
    g = torch.randn(4, 64, dtype=dtype)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_straight_through_skips_autograd_without_grad_and_moves_value():
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    v = torch.randn(2, 16, dtype=torch.float64)
    y = tf.formats.straight_through(x, v)
    assert y.dtype == x.dtype and y.grad_fn is None and torch.equal(y, v.to(x.dtype))
    xg = x.clone().requires_grad_(True)
    with torch.no_grad():
        assert tf.formats.straight_through(xg, v).grad_fn is None
    y = tf.formats.straight_through(xg, v)
    assert y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(xg))


# --- container validation: never a read past a buffer, never NaN ---------------------------------


def _bad_containers():
    q = tf.quantize_nvfp4(torch.randn(4, 64), per_row=True)
    m = tf.quantize_mxfp4(torch.randn(4, 64))
    e4m3_nan = q.scales.view(torch.uint8).clone()
    e4m3_nan[3, 2] = 0x7F
    e8m0_nan = m.scales.clone()
    e8m0_nan[1, 1] = 255
    return [
        (tf.NVFP4(q.codes, q.scales[:, :1], q.global_amax), r"NVFP4 scales: expected float8_e4m3fn of shape \(4, 4\).*got float8_e4m3fn of shape \(4, 1\)"),
        (tf.NVFP4(q.codes, q.scales[:2], q.global_amax), r"NVFP4 scales: expected float8_e4m3fn of shape \(4, 4\)"),
        (tf.NVFP4(q.codes, q.scales.view(torch.uint8), q.global_amax), "NVFP4 scales: expected float8_e4m3fn"),
        (tf.NVFP4(q.codes, e4m3_nan.view(torch.float8_e4m3fn), q.global_amax), r"NVFP4 scales: NaN scale code 0x7F at index \(3, 2\)"),
        (tf.NVFP4(q.codes.to(torch.int32), q.scales, q.global_amax), "NVFP4 codes: expected uint8"),
        (tf.NVFP4(q.codes[:, :4], q.scales, q.global_amax), "NVFP4 codes: last dim 4 holds 8 elements"),
        (tf.NVFP4(q.codes, q.scales, q.global_amax[:2]), r"NVFP4 global_amax: expected float32, a scalar or of shape \(4, 1\)"),
        (tf.NVFP4(q.codes, q.scales, q.global_amax.double()), "NVFP4 global_amax: expected float32"),
        (tf.NVFP4(q.codes, q.scales, torch.tensor(float("nan"))), "NVFP4 global_amax: must be finite"),
        (tf.NVFP4(q.codes, q.scales, torch.tensor(-2.0)), "NVFP4 global_amax: must be finite and non-negative"),
        (tf.MXFP4(m.codes, m.scales[:, :1]), r"MXFP4 scales: expected uint8 of shape \(4, 2\)"),
        (tf.MXFP4(m.codes, e8m0_nan), r"MXFP4 scales: NaN scale code 0xFF at index \(1, 1\)"),
        (tf.MXFP4(m.codes, m.scales.view(torch.float8_e4m3fn)), "MXFP4 scales: expected uint8"),
    ]


def test_bad_containers_raise_value_errors_at_every_entry():
    for bad, match in _bad_containers():
        with pytest.raises(ValueError, match=match):
            bad.check()
        with pytest.raises(ValueError, match=match):
            tf.dequantize(bad)
        with pytest.raises(ValueError, match=match):
            (tf.dequantize_nvfp4 if isinstance(bad, tf.NVFP4) else tf.dequantize_mxfp4)(bad)
        with pytest.raises(ValueError, match=match):
            tf.encode_hint(bad, "full")
    with pytest.raises(ValueError, match="expected an NVFP4"):
        tf.dequantize_nvfp4(tf.quantize_mxfp4(torch.randn(2, 32)))


def test_bad_container_errors_are_one_line():
    for bad, _ in _bad_containers():
        with pytest.raises(ValueError) as e:
            tf.dequantize(bad)
        assert "\n" not in str(e.value)


# --- no process-wide state: numba's thread count is the caller's ---------------------------------


def test_library_never_changes_numba_thread_count(monkeypatch):
    import numba

    from tracefp4.formats import kernels

    before = numba.get_num_threads()

    def refuse(n):
        raise AssertionError(f"library code called numba.set_num_threads({n})")

    monkeypatch.setattr(numba, "set_num_threads", refuse)
    x = torch.randn(2048, 1024)  # 8 MB: more than one grain, so the chunk count matters
    q = tf.quantize_nvfp4(x)
    tf.quantize_nvfp4(x, per_row=True)
    tf.dequantize(q)
    m = tf.quantize_mxfp4(x)
    tf.dequantize(m)
    tf.guided_quantize(x, tf.encode_hint(q, "lsb"))
    tf.guided_quantize(x, tf.encode_hint(m, "full"))
    assert numba.get_num_threads() == before
    # the work is sized by the chunks a kernel is given instead
    assert kernels.row_chunks(1, 1 << 40) == 1
    assert kernels.row_chunks(1000, 0) == 1
    threads = min(numba.get_num_threads(), torch.get_num_threads())
    assert kernels.row_chunks(1000, 100 * kernels.GRAIN_BYTES) == min(threads, 100)
    assert kernels.row_chunks(3, 100 * kernels.GRAIN_BYTES) == min(threads, 3)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_leave_torch_thread_count_alone(threads):
    """numba's OpenMP layer may share PyTorch's runtime; whatever it does, every op leaves torch's
    intra-op thread count as the caller set it, and sizes its work to it (one chunk per thread)."""
    import numba

    from tracefp4.formats import kernels

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(2048, 1024)
        q = tf.quantize_nvfp4(x)
        assert torch.get_num_threads() == threads
        tf.quantize_nvfp4(x, per_row=True)
        tf.dequantize(q)
        tf.guided_quantize(x, tf.encode_hint(q, "lsb"))
        tf.quantize_mxfp4(x)
        assert torch.get_num_threads() == threads
        assert kernels.row_chunks(1000, 100 * kernels.GRAIN_BYTES) == min(threads, numba.get_num_threads())
    finally:
        torch.set_num_threads(before)


@pytest.mark.subprocess
def test_threading_layer_is_workqueue_unless_chosen():
    """numba runs our kernels on its workqueue layer unless the user chose one (an OpenMP layer's
    spinning threads starve PyTorch's ops on small machines: see tracefp4.formats.kernels); under a
    chosen OpenMP layer, starting numba's threads still leaves torch's thread count alone."""
    import os
    import subprocess
    import sys

    # torch at 1 thread, numba's pool at 2: starting numba's threads must not change torch's count (a
    # kernel given 2 chunks launches in parallel; with one chunk, as every op at 1 thread, it runs serially)
    code = ("import torch, numba, numpy as np, tracefp4 as tf; from tracefp4.formats import kernels;"
            "torch.set_num_threads(1); tf.quantize_nvfp4(torch.randn(64, 64));"
            "kernels.pack_lsb(np.zeros((4, 8), np.uint8), np.zeros((4, 2), np.uint8), 2);"
            "assert torch.get_num_threads() == 1, torch.get_num_threads(); print(numba.threading_layer())")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "workqueue"
    try:
        import numba.np.ufunc.omppool  # noqa: F401 - numba's OpenMP layer, where its wheel has one
    except ImportError:
        return
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "NUMBA_THREADING_LAYER": "omp"},
                            capture_output=True, text=True, timeout=300)
    assert chosen.returncode == 0, chosen.stderr[-2000:]
    assert chosen.stdout.split()[-1] == "omp"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_serial_and_parallel_launches_give_the_same_bits(fmt):
    """A kernel called with one chunk runs its serial compilation (a parallel launch costs more than a
    small site's whole quantize); with more chunks the parallel one. Both walk the same rows: every
    output of each kernel is bit-identical whichever runs, for any chunk count."""
    from tracefp4.formats import kernels
    from tracefp4.formats.rows import kernel_rows

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 256, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(torch.bfloat16)
    rows = kernel_rows(x)
    n, k = rows.shape
    outs = []
    for chunks in (1, 2, 5):
        bad = np.zeros(n, dtype=np.bool_)
        codes = np.empty((n, k // 2), dtype=np.uint8)
        if fmt == "nvfp4":
            amax = np.empty(n, dtype=np.float32)
            scales = np.empty((n, k // 16), dtype=np.uint8)
            fused = np.empty((n, k // 2), dtype=np.uint32)
            kernels.nvfp4_quantize(rows, amax, True, np.empty((0, 0), dtype=np.uint32), codes, scales, fused, bad, chunks)
            values, block, div = kernels.E4M3_VALUES, 16, 2688.0 / np.maximum(amax, 1e-30).astype(np.float32)
        else:
            scales = np.empty((n, k // 32), dtype=np.uint8)
            kernels.mxfp4_quantize(rows, False, codes, scales, bad, chunks)
            values, block, div = kernels.E8M0_VALUES, 32, np.ones(n, dtype=np.float32)
        deq = np.empty((n, k), dtype=np.float32)
        kernels.dequantize(codes, scales, values, div.astype(np.float32), block, deq, chunks)
        bits = np.empty((n, k // 8), dtype=np.uint8)
        kernels.pack_lsb(codes, bits, chunks)
        outs.append((codes, scales, deq.view(np.uint32), bits, bad) + ((fused,) if fmt == "nvfp4" else ()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    launched = kernels.nvfp4_quantize if fmt == "nvfp4" else kernels.mxfp4_quantize
    assert launched.serial.signatures and launched.kernel.signatures  # both compilations ran


@pytest.mark.parametrize("scope", ["row", "tensor", "expert", "given"])
@pytest.mark.parametrize("k", [16, 48, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_values_is_quantize_then_dequantize_bit_for_bit(scope, k, dtype):
    """``quantize_values`` (for bf16 on the CPU one pass of the numba kernel that also writes the
    dequantized row in bf16) gives exactly ``quantize`` and ``dequantize(...).to(x.dtype)``: the same
    codes, scales and amax, and the same bits, over magnitudes from 1e-6 to 1e6 (subnormal E4M3
    scales), zero rows, negative zeros, a K with a block left over after the last 32 (K % 32 == 16)
    and enough rows for a parallel launch."""
    from tracefp4.formats.quantizers import NVFP4Quantizer

    g = torch.Generator().manual_seed(k)
    rows = 600 if k >= 256 else 40
    x = torch.randn(2, rows // 2, k, generator=g) * torch.logspace(-6, 6, rows).reshape(2, rows // 2, 1)
    x[0, 3] = 0.0
    x[1, 5, : k // 2] = -0.0
    x = x.to(dtype)
    quantizer = NVFP4Quantizer(scope if scope != "given" else "tensor",
                               global_amax=torch.tensor(7.5) if scope == "given" else None)
    q, values = quantizer.quantize_values(x)
    want = quantizer.quantize(x)
    assert torch.equal(q.codes, want.codes) and torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert torch.equal(q.global_amax, want.global_amax)
    expect = quantizer.dequantize(want).to(dtype)
    assert values.dtype == dtype and values.shape == x.shape
    assert torch.equal(values.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expect.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
