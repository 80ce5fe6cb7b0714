/* The AMX tile instructions amx_linear.c uses, in plain C on per-thread tile registers, for a
 * build with -DTISON_AMX_EMULATED on a CPU without AMX (tests/tiers.py's amx_emulated): so that
 * the AMX kernel's packing, grouping and tails are tested on every machine with AVX-512 BF16,
 * not only where the tiles exist. As the Intel SDM gives them for palette 1: a load fills a
 * tile's configured rows and bytes from memory at a row stride (the rest zero), TDPBF16PS adds
 * to C[m][n] the two products of the bf16 pairs A[m][2p, 2p+1] and B[p][2n, 2n+1] over every p,
 * in float32. Never in a shipped build: the tier's flags do not define it. */
#ifndef TISON_AMX_EMULATED_H
#define TISON_AMX_EMULATED_H

#include <stdint.h>
#include <string.h>

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps

typedef struct {
    uint8_t data[8][16][64];
    uint8_t rows[8];
    uint16_t colsb[8];
} amx_emulated_tiles;

static __thread amx_emulated_tiles amx_tiles;

static inline void amx_emulated_config(const void *config) {
    const uint8_t *c = config; /* palette, start_row, 14 reserved, colsb[16] (u16), rows[16] */
    for (int t = 0; t < 8; t++) {
        memcpy(&amx_tiles.colsb[t], c + 16 + 2 * t, 2);
        amx_tiles.rows[t] = c[48 + t];
    }
    memset(amx_tiles.data, 0, sizeof amx_tiles.data);
}

static inline void amx_emulated_load(int t, const void *base, int64_t stride) {
    memset(amx_tiles.data[t], 0, sizeof amx_tiles.data[t]);
    for (int r = 0; r < amx_tiles.rows[t]; r++)
        memcpy(amx_tiles.data[t][r], (const uint8_t *)base + r * stride, amx_tiles.colsb[t]);
}

static inline void amx_emulated_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < amx_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, amx_tiles.data[t][r], amx_tiles.colsb[t]);
}

static inline float amx_emulated_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void amx_emulated_dpbf16ps(int c, int a, int b) {
    const int m_rows = amx_tiles.rows[c], n_cols = amx_tiles.colsb[c] / 4;
    const int pairs = amx_tiles.colsb[a] / 4;
    for (int m = 0; m < m_rows; m++)
        for (int n = 0; n < n_cols; n++) {
            float acc;
            memcpy(&acc, amx_tiles.data[c][m] + 4 * n, 4);
            for (int p = 0; p < pairs; p++) {
                const uint8_t *x = amx_tiles.data[a][m] + 4 * p, *y = amx_tiles.data[b][p] + 4 * n;
                acc += amx_emulated_bf16(x) * amx_emulated_bf16(y) +
                       amx_emulated_bf16(x + 2) * amx_emulated_bf16(y + 2);
            }
            memcpy(amx_tiles.data[c][m] + 4 * n, &acc, 4);
        }
}

#define _tile_loadconfig(config) amx_emulated_config(config)
#define _tile_release() memset(&amx_tiles, 0, sizeof amx_tiles)
#define _tile_zero(t) memset(amx_tiles.data[t], 0, sizeof amx_tiles.data[t])
#define _tile_loadd(t, base, stride) amx_emulated_load(t, base, stride)
#define _tile_stored(t, base, stride) amx_emulated_store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) amx_emulated_dpbf16ps(c, a, b)
#endif
