/* The decoder layers of a decode step (one new token per sequence), Llama family (MLPs dense
 * or routed experts, moe.c; Llama 4's interleaved RoPE, NoPE layers, L2-normed q and k, query
 * temperature and shared expert; layers of several attention masks), bfloat16, in one call
 * and one OpenMP parallel region: the team runs each layer's kernels one after the other (see
 * kernels.h), meeting at a barrier after each. Op by op, every op pays a Python module call, a
 * ctypes call, a tensor allocation and a thread-team wake-up, and the Python between them runs
 * on caches that the weights stream has just flushed: ~250 us a layer here, a quarter of a
 * batch-32 step. The kernels are the ones the op-by-op path runs, in the same order, so the
 * output is the same bit for bit (the routing weights of moe.c to an ulp). The linears are
 * linear_bf16.c's: AMX tiles or the vector units, whichever the build's tier has.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define ROPE_NONE 0 /* NoPE: q and k as they are */
#define ROPE_TABLES 1 /* "rotate half", the layer's cos/sin tables */
#define ROPE_PAIRS 2 /* interleaved pairs, the step's cos/sin (rope_pairs_team) */

/* One layer's weights and shapes, filled once (decode_layer.py). Pointers to bf16 tensors;
 * qkv_bias, q_norm, k_norm, cos and sin may be NULL. Its MLP: dense (gate_up, down), or with
 * router set routed experts (moe.c; gate_up and down NULL), `intermediate` then each expert's,
 * beside a shared expert (shared_gate_up, shared_down) or not. */
typedef struct {
    const bf16 *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    const bf16 *cos, *sin; /* rotary tables (max_positions, hd), ROPE_TABLES */
    const bf16 *router, *w13, *w2; /* (E, H), (E, 2I, H), (E, H, I), or NULL */
    const bf16 *shared_gate_up, *shared_down; /* (2S, H), (H, S), or NULL */
    int64_t hidden, heads, kv_heads, head_dim, intermediate, shared_intermediate;
    int64_t experts, top_k, scoring, renormalize; /* routing: ROUTE_*; renormalize: 0 or 1 */
    int64_t mask; /* the step's attention mask this layer reads (step_mask) */
    int64_t rope; /* ROPE_* */
    int64_t norm_after_rope; /* q_norm and k_norm after the rotation (Llama 4), else before */
    int64_t temperature; /* 1: q times the step's temperature of its row (NoPE layers only) */
    float eps, qk_eps, scale;
} decode_layer;

/* One attention mask's view of the step (its layers' pool): row t's new K/V go to slots[t],
 * its keys are context_lens[t] positions of the pages block_table[t] (the last `window` when
 * window > 0; a chunked mask's tables start at the row's chunk). */
typedef struct {
    const int64_t *slots;
    const int32_t *block_table, *context_lens;
    int64_t table_stride, window;
} step_mask;

/* The LM head after the final norm: logits (m, vocab) of the normed rows `rows` (m of them;
 * NULL: all n rows, m = n), as the op-by-op head computes them from those rows gathered, and
 * where tokens is not NULL each row's argmax (argmax.c's, as greedy sampling takes it). */
typedef struct {
    const bf16 *weight; /* (vocab, hidden) */
    int64_t vocab;
    const int64_t *rows;
    int64_t m;
    bf16 *logits;
    int64_t *tokens;
} decode_head;

/* The first layer's input as the embedding rows of the step's tokens: table[ids[t]]. */
typedef struct {
    const bf16 *table; /* (vocab, hidden) */
    int64_t vocab;
    const int64_t *ids; /* (n,) */
} decode_embed;

#define MAX_MASKS 4

/* Where the call's time goes (loadtest/bench_step_overhead.py --ops): in a build with
 * -DTISON_OP_TIMES, as each op of the region ends, thread 0 adds the time since the last op
 * ended to op_seconds[op]. Every op ends at the team's barrier, so that is the team's time on
 * it, the wait for the slowest thread included. Other builds mark nothing. The names, in this
 * order, are bench_step_overhead's OPS. */
enum {
    OP_EMBED, OP_NORM, OP_QKV, OP_ROPE, OP_KV_WRITE, OP_ATTENTION, OP_O, OP_ALL_REDUCE,
    OP_GATE_UP, OP_ACT, OP_DOWN, OP_EXPERTS, OP_HEAD, OP_ARGMAX, OP_COUNT
};
#ifdef TISON_OP_TIMES
static double op_seconds[OP_COUNT], op_last; /* thread 0's: one call at a time in the process */
static inline void op_done(int op) {
    if (omp_get_thread_num() != 0) return;
    double now = omp_get_wtime();
    if (op >= 0) op_seconds[op] += now - op_last;
    op_last = now;
}
#else
static inline void op_done(int op) { (void)op; }
#endif
#define OP_START (-1) /* op_done's mark of the region's start */

/* Copies the seconds each op took over the calls since the last copy into out (OP_COUNT of
 * them, at most n) and starts them again from 0; returns OP_COUNT, or 0 in a build that does not
 * time its ops. */
int tk_op_seconds(double *out, int64_t n) {
#ifdef TISON_OP_TIMES
    for (int op = 0; op < OP_COUNT && op < n; op++) out[op] = op_seconds[op], op_seconds[op] = 0;
    return OP_COUNT;
#else
    (void)out, (void)n;
    return 0;
#endif
}

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
    int64_t n, page_size, span[MAX_MASKS]; /* span: attention_span's of each mask */
    const int64_t *positions;
    const float *rope_cs, *temperature; /* (n, hd) cos then sin, (n,); or NULL */
    const step_mask *masks;
    bf16 *xn, *qkv, *q, *k, *attn, *o, *gate_up, *act;
    void *xp; /* linear_scratch */
    float *scores;
    moe_scratch moe;
    shm_reduce *tp; /* the tensor-parallel group's all-reduce (all_reduce.c), or NULL: one rank */
} step_args;

/* NoPE: q and k out of qkv (n rows, row stride qkv_size) into q_out (n, nh, hd) and k_out
 * (n, nkv, hd); q times temperature[t] in float32, rounded once, where temperature is given. */
static void nope_team(const bf16 *qkv, int64_t qkv_size, int64_t n, int64_t q_size,
                      int64_t k_size, const float *temperature, bf16 *q_out, bf16 *k_out) {
#pragma omp for
    for (int64_t t = 0; t < n; t++) {
        const bf16 *q = qkv + t * qkv_size;
        if (temperature == NULL)
            memcpy(q_out + t * q_size, q, q_size * 2);
        else
            for (int64_t i = 0; i < q_size; i++)
                q_out[t * q_size + i] = f32_to_bf16(bf16_to_f32(q[i]) * temperature[t]);
        memcpy(k_out + t * k_size, q + q_size, k_size * 2);
    }
}

/* Inside the region: q and k of L's heads from qkv (n rows) into S->q, S->k: normed (q_norm,
 * k_norm) before or after the rotation, rotated as L->rope says. */
static void rotate_team(const decode_layer *L, const step_args *S, bf16 *qkv) {
    int64_t n = S->n, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    if (L->q_norm != NULL && !L->norm_after_rope) { /* Qwen3: per-head norms, in place */
        rms_norm_team_bf16(qkv, qkv_size, qkv, qkv_size, NULL, L->q_norm, n, nh, hd, L->qk_eps);
        rms_norm_team_bf16(qkv + q_size, qkv_size, qkv + q_size, qkv_size, NULL, L->k_norm, n,
                           nkv, hd, L->qk_eps);
    }
    if (L->rope == ROPE_TABLES)
        rope_team_bf16(qkv, qkv_size, qkv + q_size, qkv_size, n, nh, nkv, hd, S->positions,
                       L->cos, L->sin, S->q, S->k);
    else if (L->rope == ROPE_PAIRS)
        rope_pairs_team_bf16(qkv, qkv_size, qkv + q_size, qkv_size, n, nh, nkv, hd, S->rope_cs,
                             S->q, S->k);
    else
        nope_team(qkv, qkv_size, n, q_size, nkv * hd, L->temperature ? S->temperature : NULL,
                  S->q, S->k);
    if (L->q_norm != NULL && L->norm_after_rope) { /* Llama 4: L2 norms (weights of ones) */
        rms_norm_team_bf16(S->q, q_size, S->q, q_size, NULL, L->q_norm, n, nh, hd, L->qk_eps);
        rms_norm_team_bf16(S->k, nkv * hd, S->k, nkv * hd, NULL, L->k_norm, n, nkv, hd,
                           L->qk_eps);
    }
}

/* Inside the region: y (n, H) = down(silu(gate) * up) of xn, gate_up (2F, H), down (H, F). */
static void swiglu_team(const bf16 *gate_up, const bf16 *down, int64_t F, const step_args *S,
                        int64_t H, bf16 *y) {
    linear_team(S->xn, H, gate_up, NULL, S->n, 2 * F, H, S->gate_up, S->xp);
    op_done(OP_GATE_UP);
    silu_mul_team_bf16(S->gate_up, S->act, S->n, F);
    op_done(OP_ACT);
    linear_team(S->act, F, down, NULL, S->n, H, F, y, S->xp);
    op_done(OP_DOWN);
}

/* Inside the region: layer L on x (n, H) -> out (n, H); residual as the op-by-op layer keeps
 * it (first: residual is x and is only normalised; later: residual += x first). Its K/V pools:
 * k_pool, v_pool (P*S, nkv, hd), its mask's pages. Under tensor parallelism (S->tp) the
 * attention's output projection and the MLP leave this rank's partial sums, all-reduced where
 * the op-by-op layers all-reduce them. Returns 0, or a failed all-reduce's status (on every
 * thread alike). */
static int64_t layer_team(const decode_layer *L, const step_args *S, const bf16 *x,
                          bf16 *residual, int first, bf16 *out, bf16 *k_pool, bf16 *v_pool) {
    int64_t n = S->n, H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    const step_mask *A = &S->masks[L->mask];
    bf16 *qkv = S->qkv;
    rms_norm_team_bf16(x, H, S->xn, H, first ? NULL : residual, L->input_norm, n, 1, H, L->eps);
    op_done(OP_NORM);
    linear_team(S->xn, H, L->qkv, L->qkv_bias, n, qkv_size, H, qkv, S->xp);
    op_done(OP_QKV);
    rotate_team(L, S, qkv);
    op_done(OP_ROPE);
    kv_write_team_bf16(S->k, nkv * hd, qkv + q_size + nkv * hd, qkv_size, A->slots, n, k_pool,
                       v_pool, nkv, hd);
    op_done(OP_KV_WRITE);
    decode_attention_team_bf16(S->q, q_size, NULL, k_pool, v_pool, A->block_table,
                               A->table_stride, A->context_lens, n, nh, nkv, hd, S->page_size,
                               A->window, L->scale, S->attn, S->span[L->mask], S->scores);
    op_done(OP_ATTENTION);
    linear_team(S->attn, q_size, L->o, NULL, n, H, q_size, S->o, S->xp);
    op_done(OP_O);
    if (S->tp != NULL) {
        if (all_reduce_team_bf16(S->tp, S->o, n * H) != 0) return S->tp->error;
        op_done(OP_ALL_REDUCE);
    }
    rms_norm_team_bf16(S->o, H, S->xn, H, residual, L->post_norm, n, 1, H, L->eps);
    op_done(OP_NORM);
    if (L->router == NULL) {
        swiglu_team(L->gate_up, L->down, L->intermediate, S, H, out);
    } else {
        moe_team_bf16(S->xn, L->router, L->w13, L->w2, n, H, L->intermediate, L->experts,
                      L->top_k, (int)L->scoring, (int)L->renormalize, out, &S->moe, S->xp);
        op_done(OP_EXPERTS);
        if (L->shared_gate_up != NULL) {
            swiglu_team(L->shared_gate_up, L->shared_down, L->shared_intermediate, S, H, S->o);
#pragma omp for /* out = shared + routed, as the op-by-op layer adds them */
            for (int64_t i = 0; i < n * H; i++)
                out[i] = f32_to_bf16(bf16_to_f32(S->o[i]) + bf16_to_f32(out[i]));
            op_done(OP_EXPERTS);
        }
    }
    if (S->tp == NULL) return 0;
    int64_t status = all_reduce_team_bf16(S->tp, out, n * H);
    op_done(OP_ALL_REDUCE);
    return status;
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
    size_t ints = (size_t)(2 * n * k + 2 * E + 1), bytes = bf16s * 2 + ints * 8 + n * k * 4;
    char *block = malloc(bytes);
    if (block == NULL) {
        *failed = 1;
        return NULL;
    }
    M->ids = (int64_t *)block, M->pos = M->ids + n * k;
    M->start = M->pos + n * k, M->fill = M->start + E + 1;
    M->weights = (float *)(M->fill + E);
    M->logits = (bf16 *)(M->weights + n * k), M->rows = M->logits + n * E;
    M->h = M->rows + n * k * H, M->gate_up = M->h + n * k * H, M->act = M->gate_up + 2 * n * kI;
    return block;
}

/* The team's LM head on out (n, H), the final norm's output: its rows gathered into `rows`
 * scratch (m x H) where the head picks some. */
static void head_team(const decode_head *D, const bf16 *out, int64_t H, bf16 *rows,
                      void *scratch) {
    const bf16 *x = out;
    if (D->rows != NULL) {
#pragma omp for
        for (int64_t r = 0; r < D->m; r++)
            memcpy(rows + r * H, out + D->rows[r] * H, sizeof(bf16) * (size_t)H);
        x = rows;
    }
    linear_team(x, H, D->weight, NULL, D->m, D->vocab, H, D->logits, scratch);
    op_done(OP_HEAD);
    if (D->tokens != NULL) {
        argmax_team_bf16(D->logits, D->vocab, D->m, D->vocab, D->tokens);
        op_done(OP_ARGMAX);
    }
}

/* `count` layers (same attention shapes) of a decode step: x (n, hidden) -> out (n, hidden),
 * which is the last layer's output; residual (n, hidden) updated as the op-by-op layers do
 * (first != 0: it is x itself, the first layer's input). Layer i's K and V pools (P*S, nkv, hd)
 * are k_pools[i] and v_pools[i]; it reads masks[layers[i].mask] (num_masks of them, at most
 * MAX_MASKS), pages of page_size tokens. rope_cs (n, hd): each row's cosines then sines for
 * ROPE_PAIRS layers; temperature (n,): each row's factor on q for layers that ask; NULL where
 * no layer needs them. tp: the tensor-parallel group's all-reduce (n * hidden bf16 fit its
 * slots), or NULL for one rank. final_norm (hidden,), or NULL: out is then the model's final
 * RMSNorm (final_eps) of the last layer's output plus residual, residual that sum, as the last
 * stage's norm does op by op. head, or NULL: the LM head on that output too (decode_head;
 * needs final_norm). embed, or NULL: the first layer's input is the step's tokens' embedding
 * rows, gathered into residual (needs first; x is then unused). max_positions > 0: the rows
 * of the layers' rotary tables, which every position must be below. out must not be x.
 * Returns 0, -1 when scratch memory cannot be allocated, -2 for too many masks (or a head
 * without final_norm, an embed without first), -3 when an all-reduce failed (tp->error says
 * why), -4 for a position beyond the tables, -5 for a token id outside the embedding. */
int tk_decode_layers_bf16(const decode_layer *layers, int64_t count, const bf16 *x,
                          const decode_embed *embed, bf16 *residual, int first, bf16 *out,
                          int64_t n, const int64_t *positions, int64_t max_positions,
                          const float *rope_cs, const float *temperature,
                          bf16 *const *k_pools, bf16 *const *v_pools, const step_mask *masks,
                          int64_t num_masks, int64_t page_size, shm_reduce *tp,
                          const bf16 *final_norm, float final_eps, const decode_head *head,
                          int threads) {
    if (num_masks < 1 || num_masks > MAX_MASKS || (head != NULL && final_norm == NULL)) return -2;
    if (embed != NULL && !first) return -2;
    for (int64_t t = 0; t < n; t++) {
        if (max_positions > 0 && (positions[t] < 0 || positions[t] >= max_positions)) return -4;
        if (embed != NULL && (embed->ids[t] < 0 || embed->ids[t] >= embed->vocab)) return -5;
    }
    if (tp != NULL) tp->error = 0;
    const decode_layer *L = layers;
    int64_t H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t F = 0, q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    int64_t k = 1; /* the most rows a linear takes: n, or n * top_k (moe.c's experts) */
    for (int64_t i = 0; i < count; i++) { /* the widest intermediate: dense, expert or shared */
        const decode_layer *Li = &layers[i];
        F = Li->intermediate > F ? Li->intermediate : F;
        F = Li->shared_intermediate > F ? Li->shared_intermediate : F;
        k = Li->router != NULL && Li->top_k > k ? Li->top_k : k;
    }
    /* per row: xn, o, a spare output (H each); qkv; q, attn; k; gate_up (2F); act (F) */
    size_t per_row = (size_t)(3 * H + qkv_size + 2 * q_size + nkv * hd + 3 * F);
    bf16 *xn = grow_workspace(per_row * n);
    int64_t widest = H > q_size ? H : q_size, scores = 0;
    step_args S = {.n = n, .page_size = page_size, .positions = positions, .rope_cs = rope_cs,
                   .temperature = temperature, .masks = masks, .tp = tp};
    for (int64_t m = 0; m < num_masks; m++) { /* each mask's split; scratch for the largest */
        const step_mask *A = &masks[m];
        int64_t max_len = max_attended(A->context_lens, n, A->window);
        S.span[m] = attention_span(A->context_lens, n, nkv, A->window, page_size, threads);
        int64_t need = attention_scratch(threads, n, nh, hd, max_len, S.span[m]);
        scores = need > scores ? need : scores;
    }
    S.xp = linear_scratch(n * k, widest > F ? widest : F);
    S.scores = malloc(sizeof(float) * scores);
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
        int failed = 0;
        op_done(OP_START);
        if (embed != NULL) {
#pragma omp for
            for (int64_t t = 0; t < n; t++)
                memcpy(residual + t * H, embed->table + embed->ids[t] * H, sizeof(bf16) * H);
            in = residual;
            op_done(OP_EMBED);
        }
        for (int64_t i = 0; i < count && !failed; i++) {
            bf16 *to = (count - 1 - i) % 2 == 0 ? out : spare;
            /* a peer is gone: every thread leaves alike */
            failed = layer_team(&layers[i], &S, in, residual, first && i == 0, to, k_pools[i],
                                v_pools[i]) != 0;
            in = to;
        }
        if (final_norm != NULL && !failed) { /* in place: a row is read whole before written */
            rms_norm_team_bf16(out, H, out, H, residual, final_norm, n, 1, H, final_eps);
            op_done(OP_NORM);
        }
        if (head != NULL && !failed) head_team(head, out, H, xn, S.xp);
        linear_team_done();
    }
    free(S.scores);
    free(moe_block);
    return tp != NULL && tp->error != 0 ? -3 : 0;
}
