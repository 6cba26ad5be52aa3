/* 16 floats as one GCC/Clang vector (one zmm in an AVX-512 clone, two ymm in an AVX2 one),
 * shared by decode.c and prefill.c: loads and stores, and e^x in 16 lanes (and in 8). */
#ifndef SPLITSERVE_VEC16_H
#define SPLITSERVE_VEC16_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

#define VEC16_INLINE static inline __attribute__((always_inline))

VEC16_INLINE v16 load16(const float *p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

VEC16_INLINE void store16(float *p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

/* 8 floats (one ymm): the 16-float code's halves where a CPU has no AVX-512. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

VEC16_INLINE v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* e^x for x <= 0 in 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7
 * polynomial in r, times 2^n; within 2 ulp of expf). The softmax took a scalar expf per cached
 * token and query head: a quarter of the attention of a batch-32 SmolLM2 step. exp8: the same
 * in 8 lanes (each lane's operations the same, so the same bits), for CPUs without AVX-512,
 * where GCC runs 16-float vectors as ymm pairs and moves some through the stack. */
#define VEC_EXP(NAME, V, VI)                                                            \
    VEC16_INLINE V NAME(V x) {                                                          \
        const V lo = (V){0} - 87.3f;                                                    \
        VI below = x < lo; /* all ones where x < lo */                                  \
        x = (V)(((VI)x & ~below) | ((VI)lo & below));                                   \
        VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI); /* round */ \
        V nf = __builtin_convertvector(n, V);                                           \
        V r = x - nf * 0.693359375f;                                                    \
        r = r - nf * -2.12194440e-4f;                                                   \
        V p = 1.9875691500e-4f * r + 1.3981999507e-3f;                                  \
        p = p * r + 8.3334519073e-3f;                                                   \
        p = p * r + 4.1665795894e-2f;                                                   \
        p = p * r + 1.6666665459e-1f;                                                   \
        p = p * r + 5.0000001201e-1f;                                                   \
        p = p * (r * r) + r + 1.0f;                                                     \
        VI scale = (n + 127) << 23;                                                     \
        V two_n;                                                                        \
        __builtin_memcpy(&two_n, &scale, sizeof two_n);                                 \
        return p * two_n;                                                               \
    }

VEC_EXP(exp16, v16, vi16)
VEC_EXP(exp8, v8, vi8)
#endif
