"""Triton (GPU) twins of the CPU kernels: NVFP4 and MXFP4 quantize, dequantize, guided quantize
(lsb and full), lsb hint packing.

The functions here take raw rows (``[R, K]`` tensors and per-row ``[R]`` quantities) and return raw
tensors; :mod:`tracefp4.formats` validates the inputs, shapes the containers, and sends CUDA
tensors here through its one dispatch point. The results are bit for bit equal to the CPU kernels
and to :mod:`tracefp4.formats.reference`. They take CUDA tensors; under Triton's interpreter
(``TRITON_INTERPRET=1``, set before this module is imported) they take CPU tensors too, which is how
CI checks them without a GPU. ``scripts/gpu_check.py`` checks them on a real device and measures
bandwidth.

Exactness on a GPU: every step is float32 in the reference's order; divisions use ``tl.div_rn``
(IEEE round-to-nearest, where a plain ``/`` may be approximate); no product feeds an addition, so
nothing can be contracted into an FMA; the E4M3 cast is the bit-level rounding of the CPU kernels
(``kernels._e4m3_round``), checked against torch's cast on every float32 in [0, 448]; MXFP4 block
exponents and their powers of two are read from and built as float32 bit patterns; magnitudes are
compared as integer bit patterns, so NaN/Inf detection does not depend on the GPU's float min/max
NaN rules. One assumption is left to check on each device: float32 subnormals survive
multiplication (no flush to zero). They matter only for values below ~1e-35 (bf16/fp32 subnormal
inputs, a global amax so small that 1/S_enc is subnormal, or E8M0 scales near 2^-127); the ``tiny``
data in tests/test_triton.py and scripts/gpu_check.py is there to catch a device that flushes them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from tracefp4.formats.constants import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_VALUES,
    E8M0_BIAS,
    E8M0_VALUES,
    FLOAT32_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Format,
)

from tracefp4.formats.triton_device import (
    abs_bits,
    ceil_mag,
    div_rn,
    e2m1_value,
    e4m3_round,
    encode_scale,
    floor_mag,
    pack_pairs,
    rtn_mag,
    sign_code_bit,
    widen,
)

__all__ = [
    "interpreting",
    "row_amax",
    "quantize_nvfp4",
    "quantize_mxfp4",
    "dequantize",
    "guided_codes",
    "lsb_bits",
]

#: Exact float32 constants, written as the float32 values the CPU kernels use.
_ONE_SIXTH = float(np.float32(1.0) / np.float32(E2M1_MAX))
_FLT_MAX = float(np.float32(FLOAT32_MAX))
_FINITE_LIMIT = 0x7F7FFFFF  # abs bit pattern of FLT_MAX: anything above is NaN or Inf
_E8M0_BIAS = tl.constexpr(E8M0_BIAS)
_SIX = tl.constexpr(float(E2M1_MAX))
_E4M3_MAX = tl.constexpr(float(E4M3_MAX))

#: No kernel here multiplies into an addition, so FMA contraction could not change a result; it is
#: switched off anyway so that a future edit cannot silently break bit-exactness.
_EXACT = dict(enable_fp_fusion=False)
_ELEMENTS_PER_PROGRAM = 1024  # per program of the quantize kernels: 64 NVFP4 or 32 MXFP4 blocks
_ROW_TILE = 1024
_PACK_BYTES = 1024


def interpreting() -> bool:
    """True when this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_nvfp4_kernel).__name__ == "InterpretedFunction"


# --- kernels -------------------------------------------------------------------------------------
# Programs own BLOCKS consecutive blocks of one row: grid (rows, cdiv(blocks_per_row, BLOCKS)). Each
# writes one flag, bad[row, program], set when its slice holds a NaN or Inf.


@triton.jit
def _row_amax_kernel(x_ptr, amax_ptr, K, TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    top = tl.zeros((TILE,), tl.uint32)
    for k0 in range(0, K, TILE):
        offs = k0 + tl.arange(0, TILE)
        x = tl.load(x_ptr + r * K + offs, mask=offs < K, other=0.0)
        top = tl.maximum(top, abs_bits(widen(x)))
    m = tl.max(top, axis=0)  # a NaN/Inf row is clamped here; the quantize pass flags it
    tl.store(amax_ptr + r, tl.minimum(m, _FINITE_LIMIT).to(tl.float32, bitcast=True))


@triton.jit
def _flag_non_finite(x, bad_ptr):
    r = tl.program_id(0).to(tl.int64)
    top = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
    tl.store(bad_ptr + r * tl.num_programs(1) + tl.program_id(1), (top > _FINITE_LIMIT).to(tl.int8))


@triton.jit
def _nvfp4_kernel(x_ptr, amax_ptr, codes_ptr, scales_ptr, bad_ptr, K, BLOCKS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # row offsets reach past 2^31 elements on big tensors
    nb = K // 16
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_row = b < nb
    i = tl.arange(0, 16)
    x = widen(tl.load(x_ptr + r * K + b[:, None] * 16 + i[None, :], mask=in_row[:, None], other=0.0))
    _flag_non_finite(x, bad_ptr)
    mag = tl.abs(x)
    s_enc = encode_scale(tl.load(amax_ptr + r))
    d = tl.minimum(tl.max(mag, axis=1) * (s_enc * _ONE_SIXTH), _E4M3_MAX)  # clamp before the cast
    s8, s8_value = e4m3_round(d)
    enc = tl.minimum(div_rn(1.0, s8_value * div_rn(1.0, s_enc)), _FLT_MAX)
    codes = rtn_mag(mag * enc[:, None]) | sign_code_bit(x)  # |x * enc| == |x| * enc exactly
    j = tl.arange(0, 8)
    tl.store(codes_ptr + r * (K // 2) + b[:, None] * 8 + j[None, :], pack_pairs(codes, BLOCKS, 16),
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
    x = widen(tl.load(x_ptr + r * K + elem, mask=mask, other=0.0))
    _flag_non_finite(x, bad_ptr)
    scale = tl.load(values_ptr + tl.load(scales_ptr + r * nb + b, mask=in_row, other=0).to(tl.int32))
    enc = tl.minimum(div_rn(1.0, scale * tl.load(s_dec_ptr + r)), _FLT_MAX)
    m = tl.minimum(tl.abs(x) * enc[:, None], _SIX)
    lo = floor_mag(m)
    hi = ceil_mag(m)  # == lo on a codeword, so no hint can move it
    sign = sign_code_bit(x)
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
    tl.store(codes_ptr + r * (K // 2) + b[:, None] * (BLOCK // 2) + j[None, :], pack_pairs(codes, BLOCKS, BLOCK),
             mask=mask)


@triton.jit
def _pack_lsb_kernel(codes_ptr, bits_ptr, n_bytes, BYTES: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # output byte o comes from code bytes 4o .. 4o+3
    q = tl.arange(0, 4)[None, :].to(tl.uint32)
    c = tl.load(codes_ptr + o[:, None] * 4 + q, mask=(o < n_bytes)[:, None], other=0).to(tl.uint32)
    bits = ((c & 1) << (2 * q)) | (((c >> 4) & 1) << (2 * q + 1))
    tl.store(bits_ptr + o, tl.sum(bits, axis=1).to(tl.uint8), mask=o < n_bytes)  # disjoint bits: sum == or


@triton.jit
def _mx_exponent(amax, RCEIL: tl.constexpr):
    """Unbiased E8M0 exponents of float32 block amaxes (see ScaleMode), clamped to [-127, 127],
    read off float32 bit patterns (as kernels._mx_exponent's frexp, without a log).

    floor: ``floor(log2 amax) - 2`` is the exponent field minus 129; amax 0 and subnormal amaxes
    (field 0) clamp to -127. rceil: ``ceil(log2 t)`` for ``t = amax / 6`` is the field minus 127,
    plus one unless t is a power of two; a subnormal t (mantissa M, t = M * 2^-149) gives -126 when
    M > 2^22 and clamps to -127 otherwise (t = 0 included).
    """
    if RCEIL:
        t = tl.div_rn(amax, tl.full(amax.shape, _SIX, tl.float32))
        bits = t.to(tl.uint32, bitcast=True)
        field = (bits >> 23).to(tl.int32)
        mant = bits & 0x7FFFFF
        e = tl.where(field > 0, field - _E8M0_BIAS + (mant != 0).to(tl.int32), tl.where(mant > 0x400000, -126, -127))
    else:
        e = (amax.to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - (_E8M0_BIAS + 2)
    return tl.minimum(tl.maximum(e, -_E8M0_BIAS), _E8M0_BIAS)


@triton.jit
def _mxfp4_kernel(x_ptr, codes_ptr, scales_ptr, bad_ptr, K, BLOCKS: tl.constexpr, RCEIL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    nb = K // 32
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_row = b < nb
    i = tl.arange(0, 32)
    x = widen(tl.load(x_ptr + r * K + b[:, None] * 32 + i[None, :], mask=in_row[:, None], other=0.0))
    _flag_non_finite(x, bad_ptr)
    top = tl.minimum(tl.max(abs_bits(x), axis=1), _FINITE_LIMIT)  # a bad block still computes in range
    e = _mx_exponent(top.to(tl.float32, bitcast=True), RCEIL)
    # 2^-e as a float32 pattern: e is in [-127, 126], so the biased field 127 - e is a normal one
    enc = ((-e + _E8M0_BIAS).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    codes = rtn_mag(tl.abs(x) * enc[:, None]) | sign_code_bit(x)  # a power of two: |x * enc| == |x| * enc
    j = tl.arange(0, 16)
    tl.store(codes_ptr + r * (K // 2) + b[:, None] * 16 + j[None, :], pack_pairs(codes, BLOCKS, 32),
             mask=in_row[:, None])
    tl.store(scales_ptr + r * nb + b, (e + _E8M0_BIAS).to(tl.uint8), mask=in_row)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, values_ptr, div_ptr, out_ptr, K,
                    BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    nb = K // BLOCK
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_row = b < nb
    i = tl.arange(0, BLOCK)
    elem = b[:, None] * BLOCK + i[None, :]
    mask = in_row[:, None]
    byte = tl.load(codes_ptr + r * (K // 2) + elem // 2, mask=mask, other=0).to(tl.uint32)
    code = (byte >> ((elem % 2) * 4).to(tl.uint32)) & 15
    scale = tl.load(values_ptr + tl.load(scales_ptr + r * nb + b, mask=in_row, other=0).to(tl.int32))
    v = e2m1_value(code) * scale[:, None]  # exact: 2 significant bits times a scale's 4
    out = tl.div_rn(v, tl.broadcast_to(tl.load(div_ptr + r), v.shape))
    tl.store(out_ptr + r * K + elem, out, mask=mask)


# --- host wrappers -------------------------------------------------------------------------------
# Raw rows in, raw tensors out; ``bad`` [R] (bool) flags rows holding a NaN or Inf, and the caller
# refuses them. The caller has validated shapes, dtypes and grids.


def _check_device(t: torch.Tensor, what: str = "x") -> None:
    if t.is_cuda or (interpreting() and t.device.type == "cpu"):
        return
    raise ValueError(
        f"{what}: the Triton kernels take CUDA tensors (CPU tensors only under TRITON_INTERPRET=1), "
        f"got device {t.device}"
    )


def _grid(n: int, k: int, block: int) -> tuple[int, int, int]:
    """(grid rows, grid programs per row, blocks per program) for blocks of ``block`` elements."""
    blocks = _ELEMENTS_PER_PROGRAM // block
    return n, triton.cdiv(k // block, blocks), blocks


def _flags(n: int, programs: int, device) -> torch.Tensor:
    return torch.zeros(n, programs, dtype=torch.int8, device=device)


def _any_bad(bad: torch.Tensor) -> torch.Tensor:
    return bad.bool().any(dim=1) if bad.dim() == 2 else bad.bool()


@functools.lru_cache(maxsize=None)
def _scale_table(fmt: str, device: str) -> torch.Tensor:
    """float32 value of each scale byte of ``fmt``, on ``device`` (made once per device)."""
    values = E4M3_VALUES if Format(fmt) is Format.NVFP4 else E8M0_VALUES
    return torch.from_numpy(values).to(device)


def row_amax(rows: torch.Tensor) -> torch.Tensor:
    """float32 amax of each row of ``rows`` [R, K]; a NaN/Inf row gets FLT_MAX (the quantize pass flags it)."""
    _check_device(rows)
    n, k = rows.shape
    amax = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n:
        _row_amax_kernel[(n,)](rows, amax, k, TILE=_ROW_TILE, **_EXACT)
    return amax


def quantize_nvfp4(rows: torch.Tensor, row_amax: torch.Tensor):
    """NVFP4 of ``rows`` [R, K] with global amax ``row_amax`` f32 [R] (on rows' device):
    (codes u8 [R, K/2], scales u8 E4M3 patterns [R, K/16], bad [R])."""
    _check_device(rows)
    n, k = rows.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, k // NVFP4_BLOCK, dtype=torch.uint8, device=rows.device)
    grid_rows, programs, blocks = _grid(n, k, NVFP4_BLOCK)
    bad = _flags(n, programs, rows.device)
    if n and programs:
        _nvfp4_kernel[(grid_rows, programs)](rows, row_amax, codes, scales, bad, k, BLOCKS=blocks, **_EXACT)
    return codes, scales, _any_bad(bad)


def quantize_mxfp4(rows: torch.Tensor, rceil: bool):
    """MXFP4 of ``rows`` [R, K]: (codes u8 [R, K/2], biased E8M0 exponents u8 [R, K/32], bad [R])."""
    _check_device(rows)
    n, k = rows.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, k // MXFP4_BLOCK, dtype=torch.uint8, device=rows.device)
    grid_rows, programs, blocks = _grid(n, k, MXFP4_BLOCK)
    bad = _flags(n, programs, rows.device)
    if n and programs:
        _mxfp4_kernel[(grid_rows, programs)](rows, codes, scales, bad, k, BLOCKS=blocks, RCEIL=bool(rceil), **_EXACT)
    return codes, scales, _any_bad(bad)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, row_div: torch.Tensor, block: int) -> torch.Tensor:
    """float32 ``(value(code) * scale) / row_div[row]`` [R, K] of packed ``codes`` [R, K/2] and scale
    bytes ``scales`` u8 [R, K/block] of format ``fmt``."""
    _check_device(codes, "codes")
    n, half = codes.shape
    k = 2 * half
    out = torch.empty(n, k, dtype=torch.float32, device=codes.device)
    grid_rows, programs, blocks = _grid(n, k, block)
    if n and programs:
        values = _scale_table(fmt, str(codes.device))
        _dequant_kernel[(grid_rows, programs)](codes, scales, values, row_div, out, k, BLOCK=block, BLOCKS=blocks, **_EXACT)
    return out


def guided_codes(rows, scales, fmt: str, s_dec, hint, block: int, full: bool):
    """Guided codes u8 [R, K/2] of ``rows`` [R, K] on the grid ``scales`` (u8 [R, K/block] bytes of
    ``fmt``) with ``s_dec`` = 1/S_enc f32 [R] (1 for MXFP4), each element rounded to the bracket
    member ``hint`` names: packed codes u8 [R, K/2] when ``full``, else low bits u8 [R, K/8].
    Returns (codes, bad [R])."""
    _check_device(rows)
    n, k = rows.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=rows.device)
    grid_rows, programs, blocks = _grid(n, k, block)
    bad = _flags(n, programs, rows.device)
    if n and programs:
        values = _scale_table(fmt, str(rows.device))
        _guided_kernel[(grid_rows, programs)](
            rows, scales, values, s_dec, hint, codes, bad, k, BLOCK=block, BLOCKS=blocks, FULL=bool(full), **_EXACT,
        )
    return codes, _any_bad(bad)


def lsb_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed code rows u8 [R, K/2] -> bit-packed low magnitude bits u8 [R, K/8]."""
    _check_device(codes, "codes")
    flat = codes.contiguous().reshape(-1)
    n_bytes = flat.numel() // 4
    bits = torch.empty(n_bytes, dtype=torch.uint8, device=codes.device)
    if n_bytes:
        _pack_lsb_kernel[(triton.cdiv(n_bytes, _PACK_BYTES),)](flat, bits, n_bytes, BYTES=_PACK_BYTES, **_EXACT)
    return bits.reshape(codes.shape[0], codes.shape[1] // 4)
