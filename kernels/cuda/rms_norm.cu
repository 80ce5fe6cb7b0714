// RMSNorm, alone or with the residual add fused in (norm.py), as torch's F.rms_norm computes
// it: the statistics in float32, out = round(x * inv_rms * weight), the weight multiplied in
// float32 and one rounding at the end.
//
// One block a vector: its threads stride over the vector's dim values, so a block of any
// multiple of 32 threads (at most 1024) fits any dim. Each thread reads back only the values
// it wrote itself (the residual sum), so the one barrier is the block sum's.
#include "common.cuh"

// Vector blockIdx.x = row * heads + head of x (rows x_stride apart, heads dim apart) into
// out (contiguous). With residual ((rows, dim) contiguous, heads 1): residual = x + residual
// first (rounded to T, as torch's add), and the sum is normalised.
template <class T>
TISON_DEVICE void rms_norm(const T *x, tison_i64 x_stride, T *out, T *residual,
                           const T *weight, int heads, int dim, float eps) {
    __shared__ float scratch[TISON_WARP];
    tison_i64 row = blockIdx.x / heads, head = blockIdx.x % heads;
    const T *v = x + row * x_stride + head * dim;
    if (residual) {
        T *sum = residual + row * dim;
        for (int d = threadIdx.x; d < dim; d += blockDim.x)
            tison_store(sum, d, tison_load(v, d) + tison_load(sum, d));
        v = sum;
    }
    float squares = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float a = tison_load(v, d);
        squares = fmaf(a, a, squares);  // fused on purpose: the same on a GPU and the host
    }
    float inv = 1.0f / sqrtf(tison_block_sum(squares, scratch) / (float)dim + eps);
    T *o = out + (tison_i64)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        tison_store(o, d, tison_load(v, d) * inv * tison_load(weight, d));
}

#define TISON_RMS_NORM(SUFFIX, T)                                                               \
    TISON_KERNEL void tison_rms_norm_##SUFFIX(const T *x, tison_i64 x_stride, T *out,           \
                                              const T *weight, int heads, int dim, float eps) { \
        rms_norm<T>(x, x_stride, out, (T *)0, weight, heads, dim, eps);                         \
    }                                                                                           \
    TISON_KERNEL void tison_add_rms_norm_##SUFFIX(const T *x, tison_i64 x_stride,               \
                                                  T *residual, T *out, const T *weight,         \
                                                  int dim, float eps) {                         \
        rms_norm<T>(x, x_stride, out, residual, weight, 1, dim, eps);                           \
    }

TISON_RMS_NORM(f32, float)
TISON_RMS_NORM(bf16, tison_bf16)
