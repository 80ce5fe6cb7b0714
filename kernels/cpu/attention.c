/* Paged decode attention, for float32 and bfloat16 (each_type.h): the decode rows' queries
 * against the keys and values of their pages, read in place; tk_paged_attention first writes
 * the new tokens' K/V (kv_write.c). bfloat16 K/V run attention_vec.h's loops on the vector
 * tiers, float32 K/V (and bfloat16 on the portable tier) this file's. */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include <omp.h>
#include <stdlib.h>

#include "attention_vec.h"
#include "typed.h"

#define MAX_GROUP 64 /* query heads per KV head, at most */
#define PREFETCH_KEYS 32 /* this file's loops: positions ahead of the one read asked for */
#define STREAM_PAGES 2 /* this file's loops: pages ahead whose 4 KiB blocks' first lines are
                          asked for */

/* This file's loops, as a pass reaches position p, the start of a page: asks for the first
 * line of each 4 KiB block of the page STREAM_PAGES on, if the row has it (pool rows of
 * row_bytes), which sets the L2's stream prefetcher going on those blocks early (float32 K/V
 * on a Zen 4: calls took 2-4% longer without it). */
static inline void prefetch_stream_starts(const void *pool, const int32_t *pages, int64_t p,
                                          int64_t ctx, int64_t page_size, int64_t row_bytes) {
    int64_t a = (p / page_size + STREAM_PAGES) * page_size;
    if (a >= ctx) return;
    const char *page = (const char *)pool + (int64_t)pages[a / page_size] * page_size * row_bytes;
    for (int64_t off = 0; off < page_size * row_bytes; off += 4096)
        __builtin_prefetch(page + off, 0, 3);
}

/* The lines the vector loops ask for (attention_vec.h's kv_ahead) while they read positions
 * [from, from + count) of the vp-th of a task's pages in the order its passes read them: its
 * n_pages pages of keys, from first_page of its block table row `pages` on, then the same
 * pages of values. AHEAD_STREAMS pages are asked for at once, a part of each a page read: the
 * page j + 1 on gets its part S - 1 - j of S (S = AHEAD_STREAMS), so each page is asked for
 * over the S pages read before it, in order. Asked for one page ahead in the loops' order, the
 * pages' reads with no arithmetic ran at ~17 GB/s on two Zen 4 cores, and 4 streams in order
 * at 20-25 (random 8 KiB pages read 4-8 at once: 22-40); the kernel took 0.65-0.75x the time on
 * avx512_bf16, 0.72-0.82x on avx2 (2 streams or 8 were slower on one tier or the other). */
#if defined(__AVX2__) && defined(__FMA__)
static void plan_ahead(struct kv_ahead *a, const void *k_pool, const void *v_pool,
                       const int32_t *pages, int64_t first_page, int64_t n_pages, int64_t vp,
                       int64_t from, int64_t count, int64_t page_size, int64_t row_bytes) {
    int64_t page_bytes = page_size * row_bytes, S = AHEAD_STREAMS;
    a->streams = 0, a->most = 0;
    for (int64_t j = 0; j < S && vp + 1 + j < 2 * n_pages; j++) {
        int64_t t = vp + 1 + j;
        const char *pool = (const char *)(t < n_pages ? k_pool : v_pool);
        const char *page = pool + (int64_t)pages[first_page + t % n_pages] * page_bytes;
        int64_t lo = ((S - 1 - j) * page_bytes + from * row_bytes) / S / 64;
        int64_t hi = ((S - 1 - j) * page_bytes + (from + count) * row_bytes) / S / 64;
        a->at[a->streams] = page + lo * 64, a->lines[a->streams++] = hi - lo;
        a->most = hi - lo > a->most ? hi - lo : a->most;
    }
}
#endif

#define TYPED_FILE "attention.c"
#include "each_type.h"
#else
#if IS_BF16 && defined(__AVX2__) && defined(__FMA__)
#define KV_VEC 1 /* attention_vec.h's loops, where kv_lanes says */
#else
#define KV_VEC 0 /* this file's loops */
#endif

void NAME(kv_write_team)(const T *k, int64_t k_stride, const T *v, int64_t v_stride,
                         const int64_t *slots, int64_t n_new, T *k_pool, T *v_pool, int64_t nkv,
                         int64_t hd); /* kv_write.c */

/* For the `count` keys of one page from `slot` on (pool rows of nkv * hd), KV heads
 * g < nkv: scores[(g * group + j) * score_stride + i] = dot(q[g * group + j], key i of head
 * g). count <= 16 with AVX-512. */
static void NAME(page_scores)(const float *restrict q, const T *restrict pool, int64_t slot,
                              int64_t count, int64_t nkv, int64_t group, int64_t hd,
                              float *restrict scores, int64_t score_stride,
                              float *restrict key) {
#if defined(__AVX512F__)
    (void)key; /* 16 keys at a time, their dot products held in 16 registers */
    for (int64_t g = 0; g < nkv; g++) {
        const T *rows[16]; /* past `count`, the last key again: read, then masked off */
        for (int64_t i = 0; i < 16; i++)
            rows[i] = pool + ((slot + (i < count ? i : count - 1)) * nkv + g) * hd;
        for (int64_t j = g * group; j < (g + 1) * group; j++) {
            __m512 dots[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) dots[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < hd; d += LANES) {
                __m512 qd = _mm512_loadu_ps(q + j * hd + d);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    dots[i] = _mm512_fmadd_ps(qd, LOAD16(rows[i] + d), dots[i]);
            }
            _mm512_mask_storeu_ps(scores + j * score_stride, (__mmask16)((1u << count) - 1),
                                  sum16x16(dots));
        }
    }
#else
    for (int64_t i = 0; i < count; i++) {
        for (int64_t g = 0; g < nkv; g++) {
            const T *restrict k = pool + ((slot + i) * nkv + g) * hd;
            for (int64_t d = 0; d < hd; d++) key[d] = LOAD(k[d]);
            for (int64_t j = g * group; j < (g + 1) * group; j++) {
                const float *restrict qj = q + j * hd;
                float lane[LANES] = {0};
                for (int64_t d = 0; d < hd; d += LANES)
                    for (int l = 0; l < LANES; l++) lane[l] += qj[d + l] * key[d + l];
                scores[j * score_stride + i] = sum_lanes(lane);
            }
        }
    }
#endif
}

/* acc[h] += weights[h * weight_stride + i] * value i of h's KV head, for the query heads h of
 * every KV head and the `count` values of one page from `slot` on. */
static void NAME(page_values)(const float *restrict weights, int64_t weight_stride,
                              const T *restrict pool, int64_t slot, int64_t count, int64_t nkv,
                              int64_t group, int64_t hd, float *restrict acc,
                              float *restrict value) {
#if defined(__AVX512F__)
    (void)value; /* each accumulator stays in a register across the page's values */
    for (int64_t g = 0; g < nkv; g++) {
        const T *v = pool + (slot * nkv + g) * hd;
        for (int64_t j = g * group; j < (g + 1) * group; j++) {
            const float *w = weights + j * weight_stride;
            for (int64_t d = 0; d < hd; d += LANES) {
                __m512 sum = _mm512_loadu_ps(acc + j * hd + d);
                for (int64_t i = 0; i < count; i++)
                    sum = _mm512_fmadd_ps(_mm512_set1_ps(w[i]), LOAD16(v + i * nkv * hd + d), sum);
                _mm512_storeu_ps(acc + j * hd + d, sum);
            }
        }
    }
#else
    for (int64_t i = 0; i < count; i++) {
        for (int64_t g = 0; g < nkv; g++) {
            const T *restrict v = pool + ((slot + i) * nkv + g) * hd;
            for (int64_t d = 0; d < hd; d++) value[d] = LOAD(v[d]);
            for (int64_t j = g * group; j < (g + 1) * group; j++) {
                float w = weights[j * weight_stride + i];
                float *restrict aj = acc + j * hd;
                for (int64_t d = 0; d < hd; d++) aj[d] += w * value[d];
            }
        }
    }
#endif
}

/* In place: scores (n,) -> e^(score - max); returns their sum, and the max in *top_out. */
static float NAME(softmax_weights)(float *restrict s, int64_t n, float *top_out) {
#if EXP16 /* AVX-512 builds; the last block under a mask (past n: -inf, then 0) */
    __m512 top = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 in = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        top = _mm512_max_ps(_mm512_mask_loadu_ps(top, in, s + i), top); /* NaN loses */
    }
    float best = _mm512_reduce_max_ps(top);
    *top_out = best;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 in = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + i), _mm512_set1_ps(best));
        __m512 e = exp_approx16(x);
        _mm512_mask_storeu_ps(s + i, in, e);
        sums = _mm512_mask_add_ps(sums, in, sums, e);
    }
    return _mm512_reduce_add_ps(sums);
#elif EXP8 /* AVX2 builds (typed.h); the portable one takes the loops below */
    __m256 top = _mm256_set1_ps(-INFINITY), sums = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) top = _mm256_max_ps(_mm256_loadu_ps(s + i), top); /* NaN loses */
    float lane[8], best = -INFINITY, sum = 0;
    _mm256_storeu_ps(lane, top);
    for (int l = 0; l < 8; l++) best = lane[l] > best ? lane[l] : best;
    for (int64_t t = i; t < n; t++) best = s[t] > best ? s[t] : best;
    *top_out = best;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(best)));
        _mm256_storeu_ps(s + i, e);
        sums = _mm256_add_ps(sums, e);
    }
    for (; i < n; i++) s[i] = exp_approx(s[i] - best), sum += s[i];
    _mm256_storeu_ps(lane, sums);
    return sum + (((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                  ((lane[1] + lane[5]) + (lane[3] + lane[7])));
#else
    float top[LANES], lane[LANES] = {0}; /* per-lane maxima and sums: both vectorize */
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) top[l] = s[i + l] > top[l] ? s[i + l] : top[l];
    for (; i < n; i++) top[0] = s[i] > top[0] ? s[i] : top[0];
    float best = top[0];
    for (int l = 1; l < LANES; l++) best = top[l] > best ? top[l] : best;
    *top_out = best;
    for (i = 0; i < n; i++) s[i] = exp_approx(s[i] - best);
    for (i = 0; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += s[i + l];
    for (; i < n; i++) lane[0] += s[i];
    return sum_lanes(lane);
#endif
}

/* Asks for the rows of positions [from, to) of a task's stream: its keys, positions [start,
 * ctx) of every KV head on its pages, then its values over the same positions (stream
 * positions ctx - start and on). The loops read them in short strided runs (one key of a head
 * is hd values, the next a page row away) that the hardware prefetchers follow badly; asked
 * for PREFETCH_KEYS positions ahead of the one being read, the misses overlap the arithmetic. */
static void NAME(prefetch_stream)(const T *k_pool, const T *v_pool, const int32_t *pages,
                                  int64_t start, int64_t ctx, int64_t from, int64_t to,
                                  int64_t page_size, int64_t nkv, int64_t hd) {
    int64_t len = ctx - start, bytes = nkv * hd * (int64_t)sizeof(T); /* of one position */
    to = to < 2 * len ? to : 2 * len;
    for (int64_t s = from; s < to; s++) {
        int64_t p = start + (s < len ? s : s - len);
        int64_t at = ((int64_t)pages[p / page_size] * page_size + p % page_size) * nkv;
        const char *row = (const char *)((s < len ? k_pool : v_pool) + at * hd);
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
    }
}

/* A row's output o (nh, hd) = acc / total[h], acc split as the vector loops keep it when
 * lanes > 0. */
static void NAME(store_row)(const float *restrict acc, const float *restrict total, int64_t nh,
                            int64_t hd, int lanes, T *o) {
#if KV_VEC
    if (lanes > 0) {
        kv_store_out(lanes, acc, total, nh, hd, o);
        return;
    }
#endif
    (void)lanes;
    for (int64_t h = 0; h < nh; h++)
        for (int64_t d = 0; d < hd; d++) o[h * hd + d] = STORE(acc[h * hd + d] / total[h]);
}

/* Row b's output: its spans' partial results (acc, maximum, sum per head, from partials)
 * rescaled to the greatest maximum and summed, into acc and total (nh heads), then stored. */
static void NAME(merge_spans)(const float *restrict partials, int64_t spans, int64_t nh,
                              int64_t hd, float *restrict acc, float *restrict total,
                              int lanes, T *o) {
    memset(acc, 0, sizeof(float) * nh * hd);
    for (int64_t h = 0; h < nh; h++) {
        float top = -INFINITY;
        for (int64_t c = 0; c < spans; c++) {
            float m = partials[(c * nh + h) * (hd + 2) + hd];
            top = m > top ? m : top;
        }
        total[h] = 0;
        for (int64_t c = 0; c < spans; c++) {
            const float *part = partials + (c * nh + h) * (hd + 2);
            float f = expf(part[hd] - top);
            total[h] += f * part[hd + 1];
            for (int64_t d = 0; d < hd; d++) acc[h * hd + d] += f * part[d];
        }
    }
    NAME(store_row)(acc, total, nh, hd, lanes, o);
}

/* Decode attention, one query token per row b: keys and values read in place from the pages
 * block_table[b] (row stride table_stride), positions [start, context_lens[b]) where
 * start = context - window when a sliding window is set (window > 0), else 0.
 * q: row q_rows[b] (b when q_rows is NULL) of a (?, nh*hd) tensor, row stride q_stride;
 * out: the same row of a contiguous (?, nh*hd) tensor. Pools: (P*S, nkv, hd).
 * A task is `span` positions of one row (attention_span's split), all its KV heads; the query
 * heads that share a KV head are done together, reading each key once. Scores and softmax in
 * float32, two passes over a span's pages (scores; weighted values): bfloat16 K/V in
 * attention_vec_impl.h's loops on the vector tiers, else in this file's. A row cut in several
 * spans leaves their partial results in scratch, merged once every task is done. scratch:
 * attention_scratch(...) floats for the team. Needs hd % 16 == 0 and nh / nkv <= MAX_GROUP
 * (the wrapper checks). */
void NAME(decode_attention_team)(const T *q, int64_t q_stride, const int64_t *q_rows,
                                 const T *k_pool, const T *v_pool, const int32_t *block_table,
                                 int64_t table_stride, const int32_t *context_lens, int64_t n,
                                 int64_t nh, int64_t nkv, int64_t hd, int64_t page_size,
                                 int64_t window, float scale, T *out, int64_t span,
                                 float *scratch) {
    int64_t group = nh / nkv, max_len = max_attended(context_lens, n, window);
    int64_t spans = span == 0 ? 1 : (max_len + span - 1) / span; /* tasks a row at most */
    int64_t per_thread = attention_thread_scratch(nh, span, hd);
    float *partials = scratch + per_thread * omp_get_num_threads(); /* (n, spans, nh, hd + 2) */
    int lanes = KV_VEC ? kv_lanes(hd) : 0;
    int64_t block = lanes > 0 ? lanes : 16; /* keys a scores call takes at most */
    /* positions asked for at once as a task starts (the vector loops: its first page) */
    int64_t first_keys = lanes > 0 ? page_size : PREFETCH_KEYS;
    float *scores = scratch + per_thread * omp_get_thread_num();
    int64_t stride = score_stride(span); /* of the scores' rows */
    float *qf = scores + nh * stride, *acc = qf + nh * hd;
    float *key = acc + nh * hd, *top = key + hd, *total = top + nh;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * spans; task++) {
        int64_t b = task / spans, c = task % spans, ctx = context_lens[b];
        int64_t start = ctx - attended(context_lens, b, window) + c * span;
        if (start >= ctx) continue; /* a shorter row than the longest */
        ctx = ctx - start > span ? start + span : ctx; /* from here: the span's end */
        int64_t len = ctx - start, row = q_rows != NULL ? q_rows[b] : b;
        const T *qrow = q + row * q_stride;
        const int32_t *pages = block_table + b * table_stride;
        NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx, 0, first_keys, page_size, nkv, hd);
#if KV_VEC
        int64_t first_page = start / page_size, n_pages = (ctx - 1) / page_size - first_page + 1;
        struct kv_ahead ahead;
        const void *qv = lanes > 0 ? kv_prepare_q(lanes, qrow, nh, hd, qf) : qf;
#endif
        if (lanes == 0)
            for (int64_t i = 0; i < nh * hd; i++) qf[i] = LOAD(qrow[i]) * scale;
        for (int64_t p = start; p < ctx;) {
            int64_t first = p % page_size, count = page_size - first; /* keys left in page */
            count = count < ctx - p ? count : ctx - p;
            count = count < block ? count : block;
            int64_t slot = (int64_t)pages[p / page_size] * page_size + first;
            float *at = scores + p - start;
#if KV_VEC
            if (lanes > 0) {
                plan_ahead(&ahead, k_pool, v_pool, pages, first_page, n_pages,
                           p / page_size - first_page, first, count, page_size,
                           nkv * hd * sizeof(T));
                kv_scores(lanes, qv, scale, k_pool, slot, count, nkv, group, hd, at, stride,
                          &ahead);
            } else
#endif
            {
                if (first == 0)
                    prefetch_stream_starts(k_pool, pages, p, ctx, page_size, nkv * hd * sizeof(T));
                NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx,
                                      p - start + PREFETCH_KEYS,
                                      p - start + count + PREFETCH_KEYS, page_size, nkv, hd);
                NAME(page_scores)(qf, k_pool, slot, count, nkv, group, hd, at, stride, key);
            }
            p += count;
        }
        for (int64_t h = 0; h < nh; h++)
            total[h] = NAME(softmax_weights)(scores + h * stride, len, &top[h]);
        memset(acc, 0, sizeof(float) * nh * hd);
        for (int64_t p = start; p < ctx;) {
            int64_t first = p % page_size, count = page_size - first;
            count = count < ctx - p ? count : ctx - p;
            int64_t slot = (int64_t)pages[p / page_size] * page_size + first;
            const float *w = scores + p - start;
#if KV_VEC
            if (lanes > 0) {
                plan_ahead(&ahead, k_pool, v_pool, pages, first_page, n_pages,
                           n_pages + p / page_size - first_page, first, count, page_size,
                           nkv * hd * sizeof(T));
                kv_values(lanes, w, stride, v_pool, slot, count, nkv, group, hd, acc, &ahead);
            } else
#endif
            {
                if (first == 0)
                    prefetch_stream_starts(v_pool, pages, p, ctx, page_size, nkv * hd * sizeof(T));
                int64_t s = len + p - start + PREFETCH_KEYS;
                NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx, s, s + count,
                                      page_size, nkv, hd);
                NAME(page_values)(w, stride, v_pool, slot, count, nkv, group, hd, acc, key);
            }
            p += count;
        }
        if (spans > 1) { /* this span's part of the row: merged below */
            float *part = partials + (b * spans + c) * nh * (hd + 2);
            for (int64_t h = 0; h < nh; h++) {
                memcpy(part + h * (hd + 2), acc + h * hd, sizeof(float) * hd);
                part[h * (hd + 2) + hd] = top[h], part[h * (hd + 2) + hd + 1] = total[h];
            }
            continue;
        }
        NAME(store_row)(acc, total, nh, hd, lanes, out + row * nh * hd);
    }
    if (spans == 1) return;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < n; b++) {
        int64_t len = attended(context_lens, b, window), row = q_rows != NULL ? q_rows[b] : b;
        if (len == 0) continue;
        NAME(merge_spans)(partials + b * spans * nh * (hd + 2), (len + span - 1) / span, nh, hd,
                          acc, total, lanes, out + row * nh * hd);
    }
}

/* Paged attention's C part: the kv_write_team, then decode_attention_team for the n decode
 * rows (see both), on `threads` threads. Returns 0, or -1 when scratch memory cannot be
 * allocated. */
int NAME(tk_paged_attention)(const T *k, int64_t k_stride, const T *v, int64_t v_stride,
                             const int64_t *slots, int64_t n_new, const T *q, int64_t q_stride,
                             const int64_t *q_rows, T *k_pool, T *v_pool,
                             const int32_t *block_table, int64_t table_stride,
                             const int32_t *context_lens, int64_t n, int64_t nh, int64_t nkv,
                             int64_t hd, int64_t page_size, int64_t window, float scale, T *out,
                             int threads) {
    NAME(kv_write_team)(k, k_stride, v, v_stride, slots, n_new, k_pool, v_pool, nkv, hd);
    if (n == 0) return 0;
    int team = attention_team(context_lens, n, nkv, threads);
    int64_t max_len = max_attended(context_lens, n, window);
    int64_t span = attention_span(context_lens, n, nkv, window, page_size, threads);
    float *scratch = malloc(sizeof(float) * attention_scratch(team, n, nh, hd, max_len, span));
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(team)
    NAME(decode_attention_team)(q, q_stride, q_rows, k_pool, v_pool, block_table, table_stride,
                                context_lens, n, nh, nkv, hd, page_size, window, scale, out,
                                span, scratch);
    free(scratch);
    return 0;
}

/* Decode attention as the fused decoder runs it, for loadtest/bench_attention.py: `calls`
 * calls in one team of `threads` (the threads up, the scratch made once, the loops' barriers
 * ending each call), no sliding window, call c reading block table c of block_tables (calls, n,
 * table_stride); seconds[c]: call c's time on thread 0, from a barrier to the end of its loops.
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int NAME(tk_attention_timed)(const T *q, int64_t q_stride, const T *k_pool, const T *v_pool,
                             const int32_t *block_tables, int64_t calls, int64_t table_stride,
                             const int32_t *context_lens, int64_t n, int64_t nh, int64_t nkv,
                             int64_t hd, int64_t page_size, float scale, T *out, int threads,
                             double *seconds) {
    int64_t max_len = max_attended(context_lens, n, 0);
    int64_t span = attention_span(context_lens, n, nkv, 0, page_size, threads);
    float *scratch = malloc(sizeof(float) * attention_scratch(threads, n, nh, hd, max_len, span));
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(threads)
    for (int64_t c = 0; c < calls; c++) {
#pragma omp barrier
        double start = omp_get_wtime();
        NAME(decode_attention_team)(q, q_stride, NULL, k_pool, v_pool,
                                    block_tables + c * n * table_stride, table_stride,
                                    context_lens, n, nh, nkv, hd, page_size, 0, scale, out, span,
                                    scratch);
        if (omp_get_thread_num() == 0) seconds[c] = omp_get_wtime() - start;
    }
    free(scratch);
    return 0;
}
#undef KV_VEC
#endif
