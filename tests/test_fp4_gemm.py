"""The packed-FP4 grouped GEMM (tracefp4.formats.clib) against the readable reference.

Exactness: where every float32 partial sum is representable (small dyadic operands) any order of
additions gives the exact sum, so the kernel must equal ``grouped_gemm_reference`` bit for bit
(atol=0), on every code path of both layouts (``KERNELS``: the layout and the implementation forced;
``auto`` on the panels layout mixes AMX and AVX-512 by rows per expert). Elsewhere the only difference is the order of the float32
additions, bounded for any order by ``gamma_(K-1) sum |x w|`` (``clib.accumulation_bound``), plus the
float32 division (2^-24 relative) and the final bf16 rounding (2^-8 relative: bf16 keeps 8 significant
bits, so round-to-nearest is off by at most half of 2^-7): the bound below.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tracefp4.formats import clib
from tracefp4.formats import reference_composite as refc
from tracefp4.formats import nvfp4_global_encode_scale
from tracefp4.formats.quantizers import MXFP4Quantizer, NVFP4Quantizer

pytestmark = pytest.mark.needs_clib  # skipped without the library, failed under CI (tests/conftest.py)

IMPLS = ["portable"] + (["avx512_bf16"] if clib.available() and clib.has_avx512_bf16() else [])
_AMX = clib.available() and clib.has_amx()
#: (layout, impl) pairs that run here: every implementation of each layout
KERNELS = ([("tiles", i) for i in IMPLS] + [("panels", i) for i in IMPLS]
           + ([("panels", "amx"), ("panels", "auto")] if _AMX else []))
COUNTS = {"ragged": [3, 0, 5, 1, 0, 7, 2, 4], "one_row": [1, 1, 0, 1, 1, 0, 0, 1], "many_rows": [0, 19, 0, 10, 27, 0, 0, 2],
          "all_empty_but_one": [0, 0, 0, 0, 0, 0, 6, 0],
          # AMX row groups of 32 and the panels decoded once for all of them
          "over_32_rows": [0, 33, 0, 0, 70, 0, 1, 0]}


#: Block width of each format: K is a whole number of blocks, so a case whose K is not is never made
#: (it could only skip on every machine).
BLOCK = {"nvfp4": 16, "mxfp4": 32}


def whole_blocks(sizes: list, k_of=lambda size: size) -> list[tuple]:
    """(fmt, size) for every format and every size whose K (``k_of(size)``) is whole blocks of it."""
    return [(fmt, size) for fmt, block in BLOCK.items() for size in sizes if k_of(size) % block == 0]


def offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64).cumsum(0)])


def packed(w: torch.Tensor, fmt: str):
    """(standard codes, scale bytes, divisor) of ``w [E, N, K]`` quantized as the plan's weight
    quantizer does."""
    if fmt == "nvfp4":
        q = NVFP4Quantizer("expert").quantize(w)
        divisor = nvfp4_global_encode_scale(q.global_amax.reshape(w.shape[0], -1)[:, 0])
        return q.codes, q.scales.view(torch.uint8), divisor.to(torch.float32)
    q = MXFP4Quantizer().quantize(w)
    return q.codes, q.scales, torch.ones(w.shape[0], dtype=torch.float32)


def gemm(x, offs, codes, scales, divisor, fmt, *, kernel=("tiles", "auto"), **kw):
    """The kernel (layout, impl) on standard-layout codes and scales (converted to the layout here)."""
    layout, impl = clib.Layout(kernel[0]), kernel[1]
    block = 16 if fmt == "nvfp4" else 32
    return clib.grouped_gemm(x, offs, clib.kernel_layout(codes, block, layout), clib.kernel_scales(scales, layout),
                              divisor, fmt, layout=layout, impl=impl, **kw)


@pytest.mark.parametrize(("block", "k"),
                         [(BLOCK[fmt], k) for fmt, k in whole_blocks([64, 96, 256, 768, 2048, 4096 + 32])])
def test_kernel_layout_is_a_byte_permutation_and_inverts(block, k):
    """The tiles layout holds every standard byte exactly once (plus zero padding up to whole
    16-block super-groups), the panels layout exactly once; standard_layout gives the codes back, and
    standard_scales the scales."""
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 256, (3, 32, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    kc = clib.kernel_layout(codes, block)
    assert kc.shape == (3, 8, 4 * clib.code_bytes(k, block)) and clib.code_bytes(k, block) >= k // 2
    assert torch.equal(clib.standard_layout(kc, k, block), codes)
    pc = clib.kernel_layout(codes, block, clib.Layout.PANELS)
    assert pc.shape == (3, 2, k // 4, 32) and pc[1, 1, 5, 2 * 3 + 1] == codes[1, 16 + 3, 2 * 5 + 1]
    assert torch.equal(clib.standard_layout(pc, k, block, clib.Layout.PANELS), codes)
    scales = torch.randint(0, 256, (3, 32, k // block), generator=g, dtype=torch.int64).to(torch.uint8)
    ps = clib.kernel_scales(scales, clib.Layout.PANELS)
    assert ps.shape == (3, 2, k // block, 16) and ps[2, 0, 1, 7] == scales[2, 7, 1]
    assert torch.equal(clib.standard_scales(ps, clib.Layout.PANELS), scales)
    assert clib.kernel_scales(scales) is scales or torch.equal(clib.kernel_scales(scales), scales)
    # the same bytes (a permutation) and zeros for the padding: sorted, the padding comes first
    assert torch.equal(torch.sort(kc.reshape(-1)).values[kc.numel() - codes.numel():], torch.sort(codes.reshape(-1)).values)
    assert int((kc != 0).sum()) == int((codes != 0).sum())


def bound(exact: torch.Tensor, accumulation: torch.Tensor) -> torch.Tensor:
    """|kernel - exact| for any addition order: the order's error E, then the float32 division and
    the bf16 rounding of a value within E of the exact one (plus bf16's subnormal spacing)."""
    return (2.0**-8 + 2.0**-24 + 2.0**-32) * (exact.abs() + accumulation) + accumulation + 2.0**-133


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize(("fmt", "k"), whole_blocks([64, 80, 96, 2048]))  # 80: NVFP4's last AMX chunk half a tile
def test_exact_where_the_sums_are_exact(kernel, fmt, counts, k):
    """Dyadic operands: x in multiples of 1/4 up to 2, weights value(code) * {1/2, 1, 2}: every product
    a multiple of 2^-4 below 24, every partial sum below 2^16: float32 adds them all exactly."""
    g = torch.Generator().manual_seed(k)
    e, n = 8, 48
    block = 16 if fmt == "nvfp4" else 32
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    choice = torch.randint(0, 3, (e, n, k // block), generator=g)
    if fmt == "nvfp4":  # E4M3 bytes of 0.5, 1, 2
        scales = torch.tensor([0x30, 0x38, 0x40], dtype=torch.uint8)[choice]
        divisor = torch.tensor([1.0, 2.0, 0.5, 4.0, 1.0, 8.0, 0.25, 1.0])  # powers of two: exact division
    else:  # E8M0 exponents -1, 0, 1
        scales = torch.tensor([126, 127, 128], dtype=torch.uint8)[choice]
        divisor = torch.ones(e)
    offs = offsets_of(COUNTS[counts])
    rows = int(offs[-1])
    x = (torch.randint(-8, 9, (rows, k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    out = gemm(x, offs, codes, scales, divisor, fmt, kernel=kernel)
    want = refc.grouped_gemm_reference(x, offs, codes, scales, divisor, fmt)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize(("fmt", "shape"), whole_blocks([(64, 96), (32, 2048), (1536, 512)], k_of=lambda s: s[1]),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_within_the_accumulation_bound_on_real_weights(kernel, fmt, counts, shape):
    """Gaussian weights quantized by the plan's weight quantizer (real scales, real divisors) and
    Gaussian bf16 rows: within the bound of the module docstring of the float64 exact result."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    e = 8
    w = (torch.randn(e, n, k, generator=g) * torch.linspace(0.01, 3, e)[:, None, None]).to(torch.bfloat16)
    codes, scales, divisor = packed(w, fmt)
    offs = offsets_of(COUNTS[counts])
    x = torch.randn(int(offs[-1]), k, generator=g).to(torch.bfloat16)
    out = gemm(x, offs, codes, scales, divisor, fmt, kernel=kernel)
    exact = refc.grouped_gemm_exact(x, offs, codes, scales, divisor, fmt)
    acc = clib.accumulation_bound(x, offs, refc.expert_weights(codes, scales, fmt), divisor)
    assert bool(((out.to(torch.float64) - exact).abs() <= bound(exact, acc)).all())


def test_subnormal_block_scales():
    """E4M3 subnormal block scales (bytes 1..7, 2^-9 to 7 * 2^-9): value * scale is still exact in
    bf16 (6 significant bits, >= 2^-10), so the bound holds there too."""
    g = torch.Generator().manual_seed(1)
    e, n, k = 2, 16, 64
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(1, 8, (e, n, k // 16), generator=g, dtype=torch.int64).to(torch.uint8)
    divisor = torch.tensor([3.0, 0.75])
    # tiles: 5 rows stream the codes, 23 (more than 20) decode the tile (to bf16); panels with AMX:
    # 2 rows take the AVX-512 path, 5 and 23 AMX (its B tiles scaled by subnormal E4M3 scales)
    offs = offsets_of([5, 23, 2])
    x = torch.randn(30, k, generator=g).to(torch.bfloat16)
    codes, scales = torch.cat([codes, codes[:1]]), torch.cat([scales, scales[:1]])
    divisor = torch.cat([divisor, divisor[:1]])
    exact = refc.grouped_gemm_exact(x, offs, codes, scales, divisor, "nvfp4")
    acc = clib.accumulation_bound(x, offs, refc.expert_weights(codes, scales, "nvfp4"), divisor)
    for kernel in KERNELS:
        out = gemm(x, offs, codes, scales, divisor, "nvfp4", kernel=kernel)
        assert bool(((out.to(torch.float64) - exact).abs() <= bound(exact, acc)).all()), kernel


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
def test_tiny_mxfp4_scales_are_not_flushed(kernel):
    """MXFP4 scales 2^-127 and 2^-126 (E8M0 bytes 0, 1) make subnormal weights, which AMX (and a bf16
    dot product) would read as zero: such experts take the float32-scaled AVX-512 path, and the sums,
    exact here (multiples of 2^-130), come out bit for bit, subnormal outputs included."""
    g = torch.Generator().manual_seed(4)
    e, n, k = 3, 32, 64
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.full((e, n, k // 32), 127, dtype=torch.uint8)
    scales[0, 20, 1] = 0  # one block of panel 1 of expert 0
    scales[2] = 1
    offs = offsets_of([6, 5, 4])
    x = (torch.randint(-8, 9, (15, k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    out = gemm(x, offs, codes, scales, torch.ones(e), "mxfp4", kernel=kernel)
    want = refc.grouped_gemm_reference(x, offs, codes, scales, torch.ones(e), "mxfp4")
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    tiny = want[11:].float().abs()
    assert bool(((tiny > 0) & (tiny < 2.0**-126)).any()), "no subnormal output: the case does not test them"


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
@pytest.mark.parametrize("counts", ["one_row", "many_rows"])
def test_output_rounding_edge_cases(kernel, counts):
    """The epilogue's division and bf16 rounding where they are delicate, bit for bit with the
    reference (the sums are exact, as in the test above): divisors near 2^127 put outputs among the
    bf16 subnormals (kept, not flushed); tiny divisors overflow them to +-inf; a NaN activation row
    gives NaN outputs as torch writes them (0x7FC0), in rows grouped with finite ones."""
    g = torch.Generator().manual_seed(3)
    e, n, k = 8, 48, 64
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.full((e, n, k // 16), 0x38, dtype=torch.uint8)  # E4M3 1.0
    divisor = torch.tensor([2.0**127, 2.0**-125, 2.0**-120, 2.0**127, 1.0, 2.0**125, 2.0**-125, 2.0**126])
    offs = offsets_of(COUNTS[counts])
    rows = int(offs[-1])
    x = (torch.randint(-8, 9, (rows, k), generator=g).to(torch.float32) / 4).to(torch.bfloat16)
    x[rows // 2, 5] = float("nan")
    out = gemm(x, offs, codes, scales, divisor, "nvfp4", kernel=kernel).view(torch.int16)
    want = refc.grouped_gemm_reference(x, offs, codes, scales, divisor, "nvfp4").view(torch.int16)
    finite = torch.ones(rows, dtype=torch.bool)
    finite[rows // 2] = False
    assert torch.equal(out[finite], want[finite])
    assert bool((out[rows // 2] == 0x7FC0).all())
    small = out[finite].view(torch.bfloat16).float().abs()
    assert bool(((small > 0) & (small < 2.0**-126)).any()), "no subnormal output: the case does not test them"
    assert bool(torch.isinf(out[finite].view(torch.bfloat16)).any()), "no overflow: the case does not test it"


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
def test_result_does_not_depend_on_the_thread_count(kernel):
    """Each output is summed by one thread in a fixed order: 1, 2 and 5 threads give the same bits."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, 256, generator=g).to(torch.bfloat16)
    codes, scales, divisor = packed(w, "nvfp4")
    offs = offsets_of(COUNTS["ragged"])
    x = torch.randn(int(offs[-1]), 256, generator=g).to(torch.bfloat16)
    outs = [gemm(x, offs, codes, scales, divisor, "nvfp4", threads=t, kernel=kernel) for t in (1, 2, 5)]
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)


def test_bad_input_is_named():
    w = torch.randn(2, 16, 32).to(torch.bfloat16)
    codes, scales, divisor = packed(w, "nvfp4")
    codes = clib.kernel_layout(codes, 16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="offsets not a non-decreasing"):
        clib.grouped_gemm(x, torch.tensor([0, 2, 1]), codes, scales, divisor, "nvfp4")
    with pytest.raises(ValueError, match="offsets not a non-decreasing"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 2]), codes, scales, divisor, "nvfp4")  # 2 rows of 3
    with pytest.raises(ValueError, match="grouped_gemm x: expected a CPU torch.bfloat16"):
        clib.grouped_gemm(x.float(), torch.tensor([0, 1, 3]), codes, scales, divisor, "nvfp4")
    with pytest.raises(ValueError, match=r"grouped_gemm codes: expected a CPU torch.uint8 tensor of shape \(2, 4, 512\)"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 3]), codes[..., :64], scales, divisor, "nvfp4")
    with pytest.raises(ValueError, match=r"grouped_gemm x: expected \[R, K\] with K a multiple of 16"):
        clib.grouped_gemm(x[:, :8], torch.tensor([0, 1, 3]), codes, scales, divisor, "nvfp4")
    with pytest.raises(ValueError, match="grouped_gemm scales"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 3]), codes, scales[..., :1], divisor, "nvfp4")
    with pytest.raises(ValueError, match="grouped_gemm impl"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 3]), codes, scales, divisor, "nvfp4", impl="fast")
    with pytest.raises(ValueError, match="'amx' multiplies the panels layout, got codes in the tiles layout"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 3]), codes, scales, divisor, "nvfp4", impl="amx")
    with pytest.raises(ValueError, match=r"grouped_gemm codes: expected \[E, N/16, K/4, 32\] \(panels layout\)"):
        clib.grouped_gemm(x, torch.tensor([0, 1, 3]), codes, scales, divisor, "nvfp4", layout=clib.Layout.PANELS)
    with pytest.raises(ValueError, match="the panels layout needs N a multiple of 16"):
        clib.kernel_layout(torch.zeros(1, 8, 16, dtype=torch.uint8), 16, clib.Layout.PANELS)


@pytest.mark.subprocess
def test_unavailable_kernel_is_reported_once_and_said_why(tmp_path):
    """TRACEFP4_CPU_KERNEL=0 (as on a machine without a compiler): available() is False, warns once
    with the reason, and the build command says the dense path is used."""
    code = ("import warnings; warnings.simplefilter('always');"
            "from tracefp4.formats import clib;"
            "import sys\nwith warnings.catch_warnings(record=True) as w:\n"
            "    a = clib.available(); b = clib.available()\n"
            "print(a, b, len(w), clib.unavailable_reason())")
    # a user's machine: without CI's requirement, under which the build command must fail instead
    env = {**{k: v for k, v in os.environ.items() if k != "TRACEFP4_REQUIRE_CLIB"}, "TRACEFP4_CPU_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[:3] == ["False", "False", "1"] and "TRACEFP4_CPU_KERNEL=0" in out.stdout
    built = subprocess.run([sys.executable, "-m", "tracefp4.formats.clib", "build"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0 and "dense torch path" in built.stdout


@pytest.mark.slow
@pytest.mark.subprocess
def test_build_is_cached_and_published_whole(tmp_path):
    """A fresh cache folder: the first build compiles and publishes the library under its final name
    only when complete (no temporary left), the second finds it."""
    env = {**os.environ, "TRACEFP4_CACHE_DIR": str(tmp_path)}
    code = "from tracefp4.formats import clib; print(clib.build())"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    path = first.stdout.strip()
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout.strip() == path
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]


@pytest.mark.parametrize("kernel", KERNELS, ids="-".join)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 2), (8, 8), (40, 2)])
def test_routed_form_is_the_grouped_gemm_of_the_sorted_pairs(kernel, fmt, tokens, top_k):
    """``routed_gemm`` groups the (token, slot) pairs by expert itself (a stable counting sort) and reads
    and writes rows in place: bit for bit the grouped kernel on the rows sorted and gathered in torch
    (a stable argsort), scattered back to pair order. Expert counts of 0 to 40 rows cover both code
    paths and empty experts."""
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    e, n, k = 8, 32, 256
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
    codes, scales, divisor = packed(w, fmt)
    block = 16 if fmt == "nvfp4" else 32
    layout, impl = clib.Layout(kernel[0]), kernel[1]
    kcodes, kscales = clib.kernel_layout(codes, block, layout), clib.kernel_scales(scales, layout)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)]) % 5  # experts 5-7 unused
    order = torch.argsort(ids.reshape(-1), stable=True)
    offs = offsets_of(torch.bincount(ids.reshape(-1), minlength=e).tolist())
    for per_token in (True, False):
        x = torch.randn(tokens if per_token else tokens * top_k, k, generator=g).to(torch.bfloat16)
        want = torch.empty(tokens * top_k, n, dtype=torch.bfloat16)
        want[order] = clib.grouped_gemm(x[order // top_k if per_token else order], offs, kcodes, kscales, divisor, fmt,
                                         layout=layout, impl=impl)
        got = clib.routed_gemm(x, ids, kcodes, kscales, divisor, fmt, per_token=per_token, layout=layout, impl=impl)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), per_token


def test_routed_form_names_bad_input():
    w = torch.randn(2, 16, 32).to(torch.bfloat16)
    codes, scales, divisor = packed(w, "nvfp4")
    codes = clib.kernel_layout(codes, 16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"expert index 2 of pair 3 \(token 1\) out of range \[0, 2\)"):
        clib.routed_gemm(x, torch.tensor([[0, 1], [1, 2], [0, 0]]), codes, scales, divisor, "nvfp4", per_token=True)
    with pytest.raises(ValueError, match=r"6 \(token, slot\) pairs need 3 rows of x \(one per token\), got 2"):
        clib.routed_gemm(x[:2], torch.tensor([[0, 1], [1, 0], [0, 0]]), codes, scales, divisor, "nvfp4", per_token=True)
    with pytest.raises(ValueError, match=r"routed_gemm ids: expected a CPU int64 tensor"):
        clib.routed_gemm(x, torch.tensor([[0, 1]], dtype=torch.int32), codes, scales, divisor, "nvfp4", per_token=True)


@pytest.mark.parametrize("layout", list(clib.Layout))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_weights_hold_the_quantizers_codes_in_either_layout(layout, fmt):
    """``pack`` (what both engines hold) in either layout: the quantizer's own codes and scale bytes
    come back from it, its shape is the weight's, and it is 0.5625 (NVFP4) or 0.53 (MXFP4) bytes per
    parameter plus one float32 per expert (K = 512: whole 16-block super-groups in both formats, which
    the tiles layout pads a row to; the panels layout never pads)."""
    from tracefp4.engines.experts.cpu_fp4 import pack

    w = torch.randn(3, 32, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    quantizer = NVFP4Quantizer("expert") if fmt == "nvfp4" else MXFP4Quantizer()
    p = pack(w, quantizer, layout)
    codes, scales, divisor = packed(w, fmt)
    assert p.layout is layout and p.shape == (3, 32, 512)
    assert torch.equal(p.standard_codes(), codes) and torch.equal(p.standard_scales(), scales)
    assert torch.equal(p.divisor, divisor)
    assert p.nbytes == w.numel() // 2 + w.numel() // quantizer.block + 4 * 3


def test_preferred_layout_follows_the_cpu_and_can_be_forced(monkeypatch):
    """panels where the AMX path runs (and N allows it), tiles elsewhere; TRACEFP4_CPU_LAYOUT forces
    either and a bad value is named."""
    monkeypatch.delenv("TRACEFP4_CPU_LAYOUT", raising=False)
    assert clib.preferred_layout(64) is (clib.Layout.PANELS if clib.has_amx() else clib.Layout.TILES)
    assert clib.preferred_layout(36) is clib.Layout.TILES  # not a multiple of 16
    monkeypatch.setenv("TRACEFP4_CPU_LAYOUT", "tiles")
    assert clib.preferred_layout(64) is clib.Layout.TILES
    monkeypatch.setenv("TRACEFP4_CPU_LAYOUT", "panels")
    assert clib.preferred_layout(64) is clib.Layout.PANELS
    monkeypatch.setenv("TRACEFP4_CPU_LAYOUT", "rows")
    with pytest.raises(ValueError, match="TRACEFP4_CPU_LAYOUT: expected one of"):
        clib.preferred_layout(64)
