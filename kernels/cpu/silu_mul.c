/* SiLU-and-mul, the gated MLP's activation, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define SILU_BLOCK 256 /* elements a pass: their e^-g stay in L1 */

#define TYPED_FILE "silu_mul.c"
#include "each_type.h"
#else
/* x: (n, 2*d) gate|up -> out (n, d) = silu(gate) * up, the silu rounded as torch rounds it. */
void NAME(silu_mul_team)(const T *x, T *out, int64_t n, int64_t d) {
#pragma omp for
    for (int64_t t = 0; t < n; t++) {
        const T *gate = x + t * 2 * d, *up = gate + d;
        T *o = out + t * d;
        for (int64_t i0 = 0; i0 < d; i0 += SILU_BLOCK) {
            /* e^-g first, in a loop of its own: with the division in the same loop, GCC
             * if-converted exp_approx's clamps into three masked divisions a vector */
            const int64_t m = d - i0 < SILU_BLOCK ? d - i0 : SILU_BLOCK;
            float e[SILU_BLOCK];
            for (int64_t i = 0; i < m; i++) e[i] = exp_approx(-LOAD(gate[i0 + i]));
            for (int64_t i = 0; i < m; i++) {
                const float g = LOAD(gate[i0 + i]);
                o[i0 + i] = STORE(ROUND(g / (1.0f + e[i])) * LOAD(up[i0 + i]));
            }
        }
    }
}

void NAME(tk_silu_mul)(const T *x, T *out, int64_t n, int64_t d, int threads) {
#pragma omp parallel num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    NAME(silu_mul_team)(x, out, n, d);
}
#endif
