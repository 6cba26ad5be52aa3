/* The pieces of a decode row's attention that decode.c's walk (one row at a time) and
 * decode_rows.c's (several rows of one sequence per pass over the keys) share, so that a row
 * sums alike in both: the horizontal sums, a head's scores' softmax and the V sums.
 * Included by those two files only (its functions are static and inlined).
 */
#ifndef SPLITSERVE_ATTEND_H
#define SPLITSERVE_ATTEND_H
#include <math.h>
#include <stdint.h>

#include "vec16.h"

#define INLINE static inline __attribute__((always_inline))

typedef float v4 __attribute__((vector_size(16)));

/* The sum of 8 lanes, and of 16 as the sum of their halves (lanes 0-7 plus lanes 8-15), so
 * that a 16-float sum kept as two 8-float halves adds up the same. */
INLINE float hsum8(v8 a) {
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

INLINE float hsum16(v16 v) {
    return hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* q . k over D = 16 * C floats, C lanes-wide partial sums then one horizontal sum. */
INLINE float dot16(const float *q, const float *k, int C) {
    v16 acc = load16(q) * load16(k);
    for (int c = 1; c < C; c++) acc += load16(q + 16 * c) * load16(k + 16 * c);
    return hsum16(acc);
}

/* out[h] (+)= sum_i p[h * pstride + i] rows[i] for the G query heads of one KV head over n
 * cached V rows (stride floats apart), D = 16 * C floats: each row's C slices loaded once and
 * added into every head's accumulators (G * C of them). first: start from zero, else from
 * out, which holds the sums of the rows before (stored and loaded exactly, so a walk in
 * pieces sums in the same order as one walk). Called with constant G and C (see vsum_any),
 * the loops unroll and the accumulators stay in registers. */
INLINE void vsum(const float *p, int64_t pstride, int G, int C, const float *rows,
                 int64_t stride, int64_t n, float *out, int64_t D, int first) {
    v16 acc[8][8];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) acc[h][c] = first ? (v16){0} : load16(out + h * D + 16 * c);
    for (int64_t i = 0; i < n; i++) {
        v16 row[8];
        for (int c = 0; c < C; c++) row[c] = load16(rows + i * stride + 16 * c);
        for (int h = 0; h < G; h++) {
            float w = p[h * pstride + i];
            for (int c = 0; c < C; c++) acc[h][c] += w * row[c];
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) __builtin_memcpy(out + h * D + 16 * c, &acc[h][c], 64);
}

/* vsum in 8-float vectors for one query head and W <= 8 of its 8-float slices (out and rows
 * at that slice): the same additions in the same order as vsum's 16-float lanes, so the same
 * bits. Without AVX-512, GCC builds vsum's 16-float vectors from ymm pairs moved through the
 * stack, and the scalar weight's broadcast lane by lane: 46 ns a cached token and head for
 * SmolLM2 on an AVX2-only Zen 2, 3.6 ns this way (8 accumulators and a row slice in 16 ymm). */
INLINE void vsum8(const float *p, int W, const float *rows, int64_t stride, int64_t n, float *out,
                  int first) {
    v8 acc[8];
    for (int c = 0; c < W; c++) acc[c] = first ? (v8){0} : load8(out + 8 * c);
    for (int64_t i = 0; i < n; i++) {
        v8 w = (v8){0} + p[i];
        for (int c = 0; c < W; c++) acc[c] += w * load8(rows + i * stride + 8 * c);
    }
    for (int c = 0; c < W; c++) __builtin_memcpy(out + 8 * c, &acc[c], sizeof acc[c]);
}

/* dot16 in 8-float vectors: the same products and sums in the same order. */
INLINE float dot16_8(const float *q, const float *k, int C) {
    v8 lo = load8(q) * load8(k), hi = load8(q + 8) * load8(k + 8);
    for (int c = 1; c < C; c++) {
        lo += load8(q + 16 * c) * load8(k + 16 * c);
        hi += load8(q + 16 * c + 8) * load8(k + 16 * c + 8);
    }
    return hsum8(lo + hi);
}

/* 8 or 16 forces the attention's scores, softmax and V sums into 8- or 16-float vectors (the
 * tests compare the two); 0, the default, takes 16 where the CPU has AVX-512. */
extern int splitserve_attention_lanes;

INLINE int lanes16(void) {
    int lanes = splitserve_attention_lanes;
    return lanes ? lanes == 16 : __builtin_cpu_supports("avx512f");
}

/* vsum with G and C constant for the shapes of the models served (SmolLM2: 3 and 4; Llama-3
 * and Qwen: 4 to 8 and 8), else the same code with them variable; in 8-float vectors, a head
 * and 64 floats at a time, where 16-float ones are not native (vsum8). */
INLINE void vsum_any(const float *p, int64_t pstride, int G, int C, const float *rows,
                     int64_t stride, int64_t n, float *out, int first, int wide) {
    int64_t D = 16 * C;
    if (!wide) {
        for (int h = 0; h < G; h++) {
            const float *ph = p + h * pstride;
            for (int c0 = 0; c0 < 2 * C; c0 += 8) {
                float *oh = out + h * D + 8 * c0;
                if (2 * C - c0 >= 8)  /* 8 a constant: the common case unrolled */
                    vsum8(ph, 8, rows + 8 * c0, stride, n, oh, first);
                else
                    vsum8(ph, 2 * C - c0, rows + 8 * c0, stride, n, oh, first);
            }
        }
        return;
    }
#define VSUM(g, c) vsum(p, pstride, g, c, rows, stride, n, out, D, first)
    switch (C <= 8 ? G * 16 + C : 0) {  /* one key per (G, C) while C < 16 */
    case 1 * 16 + 4: VSUM(1, 4); return;
    case 2 * 16 + 4: VSUM(2, 4); return;
    case 3 * 16 + 4: VSUM(3, 4); return;
    case 4 * 16 + 4: VSUM(4, 4); return;
    case 1 * 16 + 8: VSUM(1, 8); return;
    case 2 * 16 + 8: VSUM(2, 8); return;
    default: break;
    }
#undef VSUM
    for (int h0 = 0; h0 < G; h0 += 2) {  /* two heads at a time for the rest */
        int g = G - h0 < 2 ? G - h0 : 2;
        for (int c0 = 0; c0 < C; c0 += 4) {
            int c = C - c0 < 4 ? C - c0 : 4;
            vsum(p + h0 * pstride, pstride, g, c, rows + 16 * c0, stride, n,
                 out + h0 * D + 16 * c0, D, first);
        }
    }
}

/* A head's scores sh[start, context), whose largest is best, to their softmax in place:
 * e^(s - best) 16 at a time (in 8-float halves where !wide: the same bits), the rest by
 * expf, each divided by the total (the rest's sum, then the vector lanes' sum added). */
INLINE void softmax_head(float *sh, int64_t start, int64_t context, float best, int wide) {
    int64_t t = start;
    float lanes, total = 0.0f;
    if (wide) {
        v16 sums = {0}, top = (v16){0} + best;
        for (; t + 16 <= context; t += 16) {
            v16 e = exp16(load16(sh + t) - top);
            __builtin_memcpy(sh + t, &e, sizeof e);
            sums += e;
        }
        lanes = hsum16(sums);
    } else { /* lo and hi are sums' lanes 0-7 and 8-15 */
        v8 lo = {0}, hi = {0}, top = (v8){0} + best;
        for (; t + 16 <= context; t += 16) {
            v8 e0 = exp8(load8(sh + t) - top), e1 = exp8(load8(sh + t + 8) - top);
            __builtin_memcpy(sh + t, &e0, sizeof e0);
            __builtin_memcpy(sh + t + 8, &e1, sizeof e1);
            lo += e0;
            hi += e1;
        }
        lanes = hsum8(lo + hi);
    }
    for (; t < context; t++) {
        sh[t] = expf(sh[t] - best);
        total += sh[t];
    }
    total += lanes;
    for (t = start; t < context; t++) sh[t] = sh[t] / total;
}

/* decode_rows.c: attention of rows rows of one sequence (q, out [rows, H, D], q rotated) over
 * its first lens[r] tokens, in the blocks of table (which holds the longest row's), with each
 * row's operations those of decode.c's walk. D a multiple of 16. Returns 0, or -1 when
 * scratch memory cannot be had. */
int splitserve_attend_rows(const float *q, int64_t rows, int H, int Hkv, int D,
                           const float *k_cache, const float *v_cache, int64_t block_size,
                           const int64_t *table, const int64_t *lens, float scale, float *out);
#endif
