/* The AVX2 path of blocks.c's products (AVX2 + FMA + F16C, chosen at run time).
 *
 * A pass takes one output and up to 8 rows of x; each 32-value part of a block is dequantized
 * into four ymm of 8 weights with the scalar code's float32 operations (bit-identical weights),
 * once per pass, then FMAs into each row's accumulators. The K-quants' scales are formed once
 * per 256-value block (k_scales, blocks.h). */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE AVX2 static inline __attribute__((always_inline))

/* 16 bytes of nibbles -> 32 ints: the low halves (values 0-15), then the high ones (16-31). */
INLINE void nibbles(const uint8_t *qs, __m256i v[4]) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    v[0] = _mm256_cvtepu8_epi32(lo);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    v[2] = _mm256_cvtepu8_epi32(hi);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

/* 32 bytes at q -> 32 ints: (byte >> shift) & mask. */
INLINE void bytes_bits(const uint8_t *q, int shift, int mask, __m256i v[4]) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)q);
    raw = _mm256_and_si256(_mm256_srli_epi16(raw, shift), _mm256_set1_epi8((char)mask));
    __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
    v[0] = _mm256_cvtepu8_epi32(lo);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    v[2] = _mm256_cvtepu8_epi32(hi);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

INLINE __m256 tofloat(__m256i q) { return _mm256_cvtepi32_ps(q); }

/* Part p of block b (values [32 p, 32 p + 32); p = 0 for the 32-value types) -> v. s: the
 * block's K-quant scales. */
INLINE void dequant_avx2(int qtype, const uint8_t *b, int p, const kscales *s, __m256 v[4]) {
    __m256i q[4];
    if (qtype == Q4_K) {
        __m256 d = _mm256_set1_ps(s->d[p]), m = _mm256_set1_ps(s->m[p]);
        bytes_bits(b + 16 + 32 * (p / 2), 4 * (p % 2), 15, q);
        for (int i = 0; i < 4; i++) v[i] = _mm256_sub_ps(_mm256_mul_ps(d, tofloat(q[i])), m);
        return;
    }
    if (qtype == Q6_K) {
        int h = p / 4, sh = p % 4;
        __m256i hi[4], off = _mm256_set1_epi32(32);
        bytes_bits(b + 64 * h + 32 * (sh & 1), 4 * (sh >> 1), 15, q);
        bytes_bits(b + 128 + 32 * h, 2 * sh, 3, hi);
        for (int i = 0; i < 4; i++) {
            __m256i w = _mm256_sub_epi32(_mm256_or_si256(q[i], _mm256_slli_epi32(hi[i], 4)), off);
            v[i] = _mm256_mul_ps(_mm256_set1_ps(s->d[2 * p + i / 2]), tofloat(w));
        }
        return;
    }
    __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)b));
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i raw = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
            v[i] = _mm256_mul_ps(tofloat(_mm256_cvtepi8_epi32(raw)), d);
        }
    } else if (qtype == Q5_0) {
        uint32_t qh;
        __builtin_memcpy(&qh, b + 2, 4);
        nibbles(b + 6, q);
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i sixteen = _mm256_set1_epi32(16);
        for (int i = 0; i < 4; i++) {
            /* bit 8 i + lane of qh, moved to bit 4 */
            __m256i bits = _mm256_set1_epi32((int)(((qh >> (8 * i)) & 0xff) << 4));
            __m256i high = _mm256_and_si256(_mm256_srlv_epi32(bits, lanes), sixteen);
            __m256i w = _mm256_sub_epi32(_mm256_or_si256(q[i], high), sixteen);
            v[i] = _mm256_mul_ps(d, tofloat(w));
        }
    } else if (qtype == Q4_1) {
        __m256 m = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(b + 2)));
        nibbles(b + 4, q);
        for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(tofloat(q[i]), d), m);
    } else {
        const __m256i eight = _mm256_set1_epi32(8);
        nibbles(b + 2, q);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(tofloat(_mm256_sub_epi32(q[i], eight)), d);
    }
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Outputs [n0, n1) for rows [m0, m0 + MT) of x; MT is a constant after inlining. Each row
 * keeps A accumulators (4 for one or two rows, 2 for up to four) so that the FMAs of a block
 * are not one dependency chain: with a single accumulator a one-row step waited on FMA
 * latency (257 against 292 us for SmolLM2's gate|up at one row, one thread). */
INLINE void tile_avx2(int qtype, const float *x, int64_t m0, const int MT, int64_t K,
                      const uint8_t *w, int64_t n0, int64_t n1, float *out, int64_t N) {
    const int values = block_values(qtype), parts = values / QK;
    int64_t nb = K / values, bytes = block_bytes(qtype);
    const int A = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[8][4];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
        const uint8_t *row = w + n * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            kscales s;
            if (parts > 1) k_scales(qtype, blk, &s);
#pragma GCC unroll 8
            for (int p = 0; p < parts; p++) {
                __m256 v[4];
                dequant_avx2(qtype, blk, p, &s, v);
                for (int r = 0; r < MT; r++) {
                    const float *xr = x + (m0 + r) * K + b * values + QK * p;
                    for (int i = 0; i < 4; i++)
                        acc[r][i % A] =
                            _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
                }
            }
        }
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < A; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
            out[(m0 + r) * N + n] = hsum(acc[r][0]);
        }
    }
}

#define TILES(Q)                                                                    \
    AVX2 static void tiles_##Q(const float *x, int64_t M, int64_t K, const uint8_t *w, \
                               int64_t n0, int64_t n1, float *out, int64_t N) {     \
        int64_t m = 0;                                                              \
        for (; m + 8 <= M; m += 8) tile_avx2(Q, x, m, 8, K, w, n0, n1, out, N);     \
        switch (M - m) {                                                            \
        case 7: tile_avx2(Q, x, m, 7, K, w, n0, n1, out, N); break;                 \
        case 6: tile_avx2(Q, x, m, 6, K, w, n0, n1, out, N); break;                 \
        case 5: tile_avx2(Q, x, m, 5, K, w, n0, n1, out, N); break;                 \
        case 4: tile_avx2(Q, x, m, 4, K, w, n0, n1, out, N); break;                 \
        case 3: tile_avx2(Q, x, m, 3, K, w, n0, n1, out, N); break;                 \
        case 2: tile_avx2(Q, x, m, 2, K, w, n0, n1, out, N); break;                 \
        case 1: tile_avx2(Q, x, m, 1, K, w, n0, n1, out, N); break;                 \
        default: break;                                                             \
        }                                                                           \
    }
TILES(Q4_0)
TILES(Q4_1)
TILES(Q5_0)
TILES(Q8_0)
TILES(Q4_K)
TILES(Q6_K)

void splitserve_avx2_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                           int64_t n0, int64_t n1, float *out, int64_t N) {
    switch (qtype) {
    case Q4_0: tiles_Q4_0(x, M, K, w, n0, n1, out, N); break;
    case Q4_1: tiles_Q4_1(x, M, K, w, n0, n1, out, N); break;
    case Q5_0: tiles_Q5_0(x, M, K, w, n0, n1, out, N); break;
    case Q8_0: tiles_Q8_0(x, M, K, w, n0, n1, out, N); break;
    case Q4_K: tiles_Q4_K(x, M, K, w, n0, n1, out, N); break;
    case Q6_K: tiles_Q6_K(x, M, K, w, n0, n1, out, N); break;
    default: break;
    }
}

#else /* not x86-64: splitserve_block_matmul never asks for AVX2 */
void splitserve_avx2_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                           int64_t n0, int64_t n1, float *out, int64_t N) {
    (void)qtype, (void)x, (void)M, (void)K, (void)w, (void)n0, (void)n1, (void)out, (void)N;
}
#endif
