"""The plugin's attention backend over a packed FP4 KV cache (``kv_store="packed"``, :mod:`.kv_layout`).

Selected by the quantization config (:meth:`~tracefp4.engines.vllm.quant.TraceFP4Config.get_quant_method`
calls :func:`install_packed_attention` on every attention layer when the plan's K/V is NVFP4 or MXFP4):
vLLM's CPU platform always names its own CPU attention, so the layer's backend and impl are replaced
after the layer is built, before vLLM asks the layer for its KV cache spec. Per layer:

* **Spec** (:meth:`PackedKVBackend.customize_spec`): ``state_content_bytes`` = K and V packed rows
  per token and KV head (:func:`~.kv_layout.slot_bytes`), so vLLM's block manager sizes its blocks,
  and the number of blocks ``VLLM_CPU_KVCACHE_SPACE`` buys, from the packed slot.
* **Cache update** (:meth:`PackedKVImpl.do_kv_cache_update`, from vLLM's ``unified_kv_cache_update``
  custom op): each new K and V row is quantized once by the plan's quantizer through
  :func:`~tracefp4.engines.sites.site_code` (the C site kernel; a rollout records that very code)
  and its codes, scales and amax are copied into the slot vLLM's slot mapping names.
* **Attention**: decode rows by :func:`tracefp4.formats.ckv.paged_attention` over the packed planes
  with vLLM's block table (query row ``i`` of request ``j`` attends to the first
  ``seq_len_j - (query_end_j - 1 - i)`` keys); a request with several rows (a prompt, causal; the
  cache update runs first) by :func:`prompt_attention`: its rows dequantized exactly, then SDPA in
  float32 (measured: ~10x the kernel's speed on a prompt of 512; both are attention over the exact
  dequantized K/V up to float32 rounding).

Refused with a clear error: sliding windows, ALiBi, logit soft-capping, attention sinks, encoder or
cross attention, fused output quantization, and a forward whose plan's K/V quantizer is not the one
the cache was laid out for (a BF16 call, or another K/V format). The layout relies on vLLM not
touching a block's bytes itself: true for uniform-precision caches (no block zeroing) without KV
connectors or prefix-cache offload, which :class:`~tracefp4.engines.vllm.engine.VLLMEngine` never enables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from tracefp4.engines.sites import site_code
from tracefp4.engines.vllm.kv_layout import planes, slot_bytes
from tracefp4.engines.vllm.runtime import RUNTIME, layer_index
from tracefp4.formats import ckv
from tracefp4.formats.constants import Format
from tracefp4.guidance.names import Site

__all__ = ["PackedKVBackend", "PackedKVImpl", "PackedKVMetadata", "backend_for", "install_packed_attention", "paging",
           "prompt_attention", "query_rows"]


@dataclasses.dataclass
class PackedKVMetadata:
    """One forward's paging, shared by every layer: vLLM's block table and sequence lengths (one row
    per request) and, per query row, its request (``q_seq``) and how many keys it attends to
    (``q_len``), all int32 as :func:`tracefp4.formats.ckv.paged_attention` takes them."""

    num_actual_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q_seq: torch.Tensor
    q_len: torch.Tensor
    #: ``(request, first row, end row)`` of each request with several query rows (a prompt or a chunk
    #: of one): attended by dequantize-then-SDPA; the other rows (decodes) by the C kernel.
    prompts: tuple[tuple[int, int, int], ...] = ()
    #: the decode rows when some rows are prompts' (None: every row is a decode)
    decode_rows: torch.Tensor | None = None


def query_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_seq, q_len)`` int32 for a batch whose request ``j`` has query rows
    ``query_start_loc[j] .. query_start_loc[j+1] - 1``, the last ones of its ``seq_lens[j]`` tokens."""
    qsl = query_start_loc.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    q_seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    rows = torch.arange(int(qsl[-1]))
    q_len = seq_lens.to(torch.int64)[q_seq] - (qsl[1:][q_seq] - 1 - rows)
    return q_seq.to(torch.int32), q_len.to(torch.int32)


class PackedKVMetadataBuilder(AttentionMetadataBuilder[PackedKVMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PackedKVMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("tracefp4 packed K/V attention: causal decoder attention only")
        n = m.num_reqs
        return paging(m.num_actual_tokens, m.block_table_tensor[:n], m.query_start_loc_cpu[: n + 1], m.seq_lens[:n])


def paging(num_actual_tokens: int, block_table: torch.Tensor, query_start_loc: torch.Tensor,
           seq_lens: torch.Tensor) -> PackedKVMetadata:
    """One forward's :class:`PackedKVMetadata` from vLLM's (one row of the tables per request)."""
    seq_lens = seq_lens.to(torch.int32)
    q_seq, q_len = query_rows(query_start_loc, seq_lens)
    bounds = query_start_loc.tolist()
    prompts = tuple((j, a, b) for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if b - a > 1)
    decode = None
    if prompts:
        single = (query_start_loc[1:] - query_start_loc[:-1]) == 1
        decode = query_start_loc[:-1][single].to(torch.int64)
    return PackedKVMetadata(num_actual_tokens, block_table.to(torch.int32), seq_lens, q_seq, q_len, prompts, decode)


class PackedKVBackend(AttentionBackend):
    """Attention over packed FP4 K/V rows (see the module docstring); one subclass per format."""

    fmt: ClassVar[Format]
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return replace(spec, state_content_bytes=slot_bytes(cls.fmt, spec.head_size))

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))  # what the C kernel takes (64/128/256 are its tested dims)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # layer-major: each layer's region is one contiguous range

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[PackedKVImpl]:
        return PackedKVImpl

    @staticmethod
    def get_builder_cls() -> type[PackedKVMetadataBuilder]:
        return PackedKVMetadataBuilder


class PackedNVFP4Backend(PackedKVBackend):
    fmt = Format.NVFP4

    @staticmethod
    def get_name() -> str:
        return "TRACEFP4_NVFP4_KV"


class PackedMXFP4Backend(PackedKVBackend):
    fmt = Format.MXFP4

    @staticmethod
    def get_name() -> str:
        return "TRACEFP4_MXFP4_KV"


_BACKENDS: dict[Format, type[PackedKVBackend]] = {Format.NVFP4: PackedNVFP4Backend, Format.MXFP4: PackedMXFP4Backend}


def backend_for(fmt: Format) -> type[PackedKVBackend]:
    """The backend class of a packed format, registered with vLLM (its layer reports it by name)."""
    cls = _BACKENDS[Format(fmt)]
    name = cls.get_name()
    if name not in AttentionBackendEnum.__members__:
        register_backend(name, f"{cls.__module__}.{cls.__qualname__}")
    return cls


class PackedKVImpl(AttentionImpl[PackedKVMetadata]):
    """Writes and reads one layer's packed cache (see the module docstring)."""

    #: Quantizes and records K/V itself: the worker's K/V wrapper (:func:`.plugin.install_kv_wrapper`)
    #: must not quantize them a second time before this cache write.
    _tracefp4_kv: ClassVar[bool] = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, *, fmt: Format = Format.NVFP4,
                 layer_name: str = "?", sinks: torch.Tensor | None = None) -> None:
        refused = {"sliding_window": sliding_window, "alibi_slopes": alibi_slopes, "sinks": sinks,
                   "logits_soft_cap": logits_soft_cap or None, "kv_sharing_target_layer_name": kv_sharing_target_layer_name}
        for what, value in refused.items():
            if value is not None:
                raise NotImplementedError(f"tracefp4 packed K/V cache ({layer_name}): {what} is not implemented "
                                          f"(got {value!r}); build the engine with kv_store='values'")
        if not PackedKVBackend.supports_head_size(head_size):
            raise NotImplementedError(f"tracefp4 packed K/V cache ({layer_name}): head size {head_size} not in "
                                      f"{PackedKVBackend.get_supported_head_sizes()}")
        if attn_type != AttentionType.DECODER or kv_cache_dtype != "auto":
            raise NotImplementedError(f"tracefp4 packed K/V cache ({layer_name}): decoder attention with "
                                      f"kv_cache_dtype 'auto' only, got {attn_type} / {kv_cache_dtype!r}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype, self.attn_type, self.sliding_window = kv_cache_dtype, attn_type, None
        self.fmt, self.layer_name = Format(fmt), layer_name
        self._planes: tuple[tuple, tuple[ckv.PackedKV, ckv.PackedKV]] | None = None

    def planes(self, kv_cache: torch.Tensor) -> tuple[ckv.PackedKV, ckv.PackedKV]:
        """The K and V planes over this layer's cache tensor (views, kept while the tensor stays)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._planes is None or self._planes[0] != key:
            self._planes = (key, planes(kv_cache, self.fmt, self.num_kv_heads, self.head_size))
        return self._planes[1]

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        state = RUNTIME.state()
        if state.plan is None or state.plan.kv_cache is not self.fmt:
            raise ValueError(f"{self.layer_name}: the cache holds packed {self.fmt.value} K/V rows; a forward with "
                             f"plan {state.plan!r} cannot write it (build the engine with kv_store='values')")
        i, slots = layer_index(self.layer_name), slot_mapping.to(torch.int64)
        keep = None if bool((slots >= 0).all()) else slots >= 0  # -1: padding rows, not stored
        for site, x, plane in ((Site.K, key, 0), (Site.V, value, 1)):
            # every row is quantized and recorded, as at every other site; the slot mapping's are stored
            q = site_code(state, i, site, RUNTIME.site_input(x))
            self._store(self.planes(kv_cache)[plane], q, slots, keep)

    @staticmethod
    def _store(dst: ckv.PackedKV, q, slots: torch.Tensor, keep: torch.Tensor | None) -> None:
        n = slots.shape[0]
        fields = [(dst.codes, q.codes[:n]), (dst.scales, q.scales[:n].view(torch.uint8))]
        if dst.amax is not None:
            fields.append((dst.amax, q.global_amax[:n].squeeze(-1)))
        if keep is not None:
            slots, fields = slots[keep], [(d, s[keep]) for d, s in fields]
        for d, s in fields:
            d.index_copy_(0, slots, s)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: PackedKVMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tracefp4 packed K/V attention: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up without a cache
            return output
        m, n, bs = attn_metadata, attn_metadata.num_actual_tokens, int(kv_cache.shape[2])
        k, v = self.planes(kv_cache)
        rows = m.decode_rows
        if rows is None or rows.numel():
            q = query[:n] if rows is None else query[rows]
            out = ckv.paged_attention(q, k, v, block_table=m.block_table, seq_lens=m.seq_lens,
                                      q_seq=m.q_seq if rows is None else m.q_seq[rows],
                                      q_len=m.q_len if rows is None else m.q_len[rows], block_size=bs, scale=self.scale)
            if rows is None:
                output[:n].copy_(out.view(output[:n].shape))
            else:
                output[rows] = out.to(output.dtype).view(-1, *output.shape[1:])
        for j, a, b in m.prompts:
            out = prompt_attention(query[a:b], k, v, m.block_table[j], int(m.seq_lens[j]), bs, self.scale)
            output[a:b].copy_(out.view(output[a:b].shape))
        return output


def prompt_attention(q: torch.Tensor, k: ckv.PackedKV, v: ckv.PackedKV, table: torch.Tensor, seq_len: int,
                     block_size: int, scale: float) -> torch.Tensor:
    """Causal attention of one request's last ``R`` query rows ``q [R, Hq, D]`` over its ``seq_len``
    cached keys: the rows dequantized exactly (:func:`tracefp4.formats.ckv.dequantize_rows`, the values
    the C kernel attends over) and torch's SDPA in float32 (so, like the kernel, attention over the
    exact dequantized K/V up to float32 rounding). A prompt has ``R`` times the work of a decode row,
    which SDPA's blocked GEMMs do many times faster than the kernel's row-at-a-time loop."""
    pos = torch.arange(seq_len)
    idx = table.to(torch.int64)[pos // block_size] * block_size + pos % block_size
    # [1, heads, tokens, D]: SDPA's fused CPU (flash) kernel takes 4-D inputs only; 3-D ones go to its
    # math path, which holds the [Hq, R, seq_len] scores (measured: 4.9 GB and 7x the time at R = 4K)
    rows = [ckv.dequantize_rows(ckv.PackedKV(p.codes[idx], p.scales[idx], None if p.amax is None else p.amax[idx],
                                             p.fmt)).float().transpose(0, 1).unsqueeze(0) for p in (k, v)]
    r = q.shape[0]
    if r == seq_len:  # a whole prompt: SDPA's own causal mask (no R x R mask tensor)
        mask = None
    else:
        mask = pos[None, :] <= (seq_len - r + torch.arange(r))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1).unsqueeze(0), rows[0], rows[1],
                                                           attn_mask=mask, is_causal=mask is None, scale=scale,
                                                           enable_gqa=True)
    return out[0].transpose(0, 1)


def install_packed_attention(layer, fmt: Format) -> None:
    """Give vLLM attention ``layer`` the packed backend of ``fmt`` and its impl (idempotent; called by
    the quantization config while the layer is built, before vLLM reads its KV cache spec)."""
    backend = backend_for(fmt)
    if layer.attn_backend is backend:
        return
    old = layer.impl
    layer.impl = PackedKVImpl(
        old.num_heads, old.head_size, old.scale, old.num_kv_heads, getattr(old, "alibi_slopes", None),
        layer.sliding_window, layer.kv_cache_dtype, getattr(old, "logits_soft_cap", None) or None, layer.attn_type,
        layer.kv_sharing_target_layer_name, fmt=fmt, layer_name=layer.layer_name, sinks=getattr(old, "sinks", None))
    layer.attn_backend = backend
    layer.backend = AttentionBackendEnum[backend.get_name()]
