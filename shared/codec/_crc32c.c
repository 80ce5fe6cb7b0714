/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) for the codec's checksums: the
 * SSE4.2 crc32 instruction where the CPU has it (8 bytes per instruction; several chains
 * interleaved hide its latency), slicing-by-8 tables elsewhere. combine() is zlib's
 * crc32_combine over this polynomial, so threads checksum their parts independently. */
#include <pthread.h>

#include "_codec.h"

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static uint32_t x8pow2[64]; /* x**(8 * 2**i) modulo the polynomial, for combine() */
static int have_sse42;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static uint32_t multmodp(uint32_t a, uint32_t b);

static void init(void) {
    x8pow2[0] = 1u << 23; /* x**8: one byte */
    for (int i = 1; i < 64; i++) x8pow2[i] = multmodp(x8pow2[i - 1], x8pow2[i - 1]);
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][b] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int b = 0; b < 256; b++)
            table[t][b] = (table[t - 1][b] >> 8) ^ table[0][table[t - 1][b] & 255];
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
}

/* The register (pre-inverted CRC) after bytes p[0 .. n - 1], eight at a time by table. */
static uint32_t soft(uint32_t c, const uint8_t *p, int64_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = table[7][lo & 255] ^ table[6][(lo >> 8) & 255] ^ table[5][(lo >> 16) & 255] ^
            table[4][lo >> 24] ^ table[3][hi & 255] ^ table[2][(hi >> 8) & 255] ^
            table[1][(hi >> 16) & 255] ^ table[0][hi >> 24];
    }
    for (; n > 0; n--) c = table[0][(c ^ *p++) & 255] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t hard_tail(uint32_t c, const uint8_t *p,
                                                            int64_t n) {
    for (; n > 0; n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}

/* Registers c[j] after bytes p[j][0 .. n[j] - 1]: the common length in lock-step (the
 * instruction has a latency of three cycles and a throughput of one), the rest per lane. */
__attribute__((target("sse4.2"))) static void hard(uint32_t *c, const uint8_t *const *p,
                                                   const int64_t *n, int lanes) {
    uint64_t r[MAX_LANES] = {0};
    int64_t common = n[0];
    for (int j = 0; j < lanes; j++) {
        r[j] = c[j];
        common = n[j] < common ? n[j] : common;
    }
    common &= ~(int64_t)7;
    for (int64_t i = 0; i < common; i += 8)
        for (int j = 0; j < lanes; j++) {
            uint64_t v;
            memcpy(&v, p[j] + i, 8);
            r[j] = __builtin_ia32_crc32di(r[j], v);
        }
    for (int j = 0; j < lanes; j++) {
        int64_t i = common;
        for (; i + 8 <= n[j]; i += 8) {
            uint64_t v;
            memcpy(&v, p[j] + i, 8);
            r[j] = __builtin_ia32_crc32di(r[j], v);
        }
        c[j] = hard_tail((uint32_t)r[j], p[j] + i, n[j] - i);
    }
}
#endif

void crc32c_update_lanes(uint32_t *crc, const uint8_t *const *p, const int64_t *n, int lanes) {
    pthread_once(&once, init);
    uint32_t c[MAX_LANES];
    for (int j = 0; j < lanes; j++) c[j] = ~crc[j];
#if defined(__x86_64__)
    if (have_sse42) {
        hard(c, p, n, lanes);
        for (int j = 0; j < lanes; j++) crc[j] = ~c[j];
        return;
    }
#endif
    for (int j = 0; j < lanes; j++) crc[j] = ~soft(c[j], p[j], n[j]);
}

uint32_t crc32c_update(uint32_t crc, const uint8_t *p, int64_t n) {
    crc32c_update_lanes(&crc, &p, &n, 1);
    return crc;
}

/* CRC-32C of buf[0 .. n - 1] continuing from crc (0 to start). */
uint32_t tc_crc32c(uint32_t crc, const void *buf, int64_t n) {
    return crc32c_update(crc, (const uint8_t *)buf, n);
}

/* a * b modulo the polynomial (bit 31 = x**0, reflected as in zlib). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) return p;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, int64_t len2) {
    pthread_once(&once, init);
    uint32_t x = 1u << 31; /* x**0, then x**(8 * len2): one product per set bit of len2 */
    for (int i = 0; i < 64 && (uint64_t)len2 >> i; i++)
        if (((uint64_t)len2 >> i) & 1) x = multmodp(x8pow2[i], x);
    return multmodp(x, crc1) ^ crc2;
}
