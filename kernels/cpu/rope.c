/* Rotary position embedding of q and k, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "rope.c"
#include "each_type.h"
#else
/* One head of hd values, "rotate half" layout: to = x * cos + cat(-x2, x1) * sin, each
 * product and the sum rounded as torch rounds them. */
__attribute__((noinline)) /* inlined into the OpenMP body, it would not vectorize */
static void NAME(rotate)(const T *restrict x, const T *restrict cos, const T *restrict sin,
                         int64_t hd, T *restrict to) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);
        float a = ROUND(x1 * LOAD(cos[i])) + ROUND(-x2 * LOAD(sin[i]));
        float b = ROUND(x2 * LOAD(cos[i + half])) + ROUND(x1 * LOAD(sin[i + half]));
        to[i] = STORE(a);
        to[i + half] = STORE(b);
    }
}

/* q: n rows of nh heads of hd values (row stride q_stride), k likewise with nkv heads ->
 * q_out (n, nh, hd) and k_out (n, nkv, hd), contiguous, rotated by the cos/sin rows (tables
 * (max_positions, hd)) of positions[t]. */
void NAME(rope_team)(const T *q, int64_t q_stride, const T *k, int64_t k_stride, int64_t n,
                     int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions, const T *cos,
                     const T *sin, T *q_out, T *k_out) {
    int64_t heads = nh + nkv;
#pragma omp for
    for (int64_t r = 0; r < n * heads; r++) {
        int64_t t = r / heads, h = r % heads;
        const T *c = cos + positions[t] * hd, *s = sin + positions[t] * hd;
        if (h < nh)
            NAME(rotate)(q + t * q_stride + h * hd, c, s, hd, q_out + (t * nh + h) * hd);
        else
            NAME(rotate)(k + t * k_stride + (h - nh) * hd, c, s, hd,
                         k_out + (t * nkv + h - nh) * hd);
    }
}

/* One head of hd values, interleaved pairs (Llama 4, DeepSeek): pair (a, b) = (x[2i],
 * x[2i + 1]) -> (a cos_i - b sin_i, a sin_i + b cos_i), in float32 as torch computes them
 * (each product rounded to float32, no fused multiply-add), rounded to T once. */
static void NAME(rotate_pairs)(const T *restrict x, const float *restrict cos,
                               const float *restrict sin, int64_t hd, T *restrict to) {
    for (int64_t i = 0; i < hd / 2; i++) {
        float a = LOAD(x[2 * i]), b = LOAD(x[2 * i + 1]);
        to[2 * i] = STORE(a * cos[i] - b * sin[i]);
        to[2 * i + 1] = STORE(a * sin[i] + b * cos[i]);
    }
}

/* rope_team's interleaved sibling: row t's pairs turned by cs (n, hd) float32, row t's hd / 2
 * cosines then its hd / 2 sines (computed per step by the caller: no tables). */
void NAME(rope_pairs_team)(const T *q, int64_t q_stride, const T *k, int64_t k_stride,
                           int64_t n, int64_t nh, int64_t nkv, int64_t hd, const float *cs,
                           T *q_out, T *k_out) {
    int64_t heads = nh + nkv;
#pragma omp for
    for (int64_t r = 0; r < n * heads; r++) {
        int64_t t = r / heads, h = r % heads;
        const float *c = cs + t * hd, *s = c + hd / 2;
        if (h < nh)
            NAME(rotate_pairs)(q + t * q_stride + h * hd, c, s, hd, q_out + (t * nh + h) * hd);
        else
            NAME(rotate_pairs)(k + t * k_stride + (h - nh) * hd, c, s, hd,
                               k_out + (t * nkv + h - nh) * hd);
    }
}

void NAME(tk_rope)(const T *q, int64_t q_stride, const T *k, int64_t k_stride, int64_t n,
                   int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions, const T *cos,
                   const T *sin, T *q_out, T *k_out, int threads) {
#pragma omp parallel num_threads(threads) if (n * (nh + nkv) * hd >= PARALLEL_MIN_ELEMS)
    NAME(rope_team)(q, q_stride, k, k_stride, n, nh, nkv, hd, positions, cos, sin, q_out, k_out);
}
#endif
