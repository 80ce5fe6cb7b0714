// FP8 block-scaled weights (fp8_linear.py): W (N, K) float8 e4m3fn bytes with one float32
// scale per (bn x bk) block (DeepSeek-V3's weight_scale_inv), as shared/models/quant/fp8.py
// reads them: w = float(byte) * scale, one float32 rounding.
//
// fp8_linear: y (M, N) = x (M, K) W^T (+ bias) for decode-sized M (at most 64), float32
// accumulation, y rounded once. Memory-bound: each weight byte is read once a launch. A warp
// takes R consecutive output rows (R = 4, 2, 1 as M grows: each x value it loads serves R
// rows), its lanes striding K in chunks of 16 bytes (one 16-byte load per row), every x row
// read from L1/L2 as the lanes go; the lanes' R x M partial sums end in one butterfly
// reduce-scatter over the warp.
// A block is TISON_FP8_WARPS warps; no barrier, no shared memory. Rows not 16-byte aligned
// (K % 16, a scale block not whole chunks) take the same loop one byte at a time.
//
// fp8_dequant: W -> dense (N, K) float32 or bf16 (prefill's temporary weight), exactly as the
// torch dequantization rounded to the dtype.
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
// (m / 8 * 2^-6), 0x7f and 0xff are NaN, there is no inf. Decoded in software (no header, no
// sm_89 conversion instruction): the sign moved to bit 31 and exponent|mantissa to bits 26..20
// make the float32 of value * 2^-120 for every byte (a subnormal byte becomes a float32
// denormal), so value * scale is that float times scale * 2^120, rounded once.
#include "common.cuh"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TISON_FP8_UNROLL _Pragma("unroll")
#else
#define TISON_FP8_UNROLL
#endif

#define TISON_FP8_WARPS 4  // warps of a linear block (fp8_linear.py's THREADS / 32)

// The byte in bits 24..31 of `top` as float32: its value * 2^-120, exact (NaN bytes aside).
TISON_DEVICE float tison_fp8_raw(unsigned int top) {
    return __uint_as_float((unsigned int)((int)top >> 4) & 0x87f00000u);
}

// One byte's value times scale, rounded once: float(byte) * scale as torch computes it.
TISON_DEVICE float tison_fp8_value(unsigned int byte, float scale) {
    if ((byte & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);  // NaN
    return tison_fp8_raw(byte << 24) * 0x1p120f * scale;
}

// 16 bytes (4 little-endian words: byte j of word i is element 4i + j) times their block's
// scale, each as tison_fp8_value: one multiply a value, by scale * 2^120 (exact while
// finite), unless a byte is NaN or the scale is >= 2^8 (both rare: then byte by byte).
TISON_DEVICE void tison_fp8_decode16(const unsigned int *words, float scale, float *w) {
    float wide = scale * 0x1p120f;
    unsigned int nan = 0;
    TISON_FP8_UNROLL
    for (int i = 0; i < 4; i++) {
        nan |= (words[i] & 0x7f7f7f7fu) + 0x01010101u;  // a byte's bit 7: its low 7 bits all 1
        TISON_FP8_UNROLL
        for (int j = 0; j < 4; j++) w[4 * i + j] = tison_fp8_raw(words[i] << (24 - 8 * j)) * wide;
    }
    float inf = __uint_as_float(0x7f800000u);
    if ((nan & 0x80808080u) || (fabsf(wide) == inf && fabsf(scale) != inf))
        for (int i = 0; i < 16; i++)
            w[i] = tison_fp8_value((words[i / 4] >> (8 * (i % 4))) & 0xffu, scale);
}

// V weights of a row from column k (V = 16: one 16-byte load; 1: one byte), scaled.
template <int V>
TISON_DEVICE void tison_fp8_weights(const unsigned char *row, int k, float scale, float *w) {
    if constexpr (V == 16) {
        tison_words16 v = *(const tison_words16 *)(row + k);
        tison_fp8_decode16(v.w, scale, w);
    } else {
        w[0] = tison_fp8_value(row[k], scale);
    }
}

// V values of an x row from column k, widened to float.
template <int V, class T>
TISON_DEVICE void tison_fp8_x(const T *x, int k, float *f) {
    if constexpr (V == 16) {
        TISON_FP8_UNROLL
        for (int i = 0; i < 16; i += 16 / (int)sizeof(T)) tison_load16(x + k + i, f + i);
    } else {
        f[0] = tison_load(x, k);
    }
}

// 16 floats to p (16-byte aligned) as T, in 16-byte stores.
TISON_DEVICE void tison_fp8_store16(float *p, const float *v) {
    for (int i = 0; i < 16; i += 4) {
        tison_words16 o;
        for (int j = 0; j < 4; j++) o.w[j] = __float_as_uint(v[i + j]);
        *(tison_words16 *)(p + i) = o;
    }
}
TISON_DEVICE void tison_fp8_store16(tison_bf16 *p, const float *v) {
    for (int i = 0; i < 16; i += 8) {
        tison_words16 o;
        for (int j = 0; j < 4; j++)
            o.w[j] = tison_float_to_bf16(v[i + 2 * j]) |
                     (unsigned int)tison_float_to_bf16(v[i + 2 * j + 1]) << 16;
        *(tison_words16 *)(p + i) = o;
    }
}

// Each of the V values (a power of two) summed over the warp (a butterfly reduce-scatter:
// each step halves what a lane holds, keeping the half its lane bit picks, so V - 1 + ~5 - log2
// V shuffles rather than 5 V). Lane l ends with v[j], j < max(1, V / 32), the sum of the
// values at index tison_fp8_sum_index<V>(l, j); lanes differing only in the bits of the
// steps after the halving ends (V < 32) hold the same sums.
template <int V, int OFFSET = TISON_WARP / 2>
TISON_DEVICE void tison_fp8_warp_sums(float *v, int lane) {
    if constexpr (OFFSET > 0 && V == 1) {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], OFFSET);
        tison_fp8_warp_sums<1, OFFSET / 2>(v, lane);
    } else if constexpr (OFFSET > 0) {
        bool upper = lane & OFFSET;
        TISON_FP8_UNROLL
        for (int i = 0; i < V / 2; i++) {
            float send = upper ? v[i] : v[i + V / 2], keep = upper ? v[i + V / 2] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFFSET);
        }
        tison_fp8_warp_sums<V / 2, OFFSET / 2>(v, lane);
    }
}

template <int V>
TISON_DEVICE int tison_fp8_sum_index(int lane, int j) {
    int n = V;
    for (int offset = TISON_WARP / 2; offset >= 1 && n > 1; offset /= 2) {
        n /= 2;
        if (lane & offset) j += n;
    }
    return j;
}

// R output rows from n0 of the warp (R = 4, 2, 1 for MT <= 2, <= 8, more), MT x rows at most
// (M of them real), chunks of V bytes.
template <class T, int MT, int V>
TISON_DEVICE void fp8_linear(const T *x, tison_i64 x_stride, const unsigned char *w,
                             const float *scale_inv, const T *bias, int has_bias, T *y, int M,
                             int N, int K, int bn, int bk) {
    constexpr int R = MT <= 2 ? 4 : MT <= 8 ? 2 : 1;
    int lane = threadIdx.x % TISON_WARP;
    int n0 = (blockIdx.x * (blockDim.x / TISON_WARP) + threadIdx.x / TISON_WARP) * R;
    if (n0 >= N) return;  // the whole warp; no barrier follows
    int rows = min(R, N - n0);
    int k_blocks = (K + bk - 1) / bk;
    const unsigned char *w_row[R];
    const float *s_row[R];
    TISON_FP8_UNROLL
    for (int r = 0; r < R; r++) {
        int n = n0 + min(r, rows - 1);  // rows past N repeat the last one (never stored)
        w_row[r] = w + (tison_i64)n * K;
        s_row[r] = scale_inv + (tison_i64)(n / bn) * k_blocks;
    }
    float acc[R * MT];  // output (r, m) at r * MT + m
    TISON_FP8_UNROLL
    for (int i = 0; i < R * MT; i++) acc[i] = 0.0f;
    // the scale block of the lane's chunk c (of V bytes: c / per_block), kept as c strides
    int per_block = bk / V, block = lane / per_block, within = lane % per_block;
    int jump = TISON_WARP / per_block, jump_within = TISON_WARP % per_block;
    for (int c = lane; c < K / V; c += TISON_WARP) {
        int k = c * V;
        float wv[R][V];
        TISON_FP8_UNROLL
        for (int r = 0; r < R; r++) tison_fp8_weights<V>(w_row[r], k, s_row[r][block], wv[r]);
        TISON_FP8_UNROLL
        for (int m = 0; m < MT; m++) {
            if (m >= M) break;
            float xv[V];
            tison_fp8_x<V>(x + m * x_stride, k, xv);
            TISON_FP8_UNROLL
            for (int r = 0; r < R; r++) {
                TISON_FP8_UNROLL
                for (int j = 0; j < V; j++)
                    acc[r * MT + m] = fmaf(wv[r][j], xv[j], acc[r * MT + m]);
            }
        }
        block += jump, within += jump_within;
        if (within >= per_block) within -= per_block, block++;
    }
    tison_fp8_warp_sums<R * MT>(acc, lane);
    constexpr int held = R * MT < TISON_WARP ? 1 : R * MT / TISON_WARP;  // sums a lane ends with
    if (lane % (TISON_WARP / (R * MT / held)) != 0) return;  // (V < 32: one lane of those alike)
    TISON_FP8_UNROLL
    for (int j = 0; j < held; j++) {
        int i = tison_fp8_sum_index<R * MT>(lane, j), r = i / MT, m = i % MT;
        if (r >= rows || m >= M) continue;
        float sum = acc[j];
        if (has_bias) sum += tison_load(bias, n0 + r);
        tison_store(y, (tison_i64)m * N + n0 + r, sum);
    }
}

// W (N, K) -> out (N, K) of T: chunk i of V bytes per thread, a grid-stride loop.
template <class T, int V>
TISON_DEVICE void fp8_dequant(const unsigned char *w, const float *scale_inv, T *out, int N,
                              int K, int bn, int bk) {
    int chunks = K / V, k_blocks = (K + bk - 1) / bk;
    tison_i64 total = (tison_i64)N * chunks, step = (tison_i64)gridDim.x * blockDim.x;
    for (tison_i64 i = (tison_i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        tison_i64 n = i / chunks;
        int k = (int)(i % chunks) * V;
        float v[V];
        tison_fp8_weights<V>(w + n * K, k, scale_inv[(n / bn) * k_blocks + k / bk], v);
        if constexpr (V == 16)
            tison_fp8_store16(out + n * K + k, v);
        else
            tison_store(out, n * K + k, v[0]);
    }
}

#define TISON_FP8_LINEAR(SUFFIX, T, MT)                                                        \
    TISON_KERNEL void tison_fp8_linear_m##MT##_##SUFFIX(                                       \
        const T *x, tison_i64 x_stride, const unsigned char *w, const float *scale_inv,       \
        const T *bias, int has_bias, T *y, int M, int N, int K, int bn, int bk, int vec) {     \
        if (vec)                                                                               \
            fp8_linear<T, MT, 16>(x, x_stride, w, scale_inv, bias, has_bias, y, M, N, K, bn,   \
                                  bk);                                                         \
        else                                                                                   \
            fp8_linear<T, MT, 1>(x, x_stride, w, scale_inv, bias, has_bias, y, M, N, K, bn,    \
                                 bk);                                                          \
    }

#define TISON_FP8(SUFFIX, T)                                                                   \
    TISON_FP8_LINEAR(SUFFIX, T, 1)                                                             \
    TISON_FP8_LINEAR(SUFFIX, T, 2)                                                             \
    TISON_FP8_LINEAR(SUFFIX, T, 4)                                                             \
    TISON_FP8_LINEAR(SUFFIX, T, 8)                                                             \
    TISON_FP8_LINEAR(SUFFIX, T, 16)                                                            \
    TISON_FP8_LINEAR(SUFFIX, T, 32)                                                            \
    TISON_FP8_LINEAR(SUFFIX, T, 64)                                                            \
    TISON_KERNEL void tison_fp8_dequant_##SUFFIX(const unsigned char *w, const float *scale_inv, \
                                                 T *out, int N, int K, int bn, int bk,         \
                                                 int vec) {                                    \
        if (vec)                                                                               \
            fp8_dequant<T, 16>(w, scale_inv, out, N, K, bn, bk);                               \
        else                                                                                   \
            fp8_dequant<T, 1>(w, scale_inv, out, N, K, bn, bk);                                \
    }

TISON_FP8(f32, float)
TISON_FP8(bf16, tison_bf16)
