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

/* The raw fields (R = k + 1 bits) of elements a .. z - 1 (multiples of 16) into their zeroed
 * part planes, sixteen at a time (the decoder merges them back the same way). */
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

MULTI_TARGET void tc_pack_raw(const void *in, int64_t a, int64_t z, int width, int k,
                              uint8_t *raw, const int64_t *parts, int nparts) {
    uint8_t *planes[MAX_PARTS];
    for (int j = 0; j < nparts; j++) planes[j] = raw + parts[3 * j + 2];
    int64_t whole = a + (z - a) / 16 * 16;
#define CASE(W, R, FN) case (W) * 32 + (R): FN(in, R, a, whole, planes); break;
    switch (width * 32 + k + 1) {
        CASE(1, 1, pack16_u8) CASE(1, 2, pack16_u8) CASE(1, 3, pack16_u8) CASE(1, 4, pack16_u8)
        CASE(2, 5, pack16_u16) CASE(2, 6, pack16_u16) CASE(2, 7, pack16_u16)
        CASE(2, 8, pack16_u16) CASE(2, 9, pack16_u16) CASE(2, 10, pack16_u16)
        CASE(2, 11, pack16_u16) CASE(4, 21, pack16_u32) CASE(4, 22, pack16_u32)
        CASE(4, 23, pack16_u32) CASE(4, 24, pack16_u32)
        default: whole = a;
    }
#undef CASE
    const int top = width * 8 - 1;
    for (int64_t e = whole; e < z; e++) {
        uint32_t u = load_elem(in, e, width);
        put_field(raw, parts, nparts, e, ((u >> top) << k) | (u & ((1u << k) - 1)));
    }
}
