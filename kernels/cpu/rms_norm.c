/* RMSNorm, with the residual add fused in, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "rms_norm.c"
#include "each_type.h"
#else
/* x: n rows of `heads` vectors of `dim` (row stride x_stride); out likewise (may be x).
 * With residual ((n, dim) contiguous, heads == 1): residual = x + residual first, and the
 * norm is taken of the sum. out = weight * round(v / sqrt(mean(v^2) + eps)), as HF computes
 * it: statistics in float32, the normalised value rounded to T before the weight. */
void NAME(rms_norm_team)(const T *x, int64_t x_stride, T *out, int64_t out_stride, T *residual,
                         const T *weight, int64_t n, int64_t heads, int64_t dim, float eps) {
    int64_t vectors = n * heads;
#pragma omp for
    for (int64_t r = 0; r < vectors; r++) {
        int64_t row = r / heads, head = r % heads;
        const T *v = x + row * x_stride + head * dim;
        T *o = out + row * out_stride + head * dim;
        if (residual != NULL) {
            T *sum = residual + row * dim;
            for (int64_t d = 0; d < dim; d++) sum[d] = STORE(LOAD(v[d]) + LOAD(sum[d]));
            v = sum;
        }
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += LOAD(v[d + l]) * LOAD(v[d + l]);
        for (; d < dim; d++) acc[0] += LOAD(v[d]) * LOAD(v[d]);
        float inv = 1.0f / sqrtf(sum_lanes(acc) / (float)dim + eps);
        for (d = 0; d < dim; d++) o[d] = STORE(LOAD(weight[d]) * ROUND(LOAD(v[d]) * inv));
    }
}

void NAME(tk_rms_norm)(const T *x, int64_t x_stride, T *out, int64_t out_stride, T *residual,
                       const T *weight, int64_t n, int64_t heads, int64_t dim, float eps,
                       int threads) {
#pragma omp parallel num_threads(threads) if (n * heads * dim >= PARALLEL_MIN_ELEMS)
    NAME(rms_norm_team)(x, x_stride, out, out_stride, residual, weight, n, heads, dim, eps);
}
#endif
