// SiLU-and-mul, the gated MLP's activation (activation.py): x (n, 2d) gate|up -> out (n, d)
// = silu(gate) * up, as torch's F.silu(gate) * up: silu = g / (1 + e^-g) in float32, rounded
// to T (torch's silu returns T), then times up, rounded again.
//
// One thread an output value; a grid-stride loop, so any grid and block size fits.
#include "common.cuh"

template <class T>
TISON_DEVICE void silu_mul(const T *x, T *out, tison_i64 n, int d) {
    tison_i64 total = n * d, step = (tison_i64)gridDim.x * blockDim.x;
    for (tison_i64 i = (tison_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        tison_i64 t = i / d, j = i % d;
        const T *gate = x + t * 2 * d;
        float g = tison_load(gate, j);
        float silu = tison_round(x, g / (1.0f + expf(-g)));
        tison_store(out, i, silu * tison_load(gate + d, j));
    }
}

#define TISON_SILU_MUL(SUFFIX, T)                                                       \
    TISON_KERNEL void tison_silu_mul_##SUFFIX(const T *x, T *out, tison_i64 n, int d) { \
        silu_mul<T>(x, out, n, d);                                                      \
    }

TISON_SILU_MUL(f32, float)
TISON_SILU_MUL(bf16, tison_bf16)
