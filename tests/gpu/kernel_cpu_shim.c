/* Runs the CUDA kernels of kernels/cuda/codec_decode.cu on the CPU, one thread after another,
 * so their logic is tested where no GPU is (tests/test_codec_kernel_cpu.py). The kernels use
 * no shared memory and no barriers, so running threads in turn is exact. */
#include <stdint.h>

static struct { unsigned x; } blockIdx, threadIdx, blockDim;

#define __global__
#define TC_DEVICE static inline
#define TC_BSWAP32(x) __builtin_bswap32(x)
#include "../../kernels/cuda/codec_decode.cu"

#define THREADS 128

static void each_thread(int64_t n_threads, void (*body)(void *), void *args) {
    blockDim.x = THREADS;
    for (int64_t t = 0; t < n_threads; t++) {
        blockIdx.x = (unsigned)(t / THREADS);
        threadIdx.x = (unsigned)(t % THREADS);
        body(args);
    }
}

typedef struct {
    const tc_u32 *stream;
    const unsigned char *gaps;
    const unsigned short *lut;
    int lut_bits;
    tc_i64 total_bits, n_seg;
    int seg_bits;
    tc_i64 *counts;
    const tc_i64 *first;
    tc_i64 n;
    const unsigned char *raw;
    const tc_i64 *parts;
    int nparts, width, k;
    void *out;
} launch_args;

static void count_body(void *p) {
    launch_args *a = p;
    tison_codec_count(a->stream, a->gaps, a->lut, a->lut_bits, a->total_bits, a->n_seg,
                      a->seg_bits, a->counts);
}

static void decode_body(void *p) {
    launch_args *a = p;
    tison_codec_decode(a->stream, a->gaps, a->lut, a->lut_bits, a->total_bits, a->n_seg,
                       a->seg_bits, a->first, a->n, a->raw, a->parts, a->nparts, a->width,
                       a->k, a->out);
}

/* Both kernels over a grid rounded up to whole blocks, as kernels/cuda/codec_decode.py does
 * it. */
void shim_count(const tc_u32 *stream, const unsigned char *gaps, const unsigned short *lut,
                int lut_bits, tc_i64 total_bits, tc_i64 n_seg, int seg_bits, tc_i64 *counts) {
    launch_args a = {.stream = stream, .gaps = gaps, .lut = lut, .lut_bits = lut_bits,
                     .total_bits = total_bits, .n_seg = n_seg, .seg_bits = seg_bits,
                     .counts = counts};
    each_thread((n_seg + THREADS - 1) / THREADS * THREADS, count_body, &a);
}

void shim_decode(const tc_u32 *stream, const unsigned char *gaps, const unsigned short *lut,
                 int lut_bits, tc_i64 total_bits, tc_i64 n_seg, int seg_bits,
                 const tc_i64 *first, tc_i64 n, const unsigned char *raw, const tc_i64 *parts,
                 int nparts, int width, int k, void *out) {
    launch_args a = {.stream = stream, .gaps = gaps, .lut = lut, .lut_bits = lut_bits,
                     .total_bits = total_bits, .n_seg = n_seg, .seg_bits = seg_bits,
                     .first = first, .n = n, .raw = raw, .parts = parts, .nparts = nparts,
                     .width = width, .k = k, .out = out};
    each_thread((n_seg + THREADS - 1) / THREADS * THREADS, decode_body, &a);
}
