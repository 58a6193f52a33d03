/* RMSNorm for x86 CPUs, row by row: y = weight * (x * 1 / sqrt(mean(x^2) + eps)), in the order of
 * operations of transformers' LlamaRMSNorm in fp32 (only the sum of squares is added in another
 * order than torch's). One call for a decode step's few rows: torch's rms_norm runs ~6 ops of a
 * few microseconds each on such rows, and a decode step normalises 2 * layers + 1 times.
 * AVX2 + FMA; any n. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

void rms_norm_f32(float *y, const float *x, const float *w, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
        int64_t i = 0;
        for (; i + 4 * LANES <= n; i += 4 * LANES)
            for (int k = 0; k < 4; k++) {
                const vec v = vload(xr + i + k * LANES);
                acc[k] = vfmadd(v, v, acc[k]);
            }
        for (; i + LANES <= n; i += LANES) {
            const vec v = vload(xr + i);
            acc[0] = vfmadd(v, v, acc[0]);
        }
        float ss = hsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
        for (; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const vec vinv = vset1(inv);
        for (i = 0; i + LANES <= n; i += LANES) vstore(yr + i, vmul(vload(w + i), vmul(vload(xr + i), vinv)));
        for (; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}
