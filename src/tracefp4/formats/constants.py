"""Every numeric constant of the FP4 formats, in one place.

The docstrings of the enums state each format's formula (NVFP4 in Transformer Engine's operation
order, MXFP4 per OCP MX v1.0), so a reader never has to hunt for it in the kernels.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

# --- E2M1 (FP4) element -------------------------------------------------------------------------
#: Magnitude of each 3-bit magnitude code 0..7. Bit 3 of a 4-bit code is the sign.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Rounding midpoints between consecutive magnitudes. A tie rounds to the even code, so the
#: midpoints 0.25, 1.25, 2.5, 5.0 go down (to codes 0, 2, 4, 6) and 0.75, 1.75, 3.5 go up.
E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
E2M1_MAG_MASK = 0x7

# --- E4M3 (FP8) block scale of NVFP4 ------------------------------------------------------------
E4M3_MAX = 448.0
#: Our NVFP4 allows subnormal block scales (down to 2^-9); torchao floors them at 2^-6 (the smallest
#: normal), a documented difference.
E4M3_MIN_NORMAL = 2.0**-6
TORCHAO_E4M3_SCALE_FLOOR = E4M3_MIN_NORMAL
#: Bit pattern of 448, the largest finite E4M3 value (what a saturated block scale is stored as).
E4M3_MAX_CODE = 0x7E
#: E4M3 has no infinities: 0x7F and 0xFF (magnitude bits all set) are its only NaN patterns.
E4M3_NAN_CODE = 0x7F
E4M3_MAG_MASK = 0x7F
#: Bit 7 of an E4M3 code is the sign; magnitude codes 0x00..0x7E are the finite values in increasing
#: order, so adjacent magnitudes differ by one in the code (and in its lowest bit, as E2M1's do).
E4M3_SIGN_BIT = 0x80

# --- E8M0 shared scale of MXFP4 -----------------------------------------------------------------
E8M0_BIAS = 127
E8M0_NAN = 255
#: Unbiased exponent range an MXFP4 block scale is clamped to (biased 0 .. 254).
E8M0_MIN_EXP = -E8M0_BIAS
E8M0_MAX_EXP = E8M0_BIAS
#: exponent of E2M1's largest power of two (4 = 2^2): MX scale = 2^(floor(log2 amax) - 2)
E2M1_EMAX = 2

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
#: The NVFP4 global-scale numerator: S_enc = 448 * 6 / amax.
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The dtypes a dequantization writes: float32 (exact) and bfloat16 (those values rounded to nearest
#: even, as ``.to(torch.bfloat16)`` of the float32 ones, written without the float32 tensor).
DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16)


def _e4m3_values() -> np.ndarray:
    """float32 value of every E4M3 bit pattern (0x7F/0xFF are NaN; validation keeps them out)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _e8m0_values() -> np.ndarray:
    """float32 ``2^(b - 127)`` of every biased E8M0 exponent b (b = 255, NaN in E8M0, gives inf)."""
    with np.errstate(over="ignore"):
        return np.ldexp(np.float64(1.0), np.arange(256) - E8M0_BIAS).astype(np.float32)


#: Lookup tables from a stored scale byte to its float32 value, shared by the CPU and GPU kernels.
E4M3_VALUES: np.ndarray = _e4m3_values()
E8M0_VALUES: np.ndarray = _e8m0_values()


class Format(str, enum.Enum):
    """Element formats of a quantized tensor: the two FP4 formats, and FP8 E4M3 with a per-row scale."""

    NVFP4 = "nvfp4"
    """Blocks of 16; E4M3 block scale ``s8``; FP32 global scale ``S_enc = 448*6/amax`` (0 -> 1).
    ``s8 = e4m3(clamp(amax_b * (S_enc * (1/6)), 448))``, ``enc = min(1/(s8 * (1/S_enc)), FLT_MAX)``,
    ``code = RNE(clamp(x*enc, +-6))``, ``x_hat = value(code) * s8 / S_enc``."""

    MXFP4 = "mxfp4"
    """Blocks of 32; E8M0 scale ``X = 2^e``; ``x_hat = value(code) * X``, ``code = RNE(clamp(x/X, +-6))``.
    ``e`` per :class:`ScaleMode`."""

    FP8 = "fp8"
    """E4M3 elements with one float32 scale per row (last dim): ``scale = amax / 448`` (1 for an
    all-zero row), ``code = e4m3(clamp(x / scale, +-448))`` (round to nearest, ties to the even code),
    ``x_hat = value(code) * scale``. No blocks: :attr:`block` is 1."""

    @property
    def block(self) -> int:
        return {Format.NVFP4: NVFP4_BLOCK, Format.MXFP4: MXFP4_BLOCK, Format.FP8: 1}[self]

    @property
    def fp4(self) -> bool:
        """NVFP4 or MXFP4 (4-bit codes, two per byte, block scales)."""
        return self is not Format.FP8


class ScaleMode(str, enum.Enum):
    """How MXFP4 picks its E8M0 block exponent from the block amax."""

    FLOOR = "floor"
    """OCP MX v1.0: ``e = floor(log2(amax)) - 2`` (values above 6*2^e saturate). amax 0 -> e = -127."""

    RCEIL = "rceil"
    """``e = ceil(log2(amax / 6))``: the smallest power of two with ``amax / 2^e <= 6`` (never
    saturates). amax 0 -> e = -127."""


class HintMode(str, enum.Enum):
    """What the rollout records per element at a guided site (block scales and global amax always)."""

    FULL = "full"
    """The 4-bit code itself: the trainer picks the bracket member closer to it (4 bits/element)."""

    LSB = "lsb"
    """The low bit of the code's magnitude (1 bit/element): adjacent codewords on the signed line
    alternate in this bit, so it names one member of any bracket."""
