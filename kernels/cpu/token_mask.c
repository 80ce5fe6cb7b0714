/* Grammar masks on logits: the tokens a row's bitmask disallows set to -inf, for float32 and
 * bfloat16 (each_type.h). A bitmask is llguidance's: 32 tokens to an int32 word, token t
 * allowed where bit t % 32 of word t / 32 is set. Under a JSON schema most words are all ones
 * (skipped in one compare) or all zeros (32 -inf at once); only the words around the allowed
 * tokens' ids need their bits. */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "token_mask.c"
#include "each_type.h"
#else
/* row[t] = -inf for each t < d whose bit in words is clear. */
static void NAME(mask_row)(T *row, const uint32_t *words, int64_t d) {
    const T minus_inf = STORE(-INFINITY);
    for (int64_t w = 0; w * 32 < d; w++) {
        uint32_t allowed = words[w];
        if (allowed == 0xffffffffu) continue;
        T *at = row + w * 32;
        int64_t n = d - w * 32 < 32 ? d - w * 32 : 32; /* the last word: bits past d ignored */
#if defined(__AVX512F__) && defined(__AVX512BW__)
        uint32_t clear = ~allowed & (n == 32 ? 0xffffffffu : (1u << n) - 1);
#if IS_BF16 /* 32 bfloat16 lanes: one masked store */
        _mm512_mask_storeu_epi16(at, clear, _mm512_set1_epi16((short)minus_inf));
#else /* 2 x 16 float32 lanes: masked-off lanes neither written nor faulting (past d) */
        __m512 fill = _mm512_set1_ps(minus_inf);
        _mm512_mask_storeu_ps(at, (__mmask16)clear, fill);
        _mm512_mask_storeu_ps(at + 16, (__mmask16)(clear >> 16), fill);
#endif
#else
        if (allowed == 0 && n == 32) {
            for (int l = 0; l < 32; l++) at[l] = minus_inf; /* vectorized */
            continue;
        }
        for (int64_t l = 0; l < n; l++)
            if (!(allowed >> l & 1)) at[l] = minus_inf;
#endif
    }
}

/* For r < n: row row_ids[r] of x (rows rows of d tokens, row stride xs) masked by bitmask row r
 * (row stride ms words, at least ceil(d / 32) of them). 1, writing nothing, if a row id is not
 * a row of x; else 0. */
int NAME(tk_token_mask)(T *x, int64_t xs, int64_t rows, const int64_t *row_ids,
                        const int32_t *bitmask, int64_t ms, int64_t n, int64_t d, int threads) {
    for (int64_t r = 0; r < n; r++)
        if (row_ids[r] < 0 || row_ids[r] >= rows) return 1;
#pragma omp parallel for num_threads(threads) if (n * d >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < n; r++)
        NAME(mask_row)(x + row_ids[r] * xs, (const uint32_t *)(bitmask + r * ms), d);
    return 0;
}
#endif
