/* The panels layout's kernels: portable C, AVX-512 BF16 and AMX (the layout is described in
 * fp4_gemm.c). Work items are (expert, pair of 16-column panels): the AMX path multiplies a pair with
 * two B tiles that share every A tile. */
#ifndef TFP4_PANELS_H
#define TFP4_PANELS_H
#include "fp4_common.h"

#define NC 16 /* output columns per panel */
#ifndef AMX_MIN_ROWS
/* experts with fewer rows take the AVX-512 path: AMX must write every weight, scaled, into a B tile
 * before it multiplies, which costs more than the AVX-512 path's dot products at one or two rows
 * (bandwidth preset's gate-up shapes, 2 threads: AMX 0.79x at 1 row, 0.94x at 2, 1.2x at 3, 1.9x at
 * 6, 4.2x at 16; interleaved A/B) */
#define AMX_MIN_ROWS 2
#endif

#ifndef PREFETCH
/* how far ahead the kernels prefetch a panel's codes (past its end too: a prefetch never faults, and
 * the next panel follows): this machine's hardware prefetcher alone streamed a core at 4.5 GB/s, 1 KiB
 * ahead 7.3, 2 KiB 8.7, 4 KiB 8.2 (the decode loop on 64 MiB of codes, 1 thread) */
#define PREFETCH 2048
#endif

/* Panel p of expert e: its codes ([K/2][16] bytes) and scales ([K/block][16] bytes). */
static inline const uint8_t *panel_codes(const job_t *j, int64_t e, int64_t p) {
    return j->codes + (e * j->panels + p) * (j->k / 2) * NC;
}
static inline const uint8_t *panel_scales(const job_t *j, int64_t e, int64_t p) {
    return j->scales + (e * j->panels + p) * (j->k / j->block) * NC;
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
            for (int64_t i = 0; i < j->k / 2; i++) {
                const uint8_t byte = codes[i * NC + c];
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

/* One k-pair of a panel (its 16 code bytes) as 16 bf16 pairs, lane c = column c (VNNI order): each
 * byte zero-extended to a dword and or-ed with itself shifted by 12 bits, so the low word's low 5 bits
 * are the low nibble (the table repeats) and the high word is the high nibble; one vpermw. (Two
 * k-pairs widened to words, looked up and interleaved with two vpermt2w ran no faster.) */
AVXINL __m512i decode_pair(const uint8_t *codes16, __m512i table) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes16));
    return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
}

/* `rows` output rows of one panel: acc / divisor rounded to bf16. */
AVXINL void store_panel_row(const job_t *j, int64_t e, int64_t p, int64_t r, __m512 acc) {
    _mm256_storeu_si256((__m256i *)(j->out + out_row(j, r) * j->n + p * NC),
                        bf16_rne16(_mm512_div_ps(acc, _mm512_set1_ps(j->divisor[e]))));
}

/* ROWS rows of one panel, streaming its codes: a k-pair's 16 columns advance one vdpbf16ps per row
 * (the row's pair broadcast), so every column is one lane from the first product to the stored
 * output. Per block and row, H sums apart (k-pairs i mod H) keep enough independent chains in
 * flight; each block's sum is multiplied by its 16 scales in one fused multiply-add. */
#define DEFINE_PANEL(NAME, ROWS, H)                                                                            \
    AVX512 static void NAME(const job_t *j, int64_t e, int64_t p, int64_t r) {                                \
        const __m512i table = _mm512_loadu_si512(E2M1_BF16);                                                   \
        const uint8_t *codes = panel_codes(j, e, p), *scales = panel_scales(j, e, p);                          \
        const int64_t nb = j->k / j->block, half = j->block / 2;                                              \
        const int nv = j->block == 16;                                                                         \
        const uint32_t *xr[ROWS];                                                                              \
        for (int m = 0; m < ROWS; m++) xr[m] = (const uint32_t *)(j->x + in_row(j, r + m) * j->k);             \
        __m512 acc[ROWS];                                                                                      \
        for (int m = 0; m < ROWS; m++) acc[m] = _mm512_setzero_ps();                                           \
        for (int64_t b = 0; b < nb; b++) {                                                                     \
            for (int64_t o = 0; o < half * NC; o += 64)                                                        \
                _mm_prefetch((const char *)(codes + b * half * NC + o + PREFETCH), _MM_HINT_T0);               \
            __m512 t[H][ROWS];                                                                                 \
            for (int h = 0; h < H; h++)                                                                        \
                for (int m = 0; m < ROWS; m++) t[h][m] = _mm512_setzero_ps();                                  \
            for (int64_t i = b * half; i < (b + 1) * half; i += H)                                             \
                for (int h = 0; h < H; h++) {                                                                  \
                    const __m512bh w = (__m512bh)decode_pair(codes + (i + h) * NC, table);                     \
                    for (int m = 0; m < ROWS; m++)                                                             \
                        t[h][m] = _mm512_dpbf16_ps(t[h][m], (__m512bh)_mm512_set1_epi32((int)xr[m][i + h]), w); \
                }                                                                                              \
            const __m512 s = scales16(scales + b * NC, NC, nv);                                                \
            for (int m = 0; m < ROWS; m++) {                                                                   \
                __m512 sum = t[0][m];                                                                          \
                for (int h = 1; h < H; h++) sum = _mm512_add_ps(sum, t[h][m]);                                 \
                acc[m] = _mm512_fmadd_ps(sum, s, acc[m]);                                                      \
            }                                                                                                  \
        }                                                                                                      \
        for (int m = 0; m < ROWS; m++) store_panel_row(j, e, p, r + m, acc[m]);                                \
    }
DEFINE_PANEL(panel_1, 1, 8)
DEFINE_PANEL(panel_2, 2, 4)
DEFINE_PANEL(panel_3, 3, 4)
DEFINE_PANEL(panel_4, 4, 2)

typedef void (*panel_fn)(const job_t *, int64_t, int64_t, int64_t);

/* All rows of one expert for one panel, up to four at a time. */
AVX512 static void panel_avx512(const job_t *j, int64_t e, int64_t p, int64_t r0, int64_t r1) {
    static const panel_fn fn[4] = {panel_1, panel_2, panel_3, panel_4};
    for (int64_t r = r0; r < r1; r += 4) fn[(r1 - r < 4 ? r1 - r : 4) - 1](j, e, p, r);
}

/* --- AMX ---------------------------------------------------------------------------------------- */

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

/* One k-pair of a panel (16 code bytes) as a B-tile row: per column c (lane c) the pair's two E2M1
 * values (vpermps from a float32 table: it reads the low 4 bits of an index) times the column's block
 * scale (`s`), in bf16 (VNNI order: the first element in the low word). Exact: an E2M1 value has 2
 * significant bits and an E4M3 scale 4, so their float32 product is a normal bf16 for every scale
 * (down to 2^-9) and its top half is that bf16; an E8M0 scale 2^e shifts the exponent, normal for
 * e >= -125 (smaller MXFP4 scales take the AVX-512 path: AMX reads bf16 subnormals as zero). */
AVXINL __m512i decode_scaled_pair(const uint8_t *codes16, __m512 table, __m512 s) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes16));
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s);
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s);
    /* (hi & 0xffff0000) | (lo >> 16) */
    return _mm512_ternarylogic_epi32(_mm512_castps_si512(hi), _mm512_set1_epi32((int)0xffff0000u),
                                     _mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xEA);
}

/* B tile of chunk kc (k-pairs 16 kc .. 16 kc + 15) of panel p: 16 rows of 64 bytes, zero past K. */
AVXINL void decode_chunk(const job_t *j, int64_t e, int64_t p, int64_t kc, __m512 table, uint8_t *out) {
    const uint8_t *codes = panel_codes(j, e, p), *scales = panel_scales(j, e, p);
    const int per = j->block / 2; /* k-pairs per block: 8 (NVFP4) or 16 (MXFP4) */
    for (int r0 = 0; r0 < 16; r0 += per) {
        const int64_t i0 = kc * 16 + r0;
        if (2 * i0 >= j->k) { /* K is a multiple of the block: a block is all there or not at all */
            memset(out + r0 * 64, 0, (size_t)(16 - r0) * 64);
            return;
        }
        const __m512 s = scales16(scales + (2 * i0 / j->block) * NC, NC, j->block == 16);
        for (int r = 0; r < per; r++) {
            if ((r & 3) == 0) _mm_prefetch((const char *)(codes + (i0 + r) * NC + PREFETCH), _MM_HINT_T0);
            _mm512_store_si512(out + (r0 + r) * 64, decode_scaled_pair(codes + (i0 + r) * NC, table, s));
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

/* Rows r0 .. r0 + rows - 1 of expert e (gathered into `a`: [rows][kp] bf16, zero past K) times
 * panels 2q and 2q+1, in row groups of 32. With more than 32 rows the panels are decoded once for
 * all groups (into `bbuf`: kp / 32 chunks of two 1 KiB tiles); otherwise chunk by chunk into its
 * first 4 KiB. `cfg`: the tile configuration loaded last (-1: none). */
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
            /* chunk by chunk: two buffers in turn, so that decoding the next chunk need not wait for
             * the tile loads of this one */
            uint8_t *b = bbuf + (once ? kc : kc & 1) * 2048;
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

/* The rows of expert group g (grouped rows lo .. hi - 1) copied to `a` ([rows][kp], zero past K). */
static void gather_rows(const job_t *j, int64_t lo, int64_t hi, int64_t kp, uint16_t *a) {
    for (int64_t r = lo; r < hi; r++) {
        uint16_t *dst = a + (r - lo) * kp;
        memcpy(dst, j->x + in_row(j, r) * j->k, (size_t)j->k * sizeof(uint16_t));
        memset(dst + j->k, 0, (size_t)(kp - j->k) * sizeof(uint16_t));
    }
}
#endif

/* Whether an expert with `rows` rows takes the AMX path. */
static inline int takes_amx(const job_t *j, int64_t rows) { return j->amx && rows >= j->amx_min_rows; }

/* This thread's items, panels layout. */
static int panels_run(const job_t *j, scratch_t *mem) {
#if defined(__x86_64__)
    const int64_t kp = (j->k + 31) / 32 * 32;
    int64_t most = 0;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        const int64_t g = it / j->items_per_expert, rows = j->ex_hi[g] - j->ex_lo[g];
        if (takes_amx(j, rows) && rows > most) most = rows;
    }
    /* AMX: the gathered rows, the decoded tiles (all chunks when an expert has more than 32 rows)
     * and the C tiles' store, each part 64-byte aligned */
    const size_t a_bytes = ((size_t)most * (size_t)kp * sizeof(uint16_t) + 63) / 64 * 64;
    const size_t b_bytes = most > 32 ? (size_t)(kp / 32) * 2048 : 4096;
    uint8_t *scratch = NULL;
    if (most) {
        scratch = scratch_get(mem, a_bytes + b_bytes + 32 * 32 * sizeof(float));
        if (scratch == NULL) return -3;
    }
    int cfg = -1;
    int64_t gathered_for = -1;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        const int64_t g = it / j->items_per_expert, q = it % j->items_per_expert;
        const int64_t e = j->ex[g], lo = j->ex_lo[g], hi = j->ex_hi[g];
        if (takes_amx(j, hi - lo) && amx_exact(j, e, q)) {
            if (gathered_for != g) { /* the items of one expert are consecutive: gather its rows once */
                gather_rows(j, lo, hi, kp, (uint16_t *)scratch);
                gathered_for = g;
            }
            pair_amx(j, e, q, lo, hi - lo, (const uint16_t *)scratch, kp, scratch + a_bytes,
                     (float *)(scratch + a_bytes + b_bytes), &cfg);
            continue;
        }
        for (int64_t p = 2 * q; p < 2 * q + 2 && p < j->panels; p++) {
            if (j->avx)
                panel_avx512(j, e, p, lo, hi);
            else
                panel_portable(j, e, p, lo, hi);
        }
    }
    if (cfg != -1) amx_release();
#else
    (void)mem;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        const int64_t g = it / j->items_per_expert, q = it % j->items_per_expert;
        for (int64_t p = 2 * q; p < 2 * q + 2 && p < j->panels; p++) panel_portable(j, j->ex[g], p, j->ex_lo[g], j->ex_hi[g]);
    }
#endif
    return 0;
}

#endif
