/* The decoder layers of a decode step (one new token per sequence), Llama family (MLPs dense
 * or routed experts, moe.c), bfloat16, in one call and one OpenMP parallel region: the team
 * runs each layer's kernels one after the other (see kernels.h), meeting at a barrier after
 * each. Op by op, every op pays a Python module call, a ctypes call, a tensor allocation and
 * a thread-team wake-up, and the Python between them runs on caches that the weights stream
 * has just flushed: ~250 us a layer here, a quarter of a batch-32 step. The kernels are the
 * ones the op-by-op path runs, in the same order, so the output is the same bit for bit (the
 * routing weights of moe.c to an ulp). The linears are linear_bf16.c's:
 * AMX tiles or the vector units, whichever the build's tier has.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* One layer's weights and shapes, filled once (decode_layer.py). Pointers to bf16 tensors;
 * qkv_bias, q_norm and k_norm may be NULL. Its MLP: dense (gate_up, down), or with router set
 * routed experts (moe.c; gate_up and down NULL), `intermediate` then each expert's. */
typedef struct {
    const bf16 *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    const bf16 *cos, *sin; /* rotary tables (max_positions, hd) */
    const bf16 *router, *w13, *w2; /* (E, H), (E, 2I, H), (E, H, I), or NULL */
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    int64_t experts, top_k, renormalize; /* softmax top-k routing; renormalize: 0 or 1 */
    float eps, qk_eps, scale;
} decode_layer;

static __thread bf16 *workspace; /* the caller's intermediate activations, grown, kept */
static __thread size_t workspace_elems;

static bf16 *grow_workspace(size_t elems) {
    if (elems > workspace_elems) {
        free(workspace);
        workspace = aligned_alloc(64, (elems * sizeof(bf16) + 63) / 64 * 64);
        workspace_elems = workspace == NULL ? 0 : elems;
    }
    return workspace;
}

/* One step's shapes and the team's scratch, shared by every layer of the call. */
typedef struct {
    int64_t n, table_stride, page_size, window, span; /* span: attention_span's */
    const int64_t *positions, *slots;
    const int32_t *block_table, *context_lens;
    bf16 *xn, *qkv, *q, *k, *attn, *o, *gate_up, *act;
    void *xp; /* linear_scratch */
    float *scores;
    moe_scratch moe;
} step_args;

/* Inside the region: layer L on x (n, H) -> out (n, H); residual as the op-by-op layer keeps
 * it (first: residual is x and is only normalised; later: residual += x first). */
static void layer_team(const decode_layer *L, const step_args *S, const bf16 *x, bf16 *residual,
                       int first, bf16 *out, bf16 *k_pool, bf16 *v_pool) {
    int64_t n = S->n, H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t F = L->intermediate, q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    bf16 *qkv = S->qkv;
    rms_norm_team_bf16(x, H, S->xn, H, first ? NULL : residual, L->input_norm, n, 1, H, L->eps);
    linear_team(S->xn, H, L->qkv, L->qkv_bias, n, qkv_size, H, qkv, S->xp);
    if (L->q_norm != NULL) { /* Qwen3: per-head norms of q and k, in place */
        rms_norm_team_bf16(qkv, qkv_size, qkv, qkv_size, NULL, L->q_norm, n, nh, hd, L->qk_eps);
        rms_norm_team_bf16(qkv + q_size, qkv_size, qkv + q_size, qkv_size, NULL, L->k_norm, n,
                           nkv, hd, L->qk_eps);
    }
    rope_team_bf16(qkv, qkv_size, qkv + q_size, qkv_size, n, nh, nkv, hd, S->positions, L->cos,
                   L->sin, S->q, S->k);
    kv_write_team_bf16(S->k, nkv * hd, qkv + q_size + nkv * hd, qkv_size, S->slots, n, k_pool,
                       v_pool, nkv, hd);
    decode_attention_team_bf16(S->q, q_size, NULL, k_pool, v_pool, S->block_table,
                               S->table_stride, S->context_lens, n, nh, nkv, hd, S->page_size,
                               S->window, L->scale, S->attn, S->span, S->scores);
    linear_team(S->attn, q_size, L->o, NULL, n, H, q_size, S->o, S->xp);
    rms_norm_team_bf16(S->o, H, S->xn, H, residual, L->post_norm, n, 1, H, L->eps);
    if (L->router != NULL) {
        moe_team_bf16(S->xn, L->router, L->w13, L->w2, n, H, F, L->experts, L->top_k,
                      (int)L->renormalize, out, &S->moe, S->xp);
        return;
    }
    linear_team(S->xn, H, L->gate_up, NULL, n, 2 * F, H, S->gate_up, S->xp);
    silu_mul_team_bf16(S->gate_up, S->act, n, F);
    linear_team(S->act, F, L->down, NULL, n, H, F, out, S->xp);
}

/* The MoE layers' scratch for n rows (moe.c's layout, sized for the widest of them) in one
 * block, into M; NULL when no layer routes, or when it cannot be allocated (*failed). */
static void *moe_alloc(const decode_layer *layers, int64_t count, int64_t n, moe_scratch *M,
                       int *failed) {
    int64_t E = 0, k = 0, kI = 0, H = layers->hidden;
    for (int64_t i = 0; i < count; i++) {
        const decode_layer *L = &layers[i];
        if (L->router == NULL) continue;
        E = L->experts > E ? L->experts : E, k = L->top_k > k ? L->top_k : k;
        kI = L->top_k * L->intermediate > kI ? L->top_k * L->intermediate : kI;
    }
    *failed = 0;
    if (E == 0) return NULL;
    size_t bf16s = (size_t)(n * E + n * k * 2 * H + n * 3 * kI);
    size_t ints = (size_t)(3 * n * k + 2 * E + 1), bytes = bf16s * 2 + ints * 8 + n * k * 4;
    char *block = malloc(bytes);
    if (block == NULL) {
        *failed = 1;
        return NULL;
    }
    M->ids = (int64_t *)block, M->pos = M->ids + n * k, M->token = M->pos + n * k;
    M->start = M->token + n * k, M->fill = M->start + E + 1;
    M->weights = (float *)(M->fill + E);
    M->logits = (bf16 *)(M->weights + n * k), M->rows = M->logits + n * E;
    M->h = M->rows + n * k * H, M->gate_up = M->h + n * k * H, M->act = M->gate_up + 2 * n * kI;
    return block;
}

/* `count` layers (same attention shapes) of a decode step: x (n, hidden) -> out (n, hidden), which is
 * the last layer's output; residual (n, hidden) updated as the op-by-op layers do (first !=
 * 0: it is x itself, the first layer's input). Layer i's K and V pools (P*S, nkv, hd) are at
 * pool + i * layer_stride and that + kv_stride elements; new K/V go to slots[t]; row t
 * attends to the pages block_table[t] (row stride table_stride), context_lens[t] keys (the
 * last `window` when window > 0), pages of page_size tokens. out must not be x. Returns 0,
 * or -1 when scratch memory cannot be allocated. */
int tk_decode_layers_bf16(const decode_layer *layers, int64_t count, const bf16 *x,
                          bf16 *residual, int first, bf16 *out, int64_t n,
                          const int64_t *positions, const int64_t *slots, bf16 *pool,
                          int64_t layer_stride, int64_t kv_stride, const int32_t *block_table,
                          int64_t table_stride, const int32_t *context_lens, int64_t page_size,
                          int64_t window, int threads) {
    const decode_layer *L = layers;
    int64_t H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t F = 0, q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    int64_t k = 1; /* the most rows a linear takes: n, or n * top_k (moe.c's experts) */
    for (int64_t i = 0; i < count; i++) { /* the widest intermediate: dense or an expert's */
        F = layers[i].intermediate > F ? layers[i].intermediate : F;
        k = layers[i].router != NULL && layers[i].top_k > k ? layers[i].top_k : k;
    }
    /* per row: xn, o, a spare output (H each); qkv; q, attn; k; gate_up (2F); act (F) */
    size_t per_row = (size_t)(3 * H + qkv_size + 2 * q_size + nkv * hd + 3 * F);
    bf16 *xn = grow_workspace(per_row * n);
    int64_t widest = H > q_size ? H : q_size;
    int64_t max_len = max_attended(context_lens, n, window);
    int64_t span = attention_span(context_lens, n, nkv, window, page_size, threads);
    step_args S = {.n = n, .table_stride = table_stride, .page_size = page_size,
                   .window = window, .span = span,
                   .positions = positions, .slots = slots, .block_table = block_table,
                   .context_lens = context_lens};
    S.xp = linear_scratch(n * k, widest > F ? widest : F);
    S.scores = malloc(sizeof(float) * attention_scratch(threads, n, nh, hd, max_len, S.span));
    int moe_failed;
    void *moe_block = moe_alloc(layers, count, n, &S.moe, &moe_failed);
    if (xn == NULL || S.xp == NULL || S.scores == NULL || moe_failed) {
        free(S.scores);
        return -1;
    }
    S.xn = xn, S.o = xn + n * H, S.qkv = S.o + n * H, S.q = S.qkv + n * qkv_size;
    S.k = S.q + n * q_size, S.attn = S.k + n * nkv * hd, S.gate_up = S.attn + n * q_size;
    S.act = S.gate_up + n * 2 * F;
    bf16 *spare = S.act + n * F;
#pragma omp parallel num_threads(threads)
    {
        /* outputs alternate between out and spare so that the last one lands in out */
        const bf16 *in = x;
        for (int64_t i = 0; i < count; i++) {
            bf16 *to = (count - 1 - i) % 2 == 0 ? out : spare;
            bf16 *k_pool = pool + i * layer_stride;
            layer_team(&layers[i], &S, in, residual, first && i == 0, to, k_pool,
                       k_pool + kv_stride);
            in = to;
        }
        linear_team_done();
    }
    free(S.scores);
    free(moe_block);
    return 0;
}
