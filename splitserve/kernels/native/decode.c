/* One decode token per sequence on the CPU, float32: the pieces of a decoder layer that were
 * a dozen small torch ops each (RMSNorm with its residual add, rotary + K/V write + paged
 * attention, SiLU-and-mul), as one call each.
 *
 * The arithmetic follows the torch code it replaces (engine/layers/norm.py, rotary.py,
 * attention.py, activation.py) operation by operation in float32; sums run in another order
 * (and, in the AVX-512 and AVX2 clones, in vector lanes), so results agree to float32 rounding,
 * not bits.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "vec16.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

/* sum = x + residual (x alone when residual is NULL); out = weight * (sum * rsqrt(mean(sum^2) + eps)) */
CLONES void splitserve_add_rms_norm(const float *x, const float *residual, const float *weight,
                                    float eps, int64_t M, int64_t K, float *out, float *sum) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *s = sum + m * K, *o = out + m * K;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t k = 0; k < K; k++) {
            float v = residual ? xr[k] + residual[m * K + k] : xr[k];
            s[k] = v;
            squares += v * v;
        }
        float inv = 1.0f / sqrtf(squares / (float)K + eps);
#pragma omp simd
        for (int64_t k = 0; k < K; k++) o[k] = weight[k] * (s[k] * inv);
    }
}

/* Rotate-half rotary of one head in place: x * cos + cat(-x2, x1) * sin. */
static void rotate(float *x, const float *cos, const float *sin, int D) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + (-b) * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

#define INLINE static inline __attribute__((always_inline))

/* attend_any's inner loops (compilers vectorize them). */
INLINE float dot(const float *a, const float *b, int D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < D; i++) s += a[i] * b[i];
    return s;
}

INLINE void axpy(float a, const float *x, float *y, int D) {
#pragma omp simd
    for (int i = 0; i < D; i++) y[i] += a * x[i];
}

typedef float v4 __attribute__((vector_size(16)));

/* x [M, 2I] = gate | up -> out [M, I] = silu(gate) * up, 16 lanes at a time: silu(g) = g s
 * with s = 1 / (1 + e^-g) taken from e = e^-|g| (exp16 wants x <= 0): s = 1 / (1 + e) where
 * g >= 0, e / (1 + e) below. A scalar expf per element was 4% of a batch-32 SmolLM2 step. */
CLONES void splitserve_silu_and_mul(const float *x, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        const float *g = x + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            v16 gv = load16(g + i);
            vi16 below = gv < 0.0f;
            v16 e = exp16((v16)(((vi16)gv & below) | ((vi16)(-gv) & ~below)));
            v16 num = (v16)(((vi16)e & below) | ((vi16)((v16){0} + 1.0f) & ~below));
            v16 r = gv * (num / (1.0f + e)) * load16(u + i);
            __builtin_memcpy(o + i, &r, sizeof r);
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Asks for rows i0 to i1 - 1 (stride floats apart, C 64-byte lines each) of a block whose
 * first row is at rows; NULL asks for nothing. The walks ask for the next block while they
 * read one, as a sequence's blocks lie anywhere in the pool and the hardware prefetchers do
 * not follow them. */
INLINE void prefetch_rows(const float *rows, int64_t i0, int64_t i1, int64_t stride, int C) {
    if (!rows) return;
    for (int64_t i = i0; i < i1; i++)
        for (int c = 0; c < C; c++) __builtin_prefetch(rows + i * stride + 16 * c, 0, 3);
}

/* prefetch_rows for every row of block blk of a sequence's table (which starts at token t0)
 * that is in the context, from float base of a row. */
INLINE void prefetch_block(const float *cache, const int64_t *table, int64_t blk, int64_t t0,
                           int64_t context, int64_t block_size, int64_t stride, int64_t base,
                           int C) {
    if (t0 >= context) return;
    int64_t n = context - t0 < block_size ? context - t0 : block_size;
    prefetch_rows(cache + table[blk] * block_size * stride + base, 0, n, stride, C);
}

/* The first row (from float base) of block blk of a sequence's table, which starts at token
 * t0, if a whole block of it is in the context, else NULL (a partial last block is not
 * prefetched row by row). */
INLINE const float *next_rows(const float *cache, const int64_t *table, int64_t blk, int64_t t0,
                              int64_t context, int64_t block_size, int64_t stride, int64_t base) {
    if (t0 + block_size > context) return NULL;
    return cache + table[blk] * block_size * stride + base;
}

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
int splitserve_attention_lanes = 0;

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

/* Scores of rows i0 to n - 1 of a cached block (kb: its first row, at the KV heads read)
 * against each query head, to scores[h * context + i], and each head's maximum so far; C
 * (16-float slices of a head) a constant where the caller can make it one. */
INLINE void score_rows(const float *q, int heads, int group, int C, int wide, const float *kb,
                       int64_t stride, int64_t i0, int64_t n, const float *next, int lines,
                       float scale, float *scores, int64_t context, float *best) {
    const int D = 16 * C;
    for (int64_t i = i0; i < n; i++) {
        prefetch_rows(next, i, i + 1, stride, lines);
        for (int h = 0; h < heads; h++) {
            const float *k = kb + i * stride + (h / group) * D;
            float s = (wide ? dot16(q + h * D, k, C) : dot16_8(q + h * D, k, C)) * scale;
            scores[h * context + i] = s;
            if (s > best[h]) best[h] = s;
        }
    }
}

/* Attention of one sequence's query heads over its cached tokens start to context - 1 (start
 * past 0 for a sliding window) for KV heads g0 to g1 - 1
 * (D a multiple of 16; q and out [(g1 - g0) * group, D], scores (g1 - g0) * group * context
 * floats). Walks the block table a block at a time: each cached K row is scored against
 * every query head of those KV heads while it is loaded, then the softmax of each head, then
 * a second walk adds each block's V rows into every head's sums. All KV heads of a sequence
 * in one walk read its blocks whole (Hkv * D floats a row), which the hardware prefetchers
 * follow; one KV head at a time read a third of each row for SmolLM2 and ran at a quarter of
 * the read bandwidth. Every head's sums run in the same order either way, so the results do
 * not depend on the split. Out-of-line calls of a generic dot per token and head made this a
 * quarter of a batch-32 SmolLM2 step; a walk over V per head and 16-float slice (12 walks for
 * SmolLM2) took half of it again. */
CLONES static void attend(const float *q, int group, int D, const float *k_cache,
                          const float *v_cache, int64_t Hkv, int g0, int g1,
                          int64_t block_size, const int64_t *table, int64_t start,
                          int64_t context, float scale, float *scores, float *out) {
    const int C = D / 16, heads = (g1 - g0) * group;
    const int64_t stride = Hkv * D, base = (int64_t)g0 * D;
    const int lines = (g1 - g0) * C;  /* 64-byte lines of a row that are read */
    if (context <= start) {  /* no cached token: zeros, as a sum over nothing */
        for (int64_t i = 0; i < (int64_t)heads * D; i++) out[i] = 0.0f;
        return;
    }
    const int64_t first = start / block_size;
    const int wide = lanes16();
    float best[heads], total[heads];
    for (int h = 0; h < heads; h++) best[h] = -INFINITY, total[h] = 0.0f;
    for (int64_t blk = first, t0 = first * block_size; t0 < context; t0 += block_size, blk++) {
        int64_t n = context - t0 < block_size ? context - t0 : block_size;
        const float *kb = k_cache + table[blk] * block_size * stride + base;
        const float *next = next_rows(k_cache, table, blk + 1, t0 + block_size, context,
                                      block_size, stride, base);
        int64_t i0 = t0 < start ? start - t0 : 0;
        float *at = scores + t0;
        switch (C) {  /* the dot's loop unrolled for the usual head sizes */
        case 4: score_rows(q, heads, group, 4, wide, kb, stride, i0, n, next, lines, scale, at,
                           context, best); break;
        case 8: score_rows(q, heads, group, 8, wide, kb, stride, i0, n, next, lines, scale, at,
                           context, best); break;
        default: score_rows(q, heads, group, C, wide, kb, stride, i0, n, next, lines, scale, at,
                            context, best);
        }
    }
    prefetch_block(v_cache, table, first, first * block_size, context, block_size, stride, base,
                   lines);
    for (int h = 0; h < heads; h++) {
        float *sh = scores + h * context;
        int64_t t = start;
        float lanes;  /* the vector lanes' sum, added after the tail's */
        if (wide) {
            v16 sums = {0}, top = (v16){0} + best[h];
            for (; t + 16 <= context; t += 16) {
                v16 e = exp16(load16(sh + t) - top);
                __builtin_memcpy(sh + t, &e, sizeof e);
                sums += e;
            }
            lanes = hsum16(sums);
        } else {  /* the same in 8-float halves: lo and hi are sums' lanes 0-7 and 8-15 */
            v8 lo = {0}, hi = {0}, top = (v8){0} + best[h];
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
            sh[t] = expf(sh[t] - best[h]);
            total[h] += sh[t];
        }
        total[h] += lanes;
        for (t = start; t < context; t++) sh[t] = sh[t] / total[h];
    }
    for (int64_t blk = first, t0 = first * block_size; t0 < context; t0 += block_size, blk++) {
        int64_t n = context - t0 < block_size ? context - t0 : block_size;
        int64_t i0 = t0 < start ? start - t0 : 0;  /* rows of the block before the window */
        const float *vb = v_cache + table[blk] * block_size * stride + base + i0 * stride;
        const float *next = next_rows(v_cache, table, blk + 1, t0 + block_size, context,
                                      block_size, stride, base);
        for (int g = 0, G = g1 - g0; g < G; g++) {
            /* the next block's rows asked for a share before each KV head's sums */
            prefetch_rows(next, g * block_size / G, (g + 1) * block_size / G, stride, lines);
            vsum_any(scores + (int64_t)g * group * context + t0 + i0, context, group, C,
                     vb + (int64_t)g * D, stride, n - i0, out + (int64_t)g * group * D,
                     blk == first, wide);
        }
    }
}

/* The same for any D, one cached token at a time. */
static void attend_any(const float *q, int group, int D, const float *k_cache,
                       const float *v_cache, int64_t Hkv, int g, int64_t block_size,
                       const int64_t *table, int64_t start, int64_t context, float scale,
                       float *scores, float *out) {
    for (int h = 0; h < group; h++) {
        const float *qh = q + h * D;
        float best = -INFINITY, total = 0.0f;
        for (int64_t t = start; t < context; t++) {
            const float *k = k_cache + ((table[t / block_size] * block_size + t % block_size) * Hkv + g) * D;
            scores[t] = dot(qh, k, D) * scale;
            if (scores[t] > best) best = scores[t];
        }
        for (int64_t t = start; t < context; t++) {
            scores[t] = expf(scores[t] - best);
            total += scores[t];
        }
        float *oh = out + h * D;
        for (int i = 0; i < D; i++) oh[i] = 0.0f;
        for (int64_t t = start; t < context; t++) {
            const float *v = v_cache + ((table[t / block_size] * block_size + t % block_size) * Hkv + g) * D;
            axpy(scores[t] / total, v, oh, D);
        }
    }
}

/* qkv [B, (H + 2 Hkv) D] of B decode tokens, before rotary -> out [B, H D].
 * Rotates q and k at positions[b] (cos/sin tables [max_positions, D]), writes k and v to
 * slots[b] of the paged caches [blocks, block_size, Hkv, D] (a negative slot is padding and
 * is not written), then attends over the first context_lens[b] tokens of block_tables[b], or
 * over their last window (window > 0; a Gemma 3 local layer's). Returns 0, or -1 when scratch
 * memory cannot be had. */
int splitserve_decode_attention(const float *qkv, int64_t B, int H, int Hkv, int D,
                                const int64_t *positions, const float *cos, const float *sin,
                                float *k_cache, float *v_cache, int64_t block_size,
                                const int64_t *slots, const int64_t *block_tables,
                                int64_t max_blocks, const int64_t *context_lens, float scale,
                                int64_t window, float *out) {
    int64_t width = (int64_t)(H + 2 * Hkv) * D;
    int group = H / Hkv, failed = 0;
    for (int64_t b = 0; b < B; b++) {
        if (slots[b] < 0) continue;
        const float *row = qkv + b * width, *c = cos + positions[b] * D, *s = sin + positions[b] * D;
        for (int g = 0; g < Hkv; g++) {
            float *k = k_cache + (slots[b] * Hkv + g) * D, *v = v_cache + (slots[b] * Hkv + g) * D;
            for (int i = 0; i < D; i++) {
                k[i] = row[(H + g) * D + i];
                v[i] = row[(H + Hkv + g) * D + i];
            }
            rotate(k, c, s, D);
        }
    }
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++) longest = context_lens[b] > longest ? context_lens[b] : longest;
    /* A task: all KV heads of a sequence (its blocks read whole), or one KV head of it where
     * there are fewer sequences than two per thread (batch 1 on two threads: three tasks), or
     * a share of that KV head's query heads where there are still fewer tasks than threads
     * (Gemma 3's one KV head at batch 1: each thread takes two of its four query heads). */
    int threads = omp_get_max_threads();
    int whole = D % 16 == 0 && B >= 2 * threads;
    int64_t per = whole ? Hkv : 1;
    int shares = !whole && D % 16 == 0 && B * Hkv < threads ? (int)(threads / (B * Hkv)) : 1;
    shares = shares < group ? shares : group;
    int share = (group + shares - 1) / shares; /* query heads of a share (the last: the rest) */
    shares = (group + share - 1) / share;
    int64_t tasks = B * (Hkv / per) * shares;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(per * group) * (size_t)longest);
        float *q = malloc(sizeof(float) * (size_t)(per * group) * D);
        if (!scores || !q) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            int64_t b = task / shares / (Hkv / per), context = context_lens[b];
            int64_t start = window > 0 && context > window ? context - window : 0;
            int g0 = (int)(task / shares % (Hkv / per) * per), g1 = g0 + (int)per;
            int h0 = (int)(task % shares) * share;              /* first query head of the */
            int heads = shares > 1 ? (group - h0 < share ? group - h0 : share) : group; /* share */
            const float *row = qkv + b * width;
            const float *c = cos + positions[b] * D, *s = sin + positions[b] * D;
            for (int h = 0; h < (g1 - g0) * heads; h++) {
                int from = shares > 1 ? g0 * group + h0 + h : g0 * group + h;
                for (int i = 0; i < D; i++) q[h * D + i] = row[from * D + i];
                rotate(q + h * D, c, s, D);
            }
            float *o = out + b * (int64_t)H * D + ((int64_t)g0 * group + h0) * D;
            const int64_t *table = block_tables + b * max_blocks;
            if (D % 16)
                attend_any(q, group, D, k_cache, v_cache, Hkv, g0, block_size, table, start,
                           context, scale, scores, o);
            else
                attend(q, heads, D, k_cache, v_cache, Hkv, g0, g1, block_size, table, start,
                       context, scale, scores, o);
        }
        free(scores);
        free(q);
    }
    return failed ? -1 : 0;
}

/* x [M, 2I] = gate | up -> out [M, I] = gelu(gate) * up with GELU's tanh approximation,
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Gemma's GeGLU), 16 lanes at a time:
 * tanh(u) = sign(u) (1 - e) / (1 + e) with e = e^(-2 |u|). */
CLONES void splitserve_gelu_tanh_and_mul(const float *x, int64_t M, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        const float *g = x + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            v16 gv = load16(g + i);
            v16 arg = 0.7978845608f * (gv + 0.044715f * gv * gv * gv);
            vi16 negative = arg < 0.0f;
            v16 magnitude = (v16)(((vi16)(-arg) & negative) | ((vi16)arg & ~negative));
            v16 e = exp16(-2.0f * magnitude);
            v16 t = (1.0f - e) / (1.0f + e);
            t = (v16)(((vi16)(-t) & negative) | ((vi16)t & ~negative));
            store16(o + i, 0.5f * gv * (1.0f + t) * load16(u + i));
        }
        for (; i < I; i++) {
            float arg = 0.7978845608f * (g[i] + 0.044715f * g[i] * g[i] * g[i]);
            o[i] = 0.5f * g[i] * (1.0f + tanhf(arg)) * u[i];
        }
    }
}

/* ---- every decoder layer of a Llama-family model for B decode tokens, one call ---- */
int splitserve_block_matmul(int qtype, int isa, const float *x, int64_t M, int64_t K,
                            const uint8_t *w, const uint8_t *il, int64_t N, float *out);

/* Per layer, W_COUNT addresses: the four projections' GGUF blocks, the norms before attention
 * and MLP, the K and V caches, the projections' interleaved copies (or 0), then what some
 * families add (0 where absent): RMSNorms over each query and key head (Qwen3, Gemma 3), norms
 * of the attention's and the MLP's outputs (Gemma 3), and the layer's rotary tables (cos, sin
 * [max_positions, D]: Gemma 3's local layers have their own base). */
enum {
    W_QKV, W_O, W_GATE_UP, W_DOWN, W_LN1, W_LN2, W_K_CACHE, W_V_CACHE,
    IL_QKV, IL_O, IL_GATE_UP, IL_DOWN, W_Q_NORM, W_K_NORM, W_POST_ATTN, W_POST_MLP, W_COS, W_SIN,
    W_COUNT
};
/* Per layer, L_COUNT integers: the KV cache group whose rows it reads, its sliding window (0:
 * none), its cache's block size, its MLP's activation (0 SiLU, 1 GELU-tanh). */
enum { L_GROUP, L_WINDOW, L_BLOCK, L_GELU, L_COUNT };
/* Per KV cache group, G_COUNT addresses or sizes: the step's slots, block tables, the tables'
 * width, context lengths (as splitserve_decode_attention takes them). */
enum { G_SLOTS, G_TABLES, G_MAX_BLOCKS, G_LENS, G_COUNT };
enum { D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_LAYERS, D_COUNT };

/* RMSNorm of each of n vectors of D floats at x, every stride floats, in place (tmp: n D). */
static void norm_heads(float *x, int64_t B, int64_t stride, int64_t n, int64_t D,
                       const float *weight, float eps, float *tmp) {
    for (int64_t b = 0; b < B; b++)
        splitserve_add_rms_norm(x + b * stride, NULL, weight, eps, n, D, x + b * stride, tmp);
}

/* x [B, hidden]: the embeddings, overwritten with the last layer's MLP output; residual
 * [B, hidden] receives the residual stream (the final norm adds the two). layers, ints,
 * groups: W_COUNT addresses and L_COUNT integers per layer, G_COUNT per KV cache group;
 * types: the four projections' GGUF types per layer; dims: D_COUNT sizes.
 * scratch: B * (3 hidden + qkv width + H D + 3 I) + H D floats. isa: that of
 * splitserve_block_matmul. Each step is the native call the modules make (the norms, the
 * products, splitserve_decode_attention, the activation), in the same order, so the results
 * equal the module path's where it makes the same calls (engine/layers/native_decode.py). */
int splitserve_decode_layers(float *x, float *residual, int64_t B, const uint64_t *layers,
                             const int64_t *ints, const int32_t *types, const int64_t *dims,
                             const uint64_t *groups, float eps, float scale,
                             const int64_t *positions, float *scratch, int isa) {
    int64_t hidden = dims[D_HIDDEN], H = dims[D_HEADS], Hkv = dims[D_KV_HEADS];
    int64_t D = dims[D_HEAD_DIM], I = dims[D_INTER], width = (H + 2 * Hkv) * D;
    float *h = scratch, *qkv = h + B * hidden, *attn = qkv + B * width;
    float *gate_up = attn + B * H * D, *act = gate_up + B * 2 * I, *out = act + B * I;
    float *tmp = out + B * hidden; /* B hidden + H D */
    for (int64_t l = 0; l < dims[D_LAYERS]; l++) {
        const uint64_t *p = layers + l * W_COUNT;
        const int64_t *li = ints + l * L_COUNT;
        const uint64_t *g = groups + li[L_GROUP] * G_COUNT;
        const int32_t *t = types + l * 4;
        splitserve_add_rms_norm(x, l ? residual : NULL, (const float *)p[W_LN1], eps, B, hidden,
                                h, residual);
        if (splitserve_block_matmul(t[0], isa, h, B, hidden, (const uint8_t *)p[W_QKV],
                                    (const uint8_t *)p[IL_QKV], width, qkv))
            return -1;
        if (p[W_Q_NORM]) {
            norm_heads(qkv, B, width, H, D, (const float *)p[W_Q_NORM], eps, tmp);
            norm_heads(qkv + H * D, B, width, Hkv, D, (const float *)p[W_K_NORM], eps, tmp);
        }
        if (splitserve_decode_attention(
                qkv, B, (int)H, (int)Hkv, (int)D, positions, (const float *)p[W_COS],
                (const float *)p[W_SIN], (float *)p[W_K_CACHE], (float *)p[W_V_CACHE],
                li[L_BLOCK], (const int64_t *)g[G_SLOTS], (const int64_t *)g[G_TABLES],
                (int64_t)g[G_MAX_BLOCKS], (const int64_t *)g[G_LENS], scale, li[L_WINDOW], attn))
            return -2;
        if (splitserve_block_matmul(t[1], isa, attn, B, H * D, (const uint8_t *)p[W_O],
                                    (const uint8_t *)p[IL_O], hidden, out))
            return -1;
        if (p[W_POST_ATTN])
            splitserve_add_rms_norm(out, NULL, (const float *)p[W_POST_ATTN], eps, B, hidden, out,
                                    tmp);
        splitserve_add_rms_norm(out, residual, (const float *)p[W_LN2], eps, B, hidden, h,
                                residual);
        if (splitserve_block_matmul(t[2], isa, h, B, hidden, (const uint8_t *)p[W_GATE_UP],
                                    (const uint8_t *)p[IL_GATE_UP], 2 * I, gate_up))
            return -1;
        if (li[L_GELU])
            splitserve_gelu_tanh_and_mul(gate_up, B, I, act);
        else
            splitserve_silu_and_mul(gate_up, B, I, act);
        if (splitserve_block_matmul(t[3], isa, act, B, I, (const uint8_t *)p[W_DOWN],
                                    (const uint8_t *)p[IL_DOWN], hidden, x))
            return -1;
        if (p[W_POST_MLP])
            splitserve_add_rms_norm(x, NULL, (const float *)p[W_POST_MLP], eps, B, hidden, x, tmp);
    }
    return 0;
}
