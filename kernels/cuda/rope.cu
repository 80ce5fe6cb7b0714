// Rotary position embedding of q and k in place (rope.py), in either layout of
// shared/models/layers/rotary.py: "rotate half" (GPT-NeoX, HF Llama) or interleaved pairs
// (DeepSeek, Llama 4). Every product and sum is rounded to the cos/sin tables' type, as torch
// rounds them: tables in the model dtype (RotaryEmbedding) round each op to it; float32
// tables (InterleavedRotaryEmbedding, which upcasts q and k) keep float32 until the store.
// The products go through __fmul_rn so that nvcc fuses none into an FMA, as torch does not.
//
// One block a token; its threads stride over the token's (nh + nkv) * hd / 2 pairs, each
// rotated by the thread that reads it, so any block size fits and no barrier is needed.
#include "common.cuh"

// x[j] and x[j + half] with cos/sin rows c and s of hd values.
template <class T, class C>
TISON_DEVICE void rotate_half(T *x, int j, int half, const C *c, const C *s) {
    float x1 = tison_load(x, j), x2 = tison_load(x, j + half);
    float a = tison_round(c, __fmul_rn(x1, tison_load(c, j)));
    float b = tison_round(c, __fmul_rn(-x2, tison_load(s, j)));
    float e = tison_round(c, __fmul_rn(x2, tison_load(c, j + half)));
    float f = tison_round(c, __fmul_rn(x1, tison_load(s, j + half)));
    tison_store(x, j, tison_round(c, a + b));
    tison_store(x, j + half, tison_round(c, e + f));
}

// The pair (x[2j], x[2j + 1]) as a complex number times (c[j], s[j]); rows of hd / 2 values.
template <class T, class C>
TISON_DEVICE void rotate_pair(T *x, int j, const C *c, const C *s) {
    float a = tison_load(x, 2 * j), b = tison_load(x, 2 * j + 1);
    float cj = tison_load(c, j), sj = tison_load(s, j);
    float ac = tison_round(c, __fmul_rn(a, cj)), bs = tison_round(c, __fmul_rn(b, sj));
    float as = tison_round(c, __fmul_rn(a, sj)), bc = tison_round(c, __fmul_rn(b, cj));
    tison_store(x, 2 * j, tison_round(c, ac - bs));
    tison_store(x, 2 * j + 1, tison_round(c, as + bc));
}

// Token blockIdx.x: its nh heads of q (rows q_row apart, heads q_head apart, hd values each)
// and nkv heads of k, rotated by the cos/sin table rows at positions[t] (tables contiguous,
// rows of hd values, or hd / 2 when interleaved).
template <class T, class C>
TISON_DEVICE void rope(T *q, tison_i64 q_row, tison_i64 q_head, int nh, T *k, tison_i64 k_row,
                       tison_i64 k_head, int nkv, int hd, const tison_i64 *positions,
                       const C *cos, const C *sin, int interleaved) {
    tison_i64 t = blockIdx.x;
    int half = hd / 2, width = interleaved ? half : hd;
    const C *c = cos + positions[t] * width, *s = sin + positions[t] * width;
    for (int i = threadIdx.x; i < (nh + nkv) * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        T *x = h < nh ? q + t * q_row + h * q_head : k + t * k_row + (h - nh) * k_head;
        if (interleaved)
            rotate_pair(x, j, c, s);
        else
            rotate_half(x, j, half, c, s);
    }
}

// tison_rope_<q and k type>_<table type>
#define TISON_ROPE(SUFFIX, T, C)                                                               \
    TISON_KERNEL void tison_rope_##SUFFIX(T *q, tison_i64 q_row, tison_i64 q_head, int nh,    \
                                          T *k, tison_i64 k_row, tison_i64 k_head, int nkv,    \
                                          int hd, const tison_i64 *positions, const C *cos,    \
                                          const C *sin, int interleaved) {                     \
        rope<T, C>(q, q_row, q_head, nh, k, k_row, k_head, nkv, hd, positions, cos, sin,       \
                   interleaved);                                                               \
    }

TISON_ROPE(f32_f32, float, float)
TISON_ROPE(bf16_bf16, tison_bf16, tison_bf16)
TISON_ROPE(bf16_f32, tison_bf16, float)
