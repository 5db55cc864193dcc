"""FP4 tensors (NVFP4, MXFP4): quantize, dequantize, pack, and straight-through fake quantization.

The recipes are those of ``shared/DESIGN.md`` section 2 (Transformer Engine's operation order for
NVFP4, OCP MX v1.0 for MXFP4); :mod:`tracefp4.formats.reference` spells them out and :mod:`tracefp4.formats.kernels`
runs them fast. This module validates inputs, shapes the data, and owns the public containers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tracefp4.formats import kernels
from tracefp4.formats.constants import (
    FLOAT32_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    E4M3_MAX,
    NVFP4_GLOBAL_NUMERATOR,
    SUPPORTED_DTYPES,
    Format,
    ScaleMode,
)

__all__ = [
    "NVFP4",
    "MXFP4",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "quantize",
    "dequantize",
    "pack_fp4",
    "unpack_fp4",
    "fake_quant",
    "nvfp4_global_encode_scale",
    "FP8",
    "quantize_fp8",
    "dequantize_fp8",
    "guided_codes",
    "lsb_bits",
    "clone_scales",
    "straight_through",
]


@dataclasses.dataclass
class NVFP4:
    """An NVFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]``, two 4-bit codes per byte, element 2i in the low nibble.
    scales: torch.float8_e4m3fn ``[..., K//16]``, one block scale per 16 elements.
    global_amax: float32, a scalar (per tensor) or ``[..., 1]`` (per row).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor

    fmt = Format.NVFP4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.global_amax.nbytes


@dataclasses.dataclass
class MXFP4:
    """An MXFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]`` packed as in :class:`NVFP4`.
    scales: uint8 ``[..., K//32]``, biased E8M0 exponents (value ``2^(s - 127)``).
    """

    codes: torch.Tensor
    scales: torch.Tensor

    fmt = Format.MXFP4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


@dataclasses.dataclass
class FP8:
    """An FP8 E4M3 tensor with one float32 scale per row (W4A8 activations).

    data: torch.float8_e4m3fn ``[..., K]``; scale: float32 ``[..., 1]`` (``amax / 448``, 1 for a zero row).
    """

    data: torch.Tensor
    scale: torch.Tensor

    fmt = "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


# --- validation ----------------------------------------------------------------------------------


def check_input(x: torch.Tensor, block: int, what: str = "x", *, cpu: bool = True) -> None:
    """Raise ValueError unless ``x`` is a float CPU tensor whose last dim is a multiple of ``block``.

    ``cpu=False`` leaves the device to the caller (the Triton kernels). Finiteness is checked by the
    kernels in the same pass that quantizes (see :func:`raise_non_finite`).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported; expected one of float32, bfloat16, float16")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        last = "a scalar" if x.dim() == 0 else f"last dim {x.shape[-1]}"
        raise ValueError(f"{what}: {last} is not a multiple of the block size {block} (shape {tuple(x.shape)})")
    if cpu and x.device.type != "cpu":
        raise ValueError(f"{what}: the CPU kernels take CPU tensors, got device {x.device}")


def raise_non_finite(x: torch.Tensor, bad: np.ndarray, what: str = "x") -> None:
    """Refuse input in which a kernel flagged a NaN or Inf, naming the first offending element."""
    if bad.any():
        flat = x.detach().reshape(-1, x.shape[-1])
        row = int(np.flatnonzero(bad)[0])
        col = int((~torch.isfinite(flat[row])).nonzero()[0, 0])
        index = tuple(np.unravel_index(row, tuple(x.shape[:-1]))) + (col,) if x.dim() > 1 else (col,)
        raise ValueError(
            f"{what}: non-finite input at index {tuple(int(i) for i in index)} (value {flat[row, col].item()}); "
            "NaN/Inf is a bug upstream and is never encoded"
        )


_NO_BLOCK_MAX = np.empty((0, 0), dtype=np.uint32)

#: The kernels' view of each input dtype (see :mod:`tracefp4.formats.kernels`): 16-bit formats travel as their
#: bit patterns, and the integer dtype tells the kernel which widening to compile.
_KERNEL_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def kernel_rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as 2-D rows for the kernels, without a copy when ``x`` is contiguous.

    float32 stays float32; bfloat16 and float16 are passed as their bits and widened in the kernels,
    so no float32 temporary of the input is ever made.
    """
    x = x.detach().contiguous()
    return x.view(_KERNEL_VIEW[x.dtype]).reshape(_row_count(x), x.shape[-1]).numpy()


def _row_count(x: torch.Tensor) -> int:
    return int(np.prod(tuple(x.shape[:-1]), dtype=np.int64))


# --- NVFP4 ---------------------------------------------------------------------------------------


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448*6/amax`` in float32, capped at FLT_MAX; amax 0 gives 1."""
    amax = amax.to(torch.float32)
    s_enc = torch.minimum(
        torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=torch.float32) / amax,
        torch.tensor(FLOAT32_MAX, dtype=torch.float32),
    )
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def _global_amax(x: torch.Tensor, global_amax) -> torch.Tensor:
    """A given global amax, validated: a scalar or ``[..., 1]``, finite and non-negative."""
    amax = torch.as_tensor(global_amax, dtype=torch.float32)
    lead = tuple(x.shape[:-1])
    if amax.dim() != 0 and tuple(amax.shape) != (*lead, 1):
        raise ValueError(
            f"global_amax: shape {tuple(amax.shape)} does not fit x of shape {tuple(x.shape)}; "
            f"expected a scalar or {(*lead, 1)}"
        )
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError("global_amax: must be finite and non-negative")
    return amax.clone()


def _per_row(t: torch.Tensor, x_shape: torch.Size) -> np.ndarray:
    """A scalar or [..., 1] tensor as a float32 [R] array."""
    rows = int(np.prod(tuple(x_shape[:-1]), dtype=np.int64))
    return t.to(torch.float32).expand(*x_shape[:-1], 1).reshape(rows).contiguous().numpy()


def quantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """Quantize ``x [..., K]`` (K % 16 == 0) to NVFP4.

    ``global_amax=None`` takes the amax of the whole tensor, or of each row with ``per_row=True``;
    a tensor passed in (a scalar, or ``[..., 1]``) is used as is.
    """
    check_input(x, NVFP4_BLOCK)
    rows = kernel_rows(x)
    n, k = rows.shape
    lead = x.shape[:-1]
    bad = np.zeros(n, dtype=np.bool_)
    block_max = _NO_BLOCK_MAX
    with kernels.threads_for(rows.nbytes):
        if global_amax is not None:
            amax = _global_amax(x, global_amax)
            row_amax = _per_row(amax, x.shape)  # read only: the kernel writes it back only with own_amax
        elif per_row:
            row_amax = np.empty(n, dtype=np.float32)  # the kernel finds each row's amax in its own pass
        else:
            # a per-tensor amax needs the whole tensor before the first scale: a first pass keeps the
            # block amaxes (1/8 of a bf16 input's size) so the second only has to code
            row_amax = np.empty(n, dtype=np.float32)
            block_max = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint32)
            kernels.nvfp4_block_amax(rows, block_max, row_amax, bad, kernels.row_chunks(n))
            raise_non_finite(x, bad)
            amax = torch.from_numpy(row_amax).amax() if n else torch.zeros((), dtype=torch.float32)
            row_amax[:] = amax.item()
        codes = np.empty((n, k // 2), dtype=np.uint8)
        scales = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint8)
        own_amax = global_amax is None and per_row
        kernels.nvfp4_quantize(rows, row_amax, own_amax, block_max, codes, scales, bad, kernels.row_chunks(n))
    raise_non_finite(x, bad)
    if own_amax:
        amax = torch.from_numpy(row_amax).reshape(*lead, 1)
    return NVFP4(
        codes=torch.from_numpy(codes).reshape(*lead, codes.shape[-1]),
        scales=torch.from_numpy(scales).view(torch.float8_e4m3fn).reshape(*lead, scales.shape[-1]),
        global_amax=amax,
    )


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, scale_values: np.ndarray, row_div: np.ndarray, block: int):
    n = _row_count(codes)
    rows = codes.reshape(n, codes.shape[-1]).contiguous().numpy()
    scale_bytes = scales.reshape(n, scales.shape[-1]).contiguous().view(torch.uint8).numpy()
    out = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.float32)
    with kernels.threads_for(out.nbytes):
        kernels.dequantize(rows, scale_bytes, scale_values, row_div, block, out, kernels.row_chunks(rows.shape[0]))
    return torch.from_numpy(out)


def dequantize_nvfp4(q: NVFP4) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * float(s8) / S_enc``."""
    s_enc = _per_row(nvfp4_global_encode_scale(q.global_amax), q.shape)
    return _dequantize(q.codes, q.scales, kernels.E4M3_VALUES, s_enc, NVFP4_BLOCK).reshape(q.shape)


# --- MXFP4 ---------------------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor, *, scale_mode: str = "floor") -> MXFP4:
    """Quantize ``x [..., K]`` (K % 32 == 0) to MXFP4 with E8M0 block scales (see ScaleMode)."""
    mode = ScaleMode(scale_mode)
    check_input(x, MXFP4_BLOCK)
    n, k = _row_count(x), x.shape[-1]
    codes = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // MXFP4_BLOCK), dtype=np.uint8)
    bad = np.zeros(n, dtype=np.bool_)
    rows = kernel_rows(x)
    with kernels.threads_for(rows.nbytes):
        kernels.mxfp4_quantize(rows, mode is ScaleMode.RCEIL, codes, scales, bad, kernels.row_chunks(n))
    raise_non_finite(x, bad)
    lead = x.shape[:-1]
    return MXFP4(codes=torch.from_numpy(codes).reshape(*lead, codes.shape[-1]), scales=torch.from_numpy(scales).reshape(*lead, scales.shape[-1]))


def mx_scale_values(biased: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(b - 127)`` of biased E8M0 exponents (exact, 2^-127 included)."""
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), biased.to(torch.float64) - 127).to(torch.float32)


def dequantize_mxfp4(q: MXFP4) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * 2^(s - 127)``."""
    ones = np.ones(_row_count(q.codes), dtype=np.float32)  # x / 1 == x: the NVFP4 formula with S_enc 1
    return _dequantize(q.codes, q.scales, kernels.E8M0_VALUES, ones, MXFP4_BLOCK).reshape(q.shape)


def quantize(x: torch.Tensor, fmt: str | Format = "nvfp4", *, per_row: bool = False, global_amax=None):
    """Round-to-nearest quantization in either format (``per_row``/``global_amax`` are NVFP4's)."""
    if Format(fmt) is Format.NVFP4:
        return quantize_nvfp4(x, global_amax=global_amax, per_row=per_row)
    return quantize_mxfp4(x)


def dequantize(q: NVFP4 | MXFP4) -> torch.Tensor:
    return dequantize_nvfp4(q) if isinstance(q, NVFP4) else dequantize_mxfp4(q)


# --- packing -------------------------------------------------------------------------------------


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """One 4-bit code per uint8 ``[..., K]`` -> two per byte ``[..., K//2]`` (element 2i low nibble)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4: expected uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("pack_fp4: codes must be 4-bit values 0..15")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two codes per byte ``[..., N]`` -> one per uint8 ``[..., 2N]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# --- straight-through fake quantization ----------------------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """Forward returns a precomputed value; backward passes the gradient to x unchanged."""

    @staticmethod
    def forward(ctx, x, value):  # noqa: D401 - autograd signature
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in x's dtype in the forward pass, identity gradient to ``x``."""
    return _StraightThrough.apply(x, value.to(x.dtype))


def fake_quant(
    x: torch.Tensor, fmt: str | Format = "nvfp4", *, per_row: bool = False, global_amax=None
) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize with a straight-through gradient, in x's dtype."""
    q = quantize(x.detach(), fmt, per_row=per_row, global_amax=global_amax)
    return straight_through(x, dequantize(q))


def lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K//2]`` -> bit-packed low magnitude bits ``[..., K//8]``."""
    flat = codes.reshape(_row_count(codes), codes.shape[-1]).contiguous().numpy()
    bits = np.empty((flat.shape[0], flat.shape[1] // 4), dtype=np.uint8)
    # a few bit operations per byte: one thread keeps up with memory until the codes are large
    with kernels.threads_for(flat.nbytes, grain=16 * kernels.GRAIN_BYTES):
        kernels.pack_lsb(flat, bits)
    return torch.from_numpy(bits).reshape(*codes.shape[:-1], bits.shape[-1])


# --- FP8 E4M3 with a per-row scale (W4A8 activations) --------------------------------------------


def quantize_fp8(x: torch.Tensor) -> FP8:
    """FP8 E4M3 with one float32 scale ``amax/448`` per row (any device: plain torch ops)."""
    xf = x.detach().to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("x: non-finite input; NaN/Inf is a bug upstream and is never encoded")
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # Clamp before the cast: older CPU casts turn overflow into NaN instead of saturating.
    return FP8((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale)


def dequantize_fp8(q: FP8) -> torch.Tensor:
    return q.data.to(torch.float32) * q.scale


# --- rollout-guided rounding on a given grid -----------------------------------------------------


def clone_scales(scales: torch.Tensor) -> torch.Tensor:
    """A copy of block scales, made as a plain byte copy.

    torch copies float8 element by element, and hands even a 1 MB copy to its thread pool; a numpy
    copy of the bytes is a single memcpy, with the same bits.
    """
    if scales.device.type != "cpu":
        return scales.clone()
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    out = torch.from_numpy(raw.detach().numpy().copy())
    return out.view(scales.dtype) if scales.dtype == torch.float8_e4m3fn else out


def guided_codes(
    x: torch.Tensor,
    fmt: Format | str,
    scales: torch.Tensor,
    global_amax: torch.Tensor | None,
    *,
    codes: torch.Tensor | None = None,
    lsb: torch.Tensor | None = None,
) -> NVFP4 | MXFP4:
    """Quantize ``x`` on the grid ``(scales, global_amax)``, each element rounded to the member of its
    bracket that ``codes`` (packed 4-bit codes, full information) or ``lsb`` (low magnitude bits,
    eight per byte) names. Exactly one of the two is given; shapes are checked by the caller
    (:func:`tracefp4.guidance.hints.guided_quantize`)."""
    fmt = Format(fmt)
    if (codes is None) == (lsb is None):
        raise ValueError("guided_codes: give exactly one of codes (full) or lsb")
    check_input(x, fmt.block)
    n, k = _row_count(x), x.shape[-1]
    # The kernels rebuild each block's encode factor from the stored scale byte, as the reference does.
    scale_bytes = scales.reshape(n, scales.shape[-1]).contiguous().view(torch.uint8).numpy()
    if fmt is Format.NVFP4:
        s_enc = _per_row(nvfp4_global_encode_scale(global_amax), x.shape)
        s_dec = np.float32(1.0) / s_enc
        values = kernels.E4M3_VALUES
    else:
        s_dec = np.ones(n, dtype=np.float32)
        values = kernels.E8M0_VALUES
    hint = codes if codes is not None else lsb
    out = np.empty((n, k // 2), dtype=np.uint8)
    data = hint.reshape(n, hint.shape[-1]).contiguous().numpy()
    bad = np.zeros(n, dtype=np.bool_)
    guided = kernels.guided_full if codes is not None else kernels.guided_lsb
    rows = kernel_rows(x)
    with kernels.threads_for(rows.nbytes):
        guided(rows, scale_bytes, values, s_dec, data, fmt.block, out, bad, kernels.row_chunks(n))
    raise_non_finite(x, bad)
    codes_t = torch.from_numpy(out).reshape(*x.shape[:-1], out.shape[-1])
    if fmt is Format.NVFP4:
        return NVFP4(codes_t, clone_scales(scales), torch.as_tensor(global_amax, dtype=torch.float32).clone())
    return MXFP4(codes_t, clone_scales(scales))
