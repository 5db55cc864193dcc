"""Paged attention over packed FP4 K/V (tracefp4.formats.ckv) against a float64 reference.

The kernel's result is defined as attention over the exact dequantized K/V rows (``ckv.dequantize_rows``,
checked bit for bit against the site kernel's own dequantized values) up to float32 rounding. The
bound, per query row, head and output element d, for L keys in C = ceil(L/16) chunks, head dim D,
u = 2^-24, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, eq. 4.4):

* scores: s_j = scale * sum_d q_d k_jd in float32 (D products, D - 1 additions, the scale: D + 1
  roundings): |s^_j - s_j| <= Ds_j = gamma_(D+1) * scale * sum_d |q_d k_jd|.
* weights: p_j = exp(s^_j - m_c) for the running max m_c of its chunk, then times the alpha =
  exp(m_c - m_c+1) of every later chunk. With exp^(x) = e^(x (1 + d)) (1 + e), |d| <= u the
  subtraction's rounding and |e| <= EPS_EXP (kv_exp's error, test_exp_meets_its_bound), the
  arguments' roundings sum to at most u R (R = the computed scores' range, as every |x| <= R and the
  alphas' arguments telescope to m_final - m_first <= R), so each key's effective weight is
  e^(s_j - m) (1 + t_j) with 1 + |t_j| <= e^(2 u R + Ds_max) (1 + EPS_EXP)^(C + 1) =: 1 + eta
  (m, common to all keys, cancels in the ratio). Weights below exp(-87) are flushed to 0: at most
  L e^-87 of absolute weight against a total >= 1.
* perturbed weights change a weighted mean by at most 2 eta / (1 - eta) * max_j |v_jd - o_d|
  <= 4 eta / (1 - eta) * V_d, V_d = max_j |v_jd|.
* sums: the numerator and l each pass through at most n = L + C + 5 roundings per term (a product,
  the chain of L additions, C rescalings by alpha, the tree of 16), so each is within gamma_n of its
  exact sum of |terms|, which moves the ratio by at most 2 gamma_n / (1 - gamma_n) * V_d; the final
  division adds u |o| <= u V_d.

atol_d = (4 eta / (1 - eta) + 2 gamma_n / (1 - gamma_n) + 2 u + 2 L e^-87) * V_d.

The bound holds for both paths (csrc/kv_attention_avx.h derives it there too). The AVX-512 path
sums q . k by vdpbf16ps (two exact bf16 products per float32 lane, each added with one rounding; four
keys an instruction, 4 lanes a key: D/4 additions a lane, then a tree of 4 and the scale, D/4 + 3 <= D + 1
roundings a term) and p . v by fused
multiply-adds (a term skips its product's rounding: at most n roundings a term still), so the
relative terms above cover it. vdpbf16ps also reads bf16 subnormals as zero and flushes subnormal
sums to zero: D dropped products, each below 2^-126 times the other factor, and D flushed sums, each
below 2^-126, then the later roundings (a factor below 2), add to Ds_j at most
2 scale D 2^-126 (1 + max|q| + max|k|), a term that also covers the portable path's underflowing
products (2^-150 each). As both paths lie within atol of the float64 result, they lie within 2 atol
of each other (test_portable_and_avx512_agree_within_the_bound).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tracefp4.formats import ckv, clib
from tracefp4.formats.constants import Format
from tracefp4.formats.quantizers import MXFP4Quantizer

pytestmark = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

IMPLS = ["portable"] + (["avx512"] if clib.available() and clib.has_avx512_bf16() else [])
U = 2.0**-24
#: kv_exp's relative error bound (Cephes' polynomial is within about 1 ulp; 8 ulp stated, checked below)
EPS_EXP = 8 * U


def kv_exp32(x: np.ndarray) -> np.ndarray:
    """kv_exp (csrc/kv_attention.h) in numpy float32, operation for operation (no fused operations)."""
    f = np.float32
    x = x.astype(np.float32)
    n = (x * f(1.44269504088896341) + f(12582912.0)) - f(12582912.0)
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    p = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = (p * (r * r) + r) + f(1.0)
    two_n = ((n.astype(np.int32) + 127) << 23).view(np.float32)
    return np.where(x > f(-87.0), p * two_n, f(0.0))


def test_exp_meets_its_bound():
    """The stated EPS_EXP holds over a dense grid of [-87, 0] and the reduction's boundaries."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 2_000_001), -np.arange(0, 126) * math.log(2) + 1e-6,
                        -(np.arange(0, 126) + 0.5) * math.log(2)]).astype(np.float32)
    x = x[x > -87.0]
    got = kv_exp32(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got / exact - 1.0)) <= EPS_EXP


def pack_nvfp4(x: torch.Tensor) -> tuple[ckv.PackedKV, torch.Tensor]:
    """Rows ``x [slots, Hkv, D]`` packed by the site kernel (as a rollout's K/V site packs them),
    and the site kernel's own dequantized rows."""
    slots, h, d = x.shape
    codes = torch.empty(slots, h, d // 2, dtype=torch.uint8)
    scales = torch.empty(slots, h, d // 16, dtype=torch.uint8)
    amax = torch.empty(slots, h, dtype=torch.float32)
    values = torch.empty_like(x)
    clib.quantize_into(x, amax, codes, scales, values, own_amax=True)
    return ckv.PackedKV(codes, scales, amax), values


def pack_mxfp4(x: torch.Tensor) -> ckv.PackedKV:
    q = MXFP4Quantizer().quantize(x)
    return ckv.PackedKV(q.codes, q.scales, None, Format.MXFP4)


def cache(slots: int, hkv: int, d: int, seed: int, fmt: str = "nvfp4"):
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes (the row amax matters) and a few outliers
    rows = torch.randn(2, slots, hkv, d, generator=g) * torch.exp(torch.randn(2, slots, hkv, 1, generator=g))
    rows = rows.to(torch.bfloat16)
    if fmt == "nvfp4":
        (k, _), (v, _) = pack_nvfp4(rows[0]), pack_nvfp4(rows[1])
    else:
        k, v = pack_mxfp4(rows[0]), pack_mxfp4(rows[1])
    return k, v


def reference(q, k, v, table, seq_lens, q_seq, q_len, block_size, scale):
    """float64 attention over the exact dequantized rows, and the bound of the module docstring."""
    kd, vd = ckv.dequantize_rows(k).double(), ckv.dequantize_rows(v).double()
    rows, hq, d = q.shape
    group = hq // kd.shape[1]
    out, atol = torch.zeros(rows, hq, d, dtype=torch.float64), torch.zeros(rows, hq, d, dtype=torch.float64)
    for r in range(rows):
        s, n = int(q_seq[r]), int(q_len[r])
        if n == 0:
            continue
        slots = torch.tensor([int(table[s, i // block_size]) * block_size + i % block_size for i in range(n)])
        for h in range(hq):
            kk, vv, qq = kd[slots, h // group], vd[slots, h // group], q[r, h].double()
            sc = (kk @ qq) * scale
            out[r, h] = torch.softmax(sc, 0) @ vv
            atol[r, h] = bound(qq, kk, vv, sc, scale)
    return out, atol


def bound(q, k, v, scores, scale) -> torch.Tensor:
    n_keys, d = k.shape
    chunks = -(-n_keys // 16)
    gamma = lambda n: n * U / (1 - n * U)  # noqa: E731
    flushed = 2 * scale * d * 2.0**-126 * (1 + float(q.abs().max()) + float(k.abs().max()))  # vdpbf16ps' zeros
    ds = float((gamma(d + 1) * scale * (k.abs() @ q.abs())).max()) + flushed
    spread = float(scores.max() - scores.min()) + 2 * ds
    eta = math.exp(2 * U * spread + ds) * (1 + EPS_EXP) ** (chunks + 1) - 1
    n = n_keys + chunks + 5
    factor = 4 * eta / (1 - eta) + 2 * gamma(n) / (1 - gamma(n)) + 2 * U + 2 * n_keys * math.exp(-87)
    return factor * v.abs().amax(dim=0)


def run(q, k, v, table, seq_lens, q_seq, q_len, block_size, scale, **kw):
    return ckv.paged_attention(q, k, v, block_table=table, seq_lens=seq_lens, q_seq=q_seq, q_len=q_len,
                               block_size=block_size, scale=scale, **kw)


def decode_case(d: int, hkv: int, group: int, lens: list[int], block_size: int, seed: int, fmt: str = "nvfp4"):
    """A paged cache with the sequences' blocks scattered (a shuffled table, spare blocks) and one
    decode query row per sequence."""
    per_seq = max(1, -(-max(lens) // block_size))
    num_blocks = per_seq * len(lens) + 3
    g = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(num_blocks, generator=g)[: per_seq * len(lens)].to(torch.int32).reshape(len(lens), per_seq)
    k, v = cache(num_blocks * block_size, hkv, d, seed, fmt)
    q = (torch.randn(len(lens), hkv * group, d, generator=g) * 2).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k, v, table, seq_lens, torch.arange(len(lens), dtype=torch.int32), seq_lens.clone(), block_size


LENS = {"ragged": [37, 1, 0, 16, 17, 64, 5], "block_edges": [15, 16, 17, 31, 32, 33], "empty": [0, 0],
        "one_token": [1, 1, 1], "long": [700, 3]}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lens", sorted(LENS))
def test_decode_matches_float64_reference(impl, d, lens):
    case = decode_case(d, 2, 4, LENS[lens], 16, seed=d + len(lens))
    scale = d**-0.5
    out = run(*case, scale, impl=impl)
    want, atol = reference(*case, scale)
    assert torch.all((out.double() - want).abs() <= atol), float(((out.double() - want).abs() - atol).max())
    assert torch.all(out[torch.tensor(LENS[lens]) == 0] == 0)


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_gqa_and_block_sizes(group, block_size):
    case = decode_case(128, 2, group, [40, 3, 0, 33], block_size, seed=block_size + group)
    out = run(*case, 0.1)
    want, atol = reference(*case, 0.1)
    assert torch.all((out.double() - want).abs() <= atol)


def test_mxfp4_rows():
    """MXFP4 K/V (E8M0 scales per 32, no amax) through the same kernel."""
    case = decode_case(128, 2, 4, [50, 1, 17], 16, seed=7, fmt="mxfp4")
    out = run(*case, 128**-0.5)
    want, atol = reference(*case, 128**-0.5)
    assert torch.all((out.double() - want).abs() <= atol)


def test_prefill_rows_are_causal():
    """A prompt's tokens as query rows with q_len = position + 1 (prefill through the same kernel):
    row t sees keys 0..t only, and its last row equals the decode of the whole prompt, bit for bit."""
    q, k, v, table, seq_lens, _, _, bs = decode_case(64, 2, 2, [45, 20], 16, seed=3)
    g = torch.Generator().manual_seed(9)
    qp = (torch.randn(65, 4, 64, generator=g) * 2).to(torch.bfloat16)
    q_seq = torch.tensor([0] * 45 + [1] * 20, dtype=torch.int32)
    q_len = torch.cat([torch.arange(1, 46), torch.arange(1, 21)]).to(torch.int32)
    out = run(qp, k, v, table, seq_lens, q_seq, q_len, bs, 0.125)
    want, atol = reference(qp, k, v, table, seq_lens, q_seq, q_len, bs, 0.125)
    assert torch.all((out.double() - want).abs() <= atol)
    last = run(qp[[44, 64]], k, v, table, seq_lens, torch.arange(2, dtype=torch.int32), seq_lens, bs, 0.125)
    assert torch.equal(last, out[[44, 64]])


def test_dequantized_rows_are_the_site_kernels():
    """The rows the kernel is defined over are the site kernel's dequantized rows, bit for bit."""
    x = (torch.randn(40, 3, 128, generator=torch.Generator().manual_seed(2)) * 5).to(torch.bfloat16)
    packed, values = pack_nvfp4(x)
    assert torch.equal(ckv.dequantize_rows(packed).view(torch.int16), values.view(torch.int16))


@pytest.mark.skipif(len(IMPLS) < 2, reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_portable_and_avx512_agree_within_the_bound(d):
    """The paths round differently (vdpbf16ps and fused multiply-adds on AVX-512), each within atol of
    the float64 result, so within 2 atol of each other (d 80: bf16 rows padded to 96, an odd block)."""
    case = decode_case(d, 2, 8, LENS["ragged"] + [300], 16, seed=d)
    a, b = run(*case, d**-0.5, impl="portable"), run(*case, d**-0.5, impl="avx512")
    want, atol = reference(*case, d**-0.5)
    assert torch.all((a.double() - want).abs() <= atol) and torch.all((b.double() - want).abs() <= atol)
    assert torch.all((a.double() - b.double()).abs() <= 2 * atol), float(((a - b).double().abs() - 2 * atol).max())


@pytest.mark.parametrize("impl", IMPLS)
def test_thread_counts_and_repeated_calls_give_the_same_bits(impl):
    case = decode_case(128, 4, 2, [100, 1, 0, 37, 64, 5], 16, seed=11)
    outs = [run(*case, 0.09, impl=impl, threads=t) for t in (1, 2, 5, 1, 2, 5)]
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("fmt", "d"), [("nvfp4", 64), ("nvfp4", 80), ("nvfp4", 256), ("mxfp4", 96), ("mxfp4", 128)])
def test_decode_stage_is_exact_on_both_paths(impl, fmt, d):
    """The rows the kernel attends over, as it decodes them (K rows to bf16, V rows to float32 on the
    AVX-512 path), are the exact dequantized rows bit for bit (d 80: an odd last block)."""
    k, v = cache(48, 2, d, seed=d, fmt=fmt)
    for kv in (k, v):
        want = ckv.dequantize_rows(kv).view(torch.int16)
        for key in (True, False):
            assert torch.equal(ckv.decode_rows(kv, key=key, impl=impl).view(torch.int16), want)


def test_bad_inputs_are_refused_naming_the_argument():
    q, k, v, table, seq_lens, q_seq, q_len, bs = decode_case(64, 2, 2, [20, 5], 16, seed=1)
    ok = dict(block_table=table, seq_lens=seq_lens, q_seq=q_seq, q_len=q_len, block_size=bs, scale=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        ckv.paged_attention(q, k, v, **ok, sliding_window=128)
    with pytest.raises(ValueError, match="paged_attention q:"):
        ckv.paged_attention(q.float(), k, v, **ok)
    with pytest.raises(ValueError, match="paged_attention q:"):
        ckv.paged_attention(q[:, :3], k, v, **ok)
    with pytest.raises(ValueError, match="k.amax"):
        ckv.paged_attention(q, ckv.PackedKV(k.codes, k.scales, None), v, **ok)
    with pytest.raises(ValueError, match="v.scales"):
        ckv.paged_attention(q, k, ckv.PackedKV(v.codes, v.scales[..., :2], v.amax), **ok)
    with pytest.raises(ValueError, match="block_table: sequence 1"):
        ckv.paged_attention(q, k, v, **{**ok, "block_table": torch.tensor([[0, 1], [99, 2]], dtype=torch.int32)})
    with pytest.raises(ValueError, match="q_seq/q_len: query row 1"):
        ckv.paged_attention(q, k, v, **{**ok, "q_len": torch.tensor([20, 6], dtype=torch.int32)})
    with pytest.raises(ValueError, match="seq_lens"):
        ckv.paged_attention(q, k, v, **{**ok, "seq_lens": seq_lens.long()})
    with pytest.raises(ValueError, match="block_size"):
        ckv.paged_attention(q, k, v, **{**ok, "block_size": 5})
    with pytest.raises(ValueError, match="impl"):
        ckv.paged_attention(q, k, v, **ok, impl="cuda")


def test_kernel_disabled_raises_runtime_error():
    """Without the library the wrapper says why (callers take the dequantize-then-attention path)."""
    code = ("import torch; from tracefp4.formats import ckv\n"
            "assert not ckv.available()\n"
            "kv = ckv.PackedKV(torch.zeros(16, 1, 32, dtype=torch.uint8), torch.zeros(16, 1, 4, dtype=torch.uint8), "
            "torch.ones(16, 1))\n"
            "i32 = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
            "try:\n"
            "    ckv.paged_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), kv, kv, block_table=i32([0]), "
            "seq_lens=i32(1), q_seq=i32(0), q_len=i32(1), block_size=16, scale=1.0)\n"
            "except RuntimeError as e:\n    assert 'TRACEFP4_CPU_KERNEL=0' in str(e), e\n"
            "else:\n    raise SystemExit('no error')\n")
    env = {**os.environ, "TRACEFP4_CPU_KERNEL": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def rare_scales_case(fmt: str):
    """A cache whose scale bytes and amaxes reach where the AVX-512 path's one-division decoding does
    not hold (quotients near either end of float32's normal range, negative E4M3 scales, bytes above
    the bit-decoded range): it falls back per row, and must still give the exact rows."""
    g = torch.Generator().manual_seed(5)
    slots, hkv, d = 64, 2, 128
    block = 16 if fmt == "nvfp4" else 32
    codes = torch.randint(0, 256, (2, slots, hkv, d // 2), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":  # all finite E4M3 bytes (0x7F and 0xFF are NaN), negative ones included
        scales = torch.randint(0, 0x7F, (2, slots, hkv, d // block), generator=g, dtype=torch.uint8)
        scales |= (torch.rand(scales.shape, generator=g) < 0.1).to(torch.uint8) << 7
        amax = torch.exp(torch.randn(2, slots, hkv, generator=g) * 30).clamp(1e-38, 3e38)
        amax[:, :32] = torch.exp(torch.randn(2, 32, hkv, generator=g) - 83)  # sequence 0: subnormal quotients
        amax[:, 32::7] = 0.0  # (amax 0: no divisor)
        make = lambda i: ckv.PackedKV(codes[i], scales[i], amax[i].float())  # noqa: E731
    else:  # sequence 0: exponents whose halves are subnormal; sequence 1: ordinary ones
        scales = torch.randint(110, 140, (2, slots, hkv, d // block), generator=g, dtype=torch.uint8)
        scales[:, :32] = torch.randint(0, 4, (2, 32, hkv, d // block), generator=g, dtype=torch.uint8)
        make = lambda i: ckv.PackedKV(codes[i], scales[i], None, Format.MXFP4)  # noqa: E731
    table = torch.arange(slots // 16, dtype=torch.int32).reshape(2, 2)
    lens = torch.tensor([32, 29], dtype=torch.int32)
    q = torch.randn(2, hkv * 8, d, generator=g).to(torch.bfloat16)
    return q, make(0), make(1), table, lens, torch.arange(2, dtype=torch.int32), lens.clone(), 16


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_rare_scales_decode_exactly_on_both_paths(impl, fmt):
    """Rows where the AVX-512 path's one-division decoding falls back (or, within range, does not)
    decode to the exact dequantized rows on both paths, as K and as V rows; MXFP4's attention over
    them (finite scores) stays within the float64 bound. (NVFP4's rare amaxes make scores overflow.)"""
    case = rare_scales_case(fmt)
    for kv in case[1:3]:
        want = ckv.dequantize_rows(kv).view(torch.int16)
        for key in (True, False):
            assert torch.equal(ckv.decode_rows(kv, key=key, impl=impl).view(torch.int16), want)
    if fmt == "mxfp4":
        want, atol = reference(*case, 0.09)
        assert torch.all((run(*case, 0.09, impl=impl).double() - want).abs() <= atol)
