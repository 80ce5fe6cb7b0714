/* The all-reduce of a tensor-parallel group's same-host ranks, for float32 and bfloat16
 * (each_type.h), through the shared memory of shared/parallel/shm_group.py (shm_reduce,
 * kernels.h): this rank's part goes to its slot of the step's set, one thread publishes the
 * step and waits for every peer's, then the team sums each element in float32 in rank order
 * and rounds it once, as shm_group.py's torch sum did. The op-by-op layers (ShmGroup.all_reduce)
 * and the fused decoder (decode_layer.c, between a layer's kernels) both run it, so they give
 * the same bits, and a decode step's all-reduces cost a copy, a wait and a sum: no Python. */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define REDUCE_BLOCK 256 /* elements summed at a time: their float32 sums stay in L1 */

/* One thread: publishes step `step` (this rank's part in its slot, fitting: flag 1), waits for
 * every rank's, and checks that every part fit (else its rank went to the process group). */
static void publish_and_wait(shm_reduce *G, int64_t step) {
    const int64_t flag = 1 + step % 2; /* a flag a parity, as shm_group.py's */
    int64_t *line = G->lines + G->rank * G->line;
    line[flag] = 1; /* read by the peers once they see the step (the release in post) */
    G->post(line, step);
    int64_t status = G->wait(G->lines, G->line, G->pids, G->size, step, G->timeout_s);
    for (int64_t r = 0; r < G->size && status == 0; r++)
        if (G->lines[r * G->line + flag] != 1) status = -2 - G->size;
    G->step = step;
    G->error = status;
}

#define TYPED_FILE "all_reduce.c"
#include "each_type.h"
#else
/* Inside a region (or alone): x (count elements, count * sizeof(T) <= slot_bytes) summed over
 * the ranks in place. Returns 0 or the failed step's status (G->error), on every thread. */
int64_t NAME(all_reduce_team)(shm_reduce *G, T *x, int64_t count) {
    const int64_t step = G->step + 1; /* read by every thread before the single one moves it */
    uint8_t *set = G->slots + step % 2 * G->size * G->slot_bytes;
    T *mine = (T *)(set + G->rank * G->slot_bytes);
#pragma omp for
    for (int64_t i = 0; i < count; i += REDUCE_BLOCK)
        memcpy(mine + i, x + i, sizeof(T) * (count - i < REDUCE_BLOCK ? count - i : REDUCE_BLOCK));
#pragma omp single
    publish_and_wait(G, step);
    if (G->error != 0) return G->error; /* after the single's barrier: the same on every thread */
#pragma omp for
    for (int64_t i0 = 0; i0 < count; i0 += REDUCE_BLOCK) {
        const int64_t m = count - i0 < REDUCE_BLOCK ? count - i0 : REDUCE_BLOCK;
        float sum[REDUCE_BLOCK];
        const T *part = (const T *)set + i0;
        for (int64_t i = 0; i < m; i++) sum[i] = LOAD(part[i]);
        for (int64_t r = 1; r < G->size; r++) {
            part = (const T *)(set + r * G->slot_bytes) + i0;
            for (int64_t i = 0; i < m; i++) sum[i] += LOAD(part[i]);
        }
        for (int64_t i = 0; i < m; i++) x[i0 + i] = STORE(sum[i]);
    }
    return 0;
}

int64_t NAME(tk_all_reduce)(shm_reduce *G, T *x, int64_t count, int threads) {
    int64_t status = 0;
#pragma omp parallel num_threads(threads) if (count >= PARALLEL_MIN_ELEMS)
    {
        int64_t mine = NAME(all_reduce_team)(G, x, count);
#pragma omp single
        status = mine;
    }
    return status;
}
#endif
