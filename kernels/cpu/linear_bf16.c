/* bfloat16 linear layers for the few rows of a decode step (on avx2, prefill chunks too):
 * y (M, N) = x (M, K) w (N, K)^T (+ bias), float32 sums, rounded to bfloat16 once. The weight
 * stays in its plain row-major layout (one copy, shared with a tied embedding and with F.linear
 * for prefill).
 *
 * Where the build has AMX (amx_linear.c) the tiles do the work (all but the last N % 16
 * outputs, which the vector units of that tier take); elsewhere the vector units,
 * at the build's tier (isa.py), in dot-product form: a thread owns whole groups of R weight
 * rows, streams each group from memory once into L1 and runs it against every row of x, MB rows
 * at a time, in R x MB vector accumulators summed across their lanes at the end. The team
 * takes the groups as it goes (shares.h): each thread its equal run, then a slower one's rest.
 * - avx512_bf16: vdpbf16ps multiplies 32 bf16 pairs of w and x straight from memory; a whole
 *   4 x 4 block's 16 accumulators are folded into one vector of sums and stored rounded
 *   (full_block: 1.15-1.3x at 32 rows, Zen 5), the same bits as summing each alone;
 * - one row of x on the AVX-512 tiers, up to three on avx512_bf16 (few_rows): a thread's
 *   weight rows one after another, so the weights are read as one stream in address order,
 *   with no prefetch asked for;
 * - avx512 / avx2: a 32-bit lane of w holds two bf16 (k even in the low half): lane << 16 and
 *   lane & 0xffff0000 are those two as float32 with no other work, so x is laid out once per
 *   call as float32 in that order (the even k of a block, then the odd k) and fed to FMAs;
 *   on avx2, from WIDE_ROWS rows of x on, outer products instead (outer_group: groups of NR
 *   outputs widened to float32 once, x packed in blocks of XB rows, k-major);
 * - portable: plain C on x as float32 that the compiler vectorizes for any target.
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "shares.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define R 4 /* weight rows (outputs) a group */
#define XB 16 /* rows of x a packed block (avx2's outer products) */
/* The dot-product form (but few_rows, which asks for nothing) asks for a thread's weights (one
 * stream: its groups lie back to back) as AHEAD_STREAMS streams: taken as blocks of `block`
 * bytes, while it reads block q it asks for part AHEAD_STREAMS - 1 - j of AHEAD_STREAMS of
 * block q + 1 + j (j < AHEAD_STREAMS), so each block is asked for over the blocks read before it
 * (prefetch_step): blocks of AHEAD_BLOCK where a group's weights are read in one pass, 4 to 20 KiB
 * ahead, and of AHEAD_BLOCK_PASSES where they are read in several (passes), 16 to 80 KiB ahead.
 * Against asking for one line a fixed distance ahead (16 KiB on the AVX-512 tiers, 4 KiB on avx2),
 * on a Zen 4 with 2048 x 768 and 32000 x 768 weights: one row of x read them 1.08-1.23x as fast on
 * avx512_bf16, 1.21-1.34x on avx2 (768 x 2048: 1.03x, 1.13x); 8 and 16 rows 0.94-1.10x on
 * avx512_bf16, 1.36-1.58x on avx2. At one row, 2 or 8 streams, or blocks of 8 or 16 KiB, gained
 * less; at 4 rows (one pass) 16 KiB blocks took 1.07x as long. With several passes, 16 KiB blocks
 * against 4 KiB on a Zen 4, a dense model's linears over 250 MB of cold weights ran 1.07-1.2x as
 * fast from 2 to 32 rows on avx512_bf16 (8 rows: 1.0-1.1x), 1.07-1.26x on avx2 (5 to 12 rows),
 * 0.98-1.08x on avx512 (32 KiB at 32 rows: 0.97x); batch-32 steps, alternated in one engine on
 * avx512_bf16, took 0.93-0.95x the time (dense), 0.97x (MoE), 1.00x (Llama 4), and 0.98-1.01x on
 * avx2 and avx512. */
#define AHEAD_BLOCK 4096
#define AHEAD_BLOCK_PASSES 16384
#define AHEAD_STREAMS 4
/* outer_group's (avx2, WIDE_ROWS rows of x on): at 4 KiB, batch-32 steps took 2-4% longer */
#define OUTER_AHEAD 16384

#if defined(__AVX512BF16__)
#define MB 4 /* rows of x a block */
#define XF32 0 /* x read as bf16 */
#elif defined(__AVX512F__)
#define MB 4
#define XF32 1
#define VW 16 /* float lanes of a vector */
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vsum _mm512_reduce_add_ps
static inline vec w_even(__m512i p) { return _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)); }
static inline vec w_odd(__m512i p) {
    return _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u)));
}
#define wload(p) _mm512_loadu_si512((const void *)(p))
#elif defined(__AVX2__) && defined(__FMA__)
#define MB 2
#define XF32 1
#define VW 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec w_even(__m256i p) { return _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)); }
static inline vec w_odd(__m256i p) {
    return _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u)));
}
#define wload(p) _mm256_loadu_si256((const __m256i *)(p))
#define OUTER 1 /* outer_group from WIDE_ROWS rows on */
/* 8 bf16 at p (in order) -> float32 */
static inline vec widen(const bf16 *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
#define MB 2
#define XF32 1
#define VW 8 /* the block layout of x; the loops below are plain C */
#define PORTABLE 1
#endif

/* A group's passes over its weights for M rows of x: blocks of MB rows, then one at a time. */
static inline int passes(int64_t M) { return (int)(M / MB + M % MB); }

/* Output n's float32 sum plus its bias (bias NULL: none), rounded to bf16 once. */
static inline bf16 output(float sum, const bf16 *bias, int64_t n) {
    return f32_to_bf16(sum + (bias == NULL ? 0.0f : bf16_to_f32(bias[n])));
}

/* Stores acc's sums for rows [m0, m0 + mb) and outputs [n0, n0 + rows) of y (row stride N). */
static inline void store_sums(const float sums[R][MB], const bf16 *bias, int64_t m0, int mb,
                              int64_t n0, int rows, bf16 *y, int64_t N) {
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rows; r++) y[(m0 + m) * N + n0 + r] = output(sums[r][m], bias, n0 + r);
}

#if XF32
/* x (M, K; row stride xs) -> xf (M, K) float32, each block of 2 * VW k as its VW even k then
 * its VW odd k (the order w_even / w_odd give the weights in). */
static void spread_x(const bf16 *x, int64_t xs, int64_t M, int64_t K, float *xf) {
#pragma omp for
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 2 * VW)
            for (int i = 0; i < VW; i++) {
                xf[m * K + k + i] = bf16_to_f32(x[m * xs + k + 2 * i]);
                xf[m * K + k + VW + i] = bf16_to_f32(x[m * xs + k + 2 * i + 1]);
            }
}
#endif

/* Asks for the unit (`unit` bytes) that unit u of the weights stands for in blocks of `block`
 * bytes (prefetch_step). */
__attribute__((always_inline)) static inline void ask_unit(uintptr_t u, uintptr_t unit,
                                                           uintptr_t block) {
    const uintptr_t S = AHEAD_STREAMS, B = block / unit, q = u / B, f = u % B, j = f % S;
    const char *t = (const char *)(((q + 1 + j) * B + (S - 1 - j) * B / S + f / S) * unit);
    for (uintptr_t l = 0; l < unit; l += 64) __builtin_prefetch(t + l, 0, 1);
}

/* For the R lines of the stream from `at` on (one k step of a group's weight rows): asks for
 * the lines they stand for AHEAD_STREAMS streams on (see AHEAD_BLOCK), with the L2 hint (the
 * L1 hint was slower: 75% -> 85% of the read probe's bandwidth at one row, before the
 * streams). With S streams and blocks of B units, unit f of block q stands for unit
 * (S - 1 - j) * B / S + f / S of block q + 1 + j, j = f % S: every unit of a block once. The
 * units are lines where the group's weights are read in one pass, so a step asks for a line of
 * each stream; with several passes, each asking for every `every`-th step, they are steps (R
 * lines), so that a stream is asked for whole runs of lines, not every other line (at 8 rows of
 * x on avx512_bf16, lines: 0.69-0.91x the rate, steps: 1.00x; at one row, steps gained 1.04x
 * where lines gained 1.20x; Zen 4). */
__attribute__((always_inline)) static inline void prefetch_step(const char *at, int every) {
    if (every > 1) {
        ask_unit((uintptr_t)at / (64 * R), 64 * R, AHEAD_BLOCK_PASSES);
        return;
    }
    for (int r = 0; r < R; r++) ask_unit((uintptr_t)at / 64 + r, 64, AHEAD_BLOCK);
}

#if defined(__AVX512BF16__)
/* block's products on avx512_bf16: acc[r][m] (16 lanes) for weight rows w[r] and x rows m0 + m,
 * vdpbf16ps on 32 bf16 pairs a step; asks for what every `every`-th step of the weights from
 * `stream` on stands for (prefetch_step), from step `phase` (block). */
__attribute__((always_inline)) static inline void dots(const bf16 *const w[R], const bf16 *x,
                                                       int64_t xstride, int64_t m0, int mb,
                                                       int64_t K, __m512 acc[R][MB],
                                                       const char *stream, int phase, int every) {
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = _mm512_setzero_ps();
    int count = phase + 1;
    for (int64_t k = 0; k < K; k += 32) {
        if (--count == 0) {
            count = every;
            prefetch_step(stream + k * 2 * R, every);
        }
        __m512bh wv[R];
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
        for (int m = 0; m < mb; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * xstride + k);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
        }
    }
}

/* A whole block's 16 sums in one vector, lane 4 m + r = the lanes of acc[r][m] added up, in
 * the very order _mm512_reduce_add_ps adds them (halves, quarters, then lanes 0 + 2 and 1 + 3,
 * then those two): the same bits as block's sums, in ~45 instructions instead of ~130. */
static inline __m512 sum_block(__m512 acc[R][MB]) {
    _Static_assert(R == 4 && MB == 4, "sum_block folds a 4 x 4 block");
    __m512 s[8], u[4], v[2];
    for (int i = 0; i < 8; i++) { /* acc j = 4 r + m: halves of j = 2i in lanes 0-7, 2i+1 8-15 */
        const __m512 a = acc[i / 2][i % 2 * 2], b = acc[i / 2][i % 2 * 2 + 1];
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; i++) /* quarter q of u[i]: acc number 4 i + q, 4 lanes */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* per quarter: lanes 0 + 2 and 1 + 3 of u[2i], of u[2i + 1] */
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]),
                             _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
    /* lane 4 q + i: the sum of u[i]'s quarter q, that is of acc[i][q] */
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x44), _mm512_shuffle_ps(v[0], v[1], 0xEE));
}

/* A whole block (R outputs n0.., MB rows m0.. of x) straight into y (row stride N): its sums
 * plus bias rounded as f32_to_bf16 does, four outputs a row in one 8-byte store. */
static inline void full_block(const bf16 *const w[R], const bf16 *x, int64_t xstride, int64_t m0,
                              int64_t K, const char *stream, int phase, int every,
                              const bf16 *bias, int64_t n0, bf16 *y, int64_t N) {
    __m512 acc[R][MB];
    dots(w, x, xstride, m0, MB, K, acc, stream, phase, every);
    __m128 b = _mm_setzero_ps(); /* + 0.0f without a bias, as store_sums adds */
    if (bias != NULL) {
        const __m128i h = _mm_loadl_epi64((const __m128i *)(bias + n0));
        b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    const __m512 sums = _mm512_add_ps(sum_block(acc), _mm512_broadcast_f32x4(b));
    const __m512i u = _mm512_castps_si512(sums);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i half = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, half), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    const __m256i out = _mm512_cvtepi32_epi16(r); /* 16 bf16: row m's four at 4 m */
    uint64_t rows[MB];
    memcpy(rows, &out, sizeof rows);
    for (int m = 0; m < MB; m++) memcpy(y + (m0 + m) * N + n0, &rows[m], sizeof rows[m]);
}
#endif

/* One block: weight rows w[r] (r < R, each K long) against x rows m0.. m0 + mb, sums into
 * sums[r][m]. `mb` is a constant at each call site, so the loops unroll. stream: this group's
 * weights as the thread's stream, for prefetch_step to ask for what comes after them (a
 * thread's groups lie back to back, so its weights are one stream; the rows of a group are R
 * short streams that the hardware prefetcher would only pick up once each was half read). The
 * block is pass `phase` of the group's `every` passes over its weights (one a block of x's
 * rows): it asks for the k steps phase, phase + every, ..., so the asking is spread evenly
 * over the group's compute. Asked for on the first pass alone, the memory idled through the
 * others: at 32 rows of x the LM head took 1.3-1.5x as long, a MoE step's experts (8 rows
 * each) 1.2x (Zen 5). */
__attribute__((always_inline)) static inline void block(const bf16 *const w[R], const void *xv,
                                                        int64_t xstride, int64_t m0, int mb,
                                                        int64_t K, float sums[R][MB],
                                                        const char *stream, int phase,
                                                        int every) {
#if defined(__AVX512BF16__)
    __m512 acc[R][MB];
    dots(w, (const bf16 *)xv, xstride, m0, mb, K, acc, stream, phase, every);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
#elif !defined(PORTABLE)
    const float *x = (const float *)xv;
    vec acc[R][MB];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = vzero();
    int count = phase + 1;
    for (int64_t k = 0; k < K; k += 2 * VW) {
        if ((k & 31) == 0 && --count == 0) {
            count = every;
            prefetch_step(stream + k * 2 * R, every);
        }
        vec xe[MB], xo[MB];
        for (int m = 0; m < mb; m++) {
            const float *xm = x + (m0 + m) * xstride + k;
            xe[m] = vload(xm), xo[m] = vload(xm + VW);
        }
        for (int r = 0; r < R; r++) {
            __typeof__(wload(w[r])) p = wload(w[r] + k);
            vec we = w_even(p);
            for (int m = 0; m < mb; m++) acc[r][m] = vfma(xe[m], we, acc[r][m]);
            vec wo = w_odd(p);
            for (int m = 0; m < mb; m++) acc[r][m] = vfma(xo[m], wo, acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) sums[r][m] = vsum(acc[r][m]);
#else
    (void)stream, (void)phase, (void)every;
    const float *x = (const float *)xv;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) {
            const float *xm = x + (m0 + m) * xstride;
            float lane[2 * VW] = {0};
            for (int64_t k = 0; k < K; k += 2 * VW)
                for (int i = 0; i < VW; i++) {
                    lane[i] += xm[k + i] * bf16_to_f32(w[r][k + 2 * i]);
                    lane[VW + i] += xm[k + VW + i] * bf16_to_f32(w[r][k + 2 * i + 1]);
                }
            float s = 0.0f;
            for (int i = 0; i < 2 * VW; i++) s += lane[i];
            sums[r][m] = s;
        }
#endif
}

#if defined(__AVX512F__)
/* One row of x on the AVX-512 tiers, and up to FEW_ROWS on avx512_bf16 (few_rows): outputs
 * [from, to) of y one after another, each row's sum kept over k in one accumulator as block
 * keeps it (the same bits), so that their weight rows are read in address order, one stream,
 * with nothing asked for ahead. At one row the loop is five instructions a line, and the
 * out-of-order window, held up by the sum's chain, keeps ~60 lines of it in flight. In a C
 * harness over the dense bench model's 65 linears (250 MB, 2 threads, Zen 4, its upper
 * bandwidth level) this read 56.0 GB/s in the team's shared runs where the rows taken 4 at a
 * time with prefetch_step's lines (~12 instructions more a line) read 48.1 (whole rows in a
 * static split: 53.3, with those lines 47.4); alternated in one engine with the dense model on
 * avx512_bf16, the fused batch-1 call took 0.89x the time at that level (81% of the read probe
 * against 70%), 0.96x at the lower one. block's R rows side by side are R short streams at
 * once. Against them, alternated in one engine on a Zen 4, the fused batch-1 step took
 * 0.85-0.95x the time on avx512_bf16 with the dense model, 0.92-1.04x (median 0.95x) with the
 * MoE one, 0.93-0.99x with Llama 4's, and 0.92-0.96x (dense) and 0.94-0.98x (MoE) on avx512.
 * Two and three rows of x, whose groups block read in two and three passes of one row, on
 * avx512_bf16 (Zen 4, the fused call alternated in one engine, upper / lower bandwidth level):
 * dense batch 2 0.69x / 0.86x the time, batch 3 0.78x / 0.88x, MoE batch 2 0.79x / 0.85x.
 * Four rows this way took 1.42x / 1.23x the time of full_block's one pass (five loads a line
 * here against two there), and two rows on avx512 1.18x at the upper level (each row's sum a
 * chain of two FMAs a line). avx2 keeps block: the rows in turn took 0.95-1.31x the time there;
 * two rows side by side with nothing asked for, 1.80x (the chains hold the window to ~60 ns
 * ahead, short of a miss). */
#if defined(__AVX512BF16__)
#define FEW_ROWS 3
#else
#define FEW_ROWS 1
#endif
/* few_rows for M rows of x, M a constant at each call site, so the loops unroll. */
__attribute__((always_inline)) static inline void rows_of(const bf16 *w, const bf16 *bias,
                                                          const void *xv, int64_t xstride,
                                                          int M, int64_t K, int64_t from,
                                                          int64_t to, bf16 *y, int64_t N) {
#if defined(__AVX512BF16__)
    const bf16 *x = (const bf16 *)xv;
#else
    const float *x = (const float *)xv; /* spread_x's order */
#endif
    for (int64_t n = from; n < to; n++) {
        const bf16 *wn = w + n * K;
        __m512 acc[FEW_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) { /* a line of w */
#if defined(__AVX512BF16__)
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + k);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m],
                                          (__m512bh)_mm512_loadu_si512(x + m * xstride + k), wv);
#else
            const __m512i p = wload(wn + k);
            const vec we = w_even(p), wo = w_odd(p);
            for (int m = 0; m < M; m++) {
                acc[m] = vfma(vload(x + m * xstride + k), we, acc[m]);
                acc[m] = vfma(vload(x + m * xstride + k + VW), wo, acc[m]);
            }
#endif
        }
        for (int m = 0; m < M; m++) y[m * N + n] = output(_mm512_reduce_add_ps(acc[m]), bias, n);
    }
}

static void few_rows(const bf16 *w, const bf16 *bias, const void *xv, int64_t xstride,
                     int64_t M, int64_t K, int64_t from, int64_t to, bf16 *y, int64_t N) {
    _Static_assert(FEW_ROWS <= 3, "few_rows unrolls 1 to 3 rows");
    if (FEW_ROWS == 1 || M == 1)
        rows_of(w, bias, xv, xstride, 1, K, from, to, y, N);
    else if (M == 2)
        rows_of(w, bias, xv, xstride, 2, K, from, to, y, N);
    else
        rows_of(w, bias, xv, xstride, 3, K, from, to, y, N);
}
#endif

/* The group of outputs [n0, n0 + rows) against all M rows of x. */
static void group(const bf16 *w, const bf16 *bias, const void *x, int64_t xstride, int64_t M,
                  int64_t N, int64_t K, int64_t n0, bf16 *y) {
    int rows = N - n0 < R ? (int)(N - n0) : R;
#if defined(__AVX512F__)
    if (M <= FEW_ROWS) {
        few_rows(w, bias, x, xstride, M, K, n0, n0 + rows, y, N);
        return;
    }
#endif
    const bf16 *wr[R]; /* past the last row: that row again, computed and not stored */
    for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < rows ? r : rows - 1)) * K;
    float sums[R][MB] = {{0}}; /* rows past a short block: never stored */
    const char *stream = (const char *)(w + n0 * K);
    const int every = passes(M);
    int64_t m0 = 0;
    int pass = 0;
    for (; m0 + MB <= M; m0 += MB, pass++) {
#if defined(__AVX512BF16__)
        if (rows == R) {
            full_block(wr, (const bf16 *)x, xstride, m0, K, stream, pass, every, bias, n0, y, N);
            continue;
        }
#endif
        block(wr, x, xstride, m0, MB, K, sums, stream, pass, every);
        store_sums(sums, bias, m0, MB, n0, rows, y, N);
    }
    for (; m0 < M; m0++, pass++) {
        block(wr, x, xstride, m0, 1, K, sums, stream, pass, every);
        store_sums(sums, bias, m0, 1, n0, rows, y, N);
    }
}

#if defined(OUTER)
/* avx2, from WIDE_ROWS rows of x on: outer products. The dot-product form converts each weight
 * vector again for every block of x rows and ends each sum with a horizontal add (measured on
 * Zen 3: ~80 GFLOP/s on 2 cores at 32 rows), so here a group of NR outputs is widened to
 * float32 once, KC k at a time, into L1, and x is packed once a call in blocks of 16 rows, each
 * (K, 16) float32, so that 16 rows of one k are two vectors in a row: a block is 16 rows x NR
 * outputs in 2 x NR accumulators, a step of k two loads of x, NR broadcasts of a weight,
 * 2 x NR FMAs, and no horizontal sums. Below WIDE_ROWS the widening costs more than it saves. */
#define WIDE_ROWS 16
#define NR 6 /* outputs a group */
/* KC: NR x KC float32 (3 KiB) beside the KC x XB of x a block streams (8 KiB); measured on Zen 3
 * against 256: 1.1-1.4x at 16 rows, 1.0-1.15x at 32 */
#define KC 128
#define KS (KC + 16) /* their stride: rows 512 B apart would share L1 sets */

/* Packed blocks of `rows` rows. */
static inline int64_t blocks_of(int64_t rows) { return (rows + XB - 1) / XB; }

/* k [k_from, k_to) of rows [0, rows) of x (row stride xs; rows <= XB) -> those k of one packed
 * block xp (K, XB) float32, the rows past `rows` zero: 8 k of 8 rows widened, then transposed
 * in registers. */
static void pack_block(const bf16 *x, int64_t xs, int64_t rows, int64_t k_from, int64_t k_to,
                       float *xp) {
    for (int64_t k = k_from; k < k_to; k += 8)
        for (int h = 0; h < XB / 8; h++) {
            vec r[8], t[8], u[8];
            for (int i = 0; i < 8; i++)
                r[i] = h * 8 + i < rows ? widen(x + (h * 8 + i) * xs + k) : vzero();
            for (int i = 0; i < 8; i += 2)
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]),
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
                u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
            }
            for (int j = 0; j < 4; j++) { /* u[j] holds k + j (low half) and k + 4 + j (high) */
                vstore(xp + (k + j) * XB + h * 8, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
                vstore(xp + (k + 4 + j) * XB + h * 8,
                       _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
            }
        }
}

/* Rows [0, 8 * nv) (nv = 1 or 2 vectors) of a packed block, from the chunk's first k, against
 * the widened rows wf[r] over kc k: adds into sums[r * XB + m] (r < NR). */
__attribute__((always_inline)) static inline void outer_block(const float *wf, int64_t kc,
                                                              const float *xp, int nv,
                                                              float *sums) {
    vec acc[NR][2];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = vload(sums + r * XB + v * VW);
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        vec xv[2];
        for (int v = 0; v < nv; v++) xv[v] = vload(xp + k * XB + v * VW);
        for (int r = 0; r < NR; r++) {
            vec wv = _mm256_broadcast_ss(wf + r * KS + k);
            for (int v = 0; v < nv; v++) acc[r][v] = vfma(xv[v], wv, acc[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < nv; v++) vstore(sums + r * XB + v * VW, acc[r][v]);
}

/* The team packs the rows [start[e], start[e + 1]) of x (row stride xs) of each active expert
 * e = active[a] (a < count; one matrix: count 1, start {0, M}) in blocks of their own from
 * block start[e] / XB + a on (apart: ceil(c / XB) <= floor(c / XB) + 1), into xp: a block and
 * KC k an item. */
static void pack_x(const bf16 *x, int64_t xs, const int64_t *start, const int64_t *active,
                   int64_t count, int64_t K, float *xp) {
    int64_t chunks = (K + KC - 1) / KC, last = active[count - 1];
    int64_t blocks = start[last] / XB + count - 1 + blocks_of(start[last + 1] - start[last]);
#pragma omp for
    for (int64_t i = 0; i < blocks * chunks; i++) {
        int64_t b = i / chunks, k0 = i % chunks * KC, a = 0;
        while (a + 1 < count && start[active[a + 1]] / XB + a + 1 <= b) a++;
        int64_t e = active[a], row = start[e] + (b - start[e] / XB - a) * XB;
        if (row >= start[e + 1]) continue; /* between two experts' blocks */
        int64_t left = start[e + 1] - row;
        pack_block(x + row * xs, xs, left < XB ? left : XB, k0, K - k0 < KC ? K : k0 + KC,
                   xp + b * K * XB);
    }
}

/* 8 float32 -> 8 bf16 (in 32-bit lanes) as f32_to_bf16 rounds them. */
static inline __m256i round8(vec v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* A block's XB sums of one output (lo: rows 0-7, hi: 8-15) -> out[XB] bf16, rounded as
 * f32_to_bf16 does: outer_group ran 1.01-1.07x as fast as rounding each sum alone (16-512 rows
 * of x, K 768-2048, weights in cache; Zen 4 at avx2). */
static inline void round_xb(vec lo, vec hi, bf16 out[XB]) {
    /* packus takes 128-bit halves in turn: lo 0-3, hi 0-3, lo 4-7, hi 4-7; the permute
     * puts the halves back in order */
    __m256i packed = _mm256_packus_epi32(round8(lo), round8(hi));
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(packed, 0xD8));
}

/* Outputs [n0, n0 + NR) of y (M, N) from M rows packed in blocks at xp. */
static void outer_group(const bf16 *w, const bf16 *bias, const float *xp, int64_t M, int64_t N,
                        int64_t K, int64_t n0, bf16 *y) {
    int rows = N - n0 < NR ? (int)(N - n0) : NR;
    const bf16 *wr[NR]; /* past the last row: that row again, computed and not stored */
    for (int r = 0; r < NR; r++) wr[r] = w + (n0 + (r < rows ? r : rows - 1)) * K;
    int64_t blocks = blocks_of(M);
    float wf[NR * KS] __attribute__((aligned(64)));
    float sums[blocks][NR * XB] __attribute__((aligned(32))); /* [block][r][row of the block] */
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < NR * XB; i++) sums[b][i] = 0.0f;
    const char *ahead = (const char *)(w + n0 * K) + OUTER_AHEAD; /* the rows lie in a row */
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int r = 0; r < NR; r++)
            for (int64_t k = 0; k < kc; k += VW) {
                if (k % 32 == 0) __builtin_prefetch(ahead + (r * K + k0 + k) * 2, 0, 1);
                vstore(wf + r * KS + k, widen(wr[r] + k0 + k));
            }
        for (int r = 0; r < NR; r++) /* the next chunk (or group's) into L1 while this one runs */
            for (int64_t k = 0; k < KC; k += 32)
                __builtin_prefetch(k0 + KC < K ? wr[r] + k0 + KC + k : wr[r] + NR * K + k, 0, 3);
        for (int64_t b = 0; b < blocks; b++)
            if (M - b * XB > VW)
                outer_block(wf, kc, xp + (b * K + k0) * XB, 2, sums[b]);
            else
                outer_block(wf, kc, xp + (b * K + k0) * XB, 1, sums[b]);
    }
    for (int64_t b = 0; b < blocks; b++) {
        bf16 out[NR][XB]; /* the block's rows of each output, rounded */
        for (int r = 0; r < rows; r++) {
            /* + 0.0f without a bias, as store_sums adds (-0.0f becomes 0.0f) */
            vec add = _mm256_set1_ps(bias == NULL ? 0.0f : bf16_to_f32(bias[n0 + r]));
            round_xb(_mm256_add_ps(vload(sums[b] + r * XB), add),
                     _mm256_add_ps(vload(sums[b] + r * XB + VW), add), out[r]);
        }
        for (int64_t m = b * XB; m < M && m < (b + 1) * XB; m++)
            for (int r = 0; r < rows; r++) y[m * N + n0 + r] = out[r][m % XB];
    }
}
#define WIDE(M) ((M) >= WIDE_ROWS)
#else
#define WIDE(M) 0
#endif

#if AMX_BUILD
#if XF32
#error "the amx tier's vector kernels read x as bf16 in place: no float32 copy in its scratch"
#endif
/* linear_team on the tiles (amx_linear.c: the outputs up to the last multiple of 16), then the
 * N % 16 left in groups of R on the vector units (a router of 8 experts has no tile at all). */
static void amx_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                     int64_t N, int64_t K, bf16 *y, void *scratch) {
    amx_linear_team(x, xs, w, bias, M, N, K, y, scratch);
    if (N % 16 == 0) return; /* every thread sees the same N */
    int64_t groups = (N + R - 1) / R;
#pragma omp for schedule(static)
    for (int64_t g = N / 16 * 16 / R; g < groups; g++) group(w, bias, x, xs, M, N, K, g * R, y);
}
#endif

/* Bytes of scratch vec_linear_team needs for x of M rows of K: the team's shares (shares.h),
 * at its start so that every linear of a step finds them where the last one left them empty,
 * then x laid out (x_scratch). */
int64_t vec_linear_scratch(int64_t M, int64_t K) {
#if defined(OUTER)
    /* packed blocks: at most M / XB + 1 for one matrix, M / XB + count <= M / 8 for experts (wide
     * when they have XB rows on average) */
    if (WIDE(M)) return SHARES_BYTES + K * XB * (M / 8 + 2) * 4;
#endif
    return SHARES_BYTES + (XF32 ? M * K * 4 : 0);
}

static inline void *x_scratch(void *scratch) { return (char *)scratch + SHARES_BYTES; }

/* The team lays out x (M rows; for experts, pack_x's rows of each active one) for the kernel:
 * packed in blocks (outer_group), spread (group, on float32 x) or as it is. Returns the x the
 * kernel reads; *stride: its row stride (for group). */
static const void *lay_out_x(const bf16 *x, int64_t xs, int64_t M, const int64_t *start,
                             const int64_t *active, int64_t count, int64_t K, int wide,
                             void *scratch, int64_t *stride) {
#if defined(OUTER)
    if (wide) {
        pack_x(x, xs, start, active, count, K, (float *)scratch);
        *stride = 0;
        return scratch;
    }
#endif
    (void)wide, (void)start, (void)active, (void)count;
#if XF32
    spread_x(x, xs, M, K, (float *)scratch);
    *stride = K;
    return scratch;
#else
    (void)scratch;
    *stride = xs;
    return x;
#endif
}

/* Where rows from `row` on (of the a-th active expert, when packed) lie in lay_out_x's x. */
static inline const void *rows_at(const void *xv, int64_t xstride, int64_t row, int64_t a,
                                  int64_t K, int wide) {
    if (wide) return (const float *)xv + (row / XB + a) * K * XB;
    return (const char *)xv + row * xstride * (XF32 ? 4 : 2);
}

/* Outputs [n0, n0 + R or NR) of y (M, N) from the M rows of x at xv (rows_at). */
static inline void any_group(const bf16 *w, const bf16 *bias, const void *xv, int64_t xstride,
                             int64_t M, int64_t N, int64_t K, int64_t n0, bf16 *y, int wide) {
#if defined(OUTER)
    if (wide) {
        outer_group(w, bias, (const float *)xv, M, N, K, n0, y);
        return;
    }
#endif
    (void)wide;
    group(w, bias, xv, xstride, M, N, K, n0, y);
}

/* Asks for the `ahead` bytes from `from` (not past `end`): where a thread's run of groups
 * starts, before the groups' own prefetch, that far ahead of them, takes over. */
static inline void prefetch_from(const char *from, const char *end, int64_t ahead) {
    for (const char *p = from; p < from + ahead && p < end; p += 64) __builtin_prefetch(p, 0, 1);
}

/* What prefetch_from asks for where a thread's groups start, for M rows of x: outer_group's
 * (wide) OUTER_AHEAD, else the AHEAD_STREAMS blocks that prefetch_step's streams have not yet
 * asked for whole. */
static inline int64_t ahead_of(int wide, int64_t M) {
    (void)wide;
#if defined(OUTER)
    if (wide) return OUTER_AHEAD;
#endif
    return AHEAD_STREAMS * (passes(M) > 1 ? AHEAD_BLOCK_PASSES : AHEAD_BLOCK);
}

/* Outputs a group for M rows. */
static inline int64_t group_size(int wide) {
#if defined(OUTER)
    if (wide) return NR;
#endif
    (void)wide;
    return R;
}

/* y (M, N) contiguous = x (M, K; row stride xs) w^T + bias (N,) or NULL, w (N, K) contiguous,
 * K % 32 == 0; scratch: vec_linear_scratch(M, K) bytes shared by the team. A team kernel
 * (kernels.h): the team lays out x, then takes the groups as it goes (shares.h). */
void vec_linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                     int64_t N, int64_t K, bf16 *y, void *scratch) {
    int wide = WIDE(M);
    int64_t rows[2] = {0, M}, one = 0, xstride, size = group_size(wide);
    int64_t groups = (N + size - 1) / size;
    const void *xv = lay_out_x(x, xs, M, rows, &one, 1, K, wide, x_scratch(scratch), &xstride);
    runs r = runs_start(scratch, groups);
    for (int64_t lo, hi, previous = -1; runs_next(&r, &lo, &hi); previous = hi) {
#if defined(__AVX512F__)
        if (M <= FEW_ROWS) { /* one stream of whole rows (see few_rows) */
            few_rows(w, bias, xv, xstride, M, K, lo * size, hi * size < N ? hi * size : N, y, N);
            continue;
        }
#endif
        if (lo != previous) /* not where this thread's last run ended */
            prefetch_from((const char *)(w + lo * size * K), (const char *)(w + N * K),
                          ahead_of(wide, M));
        for (int64_t g = lo; g < hi; g++)
            any_group(w, bias, xv, xstride, M, N, K, g * size, y, wide);
    }
#pragma omp barrier
}

/* The experts of a MoE layer as one team loop (moe.c): x (P, K) holds the rows of expert e at
 * [start[e], start[e + 1]), y (P, N) gets them through w + e * w_stride (N, K); the team shares
 * out every active expert's groups at once, so the weight stream does not stop between
 * experts. scratch: linear_scratch(P, K). */
void experts_linear_team(const bf16 *x, const int64_t *start, int64_t E, const bf16 *w,
                         int64_t w_stride, int64_t N, int64_t K, bf16 *y, void *scratch) {
    int64_t active[E], count = 0; /* every thread lists the same experts */
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) active[count++] = e;
#if AMX_BUILD
    for (int64_t a = 0; a < count; a++) {
        int64_t e = active[a], first = start[e];
        amx_team(x + first * K, K, w + e * w_stride, NULL, start[e + 1] - first, N, K,
                 y + first * N, scratch);
    }
#else
    int wide = count > 0 && WIDE(start[E] / count); /* rows an active expert, on average */
    int64_t xstride, size = group_size(wide), groups = (N + size - 1) / size;
    const void *xv =
        lay_out_x(x, K, start[E], start, active, count, K, wide, x_scratch(scratch), &xstride);
    /* The units: every active expert's groups, expert after expert. Experts have unequal rows,
     * so the threads' equal first runs are unequal work, which the taking evens out. */
    runs r = runs_start(scratch, count * groups);
    for (int64_t lo, hi, previous = -1; runs_next(&r, &lo, &hi); previous = hi)
        for (int64_t u = lo; u < hi; u++) {
            const int64_t a = u / groups, g = u % groups, e = active[a], first = start[e];
            const bf16 *we = w + e * w_stride;
            if (g == 0 || (u == lo && lo != previous)) /* the next expert, or a new run */
                prefetch_from((const char *)(we + g * size * K), (const char *)(we + N * K),
                              ahead_of(wide, start[e + 1] - first));
            any_group(we, NULL, rows_at(xv, xstride, first, a, K, wide), xstride,
                      start[e + 1] - first, N, K, g * size, y + first * N, wide);
        }
#pragma omp barrier
#endif
}

static __thread void *scratch; /* a caller's linear scratch, grown as needed, kept */
static __thread size_t scratch_bytes;

/* The calling thread's scratch for linear_team on M rows of K (64-byte aligned), or NULL when
 * it cannot be allocated. */
void *linear_scratch(int64_t M, int64_t K) {
#if AMX_BUILD
    size_t bytes = (size_t)((M + 15) / 16 * K * (M < 16 ? M : 16) * 2);
#else
    size_t bytes = (size_t)vec_linear_scratch(M, K);
#endif
    bytes = bytes < 64 ? 64 : bytes;
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch == NULL ? 0 : bytes;
#if !AMX_BUILD
        if (scratch != NULL) shares_clear(scratch);
#endif
    }
    return scratch;
}

void linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                 int64_t N, int64_t K, bf16 *y, void *scratch) {
#if AMX_BUILD
    amx_team(x, xs, w, bias, M, N, K, y, scratch);
#else
    vec_linear_team(x, xs, w, bias, M, N, K, y, scratch);
#endif
}

void linear_team_done(void) {
#if AMX_BUILD
    amx_release();
#endif
}

/* 1 when linear_team runs on AMX tiles (built for them, and the OS lets this process use
 * them), else 0. */
int tk_amx_ready(void) {
#if AMX_BUILD
    return amx_request();
#else
    return 0;
#endif
}

/* linear_team on `threads` threads. Returns 0, or -1 when its scratch cannot be allocated. */
int tk_linear_bf16(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                   int64_t N, int64_t K, bf16 *y, int threads) {
    void *buf = linear_scratch(M, K); /* the caller's: the team's threads have their own */
    if (buf == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        linear_team(x, xs, w, bias, M, N, K, y, buf);
        linear_team_done();
    }
    return 0;
}

/* experts_linear_team on `threads` threads (x (P, K) grouped by expert as start says, w (E, N,
 * K) at w_stride), for the tests. Returns 0, or -1 when its scratch cannot be allocated. */
int tk_experts_linear_bf16(const bf16 *x, const int64_t *start, int64_t E, const bf16 *w,
                           int64_t w_stride, int64_t N, int64_t K, bf16 *y, int threads) {
    void *buf = linear_scratch(start[E], K);
    if (buf == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        experts_linear_team(x, start, E, w, w_stride, N, K, y, buf);
        linear_team_done();
    }
    return 0;
}
