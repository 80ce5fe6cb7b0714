/* Code lengths of bounded length for the encoder: huffman.code_lengths (the reference) in C,
 * the same lengths to the bit, including its tie-breaking, so that both backends write the
 * same planes. numpy spends ~20 ms a tensor on it and holds the GIL; this takes tens of us. */
#include <stdlib.h>

#include "_codec.h"

#define MAX_SYMBOLS (1 << MAX_SYMBOL_BITS)
#define MAX_LISTS 32

/* One package-merge list: weights ascending; kind[i] = the leaf at i, or -1 for a package.
 * Lists hold at most 2n items (n leaves, fewer than n packages). */
typedef struct {
    int64_t *weight;
    int16_t *kind;
    int64_t len;
} pm_list;

/* A leaf's sort key: numpy's stable argsort by count is the order by (count, symbol). */
typedef struct {
    int64_t count, symbol;
} pm_leaf;

static int by_count(const void *a, const void *b) {
    const pm_leaf *x = a, *y = b;
    if (x->count != y->count) return x->count < y->count ? -1 : 1;
    return x->symbol < y->symbol ? -1 : x->symbol > y->symbol;
}

/* Present symbols sorted by count, ties by symbol. Returns how many are present. */
static int64_t sorted_leaves(const int64_t *counts, int64_t symbols, int16_t *order) {
    pm_leaf leaves[MAX_SYMBOLS];
    int64_t n = 0;
    for (int64_t s = 0; s < symbols; s++)
        if (counts[s]) leaves[n++] = (pm_leaf){counts[s], s};
    qsort(leaves, (size_t)n, sizeof *leaves, by_count);
    for (int64_t i = 0; i < n; i++) order[i] = (int16_t)leaves[i].symbol;
    return n;
}

/* List j+1 from list j: the leaves merged with the pairwise packages of list j, a leaf before
 * a package of equal weight (both runs are ascending, so this is numpy's stable sort). */
static void next_list(const pm_list *prev, const int64_t *leaf, int64_t n, pm_list *out) {
    const int64_t half = prev->len / 2;
    int64_t a = 0, b = 0;
    out->len = 0;
    while (a < n || b < half) {
        const int64_t package = b < half ? prev->weight[2 * b] + prev->weight[2 * b + 1] : 0;
        if (a < n && (b == half || leaf[a] <= package)) {
            out->weight[out->len] = leaf[a];
            out->kind[out->len++] = (int16_t)a++;
        } else {
            out->weight[out->len] = package;
            out->kind[out->len++] = -1;
            b++;
        }
    }
}

/* lengths[s] for counts[0 .. symbols - 1] (at most 2**MAX_SYMBOL_BITS), codes no longer than
 * max_len (<= MAX_LISTS); 0 for absent symbols, 1 for a lone one. Returns TC_OK, TC_BAD_CODE
 * if the symbols cannot have codes that short, TC_NO_MEMORY. */
int tc_code_lengths(const int64_t *counts, int64_t symbols, int max_len, uint8_t *lengths) {
    int16_t order[MAX_SYMBOLS];
    int64_t leaf[MAX_SYMBOLS], depth[MAX_SYMBOLS] = {0};
    if (symbols > MAX_SYMBOLS || max_len < 1 || max_len > MAX_LISTS) return TC_BAD_SPLIT;
    memset(lengths, 0, (size_t)symbols);
    const int64_t n = sorted_leaves(counts, symbols, order);
    if (n <= 1) {
        if (n == 1) lengths[order[0]] = 1;
        return TC_OK;
    }
    if (max_len < 31 && n > (int64_t)1 << max_len) return TC_BAD_CODE;
    pm_list lists[MAX_LISTS];
    int64_t *weights = malloc((size_t)(max_len * 2 * n) * sizeof *weights);
    int16_t *kinds = malloc((size_t)(max_len * 2 * n) * sizeof *kinds);
    if (weights == NULL || kinds == NULL) {
        free(weights);
        free(kinds);
        return TC_NO_MEMORY;
    }
    for (int j = 0; j < max_len; j++)
        lists[j] = (pm_list){weights + j * 2 * n, kinds + j * 2 * n, 0};
    for (int64_t i = 0; i < n; i++) {
        leaf[i] = counts[order[i]];
        lists[0].weight[i] = leaf[i];
        lists[0].kind[i] = (int16_t)i;
    }
    lists[0].len = n;
    for (int j = 1; j < max_len; j++) next_list(&lists[j - 1], leaf, n, &lists[j]);
    /* The 2n - 2 cheapest items of the last list; each package chosen in list j picks two
     * items of list j - 1; a leaf's length is the number of lists it is chosen in. */
    int64_t take = 2 * n - 2;
    for (int j = max_len - 1; j >= 0; j--) {
        int64_t packages = 0;
        for (int64_t i = 0; i < take && i < lists[j].len; i++) {
            if (lists[j].kind[i] >= 0) depth[lists[j].kind[i]]++;
            else packages++;
        }
        take = 2 * packages;
    }
    for (int64_t i = 0; i < n; i++) lengths[order[i]] = (uint8_t)depth[i];
    free(weights);
    free(kinds);
    return TC_OK;
}

/* For the candidate splits c = 0 .. ncand - 1 (each symbol at split c is a run of 2**c of
 * the finest symbols): the code lengths of its merged counts (huffman.code_lengths) into
 * lengths[c * symbols ..], and where each chunk's codes would start into chunk_bits[c *
 * (nchunks + 1) ..] (0, then running totals; the last is the stream's length). counts:
 * [nchunks][symbols], the finest symbols' counts per chunk. Returns TC_OK or an error of
 * tc_code_lengths. */
int tc_split_candidates(const int64_t *counts, int64_t nchunks, int64_t symbols, int ncand,
                        int max_len, uint8_t *lengths, int64_t *chunk_bits) {
    int64_t merged[MAX_SYMBOLS];
    if (symbols > MAX_SYMBOLS) return TC_BAD_SPLIT;
    for (int c = 0; c < ncand; c++) {
        const int64_t coarse = symbols >> c;
        uint8_t *len = lengths + c * symbols;
        int64_t *bits = chunk_bits + c * (nchunks + 1);
        memset(merged, 0, (size_t)coarse * sizeof *merged);
        for (int64_t ch = 0; ch < nchunks; ch++)
            for (int64_t s = 0; s < symbols; s++) merged[s >> c] += counts[ch * symbols + s];
        const int status = tc_code_lengths(merged, coarse, max_len, len);
        if (status != TC_OK) return status;
        bits[0] = 0;
        for (int64_t ch = 0; ch < nchunks; ch++) {
            int64_t sum = 0;
            for (int64_t s = 0; s < symbols; s++) sum += counts[ch * symbols + s] * len[s >> c];
            bits[ch + 1] = bits[ch] + sum;
        }
    }
    return TC_OK;
}
