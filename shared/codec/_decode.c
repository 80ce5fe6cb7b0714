/* The decoding loop of the C fast path (see _codec.h): runs of the code stream decoded by
 * table lookups, up to two symbols each, several runs interleaved so that their dependency
 * chains overlap, then merged with their raw fields 16 or 32 elements at a time; each tile
 * of output is checksummed while it is still in the cache. On x86-64 the loop is also compiled for
 * AVX2 + BMI2 (one-uop variable shifts, wider merges) and picked at load time. */
#include "_codec.h"

#define TILE 4096 /* symbols decoded per lane before they are merged with their raw fields */
#define GROUP 32 /* elements merged at once; tiles end on multiples of it */

/* The 32-byte vectors below never cross a call (all ALWAYS_INLINE); GCC still warns that
 * their ABI would differ without AVX. */
#pragma GCC diagnostic ignored "-Wpsabi"

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

#define SHIFT (64 - LUT_MAX_BITS) /* a 64-bit window's top LUT_MAX_BITS bits index the tables */

/* Rounds of one group of four pair-table lookups per lane (4 * 12 <= 57 bits: one 8-byte
 * window), each lookup giving one or two symbols, the lanes interleaved so that their
 * dependency chains (window -> table -> shift -> window) overlap. Bit 0 of a window is a
 * marker the lookups never reach: after the four shifts it sits at bit `bits consumed`, so
 * one count of trailing zeros advances the position. Runs until some lane has fewer than 8
 * symbols of room left or nearly reaches the stream's end: a group reads at most 48 bits
 * and writes at most 8 symbols (o[j] .. o[j] + 7), so a round needs no bounds check. */
ALWAYS_INLINE void decode_rounds(int lanes, const uint32_t *pairs, const uint8_t *stream,
                                 int64_t last, int64_t *p, uint16_t **o, uint16_t *const *end) {
    for (;;) {
        int64_t rounds = INT64_MAX;
        for (int j = 0; j < lanes; j++) {
            int64_t by_syms = (end[j] - o[j]) >> 3;
            const int64_t by_bits = p[j] <= last ? (last - p[j]) / 48 + 1 : 0;
            by_syms = by_syms < by_bits ? by_syms : by_bits;
            rounds = rounds < by_syms ? rounds : by_syms;
        }
        if (rounds <= 0) return;
        for (int64_t r = 0; r < rounds; r++) {
            uint64_t w[MAX_LANES];
            for (int j = 0; j < lanes; j++)
                w[j] = load_be64(stream + (p[j] >> 3)) << (p[j] & 7) | 1;
            for (int q = 0; q < 4; q++)
                for (int j = 0; j < lanes; j++) {
                    uint32_t e = pairs[w[j] >> SHIFT];
                    memcpy(o[j] + q, &e, sizeof e);
                    o[j] += e >> 31;
                    w[j] <<= e & 15;
                }
            for (int j = 0; j < lanes; j++) p[j] += __builtin_ctzll(w[j]), o[j] += 4;
        }
    }
}

/* Decodes m[j] symbols of each of `lanes` runs into syms[j] (starting at bit pos[j], which
 * it advances): interleaved rounds over the lanes that still have room, so that a lane
 * finishing early does not hold the others back, then the last few symbols of each run one
 * at a time through the single-symbol table. Returns -1 on a stream overrun. */
ALWAYS_INLINE int decode_lanes(int lanes, const tc_table *t, const uint8_t *stream,
                               int64_t stream_len, int64_t *pos, const int64_t *m,
                               uint16_t *const *syms) {
    const int64_t last = (stream_len - 8) * 8; /* the last bit a window may start at */
    uint16_t *o[MAX_LANES], *end[MAX_LANES];
    for (int j = 0; j < lanes; j++) o[j] = syms[j], end[j] = syms[j] + m[j];
    for (;;) {
        int live[MAX_LANES], n = 0;
        for (int j = 0; j < lanes; j++)
            if (end[j] - o[j] >= 8 && pos[j] <= last) live[n++] = j;
        if (n == 0) break;
        int64_t lp[MAX_LANES];
        uint16_t *lo[MAX_LANES], *lend[MAX_LANES];
        for (int q = 0; q < n; q++)
            lp[q] = pos[live[q]], lo[q] = o[live[q]], lend[q] = end[live[q]];
#define ROUNDS(L) decode_rounds(L, t->pairs, stream, last, lp, lo, lend); break
        switch (n) { /* make the lane count a compile-time constant */
            case 6: ROUNDS(6);
            case 5: ROUNDS(5);
            case 4: ROUNDS(4);
            case 3: ROUNDS(3);
            case 2: ROUNDS(2);
            default: ROUNDS(1);
        }
#undef ROUNDS
        for (int q = 0; q < n; q++) pos[live[q]] = lp[q], o[live[q]] = lo[q];
    }
    for (int j = 0; j < lanes; j++) {
        int64_t p = pos[j];
        for (; o[j] < end[j]; o[j]++) {
            if ((p >> 3) + 8 > stream_len) return -1;
            uint16_t e = t->lut[(load_be64(stream + (p >> 3)) << (p & 7)) >> SHIFT];
            *o[j] = e;
            p += e & 15;
        }
        pos[j] = p;
    }
    return 0;
}

/* Raw-field parts of b bits of the 16 * `slots` elements from e (a multiple of 16 * slots):
 * for b <= 4 they sit in one 16-byte column group at consecutive bit slots (shifted as 16-bit
 * lanes, since x86 has no byte shifts, then masked); for b = 8 they are consecutive bytes. */
ALWAYS_INLINE void parts_of(const uint8_t *plane, int b, int64_t e, int slots, u8x16 *x) {
    if (b == 8) {
        memcpy(x, plane + e, 16 * (size_t)slots);
        return;
    }
    const int log_span = 7 - __builtin_ctz((unsigned)b); /* 128 / b elements per group */
    const uint64_t u = (uint64_t)e;
    u16x8 column;
    memcpy(&column, plane + (u >> log_span) * 16, sizeof column);
    const int slot = (int)((u & ((1u << log_span) - 1)) >> 4) * b;
#pragma GCC unroll 2
    for (int i = 0; i < slots; i++)
        x[i] = (u8x16)(column >> (slot + i * b)) & (uint8_t)((1u << b) - 1);
}

ALWAYS_INLINE u8x16 part16(const uint8_t *plane, int b, int64_t e) {
    u8x16 x;
    parts_of(plane, b, e, 1, &x);
    return x;
}

/* Two 16-byte vectors as one of 32 bytes. Vector element constructors and casts lower to
 * one insert on AVX2 and to nothing (a register pair) on SSE2 or NEON; GCC 12 turns the
 * equivalent __builtin_shufflevector into byte-by-byte moves where vectors have 16 bytes. */
typedef unsigned __int128 u128;
typedef u128 u128x2 __attribute__((vector_size(32)));
ALWAYS_INLINE u8x32 join16(u8x16 lo, u8x16 hi) { return (u8x32)(u128x2){(u128)lo, (u128)hi}; }

ALWAYS_INLINE u8x32 part32(const uint8_t *plane, int b, int64_t e) {
    u8x16 x[2];
    parts_of(plane, b, e, 2, x);
    return join16(x[0], x[1]);
}

/* Sixteen bytes zero-extended (one vpmovzxbw on AVX2, two unpacks on SSE2). */
#define ZEXT16(T, x)                                                                        \
    ((T){x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13], \
         x[14], x[15]})
ALWAYS_INLINE u16x16 widen_u16(u8x16 x) { return ZEXT16(u16x16, x); }
ALWAYS_INLINE u32x16 widen_u32(u8x16 x) { return ZEXT16(u32x16, x); }
#define AS_IS(x) (x)

/* Elements a .. z - 1 (multiples of LANES) from their symbols (syms[0] is element a) and raw
 * fields of R = k + 1 bits, LANES at a time in lanes of the output's width, with GCC vector
 * extensions (SSE2, AVX2, NEON...): FP8 32 bytes, wider outputs 16 elements. W and R are
 * compile-time constants at every call, so all shifts but the planes' bit slots are
 * immediates. */
#define DEFINE_MERGE(NAME, ACC, LANE_T, OUT_T, LANES, PART, WIDEN)                                \
    ALWAYS_INLINE void NAME(void *out, int R, const uint16_t *syms, int64_t a, int64_t z,      \
                            const uint8_t *const *planes) {                                    \
        typedef uint16_t u16xL __attribute__((vector_size(2 * LANES)));                        \
        const int k = R - 1, top = (int)sizeof(OUT_T) * 8 - 1;                                 \
        /* FP8 symbols have at most 7 bits: 255 lets the narrowing reuse the mask */           \
        const uint16_t SYM_MASK = sizeof(OUT_T) == 1 ? 255 : 2047;                             \
        for (int64_t e = a; e < z; e += LANES) {                                               \
            ACC r = {0};                                                                       \
            int j = 0, shift = 0;                                                              \
            if (R & 16) {                                                                      \
                u16xL x;                                                                       \
                memcpy(&x, planes[j++] + 2 * e, sizeof x);                                     \
                r |= __builtin_convertvector(x, ACC);                                          \
                shift += 16;                                                                   \
            }                                                                                  \
            _Pragma("GCC unroll 4") /* R is a constant: the parts are known */               \
            for (int b = 8; b >= 1; b >>= 1) {                                                 \
                if (!(R & b)) continue;                                                        \
                r |= WIDEN(PART(planes[j++], b, e)) << shift;                                 \
                shift += b;                                                                    \
            }                                                                                  \
            u16xL s;                                                                           \
            memcpy(&s, syms + (e - a), sizeof s);                                              \
            ACC sym = __builtin_convertvector((s >> 4) & SYM_MASK, ACC); /* see tc_table */     \
            ACC v = ((r >> k) << top) | (sym << k) | (r & (LANE_T)((1u << k) - 1));            \
            memcpy((OUT_T *)out + e, &v, sizeof v);                                            \
        }                                                                                      \
    }
DEFINE_MERGE(merge_u8, u8x32, uint8_t, uint8_t, 32, part32, AS_IS)
DEFINE_MERGE(merge_u16, u16x16, uint16_t, uint16_t, 16, part16, widen_u16)
DEFINE_MERGE(merge_u32, u32x16, uint32_t, uint32_t, 16, part16, widen_u32)
#undef AS_IS

/* Elements lo .. hi - 1 one at a time (syms[0] is element lo). */
static void merge1(void *out, int width, int k, const uint16_t *syms, int64_t lo, int64_t hi,
                   const uint8_t *raw, const int64_t *parts, int nparts) {
    const int top = width * 8 - 1;
    const uint32_t low = (1u << k) - 1;
    for (int64_t e = lo; e < hi; e++) {
        uint32_t r = raw_field(raw, parts, nparts, e);
        uint32_t v = ((r >> k) << top) | ((uint32_t)((syms[e - lo] >> 4) & 2047) << k) | (r & low);
        if (width == 2) ((uint16_t *)out)[e] = (uint16_t)v;
        else if (width == 1) ((uint8_t *)out)[e] = (uint8_t)v;
        else ((uint32_t *)out)[e] = v;
    }
}

/* Elements lo .. hi - 1 (syms[0] is element lo): whole GROUPs through a merge specialised
 * for the layout, the ragged ends (and rare layouts) one at a time. */
ALWAYS_INLINE void merge(void *out, int width, int k, const uint16_t *syms, int64_t lo, int64_t hi,
                  const uint8_t *raw, const int64_t *parts, int nparts) {
    const uint8_t *planes[5];
    for (int j = 0; j < nparts; j++) planes[j] = raw + parts[3 * j + 2];
    int64_t a = (lo + GROUP - 1) / GROUP * GROUP, z = hi / GROUP * GROUP;
    if (z <= a) a = z = hi;
    const uint16_t *body = syms + (a - lo);
#define CASE(W, R, FN) case (W) * 32 + (R): FN(out, R, body, a, z, planes); break;
    switch (width * 32 + k + 1) {
        CASE(1, 1, merge_u8) CASE(1, 2, merge_u8) CASE(1, 3, merge_u8)
        CASE(1, 4, merge_u8) CASE(2, 5, merge_u16) CASE(2, 6, merge_u16)
        CASE(2, 7, merge_u16) CASE(2, 8, merge_u16) CASE(2, 9, merge_u16)
        CASE(2, 10, merge_u16) CASE(2, 11, merge_u16) CASE(4, 21, merge_u32)
        CASE(4, 22, merge_u32) CASE(4, 23, merge_u32) CASE(4, 24, merge_u32)
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
    uint16_t tile_syms[MAX_LANES][TILE];
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
        uint16_t *syms[MAX_LANES];
        for (int j = 0; j < lanes; j++) syms[j] = tile_syms[j];
        int bad = decode_lanes(lanes, table, t->stream, t->stream_len, pos, m, syms);
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
