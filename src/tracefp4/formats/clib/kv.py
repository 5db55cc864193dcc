"""Paged attention over a packed FP4 K/V cache, in C (``csrc/kv_attention.h``).

The cache (:class:`PackedKV`, one for K and one for V) holds per slot and KV head the row exactly as
the site kernel (:func:`tracefp4.formats.clib.site.quantize_into`) writes it: NVFP4 codes two per byte,
E4M3 block scales (one per 16) and the row's FP32 amax; or MXFP4 codes with E8M0 scales (one per 32)
and no amax. The rows the kernel attends over are the exact dequantized rows, in bf16 as a cache
stores them (:func:`dequantize_rows`):

    NVFP4: bf16( fl32( e2m1(code) * e4m3(scale) ) / S_enc(amax) )      MXFP4: e2m1(code) * 2^(scale - 127)

and the result is attention over them up to the order of the float32 additions and the float32
exponential (the portable C path defines the order; the AVX-512 path fuses the q . k and p . v
accumulations, deterministic per machine; tests/test_kv_attention.py gives the bound both meet). Layout as vLLM's
paged cache: slots ``num_blocks * block_size``, ``block_table [seqs, max_blocks]`` int32, ``seq_lens``
``[seqs]`` int32. Query row r (``q [R, Hq, D]``) attends to keys ``0 .. q_len[r] - 1`` of sequence
``q_seq[r]``: decode gives each sequence one row with ``q_len`` its length; a prompt (prefill runs
the same kernel) gives each of its tokens a row with ``q_len`` its position plus one (causal).
Sliding windows are refused. GQA: Hq a multiple of Hkv (at most 32 query heads per KV head).
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from tracefp4.formats.clib.call import (
    SCALE_TABLES,
    Impl,
    call,
    describe,
    first_bad,
    impl_name,
    impl_of,
    threads_for,
    tracing,
)
from tracefp4.formats.clib.loader import library
from tracefp4.formats.containers import MXFP4, NVFP4
from tracefp4.formats.constants import Format
from tracefp4.formats.dequant import dequantize_mxfp4, dequantize_nvfp4

__all__ = ["HEAD_DIMS", "PackedKV", "available", "decode_rows", "dequantize_rows", "paged_attention"]

#: Head dims the kernel takes (multiples of 16 up to 256; these are the tested ones).
HEAD_DIMS = (64, 128, 256)
_MESSAGES = {-1: "shapes or implementation not taken (D a multiple of 16 up to 256, Hq a multiple of Hkv with at most "
                 "32 query heads per KV head, block_size >= 1) or an implementation this CPU lacks"}


@dataclasses.dataclass(frozen=True)
class PackedKV:
    """One packed cache (K or V): ``codes [slots, Hkv, D/2]`` uint8, ``scales [slots, Hkv, D/block]``
    (E4M3 or E8M0 bytes), ``amax [slots, Hkv]`` float32 (NVFP4; None for MXFP4). ``fmt`` names the
    format; slots = num_blocks * block_size."""

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor | None
    fmt: Format = Format.NVFP4

    @property
    def head_dim(self) -> int:
        return 2 * self.codes.shape[-1]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", Format(self.fmt))

    def check(self, name: str) -> None:
        """Refuse tensors the kernel cannot read, naming ``name`` and the field."""
        fmt = self.fmt
        if not fmt.fp4:
            raise ValueError(f"{name}.fmt: packed K/V holds NVFP4 or MXFP4 rows, got {fmt.value!r}")
        c = self.codes
        if not isinstance(c, torch.Tensor) or c.dtype != torch.uint8 or c.dim() != 3 or not c.is_cpu:
            raise ValueError(f"{name}.codes: expected CPU uint8 [slots, Hkv, D/2], got {describe(c)}")
        shape = (*c.shape[:2], self.head_dim // fmt.block)
        s = self.scales
        if not isinstance(s, torch.Tensor) or s.element_size() != 1 or tuple(s.shape) != shape or not s.is_cpu:
            raise ValueError(f"{name}.scales: expected CPU one-byte {shape}, got {describe(s)}")
        a = self.amax
        if fmt is Format.MXFP4 and a is not None:
            raise ValueError(f"{name}.amax: MXFP4 rows have no amax, got {describe(a)}")
        if fmt is Format.NVFP4 and (not isinstance(a, torch.Tensor) or a.dtype != torch.float32
                                    or tuple(a.shape) != tuple(c.shape[:2]) or not a.is_cpu):
            raise ValueError(f"{name}.amax: expected CPU float32 {tuple(c.shape[:2])}, got {describe(a)}")


def available() -> bool:
    """Whether the C library is loaded (callers fall back to dequantize-then-attention otherwise)."""
    return library() is not None


def dequantize_rows(kv: PackedKV) -> torch.Tensor:
    """The exact rows the kernel attends over, bf16 ``[slots, Hkv, D]``: the readable reference's
    dequantized value (:func:`tracefp4.formats.dequant.dequantize_nvfp4` / ``dequantize_mxfp4``,
    float32) rounded to bf16, as a cache of the model's dtype holds it (the fallback path and tests)."""
    kv.check("dequantize_rows kv")
    if kv.fmt is Format.MXFP4:
        return dequantize_mxfp4(MXFP4(kv.codes, kv.scales.view(torch.uint8)), torch.bfloat16)
    q = NVFP4(kv.codes, kv.scales.view(torch.float8_e4m3fn), kv.amax.unsqueeze(-1))
    return dequantize_nvfp4(q, torch.bfloat16)


def decode_rows(kv: PackedKV, *, key: bool = True, impl: Impl | str = "auto") -> torch.Tensor:
    """The rows as :func:`paged_attention` decodes them, bf16 ``[slots, Hkv, D]``: as K rows (``key``;
    the AVX-512 path decodes those straight to bf16) or V rows (float32 there), on path ``impl``.
    Equal to :func:`dequantize_rows` bit for bit on every path: the tests check the decode stage apart
    from the arithmetic after it, which differs between the paths by rounding."""
    kv.check("decode_rows kv")
    impl = impl_of("decode_rows", impl)
    codes, scales = kv.codes.contiguous(), kv.scales.contiguous()
    amax = None if kv.amax is None else kv.amax.contiguous()
    slots, hkv, d = codes.shape[0], codes.shape[1], kv.head_dim
    out = torch.empty(slots, hkv, d, dtype=torch.bfloat16)
    call("kv_decode_rows", codes.data_ptr(), scales.data_ptr(), None if amax is None else amax.data_ptr(), slots * hkv,
         d, SCALE_TABLES[kv.fmt].ctypes.data, kv.fmt.block, int(key), impl.value, out.data_ptr(),
         messages=_MESSAGES, name="decode_rows", what=lambda: f"kv {tuple(codes.shape)}, impl {impl.name.lower()!r}")
    return out


def _int32(name: str, t: object, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim or not t.is_cpu:
        raise ValueError(f"paged_attention {name}: expected a CPU int32 tensor of {dim} dims, got {describe(t)}")
    return t.contiguous()


def _checked(q: torch.Tensor, k: PackedKV, v: PackedKV, block_size: int, sliding_window: int | None) -> None:
    if sliding_window is not None:
        raise ValueError(f"paged_attention sliding_window: sliding-window attention is not implemented by the packed "
                         f"K/V kernel (got {sliding_window}); only full causal attention")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or not q.is_cpu:
        raise ValueError(f"paged_attention q: expected CPU bf16 [R, Hq, D], got {describe(q)}")
    k.check("paged_attention k")
    v.check("paged_attention v")
    if k.fmt is not v.fmt or k.codes.shape != v.codes.shape:
        raise ValueError(f"paged_attention v: expected the layout of k ({k.fmt.value} "
                         f"{tuple(k.codes.shape)}), got {v.fmt.value} {tuple(v.codes.shape)}")
    slots, hkv, half = k.codes.shape
    if q.shape[2] != 2 * half or q.shape[1] % hkv:
        raise ValueError(f"paged_attention q: expected [R, a multiple of {hkv}, {2 * half}] for a cache of {hkv} KV "
                         f"heads of dim {2 * half}, got {tuple(q.shape)}")
    if not isinstance(block_size, int) or block_size < 1 or slots % block_size:
        raise ValueError(f"paged_attention block_size: expected a positive divisor of the cache's {slots} slots, "
                         f"got {block_size!r}")


def _explain(seq_lens: torch.Tensor, q_seq: torch.Tensor, q_len: torch.Tensor, blocks: int, per_seq: int) -> dict:
    """The kernel's index errors: a sequence's blocks out of range (-5), a query row's (-6)."""
    return {
        -5: lambda s: (f"paged_attention block_table: sequence {s} (length {int(seq_lens[s])}) names a block outside "
                       f"[0, {blocks}) or is longer than its {per_seq} blocks"),
        -6: lambda r: (f"paged_attention q_seq/q_len: query row {r} (sequence {int(q_seq[r])}, {int(q_len[r])} keys) "
                       f"is out of range of the {seq_lens.shape[0]} sequences' lengths"),
    }


def paged_attention(q: torch.Tensor, k: PackedKV, v: PackedKV, *, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    q_seq: torch.Tensor, q_len: torch.Tensor, block_size: int, scale: float,
                    sliding_window: int | None = None, threads: int | None = None, impl: Impl | str = "auto"
                    ) -> torch.Tensor:
    """Attention of query rows ``q`` bf16 ``[R, Hq, D]`` over the packed cache ``k``/``v`` (see the
    module docstring for the layout and the query rows) -> float32 ``[R, Hq, D]`` (0 for a row with
    no keys). ``scale`` multiplies the scores (1/sqrt(D) usually). ``threads``: default torch's.
    Raises ValueError naming the argument on bad input, RuntimeError without the library."""
    if tracing():
        return torch.ops.tracefp4.paged_attention(
            q, k.codes, k.scales, k.amax, v.codes, v.scales, v.amax, Format(k.fmt).value, block_table, seq_lens,
            q_seq, q_len, block_size, float(scale), threads or 0, impl_name(impl))
    _checked(q, k, v, block_size, sliding_window)
    impl = impl_of("paged_attention", impl)
    block_table, seq_lens = _int32("block_table", block_table, 2), _int32("seq_lens", seq_lens, 1)
    q_seq, q_len = _int32("q_seq", q_seq, 1), _int32("q_len", q_len, 1)
    rows, hq, d = q.shape
    if block_table.shape[0] != seq_lens.shape[0] or q_seq.shape[0] != rows or q_len.shape[0] != rows:
        raise ValueError(f"paged_attention: block_table {tuple(block_table.shape)}, seq_lens {tuple(seq_lens.shape)}, "
                         f"q_seq {tuple(q_seq.shape)}, q_len {tuple(q_len.shape)} do not fit {rows} query rows")
    q = q.contiguous()
    kc, ks, vc, vs = (t.contiguous() for t in (k.codes, k.scales, v.codes, v.scales))
    ka, va = (None if t is None else t.contiguous() for t in (k.amax, v.amax))
    out = torch.empty(rows, hq, d, dtype=torch.float32)
    blocks = kc.shape[0] // block_size
    bad = first_bad()
    call("kv_attention", q.data_ptr(), rows, hq, k.codes.shape[1], d, kc.data_ptr(), ks.data_ptr(),
         None if ka is None else ka.data_ptr(), vc.data_ptr(), vs.data_ptr(), None if va is None else va.data_ptr(),
         SCALE_TABLES[k.fmt].ctypes.data, k.fmt.block, blocks, block_size, block_table.data_ptr(),
         block_table.shape[0], block_table.shape[1], seq_lens.data_ptr(), q_seq.data_ptr(), q_len.data_ptr(),
         float(scale), out.data_ptr(), threads_for(threads), impl.value, ctypes.byref(bad),
         messages=_MESSAGES, explain=_explain(seq_lens, q_seq, q_len, blocks, block_table.shape[1]), index=bad,
         name="paged_attention", what=lambda: f"q {tuple(q.shape)}, impl {impl.name.lower()!r}")
    return out
