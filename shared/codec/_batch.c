/* Entry point of the C decoder: tc_decode_batch decodes a list of tensors in one call. It
 * checks every tensor's planes against its entry, builds its decode tables, cuts its code
 * stream into runs at block boundaries, and lets up to `threads` threads (the caller's and
 * the helpers of _pool.c) take work items - up to MAX_LANES runs of one tensor - from a
 * shared counter, so large tensors split across threads (a lone one too, down to a few
 * hundred microseconds of work) and small ones run side by side. Each tensor's output
 * CRC-32C is joined from its runs' CRCs. */
#include <stdlib.h>
#include <sys/mman.h>

#include "_codec.h"

#define RUN_ELEMENTS (1 << 18) /* aim for runs of about this many elements... */
#define MIN_ELEMENTS_PER_THREAD (1 << 16) /* ...and give a thread at least this much work */

/* One tensor to decode, laid out as native.py's _Job (all fields 8 bytes). */
typedef struct {
    const uint8_t *stream, *raw, *lengths, *gaps;
    const void *block_first;
    int64_t stream_len, raw_len, lengths_len, gaps_len, n_blocks, index_width;
    int64_t first_symbol, total_bits, n, width, k;
    void *out;
    int64_t status; /* out: TC_OK or an error code */
    int64_t crc;    /* out: CRC-32C of the output bytes, if verify */
} tc_job;

typedef struct {
    tc_table table;
    tc_target target;
    tc_run *runs;
    int64_t nruns, nitems; /* nitems: the work items its runs are dealt into */
} prepared;

typedef struct {
    prepared *tensor;
    int64_t job, run, lanes;
    int status;
} work_item;

typedef struct {
    work_item *items;
    int64_t nitems, next; /* next: the first item no thread has taken (atomic) */
    int verify;
} work_list;

static int check_sizes(const tc_job *job, tc_target *t) {
    const int64_t symbol_bits = job->width * 8 - 1 - job->k;
    if (job->k < 0 || symbol_bits <= 0 || symbol_bits > MAX_SYMBOL_BITS || job->total_bits < 0)
        return TC_BAD_SPLIT;
    const tc_sizes z = tc_plane_sizes(job->n, t->k, job->total_bits);
    memcpy(t->parts, z.parts, sizeof z.parts);
    t->nparts = z.nparts;
    const int ok = job->stream_len == z.stream && job->raw_len == z.raw &&
                   job->gaps_len == z.gaps && job->n_blocks == z.n_blocks &&
                   job->index_width == z.index_width && job->lengths_len >= 1 &&
                   job->lengths_len <= ((int64_t)1 << symbol_bits) / 2 + 1;
    return ok ? TC_OK : TC_BAD_SIZES;
}

/* The decode tables from the stored 4-bit code lengths (huffman.py: unpack_lengths,
 * table_problem, decode_table). */
static int build_table(const tc_job *job, tc_table *t) {
    const int64_t symbols = (int64_t)1 << (job->width * 8 - 1 - job->k);
    uint8_t len[1 << MAX_SYMBOL_BITS] = {0};
    int64_t count[16] = {0}, used = 0, kraft = 0;
    if (job->first_symbol < 0 || job->first_symbol + 2 * job->lengths_len > symbols + 1)
        return TC_BAD_ALPHABET;
    for (int64_t i = 0; i < 2 * job->lengths_len; i++) {
        int l = (job->lengths[i >> 1] >> ((i & 1) * 4)) & 15;
        if (l && job->first_symbol + i >= symbols) return TC_BAD_ALPHABET;
        if (l) len[job->first_symbol + i] = (uint8_t)l, count[l]++, used++;
    }
    int bits = 0;
    for (int l = 1; l < 16; l++)
        if (count[l]) bits = l, kraft += count[l] << (LUT_MAX_BITS - (l < 13 ? l : 12));
    if (used == 0 || bits > LUT_MAX_BITS) return TC_BAD_CODE;
    if (used == 1) { /* the 1-bit code 0; the decoder may read the unused code 1 too */
        if (bits != 1) return TC_BAD_CODE;
        for (int64_t s = 0; s < symbols; s++)
            for (int w = 0; len[s] && w < 1 << LUT_MAX_BITS; w++)
                t->lut[w] = (uint16_t)(s << 4 | 1);
    } else {
        if (kraft != 1 << LUT_MAX_BITS) return TC_BAD_CODE;
        int64_t at[LUT_MAX_BITS + 1]; /* canonical codes: by length, then by symbol */
        at[1] = 0;
        for (int l = 1; l < LUT_MAX_BITS; l++) at[l + 1] = at[l] + (count[l] << (LUT_MAX_BITS - l));
        for (int64_t s = 0; s < symbols; s++)
            for (int64_t r = 0, l = len[s]; l && r < (int64_t)1 << (LUT_MAX_BITS - l); r++)
                t->lut[at[l]++] = (uint16_t)(s << 4 | l);
    }
    const uint32_t mask = (1u << LUT_MAX_BITS) - 1;
    for (uint32_t w = 0; w <= mask; w++) {
        uint32_t a = t->lut[w], a_len = a & 15, b = t->lut[(w << a_len) & mask], b_len = b & 15;
        uint32_t two = a_len + b_len <= LUT_MAX_BITS;
        t->pairs[w] = two ? (a + b_len) | (b | 0x8000u) << 16 : a;
    }
    return TC_OK;
}

/* Cuts the block index into runs, each starting on a block, for at least `split` work items
 * of up to MAX_LANES runs of about RUN_ELEMENTS (fewer where there are not enough blocks). */
static int cut_runs(const tc_job *job, prepared *p, int64_t split) {
    const int64_t nb = job->n_blocks;
    int64_t *elem = malloc((size_t)(nb + 1) * sizeof *elem);
    if (elem == NULL) return TC_NO_MEMORY;
    for (int64_t b = 0; b < nb; b++)
        elem[b] = job->index_width == 4 ? ((const int32_t *)job->block_first)[b]
                                        : ((const int64_t *)job->block_first)[b];
    elem[nb] = job->n;
    int status = nb > 0 && elem[0] == 0 ? TC_OK : TC_BAD_INDEX;
    for (int64_t b = 0; status == TC_OK && b < nb; b++)
        if (elem[b + 1] < elem[b]) status = TC_BAD_INDEX;
    int64_t items = tc_ceil_div(job->n, (int64_t)RUN_ELEMENTS * MAX_LANES);
    items = items > split ? items : split;
    const int64_t want = items * MAX_LANES < nb ? items * MAX_LANES : nb;
    p->runs = status == TC_OK ? malloc((size_t)want * sizeof *p->runs) : NULL;
    if (status == TC_OK && p->runs == NULL) status = TC_NO_MEMORY;
    p->nruns = 0;
    for (int64_t i = 0, b = 0; status == TC_OK && i < want; i++) {
        const int64_t target = job->n / want * i + job->n % want * i / want;
        while (elem[b] < target) b++; /* the first block at or after the target element */
        if (b == nb || (p->nruns && p->runs[p->nruns - 1].first == elem[b])) continue;
        const int64_t seg = b * SEGS_PER_BLOCK;
        tc_run *run = &p->runs[p->nruns++];
        run->pos = seg * SEG_BITS + ((job->gaps[seg >> 1] >> ((seg & 1) * 4)) & 15);
        run->first = elem[b];
        if (p->nruns > 1) p->runs[p->nruns - 2].end = run->pos;
        if (p->nruns > 1) p->runs[p->nruns - 2].count = run->first - p->runs[p->nruns - 2].first;
    }
    if (p->nruns) {
        p->runs[p->nruns - 1].end = job->total_bits;
        p->runs[p->nruns - 1].count = job->n - p->runs[p->nruns - 1].first;
    }
    p->nitems = items < p->nruns ? items : p->nruns;
    free(elem);
    return status;
}

static int prepare(const tc_job *job, prepared *p, int64_t split) {
    tc_target *t = &p->target;
    p->runs = NULL;
    p->nruns = p->nitems = 0;
    t->k = (int)job->k;
    t->width = (int)job->width;
    if (job->width != 1 && job->width != 2 && job->width != 4) return TC_BAD_SPLIT;
    int status = check_sizes(job, t);
    if (status == TC_OK) status = build_table(job, &p->table);
    if (status == TC_OK) status = cut_runs(job, p, split);
    t->stream = job->stream;
    t->stream_len = job->stream_len;
    t->raw = job->raw;
    t->out = job->out;
#ifdef MADV_HUGEPAGE
    /* Fresh output pages fault in 2 MiB at a time, not 4 KiB: a third of a large tensor's
     * decode time otherwise. Advice only: errors do not matter. */
    const int64_t huge = 2 << 20, nbytes = job->n * job->width;
    const int64_t lo = tc_ceil_div((int64_t)(uintptr_t)job->out, huge) * huge;
    const int64_t hi = ((int64_t)(uintptr_t)job->out + nbytes) / huge * huge;
    if (status == TC_OK && nbytes >= 2 * huge && hi > lo)
        madvise((void *)(uintptr_t)lo, (size_t)(hi - lo), MADV_HUGEPAGE);
#endif
    return status;
}

static void *worker(void *arg) {
    work_list *w = arg;
    for (;;) {
        int64_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->nitems) return NULL;
        work_item *it = &w->items[i];
        it->status = tc_decode_runs(&it->tensor->table, &it->tensor->target,
                                    it->tensor->runs + it->run, (int)it->lanes, w->verify);
    }
}

/* Work items: each prepared tensor's runs dealt into its nitems items, consecutive runs of
 * as equal a count as can be (at most MAX_LANES). */
static work_item *make_items(const tc_job *jobs, prepared *p, int64_t njobs, int64_t *nitems) {
    int64_t total = 0;
    for (int64_t j = 0; j < njobs; j++) total += p[j].nitems;
    work_item *items = malloc((size_t)(total ? total : 1) * sizeof *items);
    *nitems = 0;
    for (int64_t j = 0; items != NULL && j < njobs; j++) {
        if (jobs[j].status != TC_OK) continue;
        for (int64_t i = 0; i < p[j].nitems; i++) {
            int64_t r = p[j].nruns * i / p[j].nitems, next = p[j].nruns * (i + 1) / p[j].nitems;
            items[(*nitems)++] = (work_item){&p[j], j, r, next - r, TC_OK};
        }
    }
    return items;
}

/* How many work items to cut each tensor into: a tensor larger than a thread's share of
 * the batch is split so that the threads can share it (a lone tensor: one item per thread),
 * as long as each piece keeps MIN_ELEMENTS_PER_THREAD elements. Returns the thread count
 * worth starting. */
static int plan_split(const tc_job *jobs, int64_t njobs, int threads, int64_t *split) {
    int64_t total = 0;
    for (int64_t j = 0; j < njobs; j++) total += jobs[j].n;
    const int64_t most = total / MIN_ELEMENTS_PER_THREAD;
    threads = (int)(threads < most ? threads : most);
    threads = threads > 1 ? threads : 1;
    const int64_t share = tc_ceil_div(total, threads);
    for (int64_t j = 0; j < njobs; j++) {
        int64_t s = tc_ceil_div(jobs[j].n, share > 0 ? share : 1);
        const int64_t by_size = jobs[j].n / MIN_ELEMENTS_PER_THREAD;
        s = s < by_size ? s : by_size;
        split[j] = s > 1 ? s : 1;
    }
    return threads;
}

/* Decodes jobs[0 .. njobs - 1]; sets each job's status and (verify) its output's CRC-32C.
 * Returns TC_NO_MEMORY if it could not allocate its bookkeeping, else TC_OK. */
int tc_decode_batch(tc_job *jobs, int64_t njobs, int threads, int verify) {
    prepared *p = malloc((size_t)(njobs ? njobs : 1) * sizeof *p);
    int64_t *split = malloc((size_t)(njobs ? njobs : 1) * sizeof *split);
    if (p == NULL || split == NULL) {
        free(p);
        free(split);
        return TC_NO_MEMORY;
    }
    threads = plan_split(jobs, njobs, threads, split);
    for (int64_t j = 0; j < njobs; j++) jobs[j].status = prepare(&jobs[j], &p[j], split[j]);
    free(split);
    int64_t nitems;
    work_item *items = make_items(jobs, p, njobs, &nitems);
    if (items != NULL) {
        work_list w = {items, nitems, 0, verify};
        tc_run_parallel(worker, &w, (int)(threads < nitems ? threads : nitems));
        for (int64_t i = 0; i < nitems; i++)
            if (items[i].status != TC_OK && jobs[items[i].job].status == TC_OK)
                jobs[items[i].job].status = items[i].status;
    }
    for (int64_t j = 0; j < njobs; j++) {
        uint32_t crc = 0;
        for (int64_t r = 0; verify && r < p[j].nruns; r++)
            crc = crc32c_combine(crc, p[j].runs[r].crc, p[j].runs[r].count * jobs[j].width);
        jobs[j].crc = crc;
        if (items == NULL && jobs[j].status == TC_OK) jobs[j].status = TC_NO_MEMORY;
        free(p[j].runs);
    }
    const int status = items == NULL ? TC_NO_MEMORY : TC_OK;
    free(items);
    free(p);
    return status;
}
