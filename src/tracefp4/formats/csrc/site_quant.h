/* NVFP4 quantization of bf16 activation rows for a rollout's sites: each row's codes, E4M3 block
 * scales and (optionally) the dequantized row in bf16, in one pass over the input.
 *
 * The same arithmetic as the numba kernel (tracefp4/formats/kernels.py: nvfp4_quantize, whose
 * comments give the reasons) and the readable reference (formats/reference.py), operation for
 * operation in IEEE float32 (no contractions: there is no a * b + c to fuse), so the bits are theirs:
 *
 *   amax      = the row's largest |x| (own_amax) or the one given
 *   S_enc     = min(2688 / amax, FLT_MAX) (1 when amax or that is 0); S_dec = 1 / S_enc
 *   scale[b]  = e4m3_rne(min(blockamax[b] * (S_enc * fl32(1/6)), 448))
 *   enc[b]    = min(1 / (scale[b] * S_dec), FLT_MAX)
 *   code      = e2m1_rne(min(|x| * enc[b], 6)) with x's sign
 *   value     = bf16_rne((e2m1(code) * scale[b]) / S_enc)
 *
 * A row holding a NaN or Inf is reported (the call returns the first such row, the caller refuses
 * it); its outputs are garbage computed in range. K is a multiple of 16. float32 rows (a per-tensor
 * quantize's weights and gradients) take the same passes on 32-bit patterns, codes and scales only
 * (the numba kernel writes values for bf16 input only). */
#ifndef TFP4_SITE_QUANT_H
#define TFP4_SITE_QUANT_H
#include "fp4_common.h"
#include <float.h>

#define SQ_LIMIT 0x7F7Fu /* the largest finite bf16 abs pattern */
#define SQ_LIMIT32 0x7F7FFFFFu /* the largest finite float32 abs pattern */

static inline uint32_t sq_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float sq_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Python's min(a, b) (what the numba kernel calls): a unless b < a. */
static inline float sq_min(float a, float b) { return b < a ? b : a; }

static inline float sq_s_enc(float amax) {
    if (amax == 0.0f) return 1.0f;
    float s = sq_min(2688.0f / amax, FLT_MAX);
    return s == 0.0f ? 1.0f : s;
}

/* E4M3 round-to-nearest-even of v in [0, 448], subnormals included: (pattern, value). */
static inline uint32_t sq_e4m3(float v, float *value) {
    uint32_t bits = sq_bits(v);
    if (v >= 0x1p-6f) {
        uint32_t rounded = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
        *value = sq_float(rounded);
        return (rounded >> 20) - (120u << 3);
    }
    float shifted = v + 0x1p14f; /* onto the 2^-9 grid of the subnormals */
    *value = shifted - 0x1p14f;
    return sq_bits(shifted) - 0x46800000u;
}

/* E2M1 magnitude code of m >= 0, nearest with ties to the even code. */
static inline uint32_t sq_e2m1(float m) {
    m = sq_min(m, 6.0f);
    uint32_t bits = sq_bits(m);
    if (m >= 1.0f) return ((bits + 0x1FFFFFu + ((bits >> 22) & 1u)) >> 22) - 252u;
    return sq_bits(m + 0x1p22f) - 0x4A800000u;
}

/* One row's block amax patterns into bm [k/16]; returns the row's largest. */
static uint32_t sq_block_amax_portable(const uint16_t *x, int64_t nb, uint32_t *bm) {
    uint32_t top = 0;
    for (int64_t b = 0; b < nb; b++) {
        uint32_t m = 0;
        for (int i = 0; i < 16; i++) {
            uint32_t a = x[16 * b + i] & 0x7FFFu;
            m = a > m ? a : m;
        }
        bm[b] = m;
        top = m > top ? m : top;
    }
    return top;
}

static void sq_row_portable(const uint16_t *x, int64_t k, float amax, const uint32_t *bm, uint8_t *codes,
                            uint8_t *scales, uint16_t *values) {
    const float s_enc = sq_s_enc(amax), factor = s_enc * (1.0f / 6.0f), s_dec = 1.0f / s_enc;
    for (int64_t b = 0; b < k / 16; b++) {
        uint32_t a = bm[b] < SQ_LIMIT ? bm[b] : SQ_LIMIT;
        float scale;
        scales[b] = (uint8_t)sq_e4m3(sq_min(sq_float(a << 16) * factor, 448.0f), &scale);
        const float enc = sq_min(1.0f / (scale * s_dec), FLT_MAX);
        for (int i = 0; i < 8; i++) {
            uint32_t c[2];
            for (int h = 0; h < 2; h++) {
                uint16_t w = x[16 * b + 2 * i + h];
                /* & 7: a NaN's garbage code stays a table index (its row is refused anyway) */
                c[h] = (sq_e2m1(sq_float((uint32_t)(w & 0x7FFFu) << 16) * enc) & 7u) | ((w >> 12) & 8u);
                if (values) values[16 * b + 2 * i + h] = bf16_rne((E2M1[c[h]] * scale) / s_enc);
            }
            codes[8 * b + i] = (uint8_t)(c[0] | (c[1] << 4));
        }
    }
}

/* float32 rows: block amax patterns of 32 bits (as the abs values' float32 bits). */
static uint32_t sq_block_amax_portable32(const uint32_t *x, int64_t nb, uint32_t *bm) {
    uint32_t top = 0;
    for (int64_t b = 0; b < nb; b++) {
        uint32_t m = 0;
        for (int i = 0; i < 16; i++) m = (x[16 * b + i] & 0x7FFFFFFFu) > m ? (x[16 * b + i] & 0x7FFFFFFFu) : m;
        bm[b] = m;
        top = m > top ? m : top;
    }
    return top;
}

static void sq_row_portable32(const uint32_t *x, int64_t k, float amax, const uint32_t *bm, uint8_t *codes,
                              uint8_t *scales) {
    const float s_enc = sq_s_enc(amax), factor = s_enc * (1.0f / 6.0f), s_dec = 1.0f / s_enc;
    for (int64_t b = 0; b < k / 16; b++) {
        float scale;
        scales[b] = (uint8_t)sq_e4m3(sq_min(sq_float(bm[b] < SQ_LIMIT32 ? bm[b] : SQ_LIMIT32) * factor, 448.0f), &scale);
        const float enc = sq_min(1.0f / (scale * s_dec), FLT_MAX);
        for (int i = 0; i < 8; i++) {
            uint32_t c[2];
            for (int h = 0; h < 2; h++) {
                uint32_t w = x[16 * b + 2 * i + h];
                c[h] = (sq_e2m1(sq_float(w & 0x7FFFFFFFu) * enc) & 7u) | ((w >> 28) & 8u);
            }
            codes[8 * b + i] = (uint8_t)(c[0] | (c[1] << 4));
        }
    }
}

#if defined(__x86_64__)
/* 16 consecutive blocks' amax patterns (256 bf16) into bm[0..15]; returns them as dwords. A
 * transpose-and-max network: each level pairs two vectors and keeps, per block, the max of two
 * halves of what it had, so 8 vectors of 2 blocks x 16 words end as one of 16 blocks x 1 dword in
 * 15 shuffles and 15 maxes (a block reduced in its own lanes costs 4 shuffles and 4 maxes). */
AVXINL __m512i sq_block_amax16_avx(const uint16_t *x, uint32_t *bm) {
    const __m512i abs = _mm512_set1_epi16(0x7FFF);
    __m512i l1[4], l2[2];
    for (int p = 0; p < 4; p++) { /* blocks 4p..4p+3, one 128-bit lane each (8 words) */
        __m512i a = _mm512_and_si512(_mm512_loadu_si512(x + 64 * p), abs);
        __m512i b = _mm512_and_si512(_mm512_loadu_si512(x + 64 * p + 32), abs);
        l1[p] = _mm512_max_epu16(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int q = 0; q < 2; q++) /* lane j: qword 0 block 8q+j, qword 1 block 8q+4+j (4 words each) */
        l2[q] = _mm512_max_epu16(_mm512_unpacklo_epi64(l1[2 * q], l1[2 * q + 1]), _mm512_unpackhi_epi64(l1[2 * q], l1[2 * q + 1]));
    /* lane j: dword t block j+4t (2 words each) */
    const __m512 e = _mm512_castsi512_ps(l2[0]), f = _mm512_castsi512_ps(l2[1]);
    __m512i m = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(e, f, _MM_SHUFFLE(2, 0, 2, 0))),
                                 _mm512_castps_si512(_mm512_shuffle_ps(e, f, _MM_SHUFFLE(3, 1, 3, 1))));
    m = _mm512_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(m, 16));
    /* dword 4j+t holds block j+4t: block b from dword 4(b%4) + b/4 */
    m = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), m);
    _mm512_storeu_si512(bm, m);
    return m;
}

/* One row's block amax patterns into bm [nb]; returns the row's largest. */
AVX512 static uint32_t sq_block_amax_avx(const uint16_t *x, int64_t nb, uint32_t *bm) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    __m512i top16 = _mm512_setzero_si512();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) top16 = _mm512_max_epu32(top16, sq_block_amax16_avx(x + 16 * b, bm + b));
    uint32_t top = (uint32_t)_mm512_reduce_max_epu32(top16);
    for (; b + 2 <= nb; b += 2) { /* two blocks: one 512-bit load, reduced to 2 lanes together */
        __m512i a = _mm512_and_si512(_mm512_loadu_si512(x + 16 * b), _mm512_set1_epi16(0x7FFF));
        __m512i m = _mm512_max_epu16(a, _mm512_bsrli_epi128(a, 8));
        m = _mm512_max_epu16(m, _mm512_bsrli_epi128(m, 4));
        m = _mm512_max_epu16(m, _mm512_bsrli_epi128(m, 2));
        /* each 128-bit lane's word 0 now holds its 8 elements' max; lanes 0,1 are block b, 2,3 block b+1 */
        m = _mm512_max_epu16(m, _mm512_shuffle_i64x2(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
        uint32_t m0 = (uint32_t)_mm_extract_epi16(_mm512_castsi512_si128(m), 0);
        uint32_t m1 = (uint32_t)_mm_extract_epi16(_mm512_extracti32x4_epi32(m, 2), 0);
        bm[b] = m0;
        bm[b + 1] = m1;
        top = m0 > top ? m0 : top;
        top = m1 > top ? m1 : top;
    }
    for (; b < nb; b++) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 16 * b)), mask);
        uint32_t m = (uint32_t)_mm512_reduce_max_epu32(_mm512_cvtepu16_epi32(a));
        bm[b] = m;
        top = m > top ? m : top;
    }
    return top;
}

/* float32 rows: a block is one 512-bit load. */
AVX512 static uint32_t sq_block_amax_avx32(const uint32_t *x, int64_t nb, uint32_t *bm) {
    uint32_t top = 0;
    for (int64_t b = 0; b < nb; b++) {
        uint32_t m = (uint32_t)_mm512_reduce_max_epu32(_mm512_and_si512(_mm512_loadu_si512(x + 16 * b),
                                                                        _mm512_set1_epi32(0x7FFFFFFF)));
        bm[b] = m;
        top = m > top ? m : top;
    }
    return top;
}

/* The scale pass for up to 16 blocks: pattern bytes, float32 scale values and encode factors. */
AVXINL void sq_scales16(const uint32_t *bm, int count, int f32, const float *factor, const float *s_dec,
                         const float *s_enc, uint8_t *scales, float *sv, float *enc, float *q1, float *q15) {
    const __mmask16 m = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    __m512i a = _mm512_min_epu32(_mm512_maskz_loadu_epi32(m, bm), _mm512_set1_epi32((int)(f32 ? SQ_LIMIT32 : SQ_LIMIT)));
    if (!f32) a = _mm512_slli_epi32(a, 16); /* bf16 patterns: the top half of a float32's */
    /* min(amax * factor, 448): vminps returns its second operand unless the first is smaller, as sq_min */
    __m512 d = _mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_maskz_loadu_ps(m, factor)),
                             _mm512_set1_ps(448.0f));
    __m512i bits = _mm512_castps_si512(d);
    __m512i rounded = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF),
                                                _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1)))),
        _mm512_set1_epi32((int)0xFFF00000u));
    __m512 shifted = _mm512_add_ps(d, _mm512_set1_ps(0x1p14f));
    __mmask16 normal = _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p-6f), _CMP_GE_OQ);
    __m512i pat = _mm512_mask_blend_epi32(normal, _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_set1_epi32(0x46800000)),
                                          _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3)));
    __m512 val = _mm512_mask_blend_ps(normal, _mm512_sub_ps(shifted, _mm512_set1_ps(0x1p14f)), _mm512_castsi512_ps(rounded));
    /* min(1 / (scale * S_dec), FLT_MAX): 1/0 is inf, which the min caps, as in the scalar code */
    __m512 e = _mm512_min_ps(_mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(val, _mm512_maskz_loadu_ps(m, s_dec))),
                             _mm512_set1_ps(FLT_MAX));
    /* plain stores for a full 16 (masked stores are slow on Zen 4); the scale values only where the
     * values pass reads them (q1: the values are written) */
    if (count >= 16) {
        _mm_storeu_si128((__m128i *)scales, _mm512_cvtepi32_epi8(pat));
        _mm512_storeu_ps(enc, e);
        if (q1) _mm512_storeu_ps(sv, val);
    } else {
        _mm_mask_storeu_epi8(scales, m, _mm512_cvtepi32_epi8(pat));
        _mm512_mask_storeu_ps(enc, m, e);
        if (q1) _mm512_mask_storeu_ps(sv, m, val);
    }
    if (q1) { /* masked-off lanes divide 0 by 1 */
        __m512 se = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, s_enc);
        _mm512_mask_storeu_ps(q1, m, _mm512_div_ps(val, se));
        _mm512_mask_storeu_ps(q15, m, _mm512_div_ps(_mm512_mul_ps(val, _mm512_set1_ps(1.5f)), se));
    }
}

/* 16 elements' abs values (float32 lanes) and sign bits (bit 3 of each lane) -> their codes. */
AVXINL __m512i sq_codes16(__m512 mag, __m512i signs, float enc) {
    __m512 m = _mm512_min_ps(_mm512_mul_ps(mag, _mm512_set1_ps(enc)), _mm512_set1_ps(6.0f));
    __m512i bits = _mm512_castps_si512(m);
    /* m >= 1: sq_e2m1's (bits + 0x1FFFFF + lsb) >> 22, less 252, as sq_e2m1_16 forms it (the lanes
     * below 1 wrap and are the sub form's) */
    const __m512i t = _mm512_add_epi32(bits, _mm512_set1_epi32(0x1FFFFF - (252 << 22)));
    __m512i normal = _mm512_srli_epi32(
        _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(bits, _mm512_set1_epi32(1 << 22)), t, _mm512_set1_epi32(1)), 22);
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(m, _mm512_set1_ps(0x1p22f))), _mm512_set1_epi32(0x4A800000));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(m, _mm512_set1_ps(1.0f), _CMP_GE_OQ), sub, normal);
    return _mm512_or_si512(code, _mm512_and_si512(signs, _mm512_set1_epi32(8)));
}

/* element 2i in the low nibble of byte i: each 64-bit lane's high code moves to bits 4..7 */
AVXINL void sq_store_codes16(__m512i code, uint8_t *codes) {
    _mm512_mask_cvtepi64_storeu_epi8(codes, 0xFF, _mm512_or_si512(code, _mm512_srli_epi64(code, 28)));
}

/* 16 bf16 elements of one block -> 8 code bytes and (values) their 16 dequantized bf16. */
AVXINL void sq_block16(const uint16_t *x, float enc, __m512i table, uint8_t *codes, uint16_t *values) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    __m512 mag = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7FFF)), 16));
    __m512i code = sq_codes16(mag, _mm512_srli_epi32(w, 12), enc);
    sq_store_codes16(code, codes);
    if (values) _mm256_storeu_si256((__m256i *)values, _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(code, table)));
}

/* 16 float32 elements of one block -> 8 code bytes. */
AVXINL void sq_block16_32(const uint32_t *x, float enc, uint8_t *codes) {
    __m512i w = _mm512_loadu_si512(x);
    __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0x7FFFFFFF)));
    sq_store_codes16(sq_codes16(mag, _mm512_srli_epi32(w, 28), enc), codes);
}

/* E2M1 magnitude codes of m >= 0 (sq_e2m1 on 16 lanes, before its min(m, 6)). m >= 1: the integer
 * form of sq_e2m1 with its "- 252" folded into the rounding constant (subtracting 252 << 22 before
 * the shift is the same as 252 after it, and bits >= 252 << 22 there, so nothing wraps); m < 1: the
 * float add onto the 2^-1 grid, its pattern less 2^22's by a masked subtract over the normal lanes.
 * Above 6 (Inf and NaN included) the m >= 1 form is monotonic in the bits and at least 7, code(6),
 * so a later min(code, 7) equals the code of min(m, 6). */
AVXINL __m512i sq_e2m1_16(__m512 m) {
    const __m512i bits = _mm512_castps_si512(m);
    /* + lsb (bit 22) as a masked add of 1 on a vptestmd mask: 4 operations where a shift, an and and
     * two adds were 5 (Zen 4, 4096x4096, 1 thread: the codes pass 3.22 -> 3.02 ms) */
    const __m512i t = _mm512_add_epi32(bits, _mm512_set1_epi32(0x1FFFFF - (252 << 22)));
    const __m512i normal = _mm512_srli_epi32(
        _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(bits, _mm512_set1_epi32(1 << 22)), t, _mm512_set1_epi32(1)), 22);
    const __m512i sub = _mm512_castps_si512(_mm512_add_ps(m, _mm512_set1_ps(0x1p22f)));
    return _mm512_mask_sub_epi32(normal, _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.0f), _CMP_LT_OQ), sub,
                                 _mm512_set1_epi32(0x4A800000));
}

/* Two blocks (32 bf16, one load) -> 16 code bytes, codes only. The abs and the sign are taken on the
 * 16-bit words, 32 at a time; unpacking the words under zeros makes float32 lanes directly, lanes
 * [0-3, 8-11, 16-19, 24-27] (lo) and [4-7, 12-15, 20-23, 28-31] (hi) of the 32, so in both vectors
 * lanes 0-7 are block 0 and 8-15 block 1 (the encode factor vector is enc[0] x 8, enc[1] x 8), and
 * packus puts the two vectors' codes back in element order as words (every code is below 2^10, even
 * a refused row's NaN one: nothing saturates). */
AVXINL void sq_pair32(const uint16_t *x, const float *enc, uint8_t *codes) {
    const __m512i w = _mm512_loadu_si512(x), zero = _mm512_setzero_si512();
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
    const __m512 e = _mm512_mask_broadcastss_ps(_mm512_set1_ps(enc[0]), (__mmask16)0xFF00, _mm_load_ss(enc + 1));
    const __m512 mlo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)), e);
    const __m512 mhi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)), e);
    /* min(code, 7): the code of min(m, 6) (sq_e2m1_16) */
    __m512i c = _mm512_min_epu16(_mm512_packus_epi32(sq_e2m1_16(mlo), sq_e2m1_16(mhi)), _mm512_set1_epi16(7));
    /* code | (sign >> 12 & 8): the sign bit lands on bit 3 of each word */
    c = _mm512_ternarylogic_epi32(c, _mm512_srli_epi16(w, 12), _mm512_set1_epi16(8), 0xF8);
    /* element 2i in the low nibble of byte i: dword i = word 2i + 16 * word 2i+1, then its low byte */
    _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(_mm512_madd_epi16(c, _mm512_set1_epi32(0x00100001))));
}

/* A chunk's codes (no values), `blocks` blocks of bf16 x with their encode factors: two blocks a
 * load, a single-block tail. */
AVXINL void sq_codes_chunk(const uint16_t *x, int64_t blocks, const float *enc, uint8_t *codes) {
    int64_t g = 0;
    for (; g + 2 <= blocks; g += 2) {
        /* the next chunk's line, a line a pair: its amax pass then finds it in cache, its DRAM reads
         * overlapped with this chunk's arithmetic (past the last row: a prefetch does not fault) */
        _mm_prefetch((const char *)(x + 16 * (g + blocks)), _MM_HINT_T0);
        sq_pair32(x + 16 * g, enc + g, codes + 8 * g);
    }
    if (g < blocks) sq_block16(x + 16 * g, enc[g], _mm512_setzero_si512(), codes + 8 * g, NULL);
}

/* bf16 bits (in 32-bit lanes) of (e2m1(c) * scale) / S_enc for the 16 codes c: a block's values.
 * The E2M1 magnitudes are {1, 1.5} times powers of two, so from q1 = scale / S_enc and
 * q15 = (1.5 * scale) / S_enc (1.5 * scale is exact) every value is q1 or q15 times 2^-1..2^2, which
 * is exact, and so equal to the division of each, while q1 / 2 is a normal float32 (we ask
 * q1 >= 2^-124, which keeps the exact quotient / 2 above 2^-126 too; q1 = 0 gives signed zeros, as
 * the division does). Other blocks divide all 16 (`divide`). */
AVXINL __m512i sq_value_table(float q1, float q15, float scale, float s_enc, int divide) {
    __m512 v;
    if (__builtin_expect(divide, 0)) {
        v = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(scale)), _mm512_set1_ps(s_enc));
    } else { /* codes 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 the same negated (code 8: -0) */
        const __m512 c1 = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 0.0f, 2.0f, 0.0f, 4.0f, 0.0f,
                                         -0.0f, -0.5f, -1.0f, 0.0f, -2.0f, 0.0f, -4.0f, 0.0f);
        const __m512 c15 = _mm512_setr_ps(0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 2.0f, 0.0f, 4.0f,
                                          0.0f, 0.0f, 0.0f, -1.0f, 0.0f, -2.0f, 0.0f, -4.0f);
        v = _mm512_mask_blend_ps((__mmask16)0xA8A8, _mm512_mul_ps(c1, _mm512_set1_ps(q1)), _mm512_mul_ps(c15, _mm512_set1_ps(q15)));
    }
    __m512i b = _mm512_castps_si512(v);
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    return _mm512_srli_epi32(b, 16); /* finite: no NaN case */
}

/* Per-chunk scratch of the AVX-512 path: per block of the chunk, its amax pattern and its row's
 * factor, S_dec and S_enc, then its scale value, encode factor and the two value bases. */
enum { SQ_CHUNK_BLOCKS = 256, SQ_ARRAYS = 8 };

/* Rows [r0, r1) (whole rows of one chunk, at most max(SQ_CHUNK_BLOCKS, K/16) blocks). The passes
 * run over the chunk's blocks, not row by row: a short row (K/V: 4 blocks) would otherwise wait on
 * its own chain of divisions (S_enc, the scales, the encode factors) before its first code. */
AVX512 static void sq_chunk_avx(const void *xv, int f32, int64_t k, int64_t r0, int64_t r1, float *amax, int own_amax,
                                const uint32_t *bm_in, uint8_t *codes, uint8_t *scales, uint16_t *values, float *mem,
                                int64_t *bad) {
    const int64_t nb = k / 16, blocks = (r1 - r0) * nb;
    const int64_t cap = blocks + 16;
    /* the block amaxes of the amax pass (only read from here on), or this chunk's own */
    uint32_t *bm = bm_in ? (uint32_t *)(uintptr_t)(bm_in + r0 * nb) : (uint32_t *)mem;
    float *factor = mem + cap, *s_dec = mem + 2 * cap, *s_enc = mem + 3 * cap, *sv = mem + 4 * cap, *enc = mem + 5 * cap,
          *q1 = mem + 6 * cap, *q15 = mem + 7 * cap;
    const uint16_t *x = (const uint16_t *)xv + (f32 ? 0 : r0 * k);
    const uint32_t *x32 = (const uint32_t *)xv + (f32 ? r0 * k : 0);
    const uint32_t limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t g = (r - r0) * nb;
        if (!bm_in) {
            uint32_t top = f32 ? sq_block_amax_avx32(x32 + g * 16, nb, bm + g) : sq_block_amax_avx(x + g * 16, nb, bm + g);
            if (top > limit && *bad < 0) *bad = r;
            if (own_amax) amax[r] = sq_float((top < limit ? top : limit) << (f32 ? 0 : 16));
        }
        const float se = sq_s_enc(amax[r]);
        const __m512 f = _mm512_set1_ps(se * (1.0f / 6.0f)), d = _mm512_set1_ps(1.0f / se), e = _mm512_set1_ps(se);
        for (int64_t b = 0; b < nb; b += 16) {
            if (nb - b >= 16) {
                _mm512_storeu_ps(factor + g + b, f);
                _mm512_storeu_ps(s_dec + g + b, d);
                _mm512_storeu_ps(s_enc + g + b, e);
                continue;
            }
            const __mmask16 m = (__mmask16)((1u << (nb - b)) - 1u);
            _mm512_mask_storeu_ps(factor + g + b, m, f);
            _mm512_mask_storeu_ps(s_dec + g + b, m, d);
            _mm512_mask_storeu_ps(s_enc + g + b, m, e);
        }
    }
    scales += r0 * nb;
    for (int64_t g = 0; g < blocks; g += 16) {
        const int count = blocks - g < 16 ? (int)(blocks - g) : 16;
        sq_scales16(bm + g, count, f32, factor + g, s_dec + g, s_enc + g, scales + g, sv + g, enc + g, values ? q1 + g : NULL,
                    q15 + g);
    }
    codes += r0 * (k / 2);
    if (values) values += r0 * k;
    if (f32) { /* no values: the numba kernel writes them for bf16 input only */
        for (int64_t g = 0; g < blocks; g++) sq_block16_32(x32 + 16 * g, enc[g], codes + 8 * g);
        return;
    }
    if (!values) {
        sq_codes_chunk(x, blocks, enc, codes);
        return;
    }
    for (int64_t g = 0; g < blocks; g++) {
        __m512i table = values ? sq_value_table(q1[g], q15[g], sv[g], s_enc[g], q1[g] < 0x1p-124f && q1[g] != 0.0f)
                               : _mm512_setzero_si512();
        sq_block16(x + 16 * g, enc[g], table, codes + 8 * g, values ? values + 16 * g : NULL);
    }
}
#endif

typedef struct {
    const void *x; /* bf16 bits, or float32 (f32) */
    int f32;
    int64_t k, lo, hi;
    float *amax;
    int own_amax, avx;
    const uint32_t *bm_in; /* block amax patterns [rows, k/16] of an amax pass (the caller checked them), or NULL */
    uint8_t *codes, *scales;
    uint16_t *values;
    int64_t bad; /* first non-finite row of this range, or -1 */
} sq_job_t;

/* One float32 row on the portable path. */
static void sq_row32(sq_job_t *j, int64_t r, uint32_t *bm) {
    const uint32_t *x = (const uint32_t *)j->x + r * j->k;
    if (j->bm_in) {
        bm = (uint32_t *)(uintptr_t)(j->bm_in + r * (j->k / 16));
    } else {
        uint32_t top = sq_block_amax_portable32(x, j->k / 16, bm);
        if (top > SQ_LIMIT32 && j->bad < 0) j->bad = r;
        if (j->own_amax) j->amax[r] = sq_float(top < SQ_LIMIT32 ? top : SQ_LIMIT32);
    }
    sq_row_portable32(x, j->k, j->amax[r], bm, j->codes + r * (j->k / 2), j->scales + r * (j->k / 16));
}

static int sq_run(sq_job_t *j) {
    const int64_t nb = j->k / 16;
#if defined(__x86_64__)
    if (j->avx) {
        const int64_t per_chunk = nb >= SQ_CHUNK_BLOCKS ? 1 : SQ_CHUNK_BLOCKS / nb;
        float *mem = malloc((size_t)SQ_ARRAYS * (size_t)(per_chunk * nb + 16) * sizeof(float));
        if (!mem) return -3;
        for (int64_t r = j->lo; r < j->hi; r += per_chunk)
            sq_chunk_avx(j->x, j->f32, j->k, r, r + per_chunk < j->hi ? r + per_chunk : j->hi, j->amax, j->own_amax, j->bm_in,
                         j->codes,
                         j->scales, j->values, mem, &j->bad);
        free(mem);
        return 0;
    }
#endif
    uint32_t *bm = malloc((size_t)(nb ? nb : 1) * sizeof(uint32_t)); /* a row's block amaxes */
    if (!bm) return -3;
    for (int64_t r = j->lo; r < j->hi; r++) {
        if (j->f32) {
            sq_row32(j, r, bm);
            continue;
        }
        const uint16_t *x = (const uint16_t *)j->x + r * j->k;
        const uint32_t *rbm = j->bm_in ? j->bm_in + r * nb : bm;
        if (!j->bm_in) {
            uint32_t top = sq_block_amax_portable(x, nb, bm);
            if (top > SQ_LIMIT && j->bad < 0) j->bad = r;
            if (j->own_amax) j->amax[r] = sq_float((top < SQ_LIMIT ? top : SQ_LIMIT) << 16);
        }
        sq_row_portable(x, j->k, j->amax[r], rbm, j->codes + r * (j->k / 2), j->scales + r * nb,
                        j->values ? j->values + r * j->k : NULL);
    }
    free(bm);
    return 0;
}

#endif
