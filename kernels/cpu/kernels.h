/* What the kernel files share: the bfloat16 type, decode attention's work split, and the
 * bfloat16 team kernels (rms_norm.c, rope.c, kv_write.c, attention.c, silu_mul.c,
 * linear_bf16.c, moe.c, all_reduce.c, argmax.c) that decode_layer.c runs in one parallel
 * region. A team kernel splits its loops over the enclosing region's threads (orphaned `omp
 * for`s, each ending at a barrier), or runs alone outside a region. */
#ifndef TISON_KERNELS_H
#define TISON_KERNELS_H
#include <stdint.h>
#include <string.h>

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

#define MIN_SPAN_PAGES 2 /* decode attention: the fewest pages a cut context's span holds */
/* decode attention: tasks a thread, about, when rows are cut. 1 (a batch-1 row in one span a
 * thread): on the Zen 3 (avx2, 2 threads) a batch-1 call took 0.89-0.95x the time of 2 a
 * thread at 256-2048 positions, each task start waiting for its first page. */
#define SPAN_TASKS 1

/* Positions decode attention attends to in row b: the last `window` when window > 0. */
static inline int64_t attended(const int32_t *context_lens, int64_t b, int64_t window) {
    return window > 0 && context_lens[b] > window ? window : context_lens[b];
}

static inline int64_t max_attended(const int32_t *context_lens, int64_t n, int64_t window) {
    int64_t top = 0;
    for (int64_t b = 0; b < n; b++)
        top = attended(context_lens, b, window) > top ? attended(context_lens, b, window) : top;
    return top;
}

/* Decode attention: (key, kv head) pairs below it, 1 thread. Measured (Zen 3, 2 threads, 4 KV
 * heads): at 1024, a batch-1 step's attention ran on one thread up to 256 positions, ~20 us a
 * layer; at 128 the fused batch-1 MoE step took 2.5-3% less, the call alone 16.3 -> 13.6 us at
 * 128 positions (and 16.9 -> 21.0 at 2 rows of 64, op by op). */
#define PARALLEL_MIN_KEYS 128

/* Threads decode attention of n rows runs on, of `threads`: one for too little work. */
static inline int attention_team(const int32_t *context_lens, int64_t n, int64_t nkv,
                                 int threads) {
    int64_t keys = 0;
    for (int64_t b = 0; b < n; b++) keys += context_lens[b];
    return keys * nkv >= PARALLEL_MIN_KEYS ? threads : 1;
}

/* Decode attention's split of n rows on `threads` threads: a task is a span of this many
 * positions of one row, all its KV heads, so a page is read whole and once. A span is a whole
 * row when one thread runs (attention_team) or there are rows enough to keep the team busy
 * (SPAN_TASKS a thread); else the rows are cut in spans of whole pages, about SPAN_TASKS tasks
 * a thread (flash decoding), whose partial softmaxes are merged after. A row of few KV heads
 * (one per rank under TP) thus still spreads over the team. The fused decoder, whose team is
 * always `threads`, cuts as the op-by-op call does, so both give the same bits. */
static inline int64_t attention_span(const int32_t *context_lens, int64_t n, int64_t nkv,
                                     int64_t window, int64_t page_size, int threads) {
    int64_t max_len = max_attended(context_lens, n, window);
    int team = attention_team(context_lens, n, nkv, threads);
    if (team == 1 || n >= SPAN_TASKS * team || max_len == 0) return max_len;
    int64_t pages = (max_len + page_size - 1) / page_size, cuts = (SPAN_TASKS * team + n - 1) / n;
    int64_t span = (pages + cuts - 1) / cuts;
    span = (span < MIN_SPAN_PAGES ? MIN_SPAN_PAGES : span) * page_size;
    return span < max_len ? span : max_len;
}

/* The row stride of decode attention's scores (nh, span): span rounded up to a whole number
 * of cache lines, plus one line, so that the heads' rows fall in different L1 sets (at 1024
 * or 2048 positions, rows 4 or 8 KiB apart all fell in one set, and the 8-way L1 lost them to
 * each other and to the keys on every step). */
static inline int64_t score_stride(int64_t span) { return (span + 15) / 16 * 16 + 16; }

/* Floats of decode-attention scratch per thread, for spans of `span` positions and nh query
 * heads: scores (nh, score_stride(span)), scaled q and acc (nh, hd), a key (hd), softmax
 * maxima and sums. */
static inline int64_t attention_thread_scratch(int64_t nh, int64_t span, int64_t hd) {
    return nh * (score_stride(span) + 2 * hd + 2) + hd;
}

/* Floats of decode-attention scratch for a team: each thread's, then the cut rows' partial
 * results (n rows, their spans, nh heads: acc (hd), maximum, sum), none when no row is cut. */
static inline int64_t attention_scratch(int team, int64_t n, int64_t nh, int64_t hd,
                                        int64_t max_len, int64_t span) {
    int64_t spans = span == 0 ? 1 : (max_len + span - 1) / span;
    return team * attention_thread_scratch(nh, span, hd) +
           (spans > 1 ? n * spans * nh * (hd + 2) : 0);
}

void rms_norm_team_bf16(const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
                        bf16 *residual, const bf16 *weight, int64_t n, int64_t heads,
                        int64_t dim, float eps);
void rope_team_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, int64_t n,
                    int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions,
                    const bf16 *cos, const bf16 *sin, bf16 *q_out, bf16 *k_out);
void rope_pairs_team_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride,
                          int64_t n, int64_t nh, int64_t nkv, int64_t hd, const float *cs,
                          bf16 *q_out, bf16 *k_out);
void silu_mul_team_bf16(const bf16 *x, bf16 *out, int64_t n, int64_t d);
void argmax_team_bf16(const bf16 *x, int64_t xs, int64_t n, int64_t d, int64_t *out);
void kv_write_team_bf16(const bf16 *k, int64_t k_stride, const bf16 *v, int64_t v_stride,
                        const int64_t *slots, int64_t n_new, bf16 *k_pool, bf16 *v_pool,
                        int64_t nkv, int64_t hd);
void decode_attention_team_bf16(const bf16 *q, int64_t q_stride, const int64_t *q_rows,
                                const bf16 *k_pool, const bf16 *v_pool,
                                const int32_t *block_table, int64_t table_stride,
                                const int32_t *context_lens, int64_t n, int64_t nh, int64_t nkv,
                                int64_t hd, int64_t page_size, int64_t window, float scale,
                                bf16 *out, int64_t span, float *scratch);
/* moe.c: a decode step's routed experts. Its scratch, for n rows, E experts, top k, hidden H,
 * expert intermediate I: logits (n, E); ids, weights, pos (n * k); start (E + 1), fill (E);
 * rows, h (n * k, H); gate_up (n * k, 2I); act (n * k, I). */
typedef struct {
    bf16 *logits, *rows, *gate_up, *act, *h;
    int64_t *ids, *pos, *start, *fill;
    float *weights;
} moe_scratch;
#define ROUTE_SOFTMAX 0 /* softmax top-k, each expert's output weighted (renormalised or not) */
#define ROUTE_SIGMOID 1 /* sigmoid of the top-k logits, weighting the expert's input (Llama 4) */
void moe_team_bf16(const bf16 *x, const bf16 *router, const bf16 *w13, const bf16 *w2,
                   int64_t n, int64_t H, int64_t I, int64_t E, int64_t k, int scoring,
                   int renormalize, bf16 *out, const moe_scratch *M, void *xp);
/* all_reduce.c: the all-reduce of a tensor-parallel group of same-host ranks through shared
 * memory, filled by shared/parallel/shm_group.py (its mapping, its step protocol): `size`
 * ranks' step counters and flags, a line of `line` int64s each, and their pids; two sets
 * (alternate steps) of `size` slots of slot_bytes; `step` the last step this rank published;
 * the signals of _shm_sync.c through pointers (post, wait); `error`: the failed step's status
 * (wait's: -1 - r, rank r's process gone; -1 - size, timed out; or -2 - size, a peer's part
 * went to its process group), else 0. all_reduce_team: x summed over the ranks in place (0,
 * or the status, on every team thread alike). */
typedef struct {
    int64_t *lines;
    const int64_t *pids;
    uint8_t *slots;
    int64_t line, slot_bytes, rank, size, step, error;
    double timeout_s;
    void (*post)(int64_t *counter, int64_t step);
    int64_t (*wait)(const int64_t *counters, int64_t stride, const int64_t *pids, int64_t size,
                    int64_t step, double timeout_s);
} shm_reduce;
int64_t all_reduce_team_bf16(shm_reduce *G, bf16 *x, int64_t count);
/* linear_bf16.c: y (M, N) = x (M, K; row stride xs) w (N, K)^T + bias, on AMX tiles where
 * the build has them, else on the vector units; scratch: linear_scratch(M, K), the calling
 * thread's, shared by the team. linear_team_done: each team thread once its linears are done. */
void *linear_scratch(int64_t M, int64_t K);
void linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                 int64_t N, int64_t K, bf16 *y, void *scratch);
void linear_team_done(void);
void experts_linear_team(const bf16 *x, const int64_t *start, int64_t E, const bf16 *w,
                         int64_t w_stride, int64_t N, int64_t K, bf16 *y, void *scratch);
#if (defined(__AMX_TILE__) && defined(__AMX_BF16__) || defined(TISON_AMX_EMULATED)) && \
    defined(__AVX512BF16__)
#define AMX_BUILD 1 /* the amx tier: amx_linear.c is compiled, linear_team runs on tiles */
#else
#define AMX_BUILD 0
#endif
#if AMX_BUILD
int amx_request(void);
void amx_release(void);
void amx_linear_team(const bf16 *x, int64_t xs, const bf16 *w, const bf16 *bias, int64_t M,
                     int64_t N, int64_t K, bf16 *y, bf16 *xp);
#endif
#endif
