/* Decode attention's two inner loops (scores; weighted values) for bfloat16 K and V on the
 * vector tiers, at one vector width W (float lanes): attention_vec.h includes this once per
 * width its build has (8: AVX2, 16: AVX-512) with VEC, VINT, W, VJ, VNAME(x) and the vector
 * ops defined; it undefines them at its end. No include guard on purpose.
 *
 * A 32-bit lane of a K or V row holds two bf16 (the even dim in the low half): lane << 16 and
 * lane & 0xffff0000 are those two as float32, one instruction each (linear_bf16.c's trick),
 * where widening 16-bit lanes takes two. So q and the value sums are kept "split": each block
 * of 2W dims as its W even dims, then its W odd dims; q is laid out so once a task and the sums
 * are put back in order once. On avx512_bf16 the scores skip even that: vdpbf16ps multiplies
 * 32 pairs of q and K as they are in memory. */

/* q (heads, hd) of one task -> what VNAME(scores) reads: qf split (floats), or q itself. */
static const void *VNAME(prepare_q)(const bf16 *restrict q, int64_t heads, int64_t hd,
                                    float *restrict qf) {
#if DPBF16
    (void)heads, (void)hd, (void)qf;
    return q;
#else
    for (int64_t b = 0; b < heads * hd; b += 2 * W)
        for (int l = 0; l < W; l++) {
            qf[b + l] = bf16_to_f32(q[b + 2 * l]);
            qf[b + W + l] = bf16_to_f32(q[b + 2 * l + 1]);
        }
    return qf;
#endif
}

#if W == 8 && !DPBF16
#include "attention_w8.h" /* AVX2: the loops blocked for its 16 registers */
#else
/* For the `count` (<= W) keys of one page from `slot` on (pool rows of nkv * hd), KV heads
 * g < nkv: scores[(g * group + j) * score_stride + i] = scale * dot(q[g * group + j], key i
 * of head g), q VNAME(prepare_q)'s. The query heads that share a KV head read its keys from
 * L1 after the first. Meanwhile ahead's lines are asked for, a part a KV head. */
static void VNAME(scores)(const void *restrict qv, float scale, const bf16 *restrict pool,
                          int64_t slot, int64_t count, int64_t nkv, int64_t group, int64_t hd,
                          float *restrict scores, int64_t score_stride,
                          const struct kv_ahead *ahead) {
    int64_t share = ahead_share(ahead, nkv);
    for (int64_t g = 0; g < nkv; g++) {
        prefetch_part(ahead, g, share);
        const bf16 *rows[W]; /* past `count`, the last key again: read, then masked off */
        for (int i = 0; i < W; i++)
            rows[i] = pool + ((slot + (i < count ? i : count - 1)) * nkv + g) * hd;
        for (int64_t j = g * group; j < (g + 1) * group; j++) {
            VEC dots[W];
#pragma GCC unroll 16
            for (int i = 0; i < W; i++) dots[i] = VZERO();
            for (int64_t d = 0; d < hd; d += 2 * W) {
#if DPBF16
                VINT qd = VLOADI((const bf16 *)qv + j * hd + d);
#pragma GCC unroll 16
                for (int i = 0; i < W; i++) dots[i] = VDPBF16(dots[i], qd, VLOADI(rows[i] + d));
#else
                const float *q = (const float *)qv + j * hd + d;
                VEC qe = VLOAD(q), qo = VLOAD(q + W);
#pragma GCC unroll 16
                for (int i = 0; i < W; i++) {
                    VINT p = VLOADI(rows[i] + d);
                    dots[i] = VFMA(qo, VODD(p), VFMA(qe, VEVEN(p), dots[i]));
                }
#endif
            }
            /* a whole block by a plain store: AVX2's masked store is slow on AMD (with it, a
             * hot call at 256-2048 positions took 3-4% longer on Zen 3) */
            VEC sc = VMUL(VSUMS(dots), VSET1(scale));
            if (count == W)
                VSTORE(scores + j * score_stride, sc);
            else
                VSTORE_FIRST(scores + j * score_stride, sc, count);
        }
    }
}

/* acc[jj] += w[jj * ws + i] * value i, for jn query heads (w and acc counted from the first)
 * and cn blocks of 2W split dims (v and acc counted from the first), values i < count at
 * v + i * vs. jn and cn are constants where VNAME(values) calls it, so the jn x cn x 2
 * sums stay in registers across the values; each value is split once for the jn heads. */
__attribute__((always_inline)) static inline void VNAME(values_block)(
    const float *restrict w, int64_t ws, const bf16 *restrict v, int64_t vs, int64_t count,
    int jn, int cn, float *restrict acc, int64_t hd) {
    VEC a[VJ][2][2];
    for (int jj = 0; jj < jn; jj++)
        for (int c = 0; c < cn; c++) {
            a[jj][c][0] = VLOAD(acc + jj * hd + c * 2 * W);
            a[jj][c][1] = VLOAD(acc + jj * hd + c * 2 * W + W);
        }
    for (int64_t i = 0; i < count; i++) {
        VEC even[2], odd[2];
        for (int c = 0; c < cn; c++) {
            VINT p = VLOADI(v + i * vs + c * 2 * W);
            even[c] = VEVEN(p), odd[c] = VODD(p);
        }
        for (int jj = 0; jj < jn; jj++) {
            VEC x = VSET1(w[jj * ws + i]);
            for (int c = 0; c < cn; c++) {
                a[jj][c][0] = VFMA(x, even[c], a[jj][c][0]);
                a[jj][c][1] = VFMA(x, odd[c], a[jj][c][1]);
            }
        }
    }
    for (int jj = 0; jj < jn; jj++)
        for (int c = 0; c < cn; c++) {
            VSTORE(acc + jj * hd + c * 2 * W, a[jj][c][0]);
            VSTORE(acc + jj * hd + c * 2 * W + W, a[jj][c][1]);
        }
}

#define VALUES_CASE(J)                                                                        \
    case J:                                                                                   \
        if (cn == 2)                                                                          \
            VNAME(values_block)(w, weight_stride, vd, nkv * hd, count, J, 2, acc + j * hd + d, \
                                hd);                                                          \
        else                                                                                  \
            VNAME(values_block)(w, weight_stride, vd, nkv * hd, count, J, 1, acc + j * hd + d, \
                                hd);                                                          \
        break;

/* acc[h] (split) += weights[h * weight_stride + i] * value i of h's KV head, for the query
 * heads h of every KV head and the `count` values of one page from `slot` on, asking for
 * ahead's lines meanwhile, a part a KV head. */
static void VNAME(values)(const float *restrict weights, int64_t weight_stride,
                          const bf16 *restrict pool, int64_t slot, int64_t count, int64_t nkv,
                          int64_t group, int64_t hd, float *restrict acc,
                          const struct kv_ahead *ahead) {
    int64_t share = ahead_share(ahead, nkv);
    for (int64_t g = 0; g < nkv; g++) {
        prefetch_part(ahead, g, share);
        const bf16 *v = pool + (slot * nkv + g) * hd;
        int64_t last = (g + 1) * group;
        for (int64_t j = g * group; j < last; j += VJ) {
            int jn = last - j < VJ ? (int)(last - j) : VJ;
            const float *w = weights + j * weight_stride;
            for (int64_t d = 0, cn; d < hd; d += cn * 2 * W) {
                cn = hd - d >= 4 * W ? 2 : 1;
                const bf16 *vd = v + d;
                switch (jn) {
                    VALUES_CASE(1)
                    VALUES_CASE(2)
#if VJ > 2
                    VALUES_CASE(3)
                    VALUES_CASE(4)
#endif
                }
            }
        }
    }
}
#undef VALUES_CASE

#endif

/* out (heads, hd) = acc (split) / total[h], rounded to bf16, in order. */
static void VNAME(store_out)(const float *restrict acc, const float *restrict total,
                             int64_t heads, int64_t hd, bf16 *restrict out) {
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t b = h * hd; b < (h + 1) * hd; b += 2 * W)
            for (int l = 0; l < W; l++) {
                out[b + 2 * l] = f32_to_bf16(acc[b + l] / total[h]);
                out[b + 2 * l + 1] = f32_to_bf16(acc[b + W + l] / total[h]);
            }
    }
}

#undef W
#undef VJ
#undef DPBF16
#undef VDPBF16
#undef VNAME
#undef VEC
#undef VINT
#undef VZERO
#undef VLOAD
#undef VSTORE
#undef VLOADI
#undef VEVEN
#undef VODD
#undef VFMA
#undef VMUL
#undef VSET1
#undef VSUMS
#undef VSTORE_FIRST
