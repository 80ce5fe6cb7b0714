/* What the kernel files share: the bfloat16 type, decode attention's work split, and the
 * bfloat16 team kernels (rms_norm.c, rope.c, kv_write.c, attention.c, silu_mul.c,
 * linear_bf16.c, moe.c) that decode_layer.c runs in one parallel region. A team kernel splits its
 * loops over the enclosing region's threads (orphaned `omp for`s, each ending at a barrier),
 * or runs alone outside a region. */
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

/* Decode attention's split for n rows on `team` threads: KV heads per task (all of a row's
 * when there are rows enough to keep the team busy, else one). */
static inline int64_t attention_heads_per_task(int64_t n, int64_t nkv, int team) {
    return n >= 4 * team ? nkv : 1;
}

/* Floats of decode-attention scratch per thread, for tasks of `task_heads` query heads: scores
 * (task_heads, max_ctx), scaled q and acc (task_heads, hd), a key (hd), softmax sums. */
static inline int64_t attention_scratch(int64_t task_heads, int64_t max_ctx, int64_t hd) {
    return task_heads * (max_ctx + 2 * hd + 1) + hd;
}

static inline int64_t max_context(const int32_t *context_lens, int64_t n) {
    int64_t top = 0;
    for (int64_t b = 0; b < n; b++) top = context_lens[b] > top ? context_lens[b] : top;
    return top;
}

void rms_norm_team_bf16(const bf16 *x, int64_t x_stride, bf16 *out, int64_t out_stride,
                        bf16 *residual, const bf16 *weight, int64_t n, int64_t heads,
                        int64_t dim, float eps);
void rope_team_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, int64_t n,
                    int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions,
                    const bf16 *cos, const bf16 *sin, bf16 *q_out, bf16 *k_out);
void silu_mul_team_bf16(const bf16 *x, bf16 *out, int64_t n, int64_t d);
void kv_write_team_bf16(const bf16 *k, int64_t k_stride, const bf16 *v, int64_t v_stride,
                        const int64_t *slots, int64_t n_new, bf16 *k_pool, bf16 *v_pool,
                        int64_t nkv, int64_t hd);
void decode_attention_team_bf16(const bf16 *q, int64_t q_stride, const int64_t *q_rows,
                                const bf16 *k_pool, const bf16 *v_pool,
                                const int32_t *block_table, int64_t table_stride,
                                const int32_t *context_lens, int64_t n, int64_t nh, int64_t nkv,
                                int64_t hd, int64_t page_size, int64_t window, float scale,
                                bf16 *out, int64_t heads_per_task, float *scratch);
/* moe.c: a decode step's routed experts. Its scratch, for n rows, E experts, top k, hidden H,
 * expert intermediate I: logits (n, E); ids, weights, pos (n * k); start (E + 1), fill (E);
 * token (n * k); rows, h (n * k, H); gate_up (n * k, 2I); act (n * k, I). */
typedef struct {
    bf16 *logits, *rows, *gate_up, *act, *h;
    int64_t *ids, *pos, *start, *fill, *token;
    float *weights;
} moe_scratch;
void moe_team_bf16(const bf16 *x, const bf16 *router, const bf16 *w13, const bf16 *w2,
                   int64_t n, int64_t H, int64_t I, int64_t E, int64_t k, int renormalize,
                   bf16 *out, const moe_scratch *M, void *xp);
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
