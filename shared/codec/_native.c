/* Fast CPU paths of the Tison weight codec (format in FORMAT.md; reference in reference.py).
 * Built on first use by native.py with the system C compiler and called through ctypes,
 * which releases the GIL, so Python threads decode disjoint block ranges in parallel.
 * Elements are `width` bytes (1, 2 or 4); symbol = bits under the sign down to bit k;
 * raw field = sign bit over the k low bits. A raw field is split into parts of 16, 8, 4,
 * 2 or 1 bits, one byte plane per part; `parts` lists (bits, shift in field, byte offset
 * of the plane in `raw`) per part. Sub-byte planes pack 16-element columns (see
 * part_field) so that whole groups unpack with plain vectorisable loops. */
#include <stdint.h>
#include <string.h>

#define TILE 4096 /* symbols decoded per lane before they are merged with their raw fields */
#define TILE_SLACK (TILE + 16) /* room for the spare symbols group8 writes */
#define GROUP 16 /* elements merged at once; tiles end on multiples of it */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Sixteen lanes, for the raw-field loops (GCC vector extensions: SSE2, NEON, ...). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline uint32_t load_elem(const void *in, int64_t i, int width) {
    if (width == 2) return ((const uint16_t *)in)[i];
    if (width == 1) return ((const uint8_t *)in)[i];
    return ((const uint32_t *)in)[i];
}

static inline uint64_t load_be64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
}

/* Byte and bit of element e in a plane of b-bit parts (b <= 8): 16-byte groups hold 16 * 8/b
 * elements; byte q of a group holds elements q, q + 16, q + 32, ... at bits 0, b, 2b, ... */
ALWAYS_INLINE int64_t part_byte(int64_t e, int b, int *bit) {
    const int log_b = __builtin_ctz((unsigned)b), span_log = 7 - log_b; /* span = 128 / b */
    const int64_t r = e & ((1 << span_log) - 1);
    *bit = (int)(r >> 4) << log_b;
    return ((e >> span_log) << 4) + (r & 15);
}

static uint32_t part_field(const uint8_t *plane, int b, int64_t e) {
    if (b == 16) return plane[2 * e] | (uint32_t)plane[2 * e + 1] << 8;
    int bit;
    int64_t byte = part_byte(e, b, &bit);
    return (plane[byte] >> bit) & ((1u << b) - 1);
}

static uint32_t raw_field(const uint8_t *raw, const int64_t *parts, int nparts, int64_t e) {
    uint32_t r = 0;
    for (int j = 0; j < nparts; j++) {
        const int64_t *part = parts + 3 * j;
        r |= part_field(raw + part[2], (int)part[0], e) << part[1];
    }
    return r;
}

/* counts[symbol] += 1 for every element; counts has 2**(width*8-1-k) entries. */
void tc_histogram(const void *in, int64_t n, int width, int k, int64_t *counts) {
    const uint32_t mask = (1u << (width * 8 - 1 - k)) - 1;
    for (int64_t i = 0; i < n; i++) counts[(load_elem(in, i, width) >> k) & mask]++;
}

/* Writes the raw field of element e into its part planes (zeroed beforehand). */
static void put_field(uint8_t *raw, const int64_t *parts, int nparts, int64_t e, uint32_t field) {
    for (int j = 0; j < nparts; j++) {
        const int64_t *part = parts + 3 * j;
        int b = (int)part[0], bit;
        uint32_t v = (field >> part[1]) & ((1u << b) - 1);
        uint8_t *plane = raw + part[2];
        if (b == 16) {
            plane[2 * e] = (uint8_t)v;
            plane[2 * e + 1] = (uint8_t)(v >> 8);
        } else {
            plane[part_byte(e, b, &bit)] |= (uint8_t)(v << bit);
        }
    }
}

/* The raw fields (R = k + 1 bits) of elements a .. z - 1 (multiples of 16) into their zeroed
 * part planes, sixteen at a time: the inverse of merge16 (below). */
#define DEFINE_PACK16(NAME, IN_T, INX16, ACC, LANE_T)                                       \
    ALWAYS_INLINE void NAME(const void *in, int R, int64_t a, int64_t z,                       \
                            uint8_t *const *planes) {                                          \
        const int k = R - 1, top = (int)sizeof(IN_T) * 8 - 1;                                  \
        for (int64_t e = a; e < z; e += 16) {                                                  \
            INX16 u;                                                                           \
            memcpy(&u, (const IN_T *)in + e, sizeof u);                                        \
            ACC v = __builtin_convertvector(u, ACC);                                           \
            ACC r = ((v >> top) << k) | (v & (LANE_T)((1u << k) - 1));                         \
            int j = 0, shift = 0;                                                              \
            if (R & 16) {                                                                      \
                u16x16 x = __builtin_convertvector(r, u16x16);                                 \
                memcpy(planes[j++] + 2 * e, &x, sizeof x);                                     \
                shift += 16;                                                                   \
            }                                                                                  \
            for (int b = 8; b >= 1; b >>= 1) {                                                 \
                if (!(R & b)) continue;                                                        \
                u8x16 x = __builtin_convertvector((r >> shift) & (LANE_T)((1u << b) - 1), u8x16); \
                uint8_t *p = planes[j++] + (e / (128 / b)) * 16;                               \
                u8x16 cur;                                                                     \
                memcpy(&cur, p, sizeof cur);                                                   \
                cur |= x << (int)(((e % (128 / b)) >> 4) * b);                                 \
                memcpy(p, &cur, sizeof cur);                                                   \
                shift += b;                                                                    \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_PACK16(pack16_u8, uint8_t, u8x16, u16x16, uint16_t)
DEFINE_PACK16(pack16_u16, uint16_t, u16x16, u16x16, uint16_t)
DEFINE_PACK16(pack16_u32, uint32_t, u32x16, u32x16, uint32_t)

/* All raw fields into their planes: whole 16-element chunks through a pack16 specialised for
 * the layout, the rest (and rare layouts) one at a time. */
static void pack_raw(const void *in, int64_t n, int width, int k, uint8_t *raw,
                     const int64_t *parts, int nparts) {
    uint8_t *planes[5];
    for (int j = 0; j < nparts; j++) planes[j] = raw + parts[3 * j + 2];
    int64_t z = n / 16 * 16;
#define CASE(W, R, FN) case (W) * 32 + (R): FN(in, R, 0, z, planes); break;
    switch (width * 32 + k + 1) {
        CASE(1, 1, pack16_u8) CASE(1, 2, pack16_u8) CASE(1, 3, pack16_u8) CASE(1, 4, pack16_u8)
        CASE(2, 5, pack16_u16) CASE(2, 6, pack16_u16) CASE(2, 7, pack16_u16)
        CASE(2, 8, pack16_u16) CASE(2, 9, pack16_u16) CASE(2, 10, pack16_u16)
        CASE(2, 11, pack16_u16) CASE(4, 21, pack16_u32) CASE(4, 22, pack16_u32)
        CASE(4, 23, pack16_u32) CASE(4, 24, pack16_u32)
        default: z = 0;
    }
#undef CASE
    const int top = width * 8 - 1;
    for (int64_t e = z; e < n; e++) {
        uint32_t u = load_elem(in, e, width);
        put_field(raw, parts, nparts, e, ((u >> top) << k) | (u & ((1u << k) - 1)));
    }
}

/* Writes the code stream (MSB-first), the raw field planes, the segment gaps (nibbles) and
 * the block index. Output planes must be zeroed and sized by the caller from the total bit
 * count it computed from the histogram. Returns the bits written. */
int64_t tc_encode(const void *in, int64_t n, int width, int k, const uint32_t *codes,
                  const uint8_t *lens, uint8_t *stream, uint8_t *raw, const int64_t *parts,
                  int nparts, uint8_t *gaps, int64_t *block_first, int64_t n_seg,
                  int64_t seg_bits, int64_t segs_per_block) {
    const uint32_t sym_mask = (1u << (width * 8 - 1 - k)) - 1;
    uint64_t acc = 0; /* pending code bits, at the top */
    int nacc = 0;
    int64_t pos = 0, seg = 0, out = 0, seg_start = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t s = (load_elem(in, i, width) >> k) & sym_mask;
        while (seg < n_seg && seg_start <= pos) { /* code i is the first of segment seg */
            gaps[seg >> 1] |= (uint8_t)((pos - seg_start) << ((seg & 1) * 4));
            if (seg % segs_per_block == 0) block_first[seg / segs_per_block] = i;
            seg++;
            seg_start += seg_bits;
        }
        int len = lens[s];
        acc |= (uint64_t)codes[s] << (64 - nacc - len);
        nacc += len;
        pos += len;
        if (nacc >= 32) {
            uint32_t w = (uint32_t)(acc >> 32);
            stream[out] = w >> 24;
            stream[out + 1] = w >> 16;
            stream[out + 2] = w >> 8;
            stream[out + 3] = w;
            out += 4;
            acc <<= 32;
            nacc -= 32;
        }
    }
    for (; seg < n_seg; seg++) {
        gaps[seg >> 1] |= (uint8_t)((pos - seg * seg_bits) << ((seg & 1) * 4));
        if (seg % segs_per_block == 0) block_first[seg / segs_per_block] = n;
    }
    for (; nacc > 0; nacc -= 8, acc <<= 8) stream[out++] = (uint8_t)(acc >> 56);
    pack_raw(in, n, width, k, raw, parts, nparts);
    return pos;
}

/* The pair table of a single-symbol table, for the one or two codes that end inside the
 * lut_bits-bit window: entry = first symbol | total length << 11 | (symbols - 1) << 15 |
 * second symbol << 16, so one 32-bit store writes both symbols (the first one's bits 11..15
 * are masked off when merging). */
static void build_pairs(const uint16_t *lut, int bits, uint32_t *pairs) {
    const uint32_t mask = (1u << bits) - 1;
    for (uint32_t w = 0; w <= mask; w++) {
        uint32_t a = lut[w], a_len = a & 15, b = lut[(w << a_len) & mask], b_len = b & 15;
        uint32_t two = a_len + b_len <= (uint32_t)bits;
        uint32_t second = two ? (b >> 4) << 16 : 0;
        pairs[w] = (a >> 4) | (two ? a_len + b_len : a_len) << 11 | two << 15 | second;
    }
}

/* Up to eight codes from one 8-byte window at *pos: four lookups (4 * 12 <= 57 bits) in the
 * pair table, each giving one or two symbols. Writes syms[0 .. 8] (one spare); returns the
 * number of symbols decoded. */
ALWAYS_INLINE int64_t group8(const uint8_t *stream, const uint32_t *pairs, int shift,
                             int64_t *pos, uint16_t *syms) {
    uint64_t w = load_be64(stream + (*pos >> 3)) << (*pos & 7);
    int64_t i = 0, used = 0;
    for (int q = 0; q < 4; q++) {
        uint32_t e = pairs[w >> shift], len = (e >> 11) & 15;
        memcpy(syms + i, &e, sizeof e);
        i += 1 + ((e >> 15) & 1);
        w <<= len;
        used += len;
    }
    *pos += used;
    return i;
}

/* A code stream with its decode tables (single symbols, and pairs for group8). */
typedef struct {
    const uint8_t *bytes;
    int64_t len;
    const uint16_t *lut;
    const uint32_t *pairs;
    int lut_bits;
} code_stream;

/* Decodes m[j] symbols of each of `lanes` runs, interleaved so that the runs' dependency
 * chains (window -> table -> length -> window) overlap; the last few symbols of a run go
 * through the single-symbol table. Returns -1 on a stream overrun. */
ALWAYS_INLINE int decode_lanes(int lanes, const code_stream *cs, int64_t *pos, const int64_t *m,
                               uint16_t (*syms)[TILE_SLACK]) {
    const uint8_t *stream = cs->bytes;
    const uint16_t *lut = cs->lut;
    const uint32_t *pairs = cs->pairs;
    const int64_t stream_len = cs->len;
    const int shift = 64 - cs->lut_bits;
    int64_t p[4], i[4];
    for (int j = 0; j < lanes; j++) p[j] = pos[j], i[j] = 0;
    for (;;) {
        int room = 1, over = 0;
        for (int j = 0; j < lanes; j++) {
            room &= i[j] + 8 <= m[j];
            over |= (p[j] >> 3) + 8 > stream_len;
        }
        if (!room) break;
        if (over) return -1;
        for (int j = 0; j < lanes; j++) i[j] += group8(stream, pairs, shift, &p[j], syms[j] + i[j]);
    }
    for (int j = 0; j < lanes; j++) {
        while (i[j] < m[j]) {
            if ((p[j] >> 3) + 8 > stream_len) return -1;
            if (i[j] + 8 <= m[j]) {
                i[j] += group8(stream, pairs, shift, &p[j], syms[j] + i[j]);
                continue;
            }
            uint16_t e = lut[(load_be64(stream + (p[j] >> 3)) << (p[j] & 7)) >> shift];
            syms[j][i[j]++] = e >> 4;
            p[j] += e & 15;
        }
        pos[j] = p[j];
    }
    return 0;
}

/* Sixteen raw-field parts of b bits for elements e .. e + 15 (e a multiple of 16): they sit
 * in one 16-byte column group at one bit slot. */
ALWAYS_INLINE u8x16 part16(const uint8_t *plane, int b, int64_t e) {
    const int64_t span = 128 / b;
    u8x16 x;
    memcpy(&x, plane + (e / span) * 16, sizeof x);
    return (x >> (int)(((e % span) >> 4) * b)) & (uint8_t)((1u << b) - 1);
}

/* Elements a .. z - 1 (multiples of 16) from their symbols (syms[0] is element a) and raw
 * fields of R = k + 1 bits, sixteen at a time with GCC vector extensions (SSE2, NEON...).
 * W and R are compile-time constants at every call, so all shifts are immediates. */
#define DEFINE_MERGE16(NAME, ACC, LANE_T, OUT_T, OUTX16)                                    \
    ALWAYS_INLINE void NAME(void *out, int R, const uint16_t *syms, int64_t a, int64_t z,      \
                            const uint8_t *const *planes) {                                    \
        const int k = R - 1, top = (int)sizeof(OUT_T) * 8 - 1;                                 \
        for (int64_t e = a; e < z; e += 16) {                                                  \
            ACC r = {0};                                                                       \
            int j = 0, shift = 0;                                                              \
            if (R & 16) {                                                                      \
                u16x16 x;                                                                      \
                memcpy(&x, planes[j++] + 2 * e, sizeof x);                                     \
                r |= __builtin_convertvector(x, ACC);                                          \
                shift += 16;                                                                   \
            }                                                                                  \
            for (int b = 8; b >= 1; b >>= 1) {                                                 \
                if (!(R & b)) continue;                                                        \
                r |= __builtin_convertvector(part16(planes[j++], b, e), ACC) << shift;         \
                shift += b;                                                                    \
            }                                                                                  \
            u16x16 s16;                                                                        \
            memcpy(&s16, syms + (e - a), sizeof s16);                                          \
            s16 &= (uint16_t)0x7ff; /* group8 leaves length bits above some symbols */         \
            ACC v = ((r >> k) << top) | (__builtin_convertvector(s16, ACC) << k) |             \
                    (r & (LANE_T)((1u << k) - 1));                                             \
            OUTX16 o = __builtin_convertvector(v, OUTX16);                                     \
            memcpy((OUT_T *)out + e, &o, sizeof o);                                            \
        }                                                                                      \
    }
DEFINE_MERGE16(merge16_u8, u16x16, uint16_t, uint8_t, u8x16)
DEFINE_MERGE16(merge16_u16, u16x16, uint16_t, uint16_t, u16x16)
DEFINE_MERGE16(merge16_u32, u32x16, uint32_t, uint32_t, u32x16)

/* Elements lo .. hi - 1 one at a time (syms[0] is element lo). */
static void merge1(void *out, int width, int k, const uint16_t *syms, int64_t lo, int64_t hi,
                   const uint8_t *raw, const int64_t *parts, int nparts) {
    const int top = width * 8 - 1;
    const uint32_t low = (1u << k) - 1;
    for (int64_t e = lo; e < hi; e++) {
        uint32_t r = raw_field(raw, parts, nparts, e);
        uint32_t v = ((r >> k) << top) | ((uint32_t)(syms[e - lo] & 0x7ff) << k) | (r & low);
        if (width == 2) ((uint16_t *)out)[e] = (uint16_t)v;
        else if (width == 1) ((uint8_t *)out)[e] = (uint8_t)v;
        else ((uint32_t *)out)[e] = v;
    }
}

/* Elements lo .. hi - 1 (syms[0] is element lo): whole 16-element chunks through a merge16
 * specialised for the layout, the ragged ends (and rare layouts) one at a time. */
static void merge(void *out, int width, int k, const uint16_t *syms, int64_t lo, int64_t hi,
                  const uint8_t *raw, const int64_t *parts, int nparts) {
    const uint8_t *planes[5];
    for (int j = 0; j < nparts; j++) planes[j] = raw + parts[3 * j + 2];
    int64_t a = (lo + 15) / 16 * 16, z = hi / 16 * 16;
    if (z <= a) a = z = hi;
    const uint16_t *body = syms + (a - lo);
#define CASE(W, R, FN) case (W) * 32 + (R): FN(out, R, body, a, z, planes); break;
    switch (width * 32 + k + 1) {
        CASE(1, 1, merge16_u8) CASE(1, 2, merge16_u8) CASE(1, 3, merge16_u8)
        CASE(1, 4, merge16_u8) CASE(2, 5, merge16_u16) CASE(2, 6, merge16_u16)
        CASE(2, 7, merge16_u16) CASE(2, 8, merge16_u16) CASE(2, 9, merge16_u16)
        CASE(2, 10, merge16_u16) CASE(2, 11, merge16_u16) CASE(4, 21, merge16_u32)
        CASE(4, 22, merge16_u32) CASE(4, 23, merge16_u32) CASE(4, 24, merge16_u32)
        default: a = z = hi;
    }
#undef CASE
    merge1(out, width, k, syms, lo, a, raw, parts, nparts);
    merge1(out, width, k, syms + (z - lo), z, hi, raw, parts, nparts);
}

/* Decodes `lanes` (1..4) runs of the stream into out (the whole tensor, `width`-byte
 * elements): run j covers elements first[j] .. first[j] + count[j] - 1 whose codes start at
 * bit pos[j]; on return pos[j] is the bit after its last code. Tiles end on multiples of
 * GROUP so that only a run's two ends take the slow path. Returns 0, or -1 on a stream
 * overrun (corrupt planes). */
int tc_decode(const uint8_t *stream, int64_t stream_len, const uint16_t *lut, int lut_bits,
              int lanes, int64_t *pos, const int64_t *first, const int64_t *count, void *out,
              int width, int k, const uint8_t *raw, const int64_t *parts, int nparts) {
    static _Thread_local uint16_t syms[4][TILE_SLACK];
    static _Thread_local uint32_t pairs[1 << 12];
    build_pairs(lut, lut_bits, pairs);
    const code_stream cs = {stream, stream_len, lut, pairs, lut_bits};
    int64_t next[4], m[4];
    for (int j = 0; j < lanes; j++) next[j] = first[j];
    for (;;) {
        int busy = 0;
        for (int j = 0; j < lanes; j++) {
            int64_t end = first[j] + count[j], cut = next[j] / GROUP * GROUP + TILE;
            m[j] = (cut < end ? cut : end) - next[j];
            busy |= m[j] > 0;
        }
        if (!busy) return 0;
        int bad;
        switch (lanes) { /* make the lane count a compile-time constant */
            case 4: bad = decode_lanes(4, &cs, pos, m, syms); break;
            case 3: bad = decode_lanes(3, &cs, pos, m, syms); break;
            case 2: bad = decode_lanes(2, &cs, pos, m, syms); break;
            default: bad = decode_lanes(1, &cs, pos, m, syms);
        }
        if (bad) return -1;
        for (int j = 0; j < lanes; j++) {
            merge(out, width, k, syms[j], next[j], next[j] + m[j], raw, parts, nparts);
            next[j] += m[j];
        }
    }
}
