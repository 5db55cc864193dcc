"""How the plugin's vLLM KV cache holds K and V: packed FP4 rows, or the dequantized values.

:class:`KVStore` is the quantization config's ``kv_store`` choice. With ``packed`` each attention
layer's cache region (the bytes vLLM allocates for it: ``num_blocks x block_size`` slots of
:func:`slot_bytes` per KV head) is laid out as the planes :mod:`tracefp4.formats.ckv` reads
(:func:`planes`): the K and V rows exactly as the site quantizer returns them, NVFP4 codes two per
byte, one E4M3 scale per 16 and the row's FP32 amax (MXFP4: E8M0 scales per 32, no amax). vLLM's
block manager sizes blocks from :func:`slot_bytes`, so the same ``VLLM_CPU_KVCACHE_SPACE`` holds
``2 * D * 2 / slot_bytes`` times the tokens of a BF16 cache (3.37x at head dim 128).

This module does not import vLLM (the engine reads the enum before vLLM starts).
"""

from __future__ import annotations

import enum

import torch

from tracefp4.formats.ckv import PackedKV
from tracefp4.formats.constants import Format

__all__ = ["KVStore", "packable", "planes", "resolve_kv_store", "row_bytes", "slot_bytes"]


class KVStore(str, enum.Enum):
    """What the cache of an engine built with an FP4 K/V plan holds."""

    #: Packed FP4 rows (codes, block scales, row amax), read by the C paged attention
    #: (:mod:`tracefp4.formats.ckv`); serves calls whose K/V quantizer is the engine plan's only.
    PACKED = "packed"
    #: The dequantized FP4 values in the model's dtype, read by vLLM's own CPU attention; serves any
    #: plan per call (BF16 included), at BF16's bytes per token.
    VALUES = "values"


def packable(fmt: object) -> bool:
    """Whether a plan's ``kv_cache`` format can be stored packed (NVFP4 and MXFP4; FP8 and BF16 not)."""
    return fmt in (Format.NVFP4, Format.MXFP4)


def row_bytes(fmt: Format, head_dim: int) -> int:
    """Bytes of one packed row (one token, one KV head, K or V): codes, scales, and the FP32 amax
    for NVFP4."""
    fmt = Format(fmt)
    if not packable(fmt) or head_dim % fmt.block:
        raise ValueError(f"packed K/V: expected NVFP4 or MXFP4 rows of a head dim that is a multiple of the "
                         f"block, got {fmt.value} with head dim {head_dim}")
    return head_dim // 2 + head_dim // fmt.block + (4 if fmt is Format.NVFP4 else 0)


def slot_bytes(fmt: Format, head_dim: int) -> int:
    """Bytes per token and KV head of K and V together (vLLM's ``state_content_bytes``)."""
    return 2 * row_bytes(fmt, head_dim)


def planes(region: torch.Tensor, fmt: Format, num_kv_heads: int, head_dim: int) -> tuple[PackedKV, PackedKV]:
    """The K and V caches (views, no copy) over one layer's contiguous cache ``region`` (any dtype,
    ``slots * num_kv_heads * slot_bytes`` bytes). Planes in order: the FP32 amaxes first (4-byte
    alignment whatever the head dim), then codes, then scales; each ``[slots, Hkv, ...]``."""
    fmt = Format(fmt)
    if not region.is_contiguous() or not region.is_cpu:
        raise ValueError(f"packed K/V cache: expected a contiguous CPU region, got strides {region.stride()} on "
                         f"{region.device}")
    flat = region.view(torch.uint8).reshape(-1)
    per_slot = num_kv_heads * slot_bytes(fmt, head_dim)
    if flat.numel() % per_slot or flat.data_ptr() % 4:
        raise ValueError(f"packed K/V cache: a region of {flat.numel()} bytes at {flat.data_ptr():#x} is not a 4-byte "
                         f"aligned whole number of {per_slot}-byte slots ({num_kv_heads} KV heads of dim {head_dim})")
    slots = flat.numel() // per_slot
    cursor = [0]

    def take(width: int) -> torch.Tensor:
        start, cursor[0] = cursor[0], cursor[0] + slots * num_kv_heads * width
        return flat[start:cursor[0]].view(slots, num_kv_heads, width)

    nv = fmt is Format.NVFP4
    amax = [take(4).view(torch.float32).squeeze(-1) if nv else None for _ in range(2)]
    codes = [take(head_dim // 2) for _ in range(2)]
    scales = [take(head_dim // fmt.block) for _ in range(2)]
    k, v = (PackedKV(codes[i], scales[i], amax[i], fmt) for i in range(2))
    return k, v


def resolve_kv_store(plan, keep_bf16: bool, kv_store: KVStore | str | None) -> KVStore:
    """The store of an engine built with ``plan`` (a PrecisionPlan or None): ``kv_store`` as given,
    else ``packed`` where the plan's K/V is NVFP4 or MXFP4 and the engine serves that plan only
    (``keep_bf16`` engines serve BF16 calls too, which a packed cache cannot hold: ``values``).
    Raises ValueError for ``packed`` with a plan whose K/V is not FP4."""
    fmt = None if plan is None else plan.kv_cache
    if kv_store is None:
        return KVStore.PACKED if packable(fmt) and not keep_bf16 else KVStore.VALUES
    try:
        store = KVStore(kv_store)
    except ValueError:
        raise ValueError(f"kv_store: expected one of {[s.value for s in KVStore]}, got {kv_store!r}") from None
    if store is KVStore.PACKED and not packable(fmt):
        raise ValueError(f"kv_store='packed' holds NVFP4 or MXFP4 K/V rows; the plan {plan!r} stores K/V as "
                         f"{getattr(fmt, 'value', fmt)!r} (use kv_store='values')")
    return store
