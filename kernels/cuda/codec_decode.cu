// GPU decoder of the Tison weight codec (format: shared/codec/FORMAT.md). One thread per
// 2048-bit segment of the code stream: tison_codec_count counts the codes starting in each
// segment, the host turns the counts into output offsets (exclusive cumsum, checked
// against the stored block index), and tison_codec_decode decodes each segment again,
// joins every symbol with its raw field and writes the elements. Reference: the CPU
// decoder in shared/codec (reference.py, _decode.c).
//
// The file is plain C apart from the qualifiers below, so tests/gpu/kernel_cpu_shim.c can
// compile it for the CPU and run every thread in turn where no GPU is present.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TC_DEVICE __device__ __forceinline__
#define TC_BSWAP32(x) __byte_perm((x), 0, 0x0123)
#endif
#ifdef __cplusplus
#define TC_KERNEL extern "C" __global__
#else
#define TC_KERNEL __global__
#endif

typedef unsigned long long tc_u64;
typedef long long tc_i64;
typedef unsigned int tc_u32;

// Reads a stream MSB-first through a 64-bit window over two big-endian 32-bit words.
typedef struct {
    const tc_u32 *words;
    tc_u64 buf;   // words j and j + 1
    tc_i64 base;  // bit position of word j
} tc_reader;

TC_DEVICE tc_u32 tc_be(const tc_u32 *words, tc_i64 j) { return TC_BSWAP32(words[j]); }

TC_DEVICE void tc_reader_init(tc_reader *r, const tc_u32 *words, tc_i64 pos) {
    tc_i64 j = pos >> 5;
    r->words = words;
    r->buf = ((tc_u64)tc_be(words, j) << 32) | tc_be(words, j + 1);
    r->base = j << 5;
}

// The next `bits` bits at pos (codes are at most 12 bits, so one refill suffices).
TC_DEVICE tc_u32 tc_peek(tc_reader *r, tc_i64 pos, int bits) {
    int off = (int)(pos - r->base);
    if (off >= 32) {
        r->base += 32;
        r->buf = (r->buf << 32) | tc_be(r->words, (r->base >> 5) + 1);
        off -= 32;
    }
    return (tc_u32)((r->buf << off) >> (64 - bits));
}

// First and end bit of the codes starting in segment s.
TC_DEVICE tc_i64 tc_segment(const unsigned char *gaps, tc_i64 s, int seg_bits,
                            tc_i64 total_bits, tc_i64 *end) {
    tc_i64 start = s * seg_bits;
    *end = start + seg_bits < total_bits ? start + seg_bits : total_bits;
    return start + ((gaps[s >> 1] >> ((s & 1) * 4)) & 15);
}

#define TC_MAX_PARTS 5

// The raw plane layout: per part its width, its shift in the field and its plane.
typedef struct {
    int nparts;
    int log_bits[TC_MAX_PARTS];  // log2 of the part width (1, 2, 4, 8 or 16 bits)
    int shift[TC_MAX_PARTS];
    const unsigned char *plane[TC_MAX_PARTS];
} tc_raw;

TC_DEVICE void tc_raw_init(tc_raw *raw, const unsigned char *base, const tc_i64 *parts,
                           int nparts) {
    raw->nparts = nparts;
    for (int j = 0; j < TC_MAX_PARTS; j++) {
        int b = j < nparts ? (int)parts[3 * j] : 1;
        raw->log_bits[j] = b == 16 ? 4 : b == 8 ? 3 : b == 4 ? 2 : b == 2 ? 1 : 0;
        raw->shift[j] = j < nparts ? (int)parts[3 * j + 1] : 0;
        raw->plane[j] = base + (j < nparts ? parts[3 * j + 2] : 0);
    }
}

// Raw field of element e, one byte load (two for a 16-bit part) per part. A b-bit part
// (b <= 8) fills 16-byte groups; byte q of a group holds elements q, q + 16, ... at bits
// 0, b, ... so the group of e is e >> (7 - log b) and its slot is bits 4.. of the rest.
TC_DEVICE tc_u32 tc_raw_field(const tc_raw *raw, tc_i64 e) {
    tc_u32 r = 0;
    for (int j = 0; j < TC_MAX_PARTS; j++) {
        if (j >= raw->nparts) break;
        int lb = raw->log_bits[j];
        const unsigned char *plane = raw->plane[j];
        tc_u32 v;
        if (lb == 4) {
            v = plane[2 * e] | ((tc_u32)plane[2 * e + 1] << 8);
        } else {
            tc_i64 in_group = e & ((128 >> lb) - 1);
            tc_u32 byte = plane[((e >> (7 - lb)) << 4) + (in_group & 15)];
            v = (byte >> ((in_group >> 4) << lb)) & ((1u << (1 << lb)) - 1);
        }
        r |= v << raw->shift[j];
    }
    return r;
}

TC_DEVICE void tc_store(void *out, tc_i64 e, int width, tc_u32 v) {
    if (width == 2) ((unsigned short *)out)[e] = (unsigned short)v;
    else if (width == 1) ((unsigned char *)out)[e] = (unsigned char)v;
    else ((tc_u32 *)out)[e] = v;
}

TC_KERNEL void tison_codec_count(const tc_u32 *stream, const unsigned char *gaps,
                                 const unsigned short *lut, int lut_bits, tc_i64 total_bits,
                                 tc_i64 n_seg, int seg_bits, tc_i64 *counts) {
    tc_i64 s = (tc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n_seg) return;
    tc_i64 end, pos = tc_segment(gaps, s, seg_bits, total_bits, &end), count = 0;
    tc_reader r;
    tc_reader_init(&r, stream, pos);
    while (pos < end) {
        pos += lut[tc_peek(&r, pos, lut_bits)] & 15;
        count++;
    }
    counts[s] = count;
}

// Elements go out in aligned 8-byte words where a thread owns the whole word, one at a time
// at the ragged ends of its run; `first` holds each segment's first element.
TC_KERNEL void tison_codec_decode(const tc_u32 *stream, const unsigned char *gaps,
                                  const unsigned short *lut, int lut_bits, tc_i64 total_bits,
                                  tc_i64 n_seg, int seg_bits, const tc_i64 *first, tc_i64 n,
                                  const unsigned char *raw, const tc_i64 *parts, int nparts,
                                  int width, int k, void *out) {
    tc_i64 s = (tc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n_seg) return;
    tc_i64 end, pos = tc_segment(gaps, s, seg_bits, total_bits, &end), e = first[s];
    const int top = width * 8 - 1, per_word = 8 / width;
    const int word_shift = width == 1 ? 3 : width == 2 ? 2 : 1;  // log2(per_word)
    const tc_u32 low = (1u << k) - 1;
    tc_raw fields;
    tc_raw_init(&fields, raw, parts, nparts);
    tc_u64 word = 0;
    int pending = 0;  // elements gathered in `word`, the first at e - pending
    tc_reader r;
    tc_reader_init(&r, stream, pos);
    while (pos < end && e < n) {
        unsigned short entry = lut[tc_peek(&r, pos, lut_bits)];
        pos += entry & 15;
        tc_u32 f = tc_raw_field(&fields, e);
        tc_u32 v = ((f >> k) << top) | ((tc_u32)(entry >> 4) << k) | (f & low);
        if (pending == 0 && (e & (per_word - 1)) != 0) {
            tc_store(out, e, width, v);
        } else {
            word |= (tc_u64)v << (pending * 8 * width);
            if (++pending == per_word) {
                ((tc_u64 *)out)[e >> word_shift] = word;
                word = 0;
                pending = 0;
            }
        }
        e++;
    }
    for (int q = 0; q < pending; q++)
        tc_store(out, e - pending + q, width, (tc_u32)(word >> (q * 8 * width)));
}
