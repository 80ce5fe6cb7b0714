/* The kernels of cpu_kernels.c for one element type T (see there for T, NAME, LOAD, STORE,
 * ROUND). Included once per type; no include guard on purpose.
 * Each kernel's work is a NAME(..._team) function whose loops are orphaned `omp for`s: called
 * inside a parallel region (decode_layer.c runs a whole decoder layer in one), the team shares
 * the work and meets at the loop's end; called outside one, it runs on the calling thread. The
 * tk_ entry points open a region of the caller's size around them. */

/* x: n rows of `heads` vectors of `dim` (row stride x_stride); out likewise (may be x).
 * With residual ((n, dim) contiguous, heads == 1): residual = x + residual first, and the
 * norm is taken of the sum. out = weight * round(v / sqrt(mean(v^2) + eps)), as HF computes
 * it: statistics in float32, the normalised value rounded to T before the weight. */
void NAME(rms_norm_team)(const T *x, int64_t x_stride, T *out, int64_t out_stride, T *residual,
                         const T *weight, int64_t n, int64_t heads, int64_t dim, float eps) {
    int64_t vectors = n * heads;
#pragma omp for
    for (int64_t r = 0; r < vectors; r++) {
        int64_t row = r / heads, head = r % heads;
        const T *v = x + row * x_stride + head * dim;
        T *o = out + row * out_stride + head * dim;
        if (residual != NULL) {
            T *sum = residual + row * dim;
            for (int64_t d = 0; d < dim; d++) sum[d] = STORE(LOAD(v[d]) + LOAD(sum[d]));
            v = sum;
        }
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += LOAD(v[d + l]) * LOAD(v[d + l]);
        for (; d < dim; d++) acc[0] += LOAD(v[d]) * LOAD(v[d]);
        float inv = 1.0f / sqrtf(sum_lanes(acc) / (float)dim + eps);
        for (d = 0; d < dim; d++) o[d] = STORE(LOAD(weight[d]) * ROUND(LOAD(v[d]) * inv));
    }
}

void NAME(tk_rms_norm)(const T *x, int64_t x_stride, T *out, int64_t out_stride, T *residual,
                       const T *weight, int64_t n, int64_t heads, int64_t dim, float eps,
                       int threads) {
#pragma omp parallel num_threads(threads) if (n * heads * dim >= PARALLEL_MIN_ELEMS)
    NAME(rms_norm_team)(x, x_stride, out, out_stride, residual, weight, n, heads, dim, eps);
}

/* One head of hd values, "rotate half" layout: to = x * cos + cat(-x2, x1) * sin, each
 * product and the sum rounded as torch rounds them. */
__attribute__((noinline)) /* inlined into the OpenMP body, it would not vectorize */
static void NAME(rotate)(const T *restrict x, const T *restrict cos, const T *restrict sin,
                         int64_t hd, T *restrict to) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);
        float a = ROUND(x1 * LOAD(cos[i])) + ROUND(-x2 * LOAD(sin[i]));
        float b = ROUND(x2 * LOAD(cos[i + half])) + ROUND(x1 * LOAD(sin[i + half]));
        to[i] = STORE(a);
        to[i + half] = STORE(b);
    }
}

/* q: n rows of nh heads of hd values (row stride q_stride), k likewise with nkv heads ->
 * q_out (n, nh, hd) and k_out (n, nkv, hd), contiguous, rotated by the cos/sin rows (tables
 * (max_positions, hd)) of positions[t]. */
void NAME(rope_team)(const T *q, int64_t q_stride, const T *k, int64_t k_stride, int64_t n,
                     int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions, const T *cos,
                     const T *sin, T *q_out, T *k_out) {
    int64_t heads = nh + nkv;
#pragma omp for
    for (int64_t r = 0; r < n * heads; r++) {
        int64_t t = r / heads, h = r % heads;
        const T *c = cos + positions[t] * hd, *s = sin + positions[t] * hd;
        if (h < nh)
            NAME(rotate)(q + t * q_stride + h * hd, c, s, hd, q_out + (t * nh + h) * hd);
        else
            NAME(rotate)(k + t * k_stride + (h - nh) * hd, c, s, hd,
                         k_out + (t * nkv + h - nh) * hd);
    }
}

void NAME(tk_rope)(const T *q, int64_t q_stride, const T *k, int64_t k_stride, int64_t n,
                   int64_t nh, int64_t nkv, int64_t hd, const int64_t *positions, const T *cos,
                   const T *sin, T *q_out, T *k_out, int threads) {
#pragma omp parallel num_threads(threads) if (n * (nh + nkv) * hd >= PARALLEL_MIN_ELEMS)
    NAME(rope_team)(q, q_stride, k, k_stride, n, nh, nkv, hd, positions, cos, sin, q_out, k_out);
}

/* x: (n, 2*d) gate|up -> out (n, d) = silu(gate) * up, the silu rounded as torch rounds it. */
void NAME(silu_mul_team)(const T *x, T *out, int64_t n, int64_t d) {
#pragma omp for
    for (int64_t t = 0; t < n; t++) {
        const T *gate = x + t * 2 * d, *up = gate + d;
        T *o = out + t * d;
        for (int64_t i = 0; i < d; i++) {
            float g = LOAD(gate[i]);
            o[i] = STORE(ROUND(g / (1.0f + exp_approx(-g))) * LOAD(up[i]));
        }
    }
}

void NAME(tk_silu_mul)(const T *x, T *out, int64_t n, int64_t d, int threads) {
#pragma omp parallel num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    NAME(silu_mul_team)(x, out, n, d);
}

/* The index of the first maximum of row[0..d), NaN counting as the largest value (as torch's
 * max does); d >= 1. */
static int64_t NAME(row_argmax)(const T *row, int64_t d) {
    float best = -INFINITY;
    int any_nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + LANES <= d; i += LANES) {
        __m512 v = LOAD16(row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    any_nan = nan != 0;
    best = _mm512_reduce_max_ps(top);
#endif
    for (; i < d; i++) {
        float v = LOAD(row[i]);
        best = v > best ? v : best;
        any_nan |= v != v;
    }
    int64_t at = 0;
    if (any_nan) {
        while (LOAD(row[at]) == LOAD(row[at])) at++;
        return at;
    }
#if defined(__AVX512F__)
    __m512 wanted = _mm512_set1_ps(best);
    for (; at + LANES <= d; at += LANES) {
        __mmask16 hit = _mm512_cmp_ps_mask(LOAD16(row + at), wanted, _CMP_EQ_OQ);
        if (hit) return at + __builtin_ctz(hit);
    }
#endif
    while (LOAD(row[at]) != best) at++;
    return at;
}

/* out[r] = row_argmax of row r of x (n rows of d values, row stride xs). */
void NAME(tk_argmax)(const T *x, int64_t xs, int64_t n, int64_t d, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++) out[r] = NAME(row_argmax)(x + r * xs, d);
}

/* For the `count` keys of one page from `slot` on (pool rows of nkv * hd), KV heads
 * [g0, g1): scores[(g * group + j) * score_stride + i] = dot(q[g * group + j], key i of head
 * g), q and scores counted from head g0. count <= 16 with AVX-512. */
static void NAME(page_scores)(const float *restrict q, const T *restrict pool, int64_t slot,
                              int64_t count, int64_t g0, int64_t g1, int64_t nkv,
                              int64_t group, int64_t hd, float *restrict scores,
                              int64_t score_stride, float *restrict key) {
#if defined(__AVX512F__)
    (void)key; /* 16 keys at a time, their dot products held in 16 registers */
    for (int64_t g = g0; g < g1; g++) {
        const T *rows[16]; /* past `count`, the last key again: read, then masked off */
        for (int64_t i = 0; i < 16; i++)
            rows[i] = pool + ((slot + (i < count ? i : count - 1)) * nkv + g) * hd;
        for (int64_t j = (g - g0) * group; j < (g - g0 + 1) * group; j++) {
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
        for (int64_t g = g0; g < g1; g++) {
            const T *restrict k = pool + ((slot + i) * nkv + g) * hd;
            for (int64_t d = 0; d < hd; d++) key[d] = LOAD(k[d]);
            for (int64_t j = (g - g0) * group; j < (g - g0 + 1) * group; j++) {
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
 * KV heads [g0, g1) and the `count` values of one page from `slot` on. */
static void NAME(page_values)(const float *restrict weights, int64_t weight_stride,
                              const T *restrict pool, int64_t slot, int64_t count, int64_t g0,
                              int64_t g1, int64_t nkv, int64_t group, int64_t hd,
                              float *restrict acc, float *restrict value) {
#if defined(__AVX512F__)
    (void)value; /* each accumulator stays in a register across the page's values */
    for (int64_t g = g0; g < g1; g++) {
        const T *v = pool + (slot * nkv + g) * hd;
        for (int64_t j = (g - g0) * group; j < (g - g0 + 1) * group; j++) {
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
        for (int64_t g = g0; g < g1; g++) {
            const T *restrict v = pool + ((slot + i) * nkv + g) * hd;
            for (int64_t d = 0; d < hd; d++) value[d] = LOAD(v[d]);
            for (int64_t j = (g - g0) * group; j < (g - g0 + 1) * group; j++) {
                float w = weights[j * weight_stride + i];
                float *restrict aj = acc + j * hd;
                for (int64_t d = 0; d < hd; d++) aj[d] += w * value[d];
            }
        }
    }
#endif
}

/* In place: scores (n,) -> e^(score - max); returns their sum. */
static float NAME(softmax_weights)(float *restrict s, int64_t n) {
    float top[LANES], lane[LANES] = {0}; /* per-lane maxima and sums: both vectorize */
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) top[l] = s[i + l] > top[l] ? s[i + l] : top[l];
    for (; i < n; i++) top[0] = s[i] > top[0] ? s[i] : top[0];
    float best = top[0];
    for (int l = 1; l < LANES; l++) best = top[l] > best ? top[l] : best;
    for (i = 0; i < n; i++) s[i] = exp_approx(s[i] - best);
    for (i = 0; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += s[i + l];
    for (; i < n; i++) lane[0] += s[i];
    return sum_lanes(lane);
}

/* The n_new tokens' k and v (rows of nkv*hd values, row strides k_stride and v_stride) into
 * their slots[t] of the pools (P*S, nkv, hd). */
void NAME(kv_write_team)(const T *k, int64_t k_stride, const T *v, int64_t v_stride,
                         const int64_t *slots, int64_t n_new, T *k_pool, T *v_pool, int64_t nkv,
                         int64_t hd) {
#pragma omp for
    for (int64_t t = 0; t < n_new; t++) {
        memcpy(k_pool + slots[t] * nkv * hd, k + t * k_stride, nkv * hd * sizeof(T));
        memcpy(v_pool + slots[t] * nkv * hd, v + t * v_stride, nkv * hd * sizeof(T));
    }
}

/* Asks for the rows of positions [from, to) of a task's stream: its keys, positions [start,
 * ctx) of KV heads [g0, g1) on its pages, then its values over the same positions (stream
 * positions ctx - start and on). The loops read them in short strided runs (one key of a head
 * is hd values, the next a page row away) that the hardware prefetchers follow badly; asked
 * for PREFETCH_KEYS positions ahead of the one being read, the misses overlap the arithmetic. */
static void NAME(prefetch_stream)(const T *k_pool, const T *v_pool, const int32_t *pages,
                                  int64_t start, int64_t ctx, int64_t from, int64_t to,
                                  int64_t page_size, int64_t nkv, int64_t hd, int64_t g0,
                                  int64_t g1) {
    int64_t len = ctx - start, bytes = (g1 - g0) * hd * (int64_t)sizeof(T); /* of one key */
    to = to < 2 * len ? to : 2 * len;
    for (int64_t s = from; s < to; s++) {
        int64_t p = start + (s < len ? s : s - len);
        int64_t at = ((int64_t)pages[p / page_size] * page_size + p % page_size) * nkv + g0;
        const char *row = (const char *)((s < len ? k_pool : v_pool) + at * hd);
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
    }
}

/* Decode attention, one query token per row b: keys and values read in place from the pages
 * block_table[b] (row stride table_stride), positions [start, context_lens[b]) where
 * start = context - window when a sliding window is set (window > 0), else 0.
 * q: row q_rows[b] (b when q_rows is NULL) of a (?, nh*hd) tensor, row stride q_stride;
 * out: the same row of a contiguous (?, nh*hd) tensor. Pools: (P*S, nkv, hd).
 * A task is one row and `heads_per_task` of its KV heads (nkv: pages are read front to back;
 * 1 when there are too few rows to keep the threads busy). The query heads that share a KV head
 * are done together, reading each key once. Scores and softmax in float32, two passes over the
 * pages (scores; weighted values): bfloat16 K/V in attention_vec_impl.h's loops on the vector
 * tiers, else in this file's. scratch: attention_scratch(...) floats per thread of the
 * team. Needs hd % 16 == 0 and nh / nkv <= MAX_GROUP (the wrapper checks). */
void NAME(decode_attention_team)(const T *q, int64_t q_stride, const int64_t *q_rows,
                                 const T *k_pool, const T *v_pool, const int32_t *block_table,
                                 int64_t table_stride, const int32_t *context_lens, int64_t n,
                                 int64_t nh, int64_t nkv, int64_t hd, int64_t page_size,
                                 int64_t window, float scale, T *out, int64_t heads_per_task,
                                 float *scratch) {
    int64_t group = nh / nkv, max_ctx = max_context(context_lens, n);
    int64_t tasks_per_row = nkv / heads_per_task, task_heads = heads_per_task * group;
    int64_t per_thread = attention_scratch(heads_per_task * group, max_ctx, hd);
    int lanes = KV_VEC ? kv_lanes(hd) : 0;
    int64_t block = lanes > 0 ? lanes : 16; /* keys a scores call takes at most */
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * tasks_per_row; task++) {
        float *scores = scratch + per_thread * omp_get_thread_num();
        float *qf = scores + task_heads * max_ctx, *acc = qf + task_heads * hd;
        float *key = acc + task_heads * hd, *total = key + hd;
        int64_t b = task / tasks_per_row, g0 = task % tasks_per_row * heads_per_task;
        int64_t g1 = g0 + heads_per_task, ctx = context_lens[b];
        int64_t start = window > 0 && ctx > window ? ctx - window : 0, len = ctx - start;
        int64_t row = q_rows != NULL ? q_rows[b] : b;
        const T *qrow = q + row * q_stride + g0 * group * hd;
        const int32_t *pages = block_table + b * table_stride;
        NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx, 0, PREFETCH_KEYS, page_size,
                              nkv, hd, g0, g1);
#if KV_VEC
        const void *qv = lanes > 0 ? kv_prepare_q(lanes, qrow, task_heads, hd, qf) : qf;
#endif
        if (lanes == 0)
            for (int64_t i = 0; i < task_heads * hd; i++) qf[i] = LOAD(qrow[i]) * scale;
        for (int64_t p = start; p < ctx;) {
            int64_t first = p % page_size, count = page_size - first; /* keys left in page */
            count = count < ctx - p ? count : ctx - p;
            count = count < block ? count : block;
            int64_t slot = (int64_t)pages[p / page_size] * page_size + first;
            NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx, p - start + PREFETCH_KEYS,
                                  p - start + count + PREFETCH_KEYS, page_size, nkv, hd, g0, g1);
            float *at = scores + p - start;
#if KV_VEC
            if (lanes > 0)
                kv_scores(lanes, qv, scale, k_pool, slot, count, g0, g1, nkv, group, hd, at,
                          max_ctx);
            else
#endif
                NAME(page_scores)(qf, k_pool, slot, count, g0, g1, nkv, group, hd, at, max_ctx,
                                  key);
            p += count;
        }
        for (int64_t h = 0; h < task_heads; h++)
            total[h] = NAME(softmax_weights)(scores + h * max_ctx, len);
        memset(acc, 0, sizeof(float) * task_heads * hd);
        for (int64_t p = start; p < ctx;) {
            int64_t first = p % page_size, count = page_size - first;
            count = count < ctx - p ? count : ctx - p;
            int64_t slot = (int64_t)pages[p / page_size] * page_size + first;
            int64_t s = len + p - start + PREFETCH_KEYS;
            NAME(prefetch_stream)(k_pool, v_pool, pages, start, ctx, s, s + count, page_size,
                                  nkv, hd, g0, g1);
            const float *w = scores + p - start;
#if KV_VEC
            if (lanes > 0)
                kv_values(lanes, w, max_ctx, v_pool, slot, count, g0, g1, nkv, group, hd, acc);
            else
#endif
                NAME(page_values)(w, max_ctx, v_pool, slot, count, g0, g1, nkv, group, hd, acc,
                                  key);
            p += count;
        }
        T *o = out + row * nh * hd + g0 * group * hd;
#if KV_VEC
        if (lanes > 0)
            kv_store_out(lanes, acc, total, task_heads, hd, o);
        else
#endif
            for (int64_t h = 0; h < task_heads; h++)
                for (int64_t d = 0; d < hd; d++) o[h * hd + d] = STORE(acc[h * hd + d] / total[h]);
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
    int64_t keys = 0;
    for (int64_t b = 0; b < n; b++) keys += context_lens[b];
    int team = keys * nkv >= PARALLEL_MIN_KEYS ? threads : 1;
    int64_t heads_per_task = attention_heads_per_task(n, nkv, team);
    float *scratch = malloc(sizeof(float) * team *
                            attention_scratch(heads_per_task * (nh / nkv), max_context(context_lens, n), hd));
    if (scratch == NULL) return -1;
#pragma omp parallel num_threads(team)
    NAME(decode_attention_team)(q, q_stride, q_rows, k_pool, v_pool, block_table, table_stride,
                                context_lens, n, nh, nkv, hd, page_size, window, scale, out,
                                heads_per_task, scratch);
    free(scratch);
    return 0;
}
