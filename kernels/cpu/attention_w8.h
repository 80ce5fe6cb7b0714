/* Decode attention's two inner loops for bfloat16 K and V at 8 float lanes without vdpbf16ps
 * (AVX2): attention_vec_impl.h includes this in place of its generic loops when W == 8 and
 * !DPBF16, with its macros defined. AVX2 has 16 registers and no bf16 arithmetic: the generic
 * loops split a K row into float32 again for each query head that reads it, and spilled a
 * values sum at 2 heads x 32 dims. These are register-blocked so that each K or V row is
 * split once for up to W8_HEADS heads, with every sum in a register. Both ask for the lines of
 * attention.c's plan_ahead as they read, a few at a time, in step with their arithmetic. */

#define W8_KEYS 4 /* keys a scores block: 4 keys x W8_HEADS heads of sums in 12 registers */
#define W8_HEADS 3 /* query heads a block, in both loops */

/* The sums of a[0..3] (8 lanes each), lane i for a[i]: three horizontal adds and one add. */
static inline __m128 sums4_w8(const __m256 a[W8_KEYS]) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* out[jj * score_stride + i] = scale * dot(q[jj], key i) over hd split dims, for jn query
 * heads (q split, rows hd apart) and the W8_KEYS keys at rows[i], the first kn of them
 * stored. jn is a constant where it is inlined, so the sums stay in registers. */
__attribute__((always_inline)) static inline void key_block_w8(
    const float *restrict q, int64_t hd, const bf16 *const rows[W8_KEYS], int jn, float scale,
    float *restrict out, int64_t score_stride, int64_t kn) {
    __m256 dots[W8_HEADS][W8_KEYS];
#pragma GCC unroll 4
    for (int jj = 0; jj < jn; jj++)
#pragma GCC unroll 4
        for (int i = 0; i < W8_KEYS; i++) dots[jj][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16)
#pragma GCC unroll 4
        for (int i = 0; i < W8_KEYS; i++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(rows[i] + d));
            __m256 even = VEVEN(p), odd = VODD(p);
#pragma GCC unroll 4
            for (int jj = 0; jj < jn; jj++) {
                const float *qj = q + jj * hd + d; /* from L1: no registers left for it */
                dots[jj][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8), odd,
                                              _mm256_fmadd_ps(_mm256_loadu_ps(qj), even,
                                                              dots[jj][i]));
            }
        }
#pragma GCC unroll 4
    for (int jj = 0; jj < jn; jj++) {
        __m128 s = _mm_mul_ps(sums4_w8(dots[jj]), _mm_set1_ps(scale));
        if (kn == W8_KEYS) {
            _mm_storeu_ps(out + jj * score_stride, s);
        } else {
            float four[W8_KEYS];
            _mm_storeu_ps(four, s);
            for (int64_t i = 0; i < kn; i++) out[jj * score_stride + i] = four[i];
        }
    }
}

/* For the `count` (<= 8) keys of one page from `slot` on (pool rows of nkv * hd), KV heads
 * g < nkv: scores[(g * group + j) * score_stride + i] = scale * dot(q[g * group + j], key i
 * of head g), q VNAME(prepare_q)'s. Blocks of W8_KEYS keys, all KV heads in memory order;
 * meanwhile ahead's lines are asked for, a part a block and KV head. */
static void VNAME(scores)(const void *restrict qv, float scale, const bf16 *restrict pool,
                          int64_t slot, int64_t count, int64_t nkv, int64_t group, int64_t hd,
                          float *restrict scores, int64_t score_stride,
                          const struct kv_ahead *ahead) {
    const float *qf = (const float *)qv;
    int64_t share = ahead_share(ahead, (count + W8_KEYS - 1) / W8_KEYS * nkv);
    for (int64_t i0 = 0; i0 < count; i0 += W8_KEYS) {
        int64_t kn = count - i0 < W8_KEYS ? count - i0 : W8_KEYS;
        for (int64_t g = 0; g < nkv; g++) {
            prefetch_part(ahead, i0 / W8_KEYS * nkv + g, share);
            const bf16 *rows[W8_KEYS]; /* past `count`, the last key again: read, then dropped */
            for (int i = 0; i < W8_KEYS; i++)
                rows[i] = pool + ((slot + i0 + (i < kn ? i : kn - 1)) * nkv + g) * hd;
            for (int64_t j = g * group, last = (g + 1) * group; j < last; j += W8_HEADS) {
                int jn = last - j < W8_HEADS ? (int)(last - j) : W8_HEADS;
                float *out = scores + j * score_stride + i0;
                if (jn == 3)
                    key_block_w8(qf + j * hd, hd, rows, 3, scale, out, score_stride, kn);
                else if (jn == 2)
                    key_block_w8(qf + j * hd, hd, rows, 2, scale, out, score_stride, kn);
                else
                    key_block_w8(qf + j * hd, hd, rows, 1, scale, out, score_stride, kn);
            }
        }
    }
}

/* acc[jj] (split) += w[jj * ws + i] * value i, for jn query heads (w and acc counted from the
 * first) over 16 split dims of the `count` values at v + i * vs; each value is split once for
 * the jn heads (16 dims: 6 sums, 3 weights, the value's halves and the mask in 12 registers;
 * 32 would spill a sum). jn is a constant where it is inlined. */
__attribute__((always_inline)) static inline void value_block_w8(
    const float *restrict w, int64_t ws, const bf16 *restrict v, int64_t vs, int64_t count,
    int jn, float *restrict acc, int64_t hd) {
    __m256 a[W8_HEADS][2];
    for (int jj = 0; jj < jn; jj++)
        a[jj][0] = _mm256_loadu_ps(acc + jj * hd), a[jj][1] = _mm256_loadu_ps(acc + jj * hd + 8);
    for (int64_t i = 0; i < count; i++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(v + i * vs));
        __m256 even = VEVEN(p), odd = VODD(p);
        for (int jj = 0; jj < jn; jj++) {
            __m256 x = _mm256_broadcast_ss(w + jj * ws + i);
            a[jj][0] = _mm256_fmadd_ps(x, even, a[jj][0]);
            a[jj][1] = _mm256_fmadd_ps(x, odd, a[jj][1]);
        }
    }
    for (int jj = 0; jj < jn; jj++) {
        _mm256_storeu_ps(acc + jj * hd, a[jj][0]);
        _mm256_storeu_ps(acc + jj * hd + 8, a[jj][1]);
    }
}

/* acc[h] (split) += weights[h * weight_stride + i] * value i of h's KV head, for the query
 * heads h of every KV head and the `count` values of one page from `slot` on; the first
 * block of heads of each KV head asks for a part of ahead's lines before each 16 dims. */
static void VNAME(values)(const float *restrict weights, int64_t weight_stride,
                          const bf16 *restrict pool, int64_t slot, int64_t count, int64_t nkv,
                          int64_t group, int64_t hd, float *restrict acc,
                          const struct kv_ahead *ahead) {
    int64_t vs = nkv * hd, share = ahead_share(ahead, nkv * hd / 16);
    for (int64_t g = 0; g < nkv; g++) {
        const bf16 *v = pool + (slot * nkv + g) * hd;
        for (int64_t j = g * group, last = (g + 1) * group; j < last; j += W8_HEADS) {
            int jn = last - j < W8_HEADS ? (int)(last - j) : W8_HEADS;
            const float *w = weights + j * weight_stride;
            for (int64_t d = 0; d < hd; d += 16) {
                if (j == g * group) prefetch_part(ahead, (g * hd + d) / 16, share);
                float *out = acc + j * hd + d;
                if (jn == 3)
                    value_block_w8(w, weight_stride, v + d, vs, count, 3, out, hd);
                else if (jn == 2)
                    value_block_w8(w, weight_stride, v + d, vs, count, 2, out, hd);
                else
                    value_block_w8(w, weight_stride, v + d, vs, count, 1, out, hd);
            }
        }
    }
}
#undef W8_KEYS
#undef W8_HEADS
