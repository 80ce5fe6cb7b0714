/* The raw field planes of the encoder (format: FORMAT.md "raw"; see _codec.h). */
#include "_codec.h"

static inline uint32_t load_elem(const void *in, int64_t i, int width) {
    if (width == 2) return ((const uint16_t *)in)[i];
    if (width == 1) return ((const uint8_t *)in)[i];
    return ((const uint32_t *)in)[i];
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

/* The raw fields (R = k + 1 bits) of elements a .. z - 1 (multiples of 128) into their part
 * planes, 128 at a time: eight vectors of sixteen fields, from which every part's 16-byte
 * groups (b of them for a b-bit part) are assembled in registers and stored whole, so the
 * planes are only written, never read back (the decoder merges them the same way). */
#define DEFINE_PACK128(NAME, IN_T, INX16, ACC, LANE_T)                                      \
    ALWAYS_INLINE void NAME(const void *in, int R, int64_t a, int64_t z,                       \
                            uint8_t *const *planes) {                                          \
        const int k = R - 1, top = (int)sizeof(IN_T) * 8 - 1;                                  \
        for (int64_t e = a; e < z; e += 128) {                                                 \
            ACC r[8];                                                                          \
            for (int j = 0; j < 8; j++) {                                                      \
                INX16 u;                                                                       \
                memcpy(&u, (const IN_T *)in + e + 16 * j, sizeof u);                           \
                ACC v = __builtin_convertvector(u, ACC);                                       \
                r[j] = ((v >> top) << k) | (v & (LANE_T)((1u << k) - 1));                      \
            }                                                                                  \
            int p = 0, shift = 0;                                                              \
            if (R & 16) {                                                                      \
                for (int j = 0; j < 8; j++) {                                                  \
                    u16x16 x = __builtin_convertvector(r[j], u16x16);                          \
                    memcpy(planes[p] + 2 * (e + 16 * j), &x, sizeof x);                        \
                }                                                                              \
                p++, shift += 16;                                                              \
            }                                                                                  \
            for (int b = 8; b >= 1; b >>= 1) {                                                 \
                if (!(R & b)) continue;                                                        \
                uint8_t *group = planes[p++] + e / (128 / b) * 16;                             \
                for (int g = 0; g < b; g++, group += 16) {                                     \
                    u8x16 x = {0};                                                             \
                    for (int m = 0; m < 8 / b; m++) {                                          \
                        ACC f = (r[g * (8 / b) + m] >> shift) & (LANE_T)((1u << b) - 1);       \
                        x |= __builtin_convertvector(f, u8x16) << (m * b);                     \
                    }                                                                          \
                    memcpy(group, &x, sizeof x);                                               \
                }                                                                              \
                shift += b;                                                                    \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_PACK128(pack128_u8, uint8_t, u8x16, u16x16, uint16_t)
DEFINE_PACK128(pack128_u16, uint16_t, u16x16, u16x16, uint16_t)
DEFINE_PACK128(pack128_u32, uint32_t, u32x16, u32x16, uint32_t)

MULTI_TARGET void tc_pack_raw(const void *in, int64_t a, int64_t z, int width, int k,
                              uint8_t *raw, const int64_t *parts, int nparts) {
    uint8_t *planes[MAX_PARTS];
    for (int j = 0; j < nparts; j++) planes[j] = raw + parts[3 * j + 2];
    const int64_t whole = a + (z - a) / 128 * 128;
    const int R = k + 1;
#define CASE(W, R, FN) case (W) * 32 + (R): FN(in, R, a, whole, planes); break;
    switch (width * 32 + R) {
        CASE(1, 1, pack128_u8) CASE(1, 2, pack128_u8) CASE(1, 3, pack128_u8) CASE(1, 4, pack128_u8)
        CASE(2, 5, pack128_u16) CASE(2, 6, pack128_u16) CASE(2, 7, pack128_u16)
        CASE(2, 8, pack128_u16) CASE(2, 9, pack128_u16) CASE(2, 10, pack128_u16)
        CASE(2, 11, pack128_u16) CASE(4, 21, pack128_u32) CASE(4, 22, pack128_u32)
        CASE(4, 23, pack128_u32) CASE(4, 24, pack128_u32)
        default: /* a split no format's candidates use: the same, R not known at compile time */
            if (width == 1) pack128_u8(in, R, a, whole, planes);
            if (width == 2) pack128_u16(in, R, a, whole, planes);
            if (width == 4) pack128_u32(in, R, a, whole, planes);
    }
#undef CASE
    const int top = width * 8 - 1;
    for (int64_t e = whole; e < z; e++) {
        uint32_t u = load_elem(in, e, width);
        put_field(raw, parts, nparts, e, ((u >> top) << k) | (u & ((1u << k) - 1)));
    }
}

/* Zeroes what tc_pack_raw of elements 0 .. n - 1 does not store whole: the bytes of each
 * part plane from the last, partial run of 128 elements (whose fields it ORs in) to the
 * plane's end. */
void tc_zero_raw_tail(int64_t n, uint8_t *raw, const int64_t *parts, int nparts, int64_t raw_len) {
    const int64_t whole = n / 128 * 128;
    for (int j = 0; j < nparts; j++) {
        const int64_t b = parts[3 * j], start = parts[3 * j + 2];
        const int64_t end = j + 1 < nparts ? parts[3 * (j + 1) + 2] : raw_len;
        const int64_t from = start + (b == 16 ? 2 * n : whole / (128 / b) * 16);
        memset(raw + from, 0, (size_t)(end - from));
    }
}
