// Paged decode attention (one query token a row) over a layer's KV pages, flash-decoding style,
// for GQA/MHA pools (2, P, S, nkv, hd) and MLA latent pools (P, S, R + Dr). Wrapper, launch
// arithmetic and torch references: attention.py.
//
// Launch: tison_*_part_* runs one block of 128 threads per (partition, head group, row): grid
// (num_partitions, num_kv_heads or head tiles, B). A partition is a span of partition_size key
// positions (the row's block table laid end to end), so one long row still gives many blocks;
// a head group is the GQA group of one KV head (or up to heads_per_block MLA heads, which all
// share the latent), so each K/V row is read from memory once per block and used by every
// query head of the group. The block leaves, per head, its partition's max score, sum of
// exp(score - max) and unnormalised output; tison_decode_reduce_* (grid (nh, B), 128 threads)
// merges a row's partitions. With one partition the block writes the normalised output itself
// and the reduce kernel is not launched.
//
// Inside a block: flash_decode.cuh. Shared memory: the group's queries, the partition's
// scores, two stats a head (attention.py's _smem).
#include "flash_decode.cuh"

// The keys a row sees, as positions in its block table's pages laid end to end: [*first, ctx)
// with ctx returned. Window 0: none; has_first_key 0: first_key is not read.
TISON_DEVICE int tison_attn_span(const int *context_lens, const int *first_key, int has_first_key,
                                 int window, int max_keys, int row, int *first) {
    int ctx = tison_attn_min(context_lens[row], max_keys);  // never past the table's pages
    int start = window > 0 ? ctx - window : 0;
    if (has_first_key) start = tison_attn_max(start, first_key[row]);
    *first = tison_attn_max(start, 0);
    return ctx;
}

// GQA/MHA: block (partition, kv head, row) for the kv head's nh / nkv query heads.
template <class T>
TISON_DEVICE void tison_paged_decode_part(
    const T *q, const T *k_pages, const T *v_pages, const int *block_table, int max_pages,
    const int *context_lens, const int *first_key, int has_first_key, int window, int page_size,
    int num_heads, int num_kv_heads, int head_dim, float scale, int partition_size, int vectorized,
    float *part_max, float *part_sum, float *part_out, T *out) {
    int row = blockIdx.z, kv_head = blockIdx.y, group = num_heads / num_kv_heads;
    tison_i64 head = (tison_i64)row * num_heads + kv_head * group;
    TisonAttnJob<T> job;
    job.q_a = job.q_b = q + head * head_dim;
    job.q_a_dim = head_dim, job.q_b_dim = 0;
    job.k = k_pages + kv_head * head_dim, job.v = v_pages + kv_head * head_dim;
    job.token_stride = (tison_i64)num_kv_heads * head_dim;
    job.pages = block_table + (tison_i64)row * max_pages;
    job.page_size = page_size, job.dk = job.dv = head_dim, job.heads = group;
    job.last = tison_attn_span(context_lens, first_key, has_first_key, window,
                               max_pages * page_size, row, &job.first);
    job.scale = scale;
    TisonAttnOut<T> o = {part_max, part_sum, part_out, out, head, (int)gridDim.x,
                         (int)blockIdx.x, partition_size};
    tison_attend_any(job, o, vectorized);
}

// MLA (absorbed): block (partition, head tile, row) for up to heads_per_block heads; key =
// latent + rope part of a pool row, value = its latent.
template <class T>
TISON_DEVICE void tison_mla_decode_part(
    const T *q_latent, const T *q_rope, const T *pool, const int *block_table, int max_pages,
    const int *context_lens, int page_size, int num_heads, int rank, int rope_dim, float scale,
    int partition_size, int heads_per_block, int vectorized, float *part_max, float *part_sum,
    float *part_out, T *out) {
    int row = blockIdx.z, head0 = blockIdx.y * heads_per_block;
    tison_i64 head = (tison_i64)row * num_heads + head0;
    TisonAttnJob<T> job;
    job.q_a = q_latent + head * rank, job.q_b = q_rope + head * rope_dim;
    job.q_a_dim = rank, job.q_b_dim = rope_dim;
    job.k = job.v = pool;
    job.token_stride = rank + rope_dim;
    job.pages = block_table + (tison_i64)row * max_pages;
    job.page_size = page_size, job.dk = rank + rope_dim, job.dv = rank;
    job.heads = tison_attn_min(heads_per_block, num_heads - head0);
    job.last = tison_attn_span(context_lens, context_lens, 0, 0, max_pages * page_size, row,
                               &job.first);
    job.scale = scale;
    TisonAttnOut<T> o = {part_max, part_sum, part_out, out, head, (int)gridDim.x,
                         (int)blockIdx.x, partition_size};
    tison_attend_any(job, o, vectorized);
}

// Block (head, row): merges the row's partitions p (weights exp(max_p - max) rescale each
// partition's sum and output) into out (B, nh, dim).
template <class T>
TISON_DEVICE void tison_decode_reduce(const float *part_max, const float *part_sum,
                                      const float *part_out, const int *context_lens,
                                      const int *first_key, int has_first_key, int window,
                                      int max_keys, int num_heads, int dim, int partition_size,
                                      int num_partitions, T *out) {
    int row = blockIdx.y, first;
    tison_i64 head = (tison_i64)row * num_heads + blockIdx.x;
    int ctx =
        tison_attn_span(context_lens, first_key, has_first_key, window, max_keys, row, &first);
    if (ctx <= first) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) tison_store(out, head * dim + d, 0.0f);
        return;
    }
    int p0 = first / partition_size, p1 = (ctx - 1) / partition_size;
    const float *m = part_max + head * num_partitions, *l = part_sum + head * num_partitions;
    float top = -3.0e38f, total = 0.0f;
    for (int p = p0; p <= p1; p++) top = fmaxf(top, m[p]);
    for (int p = p0; p <= p1; p++) total += expf(m[p] - top) * l[p];
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = p0; p <= p1; p++)
            acc += expf(m[p] - top) * part_out[(head * num_partitions + p) * dim + d];
        tison_store(out, head * dim + d, acc / total);
    }
}

// The kernels, one a dtype (suffix as runtime.suffix names it).
#define TISON_PAGED_ATTENTION_KERNELS(S, T)                                                    \
    TISON_KERNEL void tison_paged_decode_part_##S(                                             \
        const T *q, const T *k_pages, const T *v_pages, const int *block_table, int max_pages, \
        const int *context_lens, const int *first_key, int has_first_key, int window,          \
        int page_size, int num_heads, int num_kv_heads, int head_dim, float scale,             \
        int partition_size, int vectorized, float *part_max, float *part_sum,                  \
        float *part_out, T *out) {                                                             \
        tison_paged_decode_part<T>(q, k_pages, v_pages, block_table, max_pages, context_lens,  \
                                   first_key, has_first_key, window, page_size, num_heads,     \
                                   num_kv_heads, head_dim, scale, partition_size, vectorized,  \
                                   part_max, part_sum, part_out, out);                         \
    }                                                                                          \
    TISON_KERNEL void tison_mla_decode_part_##S(                                               \
        const T *q_latent, const T *q_rope, const T *pool, const int *block_table,             \
        int max_pages, const int *context_lens, int page_size, int num_heads, int rank,        \
        int rope_dim, float scale, int partition_size, int heads_per_block, int vectorized,    \
        float *part_max, float *part_sum, float *part_out, T *out) {                           \
        tison_mla_decode_part<T>(q_latent, q_rope, pool, block_table, max_pages, context_lens, \
                                 page_size, num_heads, rank, rope_dim, scale, partition_size,  \
                                 heads_per_block, vectorized, part_max, part_sum, part_out,    \
                                 out);                                                         \
    }                                                                                          \
    TISON_KERNEL void tison_decode_reduce_##S(                                                 \
        const float *part_max, const float *part_sum, const float *part_out,                   \
        const int *context_lens, const int *first_key, int has_first_key, int window,          \
        int max_keys, int num_heads, int dim, int partition_size, int num_partitions, T *out) { \
        tison_decode_reduce<T>(part_max, part_sum, part_out, context_lens, first_key,          \
                               has_first_key, window, max_keys, num_heads, dim,                \
                               partition_size, num_partitions, out);                           \
    }

TISON_PAGED_ATTENTION_KERNELS(f32, float)
TISON_PAGED_ATTENTION_KERNELS(bf16, tison_bf16)
