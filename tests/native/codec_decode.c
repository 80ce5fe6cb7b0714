/* Decodes the tensors of a file of coded planes with the codec's C decoder (tc_decode_batch, 2
 * threads, CRC-32C verified) and writes each one's status, CRC-32C and bytes, for
 * tests/test_codec_aarch64.py, which writes the planes on this machine and runs this program
 * built for aarch64 under qemu-user.
 *
 * In: int64 count, then per tensor 11 int64s (stream_len, raw_len, lengths_len, gaps_len,
 * n_blocks, index_width, first_symbol, total_bits, n, width, k) and the bytes of its stream,
 * raw, lengths and gaps planes and of its block index (n_blocks x index_width). Out: per tensor
 * int64 status and crc, then its n x width bytes. Built with every codec source but _batch.c,
 * which is included here for tc_job. */
#include <stdio.h>
#include <stdlib.h>

#include "_batch.c"

static void *read_bytes(FILE *f, int64_t n) {
    void *p = malloc((size_t)(n > 0 ? n : 1));
    if (p == NULL || (n > 0 && fread(p, 1, (size_t)n, f) != (size_t)n)) exit(2);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (in == NULL || out == NULL) return 2;
    int64_t count, head[11];
    if (fread(&count, 8, 1, in) != 1 || count < 1) return 2;
    tc_job *jobs = calloc((size_t)count, sizeof *jobs);
    for (int64_t j = 0; j < count; j++) {
        tc_job *J = &jobs[j];
        if (fread(head, 8, 11, in) != 11) return 2;
        J->stream_len = head[0], J->raw_len = head[1], J->lengths_len = head[2];
        J->gaps_len = head[3], J->n_blocks = head[4], J->index_width = head[5];
        J->first_symbol = head[6], J->total_bits = head[7], J->n = head[8], J->width = head[9];
        J->k = head[10];
        J->stream = read_bytes(in, J->stream_len), J->raw = read_bytes(in, J->raw_len);
        J->lengths = read_bytes(in, J->lengths_len), J->gaps = read_bytes(in, J->gaps_len);
        J->block_first = read_bytes(in, J->n_blocks * J->index_width);
        J->out = malloc((size_t)(J->n * J->width));
        if (J->out == NULL) return 2;
    }
    if (tc_decode_batch(jobs, count, 2, 1) != TC_OK) return 3;
    for (int64_t j = 0; j < count; j++) {
        fwrite(&jobs[j].status, 8, 1, out), fwrite(&jobs[j].crc, 8, 1, out);
        fwrite(jobs[j].out, 1, (size_t)(jobs[j].n * jobs[j].width), out);
    }
    return fclose(out) == 0 ? 0 : 2;
}
