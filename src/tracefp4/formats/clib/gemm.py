"""The packed-FP4 grouped GEMM for the CPU (``csrc/kernels.c``, ``tiles.h``, ``panels.h``).

:func:`grouped_gemm` multiplies bf16 activation rows, grouped by expert, with packed FP4 expert
weights (two codes per byte, one scale byte per block, one FP32 divisor per expert) in one call per
GEMM, on the thread count the caller set (torch's), and returns bf16 rows with round-to-nearest-even:

    out[r, n] = bf16( fl32( sum_k x[r, k] * value(code[e, n, k]) * scale[e, n, k // block] ) / divisor[e] )

This is the GEMM of the exact dequantized operands up to the order of the float32 additions (see
the C file for why every product is exact); the tests hold it against the readable float64 oracle
within :func:`accumulation_bound`. The weights are taken in one of the kernel's layouts
(:mod:`tracefp4.formats.clib.layout`). The code paths are chosen at run time (:class:`Impl`): AMX for
the ``panels`` layout where the CPU and OS run it, AVX-512 BF16 where the CPU has it, portable C
elsewhere.
"""

from __future__ import annotations

import ctypes

import torch

from tracefp4.formats.clib.call import (
    SCALE_TABLES,
    Impl,
    call,
    check_cpu,
    first_bad,
    impl_name,
    impl_of,
    threads_for,
    tracing,
)
from tracefp4.formats.clib.layout import Layout, code_bytes
from tracefp4.formats.constants import Format

__all__ = ["GEMM_IMPLS", "accumulation_bound", "gemm_out_features", "grouped_gemm", "routed_gemm"]

#: The GEMM's code paths: AMX multiplies the panels layout (for every expert, where ``auto`` gives
#: experts with one or two rows to the AVX-512 path).
GEMM_IMPLS = (Impl.AUTO, Impl.PORTABLE, Impl.AVX512, Impl.AMX)
_MESSAGES = {-1: "bad shapes (N a multiple of 4 for tiles, 16 for panels; K of the block) or an implementation "
                 "this CPU or layout lacks",
             -2: "offsets not a non-decreasing 0..R partition"}
_LAYOUT_IDS = {Layout.TILES: 0, Layout.PANELS: 1}


def gemm_out_features(codes: torch.Tensor, layout: Layout | str) -> int:
    """N, the output features of weights ``codes`` held in ``layout``."""
    return codes.shape[1] * (16 if Layout(layout) is Layout.PANELS else 4)


def _check_codes(name: str, codes: object, layout: Layout) -> None:
    dims = 4 if layout is Layout.PANELS else 3
    if not isinstance(codes, torch.Tensor) or codes.dim() != dims:
        want = "[E, N/16, K/4, 32]" if dims == 4 else "[E, N/4, bytes]"
        raise ValueError(f"{name} codes: expected {want} ({layout.value} layout), got "
                         f"{tuple(getattr(codes, 'shape', ())) or type(codes).__name__}")


def _operands(name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor,
              fmt: Format | str, layout: Layout | str, impl: Impl | str) -> tuple[Format, Layout, Impl, int, int, int]:
    """Check the operands both GEMMs share; returns the format, layout, implementation, E, N and K."""
    fmt, layout = Format(fmt), Layout(layout)
    block = fmt.block
    _check_codes(name, codes, layout)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"{name} x: expected [R, K] with K a multiple of {block}, got "
                         f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    e, groups, k = codes.shape[0], codes.shape[1], x.shape[1]
    check_cpu(name, "x", x, torch.bfloat16, (x.shape[0], k))
    n = gemm_out_features(codes, layout)
    if layout is Layout.PANELS:
        check_cpu(name, "codes", codes, torch.uint8, (e, groups, k // 4, 32))
        check_cpu(name, "scales", scales, torch.uint8, (e, groups, k // block, 16))
    else:
        check_cpu(name, "codes", codes, torch.uint8, (e, groups, 4 * code_bytes(k, block)))
        check_cpu(name, "scales", scales, torch.uint8, (e, n, k // block))
    check_cpu(name, "divisor", divisor, torch.float32, (e,))
    impl = impl_of(name, impl, GEMM_IMPLS)
    if impl is Impl.AMX and layout is not Layout.PANELS:
        raise ValueError(f"{name} impl: 'amx' multiplies the panels layout, got codes in the {layout.value} layout")
    return fmt, layout, impl, e, n, k


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 divisor: torch.Tensor, fmt: Format | str, *, layout: Layout | str = Layout.TILES,
                 threads: int | None = None, impl: Impl | str = "auto") -> torch.Tensor:
    """``x`` bf16 ``[R, K]`` (rows of expert e at ``offsets[e]:offsets[e+1]``) times the packed
    weights (``codes`` and ``scales`` uint8 in ``layout``; ``divisor`` float32 ``[E]``) -> bf16
    ``[R, N]`` (module docstring). ``threads``: default torch's intra-op count.
    Raises RuntimeError when the library is unavailable."""
    if tracing():
        return torch.ops.tracefp4.grouped_gemm(x, offsets, codes, scales, divisor, Format(fmt).value,
                                               Layout(layout).value, threads or 0, impl_name(impl))
    fmt, layout, impl, e, n, k = _operands("grouped_gemm", x, codes, scales, divisor, fmt, layout, impl)
    check_cpu("grouped_gemm", "offsets", offsets, torch.int64, (e + 1,))
    x, offsets, codes, scales, divisor = (t.contiguous() for t in (x, offsets, codes, scales, divisor))
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    call("grouped_gemm", x.data_ptr(), offsets.data_ptr(), codes.data_ptr(), scales.data_ptr(),
         SCALE_TABLES[fmt].ctypes.data, fmt.block, divisor.data_ptr(), out.data_ptr(), x.shape[0], e, n, k,
         _LAYOUT_IDS[layout], threads_for(threads), impl.value, messages=_MESSAGES,
         what=lambda: f"x {tuple(x.shape)}, codes {tuple(codes.shape)}, impl {impl.name.lower()}, "
              f"offsets {offsets.tolist()[:4]}...")
    return out


def _pairs(x: torch.Tensor, ids: object, per_token: bool) -> tuple[int, int]:
    """The (token, slot) pairs ``ids`` names and how many each row of ``x`` feeds, checked against x."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise ValueError(f"routed_gemm ids: expected a CPU int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    pairs = ids.numel()
    fanout = ids.shape[-1] if per_token and ids.dim() else 1
    if x.shape[0] * fanout != pairs:
        raise ValueError(f"routed_gemm: {pairs} (token, slot) pairs need {pairs // fanout if pairs % fanout == 0 else '?'} "
                         f"rows of x ({'one per token' if per_token else 'one per pair'}), got {x.shape[0]}")
    return pairs, fanout


def routed_gemm(x: torch.Tensor, ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, divisor: torch.Tensor,
                fmt: Format | str, *, per_token: bool, layout: Layout | str = Layout.TILES, threads: int | None = None,
                impl: Impl | str = "auto") -> torch.Tensor:
    """The routed form of :func:`grouped_gemm`: ``ids`` int64 ``[T, top_k]`` (or ``[P]`` with
    ``per_token=False``) names the expert of each (token, slot) pair ``f = t * top_k + j``, and the
    result is bf16 ``[P, N]`` in pair order, ``P = ids.numel()``. ``x`` is ``[T, K]``, one row per
    token that each of its pairs multiplies (``per_token``: the gate-up GEMM), or ``[P, K]``, one row
    per pair (the down GEMM). The kernel groups the pairs by expert itself (no sort, gather or scatter
    around the call); the numbers are those of :func:`grouped_gemm` on the grouped rows."""
    if tracing():
        return torch.ops.tracefp4.routed_gemm(x, ids, codes, scales, divisor, Format(fmt).value, per_token,
                                              Layout(layout).value, threads or 0, impl_name(impl))
    fmt, layout, impl, e, n, k = _operands("routed_gemm", x, codes, scales, divisor, fmt, layout, impl)
    pairs, fanout = _pairs(x, ids, per_token)
    x, ids, codes, scales, divisor = (t.contiguous() for t in (x, ids, codes, scales, divisor))
    out = torch.empty(pairs, n, dtype=torch.bfloat16)
    ids_flat = ids.reshape(-1)
    out_of_range = {-5: lambda f: f"routed_gemm: expert index {int(ids_flat[f])} of pair {f} (token {f // fanout}) "
                                  f"out of range [0, {e})"}
    bad = first_bad()
    call("routed_gemm", x.data_ptr(), ids.data_ptr(), fanout, codes.data_ptr(), scales.data_ptr(),
         SCALE_TABLES[fmt].ctypes.data, fmt.block, divisor.data_ptr(), out.data_ptr(), pairs, e, n, k,
         _LAYOUT_IDS[layout], threads_for(threads), impl.value, ctypes.byref(bad), messages=_MESSAGES,
         explain=out_of_range, index=bad,
         what=lambda: f"x {tuple(x.shape)}, codes {tuple(codes.shape)}, impl {impl.name.lower()}, {pairs} pairs")
    return out


def accumulation_bound(x: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, divisor: torch.Tensor
                       ) -> torch.Tensor:
    """The largest ``|fl32 sum - exact sum| / divisor`` any order of float32 additions can give, per
    output: ``gamma_(K-1) * sum_k |x w| / divisor`` with ``gamma_n = n u / (1 - n u)``, u = 2^-24
    (Higham, Accuracy and Stability, eq. 4.4); ``weights`` float64 ``[E, N, K]``."""
    k = weights.shape[-1]
    u = 2.0**-24
    gamma = (k - 1) * u / (1 - (k - 1) * u)
    xa = x.to(torch.float64).abs()
    out = torch.empty(x.shape[0], weights.shape[1], dtype=torch.float64)
    for e in range(weights.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = gamma * (xa[lo:hi] @ weights[e].abs().T) / float(divisor[e])
    return out

