/* Decode attention's vector loops over bfloat16 K/V (attention_vec_impl.h), at each width the
 * build has, and the kv_ functions through which attention.c calls those of the width that
 * kv_lanes picks. */
#ifndef TISON_ATTENTION_VEC_H
#define TISON_ATTENTION_VEC_H
#include "typed.h"

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
#pragma GCC unroll 4
    for (int round = 0; round < 4; round++) {
        int n = 16 >> round;
        __m512i lo = _mm512_loadu_si512(pick[round][0]), hi = _mm512_loadu_si512(pick[round][1]);
#pragma GCC unroll 8
        for (int k = 0; k < n / 2; k++)
            v[k] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * k], lo, v[2 * k + 1]),
                                 _mm512_permutex2var_ps(v[2 * k], hi, v[2 * k + 1]));
    }
    return v[0];
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Eight horizontal sums at once: lane k of the result is the sum of the 8 lanes of v[k]. */
static inline __m256 sum8x8(const __m256 v[8]) {
    __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* ab: the sums of v[0..3] over lanes 0-3, then over lanes 4-7; cd likewise for v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

#define AHEAD_STREAMS 4 /* pages being asked for at once while one is read */

/* The lines a vector loop asks for while it reads part of a page: `streams` runs of lines,
 * run s `lines[s]` lines from at[s], none longer than `most` (attention.c's plan_ahead). The
 * loops ask for them a part at a time as their arithmetic goes, so the misses overlap it. */
struct kv_ahead {
    const char *at[AHEAD_STREAMS];
    int64_t lines[AHEAD_STREAMS], most;
    int streams;
};

/* The lines of a run a part asks for, of `parts` parts. */
static inline int64_t ahead_share(const struct kv_ahead *a, int64_t parts) {
    return (a->most + parts - 1) / parts;
}

/* The cache level prefetch_part asks for the lines into. AVX-512 builds: the L2 (prefetcht2),
 * with which calls at 256-2048 positions took 0.89-0.95x the time of the L1 hint on
 * avx512_bf16 (Zen 4); the AVX2 build: the L1, 0.91-0.96x the L2's time there. */
#if defined(__AVX512F__)
#define AHEAD_HINT 1
#else
#define AHEAD_HINT 3
#endif

/* Asks for lines [part * share, (part + 1) * share) of each run of a's, those it has. */
static inline void prefetch_part(const struct kv_ahead *a, int64_t part, int64_t share) {
    for (int s = 0; s < a->streams; s++) {
        int64_t end = (part + 1) * share < a->lines[s] ? (part + 1) * share : a->lines[s];
        for (int64_t l = part * share; l < end; l++)
            __builtin_prefetch(a->at[s] + l * 64, 0, AHEAD_HINT);
    }
}

/* attention_vec_impl.h at 8 float lanes: AVX2 */
#define W 8
#define VJ 2 /* query heads a values block: 2 x 2 x 2 sums + 4 values in 16 registers */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define DPBF16 1
#define VDPBF16(acc, q, k) _mm256_dpbf16_ps(acc, (__m256bh)(q), (__m256bh)(k))
#else
#define DPBF16 0
#endif
#define VNAME(x) x##_w8
#define VEC __m256
#define VINT __m256i
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define VEVEN(p) _mm256_castsi256_ps(_mm256_slli_epi32(p, 16))
#define VODD(p) _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u)))
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
#define VSUMS sum8x8
#define VSTORE_FIRST(p, v, count)                                                            \
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count)),               \
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v)
#include "attention_vec_impl.h"
#endif

#if defined(__AVX512F__)
/* attention_vec_impl.h at 16 float lanes: AVX-512 (head sizes a multiple of 32) */
#define W 16
#define VJ 4 /* 4 x 2 x 2 sums + 4 values of 32 registers */
#if defined(__AVX512BF16__)
#define DPBF16 1
#define VDPBF16(acc, q, k) _mm512_dpbf16_ps(acc, (__m512bh)(q), (__m512bh)(k))
#else
#define DPBF16 0
#endif
#define VNAME(x) x##_w16
#define VEC __m512
#define VINT __m512i
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define VEVEN(p) _mm512_castsi512_ps(_mm512_slli_epi32(p, 16))
#define VODD(p) _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u)))
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
#define VSUMS sum16x16
#define VSTORE_FIRST(p, v, count) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (count)) - 1), v)
#include "attention_vec_impl.h"
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The float lanes of the vector loops that decode attention over bf16 K/V runs for head size
 * hd (a multiple of 16): 16 where the build has AVX-512 and hd is a multiple of 32, else 8
 * (AVX2). attention.c calls the loops of that width through the kv_ functions. */
static inline int kv_lanes(int64_t hd) {
#if defined(__AVX512F__)
    if (hd % 32 == 0) return 16;
#endif
    (void)hd;
    return 8;
}

#if defined(__AVX512F__)
#define KV_AT(lanes, fn) ((lanes) == 16 ? fn##_w16 : fn##_w8)
#else
#define KV_AT(lanes, fn) ((void)(lanes), fn##_w8)
#endif

static inline const void *kv_prepare_q(int lanes, const bf16 *q, int64_t heads, int64_t hd,
                                       float *qf) {
    return KV_AT(lanes, prepare_q)(q, heads, hd, qf);
}

static inline void kv_scores(int lanes, const void *q, float scale, const bf16 *pool,
                             int64_t slot, int64_t count, int64_t nkv, int64_t group, int64_t hd,
                             float *scores, int64_t score_stride,
                             const struct kv_ahead *ahead) {
    KV_AT(lanes, scores)(q, scale, pool, slot, count, nkv, group, hd, scores, score_stride, ahead);
}

static inline void kv_values(int lanes, const float *weights, int64_t weight_stride,
                             const bf16 *pool, int64_t slot, int64_t count, int64_t nkv,
                             int64_t group, int64_t hd, float *acc,
                             const struct kv_ahead *ahead) {
    KV_AT(lanes, values)(weights, weight_stride, pool, slot, count, nkv, group, hd, acc, ahead);
}

static inline void kv_store_out(int lanes, const float *acc, const float *total, int64_t heads,
                                int64_t hd, bf16 *out) {
    KV_AT(lanes, store_out)(acc, total, heads, hd, out);
}
#else
static inline int kv_lanes(int64_t hd) { return (void)hd, 0; }
#endif
#endif
