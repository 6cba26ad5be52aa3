/* The AVX2 path of blocks.c's products (AVX2 + FMA + F16C, chosen at run time).
 *
 * A pass takes one output and up to 8 rows of x; each block is dequantized 8 weights at a time
 * (one ymm), once per pass, and each ymm goes into FMAs with every row's x at once. On the
 * 2-core AMD EPYC (Zen 2) VM the one-row products were bound by the vector pipes, so the
 * dequantization is as few operations as gguf's values allow:
 * - the quants are widened straight from memory, 8 bytes to 8 int32 lanes (a load and one
 *   shuffle; widening from a register took two more shuffles per 16 weights and was the
 *   bottleneck: Q4_1 at one row 5.4 -> 9.3 weights/ns with the FMA below);
 * - where gguf multiplies and then adds (q * d + m, d[p] * q - m[p]) the product is exact in
 *   float32 (an fp16 or fp16-times-6-bit scale times a 4- to 6-bit integer has at most 24
 *   significant bits), so one FMA gives the very float32 that the two operations give;
 *   likewise (q - 8) * d, (q - 16) * d and (q - 32) * d as q * d plus an exact constant.
 *   Only the sign of a zero weight can differ, which no sum shows (the accumulators start at
 *   +0). The lookups (splitserve_dequant_rows) run the scalar code.
 * The K-quants' scales are formed once per 256-value block. */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE AVX2 static inline __attribute__((always_inline))
#define ACC 8 /* accumulators a row may keep */

INLINE __m256i widen_u8(const uint8_t *q) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
}

INLINE __m256 tofloat(__m256i q) { return _mm256_cvtepi32_ps(q); }

/* FMAs of 8 weights v, inputs [at, at + 8) of the pass's block, with rows [0, MT) of x (xb:
 * row 0 at the block's first input, rows K apart) into each row's accumulator a (mod A). */
INLINE void fma8(__m256 v, const float *xb, int64_t K, const int MT, int at, const int A,
                 int a, __m256 acc[][ACC]) {
    for (int r = 0; r < MT; r++)
        acc[r][a % A] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xb + r * K + at), acc[r][a % A]);
}

/* A 32-value block of nibbles (Q4_0, Q4_1, Q5_0; qs: its 16 bytes) -> FMAs. */
INLINE void block_nibbles(int qtype, const uint8_t *b, const float *xb, int64_t K, const int MT,
                          const int A, __m256 acc[][ACC]) {
    const __m256i low = _mm256_set1_epi32(15);
    const uint8_t *qs = b + (qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 2);
    __m256i r0 = widen_u8(qs), r1 = widen_u8(qs + 8), q[4];
    q[0] = _mm256_and_si256(r0, low), q[1] = _mm256_and_si256(r1, low);
    q[2] = _mm256_srli_epi32(r0, 4), q[3] = _mm256_srli_epi32(r1, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int *)b)); /* d, and m for Q4_1 */
    __m256 d = _mm256_broadcastss_ps(f), add[4];
    if (qtype == Q4_1) {
        add[0] = add[1] = add[2] = add[3] = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
    } else if (qtype == Q4_0) {
        add[0] = add[1] = add[2] = add[3] = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    } else { /* Q5_0: -16 d where weight j's high bit (bit j of the uint32 after d) is 0 */
        uint32_t qh;
        __builtin_memcpy(&qh, b + 2, 4);
        __m256 off = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
        __m256i bits = _mm256_set1_epi32((int)qh);
        __m256i one = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int i = 0; i < 4; i++) {
            __m256i m = _mm256_slli_epi32(one, 8 * i);
            __m256i unset = _mm256_cmpeq_epi32(_mm256_and_si256(bits, m), _mm256_setzero_si256());
            add[i] = _mm256_and_ps(_mm256_castsi256_ps(unset), off);
        }
    }
    for (int i = 0; i < 4; i++)
        fma8(_mm256_fmadd_ps(tofloat(q[i]), d, add[i]), xb, K, MT, 8 * i, A, i, acc);
}

INLINE void block_q8_0(const uint8_t *b, const float *xb, int64_t K, const int MT, const int A,
                       __m256 acc[][ACC]) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)b));
    for (int i = 0; i < 4; i++) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
        fma8(_mm256_mul_ps(tofloat(_mm256_cvtepi8_epi32(raw)), d), xb, K, MT, 8 * i, A, i, acc);
    }
}

/* A Q4_K block: parts 2 c and 2 c + 1 share bytes [32 c, 32 c + 32) of the quants (low and
 * high nibbles), widened once for both. */
INLINE void block_q4_k(const uint8_t *b, const float *xb, int64_t K, const int MT, const int A,
                       __m256 acc[][ACC]) {
    kscales s;
    k_scales_x86(Q4_K, b, &s);
    const __m256i low = _mm256_set1_epi32(15);
    for (int c = 0; c < 4; c++) {
        __m256 d0 = _mm256_set1_ps(s.d[2 * c]), m0 = _mm256_set1_ps(-s.m[2 * c]);
        __m256 d1 = _mm256_set1_ps(s.d[2 * c + 1]), m1 = _mm256_set1_ps(-s.m[2 * c + 1]);
        for (int i = 0; i < 4; i++) {
            __m256i r = widen_u8(b + 16 + 32 * c + 8 * i);
            __m256 v0 = _mm256_fmadd_ps(d0, tofloat(_mm256_and_si256(r, low)), m0);
            __m256 v1 = _mm256_fmadd_ps(d1, tofloat(_mm256_srli_epi32(r, 4)), m1);
            fma8(v0, xb, K, MT, 64 * c + 8 * i, A, i, acc);
            fma8(v1, xb, K, MT, 64 * c + 32 + 8 * i, A, 4 + i, acc);
        }
    }
}

/* A Q6_K block: for each half h and 8 positions i, the low-nibble bytes of rows s = 0, 1 (and
 * their high nibbles for s = 2, 3) and the 2-bit high bytes of all four, widened once. */
INLINE void block_q6_k(const uint8_t *b, const float *xb, int64_t K, const int MT, const int A,
                       __m256 acc[][ACC]) {
    kscales s;
    k_scales_x86(Q6_K, b, &s);
    const __m256i low = _mm256_set1_epi32(15), top = _mm256_set1_epi32(48);
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < 4; i++) {
            __m256i l0 = widen_u8(b + 64 * h + 8 * i), l1 = widen_u8(b + 64 * h + 32 + 8 * i);
            __m256i hi = widen_u8(b + 128 + 32 * h + 8 * i), q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low),
                                   _mm256_and_si256(_mm256_slli_epi32(hi, 4), top));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                                   _mm256_and_si256(_mm256_slli_epi32(hi, 2), top));
            q[2] = _mm256_or_si256(_mm256_srli_epi32(l0, 4), _mm256_and_si256(hi, top));
            q[3] = _mm256_or_si256(_mm256_srli_epi32(l1, 4),
                                   _mm256_and_si256(_mm256_srli_epi32(hi, 2), top));
            for (int sh = 0; sh < 4; sh++) {
                float d = s.d[8 * h + 2 * sh + i / 2];
                __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(d), tofloat(q[sh]),
                                           _mm256_set1_ps(-32.0f * d));
                fma8(v, xb, K, MT, 128 * h + 32 * sh + 8 * i, A, 4 * (sh & 1) + i, acc);
            }
        }
    }
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The accumulators a row keeps in a pass of MT rows (8 for one row, 4 for two, 2 for up to
 * four, else 1) so that the FMAs of a block are not one dependency chain: with a single
 * accumulator a one-row step waited on FMA latency (257 against 292 us for SmolLM2's gate|up
 * at one row, one thread). Batch-invariant products keep two at every row count, in passes of
 * at most four rows (8 accumulators; eight rows of two would take all 16 ymm registers): on
 * an AVX2-only Zen 2, SmolLM2's projections at one row took 13.3 ms a token this way against
 * 19.7 with one accumulator in passes of eight (the default's 13.2), at 64 rows 304 against
 * 275 ms (default 274). */
#define ACCS(MT) ((MT) == 1 ? 8 : (MT) == 2 ? 4 : (MT) <= 4 ? 2 : 1)
#define INVARIANT_ACCS 2
#define INVARIANT_ROWS 4

/* Outputs [n0, n1) for rows [m0, m0 + MT) of x, A accumulators a row; MT and A are constants
 * after inlining. */
INLINE void tile_avx2(int qtype, const float *x, int64_t m0, const int MT, const int A,
                      int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *out,
                      int64_t N) {
    const int values = block_values(qtype);
    int64_t nb = K / values, bytes = block_bytes(qtype);
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[8][ACC];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
        const uint8_t *row = w + n * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            const float *xb = x + m0 * K + b * values;
            if (qtype == Q8_0)
                block_q8_0(blk, xb, K, MT, A, acc);
            else if (qtype == Q4_K)
                block_q4_k(blk, xb, K, MT, A, acc);
            else if (qtype == Q6_K)
                block_q6_k(blk, xb, K, MT, A, acc);
            else
                block_nibbles(qtype, blk, xb, K, MT, A, acc);
        }
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < A; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
            out[(m0 + r) * N + n] = hsum(acc[r][0]);
        }
    }
}

BLOCK_PRODUCTS(AVX2, tile_avx2, ACCS, INVARIANT_ACCS, splitserve_avx2_range)

#else /* not x86-64: splitserve_block_matmul never asks for AVX2 */
void splitserve_avx2_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                           int64_t n0, int64_t n1, float *out, int64_t N, int invariant) {
    (void)qtype, (void)x, (void)M, (void)K, (void)w, (void)n0, (void)n1, (void)out, (void)N;
    (void)invariant;
}
#endif
