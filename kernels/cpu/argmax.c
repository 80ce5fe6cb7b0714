/* Greedy sampling's argmax over rows of logits, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "argmax.c"
#include "each_type.h"
#else
/* The index of the first maximum of row[0..d), NaN counting as the largest value (as torch's
 * max does); d >= 1. */
static int64_t NAME(row_argmax)(const T *row, int64_t d) {
    float best = -INFINITY;
    int any_nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + LANES <= d; i += LANES) {
        __m512 v = LOAD16(row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    any_nan = nan != 0;
    best = _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
        __m256 v = LOAD8(row + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    any_nan = _mm256_movemask_ps(nan) != 0;
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    best = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#endif
    for (; i < d; i++) {
        float v = LOAD(row[i]);
        best = v > best ? v : best;
        any_nan |= v != v;
    }
    int64_t at = 0;
    if (any_nan) {
        while (LOAD(row[at]) == LOAD(row[at])) at++;
        return at;
    }
#if defined(__AVX512F__)
    __m512 wanted = _mm512_set1_ps(best);
    for (; at + LANES <= d; at += LANES) {
        __mmask16 hit = _mm512_cmp_ps_mask(LOAD16(row + at), wanted, _CMP_EQ_OQ);
        if (hit) return at + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    __m256 wanted = _mm256_set1_ps(best);
    for (; at + 8 <= d; at += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(LOAD8(row + at), wanted, _CMP_EQ_OQ));
        if (hit) return at + __builtin_ctz(hit);
    }
#endif
    while (LOAD(row[at]) != best) at++;
    return at;
}

/* out[r] = row_argmax of row r of x (n rows of d values, row stride xs); a team kernel. */
void NAME(argmax_team)(const T *x, int64_t xs, int64_t n, int64_t d, int64_t *out) {
#pragma omp for
    for (int64_t r = 0; r < n; r++) out[r] = NAME(row_argmax)(x + r * xs, d);
}

void NAME(tk_argmax)(const T *x, int64_t xs, int64_t n, int64_t d, int64_t *out, int threads) {
#pragma omp parallel num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    NAME(argmax_team)(x, xs, n, d, out);
}
#endif
