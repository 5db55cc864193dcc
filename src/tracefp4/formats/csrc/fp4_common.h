/* What the kernels of both code layouts share (kernels.c includes this, then tiles.h and panels.h:
 * one translation unit, so the helpers inline across them): the job of one thread, the bf16
 * helpers, the E2M1 tables, the block-scale decoding and per-thread scratch memory. */
#ifndef TFP4_COMMON_H
#define TFP4_COMMON_H
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
    int layout; /* 0: tiles, 1: panels (kernels.c) */
    /* tiles layout: super-groups per row, code bytes per row; panels layout: 16-column panels */
    int64_t supers, cbytes, panels;
    /* non-empty experts: expert index and first/last row */
    const int64_t *ex, *ex_lo, *ex_hi;
    int64_t items_per_expert; /* tiles (4 columns) or panel pairs (32 columns) */
    int64_t item_lo, item_hi;
    int avx; /* the AVX-512 BF16 paths run (else portable C) */
    int amx; /* panels: experts with at least amx_min_rows rows take the AMX path */
    int64_t amx_min_rows;
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

/* 16 float32 lanes rounded to bf16 (round-to-nearest-even in integers: vcvtneps2bf16 would flush
 * subnormals; NaN -> 0x7FC0, as torch's cast). */
AVXINL __m256i bf16_rne16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                   _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))));
    bits = _mm512_mask_mov_epi32(_mm512_srli_epi32(bits, 16), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(bits);
}
#endif

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

#endif
