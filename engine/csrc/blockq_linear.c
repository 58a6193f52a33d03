/* Linear layers on GGUF block-quantized weights, for small batches (decode steps) on x86 CPUs:
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W kept in its 32-weight blocks along K.
 *
 *   Q4_1 (fmt 1): w = d * q + m, q in 0..15; 16 bytes per block, q[j] in the low nibble of
 *                 byte j and q[j + 16] in its high nibble (GGUF's own layout).
 *   Q8_0 (fmt 0): w = d * q, q int8; 32 bytes per block.
 *
 * A decode step is memory-bound: fp32 weights are 4 bytes per weight, Q4_1 0.625 and Q8_0
 * 1.125, so reading them in place beats dequantizing to fp32 once at load time. Per block,
 * d * dot(x, q) + m * sum(x): the block sums of x are computed once per row.
 *
 * Every output element is computed by the same sequence of operations whatever M is, so a row's
 * result does not depend on the rows batched with it. AVX2 + FMA; K % 32 == 0. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32
#define MR 4 /* rows of x per pass over a weight row (the weight row stays in L1) */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* The 32 weights of one block as four vectors of 8 (dequantized up to d and m). */
static inline void load_block(const uint8_t *qb, int fmt, __m256 w[4]) {
    if (fmt == 1) {
        const __m128i v = _mm_loadu_si128((const __m128i *)qb);
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        w[0] = u8_to_ps(lo);
        w[1] = u8_to_ps(_mm_srli_si128(lo, 8));
        w[2] = u8_to_ps(hi);
        w[3] = u8_to_ps(_mm_srli_si128(hi, 8));
    } else {
        const __m128i a = _mm_loadu_si128((const __m128i *)qb), b = _mm_loadu_si128((const __m128i *)(qb + 16));
        w[0] = i8_to_ps(a);
        w[1] = i8_to_ps(_mm_srli_si128(a, 8));
        w[2] = i8_to_ps(b);
        w[3] = i8_to_ps(_mm_srli_si128(b, 8));
    }
}

/* Rows r0..r0+rows-1 of y for weight row n. */
static void row_block(float *y, const float *x, const float *xsum, const uint8_t *q, const float *d, const float *m,
                      const float *bias, int64_t n, int64_t r0, int rows, int64_t N, int64_t K, int fmt) {
    const int64_t nb = K / QK, bytes = fmt == 1 ? QK / 2 : QK;
    const uint8_t *qn = q + n * nb * bytes;
    const float *dn = d + n * nb;
    __m256 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        load_block(qn + b * bytes, fmt, w);
        const __m256 db = _mm256_set1_ps(dn[b]);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (r0 + r) * K + b * QK;
            __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
            t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), t);
            t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), t);
            t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), t);
            acc[r] = _mm256_fmadd_ps(db, t, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum(acc[r]);
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
            const float *xb = x + i * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            xsum[i] = hsum(s);
        }
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r0 = 0; r0 < M; r0 += MR) {
            const int rows = M - r0 < MR ? (int)(M - r0) : MR;
            row_block(y, x, xsum, q, d, m, bias, n, r0, rows, N, K, fmt);
        }
    }
    free(xsum);
}
