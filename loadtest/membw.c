/* Memory read bandwidth probe for the benchmarks: XOR of every 64-bit word of a buffer. Each
 * of `threads` OpenMP threads reads its contiguous share as `streams` forward streams in
 * lockstep (1 to MAX_STREAMS). Which count finds the peak depends on the machine: on a Zen 3
 * one stream a thread left the memory idle between misses (a third less than four); on a
 * Zen 4 whose bandwidth swings between two levels, one stream read 59-67 GB/s at the upper
 * one where four read 44-47 (both ~35 at the lower), so the benchmarks take the best of both. */
#include <omp.h>
#include <stdint.h>

#define MAX_STREAMS 8
#define STREAMS 4 /* read_pages_xor's pages at once */
#define LINE 8 /* 64-bit words of a cache line */

uint64_t read_xor(const uint64_t *words, int64_t n, int threads, int streams) {
    uint64_t total = 0;
    int64_t lines = n / LINE;
    streams = streams < 1 ? 1 : streams > MAX_STREAMS ? MAX_STREAMS : streams;
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
        int team = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t first = lines * id / team, count = lines * (id + 1) / team - first;
        int64_t per = count / streams; /* lines of each stream; the rest is read after */
        uint64_t lane[LINE] = {0};
        for (int64_t i = 0; i < per; i++)
            for (int s = 0; s < streams; s++) {
                const uint64_t *p = words + (first + s * per + i) * LINE;
                for (int l = 0; l < LINE; l++) lane[l] ^= p[l];
            }
        for (int64_t i = first + streams * per; i < first + count; i++)
            for (int l = 0; l < LINE; l++) lane[l] ^= words[i * LINE + l];
        for (int l = 0; l < LINE; l++) total ^= lane[l];
    }
    for (int64_t i = lines * LINE; i < n; i++) total ^= words[i];
    return total;
}

/* Read bandwidth of a list of pages, the pattern of paged decode attention with none of its
 * arithmetic: XOR of every 64-bit word of pages[i] (page_words words each) of pool k, then of
 * pool v, for i < count. Each thread takes its contiguous share of the list and reads STREAMS
 * of its pages at once in lockstep: about the fastest these pages read at. */
uint64_t read_pages_xor(const uint64_t *k, const uint64_t *v, const int32_t *pages,
                        int64_t count, int64_t page_words, int threads) {
    uint64_t total = 0;
    int64_t page_lines = page_words / LINE;
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
        int team = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t first = count * id / team, end = count * (id + 1) / team;
        uint64_t lane[LINE] = {0};
        for (int pool = 0; pool < 2; pool++) {
            const uint64_t *base = pool == 0 ? k : v;
            for (int64_t p = first; p < end; p += STREAMS) {
                int n = end - p < STREAMS ? (int)(end - p) : STREAMS;
                const uint64_t *at[STREAMS];
                for (int s = 0; s < n; s++) at[s] = base + (int64_t)pages[p + s] * page_words;
                for (int64_t i = 0; i < page_lines; i++)
                    for (int s = 0; s < n; s++)
                        for (int l = 0; l < LINE; l++) lane[l] ^= at[s][i * LINE + l];
            }
        }
        for (int l = 0; l < LINE; l++) total ^= lane[l];
    }
    return total;
}
