"""The interface of a knob's codec, the per-token geometry it codes over, and the one LDPC correction step.

A :class:`Codec` codes one field of a compact record (the global amax, the block scales or the
elements) for one knob value: :meth:`Codec.encode` (what the rollout keeps), :meth:`Codec.bits`
(packed bits per token for a site shape), :meth:`Codec.pack` / :meth:`Codec.unpack` (its share of
the per-token bit string), :meth:`Codec.stored` / :meth:`Codec.read` (its whole-byte tensors) and
``decode`` (the trainer's value of the field and its :class:`~tracefp4.guidance.record.DecodeReport`;
its arguments differ per field, since each field decodes on the ones before it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch

from tracefp4.formats.constants import Format, HintMode
from tracefp4.guidance.coding import bp_flips, ldpc_checks, ldpc_layout, ldpc_syndrome

__all__ = ["Geometry", "Codec", "Expect", "check_rate", "ldpc_encode", "ldpc_correct", "LdpcResult"]

#: ``expect(name, shape, dtypes)``: a stored tensor, checked (a ValueError naming it otherwise).
Expect = Callable[[str, tuple[int, ...], tuple[torch.dtype, ...]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A site's per-token shape ``(*lead, K)`` in a format: the counts each field codes per token."""

    fmt: Format
    site_shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Rows of the site per token (one global amax each)."""
        return int(np.prod(self.site_shape[:-1], dtype=np.int64))

    @property
    def scales_per_row(self) -> int:
        """Block scales per row (FP8's one float32 row scale counts as one)."""
        return 1 if self.fmt is Format.FP8 else self.site_shape[-1] // self.fmt.block

    @property
    def blocks(self) -> int:
        return self.rows * self.scales_per_row

    @property
    def elems(self) -> int:
        return self.rows * self.site_shape[-1]

    def block_shape(self, t: int) -> tuple[int, ...]:
        return (t, *self.site_shape[:-1], self.scales_per_row)

    def elem_shape(self, t: int) -> tuple[int, ...]:
        return (t, *self.site_shape)

    def row_shape(self, t: int) -> tuple[int, ...]:
        return (t, *self.site_shape[:-1], 1)


class Codec:
    """One knob value of one field; subclasses set ``field`` and ``knob`` and override what they code.

    The defaults are a field that keeps nothing: no bits, no tensors.
    """

    field: ClassVar[str]
    knob: ClassVar[str]
    #: whether the field is the one a plain :class:`~tracefp4.guidance.hints.Hint` keeps (full scales,
    #: fp32 amax); for elements, the Hint mode it is (``full``/``lsb``) or None.
    plain: ClassVar[bool] = False
    hint_mode: ClassVar[HintMode | None] = None
    #: whether the field is stored as an LDPC syndrome (then it decodes only once compressed).
    ldpc: ClassVar[bool] = False

    def __init__(self, arg=None) -> None:
        if arg is not None:
            raise ValueError(f"{self.field}:{self.knob} takes no argument, got {arg!r}")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def name_part(self) -> str:
        """This knob in a spec's name (``+<field>:<knob>``; the default knob is written as nothing)."""
        return f"+{self.field}:{self.knob}"

    def tag_part(self) -> str:
        """This knob in a tensor name (``[A-Za-z0-9_]``)."""
        return f"{self.field[0]}{self.knob}"

    def bits(self, geom: Geometry) -> int:
        """Packed bits per token."""
        return 0

    def byte_count(self, geom: Geometry) -> int:
        """Bytes per token of the whole-byte tensors (:meth:`stored`)."""
        return 0

    def pack(self, value: torch.Tensor | None, geom: Geometry, t: int, compressed: bool) -> np.ndarray | None:
        """This field's bits of each token ``[T, bits]`` (None: it has none)."""
        return None

    def unpack(self, fields: np.ndarray, geom: Geometry, t: int) -> torch.Tensor | None:
        """Inverse of :meth:`pack` on this field's ``[T, bits]``."""
        return None

    def stored(self, value: torch.Tensor | None, prefix: str, suffix: str, t: int) -> dict[str, torch.Tensor]:
        """Whole-byte tensors of this field for the store."""
        return {}

    def read(self, tensors: Mapping[str, torch.Tensor], prefix: str, suffix: str, geom: Geometry, t: int,
             expect: Expect, where: str) -> torch.Tensor | None:
        """This field from its whole-byte tensors (inverse of :meth:`stored`; None: it has none)."""
        return None


def check_rate(rate) -> int:
    """An ldpc rate's d (the rate is 1/d)."""
    if not (isinstance(rate, int) and 1 <= rate <= 4096):
        raise ValueError(f"an ldpc rate is 1/d with an integer d in [1, 4096], got d={rate!r}")
    return rate


def ldpc_encode(plane: torch.Tensor, t: int, per_token: int, rate: int, compressed: bool) -> np.ndarray:
    """The check bits ``[T, checks]`` of one trajectory's bit plane (a compressed plane already is them)."""
    if compressed:
        return plane.numpy().astype(np.uint8)
    cpt = ldpc_checks(per_token, rate)
    layout = ldpc_layout([t], per_token, cpt)
    return ldpc_syndrome(layout, plane.reshape(-1).numpy().astype(np.uint8)).reshape(t, cpt)


@dataclasses.dataclass(frozen=True)
class LdpcResult:
    """flips / failed: per variable, whether to flip the trainer's bit, and whether its block failed."""

    flips: np.ndarray
    failed: np.ndarray
    blocks: int
    failed_blocks: int


def ldpc_correct(checks: torch.Tensor, own: np.ndarray, llr: np.ndarray, segments: Sequence[int],
                 per_token: int, rate: int) -> LdpcResult:
    """Correct the trainer's own bits ``own`` (flat uint8) toward the rollout's, given the rollout's
    check bits and each bit's prior log-likelihood ratio of being right; a failed block gets no flips."""
    layout = ldpc_layout(segments, per_token, ldpc_checks(per_token, rate))
    syn = checks.reshape(-1).numpy().astype(np.uint8) ^ ldpc_syndrome(layout, own)
    flips, solved = bp_flips(layout, syn, llr)
    failed = ~solved
    return LdpcResult(flips, failed[layout.var_block], layout.n_blocks, int(failed.sum()))
