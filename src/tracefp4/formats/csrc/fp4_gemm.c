/* Grouped GEMM of bf16 activations with packed FP4 weights (NVFP4 or MXFP4), for the CPU.
 *
 *   out[r, n] = bf16_rne( fl32( sum_k x[r, k] * w_e[n, k] ) / divisor[e] )   for rows r of expert e
 *
 * where w_e[n, k] = value(code) * scale(block) is the weight without its global scale: the E2M1
 * value of the 4-bit code times the block scale (E4M3 for NVFP4, E8M0 for MXFP4, as float32 values
 * through `lut`), and divisor[e] the expert's FP32 global encode scale S_enc (1 for MXFP4).
 *
 * Exactness (why the result is the GEMM of the exact dequantized operands up to accumulation
 * order): the product of a bf16 activation and an E2M1 value is exact in float32 (8 + 2 significant
 * bits), and so is its product with a block scale (+ 4 bits), so the only roundings are those of the
 * float32 additions, of the division and of the final bf16 rounding (round-to-nearest-even,
 * subnormals kept, NaN -> 0x7FC0, as torch's cast).
 *
 * Kernel layout of the codes (tracefp4.formats.cgemm.kernel_layout; two codes per byte as in the
 * standard layout, the bytes permuted): the blocks of a weight row are taken 16 at a time (a
 * "super-group" q; the last one may have fewer, its missing lanes zero), each super-group as
 * G = block/4 groups p of 32 bytes, and byte 2l+i of group p holds elements 4p+2i and 4p+2i+1 of
 * block 16q+l (low nibble first), i.e. standard byte (block/2)(16q+l) + 2p + i. Zero-extended to
 * words, the low nibbles are 32 "even" and the high nibbles 32 "odd" code indices whose word pairs
 * 2l, 2l+1 both belong to block 16q+l: lane l of every vdpbf16ps of the super-group sums products of
 * block 16q+l only, so the block scales multiply the super-group's float32 partial sums lane by lane,
 * once, and the E2M1 table (vpermw) never changes. The rows of 4 consecutive output columns (a tile)
 * are interleaved group by group, so a tile's codes are read as one sequential stream. The
 * activation rows are permuted the same way once per call (`permute_row`).
 *
 * Layout (row-major, contiguous): x [R, K] bf16 bits, rows grouped by expert, expert e owning rows
 * offsets[e] .. offsets[e+1]-1; codes [E, N/4, S*G, 4, 32] bytes (S = ceil(K/block/16) super-groups:
 * tile, group, column, byte); scales [E, N, K/block] (one byte per block); divisor [E]; out [R, N]
 * bf16 bits. The routed entry (tfp4_routed_gemm) takes the (token, slot) pairs' expert ids instead of
 * grouped rows and offsets: it groups the pairs by expert itself, reads each pair's activation row
 * where it is and writes its output row in pair order (no gather or scatter around the call).
 *
 * Two implementations, chosen at run time: AVX-512 BF16 and portable C (float32 products and sums).
 * The AVX-512 one streams the codes through vdpbf16ps for experts with up to STREAM_ROWS rows
 * (float32 accumulation; DAZ/FTZ, so operands and products below 2^-126 count as zero) and, for
 * more rows, decodes each tile once: NVFP4 to scaled bf16 weights (exact: see decode_tile)
 * multiplied by vdpbf16ps, MXFP4 to scaled float32 weights multiply-added in float32. They differ only
 * in the order and grouping of the float32 additions. Work is split over (expert, 4-column tile)
 * items, contiguous ranges per thread of a persistent pool; each output is computed by one thread in
 * a fixed order, so the result does not depend on the thread count.
 */
#include <pthread.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define NT 4 /* output columns per work item */
#ifndef STREAM_ROWS
/* experts with more rows decode each tile once; with the scale prefetch the streaming path wins up
 * to about 24 rows (1.6x at 12 rows, 1.1-1.2x at 16, even at 24, 0.9x at 32: bandwidth-preset shapes,
 * interleaved A/B of the two builds, 1 thread) */
#define STREAM_ROWS 20
#endif

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

typedef struct {
    const uint16_t *x;
    const uint8_t *codes;
    const uint8_t *scales;
    const float *lut;
    const float *divisor;
    uint16_t *out;
    int64_t n, k;
    int block;
    int64_t supers, cbytes; /* super-groups per row, code bytes per row */
    /* non-empty experts: expert index and first/last row */
    const int64_t *ex, *ex_lo, *ex_hi;
    int64_t tiles; /* column tiles per expert */
    int64_t item_lo, item_hi;
    int avx;
    /* routed calls (tfp4_routed_gemm): grouped row r is (token, slot) pair rowmap[r], which reads
     * x row rowmap[r] / fanout and writes out row rowmap[r]; NULL: row r reads and writes row r */
    const int64_t *rowmap;
    int64_t fanout;
} job_t;

static inline int64_t in_row(const job_t *j, int64_t r) { return j->rowmap ? j->rowmap[r] / j->fanout : r; }
static inline int64_t out_row(const job_t *j, int64_t r) { return j->rowmap ? j->rowmap[r] : r; }

static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch */
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

static inline float bf16_value(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* The code of element i of column c of a tile whose codes start at `tile` (kernel layout). */
static inline int code_at(const uint8_t *tile, int c, int64_t i, int block) {
    int64_t b = i / block, w = i % block, q = b / 16, l = b % 16, p = w / 4, r = w % 4;
    uint8_t byte = tile[((q * (block / 4) + p) * NT + c) * 32 + 2 * l + r / 2];
    return (byte >> (4 * (r % 2))) & 0xF;
}

/* --- portable ----------------------------------------------------------------------------------- */

static void tile_portable(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, float *w) {
    const int64_t k = j->k, n = j->n, nb = k / j->block;
    const uint8_t *tile = j->codes + (e * j->tiles + n0 / NT) * NT * j->cbytes;
    for (int c = 0; c < NT; c++) {
        const uint8_t *sr = j->scales + (e * n + n0 + c) * nb;
        for (int64_t i = 0; i < k; i++) w[c * k + i] = E2M1[code_at(tile, c, i, j->block)] * j->lut[sr[i / j->block]];
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = j->x + in_row(j, r) * k;
        for (int c = 0; c < NT; c++) {
            const float *wc = w + c * k;
            float lane[16] = {0};
            for (int64_t i = 0; i < k; i++) lane[(i >> 1) & 15] += bf16_value(xr[i]) * wc[i];
            for (int s = 8; s > 0; s >>= 1)
                for (int l = 0; l < s; l++) lane[l] += lane[l + s];
            j->out[out_row(j, r) * n + n0 + c] = bf16_rne(lane[0] / j->divisor[e]);
        }
    }
}

/* --- AVX-512 BF16 -------------------------------------------------------------------------------- */

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AVXINL AVX512 static inline __attribute__((always_inline))

/* vpermw reads the low 5 bits of an index: the table holds the 16 E2M1 values twice, so a low
 * nibble can be looked up without masking off the high one. */
static const uint16_t E2M1_BF16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                       0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
                                       0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                       0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

/* The 16 (or `count` < 16) block scales of one super-group as float32 lanes: E4M3 by its bits
 * (normal: exponent rebias by a multiplication with 2^120, exact; subnormal: mantissa * 2^-9),
 * E8M0 as 2^(b-127) (b = 0: 2^-127). */
AVXINL __m512 scales16(const uint8_t *sr, int count, int nv) {
    __mmask16 m = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, sr));
    if (nv) { /* block scales are never negative (the quantizer's amax), so only the magnitude bits */
        __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 20)), _mm512_set1_ps(0x1p120f));
        __mmask16 sub = _mm512_mask_cmplt_epi32_mask(m, b, _mm512_set1_epi32(8));
        if (__builtin_expect(sub != 0, 0)) /* subnormal E4M3: mantissa * 2^-9 */
            v = _mm512_mask_mul_ps(v, sub, _mm512_cvtepi32_ps(b), _mm512_set1_ps(0x1p-9f));
        return v;
    }
    __m512i bits = _mm512_slli_epi32(b, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    return _mm512_mask_mov_ps(_mm512_setzero_ps(), m, _mm512_castsi512_ps(bits));
}

/* A row in the kernel order: per super-group and group, [32 even | 32 odd] elements (zero where a
 * super-group has fewer than 16 blocks). */
static void permute_row(const uint16_t *x, int64_t k, int block, uint16_t *out) {
    const int64_t nb = k / block, g = block / 4, supers = (nb + 15) / 16;
    for (int64_t q = 0; q < supers; q++)
        for (int64_t p = 0; p < g; p++) {
            uint16_t *o = out + (q * g + p) * 64;
            for (int l = 0; l < 16; l++) {
                int64_t b = 16 * q + l;
                for (int i = 0; i < 2; i++) {
                    const uint16_t *src = x + b * block + 4 * p + 2 * i;
                    o[2 * l + i] = b < nb ? src[0] : 0;
                    o[32 + 2 * l + i] = b < nb ? src[1] : 0;
                }
            }
        }
}

/* The 64 bf16 weights of one column's group: even elements (low nibbles) and odd ones (high). */
AVXINL void decode_group(const uint8_t *codes32, __m512i table, __m512bh *we, __m512bh *wo) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes32));
    *we = (__m512bh)_mm512_permutexvar_epi16(w, table);
    *wo = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
}

/* Every group of one tile decoded to scaled weights into `out` ([group][column][64]: even elements
 * 0-15 and 16-31, odd 0-15 and 16-31 of the group, the order of the permuted rows), for tiles with
 * many rows, which then multiply from L1 instead of decoding again. An element's block is its word's
 * lane: word i of the 32 even (or odd) ones is in block i/2 of the super-group.
 * NVFP4 (`nv`) as bf16 for the dot products; exact: an E2M1 value (2 significant bits) times an E4M3
 * scale (4 bits, 2^-9 .. 448) is a normal bf16 (8 bits, exponent from -126). MXFP4 as float32, which
 * then multiply-add in float32 (exact products): an E8M0 scale below 2^-125 would make a bf16
 * subnormal, which vdpbf16ps reads as zero. */
AVX512 static void decode_tile(const job_t *j, int64_t e, int64_t n0, void *out, int nv) {
    const __m512i table = _mm512_loadu_si512(E2M1_BF16);
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const uint8_t *tile = j->codes + (e * j->tiles + n0 / NT) * NT * j->cbytes;
    const int64_t g = j->block / 4, nb = j->k / j->block;
    for (int64_t q = 0; q < j->supers; q++)
        for (int c = 0; c < NT; c++) {
            const __m512 s = scales16(j->scales + (e * j->n + n0 + c) * nb + 16 * q, (int)(nb - 16 * q), nv);
            const __m512 slo = _mm512_permutexvar_ps(lo_idx, s), shi = _mm512_permutexvar_ps(hi_idx, s);
            for (int64_t p = 0; p < g; p++) {
                const int64_t at = (q * g + p) * NT + c;
                __m512bh we, wo;
                decode_group(tile + 32 * at, table, &we, &wo);
                const __m512 e0 = _mm512_mul_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)we)), slo);
                const __m512 e1 = _mm512_mul_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)we, 1)), shi);
                const __m512 o0 = _mm512_mul_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)wo)), slo);
                const __m512 o1 = _mm512_mul_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)wo, 1)), shi);
                if (nv) {
                    uint16_t *o = (uint16_t *)out + 64 * at;
                    _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                    _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(o1, o0));
                } else {
                    float *o = (float *)out + 64 * at;
                    _mm512_store_ps(o, e0);
                    _mm512_store_ps(o + 16, e1);
                    _mm512_store_ps(o + 32, o0);
                    _mm512_store_ps(o + 48, o1);
                }
            }
        }
}

/* A permuted bf16 row (permute_row) in float32, the same order. */
AVX512 static void row_f32(const uint16_t *xs, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(xs + i))));
}

/* The NT x rows (rows <= 4) outputs of a block: each accumulator summed over its 16 lanes, divided
 * by the expert's divisor and rounded to bf16. The 16 horizontal sums are done together, as a
 * transpose: each level adds lanes l and l + s (s = 8, 4, 2, 1) of every accumulator at once, the
 * pairing of _mm512_reduce_add_ps and of the portable path, so the sums are bitwise theirs; one
 * accumulator at a time cost as much as the dot products at K = 256-512 (epilogue ~9 shuffles and
 * adds plus a scalar divide and rounding per output). Lane 4m + c of the result is row m, column c. */
AVXINL void store_rows(const job_t *j, int64_t e, int64_t n0, int64_t r, int rows, __m512 acc[][NT]) {
    __m512 a[16];
    for (int c = 0; c < NT; c++)
        for (int m = 0; m < 4; m++) a[4 * c + m] = m < rows ? acc[m][c] : _mm512_setzero_ps();
    __m512 b[8], q[4], d[2];
    for (int i = 0; i < 8; i++) /* s = 8: [a0 lanes 0-7 + 8-15 | a1 lanes 0-7 + 8-15] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* s = 4: quarter t of q[i] holds a[4i + t] */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* s = 2 */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44), _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xEE));
    /* s = 1: lane 4t + i is a[4i + t], i.e. column i, row t */
    __m512 v = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    v = _mm512_div_ps(v, _mm512_set1_ps(j->divisor[e]));
    /* bf16 round-to-nearest-even in integers (vcvtneps2bf16 would flush subnormals), NaN -> 0x7FC0 */
    __m512i bits = _mm512_castps_si512(v);
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                   _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))));
    bits = _mm512_mask_mov_epi32(_mm512_srli_epi32(bits, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    uint16_t h[16];
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtepi32_epi16(bits));
    for (int m = 0; m < rows; m++) memcpy(j->out + out_row(j, r + m) * j->n + n0, h + 4 * m, NT * sizeof(uint16_t));
}

/* Streaming (up to two rows): the codes decoded in registers as they are read, sums per block
 * scaled once per super-group. Sixteen independent accumulation chains keep the dot-product units
 * busy despite their latency: per column even and odd elements and, for one row, odd and even
 * groups apart. */
#define DEFINE_STREAM(NAME, ROWS, NV, G)                                                                       \
    AVX512 static void NAME(const job_t *j, int64_t e, int64_t n0, int64_t r, const uint16_t *xs) {           \
        const int64_t nb = j->k / j->block, rowlen = j->supers * G * 64;                                     \
        const __m512i table = _mm512_loadu_si512(E2M1_BF16);                                                   \
        const uint8_t *tile = j->codes + (e * j->tiles + n0 / NT) * NT * j->cbytes;                           \
        __m512 acc[ROWS][NT];                                                                                  \
        for (int m = 0; m < ROWS; m++)                                                                         \
            for (int c = 0; c < NT; c++) acc[m][c] = _mm512_setzero_ps();                                      \
        /* the next tile's scale bytes (its NT rows are contiguous): the codes stream is prefetched     \
         * below and by the hardware, but the scales are a second stream read once per super-group,   \
         * and their cache misses stalled every tile (2x at 1-4 rows: interleaved A/B, 1 thread)     */ \
        for (int64_t o = 0; o < NT * nb; o += 64)                                                              \
            _mm_prefetch((const char *)(j->scales + (e * j->n + n0 + NT) * nb + o), _MM_HINT_T0);              \
        for (int64_t q = 0; q < j->supers; q++) {                                                              \
            __m512 pe[2][ROWS][NT], po[2][ROWS <= 2 ? ROWS : 1][NT]; /* [group parity (one row)][row][col] */  \
            for (int h = 0; h < 2; h++)                                                                        \
                for (int m = 0; m < ROWS; m++)                                                                 \
                    for (int c = 0; c < NT; c++) {                                                             \
                        pe[h][m][c] = _mm512_setzero_ps();                                                     \
                        if (ROWS <= 2) po[h][m % (ROWS <= 2 ? ROWS : 1)][c] = _mm512_setzero_ps();             \
                    }                                                                                          \
            for (int p = 0; p < G; p++) {                                                                      \
                const int h = ROWS == 1 ? (p & 1) : 0;                                                         \
                const int64_t at = (q * G + p) * 64;                                                           \
                const uint8_t *grp = tile + (q * G + p) * NT * 32;                                             \
                /* 16 groups ahead, past the tile's end too: the next tile is the next item (a prefetch \
                 * never faults); a bounds check here cost 5-25% (interleaved A/B, 2 threads)          */ \
                _mm_prefetch((const char *)(grp + 2048), _MM_HINT_T0);                                         \
                _mm_prefetch((const char *)(grp + 2112), _MM_HINT_T0);                                         \
                __m512bh xe[ROWS], xo[ROWS];                                                                   \
                for (int m = 0; m < ROWS; m++) {                                                               \
                    xe[m] = (__m512bh)_mm512_loadu_si512(xs + m * rowlen + at);                                \
                    xo[m] = (__m512bh)_mm512_loadu_si512(xs + m * rowlen + at + 32);                           \
                }                                                                                              \
                for (int c = 0; c < NT; c++) {                                                                 \
                    __m512bh we, wo;                                                                           \
                    decode_group(grp + 32 * c, table, &we, &wo);                                               \
                    for (int m = 0; m < ROWS; m++) { /* 3-4 rows: enough chains without an odd one */         \
                        pe[h][m][c] = _mm512_dpbf16_ps(pe[h][m][c], xe[m], we);                                \
                        if (ROWS <= 2)                                                                         \
                            po[h][m][c] = _mm512_dpbf16_ps(po[h][m][c], xo[m], wo);                            \
                        else                                                                                   \
                            pe[h][m][c] = _mm512_dpbf16_ps(pe[h][m][c], xo[m], wo);                            \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            for (int c = 0; c < NT; c++) {                                                                     \
                const __m512 s = scales16(j->scales + (e * j->n + n0 + c) * nb + 16 * q, (int)(nb - 16 * q), NV); \
                for (int m = 0; m < ROWS; m++) {                                                               \
                    __m512 sum = pe[0][m][c];                                                                  \
                    if (ROWS <= 2) sum = _mm512_add_ps(sum, po[0][m % (ROWS <= 2 ? ROWS : 1)][c]);             \
                    if (ROWS == 1) sum = _mm512_add_ps(sum, _mm512_add_ps(pe[1][m][c], po[1][m][c]));         \
                    acc[m][c] = _mm512_fmadd_ps(sum, s, acc[m][c]);                                            \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        store_rows(j, e, n0, r, ROWS, acc);                                                                    \
    }
DEFINE_STREAM(nv_stream_1, 1, 1, 4)
DEFINE_STREAM(nv_stream_2, 2, 1, 4)
DEFINE_STREAM(nv_stream_3, 3, 1, 4)
DEFINE_STREAM(nv_stream_4, 4, 1, 4)
DEFINE_STREAM(mx_stream_1, 1, 0, 8)
DEFINE_STREAM(mx_stream_2, 2, 0, 8)
DEFINE_STREAM(mx_stream_3, 3, 0, 8)
DEFINE_STREAM(mx_stream_4, 4, 0, 8)

typedef void (*stream_fn)(const job_t *, int64_t, int64_t, int64_t, const uint16_t *);

/* From the decoded tile, ROWS (1 or 2) rows in float32: 16 accumulation chains (per row and
 * column two, for one row four). */
#define DEFINE_DECODED(NAME, ROWS)                                                                             \
    AVX512 static void NAME(const job_t *j, int64_t e, int64_t n0, int64_t r, const float *xf, const float *w) { \
        const int64_t groups = j->supers * (j->block / 4), rowlen = groups * 64;                             \
        __m512 acc[ROWS][NT][4 / ROWS];                                                                        \
        for (int m = 0; m < ROWS; m++)                                                                         \
            for (int c = 0; c < NT; c++)                                                                       \
                for (int v = 0; v < 4 / ROWS; v++) acc[m][c][v] = _mm512_setzero_ps();                         \
        for (int64_t g = 0; g < groups; g++) {                                                                 \
            __m512 x[ROWS][4];                                                                                 \
            for (int m = 0; m < ROWS; m++)                                                                     \
                for (int v = 0; v < 4; v++) x[m][v] = _mm512_loadu_ps(xf + m * rowlen + 64 * g + 16 * v);     \
            for (int c = 0; c < NT; c++) {                                                                     \
                const float *wc = w + (g * NT + c) * 64;                                                       \
                for (int v = 0; v < 4; v++) {                                                                  \
                    const __m512 wv = _mm512_load_ps(wc + 16 * v);                                             \
                    for (int m = 0; m < ROWS; m++)                                                             \
                        acc[m][c][v % (4 / ROWS)] = _mm512_fmadd_ps(x[m][v], wv, acc[m][c][v % (4 / ROWS)]);   \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        __m512 sum[ROWS][NT];                                                                                  \
        for (int m = 0; m < ROWS; m++)                                                                         \
            for (int c = 0; c < NT; c++) {                                                                     \
                sum[m][c] = acc[m][c][0];                                                                      \
                for (int v = 1; v < 4 / ROWS; v++) sum[m][c] = _mm512_add_ps(sum[m][c], acc[m][c][v]);          \
            }                                                                                                  \
        store_rows(j, e, n0, r, ROWS, sum);                                                                    \
    }
DEFINE_DECODED(decoded_1, 1)
DEFINE_DECODED(decoded_2, 2)

/* From the bf16-decoded tile (NVFP4), ROWS (1-4) rows by dot products in float32: per row and
 * column one accumulation chain, two (even and odd elements apart) for one or two rows. */
#define DEFINE_DECODED16(NAME, ROWS)                                                                           \
    AVX512 static void NAME(const job_t *j, int64_t e, int64_t n0, int64_t r, const uint16_t *xs, const uint16_t *w) { \
        const int64_t groups = j->supers * (j->block / 4), rowlen = groups * 64;                             \
        enum { H = ROWS <= 2 ? 2 : 1 };                                                                        \
        __m512 acc[H][ROWS][NT];                                                                               \
        for (int h = 0; h < H; h++)                                                                            \
            for (int m = 0; m < ROWS; m++)                                                                     \
                for (int c = 0; c < NT; c++) acc[h][m][c] = _mm512_setzero_ps();                               \
        for (int64_t g = 0; g < groups; g++) {                                                                 \
            __m512bh xe[ROWS], xo[ROWS];                                                                       \
            for (int m = 0; m < ROWS; m++) {                                                                   \
                xe[m] = (__m512bh)_mm512_loadu_si512(xs + m * rowlen + 64 * g);                                \
                xo[m] = (__m512bh)_mm512_loadu_si512(xs + m * rowlen + 64 * g + 32);                           \
            }                                                                                                  \
            for (int c = 0; c < NT; c++) {                                                                     \
                const __m512bh we = (__m512bh)_mm512_loadu_si512(w + (g * NT + c) * 64);                       \
                const __m512bh wo = (__m512bh)_mm512_loadu_si512(w + (g * NT + c) * 64 + 32);                  \
                for (int m = 0; m < ROWS; m++) {                                                               \
                    acc[0][m][c] = _mm512_dpbf16_ps(acc[0][m][c], xe[m], we);                                  \
                    acc[H - 1][m][c] = _mm512_dpbf16_ps(acc[H - 1][m][c], xo[m], wo);                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        if (H == 2)                                                                                            \
            for (int m = 0; m < ROWS; m++)                                                                     \
                for (int c = 0; c < NT; c++) acc[0][m][c] = _mm512_add_ps(acc[0][m][c], acc[H - 1][m][c]);     \
        store_rows(j, e, n0, r, ROWS, acc[0]);                                                                 \
    }
DEFINE_DECODED16(decoded16_1, 1)
DEFINE_DECODED16(decoded16_2, 2)
DEFINE_DECODED16(decoded16_3, 3)
DEFINE_DECODED16(decoded16_4, 4)

typedef void (*decoded16_fn)(const job_t *, int64_t, int64_t, int64_t, const uint16_t *, const uint16_t *);

/* All rows of one expert for one tile; `xs` holds their permuted copies (and, for MXFP4, `xf` the
 * same in float32 where there are more than STREAM_ROWS). Up to STREAM_ROWS rows stream the codes;
 * more decode the tile once into `decoded` (NVFP4: bf16, four rows at a time; MXFP4: float32, two
 * at a time). */
AVX512 static void tile_avx512(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, const uint16_t *xs,
                               const float *xf, float *decoded) {
    const int nv = j->block == 16;
    const int64_t rows = r1 - r0, rowlen = j->supers * (j->block / 4) * 64;
    if (rows <= STREAM_ROWS) { /* the codes streamed once per block of up to four rows */
        const stream_fn fn[4] = {nv ? nv_stream_1 : mx_stream_1, nv ? nv_stream_2 : mx_stream_2,
                                 nv ? nv_stream_3 : mx_stream_3, nv ? nv_stream_4 : mx_stream_4};
        for (int64_t r = r0; r < r1; r += 4) fn[(r1 - r < 4 ? r1 - r : 4) - 1](j, e, n0, r, xs + (r - r0) * rowlen);
        return;
    }
    decode_tile(j, e, n0, decoded, nv);
    if (nv) { /* bf16 weights: twice the products per instruction of the float32 path */
        static const decoded16_fn fn[4] = {decoded16_1, decoded16_2, decoded16_3, decoded16_4};
        const uint16_t *w16 = (const uint16_t *)decoded;
        for (int64_t r = r0; r < r1; r += 4) fn[(r1 - r < 4 ? r1 - r : 4) - 1](j, e, n0, r, xs + (r - r0) * rowlen, w16);
        return;
    }
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) decoded_2(j, e, n0, r, xf + (r - r0) * rowlen, decoded);
    if (r < r1) decoded_1(j, e, n0, r, xf + (r - r0) * rowlen, decoded);
}
#endif

/* --- driver ------------------------------------------------------------------------------------- */

/* Scratch memory each thread keeps between calls (fresh memory would be page-faulted every time). */
typedef struct {
    void *p;
    size_t cap;
} scratch_t;

static void *scratch_get(scratch_t *s, size_t bytes) {
    if (s->cap < bytes) {
        free(s->p);
        s->p = NULL;
        s->cap = 0;
        if (posix_memalign(&s->p, 64, bytes) != 0) return NULL;
        s->cap = bytes;
    }
    return s->p;
}

static int run_items(const job_t *j, scratch_t *mem) {
    /* portable: NT x K float32 weights; AVX-512: the permuted copies of one expert's rows */
    int64_t most = 0;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        int64_t g = it / j->tiles;
        if (j->ex_hi[g] - j->ex_lo[g] > most) most = j->ex_hi[g] - j->ex_lo[g];
    }
    const int64_t rowlen = j->supers * (j->block / 4) * 64;
    /* AVX-512: the permuted rows (bf16, and float32 for MXFP4 experts with more than STREAM_ROWS), then one
     * tile decoded (room for NT x rowlen float32; NVFP4 fills half with bf16), each part 64-byte aligned */
    size_t rows_bytes = ((size_t)most * (size_t)rowlen * sizeof(uint16_t) + 63) / 64 * 64;
    size_t f32_bytes = most > STREAM_ROWS && j->block != 16 ? (size_t)most * (size_t)rowlen * sizeof(float) : 0;
    size_t bytes = j->avx ? rows_bytes + f32_bytes + (size_t)NT * (size_t)rowlen * sizeof(float)
                          : (size_t)NT * (size_t)j->k * sizeof(float);
    void *scratch = scratch_get(mem, bytes + 64);
    if (scratch == NULL) return -3;
#if defined(__x86_64__)
    float *xf = (float *)((char *)scratch + rows_bytes);
    float *decoded = (float *)((char *)xf + f32_bytes);
#endif
    int64_t permuted_for = -1;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        int64_t g = it / j->tiles, n0 = (it % j->tiles) * NT;
#if defined(__x86_64__)
        if (j->avx) {
            if (permuted_for != g) { /* the items of one expert are consecutive: permute its rows once */
                const int64_t rows = j->ex_hi[g] - j->ex_lo[g];
                for (int64_t r = 0; r < rows; r++) {
                    uint16_t *xs = (uint16_t *)scratch + r * rowlen;
                    permute_row(j->x + in_row(j, j->ex_lo[g] + r) * j->k, j->k, j->block, xs);
                    if (rows > STREAM_ROWS && j->block != 16) row_f32(xs, rowlen, xf + r * rowlen); /* MXFP4's float32 path */
                }
                permuted_for = g;
            }
            tile_avx512(j, j->ex[g], n0, j->ex_lo[g], j->ex_hi[g], (const uint16_t *)scratch, xf, decoded);
            continue;
        }
#endif
        tile_portable(j, j->ex[g], n0, j->ex_lo[g], j->ex_hi[g], (float *)scratch);
    }
    (void)most;
    return 0;
}

/* --- a persistent thread pool: started once, woken per call (a thread start per call would cost
 * more than a decode step's GEMM); calls are serialised; the pool is rebuilt after a fork. */

#define MAX_THREADS 64
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static scratch_t pool_scratch[MAX_THREADS];
#if !defined(_OPENMP)
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static int pool_size = 0, active = 0, remaining = 0, failed = 0, atfork_set = 0;
static long generation = 0;
static const job_t *pool_jobs = NULL;

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    long seen = 0;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&start_cv, &pool_mu);
        seen = generation;
        if (id >= active) continue;
        const job_t *job = &pool_jobs[id];
        pthread_mutex_unlock(&pool_mu);
        int rc = run_items(job, &pool_scratch[id]);
        pthread_mutex_lock(&pool_mu);
        if (rc) failed = rc;
        if (--remaining == 0) pthread_cond_signal(&done_cv);
    }
    return NULL;
}

static void after_fork_in_child(void) { /* the child has no pool threads: start afresh */
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&start_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    pool_size = 0;
    generation = 0;
}
#endif

/* Run jobs[0..threads) on the caller and the pool; returns the first error code. Built with OpenMP
 * (-fopenmp), the threads are those of the process's OpenMP runtime, which is PyTorch's own when
 * torch is loaded first (its libgomp.so.1 answers our dependency): the same threads run torch's ops
 * and ours, so neither spins on the cores while the other works. */
static int run_parallel(const job_t *jobs, int threads) {
#if defined(_OPENMP)
    int rc = 0;
    pthread_mutex_lock(&call_mu);
#pragma omp parallel num_threads(threads) reduction(min : rc)
    {
        int id = omp_get_thread_num();
        if (id < threads) rc = run_items(&jobs[id], &pool_scratch[id]);
    }
    pthread_mutex_unlock(&call_mu);
    return rc;
#else
    pthread_mutex_lock(&call_mu);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_set = 1;
    }
    while (pool_size < threads - 1) { /* worker ids 1..: the caller is 0 */
        pthread_t tid;
        if (pthread_create(&tid, NULL, worker, (void *)(intptr_t)(pool_size + 1)) != 0) break;
        pthread_detach(tid);
        pool_size++;
    }
    if (threads > pool_size + 1) threads = pool_size + 1;
    pthread_mutex_lock(&pool_mu);
    pool_jobs = jobs;
    active = threads;
    remaining = threads - 1;
    failed = 0;
    generation++;
    pthread_cond_broadcast(&start_cv);
    pthread_mutex_unlock(&pool_mu);
    int rc = run_items(&jobs[0], &pool_scratch[0]);
    pthread_mutex_lock(&pool_mu);
    while (remaining > 0) pthread_cond_wait(&done_cv, &pool_mu);
    if (!rc) rc = failed;
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&call_mu);
    return rc;
#endif
}

/* 1 if this CPU runs the AVX-512 BF16 path. */
int tfp4_has_avx512bf16(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* Code bytes per weight row in the kernel layout. */
int64_t tfp4_code_bytes(int64_t k, int block) { return (k / block + 15) / 16 * (block / 4) * 32; }

static int check_shapes(int64_t rows, int64_t experts, int64_t n, int64_t k, int block, int impl) {
    if (rows < 0 || experts < 1 || n < NT || n % NT || (block != 16 && block != 32) || k < block || k % block)
        return -1;
    if (impl == 2 && !tfp4_has_avx512bf16()) return -1;
    return 0;
}

static int grouped(const uint16_t *x, const int64_t *offsets, const int64_t *rowmap, int64_t fanout,
                   const uint8_t *codes, const uint8_t *scales, const float *lut, int block, const float *divisor,
                   uint16_t *out, int64_t rows, int64_t experts, int64_t n, int64_t k, int threads, int impl) {
    int avx = impl == 2 || (impl == 0 && tfp4_has_avx512bf16());
    if (offsets[0] != 0 || offsets[experts] != rows) return -2;
    int64_t used = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (offsets[e + 1] < offsets[e]) return -2;
        used += offsets[e + 1] > offsets[e];
    }
    if (rows == 0) return 0;
    int64_t *ex = malloc(sizeof(int64_t) * 3 * (size_t)used);
    if (!ex) return -3;
    int64_t *lo = ex + used, *hi = lo + used, g = 0;
    for (int64_t e = 0; e < experts; e++)
        if (offsets[e + 1] > offsets[e]) {
            ex[g] = e;
            lo[g] = offsets[e];
            hi[g] = offsets[e + 1];
            g++;
        }
    job_t base = {x, codes, scales, lut, divisor, out, n, k, block, (k / block + 15) / 16, tfp4_code_bytes(k, block),
                  ex, lo, hi, n / NT, 0, 0, avx, rowmap, fanout};
    int64_t items = used * base.tiles;
    /* a woken thread costs about as much as 32 tiles of one row: fewer items than that stay on one */
    if (threads > items / 32) threads = (int)(items / 32);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* split the items by their cost (a tile costs about one row's work to decode plus its rows), so
     * that experts with many rows do not leave the other threads waiting */
    job_t jobs[MAX_THREADS];
    int64_t total = 0;
    for (int64_t q = 0; q < used; q++) total += base.tiles * (hi[q] - lo[q] + 1);
    int64_t item = 0, cost = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].item_lo = item;
        const int64_t target = total * (t + 1) / threads;
        while (item < items && (t == threads - 1 || cost < target)) {
            cost += hi[item / base.tiles] - lo[item / base.tiles] + 1;
            item++;
        }
        jobs[t].item_hi = item;
    }
    int rc;
    if (threads == 1) {
        pthread_mutex_lock(&call_mu);
        rc = run_items(&jobs[0], &pool_scratch[0]);
        pthread_mutex_unlock(&call_mu);
    } else {
        rc = run_parallel(jobs, threads);
    }
    free(ex);
    return rc;
}

/* Returns 0, or a negative code: -1 bad shapes, -2 bad offsets, -3 out of memory, -4 thread error.
 * `impl`: 0 = best available, 1 = portable, 2 = AVX-512 BF16 (refused with -1 if unavailable). */
int tfp4_grouped_gemm(const uint16_t *x, const int64_t *offsets, const uint8_t *codes, const uint8_t *scales,
                      const float *lut, int block, const float *divisor, uint16_t *out, int64_t rows,
                      int64_t experts, int64_t n, int64_t k, int threads, int impl) {
    int rc = check_shapes(rows, experts, n, k, block, impl);
    return rc ? rc : grouped(x, offsets, NULL, 1, codes, scales, lut, block, divisor, out, rows, experts, n, k, threads, impl);
}

/* The routed form: `ids` [pairs] is the expert of each (token, slot) pair f = token * fanout + slot, in
 * pair order; pair f reads x row f / fanout (fanout = top-k: one row per token, the gate-up GEMM; 1: one
 * row per pair, the down GEMM) and writes out row f ([pairs, n]). The pairs are grouped by expert
 * here (a stable counting sort), so the caller neither sorts nor gathers nor scatters rows.
 * Returns what tfp4_grouped_gemm returns, or -5 when an id is outside [0, experts) (`bad`: the first
 * such pair). */
int tfp4_routed_gemm(const uint16_t *x, const int64_t *ids, int64_t fanout, const uint8_t *codes,
                     const uint8_t *scales, const float *lut, int block, const float *divisor, uint16_t *out,
                     int64_t pairs, int64_t experts, int64_t n, int64_t k, int threads, int impl, int64_t *bad) {
    int rc = check_shapes(pairs, experts, n, k, block, impl);
    if (rc) return rc;
    if (fanout < 1 || pairs % fanout) return -1;
    for (int64_t f = 0; f < pairs; f++)
        if (ids[f] < 0 || ids[f] >= experts) {
            *bad = f;
            return -5;
        }
    int64_t *offsets = calloc((size_t)(experts + 1) + (size_t)pairs, sizeof(int64_t));
    if (!offsets) return -3;
    int64_t *order = offsets + experts + 1;
    for (int64_t f = 0; f < pairs; f++) offsets[ids[f] + 1]++;
    for (int64_t e = 0; e < experts; e++) offsets[e + 1] += offsets[e];
    int64_t *next = malloc(sizeof(int64_t) * (size_t)experts);
    if (!next) {
        free(offsets);
        return -3;
    }
    memcpy(next, offsets, sizeof(int64_t) * (size_t)experts);
    for (int64_t f = 0; f < pairs; f++) order[next[ids[f]]++] = f;
    free(next);
    rc = grouped(x, offsets, order, fanout, codes, scales, lut, block, divisor, out, pairs, experts, n, k, threads, impl);
    free(offsets);
    return rc;
}
