/* bfloat16 linear layers for the few rows of a decode step: y (M, N) = x (M, K) w (N, K)^T
 * (+ bias), float32 sums, rounded to bfloat16 once. The weight stays in its plain row-major
 * layout (one copy, shared with a tied embedding and with F.linear for prefill).
 *
 * Where the build has AMX (amx_linear.c) the tiles do the work (all but the last N % 16
 * outputs, which the vector units of that tier take); elsewhere the vector units,
 * at the build's tier (isa.py), in dot-product form: a thread owns whole groups of R weight
 * rows, streams each group from memory once into L1 and runs it against every row of x, MB rows
 * at a time, in R x MB vector accumulators summed across their lanes at the end.
 * - avx512_bf16: vdpbf16ps multiplies 32 bf16 pairs of w and x straight from memory;
 * - avx512 / avx2: a 32-bit lane of w holds two bf16 (k even in the low half): lane << 16 and
 *   lane & 0xffff0000 are those two as float32 with no other work, so x is laid out once per
 *   call as float32 in that order (the even k of a block, then the odd k) and fed to FMAs;
 *   on avx2, from WIDE_ROWS rows of x on, each group is widened to float32 once instead
 *   (wide_group: the shifts and masks of every block would take the FMAs' ports);
 * - portable: plain C on x as float32 that the compiler vectorizes for any target.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define R 4 /* weight rows (outputs) a group */
#define AHEAD 16384 /* bytes: how far ahead of the weights being read to ask for more */
/* (measured at one row of x: 4 KiB 77%, 16 KiB 81-85%, 32 KiB 68% of the probe) */

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
#define MW 3 /* rows of x a block on widened weights: 12 accumulators, 3 x, 1 w of 16 */
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

/* Stores acc's sums for rows [m0, m0 + mb) and outputs [n0, n0 + rows) of y (row stride N). */
static inline void store_sums(const float sums[R][MB], const bf16 *bias, int64_t m0, int mb,
                              int64_t n0, int rows, bf16 *y, int64_t N) {
    for (int m = 0; m < mb; m++)
        for (int r = 0; r < rows; r++)
            y[(m0 + m) * N + n0 + r] =
                f32_to_bf16(sums[r][m] + (bias == NULL ? 0.0f : bf16_to_f32(bias[n0 + r])));
}

#if XF32
/* x (M, K; row stride xs) -> xf (M, K) float32: in order when `natural` (for widened weights),
 * else each block of 2 * VW k as its VW even k then its VW odd k (the order w_even / w_odd give
 * the weights in). */
static void spread_x(const bf16 *x, int64_t xs, int64_t M, int64_t K, float *xf, int natural) {
#pragma omp for
    for (int64_t m = 0; m < M; m++)
        if (natural)
            for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(x[m * xs + k]);
        else
            for (int64_t k = 0; k < K; k += 2 * VW)
                for (int i = 0; i < VW; i++) {
                    xf[m * K + k + i] = bf16_to_f32(x[m * xs + k + 2 * i]);
                    xf[m * K + k + VW + i] = bf16_to_f32(x[m * xs + k + 2 * i + 1]);
                }
}
#endif

/* Asks for the bytes [at, at + 64 * R) (one k step of a group's weight rows), into L2: the
 * L1 hint was slower (measured: 75% -> 85% of the read probe's bandwidth at one row). */
static inline void prefetch_step(const char *at) {
    if (at == NULL) return;
    for (int r = 0; r < R; r++) __builtin_prefetch(at + 64 * r, 0, 1);
}

/* One block: weight rows w[r] (r < R, each K long) against x rows m0.. m0 + mb, sums into
 * sums[r][m]. `mb` is a constant at each call site, so the loops unroll. ahead: NULL, or
 * where to ask for the weights that come AHEAD bytes after this group's (a thread's groups
 * lie back to back, so its weights are one stream; the rows of a group are R short streams
 * that the hardware prefetcher would only pick up once each was half read). */
__attribute__((always_inline)) static inline void block(const bf16 *const w[R], const void *xv,
                                                        int64_t xstride, int64_t m0, int mb,
                                                        int64_t K, float sums[R][MB],
                                                        const char *ahead) {
#if defined(__AVX512BF16__)
    const bf16 *x = (const bf16 *)xv;
    __m512 acc[R][MB];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        prefetch_step(ahead == NULL ? NULL : ahead + k * 2 * R);
        __m512bh wv[R];
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
        for (int m = 0; m < mb; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * xstride + k);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
#elif !defined(PORTABLE)
    const float *x = (const float *)xv;
    vec acc[R][MB];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = vzero();
    for (int64_t k = 0; k < K; k += 2 * VW) {
        if ((k & 31) == 0) prefetch_step(ahead == NULL ? NULL : ahead + k * 2 * R);
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
    (void)ahead;
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

/* The group of outputs [n0, n0 + rows) against all M rows of x. */
static void group(const bf16 *w, const bf16 *bias, const void *x, int64_t xstride, int64_t M,
                  int64_t N, int64_t K, int64_t n0, bf16 *y) {
    int rows = N - n0 < R ? (int)(N - n0) : R;
    const bf16 *wr[R]; /* past the last row: that row again, computed and not stored */
    for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < rows ? r : rows - 1)) * K;
    float sums[R][MB] = {{0}}; /* rows past a short block: never stored */
    const char *ahead = (const char *)(w + n0 * K) + AHEAD; /* on the first pass only */
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB, ahead = NULL) {
        block(wr, x, xstride, m0, MB, K, sums, ahead);
        store_sums(sums, bias, m0, MB, n0, rows, y, N);
    }
    for (; m0 < M; m0++, ahead = NULL) {
        block(wr, x, xstride, m0, 1, K, sums, ahead);
        store_sums(sums, bias, m0, 1, n0, rows, y, N);
    }
}

#if defined(MW)
/* avx2, from WIDE_ROWS rows of x on: converting each weight vector again for every block of
 * x rows costs more than the FMAs it feeds (measured on Zen 3: ~62 GFLOP/s on 2 cores at 32
 * rows, ~85 this way), so a group's weights are widened to float32 once, KC k at a time, into
 * L1, and blocks of MW rows of x (in order) run plain FMAs on them: R x MW accumulators, one
 * FMA each a step, the weight a memory operand. Below WIDE_ROWS the widening costs more than
 * it saves. */
#define WIDE_ROWS 16
#define KC 1024 /* R x KC float32: 16 KiB */
#define KS (KC + 16) /* their stride: rows 4 KiB apart would share L1 sets */

/* Widened rows wf[r] (r < R, KS floats apart) against x rows m0.. m0 + mb over kc k (x already
 * at the chunk's first k, row stride xstride): adds the sums to sums[r * M + m]. */
__attribute__((always_inline)) static inline void wide_block(const float *wf, int64_t kc,
                                                             const float *x, int64_t xstride,
                                                             int64_t m0, int mb, float *sums,
                                                             int64_t M) {
    vec acc[R][MW];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = vzero();
    for (int64_t k = 0; k < kc; k += VW) {
        vec xv[MW];
        for (int m = 0; m < mb; m++) xv[m] = vload(x + (m0 + m) * xstride + k);
        for (int r = 0; r < R; r++) {
            vec wv = vload(wf + r * KS + k);
            for (int m = 0; m < mb; m++) acc[r][m] = vfma(xv[m], wv, acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mb; m++) sums[r * M + m0 + m] += vsum(acc[r][m]);
}

/* group() on widened weights; x (M, K) float32 in order. */
static void wide_group(const bf16 *w, const bf16 *bias, const float *x, int64_t M, int64_t N,
                       int64_t K, int64_t n0, bf16 *y) {
    int rows = N - n0 < R ? (int)(N - n0) : R;
    const bf16 *wr[R];
    for (int r = 0; r < R; r++) wr[r] = w + (n0 + (r < rows ? r : rows - 1)) * K;
    float wf[R * KS] __attribute__((aligned(64)));
    float sums[R * M];
    for (int64_t i = 0; i < R * M; i++) sums[i] = 0.0f;
    const char *ahead = (const char *)(w + n0 * K) + AHEAD; /* the group's rows lie in a row */
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int r = 0; r < R; r++)
            for (int64_t k = 0; k < kc; k += VW) {
                if (k % 32 == 0) __builtin_prefetch(ahead + (r * K + k0 + k) * 2, 0, 1);
                vstore(wf + r * KS + k, widen(wr[r] + k0 + k));
            }
        int64_t m0 = 0;
        for (; m0 + MW <= M; m0 += MW) wide_block(wf, kc, x + k0, K, m0, MW, sums, M);
        for (; m0 + 2 <= M; m0 += 2) wide_block(wf, kc, x + k0, K, m0, 2, sums, M);
        if (m0 < M) wide_block(wf, kc, x + k0, K, m0, 1, sums, M);
    }
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < rows; r++)
            y[m * N + n0 + r] = f32_to_bf16(
                sums[r * M + m] + (bias == NULL ? 0.0f : bf16_to_f32(bias[n0 + r])));
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

/* Bytes of scratch vec_linear_team needs for x of M rows of K. */
int64_t vec_linear_scratch(int64_t M, int64_t K) { return XF32 ? M * K * 4 : 0; }

/* y (M, N) contiguous = x (M, K; row stride xs) w^T + bias (N,) or NULL, w (N, K) contiguous,
 * K % 32 == 0; scratch: vec_linear_scratch(M, K) bytes shared by the team. A team kernel
 * (kernels.h): the team lays out x, then shares out the groups. */
void vec_linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                     int64_t N, int64_t K, bf16 *y, void *scratch) {
    int wide = WIDE(M);
#if XF32
    spread_x(x, xs, M, K, (float *)scratch, wide);
    const void *xv = scratch;
    int64_t xstride = K;
#else
    (void)scratch;
    const void *xv = x;
    int64_t xstride = xs;
#endif
    int64_t groups = (N + R - 1) / R, previous = -2;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (g != previous + 1) { /* a thread's first group: ask for the AHEAD bytes from here */
            const char *from = (const char *)(w + g * R * K), *end = (const char *)(w + N * K);
            for (const char *p = from; p < from + AHEAD && p < end; p += 64)
                __builtin_prefetch(p, 0, 1);
        }
        previous = g;
#if defined(MW)
        if (wide) {
            wide_group(w, bias, (const float *)xv, M, N, K, g * R, y);
            continue;
        }
#endif
        group(w, bias, xv, xstride, M, N, K, g * R, y);
    }
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
#if XF32
    spread_x(x, K, start[E], K, (float *)scratch, wide);
    const float *xv = (const float *)scratch;
#else
    (void)scratch;
    const bf16 *xv = x;
#endif
    int64_t groups = (N + R - 1) / R;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < count * groups; g++) {
        int64_t e = active[g / groups], first = start[e];
#if defined(MW)
        if (wide) {
            wide_group(w + e * w_stride, NULL, xv + first * K, start[e + 1] - first, N, K,
                       g % groups * R, y + first * N);
            continue;
        }
#endif
        group(w + e * w_stride, NULL, xv + first * K, K, start[e + 1] - first, N, K,
              g % groups * R, y + first * N);
    }
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
