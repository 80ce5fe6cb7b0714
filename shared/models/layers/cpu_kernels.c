/* CPU kernels for a decoder layer's memory-light ops, which in plain torch cost more in
 * dispatch than in arithmetic: residual add + RMSNorm, RoPE, the KV write into page slots,
 * SiLU-and-mul, and decode attention that reads K/V straight from the pages.
 *
 * cpu_kernels_impl.h holds the kernels; it is included once per element type: float32
 * (names ending _f32) and bfloat16 (_bf16). Arithmetic is float32; bfloat16 values are
 * rounded wherever torch rounds them (each elementwise op of the model code rounds its
 * output), so the RoPE and KV write match the torch reference bit for bit. Built with
 * -ffp-contract=off for that reason: no fused multiply-adds.
 * Work is spread over an OpenMP team of the caller's size; the library links the same
 * libgomp as torch, so the team is torch's intra-op thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* float32 lanes of one AVX-512 register; partial sums run this wide */
#define MAX_GROUP 64 /* query heads per KV head, at most */
#define PARALLEL_MIN_ELEMS 65536 /* below this an elementwise op runs on one thread */
#define PARALLEL_MIN_KEYS 1024 /* attention: (key, kv head) pairs below which one thread runs */

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) { /* round to nearest even, NaN kept, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f32_identity(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float sum_lanes(const float *acc) { /* pairwise: vectorizes, short chains */
    float half[LANES / 2], quarter[LANES / 4];
    for (int l = 0; l < LANES / 2; l++) half[l] = acc[l] + acc[l + LANES / 2];
    for (int l = 0; l < LANES / 4; l++) quarter[l] = half[l] + half[l + LANES / 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* e^x, within 2 ulp of expf for the x that softmax and SiLU meet, in plain arithmetic that
 * the compiler vectorizes (expf from libm does not): e^x = 2^n * e^r with r = x - n ln 2 in
 * [-ln2/2, ln2/2], e^r by the polynomial of Cephes' expf (floorf would not vectorize). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2): 1.5 * 2^23 */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* T: element type; NAME(x): x with the type's suffix; LOAD(v): a T as float; STORE(x): a
 * float as T; ROUND(x): float x as torch stores it in T. */
#define T float
#define NAME(x) x##_f32
#define LOAD f32_identity
#define STORE f32_identity
#define ROUND f32_identity
#include "cpu_kernels_impl.h"
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND

#define T bf16
#define NAME(x) x##_bf16
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define ROUND bf16_round
#include "cpu_kernels_impl.h"
