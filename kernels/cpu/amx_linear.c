/* bfloat16 linear layers on Intel AMX: y (M, N) = x (M, K) w (N, K)^T (+ bias), float32 sums,
 * for the few rows of a decode step, where oneDNN's kernels read the weights at two thirds of
 * the memory bandwidth. The weight stays in its plain row-major layout (one copy, which the
 * embedding can share when tied): its 16-row x 32-column blocks are the A tiles, loaded with
 * the row stride; x, packed per call into VNNI pairs, gives the B tiles; each C tile is
 * (16 outputs n, 16 rows m), transposed on the way out. A thread owns whole 32-output groups
 * and streams their rows once, for up to 32 rows of x at a time.
 *
 * Built only where the compiler targets AMX-BF16 (isa.py's amx tier), or for the tests with
 * the tiles emulated (amx_emulated.h); linear_bf16.c calls it there and its vector kernels
 * elsewhere.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if AMX_BUILD
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(TISON_AMX_EMULATED)
#include "amx_emulated.h" /* tests only: the tiles in plain C */
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use the AMX tiles (Linux grants them on request, once). */
int amx_request(void) {
#if defined(TISON_AMX_EMULATED)
    return 1; /* the tiles are this thread's memory */
#else
    uint64_t features = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &features) != 0) return 0;
    return (features >> XFEATURE_XTILEDATA) & 1;
#endif
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0 holds A (16 weight rows x 32 k), 1 and 2 B (32 k of 16 rows of x, as 16 k-pairs
 * of `width` rows), 3..6 the sums C: 3/4 the first 16 outputs of a group for B 1/2, 5/6 the
 * next 16. */
static void configure(int64_t width) {
    tile_config cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 64;
    for (int t = 1; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(width * 4);
    _tile_loadconfig(&cfg);
}

/* Tile (block b, step s) of x packed: x (M, K), row stride xs -> xp (ceil(M/16) blocks, K/32
 * steps, 16 pairs, width rows, 2), each step of a block one B tile, rows past M zero.
 * width = min(M, 16). */
static void pack_tile(const bf16 *x, int64_t xs, int64_t M, int64_t K, int64_t width, int64_t b,
                      int64_t s, bf16 *xp) {
    uint32_t *tile = (uint32_t *)(xp + (b * (K / 32) + s) * 32 * width);
    for (int64_t m = 0; m < width; m++) {
        int64_t row = b * 16 + m;
        const uint32_t *pairs = (const uint32_t *)(x + row * xs + s * 32);
        for (int64_t r = 0; r < 16; r++) tile[r * width + m] = row < M ? pairs[r] : 0;
    }
}

/* C tile c (16 outputs, 16 rows; row stride 16 floats) -> `rows` rows of y (row stride ys)
 * at 16 consecutive outputs, plus their bias, rounded to bf16 (nearest even). */
static inline void store_c(const float *c, const bf16 *bias, int64_t rows, bf16 *y, int64_t ys) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                             192, 208, 224, 240);
    __m512 b = _mm512_setzero_ps();
    if (bias != NULL) {
        __m256i h = _mm256_loadu_si256((const __m256i *)bias);
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    for (int64_t m = 0; m < rows; m++) {
        __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + m, 4), b);
        _mm256_storeu_si256((__m256i *)(y + m * ys), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

#define AHEAD 8 /* steps: measured best of 2-16 */

/* Asks for the 32 weight rows' 64 bytes that step s of a group will load, where s past the
 * group's last step means the next group (the 32 rows after: a thread's groups are
 * consecutive). The multiplies of a step hold back the next tile loads (the tile unit works
 * in order), so a core's stream has gaps that these requests fill, the more so the more rows
 * x has: at 32 rows one core streams ~12.4 -> ~14.2 GB/s with both cores busy, and a 32-row
 * decode step of the 150M model takes 18.7 -> 15.9 ms. A request past the weight's end
 * faults nothing. */
static inline void prefetch_step(const bf16 *w0, const bf16 *w1, int64_t K, int64_t steps,
                                 int64_t s) {
    if (s >= steps) s -= steps, w0 += 32 * K, w1 += 32 * K;
    for (int r = 0; r < 16; r++) {
        _mm_prefetch((const char *)(w0 + r * K + s * 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + r * K + s * 32), _MM_HINT_T0);
    }
}

/* Outputs [n0, n0 + 16 * outs) (outs 1 or 2) for the rows of B block `block` and, when
 * `pair`, the next block too; `ahead`: prefetch (this is the group's last pass). */
static void group(const bf16 *w, const bf16 *bias, const bf16 *xp, int64_t block, int pair,
                  int ahead, int64_t n0, int outs, int64_t M, int64_t N, int64_t K,
                  int64_t width, bf16 *y) {
    int64_t steps = K / 32, block_size = steps * 32 * width;
    /* with one output block left, tiles 5/6 repeat tiles 3/4 and are not stored */
    const bf16 *w0 = w + n0 * K, *w1 = outs == 2 ? w0 + 16 * K : w0;
    const bf16 *xa = xp + block * block_size, *xb = xa + block_size;
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    if (pair)
        for (int64_t s = 0; s < steps; s++) {
            if (ahead) prefetch_step(w0, w1, K, steps, s + AHEAD);
            _tile_loadd(1, xa + s * 32 * width, width * 4);
            _tile_loadd(2, xb + s * 32 * width, width * 4);
            _tile_loadd(0, w0 + s * 32, K * 2);
            _tile_dpbf16ps(3, 0, 1);
            _tile_dpbf16ps(4, 0, 2);
            _tile_loadd(0, w1 + s * 32, K * 2);
            _tile_dpbf16ps(5, 0, 1);
            _tile_dpbf16ps(6, 0, 2);
        }
    else
        for (int64_t s = 0; s < steps; s++) {
            if (ahead) prefetch_step(w0, w1, K, steps, s + AHEAD);
            _tile_loadd(1, xa + s * 32 * width, width * 4);
            _tile_loadd(0, w0 + s * 32, K * 2);
            _tile_dpbf16ps(3, 0, 1);
            _tile_loadd(0, w1 + s * 32, K * 2);
            _tile_dpbf16ps(5, 0, 1);
        }
    float c[16 * 16];
    int64_t m0 = block * 16, rows = M - m0 < 16 ? M - m0 : 16;
    bf16 *out = y + m0 * N + n0;
    const bf16 *b0 = bias == NULL ? NULL : bias + n0, *b1 = bias == NULL ? NULL : b0 + 16;
    _tile_stored(3, c, 64);
    store_c(c, b0, rows, out, N);
    if (outs == 2) {
        _tile_stored(5, c, 64);
        store_c(c, b1, rows, out + 16, N);
    }
    if (!pair) return;
    rows = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
    out += 16 * N;
    _tile_stored(4, c, 64);
    store_c(c, b0, rows, out, N);
    if (outs == 2) {
        _tile_stored(6, c, 64);
        store_c(c, b1, rows, out + 16, N);
    }
}

/* Outputs [0, N / 16 * 16) of y (M, N) contiguous = x (M, K; row stride xs) w^T + bias (N,)
 * or NULL; w (N, K) contiguous; xp: linear_scratch(M, K), shared by the team. Inside a
 * parallel region the team packs x together, then shares out the output groups (an orphaned
 * `omp for` each; outside a region the caller does all). The last N % 16 outputs are the
 * caller's (linear_bf16.c runs them on the vector units). Leaves the tiles configured: release
 * them once the team is done. Needs K % 32 == 0 (the wrapper checks). */
void amx_linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                     int64_t N, int64_t K, bf16 *y, bf16 *xp) {
    int64_t width = M < 16 ? M : 16, blocks = (M + 15) / 16, steps = K / 32, tiled = N / 16 * 16;
    if (tiled == 0) return; /* every thread sees the same N: none enters the loops below */
#pragma omp for
    for (int64_t t = 0; t < blocks * steps; t++)
        pack_tile(x, xs, M, K, width, t / steps, t % steps, xp);
    configure(width);
    int64_t groups = (tiled / 16 + 1) / 2;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int outs = g * 32 + 16 < tiled ? 2 : 1;
        for (int64_t b = 0; b < blocks; b += 2) /* prefetch on the last pass over the group */
            group(w, bias, xp, b, b + 1 < blocks, b + 2 >= blocks, g * 32, outs, M, N, K,
                  width, y);
    }
}

void amx_release(void) { _tile_release(); }
#endif
