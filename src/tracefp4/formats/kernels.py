"""Fused CPU kernels (numba) for the FP4 recipes, parallel over rows.

Each kernel is the fast twin of a function in :mod:`tracefp4.formats.reference` and is tested against it at
atol=0. All arithmetic is float32 in the reference's operation order: numba keeps float32 x float32
in float32, does not contract multiply-adds (fastmath is off), and every literal below is an
``np.float32`` so nothing is silently promoted to float64.

Layout: inputs are 2-D ``[rows, K]`` arrays of one of three element formats, told apart by dtype so
that numba compiles one specialisation per format and no per-element branch remains:

* ``float32``: float32 values;
* ``uint16``: bfloat16 bit patterns (a bf16 is the top half of a float32);
* ``int16``: float16 bit patterns.

Nothing is widened outside the kernels, so a 16-bit input is never copied into a float32 temporary.
4-bit codes are packed two per byte (element 2i in the low nibble); low-bit hints are packed eight per
byte (element 8j+i in bit i); per-block quantities are ``[rows, K/block]``; per-row quantities are
``[rows]`` (a per-tensor value is simply repeated). Rows are walked one *word* at a time: the pair of
adjacent elements (2i, 2i+1) that fills one output byte, read as a single uint32 (16-bit formats) or
uint64 (float32), little-endian, so element 2i is the low half. A block of 16 elements is 8 words.

Why it is fast: every per-element step is branch-free integer or float32 arithmetic on a word, laid
out in loops LLVM vectorises (see the comment above the kernels). Magnitudes are compared as integer
bit patterns: for non-negative IEEE values the patterns order like the values, and every NaN/Inf
pattern lies above the largest finite one, so one integer max gives a block amax and the finiteness
check together. Rounding to E2M1 and to E4M3 is done on the float32 bit pattern (the ``*_bits`` and
``_e4m3_round`` helpers); the plain comparison forms (``_rtn_mag``, ``_floor_mag``, ``_ceil_mag``)
state the rule and are the yardstick the bit forms are checked against, exhaustively, in the tests.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import types as types_module

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from tracefp4.formats.constants import (
    E2M1_EMAX,
    E2M1_MAG_MASK,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_VALUES,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_VALUES,
    FLOAT32_MAX,
    NVFP4_GLOBAL_NUMERATOR,
)

__all__ = [
    "E4M3_VALUES",
    "E8M0_VALUES",
    "GRAIN_BYTES",
    "numba_threads",
    "row_chunks",
    "nvfp4_block_amax",
    "nvfp4_quantize",
    "mxfp4_quantize",
    "dequantize",
    "guided_lsb",
    "guided_full",
    "pack_lsb",
    "count_masked",
    "copy_count_masked",
]

# Threading layer: workqueue, unless the user chose one (NUMBA_THREADING_LAYER). numba's OpenMP layer
# loads a second OpenMP runtime beside PyTorch's, whose idle threads spin after every launch: on a
# 2-core machine they starve PyTorch's own parallel ops, and a rollout that interleaves both slowed
# down 10x (48 decode steps of a 4-layer MoE, batch 64: 0.84 s under workqueue, 8.0 s under omp,
# 2.2 s under omp with OMP_WAIT_POLICY=passive), for a 5% faster quantize in isolation. Whatever the
# layer, every parallel kernel below is launched through :func:`_keeping_torch_threads` (an OpenMP
# layer may share PyTorch's runtime and reset its thread count) and sizes its work to torch's thread
# count (:func:`row_chunks`).
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

if sys.byteorder != "little":  # the word view and the packed layouts assume it
    raise ImportError("tracefp4.formats.kernels needs a little-endian machine")

F32 = np.float32
U8 = np.uint8
U32 = np.uint32
U64 = np.uint64
_SIX = F32(E2M1_MAX)
_ONE = F32(1.0)
_ONE_SIXTH = F32(1.0) / F32(E2M1_MAX)  # the float32 nearest 1/6, as C's constexpr 1.0f/6.0f
_E4M3_MAX = F32(E4M3_MAX)
_FLT_MAX = F32(FLOAT32_MAX)
_NVFP4_NUMERATOR = F32(NVFP4_GLOBAL_NUMERATOR)  # 2688: exact in float32
_SIGN_BIT = U32(E2M1_SIGN_BIT)
_MAG_MASK = U32(E2M1_MAG_MASK)
_F16_RESCALE = F32(2.0**112)  # float16 bits shifted into a float32's place are off by 2^(127-15)

_PAR = dict(nogil=True, cache=True, parallel=True)
_SER = dict(nogil=True, cache=True, error_model="numpy")  # as parallel=True: x/0 is inf, never an exception
_INL = dict(nogil=True, cache=True, inline="always")


def _keeping_torch_threads(call, *args):
    """``call(*args)``, leaving torch's thread count as it was: numba's OpenMP layer may share
    PyTorch's runtime and set its count when it starts its threads or launches a kernel."""
    threads = torch.get_num_threads()
    try:
        return call(*args)
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _serial_twin(fn):
    """A copy of ``fn`` under its own qualified name: numba's on-disk cache is keyed by the function's
    name and line, so the serial and the parallel compilation of one function need two names."""
    twin = types_module.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                     fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    return twin


def _parallel(fn):
    """``fn`` (whose last argument is its chunk count) compiled twice: as a parallel kernel launched
    through :func:`_keeping_torch_threads` (``.kernel``), and as a serial one (``.serial``: ``prange``
    runs as ``range``) for calls with one chunk. A parallel launch costs about 100 us here whatever
    the size, ten times a decode step's whole quantize of one site ([8, 2048] bf16); with one chunk
    both run the same loop over the same rows, so they give the same bits."""
    kernel = numba.njit(**_PAR)(fn)
    serial = numba.njit(**_SER)(_serial_twin(fn))

    @functools.wraps(fn)
    def launch(*args):
        if args[-1] == 1:
            return serial(*args)
        return _keeping_torch_threads(kernel, *args)

    launch.kernel = kernel
    launch.serial = serial
    return launch


# --- bit casts -----------------------------------------------------------------------------------
# numba has no scalar bit cast; these compile to a plain LLVM bitcast, which vectorises.


@intrinsic
def f32_from_bits(typingctx, bits):
    """float32 whose bit pattern is the low 32 bits of an integer.

    numba widens integer arithmetic to 64 bits, so patterns arrive as (u)int64 as often as uint32.
    """
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif bits.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """uint32 bit pattern of a float32."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


# --- element formats -----------------------------------------------------------------------------
# Each helper is resolved at compile time from the row's dtype (see the module docstring). ``abs``
# patterns are the element's bits without the sign, as a uint32.


def _words(row):
    """The row as words of two elements."""


def _abs_pair(word, row):
    """Abs patterns (uint32) of the word's two elements: (element 2i, element 2i+1)."""


def _sign_nibbles(word, row):
    """The two elements' sign bits placed as the code sign bits of an output byte (bits 3 and 7)."""


def _magnitude(abs_bits, row):
    """float32 value of an abs pattern (exact widening)."""


def _finite_limit(row):
    """The largest finite abs pattern: anything above it is NaN or Inf."""


@overload(_words, inline="always")
def _words_ov(row):
    if row.dtype == types.float32:
        return lambda row: row.view(np.uint64)
    return lambda row: row.view(np.uint32)


@overload(_abs_pair, inline="always")
def _abs_pair_ov(word, row):
    if row.dtype == types.float32:
        return lambda word, row: (U32(word & U64(0x7FFFFFFF)), U32(word >> U64(32)) & U32(0x7FFFFFFF))
    return lambda word, row: (word & U32(0x7FFF), (word >> U32(16)) & U32(0x7FFF))


@overload(_sign_nibbles, inline="always")
def _sign_nibbles_ov(word, row):
    if row.dtype == types.float32:
        return lambda word, row: U32(U32(word >> U64(28)) & U32(0x8)) | U32(U32(word >> U64(56)) & U32(0x80))
    return lambda word, row: U32(U32(word >> U32(12)) & U32(0x8)) | U32(U32(word >> U32(24)) & U32(0x80))


@overload(_magnitude, inline="always")
def _magnitude_ov(abs_bits, row):
    if row.dtype == types.float32:
        return lambda abs_bits, row: f32_from_bits(abs_bits)
    if row.dtype == types.uint16:  # bfloat16
        return lambda abs_bits, row: f32_from_bits(abs_bits << U32(16))
    if row.dtype == types.int16:  # float16: exact, subnormals included (they become float32 normals)
        return lambda abs_bits, row: f32_from_bits(abs_bits << U32(13)) * _F16_RESCALE
    raise TypeError(f"unsupported row dtype {row.dtype}")


@overload(_finite_limit, inline="always")
def _finite_limit_ov(row):
    if row.dtype == types.float32:
        return lambda row: U32(0x7F7FFFFF)
    if row.dtype == types.uint16:
        return lambda row: U32(0x7F7F)
    if row.dtype == types.int16:
        return lambda row: U32(0x7BFF)
    raise TypeError(f"unsupported row dtype {row.dtype}")


# --- scalar helpers ------------------------------------------------------------------------------


@numba.njit(**_INL)
def _rtn_mag(m):
    """Magnitude code of m >= 0, nearest with ties to the even code (0.25, 1.25, 2.5, 5 go down).

    The rule as comparisons with the midpoints; the kernels run _rtn_mag_bits, checked against this.
    """
    return (
        U32(m > F32(0.25))
        + U32(m >= F32(0.75))
        + U32(m > F32(1.25))
        + U32(m >= F32(1.75))
        + U32(m > F32(2.5))
        + U32(m >= F32(3.5))
        + U32(m > F32(5.0))
    )


@numba.njit(**_INL)
def _floor_mag(m):
    """Largest magnitude code whose value is <= m (m in [0, 6])."""
    return (
        U32(m >= F32(0.5))
        + U32(m >= F32(1.0))
        + U32(m >= F32(1.5))
        + U32(m >= F32(2.0))
        + U32(m >= F32(3.0))
        + U32(m >= F32(4.0))
        + U32(m >= F32(6.0))
    )


@numba.njit(**_INL)
def _ceil_mag(m):
    """Smallest magnitude code whose value is >= m (m in [0, 6]); equals _floor_mag(m) on a codeword."""
    return (
        U32(m > F32(0.0))
        + U32(m > F32(0.5))
        + U32(m > F32(1.0))
        + U32(m > F32(1.5))
        + U32(m > F32(2.0))
        + U32(m > F32(3.0))
        + U32(m > F32(4.0))
    )


_HALF_STEP_MAGIC = F32(2.0**22)  # floats in [2^22, 2^23) are 0.5 apart: E2M1's step below 1
_HALF_STEP_MAGIC_BITS = U32(0x4A800000)  # bits of 2^22


@numba.njit(**_INL)
def _rtn_mag_bits(m):
    """_rtn_mag by rounding the float32 in place (equal to it for every float32 m >= 0, inf included).

    E2M1 is a float with one mantissa bit: from 1 up, round the mantissa to its top bit (add 0x1fffff
    plus the kept bit, so a tie goes to even) and read exponent and that bit as the code; below 1 the
    magic addition puts m on the 0.5 grid with the FPU's own ties-to-even.
    """
    m = min(m, _SIX)
    bits = bits_from_f32(m)
    rounded = U32(U32(bits + U32(0x1FFFFF)) + U32(U32(bits >> U32(22)) & U32(1)))
    normal = U32(U32(rounded >> U32(22)) - U32(252))
    sub = U32(bits_from_f32(m + _HALF_STEP_MAGIC) - _HALF_STEP_MAGIC_BITS)
    return normal if m >= F32(1.0) else sub


@numba.njit(**_INL)
def _floor_mag_bits(m):
    """(_floor_mag(m), 1 if m is not a codeword else 0) for m in [0, 6], without 14 comparisons.

    From 1 up the code is the exponent plus the top mantissa bit, and m is a codeword when no lower
    mantissa bit is set; below 1 only 0 and 0.5 are codewords. Equal to the comparisons on every float32.
    """
    bits = bits_from_f32(m)
    big = m >= F32(1.0)
    lo = U32(U32(bits >> U32(22)) - U32(252)) if big else U32(m >= F32(0.5))
    inexact = U32(U32(bits & U32(0x3FFFFF)) != U32(0)) if big else U32((m != F32(0.0)) & (m != F32(0.5)))
    return lo, inexact


_E4M3_MIN_NORMAL = F32(E4M3_MIN_NORMAL)
#: Adding 2^14 to a float32 below 2^-6 rounds it (to nearest, ties to even) onto the 2^-9 grid of
#: E4M3 subnormals: floats in [2^14, 2^15) are spaced exactly 2^-9 apart.
_E4M3_SUBNORMAL_MAGIC = F32(2.0**14)
_E4M3_SUBNORMAL_MAGIC_BITS = U32(0x46800000)  # bits of 2^14


@numba.njit(**_INL)
def _e4m3_round(v):
    """(bit pattern, float32 value) of float32 v in [0, 448] rounded to E4M3, nearest even, subnormals in.

    Normal range: round the float32 mantissa to 3 bits in place (add 0x7ffff plus the kept LSB, so an
    exact half rounds to even; a carry runs into the exponent as it should); the masked result is the
    rounded value itself, and rebiasing its exponent from 127 to 7 gives the pattern. Below 2^-6: the
    magic addition above, whose result counts 2^-9 steps (8 steps is 2^-6, also the pattern of the
    smallest normal), and subtracting the magic again is exact. Equal to torch's cast (pattern and value)
    on every float32 in [0, 448]; tests/test_triton.py keeps a dense sample of that sweep.
    """
    bits = bits_from_f32(v)
    rounded = (bits + U32(0x7FFFF) + ((bits >> U32(20)) & U32(1))) & U32(0xFFF00000)
    shifted = v + _E4M3_SUBNORMAL_MAGIC
    if v >= _E4M3_MIN_NORMAL:
        return (rounded >> U32(20)) - U32(120 << 3), f32_from_bits(rounded)
    return bits_from_f32(shifted) - _E4M3_SUBNORMAL_MAGIC_BITS, shifted - _E4M3_SUBNORMAL_MAGIC


@numba.njit(**_INL)
def _nvfp4_s_enc(amax):
    """``S_enc = 448*6/amax`` in float32, capped at FLT_MAX; amax 0 gives 1 (as numerics'/reference's)."""
    if amax == F32(0.0):
        return _ONE
    s = min(_NVFP4_NUMERATOR / amax, _FLT_MAX)
    return _ONE if s == F32(0.0) else s


@numba.njit(**_INL)
def _encode_factor(scale_value, s_dec):
    """``min(1 / (scale * (1/S_enc)), FLT_MAX)``: the multiplier onto a block's grid."""
    return min(_ONE / (scale_value * s_dec), _FLT_MAX)


@numba.njit(**_INL)
def _guided_lsb(m, bit):
    """Member of the bracket [floor(m), ceil(m)] whose low magnitude bit is ``bit``.

    On a codeword both ends are the same code, so the choice cannot move it.
    """
    lo, inexact = _floor_mag_bits(min(m, _SIX))
    return U32(lo + U32(inexact & U32(lo ^ bit)))


@numba.njit(**_INL)
def _guided_full(m, rollout_code, same_sign):
    """Bracket member nearer the rollout code on the signed line.

    With x's sign s and the rollout's signed index r, the candidates s*lo and s*hi = s*(lo+1) sit one
    apart, so (integers) hi is nearer exactly when s*r > lo: the rollout is on x's side of zero with a
    magnitude above lo. Adjacent candidates are never equally near, so the reference's tie rule (keep
    round-to-nearest) has nothing to decide.
    """
    lo, inexact = _floor_mag_bits(min(m, _SIX))
    return U32(lo + U32(inexact & U32(U32(rollout_code & _MAG_MASK) > lo) & same_sign))


# --- kernels -------------------------------------------------------------------------------------
# Each kernel hands every thread one contiguous range of rows and walks a row in three flat passes:
# block amaxes, block scales (one lane per block), then codes. The code pass goes 16 words (two
# NVFP4 blocks, one MXFP4 block) per step with a fixed 16-trip inner loop and the step's two encode
# factors picked by lane: LLVM vectorises that loop, while it leaves a loop over one 8-word block
# scalar (too short to pay for the runtime alias check its stores need). Intermediate values pass
# through U32(...) where numba would widen them to 64 bits, so the vectors keep 16 lanes.
#
# ``bad[r]`` is set where row r holds a NaN or Inf, so the caller can refuse it without another
# pass; abs patterns are clamped to the finite limit before they become scales, so a bad row still
# computes in range (its codes are garbage and never returned).


#: Bytes a thread should have to itself before a parallel launch pays: below that the launch, and on
#: a busy machine the wait for a worker thread the OS has parked (a whole scheduler time slice), cost
#: more than the work.
GRAIN_BYTES = 4 << 20


def numba_threads() -> int:
    """numba's thread count, its threads started if they were not (torch's count left alone)."""
    return _keeping_torch_threads(numba.get_num_threads)


def row_chunks(rows: int, nbytes: int, grain: int = GRAIN_BYTES) -> int:
    """How many contiguous row ranges a kernel splits ``rows`` rows (``nbytes`` bytes) into.

    At most one per thread the caller allows (torch's intra-op thread count, which is what a user
    sets, capped by numba's pool), one per row, and one per ``grain`` bytes, and at least one. The
    kernels prange over these chunks, so fewer chunks means fewer busy threads: the work is sized to
    the data and to the caller's thread count without touching numba's process-wide count. Passed in
    rather than asked for inside a kernel: ``numba.get_num_threads()`` there would keep the kernel out
    of numba's cache.
    """
    if rows < 2 or nbytes < 2 * grain:  # one chunk whatever the threads (a decode step's sites): no thread query
        return 1
    return max(1, min(numba_threads(), torch.get_num_threads(), rows, nbytes // grain))


@numba.njit(**_INL)
def _chunk_rows(t, nchunks, rows):
    return t * rows // nchunks, (t + 1) * rows // nchunks


@numba.njit(**_INL)
def _word_abs_max(word, row):
    a0, a1 = _abs_pair(word, row)
    return max(U32(a0), U32(a1))


@numba.njit(**_INL)
def _row_abs_max(w, row):
    """The row's largest abs pattern: a flat reduction (one horizontal step at the end)."""
    m = U32(0)
    for j in range(w.shape[0]):
        m = max(m, _word_abs_max(w[j], row))
    return m


@numba.njit(**_INL)
def _block_abs_max(w, row, words_per_block, out):
    """Abs-pattern max of each block into ``out`` [nblocks]; returns the row's max."""
    top = U32(0)
    for b in range(out.shape[0]):
        m = U32(0)
        for i in range(words_per_block):
            m = max(m, _word_abs_max(w[b * words_per_block + i], row))
        out[b] = m
        top = max(top, m)
    return top


@numba.njit(**_INL)
def _rtn_byte(word, enc, row):
    a0, a1 = _abs_pair(word, row)
    c0 = _rtn_mag_bits(_magnitude(a0, row) * enc)  # |x * enc| == |x| * enc exactly
    c1 = _rtn_mag_bits(_magnitude(a1, row) * enc)
    return U8(c0 | (c1 << U32(4)) | _sign_nibbles(word, row))


@numba.njit(**_INL)
def _rtn_row(w, row, enc_b, words_per_block, cr):
    """Codes of one row from its per-block encode factors (see the section comment)."""
    nwords = w.shape[0]
    for u in range(nwords // 16):
        e0 = enc_b[(16 * u) // words_per_block]
        e1 = enc_b[(16 * u + 8) // words_per_block]
        for i in range(16):
            j = 16 * u + i
            cr[j] = _rtn_byte(w[j], e0 if i < 8 else e1, row)
    for j in range(nwords - nwords % 16, nwords):  # K % 32 == 16 (NVFP4): one block left over
        cr[j] = _rtn_byte(w[j], enc_b[enc_b.shape[0] - 1], row)


@_parallel
def nvfp4_block_amax(x, block_max, amax, bad, nchunks):
    """First pass of a per-tensor NVFP4 quantize: block amax patterns u32 [R, K/16], row amax, flags.

    The second pass (nvfp4_quantize with these block amaxes) then reads each element once more for
    its code instead of recomputing the amaxes: the global amax must be known before any scale.
    """
    rows = x.shape[0]
    for t in numba.prange(nchunks):
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            row = x[r]
            top = _block_abs_max(_words(row), row, 8, block_max[r])
            limit = _finite_limit(row)
            amax[r] = _magnitude(min(top, limit), row)
            bad[r] = top > limit


@numba.njit(**_INL)
def _bf16_bits(v):
    """bf16 bits of a finite float32, rounded to nearest even (torch's cast)."""
    b = U32(bits_from_f32(v))
    return U32((b + U32(0x7FFF) + ((b >> U32(16)) & U32(1))) >> U32(16))


@numba.njit(**_INL)
def _values_row(cr, mult, div, words_per_block, out):
    """bf16 bits of ``(value(code) * mult[block]) / div`` (``dequantize``'s float32, then its bf16
    cast) for one row of code bytes, both elements of byte j in ``out[j]`` (u32, element 2j low)."""
    nwords = cr.shape[0]
    for u in range(nwords // 16):  # 16 bytes at a time, two blocks' multipliers (vectorises, as dequantize)
        m0 = mult[(16 * u) // words_per_block]
        m1 = mult[(16 * u + 8) // words_per_block]
        for i in range(16):
            j = 16 * u + i
            out[j] = _values_pair(cr[j], m0 if i < 8 else m1, div)
    for j in range(nwords - nwords % 16, nwords):  # K % 32 == 16: one block left over
        out[j] = _values_pair(cr[j], mult[mult.shape[0] - 1], div)


@numba.njit(**_INL)
def _values_pair(byte, m, div):
    v0, v1 = _pair_values(byte, m, div)
    return U32(_bf16_bits(v0) | (_bf16_bits(v1) << U32(16)))


@_parallel
def nvfp4_quantize(x, amax, own_amax, block_max, codes, scales, values, bad, nchunks):
    """Rows -> codes u8 [R, K/2], scales u8 (E4M3 bit patterns) [R, K/16].

    ``amax`` f32 [R] is each row's global amax; with ``own_amax`` the kernel finds it (from the block
    amaxes it needs anyway) and writes it there. ``block_max`` is nvfp4_block_amax's output, or an
    empty [0, 0] array to have the block amaxes (and ``bad``) computed here. ``values`` u32 [R, K/2],
    or an empty [0, 0] array: the dequantized row in bf16 (see :func:`_values_row`), two per word,
    written in the same pass (what a rollout's next op sees).
    """
    rows, nwords = codes.shape
    given = block_max.shape[0] > 0
    want_values = values.shape[0] > 0
    for t in numba.prange(nchunks):
        scratch = np.empty(nwords // 8, dtype=np.uint32)
        enc_b = np.empty(nwords // 8, dtype=np.float32)
        mult = np.empty(nwords // 8, dtype=np.float32)
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            row = x[r]
            w = _words(row)
            sr = scales[r]
            limit = _finite_limit(row)
            bm = block_max[r] if given else scratch
            if not given:
                top = _block_abs_max(w, row, 8, bm)
                bad[r] = top > limit
                if own_amax:
                    amax[r] = _magnitude(min(top, limit), row)
            s_enc = _nvfp4_s_enc(amax[r])
            scale_factor = s_enc * _ONE_SIXTH
            s_dec = _ONE / s_enc
            for b in range(bm.shape[0]):
                d = min(_magnitude(min(bm[b], limit), row) * scale_factor, _E4M3_MAX)  # clamp, then cast
                s8, s8_value = _e4m3_round(d)
                sr[b] = U8(s8)
                enc_b[b] = _encode_factor(s8_value, s_dec)
                mult[b] = s8_value
            _rtn_row(w, row, enc_b, 8, codes[r])
            if want_values:
                _values_row(codes[r], mult, s_enc, 8, values[r])


@numba.njit(**_INL)
def _mx_exponent(amax, rceil):
    """Unbiased E8M0 exponent of a block (see ScaleMode), clamped to [-127, 127]."""
    if amax == 0:
        return E8M0_MIN_EXP
    if rceil:
        t = amax / _SIX
        if t == 0:
            return E8M0_MIN_EXP
        mant, ex = math.frexp(t)
        e = ex - 1 if mant == 0.5 else ex
    else:
        mant, ex = math.frexp(amax)
        e = ex - 1 - E2M1_EMAX
    return min(max(e, E8M0_MIN_EXP), E8M0_MAX_EXP)


@_parallel
def mxfp4_quantize(x, rceil, codes, scales, bad, nchunks):
    """Rows -> codes u8 [R, K/2], biased E8M0 exponents u8 [R, K/32]."""
    rows, nwords = codes.shape
    for t in numba.prange(nchunks):
        block_max = np.empty(nwords // 16, dtype=np.uint32)
        enc_b = np.empty(nwords // 16, dtype=np.float32)
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            row = x[r]
            w = _words(row)
            sr = scales[r]
            limit = _finite_limit(row)
            bad[r] = _block_abs_max(w, row, 16, block_max) > limit
            for b in range(block_max.shape[0]):
                e = _mx_exponent(_magnitude(min(block_max[b], limit), row), rceil)
                sr[b] = U8(e + E8M0_BIAS)
                enc_b[b] = F32(math.ldexp(1.0, -e))  # a power of two: exact in float32 for |e| <= 127
            _rtn_row(w, row, enc_b, 16, codes[r])


@numba.njit(**_INL)
def _e2m1_value(code):
    """float32 value of a 4-bit code: from magnitude code 2 up, exponent (c >> 1) - 1 and mantissa bit
    c & 1; codes 0 and 1 are 0 and 0.5; bit 3 is the float's sign bit (code 8 is -0.0)."""
    mag = U32(code & _MAG_MASK)
    normal = U32(U32(U32(126) + U32(mag >> U32(1))) << U32(23)) | U32(U32(mag & U32(1)) << U32(22))
    bits = normal if mag >= U32(2) else U32(mag * U32(0x3F000000))  # 0x3f000000 is 0.5
    return f32_from_bits(bits | U32(U32(code & _SIGN_BIT) << U32(28)))  # to bit 31


@numba.njit(**_INL)
def _pair_values(byte, mult, div):
    """float32 ``(value(code) * mult) / div`` of both elements of a code byte (low nibble first): the
    one expression every dequantized output is computed by."""
    return (_e2m1_value(U32(byte) & U32(15)) * mult) / div, (_e2m1_value(U32(byte) >> U32(4)) * mult) / div


@numba.njit(**_INL)
def _dequant_pair(byte, mult, div):
    """Both elements of a code byte as one uint64 (element 2i in the low half, as in memory)."""
    v0, v1 = _pair_values(byte, mult, div)
    return U64(bits_from_f32(v0)) | (U64(bits_from_f32(v1)) << U64(32))


@_parallel
def dequantize(codes, scales, scale_values, row_div, block, out, nchunks):
    """``(value(code) * scale) / row_div[row]`` in float32 into ``out`` f32 [R, K].

    ``scales`` u8 [R, K/block] are stored scale bytes, ``scale_values`` their float32 values.
    """
    rows, nwords = codes.shape
    words_per_block = block // 2
    for t in numba.prange(nchunks):
        mult = np.empty(nwords // words_per_block, dtype=np.float32)
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            cr = codes[r]
            sr = scales[r]
            o = out[r].view(np.uint64)
            div = row_div[r]
            for b in range(mult.shape[0]):
                mult[b] = scale_values[sr[b]]
            for u in range(nwords // 16):
                m0 = mult[(16 * u) // words_per_block]
                m1 = mult[(16 * u + 8) // words_per_block]
                for i in range(16):
                    j = 16 * u + i
                    o[j] = _dequant_pair(cr[j], m0 if i < 8 else m1, div)
            for j in range(nwords - nwords % 16, nwords):  # K % 32 == 16 (NVFP4): one block left over
                o[j] = _dequant_pair(cr[j], mult[mult.shape[0] - 1], div)


# Guided rounding: ``scale_values`` maps a stored scale byte to its float32 value (E4M3_VALUES or
# E8M0_VALUES) and ``s_dec`` f32 [R] is 1/S_enc per row (1 for MXFP4), so the encode factor is the
# reference's ``1 / (scale * s_dec)`` (for MXFP4, ``1 / 2^e``: the same float32). The code pass has
# the shape of _rtn_row; each word also reads its two elements' hints.


@numba.njit(**_INL)
def _rollout_enc(sr, scale_values, s_dec, enc_b):
    for b in range(sr.shape[0]):
        enc_b[b] = _encode_factor(scale_values[sr[b]], s_dec)


@numba.njit(**_INL)
def _guided_lsb_byte(word, enc, hint, row):
    """Output byte of one word; bits 0 and 1 of ``hint`` are its two elements' low-bit hints."""
    a0, a1 = _abs_pair(word, row)
    c0 = _guided_lsb(_magnitude(a0, row) * enc, hint)
    c1 = _guided_lsb(_magnitude(a1, row) * enc, hint >> U32(1))
    return U8(c0 | (c1 << U32(4)) | _sign_nibbles(word, row))


@_parallel
def guided_lsb(x, scales, scale_values, s_dec, bits, block, codes, bad, nchunks):
    """Guided codes u8 [R, K/2] from low-bit hints ``bits`` u8 [R, K/8] (element 8j+i in bit i)."""
    rows, nwords = codes.shape
    words_per_block = block // 2
    for t in numba.prange(nchunks):
        enc_b = np.empty(nwords // words_per_block, dtype=np.float32)
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            row = x[r]
            w = _words(row)
            cr = codes[r]
            hint16 = bits[r].view(np.uint16)  # word 8v+i's two hints are bits 2i, 2i+1 of hint16[v]
            _rollout_enc(scales[r], scale_values, s_dec[r], enc_b)
            for u in range(nwords // 16):
                e0 = enc_b[(16 * u) // words_per_block]
                e1 = enc_b[(16 * u + 8) // words_per_block]
                hint = U32(hint16[2 * u]) | U32(U32(hint16[2 * u + 1]) << U32(16))
                for i in range(16):
                    j = 16 * u + i
                    cr[j] = _guided_lsb_byte(w[j], e0 if i < 8 else e1, U32(hint >> U32(2 * i)), row)
            if nwords % 16:  # K % 32 == 16 (NVFP4): one block left over
                hint = U32(hint16[hint16.shape[0] - 1])
                for i in range(8):
                    j = nwords - 8 + i
                    cr[j] = _guided_lsb_byte(w[j], enc_b[enc_b.shape[0] - 1], U32(hint >> U32(2 * i)), row)
            bad[r] = _row_abs_max(w, row) > _finite_limit(row)


@numba.njit(**_INL)
def _guided_full_byte(word, enc, rollout_byte, row):
    """Output byte of one word; ``rollout_byte`` holds the rollout's codes of its two elements."""
    a0, a1 = _abs_pair(word, row)
    signs = _sign_nibbles(word, row)
    rc = U32(rollout_byte)
    same = ~(rc ^ signs)  # bit 3: element 2j's signs agree; bit 7: element 2j+1's
    c0 = _guided_full(_magnitude(a0, row) * enc, rc, U32(same >> U32(3)) & U32(1))
    c1 = _guided_full(_magnitude(a1, row) * enc, U32(rc >> U32(4)), U32(same >> U32(7)) & U32(1))
    return U8(c0 | (c1 << U32(4)) | signs)


@_parallel
def guided_full(x, scales, scale_values, s_dec, rollout, block, codes, bad, nchunks):
    """Guided codes u8 [R, K/2] from the rollout's packed codes ``rollout`` u8 [R, K/2]."""
    rows, nwords = codes.shape
    words_per_block = block // 2
    for t in numba.prange(nchunks):
        enc_b = np.empty(nwords // words_per_block, dtype=np.float32)
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            row = x[r]
            w = _words(row)
            cr = codes[r]
            hr = rollout[r]
            _rollout_enc(scales[r], scale_values, s_dec[r], enc_b)
            for u in range(nwords // 16):
                e0 = enc_b[(16 * u) // words_per_block]
                e1 = enc_b[(16 * u + 8) // words_per_block]
                for i in range(16):
                    j = 16 * u + i
                    cr[j] = _guided_full_byte(w[j], e0 if i < 8 else e1, hr[j], row)
            for j in range(nwords - nwords % 16, nwords):  # K % 32 == 16 (NVFP4): one block left over
                cr[j] = _guided_full_byte(w[j], enc_b[enc_b.shape[0] - 1], hr[j], row)
            bad[r] = _row_abs_max(w, row) > _finite_limit(row)


@_parallel
def pack_lsb(codes, bits, nchunks):
    """Low magnitude bit of packed codes u8 [R, K/2] -> bit-packed u8 [R, K/8]."""
    rows, nbytes = bits.shape
    for t in numba.prange(nchunks):
        start, stop = _chunk_rows(t, nchunks, rows)
        for r in range(start, stop):
            for j in range(nbytes):
                acc = np.uint8(0)
                for q in range(4):
                    byte = codes[r, 4 * j + q]
                    acc |= (byte & np.uint8(1)) << np.uint8(2 * q)
                    acc |= ((byte >> np.uint8(4)) & np.uint8(1)) << np.uint8(2 * q + 1)
                bits[r, j] = acc


@numba.njit(nogil=True, cache=True)
def count_masked(raw, mask, value):
    """How many bytes b of ``raw`` (u8, 1-D) have ``b & mask == value``: a branch-free count LLVM
    vectorises, so validating a tensor's scale bytes costs a fraction of reading them once."""
    n = 0
    for i in range(raw.shape[0]):
        n += np.int64((raw[i] & mask) == value)
    return n


@numba.njit(nogil=True, cache=True)
def copy_count_masked(raw, out, mask, value):
    """:func:`count_masked` of ``raw`` while copying it into ``out`` (u8, 1-D, as long): a grid's scale
    bytes validated and cloned in one pass over them instead of two (one of them from memory)."""
    n = 0
    for i in range(raw.shape[0]):
        b = raw[i]
        out[i] = b
        n += np.int64((b & mask) == value)
    return n
