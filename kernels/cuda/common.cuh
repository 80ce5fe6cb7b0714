// What every Tison CUDA kernel shares: qualifiers, bf16 as raw 16-bit words, warp and block
// reductions. No CUDA header is included, so the same source compiles with nvcc, with NVRTC
// (cupy.RawModule) and, through tests/gpu/cuda_host.h, as C++ for the CPU, where the tests run
// every kernel against its torch reference without a GPU.
//
// bf16 is an unsigned short holding the upper half of a float32: widening is a shift, and
// narrowing rounds to nearest even (NaN kept quiet), as torch's .to(torch.bfloat16) does.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TISON_DEVICE __device__ __forceinline__
#define TISON_KERNEL extern "C" __global__
#define TISON_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#define TISON_WARP 32

typedef unsigned short tison_bf16;
typedef long long tison_i64;

TISON_DEVICE float tison_bf16_to_float(tison_bf16 x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

TISON_DEVICE tison_bf16 tison_float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (tison_bf16)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (tison_bf16)(u >> 16);
}

// Element types a kernel is written once for: load widens to float, store narrows.
TISON_DEVICE float tison_load(const float *p, tison_i64 i) { return p[i]; }
TISON_DEVICE float tison_load(const tison_bf16 *p, tison_i64 i) {
    return tison_bf16_to_float(p[i]);
}
TISON_DEVICE void tison_store(float *p, tison_i64 i, float v) { p[i] = v; }
TISON_DEVICE void tison_store(tison_bf16 *p, tison_i64 i, float v) {
    p[i] = tison_float_to_bf16(v);
}

// v rounded to the precision of p's element type: what an op of torch in that dtype does to
// its result (bf16: to the nearest bf16, float: nothing). p is only a type tag.
TISON_DEVICE float tison_round(const float *, float v) { return v; }
TISON_DEVICE float tison_round(const tison_bf16 *, float v) {
    return tison_bf16_to_float(tison_float_to_bf16(v));
}

TISON_DEVICE float tison_warp_sum(float v) {
    for (int lane_mask = TISON_WARP / 2; lane_mask > 0; lane_mask >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, lane_mask);
    return v;
}

TISON_DEVICE float tison_warp_max(float v) {
    for (int lane_mask = TISON_WARP / 2; lane_mask > 0; lane_mask >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, lane_mask));
    return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), on every thread.
// scratch: 32 floats of shared memory; the block must call it together.
TISON_DEVICE float tison_block_sum(float v, float *scratch) {
    int lane = threadIdx.x % TISON_WARP, warp = threadIdx.x / TISON_WARP;
    v = tison_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x / TISON_WARP;
    v = lane < warps ? scratch[lane] : 0.0f;
    return tison_warp_sum(v);
}

// 16 bytes at p (16-byte aligned) widened to floats, one load on a GPU: 4 float32 or 8 bf16
// (element 2i in word i's low half: little-endian, as on every GPU and host we run).
struct alignas(16) tison_words16 {
    unsigned int w[4];
};
TISON_DEVICE void tison_load16(const float *p, float *f) {
    tison_words16 v = *(const tison_words16 *)p;
    for (int i = 0; i < 4; i++) f[i] = __uint_as_float(v.w[i]);
}
TISON_DEVICE void tison_load16(const tison_bf16 *p, float *f) {
    tison_words16 v = *(const tison_words16 *)p;
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(v.w[i] << 16);
        f[2 * i + 1] = __uint_as_float(v.w[i] & 0xffff0000u);
    }
}
