/* One decode token per sequence on the CPU, float32: the pieces of a decoder layer that were
 * a dozen small torch ops each (RMSNorm with its residual add, rotary + K/V write + paged
 * attention, SiLU-and-mul), as one call each.
 *
 * The arithmetic follows the torch code it replaces (engine/layers/norm.py, rotary.py,
 * attention.py, activation.py) operation by operation in float32; sums run in another order
 * (and, in the AVX-512 and AVX2 clones, in vector lanes), so results agree to float32 rounding,
 * not bits. Runs of rows of one sequence (prompt rows, verify rows) attend in decode_rows.c,
 * with the same bits a row as here (attend.h holds what the two share).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "attend.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

int splitserve_attention_lanes = 0; /* attend.h: 8, 16, or 0 for the CPU's best */

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
    float best[heads];
    for (int h = 0; h < heads; h++) best[h] = -INFINITY;
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
    for (int h = 0; h < heads; h++)
        softmax_head(scores + h * context, start, context, best[h], wide);
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

/* Rows of one sequence a run needs to take decode_rows.c, which transposes the keys first:
 * below 8 rows over 1,024 cached tokens the one-row walk was as fast or faster (SmolLM2's
 * shape on an Intel Xeon: 2 rows 129 against 155 us on one thread, 4 rows 120 against 140
 * on two; 8 rows 232 against 203 on two). */
#define RUN_ROWS 8

/* The end of the run of rows from b on that are positions of one sequence (a prompt chunk
 * laid out as decode rows, a verify step's rows): written rows (slot >= 0), each context at
 * least the one before's, and the tables equal over the blocks of the shorter. */
static int64_t run_end(int64_t b, int64_t B, const int64_t *slots, const int64_t *tables,
                       int64_t max_blocks, const int64_t *lens, int64_t block_size) {
    if (slots[b] < 0 || lens[b] < 1) return b + 1;
    int64_t e = b + 1;
    for (; e < B && slots[e] >= 0 && lens[e] >= lens[e - 1]; e++) {
        const int64_t *prev = tables + (e - 1) * max_blocks, *next = tables + e * max_blocks;
        int64_t i = 0, blocks = (lens[e - 1] + block_size - 1) / block_size;
        while (i < blocks && prev[i] == next[i]) i++;
        if (i < blocks) break;
    }
    return e;
}

/* Rows b0 to b1 - 1, one sequence's run, through decode_rows.c: their query heads rotated
 * as the one-row tasks rotate them, then all rows at once. */
static int attend_run(const float *qkv, int64_t b0, int64_t b1, int H, int Hkv, int D,
                      const int64_t *positions, const float *cos, const float *sin,
                      const float *k_cache, const float *v_cache, int64_t block_size,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                      float scale, float *out) {
    int64_t rows = b1 - b0, width = (int64_t)(H + 2 * Hkv) * D;
    float *q = malloc(sizeof(float) * (size_t)(rows * H) * (size_t)D);
    if (!q) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t b = b0 + r;
        const float *c = cos + positions[b] * D, *s = sin + positions[b] * D;
        for (int h = 0; h < H; h++) {
            float *qh = q + (r * H + h) * D;
            for (int i = 0; i < D; i++) qh[i] = qkv[b * width + h * D + i];
            rotate(qh, c, s, D);
        }
    }
    int failed = splitserve_attend_rows(q, rows, H, Hkv, D, k_cache, v_cache, block_size,
                                        tables + (b1 - 1) * max_blocks, lens + b0, scale,
                                        out + b0 * (int64_t)H * D);
    free(q);
    return failed;
}

/* The rows[0] to rows[count - 1] of splitserve_decode_attention one at a time.
 * A task: all KV heads of a sequence (its blocks read whole), or one KV head of it where
 * there are fewer sequences than two per thread (batch 1 on two threads: three tasks), or
 * a share of that KV head's query heads where there are still fewer tasks than threads
 * (Gemma 3's one KV head at batch 1: each thread takes two of its four query heads). */
static int attend_each(const float *qkv, const int64_t *rows, int64_t count, int H, int Hkv,
                       int D, const int64_t *positions, const float *cos, const float *sin,
                       const float *k_cache, const float *v_cache, int64_t block_size,
                       const int64_t *block_tables, int64_t max_blocks,
                       const int64_t *context_lens, float scale, int64_t window, float *out) {
    int64_t width = (int64_t)(H + 2 * Hkv) * D, longest = 1;
    int group = H / Hkv, failed = 0;
    for (int64_t i = 0; i < count; i++)
        longest = context_lens[rows[i]] > longest ? context_lens[rows[i]] : longest;
    int threads = omp_get_max_threads();
    int whole = D % 16 == 0 && count >= 2 * threads;
    int64_t per = whole ? Hkv : 1;
    int shares = !whole && D % 16 == 0 && count * Hkv < threads ? (int)(threads / (count * Hkv))
                                                                : 1;
    shares = shares < group ? shares : group;
    int share = (group + shares - 1) / shares; /* query heads of a share (the last: the rest) */
    shares = (group + share - 1) / share;
    int64_t tasks = count * (Hkv / per) * shares;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(per * group) * (size_t)longest);
        float *q = malloc(sizeof(float) * (size_t)(per * group) * D);
        if (!scores || !q) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            int64_t b = rows[task / shares / (Hkv / per)], context = context_lens[b];
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
    return failed;
}

/* qkv [B, (H + 2 Hkv) D] of B decode tokens, before rotary -> out [B, H D].
 * Rotates q and k at positions[b] (cos/sin tables [max_positions, D]), writes k and v to
 * slots[b] of the paged caches [blocks, block_size, Hkv, D] (a negative slot is padding and
 * is not written), then attends over the first context_lens[b] tokens of block_tables[b], or
 * over their last window (window > 0; a Gemma 3 local layer's). Runs of RUN_ROWS or more rows
 * of one sequence over its whole context take decode_rows.c where the attention runs in
 * 16-float vectors (the same bits a row, faster; in 8-float ones it was not: 39.0 against
 * 41.1 ms for 1,024 prompt rows, AVX2 code on the Xeon), the other rows attend one at a time.
 * Returns 0, or -1 when scratch memory cannot be had. */
int splitserve_decode_attention(const float *qkv, int64_t B, int H, int Hkv, int D,
                                const int64_t *positions, const float *cos, const float *sin,
                                float *k_cache, float *v_cache, int64_t block_size,
                                const int64_t *slots, const int64_t *block_tables,
                                int64_t max_blocks, const int64_t *context_lens, float scale,
                                int64_t window, float *out) {
    int64_t width = (int64_t)(H + 2 * Hkv) * D;
    int failed = 0;
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
    int64_t *alone = malloc(sizeof(int64_t) * (size_t)B), count = 0; /* rows one at a time */
    if (!alone) return -1;
    int runs = D % 16 == 0 && window == 0 && lanes16();
    for (int64_t b = 0, e; b < B; b = e) {
        e = runs ? run_end(b, B, slots, block_tables, max_blocks, context_lens, block_size)
                 : b + 1;
        if (e - b >= RUN_ROWS)
            failed |= attend_run(qkv, b, e, H, Hkv, D, positions, cos, sin, k_cache, v_cache,
                                 block_size, block_tables, max_blocks, context_lens, scale, out);
        else
            for (int64_t r = b; r < e; r++) alone[count++] = r;
    }
    if (count)
        failed |= attend_each(qkv, alone, count, H, Hkv, D, positions, cos, sin, k_cache,
                              v_cache, block_size, block_tables, max_blocks, context_lens, scale,
                              window, out);
    free(alone);
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
