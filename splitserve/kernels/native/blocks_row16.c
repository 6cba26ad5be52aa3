/* One-row products on 16-bit activations (AVX-512BW): a decode step of one sequence.
 *
 * A one-row product cannot share a block's dequantization between rows, and in float32 the
 * conversions, tables and scales of each 32 weights cost more than the bytes take to arrive:
 * Gemma 3 270M's Q5_0, Q4_K and Q6_K projections ran at 6-8 GB/s of one core with the weights
 * in cache. Here the row x is rounded once per call to int16 in blocks of 32 values, each
 * with its own scale, the power of two sx = 2^(e - 15) where 2^(e - 1) <= max |x| < 2^e
 * (x = sx * x16 to within sx / 2, at most 2^-15 of the block's largest value; llama.cpp
 * rounds activations to 8 bits the same way), and a part of
 * 32 weights is its integer quants q widened to int16 and multiplied pairwise into 16 int32
 * sums by one vpmaddwd: exact (|q x16| <= 128 * 32767), converted to float32 (exact below
 * 2^24) and scaled by the weights' and the row's scales once:
 *   Q8_0  d sx sum(q x16)                          q int8
 *   Q5_0  d sx sum((q - 16) x16)                   q 0..31
 *   Q4_K  d[p] sx sum(q x16) - m[p] sx sum(x16)    q 0..15, per part p of 32
 *   Q6_K  d[i] sx sum((q - 32) x16)                q 0..63, per group i of 16
 * The weights are the file's integers and scales, exactly as gguf dequantizes them; only the
 * activations are rounded. As sx is a power of two, a value of x that its int16 holds exactly
 * (a one-hot row) gives the dequantized weight bit for bit. blocks.c takes this path for one row of these types where the CPU
 * has AVX-512BW.
 */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>

#define BW __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define INLINE BW static inline __attribute__((always_inline))

int splitserve_has_avx512bw(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* x [K] -> x16 [K], sx [K / 32] (the scale of each block of 32), sums [K / 32] (sum of x16). */
void splitserve_round_row16(const float *x, int64_t K, int16_t *x16, float *sx, float *sums) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        int e = 0;
        frexpf(amax, &e); /* amax < 2^e */
        int32_t total = 0;
        for (int j = 0; j < QK; j++) {
            int32_t v = amax > 0.0f ? (int32_t)lrintf(ldexpf(xb[j], 15 - e)) : 0;
            v = v > 32767 ? 32767 : v < -32767 ? -32767 : v;
            x16[b * QK + j] = (int16_t)v;
            total += v;
        }
        sx[b] = ldexpf(1.0f, e - 15);
        sums[b] = (float)total;
    }
}

/* 32 signed bytes (widened) times the 32 int16 of x16 -> 16 pair sums, as float32. */
INLINE __m512 dot_s8(__m256i q, const int16_t *x16) {
    __m512i p = _mm512_madd_epi16(_mm512_cvtepi8_epi16(q), _mm512_loadu_si512(x16));
    return _mm512_cvtepi32_ps(p);
}

/* The 32 5-bit quants of a Q5_0 block minus 16, as signed bytes. */
INLINE __m256i q5_0_quants(const uint8_t *b) {
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6)), low = _mm_set1_epi8(15);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    uint32_t qh;
    __builtin_memcpy(&qh, b + 2, 4);
    q = _mm256_mask_add_epi8(q, (__mmask32)qh, q, _mm256_set1_epi8(16));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

/* acc + dot(q, x16 of the part) * scale: one part of 32 weights. */
INLINE __m512 part_s8(__m256i q, const int16_t *x16, __m512 scale, __m512 acc) {
    return _mm512_fmadd_ps(dot_s8(q, x16), scale, acc);
}

INLINE __m512 part_u8(__m256i q, const int16_t *x16, float scale, __m512 acc) {
    __m512i dot = _mm512_madd_epi16(_mm512_cvtepu8_epi16(q), _mm512_loadu_si512(x16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale), acc);
}

/* A 32-value block (Q8_0, Q5_0) b of a row into acc. */
INLINE __m512 block32(int qtype, const uint8_t *row, int64_t b, const int16_t *x16,
                      const float *sx, __m512 acc) {
    const uint8_t *blk = row + b * (qtype == Q8_0 ? 34 : 22);
    __m256i q = qtype == Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : q5_0_quants(blk);
    return part_s8(q, x16 + b * QK, _mm512_set1_ps(half_f16c(blk) * sx[b]), acc);
}

/* Q6_K part p of block blk into acc, whose x16 part starts at x16 and has scale sx. */
INLINE __m512 q6_k_part(const uint8_t *blk, int p, float f, const int16_t *x16, __m512 acc) {
    /* lanes 0-7 hold values 0-15 of the part (group 2 p), lanes 8-15 the rest (2 p + 1) */
    __m512d lo = _mm512_castps_pd(_mm512_set1_ps(f * (float)(int8_t)blk[192 + 2 * p]));
    __m256d hi = _mm256_castps_pd(_mm256_set1_ps(f * (float)(int8_t)blk[193 + 2 * p]));
    __m512 scale = _mm512_castpd_ps(_mm512_insertf64x4(lo, hi, 1));
    return part_s8(q6_k_quants(blk, p), x16, scale, acc);
}

/* Output n's sum over the row. Four accumulators take alternate blocks (or parts), each a
 * named register: with an index computed per block they lived on the stack. corr: Q4_K's sum
 * of m[p] sx sum(x16). */
INLINE float row_dot(int qtype, const uint8_t *row, int64_t nb, const int16_t *x16,
                     const float *sx, const float *sums) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float corr = 0.0f;
    if (qtype == Q8_0 || qtype == Q5_0) {
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            a0 = block32(qtype, row, b, x16, sx, a0);
            a1 = block32(qtype, row, b + 1, x16, sx, a1);
            a2 = block32(qtype, row, b + 2, x16, sx, a2);
            a3 = block32(qtype, row, b + 3, x16, sx, a3);
        }
        for (; b < nb; b++) a0 = block32(qtype, row, b, x16, sx, a0);
    } else if (qtype == Q4_K) {
        const __m256i low = _mm256_set1_epi8(15);
        __m256 mins = _mm256_setzero_ps(); /* sum of m[p] sx sum(x16), 8 parts a lane */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 144;
            const int16_t *xb = x16 + b * QK_K;
            kscales s;
            k_scales_x86(Q4_K, blk, &s);
            __m256 sxb = _mm256_loadu_ps(sx + b * 8);
            float f[8]; /* d[p] sx of each part */
            _mm256_storeu_ps(f, _mm256_mul_ps(_mm256_loadu_ps(s.d), sxb));
            mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s.m), sxb),
                                   _mm256_loadu_ps(sums + b * 8), mins);
            for (int p = 0; p < 8; p += 4) {
                __m256i q0 = _mm256_loadu_si256((const __m256i *)(blk + 16 + 16 * p));
                __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 48 + 16 * p));
                a0 = part_u8(_mm256_and_si256(q0, low), xb + QK * p, f[p], a0);
                a1 = part_u8(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low), xb + QK * (p + 1),
                             f[p + 1], a1);
                a2 = part_u8(_mm256_and_si256(q1, low), xb + QK * (p + 2), f[p + 2], a2);
                a3 = part_u8(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low), xb + QK * (p + 3),
                             f[p + 3], a3);
            }
        }
        __m128 half4 = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
        half4 = _mm_add_ps(half4, _mm_movehl_ps(half4, half4));
        corr = _mm_cvtss_f32(_mm_add_ss(half4, _mm_movehdup_ps(half4)));
    } else { /* Q6_K */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 210;
            const int16_t *xb = x16 + b * QK_K;
            const float *sxb = sx + b * 8;
            float d = half_f16c(blk + 208);
            for (int p = 0; p < 8; p += 4) {
                a0 = q6_k_part(blk, p, d * sxb[p], xb + QK * p, a0);
                a1 = q6_k_part(blk, p + 1, d * sxb[p + 1], xb + QK * (p + 1), a1);
                a2 = q6_k_part(blk, p + 2, d * sxb[p + 2], xb + QK * (p + 2), a2);
                a3 = q6_k_part(blk, p + 3, d * sxb[p + 3], xb + QK * (p + 3), a3);
            }
        }
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    return _mm512_reduce_add_ps(sum) - corr;
}

/* Outputs [n0, n1) of out[N] = x @ w.T for the row x rounded by splitserve_round_row16. */
BW void splitserve_row16_range(int qtype, const int16_t *x16, const float *sx, const float *sums,
                               int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *out) {
    int64_t nb = K / block_values(qtype), bytes = block_bytes(qtype);
    for (int64_t n = n0; n < n1; n++) out[n] = row_dot(qtype, w + n * nb * bytes, nb, x16, sx, sums);
}

#else
int splitserve_has_avx512bw(void) { return 0; }
void splitserve_round_row16(const float *x, int64_t K, int16_t *x16, float *sx, float *sums) {
    (void)x, (void)K, (void)x16, (void)sx, (void)sums;
}
void splitserve_row16_range(int qtype, const int16_t *x16, const float *sx, const float *sums,
                            int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *out) {
    (void)qtype, (void)x16, (void)sx, (void)sums, (void)K, (void)w, (void)n0, (void)n1, (void)out;
}
#endif
