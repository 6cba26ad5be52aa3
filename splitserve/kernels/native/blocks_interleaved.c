/* The AVX-512 path's many-row products (blocks.c), on a weight's interleaved copy: Q4_0, Q4_1
 * and Q8_0 (the types whose layout this file knows; the others take blocks_avx512.c's passes at
 * every row count).
 */
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,fma,f16c")))
#define INLINE AVX512 static inline __attribute__((always_inline))

/* ---- The interleaved layout ----
 * At a few rows and more, the one-output products (blocks_avx512.c) spend more on dequantizing
 * and on the x loads and horizontal sums of one output at a time than on FMAs. For those, a
 * copy of the weight is kept interleaved (splitserve_interleave): 16 outputs side by side, so
 * that one zmm holds one input k of 16 outputs. A block of a group of 16 outputs is 16 blocks'
 * bytes, rearranged:
 *   Q4_0  d[16] fp16, then 16 x 16 bytes: byte j of output o at 32 + 16 j + o
 *   Q4_1  d[16] fp16, m[16] fp16, then the bytes as Q4_0's from 64
 *   Q8_0  d[16] fp16, then 32 x 16 int8: weight k of output o at 32 + 16 k + o
 * (byte j holds weights j and j + 16, as in the file). The group count is even (a zero group
 * pads an odd one) and outputs past N are zero. The kernel takes two groups (32 outputs) and up
 * to IL_MT rows: per input k, two weight vectors dequantized with gguf's float32 operations
 * (as blocks_avx512.c: bit-identical weights), one broadcast of x per row, 2 IL_MT FMAs, no
 * horizontal sums; each (row, output) sums its products in one chain, inputs in the order 0,
 * 16, 1, 17, ... Passes of 8, 10, 11 and 12 rows ran within 5% of each other on SmolLM2's
 * shapes (one Zen 5 thread); 8 was the fastest at 32 and 128 rows. */
#define IL_MT 8

/* Bytes of a group's block before its quants: the 16 outputs' headers. */
INLINE int il_header(int qtype) { return 16 * block_header(qtype); }

/* The 16 outputs' bytes j of block blk (Q4_0, Q4_1: weights j and j + 16 as nibbles) or
 * int8 weights j (Q8_0), widened to int32. */
INLINE __m512i il_load(int qtype, const uint8_t *blk, int j) {
    const __m128i *at = (const __m128i *)(blk + il_header(qtype) + 16 * j);
    return qtype == Q8_0 ? _mm512_cvtepi8_epi32(_mm_loadu_si128(at))
                         : _mm512_cvtepu8_epi32(_mm_loadu_si128(at));
}

/* The 16 outputs' d (and m for Q4_1; d again otherwise) of a group's block. */
INLINE void il_scales(int qtype, const uint8_t *blk, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    *m = qtype == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : *d;
}

/* Weight j (high = 0) or j + 16 (high = 1) of the 16 outputs from il_load's q (for Q8_0, q of
 * j or j + 16 itself). */
INLINE __m512 il_weight(int qtype, __m512i q, int high, __m512 d, __m512 m) {
    if (qtype == Q8_0) return _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    if (qtype == Q4_1) return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d), m);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))), d);
}

INLINE void il_fma(const float *xb, int64_t K, const int MT, __m512 w0, __m512 w1,
                   __m512 acc[][2]) {
    for (int r = 0; r < MT; r++) {
        __m512 v = _mm512_set1_ps(xb[r * K]);
        acc[r][0] = _mm512_fmadd_ps(w0, v, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, v, acc[r][1]);
    }
}

/* The lanes of out's columns [n + 16 half, n + 16 half + 16) that are among the pair's valid
 * outputs. */
INLINE __mmask16 il_mask(int64_t valid, int half) {
    int64_t lanes = valid - 16 * half;
    return lanes >= 16 ? 0xffff : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
}

/* Rows [0, MT) of the sums into out (row stride N) columns [n, n + valid). */
INLINE void il_store(__m512 acc[][2], const int MT, float *out, int64_t N, int64_t n,
                     int64_t valid) {
    __mmask16 k0 = il_mask(valid, 0), k1 = il_mask(valid, 1);
    for (int r = 0; r < MT; r++) {
        _mm512_mask_storeu_ps(out + r * N + n, k0, acc[r][0]);
        _mm512_mask_storeu_ps(out + r * N + n + 16, k1, acc[r][1]);
    }
}

/* Asks for block b of both groups of the pair at next (NULL: nothing), nb blocks a group.
 * A thread's pairs follow each other (static schedule), so this is its next pair: streaming
 * the copy from memory, the hardware prefetchers alone left the 2-row product at 151 us against
 * 62 with the weights in cache (SmolLM2's gate|up, one Zen 5 thread). */
INLINE void prefetch_pair_block(const uint8_t *next, int64_t nb, int64_t b, int64_t gbytes) {
    if (!next) return;
    for (int64_t at = 0; at < gbytes; at += 64) {
        _mm_prefetch((const char *)next + b * gbytes + at, _MM_HINT_T0);
        _mm_prefetch((const char *)next + (nb + b) * gbytes + at, _MM_HINT_T0);
    }
}

/* Rows [0, MT) of x (row stride K) times the 32 outputs of groups g and g + 1 (at il, nb
 * blocks each), into out (row stride N) columns [n, n + valid). */
INLINE void il_pass(int qtype, const float *x, const int MT, int64_t K, const uint8_t *il,
                    float *out, int64_t N, int64_t n, int64_t valid, const uint8_t *next) {
    int64_t nb = K / QK, gbytes = 16 * (int64_t)block_bytes(qtype);
    __m512 acc[IL_MT][2];
    for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = il + b * gbytes, *b1 = b0 + nb * gbytes;
        prefetch_pair_block(next, nb, b, gbytes);
        __m512 d0, m0, d1, m1;
        il_scales(qtype, b0, &d0, &m0);
        il_scales(qtype, b1, &d1, &m1);
        const float *xb = x + b * QK;
        for (int j = 0; j < 16; j++) {
            __m512i q0 = il_load(qtype, b0, j), q1 = il_load(qtype, b1, j);
            il_fma(xb + j, K, MT, il_weight(qtype, q0, 0, d0, m0),
                   il_weight(qtype, q1, 0, d1, m1), acc);
            if (qtype == Q8_0) q0 = il_load(qtype, b0, j + 16), q1 = il_load(qtype, b1, j + 16);
            il_fma(xb + j + 16, K, MT, il_weight(qtype, q0, 1, d0, m0),
                   il_weight(qtype, q1, 1, d1, m1), acc);
        }
    }
    il_store(acc, MT, out, N, n, valid);
}

#define IL_CASE(Q, R) \
    case R: il_pass(Q, x, R, K, il, out, N, n, valid, next); break;
#define INTERLEAVED(Q)                                                                        \
    AVX512 static void il_rows_##Q(const float *x, int64_t rows, int64_t K, const uint8_t *il, \
                                   float *out, int64_t N, int64_t n, int64_t valid,          \
                                   const uint8_t *next) {                                    \
        switch (rows) {                                                                       \
            IL_CASE(Q, 1) IL_CASE(Q, 2) IL_CASE(Q, 3) IL_CASE(Q, 4) IL_CASE(Q, 5) IL_CASE(Q, 6) \
            IL_CASE(Q, 7) IL_CASE(Q, 8) default: break; /* rows <= IL_MT */                   \
        }                                                                                     \
    }
INTERLEAVED(Q4_0)
INTERLEAVED(Q4_1)
INTERLEAVED(Q8_0) /* below panel_from's 8 rows: only batch-invariant products come here */

/* ---- Many rows: a dequantized panel ----
 * From panel_from() rows the pair's 32 outputs are dequantized once per step into a float32
 * panel (in each block the inputs in the chain order 0, 16, 1, 17, ...), and every pass of up
 * to IL_MT rows only loads two weight vectors per input and runs its FMAs: dequantizing per
 * pass cost about a third of the interleaved passes above. The panel covers PANEL_KC inputs at
 * a time, so that it and the rows' x stay in the L1 cache; between pieces each pass stores its
 * sums to out and loads them back, which changes no bit. The products and their order are those
 * of il_pass, so the sums are bit-identical to it at any row count. */
#define PANEL_KC 192

/* Rows from which a pair takes the panel: the 4-bit types' passes above are as fast up to 12
 * rows (SmolLM2's gate|up: 195 us either way, 128 against 144 us at 8 rows). Q8_0's passes were
 * slower from the 8 rows at which it takes the interleaved copy by default (the LM head: 2.43
 * against 2.28 ms at 8 rows, 3.60 against 3.15 at 12; one Zen 5 thread), so Q8_0 takes the
 * passes only below 8 rows, in batch-invariant products. */
static int panel_from(int qtype) { return qtype == Q8_0 ? 8 : 16; }

/* Blocks [0, blocks) of the pair whose group 0 starts at il (group 1 stride blocks later)
 * into panel; asks for the same blocks of the next pair (NULL: none), which this thread takes
 * next. */
INLINE void panel_dequantize(int qtype, const uint8_t *il, int64_t stride, int64_t blocks,
                             float *panel, const uint8_t *next) {
    int64_t gbytes = 16 * (int64_t)block_bytes(qtype);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *b0 = il + b * gbytes, *b1 = b0 + stride * gbytes;
        prefetch_pair_block(next, stride, b, gbytes);
        __m512 d0, m0, d1, m1;
        il_scales(qtype, b0, &d0, &m0);
        il_scales(qtype, b1, &d1, &m1);
        float *pb = panel + b * QK * 32;
        for (int j = 0; j < 16; j++) {
            for (int high = 0; high < 2; high++) {
                int at = qtype == Q8_0 ? j + 16 * high : j;
                __m512i q0 = il_load(qtype, b0, at), q1 = il_load(qtype, b1, at);
                float *to = pb + (2 * j + high) * 32;
                _mm512_store_ps(to, il_weight(qtype, q0, high, d0, m0));
                _mm512_store_ps(to + 16, il_weight(qtype, q1, high, d1, m1));
            }
        }
    }
}

#define PANEL_DEQUANTIZE(Q)                                                                   \
    AVX512 static void panel_dequantize_##Q(const uint8_t *il, int64_t stride, int64_t blocks, \
                                            float *panel, const uint8_t *next) {               \
        panel_dequantize(Q, il, stride, blocks, panel, next);                                  \
    }
PANEL_DEQUANTIZE(Q4_0)
PANEL_DEQUANTIZE(Q4_1)
PANEL_DEQUANTIZE(Q8_0)

/* Rows [0, MT) of x (row stride K) times the panel's blocks [0, blocks), into out (row stride
 * N) columns [n, n + valid), starting from zero (first) or from the sums out holds. */
INLINE void panel_pass(const float *x, const int MT, int64_t K, int64_t blocks,
                       const float *panel, float *out, int64_t N, int64_t n, int64_t valid,
                       int first) {
    __m512 acc[IL_MT][2];
    __mmask16 k0 = il_mask(valid, 0), k1 = il_mask(valid, 1);
    for (int r = 0; r < MT; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k0, out + r * N + n);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k1, out + r * N + n + 16);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const float *pb = panel + b * QK * 32, *xb = x + b * QK;
        for (int j = 0; j < 16; j++) {
            il_fma(xb + j, K, MT, _mm512_load_ps(pb + 64 * j), _mm512_load_ps(pb + 64 * j + 16),
                   acc);
            il_fma(xb + j + 16, K, MT, _mm512_load_ps(pb + 64 * j + 32),
                   _mm512_load_ps(pb + 64 * j + 48), acc);
        }
    }
    il_store(acc, MT, out, N, n, valid);
}

#define PANEL_CASE(R) \
    case R: panel_pass(x, R, K, blocks, panel, out, N, n, valid, first); break;
AVX512 static void panel_rows(const float *x, int64_t rows, int64_t K, int64_t blocks,
                              const float *panel, float *out, int64_t N, int64_t n,
                              int64_t valid, int first) {
    switch (rows) {
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6)
        PANEL_CASE(7) PANEL_CASE(8)
        default: break; /* rows <= IL_MT */
    }
}

/* Rows [0, M) in passes of at most mt rows, as even as they go (20 rows at 8: 7 + 7 + 6). */
#define PASSES(mt, CALL)                                                \
    for (int64_t p = 0, m = 0, passes = (M + (mt) - 1) / (mt); p < passes; p++) { \
        int64_t rows = (M - m) / (passes - p) + ((M - m) % (passes - p) != 0);   \
        const float *xm = x + m * K;                                      \
        float *om = out + m * N;                                          \
        CALL;                                                             \
        m += rows;                                                        \
    }

void splitserve_avx512_interleaved(int qtype, const float *x, int64_t M, int64_t K,
                                   const uint8_t *il, int64_t pair, float *out, int64_t N) {
    int64_t nb = K / QK, gbytes = 16 * (int64_t)block_bytes(qtype), n = 32 * pair;
    int64_t valid = N - n < 32 ? N - n : 32;
    const uint8_t *w = il + 2 * pair * nb * gbytes;
    const uint8_t *next = n + 32 < N ? w + 2 * nb * gbytes : NULL; /* the next pair's blocks */
    if (M >= panel_from(qtype)) {
        float panel[PANEL_KC * 32] __attribute__((aligned(64)));
        for (int64_t b0 = 0; b0 < nb; b0 += PANEL_KC / QK) {
            int64_t blocks = nb - b0 < PANEL_KC / QK ? nb - b0 : PANEL_KC / QK;
            const uint8_t *at = w + b0 * gbytes, *ahead = next ? next + b0 * gbytes : NULL;
            if (qtype == Q4_1)
                panel_dequantize_Q4_1(at, nb, blocks, panel, ahead);
            else if (qtype == Q8_0)
                panel_dequantize_Q8_0(at, nb, blocks, panel, ahead);
            else
                panel_dequantize_Q4_0(at, nb, blocks, panel, ahead);
            PASSES(IL_MT,
                   panel_rows(xm + b0 * QK, rows, K, blocks, panel, om, N, n, valid, b0 == 0));
        }
    } else if (qtype == Q4_1) {
        PASSES(IL_MT, il_rows_Q4_1(xm, rows, K, w, om, N, n, valid, p ? NULL : next));
    } else if (qtype == Q8_0) {
        PASSES(IL_MT, il_rows_Q8_0(xm, rows, K, w, om, N, n, valid, p ? NULL : next));
    } else {
        PASSES(IL_MT, il_rows_Q4_0(xm, rows, K, w, om, N, n, valid, p ? NULL : next));
    }
}

#else /* not x86-64: no AVX-512, and splitserve_block_matmul never asks for it */
void splitserve_avx512_interleaved(int qtype, const float *x, int64_t M, int64_t K,
                                   const uint8_t *il, int64_t pair, float *out, int64_t N) {
    (void)qtype, (void)x, (void)M, (void)K, (void)il, (void)pair, (void)out, (void)N;
}
#endif
