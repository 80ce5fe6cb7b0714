/* What the kernels written once for float32 and bfloat16 share (each_type.h compiles them once
 * per type): their arithmetic is float32, and bfloat16 values are rounded wherever torch rounds
 * them (each elementwise op of the model code rounds its output), so the RoPE and KV write
 * match the torch reference bit for bit. Built with -ffp-contract=off for that reason: no fused
 * multiply-adds.
 * Each kernel's work is a NAME(..._team) function whose loops are orphaned `omp for`s: called
 * inside a parallel region (decode_layer.c runs a whole decoder layer in one), the team shares
 * the work and meets at the loop's end; called outside one, it runs on the calling thread. The
 * tk_ entry points open a region of the caller's size around them. The library links the same
 * libgomp as torch, so the team is torch's intra-op thread pool. */
#ifndef TISON_TYPED_H
#define TISON_TYPED_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16 /* float32 lanes of one AVX-512 register; partial sums run this wide */
#define PARALLEL_MIN_ELEMS 65536 /* below this an elementwise op runs on one thread */

static inline float f32_identity(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float sum_lanes(const float *acc) { /* pairwise: vectorizes, short chains */
    float half[LANES / 2], quarter[LANES / 4];
    for (int l = 0; l < LANES / 2; l++) half[l] = acc[l] + acc[l + LANES / 2];
    for (int l = 0; l < LANES / 4; l++) quarter[l] = half[l] + half[l + LANES / 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

#if defined(__AVX2__)
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
#if defined(__AVX512F__)
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

/* exp_approx on a vector, its steps as fused multiply-adds (within a few ulp of it): about
 * half the instructions of exp_approx as the compiler vectorizes it for AVX2, which blends its
 * clamps. For attention's softmax, whose bits no torch op has to match (the -ffp-contract=off
 * above is for the elementwise kernels that do). EXP_APPROX defines it as `name` on vectors V
 * with the intrinsics of prefix P (_mm256, _mm512), whose rounding and cast to float differ:
 * exp_approx8 in AVX2 builds, exp_approx16 in AVX-512 ones (with KV in cache, calls at 256-1024
 * positions ran 1.07-1.11x as fast as with the compiler-vectorized loop; Zen 4). */
#define EXP_APPROX(name, V, VI, P, ROUND, CAST_PS)                                             \
    static inline V name(V x) {                                                                \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                \
        V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504f)),                                   \
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                            \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                  \
        r = P##_fmadd_ps(n, P##_set1_ps(2.12194440e-4f), r);                                   \
        V p = P##_set1_ps(1.9875691500e-4f);                                                   \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                 \
        p = P##_fmadd_ps(P##_mul_ps(p, r), r, P##_add_ps(r, P##_set1_ps(1.0f)));               \
        VI n_int = P##_cvtps_epi32(n);                                                         \
        VI bits = P##_slli_epi32(P##_add_epi32(n_int, P##_set1_epi32(127)), 23);               \
        return P##_mul_ps(p, CAST_PS(bits));                                                   \
    }
#if defined(__AVX512F__)
#define EXP8 0
#define EXP16 1
EXP_APPROX(exp_approx16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#elif defined(__AVX2__) && defined(__FMA__)
#define EXP8 1
#define EXP16 0
EXP_APPROX(exp_approx8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
#else
#define EXP8 0
#define EXP16 0
#endif

#endif
