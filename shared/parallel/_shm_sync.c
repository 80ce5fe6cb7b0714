/* The signals of shm_group.py's collectives between processes of one host: each rank's step
 * counter, in a mapping they share, published with release and read with acquire order, so
 * that a rank that sees a peer's counter reach a step also sees the data the peer wrote for it.
 * Portable C11 atomics (GCC builtins); no ISA tier. */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
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

/* Whether process pid is gone: no such process, or one that has exited and waits for its
 * parent to reap it (a zombie: rank 0 is the parent of the other ranks, and kill() still
 * finds a zombie), as /proc tells where there is one. */
static int gone(int64_t pid) {
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = 0;
    const char *end = strrchr(stat, ')'); /* "pid (comm) S ...": comm may hold spaces */
    return end != NULL && (end[2] == 'Z' || end[2] == 'X');
}

/* Until the counter of every rank r < size (at counters + r * stride) reaches `step`: 0; or
 * -1 - r when rank r's process (pids[r]) is gone (or a zombie) before, or -1 - size after
 * timeout_s. Spins a little (a peer a few microseconds behind), then yields the core between
 * looks, then naps 20 us at a time, and after a third of a second or so 1 ms (an idle rank
 * waiting for its next step plan, plan_channel.py). */
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
            } else { /* a long wait (another rank's prompt): look every 20 us, then 1 ms */
                const struct timespec nap = {0, i < 65536 + 16384 ? 20000 : 1000000};
                nanosleep(&nap, NULL);
            }
            if (i % 4096 == 0) {
                if (gone(pids[r])) return -1 - r;
                if (now_s() - start > timeout_s) return -1 - size;
            }
        }
    }
    return 0;
}
