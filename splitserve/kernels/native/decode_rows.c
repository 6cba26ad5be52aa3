/* Attention of several query rows of one sequence over its paged cache on the CPU, float32 (a
 * prompt chunk laid out as decode rows in deterministic mode, a verify step's rows), each
 * row's arithmetic that of decode.c's one-row walk operation for operation, so a row's output
 * is the same bits whichever rows share its call, its chunk or its step.
 *
 * decode.c scores a key against a query head as the product of two 16-float vectors summed
 * over the head's 16-float slices, then a horizontal sum (hsum16): shuffles per score, and
 * each row reads every key again: 8 ns a score for SmolLM2's 1,024-token prompt on an Intel
 * Xeon. Here the keys lie across the lanes: the K rows are transposed once per call into
 * tiles of 16 keys (D rows of 16 floats), and lane l of dot16's accumulator becomes a vector
 * over the tile's keys (query element l times the tile's row l, plus element 16 + l times
 * row 16 + l, ...: the same products added in the same order), then hsum16's tree adds those
 * vectors as it added the lanes. A tile is scored against every query head of a task's rows
 * while it is in cache. The softmax and the V sums are decode.c's own (attend.h), a row at a
 * time, each block's V rows added into every row of the task in turn. The library is built
 * without FMA contraction, as decode.c's sums are. 16-float vectors only (decode.c sends no
 * rows here where they are not native).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attend.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define TILE 16 /* keys per transposed tile: the lanes of dot16's accumulator */
#define ROWS 8  /* query rows per task */

/* The 16 x 16 block x[i][l] transposed in place: at each scale s (8, 4, 2, 1) rows i and
 * i + s (bit s of i clear) swap their lanes l + s and l (bit s of l clear), shuffles of two
 * registers (unrolled, so that x stays in registers). */
#define STAGE(s, LO, HI)                                          \
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {      \
        if (i & s) continue;                                      \
        v16 a = x[i], c = x[i + s];                               \
        x[i] = __builtin_shufflevector(a, c, LO);                 \
        x[i + s] = __builtin_shufflevector(a, c, HI);             \
    }
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
INLINE void transpose16(v16 x[16]) {
    STAGE(8, LO8, HI8)
    STAGE(4, LO4, HI4)
    STAGE(2, LO2, HI2)
    STAGE(1, LO1, HI1)
}
#undef STAGE

/* Tile b of KV head g's keys: tokens [16 b, 16 b + 16) of the sequence (table; stride floats
 * a cached row) as D rows of 16 floats, zeros past context; 16 x 16 blocks transposed in
 * registers. */
CLONES static void transpose_tile(const float *k_cache, const int64_t *table, int64_t block_size,
                                  int64_t stride, int D, int g, int64_t b, int64_t context,
                                  float *kt) {
    const float *rows[TILE];
    for (int i = 0; i < TILE; i++) {
        int64_t t = b * TILE + i;
        rows[i] = t < context ? k_cache + (table[t / block_size] * block_size + t % block_size) *
                                              stride + (int64_t)g * D
                              : NULL;
    }
    for (int c = 0; c < D / 16; c++) {
        v16 x[16];
        for (int i = 0; i < TILE; i++) x[i] = rows[i] ? load16(rows[i] + 16 * c) : (v16){0};
        transpose16(x);
        for (int d = 0; d < 16; d++) store16(kt + (16 * c + d) * TILE, x[d]);
    }
}

/* The scores of N <= 4 query heads qs[j] (D = 16 C floats) against a tile's 16 keys, times
 * scale, to ss[j][0, 16): p[m], lane l + 4 m of dot16's accumulator for each key, is
 * q[l + 4 m] kt[l + 4 m] + q[16 + l + 4 m] kt[16 + l + 4 m] + ...; then hsum16's tree: lanes
 * l and l + 8 added, l and l + 4 (b[l]), then (b[0] + b[2]) + (b[1] + b[3]). Each of the
 * tile's rows is loaded once for the N heads. */
INLINE void score16(const float *const *qs, int N, const float *kt, int C, float scale,
                    float *const *ss) {
    v16 b[4][4];
    for (int l = 0; l < 4; l++) {
        v16 p[4][4];
        for (int m = 0; m < 4; m++) {
            int lane = l + 4 * m;
            v16 k = load16(kt + TILE * lane);
            for (int j = 0; j < N; j++) p[j][m] = qs[j][lane] * k;
            for (int c = 1; c < C; c++) {
                k = load16(kt + TILE * (16 * c + lane));
                for (int j = 0; j < N; j++) p[j][m] += qs[j][16 * c + lane] * k;
            }
        }
        for (int j = 0; j < N; j++) b[j][l] = (p[j][0] + p[j][2]) + (p[j][1] + p[j][3]);
    }
    for (int j = 0; j < N; j++)
        store16(ss[j], ((b[j][0] + b[j][2]) + (b[j][1] + b[j][3])) * scale);
}

/* A tile's scores for n heads, four, two or one at a time, C constant for the usual head
 * size (64 floats). */
INLINE void score_heads(const float *const *qs, int n, const float *kt, int C, float scale,
                        float *const *ss) {
#define SCORE16(N)                                          \
    if (C == 4)                                             \
        score16(qs + j, N, kt, 4, scale, ss + j);           \
    else                                                    \
        score16(qs + j, N, kt, C, scale, ss + j)
    int j = 0;
    for (; j + 4 <= n; j += 4) SCORE16(4);
    for (; j + 2 <= n; j += 2) SCORE16(2);
    for (; j < n; j++) SCORE16(1);
#undef SCORE16
}

/* The largest of s[0, n): the lanes' maxima of the whole tiles, then the rest. */
INLINE float largest(const float *s, int64_t n) {
    v16 most = (v16){0} - INFINITY;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        v16 x = load16(s + t);
        vi16 above = x > most;
        most = (v16)(((vi16)x & above) | ((vi16)most & ~above));
    }
    float best = -INFINITY;
    for (int i = 0; i < 16; i++) best = most[i] > best ? most[i] : best;
    for (; t < n; t++) best = s[t] > best ? s[t] : best;
    return best;
}

/* One task: rows r0 to r1 - 1 (q, out [rows, H, D]), the G query heads of KV head g; kt: that
 * head's tiles; scores: (r1 - r0) G rows of width floats. */
CLONES static void attend_task(const float *q, int H, int Hkv, int D, const float *kt,
                               const float *v_cache, int64_t block_size, const int64_t *table,
                               const int64_t *lens, int g, int64_t r0, int64_t r1, float scale,
                               float *scores, int64_t width, float *out) {
    const int G = H / Hkv, C = D / 16;
    const int n = (int)(r1 - r0) * G;
    const int64_t stride = (int64_t)Hkv * D;
    int64_t keys = 0;
    for (int64_t r = r0; r < r1; r++) keys = lens[r] > keys ? lens[r] : keys;
    const float *qs[n];
    float *ss[n];
    for (int64_t t0 = 0; t0 < keys; t0 += TILE) {
        int seeing = 0; /* the heads of rows that see the tile */
        for (int j = 0; j < n; j++) {
            int64_t r = r0 + j / G;
            if (t0 >= lens[r]) continue;
            qs[seeing] = q + (r * H + (int64_t)g * G + j % G) * D;
            ss[seeing++] = scores + j * width + t0;
        }
        score_heads(qs, seeing, kt + t0 * D, C, scale, ss);
    }
    for (int j = 0; j < n; j++) {
        float *sh = scores + j * width;
        int64_t seen = lens[r0 + j / G];
        softmax_head(sh, 0, seen, largest(sh, seen), 1);
    }
    for (int64_t blk = 0, t0 = 0; t0 < keys; blk++, t0 += block_size) {
        const float *vb = v_cache + table[blk] * block_size * stride + (int64_t)g * D;
        for (int64_t r = r0; r < r1; r++) {
            if (t0 >= lens[r]) continue;
            int64_t count = lens[r] - t0 < block_size ? lens[r] - t0 : block_size;
            vsum_any(scores + (r - r0) * G * width + t0, width, G, C, vb, stride, count,
                     out + (r * H + (int64_t)g * G) * D, blk == 0, 1);
        }
    }
}

int splitserve_attend_rows(const float *q, int64_t rows, int H, int Hkv, int D,
                           const float *k_cache, const float *v_cache, int64_t block_size,
                           const int64_t *table, const int64_t *lens, float scale, float *out) {
    int64_t keys = 0;
    for (int64_t r = 0; r < rows; r++) keys = lens[r] > keys ? lens[r] : keys;
    int64_t tiles = (keys + TILE - 1) / TILE, width = tiles * TILE;
    int64_t stride = (int64_t)Hkv * D;
    /* rows per task: ROWS, fewer where that leaves under two tasks a thread (a verify step) */
    int64_t per = rows * Hkv / (2 * omp_get_max_threads());
    per = per < 1 ? 1 : per > ROWS ? ROWS : per;
    int64_t chunks = (rows + per - 1) / per;
    per = (rows + chunks - 1) / chunks;
    float *kt = malloc(sizeof(float) * (size_t)(Hkv * width) * (size_t)D);
    if (!kt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Hkv * tiles; i++)
        transpose_tile(k_cache, table, block_size, stride, D, (int)(i / tiles), i % tiles, keys,
                       kt + i * TILE * D);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(ROWS * (H / Hkv)) * (size_t)width);
        if (!scores) failed = 1;
        /* the last rows first: they see the most keys */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < chunks * Hkv; task++) {
            if (failed) continue;
            int64_t r0 = (chunks - 1 - task / Hkv) * per, r1 = r0 + per < rows ? r0 + per : rows;
            int g = (int)(task % Hkv);
            attend_task(q, H, Hkv, D, kt + g * width * D, v_cache, block_size, table, lens, g, r0,
                        r1, scale, scores, width, out);
        }
        free(scores);
    }
    free(kt);
    return failed ? -1 : 0;
}
