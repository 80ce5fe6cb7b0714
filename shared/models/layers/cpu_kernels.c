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

#include "cpu_kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16 /* float32 lanes of one AVX-512 register; partial sums run this wide */
#define MAX_GROUP 64 /* query heads per KV head, at most */
#define PARALLEL_MIN_ELEMS 65536 /* below this an elementwise op runs on one thread */
#define PARALLEL_MIN_KEYS 1024 /* attention: (key, kv head) pairs below which one thread runs */

static inline float f32_identity(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float sum_lanes(const float *acc) { /* pairwise: vectorizes, short chains */
    float half[LANES / 2], quarter[LANES / 4];
    for (int l = 0; l < LANES / 2; l++) half[l] = acc[l] + acc[l + LANES / 2];
    for (int l = 0; l < LANES / 4; l++) quarter[l] = half[l] + half[l + LANES / 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

#if defined(__AVX512F__)
/* Sixteen horizontal sums at once: lane k of the result is the sum of the 16 lanes of v[k].
 * Four rounds (16 -> 8 -> 4 -> 2 -> 1 vectors): each pairs the vectors up and adds the
 * matching halves of a pair, kept side by side. 15 pair steps of two permutes and one add,
 * where 16 separate sums would each need their own shuffle-and-add tree. */
static inline __m512 sum16x16(__m512 v[16]) {
    static const int32_t pick[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
         {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
        {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
         {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
        {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
         {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}},
    };
    for (int round = 0, n = 16; round < 4; round++, n /= 2) {
        __m512i lo = _mm512_loadu_si512(pick[round][0]), hi = _mm512_loadu_si512(pick[round][1]);
        for (int k = 0; k < n / 2; k++)
            v[k] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * k], lo, v[2 * k + 1]),
                                 _mm512_permutex2var_ps(v[2 * k], hi, v[2 * k + 1]));
    }
    return v[0];
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

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
 * float as T; ROUND(x): float x as torch stores it in T; LOAD16(p): 16 Ts as an AVX-512
 * float vector (used only where the compiler targets AVX-512). */
#define T float
#define NAME(x) x##_f32
#define LOAD f32_identity
#define STORE f32_identity
#define ROUND f32_identity
#define LOAD16 load16_f32
#include "cpu_kernels_impl.h"
#undef T
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND
#undef LOAD16

#define T bf16
#define NAME(x) x##_bf16
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define ROUND bf16_round
#define LOAD16 load16_bf16
#include "cpu_kernels_impl.h"
