/* The routed experts' top-k combine: res[t, :] = bf16_rne( sum_j fl32(out[t, j, :] * w[t, j]) ), the
 * products rounded to float32 and summed in slot order from +0, as torch computes
 * (out.float() * w.unsqueeze(-1)).sum(dim=1).to(bf16) on the CPU (no fused multiply-add: the library
 * is compiled in ISO C mode, where GCC does not contract a * b + c). */
#ifndef TFP4_COMBINE_H
#define TFP4_COMBINE_H
#include "fp4_common.h"

/* Columns [c0, c1) of one token: out holds its k rows of h columns. */
static void combine_rows_portable(const uint16_t *out, const float *w, int64_t k, int64_t h, int64_t c0, int64_t c1,
                                  uint16_t *res) {
    for (int64_t c = c0; c < c1; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) acc = acc + bf16_value(out[j * h + c]) * w[j];
        res[c] = bf16_rne(acc);
    }
}

#if defined(__x86_64__)
AVX512 static void combine_rows_avx(const uint16_t *out, const float *w, int64_t k, int64_t h, uint16_t *res) {
    int64_t c = 0;
    for (; c + 16 <= h; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            __m512 v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(out + j * h + c))), 16));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, _mm512_set1_ps(w[j])));
        }
        _mm256_storeu_si256((__m256i *)(res + c), bf16_rne16(acc));
    }
    combine_rows_portable(out, w, k, h, c, h, res); /* the columns left over */
}
#endif
#endif
