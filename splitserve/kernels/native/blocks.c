/* Projections on GGUF block-quantized weights, float32 activations.
 *
 * A weight row of K inputs is K / values blocks as the GGUF file stores them:
 *   Q4_0  32 values, 18 bytes: fp16 d, 16 bytes of nibbles        w = (q - 8) * d
 *   Q4_1  32 values, 20 bytes: fp16 d, fp16 m, 16 bytes nibbles   w = q * d + m
 *   Q5_0  32 values, 22 bytes: fp16 d, 32 high bits (uint32), 16 bytes of nibbles
 *                                                                 w = d * (q - 16)
 *   Q8_0  32 values, 34 bytes: fp16 d, 32 int8                     w = q * d
 *   Q4_K  256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 of
 *         each), 128 bytes of nibbles                             w = d[p] * q - m[p]
 *   Q6_K  256 values, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8
 *         scales, fp16 d                                          w = d[i] * (q - 32)
 * (Q4_0, Q4_1, Q5_0: nibble j of a block is the low half of byte j, nibble j + 16 its high
 * half; Q5_0's bit j of the uint32 is bit 4 of q j. Q4_K: part p of 32 values takes the low
 * (p even) or high (p odd) halves of bytes [32 (p / 2), 32 (p / 2) + 32), with d[p], m[p] from
 * k_scales in blocks.h. Q6_K: value 128 h + 32 s + j takes the low (s < 2) or high half of
 * byte 64 h + 32 (s & 1) + j, bits 2 s and 2 s + 1 of high byte 32 h + j, and scale
 * 8 h + 2 s + j / 16.) Each block is dequantized on the fly with the same float32 operations
 * as gguf's numpy dequantize (a multiply, then an add or a subtraction where the format has
 * one, the K-quants' scale products first), so the weights the dot products see are
 * bit-identical to the dequantized checkpoint; only the summation order of the dot products
 * differs.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k]. Threads (OpenMP, the runtime torch already loaded) split
 * the outputs; each walks its outputs in groups of 8 rows of x held in registers, so a block is
 * dequantized once per 8 rows. The instruction set is chosen per call (splitserve_block_matmul's
 * isa, capped by what the CPU has): AVX-512 (blocks_avx512.c, and blocks_interleaved.c for many
 * rows), AVX2 (blocks_avx2.c), or portable C.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

int splitserve_block_bytes(int qtype) { return block_bytes(qtype); }

/* Part p (values [32 p, 32 p + 32)) of a K-quant block -> 32 floats. */
static void dequant_k_part(int qtype, const uint8_t *b, const kscales *s, int p, float *w) {
    for (int j = 0; j < QK; j++) {
        if (qtype == Q4_K) {
            int q = (b[16 + 32 * (p / 2) + j] >> (4 * (p % 2))) & 15;
            w[j] = s->d[p] * (float)q - s->m[p];
        } else {
            int h = p / 4, sh = p % 4;
            int lo = (b[64 * h + 32 * (sh & 1) + j] >> (4 * (sh >> 1))) & 15;
            int hi = (b[128 + 32 * h + j] >> (2 * sh)) & 3;
            w[j] = s->d[2 * p + j / 16] * (float)((lo | hi << 4) - 32);
        }
    }
}

/* One block -> block_values(qtype) floats, exactly as gguf's numpy dequantize computes them. */
static void dequant_block(int qtype, const uint8_t *b, float *w) {
    if (qtype == Q4_K || qtype == Q6_K) {
        kscales s;
        k_scales(qtype, b, &s);
        for (int p = 0; p < QK_K / QK; p++) dequant_k_part(qtype, b, &s, p, w + QK * p);
        return;
    }
    float d = half_at(b);
    if (qtype == Q8_0) {
        for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    if (qtype == Q5_0) {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        for (int j = 0; j < QK; j++) {
            int q = (b[6 + j % 16] >> (4 * (j / 16))) & 15;
            w[j] = d * (float)((q | (int)((qh >> j) & 1) << 4) - 16);
        }
        return;
    }
    const uint8_t *qs = b + block_header(qtype);
    float m = qtype == Q4_1 ? half_at(b + 2) : 0.0f;
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
    int64_t values = block_values(qtype), bytes = block_bytes(qtype), nb = K / values;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * nb * bytes;
        for (int64_t b = 0; b < nb; b++)
            dequant_block(qtype, row + b * bytes, out + i * K + b * values);
    }
}

/* ---- portable path ---- */
static void matmul_portable(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                            int64_t n0, int64_t n1, float *out, int64_t N) {
    int64_t values = block_values(qtype), bytes = block_bytes(qtype), nb = K / values;
    float wb[QK_K];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m = 0; m < M; m++) out[m * N + n] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            dequant_block(qtype, w + (n * nb + b) * bytes, wb);
            for (int64_t m = 0; m < M; m++) {
                const float *xr = x + m * K + b * values;
                float s = 0.0f;
                for (int64_t j = 0; j < values; j++) s += wb[j] * xr[j];
                out[m * N + n] += s;
            }
        }
    }
}

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

/* The portable path sums each row on its own at any M: it is batch-invariant as it is. */
static void matmul_range(int qtype, int isa, int invariant, const float *x, int64_t M, int64_t K,
                         const uint8_t *w, int64_t n0, int64_t n1, float *out, int64_t N) {
    if (isa == ISA_PORTABLE)
        matmul_portable(qtype, x, M, K, w, n0, n1, out, N);
    else if (isa == ISA_AVX512)
        splitserve_avx512_range(qtype, x, M, K, w, n0, n1, out, N, invariant);
    else
        splitserve_avx2_range(qtype, x, M, K, w, n0, n1, out, N, invariant);
}

/* Whether w[N, K] can have an interleaved copy (blocks_interleaved.c): the 32-value types whose
 * layout it knows. */
static int interleavable(int qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

/* Rows from which the AVX-512 path takes the interleaved copy when it has one, besides one row
 * (which always takes it: below). From two rows the interleaved kernel is faster (SmolLM2's
 * gate|up on one Zen 5 thread, weights in cache: 82 against 68 us, 789 against 600 us at 32
 * rows). Q8_0's single multiply per weight leaves the one-output products ahead from 2 up to 6
 * rows (the 49152-output LM head: 1.30 against 1.52 ms at 6 rows on two threads, 2.01 against
 * 1.62 ms at 8; benchmarks/native_blocks.py). At one row the interleaved copy is one stream
 * where the one-output products (and the 16-bit row's, blocks_row16.c) read N rows at once: as
 * fast with the weights in cache (62 against 63 us on Zen 5), and with a model's weights
 * streaming from memory SmolLM2's batch-1 decode on an Intel Xeon (AVX-512, one thread) went
 * from 40.8 to 87.6-89.8 tokens a CPU second (76-81 with Q4_1 alone taking it). */
static int interleaved_from(int qtype) { return qtype == Q8_0 ? 8 : 2; }

static int takes_interleaved(int qtype, int isa, const uint8_t *il, int64_t M, int invariant) {
    int from = invariant || M == 1 ? 1 : interleaved_from(qtype);
    return isa == ISA_AVX512 && il && interleavable(qtype) && M >= from;
}

/* The path a one-row product of qtype on isa takes on 16-bit activations (blocks_row16.c):
 * ISA_AVX512 with AVX-512BW, else ISA_AVX2 (blocks_row16_avx2.c), for the types whose float32
 * dequantization costs more than their bytes take to arrive (Gemma 3's); ISA_PORTABLE: none.
 * Q4_0 and Q4_1 keep the float32 path, fast enough at one row. */
static int row16(int qtype, int isa) {
    static int bw = -1;
    if (bw < 0) bw = splitserve_has_avx512bw();
    if (!(qtype == Q8_0 || qtype == Q5_0 || qtype == Q4_K || qtype == Q6_K)) return ISA_PORTABLE;
    if (isa == ISA_AVX512 && bw) return ISA_AVX512;
    return isa >= ISA_AVX2 ? ISA_AVX2 : ISA_PORTABLE;
}

static int one_row16(int qtype, int path, const float *x, int64_t K, const uint8_t *w, int64_t N,
                     float *out) {
    int16_t *x16 = malloc(sizeof(int16_t) * (size_t)K);
    float *sx = malloc(sizeof(float) * (size_t)(2 * (K / QK)));
    if (!x16 || !sx) {
        free(x16);
        free(sx);
        return -2;
    }
    splitserve_round_row16(x, K, x16, sx, sx + K / QK);
    const int64_t chunk = 16;
    int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (path == ISA_AVX512)
            splitserve_row16_range(qtype, x16, sx, sx + K / QK, K, w, n0, n1, out);
        else
            splitserve_row16_avx2_range(qtype, x16, sx, sx + K / QK, K, w, n0, n1, out);
    }
    free(x16);
    free(sx);
    return 0;
}

/* out[M, N] = x[M, K] @ dequant(w[N, K]).T on the instruction set isa (0 portable, 1 AVX2,
 * 2 AVX-512), or the widest below it that this CPU runs. il: w's interleaved copy
 * (splitserve_interleave), or NULL. isa | BLOCKS_INVARIANT: every row of x is summed in one
 * order whatever M (and wherever it is among the rows): the interleaved copy at every row count
 * (its sums are one chain per row and output, blocks_interleaved.c), else passes with as many
 * accumulators at every row count (blocks.h's BLOCK_TILES), never the one-row 16-bit path.
 * Each output is one thread's at any thread count, so the split between threads changes
 * nothing either.
 * Returns 0, -1 for an unknown qtype or K not a multiple of its block's values, -2 when
 * scratch memory cannot be had. */
int splitserve_block_matmul(int qtype, int isa, const float *x, int64_t M, int64_t K,
                            const uint8_t *w, const uint8_t *il, int64_t N, float *out) {
    if (block_bytes(qtype) < 0 || K % block_values(qtype)) return -1;
    int invariant = (isa & BLOCKS_INVARIANT) != 0, best = splitserve_best_isa();
    isa &= ~BLOCKS_INVARIANT;
    isa = isa < best ? isa : best;
    int interleaved = takes_interleaved(qtype, isa, il, M, invariant);
    int path = M == 1 && !invariant && !interleaved ? row16(qtype, isa) : ISA_PORTABLE;
    if (path != ISA_PORTABLE) return one_row16(qtype, path, x, K, w, N, out);
    if (interleaved) {
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
        matmul_range(qtype, isa, invariant, x, M, K, w, n0, n1, out, N);
    }
    return 0;
}

/* Bytes of w[N, K]'s interleaved copy: an even number of 16-output groups; 0 for a type that
 * has none. */
int64_t splitserve_interleaved_bytes(int qtype, int64_t N, int64_t K) {
    if (!interleavable(qtype)) return 0;
    int64_t groups = (N + 15) / 16;
    return (groups + groups % 2) * 16 * (K / QK) * block_bytes(qtype);
}

/* w[N, K] (GGUF rows) -> il, its interleaved copy (blocks_interleaved.c describes the layout).
 * Q4_0, Q4_1, Q8_0 only (splitserve_interleaved_bytes is 0 for the others). */
void splitserve_interleave(int qtype, const uint8_t *w, int64_t N, int64_t K, uint8_t *il) {
    if (!interleavable(qtype)) return;
    int64_t nb = K / QK, bytes = block_bytes(qtype), gbytes = 16 * bytes;
    int64_t header = block_header(qtype), data = bytes - header;
    memset(il, 0, (size_t)splitserve_interleaved_bytes(qtype, N, K));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t o = n % 16;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = w + (n * nb + b) * bytes;
            uint8_t *dst = il + ((n / 16) * nb + b) * gbytes;
            memcpy(dst + 2 * o, src, 2);                             /* d */
            if (qtype == Q4_1) memcpy(dst + 32 + 2 * o, src + 2, 2); /* m */
            for (int64_t j = 0; j < data; j++) dst[16 * header + 16 * j + o] = src[header + j];
        }
    }
}
