/* A whole Llama-family decoder layer for a decode step (one new token per sequence), bfloat16
 * on AMX, in one call and one OpenMP parallel region: the team runs the layer's kernels one
 * after the other (see cpu_kernels.h), meeting at a barrier after each. Per op, the layer
 * would pay a Python module call, a ctypes call, a tensor allocation and a thread-team wake-up:
 * ~250 us a layer here, a quarter of a batch-32 step. The kernels are the ones the op-by-op
 * path runs, in the same order, so the layer's output is the same bit for bit.
 *
 * Built only where amx_linear.c is; elsewhere tk_decode_layer_bf16 returns -2.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* One layer's weights and shapes, filled once (decode_layer.py). Pointers to bf16 tensors;
 * qkv_bias, q_norm and k_norm may be NULL. */
typedef struct {
    const bf16 *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    const bf16 *cos, *sin; /* rotary tables (max_positions, hd) */
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, qk_eps, scale;
} decode_layer;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

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

/* x (n, hidden) -> out (n, hidden), residual (n, hidden) updated as the op-by-op layer does:
 * first layer (first != 0): residual is x itself and is only normalised; later ones: residual
 * += x first. New K/V go to slots[t] of the pools; row t attends to the pages block_table[t]
 * (row stride table_stride), context_lens[t] keys (the last `window` when window > 0), pages
 * of page_size tokens. Returns 0, or -1 when scratch memory
 * cannot be allocated. */
int tk_decode_layer_bf16(const decode_layer *L, const bf16 *x, bf16 *residual, int first,
                         bf16 *out, int64_t n, const int64_t *positions, const int64_t *slots,
                         bf16 *k_pool, bf16 *v_pool, const int32_t *block_table,
                         int64_t table_stride, const int32_t *context_lens, int64_t page_size,
                         int64_t window, int threads) {
    int64_t H = L->hidden, nh = L->heads, nkv = L->kv_heads, hd = L->head_dim;
    int64_t F = L->intermediate, q_size = nh * hd, qkv_size = (nh + 2 * nkv) * hd;
    /* activations: xn (n, H), qkv (n, qkv_size), q (n, q_size), k (n, nkv*hd),
     * attn (n, q_size), o (n, H), gate_up (n, 2F), act (n, F) */
    size_t per_row = (size_t)(2 * H + qkv_size + 2 * q_size + nkv * hd + 3 * F);
    bf16 *xn = grow_workspace(per_row * n);
    int64_t widest = H > q_size ? H : q_size;
    bf16 *xp = amx_pack_buffer(n, widest > F ? widest : F);
    int64_t heads_per_task = attention_heads_per_task(n, nkv, threads);
    float *scores = malloc(sizeof(float) * threads *
                           attention_scratch(heads_per_task * (nh / nkv),
                                             max_context(context_lens, n), hd));
    if (xn == NULL || xp == NULL || scores == NULL) {
        free(scores);
        return -1;
    }
    bf16 *qkv = xn + n * H, *q = qkv + n * qkv_size, *k = q + n * q_size;
    bf16 *attn = k + n * nkv * hd, *o = attn + n * q_size, *gate_up = o + n * H;
    bf16 *act = gate_up + n * 2 * F;
#pragma omp parallel num_threads(threads)
    {
        rms_norm_team_bf16(x, H, xn, H, first ? NULL : residual, L->input_norm, n, 1, H, L->eps);
        amx_linear_team(xn, H, L->qkv, L->qkv_bias, n, qkv_size, H, qkv, xp);
        if (L->q_norm != NULL) { /* Qwen3: per-head norms of q and k, in place */
            rms_norm_team_bf16(qkv, qkv_size, qkv, qkv_size, NULL, L->q_norm, n, nh, hd,
                               L->qk_eps);
            rms_norm_team_bf16(qkv + q_size, qkv_size, qkv + q_size, qkv_size, NULL, L->k_norm,
                               n, nkv, hd, L->qk_eps);
        }
        rope_team_bf16(qkv, qkv_size, qkv + q_size, qkv_size, n, nh, nkv, hd, positions, L->cos,
                       L->sin, q, k);
        kv_write_team_bf16(k, nkv * hd, qkv + q_size + nkv * hd, qkv_size, slots, n, k_pool,
                           v_pool, nkv, hd);
        decode_attention_team_bf16(q, q_size, NULL, k_pool, v_pool, block_table, table_stride,
                                   context_lens, n, nh, nkv, hd, page_size, window,
                                   L->scale, attn, heads_per_task, scores);
        amx_linear_team(attn, q_size, L->o, NULL, n, H, q_size, o, xp);
        rms_norm_team_bf16(o, H, xn, H, residual, L->post_norm, n, 1, H, L->eps);
        amx_linear_team(xn, H, L->gate_up, NULL, n, 2 * F, H, gate_up, xp);
        silu_mul_team_bf16(gate_up, act, n, F);
        amx_linear_team(act, F, L->down, NULL, n, H, F, out, xp);
        _tile_release();
    }
    free(scores);
    return 0;
}

#else
int tk_decode_layer_bf16(const decode_layer *L, const bf16 *x, bf16 *residual, int first,
                         bf16 *out, int64_t n, const int64_t *positions, const int64_t *slots,
                         bf16 *k_pool, bf16 *v_pool, const int32_t *block_table,
                         int64_t table_stride, const int32_t *context_lens, int64_t page_size,
                         int64_t window, int threads) {
    (void)L, (void)x, (void)residual, (void)first, (void)out, (void)n, (void)positions;
    (void)slots, (void)k_pool, (void)v_pool, (void)block_table, (void)table_stride;
    (void)context_lens, (void)page_size, (void)window, (void)threads;
    return -2;
}
#endif
