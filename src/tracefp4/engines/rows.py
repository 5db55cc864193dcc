"""Which trajectory position each row of a forward computes: the map from a batch to its records.

A trainer's forward sees its tokens as rows: an ``[B, S]`` batch of token ids becomes ``B * S`` rows,
batch-major (row ``b * S + s``), at every quantization site (``expert_in`` ``[B*S, H]``, ``expert_mid``
``[B*S, top_k, I]``, ``k``/``v`` ``[B*S, n_kv, head_dim]``) and at the router. A rollout's record is
per trajectory, one row per token position. A :class:`RowMap` says, for every row of the forward,
which trajectory and position it is (or that it is padding), so records line up with rows whatever the
batch layout:

* **packed** (our trainer, Megatron's THD, verl's remove-padding path): one row of concatenated
  trajectories, positions restarting at 0 (:meth:`RowMap.packed`);
* **padded** (TRL, plain transformers): ``[B, S]`` with an attention mask, left or right padding,
  row b = trajectory b (:meth:`RowMap.padded`);
* anything else: per-row trajectory and position tensors (:meth:`RowMap.of`).

Decisions
    * Padding rows (``traj = -1``) have no record: their sites round to nearest on their own grid and
      the router keeps its own experts. They change nothing in the real rows (every activation and KV
      scale is per row; the attention mask keeps real rows from attending to them).
    * A position may appear at most once; positions a forward does not cover are allowed (the
      records are then selected at the covered ones: plain ``full``/``lsb`` records and fresh compact
      records can be, compact records read back from the store decode per whole trajectory and cannot).
    * The positions the forward must run at are the records' positions (``position_ids``: counting real
      tokens only, as the rollout engine does); a forward at other positions (e.g. ``arange(S)`` over a
      left-padded row) rotates K differently and the records would not match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tracefp4.formats import MXFP4, NVFP4

__all__ = ["RowMap", "select_rows", "scatter_rows", "take_rows"]


def take_rows(t: torch.Tensor, index) -> torch.Tensor:
    """``t[index]``; a 1-D integer index as ``index_select``, the same rows: indexing gathers element by
    element, ``index_select`` copies whole rows (a rollout's assembly gathers a few hundred KB per
    site: 3x faster so on the CPU)."""
    if isinstance(index, torch.Tensor) and index.dim() == 1 and index.dtype in (torch.int64, torch.int32) and t.dim():
        return t.index_select(0, index.to(t.device))
    return t[index]


def select_rows(q: NVFP4 | MXFP4, rows: torch.Tensor) -> NVFP4 | MXFP4:
    """Rows of a quantized activation (every tensor of it is per row: codes, scales, global amax)."""
    rows = rows.to(q.codes.device)
    return type(q)(**{f.name: getattr(q, f.name)[rows] for f in dataclasses.fields(q)})


def scatter_rows(n: int, parts: Sequence[tuple[torch.Tensor, NVFP4 | MXFP4]]) -> NVFP4 | MXFP4:
    """One quantized activation of ``n`` rows from ``parts``: ``(rows, q)`` puts ``q``'s rows at
    ``rows``; together the parts must cover every row once."""
    first = parts[0][1]
    out = {}
    for f in dataclasses.fields(first):
        ref = getattr(first, f.name)
        t = ref.new_empty((n, *ref.shape[1:]))
        for rows, q in parts:
            t[rows.to(t.device)] = getattr(q, f.name)
        out[f.name] = t
    return type(first)(**out)


@dataclasses.dataclass(frozen=True)
class RowMap:
    """Row ``i`` of a forward (flattened batch-major over ``shape = (B, S)``) computes position
    ``pos[i]`` of trajectory ``traj[i]`` (``-1``: padding). ``lengths[t]``: the positions of trajectory
    t's record (``T_t``). See the module docstring."""

    traj: torch.Tensor
    pos: torch.Tensor
    lengths: tuple[int, ...]
    shape: tuple[int, int]
    # derived in __post_init__
    real: torch.Tensor = dataclasses.field(init=False, repr=False)
    index: torch.Tensor = dataclasses.field(init=False, repr=False)
    counts: tuple[int, ...] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        traj = torch.as_tensor(self.traj, dtype=torch.long).reshape(-1).cpu()
        pos = torch.as_tensor(self.pos, dtype=torch.long).reshape(-1).cpu()
        lengths = tuple(int(n) for n in self.lengths)
        shape = tuple(int(d) for d in self.shape)
        if len(shape) != 2 or shape[0] * shape[1] != traj.numel() or pos.numel() != traj.numel():
            raise ValueError(f"row map: traj {tuple(traj.shape)} and pos {tuple(pos.shape)} do not cover a batch "
                             f"of shape {shape}")
        if any(n < 1 for n in lengths):
            raise ValueError(f"row map: every trajectory needs at least one position, got lengths {list(lengths)}")
        is_real = traj >= 0
        if bool((traj >= len(lengths)).any()) or bool((traj < -1).any()):
            raise ValueError(f"row map: trajectory indices outside [-1, {len(lengths)}): {sorted(set(traj.tolist()))}")
        if bool(is_real.any()):
            limit = torch.tensor(lengths, dtype=torch.long)[traj[is_real]]
            bad = (pos[is_real] < 0) | (pos[is_real] >= limit)
            if bool(bad.any()):
                i = int(is_real.nonzero()[bad.nonzero()[0]])
                raise ValueError(f"row map: row {i} is position {int(pos[i])} of trajectory {int(traj[i])}, whose "
                                 f"record has {lengths[int(traj[i])]} positions")
        offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
        flat = torch.where(is_real, offsets[traj.clamp(min=0)] + pos, torch.full_like(pos, -1))
        order = torch.argsort(flat[is_real], stable=True)
        real = is_real.nonzero().squeeze(-1)[order]
        index = flat[real]
        if index.numel() > 1 and bool((index[1:] == index[:-1]).any()):
            dup = int(index[1:][index[1:] == index[:-1]][0])
            t = int(torch.searchsorted(offsets, dup, right=True)) - 1
            raise ValueError(f"row map: position {dup - int(offsets[t])} of trajectory {t} appears in more than one row")
        counts = torch.bincount(traj[real], minlength=len(lengths)).tolist() if real.numel() else [0] * len(lengths)
        for name, value in (("traj", traj), ("pos", torch.where(is_real, pos, 0)), ("lengths", lengths),
                            ("shape", shape), ("real", real), ("index", index), ("counts", tuple(counts))):
            object.__setattr__(self, name, value)

    # --- layouts ------------------------------------------------------------------------------

    @classmethod
    def packed(cls, lengths: Sequence[int]) -> RowMap:
        """One row of the trajectories concatenated, each at positions ``0..T-1`` (packed sequences;
        verl's remove-padding layout: ``cu_seqlens`` are the lengths' running sums)."""
        lengths = [int(n) for n in lengths]
        if not lengths:
            raise ValueError("row map: no trajectories")
        traj = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        pos = torch.cat([torch.arange(n) for n in lengths])
        return cls(traj, pos, tuple(lengths), (1, sum(lengths)))

    @classmethod
    def padded(cls, attention_mask: torch.Tensor, lengths: Sequence[int] | None = None) -> RowMap:
        """Row b of ``attention_mask [B, S]`` is trajectory b; its real tokens (mask 1), in order, are
        positions ``0, 1, ...`` (left, right or any padding). ``lengths`` (default: each row's real
        tokens) are the records' lengths, when the forward covers only a prefix of them."""
        mask = torch.as_tensor(attention_mask).detach().cpu()
        if mask.dim() != 2:
            raise ValueError(f"row map: attention_mask must be [B, S], got {tuple(mask.shape)}")
        real = mask != 0
        pos = real.long().cumsum(-1) - 1
        rows = torch.arange(mask.shape[0])[:, None].expand_as(mask)
        traj = torch.where(real, rows, torch.full_like(rows, -1))
        counts = real.sum(-1).tolist()
        if lengths is None:
            lengths = counts
        return cls(traj, torch.where(real, pos, 0), tuple(int(n) for n in lengths), tuple(mask.shape))

    @classmethod
    def of(cls, traj: torch.Tensor, pos: torch.Tensor, lengths: Sequence[int]) -> RowMap:
        """Per-row trajectory (``-1``: padding) and position tensors of an ``[B, S]`` batch."""
        traj = torch.as_tensor(traj)
        if traj.dim() != 2:
            raise ValueError(f"row map: traj must be [B, S], got {tuple(traj.shape)}")
        return cls(traj, pos, tuple(lengths), tuple(traj.shape))

    # --- what the forward and the records need ------------------------------------------------

    @property
    def n_rows(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def dense(self) -> bool:
        """Every row is a real one, in record order, and every position of every record is covered:
        the records' rows are the forward's rows as they are (a packed batch)."""
        return self.real.numel() == self.n_rows == sum(self.lengths) and bool(
            torch.equal(self.real, torch.arange(self.n_rows)))

    @property
    def complete(self) -> bool:
        """Every position of every record is covered by some row."""
        return self.index.numel() == sum(self.lengths)

    @property
    def position_ids(self) -> torch.Tensor:
        """``[B, S]`` positions to run the forward at (the records'; 0 on padding)."""
        return self.pos.reshape(self.shape)

    @property
    def pad(self) -> torch.Tensor:
        """The padding rows."""
        return (self.traj < 0).nonzero().squeeze(-1)
