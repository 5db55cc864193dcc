"""Quantization sites on the device without host synchronisation, so a decode step can run ahead of
the host (and be captured in a CUDA graph).

The public quantize ops read their non-finite flag back at every call (a NaN or Inf is refused with
its index at once): one host synchronisation per site per layer per decode step. A rollout instead
keeps each check as a device flag in its :class:`StepChecks` (OR-ed in place, never read) and reads
all of them once, after the rollout, when its records are assembled: a NaN or Inf is still refused,
naming the site, but per rollout rather than per call. The records themselves stay on the device
until then (they are gathered to the host once per rollout by the record assembly).

:func:`site_values` is what a rollout's site hook calls. On the Triton path (CUDA tensors, or CPU
tensors routed to the Triton kernels under ``TRITON_INTERPRET=1`` by
:func:`tracefp4.formats.dispatch.use_backend`, which is how the tests run this very code without a
GPU) the NVFP4 (standard recipe, per row or per tensor amax) and MXFP4 quantizers run the Triton
kernels here with the check deferred; every other quantizer, and every CPU tensor, takes the
quantizer's own path, which checks at once. Both give the same codes and values bit for bit.
"""

from __future__ import annotations

import torch

from tracefp4.formats.constants import FLOAT32_MAX, MXFP4_BLOCK, NVFP4_BLOCK, NVFP4_GLOBAL_NUMERATOR, Format, ScaleMode
from tracefp4.formats import MXFP4, NVFP4, as_rows, backend, check_input
from tracefp4.formats.quantizers import MXFP4Quantizer, NVFP4Quantizer, Quantizer

__all__ = ["NON_FINITE", "StepChecks", "deferrable", "site_values"]

#: What a site's flag means when it is found set.
NON_FINITE = "non-finite input (NaN/Inf is a bug upstream and is never encoded)"


class StepChecks:
    """Failure flags kept on the device during a rollout: ``(where, what) -> bool`` tensor, OR-ed in
    place by :meth:`note` (no host read), read once by :meth:`raise_if_any`."""

    def __init__(self) -> None:
        self._flags: dict[tuple[str, str], torch.Tensor] = {}

    def note(self, where: str, what: str, bad: torch.Tensor) -> None:
        """Keep ``bad.any()`` (a bool tensor of any shape, on the device) for ``where``/``what``."""
        seen = bad.any()
        flag = self._flags.get((where, what))
        if flag is None:
            self._flags[(where, what)] = seen.clone()
        else:
            flag.logical_or_(seen)

    def raise_if_any(self) -> None:
        """Read every flag in one host transfer and start over; raise ValueError naming each
        ``where: what`` found set."""
        keys, flags = list(self._flags), list(self._flags.values())
        self._flags = {}
        if not keys:
            return
        seen = torch.stack(flags).cpu().tolist()  # the rollout's one read of its device checks
        failed = [f"{where}: {what}" for (where, what), hit in zip(keys, seen) if hit]
        if failed:
            raise ValueError("; ".join(failed) + " (flagged on the device during this rollout)")


def deferrable(quantizer: Quantizer, x: torch.Tensor) -> bool:
    """Whether :func:`site_values` runs ``x`` through ``quantizer`` on the device with the check
    deferred (see the module docstring)."""
    if backend(x) != "triton":
        return False
    if isinstance(quantizer, NVFP4Quantizer):
        return quantizer.block_max == 6 and quantizer.global_amax is None and quantizer.amax_scope != "expert"
    return isinstance(quantizer, MXFP4Quantizer)


def _s_enc(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448*6/amax`` capped at FLT_MAX, 1 for amax 0, in float32 on amax's device: the recipe of
    :func:`tracefp4.formats.grid.nvfp4_global_encode_scale`, with its constants filled on the
    device instead of copied from the host (a host-to-device copy synchronises and cannot be captured
    in a CUDA graph). ``full_like / amax`` is IEEE division (``scalar / tensor`` would be a reciprocal
    times the scalar, off by an ulp); the site tests hold the two recipes equal bit for bit."""
    s = torch.clamp(torch.full_like(amax, NVFP4_GLOBAL_NUMERATOR) / amax, max=FLOAT32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _nvfp4(tk, rows: torch.Tensor, per_row: bool, lead: torch.Size):
    """(NVFP4 container, float32 values, bad [R]) of rows, as the formats' Triton path computes them."""
    n, k = rows.shape
    by_row = tk.row_amax(rows)  # a NaN/Inf row gets a finite amax here; the quantize pass flags it
    if per_row:
        amax = by_row.reshape(*lead, 1)
    else:  # an empty tensor has amax 0 (S_enc 1)
        amax = by_row.amax() if n else torch.zeros((), dtype=torch.float32, device=rows.device)
        by_row = amax.expand(n).contiguous()
    codes, scales, bad = tk.quantize_nvfp4(rows, by_row)
    values = tk.dequantize(codes, scales, Format.NVFP4.value, _s_enc(by_row), NVFP4_BLOCK)
    q = NVFP4(codes=codes.reshape(*lead, k // 2),
              scales=scales.view(torch.float8_e4m3fn).reshape(*lead, k // NVFP4_BLOCK), global_amax=amax)
    return q, values, bad


def _mxfp4(tk, rows: torch.Tensor, rceil: bool, lead: torch.Size):
    n, k = rows.shape
    codes, scales, bad = tk.quantize_mxfp4(rows, rceil)
    ones = torch.ones(n, dtype=torch.float32, device=rows.device)  # MXFP4 has no global scale
    values = tk.dequantize(codes, scales, Format.MXFP4.value, ones, MXFP4_BLOCK)
    q = MXFP4(codes=codes.reshape(*lead, k // 2), scales=scales.reshape(*lead, k // MXFP4_BLOCK))
    return q, values, bad


def site_values(quantizer: Quantizer, x: torch.Tensor, checks: StepChecks, where: str
                ) -> tuple[NVFP4 | MXFP4, torch.Tensor]:
    """``quantizer.quantize_values(x)`` (the site's code and the value its next op sees, in x's dtype),
    with the non-finite check kept in ``checks`` under ``where`` on the device path (see the module
    docstring) instead of read back at once."""
    if not deferrable(quantizer, x):
        return quantizer.quantize_values(x)
    from tracefp4.formats import triton_kernels as tk  # imports triton: only on the device path

    check_input(x, quantizer.block)
    rows = as_rows(x)
    if isinstance(quantizer, NVFP4Quantizer):
        q, values, bad = _nvfp4(tk, rows, quantizer.amax_scope == "row", x.shape[:-1])
    else:
        q, values, bad = _mxfp4(tk, rows, quantizer.scale_mode is ScaleMode.RCEIL, x.shape[:-1])
    checks.note(where, NON_FINITE, bad)
    return q, values.reshape(x.shape).to(x.dtype)
