/* What kv_attention.h's two paths share: the job both run, its limits, and the scalar steps whose
 * results both must reproduce bit for bit (exp, the 16-lane tree, the key -> cache row lookup).
 * Each path's header includes this one, so kv_attention_avx.h stands on its own (it compiles alone)
 * and kv_attention.h includes it at the top like any other header, not after its own definitions. */
#ifndef TFP4_KV_COMMON_H
#define TFP4_KV_COMMON_H
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
    int scale_bits; /* kv_scale_bits_match: the AVX-512 path may decode scale bytes by their bits */
    float scale;
    int vbmi; /* the AVX-512 path may use AVX512-VBMI (kv_has_vbmi) */
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

/* The cache rows (slot * hkv + h) of keys k0 .. k0+n-1 of sequence seq: consecutive slots when the
 * chunk lies in one block (block sizes that are multiples of 16), else looked up key by key. */
static inline void kv_chunk_rows(const kv_job_t *j, int64_t seq, int64_t k0, int n, int64_t h, int64_t *r) {
    if (k0 / j->block_size == (k0 + n - 1) / j->block_size) {
        const int64_t first = kv_slot(j, seq, k0);
        for (int i = 0; i < n; i++) r[i] = (first + i) * j->hkv + h;
        return;
    }
    for (int i = 0; i < n; i++) r[i] = kv_slot(j, seq, k0 + i) * j->hkv + h;
}
#endif
