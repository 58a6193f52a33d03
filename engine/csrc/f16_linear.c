/* Linear layers whose fp32 weights are exactly fp16 values (a model converted from an fp16
 * checkpoint, e.g. Whisper from CTranslate2), for small batches on x86 CPUs:
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W read as fp16 and widened exactly to fp32, fp32
 * arithmetic. A decode step reads every weight once, so half the bytes is up to half the time
 * (Whisper's 51,864 x 384 output head: docs/BENCHMARKS.md).
 *
 * Every output element is computed by the same sequence of operations whatever M is, so a row's
 * result does not depend on the rows batched with it (for a given build). AVX2 + FMA + F16C, or
 * AVX-512F when compiled for it; K % 16 == 0. */
#include <stdint.h>

#include "vec.h"

#define MR 4                 /* rows of x per pass over a weight row (the weight row stays in L1) */
#define PREFETCH_BYTES 4096 /* how far ahead in the weights */

#if defined(__AVX512F__)
static inline vec wload(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
static inline vec wload(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* Rows r0..r0+ROWS-1 of y for weight row n; two accumulators (even and odd vectors along K),
 * named, not picked by the vector's parity: so picked, they lived on the stack. */
static inline __attribute__((always_inline)) void row_block(float *y, const float *x, const uint16_t *w,
                                                           const float *bias, int64_t n, int64_t r0, const int ROWS,
                                                           int64_t N, int64_t K) {
    const uint16_t *wn = w + n * K;
    const float *xb = x + r0 * K;
    vec even[MR], odd[MR];
    for (int r = 0; r < ROWS; r++) even[r] = odd[r] = vzero();
    int64_t k = 0;
    for (; k + LANES < K; k += 2 * LANES) {
        /* every 32 halves (64 bytes): k steps 16 (AVX2) or 32 (AVX-512), so k + LANES never lands on one */
        if ((k & 31) == 0) _mm_prefetch((const char *)(wn + k) + PREFETCH_BYTES, _MM_HINT_T0);
        const vec we = wload(wn + k), wo = wload(wn + k + LANES);
        for (int r = 0; r < ROWS; r++) {
            even[r] = vfmadd(we, vload(xb + r * K + k), even[r]);
            odd[r] = vfmadd(wo, vload(xb + r * K + k + LANES), odd[r]);
        }
    }
    if (k < K) {
        const vec we = wload(wn + k);
        for (int r = 0; r < ROWS; r++) even[r] = vfmadd(we, vload(xb + r * K + k), even[r]);
    }
    for (int r = 0; r < ROWS; r++) {
        const float s = hsum(vadd(even[r], odd[r]));
        y[(r0 + r) * N + n] = bias ? s + bias[n] : s;
    }
}

void f16_linear_f32(float *y, const float *x, const uint16_t *w, const float *bias, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            switch (M - r0 < MR ? (int)(M - r0) : MR) { /* constant ROWS: registers, unrolled loops */
            case 1: row_block(y, x, w, bias, n, r0, 1, N, K); break;
            case 2: row_block(y, x, w, bias, n, r0, 2, N, K); break;
            case 3: row_block(y, x, w, bias, n, r0, 3, N, K); break;
            default: row_block(y, x, w, bias, n, r0, 4, N, K); break;
            }
        }
    }
}
