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
 * Above SMALL_M rows (a prefill chunk, a large decode batch) the per-block unpacking would be
 * repeated for every MR rows, so the kernel stages NR weight rows at a time, dequantized to fp32
 * (exactly the loader's weights), in a small per-thread buffer that stays in L1, and streams every
 * row of x past them with one accumulator per (row, weight row) over the whole of K. On 2 cores a
 * short prefill is bound by reading the weights: fp32 weights are 6.4x the bytes of Q4_1 blocks.
 *
 * In each regime (M <= SMALL_M, M > SMALL_M) every output element is computed by the same
 * sequence of operations whatever M is, so a row's result does not depend on the rows batched
 * with it (for a given build). AVX2 + FMA, or AVX-512F when compiled for it; K % 32 == 0. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define QK 32
#define MR 4                 /* rows of x per pass over a weight row (the weight row stays in L1) */
#define PREFETCH_BYTES 4096 /* how far ahead in the quants (measured: 2-8 KiB all good) */
#define SMALL_M (2 * MR)     /* up to this many rows: per-block dots (row_block) */
#define NR 4                 /* weight rows staged at once (staged path) */
#if defined(__AVX512F__)
#define RR 4 /* rows of x per pass over the staged weights: RR * NR accumulators + NR weights */
#else
#define RR 2 /* 16 registers: 8 accumulators, 4 weights, x */
#endif

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
/* 8 int8 quants widened straight from memory (no register shuffle). */
static inline __m256 i8_to_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 32 quants of one block as four vectors of 8 (dequantized up to d and m). Q4_1: each 8 bytes
 * widened once to 32-bit lanes give both their low nibbles (quants j) and high ones (j + 16):
 * two widening shuffles a block instead of six (the shuffle port bounds a 1-row step). */
static inline void load_block(const uint8_t *qb, int fmt, vec w[4]) {
    if (fmt == 1) {
        const __m256i mask = _mm256_set1_epi32(0x0F);
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qb));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8)));
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else {
        w[0] = i8_to_ps(qb);
        w[1] = i8_to_ps(qb + 8);
        w[2] = i8_to_ps(qb + 16);
        w[3] = i8_to_ps(qb + 24);
    }
}
#endif

#define NV (QK / LANES) /* vectors per block */

/* acc[r] += d_b * dot(block b of weight row qn, block b of row r of x), for ROWS rows. */
static inline __attribute__((always_inline)) void block_dot(vec *acc, const float *xb, const uint8_t *qn,
                                                           const float *dn, int64_t b, const int ROWS, int64_t K,
                                                           const int fmt) {
    const int64_t bytes = fmt == 1 ? QK / 2 : QK;
    vec w[NV];
    _mm_prefetch((const char *)(qn + b * bytes) + PREFETCH_BYTES, _MM_HINT_T0);
    if ((b & 7) == 0) _mm_prefetch((const char *)(dn + b) + PREFETCH_BYTES / 8, _MM_HINT_T0);
    load_block(qn + b * bytes, fmt, w);
    const vec db = vset1(dn[b]);
    for (int r = 0; r < ROWS; r++) {
        const float *xr = xb + r * K + b * QK;
        vec t = vmul(w[0], vload(xr));
        for (int v = 1; v < NV; v++) t = vfmadd(w[v], vload(xr + v * LANES), t);
        acc[r] = vfmadd(db, t, acc[r]);
    }
}

/* Rows r0..r0+ROWS-1 of y for weight row n. Even and odd blocks go to two accumulators (two
 * dependency chains), added at the end; ROWS and fmt are constants at each call (registers,
 * unrolled loops: an accumulator picked by b & 1 lived on the stack) and the operations per row
 * are the same for every ROWS. */
static inline __attribute__((always_inline)) void row_block(float *y, const float *x, const float *xsum,
                                                           const uint8_t *q, const float *d, const float *m,
                                                           const float *bias, int64_t n, int64_t r0, const int ROWS,
                                                           int64_t N, int64_t K, const int fmt) {
    const int64_t nb = K / QK, bytes = fmt == 1 ? QK / 2 : QK;
    const uint8_t *qn = q + n * nb * bytes;
    const float *dn = d + n * nb, *xb = x + r0 * K;
    vec even[MR], odd[MR];
    for (int r = 0; r < ROWS; r++) even[r] = odd[r] = vzero();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        block_dot(even, xb, qn, dn, b, ROWS, K, fmt);
        block_dot(odd, xb, qn, dn, b + 1, ROWS, K, fmt);
    }
    if (b < nb) block_dot(even, xb, qn, dn, b, ROWS, K, fmt);
    for (int r = 0; r < ROWS; r++) {
        float s = hsum(vadd(even[r], odd[r]));
        if (fmt == 1) { /* + sum_b m[n, b] * xsum[r, b] */
            const float *mn = m + n * nb, *xs = xsum + (r0 + r) * nb;
            for (int64_t j = 0; j < nb; j++) s += mn[j] * xs[j];
        }
        y[(r0 + r) * N + n] = bias ? s + bias[n] : s;
    }
}

/* row_block for the rows from r0 (at most MR), with ROWS and fmt as constants. */
static inline __attribute__((always_inline)) void rows_of(float *y, const float *x, const float *xsum,
                                                         const uint8_t *q, const float *d, const float *m,
                                                         const float *bias, int64_t n, int64_t r0, int64_t M,
                                                         int64_t N, int64_t K, const int fmt) {
    switch (M - r0 < MR ? (int)(M - r0) : MR) {
    case 1: row_block(y, x, xsum, q, d, m, bias, n, r0, 1, N, K, fmt); break;
    case 2: row_block(y, x, xsum, q, d, m, bias, n, r0, 2, N, K, fmt); break;
    case 3: row_block(y, x, xsum, q, d, m, bias, n, r0, 3, N, K, fmt); break;
    default: row_block(y, x, xsum, q, d, m, bias, n, r0, 4, N, K, fmt); break;
    }
}

/* Weight rows n0..n0+nr-1 as fp32 in buf[NR][K] (rows past nr zero). The values are exactly the
 * loader's dequantized weights: d * q, and for Q4_1 + m rounded after the product, as torch
 * computes it (so no contraction into an FMA here). */
__attribute__((optimize("fp-contract=off"))) static void stage_rows(float *buf, const uint8_t *q, const float *d,
                                                                    const float *m, int64_t n0, int64_t nr, int64_t K,
                                                                    int fmt) {
    const int64_t nb = K / QK, bytes = fmt == 1 ? QK / 2 : QK;
    for (int64_t j = 0; j < NR; j++) {
        float *out = buf + j * K;
        if (j >= nr) {
            for (int64_t k = 0; k < K; k += LANES) vstore(out + k, vzero());
            continue;
        }
        const int64_t row = (n0 + j) * nb;
        for (int64_t b = 0; b < nb; b++) {
            vec w[NV];
            load_block(q + (row + b) * bytes, fmt, w);
            const vec db = vset1(d[row + b]), mb = fmt == 1 ? vset1(m[row + b]) : vzero();
            for (int v = 0; v < NV; v++) {
                vec t = vmul(w[v], db);
                if (fmt == 1) t = vadd(t, mb);
                vstore(out + b * QK + v * LANES, t);
            }
        }
    }
}

/* y[r0..r0+ROWS-1, n0..n0+nr-1] from the staged rows: for each (row, weight row) one accumulator,
 * FMAs over K in order, then a horizontal sum; ROWS is a constant at each call. */
static inline __attribute__((always_inline)) void staged_rows(float *y, const float *x, const float *buf,
                                                              const float *bias, int64_t n0, int64_t nr, int64_t r0,
                                                              const int ROWS, int64_t N, int64_t K) {
    vec acc[RR][NR];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = vzero();
    for (int64_t k = 0; k < K; k += LANES) {
        vec w[NR];
        for (int j = 0; j < NR; j++) w[j] = vload(buf + j * K + k);
        for (int r = 0; r < ROWS; r++) {
            const vec xv = vload(x + (r0 + r) * K + k);
            for (int j = 0; j < NR; j++) acc[r][j] = vfmadd(w[j], xv, acc[r][j]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < nr; j++) {
            const float s = hsum(acc[r][j]);
            y[(r0 + r) * N + n0 + j] = bias ? s + bias[n0 + j] : s;
        }
}

/* Returns 0 when its buffers cannot be had (the caller takes the per-block path). */
static int staged_linear(float *y, const float *x, const uint8_t *q, const float *d, const float *m,
                         const float *bias, int64_t M, int64_t N, int64_t K, int fmt, int nthreads) {
    float *bufs = aligned_alloc(64, sizeof(float) * NR * K * nthreads); /* K % 32 == 0: 64-byte rows */
    if (bufs == NULL) return 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = bufs + (int64_t)omp_get_thread_num() * NR * K;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NR) {
            const int64_t nr = N - n0 < NR ? N - n0 : NR;
            stage_rows(buf, q, d, m, n0, nr, K, fmt);
            for (int64_t r0 = 0; r0 < M; r0 += RR) {
                switch (M - r0 < RR ? (int)(M - r0) : RR) {
                case 1: staged_rows(y, x, buf, bias, n0, nr, r0, 1, N, K); break;
#if RR > 2
                case 2: staged_rows(y, x, buf, bias, n0, nr, r0, 2, N, K); break;
                case 3: staged_rows(y, x, buf, bias, n0, nr, r0, 3, N, K); break;
#endif
                default: staged_rows(y, x, buf, bias, n0, nr, r0, RR, N, K); break;
                }
            }
        }
    }
    free(bufs);
    return 1;
}

void blockq_linear_f32(float *y, const float *x, const uint8_t *q, const float *d, const float *m, const float *bias,
                       int64_t M, int64_t N, int64_t K, int fmt, int nthreads) {
    if (M > SMALL_M && staged_linear(y, x, q, d, m, bias, M, N, K, fmt, nthreads)) return;
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
            if (fmt == 1)
                rows_of(y, x, xsum, q, d, m, bias, n, r0, M, N, K, 1);
            else
                rows_of(y, x, xsum, q, d, m, bias, n, r0, M, N, K, 0);
        }
    }
    free(xsum);
}
