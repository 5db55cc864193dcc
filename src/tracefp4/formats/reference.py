"""The readable reference: every recipe (NVFP4, MXFP4, FP8 E4M3, guided rounding, residual activation
compensation) written as plainly as possible.

This module is the oracle. It favours one obvious step per line over speed: rounding is done by
searching the codeword table for the nearest value (not by comparing against midpoints, as the fast
kernels do), block scales go through PyTorch's own float8 cast, and guided rounding enumerates the
bracket explicitly. The fast paths in :mod:`tracefp4.formats` (every backend of every op: tests/test_conformance.py)
and :mod:`tracefp4.guidance` are tested against these functions bit for bit (atol=0). The recipes built
on these (residual activation compensation, the packed-FP4 GEMM) are in
:mod:`tracefp4.formats.reference_composite`. Tests import both; the library never does.

All arithmetic is float32, in the operation order of Transformer Engine's NVFP4 recipe. Inputs are
assumed validated (finite, last dim a multiple of the block); outputs are *unpacked* 4-bit codes
(one per uint8) plus raw scales, so the reference does not depend on the packing code it checks.
"""

from __future__ import annotations

import math

import torch

from tracefp4.formats.constants import (
    E2M1_EMAX,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MAX_CODE,
    E4M3_SIGN_BIT,
    E8M0_BIAS,
    FLOAT32_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_NUMERATOR,
)

_F32 = torch.float32


def e2m1_table() -> torch.Tensor:
    """Value of each 4-bit code 0..15 (bit 3 is the sign; code 8 is -0.0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=_F32)
    return torch.cat([mags, -mags])


def round_to_e2m1(z: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit code of each float32 in ``z`` (already clamped to [-6, 6]).

    Nearest magnitude by exhaustive search; on a tie the even code wins. The sign bit is the input's
    sign bit, so -0.0 and small negatives that round to zero give code 8.
    """
    mags = torch.tensor(E2M1_VALUES, dtype=_F32)
    dist = (z.abs().unsqueeze(-1) - mags).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    is_best = dist == best
    # Among equally near codes (a tie: exactly two) prefer the even one.
    codes = torch.arange(8)
    preference = torch.where(is_best, (codes % 2) * 8 + codes, torch.full_like(codes, 10_000))
    mag_code = preference.argmin(dim=-1)
    sign = torch.signbit(z).to(torch.int64) * E2M1_SIGN_BIT
    return (mag_code + sign).to(torch.uint8)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of unpacked 4-bit codes."""
    return e2m1_table()[codes.long()]


# --- NVFP4 ---------------------------------------------------------------------------------------


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448*6 / amax`` in float32, capped at FLT_MAX; amax 0 gives 1 (TE's rule)."""
    amax = amax.to(_F32)
    s_enc = torch.tensor(NVFP4_GLOBAL_NUMERATOR, dtype=_F32) / amax
    s_enc = torch.minimum(s_enc, torch.tensor(FLOAT32_MAX, dtype=_F32))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def nvfp4_block_scale(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale: ``e4m3(clamp(amax_b * (S_enc * (1/6)), 448))`` (subnormals allowed)."""
    one_sixth = torch.tensor(1.0, dtype=_F32) / torch.tensor(E2M1_MAX, dtype=_F32)
    decode = block_amax * (s_enc * one_sixth)
    # Clamp before the cast: older CPU casts turn overflow into NaN instead of saturating.
    decode = torch.clamp(decode, max=E4M3_MAX)
    return decode.to(torch.float8_e4m3fn)


def nvfp4_encode_factor(s8: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Per-block multiplier ``1 / (float(s8) * (1/S_enc))``, capped at FLT_MAX (zero block scale)."""
    s_dec = torch.tensor(1.0, dtype=_F32) / s_enc
    enc = torch.tensor(1.0, dtype=_F32) / (s8.to(_F32) * s_dec)
    return torch.minimum(enc, torch.tensor(FLOAT32_MAX, dtype=_F32))


def _amax_for(x: torch.Tensor, global_amax, per_row: bool) -> torch.Tensor:
    if global_amax is not None:
        return torch.as_tensor(global_amax, dtype=_F32)
    xf = x.to(_F32).abs()
    return xf.amax(dim=-1, keepdim=True) if per_row else xf.amax()


def quantize_nvfp4(x: torch.Tensor, global_amax=None, per_row: bool = False):
    """Reference NVFP4: returns (unpacked codes uint8 [..., K], s8 e4m3 [..., K/16], amax float32)."""
    amax = _amax_for(x, global_amax, per_row)
    s_enc = nvfp4_global_encode_scale(amax)
    xb = x.to(_F32).reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    # amax/S_enc are scalar or [..., 1]: both broadcast against per-block tensors [..., K/16].
    s8 = nvfp4_block_scale(xb.abs().amax(dim=-1), s_enc)
    enc = nvfp4_encode_factor(s8, s_enc)
    z = torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1(z).reshape(x.shape)
    return codes, s8, amax


def dequantize_nvfp4(codes: torch.Tensor, s8: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``value(code) * float(s8) / S_enc`` in float32."""
    s_enc = nvfp4_global_encode_scale(amax).unsqueeze(-1)  # broadcast over elements of a block
    vals = e2m1_value(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    return (vals * s8.to(_F32).unsqueeze(-1) / s_enc).reshape(codes.shape)


# --- NVFP4 "Four over Six" (arXiv 2512.02010) -----------------------------------------------------
# Each block of 16 is quantized twice, once with the E4M3 block scale that maps its maximum to 6 (the
# standard recipe above) and once with the scale that maps it to 4; the block keeps the candidate with
# the smaller sum of squared errors (ties keep 6). Mapping the maximum to 4 uses the codewords
# {0, 0.5, ..., 3, 4} with finer relative steps near the block maximum, and never the 4 -> 6 gap.
# The global scale is TE's ``448*6/amax`` as for 6; a 4-candidate scale above 448 saturates at 448.


def nvfp4_block_scale_4(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale mapping the block maximum to 4: ``e4m3(clamp(amax_b * (S_enc * (1/4)), 448))``."""
    quarter = torch.tensor(0.25, dtype=_F32)
    decode = torch.clamp(block_amax * (s_enc * quarter), max=E4M3_MAX)
    return decode.to(torch.float8_e4m3fn)


def block_sse(xb: torch.Tensor, codes: torch.Tensor, s8: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors of each block ``[..., nb]``: float64, accumulated element 0..15 in order,
    of ``x - value(code) * float(s8) / S_enc`` (the dequantized value, in float32 as dequantize does)."""
    deq = e2m1_value(codes) * s8.to(_F32).unsqueeze(-1) / s_enc.unsqueeze(-1)
    sq = (xb.double() - deq.double()) ** 2
    total = torch.zeros(sq.shape[:-1], dtype=torch.float64)
    for j in range(sq.shape[-1]):
        total = total + sq[..., j]
    return total


def quantize_nvfp4_4over6(x: torch.Tensor, global_amax=None, per_row: bool = False):
    """Reference Four over Six NVFP4: returns (unpacked codes uint8 [..., K], s8 e4m3 [..., K/16], amax).

    Both candidates follow :func:`quantize_nvfp4`'s operation order; only the block scale differs.
    """
    amax = _amax_for(x, global_amax, per_row)
    s_enc = nvfp4_global_encode_scale(amax)
    xb = x.to(_F32).reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = xb.abs().amax(dim=-1)
    candidates = {}
    for block_max, s8 in ((6, nvfp4_block_scale(block_amax, s_enc)), (4, nvfp4_block_scale_4(block_amax, s_enc))):
        enc = nvfp4_encode_factor(s8, s_enc)
        z = torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
        codes = round_to_e2m1(z)
        candidates[block_max] = (codes, s8, block_sse(xb, codes, s8, s_enc))
    codes6, s8_6, err6 = candidates[6]
    codes4, s8_4, err4 = candidates[4]
    four_wins = err4 < err6  # a tie keeps 6
    s8 = torch.where(four_wins, s8_4.view(torch.uint8), s8_6.view(torch.uint8)).view(torch.float8_e4m3fn)
    codes = torch.where(four_wins.unsqueeze(-1), codes4, codes6).reshape(x.shape)
    return codes, s8, amax


# --- MXFP4 ---------------------------------------------------------------------------------------


def mx_exponent(amax: float, scale_mode: str) -> int:
    """Unbiased E8M0 exponent of one block, from its float32 amax (a Python float, exact)."""
    if amax == 0.0:
        return -E8M0_BIAS
    if scale_mode == "floor":
        mant, exp = math.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
        e = (exp - 1) - E2M1_EMAX
    elif scale_mode == "rceil":
        t = float(torch.tensor(amax, dtype=_F32) / torch.tensor(E2M1_MAX, dtype=_F32))
        if t == 0.0:  # amax/6 underflowed: the smallest scale will do
            return -E8M0_BIAS
        mant, exp = math.frexp(t)
        e = exp - 1 if mant == 0.5 else exp
    else:
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    return max(-E8M0_BIAS, min(E8M0_BIAS, e))


def quantize_mxfp4(x: torch.Tensor, scale_mode: str = "floor"):
    """Reference MXFP4: returns (unpacked codes uint8 [..., K], biased E8M0 exponents uint8 [..., K/32])."""
    xb = x.to(_F32).reshape(-1, MXFP4_BLOCK)
    amax = xb.abs().amax(dim=-1)
    exps = torch.tensor([mx_exponent(float(a), scale_mode) for a in amax], dtype=torch.int32)
    inv_scale = torch.pow(torch.tensor(2.0, dtype=torch.float64), -exps.double()).to(_F32)
    z = torch.clamp(xb * inv_scale.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1(z).reshape(x.shape)
    biased = (exps + E8M0_BIAS).to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK)
    return codes, biased


def mx_scale(biased: torch.Tensor) -> torch.Tensor:
    """float32 value ``2^(b - 127)`` of biased E8M0 exponents (exact, also for b = 0)."""
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), biased.double() - E8M0_BIAS).to(_F32)


def dequantize_mxfp4(codes: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    vals = e2m1_value(codes).reshape(*codes.shape[:-1], -1, MXFP4_BLOCK)
    return (vals * mx_scale(biased).unsqueeze(-1)).reshape(codes.shape)


# --- Rollout-guided rounding ----------------------------------------------------------------------
# The trainer rounds its own value onto the rollout's grid and, of the two codewords bracketing it,
# keeps the one the rollout's hint names: the one nearer the rollout's code on the signed code line
# (full; a tie keeps round-to-nearest), or the one whose low magnitude bit matches (lsb).


def bracket(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude codes (lo, hi) of the codewords bracketing |z|: value(lo) <= |z| <= value(hi).

    lo == hi exactly when |z| is itself a codeword.
    """
    mags = torch.tensor(E2M1_VALUES, dtype=_F32)
    a = z.abs().unsqueeze(-1)
    lo = (mags <= a).sum(dim=-1) - 1
    hi = 7 - (mags >= a).sum(dim=-1) + 1
    return lo, hi


def signed_index(codes: torch.Tensor) -> torch.Tensor:
    """Position of each 4-bit code on the signed line -7..7 (both zeros at 0)."""
    c = codes.long()
    return torch.where(c >= E2M1_SIGN_BIT, -(c - E2M1_SIGN_BIT), c)


def guided_choice(z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rtn: torch.Tensor,
                   rollout_signed: torch.Tensor | None, rollout_lsb: torch.Tensor | None) -> torch.Tensor:
    """The signed-line position chosen from the bracket ``(lo, hi)`` of ``|z|`` (magnitude codes) given
    round-to-nearest's position ``rtn`` and the rollout's position (full) or low magnitude bit (lsb).
    The same rule for every element format whose adjacent magnitude codes differ by one."""
    negative = torch.signbit(z)
    sign = torch.where(negative, -1, 1)
    # The bracket on the signed line: q_minus <= z <= q_plus.
    q_minus = torch.where(negative, -hi, lo)
    q_plus = torch.where(negative, -lo, hi)
    if rollout_signed is not None:
        d_minus = (q_minus - rollout_signed).abs()
        d_plus = (q_plus - rollout_signed).abs()
        return torch.where(d_minus < d_plus, q_minus, torch.where(d_plus < d_minus, q_plus, rtn))
    bit = rollout_lsb.long()
    return torch.where(lo == hi, lo * sign, torch.where((lo & 1) == bit, lo * sign, hi * sign))


def guided_round(z: torch.Tensor, rollout_codes: torch.Tensor | None, rollout_lsb: torch.Tensor | None):
    """Unpacked guided codes for float32 ``z`` (on the rollout's grid, clamped to [-6, 6]).

    Exactly one of ``rollout_codes`` (full information) or ``rollout_lsb`` (low magnitude bit) is given.
    """
    lo, hi = bracket(z)
    rtn = signed_index(round_to_e2m1(z))
    r = None if rollout_codes is None else signed_index(rollout_codes)
    chosen = guided_choice(z, lo, hi, rtn, r, rollout_lsb)
    return (chosen.abs() + torch.signbit(z).long() * E2M1_SIGN_BIT).to(torch.uint8)


# --- mod4: the code's position on the signed line mod 4 -------------------------------------------
# The trainer's bracket is two adjacent positions q-, q+ = q- + 1 of the signed line (or one, q- == q+,
# when z is a codeword: the bracket of :func:`bracket`). Of the four residues mod 4, two name q- and q+;
# the other two are positions 1 or 2 steps outside the bracket (q+ + 1 == q- - 3 and q+ + 2 == q- - 2,
# so the side is unknown): a detected miss, rounded to nearest. A miss of 3 or 4 steps has an in-bracket
# residue and is undetectable (decoded as that bracket member); at a codeword only 4, 8, ... steps are.


def mod4_residue(codes: torch.Tensor, element: str = "e2m1") -> torch.Tensor:
    """What a ``mod4`` record keeps per element: its code's position on the signed line mod 4 (0..3)."""
    position = signed_index(codes) if element == "e2m1" else signed_index_e4m3(codes)
    return (position % 4).to(torch.uint8)  # floor mod: -1 -> 3, so the residue is the line's, not |code|'s


def guided_choice_mod4(z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rtn: torch.Tensor,
                       residue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed-line position chosen, detected miss) from the bracket ``(lo, hi)`` of ``|z|`` (magnitude
    codes), round to nearest's position ``rtn`` and the rollout's position mod 4 ``residue``: the bracket
    member with that residue, else (the rollout's code is 1-2 steps outside) ``rtn``, and a miss."""
    negative = torch.signbit(z)
    q_minus = torch.where(negative, -hi, lo)
    q_plus = torch.where(negative, -lo, hi)
    r = residue.long()
    names_minus = (q_minus % 4) == r
    names_plus = (q_plus % 4) == r
    chosen = torch.where(names_minus, q_minus, torch.where(names_plus, q_plus, rtn))
    return chosen, ~(names_minus | names_plus)


def guided_round_mod4(z: torch.Tensor, residue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unpacked E2M1 codes, detected-miss mask) for float32 ``z`` (on the rollout's grid, clamped to
    [-6, 6]) guided by the rollout's ``mod4`` residues; the sign bit is z's, as in :func:`guided_round`."""
    lo, hi = bracket(z)
    rtn = signed_index(round_to_e2m1(z))
    chosen, miss = guided_choice_mod4(z, lo, hi, rtn, residue)
    return (chosen.abs() + torch.signbit(z).long() * E2M1_SIGN_BIT).to(torch.uint8), miss


def guided_round_mod4_e4m3(z: torch.Tensor, residue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`guided_round_mod4` on the E4M3 line (float32 ``z`` on the rollout's row scale, clamped)."""
    lo, hi = bracket_e4m3(z)
    rtn = signed_index_e4m3(round_to_e4m3(z))
    chosen, miss = guided_choice_mod4(z, lo, hi, rtn, residue)
    return (chosen.abs() + torch.signbit(z).long() * E4M3_SIGN_BIT).to(torch.uint8), miss


def bracket_distance(z: torch.Tensor, rollout_codes: torch.Tensor, element: str = "e2m1") -> torch.Tensor:
    """How many codewords the rollout's code lies outside the trainer's bracket of ``z`` on the signed
    line (0: one of its members). The quantity ``mod4`` detects for 1 and 2."""
    if element == "e2m1":
        (lo, hi), r = bracket(z), signed_index(rollout_codes)
    else:
        (lo, hi), r = bracket_e4m3(z), signed_index_e4m3(rollout_codes)
    negative = torch.signbit(z)
    q_minus = torch.where(negative, -hi, lo)
    q_plus = torch.where(negative, -lo, hi)
    return torch.clamp(q_minus - r, min=0) + torch.clamp(r - q_plus, min=0)


def nvfp4_z(x: torch.Tensor, s8: torch.Tensor, amax) -> torch.Tensor:
    """float32 ``clamp(x * enc, +-6)`` of ``x`` on the NVFP4 grid ``(s8, amax)`` (block scales
    ``[..., K/16]``, global amax): the value each E2M1 code of that grid rounds."""
    s_enc = nvfp4_global_encode_scale(torch.as_tensor(amax, dtype=_F32))
    enc = nvfp4_encode_factor(s8, s_enc)
    xb = x.to(_F32).reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    return torch.clamp(xb * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).reshape(x.shape)


def mxfp4_z(x: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    """float32 ``clamp(x / 2^e, +-6)`` of ``x`` on the MXFP4 grid of biased E8M0 exponents ``[..., K/32]``."""
    xb = x.to(_F32).reshape(*x.shape[:-1], -1, MXFP4_BLOCK)
    inv_scale = torch.tensor(1.0, dtype=_F32) / mx_scale(biased)
    return torch.clamp(xb * inv_scale.unsqueeze(-1), -E2M1_MAX, E2M1_MAX).reshape(x.shape)


def guided_quantize_nvfp4(x, s8, amax, rollout_codes=None, rollout_lsb=None) -> torch.Tensor:
    """Guided NVFP4 codes of ``x`` on the rollout's grid ``(s8, amax)``; unpacked uint8 [..., K]."""
    return guided_round(nvfp4_z(x, s8, amax), rollout_codes, rollout_lsb)


def guided_quantize_mxfp4(x, biased, rollout_codes=None, rollout_lsb=None) -> torch.Tensor:
    return guided_round(mxfp4_z(x, biased), rollout_codes, rollout_lsb)


# --- FP8 E4M3 with a per-row scale ---------------------------------------------------------------
# An E4M3 code is a sign bit (bit 7), 4 exponent bits (bias 7) and 3 mantissa bits; magnitude codes
# 0x00..0x7E are the finite values in increasing order (0x7F is NaN). Exponent 0 holds the subnormals
# m/8 * 2^-6; otherwise the value is (1 + m/8) * 2^(e - 7). Each row (last dim) has one float32 scale
# ``amax / 448`` (1 for an all-zero row), so the row's maximum maps to E4M3's largest value.


def e4m3_magnitudes() -> torch.Tensor:
    """float32 value of every finite magnitude code 0x00..0x7E, from the bit layout (ascending)."""
    out = []
    for code in range(E4M3_MAX_CODE + 1):
        e, m = code >> 3, code & 0x7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(out, dtype=_F32)


def round_to_e4m3(z: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 code of each float32 in ``z`` (already clamped to [-448, 448]): the nearest magnitude
    by exhaustive search, a tie to the even code (even mantissa), the sign bit from z's sign bit."""
    mags = e4m3_magnitudes()
    dist = (z.abs().unsqueeze(-1) - mags).abs()  # [..., 127]
    best = dist.min(dim=-1, keepdim=True).values
    codes = torch.arange(mags.numel())
    preference = torch.where(dist == best, (codes % 2) * 1024 + codes, torch.full_like(codes, 1 << 20))
    mag_code = preference.argmin(dim=-1)
    return (mag_code + torch.signbit(z).to(torch.int64) * E4M3_SIGN_BIT).to(torch.uint8)


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of uint8 E4M3 codes (no NaN codes)."""
    c = codes.long()
    mag = e4m3_magnitudes()[c & 0x7F]
    return torch.where(c >= E4M3_SIGN_BIT, -mag, mag)


def fp8_row_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 1]``: ``amax / 448`` of each row, 1 for an all-zero row."""
    amax = x.to(_F32).abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / torch.tensor(E4M3_MAX, dtype=_F32), torch.ones_like(amax))


def fp8_z(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, +-448)`` in float32: the value each code rounds."""
    return torch.clamp(x.to(_F32) / scale.to(_F32), -E4M3_MAX, E4M3_MAX)


def quantize_fp8(x: torch.Tensor):
    """Reference FP8: returns (uint8 codes [..., K], float32 scale [..., 1])."""
    scale = fp8_row_scale(x)
    return round_to_e4m3(fp8_z(x, scale)), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return e4m3_value(codes) * scale.to(_F32)


def bracket_e4m3(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude codes (lo, hi) of the E4M3 codewords bracketing |z| (lo == hi on a codeword)."""
    mags = e4m3_magnitudes()
    a = z.abs().unsqueeze(-1)
    lo = (mags <= a).sum(dim=-1) - 1
    hi = mags.numel() - (mags >= a).sum(dim=-1)
    return lo, hi


def signed_index_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """Position of each E4M3 code on the signed line -126..126 (both zeros at 0)."""
    c = codes.long()
    return torch.where(c >= E4M3_SIGN_BIT, -(c - E4M3_SIGN_BIT), c)


def guided_round_e4m3(z: torch.Tensor, rollout_codes: torch.Tensor | None, rollout_lsb: torch.Tensor | None):
    """uint8 guided E4M3 codes for float32 ``z`` (on the rollout's scale, clamped).

    lsb: the rule of :func:`guided_round` on the E4M3 line (adjacent magnitude codes differ in their
    lowest bit, so the bit names one member of any bracket). full: the rollout's code itself, a zero
    keeping z's sign bit. E4M3's spacing near zero is far finer than the BF16 noise of a cancelling
    sum, so there the rollout's code can lie outside the trainer's bracket, which on the E2M1 grid
    never happens at BF16-level drift; full information then has no reason to leave it wrong.
    """
    negative = torch.signbit(z)
    if rollout_codes is not None:
        mag = rollout_codes.long() & 0x7F
        sign = torch.where(mag == 0, negative, rollout_codes.long() >= E4M3_SIGN_BIT)
        return (mag + sign.long() * E4M3_SIGN_BIT).to(torch.uint8)
    lo, hi = bracket_e4m3(z)
    rtn = signed_index_e4m3(round_to_e4m3(z))
    chosen = guided_choice(z, lo, hi, rtn, None, rollout_lsb)
    return (chosen.abs() + negative.long() * E4M3_SIGN_BIT).to(torch.uint8)


def guided_quantize_fp8(x, scale, rollout_codes=None, rollout_lsb=None) -> torch.Tensor:
    """Guided E4M3 codes of ``x`` on the rollout's per-row ``scale``; uint8 [..., K]."""
    return guided_round_e4m3(fp8_z(x, scale), rollout_codes, rollout_lsb)


# --- Rounding midpoints and summation-order bounds --------------------------------------------------
# Two computations of one value that differ only in the order of their float32 additions pick the
# same code unless the exact value lies within the sum of their two error bounds of a rounding
# midpoint (on either side of it each may round its own way, ties included). These let a test say
# which differing codes that explains, against a float64 value it computes itself.


def rounding_midpoints(element: str) -> torch.Tensor:
    """float64 midpoints between consecutive finite magnitudes of ``element`` ("e2m1" or "e4m3"),
    ascending: the values of |z| where round to nearest changes code (ties go to the even code)."""
    if element == "e2m1":
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    elif element == "e4m3":
        mags = e4m3_magnitudes().double()
    else:
        raise ValueError(f"element must be 'e2m1' or 'e4m3', got {element!r}")
    return (mags[1:] + mags[:-1]) / 2  # exact: both formats' magnitudes have few significant bits


def boundary_distance(z: torch.Tensor, element: str) -> torch.Tensor:
    """float64 distance of ``|z|`` (float64, grid units, unclamped) to the nearest value where the code
    of ``element`` changes: a rounding midpoint, or 0 (a code's sign bit is z's, so +0 and -0 codes
    part there although both are zero)."""
    bounds = torch.cat([torch.zeros(1, dtype=torch.float64), rounding_midpoints(element)])
    a = z.double().abs()
    i = torch.bucketize(a, bounds).clamp(max=bounds.numel() - 1)
    return torch.minimum((a - bounds[i]).abs(), (a - bounds[(i - 1).clamp(min=0)]).abs())


def float32_sum_bound(abs_sum: torch.Tensor, n: int) -> torch.Tensor:
    """float64 bound on ``|fl32(t_1 + ... + t_n) - (t_1 + ... + t_n)|`` for float32 terms whose
    absolute values sum to ``abs_sum``, in ANY order of additions (every summation tree, blocked, SIMD
    lanes or FMA-free pairwise alike): Higham, Accuracy and Stability, eq. (4.4),
    ``gamma_{n-1} * sum |t_i|`` with ``gamma_k = k u / (1 - k u)``, u = 2^-24."""
    u, k = 2.0**-24, max(n - 1, 0)
    return abs_sum.double() * (k * u / (1 - k * u))
