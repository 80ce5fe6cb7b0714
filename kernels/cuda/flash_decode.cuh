// One block's share of paged decode attention (paged_attention.cu): the keys of one partition
// of a row for a group of query heads that read the same K/V rows, in four phases:
//   1. the group's queries, times scale, into shared memory as float32;
//   2. scores: one thread a key, its K row read in 16-byte pieces (VEC elements), dotted with
//      up to TILE query heads at once (the queries are broadcast reads of shared memory);
//   3. softmax numerators: one warp a head, max and sum by warp shuffles;
//   4. P.V: groups of `lanes` threads read one V row together (coalesced, VEC elements a
//      thread, `lanes` = the row's 16-byte pieces, at most 32), each group over its own keys;
//      the groups' sums are added in shared memory in group order (deterministic).
// VEC is 16 / sizeof(element) where rows are 16-byte aligned, else 1 (any head size).
// Accumulation is float32 throughout; outputs are rounded to the element type once.
#pragma once

#include "common.cuh"

#define TISON_ATTN_TILE 8  // query heads a thread accumulates at once (more: K read per tile)
#define TISON_ATTN_AHEAD 4  // 16-byte loads a thread issues before using the first

TISON_DEVICE int tison_attn_min(int a, int b) { return a < b ? a : b; }
TISON_DEVICE int tison_attn_max(int a, int b) { return a > b ? a : b; }

// VEC elements at p widened to float: one 16-byte load, or one element when VEC is 1.
template <int VEC, class T> TISON_DEVICE void tison_attn_load(const T *p, float *f) {
    if constexpr (VEC == 1) {
        f[0] = tison_load(p, 0);
    } else {
        for (int i = 0; i < VEC; i += 16 / (int)sizeof(T)) tison_load16(p + i, f + i);
    }
}

// One block's work: a row's keys [first, last) of one partition for `heads` query heads.
template <class T> struct TisonAttnJob {
    const T *q_a, *q_b;      // the block's first head's query: dims [0, q_a_dim), the rest
    int q_a_dim, q_b_dim;    // elements a head of each part (GQA: hd and 0)
    const T *k, *v;          // K and V of pool slot 0 (GQA: the block's KV head already added)
    tison_i64 token_stride;  // elements from one pool slot to the next
    const int *pages;        // the row's block table
    int page_size, dk, dv;   // key and value sizes (MLA: R + Dr and R, both from one row)
    int heads, first, last;  // query heads; the row's visible keys, cut to the partition
    float scale;
};

// Where the block's results go: heads (row * nh + head0 + g), g < job.heads.
template <class T> struct TisonAttnOut {
    float *part_max, *part_sum, *part_out;  // (B, nh, NP), (B, nh, NP), (B, nh, NP, dv)
    T *out;                                 // (B, nh, dv): written directly when NP is 1
    tison_i64 head;                         // row * nh + the block's first head
    int num_partitions, partition, partition_size;
};

template <class T> TISON_DEVICE tison_i64 tison_attn_slot(const TisonAttnJob<T> &job, int pos) {
    tison_i64 page = job.pages[pos / job.page_size];
    return (page * job.page_size + pos % job.page_size) * job.token_stride;
}

// Phase 2: scores[g][t] = (q_g * scale) . k_(first + t), one thread a key (its row read again
// from L1 for each further tile of heads).
template <class T, int VEC>
TISON_DEVICE void tison_attn_scores(const TisonAttnJob<T> &job, const float *q_s, float *s_s,
                                    int stride) {
    int n = job.last - job.first;
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const T *key = job.k + tison_attn_slot(job, job.first + t);
        for (int g0 = 0; g0 < job.heads; g0 += TISON_ATTN_TILE) {
            int tile = tison_attn_min(TISON_ATTN_TILE, job.heads - g0);
            float acc[TISON_ATTN_TILE] = {};
            for (int i0 = 0; i0 < job.dk; i0 += TISON_ATTN_AHEAD * VEC) {
                float kf[TISON_ATTN_AHEAD][VEC], qf[VEC];
                for (int u = 0; u < TISON_ATTN_AHEAD; u++)  // the loads first: all in flight
                    if (i0 + u * VEC < job.dk) tison_attn_load<VEC>(key + i0 + u * VEC, kf[u]);
                for (int u = 0; u < TISON_ATTN_AHEAD; u++) {
                    int i = i0 + u * VEC;
                    if (i >= job.dk) break;
                    for (int j = 0; j < TISON_ATTN_TILE; j++) {
                        if (j >= tile) break;
                        tison_attn_load<VEC>(q_s + (g0 + j) * job.dk + i, qf);
                        for (int e = 0; e < VEC; e++) acc[j] += qf[e] * kf[u][e];
                    }
                }
            }
            for (int j = 0; j < tile; j++) s_s[(g0 + j) * stride + t] = acc[j];
        }
    }
}

// Phase 3: each head's scores -> exp(score - max), one warp a head; max and sum into stats.
TISON_DEVICE void tison_attn_softmax(float *s_s, int stride, int n, int heads, float *stats) {
    int lane = threadIdx.x % TISON_WARP, warp = threadIdx.x / TISON_WARP;
    for (int g = warp; g < heads; g += blockDim.x / TISON_WARP) {
        float *s = s_s + g * stride;
        float top = -3.0e38f;
        for (int t = lane; t < n; t += TISON_WARP) top = fmaxf(top, s[t]);
        top = tison_warp_max(top);
        float sum = 0.0f;
        for (int t = lane; t < n; t += TISON_WARP) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        sum = tison_warp_sum(sum);
        if (lane == 0) stats[g] = top, stats[heads + g] = sum;
    }
}

// One value of the block's output: head g, dimension d, the partition's sum p . v.
template <class T>
TISON_DEVICE void tison_attn_emit(const TisonAttnOut<T> &o, int dv, int heads, const float *stats,
                                  int g, int d, float value) {
    if (o.num_partitions == 1) {
        tison_store(o.out, (o.head + g) * dv + d, value / stats[heads + g]);
    } else {
        o.part_out[((o.head + g) * o.num_partitions + o.partition) * dv + d] = value;
    }
}

// Phase 4: out[g] = sum_t p[g][t] v_t; groups of `lanes` threads share a V row, VEC each.
// red: tile * lanes * VEC floats of shared memory (the queries' space, free by now).
template <class T, int VEC>
TISON_DEVICE void tison_attn_values(const TisonAttnJob<T> &job, const TisonAttnOut<T> &o,
                                    const float *p_s, int stride, const float *stats, float *red) {
    int n = job.last - job.first, chunks = job.dv / VEC;
    int lanes = tison_attn_min(chunks, TISON_WARP), groups = blockDim.x / lanes;
    int group = threadIdx.x / lanes, lane = threadIdx.x % lanes;
    for (int g0 = 0; g0 < job.heads; g0 += TISON_ATTN_TILE) {
        int tile = tison_attn_min(TISON_ATTN_TILE, job.heads - g0);
        for (int c0 = 0; c0 < chunks; c0 += lanes) {
            int c = c0 + lane;
            bool active = group < groups && c < chunks;
            float acc[TISON_ATTN_TILE][VEC] = {};
            for (int t0 = group; active && t0 < n; t0 += TISON_ATTN_AHEAD * groups) {
                float vf[TISON_ATTN_AHEAD][VEC];
                for (int u = 0; u < TISON_ATTN_AHEAD; u++) {  // the loads first: all in flight
                    int t = t0 + u * groups;
                    if (t < n)
                        tison_attn_load<VEC>(job.v + tison_attn_slot(job, job.first + t) + c * VEC,
                                             vf[u]);
                }
                for (int u = 0; u < TISON_ATTN_AHEAD; u++) {
                    int t = t0 + u * groups;
                    if (t >= n) break;
                    for (int j = 0; j < TISON_ATTN_TILE; j++) {
                        if (j >= tile) break;
                        float p = p_s[(g0 + j) * stride + t];
                        for (int e = 0; e < VEC; e++) acc[j][e] += p * vf[u][e];
                    }
                }
            }
            for (int r = 0; r < groups; r++) {  // every thread passes every barrier
                if (group == r && active) {
                    for (int j = 0; j < tile; j++)
                        for (int e = 0; e < VEC; e++) {
                            float *x = red + (j * lanes + lane) * VEC + e;
                            *x = (r == 0 ? 0.0f : *x) + acc[j][e];
                        }
                }
                __syncthreads();
            }
            int width = tison_attn_min(lanes, chunks - c0) * VEC;
            for (int i = threadIdx.x; i < tile * width; i += blockDim.x) {
                int j = i / width, d = i % width;
                tison_attn_emit(o, job.dv, job.heads, stats, g0 + j, c0 * VEC + d,
                                red[j * lanes * VEC + d]);
            }
            __syncthreads();  // red is read before the next pass adds into it
        }
    }
}

// A block's partition: phases 1-4. smem: heads * (dk + partition_size + 2) floats.
template <class T, int VEC>
TISON_DEVICE void tison_attend(const TisonAttnJob<T> &job, const TisonAttnOut<T> &o, float *smem) {
    int stride = o.partition_size, n = job.last - job.first;
    float *q_s = smem;                          // (heads, dk); later the groups' sums
    float *s_s = q_s + job.heads * job.dk;      // (heads, stride): scores, then numerators
    float *stats = s_s + job.heads * stride;    // (2, heads): max, sum
    for (int i = threadIdx.x; i < job.heads * job.dk; i += blockDim.x) {
        int g = i / job.dk, d = i % job.dk;
        int e = d - job.q_a_dim;  // the second part's dimension
        float x = e < 0 ? tison_load(job.q_a, (tison_i64)g * job.q_a_dim + d)
                        : tison_load(job.q_b, (tison_i64)g * job.q_b_dim + e);
        q_s[i] = x * job.scale;
    }
    __syncthreads();
    tison_attn_scores<T, VEC>(job, q_s, s_s, stride);
    __syncthreads();
    tison_attn_softmax(s_s, stride, n, job.heads, stats);
    __syncthreads();
    if (o.num_partitions > 1) {
        for (int g = threadIdx.x; g < job.heads; g += blockDim.x) {
            tison_i64 at = (o.head + g) * o.num_partitions + o.partition;
            o.part_max[at] = stats[g], o.part_sum[at] = stats[job.heads + g];
        }
    }
    tison_attn_values<T, VEC>(job, o, s_s, stride, stats, q_s);
}

// Runs the job, or (no visible key in the partition) zeroes a lone partition's output; a
// multi-partition row's empty partitions write nothing (the reduce kernel skips them).
template <class T>
TISON_DEVICE void tison_attend_any(TisonAttnJob<T> &job, const TisonAttnOut<T> &o, int vectorized) {
    TISON_DYNAMIC_SMEM(smem);
    job.first = tison_attn_max(job.first, o.partition * o.partition_size);
    job.last = tison_attn_min(job.last, (o.partition + 1) * o.partition_size);
    if (job.last <= job.first) {
        if (o.num_partitions > 1) return;
        for (int i = threadIdx.x; i < job.heads * job.dv; i += blockDim.x)
            tison_store(o.out, o.head * job.dv + i, 0.0f);
        return;
    }
    if (vectorized) {
        tison_attend<T, (int)(16 / sizeof(T))>(job, o, (float *)smem);
    } else {
        tison_attend<T, 1>(job, o, (float *)smem);
    }
}
