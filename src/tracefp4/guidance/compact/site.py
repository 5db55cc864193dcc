"""The record-level helpers the model, rollout and trainer call, for every kind of site record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tracefp4.formats.constants import Format, HintMode
from tracefp4.formats import MXFP4, NVFP4
from tracefp4.guidance.compact.codec import Geometry
from tracefp4.guidance.compact.record import CompactRecord, compact_site_bytes
from tracefp4.guidance.compact.spec import GuidanceSpec, parse_hint_mode
from tracefp4.guidance.hints import Hint, encode_hint, hint_site_bytes
from tracefp4.guidance.record import SiteRecord
from tracefp4.guidance.report import DecodeReport

__all__ = ["encode_record", "read_record", "decode_record", "record_cat", "site_bytes_per_token"]


def encode_record(x: torch.Tensor, q: NVFP4 | MXFP4, mode: HintMode | GuidanceSpec) -> SiteRecord:
    """What the rollout records at a site: a :class:`Hint` for ``full``/``lsb``, else a compact record."""
    if isinstance(mode, HintMode):
        return encode_hint(q, mode)
    return CompactRecord.encode(x, q, mode)


def read_record(tensors: Mapping[str, torch.Tensor], prefix: str) -> SiteRecord:
    """A site's record from a trajectory's tensors, whichever kind its tensor names say it is."""
    if any(k.startswith(f"{prefix}.packed__") or k.startswith(f"{prefix}.stream__") for k in tensors):
        return CompactRecord.from_tensors(tensors, prefix)
    return Hint.from_tensors(dict(tensors), prefix)


def decode_record(record: SiteRecord, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
    """The Hint a site's record means given the trainer's own value ``x``, and what could not be decoded."""
    return record.decode(x)


def record_cat(records: Sequence[SiteRecord]) -> SiteRecord:
    """Concatenate the records of one site along the token dim (trajectories of a batch, or steps)."""
    if not records:
        raise ValueError("record_cat: no records given")
    kinds = {type(r).__name__ for r in records}
    if len(kinds) != 1:
        raise ValueError(f"record_cat: mixing record kinds of one site ({', '.join(sorted(kinds))})")
    return records[0].cat(records[1:])


def site_bytes_per_token(
    mode: HintMode | GuidanceSpec | str,
    site_shape: Sequence[int],
    fmt: Format | str = Format.NVFP4,
    density: float | None = None,
) -> float:
    """Record bytes per token of one site with per-token shape ``(*lead, K)``, by the record kind's own formula.

    Exact for every mode but ``sparse``, whose stream is ``density * elements * rice_bits_per_entry /
    8`` in expectation (the few header bytes and the padding to a multiple of T are left out).
    """
    mode, fmt = parse_hint_mode(mode), Format(fmt)
    if isinstance(mode, HintMode):
        return hint_site_bytes(mode, fmt, site_shape)
    return compact_site_bytes(mode, Geometry(fmt, tuple(int(d) for d in site_shape)), density)
