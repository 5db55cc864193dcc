"""The compact record: one site's fields, each coded by its knob's codec (see :mod:`tracefp4.guidance.compact`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracefp4.formats.constants import Format, HintMode
from tracefp4.formats import FP8, MXFP4, NVFP4, pack_fp4, unpack_fp4
from tracefp4.formats.fp8 import fp8_grid_z
from tracefp4.guidance.coding import pack_bits, unpack_bits
from tracefp4.guidance.compact.codec import Geometry
from tracefp4.guidance.compact.grid import global_encode_scale, grid_z, rtn_codes
from tracefp4.guidance.compact.spec import GuidanceSpec, unsupported_knob
from tracefp4.guidance.hints import Hint, record_format
from tracefp4.guidance.report import DecodeReport

__all__ = ["CompactRecord", "compact_site_bytes"]


def _geometry_name(shape: Sequence[int]) -> str:
    return "g" + "x".join(str(int(d)) for d in shape)


def _parse_geometry(g: str) -> tuple[int, ...]:
    if re.fullmatch(r"g\d+(x\d+)*", g) is None:
        raise ValueError(f"not a site geometry: {g!r}")
    return tuple(int(d) for d in g[1:].split("x"))


def _packed_bits(spec: GuidanceSpec, geom: Geometry) -> int:
    return sum(c.bits(geom) for c in spec.codecs)


def compact_site_bytes(spec: GuidanceSpec, geom: Geometry, density: float | None = None) -> float:
    """Store bytes per token of a compact record (``sparse``: its stream in expectation at ``density``)."""
    total = float(sum(c.byte_count(geom) for c in spec.codecs))
    total += -(-_packed_bits(spec, geom) // 8)
    return total + spec.element_codec.stream_bytes(geom, density, spec.name)


@dataclasses.dataclass
class CompactRecord:
    """One site's compact guidance over T token rows.

    site_shape: per-token shape ``(*lead, K)`` of the site tensor (the record covers ``[T, *site_shape]``).
    amax: float32/bfloat16 values or uint8 ``lo<b>`` residues ``[T, *lead, 1]``; None for ``own`` and MXFP4.
    scales: e4m3 (or E8M0 uint8) ``[T, *lead, K/block]`` for ``full`` (FP8: its float32 row scale
        ``[T, *lead, 1]``); the low bits of the E4M3
        codes (uint8 0/1, same shape) for ``parity`` and, before compression, ``ldpc``; the check bits
        ``[T, checks]`` of a compressed ``ldpc``; None for ``own``.
    elements: unpacked codes (``full``), signed-line residues mod 4 (``mod4``) or low bits (``lsb``, ``ldpc``
        before compression) ``[T, *lead, K]``;
        int8 ``sparse`` plane (-1 where nothing is recorded, else the low bit); check bits
        ``[T, checks]`` of a compressed ``ldpc``.
    segments: trajectory lengths, set when read from tensors (``ldpc`` checks and ``sparse`` streams
        are per trajectory). None for a record fresh from the rollout (uncompressed, any rows).
    """

    spec: GuidanceSpec
    fmt: Format
    site_shape: tuple[int, ...]
    amax: torch.Tensor | None
    scales: torch.Tensor | None
    elements: torch.Tensor
    segments: tuple[int, ...] | None = None

    @property
    def rows(self) -> int:
        return int(self.elements.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, *self.site_shape))

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.fmt, self.site_shape)

    @property
    def compressed(self) -> bool:
        return self.segments is not None and self.spec.uses_ldpc

    @property
    def nbytes(self) -> int:
        """Bytes this record occupies in the store (the sum over its trajectories)."""
        return sum(t.nbytes for seg in self._split() for t in seg.to_tensors("L00.k").values())

    def bytes_per_token(self) -> float:
        """Store bytes per token of this record (a sparse one: its own stream bytes over its tokens)."""
        if self.spec.element_codec.kept(self.elements) is None:
            return compact_site_bytes(self.spec, self.geometry)
        return self.nbytes / self.rows

    def kept_elements(self) -> tuple[int, int] | None:
        return self.spec.element_codec.kept(self.elements)

    # -- rollout side --

    @classmethod
    def encode(cls, x: torch.Tensor, q: NVFP4 | MXFP4 | FP8, spec: GuidanceSpec) -> CompactRecord:
        """What the rollout keeps of site value ``x`` (``[T, *lead, K]``), quantized as ``q``."""
        if tuple(x.shape) != tuple(q.shape) or x.dim() < 2:
            raise ValueError(f"compact encode: x {tuple(x.shape)} vs quantized {tuple(q.shape)} (need [T, ..., K])")
        fmt = Format(q.fmt)
        # the entries refuse these before any rollout (check_supported); a tensor alone cannot tell a
        # Four over Six scale from a standard one, so only the format's own limits are checked here
        refused = unsupported_knob(spec, fmt)
        if refused is not None:
            raise ValueError(f"{spec.name}: {refused}")
        a, s, e = spec.codecs
        if fmt is Format.FP8:  # E4M3 codes as they are, FP8's float32 row scale as its one "block scale"
            shape = tuple(int(d) for d in x.shape[1:])
            return cls(spec, fmt, shape, None, s.encode(q.scale), e.encode(q.codes, None, fmt))
        amax = getattr(q, "global_amax", None)
        z = grid_z(x, fmt, q.scales, amax) if e.needs_z() else None
        elements = e.encode(unpack_fp4(q.codes), z, fmt)
        kept_amax = None
        if fmt is Format.NVFP4:
            kept_amax = a.encode(q.global_amax.to(torch.float32).expand(*q.shape[:-1], 1).clone())
        return cls(spec, fmt, tuple(int(d) for d in x.shape[1:]), kept_amax, s.encode(q.scales), elements)

    def select(self, index) -> CompactRecord:
        """Rows ``index`` (token positions) of an uncompressed record."""
        if self.segments is not None:
            raise ValueError("select() needs a record fresh from the rollout; records read back are per trajectory")
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return dataclasses.replace(self, amax=pick(self.amax), scales=pick(self.scales), elements=self.elements[index])

    def cat(self, others: Sequence[CompactRecord]) -> CompactRecord:
        """This record followed by ``others`` along the token dim (trajectories of a batch, or steps)."""
        records = [self, *others]
        for r in others:
            if (r.spec, r.fmt, r.site_shape) != (self.spec, self.fmt, self.site_shape):
                raise ValueError(f"record_cat: {r.spec.name} {r.site_shape} vs {self.spec.name} {self.site_shape}")
            if (r.segments is None) != (self.segments is None):
                raise ValueError("record_cat: mixing fresh rollout records with records read back")
        cat = lambda f: None if getattr(self, f) is None else torch.cat([getattr(r, f) for r in records])  # noqa: E731
        segments = None if self.segments is None else tuple(s for r in records for s in r.segments)
        return dataclasses.replace(self, amax=cat("amax"), scales=cat("scales"), elements=cat("elements"),
                                   segments=segments)

    # -- storage --

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        """The record's fields in its codecs' order (amax, scales, elements)."""
        return self.amax, self.scales, self.elements

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors for the store, treating the record as one trajectory (compressing ``ldpc``)."""
        if self.segments is not None and len(self.segments) != 1:
            raise ValueError(f"{prefix}: a record of {len(self.segments)} trajectories is written one at a time")
        t, geom, (a, s, e) = self.rows, self.geometry, self.spec.codecs
        suffix = f"{self.spec.tag}__{_geometry_name(self.site_shape)}"
        out = {**s.stored(self.scales, prefix, suffix, t), **a.stored(self.amax, prefix, suffix, t)}
        parts = [p for c, v in zip(self.spec.codecs, self._fields())
                 if (p := c.pack(v, geom, t, self.compressed)) is not None]
        bits = np.concatenate(parts, axis=1) if parts else np.zeros((t, 0), dtype=np.uint8)
        if bits.shape[1]:
            out[f"{prefix}.packed__{suffix}"] = torch.from_numpy(pack_bits(bits))
        out.update(e.stored(self.elements, prefix, suffix, t))
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> CompactRecord:
        """One trajectory's record from the store's tensors (inverse of :meth:`to_tensors`)."""
        tagged = [k for k in tensors if k.startswith(f"{prefix}.packed__") or k.startswith(f"{prefix}.stream__")]
        if not tagged:
            raise ValueError(f"no compact record named {prefix!r} (have: {sorted(tensors)})")
        suffixes = {k.split("__", 1)[1] for k in tagged}
        if len(suffixes) != 1:
            raise ValueError(f"{prefix}: compact fields of different specs/shapes: {sorted(tagged)}")
        suffix = next(iter(suffixes))
        tag, geom_name = suffix.rsplit("__", 1)
        spec, site_shape = GuidanceSpec.from_tag(tag), _parse_geometry(geom_name)
        t = int(tensors[tagged[0]].shape[0])
        scales_t = tensors.get(f"{prefix}.scales")
        # the scales' dtype names the format (as a Hint's); without recorded scales (scales:own) it is NVFP4
        fmt = Format.NVFP4 if scales_t is None else record_format(scales_t, f"compact record {prefix!r}")
        geom, where = Geometry(fmt, site_shape), f"{prefix} ({spec.name})"

        def expect(name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
            v = tensors.get(name)
            if v is None or tuple(v.shape) != shape or v.dtype not in dtypes:
                got = "missing" if v is None else f"{v.dtype} {tuple(v.shape)}"
                raise ValueError(f"{where}: {name} should be {dtypes[0]} {shape}, got {got}")
            return v

        codecs = spec.codecs
        fields = [c.read(tensors, prefix, suffix, geom, t, expect, where) for c in codecs[1:]]
        amax = codecs[0].read(tensors, prefix, suffix, geom, t, expect, where) if fmt is Format.NVFP4 else None
        fields.insert(0, amax)  # MXFP4 has no global amax
        nbits = _packed_bits(spec, geom)
        if nbits:
            packed = expect(f"{prefix}.packed__{suffix}", (t, -(-nbits // 8)), (torch.uint8,))
            bits, i = unpack_bits(packed.numpy(), nbits), 0
            for k, c in enumerate(codecs):
                w = c.bits(geom)
                if w:
                    fields[k] = c.unpack(bits[:, i : i + w], geom, t)
                i += w
        amax, scales, elements = fields
        return cls(spec, fmt, site_shape, amax, scales, torch.empty(0) if elements is None else elements, (t,))

    def _split(self) -> list[CompactRecord]:
        """One record per trajectory (a fresh rollout record is one)."""
        if self.segments is None or len(self.segments) == 1:
            return [self]
        out, start = [], 0
        for length in self.segments:
            part = {}
            for f in ("amax", "scales", "elements"):
                v = getattr(self, f)
                part[f] = None if v is None else v[start : start + length]
            out.append(dataclasses.replace(self, segments=(length,), **part))
            start += length
        return out

    # -- trainer side --

    def decode(self, x: torch.Tensor) -> tuple[Hint, DecodeReport]:
        """The lsb (or full) Hint this record means, given the trainer's own value ``x`` of the site,
        and what could not be decoded (a failed LDPC block takes the trainer's own values; see
        :mod:`tracefp4.guidance.compact`, "Decode failures"): amax, scales, elements in that order,
        each on the result of the one before."""
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(
                f"compact record {self.spec.name}: x has shape {tuple(x.shape)} but the record covers "
                f"{tuple(self.shape)}"
            )
        if self.spec.uses_ldpc and not self.compressed:
            raise ValueError(f"{self.spec.name}: an ldpc record decodes only once compressed (to_tensors/from_tensors)")
        x = x.detach()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("non-finite input; NaN/Inf is a bug upstream and is never encoded")
        (a, s, e), geom = self.spec.codecs, self.geometry
        if self.fmt is Format.FP8:  # only full scales and a codec that takes E4M3 codes get here (encode)
            codes, r_elements = e.decode(self.elements, None, fp8_grid_z(x, self.scales), self.segments, geom)
            return Hint(HintMode.FULL, self.fmt, codes, self.scales, None), r_elements
        amax, scales, report = None, self.scales, DecodeReport()
        if self.fmt is Format.NVFP4:
            amax, r_amax = a.decode(self.amax, x, self.segments, geom)
            scales, r_scales = s.decode(self.scales, x, global_encode_scale(amax), self.segments, geom)
            report = r_amax + r_scales
        if e.hint_mode is HintMode.FULL:
            return Hint(HintMode.FULL, self.fmt, pack_fp4(self.elements.to(torch.uint8)), scales, amax), report
        z = grid_z(x, self.fmt, scales, amax)
        decoded, r_elements = e.decode(self.elements, rtn_codes(z) & 1, z, self.segments, geom)
        if e.decodes_to is HintMode.FULL:
            return Hint(HintMode.FULL, self.fmt, pack_fp4(decoded), scales, amax), report + r_elements
        data = torch.from_numpy(pack_bits(decoded.numpy().astype(np.uint8)))
        return Hint(HintMode.LSB, self.fmt, data, scales, amax), report + r_elements
