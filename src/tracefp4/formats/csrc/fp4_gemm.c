/* Grouped GEMM of bf16 activations with packed FP4 weights (NVFP4 or MXFP4), for the CPU.
 *
 *   out[r, n] = bf16_rne( fl32( sum_k x[r, k] * w_e[n, k] ) / divisor[e] )   for rows r of expert e
 *
 * where w_e[n, k] = value(code) * scale(block) is the weight without its global scale: the E2M1
 * value of the 4-bit code times the block scale (E4M3 for NVFP4, E8M0 for MXFP4, as float32 values
 * through `scale_lut`), and divisor[e] the expert's FP32 global encode scale S_enc (1 for MXFP4).
 *
 * Exactness (why the result is the GEMM of the exact dequantized operands up to accumulation
 * order): every value(code) * scale is exact in bf16 (an E2M1 value has 2 significant bits, an E4M3
 * scale 4, a power of two 1), and the product of two bf16 values is exact in float32 (8 + 8 <= 24
 * bits), so the only roundings are those of the float32 sum, of the division and of the final
 * bf16 rounding (round-to-nearest-even, subnormals kept, NaN -> 0x7FC0, as torch's cast).
 *
 * Layout (row-major, contiguous): x [R, K] bf16 bits, rows grouped by expert, expert e owning rows
 * offsets[e] .. offsets[e+1]-1; codes [E, N, K/2] (element 2i in the low nibble); scales [E, N, K/block]
 * (one byte per block); divisor [E]; out [R, N] bf16 bits.
 *
 * Two implementations, chosen at run time: an AVX-512 BF16 one (nibbles -> bf16 weights through a
 * per-block table and vpermw, vdpbf16ps accumulation in float32; DAZ/FTZ, so operands and products
 * below 2^-126 count as zero) and a portable one in plain C (float32 products and sums, 16 partial
 * sums like the vector lanes). They differ only in the order and grouping of the float32 additions.
 * Work is split over (expert, 4-column tile) items, contiguous ranges per thread; each output is
 * computed by one thread in a fixed order, so the result does not depend on the thread count.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define NT 4 /* output columns per work item */

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
    /* non-empty experts: expert index and first/last row */
    const int64_t *ex, *ex_lo, *ex_hi;
    int64_t tiles; /* column tiles per expert */
    int64_t item_lo, item_hi;
    int avx;
} job_t;

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

/* --- portable ----------------------------------------------------------------------------------- */

static void tile_portable(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, float *w) {
    const int64_t k = j->k, n = j->n, half = k / 2, nb = k / j->block;
    for (int c = 0; c < NT; c++) {
        const uint8_t *cr = j->codes + (e * n + n0 + c) * half;
        const uint8_t *sr = j->scales + (e * n + n0 + c) * nb;
        for (int64_t i = 0; i < k; i++) {
            int code = (cr[i >> 1] >> ((i & 1) * 4)) & 0xF;
            w[c * k + i] = E2M1[code] * j->lut[sr[i / j->block]];
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = j->x + r * k;
        for (int c = 0; c < NT; c++) {
            const float *wc = w + c * k;
            float lane[16] = {0};
            for (int64_t i = 0; i < k; i += 2) {
                int l = (int)((i >> 1) & 15);
                lane[l] += bf16_value(xr[i + 1]) * wc[i + 1];
                lane[l] += bf16_value(xr[i]) * wc[i];
            }
            for (int s = 8; s > 0; s >>= 1)
                for (int l = 0; l < s; l++) lane[l] += lane[l + s];
            j->out[r * n + n0 + c] = bf16_rne(lane[0] / j->divisor[e]);
        }
    }
}

/* --- AVX-512 BF16 -------------------------------------------------------------------------------- */

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The 32 bf16 weights k0..k0+31 of one output column: codes -> E2M1 values times the two block
 * scales (or one, for blocks of 32), as a table of 32 bf16 values indexed by vpermw. */
AVX512 static inline __m512bh decode32(const uint8_t *cr, const uint8_t *sr, const float *lut, int block,
                                       int64_t k0, int tail) {
    const __m512 tab = _mm512_loadu_ps(E2M1);
    const __m512i nib = _mm512_set1_epi32(0xF);
    const __m512i upper = _mm512_set_epi32(0x100010, 0x100010, 0x100010, 0x100010, 0x100010, 0x100010, 0x100010,
                                           0x100010, 0, 0, 0, 0, 0, 0, 0, 0);
    float s0, s1;
    if (block == 16) {
        s0 = lut[sr[k0 / 16]];
        s1 = tail ? s0 : lut[sr[k0 / 16 + 1]];
    } else {
        s0 = s1 = lut[sr[k0 / 32]];
    }
    __m512bh table = _mm512_cvtne2ps_pbh(_mm512_mul_ps(tab, _mm512_set1_ps(s1)), _mm512_mul_ps(tab, _mm512_set1_ps(s0)));
    __m128i bytes = tail ? _mm_loadl_epi64((const __m128i *)(cr + k0 / 2)) : _mm_loadu_si128((const __m128i *)(cr + k0 / 2));
    __m512i d = _mm512_cvtepu8_epi32(bytes);
    __m512i idx = _mm512_or_si512(_mm512_and_si512(d, nib), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(d, 4), nib), 16));
    idx = _mm512_add_epi32(idx, upper); /* elements 16..31 read the second block's half of the table */
    return (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)table);
}

AVX512 static inline __m512bh load_x(const uint16_t *p, int tail) {
    return (__m512bh)(tail ? _mm512_maskz_loadu_epi16(0xFFFF, p) : _mm512_loadu_si512(p));
}

AVX512 static inline void store_tile(const job_t *j, int64_t e, int64_t r, int64_t n0, __m512 *acc) {
    for (int c = 0; c < NT; c++)
        j->out[r * j->n + n0 + c] = bf16_rne(_mm512_reduce_add_ps(acc[c]) / j->divisor[e]);
}

/* ROWS rows (1..4) of one tile with the weights decoded in registers, chunk by chunk. */
#define DEFINE_ROWS(ROWS)                                                                                    \
    AVX512 static void rows_reg_##ROWS(const job_t *j, int64_t e, int64_t n0, int64_t r) {                 \
        const int64_t k = j->k, n = j->n, half = k / 2, nb = k / j->block;                                 \
        __m512 acc[ROWS][NT];                                                                                \
        for (int m = 0; m < ROWS; m++)                                                                       \
            for (int c = 0; c < NT; c++) acc[m][c] = _mm512_setzero_ps();                                    \
        for (int64_t k0 = 0; k0 < k; k0 += 32) {                                                             \
            int tail = k - k0 < 32;                                                                          \
            __m512bh w[NT];                                                                                  \
            for (int c = 0; c < NT; c++)                                                                     \
                w[c] = decode32(j->codes + (e * n + n0 + c) * half, j->scales + (e * n + n0 + c) * nb, j->lut, \
                                j->block, k0, tail);                                                         \
            for (int m = 0; m < ROWS; m++) {                                                                 \
                __m512bh xv = load_x(j->x + (r + m) * k + k0, tail);                                         \
                for (int c = 0; c < NT; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, w[c]);              \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < ROWS; m++) store_tile(j, e, r + m, n0, acc[m]);                                  \
    }
DEFINE_ROWS(1)
DEFINE_ROWS(2)
DEFINE_ROWS(3)
DEFINE_ROWS(4)

/* Many rows: the tile's weights decoded once into `w` (NT x K bf16), then 4 rows at a time. */
AVX512 static void rows_scratch(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, uint16_t *w) {
    const int64_t k = j->k, n = j->n, half = k / 2, nb = k / j->block, kp = (k + 31) / 32 * 32;
    for (int c = 0; c < NT; c++)
        for (int64_t k0 = 0; k0 < k; k0 += 32)
            _mm512_storeu_si512(w + c * kp + k0, (__m512i)decode32(j->codes + (e * n + n0 + c) * half,
                                                                  j->scales + (e * n + n0 + c) * nb, j->lut,
                                                                  j->block, k0, k - k0 < 32));
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        __m512 acc[4][NT];
        for (int m = 0; m < 4; m++)
            for (int c = 0; c < NT; c++) acc[m][c] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < k; k0 += 32) {
            int tail = k - k0 < 32;
            __m512bh wv[NT];
            for (int c = 0; c < NT; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * kp + k0);
            for (int m = 0; m < 4; m++) {
                __m512bh xv = load_x(j->x + (r + m) * k + k0, tail);
                for (int c = 0; c < NT; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wv[c]);
            }
        }
        for (int m = 0; m < 4; m++) store_tile(j, e, r + m, n0, acc[m]);
    }
    switch (r1 - r) {
        case 3: rows_reg_3(j, e, n0, r); break;
        case 2: rows_reg_2(j, e, n0, r); break;
        case 1: rows_reg_1(j, e, n0, r); break;
        default: break;
    }
}

AVX512 static void tile_avx512(const job_t *j, int64_t e, int64_t n0, int64_t r0, int64_t r1, uint16_t *w) {
    if (r1 - r0 > 8) {
        rows_scratch(j, e, n0, r0, r1, w);
        return;
    }
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) rows_reg_4(j, e, n0, r);
    switch (r1 - r) {
        case 3: rows_reg_3(j, e, n0, r); break;
        case 2: rows_reg_2(j, e, n0, r); break;
        case 1: rows_reg_1(j, e, n0, r); break;
        default: break;
    }
}
#endif

/* --- driver ------------------------------------------------------------------------------------- */

static void *run_items(void *arg) {
    const job_t *j = (const job_t *)arg;
    size_t floats = (size_t)NT * (size_t)((j->k + 31) / 32 * 32); /* NT columns, K padded to 32 */
    void *scratch = NULL;
    if (posix_memalign(&scratch, 64, floats * sizeof(float)) != 0) return (void *)1;
    for (int64_t it = j->item_lo; it < j->item_hi; it++) {
        int64_t g = it / j->tiles, n0 = (it % j->tiles) * NT;
#if defined(__x86_64__)
        if (j->avx) {
            tile_avx512(j, j->ex[g], n0, j->ex_lo[g], j->ex_hi[g], (uint16_t *)scratch);
            continue;
        }
#endif
        tile_portable(j, j->ex[g], n0, j->ex_lo[g], j->ex_hi[g], (float *)scratch);
    }
    free(scratch);
    return NULL;
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

/* Returns 0, or a negative code: -1 bad shapes, -2 bad offsets, -3 out of memory, -4 thread error.
 * `impl`: 0 = best available, 1 = portable, 2 = AVX-512 BF16 (refused with -1 if unavailable). */
int tfp4_grouped_gemm(const uint16_t *x, const int64_t *offsets, const uint8_t *codes, const uint8_t *scales,
                      const float *lut, int block, const float *divisor, uint16_t *out, int64_t rows,
                      int64_t experts, int64_t n, int64_t k, int threads, int impl) {
    if (rows < 0 || experts < 1 || n < NT || n % NT || k < block || k % block || (block != 16 && block != 32) ||
        (block == 32 && k % 32))
        return -1;
    int avx = impl == 2 || (impl == 0 && tfp4_has_avx512bf16());
    if (avx && !tfp4_has_avx512bf16()) return -1;
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
    job_t base = {x, codes, scales, lut, divisor, out, n, k, block, ex, lo, hi, n / NT, 0, 0, avx};
    int64_t items = used * base.tiles;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int)items;
    job_t jobs[64];
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    int rc = 0, started = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].item_lo = items * t / threads;
        jobs[t].item_hi = items * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, run_items, &jobs[t]) != 0) {
            rc = -4;
            break;
        }
        started = t;
    }
    if (run_items(&jobs[0]) != NULL) rc = -3;
    for (int t = 1; t <= started; t++) {
        void *res = NULL;
        pthread_join(tid[t], &res);
        if (res != NULL) rc = -3;
    }
    if (rc == -4) { /* a thread could not start: do its share here */
        for (int t = started + 1; t < threads; t++)
            if (run_items(&jobs[t]) != NULL) rc = -3;
        if (rc == -4) rc = 0;
    }
    free(ex);
    return rc;
}
