/* Projections on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), float32 activations.
 *
 * A weight row of K inputs is K/32 blocks as the GGUF file stores them:
 *   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles       w = (q - 8) * d
 *   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes nibbles  w = q * d + m
 *   Q8_0  34 bytes: fp16 d, 32 int8                    w = q * d
 * (nibble j of a block is the low half of byte j, nibble j + 16 its high half). Each block is
 * dequantized on the fly with the same float32 operations as gguf's numpy dequantize (a
 * multiply, then an add for Q4_1), so the weights the dot products see are bit-identical to
 * the dequantized checkpoint; only the summation order of the dot products differs.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k]. Threads (OpenMP, the runtime torch already loaded) split
 * the outputs; each walks its outputs in groups of 8 rows of x held in registers, so a block is
 * dequantized once per 8 rows. The instruction set is chosen per call (splitserve_block_matmul's
 * isa, capped by what the CPU has): AVX-512 (blocks_avx512.c), AVX2, or portable C.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

static float half_to_float(uint16_t h) {
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

static float block_scale(const uint8_t *block, int offset) {
    uint16_t h;
    memcpy(&h, block + offset, 2);
    return half_to_float(h);
}

int splitserve_block_bytes(int qtype) { return block_bytes(qtype); }

/* One block -> 32 floats, exactly as gguf's numpy dequantize computes them. */
static void dequant_block(int qtype, const uint8_t *b, float *w) {
    float d = block_scale(b, 0);
    if (qtype == Q8_0) {
        for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    const uint8_t *qs = b + block_header(qtype);
    float m = qtype == Q4_1 ? block_scale(b, 2) : 0.0f;
    for (int j = 0; j < QK / 2; j++) {
        int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
        if (qtype == Q4_1) {
            w[j] = (float)lo * d + m;
            w[j + QK / 2] = (float)hi * d + m;
        } else {
            w[j] = (float)(lo - 8) * d;
            w[j + QK / 2] = (float)(hi - 8) * d;
        }
    }
}

/* Rows ids[i] of a block-quantized matrix -> out[i, :] (embedding lookups). */
void splitserve_dequant_rows(int qtype, const uint8_t *w, int64_t K, const int64_t *ids,
                             int64_t count, float *out) {
    int64_t nb = K / QK, row_bytes = nb * splitserve_block_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        for (int64_t b = 0; b < nb; b++)
            dequant_block(qtype, row + b * splitserve_block_bytes(qtype), out + i * K + b * QK);
    }
}

/* ---- portable path ---- */
static void matmul_portable(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                            int64_t n0, int64_t n1, float *out, int64_t N) {
    int64_t nb = K / QK, bytes = splitserve_block_bytes(qtype);
    float wb[QK];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) out[m * N + n] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            dequant_block(qtype, w + (n * nb + b) * bytes, wb);
            for (int64_t m = 0; m < M; m++) {
                const float *xr = x + m * K + b * QK;
                float s = 0.0f;
                for (int j = 0; j < QK; j++) s += wb[j] * xr[j];
                out[m * N + n] += s;
            }
        }
    }
}

/* ---- AVX2 path ---- */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE AVX2 static inline __attribute__((always_inline))

INLINE void nibbles(const uint8_t *qs, __m256 v[4]) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

INLINE void dequant_avx2(int qtype, const uint8_t *b, __m256 v[4]) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)b));
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
            v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        }
    } else if (qtype == Q4_1) {
        __m256 m = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(b + 2)));
        nibbles(b + 4, v);
        for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(v[i], d), m);
    } else {
        __m256 eight = _mm256_set1_ps(8.0f);
        nibbles(b + 2, v);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(_mm256_sub_ps(v[i], eight), d);
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
    int64_t nb = K / QK, bytes = splitserve_block_bytes(qtype);
    const int A = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[8][4];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
        const uint8_t *row = w + n * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            dequant_avx2(qtype, row + b * bytes, v);
            for (int r = 0; r < MT; r++) {
                const float *xr = x + (m0 + r) * K + b * QK;
                for (int i = 0; i < 4; i++)
                    acc[r][i % A] =
                        _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
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
TILES(Q8_0)

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512 };

/* The widest instruction set this CPU runs: 2 AVX-512, 1 AVX2, 0 portable C. */
int splitserve_best_isa(void) {
    return splitserve_has_avx512() ? ISA_AVX512 : has_avx2() ? ISA_AVX2 : ISA_PORTABLE;
}

static void matmul_range(int qtype, int isa, const float *x, int64_t M, int64_t K,
                         const uint8_t *w, int64_t n0, int64_t n1, float *out, int64_t N) {
    if (isa == ISA_PORTABLE) {
        matmul_portable(qtype, x, M, K, w, n0, n1, out, N);
    } else if (isa == ISA_AVX512) {
        splitserve_avx512_range(qtype, x, M, K, w, n0, n1, out, N);
    } else if (qtype == Q4_1) {
        tiles_Q4_1(x, M, K, w, n0, n1, out, N);
    } else if (qtype == Q8_0) {
        tiles_Q8_0(x, M, K, w, n0, n1, out, N);
    } else {
        tiles_Q4_0(x, M, K, w, n0, n1, out, N);
    }
}

/* Rows from which the AVX-512 path takes the interleaved copy when it has one. At one row the
 * one-output products above are as fast (SmolLM2's gate|up on one Zen 5 thread, weights in
 * cache: 62 against 63 us); from two rows the interleaved kernel is faster (82 against 68 us,
 * 789 against 600 us at 32 rows). Q8_0's single multiply per weight leaves the one-output
 * products ahead up to 6 rows (the 49152-output LM head: 1.30 against 1.52 ms at 6 rows on two
 * threads, 2.01 against 1.62 ms at 8; benchmarks/native_blocks.py). */
static int interleaved_from(int qtype) { return qtype == Q8_0 ? 8 : 2; }

/* out[M, N] = x[M, K] @ dequant(w[N, K]).T on the instruction set isa (0 portable, 1 AVX2,
 * 2 AVX-512), or the widest below it that this CPU runs. il: w's interleaved copy
 * (splitserve_interleave), or NULL.
 * Returns 0, or -1 for an unknown qtype or K not a multiple of 32. */
int splitserve_block_matmul(int qtype, int isa, const float *x, int64_t M, int64_t K,
                            const uint8_t *w, const uint8_t *il, int64_t N, float *out) {
    if (splitserve_block_bytes(qtype) < 0 || K % QK) return -1;
    int best = splitserve_best_isa();
    isa = isa < best ? isa : best;
    if (isa == ISA_AVX512 && il && M >= interleaved_from(qtype)) {
        int64_t pairs = (N + 31) / 32;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            splitserve_avx512_interleaved(qtype, x, M, K, il, p, out, N);
        return 0;
    }
    const int64_t chunk = 16;
    int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        matmul_range(qtype, isa, x, M, K, w, n0, n1, out, N);
    }
    return 0;
}

/* Bytes of w[N, K]'s interleaved copy: an even number of 16-output groups. */
int64_t splitserve_interleaved_bytes(int qtype, int64_t N, int64_t K) {
    int64_t groups = (N + 15) / 16;
    return (groups + groups % 2) * 16 * (K / QK) * splitserve_block_bytes(qtype);
}

/* w[N, K] (GGUF rows) -> il, its interleaved copy (blocks_avx512.c describes the layout). */
void splitserve_interleave(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *il) {
    int64_t nb = K / QK, bytes = splitserve_block_bytes(qtype), gbytes = 16 * bytes;
    int64_t header = block_header(qtype), data = bytes - header;
    memset(il, 0, (size_t)splitserve_interleaved_bytes(qtype, N, K));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t o = n % 16;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = w + (n * nb + b) * bytes;
            uint8_t *dst = il + ((n / 16) * nb + b) * gbytes;
            memcpy(dst + 2 * o, src, 2);                          /* d */
            if (qtype == Q4_1) memcpy(dst + 32 + 2 * o, src + 2, 2); /* m */
            for (int64_t j = 0; j < data; j++) dst[16 * header + 16 * j + o] = src[header + j];
        }
    }
}
