/* The CPU quantizers besides the sites' per-row NVFP4 (site_quant.h): the amax pass of a per-tensor
 * quantize, dequantization of NVFP4/MXFP4 rows to float32, guided rounding from a rollout's hint, and
 * the packing of codes' low bits into a hint.
 *
 * Each is the numba kernel of the same name (tracefp4/formats/kernels.py: dequantize, guided_lsb,
 * guided_full, pack_lsb, nvfp4_block_amax) operation for operation in IEEE float32, with no
 * contraction (no a * b + c is ever written), so the bits are the numba kernel's and the readable
 * reference's:
 *
 *   dequantize: out = (e2m1(code) * lut[scale byte]) / row_div[row]
 *   guided:     enc = min(1 / (lut[scale byte] * s_dec[row]), FLT_MAX); m = min(|x| * enc, 6);
 *               lo = the largest code whose value is <= m, inexact = m is no code value;
 *               lsb:  code = lo + (inexact & ((lo ^ bit) & 1))       (the bracket member with the hint's low bit)
 *               full: code = lo + (inexact & (rc_mag > lo) & same_sign) (the member nearer the rollout code)
 *               with x's sign bit as the code's.
 *
 * Blocks are 16 (NVFP4) or 32 (MXFP4) elements, so every kernel walks a row in groups of 16 elements
 * (8 code bytes), each group inside one block. Rows are independent: a row's bits do not depend on
 * how the rows are split over threads. */
#ifndef TFP4_CPU_QUANT_H
#define TFP4_CPU_QUANT_H
#include "site_quant.h"

/* --- the per-tensor amax pass: the largest abs pattern of n bf16 (f32 = 0) or float32 elements --- */

static uint32_t cq_abs_max_portable(const void *x, int64_t n, int f32) {
    uint32_t m = 0;
    if (f32) {
        const uint32_t *p = x;
        for (int64_t i = 0; i < n; i++) m = (p[i] & 0x7FFFFFFFu) > m ? (p[i] & 0x7FFFFFFFu) : m;
    } else {
        const uint16_t *p = x;
        for (int64_t i = 0; i < n; i++) m = (p[i] & 0x7FFFu) > m ? (p[i] & 0x7FFFu) : m;
    }
    return m;
}

#if defined(__x86_64__)
/* Four independent accumulators hide the max's latency; the tail is a masked load. */
AVX512 static uint32_t cq_abs_max_avx(const void *x, int64_t n, int f32) {
    const int64_t lanes = f32 ? 16 : 32; /* elements per 512-bit vector */
    const __m512i mask = f32 ? _mm512_set1_epi32(0x7FFFFFFF) : _mm512_set1_epi16(0x7FFF);
    const char *p = x;
    const int64_t bytes = n * (f32 ? 4 : 2);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
        __m512i v0 = _mm512_and_si512(_mm512_loadu_si512(p + i), mask);
        __m512i v1 = _mm512_and_si512(_mm512_loadu_si512(p + i + 64), mask);
        __m512i v2 = _mm512_and_si512(_mm512_loadu_si512(p + i + 128), mask);
        __m512i v3 = _mm512_and_si512(_mm512_loadu_si512(p + i + 192), mask);
        if (f32) {
            a0 = _mm512_max_epu32(a0, v0), a1 = _mm512_max_epu32(a1, v1);
            a2 = _mm512_max_epu32(a2, v2), a3 = _mm512_max_epu32(a3, v3);
        } else {
            a0 = _mm512_max_epu16(a0, v0), a1 = _mm512_max_epu16(a1, v1);
            a2 = _mm512_max_epu16(a2, v2), a3 = _mm512_max_epu16(a3, v3);
        }
    }
    for (; i < bytes; i += 64) {
        const int64_t left = (bytes - i) / (f32 ? 4 : 2);
        const __mmask64 m = left >= lanes ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i v = f32 ? _mm512_maskz_loadu_epi32((__mmask16)m, p + i) : _mm512_maskz_loadu_epi16((__mmask32)m, p + i);
        v = _mm512_and_si512(v, mask);
        a0 = f32 ? _mm512_max_epu32(a0, v) : _mm512_max_epu16(a0, v);
    }
    if (f32) return (uint32_t)_mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(a0, a1), _mm512_max_epu32(a2, a3)));
    __m512i a = _mm512_max_epu16(_mm512_max_epu16(a0, a1), _mm512_max_epu16(a2, a3));
    /* the 32 words as two halves of 16 dwords */
    __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(a)), hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a, 1));
    return (uint32_t)_mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
}
#endif

/* --- dequantize: code rows [R, K/2] and scale bytes [R, K/block] -> float32 or bf16 [R, K] --- */

/* out: float32 [k], or (bf16) the float32 values rounded to bf16 [k] as torch's cast rounds them
 * (to nearest even; the values are finite: a container with a NaN scale is refused before). */
static void cq_dequant_row_portable(const uint8_t *codes, const uint8_t *scales, const float *lut, float div, int64_t k,
                                    int block, void *out, int bf16) {
    for (int64_t g = 0; g < k / 16; g++) {
        const float mult = lut[scales[16 * g / block]];
        for (int64_t e = 16 * g; e < 16 * g + 16; e++) {
            const uint8_t byte = codes[e / 2];
            const float v = (E2M1[e % 2 ? byte >> 4 : byte & 15] * mult) / div;
            if (bf16) ((uint16_t *)out)[e] = bf16_rne(v);
            else ((float *)out)[e] = v;
        }
    }
}

#if defined(__x86_64__)
/* 8 code bytes -> 16 dword lanes holding their nibbles in element order (lane 2i: byte i's low). */
AVXINL __m512i cq_nibbles16(const uint8_t *codes) {
    __m512i v = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)codes));
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi64(15)), _mm512_slli_epi64(_mm512_srli_epi64(v, 4), 32));
}

AVX512 static void cq_dequant_row_avx(const uint8_t *codes, const uint8_t *scales, const float *lut, float div, int64_t k,
                                      int block, float *out) {
    const __m512 table = _mm512_loadu_ps(E2M1), d = _mm512_set1_ps(div);
    for (int64_t g = 0; g < k / 16; g++) {
        __m512 v = _mm512_permutexvar_ps(cq_nibbles16(codes + 8 * g), table);
        v = _mm512_mul_ps(v, _mm512_set1_ps(lut[scales[16 * g / block]]));
        _mm512_storeu_ps(out + 16 * g, _mm512_div_ps(v, d));
    }
}

/* bf16 output by table: a value depends on its code, its scale byte and its row's divisor alone, so
 * the 16 values of a scale byte, T[s][c] = bf16((e2m1(c) * lut[s]) / div) (the definition, lane for
 * lane, rounded as torch's scalar cast rounds, NaN to 0x7FC0), are computed the first time a row of
 * that divisor meets the byte and then looked up: one vpermw per 32 codes instead of a division per 16. A per-tensor NVFP4
 * container (one S_enc for every row) and an MXFP4 one (divisor 1) build at most 256 tables a thread;
 * a per-row one rebuilds as its divisor changes, at most one division a block. Per-thread, 8 KiB. */
typedef struct {
    uint32_t div_bits; /* the divisor the tables hold, by its bits (0.0 and -0.0 differ: so may quotients) */
    int valid;
    uint64_t built[4]; /* bit s: t[s] is built */
    uint16_t t[256][16];
} cq_tables_t;

AVXINL const uint16_t *cq_table(cq_tables_t *tb, const float *lut, float div, uint8_t s) {
    if (!((tb->built[s >> 6] >> (s & 63)) & 1u)) {
        const __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(lut[s])), _mm512_set1_ps(div));
        _mm256_storeu_si256((__m256i *)tb->t[s], bf16_rne16(v));
        tb->built[s >> 6] |= (uint64_t)1 << (s & 63);
    }
    return tb->t[s];
}

/* 8 code bytes -> 16 word indices (word 2i: byte i & 15, word 2i+1: byte i >> 4); `upper` (16 or 0)
 * added: which half of a 32-word table they read. */
AVXINL __m256i cq_nibble_words(const uint8_t *codes, int upper) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_or_si256(_mm256_ternarylogic_epi32(x, _mm256_slli_epi32(x, 12), _mm256_set1_epi32(0x000F000F), 0xA8),
                           _mm256_set1_epi16((short)upper));
}

AVX512 static void cq_dequant_row_bf16_avx(const uint8_t *codes, const uint8_t *scales, const float *lut, float div,
                                           int64_t k, int block, uint16_t *out, cq_tables_t *tb) {
    if (!tb->valid || tb->div_bits != sq_bits(div)) {
        memset(tb->built, 0, sizeof tb->built);
        tb->div_bits = sq_bits(div), tb->valid = 1;
    }
    const int64_t groups = k / 16;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) { /* two groups of 16 (one block or two) by one 32-word table */
        const __m256i lo = _mm256_loadu_si256((const __m256i *)cq_table(tb, lut, div, scales[16 * g / block]));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)cq_table(tb, lut, div, scales[16 * (g + 1) / block]));
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(cq_nibble_words(codes + 8 * g, 0)),
                                               cq_nibble_words(codes + 8 * g + 8, 16), 1);
        _mm512_storeu_si512(out + 16 * g, _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
    }
    if (g < groups) {
        const __m256i t = _mm256_loadu_si256((const __m256i *)cq_table(tb, lut, div, scales[16 * g / block]));
        _mm256_storeu_si256((__m256i *)(out + 16 * g), _mm256_permutexvar_epi16(cq_nibble_words(codes + 8 * g, 0), t));
    }
}
#endif

/* --- guided rounding of bf16 rows on a stored grid --- */

/* The largest magnitude code whose value is <= m (m in [0, 6]) and whether m is no code value
 * (kernels.py: _floor_mag_bits): from 1 up the exponent and the top mantissa bit. */
static inline uint32_t cq_floor_mag(float m, uint32_t *inexact) {
    /* both forms, then a select: a branch on m >= 1 would be mispredicted about every other element */
    const uint32_t bits = sq_bits(m), big = m >= 1.0f;
    const uint32_t lo_big = (bits >> 22) - 252u, in_big = (bits & 0x3FFFFFu) != 0;
    const uint32_t lo_small = m >= 0.5f, in_small = (m != 0.0f) & (m != 0.5f);
    *inexact = big ? in_big : in_small;
    return big ? lo_big : lo_small;
}

/* The encode factor of each block of a row: min(1 / (scale * s_dec), FLT_MAX). */
static void cq_encode_factors(const uint8_t *scales, const float *lut, float s_dec, int64_t nb, float *enc) {
    for (int64_t b = 0; b < nb; b++) enc[b] = sq_min(1.0f / (lut[scales[b]] * s_dec), FLT_MAX);
}

#if defined(__x86_64__)
/* cq_encode_factors 16 blocks a division: the same IEEE operations lane by lane (vminps returns its
 * second operand unless the first is smaller, as sq_min; 1/0 is Inf, which the min caps). */
AVX512 static void cq_encode_factors_avx(const uint8_t *scales, const float *lut, float s_dec, int64_t nb, float *enc) {
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 m = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1u);
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, scales + b));
        const __m512 v = _mm512_mask_i32gather_ps(_mm512_set1_ps(1.0f), m, idx, lut, 4);
        const __m512 e = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(v, _mm512_set1_ps(s_dec)));
        _mm512_mask_storeu_ps(enc + b, m, _mm512_min_ps(e, _mm512_set1_ps(FLT_MAX)));
    }
}
#endif

/* One element's code (sign included) from its bf16 pattern w, encode factor and hint: the low bit
 * wanted (full = 0) or the rollout's 4-bit code (full = 1). */
static inline uint32_t cq_guided_code(uint32_t w, float enc, uint32_t hint, int full) {
    const uint32_t a = w & 0x7FFFu, sign = (w >> 15) & 1u;
    uint32_t inexact, lo = cq_floor_mag(sq_min(sq_float(a << 16) * enc, 6.0f), &inexact);
    const uint32_t up = full ? inexact & ((hint & 7u) > lo) & ((hint >> 3) == sign) : inexact & ((lo ^ hint) & 1u);
    return (lo + up) | (sign << 3);
}

/* One row, a group of 16 elements (8 code bytes, 2 hint bytes) at a time: each group lies in one
 * block; hint: the row's low-bit hints [K/8] (full = 0) or the rollout's codes [K/2] (full = 1).
 * Returns the row's largest abs pattern (above 0x7F7F: a NaN or Inf). */
static uint32_t cq_guided_row_portable(const uint16_t *x, const float *enc, int64_t k, int block, const uint8_t *hint,
                                       int full, uint8_t *codes) {
    uint32_t top = 0;
    for (int64_t g = 0; g < k / 16; g++) {
        const float e = enc[16 * g / block];
        const uint32_t bits = (uint32_t)hint[2 * g] | ((uint32_t)hint[2 * g + 1] << 8);
        for (int i = 0; i < 8; i++) {
            const uint32_t w0 = x[16 * g + 2 * i], w1 = x[16 * g + 2 * i + 1];
            top = (w0 & 0x7FFFu) > top ? (w0 & 0x7FFFu) : top;
            top = (w1 & 0x7FFFu) > top ? (w1 & 0x7FFFu) : top;
            const uint32_t h0 = full ? hint[8 * g + i] & 15u : bits >> (2 * i), h1 = full ? hint[8 * g + i] >> 4 : bits >> (2 * i + 1);
            codes[8 * g + i] = (uint8_t)(cq_guided_code(w0, e, h0, full) | (cq_guided_code(w1, e, h1, full) << 4));
        }
    }
    return top;
}

#if defined(__x86_64__)
/* One group of 16 elements (inside one block) with encode factor e: its 8 code bytes; top: the
 * running max of the abs patterns. The single-group form, for a row's odd last group. */
AVXINL void cq_guided16_avx(const uint16_t *x, float e, const uint8_t *hint, int full, uint8_t *codes, __m512i *top) {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi32(0x7FFF)), sign = _mm512_srli_epi32(w, 15);
    *top = _mm512_max_epu32(*top, a);
    const __m512 m = _mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_set1_ps(e)),
                                   _mm512_set1_ps(6.0f));
    const __m512i bits = _mm512_castps_si512(m);
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.0f), _CMP_GE_OQ);
    const __mmask16 half = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    /* below 1: lo = (m >= 0.5), inexact unless m is 0 or 0.5 */
    __m512i lo = _mm512_mask_blend_epi32(big, _mm512_maskz_mov_epi32(half, one),
                                         _mm512_sub_epi32(_mm512_srli_epi32(bits, 22), _mm512_set1_epi32(252)));
    const __mmask16 inexact =
        (big & _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x3FFFFF))) |
        (~big & _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_NEQ_UQ) & _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.5f), _CMP_NEQ_UQ));
    __mmask16 up;
    if (full) {
        const __m512i rc = cq_nibbles16(hint);
        up = inexact & _mm512_cmpgt_epu32_mask(_mm512_and_si512(rc, _mm512_set1_epi32(7)), lo) &
             _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(rc, 3), sign);
    } else {
        uint16_t h; /* the group's 16 hint bits are a lane mask as they are */
        memcpy(&h, hint, 2);
        up = inexact & (_mm512_test_epi32_mask(lo, one) ^ (__mmask16)h);
    }
    __m512i code = _mm512_or_si512(_mm512_mask_add_epi32(lo, up, lo, one), _mm512_slli_epi32(sign, 3));
    /* element 2i in the low nibble of byte i: each 64-bit lane's high code moves to bits 4..7 */
    _mm512_mask_cvtepi64_storeu_epi8(codes, 0xFF, _mm512_or_si512(code, _mm512_srli_epi64(code, 28)));
}

/* The floor code lo of m in [0, 6] (cq_floor_mag) and whether m is no code value, 16 lanes. With
 * m' = max(m, 0.25), bits(m') >> 22 (twice the biased exponent plus the top mantissa bit) runs over
 * 250..259, distinct in its low 4 bits, which are all vpermd reads: one table gives lo (below 0.5: 0;
 * then 1, 1, 2, 3, 4, 5, 6, and 7 at 6). m is a code value exactly when it equals lo's value. */
AVXINL __m512i cq_floor16(__m512 m, __mmask16 *inexact) {
    const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(_mm512_max_ps(m, _mm512_set1_ps(0.25f))), 22);
    const __m512i lo = _mm512_permutexvar_epi32(idx, _mm512_setr_epi32(4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3));
    const __m512 values = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0, 0, 0, 0, 0, 0, 0, 0);
    *inexact = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(lo, values), m, _CMP_NEQ_UQ);
    return lo;
}

/* The lanes of cq_guided32_avx that move up to lo + 1 (lsb: the member whose low bit is the hint's;
 * full: the rollout code's magnitude is above lo and its sign is x's), lo/hi: the two lane halves. */
AVXINL void cq_guided_up32(const uint8_t *hint, int full, __m512i w, __m512i lo, __m512i hi, __mmask16 *up_lo, __mmask16 *up_hi) {
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    if (full) { /* dword i of the 16 code bytes, byte i | byte i << 12, masked: a nibble a word, in element order */
        __m512i rc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)hint));
        rc = _mm512_ternarylogic_epi32(rc, _mm512_slli_epi32(rc, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
        /* rc ^ (~sign << 3): bit 3 set where the signs agree; less 8, saturated: the magnitude there, else 0 */
        rc = _mm512_subs_epu16(_mm512_ternarylogic_epi32(rc, _mm512_srli_epi16(w, 12), _mm512_set1_epi16(8), 0xD2),
                               _mm512_set1_epi16(8));
        *up_lo = _mm512_mask_cmpgt_epu32_mask(*up_lo, _mm512_unpacklo_epi16(rc, zero), lo);
        *up_hi = _mm512_mask_cmpgt_epu32_mask(*up_hi, _mm512_unpackhi_epi16(rc, zero), hi);
    } else { /* the 32 hint bits as words of all ones, unpacked as x is: bit 0 of each lane the hint's */
        uint32_t h;
        memcpy(&h, hint, 4);
        const __m512i hw = _mm512_movm_epi16((__mmask32)h);
        *up_lo = _mm512_mask_test_epi32_mask(*up_lo, _mm512_xor_si512(lo, _mm512_unpacklo_epi16(hw, zero)), one);
        *up_hi = _mm512_mask_test_epi32_mask(*up_hi, _mm512_xor_si512(hi, _mm512_unpackhi_epi16(hw, zero)), one);
    }
}

/* Two groups of 16 (32 elements, one load; enc0, enc1 their blocks' factors): 16 code bytes, in the
 * lane order of site_quant.h's sq_pair32 (lo: elements [0-3, 8-11, ..], hi: [4-7, 12-15, ..]).
 * top: the running max of the 16-bit abs patterns. */
AVXINL void cq_guided32_avx(const uint16_t *x, float enc0, float enc1, const uint8_t *hint, int full, uint8_t *codes,
                            __m512i *top) {
    const __m512i w = _mm512_loadu_si512(x), zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
    *top = _mm512_max_epu16(*top, a);
    const __m512 e = _mm512_mask_broadcastss_ps(_mm512_set1_ps(enc0), (__mmask16)0xFF00, _mm_set_ss(enc1));
    const __m512 six = _mm512_set1_ps(6.0f);
    __mmask16 up_lo, up_hi; /* inexact, then the lanes that move up */
    const __m512i lo = cq_floor16(_mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)), e), six), &up_lo);
    const __m512i hi = cq_floor16(_mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)), e), six), &up_hi);
    cq_guided_up32(hint, full, w, lo, hi, &up_lo, &up_hi);
    __m512i c = _mm512_packus_epi32(_mm512_mask_add_epi32(lo, up_lo, lo, one), _mm512_mask_add_epi32(hi, up_hi, hi, one));
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(w, 12), _mm512_set1_epi16(8), 0xF8); /* x's sign as bit 3 */
    /* element 2i in the low nibble of byte i: dword i = word 2i + 16 * word 2i+1, then its low byte */
    _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(_mm512_madd_epi16(c, _mm512_set1_epi32(0x00100001))));
}

AVX512 static uint32_t cq_guided_row_avx(const uint16_t *x, const float *enc, int64_t k, int block, const uint8_t *hint,
                                         int full, uint8_t *codes) {
    __m512i top = _mm512_setzero_si512(); /* 16-bit abs patterns (32 words) */
    const int64_t groups = k / 16, hint_group = full ? 8 : 2; /* hint bytes a group of 16 */
    const int per_block = block == 32; /* log2 of the groups a block: a shift, not a division a pair */
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2)
        cq_guided32_avx(x + 16 * g, enc[g >> per_block], enc[(g + 1) >> per_block], hint + hint_group * g, full, codes + 8 * g,
                        &top);
    __m512i top32 = _mm512_max_epu32(_mm512_and_si512(top, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(top, 16));
    if (g < groups) cq_guided16_avx(x + 16 * g, enc[16 * g / block], hint + hint_group * g, full, codes + 8 * g, &top32);
    return (uint32_t)_mm512_reduce_max_epu32(top32);
}
#endif

/* --- the low magnitude bit of packed codes, eight per byte: out byte j from code bytes 4j..4j+3 --- */

static void cq_lsb_portable(const uint8_t *codes, int64_t nout, uint8_t *bits) {
    for (int64_t j = 0; j < nout; j++) {
        uint32_t t;
        memcpy(&t, codes + 4 * j, 4);
        /* bits 0, 4, .., 28 (element order) gathered to 0..7 in three shifts */
        t &= 0x11111111u;
        t = (t | (t >> 3)) & 0x03030303u;
        t = (t | (t >> 6)) & 0x000F000Fu;
        bits[j] = (uint8_t)((t | (t >> 12)) & 0xFFu);
    }
}

#if defined(__x86_64__)
/* The portable shifts on 16 dwords at once: 64 code bytes -> 16 bytes (vpmovdb keeps each low byte). */
AVX512 static void cq_lsb_avx(const uint8_t *codes, int64_t nout, uint8_t *bits) {
    int64_t j = 0;
    for (; j + 16 <= nout; j += 16) {
        __m512i t = _mm512_and_si512(_mm512_loadu_si512(codes + 4 * j), _mm512_set1_epi32(0x11111111));
        t = _mm512_and_si512(_mm512_or_si512(t, _mm512_srli_epi32(t, 3)), _mm512_set1_epi32(0x03030303));
        t = _mm512_and_si512(_mm512_or_si512(t, _mm512_srli_epi32(t, 6)), _mm512_set1_epi32(0x000F000F));
        _mm_storeu_si128((__m128i *)(bits + j), _mm512_cvtepi32_epi8(_mm512_or_si512(t, _mm512_srli_epi32(t, 12))));
    }
    if (j < nout) cq_lsb_portable(codes + 4 * j, nout - j, bits + j);
}
#endif

/* --- MXFP4 quantize of bf16 or float32 rows (kernels.py: mxfp4_quantize): per block of 32, the E8M0
 * exponent of its amax (_mx_exponent), then every code rounded to nearest on 2^-e. --- */

/* frexp's exponent of a float32 f > 0 (f = mant * 2^ex, mant in [0.5, 1)) and whether mant is 0.5,
 * from the bits (subnormals: the top set bit of the mantissa). */
static inline int cq_frexp(float f, int *half) {
    const uint32_t b = sq_bits(f) & 0x7FFFFFFFu, e = b >> 23, m = b & 0x7FFFFFu;
    if (e) {
        *half = m == 0;
        return (int)e - 126;
    }
    *half = (m & (m - 1u)) == 0;
    return (32 - __builtin_clz(m)) - 149;
}

/* The unbiased E8M0 exponent of a block with amax `amax`, in [-127, 127]: floor, the OCP rule
 * (exponent of amax less E2M1's emax 2), or rceil, the smallest e with amax / 6 <= 2^e. */
static inline int cq_mx_exponent(float amax, int rceil) {
    int half, e;
    if (amax == 0.0f) return -127;
    if (rceil) {
        const float t = amax / 6.0f;
        if (t == 0.0f) return -127;
        const int ex = cq_frexp(t, &half);
        e = half ? ex - 1 : ex;
    } else {
        e = cq_frexp(amax, &half) - 1 - 2;
    }
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

/* Block b's scale byte from the two 16-element amax patterns bm[2b], bm[2b + 1]; returns 2^-e. */
static inline float cq_mx_scale(const uint32_t *bm, int64_t b, int f32, int rceil, uint8_t *scale) {
    const uint32_t limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    uint32_t a = bm[2 * b] > bm[2 * b + 1] ? bm[2 * b] : bm[2 * b + 1];
    a = a < limit ? a : limit; /* a NaN's block computes in range (its row is refused) */
    const int e = cq_mx_exponent(sq_float(f32 ? a : a << 16), rceil);
    *scale = (uint8_t)(e + 127);
    return sq_float(e < 127 ? (uint32_t)(127 - e) << 23 : 0x00200000u); /* 2^-e; 2^-127 is subnormal */
}

/* One row; bm: scratch [k/16]. Returns the row's largest abs pattern. */
static uint32_t cq_mx_row_portable(const void *xv, int f32, int64_t k, int rceil, uint32_t *bm, uint8_t *codes,
                                   uint8_t *scales) {
    const uint16_t *x = xv;
    const uint32_t *x32 = xv;
    const uint32_t top = f32 ? sq_block_amax_portable32(x32, k / 16, bm) : sq_block_amax_portable(x, k / 16, bm);
    for (int64_t b = 0; b < k / 32; b++) {
        const float enc = cq_mx_scale(bm, b, f32, rceil, scales + b);
        for (int64_t e = 32 * b; e < 32 * b + 32; e += 2) {
            uint32_t c[2];
            for (int h = 0; h < 2; h++) {
                const uint32_t w = f32 ? x32[e + h] : x[e + h];
                const float mag = f32 ? sq_float(w & 0x7FFFFFFFu) : sq_float((w & 0x7FFFu) << 16);
                c[h] = (sq_e2m1(mag * enc) & 7u) | ((w >> (f32 ? 28 : 12)) & 8u);
            }
            codes[e / 2] = (uint8_t)(c[0] | (c[1] << 4));
        }
    }
    return top;
}

#if defined(__x86_64__)
AVX512 static uint32_t cq_mx_row_avx(const void *xv, int f32, int64_t k, int rceil, uint32_t *bm, uint8_t *codes,
                                     uint8_t *scales) {
    const uint16_t *x = xv;
    const uint32_t *x32 = xv;
    const uint32_t top = f32 ? sq_block_amax_avx32(x32, k / 16, bm) : sq_block_amax_avx(x, k / 16, bm);
    for (int64_t b = 0; b < k / 32; b++) {
        const float enc = cq_mx_scale(bm, b, f32, rceil, scales + b);
        for (int64_t g = 2 * b; g < 2 * b + 2; g++) {
            if (f32) sq_block16_32(x32 + 16 * g, enc, codes + 8 * g);
            else sq_block16(x + 16 * g, enc, _mm512_setzero_si512(), codes + 8 * g, NULL);
        }
    }
    return top;
}
#endif

/* --- FP8 E4M3 with one float32 scale per row (formats/fp8.py: quantize_fp8; reference.py:
 * quantize_fp8): scale = amax / 448 (1 for an all-zero row), code = e4m3_rne(min(|x| / scale, 448))
 * with x's sign bit (torch's clamp, then its cast: the clamp keeps a -0.0). --- */

/* One row of bf16 (f32 = 0) or float32 -> k E4M3 codes and the row's scale; returns the row's
 * largest abs pattern (above the format's largest finite one: a NaN or Inf). */
static uint32_t cq_fp8_row_portable(const void *xv, int f32, int64_t k, uint8_t *codes, float *scale) {
    const uint16_t *x = xv;
    const uint32_t *x32 = xv;
    const uint32_t top = cq_abs_max_portable(xv, k, f32), limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    const float amax = sq_float((top < limit ? top : limit) << (f32 ? 0 : 16));
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    *scale = s;
    for (int64_t e = 0; e < k; e++) {
        const uint32_t w = f32 ? x32[e] : (uint32_t)x[e] << 16;
        float v;
        codes[e] = (uint8_t)(sq_e4m3(sq_min(sq_float(w & 0x7FFFFFFFu) / s, 448.0f), &v) | ((w >> 24) & 0x80u));
    }
    return top;
}

#if defined(__x86_64__)
AVX512 static uint32_t cq_fp8_row_avx(const void *xv, int f32, int64_t k, uint8_t *codes, float *scale) {
    const uint32_t top = cq_abs_max_avx(xv, k, f32), limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    const float amax = sq_float((top < limit ? top : limit) << (f32 ? 0 : 16));
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    *scale = s;
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
        const __m512i w = f32 ? _mm512_loadu_si512((const uint32_t *)xv + e)
                              : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)xv + e))), 16);
        /* min(|x| / s, 448): vminps returns its second operand unless the first is smaller, as sq_min */
        const __m512 v = _mm512_min_ps(_mm512_div_ps(_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0x7FFFFFFF))),
                                                     _mm512_set1_ps(s)),
                                       _mm512_set1_ps(448.0f));
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i rounded = _mm512_and_si512(
            _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF),
                                                    _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1)))),
            _mm512_set1_epi32((int)0xFFF00000u));
        const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(v, _mm512_set1_ps(0x1p14f))),
                                             _mm512_set1_epi32(0x46800000));
        __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, _mm512_set1_ps(0x1p-6f), _CMP_GE_OQ), sub,
                                               _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3)));
        code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(w, 24), _mm512_set1_epi32(0x80)));
        _mm_storeu_si128((__m128i *)(codes + e), _mm512_cvtepi32_epi8(code));
    }
    for (; e < k; e++) { /* the tail: the scalar rule */
        const uint32_t w = f32 ? ((const uint32_t *)xv)[e] : (uint32_t)((const uint16_t *)xv)[e] << 16;
        float v;
        codes[e] = (uint8_t)(sq_e4m3(sq_min(sq_float(w & 0x7FFFFFFFu) / s, 448.0f), &v) | ((w >> 24) & 0x80u));
    }
    return top;
}
#endif

/* FP8 dequantize: value(code) * scale, the values from `lut` [256] (torch's own widening of E4M3). */
static void cq_fp8_dequant_row_portable(const uint8_t *codes, const float *lut, float scale, int64_t k, float *out) {
    for (int64_t e = 0; e < k; e++) out[e] = lut[codes[e]] * scale;
}

#if defined(__x86_64__)
AVX512 static void cq_fp8_dequant_row_avx(const uint8_t *codes, const float *lut, float scale, int64_t k, float *out) {
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + e)));
        _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_i32gather_ps(idx, lut, 4), _mm512_set1_ps(scale)));
    }
    cq_fp8_dequant_row_portable(codes + e, lut, scale, k - e, out + e);
}
#endif

#endif
