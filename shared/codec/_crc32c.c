/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) for the codec's checksums: carry-less
 * multiplication folding 256 bytes at a time where the CPU has AVX-512 VPCLMULQDQ (about 32
 * bytes a cycle), else the SSE4.2 crc32 instruction (8 bytes a cycle; several chains
 * interleaved hide its latency), else slicing-by-8 tables. combine() is zlib's crc32_combine
 * over this polynomial, so threads checksum their parts independently. */
#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "_codec.h"

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static uint32_t x8pow2[64]; /* x**(8 * 2**i) modulo the polynomial, for combine() */
/* fold_k[i]: {x**(128 i + 32), x**(128 i - 32)} modulo the polynomial, reflected and shifted
 * left by one: multiplying a 128-bit accumulator's low and high halves by them moves it
 * 128 i bits forward (Intel, "Fast CRC Computation Using PCLMULQDQ"); fold_k[0] = 0. */
static uint64_t fold_k[17][2];
static int have_sse42, have_fold;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static uint32_t multmodp(uint32_t a, uint32_t b);

/* x**(8 * bytes) modulo the polynomial (bit 31 = x**0). */
static uint32_t x8pow(uint64_t bytes) {
    uint32_t x = 1u << 31;
    for (int i = 0; i < 64 && bytes >> i; i++)
        if ((bytes >> i) & 1) x = multmodp(x8pow2[i], x);
    return x;
}

static void init(void) {
    x8pow2[0] = 1u << 23; /* x**8: one byte */
    for (int i = 1; i < 64; i++) x8pow2[i] = multmodp(x8pow2[i - 1], x8pow2[i - 1]);
    for (int i = 1; i <= 16; i++) {
        fold_k[i][0] = (uint64_t)x8pow(16 * (uint64_t)i + 4) << 1;
        fold_k[i][1] = (uint64_t)x8pow(16 * (uint64_t)i - 4) << 1;
    }
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
    have_fold = have_sse42 && __builtin_cpu_supports("avx512f") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
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

__attribute__((target("sse4.2"))) static uint32_t hard1(uint32_t c, const uint8_t *p,
                                                        int64_t n) {
    uint64_t r = c;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        r = __builtin_ia32_crc32di(r, v);
    }
    return hard_tail((uint32_t)r, p, n);
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

#define FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,sse4.2")))

/* The 128-bit lanes of x moved forward (see fold_k) and added to y. */
FOLD_TARGET static inline __m512i fold_into(__m512i x, __m512i k, __m512i y) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), y, 0x96);
}

/* Lane l moves 128 * (first - l) bits forward. */
FOLD_TARGET static inline __m512i fold_by(int first) {
    const uint64_t *a = fold_k[first], *b = fold_k[first - 1], *c = fold_k[first - 2];
    const uint64_t *d = fold_k[first - 3];
    return _mm512_set_epi64((int64_t)d[1], (int64_t)d[0], (int64_t)c[1], (int64_t)c[0],
                            (int64_t)b[1], (int64_t)b[0], (int64_t)a[1], (int64_t)a[0]);
}

/* The register after bytes p[0 .. n - 1], n >= 256: sixteen 128-bit accumulators (four zmm
 * registers), each moved 256 bytes forward per round by two carry-less multiplies, then
 * moved onto the last one and summed; two crc32 instructions reduce that to the register,
 * and the n % 256 bytes left go through crc32 too. */
FOLD_TARGET static uint32_t fold(uint32_t c, const uint8_t *p, int64_t n) {
    __m512i x[4];
    for (int r = 0; r < 4; r++) x[r] = _mm512_loadu_si512(p + 64 * r);
    x[0] = _mm512_xor_si512(x[0], _mm512_inserti32x4(_mm512_setzero_si512(),
                                                     _mm_cvtsi32_si128((int)c), 0));
    const __m512i round = _mm512_broadcast_i32x4(
        _mm_set_epi64x((int64_t)fold_k[16][1], (int64_t)fold_k[16][0]));
    int64_t i = 256;
    for (; i + 256 <= n; i += 256)
        for (int r = 0; r < 4; r++)
            x[r] = fold_into(x[r], round, _mm512_loadu_si512(p + i + 64 * r));
    /* Lane l of x[r] is accumulator 4 r + l, 15 - 4 r - l lanes before the last one. */
    __m512i sum = _mm512_maskz_mov_epi64(0xC0, x[3]);
    for (int r = 0; r < 4; r++) sum = fold_into(x[r], fold_by(15 - 4 * r), sum);
    __m128i y = _mm_xor_si128(
        _mm_xor_si128(_mm512_castsi512_si128(sum), _mm512_extracti32x4_epi32(sum, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(sum, 2), _mm512_extracti32x4_epi32(sum, 3)));
    uint64_t reg = __builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(y));
    reg = __builtin_ia32_crc32di(reg, (uint64_t)_mm_extract_epi64(y, 1));
    return hard1((uint32_t)reg, p + i, n - i);
}
#endif

void crc32c_update_lanes(uint32_t *crc, const uint8_t *const *p, const int64_t *n, int lanes) {
    pthread_once(&once, init);
    uint32_t c[MAX_LANES];
    for (int j = 0; j < lanes; j++) c[j] = ~crc[j];
#if defined(__x86_64__)
    if (have_fold) {
        for (int j = 0; j < lanes; j++)
            crc[j] = ~(n[j] >= 256 ? fold(c[j], p[j], n[j]) : hard1(c[j], p[j], n[j]));
        return;
    }
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

#define SPLIT_LANES 3 /* pieces a thread checksums interleaved: the crc32 latency */
#define SPLIT_MIN ((int64_t)1 << 16) /* bytes a piece keeps at least */
#define SPLIT_MAX_ITEMS 64

/* A buffer cut into items * SPLIT_LANES pieces of as equal a size as can be. */
typedef struct {
    const uint8_t *p;
    int64_t n, items, next; /* next: the first item no thread has taken (atomic) */
    uint32_t crc[SPLIT_MAX_ITEMS * SPLIT_LANES];
} split_crc;

static int64_t piece_at(const split_crc *s, int64_t i) {
    return s->n / (s->items * SPLIT_LANES) * i + s->n % (s->items * SPLIT_LANES) * i /
           (s->items * SPLIT_LANES);
}

static void *split_worker(void *arg) {
    split_crc *s = arg;
    for (int64_t it; (it = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED)) < s->items;) {
        const uint8_t *p[SPLIT_LANES];
        int64_t n[SPLIT_LANES];
        for (int j = 0; j < SPLIT_LANES; j++) {
            const int64_t a = piece_at(s, it * SPLIT_LANES + j);
            p[j] = s->p + a, n[j] = piece_at(s, it * SPLIT_LANES + j + 1) - a;
            s->crc[it * SPLIT_LANES + j] = 0;
        }
        crc32c_update_lanes(s->crc + it * SPLIT_LANES, p, n, SPLIT_LANES);
    }
    return NULL;
}

/* CRC-32C of buf[0 .. n - 1] continuing from crc (0 to start), on up to `threads` threads:
 * pieces checksummed SPLIT_LANES interleaved per thread and joined with crc32c_combine. */
uint32_t tc_crc32c(uint32_t crc, const void *buf, int64_t n, int threads) {
    int64_t items = n / (SPLIT_MIN * SPLIT_LANES);
    items = items < threads ? items : threads;
    items = items < SPLIT_MAX_ITEMS ? items : SPLIT_MAX_ITEMS;
    if (items < 1) return crc32c_update(crc, (const uint8_t *)buf, n);
    split_crc s = {.p = buf, .n = n, .items = items, .next = 0};
    tc_run_parallel(split_worker, &s, (int)items);
    for (int64_t i = 0; i < items * SPLIT_LANES; i++)
        crc = crc32c_combine(crc, s.crc[i], piece_at(&s, i + 1) - piece_at(&s, i));
    return crc;
}

/* The same by one way (0: tables, 1: crc32 instruction, 2: folding), or -1 where this CPU
 * lacks it: for tests, which otherwise only see the fastest way. */
int64_t tc_crc32c_by(int how, uint32_t crc, const void *buf, int64_t n) {
    pthread_once(&once, init);
    const uint8_t *p = buf;
    if (how == 0) return ~soft(~crc, p, n) & 0xFFFFFFFFu;
#if defined(__x86_64__)
    if (how == 1 && have_sse42) {
        uint32_t c = ~crc;
        hard(&c, &p, &n, 1);
        return ~c & 0xFFFFFFFFu;
    }
    if (how == 2 && have_fold)
        return ~(n >= 256 ? fold(~crc, p, n) : hard1(~crc, p, n)) & 0xFFFFFFFFu;
#endif
    return -1;
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
