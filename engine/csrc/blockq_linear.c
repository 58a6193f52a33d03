/* Linear layers on GGUF block-quantized weights, for small batches (decode steps) on x86 CPUs:
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W kept in its 32-weight blocks along K.
 *
 *   Q4_1 (fmt 1): w = d * q + m, q in 0..15; 16 bytes per block, q[j] in the low nibble of
 *                 byte j and q[j + 16] in its high nibble (GGUF's own layout).
 *   Q8_0 (fmt 0): w = d * q, q int8; 32 bytes per block.
 *
 * A decode step reads every weight once: fp32 weights are 4 bytes per weight, Q4_1 0.625 and
 * Q8_0 1.125, so reading them in place beats dequantizing to fp32 once at load time. Per block,
 * d * dot(x, q) + m * sum(x): the block sums of x are computed once per row. Unpacking the
 * quants is most of the work, so the weight rows are prefetched ahead (the hardware prefetcher
 * alone left a 1-row step at ~half the memory bandwidth) and, built with AVX-512, a block is two
 * 16-lane vectors instead of four 8-lane ones (1.4x on a SmolLM2 step where AVX-512 runs at full
 * width; docs/BENCHMARKS.md).
 *
 * Every output element is computed by the same sequence of operations whatever M is, so a row's
 * result does not depend on the rows batched with it (for a given build). AVX2 + FMA, or
 * AVX-512F when compiled for it; K % 32 == 0. */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define QK 32
#define MR 4                 /* rows of x per pass over a weight row (the weight row stays in L1) */
#define PREFETCH_BYTES 4096 /* how far ahead in the quants (measured: 2-8 KiB all good) */

#if defined(__AVX512F__)
/* The 32 quants of one block as two vectors of 16 (dequantized up to d and m). */
static inline void load_block(const uint8_t *qb, int fmt, vec w[2]) {
    if (fmt == 1) {
        const __m128i v = _mm_loadu_si128((const __m128i *)qb), mask = _mm_set1_epi8(0x0F);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
    } else {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16))));
    }
}
#else
static inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
/* 8 int8 quants widened straight from memory (no register shuffle). */
static inline __m256 i8_to_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 32 quants of one block as four vectors of 8 (dequantized up to d and m). */
static inline void load_block(const uint8_t *qb, int fmt, vec w[4]) {
    if (fmt == 1) {
        const __m128i v = _mm_loadu_si128((const __m128i *)qb);
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        w[0] = u8_to_ps(lo);
        w[1] = u8_to_ps(_mm_srli_si128(lo, 8));
        w[2] = u8_to_ps(hi);
        w[3] = u8_to_ps(_mm_srli_si128(hi, 8));
    } else {
        w[0] = i8_to_ps(qb);
        w[1] = i8_to_ps(qb + 8);
        w[2] = i8_to_ps(qb + 16);
        w[3] = i8_to_ps(qb + 24);
    }
}
#endif

#define NV (QK / LANES) /* vectors per block */

/* Rows r0..r0+ROWS-1 of y for weight row n. Even and odd blocks go to two accumulators (two
 * dependency chains), added at the end; ROWS is a constant at each call (registers, unrolled
 * loops) and the operations per row are the same for every ROWS. */
static inline __attribute__((always_inline)) void row_block(float *y, const float *x, const float *xsum,
                                                           const uint8_t *q, const float *d, const float *m,
                                                           const float *bias, int64_t n, int64_t r0, const int ROWS,
                                                           int64_t N, int64_t K, int fmt) {
    const int64_t nb = K / QK, bytes = fmt == 1 ? QK / 2 : QK;
    const uint8_t *qn = q + n * nb * bytes;
    const float *dn = d + n * nb, *xb = x + r0 * K;
    vec acc[2][MR];
    for (int r = 0; r < ROWS; r++) acc[0][r] = acc[1][r] = vzero();
    for (int64_t b = 0; b < nb; b++) {
        vec w[NV];
        _mm_prefetch((const char *)(qn + b * bytes) + PREFETCH_BYTES, _MM_HINT_T0);
        if ((b & 7) == 0) _mm_prefetch((const char *)(dn + b) + PREFETCH_BYTES / 8, _MM_HINT_T0);
        load_block(qn + b * bytes, fmt, w);
        const vec db = vset1(dn[b]);
        for (int r = 0; r < ROWS; r++) {
            const float *xr = xb + r * K + b * QK;
            vec t = vmul(w[0], vload(xr));
            for (int v = 1; v < NV; v++) t = vfmadd(w[v], vload(xr + v * LANES), t);
            acc[b & 1][r] = vfmadd(db, t, acc[b & 1][r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float s = hsum(vadd(acc[0][r], acc[1][r]));
        if (fmt == 1) { /* + sum_b m[n, b] * xsum[r, b] */
            const float *mn = m + n * nb, *xs = xsum + (r0 + r) * nb;
            for (int64_t b = 0; b < nb; b++) s += mn[b] * xs[b];
        }
        y[(r0 + r) * N + n] = bias ? s + bias[n] : s;
    }
}

void blockq_linear_f32(float *y, const float *x, const uint8_t *q, const float *d, const float *m, const float *bias,
                       int64_t M, int64_t N, int64_t K, int fmt, int nthreads) {
    const int64_t nb = K / QK;
    float *xsum = NULL;
    if (fmt == 1) {
        xsum = malloc(sizeof(float) * M * nb);
        for (int64_t i = 0; i < M * nb; i++) {
            const float *xq = x + i * QK;
            vec s = vload(xq);
            for (int v = 1; v < NV; v++) s = vadd(s, vload(xq + v * LANES));
            xsum[i] = hsum(s);
        }
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            switch (M - r0 < MR ? (int)(M - r0) : MR) {
            case 1: row_block(y, x, xsum, q, d, m, bias, n, r0, 1, N, K, fmt); break;
            case 2: row_block(y, x, xsum, q, d, m, bias, n, r0, 2, N, K, fmt); break;
            case 3: row_block(y, x, xsum, q, d, m, bias, n, r0, 3, N, K, fmt); break;
            default: row_block(y, x, xsum, q, d, m, bias, n, r0, 4, N, K, fmt); break;
            }
        }
    }
    free(xsum);
}
