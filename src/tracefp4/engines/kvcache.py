"""Our engine's quantized KV cache as it sits in memory: codes in pages, and the attention that reads them.

Storage (:class:`KVStorage`, chosen by the plan's K/V format): an FP4 plan keeps per slot and KV head
the row exactly as its quantizer coded it, in the layout :class:`tracefp4.formats.ckv.PackedKV`
reads (NVFP4: codes two per byte, E4M3 block scales, the row's FP32 amax; MXFP4: codes and E8M0
scales); an FP8 plan keeps one E4M3 byte per element and the row's float32 scale; a plan that leaves
K/V in BF16 keeps transformers' dense layer. Slots come in blocks of :data:`BLOCK_SIZE` tokens and a
:class:`PageTable` maps each sequence's tokens to blocks, as vLLM's block table does: ragged
sequences hold only their real tokens (left padding is never stored), and a finished sequence's
blocks are reused.

Each new K/V row is quantized once, by the plan's quantizer through the forward's path
(:func:`tracefp4.engines.sites.site_code`, which records it: a rollout's K/V record *is* the stored
code), and its code is copied into its slot. No dequantized copy is kept. Attention reads the slots
(:class:`KVRead`): ckv's C kernel over the packed rows (bf16 queries on the CPU), or, where that
kernel does not run (no library, other devices or dtypes, FP8 rows), a torch read that dequantizes
the sequences' rows for the call only. Both compute attention over the exact dequantized rows in the
model's dtype (what the simulator this cache replaced stored), in float32: they differ only in the
order of the float32 additions (and the exponential), then round to the model's dtype.

The model's attention modules reach the cache through the attention implementation
:func:`attention_implementation` registers with transformers (``tracefp4_<base>``): a forward whose
cache reads itself gets its attention from the cache; a forward handed a
:class:`~tracefp4.engines.segments.Segments` (the trainer's packed forward above a length) attends
per packed sequence with the base implementation; every other forward (the trainer's, BF16 ones) goes
to the base implementation (``sdpa``, ``eager``) with the same arguments, unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from tracefp4.engines.segments import SEGMENTS_KWARG
from tracefp4.engines.sites import ForwardState, site_code
from tracefp4.formats.ckv import PackedKV, available, paged_attention
from tracefp4.formats import FP8, MXFP4, NVFP4, dequantize
from tracefp4.guidance.names import Site

__all__ = ["ATTENTION_PREFIX", "BLOCK_SIZE", "KV_LAYER_KWARG", "KVRead", "KVStorage", "PageTable", "QuantizedKV",
           "RowStore", "attention_implementation", "kv_storage"]

#: Tokens per block of the page table (vLLM's CPU default).
BLOCK_SIZE = 16
#: Prefix of the attention implementations registered by :func:`attention_implementation`.
ATTENTION_PREFIX = "tracefp4_"
#: The keyword under which the attention pre-hook hands a cache layer to the attention function.
KV_LAYER_KWARG = "tracefp4_kv_layer"
#: Query heads per KV head ckv's kernel takes at most.
_KERNEL_MAX_GROUP = 32
#: Head dim ckv's kernel takes at most (a multiple of 16).
_KERNEL_MAX_DIM = 256


class KVStorage(enum.Enum):
    """What a cache layer holds, by the plan's K/V format (fixed at the layer's first update)."""

    DENSE = "dense"
    """No K/V quantizer (BF16 plans, W4A16): the states in the model's dtype, as transformers' DynamicLayer."""
    FP4 = "fp4"
    """NVFP4 or MXFP4 codes packed in ckv's layout: 152 B per token and KV head of 128 (K and V), 0.297x BF16."""
    FP8 = "fp8"
    """FP8 E4M3: one byte per element plus the row's float32 scale (K and V: 2 x (128 + 4) B, 0.516x BF16)."""


class KVRead(enum.Enum):
    """How attention reads an FP4 or FP8 cache layer (a cache's ``read``)."""

    AUTO = "auto"
    """ckv's C kernel where it runs (FP4 rows, bf16 queries on the CPU, the library loaded, a head dim
    and GQA group it takes), else :attr:`TORCH`."""
    KERNEL = "kernel"
    """ckv's C kernel; its error where it cannot run."""
    TORCH = "torch"
    """Dequantize the sequences' rows for this call (never kept) and attend in float32 with torch."""


def kv_storage(state: ForwardState) -> KVStorage:
    """The storage a cache layer takes for the K/V format of ``state``'s plan."""
    quantizer = None if state.plan is None else state.plan.quantizer(Site.K)
    if quantizer is None:
        return KVStorage.DENSE
    return KVStorage.FP8 if quantizer.fmt == "fp8" else KVStorage.FP4


# --- the page table ------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class PageTable:
    """Which slots hold each sequence's tokens, shared by every layer of a cache (all layers store the
    same tokens). ``table [seqs, cols]`` int32 block ids, ``lens [seqs]`` int32 tokens stored,
    ``held [seqs]`` blocks owned; ``blocks`` the slot capacity in blocks (layers grow their tensors to
    it). Per forward (:meth:`declare`): ``rows`` the flattened new rows (``b*S + s``) that are real
    tokens, ``slots`` where each goes, and for every query row its sequence ``q_seq`` and key count
    ``q_len`` (its own position plus one; 0 for a pad row)."""

    block_size: int = BLOCK_SIZE
    blocks: int = 0
    forwards: int = 0
    table: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int32))
    lens: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    held: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    free: list[int] = dataclasses.field(default_factory=list)
    rows: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    slots: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    q_seq: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    q_len: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))

    @property
    def slot_count(self) -> int:
        return self.blocks * self.block_size

    def declare(self, real: torch.Tensor) -> None:
        """The next forward's new tokens, ``real [seqs, S]`` bool (False: a pad row, not stored). The
        first forward sets the number of sequences; later ones must keep it (:meth:`select` drops)."""
        if real.dtype != torch.bool or real.dim() != 2:
            raise ValueError(f"PageTable.declare real: expected a bool [sequences, new tokens] mask, got "
                             f"{real.dtype} {tuple(real.shape)}")
        real = real.cpu()
        seqs, width = real.shape
        if self.forwards == 0:
            self.table = torch.zeros(seqs, 0, dtype=torch.int32)
            self.lens, self.held = torch.zeros(seqs, dtype=torch.int32), torch.zeros(seqs, dtype=torch.int32)
        elif seqs != self.lens.shape[0]:
            raise ValueError(f"PageTable.declare real: {seqs} sequences in a cache of {self.lens.shape[0]}")
        pos = self.lens[:, None].long() + real.long().cumsum(1) - 1  # each real token's position
        new_lens = self.lens + real.sum(1, dtype=torch.int32)
        self._reserve(-(-new_lens // self.block_size))
        self.rows = real.reshape(-1).nonzero().squeeze(-1)
        p = pos.clamp(min=0)
        slots = self.table.long().gather(1, p // self.block_size) * self.block_size + p % self.block_size
        self.slots = slots.reshape(-1)[self.rows]
        self.q_seq = torch.arange(seqs, dtype=torch.int32).repeat_interleave(width)
        self.q_len = torch.where(real, pos + 1, 0).reshape(-1).to(torch.int32)
        self.lens = new_lens
        self.forwards += 1

    def _reserve(self, need: torch.Tensor) -> None:
        """Give every sequence ``need`` blocks: from the free list, else from new capacity (doubling)."""
        extra = int((need - self.held).clamp(min=0).sum())
        if extra > len(self.free):
            grown = max(2 * self.blocks, self.blocks + extra - len(self.free))
            self.free.extend(range(grown - 1, self.blocks - 1, -1))  # popped lowest first
            self.blocks = grown
        cols = int(need.max()) if need.numel() else 0
        if cols > self.table.shape[1]:
            wider = self.table.new_zeros(self.table.shape[0], cols - self.table.shape[1])
            self.table = torch.cat([self.table, wider], 1)
        for b in (need > self.held).nonzero().flatten().tolist():
            for col in range(int(self.held[b]), int(need[b])):
                self.table[b, col] = self.free.pop()
        self.held = torch.maximum(self.held, need.to(torch.int32))

    def select(self, keep: torch.Tensor) -> None:
        """Keep the sequences ``keep`` (in that order); the others' blocks return to the free list."""
        keep = keep.cpu().long()
        dropped = torch.ones(self.lens.shape[0], dtype=torch.bool)
        dropped[keep] = False
        for b in dropped.nonzero().flatten().tolist():
            self.free.extend(self.table[b, : int(self.held[b])].tolist())
        self.table, self.lens, self.held = self.table[keep], self.lens[keep], self.held[keep]


# --- one layer's rows ----------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class RowStore:
    """One layer's K or V rows: every field of the plan's code container (NVFP4: ``codes``,
    ``scales``, ``global_amax``; MXFP4: ``codes``, ``scales``; FP8: ``data``, ``scale``) as
    ``[slots, Hkv, width]``, in the container's dtypes."""

    kind: type
    fields: dict[str, torch.Tensor]

    @classmethod
    def like(cls, q: NVFP4 | MXFP4 | FP8, slots: int, what: str) -> RowStore:
        if not isinstance(q, (NVFP4, MXFP4, FP8)):
            raise ValueError(f"{what}: the plan's K/V quantizer gives {type(q).__name__} codes; the cache stores "
                             "NVFP4, MXFP4 or FP8 rows")
        lead = q.shape[:-1]
        fields = {}
        for f in dataclasses.fields(q):
            t = getattr(q, f.name)
            if t.shape[:-1] != lead:
                raise ValueError(f"{what}: {type(q).__name__}.{f.name} {tuple(t.shape)} is not per row of "
                                 f"{tuple(q.shape)} (the cache stores per-row scales only)")
            fields[f.name] = torch.zeros(slots, *t.shape[1:], dtype=t.dtype, device=t.device)
        return cls(type(q), fields)

    @property
    def slots(self) -> int:
        return next(iter(self.fields.values())).shape[0]

    @property
    def device(self) -> torch.device:
        return next(iter(self.fields.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.fields.values())

    def grow(self, slots: int) -> None:
        for name, t in self.fields.items():
            if t.shape[0] < slots:
                self.fields[name] = torch.cat([t, t.new_zeros(slots - t.shape[0], *t.shape[1:])])

    def write(self, slots: torch.Tensor, q: NVFP4 | MXFP4 | FP8, rows: torch.Tensor) -> None:
        """Rows ``rows`` of the code ``q`` (flattened ``[rows, Hkv, ...]``) into ``slots``."""
        if type(q) is not self.kind:
            raise ValueError(f"a cache of {self.kind.__name__} rows was handed {type(q).__name__} codes "
                             "(one cache serves one plan)")
        for name, t in self.fields.items():
            t[slots] = getattr(q, name)[rows]

    def gather(self, slots: torch.Tensor) -> NVFP4 | MXFP4 | FP8:
        """The code of the rows at ``slots`` (any shape), as a container."""
        return self.kind(**{name: t[slots] for name, t in self.fields.items()})

    def packed(self) -> PackedKV:
        """The rows as ckv's kernel reads them (views, no copy)."""
        f = self.fields
        if self.kind is NVFP4:
            return PackedKV(f["codes"], f["scales"], f["global_amax"].squeeze(-1))
        return PackedKV(f["codes"], f["scales"], None, MXFP4.fmt)


@dataclasses.dataclass(eq=False)
class QuantizedKV:
    """One layer's FP4 or FP8 K/V on a shared :class:`PageTable`: its rows and the attention over them."""

    layer: int
    table: PageTable
    read: KVRead
    keys: RowStore | None = None
    values: RowStore | None = None
    seen: int = 0  # forwards written

    def update(self, state: ForwardState, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Quantize (and record, through the path) the new ``[B, Hkv, S, D]`` states and store the real rows."""
        if self.seen == self.table.forwards:  # no declared forward (a plain model call): every token is real
            self.table.declare(torch.ones(key_states.shape[0], key_states.shape[2], dtype=torch.bool))
        if self.seen + 1 != self.table.forwards:
            raise RuntimeError(f"layer {self.layer}: the page table is {self.table.forwards - self.seen} forwards "
                               "ahead of this layer (a forward did not reach every layer)")
        self.seen += 1
        self.keys = self._store(self.keys, state, Site.K, key_states)
        self.values = self._store(self.values, state, Site.V, value_states)

    def _store(self, store: RowStore | None, state: ForwardState, site: Site, states: torch.Tensor) -> RowStore:
        b, h, s, d = states.shape
        q = site_code(state, self.layer, site, states.transpose(1, 2).reshape(b * s, h, d))
        if store is None:
            store = RowStore.like(q, self.table.slot_count, f"layer {self.layer} {site.value}")
        store.grow(self.table.slot_count)
        store.write(self.table.slots.to(states.device), q, self.table.rows.to(states.device))
        return store

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (self.keys, self.values) if s is not None)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query [B, Hq, S, D]`` (this forward's rows) over the stored rows ->
        ``[B, S, Hq, D]`` in the query's dtype (a pad row, with no keys, gives 0)."""
        if self.keys is None or self.keys.slots < self.table.slot_count:
            raise RuntimeError(f"layer {self.layer}: attention before this forward's K/V were stored")
        if self._kernel(query):
            return self._kernel_attend(query, scaling)
        return self._torch_attend(query, scaling)

    def _kernel(self, query: torch.Tensor) -> bool:
        fp4 = self.keys.kind is not FP8
        if self.read is KVRead.KERNEL:
            if not fp4:
                raise ValueError(f"layer {self.layer}: KVRead.KERNEL reads FP4 rows; this cache holds FP8 rows")
            return True
        if self.read is KVRead.TORCH or not fp4:
            return False
        hkv, hq, d = self.keys.fields["codes"].shape[1], query.shape[1], query.shape[3]
        # the kernel's contract (ckv): D a multiple of 16 up to 256, at most 32 query heads per KV head
        return (available() and query.dtype == torch.bfloat16 and query.is_cpu and d % 16 == 0
                and d <= _KERNEL_MAX_DIM and hq // hkv <= _KERNEL_MAX_GROUP)

    def _kernel_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        b, hq, s, d = query.shape
        t = self.table
        out = paged_attention(query.transpose(1, 2).reshape(b * s, hq, d), self.keys.packed(), self.values.packed(),
                              block_table=t.table, seq_lens=t.lens, q_seq=t.q_seq, q_len=t.q_len,
                              block_size=t.block_size, scale=scaling)
        return out.view(b, s, hq, d).to(query.dtype)

    def _torch_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Dequantize each sequence's rows (padded to the longest with slot 0, masked out), round them to
        the query's dtype as a cache of that dtype holds them, attend in float32."""
        b, hq, s, d = query.shape
        t, dev = self.table, query.device
        n = int(t.lens.max()) if t.lens.numel() else 0
        if n == 0:  # no sequence holds a token: every row attends to nothing
            return query.new_zeros(b, s, hq, d)
        pos = torch.arange(n)
        slots = t.table.long()[:, pos // t.block_size] * t.block_size + pos % t.block_size
        slots = torch.where(pos < t.lens[:, None], slots, 0).to(self.keys.device)
        k, v = (dequantize(r.gather(slots)).to(query.dtype).float().to(dev).transpose(1, 2)
                for r in (self.keys, self.values))
        mask = (pos[None, None, :] < t.q_len.view(b, s, 1)).to(dev)  # [B, S, keys]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out = sdpa(query.float(), k, v, attn_mask=mask[:, None], scale=scaling, enable_gqa=True)  # no K/V copy per head
        out = out.masked_fill(~mask.any(-1)[:, None, :, None], 0.0)  # no keys: 0, as the kernel
        return out.transpose(1, 2).to(query.dtype)


# --- the attention implementation ----------------------------------------------------------------


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *args: Any, base: str, **kwargs: Any) -> tuple[torch.Tensor, None]:
    layer = kwargs.pop(KV_LAYER_KWARG, None)
    quantized = getattr(layer, "quantized", None)
    if quantized is not None:
        # the cache knows each sequence's tokens: the mask (built for the padded layout) is not needed
        scaling = kwargs.get("scaling")  # None: the modules' default, 1/sqrt(head dim)
        return quantized.attend(query, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is not None:  # packed sequences attended one by one (the mask passed is a placeholder)
        return segments.attend(module, query, key, value, _base_attention(module, base), base, *args, **kwargs)
    return _base_attention(module, base)(module, query, key, value, attention_mask, *args, **kwargs)


def _base_attention(module: torch.nn.Module, base: str):
    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    # "eager" is each model file's own eager_attention_forward (what its modules default to)
    fn = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if base != "eager" or fn is None:
        raise NotImplementedError(f"{type(module).__name__}: no attention implementation {base!r} to fall back on")
    return fn


def attention_implementation(base: str) -> str:
    """Register with transformers (once per process) and return ``tracefp4_<base>``: the attention that
    reads an FP4/FP8 cache layer handed to it (:data:`KV_LAYER_KWARG`) from the layer, and otherwise
    is ``base`` (same function, same arguments, same masks)."""
    if base.startswith(ATTENTION_PREFIX):
        base = base[len(ATTENTION_PREFIX):]
    name = ATTENTION_PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, functools.partial(_attention, base=base))
        if base in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name
