/* The new tokens' K and V into their page slots, for float32 and bfloat16 (each_type.h). */
#ifndef NAME /* compiled as itself: the typed part below, once per element type */
#include "typed.h"

#define TYPED_FILE "kv_write.c"
#include "each_type.h"
#else
/* The n_new tokens' k and v (rows of nkv*hd values, row strides k_stride and v_stride) into
 * their slots[t] of the pools (P*S, nkv, hd). */
void NAME(kv_write_team)(const T *k, int64_t k_stride, const T *v, int64_t v_stride,
                         const int64_t *slots, int64_t n_new, T *k_pool, T *v_pool, int64_t nkv,
                         int64_t hd) {
#pragma omp for
    for (int64_t t = 0; t < n_new; t++) {
        memcpy(k_pool + slots[t] * nkv * hd, k + t * k_stride, nkv * hd * sizeof(T));
        memcpy(v_pool + slots[t] * nkv * hd, v + t * v_stride, nkv * hd * sizeof(T));
    }
}
#endif
