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
 * exp is a Cephes-style polynomial (kv_exp) made of float32 additions and multiplications only.
 *
 * This portable path is the readable definition: every operation above as written, in that order
 * (the library is compiled in ISO C mode, so nothing is contracted into fused multiply-adds). The
 * AVX-512 path (kv_attention_avx.h) computes the same attention over the same decoded rows (bit for
 * bit) with fused or paired float32 accumulation where that pays: q . k by vdpbf16ps (two exact
 * bf16 products added per lane and instruction, 4 lanes a key and a tree of 4 instead of 16 lanes
 * and a tree of 16), p . v by fused multiply-adds; the decode, exp, softmax, l, the l and numerator
 * sums, the scale and the division are the same operations in the same order. So the two paths
 * differ by rounding only, within the bound both are tested against (a score passes through at most
 * D + 1 roundings a term on either path, each sum through no more than on this path; the derivation
 * is in kv_attention_avx.h and beside the atol in tests/test_kv_attention.py).
 *
 * On either path each output is computed by one thread in a fixed order, so the thread count does
 * not change a bit, and repeated calls give the same bits; the AVX-512 path's roundings are those
 * of its instructions' definitions, the same on every run of a given machine. That path also lays
 * the work out for throughput: one division per row's tables, four keys scored by one instruction,
 * K and V loads shared by up to four query heads. */
#ifndef TFP4_KV_ATTENTION_H
#define TFP4_KV_ATTENTION_H
#include "kv_common.h"
#include "kv_attention_avx.h"

/* Whether the scale table holds what the bytes' bits say (E4M3 for 16-element blocks: bytes below
 * 0x7F, subnormals m * 2^-9; E8M0 for 32: 2^(b - 127), bytes below 0xFF), bit for bit: then the
 * AVX-512 path decodes scales without a table lookup (a gather) and gives the same values. */
static int kv_scale_bits_match(const float *lut, int fblock) {
    for (uint32_t b = 0; b < (fblock == 16 ? 0x7Fu : 0xFFu); b++) {
        float want;
        if (fblock == 16) want = b < 8 ? (float)b * 0x1p-9f : sq_float(b << 20) * 0x1p120f;
        else want = sq_float(b ? b << 23 : 0x00400000u);
        if (memcmp(&want, lut + b, sizeof want)) return 0;
    }
    return 1;
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
static void kv_decode_chunk(const kv_job_t *j, int64_t seq, int64_t k0, int n, int64_t h, float *kb, float *vb) {
    const int64_t half = j->d / 2, nsc = j->d / j->fblock;
    int64_t r[KV_CHUNK];
    kv_chunk_rows(j, seq, k0, n, h, r);
    for (int i = 0; i < n; i++) {
        kv_decode_portable(j, j->kc + r[i] * half, j->ks + r[i] * nsc, j->ka ? j->ka + r[i] : NULL, kb + i * j->d);
        kv_decode_portable(j, j->vc + r[i] * half, j->vs + r[i] * nsc, j->va ? j->va + r[i] : NULL, vb + i * j->d);
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
        kv_decode_chunk(j, seq, k0, n, h, kb, vb);
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

/* One packed row as the path of `j` decodes it (as a K row when `key`: the AVX-512 path's bf16
 * decoding) -> d bf16 bits in `out` (`row`: d floats of room). For tfp4_kv_decode_rows. */
static void kv_decode_row(const kv_job_t *j, const uint8_t *codes, const uint8_t *scales, const float *amax, int key,
                          float *row, uint16_t *out) {
#if defined(__x86_64__)
    if (j->avx && key) {
        kv_decode_bf16_avx(j, codes, scales, amax, row, out);
        return;
    }
    if (j->avx) kv_decode_fast_avx(j, codes, scales, amax, row);
    else
#endif
        kv_decode_portable(j, codes, scales, amax, row);
    for (int64_t e = 0; e < j->d; e++) out[e] = bf16_rne(row[e]); /* exact: the values are bf16 */
}

/* Items [lo, hi) of (query row, KV head) pairs, row-major. Returns 0 or -3 (out of memory). */
static int kv_run(const kv_job_t *j, int64_t lo, int64_t hi) {
    const int64_t g_count = j->hq / j->hkv;
    /* q, acc, the chunk's K and V rows, and two spare rows (the AVX-512 path's float32 K row before its
     * bf16 packing, and the bf16 row before its four-keys layout); zeroed: that path scores all 16
     * rows of a chunk and needs the unused ones finite, and reads its bf16 rows' zero padding */
    float *mem = calloc((size_t)((2 * g_count + 2 * KV_CHUNK + 2) * j->d), sizeof(float));
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
