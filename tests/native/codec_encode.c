/* Encodes tensors with the codec's C encoder as many.py's batches do (tc_stats_many, then
 * tc_encode_many, on 2 threads) and writes what each gives, for tests/test_codec_aarch64.py,
 * which runs this program built for aarch64 under qemu-user and for this machine, and asks for
 * the same bytes from both and from many.py.
 *
 * In: int64 count, max_len, then per tensor 4 int64s (n, width, finest, ncand: many.py's
 * _splits) and its n x width bytes. Out: per tensor 12 int64s (status, crc, k, total_bits,
 * first_symbol, planes_crc, and the bytes of its stream, raw, packed lengths, gaps and block
 * index planes, then the index's width), then those planes' bytes; a tensor kept raw (k -1) has
 * none. Built with every codec source but _many.c, which is included here for tc_many_job. */
#include <stdio.h>
#include <stdlib.h>

#include "_many.c"

static void *read_bytes(FILE *f, int64_t n) {
    void *p = malloc((size_t)(n > 0 ? n : 1));
    if (p == NULL || (n > 0 && fread(p, 1, (size_t)n, f) != (size_t)n)) exit(2);
    return p;
}

static void *alloc(int64_t n) {
    void *p = calloc((size_t)(n > 0 ? n : 1), 1);
    if (p == NULL) exit(2);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (in == NULL || out == NULL) return 2;
    int64_t count, max_len, head[4];
    if (fread(&count, 8, 1, in) != 1 || fread(&max_len, 8, 1, in) != 1 || count < 1) return 2;
    tc_many_job *jobs = alloc(count * (int64_t)sizeof *jobs);
    for (int64_t j = 0; j < count; j++) {
        tc_many_job *J = &jobs[j];
        if (fread(head, 8, 4, in) != 4) return 2;
        J->n = head[0], J->width = head[1], J->finest = head[2], J->ncand = head[3];
        J->in = read_bytes(in, J->n * J->width);
        J->lengths = alloc(J->ncand << (8 * J->width - 1 - J->finest));
        J->chunk_bits = alloc(J->ncand * 2 * 8);
    }
    tc_stats_many(jobs, count, (int)max_len, 2);
    for (int64_t j = 0; j < count; j++) {
        tc_many_job *J = &jobs[j];
        if (J->status != TC_OK || J->k < 0) continue;
        J->stream = alloc(J->stream_len), J->raw = alloc(J->raw_len);
        J->packed = alloc(J->packed_len), J->gaps = alloc(J->gaps_len);
        J->index = alloc(J->n_blocks * J->index_width);
    }
    tc_encode_many(jobs, count, 2);
    for (int64_t j = 0; j < count; j++) {
        tc_many_job *J = &jobs[j];
        const int coded = J->status == TC_OK && J->k >= 0;
        int64_t index_len = coded ? J->n_blocks * J->index_width : 0;
        int64_t fields[12] = {J->status, J->crc, J->k, J->total_bits, J->first_symbol,
                              J->planes_crc, coded ? J->stream_len : 0, coded ? J->raw_len : 0,
                              coded ? J->packed_len : 0, coded ? J->gaps_len : 0, index_len,
                              J->index_width};
        fwrite(fields, 8, 12, out);
        if (!coded) continue;
        const void *planes[5] = {J->stream, J->raw, J->packed, J->gaps, J->index};
        for (int p = 0; p < 5; p++) fwrite(planes[p], 1, (size_t)fields[6 + p], out);
    }
    return fclose(out) == 0 ? 0 : 2;
}
