"""Attention over packed sequences, one sequence at a time: cost sum(T_b^2), not (sum T_b)^2.

The trainer packs its trajectories into one row (:func:`tracefp4.engines.trainer.forward_logprobs`).
With a dense block-diagonal mask, scaled-dot-product attention computes (and its backward stores)
every query-key pair of the whole row: at 16 trajectories of ~530 tokens that is 72 M pairs per head
and layer where the sequences themselves hold 2.2 M, and it was most of a GRPO step's time. Here
the attention core runs per trajectory on the rows the trajectory owns, causal, without a mask.

Only the attention core changes: every projection, norm, rotary embedding, quantization site and
router still runs once over the packed row, on the same rows as before (the records line up with
them unchanged). Per trajectory the core computes the same attention as the dense mask up to the
order of its float32 additions (the masked keys contribute exact zeros; the kernel's blocking of the
remaining ones differs), so its outputs agree with the masked call's within float32 summation bounds
and the outputs' rounding to the model's dtype, not bit for bit (tests/test_segmented_attention.py).

How it reaches the model: the caller passes a :class:`Segments` as the keyword :data:`SEGMENTS_KWARG`
of the model's forward; transformers hands every keyword on to the attention function, and the
``tracefp4_*`` attention :func:`tracefp4.engines.kvcache.attention_implementation` registers calls
:meth:`Segments.attend` instead of its base function. :meth:`Segments.check_engaged` after the
forward says whether every layer did (a model whose attention implementation was swapped afterwards
would otherwise read the caller's placeholder mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["SEGMENTS_KWARG", "Segments"]

#: The keyword under which a forward hands its :class:`Segments` to the attention function.
SEGMENTS_KWARG = "tracefp4_segments"
#: Base attention implementations that are causal by themselves when called without a mask (SDPA's
#: ``is_causal``, flash attention's ``causal``), and those that need an explicit causal mask (eager).
_CAUSAL_WITHOUT_MASK = frozenset({"sdpa", "flash_attention_2", "flash_attention_3"})
_CAUSAL_BY_MASK = frozenset({"eager"})


@dataclasses.dataclass(eq=False)
class Segments:
    """The packed row's sequences: ``lengths[b]`` consecutive rows each, in order, every one causal
    from its own first row. ``calls`` counts the attention calls that attended per sequence."""

    lengths: tuple[int, ...]
    calls: int = 0

    def __post_init__(self) -> None:
        self.lengths = tuple(int(n) for n in self.lengths)
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError(f"segments: every sequence needs at least one row, got lengths {list(self.lengths)}")

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Segments:
        return cls(tuple(lengths))

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               base: Callable[..., tuple[torch.Tensor, Any]], base_name: str, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
        """``base`` attention, the implementation named ``base_name`` (transformers' signature:
        ``[1, H, N, D]`` states in, ``[1, N, H, D]`` out), run on each sequence's rows: called without a
        mask where it is causal by itself (SDPA takes ``is_causal`` for any query longer than one row,
        flash attention its module's ``is_causal``), with an additive causal mask for eager attention;
        any other implementation is refused (its causality without a mask is not known here)."""
        if base_name not in _CAUSAL_WITHOUT_MASK | _CAUSAL_BY_MASK:
            raise NotImplementedError(f"segments: per-sequence attention over the {base_name!r} implementation is not "
                                      f"supported (one of {sorted(_CAUSAL_WITHOUT_MASK | _CAUSAL_BY_MASK)}); use "
                                      "packed_attention='mask'")
        causal_mask = base_name in _CAUSAL_BY_MASK
        total = sum(self.lengths)
        if query.shape[0] != 1 or query.shape[2] != total or key.shape[2] != total:
            raise ValueError(f"segments: the attention got query {tuple(query.shape)} and key {tuple(key.shape)}, "
                             f"not one packed row of {total} = sum of the sequences' lengths (no cache may be used)")
        outs = []
        for q, k, v in zip(*(t.split(self.lengths, dim=2) for t in (query, key, value))):
            mask = None
            if causal_mask:
                n = q.shape[2]
                mask = torch.full((n, n), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)[None, None]
            outs.append(base(module, q, k, v, mask, *args, **kwargs)[0])
        self.calls += 1
        return torch.cat(outs, dim=1), None

    def check_engaged(self, layers: int) -> None:
        """Raise unless each of the model's ``layers`` attention calls attended per sequence."""
        if self.calls != layers:
            raise RuntimeError(f"segments: {self.calls} of the model's {layers} attention calls attended per "
                               "sequence; per-sequence attention needs the tracefp4_* attention implementation "
                               "prepare_model sets (the model's was changed since)")
