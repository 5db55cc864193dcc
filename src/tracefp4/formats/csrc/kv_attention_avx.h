/* The AVX-512 path of kv_attention.h: the attention the portable path defines (the header comment
 * there), over the same decoded K/V rows bit for bit, with two accumulations fused or paired:
 *
 * - q . k by vdpbf16ps. q is bf16 and every decoded K value is bf16-exact, so the K rows are packed
 *   to bf16 (their bits, no rounding) and each instruction adds, per float32 lane i, the products of
 *   elements 2i+1 and 2i of its two operands: both exact (8-bit significands), each added with one
 *   round-to-nearest-even. Four keys share an instruction, a 128-bit quarter each (kv_scores_avx),
 *   so a key has 4 lanes where the portable path has 16: lane i sums d = 8t + 2i, 8t + 2i + 1, D/4
 *   additions a lane, then a tree of the 4 ((l0 + l2) + (l1 + l3)) and the scale. The instruction
 *   reads bf16 subnormals as zero and flushes subnormal sums to zero.
 * - p . v by fused multiply-adds: acc[d] = fma(p_i, v_i[d], acc[d]), one rounding a term instead of
 *   the product's and the sum's.
 *
 * The error this adds, against the exact attention over the decoded rows: a score passes through
 * D/4 + 3 <= D + 1 roundings a term (the portable path D/16 + 5), and a numerator term through no
 * more than on the portable path (a fused term skips its product's rounding), so the relative
 * bounds tests/test_kv_attention.py derives (gamma_(D+1) on a score, gamma_(L+C+5) on the sums) hold
 * for both paths. The flushing adds an absolute error per score below
 * 2 scale D 2^-126 (1 + max|q| + max|k|): D inputs that may read as zero, each product then below
 * 2^-126 times the other factor, and D sums that may flush, each by less than 2^-126; the factor 2
 * covers the later roundings (the portable path's underflowing products, 2^-150 each, lie within
 * it too). Both paths are within that bound of the exact result, so within twice it of each other.
 * The result is deterministic: a fixed sequence of instructions whose roundings are defined, the
 * same bits on every call and at every thread count on a given machine.
 *
 * Laid out for throughput rather than as a transcription of the portable loops:
 *
 * - A row is decoded with one vector division instead of one per 16 elements: an E2M1 value is
 *   sign * 2^k * m with m in {1, 1.5} and k in {-1 .. 2}, and scaling by 2^k commutes with float32
 *   division's rounding and with the bf16 rounding wherever no value leaves the normal range, so
 *   bf16(fl32(e2m1 * scale) / S_enc) = sign * 2^k * bf16(fl32(m * scale) / S_enc). The row's 8 (or
 *   16) blocks' two quotients each fill the 16 lanes of one division; a row whose quotients come
 *   near either end of the normal range (|t| outside [2^-125, 2^125], or not finite) is decoded by
 *   the per-block division instead, so the values are the portable path's in every case.
 * - K rows are decoded straight to bf16 (a 32-word table per two 16-code blocks, one vpermw per 32
 *   codes: half the lookups and stores of float32 rows, which V keeps for p . v). The tables are
 *   built in bf16 bits: scaling by sign * 2^k is an addition to the sign and exponent fields of the
 *   quotient's bits when both it and the result are normal (the range above), so a table is one
 *   permutation of the quotients' words and one addition (kv_word_table_avx), 4% of the attention's
 *   time at 16K keys over the float32 tables it replaced. V rows take the same word tables and widen
 *   the looked-up words to float32 (vpunpck*wd with zeros: a bf16 word's float32 value, exact).
 *   Zero or negative quotients (a zero or a negative scale: the zero codes' signs then depend on it)
 *   take the float32 tables.
 * - The 16 keys of a chunk are scored side by side, four keys an instruction (kv_quad_row's layout,
 *   decoded straight into it by kv_decode_rows_vbmi), so a key's lane sums take a tree of 4 (10
 *   instructions a head and chunk where 16 lanes a key took 46): 6-13% of the attention.
 * - p . v keeps up to 128 output elements of a head in registers across the chunk's keys.
 *
 * Where a key's time goes (8 query heads a KV head of 128, one Zen 4 core, 4K-16K keys; each stage
 * timed alone): decoding its K row 16 ns and its V row 19 (of which 5.5 each the quotient pairs,
 * before kv_pairs2_avx took both rows' at once), q . k 17 (the tree 4 of it), softmax 7, p . v 21
 * (its 64 fused multiply-adds at one a cycle); together 66-70, the stages overlapping a little. It is bound by the vector instructions' count
 * (about two a cycle), not by memory. Decoding the next chunk in pieces between the current chunk's
 * q . k and p . v (double-buffered) measured 4% slower; so did p . v over eight heads at once and
 * broadcasts folded into the fused multiply-adds. Knocked out one at a time later (same machine,
 * 16K keys, 68-71 ns a key): the decode 25% of the time, p . v 27%, the score tree's shuffles 5%.
 * Measured no faster, and not kept: each group's softmax issued before any group's p . v (the
 * core overlaps them already), p . v 64 rather than 32 elements of four heads a pass (16
 * accumulators), the four-keys layout below by quarter stores of the natural rows (2-3% slower:
 * it is the decoding straight into the quarters that pays, 6-13%), one S_enc division
 * for a chunk's 16 rows (a gather of their amaxes), and both rows' quotient words by one
 * vcvtne2ps2bf16 (0.4-1.2% slower than two conversions and two lane permutations); constants
 * loaded from memory rather than set1 (GCC makes the same move-and-broadcast of them per row).
 */
#ifndef TFP4_KV_ATTENTION_AVX_H
#define TFP4_KV_ATTENTION_AVX_H
#include "kv_common.h"
#if defined(__x86_64__)

AVXINL float kv_tree16_avx(__m512 v) {
    __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 e = _mm_add_ps(c, _mm_movehl_ps(c, c)); /* lanes 0, 1: (c0 + c2), (c1 + c3) */
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}

/* Level 2's permutation of kv_tree16's pairing done for four vectors at once (kv_reduce4_avx): the
 * 128-bit quarters (x_i 1, x_i+4 0, x_i 3, x_i+4 2), against the blend's (x_i 0, x_i+4 1, x_i 2, x_i+4 3). */
static const int32_t KV_TREE_SWAP[16] = {4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27};

/* The K rows of a chunk for kv_scores_avx: four keys to a quad (keys 4j .. 4j+3), a quad's rows 8
 * elements at a time side by side, so that one vdpbf16ps scores four keys, a 128-bit quarter each:
 * key i's elements 8t .. 8t+7 at word (i / 4) * 4 dp + 32 t + 8 (i % 4). */
AVXINL uint16_t *kv_quad_row(uint16_t *kb, int64_t dp, int i) { return kb + (i / 4) * 4 * dp + (i % 4) * 8; }

/* Elements e .. e+31 of a key (bf16 words v) into its quad row kq. */
AVXINL void kv_store_quad_avx(uint16_t *kq, int64_t e, __m512i v) {
    _mm_storeu_si128((__m128i *)(kq + e * 4), _mm512_castsi512_si128(v));
    _mm_storeu_si128((__m128i *)(kq + e * 4 + 32), _mm512_extracti32x4_epi32(v, 1));
    _mm_storeu_si128((__m128i *)(kq + e * 4 + 64), _mm512_extracti32x4_epi32(v, 2));
    _mm_storeu_si128((__m128i *)(kq + e * 4 + 96), _mm512_extracti32x4_epi32(v, 3));
}

/* The 16 scores of a chunk from its four quads' lane sums (a[j] quarter q: key 4j + q's four lane
 * sums): each key's four lanes summed as (l0 + l2) + (l1 + l3), the lanes then put in key order. */
static const int32_t KV_QUAD_ORDER[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
AVXINL __m512 kv_tree4x16_avx(const __m512 *a) {
    const __m512 z0 = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, a[0], a[1]), _mm512_shuffle_ps(a[0], a[1], 0x4E));
    const __m512 z1 = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, a[2], a[3]), _mm512_shuffle_ps(a[2], a[3], 0x4E));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
    return _mm512_permutexvar_ps(_mm512_loadu_si512(KV_QUAD_ORDER), w);
}

/* float32 lanes -> bf16 values (round to nearest even on the bits; the lanes are finite). */
AVXINL __m512 kv_bf16_avx(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}

/* One block's table by its own division (the slow but general way). */
AVXINL __m512 kv_table_avx(float scale, __m512 s_enc) {
    return kv_bf16_avx(_mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(scale)), s_enc));
}

/* 16 code nibbles from 8 bytes as vpermps indices: lane 2i holds byte i (vpermps reads bits 0-3,
 * its low nibble), lane 2i+1 byte i >> 4 (the upper half of the 64-bit lane byte i << 28 fills). */
AVXINL __m512i kv_nibbles_avx(const uint8_t *codes) {
    const __m512i q = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)codes));
    return _mm512_or_si512(q, _mm512_slli_epi64(q, 28));
}

/* One packed row -> d float32 values, a division per block (any scales). */
AVX512 static void kv_decode_avx(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales, float s_enc1,
                                 float *row) {
    const __m512 s_enc = _mm512_set1_ps(s_enc1); /* 1 without an amax: dividing by it is exact */
    __m512 tbl = _mm512_setzero_ps();
    for (int64_t e = 0; e < j->d; e += 16) {
        if (e % j->fblock == 0) tbl = kv_table_avx(j->lut[scales[e / j->fblock]], s_enc);
        _mm512_storeu_ps(row + e, _mm512_permutexvar_ps(kv_nibbles_avx(codes + e / 2), tbl));
    }
}

/* E2M1 code c = sign * 2^k * m: the lane (0: m = 1, 8: m = 1.5) of its block's quotient pair and
 * the factor sign * 2^k (0 and -0 for the zero codes). */
static const int32_t KV_PAIR_LANE[16] = {0, 0, 0, 8, 0, 8, 0, 8, 0, 0, 0, 8, 0, 8, 0, 8};
static const float KV_PAIR_FACTOR[16] = {0.0f, 0.5f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f,
                                         -0.0f, -0.5f, -1.0f, -1.0f, -2.0f, -2.0f, -4.0f, -4.0f};

/* `count` (<= 8) block scales from their bytes in lanes 0 .. count-1 and again in lanes 8 .. (by
 * the bits, as scales16: E4M3 below 0x7F, E8M0 below 0xFF, where kv_scale_bits_match checked the
 * table), or through the table where a byte is outside that range. */
AVXINL __m512 kv_scales_avx(const kv_job_t *j, const uint8_t *scales, int count) {
    const __mmask16 m = (__mmask16)((1u << count) - 1u);
    const __m128i x = _mm_maskz_loadu_epi8(m, scales); /* the byte checks on these 16 bytes, not 16 dwords */
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x, x));
    const __mmask16 lanes = (__mmask16)(m | (m << 8));
    const int nv = j->fblock == 16;
    if (j->scale_bits && !_mm_mask_cmpge_epu8_mask(m, x, _mm_set1_epi8((char)(nv ? 0x7F : 0xFF)))) {
        if (nv) { /* lanes past count hold zero bytes: zero scales */
            __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bytes, 20)), _mm512_set1_ps(0x1p120f));
            const __mmask16 sub = _mm_mask_cmplt_epu8_mask(m, x, _mm_set1_epi8(8));
            if (sub) v = _mm512_mask_mul_ps(v, (__mmask16)(sub | sub << 8), _mm512_cvtepi32_ps(bytes), _mm512_set1_ps(0x1p-9f));
            return v;
        }
        __m512i bits = _mm512_slli_epi32(bytes, 23);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bytes, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
        return _mm512_maskz_mov_ps(lanes, _mm512_castsi512_ps(bits));
    }
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, bytes, j->lut, 4);
}

/* The quotient pairs of `count` (<= 8) blocks, before their bf16 rounding: lane i fl32(scale_i /
 * S_enc), lane 8 + i fl32(1.5 scale_i) / S_enc. Returns 0 where a quotient is not zero and outside
 * [2^-125, 2^125] in magnitude (or not finite): there scaling by 1/2 .. 4 could leave the normal
 * range; 2 where one of the blocks' quotients is zero or negative (a negative E4M3 byte: the zero
 * codes' signs then follow the scale's, which kv_word_table_avx's masking does not give); else 1. */
AVXINL int kv_pairs_avx(const kv_job_t *j, const uint8_t *scales, int count, __m512 s_enc, int divide, __m512 *quot) {
    __m512 t = kv_scales_avx(j, scales, count);
    t = _mm512_mask_mul_ps(t, 0xFF00, t, _mm512_set1_ps(1.5f)); /* exact: a scale has at most 4 significant bits */
    if (divide) t = _mm512_div_ps(t, s_enc);
    *quot = t;
    const __mmask16 m = (__mmask16)((1u << count) - 1u), lanes = (__mmask16)(m | m << 8);
    const __m512i bits = _mm512_castps_si512(t);
    /* the common case in two comparisons: every block's quotients positive and in range (signed, so
     * a negative one is not) */
    const __mmask16 low = _mm512_mask_cmpge_epi32_mask(lanes, bits, _mm512_set1_epi32(0x01000000));
    if (_mm512_mask_cmple_epi32_mask(low, bits, _mm512_set1_epi32(0x7e000000)) == lanes) return 1;
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 normal = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x01000000)) &
                             _mm512_cmple_epu32_mask(mag, _mm512_set1_epi32(0x7e000000));
    return (__mmask16)(normal | _mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512())) != 0xFFFF ? 0 : 2;
}

/* The upper 16-bit halves of two vectors' 32 floats (vpermt2w's indices): their bf16 bits when the
 * floats are bf16-exact, taken by a permutation (vcvtne2ps2bf16 would flush subnormals to zero). */
static const uint16_t KV_ODD_WORDS[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                          33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};

/* A decoded float32 row (bf16-exact values) -> its bf16 bits, zero-padded to dp: the upper halves
 * of the floats, taken by a permutation (no conversion instruction: those flush subnormals). */
AVXINL void kv_pack_bf16_avx(const float *row, int64_t d, uint16_t *out) {
    const __m512i idx = _mm512_loadu_si512(KV_ODD_WORDS);
    int64_t e = 0;
    for (; e + 32 <= d; e += 32)
        _mm512_storeu_si512(out + e, _mm512_permutex2var_epi16(_mm512_castps_si512(_mm512_loadu_ps(row + e)), idx,
                                                               _mm512_castps_si512(_mm512_loadu_ps(row + e + 16))));
    if (e < d) /* 16 left: the padding's 16 words stay the zeros kv_run allocated */
        _mm256_storeu_si256((__m256i *)(out + e), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(row + e)), 16)));
}

/* Block b's table from its quotient pairs: per code the pair lane its magnitude is a multiple of,
 * times sign * 2^k. */
AVXINL __m512 kv_pair_table_avx(__m512 pairs, int b) {
    const __m512i lane = _mm512_add_epi32(_mm512_loadu_si512(KV_PAIR_LANE), _mm512_set1_epi32(b));
    return _mm512_mul_ps(_mm512_permutexvar_ps(lane, pairs), _mm512_loadu_ps(KV_PAIR_FACTOR));
}

/* The values of `count` (<= 8) blocks of `groups` x 16 codes each from their quotient pairs: per
 * block its table, then a lookup per 16 codes. `groups` is a constant at each call, so the loops
 * unroll. */
AVXINL void kv_blocks_avx(const uint8_t *codes, __m512 pairs, int count, float *row, const int groups) {
#pragma GCC unroll 8
    for (int b = 0; b < count; b++) {
        const __m512 tbl = kv_pair_table_avx(pairs, b);
        for (int u = 0; u < groups; u++)
            _mm512_storeu_ps(row + (b * groups + u) * 16, _mm512_permutexvar_ps(kv_nibbles_avx(codes + (b * groups + u) * 8), tbl));
    }
}

/* 32 code nibbles from 16 bytes as vpermw indices into a 32-word table: word 2i holds byte i & 15,
 * word 2i+1 byte i >> 4 (dword i is byte i | byte i << 12, masked), plus `upper` (16 or 0) in the
 * words of bytes 8 .. 15: which half of the table they read. */
AVXINL __m512i kv_nibbles32_avx(const uint8_t *codes, int upper) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512i idx = _mm512_ternarylogic_epi32(x, _mm512_slli_epi32(x, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    return upper ? _mm512_mask_or_epi32(idx, 0xFF00, idx, _mm512_set1_epi32(0x00100010)) : idx;
}

/* kv_blocks_avx to bf16 (a 32-word table per two 16-code blocks, or per 32-code block: one vpermw
 * per 32 codes). */
AVXINL void kv_blocks_bf16_avx(const uint8_t *codes, __m512 pairs, int count, uint16_t *row, const int groups) {
    const __m512i odd = _mm512_loadu_si512(KV_ODD_WORDS);
    if (groups == 2) {
#pragma GCC unroll 8
        for (int b = 0; b < count; b++) {
            const __m512i t = _mm512_castps_si512(kv_pair_table_avx(pairs, b));
            _mm512_storeu_si512(row + b * 32, _mm512_permutexvar_epi16(kv_nibbles32_avx(codes + b * 16, 0),
                                                                       _mm512_permutex2var_epi16(t, odd, t)));
        }
        return;
    }
    int b = 0;
#pragma GCC unroll 4
    for (; b + 2 <= count; b += 2) {
        const __m512i t = _mm512_permutex2var_epi16(_mm512_castps_si512(kv_pair_table_avx(pairs, b)), odd,
                                                    _mm512_castps_si512(kv_pair_table_avx(pairs, b + 1)));
        _mm512_storeu_si512(row + b * 16, _mm512_permutexvar_epi16(kv_nibbles32_avx(codes + b * 8, 1), t));
    }
    if (b < count) { /* an odd last block: its 16 codes (8 bytes) as the lower half */
        const __m512i t = _mm512_castps_si512(kv_pair_table_avx(pairs, b));
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + b * 8)));
        const __m512i idx = _mm512_ternarylogic_epi32(x, _mm512_slli_epi32(x, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
        _mm256_storeu_si256((__m256i *)(row + b * 16),
                            _mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, _mm512_permutex2var_epi16(t, odd, t))));
    }
}

/* E2M1 code c = sign * 2^k * m as bf16 bits: the bits of its m's quotient (pair lane KV_PAIR_LANE[c])
 * plus k in the exponent field and the sign, modulo 2^16: exact where the quotient and the value are
 * normal, which kv_pairs_avx checked (|quotient| in [2^-125, 2^125], k in -1 .. 2). Word w of a
 * table is code w mod 16 of block b (w < 16) or b + 1; the zero codes are masked to 0 and get +-0. */
static const uint16_t KV_WORD_LANE[32] = {0, 0, 0, 8, 0, 8, 0, 8, 0, 0, 0, 8, 0, 8, 0, 8,
                                          1, 1, 1, 9, 1, 9, 1, 9, 1, 1, 1, 9, 1, 9, 1, 9};
static const uint16_t KV_WORD_OFFSET[32] = {0, 0xFF80, 0, 0, 0x80, 0x80, 0x100, 0x100,
                                            0x8000, 0x7F80, 0x8000, 0x8000, 0x8080, 0x8080, 0x8100, 0x8100,
                                            0, 0xFF80, 0, 0, 0x80, 0x80, 0x100, 0x100,
                                            0x8000, 0x7F80, 0x8000, 0x8000, 0x8080, 0x8080, 0x8100, 0x8100};

/* Blocks b and b + 1's 32-word table from the quotients' bf16 words (lanes as kv_pairs_avx's): two
 * instructions where kv_pair_table_avx takes five for the same values. */
AVXINL __m512i kv_word_table_avx(__m512i words, int b) {
    const __m512i lane = _mm512_add_epi16(_mm512_loadu_si512(KV_WORD_LANE), _mm512_set1_epi16((short)b));
    return _mm512_add_epi16(_mm512_maskz_permutexvar_epi16(0xFEFEFEFEu, lane, words), _mm512_loadu_si512(KV_WORD_OFFSET));
}

/* kv_blocks_bf16_avx through kv_word_table_avx (nonzero normal quotients only). */
AVXINL void kv_blocks_words_avx(const uint8_t *codes, __m512i words, int count, uint16_t *row, const int groups) {
    if (groups == 2) { /* 32-code blocks: the indices stay below 16, block b's half of the table */
#pragma GCC unroll 8
        for (int b = 0; b < count; b++)
            _mm512_storeu_si512(row + b * 32, _mm512_permutexvar_epi16(kv_nibbles32_avx(codes + b * 16, 0), kv_word_table_avx(words, b)));
        return;
    }
    int b = 0;
#pragma GCC unroll 4
    for (; b + 2 <= count; b += 2)
        _mm512_storeu_si512(row + b * 16, _mm512_permutexvar_epi16(kv_nibbles32_avx(codes + b * 8, 1), kv_word_table_avx(words, b)));
    if (b < count) { /* an odd last block: its 16 codes (8 bytes) read the lower half */
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + b * 8)));
        const __m512i idx = _mm512_ternarylogic_epi32(x, _mm512_slli_epi32(x, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
        _mm256_storeu_si256((__m256i *)(row + b * 16), _mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, kv_word_table_avx(words, b))));
    }
}

/* The dword order, per 128-bit lane L, of the code bytes 2L, 2L+1, 8+2L, 9+2L: vpermw then puts the
 * values of elements 4L .. 4L+3 in the words vpunpcklwd widens and 16+4L .. 16+4L+3 in those
 * vpunpckhwd widens, so the two widenings come out in element order. */
static const uint8_t KV_WIDEN_BYTES[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

/* 32 codes from 16 bytes looked up in a 32-word table (bytes 8 .. 15 in its upper half when `upper`)
 * -> 32 float32 values: a bf16 word widened is its float32 value. */
AVXINL void kv_widen32_avx(const uint8_t *codes, __m512i table, int upper, float *row) {
    const __m128i bytes = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)codes), _mm_loadu_si128((const __m128i *)KV_WIDEN_BYTES));
    const __m512i x = _mm512_cvtepu8_epi32(bytes);
    __m512i idx = _mm512_ternarylogic_epi32(x, _mm512_slli_epi32(x, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    if (upper) idx = _mm512_mask_or_epi32(idx, 0xCCCC, idx, _mm512_set1_epi32(0x00100010));
    const __m512i w = _mm512_permutexvar_epi16(idx, table);
    _mm512_storeu_si512(row, _mm512_unpacklo_epi16(_mm512_setzero_si512(), w));
    _mm512_storeu_si512(row + 16, _mm512_unpackhi_epi16(_mm512_setzero_si512(), w));
}

/* kv_blocks_avx through kv_word_table_avx (nonzero normal quotients only; an odd last 16-code block
 * through its float32 table). */
AVXINL void kv_blocks_words_f32_avx(const uint8_t *codes, __m512i words, __m512 quot, int count, float *row,
                                    const int groups) {
    if (groups == 2) {
#pragma GCC unroll 8
        for (int b = 0; b < count; b++) kv_widen32_avx(codes + b * 16, kv_word_table_avx(words, b), 0, row + b * 32);
        return;
    }
    int b = 0;
#pragma GCC unroll 4
    for (; b + 2 <= count; b += 2) kv_widen32_avx(codes + b * 8, kv_word_table_avx(words, b), 1, row + b * 16);
    if (b < count)
        _mm512_storeu_ps(row + b * 16, _mm512_permutexvar_ps(kv_nibbles_avx(codes + b * 8), kv_pair_table_avx(kv_bf16_avx(quot), b)));
}

/* One packed row -> d float32 values (`bf16` 0) or d bf16 values into `packed` (`bf16` 1), one
 * division per 8 blocks (the header comment's identity); a row it does not hold for goes to
 * kv_decode_avx (into `row`, then packed). The job's fields are read into locals once: the library
 * is built with -fno-strict-aliasing, so each store would otherwise reload them. */
AVXINL void kv_decode_row_avx(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales, float s_enc1, int divide,
                              float *row, uint16_t *packed, const int bf16) {
    const __m512 s_enc = _mm512_set1_ps(s_enc1);
    const int fblock = j->fblock;
    const int blocks = (int)(j->d / fblock);
    for (int b8 = 0; b8 < blocks; b8 += 8) {
        const int count = blocks - b8 < 8 ? blocks - b8 : 8;
        __m512 quot;
        const int ok = kv_pairs_avx(j, scales + b8, count, s_enc, divide, &quot);
        if (!ok) {
            kv_decode_avx(j, codes, scales, s_enc1, row);
            if (bf16) kv_pack_bf16_avx(row, j->d, packed);
            return;
        }
        if (ok == 1) {
            /* normal quotients: vcvtneps2bf16 rounds them as kv_bf16_avx does (it flushes subnormals only) */
            const __m512i words = _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(quot));
            if (bf16) kv_blocks_words_avx(codes + b8 * (fblock / 2), words, count, packed + b8 * fblock, fblock / 16);
            else kv_blocks_words_f32_avx(codes + b8 * (fblock / 2), words, quot, count, row + b8 * fblock, fblock / 16);
            continue;
        }
        const __m512 pairs = kv_bf16_avx(quot);
        if (bf16 && fblock == 16) kv_blocks_bf16_avx(codes + b8 * 8, pairs, count, packed + b8 * 16, 1);
        else if (bf16) kv_blocks_bf16_avx(codes + b8 * 16, pairs, count, packed + b8 * 32, 2);
        else if (fblock == 16) kv_blocks_avx(codes + b8 * 8, pairs, count, row + b8 * 16, 1);
        else kv_blocks_avx(codes + b8 * 16, pairs, count, row + b8 * 32, 2);
    }
}

/* A V row: d float32 values. */
AVX512 static void kv_decode_fast_avx(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales,
                                      const float *amax, float *row) {
    kv_decode_row_avx(j, codes, scales, amax ? sq_s_enc(*amax) : 1.0f, amax != NULL, row, NULL, 0);
}

/* A K row: d bf16 values (`tmp`, d floats, for the rows that take the per-block division). */
AVX512 static void kv_decode_bf16_avx(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales,
                                      const float *amax, float *tmp, uint16_t *packed) {
    kv_decode_row_avx(j, codes, scales, amax ? sq_s_enc(*amax) : 1.0f, amax != NULL, tmp, packed, 1);
}

/* kv_exp on 16 lanes, the same values: its operations, two of its steps by one instruction each
 * that gives the same bits (below; 1% of the attention). */
AVXINL __m512 kv_exp_avx(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    /* kv_exp's (t + 1.5 2^23) - 1.5 2^23: t rounded to the nearest integer, ties to even, as vrndscaleps
     * rounds it (|t| < 2^22 on the lanes kept), but for a -0 where t is in (-0.5, -0]: x - n c and
     * 2^n are then the same (x is not 0, or r comes out +0 either way after the second step) */
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    /* p 2^n by vscalefps: exact, as kv_exp's product by 2^n's bits (n >= -125 on the lanes kept, p
     * near 1: the result normal) */
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* The row length of the bf16 q and K rows: d rounded up to vdpbf16ps's 32 (the padding zero). */
static inline int64_t kv_padded(int64_t d) { return (d + 31) / 32 * 32; }

/* The chunk's 16 scores of `heads` (1, 2 or 4) query heads (bf16 q rows dp apart) into s[heads]: per
 * head and key 4 lane sums over d, lane i taking the pairs d = 8t + 2i, 8t + 2i + 1 by vdpbf16ps
 * (both products exact, each added with one rounding; the head's 8 elements broadcast to the four
 * quarters, the quads' rows as kv_quad_row lays them out), then kv_tree4x16 and the scale. All 16
 * keys at once (4 heads x 4 quads: 16 accumulators), each k load serving every head. A 16-lane sum
 * per key and a tree of 16, as before, took 46 instructions a head and chunk for its trees where
 * this takes 10 (the rows' quarter stores cost fewer). The rows are zero-padded to dp (a multiple of
 * 32) and rows of kb past the chunk's keys hold finite values whose lanes are not used. */
AVXINL void kv_scores_avx(const uint16_t *q, const uint16_t *kb, int64_t dp, float scale, const int heads, __m512 *s) {
    __m512 a[4][4];
    for (int h = 0; h < heads; h++)
        for (int jq = 0; jq < 4; jq++) a[h][jq] = _mm512_setzero_ps();
    for (int64_t t = 0; t < dp; t += 8) {
        __m512bh qv[4];
        for (int h = 0; h < heads; h++) qv[h] = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + h * dp + t)));
        for (int jq = 0; jq < 4; jq++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kb + jq * 4 * dp + t * 4);
            for (int h = 0; h < heads; h++) a[h][jq] = _mm512_dpbf16_ps(a[h][jq], qv[h], k);
        }
    }
    for (int h = 0; h < heads; h++) s[h] = _mm512_mul_ps(kv_tree4x16_avx(a[h]), _mm512_set1_ps(scale));
}

/* acc[e .. e + 16 nv) of `heads` query heads (rows d apart; weights p[h * 16 + i], alpha[h]):
 * acc * alpha + p_0 v_0 + ... + p_(n-1) v_(n-1), per element in that order, each term added by a
 * fused multiply-add (one rounding instead of two), held in registers across the keys; each v load
 * serves every head (nv * heads <= 16 accumulators). alpha NULL: every alpha 1, acc taken as it is
 * (acc * 1 is acc, bit for bit; the multiplications are on the pipes the multiply-adds need). */
AVXINL void kv_pv_avx(float *acc, const float *vb, int64_t d, const float *p, int n, const float *alpha, int64_t e,
                      const int nv, const int heads) {
    __m512 a[16];
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < nv; v++) {
            a[h * nv + v] = _mm512_loadu_ps(acc + h * d + e + 16 * v);
            if (alpha) a[h * nv + v] = _mm512_mul_ps(a[h * nv + v], _mm512_set1_ps(alpha[h]));
        }
    for (int i = 0; i < n; i++) {
        __m512 w[4];
        for (int h = 0; h < heads; h++) w[h] = _mm512_set1_ps(p[h * 16 + i]);
        for (int v = 0; v < nv; v++) {
            const __m512 x = _mm512_loadu_ps(vb + i * d + e + 16 * v);
            for (int h = 0; h < heads; h++) a[h * nv + v] = _mm512_fmadd_ps(w[h], x, a[h * nv + v]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + h * d + e + 16 * v, a[h * nv + v]);
}

/* The heads' accumulators over the chunk, 128 / heads, then 64 / heads, then 16 elements at a time. */
AVXINL void kv_pv_heads_avx(float *acc, const float *vb, int64_t d, const float *p, int n, const float *alpha,
                            const int heads) {
    int64_t e = 0;
    for (; e + 128 / heads <= d; e += 128 / heads) kv_pv_avx(acc, vb, d, p, n, alpha, e, 8 / heads, heads);
    for (; e + 64 / heads <= d; e += 64 / heads) kv_pv_avx(acc, vb, d, p, n, alpha, e, 4 / heads, heads);
    for (; e < d; e += 16) kv_pv_avx(acc, vb, d, p, n, alpha, e, 1, heads);
}

/* The softmax step of `heads` query heads over a chunk of n keys with scores s[heads]: updates m
 * and l, writes the weights into p[16 * heads] and the heads' alphas into alpha[heads]. The maximum
 * skips NaN lanes, as the portable comparison; the alphas take one kv_exp_avx for all the heads
 * (lane for lane kv_exp's operations, so kv_exp's values). Returns whether every alpha is 1. */
AVXINL int kv_softmax_avx(const __m512 *s, int n, float *m, float *l, float *p, float *alpha, const int heads) {
    const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    const __mmask16 lanes = (__mmask16)((1u << heads) - 1u);
    float mx[4];
    for (int h = 0; h < heads; h++) {
        const float top = _mm512_mask_reduce_max_ps(live & _mm512_cmp_ps_mask(s[h], s[h], _CMP_ORD_Q), s[h]);
        mx[h] = top > m[h] ? top : m[h];
    }
    int same = 1; /* no new maximum (most chunks): alpha = kv_exp(+0) = 1 exactly, no exp to compute */
    for (int h = 0; h < heads; h++) same &= mx[h] == m[h] && m[h] > -INFINITY;
    if (same) _mm512_mask_storeu_ps(alpha, lanes, _mm512_set1_ps(1.0f));
    else _mm512_mask_storeu_ps(alpha, lanes, kv_exp_avx(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, m),
                                                                      _mm512_maskz_loadu_ps(lanes, mx))));
    for (int h = 0; h < heads; h++) {
        const __m512 pv = _mm512_maskz_mov_ps(live, kv_exp_avx(_mm512_sub_ps(s[h], _mm512_set1_ps(mx[h]))));
        _mm512_storeu_ps(p + 16 * h, pv);
        m[h] = mx[h];
        l[h] = l[h] * alpha[h] + kv_tree16_avx(pv);
    }
    return same;
}

/* kv_softmax_avx for four heads, their reductions side by side: lane h * 4 + i of a vector is head
 * h's (quarter h), the maxima and the l trees reduced across the four heads' vectors at once by the
 * pairing kv_tree16 takes (for the sums: the same additions, so the same bits; for the
 * maxima any pairing gives the same value, up to the sign of a zero maximum, which no later value
 * depends on: s - m and m - m' differ only in zero signs then, and exp takes either zero to 1). About
 * 30 instructions of a group's chunk fewer than four lone reductions and their scalar round trips. */
static const int32_t KV_QUARTERS[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
static const int32_t KV_QUARTER_FIRST[16] = {0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12};

/* max (add 0) or sum (add 1) of each of four vectors' 16 lanes, into every lane of its quarter. */
AVXINL __m512 kv_reduce4_avx(const __m512 *x, const int add) {
#define KV_OP(a, b) (add ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b))
    const __m512 y0 = KV_OP(_mm512_mask_blend_ps(0xFF00, x[0], x[2]), _mm512_shuffle_f32x4(x[0], x[2], 0x4E));
    const __m512 y1 = KV_OP(_mm512_mask_blend_ps(0xFF00, x[1], x[3]), _mm512_shuffle_f32x4(x[1], x[3], 0x4E));
    __m512 z = KV_OP(_mm512_mask_blend_ps(0xF0F0, y0, y1), _mm512_permutex2var_ps(y0, _mm512_loadu_si512(KV_TREE_SWAP), y1));
    z = KV_OP(z, _mm512_shuffle_ps(z, z, 0x4E));
    return KV_OP(z, _mm512_shuffle_ps(z, z, 0xB1));
#undef KV_OP
}

/* Lanes 0, 4, 8, 12 into f[0 .. 3]. */
AVXINL void kv_store4_avx(float *f, __m512 v) {
    _mm_storeu_ps(f, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_loadu_si512(KV_QUARTER_FIRST), v)));
}

AVXINL int kv_softmax4_avx(const __m512 *s, int n, float *m, float *l, float *p, float *alpha) {
    const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    const __m512i quarters = _mm512_loadu_si512(KV_QUARTERS);
    __m512 x[4];
    for (int h = 0; h < 4; h++) /* NaN lanes skipped, as the portable comparison */
        x[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live & _mm512_cmp_ps_mask(s[h], s[h], _CMP_ORD_Q), s[h]);
    const __m512 mv = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_loadu_ps(m)));
    const __m512 mx = _mm512_max_ps(kv_reduce4_avx(x, 0), mv); /* top > m ? top : m */
    const int same = (__mmask16)(_mm512_cmp_ps_mask(mx, mv, _CMP_EQ_OQ) &
                                 _mm512_cmp_ps_mask(mv, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ)) == 0xFFFF;
    const __m512 av = same ? _mm512_set1_ps(1.0f) : kv_exp_avx(_mm512_sub_ps(mv, mx));
    kv_store4_avx(alpha, av);
    kv_store4_avx(m, mx);
    __m512 pv[4];
    for (int h = 0; h < 4; h++) {
        pv[h] = _mm512_maskz_mov_ps(live, kv_exp_avx(_mm512_sub_ps(s[h], _mm512_shuffle_f32x4(mx, mx, h * 0x55))));
        _mm512_storeu_ps(p + 16 * h, pv[h]);
    }
    const __m512 lv = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_loadu_ps(l)));
    kv_store4_avx(l, _mm512_add_ps(same ? lv : _mm512_mul_ps(lv, av), kv_reduce4_avx(pv, 1)));
    return same;
}

/* `heads` (1, 2 or 4) consecutive query heads from g over the decoded chunk: scores, softmax, p . v. */
AVXINL void kv_heads_avx(const kv_job_t *j, const uint16_t *q, const uint16_t *kb, const float *vb, int n, int64_t g,
                         float *m, float *l, float *acc, const int heads) {
    const int64_t d = j->d, dp = kv_padded(d);
    __m512 s[4];
    float p[64], alpha[4];
    kv_scores_avx(q + g * dp, kb, dp, j->scale, heads, s);
    const int same = heads == 4 ? kv_softmax4_avx(s, n, m + g, l + g, p, alpha)
                                : kv_softmax_avx(s, n, m + g, l + g, p, alpha, heads);
    kv_pv_heads_avx(acc + g * d, vb, d, p, n, same ? NULL : alpha, heads); /* acc * 1 is acc, bit for bit */
}

/* The item's G query rows (bf16, dp apart; the padding stays kv_run's zeros), its softmax state reset. */
AVXINL void kv_item_start_avx(const kv_job_t *j, int64_t row, int64_t h, uint16_t *q, float *acc, float *m, float *l) {
    const int64_t d = j->d, dp = kv_padded(d), g_count = j->hq / j->hkv;
    for (int64_t g = 0; g < g_count; g++) {
        memcpy(q + g * dp, j->q + (row * j->hq + h * g_count + g) * d, sizeof(uint16_t) * (size_t)d);
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(g_count * d));
}

/* Asks for the cache lines of rows r[0 .. n) (codes, scales, amaxes of K and V) ahead of their
 * decoding: a row is one or two lines, 256 bytes or more from the next row of the item, and the
 * work on a chunk is too long for the out-of-order window to reach a later chunk's loads. */
AVXINL void kv_prefetch_rows(const kv_job_t *j, const int64_t *r, int n) {
    const int64_t half = j->d / 2, nsc = j->d / j->fblock;
    for (int i = 0; i < n; i++) {
        for (int64_t b = 0; b < half; b += 64) {
            _mm_prefetch((const char *)(j->kc + r[i] * half + b), _MM_HINT_T0);
            _mm_prefetch((const char *)(j->vc + r[i] * half + b), _MM_HINT_T0);
        }
        _mm_prefetch((const char *)(j->ks + r[i] * nsc), _MM_HINT_T0);
        _mm_prefetch((const char *)(j->vs + r[i] * nsc), _MM_HINT_T0);
        if (j->ka) {
            _mm_prefetch((const char *)(j->ka + r[i]), _MM_HINT_T0);
            _mm_prefetch((const char *)(j->va + r[i]), _MM_HINT_T0);
        }
    }
}

/* How many chunks ahead of the one being decoded the rows are asked for (of 1, 2, 4 and 8, 2 measured
 * fastest at 16K keys, by a few percent). */
#define KV_AHEAD 2

/* kv_prefetch_rows for the chunk of keys k0 .. of sequence seq (len keys). */
AVXINL void kv_prefetch_chunk(const kv_job_t *j, int64_t seq, int64_t k0, int64_t len, int64_t h) {
    int64_t r[KV_CHUNK];
    const int n = len - k0 < KV_CHUNK ? (int)(len - k0) : KV_CHUNK;
    kv_chunk_rows(j, seq, k0, n, h, r);
    kv_prefetch_rows(j, r, n);
}

/* sq_s_enc of a K and a V row's amaxes in lanes 0 and 1, the same operations (min(2688 / amax,
 * FLT_MAX), a NaN staying; 1 where amax or that is 0): one division for the two. */
AVXINL __m128 kv_s_enc2_avx(float ka, float va) {
    const __m128 a = _mm_set_ps(1.0f, 1.0f, va, ka);
    __m128 s = _mm_div_ps(_mm_set1_ps(2688.0f), a);
    s = _mm_mask_mov_ps(s, _mm_cmp_ps_mask(_mm_set1_ps(FLT_MAX), s, _CMP_LT_OQ), _mm_set1_ps(FLT_MAX));
    const __mmask8 one = (__mmask8)(_mm_cmp_ps_mask(a, _mm_setzero_ps(), _CMP_EQ_OQ) | _mm_cmp_ps_mask(s, _mm_setzero_ps(), _CMP_EQ_OQ));
    return _mm_mask_mov_ps(s, one, _mm_set1_ps(1.0f));
}

/* Whether all 16 quotients are positive and within [2^-125, 2^125] (signed comparisons on the bits:
 * a negative one is not): the word tables' case. */
AVXINL int kv_normal_avx(__m512 t) {
    const __m512i bits = _mm512_castps_si512(t);
    const __mmask16 low = _mm512_cmpge_epi32_mask(bits, _mm512_set1_epi32(0x01000000));
    return _mm512_mask_cmple_epi32_mask(low, bits, _mm512_set1_epi32(0x7e000000)) == 0xFFFF;
}

/* kv_pairs_avx's words for 8 blocks of a K row and of a V row at once (NVFP4, E4M3 scales by their
 * bits, S_enc in lanes 0 and 1 of se): lanes 0-7 of one division K's scale_i / S_enc and 8-15 V's,
 * of the other the same for 1.5 scale_i, so the two rows share one byte check, one conversion and
 * the two divisions (2% of the attention over a row at a time). Returns 0 where either row is not
 * the word tables' case (kv_decode_row_avx then decodes both rows). */
AVXINL int kv_pairs2_avx(const uint8_t *ks, const uint8_t *vs, __m128 se, __m512i *wk, __m512i *wv) {
    const __m128i x = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)ks), _mm_loadl_epi64((const __m128i *)vs));
    if (_mm_cmpge_epu8_mask(x, _mm_set1_epi8(0x7F))) return 0;
    const __m512i bytes = _mm512_cvtepu8_epi32(x);
    __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bytes, 20)), _mm512_set1_ps(0x1p120f));
    const __mmask16 sub = _mm_cmplt_epu8_mask(x, _mm_set1_epi8(8));
    if (sub) t = _mm512_mask_mul_ps(t, sub, _mm512_cvtepi32_ps(bytes), _mm512_set1_ps(0x1p-9f));
    const __m512 s_enc = _mm512_mask_blend_ps(0xFF00, _mm512_broadcastss_ps(se), _mm512_broadcastss_ps(_mm_movehdup_ps(se)));
    const __m512 t1 = _mm512_div_ps(t, s_enc), t15 = _mm512_div_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.5f)), s_enc);
    if (!kv_normal_avx(t1) || !kv_normal_avx(t15)) return 0;
    const __m256i w1 = (__m256i)_mm512_cvtneps_pbh(t1), w15 = (__m256i)_mm512_cvtneps_pbh(t15);
    *wk = _mm512_zextsi256_si512(_mm256_permute2x128_si256(w1, w15, 0x20));
    *wv = _mm512_zextsi256_si512(_mm256_permute2x128_si256(w1, w15, 0x31));
    return 1;
}

/* Row r's K (bf16, into its quad row kq) and V (float32) rows through kv_pairs2_avx, 8 blocks at a time; 0 where a group
 * of blocks is not the word tables' case. */
AVXINL int kv_decode_pair_avx(const kv_job_t *j, int64_t r, __m128 se, uint16_t *kq, float *vb) {
    const int64_t half = j->d / 2, nsc = j->d / 16;
    for (int64_t b8 = 0; b8 < nsc; b8 += 8) {
        __m512i wk, wv;
        if (!kv_pairs2_avx(j->ks + r * nsc + b8, j->vs + r * nsc + b8, se, &wk, &wv)) return 0;
#pragma GCC unroll 4
        for (int b = 0; b < 8; b += 2)
            kv_store_quad_avx(kq, (b8 + b) * 16, _mm512_permutexvar_epi16(kv_nibbles32_avx(j->kc + r * half + (b8 + b) * 8, 1),
                                                                          kv_word_table_avx(wk, b)));
        kv_blocks_words_f32_avx(j->vc + r * half + b8 * 8, wv, _mm512_setzero_ps(), 8, vb + b8 * 16, 1);
    }
    return 1;
}

/* The AVX-512 path's functions that also use AVX512-VBMI's vpmultishiftqb (kv_has_vbmi says whether
 * the CPU has it: Cooper Lake has AVX512-BF16 without it). */
#define AVX512VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))

/* 1 if this CPU has AVX512-VBMI (TFP4_NO_VBMI builds the library without that path, to test the other). */
static int kv_has_vbmi(void) {
#if defined(TFP4_NO_VBMI)
    return 0;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi");
#endif
}

/* vpmultishiftqb's bit offsets into a qword of 8 code bytes (16 codes, code c at bits 4c .. 4c+3):
 * KV_SHIFT_DWORDS puts code i in the low byte of dword i's upper word (V: 16 float32 values, the
 * looked-up word in the upper half, the lower half word 0 of the table, which is +0). The bits above
 * the code's 4 are the next code's and are masked off. */
static const uint8_t KV_SHIFT_DWORDS[64] = {0, 0, 0,  0, 0, 0, 4,  0, 0, 0, 8,  0, 0, 0, 12, 0,
                                            0, 0, 16, 0, 0, 0, 20, 0, 0, 0, 24, 0, 0, 0, 28, 0,
                                            0, 0, 32, 0, 0, 0, 36, 0, 0, 0, 40, 0, 0, 0, 44, 0,
                                            0, 0, 48, 0, 0, 0, 52, 0, 0, 0, 56, 0, 0, 0, 60, 0};

/* The chunk's n K rows (bf16, dp apart, through the float32 row `tmp`) and V rows (float32) of
 * rows r, decoded one row at a time with the next chunks' row `ahead[i]` asked for meanwhile: a
 * chunk's 50-odd lines at once measured 7-10% slower (more misses in flight than the core tracks). */
#define KV_DECODE_ROWS(NAME, TARGET, PAIR)                                                                      \
    TARGET static void NAME(const kv_job_t *j, const int64_t *r, int n, const int64_t *ahead, int n_ahead, uint16_t *kb, \
                            float *vb, float *tmp) {                                                                 \
        const int64_t d = j->d, dp = kv_padded(d), half = d / 2, nsc = d / j->fblock;                               \
        const int paired = j->ka && j->fblock == 16 && j->scale_bits && nsc % 8 == 0;                                \
        uint16_t *nat = (uint16_t *)(tmp + d); /* a K row in element order, before its quad row */                   \
        for (int i = 0; i < n; i++) {                                                                                \
            if (i < n_ahead) kv_prefetch_rows(j, ahead + i, 1);                                                      \
            const __m128 se = j->ka ? kv_s_enc2_avx(j->ka[r[i]], j->va[r[i]]) : _mm_set1_ps(1.0f);                   \
            uint16_t *kq = kv_quad_row(kb, dp, i);                                                                   \
            if (paired && PAIR(j, r[i], se, kq, vb + i * d)) continue;                                               \
            kv_decode_row_avx(j, j->kc + r[i] * half, j->ks + r[i] * nsc, _mm_cvtss_f32(se), j->ka != NULL, tmp,     \
                              nat, 1);                                                                               \
            for (int64_t t = 0; t < d / 8; t++) /* into the quad row (its padding stays kv_run's zeros) */           \
                _mm_storeu_si128((__m128i *)(kq + 32 * t), _mm_loadu_si128((const __m128i *)(nat + 8 * t)));         \
            kv_decode_row_avx(j, j->vc + r[i] * half, j->vs + r[i] * nsc, _mm_cvtss_f32(_mm_movehdup_ps(se)),        \
                              j->ka != NULL, vb + i * d, NULL, 0);                                                   \
        }                                                                                                            \
        if (n_ahead > n) kv_prefetch_rows(j, ahead + n, n_ahead - n);                                                \
    }
/* (one function a pair decoder: a VBMI function inlines into a VBMI one only) */
KV_DECODE_ROWS(kv_decode_rows_avx, AVX512, kv_decode_pair_avx)

/* The four-keys layout decoded straight into its quarters (kv_quad_row), four rows at a time, the
 * table indices by vpmultishiftqb (AVX512-VBMI): a group of 8 elements of four keys is one lookup in
 * a 64-word table of the four keys' blocks (vpermt2w; a key's 2-block tables, kv_word_table_avx,
 * paired by 128-bit lanes), where quarter stores of each row's 32-element lookups cost more than the
 * shorter score tree saves. Offsets: word w (quarter q = w / 8, j = w % 8) takes code 8g + j of its
 * qword (key q's 8 code bytes of the block), g the group's half of the block; KV_QUAD_KEY then adds
 * 16 q (which key's table: bit 4 its half of a register, bit 5 the register). */
static const uint8_t KV_SHIFT_QUAD[2][64] = {
    {0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28, 0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28,
     0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28, 0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28},
    {32, 32, 36, 36, 40, 40, 44, 44, 48, 48, 52, 52, 56, 56, 60, 60, 32, 32, 36, 36, 40, 40, 44, 44, 48, 48, 52, 52, 56, 56, 60, 60,
     32, 32, 36, 36, 40, 40, 44, 44, 48, 48, 52, 52, 56, 56, 60, 60, 32, 32, 36, 36, 40, 40, 44, 44, 48, 48, 52, 52, 56, 56, 60, 60}};
static const uint16_t KV_QUAD_KEY[32] = {0,  0,  0,  0,  0,  0,  0,  0,  16, 16, 16, 16, 16, 16, 16, 16,
                                         32, 32, 32, 32, 32, 32, 32, 32, 48, 48, 48, 48, 48, 48, 48, 48};

/* The chunk's rows as kv_decode_rows_avx decodes them (the same values, the same layout). */
AVX512VBMI static void kv_decode_rows_vbmi(const kv_job_t *j, const int64_t *r, int n, const int64_t *ahead, int n_ahead,
                                           uint16_t *kb, float *vb, float *tmp) {
    const int64_t d = j->d, dp = kv_padded(d), half = d / 2, nsc = d / j->fblock;
    if (!(j->ka && j->fblock == 16 && j->scale_bits && nsc % 8 == 0)) {
        kv_decode_rows_avx(j, r, n, ahead, n_ahead, kb, vb, tmp);
        return;
    }
    uint16_t *nat = (uint16_t *)(tmp + d);
    const __m512i sd = _mm512_loadu_si512(KV_SHIFT_DWORDS);
    const __m512i sq0 = _mm512_loadu_si512(KV_SHIFT_QUAD[0]), sq1 = _mm512_loadu_si512(KV_SHIFT_QUAD[1]);
    const __m512i keyoff = _mm512_loadu_si512(KV_QUAD_KEY), nib = _mm512_set1_epi16(0x000F);
    const __m512i nib_hi = _mm512_set1_epi32(0x000F0000), upper_hi = _mm512_set1_epi32(0x00100000);
    for (int i0 = 0; i0 < n; i0 += 4) {
        const int m = n - i0 < 4 ? n - i0 : 4;
        __m128 se[4];
        for (int q = 0; q < m; q++) {
            if (i0 + q < n_ahead) kv_prefetch_rows(j, ahead + i0 + q, 1);
            se[q] = kv_s_enc2_avx(j->ka[r[i0 + q]], j->va[r[i0 + q]]);
        }
        int ok = m == 4;
        for (int64_t b8 = 0; ok && b8 < nsc; b8 += 8) {
            __m512i wk[4], wv[4];
            for (int q = 0; ok && q < 4; q++)
                ok = kv_pairs2_avx(j->ks + r[i0 + q] * nsc + b8, j->vs + r[i0 + q] * nsc + b8, se[q], &wk[q], &wv[q]);
            if (!ok) break;
            for (int q = 0; q < 4; q++) { /* V rows: 3 instructions a 16 float32 values straight from vpermw */
                const uint8_t *vc = j->vc + r[i0 + q] * half + b8 * 8;
                float *vrow = vb + (i0 + q) * d;
#pragma GCC unroll 4
                for (int b = 0; b < 8; b += 2) {
                    const __m512i tv = kv_word_table_avx(wv[q], b);
                    int64_t c0, c1;
                    memcpy(&c0, vc + b * 8, 8);
                    memcpy(&c1, vc + b * 8 + 8, 8);
                    const __m512i v0 = _mm512_and_si512(_mm512_multishift_epi64_epi8(sd, _mm512_set1_epi64(c0)), nib_hi);
                    const __m512i v1 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(sd, _mm512_set1_epi64(c1)), nib_hi, upper_hi, 0xEA);
                    _mm512_storeu_si512(vrow + (b8 + b) * 16, _mm512_permutexvar_epi16(v0, tv));
                    _mm512_storeu_si512(vrow + (b8 + b) * 16 + 16, _mm512_permutexvar_epi16(v1, tv));
                }
            }
            uint16_t *kq = kb + (i0 / 4) * 4 * dp;
            const uint8_t *c0 = j->kc + r[i0] * half + b8 * 8, *c1 = j->kc + r[i0 + 1] * half + b8 * 8;
            const uint8_t *c2 = j->kc + r[i0 + 2] * half + b8 * 8, *c3 = j->kc + r[i0 + 3] * half + b8 * 8;
#pragma GCC unroll 4
            for (int b = 0; b < 8; b += 2) {
                const __m512i t0 = kv_word_table_avx(wk[0], b), t1 = kv_word_table_avx(wk[1], b);
                const __m512i t2 = kv_word_table_avx(wk[2], b), t3 = kv_word_table_avx(wk[3], b);
                /* block b of keys 0, 1 | 2, 3 (the tables' lower halves), then block b + 1 (upper) */
                const __m512i lo01 = _mm512_shuffle_i64x2(t0, t1, 0x44), lo23 = _mm512_shuffle_i64x2(t2, t3, 0x44);
                const __m512i hi01 = _mm512_shuffle_i64x2(t0, t1, 0xEE), hi23 = _mm512_shuffle_i64x2(t2, t3, 0xEE);
                for (int blk = 0; blk < 2; blk++) {
                    const int64_t o = (b + blk) * 8;
                    int64_t x0, x1, x2, x3;
                    memcpy(&x0, c0 + o, 8);
                    memcpy(&x1, c1 + o, 8);
                    memcpy(&x2, c2 + o, 8);
                    memcpy(&x3, c3 + o, 8);
                    __m512i src = _mm512_set1_epi64(x0);
                    src = _mm512_mask_mov_epi64(src, 0x0C, _mm512_set1_epi64(x1));
                    src = _mm512_mask_mov_epi64(src, 0x30, _mm512_set1_epi64(x2));
                    src = _mm512_mask_mov_epi64(src, 0xC0, _mm512_set1_epi64(x3));
                    for (int g = 0; g < 2; g++) {
                        const __m512i idx = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(g ? sq1 : sq0, src), nib, keyoff, 0xEA);
                        const int64_t t = 2 * (b8 + b + blk) + g;
                        _mm512_storeu_si512(kq + 32 * t, blk ? _mm512_permutex2var_epi16(hi01, idx, hi23) : _mm512_permutex2var_epi16(lo01, idx, lo23));
                    }
                }
            }
        }
        if (ok) continue;
        for (int q = 0; q < m; q++) { /* any row outside the word tables' case: each row as kv_decode_row_avx decodes it */
            const int i = i0 + q;
            uint16_t *kq = kv_quad_row(kb, dp, i);
            kv_decode_row_avx(j, j->kc + r[i] * half, j->ks + r[i] * nsc, _mm_cvtss_f32(se[q]), 1, tmp, nat, 1);
            for (int64_t t = 0; t < d / 8; t++) _mm_storeu_si128((__m128i *)(kq + 32 * t), _mm_loadu_si128((const __m128i *)(nat + 8 * t)));
            kv_decode_row_avx(j, j->vc + r[i] * half, j->vs + r[i] * nsc, _mm_cvtss_f32(_mm_movehdup_ps(se[q])), 1, vb + i * d, NULL, 0);
        }
    }
    if (n_ahead > n) kv_prefetch_rows(j, ahead + n, n_ahead - n);
}

/* One (query row, KV head) item on the AVX-512 path (d a multiple of 16; mem zeroed by kv_run). */
AVX512 static void kv_item_avx(const kv_job_t *j, int64_t row, int64_t h, float *mem) {
    const int64_t d = j->d, g_count = j->hq / j->hkv, seq = j->q_seq[row], len = j->q_len[row];
    /* kv_run's regions: q and kb hold bf16 rows (half the floats' room, padding included), tmp the
     * two extra rows at the end */
    uint16_t *q = (uint16_t *)mem, *kb = (uint16_t *)(mem + 2 * g_count * d);
    float *acc = mem + g_count * d, *vb = mem + (2 * g_count + KV_CHUNK) * d, *tmp = vb + KV_CHUNK * d;
    float m[KV_MAX_GROUP], l[KV_MAX_GROUP];
    int64_t r[KV_CHUNK], ahead[KV_CHUNK];
    kv_item_start_avx(j, row, h, q, acc, m, l);
    for (int64_t k0 = 0; k0 < KV_AHEAD * KV_CHUNK && k0 < len; k0 += KV_CHUNK) kv_prefetch_chunk(j, seq, k0, len, h);
    for (int64_t k0 = 0; k0 < len; k0 += KV_CHUNK) {
        const int n = len - k0 < KV_CHUNK ? (int)(len - k0) : KV_CHUNK;
        const int64_t later = k0 + KV_AHEAD * KV_CHUNK;
        const int n_ahead = later >= len ? 0 : len - later < KV_CHUNK ? (int)(len - later) : KV_CHUNK;
        if (n_ahead) kv_chunk_rows(j, seq, later, n_ahead, h, ahead);
        kv_chunk_rows(j, seq, k0, n, h, r);
        (j->vbmi ? kv_decode_rows_vbmi : kv_decode_rows_avx)(j, r, n, ahead, n_ahead, kb, vb, tmp);
        int64_t g = 0;
        for (; g + 4 <= g_count; g += 4) kv_heads_avx(j, q, kb, vb, n, g, m, l, acc, 4);
        for (; g + 2 <= g_count; g += 2) kv_heads_avx(j, q, kb, vb, n, g, m, l, acc, 2);
        if (g < g_count) kv_heads_avx(j, q, kb, vb, n, g, m, l, acc, 1);
    }
    float *out = j->out + (row * j->hq + h * g_count) * d;
    for (int64_t g = 0; g < g_count; g++) {
        const __m512 lv = _mm512_set1_ps(l[g]);
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_ps(out + g * d + e, len ? _mm512_div_ps(_mm512_loadu_ps(acc + g * d + e), lv) : _mm512_setzero_ps());
    }
}
#endif
#endif
