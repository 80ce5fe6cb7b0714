/* SiLU-and-mul, the gated MLP's activation, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "silu_mul.c"
#include "each_type.h"
#else
/* x: (n, 2*d) gate|up -> out (n, d) = silu(gate) * up, the silu rounded as torch rounds it. */
void NAME(silu_mul_team)(const T *x, T *out, int64_t n, int64_t d) {
#pragma omp for
    for (int64_t t = 0; t < n; t++) {
        const T *gate = x + t * 2 * d, *up = gate + d;
        T *o = out + t * d;
        for (int64_t i = 0; i < d; i++) {
            float g = LOAD(gate[i]);
            o[i] = STORE(ROUND(g / (1.0f + exp_approx(-g))) * LOAD(up[i]));
        }
    }
}

void NAME(tk_silu_mul)(const T *x, T *out, int64_t n, int64_t d, int threads) {
#pragma omp parallel num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    NAME(silu_mul_team)(x, out, n, d);
}
#endif
