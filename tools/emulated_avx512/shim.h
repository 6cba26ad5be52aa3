/* For tools/emulated_avx512/run.sh only: SIMDe's portable AVX-512 intrinsics (libsimde-dev,
 * 0.7.4) under their Intel names, plus the few the AVX-512 block products use that it lacks,
 * written here lane by lane. Never part of the package's build. */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <string.h>
#include "blocks.h"
typedef simde__mmask16 __mmask16;
static inline float _cvtsh_ss(unsigned short h) { return half_to_float(h); }
static inline __m512i _mm512_cvtepu8_epi32(__m128i a) {
    uint8_t b[16]; int32_t o[16]; memcpy(b, &a, 16);
    for (int i = 0; i < 16; i++) o[i] = b[i];
    return _mm512_loadu_si512(o);
}
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) {
    int8_t b[16]; int32_t o[16]; memcpy(b, &a, 16);
    for (int i = 0; i < 16; i++) o[i] = b[i];
    return _mm512_loadu_si512(o);
}
static inline __m512 _mm512_cvtepi32_ps(__m512i a) {
    int32_t b[16]; float o[16]; _mm512_storeu_si512(b, a);
    for (int i = 0; i < 16; i++) o[i] = (float)b[i];
    return _mm512_loadu_ps(o);
}
static inline float _mm512_reduce_add_ps(__m512 a) {
    float b[16]; _mm512_storeu_ps(b, a);
    for (int w = 8; w; w /= 2) for (int i = 0; i < w; i++) b[i] += b[i + w];
    return b[0];
}
static inline __m512 _mm512_cvtph_ps(__m256i a) {
    uint16_t b[16]; float o[16]; memcpy(b, &a, 32);
    for (int i = 0; i < 16; i++) o[i] = half_to_float(b[i]);
    return _mm512_loadu_ps(o);
}
static inline void _mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 a) {
    float b[16]; _mm512_storeu_ps(b, a);
    for (int i = 0; i < 16; i++) if (k >> i & 1) ((float *)p)[i] = b[i];
}
static inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void *p) {
    float o[16];
    for (int i = 0; i < 16; i++) o[i] = k >> i & 1 ? ((const float *)p)[i] : 0.0f;
    return _mm512_loadu_ps(o);
}
