"""Device helpers of the Triton kernels (:mod:`tracefp4.formats.triton_kernels`): exact float32 and
bit-level building blocks, each the twin of a CPU kernel's step (:mod:`tracefp4.formats.kernels`).
Imports triton: loaded only where the Triton kernels are."""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from tracefp4.formats.constants import FLOAT32_MAX, NVFP4_GLOBAL_NUMERATOR

__all__ = ["widen", "abs_bits", "sign_code_bit", "rtn_mag", "floor_mag", "ceil_mag", "e4m3_round", "div_rn",
           "encode_scale", "pack_pairs", "e2m1_value"]

FLT_MAX_F32 = float(np.float32(FLOAT32_MAX))
NVFP4_NUMERATOR = tl.constexpr(float(NVFP4_GLOBAL_NUMERATOR))  # 448 * 6 = 2688, exact in float32


@triton.jit
def widen(x):
    """x as float32, exactly. A bf16 is the top half of a float32, so it is widened by a shift: the
    interpreter's bf16 cast loses bf16 subnormals, and a shift cannot depend on a denormal mode."""
    if x.dtype.is_bf16():
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def abs_bits(xf):
    """float32 abs bit patterns; they order like the magnitudes and NaN/Inf lie above _FINITE_LIMIT."""
    return xf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def sign_code_bit(xf):
    """8 where float32 xf's sign bit is set (-0.0 included), else 0."""
    return (xf.to(tl.uint32, bitcast=True) >> 31) << 3


@triton.jit
def rtn_mag(m):
    """Magnitude code of m >= 0, nearest with ties to even (see kernels._rtn_mag)."""
    c = (m > 0.25).to(tl.uint32) + (m >= 0.75).to(tl.uint32) + (m > 1.25).to(tl.uint32)
    c += (m >= 1.75).to(tl.uint32) + (m > 2.5).to(tl.uint32) + (m >= 3.5).to(tl.uint32)
    return c + (m > 5.0).to(tl.uint32)


@triton.jit
def floor_mag(m):
    c = (m >= 0.5).to(tl.uint32) + (m >= 1.0).to(tl.uint32) + (m >= 1.5).to(tl.uint32)
    c += (m >= 2.0).to(tl.uint32) + (m >= 3.0).to(tl.uint32) + (m >= 4.0).to(tl.uint32)
    return c + (m >= 6.0).to(tl.uint32)


@triton.jit
def ceil_mag(m):
    c = (m > 0.0).to(tl.uint32) + (m > 0.5).to(tl.uint32) + (m > 1.0).to(tl.uint32)
    c += (m > 1.5).to(tl.uint32) + (m > 2.0).to(tl.uint32) + (m > 3.0).to(tl.uint32)
    return c + (m > 4.0).to(tl.uint32)


@triton.jit
def e4m3_round(v):
    """(pattern, value) of float32 v in [0, 448] rounded to E4M3 (see kernels._e4m3_round)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    shifted = v + 16384.0  # 2^14: floats in [2^14, 2^15) are 2^-9 apart, the E4M3 subnormal step
    normal = v >= 0.015625  # 2^-6, the smallest E4M3 normal
    code = tl.where(normal, (rounded >> 20) - 960, shifted.to(tl.uint32, bitcast=True) - 0x46800000)
    value = tl.where(normal, rounded.to(tl.float32, bitcast=True), shifted - 16384.0)
    return code, value


@triton.jit
def div_rn(numerator: tl.constexpr, x):
    """numerator / x, correctly rounded (a plain ``/`` may compile to an approximate division)."""
    return tl.div_rn(tl.full(x.shape, numerator, tl.float32), x)


@triton.jit
def encode_scale(amax):
    """``S_enc = 448*6/amax`` capped at FLT_MAX; amax 0 (or a quotient of 0) gives 1."""
    s = tl.minimum(div_rn(NVFP4_NUMERATOR, amax), FLT_MAX_F32)
    return tl.where((amax == 0.0) | (s == 0.0), 1.0, s)


@triton.jit
def pack_pairs(codes, BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCKS, BLOCK] codes -> [BLOCKS, BLOCK // 2] bytes, element 2i in the low nibble."""
    even, odd = tl.split(tl.reshape(codes, (BLOCKS, BLOCK // 2, 2)))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def e2m1_value(code):
    """float32 value of 4-bit codes (uint32), built as bits like kernels._e2m1_value: from magnitude
    code 2 up, exponent (c >> 1) - 1 and mantissa bit c & 1; codes 0 and 1 are 0 and 0.5; bit 3 is
    the float's sign bit."""
    mag = code & 7
    normal = ((126 + (mag >> 1)) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag >= 2, normal, mag * 0x3F000000)  # 0x3f000000 is 0.5
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
