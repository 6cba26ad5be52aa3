/* The AVX-512 path of blocks.c's products, chosen at run time on CPUs with AVX-512F.
 *
 * A 32-value part of a block dequantizes into two zmm registers of 16 weights, with the same
 * float32 operations as the scalar code, so the weights stay bit-identical to gguf's dequantize:
 *   Q4_0, Q4_1  the 16 values a nibble can stand for form one zmm table, t[j] = (j - 8) * d or
 *               j * d + m (a multiply, then an add, as the scalar code); the 16 bytes of
 *               nibbles widen to 16 int32 and vpermps looks the weights up: the low nibbles
 *               directly (it reads only the low 4 bits of an index), the high ones after a
 *               shift. No conversion, multiply or add per weight.
 *   Q4_K        the same with a part's own table, t[j] = d[p] * j - m[p].
 *   Q5_0        a table of the 32 values, (j - 16) * d, in two zmm; the high bit of each index
 *               set under a mask from the block's 32 high bits, and vpermt2ps (5 index bits)
 *               looks the weights up.
 *   Q8_0        widen the int8 to int32, convert, multiply by d.
 *   Q6_K        assemble the 6-bit q from its nibble and its 2 high bits in int32 lanes,
 *               subtract 32, convert, multiply by the group's scale (a zmm is one group of 16).
 * As in the AVX2 path, a pass takes one output and up to 8 rows of x, so a block is dequantized
 * once per 8 rows. Software prefetch (1 KB ahead) was tried and gained nothing measurable.
 */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,fma,f16c")))
#define INLINE AVX512 static inline __attribute__((always_inline))

INLINE __m512 scale(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _mm512_set1_ps(_cvtsh_ss(h));
}

INLINE __m512i widen16(const uint8_t *q) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
}

/* The 32 weights of 16 bytes of nibbles, looked up in table (vpermps reads only the low 4
 * bits of each index, so the low nibbles need no mask). */
INLINE void lookup(const uint8_t *qs, __m512 table, __m512 v[2]) {
    __m512i q = widen16(qs);
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

INLINE void dequant_q5_0(const uint8_t *b, __m512 v[2]) {
    __m512 d = scale(b);
    __m512 lo = _mm512_mul_ps(
        _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1), d);
    __m512 hi = _mm512_mul_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d);
    uint32_t qh;
    __builtin_memcpy(&qh, b + 2, 4);
    __m512i q = widen16(b + 6), sixteen = _mm512_set1_epi32(16);
    __m512i q0 = _mm512_and_si512(q, _mm512_set1_epi32(15)), q1 = _mm512_srli_epi32(q, 4);
    q0 = _mm512_mask_or_epi32(q0, (__mmask16)(qh & 0xffff), q0, sixteen);
    q1 = _mm512_mask_or_epi32(q1, (__mmask16)(qh >> 16), q1, sixteen);
    v[0] = _mm512_permutex2var_ps(lo, q0, hi);
    v[1] = _mm512_permutex2var_ps(lo, q1, hi);
}

/* Part p of a Q6_K block: values 128 h + 32 s + [0, 32) (p = 4 h + s). */
INLINE void dequant_q6_k(const uint8_t *b, int p, const kscales *s, __m512 v[2]) {
    int h = p / 4, sh = p % 4;
    const uint8_t *ql = b + 64 * h + 32 * (sh & 1), *qh = b + 128 + 32 * h;
    for (int i = 0; i < 2; i++) {
        __m512i lo = _mm512_srli_epi32(widen16(ql + 16 * i), 4 * (sh >> 1));
        __m512i hi = _mm512_srli_epi32(widen16(qh + 16 * i), 2 * sh);
        lo = _mm512_and_si512(lo, _mm512_set1_epi32(15));
        hi = _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4);
        __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
        v[i] = _mm512_mul_ps(_mm512_set1_ps(s->d[2 * p + i]), _mm512_cvtepi32_ps(q));
    }
}

/* Part p of block b (p = 0 for the 32-value types) -> v. s: the block's K-quant scales. */
INLINE void dequant(int qtype, const uint8_t *b, int p, const kscales *s, __m512 v[2]) {
    const __m512 j = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (qtype == Q4_K) {
        __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s->d[p]), j),
                                 _mm512_set1_ps(s->m[p]));
        const uint8_t *qs = b + 16 + 32 * (p / 2);
        __m512i q0 = widen16(qs), q1 = widen16(qs + 16);
        if (p % 2) q0 = _mm512_srli_epi32(q0, 4), q1 = _mm512_srli_epi32(q1, 4);
        v[0] = _mm512_permutexvar_ps(q0, t);
        v[1] = _mm512_permutexvar_ps(q1, t);
    } else if (qtype == Q6_K) {
        dequant_q6_k(b, p, s, v);
    } else if (qtype == Q5_0) {
        dequant_q5_0(b, v);
    } else if (qtype == Q4_1) { /* d and m in one conversion: ~7% faster than two */
        uint32_t dm;
        __builtin_memcpy(&dm, b, 4);
        __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        __m512 d = _mm512_broadcastss_ps(f), m = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
        lookup(b + 4, _mm512_add_ps(_mm512_mul_ps(j, d), m), v);
    } else if (qtype == Q8_0) {
        __m512 d = scale(b);
        for (int i = 0; i < 2; i++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i));
            v[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
    } else {
        __m512 t = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        lookup(b + 2, _mm512_mul_ps(t, scale(b)), v);
    }
}

/* One part's weights v times rows [m0, m0 + MT) of x at input at, into accumulators u and
 * u + 1 of each row (mod A). */
INLINE void part_fma(const __m512 v[2], const float *x, int64_t m0, const int MT, int64_t K,
                     int64_t at, const int A, int u, __m512 acc[8][4]) {
    for (int r = 0; r < MT; r++) {
        const float *xr = x + (m0 + r) * K + at;
        acc[r][u % A] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xr), acc[r][u % A]);
        acc[r][(u + 1) % A] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xr + 16), acc[r][(u + 1) % A]);
    }
}

/* Block b's weights times rows [m0, m0 + MT) of x into the accumulators: a 32-value type's
 * parts go to accumulators u and u + 1 (mod A), a K-quant's parts alternate between 0, 1 and
 * 2, 3. */
INLINE void block_fma(int qtype, const uint8_t *blk, int64_t b, const float *x, int64_t m0,
                      const int MT, int64_t K, const int A, const int u, __m512 acc[8][4]) {
    const int values = block_values(qtype), parts = values / QK;
    kscales s;
    if (parts > 1) k_scales_x86(qtype, blk, &s);
#pragma GCC unroll 8
    for (int p = 0; p < parts; p++) {
        __m512 v[2];
        dequant(qtype, blk, p, &s, v);
        part_fma(v, x, m0, MT, K, b * values + QK * p, A, parts > 1 ? 2 * (p & 1) : u, acc);
    }
}

/* One row of x times Q8_0 weights: each block's sum of q x taken first and multiplied by the
 * block's d once (8 vector operations per block against 11 for d q x: the conversions and the
 * scale dominate a one-row product; the 262,144-output LM head of Gemma 3 took 13.0 ms of one
 * core with d q, 11.4 this way). The products differ from those of the dequantized weights in
 * rounding only, as a different summation order does. */
INLINE __m512 q8_0_dot(const uint8_t *blk, const float *x) {
    __m128i lo = _mm_loadu_si128((const __m128i *)(blk + 2));
    __m128i hi = _mm_loadu_si128((const __m128i *)(blk + 18));
    __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_loadu_ps(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_loadu_ps(x + 16),
                           dot);
}

INLINE void q8_0_row(const float *x, int64_t nb, const uint8_t *w, int64_t n0, int64_t n1,
                     float *out) {
    for (int64_t n = n0; n < n1; n++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const uint8_t *row = w + n * nb * 34;
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            const uint8_t *blk = row + b * 34;
            a0 = _mm512_fmadd_ps(q8_0_dot(blk, x + 32 * b), scale(blk), a0);
            a1 = _mm512_fmadd_ps(q8_0_dot(blk + 34, x + 32 * b + 32), scale(blk + 34), a1);
            a2 = _mm512_fmadd_ps(q8_0_dot(blk + 68, x + 32 * b + 64), scale(blk + 68), a2);
            a3 = _mm512_fmadd_ps(q8_0_dot(blk + 102, x + 32 * b + 96), scale(blk + 102), a3);
        }
        for (; b < nb; b++)
            a0 = _mm512_fmadd_ps(q8_0_dot(row + b * 34, x + 32 * b), scale(row + b * 34), a0);
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
}

/* The accumulators a row keeps in a pass of MT rows (4 for one row, 2 for two, else 1), parts
 * taken in pairs, so that a one-row pass is not one FMA dependency chain. Batch-invariant
 * products keep two at every row count (16 of the 32 zmm registers at eight rows). */
#define ACCS(MT) ((MT) == 1 ? 4 : (MT) == 2 ? 2 : 1)
#define INVARIANT_ACCS 2
#define INVARIANT_ROWS 8

/* Outputs [n0, n1) for rows [m0, m0 + MT) of x, A accumulators a row; MT and A are constants
 * after inlining. One output at a time: walking two or four weight rows side by side (to share
 * the loads of x) was faster with the weights in cache but up to 3x slower streaming them from
 * memory (SmolLM2's LM head). The blocks go two at a time so that every accumulator's index is
 * a constant: with the index computed per block, the accumulators lived on the stack and a
 * one-row Q8_0 product ran at half the speed. */
INLINE void rows(int qtype, const float *x, int64_t m0, const int MT, const int A, int64_t K,
                 const uint8_t *w, int64_t n0, int64_t n1, float *out, int64_t N) {
    int64_t nb = K / block_values(qtype), bytes = block_bytes(qtype);
    if (qtype == Q8_0 && MT == 1 && A == ACCS(1)) { /* not a batch-invariant pass */
        q8_0_row(x + m0 * K, nb, w, n0, n1, out + m0 * N);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[8][4];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < A; a++) acc[r][a] = _mm512_setzero_ps();
        const uint8_t *row = w + n * nb * bytes;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            block_fma(qtype, row + b * bytes, b, x, m0, MT, K, A, 0, acc);
            block_fma(qtype, row + (b + 1) * bytes, b + 1, x, m0, MT, K, A, 2, acc);
        }
        if (b < nb) block_fma(qtype, row + b * bytes, b, x, m0, MT, K, A, 0, acc);
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < A; a++) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][a]);
            out[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r][0]);
        }
    }
}

int splitserve_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

BLOCK_PRODUCTS(AVX512, rows, ACCS, INVARIANT_ACCS, splitserve_avx512_range)

#else /* not x86-64: no AVX-512, and splitserve_block_matmul never asks for it */
int splitserve_has_avx512(void) { return 0; }

void splitserve_avx512_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t n0, int64_t n1, float *out, int64_t N, int invariant) {
    (void)qtype, (void)x, (void)M, (void)K, (void)w, (void)n0, (void)n1, (void)out, (void)N;
    (void)invariant;
}
#endif
