/* The panels layout's kernels: portable C, AVX-512 BF16 and AMX (the layout is described in
 * kernels.c). Work items are (expert, pair of 16-column panels): the AMX path multiplies a pair with
 * two B tiles that share every A tile.
 *
 * A quad is 4 consecutive elements 4t .. 4t+3 of a row (two code bytes: k-pairs 2t and 2t+1); a
 * panel's quad t is 32 bytes, byte 2c + h = k-pair 2t + h of column c. Widened to words and looked up
 * by low nibbles, they are per column the pair (w[4t], w[4t+2]); by high nibbles (w[4t+1], w[4t+3]):
 * two vectors of 16 column lanes for one vdpbf16ps each, or two rows of an AMX B tile (VNNI order).
 * The activations are taken in the matching order, each quad as (x[4t], x[4t+2], x[4t+1], x[4t+3])
 * (`permute_quads`, once per row and call): the sums are over the same products. */
#ifndef TFP4_PANELS_H
#define TFP4_PANELS_H
#include "fp4_common.h"

#define NC 16 /* output columns per panel */
#ifndef AMX_MIN_ROWS
/* experts with fewer rows take the AVX-512 path: AMX must write every weight, scaled, into a B tile
 * before it multiplies, which costs more than the AVX-512 path's dot products at one or two rows
 * (bandwidth preset's gate-up shapes, 512 experts, 2 threads: AMX 0.68x at 1 row, 0.91x at 2, 1.16x at
 * 3, 1.44x at 4, 2.7x at 8; interleaved A/B) */
#define AMX_MIN_ROWS 3
#endif

#ifndef PREFETCH
/* how far ahead the kernels prefetch a panel's codes (past its end too: a prefetch never faults, and
 * the next panel follows): this machine's hardware prefetcher alone streamed a core at 4.5 GB/s, 1 KiB
 * ahead 7.3, 2 KiB 8.7, 4 KiB 8.2 (a decode loop on 64 MiB of codes, 1 thread) */
#define PREFETCH 2048
#endif

/* Panel p of expert e: its codes ([K/4][32] bytes) and scales ([K/block][16] bytes). */
static inline const uint8_t *panel_codes(const job_t *j, int64_t e, int64_t p) {
    return j->codes + (e * j->panels + p) * (j->k / 2) * NC;
}
static inline const uint8_t *panel_scales(const job_t *j, int64_t e, int64_t p) {
    return j->scales + (e * j->panels + p) * (j->k / j->block) * NC;
}

/* A row in the panels' k order (each quad as elements 0, 2, 1, 3), zero from K up to kp. */
static void permute_quads(const uint16_t *x, int64_t k, int64_t kp, uint16_t *out) {
    for (int64_t i = 0; i < k; i += 4) {
        out[i] = x[i];
        out[i + 1] = x[i + 2];
        out[i + 2] = x[i + 1];
        out[i + 3] = x[i + 3];
    }
    memset(out + k, 0, (size_t)(kp - k) * sizeof(uint16_t));
}

/* The rows of an expert (grouped rows lo .. hi - 1) permuted into `a` ([rows][kp]). */
static void gather_rows(const job_t *j, int64_t lo, int64_t hi, int64_t kp, uint16_t *a) {
    for (int64_t r = lo; r < hi; r++) permute_quads(j->x + in_row(j, r) * j->k, j->k, kp, a + (r - lo) * kp);
}

/* --- portable ----------------------------------------------------------------------------------- */

/* All rows of one expert for one panel, the exact products summed in k order. */
static void panel_portable(const job_t *j, int64_t e, int64_t p, int64_t r0, int64_t r1) {
    const uint8_t *codes = panel_codes(j, e, p), *scales = panel_scales(j, e, p);
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = j->x + in_row(j, r) * j->k;
        uint16_t *o = j->out + out_row(j, r) * j->n + p * NC;
        for (int c = 0; c < NC; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < j->k / 2; i++) { /* k-pair i: byte 2c + i % 2 of quad i / 2 */
                const uint8_t byte = codes[(i / 2) * 2 * NC + 2 * c + i % 2];
                const float s = j->lut[scales[(2 * i / j->block) * NC + c]];
                acc += bf16_value(xr[2 * i]) * (E2M1[byte & 15] * s);
                acc += bf16_value(xr[2 * i + 1]) * (E2M1[byte >> 4] * s);
            }
            o[c] = bf16_rne(acc / j->divisor[e]);
        }
    }
}

#if defined(__x86_64__)
/* --- AVX-512 BF16 -------------------------------------------------------------------------------- */

/* A quad of a panel (32 code bytes) as its two vectors of 16 bf16 pairs (the comment above): the
 * bytes widened to words, both nibbles looked up with vpermw (which reads 5 bits of an index: the
 * table repeats, so the high nibble left above a low one is ignored). */
AVXINL void decode_quad(const uint8_t *codes32, __m512i table, __m512bh *lo, __m512bh *hi) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes32));
    *lo = (__m512bh)_mm512_permutexvar_epi16(w, table);
    *hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
}

/* One output row of one panel: acc / divisor rounded to bf16. */
AVXINL void store_panel_row(const job_t *j, int64_t e, int64_t p, int64_t r, __m512 acc) {
    _mm256_storeu_si256((__m256i *)(j->out + out_row(j, r) * j->n + p * NC),
                        bf16_rne16(_mm512_div_ps(acc, _mm512_set1_ps(j->divisor[e]))));
}

/* ROWS rows (permuted, `a`: [rows][kp]) of one panel, streaming its codes: a quad's 16 columns advance
 * two vdpbf16ps per row (the row's matching pairs broadcast), so every column is one lane from the
 * first product to the stored output. Per block and row, 2H sums apart (H quads in flight) keep
 * enough independent chains; each block's sum is multiplied by its 16 scales in one fused
 * multiply-add. */
#define DEFINE_PANEL(NAME, ROWS, H)                                                                            \
    AVX512 static void NAME(const job_t *j, int64_t e, int64_t p, int64_t r, const uint16_t *a, int64_t kp) { \
        const __m512i table = _mm512_loadu_si512(E2M1_BF16);                                                   \
        const uint8_t *codes = panel_codes(j, e, p), *scales = panel_scales(j, e, p);                          \
        const int64_t nb = j->k / j->block, quads = j->block / 4; /* per block */                             \
        const int nv = j->block == 16;                                                                         \
        const uint32_t *xr[ROWS];                                                                              \
        for (int m = 0; m < ROWS; m++) xr[m] = (const uint32_t *)(a + (int64_t)m * kp);                        \
        __m512 acc[ROWS];                                                                                      \
        for (int m = 0; m < ROWS; m++) acc[m] = _mm512_setzero_ps();                                           \
        for (int64_t b = 0; b < nb; b++) {                                                                     \
            const uint8_t *cb = codes + b * quads * 2 * NC;                                                    \
            for (int64_t o = 0; o < quads * 2 * NC; o += 64)                                                   \
                _mm_prefetch((const char *)(cb + o + PREFETCH), _MM_HINT_T0);                                  \
            __m512 t[2 * H][ROWS];                                                                             \
            for (int h = 0; h < 2 * H; h++)                                                                    \
                for (int m = 0; m < ROWS; m++) t[h][m] = _mm512_setzero_ps();                                  \
            for (int64_t q = 0; q < quads; q += H)                                                             \
                for (int h = 0; h < H; h++) {                                                                  \
                    __m512bh lo, hi;                                                                           \
                    decode_quad(cb + (q + h) * 2 * NC, table, &lo, &hi);                                       \
                    const int64_t at = 2 * (b * quads + q + h); /* the quad's first dword of a row */          \
                    for (int m = 0; m < ROWS; m++) {                                                           \
                        t[2 * h][m] = _mm512_dpbf16_ps(t[2 * h][m], (__m512bh)_mm512_set1_epi32((int)xr[m][at]), lo); \
                        t[2 * h + 1][m] =                                                                      \
                            _mm512_dpbf16_ps(t[2 * h + 1][m], (__m512bh)_mm512_set1_epi32((int)xr[m][at + 1]), hi); \
                    }                                                                                          \
                }                                                                                              \
            const __m512 s = scales16(scales + b * NC, NC, nv);                                                \
            for (int m = 0; m < ROWS; m++) {                                                                   \
                __m512 sum = t[0][m];                                                                          \
                for (int h = 1; h < 2 * H; h++) sum = _mm512_add_ps(sum, t[h][m]);                             \
                acc[m] = _mm512_fmadd_ps(sum, s, acc[m]);                                                      \
            }                                                                                                  \
        }                                                                                                      \
        for (int m = 0; m < ROWS; m++) store_panel_row(j, e, p, r + m, acc[m]);                                \
    }
DEFINE_PANEL(panel_1, 1, 4)
DEFINE_PANEL(panel_2, 2, 2)
DEFINE_PANEL(panel_3, 3, 1)
DEFINE_PANEL(panel_4, 4, 1)

typedef void (*panel_fn)(const job_t *, int64_t, int64_t, int64_t, const uint16_t *, int64_t);

/* All rows of one expert (grouped rows r0 .. r1 - 1, permuted in `a`) for one panel, up to four at a
 * time. */
AVX512 static void panel_avx512(const job_t *j, int64_t e, int64_t p, int64_t r0, int64_t r1, const uint16_t *a,
                                int64_t kp) {
    static const panel_fn fn[4] = {panel_1, panel_2, panel_3, panel_4};
    for (int64_t r = r0; r < r1; r += 4) fn[(r1 - r < 4 ? r1 - r : 4) - 1](j, e, p, r, a + (r - r0) * kp, kp);
}

/* --- AMX ---------------------------------------------------------------------------------------- */
/* Only with a compiler that has the AMX intrinsics (GCC 11, Clang 12 and later): an older one builds
 * the rest, and tfp4_has_amx() says no. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define TFP4_AMX 1

#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Tiles 0-3: C (float32 sums; rows 0-15 / 16-31 of a row group x first / second panel), 4-5: A
 * (those rows, 32 bf16 of K each), 6-7: B (the two panels' 16 k-pairs x 16 columns, VNNI order).
 * m0, m1: the row group's rows in its two halves; two: whether the second panel exists. */
AMX static void amx_configure(int m0, int m1, int two) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {m0, two ? m0 : 0, m1, two ? m1 : 0, m0, m1, 16, two ? 16 : 0};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

AMX static void amx_release(void) { _tile_release(); }

/* A quad of a panel as its two B-tile rows, each value times its column's block scale `s`: the
 * quad's 16 words (word c: column c's two bytes) widened to dwords, each of the 4 elements looked up
 * as float32 by vpermps (which reads the low 4 bits of an index, so a shift brings each nibble there),
 * multiplied, and the products' top halves paired per column in VNNI order. Exact: an E2M1 value has 2
 * significant bits and an E4M3 scale 4, so their float32 product is a normal bf16 for every scale
 * (down to 2^-9) and its top half is that bf16; an E8M0 scale 2^e shifts the exponent, normal for
 * e >= -125 (smaller MXFP4 scales take the AVX-512 path: AMX reads bf16 subnormals as zero). (Two
 * vpermw to bf16 and the products from them ran 10% slower; vcvtne2ps2bf16 packing 25%.) */
AVXINL void decode_scaled_quad(const uint8_t *codes32, __m512 table, __m512 s, __m512i *lo, __m512i *hi) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)codes32));
    const __m512 e0 = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s);
    const __m512 e1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s);
    const __m512 e2 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 8), table), s);
    const __m512 e3 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 12), table), s);
    /* (second & top) | (first >> 16) */
    *lo = _mm512_ternarylogic_epi32(_mm512_castps_si512(e2), top, _mm512_srli_epi32(_mm512_castps_si512(e0), 16), 0xEA);
    *hi = _mm512_ternarylogic_epi32(_mm512_castps_si512(e3), top, _mm512_srli_epi32(_mm512_castps_si512(e1), 16), 0xEA);
}

/* B tile of chunk kc (k-pairs 16 kc .. 16 kc + 15: quads 8 kc .. 8 kc + 7) of panel p: 16 rows of
 * 64 bytes, zero past K. */
AVXINL void decode_chunk(const job_t *j, int64_t e, int64_t p, int64_t kc, __m512 table, uint8_t *out) {
    const uint8_t *codes = panel_codes(j, e, p), *scales = panel_scales(j, e, p);
    const int per = j->block / 4; /* quads per block: 4 (NVFP4) or 8 (MXFP4) */
    for (int q0 = 0; q0 < 8; q0 += per) {
        const int64_t t0 = kc * 8 + q0;
        if (4 * t0 >= j->k) { /* K is a multiple of the block: a block is all there or not at all */
            memset(out + 2 * q0 * 64, 0, (size_t)(8 - q0) * 2 * 64);
            return;
        }
        const __m512 s = scales16(scales + (4 * t0 / j->block) * NC, NC, j->block == 16);
        for (int q = 0; q < per; q++) {
            const uint8_t *c = codes + (t0 + q) * 2 * NC;
            if ((q & 1) == 0) _mm_prefetch((const char *)(c + PREFETCH), _MM_HINT_T0);
            __m512i lo, hi;
            decode_scaled_quad(c, table, s, &lo, &hi);
            _mm512_store_si512(out + (2 * (q0 + q)) * 64, lo);
            _mm512_store_si512(out + (2 * (q0 + q) + 1) * 64, hi);
        }
    }
}

/* Whether AMX may multiply panels 2q, 2q+1 of expert e: every MXFP4 scale at least 2^-125. */
AVX512 static int amx_exact(const job_t *j, int64_t e, int64_t q) {
    if (j->block == 16) return 1;
    const int64_t bytes = (2 * q + 2 <= j->panels ? 2 : 1) * (j->k / j->block) * NC;
    const uint8_t *s = panel_scales(j, e, 2 * q);
    for (int64_t i = 0; i < bytes; i += 64) {
        const __mmask64 m = bytes - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (bytes - i)) - 1);
        if (_mm512_mask_cmplt_epu8_mask(m, _mm512_maskz_loadu_epi8(m, s + i), _mm512_set1_epi8(2))) return 0;
    }
    return 1;
}

/* Rows r0 .. r0 + rows - 1 of expert e (permuted in `a`: [rows][kp], zero past K) times panels 2q
 * and 2q+1, in row groups of 32. With more than 32 rows the panels are decoded once for all groups
 * (into `bbuf`: kp / 32 chunks of two 1 KiB tiles); otherwise chunk by chunk into its first 2 KiB.
 * `cfg`: the tile configuration loaded last (-1: none). */
AMX static void pair_amx(const job_t *j, int64_t e, int64_t q, int64_t r0, int64_t rows, const uint16_t *a, int64_t kp,
                         uint8_t *bbuf, float *cbuf, int *cfg) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    const int two = 2 * q + 1 < j->panels, once = rows > 32;
    const int64_t chunks = kp / 32;
    if (once)
        for (int64_t kc = 0; kc < chunks; kc++) {
            decode_chunk(j, e, 2 * q, kc, table, bbuf + kc * 2048);
            if (two) decode_chunk(j, e, 2 * q + 1, kc, table, bbuf + kc * 2048 + 1024);
        }
    for (int64_t g = 0; g < rows; g += 32) {
        const int m0 = rows - g < 16 ? (int)(rows - g) : 16;
        const int m1 = rows - g <= 16 ? 0 : rows - g - 16 < 16 ? (int)(rows - g - 16) : 16;
        const int key = m0 | m1 << 5 | two << 10;
        if (*cfg != key) {
            amx_configure(m0, m1, two);
            *cfg = key;
        }
        _tile_zero(0);
        if (two) _tile_zero(1);
        if (m1) {
            _tile_zero(2);
            if (two) _tile_zero(3);
        }
        const uint16_t *a0 = a + g * kp, *a1 = a0 + 16 * kp;
        for (int64_t kc = 0; kc < chunks; kc++) {
            uint8_t *b = once ? bbuf + kc * 2048 : bbuf;
            if (!once) {
                decode_chunk(j, e, 2 * q, kc, table, b);
                if (two) decode_chunk(j, e, 2 * q + 1, kc, table, b + 1024);
            }
            _tile_loadd(6, b, 64);
            _tile_loadd(4, a0 + kc * 32, kp * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, b + 1024, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (m1) {
                _tile_loadd(5, a1 + kc * 32, kp * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        /* cbuf: [32 rows][32 columns] float32 */
        _tile_stored(0, cbuf, 128);
        if (two) _tile_stored(1, cbuf + 16, 128);
        if (m1) {
            _tile_stored(2, cbuf + 512, 128);
            if (two) _tile_stored(3, cbuf + 528, 128);
        }
        for (int m = 0; m < m0 + m1; m++)
            for (int t = 0; t <= two; t++) store_panel_row(j, e, 2 * q + t, r0 + g + m, _mm512_load_ps(cbuf + m * 32 + t * 16));
    }
}
#endif /* TFP4_AMX */
#endif

/* Whether an expert with `rows` rows takes the AMX path. */
static inline int takes_amx(const job_t *j, int64_t rows) { return j->amx && rows >= j->amx_min_rows; }

/* The cost of one item (a panel pair) of an expert with `rows` rows, for the split over threads: a
 * pair streamed by the AVX-512 path costs about 1.5 rows' work plus its rows, one multiplied by AMX
 * about 3.7 rows' to decode and scale plus 1/16 of a row per row (fits of the bandwidth preset's
 * gate-up timings). */
static inline int64_t panel_pair_cost(const job_t *j, int64_t rows) { return takes_amx(j, rows) ? 60 + rows : 25 + 16 * rows; }

/* This thread's items, panels layout. */
static int panels_run(const job_t *j, scratch_t *mem) {
#if defined(__x86_64__)
    if (j->avx) {
        const int64_t kp = (j->k + 31) / 32 * 32;
        int64_t most = 0, amx_rows = 0;
        for (int64_t it = j->item_lo; it < j->item_hi; it++) {
            const int64_t g = it / j->items_per_expert, rows = j->ex_hi[g] - j->ex_lo[g];
            if (rows > most) most = rows;
            if (takes_amx(j, rows) && rows > amx_rows) amx_rows = rows;
        }
        /* the expert's permuted rows; for AMX the decoded tiles (all chunks when an expert has more
         * than 32 rows) and the C tiles' store; each part 64-byte aligned */
        const size_t a_bytes = ((size_t)most * (size_t)kp * sizeof(uint16_t) + 63) / 64 * 64;
        const size_t b_bytes = amx_rows > 32 ? (size_t)(kp / 32) * 2048 : 2048;
        uint8_t *scratch = scratch_get(mem, a_bytes + b_bytes + 32 * 32 * sizeof(float));
        if (scratch == NULL) return -3;
        const uint16_t *a = (const uint16_t *)scratch;
        int cfg = -1;
        int64_t gathered_for = -1;
        for (int64_t it = j->item_lo; it < j->item_hi; it++) {
            const int64_t g = it / j->items_per_expert, q = it % j->items_per_expert;
            const int64_t e = j->ex[g], lo = j->ex_lo[g], hi = j->ex_hi[g];
            if (gathered_for != g) { /* the items of one expert are consecutive: permute its rows once */
                gather_rows(j, lo, hi, kp, (uint16_t *)scratch);
                gathered_for = g;
            }
#if defined(TFP4_AMX)
            if (takes_amx(j, hi - lo) && amx_exact(j, e, q)) {
                pair_amx(j, e, q, lo, hi - lo, a, kp, scratch + a_bytes, (float *)(scratch + a_bytes + b_bytes), &cfg);
                continue;
            }
#endif
            for (int64_t p = 2 * q; p < 2 * q + 2 && p < j->panels; p++) panel_avx512(j, e, p, lo, hi, a, kp);
        }
#if defined(TFP4_AMX)
        if (cfg != -1) amx_release();
#endif
        (void)cfg;
        return 0;
    }
#endif
    (void)mem;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        const int64_t g = it / j->items_per_expert, q = it % j->items_per_expert;
        for (int64_t p = 2 * q; p < 2 * q + 2 && p < j->panels; p++) panel_portable(j, j->ex[g], p, j->ex_lo[g], j->ex_hi[g]);
    }
    return 0;
}

#endif
