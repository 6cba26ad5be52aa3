/* blocks_row16.c's one-row products on 16-bit activations for CPUs with AVX2 and no
 * AVX-512BW: the same rounded row (splitserve_round_row16) and the same exact integer sums, a
 * part of 32 weights as two halves of 16 widened to int16 and multiplied pairwise by vpmaddwd
 * into 8 int32 sums each. A 32-value part's two halves share its scale, so their sums are added
 * as integers and converted once; Q6_K's halves are its two groups of 16, each with its own. */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE AVX2 static inline __attribute__((always_inline))

/* 16 int8 (signed: s, else unsigned) times 16 int16 of x16 -> 8 int32 pair sums. */
INLINE __m256i half_dot(__m128i q, int s, const int16_t *x16) {
    __m256i w = s ? _mm256_cvtepi8_epi16(q) : _mm256_cvtepu8_epi16(q);
    return _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *)x16));
}

/* acc + (q . x16 over a part of 32) * scale. */
INLINE __m256 part(__m256i q, int s, const int16_t *x16, float scale, __m256 acc) {
    __m256i dot = _mm256_add_epi32(half_dot(_mm256_castsi256_si128(q), s, x16),
                                   half_dot(_mm256_extracti128_si256(q, 1), s, x16 + 16));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc);
}

/* The 32 5-bit quants of a Q5_0 block minus 16, as signed bytes: bit j of the block's high
 * bits spread to byte j (each byte of the broadcast word tested against its own bit). */
INLINE __m256i q5_0_quants(const uint8_t *b) {
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6)), low = _mm_set1_epi8(15);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    uint32_t qh;
    __builtin_memcpy(&qh, b + 2, 4);
    __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                         3, 3, 3, 3, 3, 3, 3));
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

INLINE float row_dot(int qtype, const uint8_t *row, int64_t nb, const int16_t *x16,
                     const float *sx, const float *sums) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float corr = 0.0f;
    if (qtype == Q8_0 || qtype == Q5_0) {
        const int bytes = qtype == Q8_0 ? 34 : 22;
        int64_t b = 0;
#define BLOCK(i, acc)                                                                           \
    do {                                                                                        \
        const uint8_t *blk = row + (b + i) * bytes;                                             \
        __m256i q = qtype == Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))             \
                                  : q5_0_quants(blk);                                           \
        acc = part(q, 1, x16 + (b + i) * QK, half_f16c(blk) * sx[b + i], acc);                       \
    } while (0)
        for (; b + 4 <= nb; b += 4) {
            BLOCK(0, a0);
            BLOCK(1, a1);
            BLOCK(2, a2);
            BLOCK(3, a3);
        }
        for (; b < nb; b++) BLOCK(0, a0);
#undef BLOCK
    } else if (qtype == Q4_K) {
        const __m256i low = _mm256_set1_epi8(15);
        __m256 mins = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 144;
            const int16_t *xb = x16 + b * QK_K;
            kscales s;
            k_scales_x86(Q4_K, blk, &s);
            __m256 sxb = _mm256_loadu_ps(sx + b * 8);
            float f[8];
            _mm256_storeu_ps(f, _mm256_mul_ps(_mm256_loadu_ps(s.d), sxb));
            mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s.m), sxb),
                                   _mm256_loadu_ps(sums + b * 8), mins);
            for (int p = 0; p < 8; p += 4) {
                __m256i q0 = _mm256_loadu_si256((const __m256i *)(blk + 16 + 16 * p));
                __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 48 + 16 * p));
                a0 = part(_mm256_and_si256(q0, low), 0, xb + QK * p, f[p], a0);
                a1 = part(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low), 0, xb + QK * (p + 1),
                          f[p + 1], a1);
                a2 = part(_mm256_and_si256(q1, low), 0, xb + QK * (p + 2), f[p + 2], a2);
                a3 = part(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low), 0, xb + QK * (p + 3),
                          f[p + 3], a3);
            }
        }
        __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
        h4 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        corr = _mm_cvtss_f32(_mm_add_ss(h4, _mm_movehdup_ps(h4)));
    } else { /* Q6_K: the halves are its groups 2 p and 2 p + 1, each with its own scale */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 210;
            const int16_t *xb = x16 + b * QK_K;
            float d = half_f16c(blk + 208);
            for (int p = 0; p < 8; p++) {
                float f = d * sx[b * 8 + p];
                __m256i q = q6_k_quants(blk, p);
                __m256 lo = _mm256_cvtepi32_ps(half_dot(_mm256_castsi256_si128(q), 1, xb + QK * p));
                __m256 hi =
                    _mm256_cvtepi32_ps(half_dot(_mm256_extracti128_si256(q, 1), 1, xb + QK * p + 16));
                __m256 *acc = p % 2 ? &a1 : &a0;
                *acc = _mm256_fmadd_ps(lo, _mm256_set1_ps(f * (float)(int8_t)blk[192 + 2 * p]), *acc);
                a2 = _mm256_fmadd_ps(hi, _mm256_set1_ps(f * (float)(int8_t)blk[193 + 2 * p]), a2);
            }
        }
    }
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) - corr;
}

AVX2 void splitserve_row16_avx2_range(int qtype, const int16_t *x16, const float *sx,
                                      const float *sums, int64_t K, const uint8_t *w, int64_t n0,
                                      int64_t n1, float *out) {
    int64_t nb = K / block_values(qtype), bytes = block_bytes(qtype);
    for (int64_t n = n0; n < n1; n++) out[n] = row_dot(qtype, w + n * nb * bytes, nb, x16, sx, sums);
}

#else
void splitserve_row16_avx2_range(int qtype, const int16_t *x16, const float *sx,
                                 const float *sums, int64_t K, const uint8_t *w, int64_t n0,
                                 int64_t n1, float *out) {
    (void)qtype, (void)x16, (void)sx, (void)sums, (void)K, (void)w, (void)n0, (void)n1, (void)out;
}
#endif
