/* The expert-parallel payload codec on CPU (mx_rows_cpu.py): rows of H values <-> rows of H one-byte
 * MX elements followed by their ceil(H/32) E8M0 scale bytes (locus/engine/ep/payload.py), one pass
 * per row instead of torch's chain of ~20 ops. Bit-exact with the torch path (formats.py
 * `quantize` / `dequantize`, then `.to(dtype)`):
 *   encode: per block of 32 (the last may be short) amax in float32; a NaN or Inf in the block: scale
 *           0xFF, elements 0; amax 0 or a float32 subnormal: shared exponent -127; else
 *           floor(log2 amax) - emax (emax 8 for E4M3, 0 for INT8), at most 127. Each value times
 *           2^-shared in float32 (what torch.ldexp computes), clamped to +-max_normal, then rounded
 *           to nearest-even: E4M3 as c10's fp8e4m3fn_from_fp32_value, INT8 as round(v * 64).
 *   decode: element value (E4M3 exactly, its NaN codes NaN; INT8 * 2^-6) times the scale 2^(b-127)
 *           (b 0: the float32 subnormal 2^-127; 0xFF: NaN) in float32, then RNE to the dtype
 *           (bfloat16 RNE, a NaN as this torch's float32 -> bfloat16 conversion writes it; float16 as c10's fp16_ieee_from_fp32_value).
 * dtype codes: 0 float32, 1 bfloat16, 2 float16. format codes: 0 mxfp8 (E4M3), 1 mxint8.
 * Single-threaded: the rows of one exchange are few (tens), and ranks share the cores.
 */
#include <stdint.h>
#include <string.h>

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

static float E4M3_VALUE[256];

__attribute__((constructor)) static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 0xF, m = b & 7;
        /* exact: (8 + m) * 2^(e - 10), subnormals m * 2^-9 */
        float v = e == 0 ? (float)m / 512.0f : bits_f((uint32_t)(e - 7 + 127) << 23) * (1.0f + (float)m / 8.0f);
        if ((b & 0x7F) == 0x7F) v = bits_f(0x7FC00000u);
        E4M3_VALUE[b] = (b & 0x80) && (b & 0x7F) != 0x7F ? -v : v;
    }
}

/* c10::detail::fp16_ieee_to_fp32_value */
static inline float half_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f(sign | (two_w < (1u << 27) ? f_bits(denormalized) : f_bits(normalized)));
}

/* c10::detail::fp16_ieee_from_fp32_value */
static inline uint16_t float_to_half(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16 rounded to nearest-even; a NaN becomes `nan`, what this torch's conversion
 * writes (0xFFFF from its AVX2 / AVX-512 cvtfp32_bf16, 0x7FC0 from c10's scalar round_to_nearest_even) */
static inline uint16_t float_to_bf16(float f, uint16_t nan) {
    if (f != f) return nan;
    const uint32_t u = f_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* c10::detail::fp8e4m3fn_from_fp32_value for |f| <= 448 */
static inline uint8_t float_to_e4m3(float f) {
    uint32_t u = f_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u < (121u << 23)) { /* below 2^-6: E4M3 subnormal, rounded by the float add */
        const uint32_t denorm_mask = 141u << 23;
        r = (uint8_t)(f_bits(bits_f(u) + bits_f(denorm_mask)) - denorm_mask);
    } else {
        const uint32_t mant_odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + mant_odd;
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

static inline float load(const void *x, int dtype, int64_t i) {
    if (dtype == 1) return bits_f((uint32_t)((const uint16_t *)x)[i] << 16);
    if (dtype == 2) return half_to_float(((const uint16_t *)x)[i]);
    return ((const float *)x)[i];
}

static inline void store(void *y, int dtype, int64_t i, float v, uint16_t bf16_nan) {
    if (dtype == 1) ((uint16_t *)y)[i] = float_to_bf16(v, bf16_nan);
    else if (dtype == 2) ((uint16_t *)y)[i] = float_to_half(v);
    else ((float *)y)[i] = v;
}

/* 2^e as float32, e in [-127, 127] (-127: a subnormal) */
static inline float pow2(int e) { return e == -127 ? bits_f(0x00400000u) : bits_f((uint32_t)(e + 127) << 23); }

/* x: [N, H] contiguous in dtype -> out: [N, H + ceil(H/32)] contiguous bytes */
void locus_mx_encode_rows(const void *x, int64_t N, int64_t H, int dtype, int format, uint8_t *out) {
    const int64_t nb = (H + 31) / 32, row_bytes = H + nb;
    const int emax = format == 0 ? 8 : 0;
    const float max_normal = format == 0 ? 448.0f : 127.0f / 64.0f;
    float v[32];
    for (int64_t r = 0; r < N; r++) {
        uint8_t *elements = out + r * row_bytes, *scales = elements + H;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = b * 32, n = H - start < 32 ? H - start : 32;
            uint32_t amax = 0; /* bits of |v| (ordered as the values are); >= 0x7F800000: NaN or Inf */
            for (int64_t j = 0; j < n; j++) {
                v[j] = load(x, dtype, r * H + start + j);
                const uint32_t a = f_bits(v[j]) & 0x7FFFFFFFu;
                amax = a > amax ? a : amax;
            }
            uint8_t *e = elements + start;
            if (amax >= 0x7F800000u) {
                scales[b] = 0xFF;
                memset(e, 0, (size_t)n);
                continue;
            }
            /* floor(log2 amax) - emax; zero and float32-subnormal amax (floor(log2) <= -127) clamp to -127 */
            int shared = (int)(amax >> 23) == 0 ? -127 : (int)(amax >> 23) - 127 - emax;
            if (shared < -127) shared = -127;
            scales[b] = (uint8_t)(shared + 127);
            const float factor = pow2(-shared);
            for (int64_t j = 0; j < n; j++) {
                float s = v[j] * factor;
                s = s < -max_normal ? -max_normal : (s > max_normal ? max_normal : s);
                if (format == 0) e[j] = float_to_e4m3(s);
                else e[j] = (uint8_t)(int8_t)__builtin_nearbyintf(s * 64.0f);
            }
        }
    }
}

/* rows: N rows of H element bytes then ceil(H/32) scale bytes, row i at rows + i * stride ->
 * y: [N, H] contiguous in dtype (a bfloat16 NaN written as bf16_nan) */
void locus_mx_decode_rows(const uint8_t *rows, int64_t N, int64_t H, int64_t stride, int dtype, int format,
                          int bf16_nan, void *y) {
    const int64_t nb = (H + 31) / 32;
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *elements = rows + r * stride, *scales = elements + H;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = b * 32, n = H - start < 32 ? H - start : 32;
            const uint8_t sb = scales[b];
            const float scale = sb == 0xFF ? bits_f(0x7FC00000u) : pow2((int)sb - 127);
            const uint8_t *e = elements + start;
            const int64_t at = r * H + start;
            if (format == 0)
                for (int64_t j = 0; j < n; j++) store(y, dtype, at + j, E4M3_VALUE[e[j]] * scale, bf16_nan);
            else
                for (int64_t j = 0; j < n; j++) store(y, dtype, at + j, ((float)(int8_t)e[j] * 0x1.0p-6f) * scale, bf16_nan);
        }
    }
}
