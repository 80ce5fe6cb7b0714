/* Shared declarations of the Tison codec's C fast path (format: FORMAT.md; reference:
 * reference.py). native.py compiles _encode.c, _pack.c, _huffman.c, _many.c (encoder),
 * _decode.c, _batch.c (decoder), _crc32c.c and _pool.c into one library and calls it through
 * ctypes, which releases the GIL. Elements are `width` bytes (1, 2 or 4); symbol = the bits
 * under the sign down to bit k; raw field = the sign bit over the k low bits, split into parts of 16, 8, 4, 2 or 1 bits, one byte plane per part;
 * `parts` lists (bits, shift in field, byte offset of the plane in `raw`) per part. */
#ifndef TISON_CODEC_H
#define TISON_CODEC_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Hot loops built twice on x86-64 (baseline, and AVX2 + BMI2), picked at load time; once,
 * baseline, at the portable tier (TISON_CPU_ISA=portable: native.py), so that every CPU
 * can test the baseline code. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(TC_BASELINE_ONLY)
#define MULTI_TARGET __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MULTI_TARGET
#endif
#define MAX_PARTS 5
#define MAX_LANES 6 /* runs one work item decodes interleaved */
#define LUT_MAX_BITS 12 /* = MAX_CODE_LEN in format.py */
#define MAX_SYMBOL_BITS 11 /* format.py's constants of the same names */
#define SEG_BITS 2048
#define SEGS_PER_BLOCK 32

/* Sixteen lanes, for the raw-field loops (GCC vector extensions: SSE2, AVX2, NEON...). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

/* Byte and bit of element e in a plane of b-bit parts (b <= 8): 16-byte groups hold 16 * 8/b
 * elements; byte q of a group holds elements q, q + 16, q + 32, ... at bits 0, b, 2b, ... */
ALWAYS_INLINE int64_t part_byte(int64_t e, int b, int *bit) {
    const int log_b = __builtin_ctz((unsigned)b), span_log = 7 - log_b; /* span = 128 / b */
    const int64_t r = e & ((1 << span_log) - 1);
    *bit = (int)(r >> 4) << log_b;
    return ((e >> span_log) << 4) + (r & 15);
}

/* The decode tables of one tensor's code, indexed by the next LUT_MAX_BITS stream bits w
 * (codes shorter than that fill several entries). lut[w] = the one code that starts w, as
 * symbol << 4 | length. pairs[w] = the one or two codes that end inside w, as two 16-bit
 * halves in the same form: the low half holds the first symbol over the total length, the
 * high half the second symbol with bit 15 set, or 0 if there is none. One 32-bit store
 * writes both symbols, `e >> 31` counts the second, `e & 15` is the shift. Symbols have at
 * most 11 bits (MAX_SYMBOL_BITS), so both forms fit 16 bits. */
typedef struct {
    uint16_t lut[1 << LUT_MAX_BITS];
    uint32_t pairs[1 << LUT_MAX_BITS];
} tc_table;

/* One tensor's planes and output, as the decoder reads them. */
typedef struct {
    const uint8_t *stream;
    int64_t stream_len;
    const uint8_t *raw;
    int64_t parts[3 * MAX_PARTS];
    int nparts, width, k;
    void *out;
} tc_target;

/* A run of the code stream: `count` elements from element `first`, whose codes start at bit
 * `pos` and must end exactly at bit `end`. */
typedef struct {
    int64_t pos, first, count, end;
    uint32_t crc; /* CRC-32C of the run's output bytes, if asked for */
} tc_run;

/* Status codes (native.py turns them into messages). */
enum {
    TC_OK = 0,
    TC_BAD_SPLIT = -1,
    TC_BAD_SIZES = -2,
    TC_BAD_ALPHABET = -3,
    TC_BAD_CODE = -4,
    TC_BAD_INDEX = -5,
    TC_OVERRUN = -6,
    TC_MISMATCH = -7,
    TC_NO_MEMORY = -8,
};

static inline int64_t tc_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The planes' byte sizes of n elements coded at split k in total_bits stream bits (FORMAT.md;
 * format.py's padded_plane_bytes, raw_layout, num_segments, num_blocks), and the raw plane's
 * parts: (bits, shift, byte offset) of each, nparts of them. The encoder sizes planes by it,
 * the decoder checks them against it. */
typedef struct {
    int64_t stream, raw, gaps, n_blocks, index_width, parts[3 * MAX_PARTS];
    int nparts;
} tc_sizes;

static inline tc_sizes tc_plane_sizes(int64_t n, int k, int64_t total_bits) {
    static const int widths[MAX_PARTS] = {16, 8, 4, 2, 1};
    const int64_t n_seg = tc_ceil_div(total_bits, SEG_BITS);
    tc_sizes z = {4 * tc_ceil_div(total_bits, 32) + 8, 0, tc_ceil_div(n_seg, 2),
                  tc_ceil_div(n_seg, SEGS_PER_BLOCK), n < ((int64_t)1 << 31) ? 4 : 8, {0}, 0};
    for (int i = 0, shift = 0; i < MAX_PARTS; i++) {
        if (!((k + 1) & widths[i])) continue;
        int64_t *part = z.parts + 3 * z.nparts++;
        part[0] = widths[i], part[1] = shift, part[2] = z.raw;
        shift += widths[i];
        z.raw += 16 * tc_ceil_div(n * widths[i], 128) + 16;
    }
    return z;
}

/* _decode.c: decodes `lanes` (1..MAX_LANES) runs interleaved, checking that each ends at
 * its recorded bit; with `verify`, also the CRC-32C of each run's output. */
int tc_decode_runs(const tc_table *table, const tc_target *target, tc_run *runs, int lanes,
                   int verify);

/* _pack.c: the raw fields of elements a .. z - 1 (a a multiple of 128) into their part
 * planes in `raw`, whose bytes from element (n / 128) * 128 on tc_zero_raw_tail has zeroed
 * (n: the tensor's elements; raw_len: the bytes of all part planes). */
void tc_pack_raw(const void *in, int64_t a, int64_t z, int width, int k, uint8_t *raw,
                 const int64_t *parts, int nparts);
void tc_zero_raw_tail(int64_t n, uint8_t *raw, const int64_t *parts, int nparts, int64_t raw_len);

/* _encode.c, _huffman.c, _crc32c.c: what _many.c calls of them (see there, and native.py). */
void tc_histogram(const void *in, int width, int k, const int64_t *chunk_first, int64_t nchunks,
                  int64_t *counts, int threads);
int tc_split_candidates(const int64_t *counts, int64_t nchunks, int64_t symbols, int ncand,
                        int max_len, uint8_t *lengths, int64_t *chunk_bits);
int tc_encode(const void *in, int width, int k, const uint8_t *lengths, uint8_t *stream,
              uint8_t *raw, const int64_t *parts, int nparts, uint8_t *gaps,
              int64_t *block_first, const int64_t *chunk_first, const int64_t *chunk_bit,
              int64_t nchunks, int threads);
uint32_t tc_crc32c(uint32_t crc, const void *buf, int64_t n, int threads);

/* _pool.c: fn(arg) on the calling thread and on up to threads - 1 helper threads kept
 * between calls; returns when every one of them has returned. */
void tc_run_parallel(void *(*fn)(void *), void *arg, int threads);

/* _crc32c.c: CRC-32C (Castagnoli; iSCSI, ext4) with the usual pre- and post-inversion:
 * crc32c_update(0, "123456789", 9) == 0xE3069283. */
uint32_t crc32c_update(uint32_t crc, const uint8_t *p, int64_t n);
/* crc[j] = crc32c_update(crc[j], p[j], n[j]) for j < lanes, the chains interleaved. */
void crc32c_update_lanes(uint32_t *crc, const uint8_t *const *p, const int64_t *n, int lanes);
/* The CRC-32C of A + B from crc1 of A, crc2 of B and len2 = len(B). */
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, int64_t len2);

#endif
