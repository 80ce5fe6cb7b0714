// The KV cache's token rows (kv_pages.py): the step's new K/V written into their slots, and
// a layer's rows of some slots gathered into a contiguous payload or scattered back from one
// (the KV handoff). Pure copies of bits: elements move as unsigned ints of their width.
//
// A pool is seen as planes (MHA: K and V; MLA: one) of num_slots rows of `row` elements; a
// slot is page * page_size + offset. A block moves one token's row of one plane (or part):
// grid (tokens, parts), its threads striding over the row, so any block size fits. Slots
// outside [0, num_slots) are skipped (a gather gives zeros there): a GPU cannot raise, and a
// negative slot can mark a padding token.
#include "common.cuh"

// Part blockIdx.y (0: a, 1: b) of token blockIdx.x: its source row (t * stride) into the
// part's destination at slots[t] * row + offset, width elements.
template <class E>
TISON_DEVICE void write_rows(const E *a, tison_i64 a_stride, E *a_dst, int a_offset,
                             int a_width, const E *b, tison_i64 b_stride, E *b_dst,
                             int b_offset, int b_width, int row, const tison_i64 *slots,
                             tison_i64 num_slots) {
    tison_i64 t = blockIdx.x, slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    bool second = blockIdx.y == 1;
    const E *from = second ? b + t * b_stride : a + t * a_stride;
    E *to = (second ? b_dst + b_offset : a_dst + a_offset) + slot * row;
    int width = second ? b_width : a_width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) to[i] = from[i];
}

// Token blockIdx.x of plane blockIdx.y: elements [offset, offset + width) of its slot's row
// in pool <-> row (plane, t) of payload (planes, n, width).
template <class E>
TISON_DEVICE void move_rows(E *pool, int row, int offset, int width, E *payload,
                            const tison_i64 *slots, tison_i64 n, tison_i64 num_slots,
                            bool gather) {
    tison_i64 t = blockIdx.x, plane = blockIdx.y, slot = slots[t];
    bool valid = slot >= 0 && slot < num_slots;
    E *rows = payload + (plane * n + t) * width;
    if (!valid) {
        if (gather)
            for (int i = threadIdx.x; i < width; i += blockDim.x) rows[i] = 0;
        return;
    }
    E *in_pool = pool + (plane * num_slots + slot) * row + offset;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        if (gather)
            rows[i] = in_pool[i];
        else
            in_pool[i] = rows[i];
    }
}

#define TISON_KV_PAGES(SUFFIX, E)                                                              \
    TISON_KERNEL void tison_kv_write_##SUFFIX(                                                 \
        const E *a, tison_i64 a_stride, E *a_dst, int a_offset, int a_width, const E *b,       \
        tison_i64 b_stride, E *b_dst, int b_offset, int b_width, int row,                      \
        const tison_i64 *slots, tison_i64 num_slots) {                                         \
        write_rows<E>(a, a_stride, a_dst, a_offset, a_width, b, b_stride, b_dst, b_offset,     \
                      b_width, row, slots, num_slots);                                         \
    }                                                                                          \
    TISON_KERNEL void tison_kv_gather_##SUFFIX(E *pool, int row, int offset, int width,       \
                                               E *payload, const tison_i64 *slots,             \
                                               tison_i64 n, tison_i64 num_slots) {             \
        move_rows<E>(pool, row, offset, width, payload, slots, n, num_slots, true);            \
    }                                                                                          \
    TISON_KERNEL void tison_kv_scatter_##SUFFIX(E *pool, int row, int offset, int width,      \
                                                E *payload, const tison_i64 *slots,            \
                                                tison_i64 n, tison_i64 num_slots) {            \
        move_rows<E>(pool, row, offset, width, payload, slots, n, num_slots, false);           \
    }

TISON_KV_PAGES(f32, unsigned int)
TISON_KV_PAGES(bf16, tison_bf16)
