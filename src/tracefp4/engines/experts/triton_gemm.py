"""The Triton routed GEMM: packed E2M1 codes and E4M3/E8M0 block scales decoded to bf16 in
registers, ``tl.dot`` with float32 accumulation, the expert's float32 divisor after the sum, then bf16
(:func:`routed_fp4_gemm`); the same kernel over bf16 weights with no divisor is the BF16 rollout's
GEMM (:func:`routed_bf16_gemm`), so the two are compared on one kernel.

Imported only where the Triton backend runs (CUDA, or Triton's interpreter on the CPU in the tests),
so the CPU paths never import triton.

Operands in the standard layout the quantizer returns: codes ``[E, N, K/2]`` (element 2i in the low
nibble), scale bytes ``[E, N, K/block]``. A program multiplies a ``[BLOCK_M, BLOCK_K]`` tile of rows
with a ``[BLOCK_N, BLOCK_K]`` tile of one expert's weights: each output channel's codes are
``BLOCK_K / 2`` contiguous bytes, so a K-contiguous row is what a GPU loads coalesced; the CPU's
tiles/panels layouts exist for AVX-512 and AMX register shapes and would only scatter those loads.

Grouping by expert without a host round trip: the pairs are sorted by expert on the device
(:attr:`~tracefp4.engines.experts.base.Routing.grouped`); the launch grid is sized from shapes alone,
``cdiv(pairs, BLOCK_M) + E`` row blocks (an upper bound of ``sum_e cdiv(count_e, BLOCK_M)``), and
each program finds its expert by counting the cumulative row-block ends at or below its index;
programs past the last expert's blocks return at once. Rows are read through the sort order and the
results written to their pair's row, so the output is in pair order with no gather or scatter around
the call.

Exactness: ``value(code) * scale`` has at most 2 + 4 significant bits (E4M3; E8M0 scales 1) and is
exact in bf16 (bf16 subnormal block values included, down to 2^-133, where the device keeps
subnormal bf16 operands: checked by ``scripts/gpu_check.py``); bf16 products are exact in float32, so
the only rounding before the epilogue is in the float32 additions, whose order ``tl.dot`` chooses; the
epilogue's ``tl.div_rn`` is IEEE division and the cast to bf16 rounds to nearest even. The result is
``grouped_gemm_reference`` wherever the partial sums are exact, and within the any-order bound of
``tests/test_fp4_gemm.py`` elsewhere.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from tracefp4.formats.constants import E2M1_VALUES, E4M3_VALUES, E8M0_VALUES, Format

__all__ = ["BLOCK_M", "interpreting", "routed_bf16_gemm", "routed_fp4_gemm"]

#: Rows per program: decode steps route a few rows to each expert, and 16 is tl.dot's smallest tile.
BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 64  # a multiple of both FP4 block sizes, so a K tile holds whole scale blocks
_EXACT = dict(enable_fp_fusion=False)  # nothing multiplies into an addition outside tl.dot; kept exact by rule


def interpreting() -> bool:
    """True when the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_routed_kernel).__name__ == "InterpretedFunction"


@triton.jit
def _expert_of_program(block_ends_ptr, E, E_POW2: tl.constexpr):
    """(expert, first row block of that expert) of this program: experts' row blocks are numbered in
    expert order, ``block_ends`` holds their inclusive cumulative counts; expert E means past the end."""
    pid = tl.program_id(0)
    ev = tl.arange(0, E_POW2)
    ends = tl.load(block_ends_ptr + ev, mask=ev < E, other=2147483647)
    e = tl.sum((ends <= pid).to(tl.int32), axis=0)
    first = tl.load(block_ends_ptr + e - 1, mask=e > 0, other=0)
    return e, pid - first


@triton.jit
def _bf16_rne(v):
    """float32 -> bf16 bit patterns (int16), round to nearest even, every NaN as 0x7FC0 (the CPU
    backend's NaN; a GPU's NaN sign and payload are arbitrary): by integer arithmetic, because
    Triton's interpreter truncates where a GPU rounds, and the same bits must come out of both."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)  # the output's view


@triton.jit
def _widen_bf16(x):
    """bf16 as float32, exactly, by a shift (the interpreter's tl.dot misreads bf16 operands)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, e2m1_ptr, scale_values_ptr, e, n, k0, N, K,
                 FMT_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 ``[BLOCK_N, BLOCK_K]``: ``value(code) * block scale`` of expert e's rows n, columns from k0
    (exact in bf16; zeros past N and K)."""
    half = K // 2
    kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    nmask = (n < N)[:, None]
    byte = tl.load(codes_ptr + (e * N + n[:, None]).to(tl.int64) * half + kh[None, :],
                   mask=nmask & (kh < half)[None, :], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K))  # element 2i: the low nibble
    nb = K // FMT_BLOCK
    kb = k0 // FMT_BLOCK + tl.arange(0, BLOCK_K // FMT_BLOCK)
    sbyte = tl.load(scales_ptr + (e * N + n[:, None]).to(tl.int64) * nb + kb[None, :],
                    mask=nmask & (kb < nb)[None, :], other=0).to(tl.int32)
    scale = tl.load(scale_values_ptr + sbyte)  # float32 [BLOCK_N, BLOCK_K / FMT_BLOCK]
    v = tl.reshape(tl.load(e2m1_ptr + codes), (BLOCK_N, BLOCK_K // FMT_BLOCK, FMT_BLOCK)) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_N, BLOCK_K))  # float32, exact in bf16: 2 significant bits times 4


@triton.jit
def _routed_kernel(x_ptr, order_ptr, offsets_ptr, block_ends_ptr, codes_ptr, scales_ptr, e2m1_ptr,
                   scale_values_ptr, div_ptr, out_ptr, N, K, E, FANOUT,
                   DENSE: tl.constexpr, FMT_BLOCK: tl.constexpr, E_POW2: tl.constexpr, WIDE_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """DENSE: ``codes_ptr`` is a bf16 ``[E, N, K]`` weight (the scale pointers unused); else packed FP4."""
    e, local = _expert_of_program(block_ends_ptr, E, E_POW2)
    if e >= E:
        return  # a spare row block of the shape-sized grid
    row = tl.load(offsets_ptr + e) + local * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = row < tl.load(offsets_ptr + e + 1)
    pair = tl.load(order_ptr + row, mask=rmask, other=0)
    src = (pair // FANOUT).to(tl.int64)  # FANOUT top_k: a token's row feeds its pairs; 1: a row per pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + src[:, None] * K + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)
        if DENSE:
            w = tl.load(codes_ptr + (e * N + n[:, None]).to(tl.int64) * K + k[None, :],
                        mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            if WIDE_DOT:
                w = _widen_bf16(w)
        else:
            w = _weight_tile(codes_ptr, scales_ptr, e2m1_ptr, scale_values_ptr, e, n, k0, N, K,
                             FMT_BLOCK, BLOCK_N, BLOCK_K)
            if not WIDE_DOT:
                w = w.to(tl.bfloat16)  # exact
        if WIDE_DOT:  # the interpreter: exact float32 operands, products exact as in bf16 x bf16
            acc = tl.dot(_widen_bf16(a), tl.trans(w), acc, input_precision="ieee", out_dtype=tl.float32)
        else:  # the device: bf16 tensor cores, float32 accumulation
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.float32)
    out = tl.div_rn(acc, tl.full((BLOCK_M, BLOCK_N), 1.0, tl.float32) * tl.load(div_ptr + e))
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + n[None, :], _bf16_rne(out),
             mask=rmask[:, None] & (n < N)[None, :])


@functools.lru_cache(maxsize=None)
def _tables(fmt: Format, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 value of each E2M1 code (sign in bit 3) and of each scale byte of ``fmt``, on ``device``."""
    e2m1 = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)
    scales = E4M3_VALUES if fmt is Format.NVFP4 else E8M0_VALUES
    return torch.from_numpy(e2m1).to(device), torch.from_numpy(np.asarray(scales, dtype=np.float32)).to(device)


def _check_device(what: str, *tensors: torch.Tensor) -> None:
    on = {t.device for t in tensors}
    if len(on) != 1 or not (tensors[0].is_cuda or (interpreting() and tensors[0].device.type == "cpu")):
        raise ValueError(f"{what}: operands on {sorted(map(str, on))}; expected one CUDA device "
                         "(CPU tensors only under TRITON_INTERPRET=1)")


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor, block: int) -> None:
    _check_device("routed_fp4_gemm", x, codes, scales, divisor)
    if x.dtype != torch.bfloat16 or codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"routed_fp4_gemm: expected bf16 x and uint8 codes and scales, got {x.dtype}, "
                         f"{codes.dtype}, {scales.dtype}")
    e, n, half = codes.shape
    k = 2 * half
    if x.shape[-1] != k or k % block or tuple(scales.shape) != (e, n, k // block) or tuple(divisor.shape) != (e,):
        raise ValueError(f"routed_fp4_gemm: shapes x {tuple(x.shape)}, codes {tuple(codes.shape)}, scales "
                         f"{tuple(scales.shape)}, divisor {tuple(divisor.shape)} do not make one [E, N, K] "
                         f"weight in blocks of {block}")


def _launch(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, n: int, operands: tuple, *,
            fanout: int, dense: bool, block: int) -> torch.Tensor:
    """bf16 ``[P, N]``: the kernel over ``operands`` (weight, scales, E2M1 table, scale table, divisor)."""
    e = offsets.numel() - 1
    pairs = order.numel()
    out = torch.empty(pairs, n, dtype=torch.bfloat16, device=x.device)
    if pairs == 0 or n == 0:
        return out
    counts = offsets[1:] - offsets[:-1]
    block_ends = torch.cumsum(torch.div(counts + (BLOCK_M - 1), BLOCK_M, rounding_mode="floor"), 0)
    grid = (triton.cdiv(pairs, BLOCK_M) + e, triton.cdiv(n, _BLOCK_N))
    _routed_kernel[grid](
        x.contiguous(), order, offsets, block_ends.to(torch.int32), *operands,
        out.view(torch.int16), n, x.shape[-1], e, fanout,  # the kernel writes bf16 bit patterns (_bf16_rne)
        DENSE=dense, FMT_BLOCK=block, E_POW2=triton.next_power_of_2(e), WIDE_DOT=interpreting(), BLOCK_M=BLOCK_M,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, **_EXACT,
    )
    return out


def routed_fp4_gemm(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor, divisor: torch.Tensor, fmt: Format, *, fanout: int) -> torch.Tensor:
    """bf16 ``[P, N]`` in pair order: pair p's row of ``x`` (row ``p // fanout``) times expert e's
    weights over ``divisor[e]``, where ``order`` (int64 ``[P]``, the pairs sorted by expert) and
    ``offsets`` (int64 ``[E + 1]``) group the pairs. No host synchronisation: the grid comes from the
    shapes (see the module docstring)."""
    fmt = Format(fmt)
    _check(x, codes, scales, divisor, fmt.block)
    e2m1, scale_values = _tables(fmt, str(x.device))
    operands = (codes.contiguous(), scales.contiguous(), e2m1, scale_values, divisor.to(torch.float32).contiguous())
    return _launch(x, order, offsets, codes.shape[1], operands, fanout=fanout, dense=False, block=fmt.block)


def routed_bf16_gemm(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, *,
                     fanout: int) -> torch.Tensor:
    """:func:`routed_fp4_gemm` over bf16 weights ``[E, N, K]``: ``bf16(fl32(x @ w[e].T))``, what a bf16
    ``F.linear`` computes up to the order of the float32 additions."""
    _check_device("routed_bf16_gemm", x, weight)
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.dim() != 3 or x.shape[-1] != weight.shape[2]:
        raise ValueError(f"routed_bf16_gemm: expected bf16 x [.., K] and weights [E, N, K], got x {x.dtype} "
                         f"{tuple(x.shape)}, weights {weight.dtype} {tuple(weight.shape)}")
    w = weight.contiguous()
    ones = torch.ones(weight.shape[0], dtype=torch.float32, device=x.device)  # x / 1 == x: no divisor
    return _launch(x, order, offsets, weight.shape[1], (w, w, w, w, ones), fanout=fanout, dense=True, block=16)
