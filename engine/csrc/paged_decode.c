/* Paged decode attention for x86 CPUs: one query token per sequence, keys and values read in
 * place from the paged cache (no gather copy).
 *
 * Cache layout: [slot, kv_head, head_dim], slot = block * block_size + i. One task handles one
 * chunk of one sequence's context for ALL heads, so every cache row ([kv_head, head_dim], all
 * heads of one token) is read once, contiguously, and can be prefetched as a whole. Long contexts at small batch are split into several chunks (flash-decoding) so both cores
 * work; the chunks' partial softmax states are merged at the end.
 *
 * The rows of one sequence sit in random blocks, so the hardware prefetcher loses the stream at
 * every block boundary: rows are prefetched (into L2) 16 ahead. Together 2x faster than the
 * per-head kernel before it (docs/BENCHMARKS.md). AVX2+FMA; requires head_dim % 16 == 0. (AVX-512 gained <5% on the Zen 4 here.) */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CHUNK 512
#define PREFETCH_ROWS 16 /* measured: 8-32 within noise, 16 best; into L2 (L1 prefetch was 2x slower) */

static inline const float *row_at(const float *cache, const int64_t *table, int64_t pos, int64_t block_size,
                                  int64_t row_len) {
    return cache + (table[pos / block_size] * block_size + pos % block_size) * row_len;
}

static inline void prefetch_row(const float *row, int64_t row_len) {
    for (int64_t i = 0; i < row_len; i += 16) __builtin_prefetch(row + i, 0, 1);
}

/* Scores of one query row against 8 key rows at once: 8 independent FMA chains (no latency
 * stall), then one transposing reduction instead of 8 horizontal sums. */
static inline __m256 dot8(const float *qv, const float *const *rows, int64_t off, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(qv + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[0] + off + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[1] + off + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[2] + off + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[3] + off + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[4] + off + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[5] + off + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[6] + off + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[7] + off + d), a7);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* acc[0:16] += sum_i p[i] * rows[i][off:off+16] for the m <= 8 rows of a group. */
static inline void accumulate16(float *acc, const float *p, const float *const *rows, int64_t m, int64_t off) {
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
    for (int64_t i = 0; i < m; i++) {
        const __m256 w = _mm256_set1_ps(p[i]);
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[i] + off), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[i] + off + 8), a1);
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
}

/* Same for 64 columns: 8 accumulators, loaded and stored once per group of rows. */
static inline void accumulate64(float *acc, const float *p, const float *const *rows, int64_t m, int64_t off) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + 8 * j);
    for (int64_t i = 0; i < m; i++) {
        const __m256 w = _mm256_set1_ps(p[i]);
        const float *r = rows[i] + off;
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

/* Row pointers of positions [pos, pos + 8) (the last one repeated past the end), and a prefetch
 * of the group after them. */
static inline int64_t group_rows(const float **rows, const float *cache, const int64_t *table, int64_t pos,
                                 int64_t end, int64_t block_size, int64_t row_len) {
    const int64_t m = end - pos < 8 ? end - pos : 8;
    for (int64_t i = 0; i < 8; i++) rows[i] = row_at(cache, table, pos + (i < m ? i : m - 1), block_size, row_len);
    for (int64_t i = pos + 8; i < pos + 8 + PREFETCH_ROWS && i < end; i++)
        prefetch_row(row_at(cache, table, i, block_size, row_len), row_len);
    return m;
}

/* Scores, softmax state and unnormalised output of one chunk for all H query heads:
 * m[h] (max score), l[h] (sum of exp), acc[h * D + d]. */
static void chunk_attend(float *acc, float *m, float *l, float *scores, const float *q, const float *k_cache,
                         const float *v_cache, const int64_t *table, int64_t lo, int64_t hi, int64_t H, int64_t KV,
                         int64_t D, int64_t block_size, float scale) {
    const int64_t G = H / KV, n = hi - lo, row_len = KV * D;
    const float *rows[8];
    float tmp[8];
    for (int64_t t = 0; t < n; t += 8) {
        const int64_t cnt = group_rows(rows, k_cache, table, lo + t, hi, block_size, row_len);
        for (int64_t h = 0; h < H; h++) {
            _mm256_storeu_ps(tmp, _mm256_mul_ps(dot8(q + h * D, rows, (h / G) * D, D), _mm256_set1_ps(scale)));
            memcpy(scores + h * n + t, tmp, sizeof(float) * cnt);
        }
    }
    for (int64_t h = 0; h < H; h++) {
        float *s = scores + h * n, mx = s[0], sum = 0.f;
        for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) sum += (s[t] = expf(s[t] - mx));
        m[h] = mx;
        l[h] = sum;
    }
    memset(acc, 0, sizeof(float) * H * D);
    for (int64_t t = 0; t < n; t += 8) {
        const int64_t cnt = group_rows(rows, v_cache, table, lo + t, hi, block_size, row_len);
        for (int64_t h = 0; h < H; h++) {
            const float *p = scores + h * n + t;
            int64_t off = 0;
            for (; off + 64 <= D; off += 64) accumulate64(acc + h * D + off, p, rows, cnt, (h / G) * D + off);
            for (; off < D; off += 16) accumulate16(acc + h * D + off, p, rows, cnt, (h / G) * D + off);
        }
    }
}

void paged_decode_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                      int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, int num_threads) {
    const int64_t H = num_heads, D = head_dim;
    /* Chunks per sequence: enough tasks for every thread at small batch, none over MAX_CHUNK. */
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t splits = (2 * num_threads + num_seqs - 1) / num_seqs;
    if (splits < (max_len + MAX_CHUNK - 1) / MAX_CHUNK) splits = (max_len + MAX_CHUNK - 1) / MAX_CHUNK;
    float *part_acc = (float *)malloc(sizeof(float) * num_seqs * splits * H * D);
    float *part_m = (float *)malloc(sizeof(float) * num_seqs * splits * H);
    float *part_l = (float *)malloc(sizeof(float) * num_seqs * splits * H);
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * H * MAX_CHUNK);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < num_seqs; b++) {
            for (int64_t c = 0; c < splits; c++) {
                const int64_t len = seq_lens[b];
                const int64_t start = (window > 0 && len > window) ? len - window : 0;
                const int64_t per = (len - start + splits - 1) / splits;
                const int64_t lo = start + c * per, hi = lo + per < len ? lo + per : len;
                const int64_t p = b * splits + c;
                if (lo >= hi) { /* empty chunk: contributes nothing to the merge */
                    for (int64_t h = 0; h < H; h++) part_m[p * H + h] = -INFINITY, part_l[p * H + h] = 0.f;
                    continue;
                }
                chunk_attend(part_acc + p * H * D, part_m + p * H, part_l + p * H, scores, q + b * H * D, k_cache,
                             v_cache, block_tables + b * max_blocks, lo, hi, H, num_kv_heads, D, block_size, scale);
            }
        }
        free(scores);
#pragma omp for collapse(2)
        for (int64_t b = 0; b < num_seqs; b++) {
            for (int64_t h = 0; h < H; h++) {
                float mx = -INFINITY, sum = 0.f;
                for (int64_t c = 0; c < splits; c++) mx = fmaxf(mx, part_m[(b * splits + c) * H + h]);
                float *o = out + (b * H + h) * D;
                memset(o, 0, sizeof(float) * D);
                for (int64_t c = 0; c < splits; c++) {
                    const int64_t p = (b * splits + c) * H + h;
                    if (part_l[p] == 0.f) continue;
                    const float w = expf(part_m[p] - mx);
                    const float *a = part_acc + p * D;
                    sum += w * part_l[p];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
    }
    free(part_acc);
    free(part_m);
    free(part_l);
}
