"""Validation of what enters an op: input tensors, containers' fields, grids and global amaxes.

Every error names the argument (or the container and field) and what was found. Finiteness of an
input is checked by the kernels in the same pass that quantizes (:func:`raise_non_finite` turns their
per-row flags into the error naming the first offending element).
"""

from __future__ import annotations

import numpy as np
import torch

from tracefp4.formats import kernels
from tracefp4.formats.constants import (DEQUANTIZE_DTYPES, E4M3_MAG_MASK, E4M3_NAN_CODE, E8M0_NAN, FLOAT32_MAX,
                                        SUPPORTED_DTYPES, Format)
from tracefp4.formats.rows import as_rows, numpy_of

__all__ = ["FP8_NON_FINITE", "check_codes", "check_global_amax", "check_grid", "check_hint", "check_input",
           "check_out_dtype", "checked_scale_copy", "describe", "expect", "raise_non_finite", "shape_tuple"]

_SCALE_DTYPE = {Format.NVFP4: torch.float8_e4m3fn, Format.MXFP4: torch.uint8}


def shape_tuple(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def describe(t) -> str:
    """What was found, for an error message: a tensor's dtype and shape, else the value's type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} of shape {shape_tuple(t.shape)}"


def expect(q, cls):
    """``q`` if it is a ``cls`` container, else ValueError naming what it is."""
    if not isinstance(q, cls):
        raise ValueError(f"expected an {cls.__name__} tensor, got {type(q).__name__}")
    return q


def check_hint(hint, name: str, owner: str, x: torch.Tensor, per_byte: int) -> None:
    """A guide ``hint`` for ``x``: uint8 ``[..., K/per_byte]`` over x's leading dims."""
    want = (*shape_tuple(x.shape[:-1]), x.shape[-1] // per_byte)
    if not isinstance(hint, torch.Tensor) or hint.dtype != torch.uint8 or shape_tuple(hint.shape) != want:
        raise ValueError(
            f"{owner} {name}: expected uint8 of shape {want} for x of shape {shape_tuple(x.shape)}, "
            f"got {describe(hint)}"
        )




def check_input(x: torch.Tensor, block: int, what: str = "x") -> None:
    """Raise ValueError unless ``x`` is a float tensor whose last dim is a multiple of ``block``.

    The device is checked by :func:`backend`. Finiteness is checked by the kernels in the same pass
    that quantizes (see :func:`raise_non_finite`).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported; expected one of float32, bfloat16, float16")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        last = "a scalar" if x.dim() == 0 else f"last dim {x.shape[-1]}"
        raise ValueError(f"{what}: {last} is not a multiple of the block size {block} (shape {shape_tuple(x.shape)})")


def check_codes(codes, block: int, owner: str) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0:
        raise ValueError(f"{owner} codes: expected uint8 of shape [..., K/2], got {describe(codes)}")
    if (2 * codes.shape[-1]) % block:
        raise ValueError(
            f"{owner} codes: last dim {codes.shape[-1]} holds {2 * codes.shape[-1]} elements, "
            f"not a multiple of the block size {block}"
        )


def _check_amax_values(amax: torch.Tensor, what: str) -> None:
    if amax.device.type == "cpu":  # numpy: a fraction of torch's per-op cost on these small tensors
        a = amax.detach().numpy()
        ok = bool(np.isfinite(a).all() and (a >= 0).all())
    else:  # one device sync: NaN fails both comparisons
        ok = bool(((amax >= 0) & (amax <= FLOAT32_MAX)).all())
    if not ok:
        raise ValueError(f"{what}: must be finite and non-negative")


def check_global_amax(global_amax, shape, what: str = "global_amax") -> torch.Tensor:
    """A global amax given for a tensor of ``shape``, validated and copied as float32.

    A scalar or ``[..., 1]`` over ``shape``'s leading dims, finite and non-negative. Python numbers
    and other float dtypes are accepted here (an argument, not a stored container).
    """
    amax = torch.as_tensor(global_amax, dtype=torch.float32)
    lead = shape_tuple(shape[:-1])
    if amax.dim() != 0 and shape_tuple(amax.shape) != (*lead, 1):
        raise ValueError(
            f"{what}: shape {shape_tuple(amax.shape)} does not fit x of shape {shape_tuple(shape)}; "
            f"expected a scalar or {(*lead, 1)}"
        )
    _check_amax_values(amax, what)
    return amax.clone()


#: A scale byte b is NaN when ``b & mask == value``: E4M3 0x7F/0xFF, E8M0 255.
_NAN_SCALE = {Format.NVFP4: (E4M3_MAG_MASK, E4M3_NAN_CODE), Format.MXFP4: (0xFF, E8M0_NAN)}


def _check_scale_codes(fmt: Format, scales: torch.Tensor, owner: str) -> None:
    """Refuse NaN scale codes, naming the first. One vectorised pass over the scale bytes."""
    mask, value = _NAN_SCALE[fmt]
    raw = scales.view(torch.uint8)
    if raw.device.type == "cpu":
        if not kernels.count_masked(numpy_of(raw).reshape(-1), np.uint8(mask), np.uint8(value)):
            return
    elif not bool(((raw & mask) == value).any()):
        return
    index = tuple(int(i) for i in ((raw & mask) == value).nonzero()[0])
    raise ValueError(
        f"{owner} scales: NaN scale code 0x{int(raw[index]):02X} at index {index}; a grid never holds NaN"
    )


def check_out_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    """``dtype`` if a dequantization writes it (:data:`~tracefp4.formats.constants.DEQUANTIZE_DTYPES`),
    else ValueError naming ``where``."""
    if dtype not in DEQUANTIZE_DTYPES:
        raise ValueError(f"{where} dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


def checked_scale_copy(fmt: Format | str, scales: torch.Tensor, owner: str = "grid") -> torch.Tensor:
    """A copy of a grid's scales whose dtype and shape were checked (``check_grid(..., scan_scales=False)``),
    refusing NaN codes with :func:`check_grid`'s words. On the CPU the copy and the NaN count are one
    pass over the bytes (a clone after a check reads them twice, the first time from memory)."""
    fmt = Format(fmt)
    if scales.device.type != "cpu":
        _check_scale_codes(fmt, scales, owner)
        return scales.clone()
    raw = numpy_of(scales.view(torch.uint8))
    out = np.empty_like(raw)
    mask, value = _NAN_SCALE[fmt]
    if kernels.copy_count_masked(raw.reshape(-1), out.reshape(-1), np.uint8(mask), np.uint8(value)):
        _check_scale_codes(fmt, scales, owner)  # raises, naming the first
    copy = torch.from_numpy(out)
    return copy if scales.dtype == torch.uint8 else copy.view(scales.dtype)


def check_grid(
    fmt: Format | str,
    scales,
    global_amax,
    shape,
    owner: str = "grid",
    *,
    device: torch.device | None = None,
    scan_scales: bool = True,
) -> None:
    """Raise ValueError unless ``(scales, global_amax)`` is a valid grid for a tensor of ``shape``.

    scales: ``[..., K/block]`` over ``shape``'s leading dims, float8_e4m3fn (NVFP4) or uint8 (MXFP4),
    no NaN codes; on ``device`` when one is given. global_amax: NVFP4 only, float32, a scalar or
    ``[..., 1]``, finite and non-negative; None for MXFP4. Shapes and dtypes cost nothing; the NaN
    check is one vectorised pass over the scales (1/16 or 1/32 of the elements); ``scan_scales=False``
    leaves it to the caller's :func:`checked_scale_copy` (one pass that also copies them).
    """
    fmt = Format(fmt)
    shape = shape_tuple(shape)
    lead, k = shape[:-1], shape[-1]
    if fmt is Format.FP8:
        _check_fp8_scale(scales, global_amax, lead, owner, device)
        return
    dtype = _SCALE_DTYPE[fmt]
    expect = (*lead, k // fmt.block)
    name = str(dtype).removeprefix("torch.")
    if not isinstance(scales, torch.Tensor) or scales.dtype != dtype or shape_tuple(scales.shape) != expect:
        raise ValueError(
            f"{owner} scales: expected {name} of shape {expect} for a {fmt.value} tensor of shape {shape}, "
            f"got {describe(scales)}"
        )
    if device is not None and scales.device != device:
        raise ValueError(f"{owner} scales: expected device {device} (where the codes are), got {scales.device}")
    if scan_scales:
        _check_scale_codes(fmt, scales, owner)
    if fmt is Format.MXFP4:
        if global_amax is not None:
            raise ValueError(f"{owner} global_amax: expected None for mxfp4 (E8M0 scales are absolute), got {describe(global_amax)}")
        return
    if not isinstance(global_amax, torch.Tensor) or global_amax.dtype != torch.float32:
        raise ValueError(
            f"{owner} global_amax: expected float32, a scalar or of shape {(*lead, 1)}, got "
            f"{'None' if global_amax is None else describe(global_amax)}"
        )
    if global_amax.dim() != 0 and shape_tuple(global_amax.shape) != (*lead, 1):
        raise ValueError(
            f"{owner} global_amax: expected float32, a scalar or of shape {(*lead, 1)}, got {describe(global_amax)}"
        )
    _check_amax_values(global_amax, f"{owner} global_amax")


def _check_fp8_scale(scale, global_amax, lead: tuple[int, ...], owner: str, device) -> None:
    """An FP8 grid: one finite, positive float32 scale per row, ``[..., 1]``; no global amax."""
    expect = (*lead, 1)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or shape_tuple(scale.shape) != expect:
        raise ValueError(f"{owner} scales: expected float32 of shape {expect} (one FP8 scale per row), got {describe(scale)}")
    if device is not None and scale.device != device:
        raise ValueError(f"{owner} scales: expected device {device}, got {scale.device}")
    if global_amax is not None:
        raise ValueError(f"{owner} global_amax: expected None for fp8 (the row scale is the grid), got {describe(global_amax)}")
    if not bool(((scale > 0) & (scale <= FLOAT32_MAX)).all()):
        raise ValueError(f"{owner} scales: an FP8 row scale must be finite and positive")


#: What an FP8 quantize says of a NaN or Inf (every backend alike: its row scale is found first).
FP8_NON_FINITE = "x: non-finite input; NaN/Inf is a bug upstream and is never encoded"


def raise_non_finite(x: torch.Tensor, bad, what: str = "x") -> None:
    """Refuse input in which a kernel flagged a NaN or Inf (``bad`` [R], per row), naming the first
    offending element. ``bad`` may be a numpy array (CPU kernels) or a tensor on x's device."""
    if isinstance(bad, np.ndarray):  # a CPU kernel's flags: numpy answers without a tensor round trip
        if not bad.any():
            return
    bad = torch.as_tensor(bad)
    if not bool(bad.any()):
        return
    flat = as_rows(x)
    row = int(bad.nonzero()[0, 0])
    col = int((~torch.isfinite(flat[row])).nonzero()[0, 0])
    index = tuple(np.unravel_index(row, tuple(x.shape[:-1]))) + (col,) if x.dim() > 1 else (col,)
    raise ValueError(
        f"{what}: non-finite input at index {tuple(int(i) for i in index)} (value {flat[row, col].item()}); "
        "NaN/Inf is a bug upstream and is never encoded"
    )
