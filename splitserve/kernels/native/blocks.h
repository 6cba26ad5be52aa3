/* Shared by the block products (blocks.c, blocks_avx2.c, blocks_avx512.c,
 * blocks_interleaved.c): the block formats (blocks.c describes them) and the scalar pieces of
 * their dequantization. */
#ifndef SPLITSERVE_BLOCKS_H
#define SPLITSERVE_BLOCKS_H
#include <stdint.h>
#include <string.h>

#define QK 32   /* values of a block of the 32-value types, and of a part of any block */
#define QK_K 256 /* values of a K-quant super-block */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

static inline int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return -1;
    }
}
int splitserve_block_bytes(int qtype);

/* Or-ed into splitserve_block_matmul's isa: batch-invariant products, each row of x summed in
 * one order whatever the row count M (deterministic mode, engine/layers/batch_invariant.py). */
#define BLOCKS_INVARIANT 16

/* Values of a block: 32, or 256 for the K-quants. A block is block_values / 32 parts of 32
 * consecutive values, which every path dequantizes one at a time. */
static inline int block_values(int qtype) { return qtype == Q4_K || qtype == Q6_K ? QK_K : QK; }

/* Bytes of a block before its quants: d (and m for Q4_1), fp16 each. The interleaved copy's
 * types only (Q4_0, Q4_1, Q8_0). */
static inline int block_header(int qtype) { return qtype == Q4_1 ? 4 : 2; }

/* IEEE half -> float, exactly (numpy's astype(float32) of a float16). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* A K-quant super-block's float32 scales, as gguf's numpy dequantize forms them:
 *   Q4_K  d[p] = d * sc[p], m[p] = dmin * min[p] for its 8 parts (6-bit sc and min unpacked
 *         from the 12 scale bytes as gguf's get_scale_min); weight = d[p] * q - m[p]
 *   Q6_K  d[i] = d * scales[i] for its 16 groups of 16 values; weight = d[i] * (q - 32) */
typedef struct {
    float d[16], m[8];
} kscales;

static inline void k_scales(int qtype, const uint8_t *b, kscales *s) {
    if (qtype == Q6_K) {
        float d = half_at(b + 208);
        for (int i = 0; i < 16; i++) s->d[i] = d * (float)(int8_t)b[192 + i];
        return;
    }
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *sc = b + 4;
    for (int p = 0; p < 8; p++) {
        int scale = p < 4 ? sc[p] & 63 : (sc[p + 4] & 15) | ((sc[p - 4] >> 6) << 4);
        int min = p < 4 ? sc[p + 4] & 63 : (sc[p + 4] >> 4) | ((sc[p] >> 6) << 4);
        s->d[p] = d * (float)scale;
        s->m[p] = dmin * (float)min;
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* k_scales in vector registers (x86-64 with AVX2, the AVX2, AVX-512 and 16-bit paths): the same
 * products, bit for bit; the scalar code's loop and int to float conversions cost a third of a
 * one-row Q4_K product. */
__attribute__((target("avx2,f16c"), always_inline)) static inline void k_scales_x86(
    int qtype, const uint8_t *b, kscales *s) {
    if (qtype == Q6_K) {
        __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(b + 208)));
        for (int i = 0; i < 2; i++) {
            __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * i)));
            _mm256_storeu_ps(s->d + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        }
        return;
    }
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int *)b));
    uint32_t w[3];
    __builtin_memcpy(w, b + 4, 12);
    /* bytes of the 6-bit scales (parts 0-3, then 4-7) and mins, as k_scales unpacks them */
    uint32_t sc_lo = w[0] & 0x3f3f3f3fu, mn_lo = w[1] & 0x3f3f3f3fu;
    uint32_t sc_hi = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    __m256i sc = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo));
    __m256i mn = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo));
    _mm256_storeu_ps(s->d, _mm256_mul_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(sc)));
    _mm256_storeu_ps(s->m, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), _mm256_cvtepi32_ps(mn)));
}

/* An fp16 at p as float32 (one vcvtph2ps; half_at's value). */
__attribute__((target("f16c"), always_inline)) static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Part p of a Q6_K block's quants minus 32, as signed bytes (values 128 h + 32 s + j): the
 * one-row 16-bit products' (blocks_row16.c, blocks_row16_avx2.c). */
__attribute__((target("avx2"), always_inline)) static inline __m256i q6_k_quants(const uint8_t *b,
                                                                                 int p) {
    int h = p / 4, s = p % 4;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s & 1)));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    if (s >> 1) lo = _mm256_srli_epi16(lo, 4);
    lo = _mm256_and_si256(lo, _mm256_set1_epi8(15));
    hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * s), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}
#endif

/* The AVX2 and AVX-512 paths (blocks_avx2.c, blocks_avx512.c): outputs [n0, n1) of
 * out[M, N] = x[M, K] @ dequant(w[N, K]).T, which each may only be asked for where the CPU
 * runs it. */
int splitserve_has_avx512(void);
void splitserve_avx2_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                           int64_t n0, int64_t n1, float *out, int64_t N, int invariant);
void splitserve_avx512_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t n0, int64_t n1, float *out, int64_t N, int invariant);
/* An instruction set's block products over outputs [n0, n1) (blocks_avx2.c, blocks_avx512.c):
 * per type, passes PASS(qtype, x, m0, MT, A, K, w, n0, n1, out, N) over 8 rows of x at a time
 * and one over the rest, MT a constant in each call so that every row count compiles on its
 * own; A, the accumulators a row keeps, is ACCS(MT) (fewer rows, more accumulators), or
 * INVARIANT_ACCS at every row count when invariant is set, so that each row's sums run in one
 * order whatever M (then in passes of INVARIANT_ROWS rows where that is under 8, the rest a
 * row at a time: a row's sums do not depend on the rows beside it in a pass).
 * RANGE(qtype, ..., invariant) picks the type's. ATTR: the instruction set's
 * target attribute. */
#define BLOCK_PASS(PASS, Q, MT, ACCS, INVARIANT_ACCS)                                   \
    do {                                                                                \
        if (invariant)                                                                  \
            PASS(Q, x, m, MT, INVARIANT_ACCS, K, w, n0, n1, out, N);                    \
        else                                                                            \
            PASS(Q, x, m, MT, ACCS(MT), K, w, n0, n1, out, N);                          \
    } while (0)
#define BLOCK_TILES(ATTR, PASS, ACCS, INV, Q)                                           \
    ATTR static void tiles_##Q(const float *x, int64_t M, int64_t K, const uint8_t *w,  \
                               int64_t n0, int64_t n1, float *out, int64_t N,           \
                               int invariant) {                                         \
        int64_t m = 0;                                                                  \
        if (invariant && INVARIANT_ROWS < 8) {                                          \
            for (; m + INVARIANT_ROWS <= M; m += INVARIANT_ROWS)                        \
                PASS(Q, x, m, INVARIANT_ROWS, INV, K, w, n0, n1, out, N);               \
            for (; m < M; m++) PASS(Q, x, m, 1, INV, K, w, n0, n1, out, N);             \
            return;                                                                     \
        }                                                                               \
        for (; m + 8 <= M; m += 8) BLOCK_PASS(PASS, Q, 8, ACCS, INV);                   \
        switch (M - m) {                                                                \
        case 7: BLOCK_PASS(PASS, Q, 7, ACCS, INV); break;                               \
        case 6: BLOCK_PASS(PASS, Q, 6, ACCS, INV); break;                               \
        case 5: BLOCK_PASS(PASS, Q, 5, ACCS, INV); break;                               \
        case 4: BLOCK_PASS(PASS, Q, 4, ACCS, INV); break;                               \
        case 3: BLOCK_PASS(PASS, Q, 3, ACCS, INV); break;                               \
        case 2: BLOCK_PASS(PASS, Q, 2, ACCS, INV); break;                               \
        case 1: BLOCK_PASS(PASS, Q, 1, ACCS, INV); break;                               \
        default: break;                                                                 \
        }                                                                               \
    }
#define BLOCK_PRODUCTS(ATTR, PASS, ACCS, INV, RANGE)                                    \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q4_0)                                            \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q4_1)                                            \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q5_0)                                            \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q8_0)                                            \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q4_K)                                            \
    BLOCK_TILES(ATTR, PASS, ACCS, INV, Q6_K)                                            \
    void RANGE(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,      \
               int64_t n0, int64_t n1, float *out, int64_t N, int invariant) {          \
        switch (qtype) {                                                                \
        case Q4_0: tiles_Q4_0(x, M, K, w, n0, n1, out, N, invariant); break;            \
        case Q4_1: tiles_Q4_1(x, M, K, w, n0, n1, out, N, invariant); break;            \
        case Q5_0: tiles_Q5_0(x, M, K, w, n0, n1, out, N, invariant); break;            \
        case Q8_0: tiles_Q8_0(x, M, K, w, n0, n1, out, N, invariant); break;            \
        case Q4_K: tiles_Q4_K(x, M, K, w, n0, n1, out, N, invariant); break;            \
        case Q6_K: tiles_Q6_K(x, M, K, w, n0, n1, out, N, invariant); break;            \
        default: break;                                                                 \
        }                                                                               \
    }

/* One-row products on 16-bit activations (blocks_row16.c, blocks_row16_avx2.c): x [K] rounded
 * once per call, then outputs [n0, n1) of out[N]. Q8_0, Q5_0, Q4_K, Q6_K, on CPUs with
 * AVX-512BW, or AVX2. */
int splitserve_has_avx512bw(void);
void splitserve_round_row16(const float *x, int64_t K, int16_t *x16, float *sx, float *sums);
void splitserve_row16_range(int qtype, const int16_t *x16, const float *sx, const float *sums,
                            int64_t K, const uint8_t *w, int64_t n0, int64_t n1, float *out);
void splitserve_row16_avx2_range(int qtype, const int16_t *x16, const float *sx,
                                 const float *sums, int64_t K, const uint8_t *w, int64_t n0,
                                 int64_t n1, float *out);

/* The many-row product on the interleaved copy (blocks_interleaved.c describes the layout):
 * outputs [32 pair, 32 pair + 32) of out[M, N]. AVX-512 only; Q4_0, Q4_1, Q8_0. */
void splitserve_avx512_interleaved(int qtype, const float *x, int64_t M, int64_t K,
                                   const uint8_t *il, int64_t pair, float *out, int64_t N);
#endif
