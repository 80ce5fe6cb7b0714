/* A team loop's units (a linear's groups of outputs) shared out as the threads go: thread t
 * starts on the t-th of T equal runs (schedule(static)'s part, so that at equal speed each
 * reads one stream), takes SHARE_CHUNK units at a time from its front, and once its own run is
 * empty takes half of what is left of another's from the back, until every run is empty. A
 * static split leaves the faster thread waiting at the loop's end whenever the cores run at
 * unequal speed: on a shared Zen 4 VM, for seconds at a time, 0.2-1 ms of a 6 ms batch-1 step
 * at its upper bandwidth level; hybrid laptops' efficiency cores would do it always. A unit is
 * still one thread's whole work, so the results are the same bits whoever takes it. Against
 * the static split, alternated in one engine (Zen 4, 2 threads), the fused batch-1 call took
 * 0.958x the time with the dense model (rounds 0.91-1.02), 0.985x MoE, 0.981x Llama 4 on
 * avx512_bf16, 0.984x dense on avx2; batch 32 0.96-1.01x. */
#ifndef TISON_SHARES_H
#define TISON_SHARES_H
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_SHARES 256 /* threads a team's shares hold; a larger team keeps the static split */
#define SHARE_CHUNK 4 /* units its owner takes at a time (1 or 16: no faster) */

/* A thread's run [front, back) of the loop, as front << 32 | back (units < 2^32), on a cache
 * line of its own. Between loops every run is empty: a thread that looks at another's before
 * its owner has started it on a new loop finds nothing to take. */
typedef struct {
    _Atomic uint64_t run;
    char pad[64 - sizeof(uint64_t)];
} share;

#define SHARES_BYTES ((int64_t)sizeof(share) * MAX_SHARES)

/* Empty runs, for shares just allocated. */
static inline void shares_clear(share *shares) {
    for (int t = 0; t < MAX_SHARES; t++) atomic_init(&shares[t].run, 0);
}

/* Thread t of T: its part of `units` as its run. */
static inline void share_start(share *shares, int64_t units, int t, int T) {
    uint64_t front = (uint64_t)(units * t / T), back = (uint64_t)(units * (t + 1) / T);
    atomic_store_explicit(&shares[t].run, front << 32 | back, memory_order_relaxed);
}

/* Takes from s's front (up to `chunk` units) or, with chunk 0, half of what is left (at least
 * one unit) from its back, into [*lo, *hi). Returns 0 when s is empty. */
static inline int share_take(share *s, int64_t chunk, int64_t *lo, int64_t *hi) {
    uint64_t run = atomic_load_explicit(&s->run, memory_order_relaxed), next;
    for (;;) {
        int64_t front = (int64_t)(run >> 32), back = (int64_t)(run & 0xffffffffu);
        if (front >= back) return 0;
        if (chunk > 0) {
            *lo = front, *hi = back - front > chunk ? front + chunk : back;
            next = (uint64_t)*hi << 32 | (uint64_t)back;
        } else {
            *hi = back, *lo = back - ((back - front) / 2 > 0 ? (back - front) / 2 : 1);
            next = (uint64_t)front << 32 | (uint64_t)*lo;
        }
        if (atomic_compare_exchange_weak_explicit(&s->run, &run, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            return 1;
    }
}

/* Thread t's next units [*lo, *hi): its own run's front, else the back of another's. Returns 0
 * when every run is empty. */
static inline int share_next(share *shares, int t, int T, int64_t *lo, int64_t *hi) {
    if (share_take(&shares[t], SHARE_CHUNK, lo, hi)) return 1;
    for (int v = 1; v < T; v++)
        if (share_take(&shares[(t + v) % T], 0, lo, hi)) return 1;
    return 0;
}

/* A thread's runs of a team loop: the team's shares, or where the team is larger than they
 * hold (or the units more than a run counts), its static part alone. */
typedef struct {
    share *shares;
    int t, T, done;
    int64_t units;
} runs;

/* In a team (or alone), before the loop: this thread's run of `units` started. */
static inline runs runs_start(share *shares, int64_t units) {
    runs r = {shares, omp_get_thread_num(), omp_get_num_threads(), 0, units};
    if (r.T > MAX_SHARES || units > (int64_t)UINT32_MAX)
        r.shares = NULL;
    else
        share_start(shares, units, r.t, r.T);
    return r;
}

/* This thread's next units [*lo, *hi); 0 when it has none left to take. */
static inline int runs_next(runs *r, int64_t *lo, int64_t *hi) {
    if (r->shares != NULL) return share_next(r->shares, r->t, r->T, lo, hi);
    if (r->done) return 0;
    r->done = 1, *lo = r->units * r->t / r->T, *hi = r->units * (r->t + 1) / r->T;
    return *lo < *hi;
}
#endif
