/* The routed experts' SiLU-gated activation: res[r, i] = bf16_rne( fl32(silu[g]) * fl32(u) ) for gate
 * g = x[r, i] and up u = x[r, inter + i] (the [gate; up] halves of one gate-up row), where silu[] is a
 * table of torch's own bf16 SiLU of every bf16 bit pattern, made by the caller with torch in this
 * process (tracefp4.formats.clib.combine.silu_gate). So the result is bit for bit torch's
 * F.silu(gate) * up, two ops each rounded to bf16 (the product of two bf16 values is exact in
 * float32, and its rounding here is torch's round-to-nearest-even), without an exponential here
 * that would have to match Sleef's to the last bit. The table has one entry of padding, so a
 * 32-bit gather at entry 65535 stays inside it. */
#ifndef TFP4_SILU_GATE_H
#define TFP4_SILU_GATE_H
#include "fp4_common.h"

/* Columns [c0, inter) of one row. */
static void silu_row_portable(const uint16_t *x, int64_t inter, const uint16_t *table, uint16_t *res, int64_t c0) {
    for (int64_t i = c0; i < inter; i++) res[i] = bf16_rne(bf16_value(table[x[i]]) * bf16_value(x[inter + i]));
}

#if defined(__x86_64__)
AVX512 static void silu_row_avx(const uint16_t *x, int64_t inter, const uint16_t *table, uint16_t *res) {
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) {
        const __m512i g = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i)));
        /* 4 bytes at entry g: the entry in the low half (little-endian), its neighbour shifted out */
        const __m512i s = _mm512_i32gather_epi32(g, (const void *)table, 2);
        const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(s, 16));
        const __m512 uv = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + inter + i))), 16));
        _mm256_storeu_si256((__m256i *)(res + i), bf16_rne16(_mm512_mul_ps(sv, uv)));
    }
    silu_row_portable(x, inter, table, res, i); /* the columns left over */
}
#endif
#endif
