/* Causal attention of a prefill chunk on the CPU, float32: the new tokens' queries over their
 * sequence's context (the cached prefix and the chunk itself).
 *
 * torch's CPU flash kernel took no grouped K/V and ran at 44-75 GFLOP/s on one Zen 5 thread
 * (SmolLM2, 256 to 2048 tokens): at 2048 tokens attention was half of a prefill. Here each
 * task takes one KV head and a few query rows with all the query heads of that KV head
 * ("query vectors", R rows x G heads), and runs in three steps:
 *   scores  per 32 keys, the K rows transposed once per call (KT: D x 32 floats), so a query
 *           vector's element is broadcast against 32 keys' elements: FMAs into 2 x 8
 *           accumulators, no horizontal sums;
 *   softmax per query vector over the keys it sees (the max taken in the score pass, then
 *           e^(s - max) and the sum), masked keys 0;
 *   values  per key, its V row added into the outputs of 4 query vectors at a time (D = 64; 2
 *           at D = 128).
 * The output is divided by the sum last. The arithmetic is torch's up to summation order and
 * the exponential (vec16.h's exp16), so results agree to float32
 * rounding, not bits (tests/test_native_kernels.py compares them).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast") /* the library is built without contraction */
#endif

#include "vec16.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define INLINE static inline __attribute__((always_inline))

#define KB 32   /* keys per transposed block */
#define QV 8    /* query vectors per score pass */
#define ROWS 8  /* query rows per task */

/* Block b of KV head g's KT: keys [32 b, 32 b + 32) as D rows of 32 (zeros past T). */
static void transpose_block(const float *k, int64_t T, int Hkv, int D, int g, int64_t b,
                            float *blk) {
    for (int t = 0; t < KB; t++) {
        int64_t key = b * KB + t;
        if (key >= T) {
            for (int d = 0; d < D; d++) blk[d * KB + t] = 0.0f;
            continue;
        }
        const float *row = k + (key * Hkv + g) * D;
        for (int d = 0; d < D; d++) blk[d * KB + t] = row[d];
    }
}

INLINE v16 max16(v16 a, v16 b) {
    vi16 above = a > b;
    return (v16)(((vi16)a & above) | ((vi16)b & ~above));
}

/* The 16 lanes of s at keys [t0, t0 + 16) that a query vector seeing keys [0, seen) sees,
 * others -inf. */
INLINE v16 seen16(v16 s, int64_t t0, int64_t seen) {
    if (t0 + 16 <= seen) return s;
    const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vi16 in = iota < (float)(seen - t0);
    return (v16)(((vi16)s & in) | ((vi16)((v16){0} - INFINITY) & ~in));
}

/* scores[j][t] = scale * q_j . k_t for the n <= QV query vectors qp[j] and keys [0, keys);
 * best[j]: the largest score of the keys [0, seen[j]) vector j sees. */
INLINE void score_pass(const float *const *qp, int n, const float *kt, int64_t keys, int D,
                       float scale, float *scores, int64_t stride, const int64_t *seen,
                       float *best) {
    v16 most[QV];
    for (int j = 0; j < QV; j++) most[j] = (v16){0} - INFINITY;
    for (int64_t t0 = 0; t0 < keys; t0 += KB) {
        const float *blk = kt + t0 * D;
        v16 acc[QV][2];
        for (int j = 0; j < QV; j++) acc[j][0] = acc[j][1] = (v16){0};
        for (int d = 0; d < D; d++) {
            v16 k0 = load16(blk + d * KB), k1 = load16(blk + d * KB + 16);
            for (int j = 0; j < QV; j++) {
                if (j < n) {
                    float x = qp[j][d];
                    acc[j][0] += x * k0;
                    acc[j][1] += x * k1;
                }
            }
        }
        for (int j = 0; j < n; j++) {
            v16 s0 = acc[j][0] * scale, s1 = acc[j][1] * scale;
            most[j] = max16(most[j], max16(seen16(s0, t0, seen[j]), seen16(s1, t0 + 16, seen[j])));
            float *row = scores + j * stride + t0;
            if (t0 + KB <= keys) {
                store16(row, s0);
                store16(row + 16, s1);
            } else {
                float part[KB];
                store16(part, s0);
                store16(part + 16, s1);
                memcpy(row, part, (size_t)(keys - t0) * sizeof(float));
            }
        }
    }
    for (int j = 0; j < n; j++) {
        best[j] = -INFINITY;
        for (int i = 0; i < 16; i++) best[j] = most[j][i] > best[j] ? most[j][i] : best[j];
    }
}

/* In place over keys [0, seen): e^(s - best); zeros over [seen, keys). Returns the sum. */
INLINE float softmax_row(float *s, int64_t seen, int64_t keys, float best) {
    v16 sums = {0};
    float total = 0.0f;
    int64_t t = 0;
    for (; t + 16 <= seen; t += 16) {
        v16 e = exp16(load16(s + t) - best);
        store16(s + t, e);
        sums += e;
    }
    for (; t < seen; t++) {
        s[t] = expf(s[t] - best);
        total += s[t];
    }
    for (int i = 0; i < 16; i++) total += sums[i];
    for (t = seen; t < keys; t++) s[t] = 0.0f;
    return total;
}

/* out_j = sum_t p[j][t] v_t / totals[j] for n query vectors (D = 16 C floats; n C <= 16).
 * Called with constant n and C (value_any), the accumulators stay in registers. */
INLINE void value_pass(const float *p, int64_t stride, int n, int C, const float *v,
                       int64_t vstride, int64_t keys, const float *totals, float *const *op) {
    v16 acc[16];
    for (int i = 0; i < n * C; i++) acc[i] = (v16){0};
    for (int64_t t = 0; t < keys; t++) {
        const float *row = v + t * vstride;
        for (int j = 0; j < n; j++) {
            float w = p[j * stride + t];
            for (int c = 0; c < C; c++) acc[j * C + c] += w * load16(row + 16 * c);
        }
    }
    for (int j = 0; j < n; j++)
        for (int c = 0; c < C; c++) store16(op[j] + 16 * c, acc[j * C + c] * (1.0f / totals[j]));
}

/* value_pass over n vectors, four (D = 64), two (D = 128) or one at a time. */
INLINE void value_any(const float *p, int64_t stride, int n, int C, const float *v,
                      int64_t vstride, int64_t keys, const float *totals, float *const *op) {
#define VALUE(m, c) value_pass(p + j * stride, stride, m, c, v, vstride, keys, totals + j, op + j)
    int j = 0;
    if (C == 4)
        for (; j + 4 <= n; j += 4) VALUE(4, 4);
    if (C == 8)
        for (; j + 2 <= n; j += 2) VALUE(2, 8);
    for (; j < n; j++) {
        if (C == 4)
            VALUE(1, 4);
        else if (C == 8)
            VALUE(1, 8);
        else
            VALUE(1, C);
    }
#undef VALUE
}

/* One task: query rows [i0, i1) of the chunk, the G query heads of KV head g. */
CLONES static void attend_rows(const float *q, const float *kt, const float *v, int64_t L,
                               int64_t T, int H, int Hkv, int D, int g, int64_t i0, int64_t i1,
                               float scale, float *scores, float *out) {
    int G = H / Hkv, C = D / 16, vectors = (int)(i1 - i0) * G;
    int64_t keys = T - L + i1; /* the last row sees this many */
    const float *qp[ROWS * 8];
    float *op[ROWS * 8], best[ROWS * 8], totals[ROWS * 8];
    int64_t seen[ROWS * 8];
    for (int j = 0; j < vectors; j++) {
        int64_t row = i0 + j / G;
        int h = g * G + j % G;
        qp[j] = q + (row * H + h) * D;
        op[j] = out + (row * H + h) * D;
        seen[j] = T - L + row + 1;
    }
    for (int j0 = 0; j0 < vectors; j0 += QV) {
        int n = vectors - j0 < QV ? vectors - j0 : QV;
        score_pass(qp + j0, n, kt, keys, D, scale, scores + j0 * keys, keys, seen + j0,
                   best + j0);
    }
    for (int j = 0; j < vectors; j++)
        totals[j] = softmax_row(scores + j * keys, seen[j], keys, best[j]);
    value_any(scores, keys, vectors, C, v + g * D, (int64_t)Hkv * D, keys, totals, op);
}

/* q [L, H, D]: the chunk's queries (rotated), at positions T - L to T - 1 of the sequence;
 * k, v [T, Hkv, D]: the sequence's keys and values up to the chunk's last token; out [L, H, D].
 * D a multiple of 16 up to 256, H / Hkv at most 8. Returns 0, -1 for a shape it does not take,
 * -2 when scratch memory cannot be had. */
int splitserve_prefill_attention(const float *q, const float *k, const float *v, int64_t L,
                                 int64_t T, int H, int Hkv, int D, float scale, float *out) {
    if (D % 16 || D > 256 || H % Hkv || H / Hkv > 8 || L > T || L < 1) return -1;
    int64_t blocks = (T + KB - 1) / KB, rows_tasks = (L + ROWS - 1) / ROWS;
    float *kt = malloc(sizeof(float) * (size_t)(Hkv * blocks * KB) * (size_t)D);
    if (!kt) return -2;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Hkv * blocks; i++)
        transpose_block(k, T, Hkv, D, (int)(i / blocks), i % blocks, kt + i * KB * D);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(ROWS * H / Hkv) * (size_t)T);
        if (!scores) failed = 1;
        /* the last rows first: they see the most keys */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < rows_tasks * Hkv; task++) {
            if (failed) continue;
            int64_t r = rows_tasks - 1 - task / Hkv, i0 = r * ROWS;
            int64_t i1 = i0 + ROWS < L ? i0 + ROWS : L;
            int g = (int)(task % Hkv);
            attend_rows(q, kt + g * blocks * KB * D, v, L, T, H, Hkv, D, g, i0, i1, scale,
                        scores, out);
        }
        free(scores);
    }
    free(kt);
    return failed ? -2 : 0;
}
