/* The greedy token of each sequence: argmax over the vocabulary of logits laid out [V, B] (each
 * vocabulary row holds the B sequences' logits side by side), as the compiled decode step makes them
 * (`W @ h^T`, the lm_head form that streams the weight once).
 *
 * Why not torch: aten's argmax over the transposed view reduces along the strided dimension one
 * element at a time (0.5 ms at V = 32000, B = 32 in float32, 1.7 ms in bfloat16), and inductor's
 * generated reduction keeps an index per element (0.3 ms). Here each vocabulary row is one or two
 * vector loads and a compare-and-blend per vector, over a read of the logits that are still in cache.
 *
 * Semantics are torch.argmax's: the first index of the maximum; a NaN counts as larger than any
 * number (the first NaN wins). Threads split the vocabulary; their results merge in vocabulary order.
 *
 * Shape legend: V vocabulary rows, B sequences, ld the distance between vocabulary rows (>= B).
 *     logits [V, ld]  float32 or bfloat16, the first B of each row used
 *     out    [B]      int64, each sequence's argmax
 */
#include <stdint.h>
#include <string.h>

#include "cpu_vectors.h"

#define GROUP 256    /* sequences handled per sweep over the vocabulary: their best values and indices stay in L1 */
#define MAX_THREADS 256

/* x replaces the running best where it is larger, or NaN over a number. */
static inline int takes(float x, float best) { return x > best || (x != x && best == best); }

/* best/arg [n] over rows v0..v1 of columns c0..c0+n (n <= GROUP). */
#define DEFINE_SWEEP(SUF, T)                                                                           \
    static void sweep_##SUF(const T *logits, long ld, long v0, long v1, int c0, int n, float *best,   \
                            int32_t *arg) {                                                            \
        int nv = n / VW;                                                                               \
        vf vbest[GROUP / VW];                                                                          \
        vi varg[GROUP / VW];                                                                           \
        for (int g = 0; g < nv; g++) {                                                                 \
            vbest[g] = load_vec_##SUF(logits + v0 * ld + c0 + g * VW);                                 \
            varg[g] = (vi){} + (int32_t)v0;                                                            \
        }                                                                                              \
        for (long v = v0 + 1; v < v1; v++) {                                                           \
            const T *row = logits + v * ld + c0;                                                       \
            for (int g = 0; g < nv; g++) {                                                             \
                vf x = load_vec_##SUF(row + g * VW);                                                   \
                vi m = (x > vbest[g]) | ((x != x) & (vbest[g] == vbest[g]));                           \
                vi xb, bb;                                                                             \
                memcpy(&xb, &x, sizeof xb);                                                            \
                memcpy(&bb, &vbest[g], sizeof bb);                                                     \
                bb = (xb & m) | (bb & ~m);                                                             \
                memcpy(&vbest[g], &bb, sizeof bb);                                                     \
                varg[g] = (((vi){} + (int32_t)v) & m) | (varg[g] & ~m);                                \
            }                                                                                          \
        }                                                                                              \
        for (int g = 0; g < nv; g++) {                                                                 \
            memcpy(best + g * VW, &vbest[g], sizeof vbest[g]);                                         \
            memcpy(arg + g * VW, &varg[g], sizeof varg[g]);                                            \
        }                                                                                              \
        for (int c = nv * VW; c < n; c++) { /* n % VW leftover columns */                              \
            float b = load_one_##SUF(logits + v0 * ld + c0 + c);                                       \
            int32_t a = (int32_t)v0;                                                                   \
            for (long v = v0 + 1; v < v1; v++) {                                                       \
                float x = load_one_##SUF(logits + v * ld + c0 + c);                                    \
                if (takes(x, b)) b = x, a = (int32_t)v;                                                \
            }                                                                                          \
            best[c] = b, arg[c] = a;                                                                   \
        }                                                                                              \
    }                                                                                                  \
    void locus_argmax_##SUF(const T *logits, long V, long B, long ld, int64_t *out, int threads) {     \
        if (V < 1) return; /* the caller checks: no vocabulary, no argmax */                            \
        if (threads > MAX_THREADS) threads = MAX_THREADS;                                              \
        if (threads > V) threads = (int)V;                                                             \
        if (threads < 1) threads = 1;                                                                  \
        for (long c0 = 0; c0 < B; c0 += GROUP) {                                                       \
            int n = B - c0 < GROUP ? (int)(B - c0) : GROUP;                                            \
            float bp[threads][GROUP];                                                                  \
            int32_t ap[threads][GROUP];                                                                \
            _Pragma("omp parallel for num_threads(threads)")                                           \
            for (int t = 0; t < threads; t++) /* thread t: rows [V*t/threads, V*(t+1)/threads) */      \
                sweep_##SUF(logits, ld, V * t / threads, V * (t + 1) / threads, (int)c0, n, bp[t], ap[t]); \
            for (int c = 0; c < n; c++) { /* merge in vocabulary order: a later part wins only if larger */ \
                float b = bp[0][c];                                                                    \
                int32_t a = ap[0][c];                                                                  \
                for (int t = 1; t < threads; t++)                                                      \
                    if (takes(bp[t][c], b)) b = bp[t][c], a = ap[t][c];                                \
                out[c0 + c] = a;                                                                       \
            }                                                                                          \
        }                                                                                              \
    }

DEFINE_SWEEP(f32, float)
DEFINE_SWEEP(bf16, uint16_t)
