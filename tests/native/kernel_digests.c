/* Runs the C kernels (kernels/cpu) on fixed pseudo-random inputs and prints one line a result:
 * its name and a 64-bit FNV-1a digest of its bytes. tests/test_cpu_builds.py builds it at the
 * portable tier for this machine and for aarch64, runs the aarch64 build under qemu-user, and
 * asks for the same lines: the portable kernels, which the rest of the suite checks against
 * torch on this machine, then compute the same bits on ARM (no fused multiply-add is formed,
 * -ffp-contract=off; no float sum is reordered without -ffast-math). Every team kernel runs,
 * inside the fused decoder (dense, routed and shared experts, the three RoPE kinds, q/k norms, a
 * sliding-window mask, the embedding, the LM head and its argmax) and through its own entry
 * point, float32 and bfloat16, on one thread and on two. The all-reduce runs between two
 * processes (this one and a child, rank 1) through a shared mapping and
 * shared/parallel/_shm_sync.c's signals, as a host's tensor-parallel ranks run it: through its
 * entry point and inside the fused decoder; rank 0 prints the digests.
 *
 * Built with every kernel source but decode_layer.c, which is included here for its structs,
 * and _shm_sync.c. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "decode_layer.c"

/* the entry points (kernels/cpu/library.py's signatures) */
#define ENTRY_POINTS(T, S)                                                                       \
    void tk_rms_norm_##S(const T *, int64_t, T *, int64_t, T *, const T *, int64_t, int64_t,     \
                         int64_t, float, int);                                                   \
    void tk_rope_##S(const T *, int64_t, const T *, int64_t, int64_t, int64_t, int64_t, int64_t, \
                     const int64_t *, const T *, const T *, T *, T *, int);                      \
    void tk_silu_mul_##S(const T *, T *, int64_t, int64_t, int);                                 \
    void tk_argmax_##S(const T *, int64_t, int64_t, int64_t, int64_t *, int);                    \
    int tk_token_mask_##S(T *, int64_t, int64_t, const int64_t *, const int32_t *, int64_t,      \
                          int64_t, int64_t, int);                                                \
    int tk_paged_attention_##S(const T *, int64_t, const T *, int64_t, const int64_t *, int64_t, \
                               const T *, int64_t, const int64_t *, T *, T *, const int32_t *,   \
                               int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t,     \
                               int64_t, int64_t, float, T *, int);
ENTRY_POINTS(float, f32)
ENTRY_POINTS(bf16, bf16)
int64_t tk_all_reduce_f32(shm_reduce *, float *, int64_t, int);
int64_t tk_all_reduce_bf16(shm_reduce *, bf16 *, int64_t, int);
void tison_shm_post(int64_t *, int64_t);
int64_t tison_shm_wait(const int64_t *, int64_t, const int64_t *, int64_t, int64_t, double);
int tk_linear_bf16(const bf16 *, int64_t, const bf16 *, const bf16 *, int64_t, int64_t, int64_t,
                   bf16 *, int);
int tk_experts_linear_bf16(const bf16 *, const int64_t *, int64_t, const bf16 *, int64_t,
                           int64_t, int64_t, bf16 *, int);

static uint64_t state = 0x9e3779b97f4a7c15u;

static float uniform(void) { /* xorshift64*, [-1, 1) */
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return (float)((state * 0x2545f4914f6cdd1du) >> 40) / 8388608.0f - 1.0f;
}

static float *f32s(int64_t n, float scale) {
    float *p = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) p[i] = uniform() * scale;
    return p;
}

static bf16 *bf16s(int64_t n, float scale) {
    bf16 *p = malloc(sizeof(bf16) * n);
    for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(uniform() * scale);
    return p;
}

static void *zeros(int64_t bytes) { return calloc((size_t)bytes, 1); }

static void digest(const char *name, int threads, const void *p, int64_t bytes) {
    uint64_t h = 0xcbf29ce484222325u;
    for (int64_t i = 0; i < bytes; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3u;
    printf("%s threads=%d %016llx\n", name, threads, (unsigned long long)h);
}

static void linears(int threads) {
    const int64_t N = 37, K = 96, xs = 128, rows[] = {1, 3, 17, 33};
    bf16 *w = bf16s(N * K, 0.2f), *bias = bf16s(N, 1.0f), *x = bf16s(33 * xs, 1.0f);
    bf16 *y = zeros(33 * N * 2);
    char name[64];
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 2; b++) {
            tk_linear_bf16(x, xs, w, b ? bias : NULL, rows[i], N, K, y, threads);
            snprintf(name, sizeof name, "linear M=%lld bias=%d", (long long)rows[i], b);
            digest(name, threads, y, rows[i] * N * 2);
        }
    /* 4 experts, rows 0-2 to expert 0, none to 1, 3-7 to 2, 8 to 3 */
    const int64_t E = 4, start[] = {0, 3, 3, 8, 9}, P = 9, EN = 20, EK = 64;
    bf16 *ew = bf16s(E * EN * EK, 0.2f), *ex = bf16s(P * EK, 1.0f), *ey = zeros(P * EN * 2);
    tk_experts_linear_bf16(ex, start, E, ew, EN * EK, EN, EK, ey, threads);
    digest("experts linear", threads, ey, P * EN * 2);
    free(w), free(bias), free(x), free(y), free(ew), free(ex), free(ey);
}

/* The light kernels and paged attention through their entry points, in T (suffix S). */
#define LIGHT_KERNELS(T, S, make)                                                                \
    static void light_##S(int threads) {                                                         \
        const int64_t n = 5, H = 64, d = 1000, nh = 4, nkv = 2, hd = 16, pos[] = {0, 7, 30};    \
        T *x = make(n * H, 2.0f), *res = make(n * H, 1.0f), *wt = make(H, 1.0f);                 \
        T *out = zeros(n * H * sizeof(T));                                                       \
        tk_rms_norm_##S(x, H, out, H, res, wt, n, 1, H, 1e-5f, threads);                         \
        digest(#S " rms_norm", threads, out, n * H * sizeof(T));                                 \
        digest(#S " rms_norm residual", threads, res, n * H * sizeof(T));                        \
        tk_rms_norm_##S(x, H, out, H, NULL, wt, n, H / hd, hd, 1e-6f, threads); /* per head */   \
        digest(#S " rms_norm heads", threads, out, n * H * sizeof(T));                           \
        T *q = make(3 * 128, 1.0f), *cos = make(32 * hd, 1.0f), *sin = make(32 * hd, 1.0f);      \
        T *qo = zeros(3 * nh * hd * sizeof(T)), *ko = zeros(3 * nkv * hd * sizeof(T));           \
        tk_rope_##S(q, 128, q + nh * hd, 128, 3, nh, nkv, hd, pos, cos, sin, qo, ko, threads);   \
        digest(#S " rope q", threads, qo, 3 * nh * hd * sizeof(T));                              \
        digest(#S " rope k", threads, ko, 3 * nkv * hd * sizeof(T));                             \
        T *g = make(3 * 2 * 80, 4.0f), *act = zeros(3 * 80 * sizeof(T));                        \
        tk_silu_mul_##S(g, act, 3, 80, threads);                                                 \
        digest(#S " silu_mul", threads, act, 3 * 80 * sizeof(T));                                \
        T *logits = make(4 * d, 8.0f);                                                           \
        int64_t ids[4], rows[] = {2, 0};                                                         \
        tk_argmax_##S(logits, d, 4, d, ids, threads);                                            \
        digest(#S " argmax", threads, ids, sizeof ids);                                          \
        int32_t bits[2 * 32];                                                                    \
        for (int i = 0; i < 2 * 32; i++) bits[i] = (int32_t)(uniform() * 2147483647.0f);         \
        tk_token_mask_##S(logits, d, 4, rows, bits, 32, 2, d, threads);                          \
        digest(#S " token_mask", threads, logits, 4 * d * sizeof(T));                            \
        /* pages of 16: rows of 5, 40 and 70 positions, then one of 200 (cut in spans) */        \
        const int64_t page = 16, pages = 24, per_row = 13, stride = nkv * hd;                    \
        T *kp = make(pages * page * stride, 1.0f), *vp = make(pages * page * stride, 1.0f);      \
        T *nk = make(3 * stride, 1.0f), *nv = make(3 * stride, 1.0f), *aq = make(3 * nh * hd, 2.0f); \
        T *ao = zeros(3 * nh * hd * sizeof(T));                                                  \
        int32_t table[3 * 13], lens[] = {5, 40, 70}, long_len[] = {200};                         \
        for (int i = 0; i < 3 * per_row; i++) table[i] = (int32_t)((i * 7 + 3) % pages);        \
        int64_t slots[3];                                                                        \
        for (int b = 0; b < 3; b++)                                                              \
            slots[b] = table[b * per_row + (lens[b] - 1) / page] * page + (lens[b] - 1) % page;  \
        for (int64_t window = 0; window <= 24; window += 24) {                                   \
            char name[48];                                                                       \
            tk_paged_attention_##S(nk, stride, nv, stride, slots, 3, aq, nh * hd, NULL, kp, vp,  \
                                   table, per_row, lens, 3, nh, nkv, hd, page, window, 0.25f,    \
                                   ao, threads);                                                 \
            snprintf(name, sizeof name, #S " attention window=%lld", (long long)window);         \
            digest(name, threads, ao, 3 * nh * hd * sizeof(T));                                  \
        }                                                                                        \
        tk_paged_attention_##S(nk, stride, nv, stride, slots, 0, aq, nh * hd, NULL, kp, vp,      \
                               table, per_row, long_len, 1, nh, nkv, hd, page, 0, 0.25f, ao,     \
                               threads);                                                         \
        digest(#S " attention 200 positions", threads, ao, nh * hd * sizeof(T));                 \
        digest(#S " kv pages", threads, kp, pages * page * stride * sizeof(T));                  \
        free(x), free(res), free(wt), free(out), free(q), free(cos), free(sin), free(qo);        \
        free(ko), free(g), free(act), free(logits), free(kp), free(vp), free(nk), free(nv);      \
        free(aq), free(ao);                                                                      \
    }
LIGHT_KERNELS(float, f32, f32s)
LIGHT_KERNELS(bf16, bf16, bf16s)

/* Three layers in one fused call, each of another kind, behind the embedding and before the
 * final norm, the LM head and its argmax: n = 3 rows at positions 4, 20 and 37, pages of 16.
 * tp: a tensor-parallel rank's group (its weights then are its own), or NULL. */
static void fused(int threads, shm_reduce *tp) {
    enum { H = 64, nh = 4, nkv = 2, hd = 16, F = 96, E = 4, I = 32, SH = 48, V = 300, n = 3 };
    enum { page = 16, pages = 12, per_row = 3, count = 3 };
    const int64_t qkv = (nh + 2 * nkv) * hd, positions[n] = {4, 20, 37};
    bf16 *ones = malloc(sizeof(bf16) * hd);
    for (int i = 0; i < hd; i++) ones[i] = f32_to_bf16(1.0f);
    decode_layer L[count];
    memset(L, 0, sizeof L);
    for (int i = 0; i < count; i++) {
        L[i].input_norm = bf16s(H, 1.0f), L[i].post_norm = bf16s(H, 1.0f);
        L[i].qkv = bf16s(qkv * H, 0.2f), L[i].o = bf16s(H * nh * hd, 0.2f);
        L[i].hidden = H, L[i].heads = nh, L[i].kv_heads = nkv, L[i].head_dim = hd;
        L[i].eps = 1e-5f, L[i].qk_eps = 1e-6f, L[i].scale = 0.25f;
    }
    /* dense, rotate-half tables, a qkv bias */
    L[0].qkv_bias = bf16s(qkv, 0.5f), L[0].rope = ROPE_TABLES, L[0].intermediate = F;
    L[0].cos = bf16s(64 * hd, 1.0f), L[0].sin = bf16s(64 * hd, 1.0f);
    L[0].gate_up = bf16s(2 * F * H, 0.2f), L[0].down = bf16s(H * F, 0.2f);
    /* routed experts (softmax top 2, renormalised), NoPE with the query temperature, Qwen3's
     * q/k norms before, the sliding-window mask */
    L[1].rope = ROPE_NONE, L[1].temperature = 1, L[1].mask = 1;
    L[1].q_norm = bf16s(hd, 1.0f), L[1].k_norm = bf16s(hd, 1.0f);
    /* routed (sigmoid top 1) beside a shared expert, interleaved pairs, Llama 4's L2 norms */
    L[2].rope = ROPE_PAIRS, L[2].norm_after_rope = 1, L[2].q_norm = ones, L[2].k_norm = ones;
    L[2].shared_intermediate = SH;
    L[2].shared_gate_up = bf16s(2 * SH * H, 0.2f), L[2].shared_down = bf16s(H * SH, 0.2f);
    for (int i = 1; i < count; i++) {
        L[i].router = bf16s(E * H, 0.5f), L[i].experts = E, L[i].intermediate = I;
        L[i].w13 = bf16s(E * 2 * I * H, 0.2f), L[i].w2 = bf16s(E * H * I, 0.2f);
        L[i].top_k = i == 1 ? 2 : 1, L[i].renormalize = i == 1;
        L[i].scoring = i == 1 ? ROUTE_SOFTMAX : ROUTE_SIGMOID;
    }
    bf16 *k_pools[count], *v_pools[count];
    for (int i = 0; i < count; i++)
        k_pools[i] = bf16s(pages * page * nkv * hd, 1.0f),
        v_pools[i] = bf16s(pages * page * nkv * hd, 1.0f);
    int32_t table[n * per_row], lens[n];
    int64_t slots[n], ids[n] = {7, 299, 0}, tokens[n];
    for (int i = 0; i < n * per_row; i++) table[i] = (int32_t)((i * 5 + 2) % pages);
    for (int t = 0; t < n; t++) {
        lens[t] = (int32_t)positions[t] + 1;
        slots[t] = table[t * per_row + positions[t] / page] * page + positions[t] % page;
    }
    step_mask masks[2] = {{slots, table, lens, per_row, 0}, {slots, table, lens, per_row, 8}};
    float *cs = f32s(n * hd, 1.0f), temperature[n] = {1.0f, 1.25f, 0.75f};
    decode_embed embed = {bf16s(V * H, 1.0f), V, ids};
    bf16 *logits = zeros(n * V * 2), *final_norm = bf16s(H, 1.0f);
    decode_head head = {bf16s(V * H, 0.2f), V, NULL, n, logits, tokens};
    bf16 *residual = zeros(n * H * 2), *out = zeros(n * H * 2);
    int status = tk_decode_layers_bf16(L, count, NULL, &embed, residual, 1, out, n, positions, 64,
                                       cs, temperature, k_pools, v_pools, masks, 2, page, tp,
                                       final_norm, 1e-5f, &head, threads);
    const char *tag = tp == NULL ? "fused" : "tp fused";
    char name[48];
    if (status != 0) printf("%s status %d\n", tag, status);
    if (tp != NULL && tp->rank != 0) return; /* rank 0 prints */
    snprintf(name, sizeof name, "%s out", tag), digest(name, threads, out, n * H * 2);
    snprintf(name, sizeof name, "%s residual", tag);
    digest(name, threads, residual, n * H * 2);
    snprintf(name, sizeof name, "%s logits", tag), digest(name, threads, logits, n * V * 2);
    snprintf(name, sizeof name, "%s tokens", tag), digest(name, threads, tokens, sizeof tokens);
    for (int i = 0; i < count; i++) {
        snprintf(name, sizeof name, "%s layer %d k pool", tag, i);
        digest(name, threads, k_pools[i], pages * page * nkv * hd * 2);
        snprintf(name, sizeof name, "%s layer %d v pool", tag, i);
        digest(name, threads, v_pools[i], pages * page * nkv * hd * 2);
    }
}

/* Two ranks' all-reduces, float32 and bfloat16, of counts below and above the entry point's
 * one-thread size, then the fused decoder on each rank's own weights. The caller forks rank 1
 * after making the group: no OpenMP team runs before the fork. */
static void tensor_parallel(shm_reduce *G, int threads) {
    const int64_t counts[] = {1000, 70000};
    for (int c = 0; c < 2; c++) {
        state = 0x2545f4914f6cdd1du + (uint64_t)(G->rank * 2 + c); /* each rank's own part */
        float *xf = f32s(counts[c], 4.0f);
        bf16 *xb = bf16s(counts[c], 4.0f);
        int64_t status = tk_all_reduce_f32(G, xf, counts[c], threads);
        status = status != 0 ? status : tk_all_reduce_bf16(G, xb, counts[c], threads);
        if (status != 0) printf("all_reduce status %lld\n", (long long)status);
        if (G->rank == 0) {
            char name[48];
            snprintf(name, sizeof name, "f32 all_reduce count=%lld", (long long)counts[c]);
            digest(name, threads, xf, counts[c] * 4);
            snprintf(name, sizeof name, "bf16 all_reduce count=%lld", (long long)counts[c]);
            digest(name, threads, xb, counts[c] * 2);
        }
        free(xf), free(xb);
    }
    state = 0x9e3779b97f4a7c15u + (uint64_t)G->rank;
    fused(threads, G);
}

/* A group of two ranks in a shared anonymous mapping (shm_group.py's layout: a line of step
 * counter and flags a rank, the pids, two sets of two slots); rank 1 is a child that runs
 * tensor_parallel alike and exits. Returns 0, or why not. */
static int tensor_parallel_digests(void) {
    enum { LINE = 8, SIZE = 2 };
    const int64_t slot_bytes = 512 << 10;
    size_t bytes = sizeof(int64_t) * (SIZE * LINE + SIZE) + 2 * SIZE * slot_bytes;
    uint8_t *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return 1;
    int64_t *lines = (int64_t *)map, *pids = lines + SIZE * LINE;
    shm_reduce G = {.lines = lines, .pids = pids, .slots = (uint8_t *)(pids + SIZE), .line = LINE,
                    .slot_bytes = slot_bytes, .size = SIZE, .timeout_s = 30.0,
                    .post = tison_shm_post, .wait = tison_shm_wait};
    pids[0] = getpid();
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) return 2;
    if (child == 0) {
        G.rank = 1;
        pids[1] = getpid();
    } else {
        pids[1] = child;
    }
    for (int threads = 1; threads <= 2; threads++) tensor_parallel(&G, threads);
    if (child == 0) {
        fflush(stdout);
        _exit(0);
    }
    int status;
    return waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0
               ? 0
               : 3;
}

int main(void) {
    if (tensor_parallel_digests() != 0) return 1; /* first: it forks */
    state = 0x9e3779b97f4a7c15u;
    for (int threads = 1; threads <= 2; threads++) {
        linears(threads);
        light_f32(threads);
        light_bf16(threads);
        fused(threads, NULL);
    }
    return 0;
}
