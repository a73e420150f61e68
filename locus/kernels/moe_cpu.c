/* Routed experts on the CPU for batches with few rows per expert (decode).
 *
 * Why not torch.bmm: a small-M GEMM in MKL/oneDNN packs the weight panel before multiplying, so at
 * 2-8 rows per expert it reads each weight about twice and runs at a third of the memory stream
 * rate. Here each expert's weights are read once, straight from the checkpoint layout, with every
 * row of that expert multiplied against the weight vectors while they sit in registers.
 *
 * The whole routed-expert computation of a layer is two calls (moe_cpu.py): locus_moe_sort sorts the
 * (token, slot) pairs by expert and reports the busiest expert's row count (the caller decides whether
 * the kernel applies), then locus_moe_run_{f32,bf16} gathers the rows, runs both GEMMs and sums each
 * token's slots. No tensor op runs between them.
 *
 * Shape legend: T tokens, K slots per token, P = T*K pairs, Ph the pairs held here, E experts held
 * here, H hidden, I expert width. Rows of expert e are offsets[e] .. offsets[e+1]-1 of the sorted pairs.
 *     x       [T, H]   the layer's input, float32 or bfloat16
 *     ids     [P]      int64 expert id of each pair (global when an expert map is given; -1: skip)
 *     weights [P]      float32 routing weight of each pair
 *     gate_up expert e at gate_up + e*se; element (k, n) at k*sk + n   [E, H, 2I], gate = first I columns
 *     down    expert e at down + e*se; element (j, n) at j*sk + n      [E, I, H]
 *     rows    [Ph, H]  float32, the input row of each held pair (times its weight when it scales the input)
 *     h       [Ph, I]  float32, silu(rows @ gate) * (rows @ up)
 *     y       [Ph, H]  float32, h @ down
 *     out     [T, H]   x's dtype, sum over each token's slots of y (times the weight when it scales the output)
 * Weights are float32 or bfloat16 (widened to float32 in registers); accumulation is float32.
 *
 * Work is split over (expert, column block) items with OpenMP; the library links the libgomp that
 * torch has loaded, so it shares torch's threads and thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vectors.h"

#define RB 8    /* rows multiplied per pass over a weight block (more rows: more passes) */
#define CB 512  /* output columns per work item: the accumulators RB x CB stay in L1 */
#define KB 8    /* weight rows loaded together: KB sequential read streams per pass */
/* Weight-row blocks read ahead by software prefetch. Each block is KB short runs (one per weight row,
 * a row apart), too short for the hardware prefetcher to follow: without it the bfloat16 kernel ran at
 * half the speed (bench/moe_kernels.py, docs/kernels.md). */
#define PREFETCH 2

/* acc[r][c] += sum_k a[r][k] * w[k][c] for r < nr, k < K, c < C; rows of a are lda apart, of w ldw
 * apart, of acc ldc apart. Each block of KB x VW weights is loaded once and used by all nr rows. */
#define DEFINE_ACCUMULATE(SUF, WT)                                                                   \
    static void accumulate_##SUF(const float *a, long lda, int nr, const WT *w, long ldw, int K,     \
                                 int C, float *acc, int ldc) {                                       \
        int cv = C - C % VW, k0 = 0;                                                                 \
        for (; k0 + KB <= K; k0 += KB) {                                                             \
            const WT *wk = w + (long)k0 * ldw;                                                       \
            for (int c = 0; c < cv; c += VW) {                                                       \
                if (k0 + (PREFETCH + 1) * KB <= K) /* the rows PREFETCH blocks ahead, these columns */ \
                    for (int q = 0; q < KB; q++) __builtin_prefetch(wk + (PREFETCH * KB + q) * ldw + c, 0, 3); \
                vf w0 = load_vec_##SUF(wk + c), w1 = load_vec_##SUF(wk + ldw + c),                   \
                   w2 = load_vec_##SUF(wk + 2 * ldw + c), w3 = load_vec_##SUF(wk + 3 * ldw + c),     \
                   w4 = load_vec_##SUF(wk + 4 * ldw + c), w5 = load_vec_##SUF(wk + 5 * ldw + c),     \
                   w6 = load_vec_##SUF(wk + 6 * ldw + c), w7 = load_vec_##SUF(wk + 7 * ldw + c);     \
                for (int r = 0; r < nr; r++) {                                                       \
                    const float *x = a + r * lda + k0;                                               \
                    vf *out = (vf *)(acc + r * ldc + c);                                             \
                    vf s = *out; /* one chain of fused multiply-adds per row; rows are independent */ \
                    s += x[0] * w0; s += x[1] * w1; s += x[2] * w2; s += x[3] * w3;                  \
                    s += x[4] * w4; s += x[5] * w5; s += x[6] * w6; s += x[7] * w7;                  \
                    *out = s;                                                                        \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (; k0 < K; k0++) { /* K % KB leftover weight rows */                                      \
            const WT *wk = w + (long)k0 * ldw;                                                       \
            for (int c = 0; c < cv; c += VW) {                                                       \
                vf wv = load_vec_##SUF(wk + c);                                                      \
                for (int r = 0; r < nr; r++) *(vf *)(acc + r * ldc + c) += a[r * lda + k0] * wv;     \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < nr; r++) /* C % VW leftover columns */                                   \
            for (int k = 0; k < K; k++)                                                              \
                for (int c = cv; c < C; c++)                                                         \
                    acc[r * ldc + c] += a[r * lda + k] * load_one_##SUF(w + (long)k * ldw + c);     \
    }

DEFINE_ACCUMULATE(f32, float)
DEFINE_ACCUMULATE(bf16, uint16_t)

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

#define DEFINE_STAGES(SUF, WT)                                                                       \
    static void gate_up_##SUF(const float *x, const WT *gate_up, long se, long sk,                \
                                 const int64_t *offsets, int E, int H, int I, float *h, int threads) { \
        int blocks = (I + CB - 1) / CB;                                                              \
        _Pragma("omp parallel for schedule(dynamic) num_threads(threads)")                           \
        for (long item = 0; item < (long)E * blocks; item++) {                                       \
            int e = item / blocks, j0 = (item % blocks) * CB, C = I - j0 < CB ? I - j0 : CB;          \
            float gate[RB * CB] __attribute__((aligned(64))), up[RB * CB] __attribute__((aligned(64))); \
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += RB) {                           \
                int nr = offsets[e + 1] - p0 < RB ? offsets[e + 1] - p0 : RB;                        \
                memset(gate, 0, sizeof gate);                                                        \
                memset(up, 0, sizeof up);                                                            \
                const WT *w = gate_up + e * se + j0;                                                 \
                accumulate_##SUF(x + p0 * H, H, nr, w, sk, H, C, gate, CB);                          \
                accumulate_##SUF(x + p0 * H, H, nr, w + I, sk, H, C, up, CB);                        \
                for (int r = 0; r < nr; r++)                                                         \
                    for (int c = 0; c < C; c++)                                                      \
                        h[(p0 + r) * I + j0 + c] = silu(gate[r * CB + c]) * up[r * CB + c];          \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    static void down_##SUF(const float *h, const WT *down, long se, long sk,                      \
                              const int64_t *offsets, int E, int I, int H, float *y, int threads) {  \
        int blocks = (H + CB - 1) / CB;                                                              \
        _Pragma("omp parallel for schedule(dynamic) num_threads(threads)")                           \
        for (long item = 0; item < (long)E * blocks; item++) {                                       \
            int e = item / blocks, n0 = (item % blocks) * CB, C = H - n0 < CB ? H - n0 : CB;          \
            float acc[RB * CB] __attribute__((aligned(64)));                                         \
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += RB) {                           \
                int nr = offsets[e + 1] - p0 < RB ? offsets[e + 1] - p0 : RB;                        \
                memset(acc, 0, sizeof acc);                                                          \
                accumulate_##SUF(h + p0 * I, I, nr, down + e * se + n0, sk, I, C, acc, CB);          \
                for (int r = 0; r < nr; r++)                                                         \
                    memcpy(y + (p0 + r) * H + n0, acc + r * CB, C * sizeof(float));                  \
            }                                                                                        \
        }                                                                                            \
    }

DEFINE_STAGES(f32, float)
DEFINE_STAGES(bf16, uint16_t)

static inline float round_bf16(float f) { /* to the nearest bfloat16 (ties to even), as a float32 */
    if (f != f) return f; /* NaN stays NaN (the rounding carry could reach the sign bit) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void store_f32(float *p, float v) { *p = v; }
static inline void store_bf16(uint16_t *p, float v) {
    float r = round_bf16(v);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    *p = (uint16_t)(u >> 16);
}
static inline float keep_f32(float v) { return v; }

/* First half of a layer: count the P pairs per local expert. iwork (int64, E+1 + 2P + E): offsets
 * [E+1], order [P] (pair index of each sorted row), slot_row [P] (here: each pair's local expert,
 * -1 if not held here), cursors [E]. Returns the largest row count of any expert, or -1 if an id (or
 * its map entry) is out of range. */
int64_t locus_moe_sort(const int64_t *ids, int64_t P, const int64_t *expert_map, int64_t map_size, int E,
                       int64_t *iwork) {
    int64_t *offsets = iwork, *slot_row = iwork + E + 1 + P, most = 0;
    memset(offsets, 0, (E + 1) * sizeof *offsets);
    for (int64_t p = 0; p < P; p++) {
        int64_t e = ids[p];
        if (e >= 0 && expert_map) e = e < map_size ? expert_map[e] : -2;
        if (e < -1 || e >= E) return -1;
        slot_row[p] = e;
        if (e >= 0) offsets[e + 1]++;
    }
    for (int e = 0; e < E; e++) {
        most = offsets[e + 1] > most ? offsets[e + 1] : most;
        offsets[e + 1] += offsets[e];
    }
    return most;
}

/* Second half, on the iwork locus_moe_sort filled: place the pairs (stable counting sort), gather
 * their rows, run both GEMMs, sum each token's slots into out. fwork (float32, Ph * (2H + I)): rows,
 * h, y. gather_##SUF does the first step (it returns Ph), sum_slots_##SUF the last. */
#define DEFINE_GATHER_SUM(SUF, WT, ROUND_INPUT)                                                      \
    static int64_t gather_##SUF(const WT *x, const float *weights, int T, int K, int weight_on_input, \
                                int E, int H, int64_t *iwork, float *rows, int threads) {            \
        int64_t P = (int64_t)T * K, *offsets = iwork, *order = iwork + E + 1, *slot_row = order + P; \
        int64_t *cursor = slot_row + P, held = offsets[E];                                           \
        memcpy(cursor, offsets, E * sizeof *cursor);                                                 \
        for (int64_t p = 0; p < P; p++) { /* stable: pairs keep their order within an expert */      \
            int64_t e = slot_row[p];                                                                 \
            slot_row[p] = e >= 0 ? cursor[e]++ : -1;                                                 \
            if (e >= 0) order[slot_row[p]] = p;                                                      \
        }                                                                                            \
        _Pragma("omp parallel for num_threads(threads)")                                             \
        for (int64_t r = 0; r < held; r++) {                                                         \
            int64_t p = order[r];                                                                    \
            const WT *src = x + (p / K) * H;                                                         \
            float w = ROUND_INPUT(weights[p]), *dst = rows + r * H;                                  \
            for (int c = 0; c < H; c++) {                                                            \
                float v = load_one_##SUF(src + c);                                                   \
                dst[c] = weight_on_input ? ROUND_INPUT(v * w) : v; /* as the reference, in x's dtype */ \
            }                                                                                        \
        }                                                                                            \
        return held;                                                                                 \
    }                                                                                                \
    static void sum_slots_##SUF(const float *y, const float *weights, int T, int K, int weight_on_input, \
                                int E, int H, const int64_t *iwork, WT *out, int threads) {          \
        const int64_t *slot_row = iwork + E + 1 + (int64_t)T * K;                                    \
        _Pragma("omp parallel for num_threads(threads)")                                             \
        for (int t = 0; t < T; t++) {                                                                \
            float acc[H];                                                                            \
            memset(acc, 0, sizeof acc);                                                              \
            for (int k = 0; k < K; k++) {                                                            \
                int64_t p = (int64_t)t * K + k, r = slot_row[p];                                     \
                if (r < 0) continue;                                                                 \
                float w = weight_on_input ? 1.0f : weights[p];                                       \
                for (int c = 0; c < H; c++) acc[c] += y[r * H + c] * w;                              \
            }                                                                                        \
            for (int c = 0; c < H; c++) store_##SUF(out + (int64_t)t * H + c, acc[c]);                \
        }                                                                                            \
    }

DEFINE_GATHER_SUM(f32, float, keep_f32)
DEFINE_GATHER_SUM(bf16, uint16_t, round_bf16)

#define DEFINE_RUN(SUF, WT)                                                                          \
    void locus_moe_run_##SUF(const WT *x, const float *weights, int T, int K, int weight_on_input,  \
                             const WT *gate_up, long gu_se, long gu_sk, const WT *down, long d_se,    \
                             long d_sk, int E, int H, int I, int64_t *iwork, float *fwork, WT *out,   \
                             int threads) {                                                          \
        float *rows = fwork;                                                                         \
        int64_t held = gather_##SUF(x, weights, T, K, weight_on_input, E, H, iwork, rows, threads);  \
        float *h = rows + held * H, *y = h + held * I;                                               \
        gate_up_##SUF(rows, gate_up, gu_se, gu_sk, iwork, E, H, I, h, threads);                      \
        down_##SUF(h, down, d_se, d_sk, iwork, E, I, H, y, threads);                                 \
        sum_slots_##SUF(y, weights, T, K, weight_on_input, E, H, iwork, out, threads);               \
    }

DEFINE_RUN(f32, float)
DEFINE_RUN(bf16, uint16_t)

#include "moe_cpu_quantized.h"
