// The subset of CUDA that Tison's kernels use, emulated on the CPU, so that a kernel's .cu
// file compiles as C++ (g++ -x c++ -std=c++17 -pthread) and runs here against its torch
// reference where no GPU is (tests/test_cuda_kernels_cpu.py). Include it before the .cu.
//
// A launch runs the grid's blocks one after another on a block's worth of real threads
// (created once a launch), so __syncthreads is a barrier of the block and a warp shuffle a
// barrier of the warp (32 threads, fewer in a block's last warp): code that diverges around
// either deadlocks here as it would be undefined on a GPU. __shared__ arrays are static
// (blocks never overlap), and dynamic shared memory is one buffer of TISON_HOST_SMEM bytes.
#pragma once

#include <math.h>
#include <pthread.h>
#include <string.h>

#include <functional>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict
#define TISON_DEVICE static inline
#define TISON_KERNEL extern "C"
#define TISON_HOST_SMEM (96 * 1024)
[[maybe_unused]] alignas(16) static unsigned char tison_host_smem[TISON_HOST_SMEM];
#define TISON_DYNAMIC_SMEM(name) unsigned char *name = tison_host_smem

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#define __expf expf  // glibc declares a __expf of its own
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }  // never fused, as here
template <class T> static inline T __ldg(const T *p) { return *p; }
template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }

static inline float atomicAdd(float *p, float v) {
    unsigned int *u = (unsigned int *)p, old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(u, &old, __float_as_uint(__uint_as_float(old) + v),
                                        false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return __uint_as_float(old);
}
static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

namespace tison_host {
struct Block {
    pthread_barrier_t all;
    std::vector<pthread_barrier_t> warps;
    std::vector<unsigned long long> lanes;  // one shuffle slot a thread
};
static Block *block;

static inline unsigned int linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

static inline void warp_wait() { pthread_barrier_wait(&block->warps[linear_thread() / 32]); }

template <class T> static inline T exchange(T v, unsigned int src_lane) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    unsigned int me = linear_thread(), base = me / 32 * 32;
    unsigned long long slot = 0;
    memcpy(&slot, &v, sizeof(T));
    block->lanes[me] = slot;
    warp_wait();
    unsigned int total = blockDim.x * blockDim.y * blockDim.z;
    unsigned int src = base + src_lane;
    T out = v;  // a lane outside the warp reads its own value, as on a GPU
    if (src_lane < 32 && src < total) memcpy(&out, &block->lanes[src], sizeof(T));
    warp_wait();  // every lane read before the slots are written again
    return out;
}
}  // namespace tison_host

static inline void __syncthreads() { pthread_barrier_wait(&tison_host::block->all); }
static inline void __syncwarp(unsigned int = 0xffffffffu) { tison_host::warp_wait(); }

template <class T> static inline T __shfl_xor_sync(unsigned int, T v, int lane_mask, int = 32) {
    return tison_host::exchange(v, (tison_host::linear_thread() % 32) ^ lane_mask);
}
template <class T> static inline T __shfl_sync(unsigned int, T v, int src_lane, int = 32) {
    return tison_host::exchange(v, (unsigned int)src_lane);
}
template <class T> static inline T __shfl_down_sync(unsigned int, T v, unsigned int d, int = 32) {
    return tison_host::exchange(v, tison_host::linear_thread() % 32 + d);
}

// Runs body (a call of one kernel with its arguments) on every thread of the grid.
static inline void tison_host_launch(dim3 grid, dim3 block_dim,
                                     const std::function<void()> &body) {
    unsigned int n = block_dim.x * block_dim.y * block_dim.z;
    tison_host::Block b;
    pthread_barrier_init(&b.all, nullptr, n);
    b.warps.resize((n + 31) / 32);
    for (unsigned int w = 0; w < b.warps.size(); w++)
        pthread_barrier_init(&b.warps[w], nullptr, n - 32 * w < 32 ? n - 32 * w : 32);
    b.lanes.resize(n);
    tison_host::block = &b;
    gridDim = grid, blockDim = block_dim;
    // One thread per CUDA thread for the whole grid (creating threads costs more than the
    // blocks' work): each runs its part of every block in turn, and a barrier ends each block
    // before the next starts, so blocks still never overlap.
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned int t = 0; t < n; t++)
        threads.emplace_back([&, t] {
            threadIdx = {t % block_dim.x, t / block_dim.x % block_dim.y,
                         t / (block_dim.x * block_dim.y)};
            for (unsigned int bz = 0; bz < grid.z; bz++)
                for (unsigned int by = 0; by < grid.y; by++)
                    for (unsigned int bx = 0; bx < grid.x; bx++) {
                        blockIdx = {bx, by, bz};
                        body();
                        pthread_barrier_wait(&b.all);
                    }
        });
    for (auto &t : threads) t.join();
    pthread_barrier_destroy(&b.all);
    for (auto &w : b.warps) pthread_barrier_destroy(&w);
    tison_host::block = nullptr;
}
