/* Paged decode attention for x86 CPUs with AVX2+FMA: one query token per sequence, keys and
 * values read in place from the paged cache (no gather copy). Parallel over (sequence, kv
 * head). For each, pass 1 computes the scores of the G query heads sharing the kv head and a
 * softmax; pass 2 accumulates the values with the output row held in registers.
 * Requires head_dim % 16 == 0. Cache layout: [slot, kv_head, head_dim], slot = block*bs + i. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* Scores of one query row against 8 key rows at once: 8 independent FMA chains (no latency
 * stall), then one transposing reduction instead of 8 horizontal sums. */
static inline __m256 dot8(const float *qv, const float *const *rows, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(qv + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[0] + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[1] + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[2] + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[3] + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[4] + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[5] + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[6] + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[7] + d), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* out[d] = sum_t p[t] * rows[t][d] for one 64-wide chunk of the head (8 registers). */
static inline void weighted_rows64(float *out, const float *p, const float *const *rows, int64_t n, int64_t off) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m256 w = _mm256_set1_ps(p[t]);
        const float *r = rows[t] + off;
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
        a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
        a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
        a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
        a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
    }
    _mm256_storeu_ps(out, a0); _mm256_storeu_ps(out + 8, a1); _mm256_storeu_ps(out + 16, a2);
    _mm256_storeu_ps(out + 24, a3); _mm256_storeu_ps(out + 32, a4); _mm256_storeu_ps(out + 40, a5);
    _mm256_storeu_ps(out + 48, a6); _mm256_storeu_ps(out + 56, a7);
}

/* Same for a 16-wide tail chunk (head dims like 80 or 112). */
static inline void weighted_rows16(float *out, const float *p, const float *const *rows, int64_t n, int64_t off) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m256 w = _mm256_set1_ps(p[t]);
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[t] + off), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[t] + off + 8), a1);
    }
    _mm256_storeu_ps(out, a0); _mm256_storeu_ps(out + 8, a1);
}

void paged_decode_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                      int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
#pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t *table = block_tables + b * max_blocks;
            float *scores = (float *)malloc(sizeof(float) * G * n);
            const float **krows = (const float **)malloc(sizeof(float *) * n);
            const float **vrows = (const float **)malloc(sizeof(float *) * n);
            for (int64_t t = 0; t < n; t++) {
                const int64_t pos = start + t;
                const int64_t row = (table[pos / block_size] * block_size + pos % block_size) * num_kv_heads + h;
                krows[t] = k_cache + row * D;
                vrows[t] = v_cache + row * D;
            }
            const float *qh = q + (b * num_heads + h * G) * D;
            const __m256 vscale = _mm256_set1_ps(scale);
            int64_t t = 0;
            for (; t + 8 <= n; t += 8)
                for (int64_t g = 0; g < G; g++)
                    _mm256_storeu_ps(scores + g * n + t, _mm256_mul_ps(dot8(qh + g * D, krows + t, D), vscale));
            for (; t < n; t++)
                for (int64_t g = 0; g < G; g++) scores[g * n + t] = dot(qh + g * D, krows[t], D) * scale;
            float *oh = out + (b * num_heads + h * G) * D;
            for (int64_t g = 0; g < G; g++) {
                float *s = scores + g * n;
                float mx = s[0], sum = 0.f;
                for (int64_t i = 1; i < n; i++) mx = s[i] > mx ? s[i] : mx;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; i++) sum += (s[i] = expf(s[i] - mx));
                const float inv = 1.f / sum;
                for (int64_t i = 0; i < n; i++) s[i] *= inv;
                int64_t off = 0;
                for (; off + 64 <= D; off += 64) weighted_rows64(oh + g * D + off, s, vrows, n, off);
                for (; off < D; off += 16) weighted_rows16(oh + g * D + off, s, vrows, n, off);
            }
            free(scores);
            free(krows);
            free(vrows);
        }
    }
}
