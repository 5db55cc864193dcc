"""Fused CPU kernels (numba) for the FP4 recipes: one pass over the input, parallel over rows.

Each kernel is the fast twin of a function in :mod:`tracefp4.reference` and is tested against it at
atol=0. All arithmetic is float32 in the reference's operation order: numba keeps float32 x float32
in float32, does not contract multiply-adds (fastmath is off), and every literal below is an
``np.float32`` so nothing is silently promoted to float64.

Layout: inputs are 2-D float32 ``[rows, K]``; 4-bit codes are packed two per byte (element 2i in the
low nibble); low-bit hints are packed eight per byte (element 8j+i in bit i); per-block quantities are
``[rows, K/block]``; per-row quantities are ``[rows]`` (a per-tensor value is simply repeated).
"""

from __future__ import annotations

import math

import numba
import numpy as np

F32 = np.float32
_SIX = F32(6.0)
_ONE = F32(1.0)
_ONE_SIXTH = F32(1.0) / F32(6.0)  # the float32 nearest 1/6, as C's constexpr 1.0f/6.0f
_E4M3_MAX = F32(448.0)
_FLT_MAX = F32(np.finfo(np.float32).max)

_PAR = dict(nogil=True, cache=True, parallel=True)
_INL = dict(nogil=True, cache=True, inline="always")

#: float32 magnitude of each 3-bit magnitude code.
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _e4m3_values() -> np.ndarray:
    """float32 value of every E4M3 bit pattern (0x7f/0xff are NaN and never produced here)."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


E4M3_VALUES = _e4m3_values()


# --- scalar helpers ------------------------------------------------------------------------------


@numba.njit(**_INL)
def _rtn_mag(m):
    """Magnitude code of m in [0, 6], nearest with ties to the even code (0.25, 1.25, 2.5, 5 go down)."""
    return (
        np.uint8(m > F32(0.25))
        + np.uint8(m >= F32(0.75))
        + np.uint8(m > F32(1.25))
        + np.uint8(m >= F32(1.75))
        + np.uint8(m > F32(2.5))
        + np.uint8(m >= F32(3.5))
        + np.uint8(m > F32(5.0))
    )


@numba.njit(**_INL)
def _floor_mag(m):
    """Largest magnitude code whose value is <= m (m in [0, 6])."""
    return (
        np.uint8(m >= F32(0.5))
        + np.uint8(m >= F32(1.0))
        + np.uint8(m >= F32(1.5))
        + np.uint8(m >= F32(2.0))
        + np.uint8(m >= F32(3.0))
        + np.uint8(m >= F32(4.0))
        + np.uint8(m >= F32(6.0))
    )


@numba.njit(**_INL)
def _round_half_even(t):
    """Nearest integer to a non-negative float (exact for t < 2^23), ties to even."""
    n = math.floor(t)
    frac = t - n
    if frac > 0.5 or (frac == 0.5 and int(n) % 2 == 1):
        n += 1
    return int(n)


@numba.njit(**_INL)
def _e4m3_code(v):
    """E4M3 bit pattern of float32 v in [0, 448], round to nearest even, subnormals included.

    With e = max(floor(log2 v), -6) the E4M3 grid spacing near v is 2^(e-3); v counted in those steps
    is n in [8, 16] (or [0, 8] below the normal range), and the bit pattern is (e + 6) * 8 + n — a
    rounding carry to n = 16 lands on the next binade's pattern by itself.
    """
    if v == 0:
        return np.uint8(0)
    mant, ex = math.frexp(v)  # v = mant * 2^ex, mant in [0.5, 1): floor(log2 v) = ex - 1
    e = max(ex - 1, -6)
    n = _round_half_even(math.ldexp(float(v), 3 - e))  # exact: scaling by a power of two
    return np.uint8((e + 6) * 8 + n)


@numba.njit(**_INL)
def _sign_bit(x):
    """3 -> 0, -3 -> 8, -0.0 -> 8: the code's sign is the input's sign bit."""
    return np.uint8(8) if math.copysign(1.0, x) < 0 else np.uint8(0)


@numba.njit(**_INL)
def _rtn_code(xv, enc):
    z = abs(xv * enc)  # x * enc may overflow to inf for a zero block scale: the clamp takes it to 6
    if z > _SIX:
        z = _SIX
    return _rtn_mag(z) | _sign_bit(xv)


@numba.njit(**_INL)
def _guided_mag_lsb(m, bit):
    """Member of the bracket [floor(m), ceil(m)] whose low magnitude bit is ``bit``."""
    lo = _floor_mag(m)
    if E2M1_MAGS[lo] == m or (lo & np.uint8(1)) == bit:
        return lo
    return lo + np.uint8(1)


@numba.njit(**_INL)
def _guided_mag_full(m, negative, rollout_code):
    """Bracket member nearer the rollout code on the signed line; a tie (m a codeword) keeps RTN."""
    lo = _floor_mag(m)
    if E2M1_MAGS[lo] == m:
        return lo
    r = np.int32(rollout_code & np.uint8(7))
    if rollout_code & np.uint8(8):
        r = -r
    s = np.int32(-1) if negative else np.int32(1)
    d_lo = abs(s * np.int32(lo) - r)
    d_hi = abs(s * np.int32(lo + np.uint8(1)) - r)
    if d_lo < d_hi:
        return lo
    if d_hi < d_lo:
        return lo + np.uint8(1)
    return _rtn_mag(m)  # not reachable for adjacent codes; kept for the stated tie rule


# --- kernels -------------------------------------------------------------------------------------
# Inputs come as either float32 rows (``x32``) or bfloat16 rows viewed as uint16 (``x16``): a bf16 is
# the top half of a float32, so widening it is a 16-bit shift, done here instead of in an extra pass
# over memory. The unused one is an empty [0, 0] array. ``bad[r]`` is set where row r holds a NaN or
# Inf, so the caller can refuse it without a separate pass.


@numba.njit(**_INL)
def _load_block(x32, x16, r, base, n, ubuf, fbuf):
    """Copy elements [base, base+n) of row r into ``fbuf`` as float32; return (amax, all_finite)."""
    if x16.shape[0] > 0:
        for i in range(n):
            ubuf[i] = np.uint32(x16[r, base + i]) << np.uint32(16)
    else:
        for i in range(n):
            fbuf[i] = x32[r, base + i]
    amax = F32(0.0)
    finite = True
    for i in range(n):
        a = abs(fbuf[i])
        finite &= a <= _FLT_MAX  # false for NaN and Inf
        amax = max(amax, a)
    return amax, finite


@numba.njit(**_PAR)
def row_amax(x32, x16, block, amax, bad):
    """Per-row amax (float32 [R]) and non-finite flags, one pass."""
    rows = amax.shape[0]
    k = max(x32.shape[1], x16.shape[1])
    for r in numba.prange(rows):
        ubuf = np.empty(block, dtype=np.uint32)
        fbuf = ubuf.view(np.float32)
        m = F32(0.0)
        ok = True
        for base in range(0, k, block):
            a, f = _load_block(x32, x16, r, base, block, ubuf, fbuf)
            m = max(m, a)
            ok &= f
        amax[r] = m
        bad[r] = not ok


@numba.njit(**_PAR)
def nvfp4_quantize(x32, x16, s_enc, codes, scales, bad, e4m3_values):
    """Rows -> codes u8 [R, K/2], scales u8 (E4M3 bit patterns) [R, K/16]; s_enc f32 [R]."""
    rows = codes.shape[0]
    k = codes.shape[1] * 2
    for r in numba.prange(rows):
        ubuf = np.empty(16, dtype=np.uint32)
        fbuf = ubuf.view(np.float32)
        scale_factor = s_enc[r] * _ONE_SIXTH
        s_dec = _ONE / s_enc[r]
        ok = True
        for b in range(k // 16):
            amax, f = _load_block(x32, x16, r, b * 16, 16, ubuf, fbuf)
            ok &= f
            d = amax * scale_factor
            if d > _E4M3_MAX:  # clamp before the cast (also catches +inf)
                d = _E4M3_MAX
            s8 = _e4m3_code(d)
            scales[r, b] = s8
            enc = _ONE / (e4m3_values[s8] * s_dec)
            if enc > _FLT_MAX:
                enc = _FLT_MAX
            for i in range(0, 16, 2):
                codes[r, b * 8 + i // 2] = _rtn_code(fbuf[i], enc) | (_rtn_code(fbuf[i + 1], enc) << np.uint8(4))
        bad[r] = not ok


@numba.njit(**_INL)
def _mx_exponent(amax, rceil):
    """Unbiased E8M0 exponent of a block (see ScaleMode), clamped to [-127, 127]."""
    if amax == 0:
        return -127
    if rceil:
        t = amax / _SIX
        if t == 0:
            return -127
        mant, ex = math.frexp(t)
        e = ex - 1 if mant == 0.5 else ex
    else:
        mant, ex = math.frexp(amax)
        e = ex - 1 - 2
    return min(max(e, -127), 127)


@numba.njit(**_PAR)
def mxfp4_quantize(x32, x16, rceil, codes, scales, bad):
    """Rows -> codes u8 [R, K/2], biased E8M0 exponents u8 [R, K/32]."""
    rows = codes.shape[0]
    k = codes.shape[1] * 2
    for r in numba.prange(rows):
        ubuf = np.empty(32, dtype=np.uint32)
        fbuf = ubuf.view(np.float32)
        ok = True
        for b in range(k // 32):
            amax, f = _load_block(x32, x16, r, b * 32, 32, ubuf, fbuf)
            ok &= f
            e = _mx_exponent(amax, rceil)
            scales[r, b] = np.uint8(e + 127)
            enc = F32(math.ldexp(1.0, -e))  # a power of two: exact in float32 for |e| <= 127
            for i in range(0, 32, 2):
                codes[r, b * 16 + i // 2] = _rtn_code(fbuf[i], enc) | (_rtn_code(fbuf[i + 1], enc) << np.uint8(4))
        bad[r] = not ok


@numba.njit(**_PAR)
def dequantize(codes, block_mult, row_div, block):
    """``(value(code) * block_mult[block]) / row_div[row]`` in float32 -> f32 [R, K]."""
    rows, half = codes.shape
    out = np.empty((rows, half * 2), dtype=np.float32)
    for r in numba.prange(rows):
        div = row_div[r]
        for j in range(half):
            byte = codes[r, j]
            mult = block_mult[r, (2 * j) // block]
            for h in range(2):
                c = (byte >> np.uint8(4 * h)) & np.uint8(15)
                v = E2M1_MAGS[c & np.uint8(7)]
                if c & np.uint8(8):
                    v = -v
                out[r, 2 * j + h] = (v * mult) / div
    return out


@numba.njit(**_PAR)
def guided(x32, x16, enc, hint, full, block, codes, bad):
    """Guided codes u8 [R, K/2] on the rollout's grid ``enc`` f32 [R, K/block].

    ``hint`` is u8 [R, K/8] low bits (element 8j+i in bit i) or, with ``full``, the rollout's packed
    codes u8 [R, K/2].
    """
    rows = codes.shape[0]
    k = codes.shape[1] * 2
    for r in numba.prange(rows):
        ubuf = np.empty(block, dtype=np.uint32)
        fbuf = ubuf.view(np.float32)
        ok = True
        for b in range(k // block):
            base = b * block
            amax, f = _load_block(x32, x16, r, base, block, ubuf, fbuf)
            ok &= f
            e = enc[r, b]
            for i in range(0, block, 2):
                out = np.uint8(0)
                for h in range(2):
                    j = base + i + h  # element index in the row
                    xv = fbuf[i + h]
                    m = abs(xv * e)
                    if m > _SIX:
                        m = _SIX
                    sb = _sign_bit(xv)
                    if full:
                        rc = (hint[r, j // 2] >> np.uint8(4 * h)) & np.uint8(15)
                        c = _guided_mag_full(m, sb != 0, rc)
                    else:
                        c = _guided_mag_lsb(m, (hint[r, j // 8] >> np.uint8(j % 8)) & np.uint8(1))
                    out |= (c | sb) << np.uint8(4 * h)
                codes[r, (base + i) // 2] = out
        bad[r] = not ok


@numba.njit(**_PAR)
def pack_lsb(codes, bits):
    """Low magnitude bit of packed codes u8 [R, K/2] -> bit-packed u8 [R, K/8]."""
    rows, nbytes = bits.shape
    for r in numba.prange(rows):
        for j in range(nbytes):
            acc = np.uint8(0)
            for q in range(4):
                byte = codes[r, 4 * j + q]
                acc |= (byte & np.uint8(1)) << np.uint8(2 * q)
                acc |= ((byte >> np.uint8(4)) & np.uint8(1)) << np.uint8(2 * q + 1)
            bits[r, j] = acc
