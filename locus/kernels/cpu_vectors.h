/* Vectors and loads shared by our C kernels (moe_cpu.c, argmax_cpu.c): GCC/Clang vector extensions,
 * so -march=native picks the ISA (one AVX-512 register per vector here; narrower ISAs split it).
 * float32 and bfloat16 data are both read as float32: bfloat16 is the top half of a float32.
 * c_library.py hashes this header into each library's name, so a change here rebuilds them. */
#ifndef LOCUS_CPU_VECTORS_H
#define LOCUS_CPU_VECTORS_H

#include <stdint.h>
#include <string.h>

#define VW 16 /* floats per vector */

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

static inline vf load_vec_f32(const float *p) { return *(const vf *)p; }
static inline vf load_vec_bf16(const uint16_t *p) {
    vu u = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float load_one_f32(const float *p) { return *p; }
static inline float load_one_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
