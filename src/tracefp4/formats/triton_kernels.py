"""Triton (GPU) twins of the CPU kernels: NVFP4 quantize, guided quantize (lsb and full), lsb hint packing.

Same contracts as the CPU path (:mod:`tracefp4.formats.numerics`, :mod:`tracefp4.guidance`): the functions
here return the same containers, bit for bit equal to :mod:`tracefp4.formats.reference`. They take CUDA
tensors; under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is imported) they
take CPU tensors too, which is how CI checks them without a GPU. ``scripts/gpu_check.py`` checks them
on a real device and measures bandwidth.

Exactness on a GPU: every step is float32 in the reference's order; divisions use ``tl.div_rn``
(IEEE round-to-nearest, where a plain ``/`` may be approximate); no product feeds an addition, so
nothing can be contracted into an FMA; the E4M3 cast is the bit-level rounding of the CPU kernels
(:func:`tracefp4.formats.kernels._e4m3_round`), checked against torch's cast on every float32 in [0, 448];
magnitudes are compared as integer bit patterns, so NaN/Inf detection does not depend on the
GPU's float min/max NaN rules. One assumption is left to check on each device: float32 subnormals
survive multiplication (no flush to zero). They matter only for values below ~1e-35 (bf16/fp32
subnormal inputs, or a global amax so small that 1/S_enc is subnormal); the ``tiny`` data in
tests/test_triton.py and scripts/gpu_check.py is there to catch a device that flushes them.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tracefp4.guidance import hints as guidance
from tracefp4.formats import kernels
from tracefp4.formats.constants import NVFP4_BLOCK, Format, HintMode
from tracefp4.guidance.hints import Hint, _check_hint
from tracefp4.formats.numerics import MXFP4, NVFP4, _global_amax, check_input, nvfp4_global_encode_scale, raise_non_finite

__all__ = ["interpreting", "row_amax", "quantize_nvfp4", "guided_quantize", "encode_hint", "lsb_bits"]

#: Exact float32 constants, written as the float32 values the CPU kernels use.
_ONE_SIXTH = float(np.float32(1.0) / np.float32(6.0))
_FLT_MAX = float(np.finfo(np.float32).max)
_FINITE_LIMIT = 0x7F7FFFFF  # abs bit pattern of FLT_MAX: anything above is NaN or Inf

#: No kernel here multiplies into an addition, so FMA contraction could not change a result; it is
#: switched off anyway so that a future edit cannot silently break bit-exactness.
_EXACT = dict(enable_fp_fusion=False)
_ELEMENTS_PER_PROGRAM = 1024  # per program of the quantize kernels: 64 NVFP4 or 32 MXFP4 blocks
_ROW_TILE = 1024
_PACK_BYTES = 1024


def interpreting() -> bool:
    """True when this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_nvfp4_kernel).__name__ == "InterpretedFunction"


# --- device helpers ------------------------------------------------------------------------------


@triton.jit
def _widen(x):
    """x as float32, exactly. A bf16 is the top half of a float32, so it is widened by a shift: the
    interpreter's bf16 cast loses bf16 subnormals, and a shift cannot depend on a denormal mode."""
    if x.dtype.is_bf16():
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _abs_bits(xf):
    """float32 abs bit patterns; they order like the magnitudes and NaN/Inf lie above _FINITE_LIMIT."""
    return xf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _sign_code_bit(xf):
    """8 where float32 xf's sign bit is set (-0.0 included), else 0."""
    return (xf.to(tl.uint32, bitcast=True) >> 31) << 3


@triton.jit
def _rtn_mag(m):
    """Magnitude code of m >= 0, nearest with ties to even (see kernels._rtn_mag)."""
    c = (m > 0.25).to(tl.uint32) + (m >= 0.75).to(tl.uint32) + (m > 1.25).to(tl.uint32)
    c += (m >= 1.75).to(tl.uint32) + (m > 2.5).to(tl.uint32) + (m >= 3.5).to(tl.uint32)
    return c + (m > 5.0).to(tl.uint32)


@triton.jit
def _floor_mag(m):
    c = (m >= 0.5).to(tl.uint32) + (m >= 1.0).to(tl.uint32) + (m >= 1.5).to(tl.uint32)
    c += (m >= 2.0).to(tl.uint32) + (m >= 3.0).to(tl.uint32) + (m >= 4.0).to(tl.uint32)
    return c + (m >= 6.0).to(tl.uint32)


@triton.jit
def _ceil_mag(m):
    c = (m > 0.0).to(tl.uint32) + (m > 0.5).to(tl.uint32) + (m > 1.0).to(tl.uint32)
    c += (m > 1.5).to(tl.uint32) + (m > 2.0).to(tl.uint32) + (m > 3.0).to(tl.uint32)
    return c + (m > 4.0).to(tl.uint32)


@triton.jit
def _e4m3_round(v):
    """(pattern, value) of float32 v in [0, 448] rounded to E4M3 (see kernels._e4m3_round)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    shifted = v + 16384.0  # 2^14: floats in [2^14, 2^15) are 2^-9 apart, the E4M3 subnormal step
    normal = v >= 0.015625  # 2^-6, the smallest E4M3 normal
    code = tl.where(normal, (rounded >> 20) - 960, shifted.to(tl.uint32, bitcast=True) - 0x46800000)
    value = tl.where(normal, rounded.to(tl.float32, bitcast=True), shifted - 16384.0)
    return code, value


@triton.jit
def _div(numerator: tl.constexpr, x):
    """numerator / x, correctly rounded (a plain ``/`` may compile to an approximate division)."""
    return tl.div_rn(tl.full(x.shape, numerator, tl.float32), x)


@triton.jit
def _s_enc(amax):
    """``S_enc = 448*6/amax`` capped at FLT_MAX; amax 0 (or a quotient of 0) gives 1."""
    s = tl.minimum(_div(2688.0, amax), _FLT_MAX)
    return tl.where((amax == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def _pack_pairs(codes, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCKS, BLOCK] codes -> [BLOCKS, BLOCK // 2] bytes, element 2i in the low nibble."""
    even, odd = tl.split(tl.reshape(codes, (BLOCKS, BLOCK // 2, 2)))
    return (even | (odd << 4)).to(tl.uint8)


# --- kernels -------------------------------------------------------------------------------------
# Programs own BLOCKS consecutive blocks of one row: grid (rows, cdiv(blocks_per_row, BLOCKS)). Each
# writes one flag, bad[row, program], set when its slice holds a NaN or Inf.


@triton.jit
def _row_amax_kernel(x_ptr, amax_ptr, bad_ptr, K, TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    top = tl.zeros((TILE,), tl.uint32)
    for k0 in range(0, K, TILE):
        offs = k0 + tl.arange(0, TILE)
        x = tl.load(x_ptr + r * K + offs, mask=offs < K, other=0.0)
        top = tl.maximum(top, _abs_bits(_widen(x)))
    m = tl.max(top, axis=0)
    tl.store(bad_ptr + r, (m > _FINITE_LIMIT).to(tl.int8))
    tl.store(amax_ptr + r, tl.minimum(m, _FINITE_LIMIT).to(tl.float32, bitcast=True))


@triton.jit
def _flag_non_finite(x, bad_ptr):
    r = tl.program_id(0).to(tl.int64)
    top = tl.max(tl.max(_abs_bits(x), axis=1), axis=0)
    tl.store(bad_ptr + r * tl.num_programs(1) + tl.program_id(1), (top > _FINITE_LIMIT).to(tl.int8))


@triton.jit
def _nvfp4_kernel(x_ptr, amax_ptr, codes_ptr, scales_ptr, bad_ptr, K, BLOCKS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # row offsets reach past 2^31 elements on big tensors
    nb = K // 16
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_row = b < nb
    i = tl.arange(0, 16)
    x = _widen(tl.load(x_ptr + r * K + b[:, None] * 16 + i[None, :], mask=in_row[:, None], other=0.0))
    _flag_non_finite(x, bad_ptr)
    mag = tl.abs(x)
    s_enc = _s_enc(tl.load(amax_ptr + r))
    d = tl.minimum(tl.max(mag, axis=1) * (s_enc * _ONE_SIXTH), 448.0)  # clamp before the cast
    s8, s8_value = _e4m3_round(d)
    enc = tl.minimum(_div(1.0, s8_value * _div(1.0, s_enc)), _FLT_MAX)
    codes = _rtn_mag(mag * enc[:, None]) | _sign_code_bit(x)  # |x * enc| == |x| * enc exactly
    j = tl.arange(0, 8)
    tl.store(codes_ptr + r * (K // 2) + b[:, None] * 8 + j[None, :], _pack_pairs(codes, BLOCKS, 16),
             mask=in_row[:, None])
    tl.store(scales_ptr + r * nb + b, s8.to(tl.uint8), mask=in_row)


@triton.jit
def _guided_kernel(x_ptr, scales_ptr, values_ptr, s_dec_ptr, hint_ptr, codes_ptr, bad_ptr, K,
                   BLOCK: tl.constexpr, BLOCKS: tl.constexpr, FULL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    nb = K // BLOCK
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_row = b < nb
    i = tl.arange(0, BLOCK)
    elem = b[:, None] * BLOCK + i[None, :]  # element index within the row
    mask = in_row[:, None]
    x = _widen(tl.load(x_ptr + r * K + elem, mask=mask, other=0.0))
    _flag_non_finite(x, bad_ptr)
    scale = tl.load(values_ptr + tl.load(scales_ptr + r * nb + b, mask=in_row, other=0).to(tl.int32))
    enc = tl.minimum(_div(1.0, scale * tl.load(s_dec_ptr + r)), _FLT_MAX)
    m = tl.minimum(tl.abs(x) * enc[:, None], 6.0)
    lo = _floor_mag(m)
    hi = _ceil_mag(m)  # == lo on a codeword, so no hint can move it
    sign = _sign_code_bit(x)
    if FULL:
        byte = tl.load(hint_ptr + r * (K // 2) + elem // 2, mask=mask, other=0).to(tl.uint32)
        rc = (byte >> ((elem % 2) * 4).to(tl.uint32)) & 15
        # hi is nearer the rollout code exactly when that code is on x's side of zero with a magnitude
        # above lo (kernels._guided_full has the argument)
        up = ((rc & 7) > lo) & ((rc & 8) == sign)
    else:
        byte = tl.load(hint_ptr + r * (K // 8) + elem // 8, mask=mask, other=0).to(tl.uint32)
        up = (lo & 1) != ((byte >> (elem % 8).to(tl.uint32)) & 1)
    codes = tl.where(up, hi, lo) | sign
    j = tl.arange(0, BLOCK // 2)
    tl.store(codes_ptr + r * (K // 2) + b[:, None] * (BLOCK // 2) + j[None, :], _pack_pairs(codes, BLOCKS, BLOCK),
             mask=mask)


@triton.jit
def _pack_lsb_kernel(codes_ptr, bits_ptr, n_bytes, BYTES: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # output byte o comes from code bytes 4o .. 4o+3
    q = tl.arange(0, 4)[None, :].to(tl.uint32)
    c = tl.load(codes_ptr + o[:, None] * 4 + q, mask=(o < n_bytes)[:, None], other=0).to(tl.uint32)
    bits = ((c & 1) << (2 * q)) | (((c >> 4) & 1) << (2 * q + 1))
    tl.store(bits_ptr + o, tl.sum(bits, axis=1).to(tl.uint8), mask=o < n_bytes)  # disjoint bits: sum == or


# --- host wrappers -------------------------------------------------------------------------------


def _check_device(x: torch.Tensor, what: str = "x") -> None:
    if x.is_cuda or (interpreting() and x.device.type == "cpu"):
        return
    raise ValueError(
        f"{what}: the Triton kernels take CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), "
        f"got device {x.device}"
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().reshape(-1, x.shape[-1])


def _refuse_non_finite(x: torch.Tensor, bad: torch.Tensor) -> None:
    """Raise as the CPU path does when any program flagged a NaN/Inf (``bad`` [rows, ...])."""
    flagged = bad.any(dim=1) if bad.dim() == 2 else bad.bool()
    if bool(flagged.any()):
        raise_non_finite(x.detach().cpu(), flagged.cpu().numpy())


def row_amax(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 amax of each row of ``rows`` [R, K] and an int8 non-finite flag per row."""
    n, k = rows.shape
    amax = torch.empty(n, dtype=torch.float32, device=rows.device)
    bad = torch.zeros(n, dtype=torch.int8, device=rows.device)
    if n:
        _row_amax_kernel[(n,)](rows, amax, bad, k, TILE=_ROW_TILE, **_EXACT)
    return amax, bad


def _grid(n: int, k: int, block: int) -> tuple[int, int, int]:
    """(grid rows, grid programs per row, blocks per program) for blocks of ``block`` elements."""
    blocks = _ELEMENTS_PER_PROGRAM // block
    return n, triton.cdiv(k // block, blocks), blocks


def quantize_nvfp4(x: torch.Tensor, *, global_amax=None, per_row: bool = False) -> NVFP4:
    """:func:`tracefp4.formats.numerics.quantize_nvfp4` on the GPU: same arguments, same result."""
    check_input(x, NVFP4_BLOCK, cpu=False)
    _check_device(x)
    rows = _rows(x)
    n, k = rows.shape
    lead = x.shape[:-1]
    if global_amax is not None:
        amax = _global_amax(x, global_amax).to(x.device)
        by_row = amax.expand(*lead, 1).reshape(n).contiguous()
    else:
        by_row, bad = row_amax(rows)
        _refuse_non_finite(x, bad)
        if per_row:
            amax = by_row.reshape(*lead, 1)
        else:  # an empty tensor has amax 0 (S_enc 1), as on the CPU
            amax = by_row.amax() if n else torch.zeros((), dtype=torch.float32, device=x.device)
            by_row = amax.expand(n).contiguous()
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, k // NVFP4_BLOCK, dtype=torch.uint8, device=x.device)
    grid_rows, programs, blocks = _grid(n, k, NVFP4_BLOCK)
    bad = torch.zeros(n, programs, dtype=torch.int8, device=x.device)
    if n:
        _nvfp4_kernel[(grid_rows, programs)](rows, by_row, codes, scales, bad, k, BLOCKS=blocks, **_EXACT)
        _refuse_non_finite(x, bad)
    return NVFP4(codes.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn).reshape(*lead, k // NVFP4_BLOCK), amax)


_SCALE_VALUES = {Format.NVFP4: kernels.E4M3_VALUES, Format.MXFP4: kernels.E8M0_VALUES}


def guided_quantize(x: torch.Tensor, hint: Hint) -> NVFP4 | MXFP4:
    """:func:`tracefp4.guidance.guided_quantize` on the GPU; the hint's tensors may live anywhere."""
    _check_hint(x, hint, cpu=False)
    _check_device(x)
    rows = _rows(x)
    n, k = rows.shape
    dev = x.device
    if hint.fmt is Format.NVFP4:
        s_enc = nvfp4_global_encode_scale(hint.global_amax.to(dev))
        s_dec = (torch.tensor(1.0, dtype=torch.float32, device=dev) / s_enc).expand(*x.shape[:-1], 1)
        s_dec = s_dec.reshape(n).contiguous()
    else:
        s_dec = torch.ones(n, dtype=torch.float32, device=dev)
    values = torch.from_numpy(_SCALE_VALUES[hint.fmt]).to(dev)
    scales = hint.scales.reshape(-1, hint.scales.shape[-1]).contiguous().view(torch.uint8).to(dev)
    data = hint.data.reshape(-1, hint.data.shape[-1]).contiguous().to(dev)
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=dev)
    grid_rows, programs, blocks = _grid(n, k, hint.fmt.block)
    bad = torch.zeros(n, programs, dtype=torch.int8, device=dev)
    if n:
        _guided_kernel[(grid_rows, programs)](
            rows, scales, values, s_dec, data, codes, bad, k,
            BLOCK=hint.fmt.block, BLOCKS=blocks, FULL=hint.mode is HintMode.FULL, **_EXACT,
        )
        _refuse_non_finite(x, bad)
    codes_t = codes.reshape(*x.shape[:-1], k // 2)
    if hint.fmt is Format.NVFP4:
        return NVFP4(codes_t, hint.scales.clone(), hint.global_amax.clone())
    return MXFP4(codes_t, hint.scales.clone())


def lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K//2]`` -> bit-packed low magnitude bits ``[..., K//8]`` (guidance.lsb_bits)."""
    _check_device(codes, "codes")
    flat = codes.contiguous().reshape(-1)
    n_bytes = flat.numel() // 4
    bits = torch.empty(n_bytes, dtype=torch.uint8, device=codes.device)
    if n_bytes:
        _pack_lsb_kernel[(triton.cdiv(n_bytes, _PACK_BYTES),)](flat, bits, n_bytes, BYTES=_PACK_BYTES, **_EXACT)
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] // 4)


def encode_hint(q: NVFP4 | MXFP4, mode: str | HintMode = "lsb") -> Hint:
    """:func:`tracefp4.guidance.encode_hint` on the GPU."""
    return guidance.encode_hint(q, mode, pack=lsb_bits)
