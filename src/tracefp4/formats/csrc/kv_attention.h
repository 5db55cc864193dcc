/* Paged, causal, grouped-query attention over a packed FP4 K/V cache (decode, and prefill as the
 * same kernel over the prompt's query rows).
 *
 * The cache holds, per slot (block b, offset o: slot b * block_size + o) and KV head h, a K row and a
 * V row exactly as the site kernel (site_quant.h) writes a row: D/2 code bytes (element 2i in the
 * low nibble of byte i), D/fblock scale bytes, and (NVFP4) the row's FP32 amax. A row's element is
 *
 *   kv = bf16_rne( fl32( e2m1(code) * lut[scale] ) / S_enc(amax) )      (S_enc = 1 without amaxes)
 *
 * the very value the site kernel returns as the dequantized row (site_quant.h, formats/reference.py:
 * dequantize_nvfp4, rounded to bf16 as the cache stores it): exact, decoded here per 16 elements
 * through a table of the 16 values of the block (one multiplication, one division and one rounding
 * per entry, the same in both paths).
 *
 * Query row r (sequence seq = q_seq[r], attending to keys 0 .. q_len[r]-1 of it: q_len = the
 * sequence length for decode, position + 1 for a prompt's rows) and KV head h: the G = Hq/Hkv query
 * heads h*G .. h*G+G-1 are computed together, reading each K/V row once. Keys are taken 16 at a time
 * (a chunk), in order; for query head g:
 *
 *   s_j   = fl32(q_g . k_j) * scale            (16 float32 lane sums over d = lane mod 16, then a
 *                                               fixed pairwise tree: lanes i + i+8, i + i+4, ...)
 *   m'    = max(m, max_j s_j);  alpha = exp(m - m');  p_j = exp(s_j - m')
 *   l     = l * alpha + tree_sum(p)            acc[d] = acc[d] * alpha + p_0 v_0[d] + p_1 v_1[d] + ...
 *   out   = acc / l                            (0 for a row with no keys)
 *
 * exp is a Cephes-style polynomial (kv_exp) made of float32 additions and multiplications only, so
 * the portable C and AVX-512 paths run the same operations in the same order and give the same bits
 * (the library is compiled in ISO C mode: no contraction into fused multiply-adds). Each output is
 * computed by one thread in that fixed order, so the thread count does not change a bit either. */
#ifndef TFP4_KV_ATTENTION_H
#define TFP4_KV_ATTENTION_H
#include "fp4_common.h"
#include "site_quant.h"
#include <math.h>

#define KV_CHUNK 16
#define KV_MAX_DIM 256
#define KV_MAX_GROUP 32

typedef struct {
    const uint16_t *q;
    const uint8_t *kc, *ks, *vc, *vs;
    const float *ka, *va, *lut;
    const int32_t *table, *q_seq, *q_len;
    float *out;
    int64_t hq, hkv, d, max_blocks;
    int block_size, fblock, avx;
    float scale;
} kv_job_t;

/* exp(x) for x <= 0 (0 below -87, where the result would leave float32's normal range):
 * x = n ln2 + r with n = rint(x log2 e) (the 1.5 * 2^23 trick: round to nearest even), ln2 in two
 * parts (Cody-Waite), Cephes' degree-7 polynomial for e^r, times 2^n by the exponent bits. */
static inline float kv_exp(float x) {
    if (!(x > -87.0f)) return 0.0f;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    return p * sq_float((uint32_t)((int32_t)n + 127) << 23);
}

/* The pairwise tree both paths sum 16 lanes with. */
static inline float kv_tree16(const float *a) {
    float b[8], c[4];
    for (int i = 0; i < 8; i++) b[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* The slot of key i of sequence seq. */
static inline int64_t kv_slot(const kv_job_t *j, int64_t seq, int64_t i) {
    return (int64_t)j->table[seq * j->max_blocks + i / j->block_size] * j->block_size + i % j->block_size;
}

/* The 16 values a block's codes stand for (its table), in float32 (bf16-exact). */
static inline void kv_block_table(float scale, float s_enc, float *tbl) {
    for (int c = 0; c < 16; c++) tbl[c] = bf16_value(bf16_rne((E2M1[c] * scale) / s_enc));
}

/* One packed row (codes, scale bytes, amax or NULL) -> d float32 values. */
static void kv_decode_portable(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales, const float *amax,
                               float *row) {
    const float s_enc = amax ? sq_s_enc(*amax) : 1.0f;
    float tbl[16];
    for (int64_t e = 0; e < j->d; e += 16) {
        if (e % j->fblock == 0) kv_block_table(j->lut[scales[e / j->fblock]], s_enc, tbl);
        for (int i = 0; i < 8; i++) {
            const uint8_t b = codes[e / 2 + i];
            row[e + 2 * i] = tbl[b & 15];
            row[e + 2 * i + 1] = tbl[b >> 4];
        }
    }
}

/* Decode the chunk's n K and V rows of KV head h into kb, vb [16, d]. */
static void kv_decode_chunk(const kv_job_t *j, int64_t seq, int64_t k0, int n, int64_t h, float *kb, float *vb,
                            void (*decode)(const kv_job_t *, const uint8_t *, const uint8_t *, const float *, float *)) {
    const int64_t half = j->d / 2, nsc = j->d / j->fblock;
    for (int i = 0; i < n; i++) {
        const int64_t r = kv_slot(j, seq, k0 + i) * j->hkv + h;
        decode(j, j->kc + r * half, j->ks + r * nsc, j->ka ? j->ka + r : NULL, kb + i * j->d);
        decode(j, j->vc + r * half, j->vs + r * nsc, j->va ? j->va + r : NULL, vb + i * j->d);
    }
}

/* The softmax step of one query head over a chunk of n scores s[16] (lanes n.. unused): updates
 * m and l, writes the weights into p[16] and returns alpha. */
static inline float kv_softmax_step(float *s, int n, float *m, float *l, float *p) {
    float mx = *m;
    for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    const float alpha = kv_exp(*m - mx);
    for (int i = 0; i < 16; i++) p[i] = i < n ? kv_exp(s[i] - mx) : 0.0f;
    *m = mx;
    *l = *l * alpha + kv_tree16(p);
    return alpha;
}

/* One (query row, KV head) item on the portable path. */
static void kv_item_portable(const kv_job_t *j, int64_t row, int64_t h, float *mem) {
    const int64_t d = j->d, g_count = j->hq / j->hkv, seq = j->q_seq[row], len = j->q_len[row];
    float *q = mem, *acc = q + g_count * d, *kb = acc + g_count * d, *vb = kb + KV_CHUNK * d;
    float m[KV_MAX_GROUP], l[KV_MAX_GROUP], s[16], p[16], lane[16];
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t e = 0; e < d; e++) q[g * d + e] = bf16_value(j->q[(row * j->hq + h * g_count + g) * d + e]);
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(g_count * d));
    for (int64_t k0 = 0; k0 < len; k0 += KV_CHUNK) {
        const int n = len - k0 < KV_CHUNK ? (int)(len - k0) : KV_CHUNK;
        kv_decode_chunk(j, seq, k0, n, h, kb, vb, kv_decode_portable);
        for (int64_t g = 0; g < g_count; g++) {
            for (int i = 0; i < n; i++) {
                for (int c = 0; c < 16; c++) lane[c] = 0.0f;
                for (int64_t e = 0; e < d; e++) lane[e % 16] = lane[e % 16] + q[g * d + e] * kb[i * d + e];
                s[i] = kv_tree16(lane) * j->scale;
            }
            const float alpha = kv_softmax_step(s, n, &m[g], &l[g], p);
            for (int64_t e = 0; e < d; e++) {
                float a = acc[g * d + e] * alpha;
                for (int i = 0; i < n; i++) a = a + p[i] * vb[i * d + e];
                acc[g * d + e] = a;
            }
        }
    }
    float *out = j->out + (row * j->hq + h * g_count) * d;
    for (int64_t e = 0; e < g_count * d; e++) out[e] = len ? acc[e] / l[e / d] : 0.0f;
}

#if defined(__x86_64__)
AVXINL float kv_tree16_avx(__m512 v) {
    __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 e = _mm_add_ps(c, _mm_movehl_ps(c, c)); /* lanes 0, 1: (c0 + c2), (c1 + c3) */
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}

/* The 16 blocks' worth of... one row: per 16 elements, the block's table by one vector
 * multiplication, division and rounding, then vpermps by the 16 code nibbles. */
AVX512 static void kv_decode_avx(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales, const float *amax,
                                 float *row) {
    const __m512 s_enc = _mm512_set1_ps(amax ? sq_s_enc(*amax) : 1.0f), e2m1 = _mm512_loadu_ps(E2M1);
    const __m128i nib = _mm_set1_epi8(15);
    __m512 tbl = _mm512_setzero_ps();
    for (int64_t e = 0; e < j->d; e += 16) {
        if (e % j->fblock == 0) {
            __m512i b = _mm512_castps_si512(_mm512_div_ps(_mm512_mul_ps(e2m1, _mm512_set1_ps(j->lut[scales[e / j->fblock]])), s_enc));
            b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
            tbl = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u))); /* finite: no NaN case */
        }
        const __m128i by = _mm_loadl_epi64((const __m128i *)(codes + e / 2));
        const __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(by, nib), _mm_and_si128(_mm_srli_epi16(by, 4), nib));
        _mm512_storeu_ps(row + e, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), tbl));
    }
}

/* kv_exp on 16 lanes, the same operations. */
AVXINL __m512 kv_exp_avx(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

/* One (query row, KV head) item on the AVX-512 path (d a multiple of 16). */
AVX512 static void kv_item_avx(const kv_job_t *j, int64_t row, int64_t h, float *mem) {
    const int64_t d = j->d, g_count = j->hq / j->hkv, seq = j->q_seq[row], len = j->q_len[row];
    float *q = mem, *acc = q + g_count * d, *kb = acc + g_count * d, *vb = kb + KV_CHUNK * d;
    float m[KV_MAX_GROUP], l[KV_MAX_GROUP];
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_ps(q + g * d + e, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(j->q + (row * j->hq + h * g_count + g) * d + e))), 16)));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(g_count * d));
    for (int64_t k0 = 0; k0 < len; k0 += KV_CHUNK) {
        const int n = len - k0 < KV_CHUNK ? (int)(len - k0) : KV_CHUNK;
        kv_decode_chunk(j, seq, k0, n, h, kb, vb, kv_decode_avx);
        for (int64_t g = 0; g < g_count; g++) {
            float s[16] = {0};
            for (int i = 0; i < n; i++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t e = 0; e < d; e += 16)
                    a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(q + g * d + e), _mm512_loadu_ps(kb + i * d + e)));
                s[i] = kv_tree16_avx(a) * j->scale;
            }
            float mx = m[g];
            for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            const float alpha = kv_exp(m[g] - mx);
            const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
            const __m512 pv = _mm512_maskz_mov_ps(live, kv_exp_avx(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(mx))));
            float p[16];
            _mm512_storeu_ps(p, pv);
            m[g] = mx;
            l[g] = l[g] * alpha + kv_tree16_avx(pv);
            for (int64_t e = 0; e < d; e += 16) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + e), _mm512_set1_ps(alpha));
                for (int i = 0; i < n; i++) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(vb + i * d + e)));
                _mm512_storeu_ps(acc + g * d + e, a);
            }
        }
    }
    float *out = j->out + (row * j->hq + h * g_count) * d;
    for (int64_t g = 0; g < g_count; g++) {
        const __m512 lv = _mm512_set1_ps(l[g]);
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_ps(out + g * d + e, len ? _mm512_div_ps(_mm512_loadu_ps(acc + g * d + e), lv) : _mm512_setzero_ps());
    }
}
#endif

/* Items [lo, hi) of (query row, KV head) pairs, row-major. Returns 0 or -3 (out of memory). */
static int kv_run(const kv_job_t *j, int64_t lo, int64_t hi) {
    const int64_t g_count = j->hq / j->hkv;
    float *mem = malloc(sizeof(float) * (size_t)((2 * g_count + 2 * KV_CHUNK) * j->d));
    if (!mem) return -3;
    for (int64_t it = lo; it < hi; it++) {
#if defined(__x86_64__)
        if (j->avx) {
            kv_item_avx(j, it / j->hkv, it % j->hkv, mem);
            continue;
        }
#endif
        kv_item_portable(j, it / j->hkv, it % j->hkv, mem);
    }
    free(mem);
    return 0;
}

/* Checks the block table and the query rows against the cache; returns 0, -5 (*bad: the sequence
 * whose used blocks leave [0, num_blocks)) or -6 (*bad: the query row whose sequence or key count
 * is out of range). */
static int kv_check(const kv_job_t *j, int64_t rows, int64_t seqs, const int32_t *seq_lens, int64_t num_blocks,
                    int64_t *bad) {
    for (int64_t s = 0; s < seqs; s++) {
        if (seq_lens[s] < 0 || seq_lens[s] > j->max_blocks * j->block_size) {
            *bad = s;
            return -5;
        }
        for (int64_t b = 0; b < (seq_lens[s] + j->block_size - 1) / j->block_size; b++)
            if (j->table[s * j->max_blocks + b] < 0 || j->table[s * j->max_blocks + b] >= num_blocks) {
                *bad = s;
                return -5;
            }
    }
    for (int64_t r = 0; r < rows; r++)
        if (j->q_seq[r] < 0 || j->q_seq[r] >= seqs || j->q_len[r] < 0 || j->q_len[r] > seq_lens[j->q_seq[r]]) {
            *bad = r;
            return -6;
        }
    return 0;
}
#endif
