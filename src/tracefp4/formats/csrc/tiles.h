/* The tiles layout's kernels: portable C and AVX-512 BF16 (the layout is described in kernels.c).
 * Work items are (expert, tile of NT = 4 output columns). */
#ifndef TFP4_TILES_H
#define TFP4_TILES_H
#include "fp4_common.h"

#define NT 4 /* output columns per work item */
#ifndef STREAM_ROWS
/* experts with more rows decode each tile once; with the scale prefetch the streaming path wins up
 * to about 24 rows (1.6x at 12 rows, 1.1-1.2x at 16, even at 24, 0.9x at 32: bandwidth-preset shapes,
 * interleaved A/B of the two builds, 1 thread) */
#define STREAM_ROWS 20
#endif

/* The code of element i of column c of a tile whose codes start at `tile` (kernel layout). */
static inline int code_at(const uint8_t *tile, int c, int64_t i, int block) {
    int64_t b = i / block, w = i % block, q = b / 16, l = b % 16, p = w / 4, r = w % 4;
    uint8_t byte = tile[((q * (block / 4) + p) * NT + c) * 32 + 2 * l + r / 2];
    return (byte >> (4 * (r % 2))) & 0xF;
}

/* --- portable ----------------------------------------------------------------------------------- */

static void tile_portable(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, float *w) {
    const int64_t k = j->k, n = j->n, nb = k / j->block;
    const uint8_t *tile = j->codes + (e * j->items_per_expert + n0 / NT) * NT * j->cbytes;
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
    const uint8_t *tile = j->codes + (e * j->items_per_expert + n0 / NT) * NT * j->cbytes;
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
    uint16_t h[16];
    _mm256_storeu_si256((__m256i *)h, bf16_rne16(v));
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
        const uint8_t *tile = j->codes + (e * j->items_per_expert + n0 / NT) * NT * j->cbytes;                           \
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

/* This thread's items, tiles layout. */
static int tiles_run(const job_t *j, scratch_t *mem) {
    /* portable: NT x K float32 weights; AVX-512: the permuted copies of one expert's rows */
    int64_t most = 0;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        int64_t g = it / j->items_per_expert;
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
        int64_t g = it / j->items_per_expert, n0 = (it % j->items_per_expert) * NT;
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

#endif
