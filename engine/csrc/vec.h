/* One float vector type for the kernels built both for AVX2 and for AVX-512 (engine/native.py picks
 * the widest build the CPU runs): LANES floats per vector, the few operations they share, and a
 * horizontal sum. */
#ifndef MMSERVE_VEC_H
#define MMSERVE_VEC_H
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define vfmadd _mm512_fmadd_ps
#define hsum _mm512_reduce_add_ps
#else
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vfmadd _mm256_fmadd_ps

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
