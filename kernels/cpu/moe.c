/* A mixture-of-experts MLP of a decode step (Mixtral, Qwen3-MoE, Llama 4's routed experts),
 * bfloat16, as a team kernel (kernels.h) of decode_layer.c: router logits on the bf16 linear,
 * softmax top-k (renormalised or not) or Llama 4's sigmoid top-k, the rows grouped by expert so
 * that each active expert's weights are read once for all its rows, each expert's gate_up,
 * SiLU-and-mul and down on the bf16 linear, and each row's sum of its experts' outputs. The
 * same steps and roundings as layers/moe.py's FusedMoE on one rank: the linears are the ones it
 * calls per expert; softmax: each output is scaled by its weight in float32; sigmoid: each
 * expert's input row is scaled by its weight rounded to bf16, the output summed as is; the
 * row's outputs are summed in float32 in ascending expert order (its index_add_ over the pairs
 * sorted by expert), rounded to bf16 once. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Top-k of one row's logits (E,): ids[j], weights[j] for j < k, best first (an exact tie goes
 * to the lower expert id); softmax weights renormalised to sum 1 if asked, or (ROUTE_SIGMOID)
 * the sigmoid of each chosen logit. */
static void route_row(const bf16 *logits, int64_t E, int64_t k, int scoring, int renormalize,
                      int64_t *ids, float *weights) {
    float top = -INFINITY, sum = 0.0f;
    /* the largest logit, a NaN skipped, as fmaxf does (whose reduction crashed the aarch64
     * vectorizer of gcc 12 at -O3) */
    for (int64_t e = 0; e < E; e++) {
        const float v = bf16_to_f32(logits[e]);
        top = v > top ? v : top;
    }
    for (int64_t e = 0; e < E; e++) sum += expf(bf16_to_f32(logits[e]) - top);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || bf16_to_f32(logits[e]) > bf16_to_f32(logits[best])))
                best = e;
        }
        ids[j] = best;
        weights[j] = scoring == ROUTE_SIGMOID ? 1.0f / (1.0f + expf(-bf16_to_f32(logits[best])))
                                              : expf(bf16_to_f32(logits[best]) - top) / sum;
    }
    if (renormalize) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= total;
    }
}

/* Every row's experts, and the (row, slot) pairs grouped by expert: pair p = t * k + j sits at
 * pos[p] of the grouped order (rows ascending within an expert); expert e's pairs are
 * [start[e], start[e + 1]). */
static void group_pairs(const bf16 *logits, int64_t n, int64_t E, int64_t k, int scoring,
                        int renormalize, const moe_scratch *M) {
    for (int64_t e = 0; e <= E; e++) M->start[e] = 0;
    for (int64_t t = 0; t < n; t++) {
        route_row(logits + t * E, E, k, scoring, renormalize, M->ids + t * k,
                  M->weights + t * k);
        for (int64_t j = 0; j < k; j++) M->start[M->ids[t * k + j] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) M->start[e + 1] += M->start[e];
    for (int64_t e = 0; e < E; e++) M->fill[e] = M->start[e];
    for (int64_t p = 0; p < n * k; p++) M->pos[p] = M->fill[M->ids[p]]++;
}

/* x (n, H) -> out (n, H): the experts w13 (E, 2I, H) (gate rows, then up rows) and w2 (E, H, I)
 * of the top k of router (E, H)'s logits, routed by `scoring` (ROUTE_*). xp: linear_scratch of
 * (n * k, max(H, I)). */
void moe_team_bf16(const bf16 *x, const bf16 *router, const bf16 *w13, const bf16 *w2,
                   int64_t n, int64_t H, int64_t I, int64_t E, int64_t k, int scoring,
                   int renormalize, bf16 *out, const moe_scratch *M, void *xp) {
    const int on_input = scoring == ROUTE_SIGMOID;
    linear_team(x, H, router, NULL, n, E, H, M->logits, xp);
#pragma omp single
    group_pairs(M->logits, n, E, k, scoring, renormalize, M);
#pragma omp for /* pair p (token p / k) into its row of the grouped order */
    for (int64_t p = 0; p < n * k; p++) {
        const bf16 *from = x + p / k * H;
        bf16 *row = M->rows + M->pos[p] * H;
        if (!on_input) {
            memcpy(row, from, H * 2);
            continue;
        }
        const float w = bf16_to_f32(f32_to_bf16(M->weights[p]));
        for (int64_t c = 0; c < H; c++) row[c] = f32_to_bf16(bf16_to_f32(from[c]) * w);
    }
    experts_linear_team(M->rows, M->start, E, w13, 2 * I * H, 2 * I, H, M->gate_up, xp);
    silu_mul_team_bf16(M->gate_up, M->act, n * k, I);
    experts_linear_team(M->act, M->start, E, w2, H * I, H, I, M->h, xp);
#pragma omp for
    for (int64_t t = 0; t < n; t++) {
        int64_t order[k]; /* the row's slots by ascending expert id */
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j;
            for (; i > 0 && M->ids[t * k + order[i - 1]] > M->ids[t * k + j]; i--)
                order[i] = order[i - 1];
            order[i] = j;
        }
        for (int64_t c = 0; c < H; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                int64_t p = t * k + order[j];
                float h = bf16_to_f32(M->h[M->pos[p] * H + c]);
                acc += on_input ? h : h * M->weights[p];
            }
            out[t * H + c] = f32_to_bf16(acc);
        }
    }
}
