/* Encoder side of the C fast path: symbol histogram and the code planes (see _codec.h). */
#include "_codec.h"

static inline uint32_t load_elem(const void *in, int64_t i, int width) {
    if (width == 2) return ((const uint16_t *)in)[i];
    if (width == 1) return ((const uint8_t *)in)[i];
    return ((const uint32_t *)in)[i];
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
