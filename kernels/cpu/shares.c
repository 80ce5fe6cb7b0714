/* For the tests (tests/test_shares.py): shares.h's taking, driven one take at a time. */
#include <stdint.h>
#include <stdlib.h>

#include "shares.h"

/* A team of T threads' shares of `units`, cleared, then the runs of threads t < started
 * started; then take i (i < n) made by thread who[i], one after another on this thread:
 * taken[2i], taken[2i + 1] = its units [lo, hi), or -1, -1 where it found none. Returns 0, -1
 * for T outside [1, MAX_SHARES] or a thread outside the team, -2 when out of memory. */
int tk_shares_walk(int64_t units, int T, int started, const int32_t *who, int64_t n,
                   int64_t *taken) {
    if (T < 1 || T > MAX_SHARES || started < 0 || started > T) return -1;
    for (int64_t i = 0; i < n; i++)
        if (who[i] < 0 || who[i] >= T) return -1;
    share *shares = aligned_alloc(64, SHARES_BYTES);
    if (shares == NULL) return -2;
    shares_clear(shares);
    for (int t = 0; t < started; t++) share_start(shares, units, t, T);
    for (int64_t i = 0; i < n; i++)
        if (!share_next(shares, who[i], T, &taken[2 * i], &taken[2 * i + 1]))
            taken[2 * i] = taken[2 * i + 1] = -1;
    free(shares);
    return 0;
}
