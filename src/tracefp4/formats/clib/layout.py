"""The layouts the packed-FP4 GEMM reads its weights in (:class:`Layout`), and the conversions to and
from the standard one (codes ``[E, N, K/2]``, element 2i in the low nibble of byte i; scales
``[E, N, K/block]``): the same codes, two per byte, with the bytes permuted for the kernels that
read them (see ``csrc/kernels.c``). :func:`preferred_layout` is the one this CPU multiplies fastest:
``panels`` (AMX tiles) where the CPU and OS run AMX, ``tiles`` (AVX-512 BF16) elsewhere.
"""

from __future__ import annotations

import enum
import os

import torch

from tracefp4.formats.clib.loader import has_amx

__all__ = ["Layout", "code_bytes", "kernel_layout", "kernel_scales", "preferred_layout", "standard_layout",
           "standard_scales"]


class Layout(enum.Enum):
    """How the kernel holds a weight's codes and scales (the standard layout: codes ``[E, N, K/2]``,
    element 2i in the low nibble of byte i; scales ``[E, N, K/block]``)."""

    TILES = "tiles"
    """For the AVX-512 BF16 streaming kernels: codes ``[E, N/4, 4 * code_bytes(K, block)]``, each row's
    bytes permuted so that a vector lane sums one block's products, the rows of each 4-column tile
    interleaved 32 bytes at a time; scales standard. N a multiple of 4."""

    PANELS = "panels"
    """For AMX (and an AVX-512 BF16 kernel for experts with one or two rows): codes ``[E, N/16, K/4, 32]``,
    byte ``(e, p, t, 2c + h)`` = standard byte ``2t + h`` of column ``16p + c`` (a quad of 4 elements
    of 16 columns: two B-tile rows once decoded); scales ``[E, N/16, K/block, 16]``, ``(e, p, b, c)``
    = block b of column 16p + c. N a multiple of 16."""


def preferred_layout(n: int) -> Layout:
    """The layout this CPU multiplies ``[*, N]`` outputs fastest in: ``panels`` where the AMX path runs
    and N is a multiple of 16, else ``tiles``. ``TRACEFP4_CPU_LAYOUT=tiles|panels`` forces one (for A/B
    benchmarks and tests; panels still needs N a multiple of 16)."""
    forced = os.environ.get("TRACEFP4_CPU_LAYOUT")
    if forced:
        try:
            return Layout(forced)
        except ValueError:
            raise ValueError(f"TRACEFP4_CPU_LAYOUT: expected one of {[m.value for m in Layout]}, got {forced!r}") from None
    return Layout.PANELS if n % 16 == 0 and has_amx() else Layout.TILES



def code_bytes(k: int, block: int) -> int:
    """Bytes per weight row in the kernel layout: blocks 16 at a time, each 16-block super-group
    ``block / 4`` groups of 32 bytes (the last super-group padded with zero codes)."""
    return -(-(k // block) // 16) * (block // 4) * 32


_LAYOUTS: dict[tuple[int, int], torch.Tensor] = {}


def _source_bytes(k: int, block: int) -> torch.Tensor:
    """For each kernel-layout byte, the standard-layout byte it holds (-1: padding): byte 2l+i of
    group p of super-group q holds standard byte (block/2)(16q+l) + 2p + i."""
    key = (k, block)
    if key not in _LAYOUTS:
        nb, groups = k // block, block // 4
        q, p, lane, i = torch.meshgrid(torch.arange(-(-nb // 16)), torch.arange(groups), torch.arange(16),
                                       torch.arange(2), indexing="ij")
        blk = 16 * q + lane
        src = (block // 2) * blk + 2 * p + i
        _LAYOUTS[key] = torch.where(blk < nb, src, torch.full_like(src, -1)).reshape(-1)
    return _LAYOUTS[key]


def kernel_layout(codes: torch.Tensor, block: int, layout: Layout = Layout.TILES) -> torch.Tensor:
    """Standard packed codes ``[E, N, K/2]`` (element 2i in the low nibble of byte i) -> the codes in
    ``layout`` (:class:`Layout`)."""
    layout = Layout(layout)
    e, n, half = codes.shape
    if layout is Layout.PANELS:
        if n % 16:
            raise ValueError(f"kernel_layout: the panels layout needs N a multiple of 16, got codes of shape "
                             f"{tuple(codes.shape)}")
        return codes.reshape(e, n // 16, 16, half // 2, 2).permute(0, 1, 3, 2, 4).reshape(e, n // 16, half // 2, 32)
    if n % 4:
        raise ValueError(f"kernel_layout: N must be a multiple of 4, got codes of shape {tuple(codes.shape)}")
    src = _source_bytes(2 * half, block).to(codes.device)
    rows = torch.where(src >= 0, codes[..., src.clamp(min=0)], torch.zeros((), dtype=codes.dtype, device=codes.device))
    groups = rows.shape[-1] // 32
    return rows.reshape(e, n // 4, 4, groups, 32).transpose(2, 3).reshape(e, n // 4, -1).contiguous()


def standard_layout(kcodes: torch.Tensor, k: int, block: int, layout: Layout = Layout.TILES) -> torch.Tensor:
    """The inverse of :func:`kernel_layout` for rows of ``k`` elements: ``[E, N, K/2]``."""
    if Layout(layout) is Layout.PANELS:
        e, panels, quads, _ = kcodes.shape
        return kcodes.reshape(e, panels, quads, 16, 2).permute(0, 1, 3, 2, 4).reshape(e, 16 * panels, 2 * quads)
    e, tiles, _ = kcodes.shape
    src = _source_bytes(k, block).to(kcodes.device)
    rows = kcodes.reshape(e, tiles, -1, 4, 32).transpose(2, 3).reshape(e, 4 * tiles, -1)
    out = torch.empty(e, 4 * tiles, k // 2, dtype=kcodes.dtype, device=kcodes.device)
    out[..., src[src >= 0]] = rows[..., src >= 0]
    return out


def kernel_scales(scales: torch.Tensor, layout: Layout = Layout.TILES) -> torch.Tensor:
    """Standard scale bytes ``[E, N, K/block]`` -> the scales in ``layout`` (the tiles layout keeps
    them; panels: ``[E, N/16, K/block, 16]``)."""
    if Layout(layout) is Layout.TILES:
        return scales.contiguous()
    e, n, nb = scales.shape
    if n % 16:
        raise ValueError(f"kernel_scales: the panels layout needs N a multiple of 16, got scales of shape "
                         f"{tuple(scales.shape)}")
    return scales.reshape(e, n // 16, 16, nb).transpose(2, 3).contiguous()


def standard_scales(kscales: torch.Tensor, layout: Layout = Layout.TILES) -> torch.Tensor:
    """The inverse of :func:`kernel_scales`: ``[E, N, K/block]``."""
    if Layout(layout) is Layout.TILES:
        return kscales
    e, panels, nb, _ = kscales.shape
    return kscales.transpose(2, 3).reshape(e, 16 * panels, nb)

