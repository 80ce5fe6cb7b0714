/* The decoding loop of the C fast path (see _codec.h): runs of the code stream decoded by
 * table lookups, several runs interleaved so that their dependency chains overlap, then
 * merged with their raw fields sixteen elements at a time; each tile of output is
 * checksummed while it is still in the L1 cache. On x86-64 the loop is also compiled for
 * AVX2 + BMI2 (one-uop variable shifts, wider merges) and picked at load time. */
#include "_codec.h"

#define TILE 4096 /* symbols decoded per lane before they are merged with their raw fields */
#define TILE_SLACK (TILE + 16) /* room for the spare symbols group8 writes */
#define GROUP 16 /* elements merged at once; tiles end on multiples of it */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTI_TARGET __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MULTI_TARGET
#endif

static inline uint64_t load_be64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
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

/* Up to eight codes from one 8-byte window at *pos: four lookups (4 * 12 <= 57 bits) in the
 * pair table, each giving one or two symbols. Writes syms[0 .. 8] (one spare); returns the
 * number of symbols decoded. */
ALWAYS_INLINE int64_t group8(const uint8_t *stream, const uint32_t *pairs, int shift,
                             int64_t *pos, uint16_t *syms) {
    uint64_t w = load_be64(stream + (*pos >> 3)) << (*pos & 7);
    int64_t i = 0, used = 0;
    for (int q = 0; q < 4; q++) {
        uint32_t e = pairs[w >> shift];
        memcpy(syms + i, &e, sizeof e);
        i += 1 + ((e >> 16) & 1);
        w <<= e & 15;
        used += e & 15;
    }
    *pos += used;
    return i;
}

/* Decodes m[j] symbols of each of `lanes` runs, interleaved so that the runs' dependency
 * chains (window -> table -> length -> window) overlap; the last few symbols of a run go
 * through the single-symbol table. Returns -1 on a stream overrun. */
ALWAYS_INLINE int decode_lanes(int lanes, const tc_table *t, const uint8_t *stream,
                               int64_t stream_len, int64_t *pos, const int64_t *m,
                               uint16_t (*syms)[TILE_SLACK]) {
    const uint16_t *lut = t->lut;
    const uint32_t *pairs = t->pairs;
    const int shift = 64 - t->lut_bits;
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
            syms[j][i[j]++] = (uint16_t)((e >> 4) << 5);
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
            s16 >>= 5; /* group8 leaves length bits under the symbols */                        \
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
        uint32_t v = ((r >> k) << top) | ((uint32_t)(syms[e - lo] >> 5) << k) | (r & low);
        if (width == 2) ((uint16_t *)out)[e] = (uint16_t)v;
        else if (width == 1) ((uint8_t *)out)[e] = (uint8_t)v;
        else ((uint32_t *)out)[e] = v;
    }
}

/* Elements lo .. hi - 1 (syms[0] is element lo): whole 16-element chunks through a merge16
 * specialised for the layout, the ragged ends (and rare layouts) one at a time. */
ALWAYS_INLINE void merge(void *out, int width, int k, const uint16_t *syms, int64_t lo, int64_t hi,
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


/* Checksums the tiles lanes 0 .. lanes - 1 just wrote: elements next[j] .. + m[j] - 1. */
static void tile_crc(const tc_target *t, tc_run *runs, const int64_t *next, const int64_t *m,
                     int lanes) {
    const uint8_t *p[MAX_LANES];
    int64_t n[MAX_LANES];
    uint32_t crc[MAX_LANES];
    for (int j = 0; j < lanes; j++) {
        p[j] = (const uint8_t *)t->out + next[j] * t->width;
        n[j] = m[j] * t->width;
        crc[j] = runs[j].crc;
    }
    crc32c_update_lanes(crc, p, n, lanes);
    for (int j = 0; j < lanes; j++) runs[j].crc = crc[j];
}

/* Tiles end on multiples of GROUP so that only a run's two ends take the slow merge path. */
MULTI_TARGET int tc_decode_runs(const tc_table *table, const tc_target *t, tc_run *runs,
                                int lanes, int verify) {
    uint16_t tile_syms[MAX_LANES][TILE_SLACK];
    int64_t pos[MAX_LANES], next[MAX_LANES], m[MAX_LANES];
    for (int j = 0; j < lanes; j++) {
        pos[j] = runs[j].pos;
        next[j] = runs[j].first;
        runs[j].crc = 0;
    }
    for (;;) {
        int busy = 0;
        for (int j = 0; j < lanes; j++) {
            int64_t end = runs[j].first + runs[j].count, cut = next[j] / GROUP * GROUP + TILE;
            m[j] = (cut < end ? cut : end) - next[j];
            busy |= m[j] > 0;
        }
        if (!busy) break;
        int bad;
        switch (lanes) { /* make the lane count a compile-time constant */
            case 4: bad = decode_lanes(4, table, t->stream, t->stream_len, pos, m, tile_syms); break;
            case 3: bad = decode_lanes(3, table, t->stream, t->stream_len, pos, m, tile_syms); break;
            case 2: bad = decode_lanes(2, table, t->stream, t->stream_len, pos, m, tile_syms); break;
            default: bad = decode_lanes(1, table, t->stream, t->stream_len, pos, m, tile_syms);
        }
        if (bad) return TC_OVERRUN;
        for (int j = 0; j < lanes; j++)
            merge(t->out, t->width, t->k, tile_syms[j], next[j], next[j] + m[j], t->raw,
                  t->parts, t->nparts);
        if (verify) tile_crc(t, runs, next, m, lanes);
        for (int j = 0; j < lanes; j++) next[j] += m[j];
    }
    for (int j = 0; j < lanes; j++)
        if (pos[j] != runs[j].end) return TC_MISMATCH;
    return TC_OK;
}
