"""Paged attention over a packed FP4 K/V cache: the names the engines use, from
:mod:`tracefp4.formats.clib.kv` (where the kernel's Python side lives)."""

from tracefp4.formats.clib.kv import HEAD_DIMS, PackedKV, available, decode_rows, dequantize_rows, paged_attention

__all__ = ["HEAD_DIMS", "PackedKV", "available", "decode_rows", "dequantize_rows", "paged_attention"]
