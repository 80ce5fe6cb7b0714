/* Many small tensors encoded in two calls (many.py), each tensor on one thread, the threads
 * taking tensors from a shared counter: a tensor of a few hundred thousand elements takes
 * ~1 ms of C, and called one by one from Python threads, each of its ~9 calls through
 * ctypes gives up the GIL and waits to take it back, which on a busy virtual CPU costs as much
 * as the work (1.14x on 2 threads against 1.9x for one large tensor split in chunks).
 *
 * tc_stats_many: per tensor its CRC-32C and, if it may be coded, the histogram at the finest
 * split, every candidate split's code lengths and stream bits (tc_split_candidates on one
 * chunk), and the split storing fewest bytes with its plane sizes (tensor.py's _best_split,
 * FORMAT.md's sizes), or none if raw storage is no bigger. The caller allocates the planes.
 * tc_encode_many: per coded tensor its planes (tc_encode on one chunk), the block index at its
 * stored width, the packed code table, and the planes' CRC-32C in the order the format stores
 * them. */
#include <stdlib.h>

#include "_codec.h"

/* One tensor of both calls (native.MANY_JOB: every field 8 bytes). */
typedef struct {
    /* the caller's, before tc_stats_many */
    const void *in;
    int64_t n, width, finest, ncand; /* finest: the finest candidate split; ncand 0: raw */
    uint8_t *lengths;                /* scratch [ncand][2**(8 * width - 1 - finest)] */
    int64_t *chunk_bits;             /* scratch [ncand][2] */
    /* tc_stats_many's (status: tc_encode_many's too) */
    int64_t status, crc, k; /* k: the split chosen, or -1: stored raw */
    int64_t total_bits, stream_len, raw_len, packed_len, gaps_len, n_blocks, index_width;
    int64_t first_symbol;
    /* the caller's, before tc_encode_many: the planes, of the sizes above (not zeroed) */
    uint8_t *stream, *raw, *packed, *gaps;
    void *index;
    int64_t planes_crc; /* tc_encode_many's */
} tc_many_job;

typedef struct {
    tc_many_job *jobs;
    int64_t njobs, next; /* next: the first job no thread has taken (atomic) */
    int max_len;
} many_work;

static int64_t take_job(many_work *w) { return __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED); }

/* Candidate c's sizes into j if it stores fewer than *best bytes (then its count there). */
static void consider(tc_many_job *j, int c, int64_t *best) {
    const int k = (int)(j->finest + c);
    const int64_t symbols = (int64_t)1 << (8 * j->width - 1 - j->finest), coarse = symbols >> c;
    const uint8_t *len = j->lengths + c * symbols;
    int64_t first = 0, last = coarse - 1;
    while (first < coarse && len[first] == 0) first++;
    while (last > first && len[last] == 0) last--;
    if (first == coarse) return; /* no symbol: only for n == 0, which is never coded */
    const tc_sizes z = tc_plane_sizes(j->n, k, j->chunk_bits[2 * c + 1]);
    const int64_t packed = (last - first + 2) / 2;
    const int64_t stored = z.stream + z.raw + z.gaps + packed + z.n_blocks * z.index_width;
    if (stored >= *best) return;
    *best = stored;
    j->k = k, j->total_bits = j->chunk_bits[2 * c + 1], j->stream_len = z.stream;
    j->raw_len = z.raw, j->packed_len = packed, j->gaps_len = z.gaps, j->n_blocks = z.n_blocks;
    j->index_width = z.index_width, j->first_symbol = first;
}

static void stats_one(tc_many_job *j, int max_len) {
    j->crc = tc_crc32c(0, j->in, j->n * j->width, 1);
    j->status = TC_OK;
    j->k = -1;
    if (j->ncand == 0) return;
    const int64_t symbols = (int64_t)1 << (8 * j->width - 1 - j->finest), bounds[2] = {0, j->n};
    int64_t *counts = calloc((size_t)symbols, sizeof *counts);
    if (counts == NULL) {
        j->status = TC_NO_MEMORY;
        return;
    }
    tc_histogram(j->in, (int)j->width, (int)j->finest, bounds, 1, counts, 1);
    j->status = tc_split_candidates(counts, 1, symbols, (int)j->ncand, max_len, j->lengths,
                                    j->chunk_bits);
    free(counts);
    if (j->status != TC_OK) return;
    int64_t best = j->n * j->width; /* raw storage: a split must store fewer bytes */
    for (int c = (int)j->ncand - 1; c >= 0; c--) consider(j, c, &best); /* k descending */
}

static void encode_one(tc_many_job *j) {
    if (j->k < 0) return;
    const int c = (int)(j->k - j->finest);
    const int64_t symbols = (int64_t)1 << (8 * j->width - 1 - j->finest), coarse = symbols >> c;
    const uint8_t *len = j->lengths + c * symbols;
    const int64_t bounds[2] = {0, j->n};
    const tc_sizes z = tc_plane_sizes(j->n, (int)j->k, j->total_bits);
    int64_t *first = j->index_width == 8 ? j->index : malloc((size_t)(j->n_blocks + 1) * 8);
    if (first == NULL) {
        j->status = TC_NO_MEMORY;
        return;
    }
    j->status = tc_encode(j->in, (int)j->width, (int)j->k, len, j->stream, j->raw, z.parts,
                          z.nparts, j->gaps, first, bounds, j->chunk_bits + 2 * c, 1, 1);
    if (j->index_width == 4) {
        for (int64_t b = 0; b < j->n_blocks; b++) ((int32_t *)j->index)[b] = (int32_t)first[b];
        free(first);
    }
    memset(j->packed, 0, (size_t)j->packed_len);
    for (int64_t s = 0; s < 2 * j->packed_len; s++) { /* huffman.pack_lengths */
        const int64_t symbol = j->first_symbol + s;
        j->packed[s / 2] |= (uint8_t)((symbol < coarse ? len[symbol] : 0) << (4 * (s & 1)));
    }
    uint32_t crc = tc_crc32c(0, j->stream, j->stream_len, 1);
    crc = tc_crc32c(crc, j->raw, j->raw_len, 1);
    crc = tc_crc32c(crc, j->packed, j->packed_len, 1);
    crc = tc_crc32c(crc, j->gaps, j->gaps_len, 1);
    j->planes_crc = tc_crc32c(crc, j->index, j->n_blocks * j->index_width, 1);
}

static void *stats_worker(void *arg) {
    many_work *w = arg;
    for (int64_t i; (i = take_job(w)) < w->njobs;) stats_one(w->jobs + i, w->max_len);
    return NULL;
}

static void *encode_worker(void *arg) {
    many_work *w = arg;
    for (int64_t i; (i = take_job(w)) < w->njobs;) encode_one(w->jobs + i);
    return NULL;
}

/* Each job's CRC-32C, status (TC_OK, or an error of tc_split_candidates), split and plane
 * sizes, on up to `threads` threads; max_len: the longest code (MAX_CODE_LEN). */
void tc_stats_many(tc_many_job *jobs, int64_t njobs, int max_len, int threads) {
    many_work w = {jobs, njobs, 0, max_len};
    tc_run_parallel(stats_worker, &w, (int)(threads < njobs ? threads : njobs));
}

/* The planes of each job with a split, their status (as tc_encode's) and CRC-32C, on up to
 * `threads` threads. */
void tc_encode_many(tc_many_job *jobs, int64_t njobs, int threads) {
    many_work w = {jobs, njobs, 0, 0};
    tc_run_parallel(encode_worker, &w, (int)(threads < njobs ? threads : njobs));
}
