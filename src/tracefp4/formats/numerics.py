"""FP4 tensors (NVFP4, MXFP4) and FP8: containers, quantize, dequantize, pack, straight-through, guided
rounding on either grid, and NVFP4 with residual activation compensation.

NVFP4 follows Transformer Engine's operation order and MXFP4 the OCP MX v1.0 recipe; the formulas
are stated on :class:`tracefp4.formats.constants.Format` and :class:`ScaleMode`,
:mod:`tracefp4.formats.reference` spells them out plainly, and the kernels run them fast.

This module owns the public containers and ops. Every op validates what enters it (input tensors,
containers, grids) and then hands the work to the kernels of the tensor's device, chosen in one
place, :func:`backend`: CPU tensors go to the numba kernels (:mod:`tracefp4.formats.kernels`), CUDA
tensors to the Triton kernels (:mod:`tracefp4.formats.triton_kernels`, imported only when needed).
Both are bit for bit equal to the reference; nothing is copied to the host to be quantized.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Literal

import numpy as np
import torch

from tracefp4.formats import csite, kernels
from tracefp4.formats.constants import (
    E4M3_MAG_MASK,
    E4M3_MAX,
    E4M3_MAX_CODE,
    E4M3_NAN_CODE,
    E4M3_SIGN_BIT,
    E4M3_VALUES,
    E8M0_BIAS,
    E8M0_NAN,
    E2M1_VALUES,
    E8M0_VALUES,
    FLOAT32_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_NUMERATOR,
    SUPPORTED_DTYPES,
    Format,
    ScaleMode,
)

__all__ = [
    "NVFP4",
    "MXFP4",
    "FP8",
    "Backend",
    "backend",
    "use_backend",
    "check_input",
    "check_global_amax",
    "check_grid",
    "row_count",
    "as_rows",
    "per_row_values",
    "raise_non_finite",
    "quantize_nvfp4",
    "quantize_dequantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "dequantize",
    "mx_scale_values",
    "pack_fp4",
    "unpack_fp4",
    "code_positions",
    "nvfp4_global_encode_scale",
    "quantize_fp8",
    "dequantize_fp8",
    "guided_fp8",
    "fp8_lsb_bits",
    "CompensatedNVFP4",
    "rac_channel_count",
    "quantize_nvfp4_rac",
    "dequantize_nvfp4_rac",
    "guided_codes",
    "lsb_bits",
    "clone_scales",
    "straight_through",
]

_SCALE_DTYPE = {Format.NVFP4: torch.float8_e4m3fn, Format.MXFP4: torch.uint8}


def _fmt_shape(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _found(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} of shape {_fmt_shape(t.shape)}"


# --- rows ----------------------------------------------------------------------------------------
# Every kernel, CPU or GPU, sees a tensor [..., K] as 2-D rows [R, K]; per-row quantities are [R].


def row_count(shape) -> int:
    """Number of rows of a tensor of ``shape``: the product of its leading dims (1 for a vector)."""
    return math.prod(shape[:-1])


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` as contiguous rows ``[R, K]`` on its own device (no copy when contiguous)."""
    return t.detach().contiguous().reshape(row_count(t.shape), t.shape[-1])


def per_row_values(t: torch.Tensor, shape) -> torch.Tensor:
    """A scalar or ``[..., 1]`` tensor as float32 ``[R]`` for a tensor of ``shape``, on t's device."""
    return t.to(torch.float32).expand(*shape[:-1], 1).reshape(row_count(shape)).contiguous()


# --- containers ----------------------------------------------------------------------------------


@dataclasses.dataclass
class NVFP4:
    """An NVFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]``, two 4-bit codes per byte, element 2i in the low nibble.
    scales: torch.float8_e4m3fn ``[..., K//16]``, one block scale per 16 elements.
    global_amax: float32, a scalar (per tensor) or ``[..., 1]`` (per row), finite and non-negative.
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

    def check(self) -> "NVFP4":
        """Raise ValueError unless codes, scales and global amax agree (see :func:`check_grid`)."""
        _check_codes(self.codes, NVFP4_BLOCK, "NVFP4")
        check_grid(Format.NVFP4, self.scales, self.global_amax, self.shape, "NVFP4", device=self.codes.device)
        return self


@dataclasses.dataclass
class MXFP4:
    """An MXFP4 tensor of logical shape ``[..., K]``.

    codes: uint8 ``[..., K//2]`` packed as in :class:`NVFP4`.
    scales: uint8 ``[..., K//32]``, biased E8M0 exponents (value ``2^(s - 127)``; 255 is NaN).
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

    def check(self) -> "MXFP4":
        """Raise ValueError unless codes and scales agree (see :func:`check_grid`)."""
        _check_codes(self.codes, MXFP4_BLOCK, "MXFP4")
        check_grid(Format.MXFP4, self.scales, None, self.shape, "MXFP4", device=self.codes.device)
        return self


@dataclasses.dataclass
class FP8:
    """An FP8 E4M3 tensor with one float32 scale per row (activations, KV cache, W8A8 weights).

    data: torch.float8_e4m3fn ``[..., K]``; scale: float32 ``[..., 1]`` (``amax / 448``, 1 for a zero row).
    """

    data: torch.Tensor
    scale: torch.Tensor

    fmt = Format.FP8

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def codes(self) -> torch.Tensor:
        """The E4M3 codes as uint8 ``[..., K]`` (a view): bit 7 the sign, bits 0..6 the magnitude code."""
        return self.data.view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def check(self) -> "FP8":
        """Raise ValueError unless data and scale have the documented dtypes and shapes."""
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float8_e4m3fn or self.data.dim() == 0:
            raise ValueError(f"FP8 data: expected float8_e4m3fn of shape [..., K], got {_found(self.data)}")
        expect = (*_fmt_shape(self.data.shape[:-1]), 1)
        if (
            not isinstance(self.scale, torch.Tensor)
            or self.scale.dtype != torch.float32
            or _fmt_shape(self.scale.shape) != expect
        ):
            raise ValueError(f"FP8 scale: expected float32 of shape {expect}, got {_found(self.scale)}")
        return self


# --- validation ----------------------------------------------------------------------------------


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
        raise ValueError(f"{what}: {last} is not a multiple of the block size {block} (shape {_fmt_shape(x.shape)})")


def _check_codes(codes, block: int, owner: str) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0:
        raise ValueError(f"{owner} codes: expected uint8 of shape [..., K/2], got {_found(codes)}")
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
    lead = _fmt_shape(shape[:-1])
    if amax.dim() != 0 and _fmt_shape(amax.shape) != (*lead, 1):
        raise ValueError(
            f"{what}: shape {_fmt_shape(amax.shape)} does not fit x of shape {_fmt_shape(shape)}; "
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
        if not kernels.count_masked(_numpy(raw).reshape(-1), np.uint8(mask), np.uint8(value)):
            return
    elif not bool(((raw & mask) == value).any()):
        return
    index = tuple(int(i) for i in ((raw & mask) == value).nonzero()[0])
    raise ValueError(
        f"{owner} scales: NaN scale code 0x{int(raw[index]):02X} at index {index}; a grid never holds NaN"
    )


def check_grid(
    fmt: Format | str,
    scales,
    global_amax,
    shape,
    owner: str = "grid",
    *,
    device: torch.device | None = None,
) -> None:
    """Raise ValueError unless ``(scales, global_amax)`` is a valid grid for a tensor of ``shape``.

    scales: ``[..., K/block]`` over ``shape``'s leading dims, float8_e4m3fn (NVFP4) or uint8 (MXFP4),
    no NaN codes; on ``device`` when one is given. global_amax: NVFP4 only, float32, a scalar or
    ``[..., 1]``, finite and non-negative; None for MXFP4. Shapes and dtypes cost nothing; the NaN
    check is one vectorised pass over the scales (1/16 or 1/32 of the elements).
    """
    fmt = Format(fmt)
    shape = _fmt_shape(shape)
    lead, k = shape[:-1], shape[-1]
    if fmt is Format.FP8:
        _check_fp8_scale(scales, global_amax, lead, owner, device)
        return
    dtype = _SCALE_DTYPE[fmt]
    expect = (*lead, k // fmt.block)
    name = str(dtype).removeprefix("torch.")
    if not isinstance(scales, torch.Tensor) or scales.dtype != dtype or _fmt_shape(scales.shape) != expect:
        raise ValueError(
            f"{owner} scales: expected {name} of shape {expect} for a {fmt.value} tensor of shape {shape}, "
            f"got {_found(scales)}"
        )
    if device is not None and scales.device != device:
        raise ValueError(f"{owner} scales: expected device {device} (where the codes are), got {scales.device}")
    _check_scale_codes(fmt, scales, owner)
    if fmt is Format.MXFP4:
        if global_amax is not None:
            raise ValueError(f"{owner} global_amax: expected None for mxfp4 (E8M0 scales are absolute), got {_found(global_amax)}")
        return
    if not isinstance(global_amax, torch.Tensor) or global_amax.dtype != torch.float32:
        raise ValueError(
            f"{owner} global_amax: expected float32, a scalar or of shape {(*lead, 1)}, got "
            f"{'None' if global_amax is None else _found(global_amax)}"
        )
    if global_amax.dim() != 0 and _fmt_shape(global_amax.shape) != (*lead, 1):
        raise ValueError(
            f"{owner} global_amax: expected float32, a scalar or of shape {(*lead, 1)}, got {_found(global_amax)}"
        )
    _check_amax_values(global_amax, f"{owner} global_amax")


def _check_fp8_scale(scale, global_amax, lead: tuple[int, ...], owner: str, device) -> None:
    """An FP8 grid: one finite, positive float32 scale per row, ``[..., 1]``; no global amax."""
    expect = (*lead, 1)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or _fmt_shape(scale.shape) != expect:
        raise ValueError(f"{owner} scales: expected float32 of shape {expect} (one FP8 scale per row), got {_found(scale)}")
    if device is not None and scale.device != device:
        raise ValueError(f"{owner} scales: expected device {device}, got {scale.device}")
    if global_amax is not None:
        raise ValueError(f"{owner} global_amax: expected None for fp8 (the row scale is the grid), got {_found(global_amax)}")
    if not bool(((scale > 0) & (scale <= FLOAT32_MAX)).all()):
        raise ValueError(f"{owner} scales: an FP8 row scale must be finite and positive")


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


# --- device dispatch -----------------------------------------------------------------------------

Backend = Literal["numba", "triton"]
_CPU_BACKEND: contextvars.ContextVar[Backend] = contextvars.ContextVar("tracefp4_cpu_backend", default="numba")


@contextlib.contextmanager
def use_backend(name: Backend):
    """Send CPU tensors to the named kernels inside the block (this thread/context only).

    For tests: with Triton's CPU interpreter (``TRITON_INTERPRET=1``) the Triton kernels accept CPU
    tensors, and this routes the public ops to them through the same code path a CUDA tensor takes.
    """
    if name not in ("numba", "triton"):
        raise ValueError(f"backend: expected 'numba' or 'triton', got {name!r}")
    token = _CPU_BACKEND.set(name)
    try:
        yield
    finally:
        _CPU_BACKEND.reset(token)


def backend(x: torch.Tensor, what: str = "x") -> Backend:
    """Which kernels handle ``x``: Triton for CUDA tensors, numba for CPU tensors. The one place the
    choice is made; every public op asks it."""
    if x.device.type == "cuda":
        return "triton"
    if x.device.type == "cpu":
        return _CPU_BACKEND.get()
    raise ValueError(f"{what}: tensors on {x.device} are not supported; expected a CPU or CUDA tensor")


def _triton():
    # lazy: triton (and a GPU toolchain) is needed only for CUDA tensors and the interpreter tests
    from tracefp4.formats import triton_kernels

    return triton_kernels


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


#: The numba kernels' view of each input dtype: 16-bit formats travel as their bit patterns, and the
#: integer dtype tells the kernel which widening to compile (see :mod:`tracefp4.formats.kernels`).
_KERNEL_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def kernel_rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as 2-D rows for the numba kernels, without a copy when ``x`` is contiguous.

    float32 stays float32; bfloat16 and float16 are passed as their bits and widened in the kernels,
    so no float32 temporary of the input is ever made.
    """
    return as_rows(x).view(_KERNEL_VIEW[x.dtype]).numpy()


def _chunks(rows: np.ndarray) -> int:
    return kernels.row_chunks(rows.shape[0], rows.nbytes)


# --- NVFP4 ---------------------------------------------------------------------------------------


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448*6/amax`` in float32, capped at FLT_MAX; amax 0 gives 1 (on amax's device)."""
    amax = amax.to(torch.float32)
    if amax.device.type == "cpu":  # numpy: the same IEEE float32 operations at a fraction of torch's per-op cost
        a = amax.detach().numpy()
        with np.errstate(divide="ignore", over="ignore"):
            s = np.minimum(np.float32(NVFP4_GLOBAL_NUMERATOR) / a, np.float32(FLOAT32_MAX))
        return torch.from_numpy(np.asarray(np.where((a == 0) | (s == 0), np.float32(1), s), dtype=np.float32))
    s_enc = torch.minimum(
        torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=torch.float32, device=amax.device) / amax,
        torch.tensor(FLOAT32_MAX, dtype=torch.float32, device=amax.device),
    )
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


_NO_BLOCK_MAX = np.empty((0, 0), dtype=np.uint32)


def _nvfp4_numba(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool, values: bool = False):
    """(codes, scale bytes, global amax, bf16 values (as u32 pairs from numba) or None) of ``x`` (see
    kernels). bf16 rows with a per-row or given amax (every rollout site) take the C kernel where it
    is built (:mod:`tracefp4.formats.csite`: the same bits, a fraction of the time)."""
    if x.dtype == torch.bfloat16 and (per_row or amax is not None) and csite.available():
        given = None if amax is None else per_row_values(amax, x.shape)
        codes, scales, row_amax, out, bad = csite.nvfp4_rows(as_rows(x), given, values=values)
        raise_non_finite(x, bad)
        return codes, scales, row_amax.reshape(*x.shape[:-1], 1) if amax is None else amax, out
    rows = kernel_rows(x)
    n, k = rows.shape
    bad = np.zeros(n, dtype=np.bool_)
    block_max = _NO_BLOCK_MAX
    own_amax = amax is None and per_row
    if amax is not None:
        row_amax = per_row_values(amax, x.shape).numpy()  # read only: written back only with own_amax
    elif per_row:
        row_amax = np.empty(n, dtype=np.float32)  # the kernel finds each row's amax in its own pass
    else:
        # a per-tensor amax needs the whole tensor before the first scale: a first pass keeps the
        # block amaxes (1/8 of a bf16 input's size) so the second only has to code
        row_amax = np.empty(n, dtype=np.float32)
        block_max = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint32)
        kernels.nvfp4_block_amax(rows, block_max, row_amax, bad, _chunks(rows))
        raise_non_finite(x, bad)
        amax = torch.from_numpy(row_amax).amax() if n else torch.zeros((), dtype=torch.float32)
        row_amax[:] = amax.item()
    codes = np.empty((n, k // 2), dtype=np.uint8)
    scales = np.empty((n, k // NVFP4_BLOCK), dtype=np.uint8)
    out = np.empty((n, k // 2), dtype=np.uint32) if values else _NO_BLOCK_MAX  # empty u32: no values wanted
    kernels.nvfp4_quantize(rows, row_amax, own_amax, block_max, codes, scales, out, bad, _chunks(rows))
    raise_non_finite(x, bad)
    if own_amax:
        amax = torch.from_numpy(row_amax).reshape(*x.shape[:-1], 1)
    return torch.from_numpy(codes), torch.from_numpy(scales), amax, torch.from_numpy(out) if values else None


def _nvfp4_triton(x: torch.Tensor, amax: torch.Tensor | None, per_row: bool):
    tk = _triton()
    rows = as_rows(x)
    n = rows.shape[0]
    if amax is not None:
        by_row = per_row_values(amax, x.shape)
    else:
        by_row = tk.row_amax(rows)  # a NaN/Inf row gets a finite amax here; the quantize pass flags it
        if per_row:
            amax = by_row.reshape(*x.shape[:-1], 1)
        else:  # an empty tensor has amax 0 (S_enc 1), as on the CPU
            amax = by_row.amax() if n else torch.zeros((), dtype=torch.float32, device=x.device)
            by_row = amax.expand(n).contiguous()
    codes, scales, bad = tk.quantize_nvfp4(rows, by_row)
    raise_non_finite(x, bad)
    return codes, scales, amax


def quantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """Quantize ``x [..., K]`` (K % 16 == 0) to NVFP4, on x's device.

    ``global_amax=None`` takes the amax of the whole tensor, or of each row with ``per_row=True``;
    a tensor passed in (a scalar, or ``[..., 1]``) is used as is.
    """
    return _quantize_nvfp4(x, global_amax, per_row, values=False)[0]


def quantize_dequantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False
                              ) -> tuple[NVFP4, torch.Tensor]:
    """``q = quantize_nvfp4(x)`` and ``dequantize_nvfp4(q).to(x.dtype)``, bit for bit; a bf16 ``x`` on
    the CPU gets both from one pass of the numba kernel (what a rollout's site needs: its codes and
    the value its next op sees, without a second pass, a float32 copy and its cast)."""
    q, values = _quantize_nvfp4(x, global_amax, per_row, values=True)
    return q, (dequantize_nvfp4(q).to(x.dtype) if values is None else values)


def _quantize_nvfp4(x: torch.Tensor, global_amax, per_row: bool, *, values: bool
                    ) -> tuple[NVFP4, torch.Tensor | None]:
    if (global_amax is None and per_row and isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.dim() and x.shape[-1] % NVFP4_BLOCK == 0 and x.shape[-1]
            and _CPU_BACKEND.get() == "numba" and csite.available()):
        # a rollout site (bf16 rows, each its own amax): the C kernel with nothing around it, since a
        # decode step's site is a few microseconds of work and every tensor op here costs one
        lead, k = x.shape[:-1], x.shape[-1]
        # the outputs made in their final shapes and dtypes, so no view is needed after the pass
        q = NVFP4(codes=torch.empty(*lead, k // 2, dtype=torch.uint8),
                  scales=torch.empty(*lead, k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn),
                  global_amax=torch.empty(*lead, 1, dtype=torch.float32))
        out = torch.empty(x.shape, dtype=torch.bfloat16) if values else None
        xd = x.detach().contiguous()
        if csite.quantize_into(xd, q.global_amax, q.codes, q.scales, out, own_amax=True):
            raise_non_finite(xd, ~torch.isfinite(xd.reshape(-1, k)).all(dim=1))
        return q, out
    check_input(x, NVFP4_BLOCK)
    amax = None if global_amax is None else check_global_amax(global_amax, x.shape).to(x.device)
    lead = x.shape[:-1]
    if backend(x) == "triton":
        codes, scales, amax = _nvfp4_triton(x, amax, per_row)
        out = None
    else:
        codes, scales, amax, out = _nvfp4_numba(x, amax, per_row, values and x.dtype == torch.bfloat16)
    q = NVFP4(
        codes=codes.reshape(*lead, codes.shape[-1]),
        scales=scales.view(torch.float8_e4m3fn).reshape(*lead, scales.shape[-1]),
        global_amax=amax,
    )
    return q, None if out is None else out.view(torch.bfloat16).reshape(x.shape)


_E2M1_SIGNED = tuple(E2M1_VALUES) + tuple(-v for v in E2M1_VALUES)  # value of codes 0..15
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _rtn_e2m1(z: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes of clamped float32 ``z`` by midpoint comparison (ties to the even code: a
    midpoint above an even code rounds down, above an odd code up), the sign bit from z's sign bit."""
    a = z.abs()
    mag = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        mag += (a > m if i % 2 == 0 else a >= m).to(torch.uint8)
    return mag | (torch.signbit(z).to(torch.uint8) << 3)


def quantize_nvfp4_4over6(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """NVFP4 with the "Four over Six" block scales (arXiv 2512.02010): each block of 16 takes the E4M3
    scale mapping its maximum to 4 or to 6, whichever gives the smaller sum of squared errors (float64,
    accumulated in element order; a tie keeps 6). Same arguments and container as :func:`quantize_nvfp4`.

    A vectorised torch implementation (both candidates at once, rounding by midpoints) in the
    reference's operation order, on x's device; not a numba/triton kernel.
    """
    check_input(x, NVFP4_BLOCK)
    bad = ~torch.isfinite(as_rows(x.detach())).all(dim=-1)
    if bool(bad.any()):
        raise_non_finite(x, bad)
    dev, f32 = x.device, torch.float32
    xf = x.detach().to(f32)
    if global_amax is not None:
        amax = check_global_amax(global_amax, x.shape).to(dev)
    elif per_row:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    else:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=f32, device=dev)
    s_enc = per_row_values(nvfp4_global_encode_scale(amax), x.shape).unsqueeze(-1)  # [R, 1]
    rows = as_rows(xf)
    step = max(1, _4OVER6_CHUNK // max(rows.shape[1], 1))  # rows per chunk: bounded temporaries
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=dev)
    scales = torch.empty((rows.shape[0], rows.shape[1] // NVFP4_BLOCK), dtype=torch.uint8, device=dev)
    for r in range(0, rows.shape[0], step):
        codes[r:r + step], scales[r:r + step] = _4over6_rows(rows[r:r + step], s_enc[r:r + step])
    lead = x.shape[:-1]
    return NVFP4(codes=pack_fp4(codes).reshape(*lead, -1),
                 scales=scales.view(torch.float8_e4m3fn).reshape(*lead, -1), global_amax=amax)


_4OVER6_CHUNK = 1 << 20  # elements per chunk of rows


def _4over6_rows(xr: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked codes ``[R, K]`` and E4M3 scale bytes ``[R, K/16]`` of float32 rows ``xr`` with their
    ``S_enc`` ``[R, 1]``: both candidates at once, in the reference's operation order."""
    dev, f32 = xr.device, torch.float32
    xb = xr.reshape(xr.shape[0], -1, NVFP4_BLOCK)  # [R, nb, 16]
    one_sixth = torch.tensor(1.0, dtype=f32, device=dev) / torch.tensor(6.0, dtype=f32, device=dev)
    per_max = torch.stack([s_enc * one_sixth, s_enc * torch.tensor(0.25, dtype=f32, device=dev)], dim=-1)
    decode = xb.abs().amax(dim=-1).unsqueeze(-1) * per_max  # [R, nb, 2]: candidates 6, 4
    s8 = torch.clamp(decode, max=E4M3_MAX).to(torch.float8_e4m3fn)
    s_enc_c = s_enc.unsqueeze(-1)  # [R, 1, 1]
    s_dec = torch.tensor(1.0, dtype=f32, device=dev) / s_enc_c
    enc = torch.minimum(torch.tensor(1.0, dtype=f32, device=dev) / (s8.to(f32) * s_dec),
                        torch.tensor(FLOAT32_MAX, dtype=f32, device=dev))
    z = torch.clamp(xb.unsqueeze(-2) * enc.unsqueeze(-1), -6.0, 6.0)  # [R, nb, 2, 16]
    codes = _rtn_e2m1(z)
    values = torch.tensor(_E2M1_SIGNED, dtype=f32, device=dev)[codes.long()]
    deq = values * s8.to(f32).unsqueeze(-1) / s_enc_c.unsqueeze(-1)
    sq = (xb.unsqueeze(-2).double() - deq.double()) ** 2
    err = torch.zeros(sq.shape[:-1], dtype=torch.float64, device=dev)
    for j in range(NVFP4_BLOCK):  # in element order, as the reference
        err = err + sq[..., j]
    four_wins = err[..., 1] < err[..., 0]  # a tie keeps 6
    s8u = s8.view(torch.uint8)
    scales = torch.where(four_wins, s8u[..., 1], s8u[..., 0])
    chosen = torch.where(four_wins.unsqueeze(-1), codes[..., 1, :], codes[..., 0, :])
    return chosen.reshape(xr.shape), scales


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: Format, row_div: torch.Tensor) -> torch.Tensor:
    """float32 ``(value(code) * scale) / row_div[row]`` of a validated container, on the codes' device."""
    rows = as_rows(codes)
    scale_rows = as_rows(scales.view(torch.uint8))
    row_div = row_div.to(codes.device)  # a global amax may be kept elsewhere than the codes
    if backend(codes, "codes") == "triton":
        out = _triton().dequantize(rows, scale_rows, fmt.value, row_div, fmt.block)
    else:
        values = E4M3_VALUES if fmt is Format.NVFP4 else E8M0_VALUES
        out = np.empty((rows.shape[0], rows.shape[1] * 2), dtype=np.float32)
        nchunks = kernels.row_chunks(rows.shape[0], out.nbytes)
        kernels.dequantize(rows.numpy(), scale_rows.numpy(), values, _numpy(row_div), fmt.block, out, nchunks)
        out = torch.from_numpy(out)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize_nvfp4(q: NVFP4) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * float(s8) / S_enc``, on the codes' device."""
    _expect(q, NVFP4).check()
    s_enc = per_row_values(nvfp4_global_encode_scale(q.global_amax), q.shape)
    return _dequantize(q.codes, q.scales, Format.NVFP4, s_enc)


def dequantize_blocks(q: NVFP4 | MXFP4) -> torch.Tensor:
    """float32 ``value(code) * block scale``, without NVFP4's global scale: the operand a packed FP4
    GEMM multiplies (exact, and exact in bf16: an E2M1 value has 2 significant bits, an E4M3 scale 4,
    an E8M0 one 1). ``dequantize(q)`` is exactly ``dequantize_blocks(q) / global_divisor(q)`` in float32."""
    if isinstance(q, NVFP4):
        q.check()
        fmt = Format.NVFP4
    elif isinstance(q, MXFP4):
        q.check()
        fmt = Format.MXFP4
    else:
        raise ValueError(f"dequantize_blocks: expected an NVFP4 or MXFP4 tensor, got {type(q).__name__}")
    ones = torch.ones(row_count(q.codes.shape), dtype=torch.float32, device=q.codes.device)
    return _dequantize(q.codes, q.scales, fmt, ones)


def global_divisor(q: NVFP4 | MXFP4) -> torch.Tensor:
    """float32 ``[..., 1]``: what :func:`dequantize_blocks` is divided by per row (S_enc; 1 for MXFP4)."""
    lead = (*q.codes.shape[:-1], 1)
    if isinstance(q, NVFP4):
        return per_row_values(nvfp4_global_encode_scale(q.global_amax), q.shape).reshape(lead)
    return torch.ones(lead, dtype=torch.float32, device=q.codes.device)


def _expect(q, cls):
    if not isinstance(q, cls):
        raise ValueError(f"expected an {cls.__name__} tensor, got {type(q).__name__}")
    return q


# --- MXFP4 ---------------------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor, *, scale_mode: str = "floor") -> MXFP4:
    """Quantize ``x [..., K]`` (K % 32 == 0) to MXFP4 with E8M0 block scales (see ScaleMode), on x's device."""
    rceil = ScaleMode(scale_mode) is ScaleMode.RCEIL
    check_input(x, MXFP4_BLOCK)
    if backend(x) == "triton":
        codes, scales, bad = _triton().quantize_mxfp4(as_rows(x), rceil)
    else:
        rows = kernel_rows(x)
        n, k = rows.shape
        codes = np.empty((n, k // 2), dtype=np.uint8)
        scales = np.empty((n, k // MXFP4_BLOCK), dtype=np.uint8)
        bad = np.zeros(n, dtype=np.bool_)
        kernels.mxfp4_quantize(rows, rceil, codes, scales, bad, _chunks(rows))
        codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
    raise_non_finite(x, bad)
    lead = x.shape[:-1]
    return MXFP4(codes=codes.reshape(*lead, codes.shape[-1]), scales=scales.reshape(*lead, scales.shape[-1]))


def mx_scale_values(biased: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(b - 127)`` of biased E8M0 exponents (exact, 2^-127 included)."""
    two = torch.tensor(2.0, dtype=torch.float64, device=biased.device)
    return torch.pow(two, biased.to(torch.float64) - E8M0_BIAS).to(torch.float32)


def dequantize_mxfp4(q: MXFP4) -> torch.Tensor:
    """float32 ``[..., K]``: ``value(code) * 2^(s - 127)``, on the codes' device."""
    _expect(q, MXFP4).check()
    # x / 1 == x: the NVFP4 formula with S_enc 1
    ones = torch.ones(row_count(q.codes.shape), dtype=torch.float32, device=q.codes.device)
    return _dequantize(q.codes, q.scales, Format.MXFP4, ones)


def dequantize(q: NVFP4 | MXFP4 | FP8) -> torch.Tensor:
    """float32 values of an NVFP4, MXFP4 or FP8 container."""
    if isinstance(q, NVFP4):
        return dequantize_nvfp4(q)
    if isinstance(q, MXFP4):
        return dequantize_mxfp4(q)
    if isinstance(q, FP8):
        return dequantize_fp8(q)
    raise ValueError(f"dequantize: expected an NVFP4, MXFP4 or FP8 tensor, got {type(q).__name__}")


# --- packing -------------------------------------------------------------------------------------


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """One 4-bit code per uint8 ``[..., K]`` -> two per byte ``[..., K//2]`` (element 2i low nibble)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4: expected uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {_fmt_shape(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("pack_fp4: codes must be 4-bit values 0..15")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two codes per byte ``[..., N]`` -> one per uint8 ``[..., 2N]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def code_positions(codes: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """int64 position of each stored code on its format's signed line (both zeros at 0): FP4 codes
    packed two per byte ``[..., K//2]`` (-7..7), FP8 E4M3 codes ``[..., K]`` (-126..126). Codes one
    position apart are adjacent codewords."""
    fmt = Format(fmt)
    c = (unpack_fp4(codes) if fmt.fp4 else codes).long()
    sign = 0x8 if fmt.fp4 else E4M3_SIGN_BIT
    return torch.where(c >= sign, -(c - sign), c)


def lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K//2]`` -> bit-packed low magnitude bits ``[..., K//8]``, on the codes' device."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 4:
        raise ValueError(f"lsb_bits codes: expected uint8 of shape [..., K/2] with K/2 % 4 == 0, got {_found(codes)}")
    rows = as_rows(codes)
    if backend(codes, "codes") == "triton":
        bits = _triton().lsb_bits(rows)
    else:
        out = np.empty((rows.shape[0], rows.shape[1] // 4), dtype=np.uint8)
        # a few bit operations per byte: one thread keeps up with memory until the codes are large
        nchunks = kernels.row_chunks(rows.shape[0], rows.nbytes, grain=16 * kernels.GRAIN_BYTES)
        kernels.pack_lsb(rows.numpy(), out, nchunks)
        bits = torch.from_numpy(out)
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] // 4)


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
    """``value`` on x's device and in x's dtype in the forward pass, identity gradient to ``x``.

    Without a gradient to carry (grad mode off, or ``x`` not requiring one) no autograd node is made.
    """
    value = value.to(device=x.device, dtype=x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return value
    return _StraightThrough.apply(x, value)


# --- FP8 E4M3 with a per-row scale (W4A8 activations) --------------------------------------------


def quantize_fp8(x: torch.Tensor) -> FP8:
    """FP8 E4M3 with one float32 scale ``amax/448`` per row, on x's device.

    A handful of elementwise torch ops, the same on either backend: no kernel of ours is needed.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES or x.dim() == 0:
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor of shape [..., K], got {_found(x)}")
    backend(x)  # the device check every op makes
    xf = x.detach().to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("x: non-finite input; NaN/Inf is a bug upstream and is never encoded")
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # Clamp before the cast: older CPU casts turn overflow into NaN instead of saturating.
    return FP8((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale)


def dequantize_fp8(q: FP8) -> torch.Tensor:
    _expect(q, FP8).check()
    return q.data.to(torch.float32) * q.scale


def fp8_lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes ``[..., K]`` (K % 8 == 0) -> their lowest bits, eight per byte ``[..., K//8]``
    (element 8j+i in bit i, as :func:`lsb_bits` packs FP4's), on the codes' device."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 8:
        raise ValueError(f"fp8_lsb_bits codes: expected uint8 of shape [..., K] with K % 8 == 0, got {_found(codes)}")
    low = (codes & 1).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (low * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack_lsb(bits: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., K//8]`` packed bits -> int64 ``[..., K]`` (element 8j+i from bit i of byte j)."""
    shifts = torch.arange(8, device=bits.device)
    return ((bits.long().unsqueeze(-1) >> shifts) & 1).reshape(*bits.shape[:-1], k)


def guided_fp8(
    x: torch.Tensor, scale: torch.Tensor, *, codes: torch.Tensor | None = None, lsb: torch.Tensor | None = None,
    owner: str = "grid",
) -> FP8:
    """Quantize ``x`` to E4M3 on the per-row ``scale`` (the rollout's), guided by ``codes`` (uint8 E4M3
    codes ``[..., K]``, full information: the rollout's code is taken, a zero keeping x's sign bit) or
    ``lsb`` (lowest code bits, eight per byte, ``[..., K//8]``: the member of the bracket with that
    bit); exactly one of the two is given.

    The rule of :func:`tracefp4.formats.reference.guided_round_e4m3`, vectorised: the round-to-nearest
    code (PyTorch's E4M3 cast) and the neighbour on the other side of ``z`` form the bracket (adjacent
    magnitude codes are adjacent values). The result is on x's device; grid and hint may be elsewhere.
    """
    if (codes is None) == (lsb is None):
        raise ValueError("guided_fp8: give exactly one of codes (full) or lsb")
    if not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES or x.dim() == 0:
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor of shape [..., K], got {_found(x)}")
    backend(x)
    check_grid(Format.FP8, scale, None, x.shape, owner)
    hint, name = (codes, "codes") if codes is not None else (lsb, "lsb")
    k = x.shape[-1]
    if lsb is not None and k % 8:
        raise ValueError(f"{owner} lsb: FP8 lsb hints pack eight elements per byte; K = {k} is not a multiple of 8")
    expect = (*_fmt_shape(x.shape[:-1]), k if codes is not None else k // 8)
    if not isinstance(hint, torch.Tensor) or hint.dtype != torch.uint8 or _fmt_shape(hint.shape) != expect:
        raise ValueError(
            f"{owner} {name}: expected uint8 of shape {expect} for x of shape {_fmt_shape(x.shape)}, got {_found(hint)}"
        )
    dev = x.device
    xf = x.detach().to(torch.float32)
    bad = ~torch.isfinite(as_rows(xf)).all(dim=-1)
    if bool(bad.any()):
        raise_non_finite(x, bad)
    s = scale.to(dev)
    z = torch.clamp(xf / s, -E4M3_MAX, E4M3_MAX)
    sign = torch.signbit(z).to(torch.uint8) << 7
    if codes is not None:  # the rollout's code; only a zero's sign is the trainer's
        r = hint.to(dev)
        out = torch.where((r & E4M3_MAG_MASK) == 0, sign, r)
    else:
        mag = (z.to(torch.float8_e4m3fn).view(torch.uint8) & E4M3_MAG_MASK).long()
        value = torch.from_numpy(E4M3_VALUES[: E4M3_MAX_CODE + 1].copy()).to(dev)[mag]
        a = z.abs()
        lo = torch.where(value <= a, mag, mag - 1)
        hi = torch.where(value >= a, mag, mag + 1)
        bit = _unpack_lsb(hint.to(dev), k)
        out = torch.where((lo == hi) | ((lo & 1) == bit), lo, hi).to(torch.uint8) | sign
    return FP8(out.view(torch.float8_e4m3fn), s.clone())


# --- NVFP4 with residual activation compensation (QUADS) ----------------------------------------


@dataclasses.dataclass
class CompensatedNVFP4:
    """An activation quantized twice (QUADS' residual activation compensation): ``first`` is the
    NVFP4 quantization of x (a global amax per row), ``residual`` that of ``x - dequantize(first)`` kept
    on the compensated channels of each row and zero elsewhere. Its value is the float32 sum of both."""

    first: NVFP4
    residual: NVFP4

    fmt = Format.NVFP4

    @property
    def shape(self) -> torch.Size:
        return self.first.shape

    @property
    def nbytes(self) -> int:
        return self.first.nbytes + self.residual.nbytes


def rac_channel_count(k: int, fraction: float) -> int:
    """Channels of a row of ``k`` that are compensated: ``ceil(fraction * k)``, fraction in (0, 1]."""
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1):
        raise ValueError(f"compensation fraction: expected a number in (0, 1], got {fraction!r}")
    return int(np.ceil(fraction * k))


def quantize_nvfp4_rac(x: torch.Tensor, fraction: float = 0.5) -> CompensatedNVFP4:
    """NVFP4 per row, plus the residual re-quantized on the ``ceil(fraction * K)`` channels of each
    row with the largest first-pass error ``|x - x_hat|`` (ties to the lower channel index), on x's
    device; :func:`tracefp4.formats.reference.quantize_nvfp4_rac` is the readable form."""
    n = rac_channel_count(x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0, fraction)
    first = quantize_nvfp4(x, per_row=True)
    residual = as_rows(x.detach().to(torch.float32) - dequantize_nvfp4(first))
    chosen = torch.argsort(residual.abs(), dim=-1, descending=True, stable=True)[:, :n]
    mask = torch.zeros(residual.shape, dtype=torch.bool, device=residual.device).scatter_(1, chosen, True)
    kept = torch.where(mask, residual, torch.zeros_like(residual)).reshape(x.shape)
    return CompensatedNVFP4(first, quantize_nvfp4(kept, per_row=True))


def dequantize_nvfp4_rac(q: CompensatedNVFP4) -> torch.Tensor:
    """float32 ``dequantize(first) + dequantize(residual)``: what the compensated GEMM multiplies."""
    _expect(q, CompensatedNVFP4)
    return dequantize_nvfp4(q.first) + dequantize_nvfp4(q.residual)


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
    owner: str = "grid",
) -> NVFP4 | MXFP4:
    """Quantize ``x`` on the grid ``(scales, global_amax)``, each element rounded to the member of its
    bracket that ``codes`` (packed 4-bit codes ``[..., K//2]``, full information) or ``lsb`` (low
    magnitude bits, eight per byte, ``[..., K//8]``) names. Exactly one of the two is given.

    The grid and the hint are validated against x (:func:`check_grid`; ``owner`` names them in the
    errors); they may live on another device than x and are moved to it. The result is on x's device.
    """
    fmt = Format(fmt)
    if not fmt.fp4:
        raise ValueError(f"guided_codes: {fmt.value} is not an FP4 format (FP8 is guided by guided_fp8)")
    if (codes is None) == (lsb is None):
        raise ValueError("guided_codes: give exactly one of codes (full) or lsb")
    check_input(x, fmt.block)
    check_grid(fmt, scales, global_amax, x.shape, owner)
    hint, name, per_byte = (codes, "codes", 2) if codes is not None else (lsb, "lsb", 8)
    expect = (*_fmt_shape(x.shape[:-1]), x.shape[-1] // per_byte)
    if not isinstance(hint, torch.Tensor) or hint.dtype != torch.uint8 or _fmt_shape(hint.shape) != expect:
        raise ValueError(
            f"{owner} {name}: expected uint8 of shape {expect} for x of shape {_fmt_shape(x.shape)}, got {_found(hint)}"
        )
    dev = x.device
    scales = scales.to(dev)
    if fmt is Format.NVFP4:
        global_amax = global_amax.to(dev)
        s_dec = torch.tensor(1.0, dtype=torch.float32, device=dev) / nvfp4_global_encode_scale(global_amax)
        s_dec = per_row_values(s_dec, x.shape)
    else:
        s_dec = torch.ones(row_count(x.shape), dtype=torch.float32, device=dev)
    scale_rows = as_rows(scales.view(torch.uint8))
    hint_rows = as_rows(hint.to(dev))
    full = codes is not None
    if backend(x) == "triton":
        out, bad = _triton().guided_codes(as_rows(x), scale_rows, fmt.value, s_dec, hint_rows, fmt.block, full)
    else:
        # the kernels rebuild each block's encode factor from the stored scale byte, as the reference does
        rows = kernel_rows(x)
        n, k = rows.shape
        out = np.empty((n, k // 2), dtype=np.uint8)
        bad = np.zeros(n, dtype=np.bool_)
        values = E4M3_VALUES if fmt is Format.NVFP4 else E8M0_VALUES
        guided = kernels.guided_full if full else kernels.guided_lsb
        guided(rows, scale_rows.numpy(), values, s_dec.numpy(), hint_rows.numpy(), fmt.block, out, bad, _chunks(rows))
        out = torch.from_numpy(out)
    raise_non_finite(x, bad)
    codes_t = out.reshape(*x.shape[:-1], out.shape[-1])
    if fmt is Format.NVFP4:
        return NVFP4(codes_t, clone_scales(scales), global_amax.clone())
    return MXFP4(codes_t, clone_scales(scales))
