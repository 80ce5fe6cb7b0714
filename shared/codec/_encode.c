/* Encoder side of the C fast path: symbol histograms and the code planes (see _codec.h). A
 * tensor's elements are cut into chunks at multiples of 128 elements, so every 16-byte group
 * of a raw plane has one owner; threads histogram and encode chunks side by side. The caller
 * knows from the per-chunk histograms where each chunk's codes start in the stream; a chunk
 * stores every byte of its codes but its last, partial one (shared with the next chunk),
 * which is ORed in after the threads are joined. */
#include <stdlib.h>

#include "_codec.h"

#define SUB 4096 /* elements coded before their raw fields are packed, while still in L1 */
#define HIST_BLOCK ((int64_t)1 << 30) /* elements the 32-bit sub-histograms count at once */

ALWAYS_INLINE uint32_t load_elem(const void *in, int64_t i, int width) {
    if (width == 2) return ((const uint16_t *)in)[i];
    if (width == 1) return ((const uint8_t *)in)[i];
    return ((const uint32_t *)in)[i];
}

/* Chunks dealt to threads from a shared counter. */
typedef struct {
    const void *in;
    int width, k;
    const int64_t *chunk_first; /* nchunks + 1 element indices: chunk c is [c, c + 1) */
    int64_t nchunks, next;      /* next: the first chunk no thread has taken (atomic) */
} chunks;

ALWAYS_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int64_t take_chunk(chunks *c) { return __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED); }

typedef struct {
    chunks c;
    int64_t *counts; /* [nchunks][symbols] */
} hist_work;

/* counts[symbol] += the elements a .. z - 1 of that symbol; four sub-histograms, so that
 * runs of one symbol do not wait on one counter. Inlined with constant widths and (for the
 * finest split of each float format, the one histogrammed) constant k. */
ALWAYS_INLINE void count_range(const void *in, int64_t a, int64_t z, int width, int k,
                               int64_t symbols, int64_t *counts) {
    uint32_t sub[4][1 << MAX_SYMBOL_BITS];
    const uint32_t mask = (uint32_t)symbols - 1;
    for (int64_t lo = a; lo < z; lo += HIST_BLOCK) {
        const int64_t hi = z - lo < HIST_BLOCK ? z : lo + HIST_BLOCK;
        memset(sub, 0, sizeof sub);
        int64_t i = lo;
        for (; i + 4 <= hi; i += 4)
            for (int r = 0; r < 4; r++) sub[r][(load_elem(in, i + r, width) >> k) & mask]++;
        for (; i < hi; i++) sub[0][(load_elem(in, i, width) >> k) & mask]++;
        for (int64_t s = 0; s < symbols; s++) counts[s] += sub[0][s] + sub[1][s] + sub[2][s] + sub[3][s];
    }
}

MULTI_TARGET static void *hist_worker(void *arg) {
    hist_work *w = arg;
    const int64_t symbols = (int64_t)1 << (w->c.width * 8 - 1 - w->c.k);
    for (int64_t c; (c = take_chunk(&w->c)) < w->c.nchunks;) {
        const int64_t a = w->c.chunk_first[c], z = w->c.chunk_first[c + 1];
        int64_t *counts = w->counts + c * symbols;
        const int width = w->c.width, k = w->c.k;
        if (width == 1 && k == 0) count_range(w->c.in, a, z, 1, 0, symbols, counts);
        else if (width == 2 && k == 4) count_range(w->c.in, a, z, 2, 4, symbols, counts);
        else if (width == 2 && k == 7) count_range(w->c.in, a, z, 2, 7, symbols, counts);
        else if (width == 4 && k == 20) count_range(w->c.in, a, z, 4, 20, symbols, counts);
        else if (width == 1) count_range(w->c.in, a, z, 1, k, symbols, counts);
        else if (width == 2) count_range(w->c.in, a, z, 2, k, symbols, counts);
        else count_range(w->c.in, a, z, 4, k, symbols, counts);
    }
    return NULL;
}

/* counts[c][symbol] += the elements of chunk c with that symbol (2**(width*8-1-k) symbols,
 * at most 2**MAX_SYMBOL_BITS), on up to `threads` threads. */
void tc_histogram(const void *in, int width, int k, const int64_t *chunk_first, int64_t nchunks,
                  int64_t *counts, int threads) {
    hist_work w = {{in, width, k, chunk_first, nchunks, 0}, counts};
    tc_run_parallel(hist_worker, &w, (int)(threads < nchunks ? threads : nchunks));
}

typedef struct {
    chunks c;
    const int64_t *chunk_bit; /* nchunks + 1 stream bits: where each chunk's codes start */
    const uint64_t *table;    /* element >> k (sign included) -> its entry (LEN_BITS) */
    uint8_t *stream, *raw;
    const int64_t *parts;
    int nparts;
    uint8_t *seg_gap;     /* per segment: its gap (packed into nibbles afterwards) */
    int64_t n_seg;
    int64_t *block_first; /* per block: its first element */
    uint8_t *tail;        /* per chunk: its last, partial stream byte */
    int *status;          /* per chunk: TC_OK, or TC_MISMATCH if it missed its end bit */
} enc_work;

/* A chunk's bit writer: the next code starts at stream bit `pos`; the pending bits, those of
 * its byte before it (pos & 7), are the top ones of `acc`, every lower bit 0. */
typedef struct {
    int64_t pos;
    uint64_t acc;
    int64_t seg, seg_start; /* the next segment to record, and its first bit */
} writer;

/* A code table entry: the code in the top bits of 64 (its first bit at bit 63), the length
 * in the low 6. The low 6 bits of a sum of up to four entries are the sum of their lengths
 * (at most 48: carries only go up into code bits), so `x >> (sum & LEN_BITS)` is one shift
 * (x86's shrx and ARM's lsr take the count mod 64 anyway), and an entry shifted right by the
 * lengths before it is its code in place, over length bits in the low 6 that `& CODE_BITS`
 * clears. */
#define LEN_BITS 63u
#define CODE_BITS (~(uint64_t)LEN_BITS)

/* Element i starts at bit pos: it is the first code of every segment not yet recorded that
 * starts at or before pos. */
ALWAYS_INLINE void record(const enc_work *w, writer *b, int64_t i, int64_t pos) {
    for (; b->seg_start <= pos && b->seg < w->n_seg; b->seg++, b->seg_start += SEG_BITS) {
        w->seg_gap[b->seg] = (uint8_t)(pos - b->seg_start);
        if (b->seg % SEGS_PER_BLOCK == 0) w->block_first[b->seg / SEGS_PER_BLOCK] = i;
    }
}

/* The first bit of the next segment to record (beyond any stream if none is left). */
ALWAYS_INLINE int64_t next_segment(const enc_work *w, const writer *b) {
    return b->seg < w->n_seg ? b->seg_start : INT64_MAX / 2;
}

/* Records the segments that the codes of elements i .. i + 3 start, the first at stream bit
 * pos; returns next_segment. Out of line, with the code lengths looked up again, so that
 * the coding loop keeps its registers. */
static __attribute__((noinline)) int64_t record4(const enc_work *w, writer *b, int64_t i,
                                                 int64_t pos) {
    for (int64_t j = i; j < i + 4; j++) {
        record(w, b, j, pos);
        pos += w->table[load_elem(w->c.in, j, w->c.width) >> w->c.k] & LEN_BITS;
    }
    return next_segment(w, b);
}

/* The codes of elements a .. z - 1. Four entries are joined into their codes in a row (at
 * most 4 * 12 bits, which below the <= 7 pending bits fits 64), ORed below the pending bits,
 * and stored with one 8-byte big-endian store at the byte the pending bits start in, in runs
 * of groups that cannot store past `limit` (the chunk's last byte; a group moves the store
 * by at most 6 bytes); code by code after that. The loop keeps the stream bit `pos` (pos & 7
 * pending bits), and the serial chains are one add for pos and an or and a shift for acc
 * per four elements. */
ALWAYS_INLINE void code_range(const enc_work *w, writer *b, int64_t a, int64_t z,
                              const uint8_t *limit, int width, int k) {
    const uint64_t *table = w->table;
    const void *in = w->c.in;
    uint8_t *const stream = w->stream;
    uint64_t acc = b->acc;
    int64_t pos = b->pos, next_seg = next_segment(w, b), i = a;
    for (int64_t groups; (groups = min64((z - i) / 4, ((limit - stream) - 8 - pos / 8) / 6)) > 0;) {
        for (const int64_t run_end = i + 4 * groups; i < run_end; i += 4) {
            const uint64_t e0 = table[load_elem(in, i, width) >> k];
            const uint64_t e1 = table[load_elem(in, i + 1, width) >> k];
            const uint64_t e2 = table[load_elem(in, i + 2, width) >> k];
            const uint64_t e3 = table[load_elem(in, i + 3, width) >> k];
            const uint64_t to1 = e0 + e1, to2 = to1 + e2, to3 = to2 + e3; /* lengths, low bits */
            const uint64_t codes =
                (e0 | e1 >> (e0 & LEN_BITS) | e2 >> (to1 & LEN_BITS) | e3 >> (to2 & LEN_BITS)) &
                CODE_BITS;
            if (__builtin_expect(pos + (int64_t)(to2 & LEN_BITS) >= next_seg, 0)) {
                next_seg = record4(w, b, i, pos); /* a segment starts at one of these */
                table = w->table, in = w->c.in;
            }
            const int64_t byte = pos >> 3;
            acc |= codes >> (pos & 7);
            memcpy(stream + byte, &(uint64_t){__builtin_bswap64(acc)}, sizeof acc);
            pos += to3 & LEN_BITS;
            acc <<= 8 * ((pos >> 3) - byte);
        }
    }
    for (; i < z; i++) {
        const uint64_t e = table[load_elem(in, i, width) >> k];
        if (pos >= next_seg) {
            record(w, b, i, pos);
            next_seg = next_segment(w, b);
        }
        uint8_t *out = stream + pos / 8;
        int64_t nacc = (pos & 7) + (int64_t)(e & LEN_BITS);
        acc |= (e & CODE_BITS) >> (pos & 7);
        pos += e & LEN_BITS;
        for (; nacc >= 8; nacc -= 8, out++) {
            if (out < limit) *out = (uint8_t)(acc >> 56); /* else: too many bits, see below */
            acc <<= 8;
        }
    }
    b->pos = pos, b->acc = acc;
}

/* code_range with the element width and k known at compile time: the common splits. */
ALWAYS_INLINE void code_any(const enc_work *w, writer *b, int64_t a, int64_t z, const uint8_t *limit) {
    const int width = w->c.width, k = w->c.k;
#define CASE(W, K) case (W) * 64 + (K): code_range(w, b, a, z, limit, W, K); return;
    switch (width * 64 + k) {
        CASE(1, 0) CASE(1, 1) CASE(1, 2) CASE(1, 3)
        CASE(2, 4) CASE(2, 5) CASE(2, 6) CASE(2, 7) CASE(2, 8) CASE(2, 9) CASE(2, 10)
        CASE(4, 20) CASE(4, 21) CASE(4, 22) CASE(4, 23)
    }
#undef CASE
    if (width == 1) code_range(w, b, a, z, limit, 1, k);
    if (width == 2) code_range(w, b, a, z, limit, 2, k);
    if (width == 4) code_range(w, b, a, z, limit, 4, k);
}

MULTI_TARGET static int encode_chunk(const enc_work *w, int64_t c) {
    const int64_t a = w->c.chunk_first[c], z = w->c.chunk_first[c + 1];
    const int64_t start = w->chunk_bit[c], end = w->chunk_bit[c + 1];
    const int64_t seg = (start + SEG_BITS - 1) / SEG_BITS;
    writer b = {start, 0, seg, seg * SEG_BITS};
    const uint8_t *limit = w->stream + end / 8;
    for (int64_t s = a; s < z; s += SUB) {
        const int64_t e = z - s < SUB ? z : s + SUB;
        code_any(w, &b, s, e, limit);
        tc_pack_raw(w->c.in, s, e, w->c.width, w->c.k, w->raw, w->parts, w->nparts);
    }
    if (b.pos != end) return TC_MISMATCH;
    for (; b.seg_start < end && b.seg < w->n_seg; b.seg++, b.seg_start += SEG_BITS) { /* none starts in them */
        w->seg_gap[b.seg] = (uint8_t)(end - b.seg_start);
        if (b.seg % SEGS_PER_BLOCK == 0) w->block_first[b.seg / SEGS_PER_BLOCK] = z;
    }
    w->tail[c] = (uint8_t)(b.acc >> 56);
    return TC_OK;
}

static void *enc_worker(void *arg) {
    enc_work *w = arg;
    for (int64_t c; (c = take_chunk(&w->c)) < w->c.nchunks;) w->status[c] = encode_chunk(w, c);
    return NULL;
}

/* The code table indexed by element >> k (the sign bit too: 2 * symbols entries) of
 * entries (LEN_BITS), from the code lengths of the symbols: canonical codes, shorter ones first,
 * codes of one length consecutive in symbol order (huffman.canonical_codes). */
static void code_table(const uint8_t *lengths, int64_t symbols, uint64_t *table) {
    uint64_t count[LUT_MAX_BITS + 2] = {0}, next[LUT_MAX_BITS + 2] = {0};
    for (int64_t s = 0; s < symbols; s++) count[lengths[s] <= LUT_MAX_BITS ? lengths[s] : 0]++;
    count[0] = 0;
    for (int l = 1, code = 0; l <= LUT_MAX_BITS; l++) next[l] = code = (code + count[l - 1]) << 1;
    for (int64_t s = 0; s < symbols; s++) {
        const int l = lengths[s] <= LUT_MAX_BITS ? lengths[s] : 0;
        table[s] = table[s + symbols] = l ? next[l]++ << (64 - l) | (uint64_t)l : 0;
    }
}

/* Writes the code stream (MSB-first), the raw field planes, the segment gaps (nibbles) and
 * the block index of the chunks' elements, on up to `threads` threads; lengths: the code
 * length of each of the 2**(width*8-1-k) symbols. chunk_bit[c] is the
 * stream bit where chunk c's codes start (chunk_bit[nchunks]: the total); chunks start on
 * multiples of 128 elements, the first at 0. The planes must be sized by the caller
 * (FORMAT.md); every byte of them is written, so they need not be zeroed.
 * Returns TC_OK, TC_MISMATCH if the codes do not fill the chunks' bit ranges exactly (the
 * planes are then garbage), or TC_NO_MEMORY. */
int tc_encode(const void *in, int width, int k, const uint8_t *lengths, uint8_t *stream,
              uint8_t *raw, const int64_t *parts, int nparts, uint8_t *gaps,
              int64_t *block_first, const int64_t *chunk_first, const int64_t *chunk_bit,
              int64_t nchunks, int threads) {
    const int64_t n_seg = (chunk_bit[nchunks] + SEG_BITS - 1) / SEG_BITS;
    uint8_t *seg_gap = malloc((size_t)n_seg + 2), *tail = malloc((size_t)nchunks);
    int *status = malloc((size_t)nchunks * sizeof *status);
    const int64_t symbols = (int64_t)1 << (width * 8 - 1 - k);
    uint64_t *table = malloc((size_t)(2 * symbols) * sizeof *table);
    int result = seg_gap && tail && status && table ? TC_OK : TC_NO_MEMORY;
    if (result == TC_OK) {
        /* the chunks store every byte but the last partial one and the padding */
        const int64_t n = chunk_first[nchunks], total = chunk_bit[nchunks];
        const tc_sizes sizes = tc_plane_sizes(n, k, total);
        memset(stream + total / 8, 0, (size_t)(sizes.stream - total / 8));
        tc_zero_raw_tail(n, raw, parts, nparts, sizes.raw);
        code_table(lengths, symbols, table);
        enc_work w = {{in, width, k, chunk_first, nchunks, 0}, chunk_bit, table, stream, raw,
                      parts, nparts, seg_gap, n_seg, block_first, tail, status};
        tc_run_parallel(enc_worker, &w, (int)(threads < nchunks ? threads : nchunks));
        for (int64_t c = 0; c < nchunks; c++) {
            if (status[c] != TC_OK) result = status[c];
            stream[chunk_bit[c + 1] / 8] |= tail[c];
        }
        seg_gap[n_seg] = 0;
        for (int64_t s = 0; s < n_seg; s += 2) gaps[s / 2] = seg_gap[s] | seg_gap[s + 1] << 4;
    }
    free(seg_gap);
    free(tail);
    free(status);
    free(table);
    return result;
}
