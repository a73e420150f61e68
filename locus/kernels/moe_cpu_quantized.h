/* The CPU routed-expert kernel on quantized expert weights (included at the end of moe_cpu.c).
 *
 * Same work split, row blocks and accumulators as the float kernel; only the weight loads differ:
 * each weight vector (16 columns of one weight row) is read in its narrow format and widened to
 * float32 in registers, so an expert's bytes read drop 2x (FP8) or 4x (MXFP4) against bfloat16.
 * A weight is element * scale (locus/kernels/formats.py), exactly in float32:
 *     QFMT_FP8     E4M3 elements [E, K, N], float32 scale per output column  [E, 1, N]
 *     QFMT_MXFP8   E4M3 elements [E, K, N], E8M0 scale per 32 rows of K       [E, ceil(K/32), N]
 *     QFMT_MXFP4   E2M1 elements two a byte along K [E, ceil(K/2), N] (row 2i in the low nibble),
 *                  E8M0 scale per 32 rows of K                                [E, ceil(K/32), N]
 * E4M3 is widened through float16: its sign, exponent and mantissa bits moved to float16's places
 * (sign-extend to 16 bits, shift by 7, clear bit 14) read as a float16 of value/2^8, E4M3's
 * subnormals landing on float16's, then the hardware float16 -> float32 conversion; the 2^8 (the bias
 * difference) is folded into the scale. So a weight costs 4 vector operations before its
 * multiply-adds (MXFP4: 2.5), against 2 for bfloat16; the scale multiplies a block's sums, not each
 * weight. E2M1 is a 16-entry table indexed by the nibble. E4M3 NaN
 * codes are not decoded (the quantizer never writes them: a NaN block is a NaN scale), and a scale
 * times 2^8 must stay finite (an FP8 weight's scale below 2^119).
 * Rows of a block of 8 weight rows share one scale vector: 8 divides 32.
 */

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { QFMT_FP8 = 1, QFMT_MXFP8 = 2, QFMT_MXFP4 = 3 };

typedef struct { /* one quantized expert tensor [E, K, N]; strides in elements (bytes of data) */
    const uint8_t *data;
    int64_t se, sk;       /* expert and row stride of data (MXFP4: a row of bytes holds rows 2i, 2i+1) */
    const void *scale;    /* uint8 E8M0 (MX) or float32 (FP8) */
    int64_t sse, ssk;     /* expert and block-row stride of scale */
} qweights;

typedef uint8_t vb __attribute__((vector_size(VW), aligned(1)));
typedef int8_t vsb __attribute__((vector_size(VW), aligned(1)));
typedef int16_t vs16 __attribute__((vector_size(VW * 2)));
typedef uint16_t vw16 __attribute__((vector_size(VW * 2)));
typedef _Float16 vhf __attribute__((vector_size(VW * 2)));

static inline vf bits_vf(vu u) {
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
#define E4M3_FOLD 256.0f /* E4M3 bits read as float16 are the value / 2^8 */

/* VW bytes -> VW uint32 lanes (GCC builds __builtin_convertvector of unaligned bytes lane by lane) */
static inline __attribute__((always_inline)) vu bytes_u32(const uint8_t *p) {
#if defined(__AVX512F__)
    __m512i r = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    vu u;
    memcpy(&u, &r, sizeof u);
    return u;
#else
    return __builtin_convertvector(*(const vb *)p, vu);
#endif
}

/* E8M0 bytes -> 2^(s-127) (s = 0: the float32 subnormal 2^-127; s = 255: NaN) */
static inline __attribute__((always_inline)) vf e8m0_vec(const uint8_t *p) {
    vu s = bytes_u32(p);
    vu bits = s << 23, zero = (vu)(s == 0), nan = (vu)(s == 255);
    bits = (bits & ~zero) | (0x00400000u & zero);
    bits = (bits & ~nan) | (0x7FC00000u & nan);
    return bits_vf(bits);
}
static inline float e8m0_one(uint8_t s) {
    return s == 0 ? bits_f(0x00400000u) : s == 255 ? bits_f(0x7FC00000u) : bits_f((uint32_t)s << 23);
}
static inline __attribute__((always_inline)) vf e4m3_vec(const uint8_t *p) { /* value / 2^8 */
    vw16 h = (vw16)__builtin_convertvector(*(const vsb *)p, vs16);
    h = (h << 7) & 0xBFFF;
    vf out;
#if defined(__AVX512F__) /* GCC scalarises __builtin_convertvector from float16: the intrinsics do not */
    __m256i hv;
    memcpy(&hv, &h, sizeof hv);
    __m512 r = _mm512_cvtph_ps(hv);
    memcpy(&out, &r, sizeof out);
#elif defined(__F16C__)
    __m128i lo, hi;
    memcpy(&lo, &h, sizeof lo);
    memcpy(&hi, (const char *)&h + sizeof lo, sizeof hi);
    __m256 a = _mm256_cvtph_ps(lo), b = _mm256_cvtph_ps(hi);
    memcpy(&out, &a, sizeof a);
    memcpy((char *)&out + sizeof a, &b, sizeof b);
#else
    vhf f;
    memcpy(&f, &h, sizeof f);
    out = __builtin_convertvector(f, vf);
#endif
    return out;
}
static inline float e4m3_one(uint8_t b) { /* value / 2^8, as e4m3_vec */
    uint16_t h = (uint16_t)((uint16_t)(int16_t)(int8_t)b << 7) & 0xBFFF;
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}
static inline __attribute__((always_inline)) vf e2m1_vec(const uint8_t *p, int high) {
    vu u = (bytes_u32(p) >> (high ? 4 : 0)) & 0xF;
#if defined(__clang__)
    vf out;
    for (int i = 0; i < VW; i++) out[i] = E2M1[u[i]];
    return out;
#else
    vf table;
    memcpy(&table, E2M1, sizeof table);
    return __builtin_shuffle(table, (vi)u);
#endif
}

/* Both weight rows of one MXFP4 byte row (columns n .. n+VW-1), unscaled: the even row in the low nibbles. */
static inline __attribute__((always_inline)) void e2m1_pair(const uint8_t *p, vf *even, vf *odd) {
    vu u = bytes_u32(p);
#if defined(__clang__)
    for (int i = 0; i < VW; i++) (*even)[i] = E2M1[u[i] & 0xF], (*odd)[i] = E2M1[u[i] >> 4];
#else
    vf table;
    memcpy(&table, E2M1, sizeof table);
    *even = __builtin_shuffle(table, (vi)(u & 0xF));
    *odd = __builtin_shuffle(table, (vi)(u >> 4));
#endif
}

/* Weight row k of expert e at columns n .. n+VW-1 (one) as float32, and its scale. */
static inline __attribute__((always_inline)) const uint8_t *qrow(const qweights *w, int64_t e, int fmt, int k, int n) {
    return w->data + e * w->se + (int64_t)(fmt == QFMT_MXFP4 ? k >> 1 : k) * w->sk + n;
}
/* The scale of weight row k at columns n .. n+VW-1 (one), times 2^8 for the E4M3 formats. */
static inline __attribute__((always_inline)) vf qscale_vec(const qweights *w, int64_t e, int fmt, int k, int n) {
    if (fmt == QFMT_FP8) return *(const vf *)((const float *)w->scale + e * w->sse + n) * E4M3_FOLD;
    vf s = e8m0_vec((const uint8_t *)w->scale + e * w->sse + (int64_t)(k / 32) * w->ssk + n);
    return fmt == QFMT_MXFP8 ? s * E4M3_FOLD : s;
}
static inline float qscale_one(const qweights *w, int64_t e, int fmt, int k, int n) {
    if (fmt == QFMT_FP8) return ((const float *)w->scale)[e * w->sse + n] * E4M3_FOLD;
    float s = e8m0_one(((const uint8_t *)w->scale)[e * w->sse + (int64_t)(k / 32) * w->ssk + n]);
    return fmt == QFMT_MXFP8 ? s * E4M3_FOLD : s;
}
static inline __attribute__((always_inline)) vf qelem_vec(const qweights *w, int64_t e, int fmt, int k, int n) {
    const uint8_t *p = qrow(w, e, fmt, k, n);
    return fmt == QFMT_MXFP4 ? e2m1_vec(p, k & 1) : e4m3_vec(p);
}
static inline float qelem_one(const qweights *w, int64_t e, int fmt, int k, int n) {
    uint8_t b = *qrow(w, e, fmt, k, n);
    return fmt == QFMT_MXFP4 ? E2M1[(k & 1 ? b >> 4 : b) & 0xF] : e4m3_one(b);
}

/* acc[r][c] += sum_k a[r][k] * W[k][n0 + c] for r < nr, k < K, c < C: accumulate_f32's loop over
 * blocks of KB x VW weights, widened once and used by all nr rows. The scale is applied once per
 * scale block, not per weight: the rows of a block (32 for MX, all K for row-wise FP8) accumulate
 * element products into blk, which is then scaled into acc. Specialised per format (FMT is a
 * constant in each caller), so the format tests fold away. */
static inline __attribute__((always_inline)) void accumulate_q(const float *a, long lda, int nr, const qweights *w,
                                                               int64_t e, int fmt, int n0, int K, int C, float *acc,
                                                               int ldc) {
    int cv = C - C % VW, span = fmt == QFMT_FP8 ? K : 32;
    float blk[RB * CB] __attribute__((aligned(64)));
    for (int kb = 0; kb < K; kb += span) {
        int kend = kb + span < K ? kb + span : K, k0 = kb;
        for (int r = 0; r < nr; r++) memset(blk + r * CB, 0, cv * sizeof(float));
        for (; k0 + KB <= kend; k0 += KB) {
            for (int c = 0; c < cv; c += VW) {
                if (k0 + (PREFETCH + 1) * KB <= K && c % 64 == 0) /* a line holds 64 columns of one row */
                    for (int q = 0; q < KB; q += fmt == QFMT_MXFP4 ? 2 : 1)
                        __builtin_prefetch(qrow(w, e, fmt, k0 + PREFETCH * KB + q, n0 + c), 0, 3);
                const uint8_t *b = qrow(w, e, fmt, k0, n0 + c);
                vf w0, w1, w2, w3, w4, w5, w6, w7;
                if (fmt == QFMT_MXFP4) { /* one byte row holds two weight rows: read it once */
                    e2m1_pair(b, &w0, &w1);
                    e2m1_pair(b + w->sk, &w2, &w3);
                    e2m1_pair(b + 2 * w->sk, &w4, &w5);
                    e2m1_pair(b + 3 * w->sk, &w6, &w7);
                } else {
                    w0 = e4m3_vec(b), w1 = e4m3_vec(b + w->sk), w2 = e4m3_vec(b + 2 * w->sk),
                    w3 = e4m3_vec(b + 3 * w->sk), w4 = e4m3_vec(b + 4 * w->sk), w5 = e4m3_vec(b + 5 * w->sk),
                    w6 = e4m3_vec(b + 6 * w->sk), w7 = e4m3_vec(b + 7 * w->sk);
                }
                for (int r = 0; r < nr; r++) {
                    const float *x = a + r * lda + k0;
                    vf *out = (vf *)(blk + r * CB + c);
                    vf t = *out;
                    t += x[0] * w0; t += x[1] * w1; t += x[2] * w2; t += x[3] * w3;
                    t += x[4] * w4; t += x[5] * w5; t += x[6] * w6; t += x[7] * w7;
                    *out = t;
                }
            }
        }
        for (; k0 < kend; k0++) /* K % KB leftover weight rows (the last block only) */
            for (int c = 0; c < cv; c += VW) {
                vf wv = qelem_vec(w, e, fmt, k0, n0 + c);
                for (int r = 0; r < nr; r++) *(vf *)(blk + r * CB + c) += a[r * lda + k0] * wv;
            }
        for (int c = 0; c < cv; c += VW) {
            vf s = qscale_vec(w, e, fmt, kb, n0 + c);
            for (int r = 0; r < nr; r++) *(vf *)(acc + r * ldc + c) += *(vf *)(blk + r * CB + c) * s;
        }
    }
    for (int k = 0; k < K; k++) /* C % VW leftover columns */
        for (int c = cv; c < C; c++) {
            float wk = qelem_one(w, e, fmt, k, n0 + c) * qscale_one(w, e, fmt, k, n0 + c);
            for (int r = 0; r < nr; r++) acc[r * ldc + c] += a[r * lda + k] * wk;
        }
}

#define DEFINE_Q_ACCUMULATE(NAME, FMT)                                                                 \
    static void accumulate_##NAME(const float *a, long lda, int nr, const qweights *w, int64_t e, int n0, \
                                  int K, int C, float *acc, int ldc) {                                 \
        accumulate_q(a, lda, nr, w, e, FMT, n0, K, C, acc, ldc);                                       \
    }
DEFINE_Q_ACCUMULATE(fp8, QFMT_FP8)
DEFINE_Q_ACCUMULATE(mxfp8, QFMT_MXFP8)
DEFINE_Q_ACCUMULATE(mxfp4, QFMT_MXFP4)

typedef void (*q_accumulate)(const float *, long, int, const qweights *, int64_t, int, int, int, float *, int);

static q_accumulate accumulate_for(int fmt) {
    return fmt == QFMT_FP8 ? accumulate_fp8 : fmt == QFMT_MXFP8 ? accumulate_mxfp8 : accumulate_mxfp4;
}

static void gate_up_q(const float *x, const qweights *gate_up, int fmt, const int64_t *offsets, int E, int H, int I,
                      float *h, int threads) {
    q_accumulate accumulate = accumulate_for(fmt);
    int blocks = (I + CB - 1) / CB;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (long item = 0; item < (long)E * blocks; item++) {
        int e = item / blocks, j0 = (item % blocks) * CB, C = I - j0 < CB ? I - j0 : CB;
        float gate[RB * CB] __attribute__((aligned(64))), up[RB * CB] __attribute__((aligned(64)));
        for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += RB) {
            int nr = offsets[e + 1] - p0 < RB ? offsets[e + 1] - p0 : RB;
            memset(gate, 0, sizeof gate);
            memset(up, 0, sizeof up);
            accumulate(x + p0 * H, H, nr, gate_up, e, j0, H, C, gate, CB);
            accumulate(x + p0 * H, H, nr, gate_up, e, I + j0, H, C, up, CB);
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < C; c++) h[(p0 + r) * I + j0 + c] = silu(gate[r * CB + c]) * up[r * CB + c];
        }
    }
}

static void down_q(const float *h, const qweights *down, int fmt, const int64_t *offsets, int E, int I, int H, float *y,
                   int threads) {
    q_accumulate accumulate = accumulate_for(fmt);
    int blocks = (H + CB - 1) / CB;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (long item = 0; item < (long)E * blocks; item++) {
        int e = item / blocks, n0 = (item % blocks) * CB, C = H - n0 < CB ? H - n0 : CB;
        float acc[RB * CB] __attribute__((aligned(64)));
        for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += RB) {
            int nr = offsets[e + 1] - p0 < RB ? offsets[e + 1] - p0 : RB;
            memset(acc, 0, sizeof acc);
            accumulate(h + p0 * I, I, nr, down, e, n0, I, C, acc, CB);
            for (int r = 0; r < nr; r++) memcpy(y + (p0 + r) * H + n0, acc + r * CB, C * sizeof(float));
        }
    }
}

/* locus_moe_run_{f32,bf16} with quantized expert weights (fmt: QFMT_*); x and out keep x's dtype. */
#define DEFINE_RUN_Q(SUF, WT)                                                                        \
    void locus_moe_run_q_##SUF(const WT *x, const float *weights, int T, int K, int weight_on_input, \
                               const qweights *gate_up, const qweights *down, int fmt, int E, int H, int I, \
                               int64_t *iwork, float *fwork, WT *out, int threads) {                 \
        float *rows = fwork;                                                                         \
        int64_t held = gather_##SUF(x, weights, T, K, weight_on_input, E, H, iwork, rows, threads);  \
        float *h = rows + held * H, *y = h + held * I;                                               \
        gate_up_q(rows, gate_up, fmt, iwork, E, H, I, h, threads);                                   \
        down_q(h, down, fmt, iwork, E, I, H, y, threads);                                            \
        sum_slots_##SUF(y, weights, T, K, weight_on_input, E, H, iwork, out, threads);               \
    }

DEFINE_RUN_Q(f32, float)
DEFINE_RUN_Q(bf16, uint16_t)
