/* Helper threads kept between decoding calls. Starting a thread costs about 20 us here, and
 * waking one asleep on a futex another 20 us (an idle virtual CPU is slow to resume), while
 * a loader decodes tensor by tensor, many of them in a few hundred microseconds. So
 * tc_run_parallel keeps the helpers it starts, and both sides spin for a short while before
 * they sleep: helpers after a call (the next one usually follows within tens of
 * microseconds), the calling thread while its helpers finish. Between tc_pool_poll(1) and
 * tc_pool_poll(-1) helpers poll without end: an encoder returns to Python between its calls
 * for longer than SPIN_NS (laying out planes, loading the next tensors). One call uses the
 * helpers at a time: a concurrent call (from another Python thread) starts threads of its
 * own. A forked child, which has none of the parent's threads, starts afresh. */
#include <pthread.h>
#include <time.h>

#include "_codec.h"

#define MAX_HELPERS 63
#define SPIN_NS 200000 /* how long a thread polls before it sleeps */

static struct {
    pthread_mutex_t lock; /* guards the fields below; the counters are also polled unlocked */
    pthread_cond_t wake;  /* helpers sleep here between calls */
    pthread_cond_t done;  /* the calling thread sleeps here while its helpers finish */
    int helpers;          /* started and alive */
    int sleepers;         /* helpers asleep on `wake` */
    int busy;             /* a call is using the helpers */
    int wanted;           /* helpers the current call still asks for (atomic) */
    int running;          /* helpers the current call waits for (atomic) */
    int polling;          /* tc_pool_poll(1) calls not yet undone: no sleeping (atomic) */
    void *(*fn)(void *);
    void *arg;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static pthread_once_t once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Polls *counter for up to SPIN_NS (or while tc_pool_poll holds); returns once it is nonzero
 * (want) or zero (!want). */
static void spin_while(const int *counter, int want) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 1; (__atomic_load_n(counter, __ATOMIC_ACQUIRE) != 0) != want; i++) {
        cpu_relax();
        const int held = __atomic_load_n(&pool.polling, __ATOMIC_RELAXED) > 0;
        if (i % 64 == 0 && !held && now_ns() > until) return;
    }
}

/* delta 1: helpers poll for work without end until the matching tc_pool_poll(-1). */
void tc_pool_poll(int delta) { __atomic_add_fetch(&pool.polling, delta, __ATOMIC_RELAXED); }

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        spin_while(&pool.wanted, 1);
        pthread_mutex_lock(&pool.lock);
        while (pool.wanted == 0) {
            pool.sleepers++;
            pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleepers--;
        }
        __atomic_store_n(&pool.wanted, pool.wanted - 1, __ATOMIC_RELAXED);
        void *(*fn)(void *) = pool.fn;
        void *arg = pool.arg;
        pthread_mutex_unlock(&pool.lock);
        fn(arg);
        pthread_mutex_lock(&pool.lock);
        if (__atomic_sub_fetch(&pool.running, 1, __ATOMIC_RELEASE) == 0)
            pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

/* fork() holds the lock across the copy, so the child's pool is consistent; the child
 * then forgets the parent's helpers. */
static void before_fork(void) { pthread_mutex_lock(&pool.lock); }
static void after_fork_in_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void after_fork_in_child(void) {
    pool.helpers = pool.sleepers = pool.busy = pool.wanted = pool.running = pool.polling = 0;
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pthread_mutex_unlock(&pool.lock);
}
static void init(void) { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); }

/* fn(arg) on the calling thread and up to threads - 1 fresh ones, joined. */
static void run_fresh(void *(*fn)(void *), void *arg, int threads) {
    pthread_t ids[MAX_HELPERS];
    int started = 0;
    for (int i = 1; i < threads; i++)
        if (pthread_create(&ids[started], NULL, fn, arg) == 0) started++;
    fn(arg);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
}

/* Starts helpers until there are `want` (fewer if threads cannot start); lock held. */
static void start_helpers(int want) {
    pthread_attr_t detached;
    pthread_attr_init(&detached);
    pthread_attr_setdetachstate(&detached, PTHREAD_CREATE_DETACHED);
    for (pthread_t id; pool.helpers < want; pool.helpers++)
        if (pthread_create(&id, &detached, helper, NULL) != 0) break;
    pthread_attr_destroy(&detached);
}

void tc_run_parallel(void *(*fn)(void *), void *arg, int threads) {
    threads = threads < MAX_HELPERS + 1 ? threads : MAX_HELPERS + 1;
    if (threads <= 1) {
        fn(arg);
        return;
    }
    pthread_once(&once, init);
    pthread_mutex_lock(&pool.lock);
    if (pool.busy) {
        pthread_mutex_unlock(&pool.lock);
        run_fresh(fn, arg, threads);
        return;
    }
    start_helpers(threads - 1);
    const int helpers = threads - 1 < pool.helpers ? threads - 1 : pool.helpers;
    pool.busy = 1, pool.fn = fn, pool.arg = arg;
    __atomic_store_n(&pool.running, helpers, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.wanted, helpers, __ATOMIC_RELEASE);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg);
    /* fn returns once no work is left: helpers that have not come yet need not. */
    pthread_mutex_lock(&pool.lock);
    __atomic_sub_fetch(&pool.running, pool.wanted, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.wanted, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.lock);
    spin_while(&pool.running, 0);
    pthread_mutex_lock(&pool.lock);
    while (pool.running > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pool.busy = 0;
    pthread_mutex_unlock(&pool.lock);
}
