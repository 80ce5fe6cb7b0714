/* The signals of shm_group.py's collectives between processes of one host: each rank's step
 * counter, in a mapping they share, published with release and read with acquire order, so
 * that a rank that sees a peer's counter reach a step also sees the data the peer wrote for it.
 * Portable C11 atomics (GCC builtins); no ISA tier. */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

void tison_shm_post(int64_t *counter, int64_t step) {
    __atomic_store_n(counter, step, __ATOMIC_RELEASE);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Until the counter of every rank r < size (at counters + r * stride) reaches `step`: 0; or
 * -1 - r when rank r's process (pids[r]) is gone before, or -1 - size after timeout_s. Spins a
 * little (a peer a few microseconds behind), then yields the core between looks, then naps. */
int64_t tison_shm_wait(const int64_t *counters, int64_t stride, const int64_t *pids, int64_t size,
                       int64_t step, double timeout_s) {
    const double start = now_s();
    for (int64_t r = 0; r < size; r++) {
        for (int64_t i = 0; __atomic_load_n(counters + r * stride, __ATOMIC_ACQUIRE) < step; i++) {
            if (i < 4096) {
                relax();
                continue;
            }
            if (i < 65536) {
                sched_yield(); /* another rank may need this core */
            } else { /* a long wait (another rank's prompt): look every 20 us */
                const struct timespec nap = {0, 20000};
                nanosleep(&nap, NULL);
            }
            if (i % 4096 == 0) {
                if (kill((pid_t)pids[r], 0) != 0 && errno == ESRCH) return -1 - r;
                if (now_s() - start > timeout_s) return -1 - size;
            }
        }
    }
    return 0;
}
