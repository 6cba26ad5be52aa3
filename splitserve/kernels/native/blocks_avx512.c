/* The AVX-512 path of blocks.c's products, chosen at run time on CPUs with AVX-512F.
 *
 * A block dequantizes into two zmm registers of 16 weights, with the same float32 operations
 * as the scalar code, so the weights stay bit-identical to gguf's dequantize:
 *   Q4_0, Q4_1  the 16 values a nibble can stand for form one zmm table, t[j] = (j - 8) * d or
 *               j * d + m (a multiply, then an add, as the scalar code); the 16 bytes of
 *               nibbles widen to 16 int32 and vpermps looks the weights up: the low nibbles
 *               directly (it reads only the low 4 bits of an index), the high ones after a
 *               shift. No conversion, multiply or add per weight.
 *   Q8_0        widen the int8 to int32, convert, multiply by d.
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

/* The 32 weights of 16 bytes of nibbles, looked up in table (vpermps reads only the low 4
 * bits of each index, so the low nibbles need no mask). */
INLINE void lookup(const uint8_t *qs, __m512 table, __m512 v[2]) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

INLINE void dequant(int qtype, const uint8_t *b, __m512 v[2]) {
    if (qtype == Q4_1) { /* d and m in one conversion: ~7% faster than two */
        uint32_t dm;
        __builtin_memcpy(&dm, b, 4);
        __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        __m512 d = _mm512_broadcastss_ps(f), m = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
        __m512 j = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        lookup(b + 4, _mm512_add_ps(_mm512_mul_ps(j, d), m), v);
        return;
    }
    __m512 d = scale(b);
    if (qtype == Q8_0) {
        for (int i = 0; i < 2; i++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i));
            v[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
        return;
    }
    __m512 j = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    lookup(b + 2, _mm512_mul_ps(j, d), v);
}

/* One block of output n times rows [m0, m0 + MT) of x, into accumulators u and u + 1 of each
 * row (mod A). */
INLINE void block_fma(int qtype, const uint8_t *block, const float *x, int64_t m0, const int MT,
                      int64_t K, int64_t b, const int A, int u, __m512 acc[8][4]) {
    __m512 v[2];
    dequant(qtype, block, v);
    for (int r = 0; r < MT; r++) {
        const float *xr = x + (m0 + r) * K + b * QK;
        acc[r][u % A] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xr), acc[r][u % A]);
        acc[r][(u + 1) % A] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xr + 16), acc[r][(u + 1) % A]);
    }
}

/* Outputs [n0, n1) for rows [m0, m0 + MT) of x; MT is a constant after inlining. One output at
 * a time: walking two or four weight rows side by side (to share the loads of x) was faster
 * with the weights in cache but up to 3x slower streaming them from memory (SmolLM2's LM
 * head). Each row keeps A accumulators (4 for one row, 2 for two, else 1), blocks taken in
 * pairs, so that a one-row pass is not one FMA dependency chain. */
INLINE void rows(int qtype, const float *x, int64_t m0, const int MT, int64_t K,
                 const uint8_t *w, int64_t n0, int64_t n1, float *out, int64_t N) {
    int64_t nb = K / QK, bytes = block_bytes(qtype);
    const int A = MT == 1 ? 4 : MT == 2 ? 2 : 1;
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[8][4];
        for (int r = 0; r < MT; r++)
            for (int a = 0; a < A; a++) acc[r][a] = _mm512_setzero_ps();
        const uint8_t *row = w + n * nb * bytes;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            block_fma(qtype, row + b * bytes, x, m0, MT, K, b, A, 0, acc);
            block_fma(qtype, row + (b + 1) * bytes, x, m0, MT, K, b + 1, A, 2, acc);
        }
        if (b < nb) block_fma(qtype, row + b * bytes, x, m0, MT, K, b, A, 0, acc);
        for (int r = 0; r < MT; r++) {
            for (int a = 1; a < A; a++) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][a]);
            out[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r][0]);
        }
    }
}

#define TILES(Q)                                                                        \
    AVX512 static void tiles_##Q(const float *x, int64_t M, int64_t K, const uint8_t *w, \
                                 int64_t n0, int64_t n1, float *out, int64_t N) {       \
        int64_t m = 0;                                                                  \
        for (; m + 8 <= M; m += 8) rows(Q, x, m, 8, K, w, n0, n1, out, N);              \
        switch (M - m) {                                                                \
        case 7: rows(Q, x, m, 7, K, w, n0, n1, out, N); break;                          \
        case 6: rows(Q, x, m, 6, K, w, n0, n1, out, N); break;                          \
        case 5: rows(Q, x, m, 5, K, w, n0, n1, out, N); break;                          \
        case 4: rows(Q, x, m, 4, K, w, n0, n1, out, N); break;                          \
        case 3: rows(Q, x, m, 3, K, w, n0, n1, out, N); break;                          \
        case 2: rows(Q, x, m, 2, K, w, n0, n1, out, N); break;                          \
        case 1: rows(Q, x, m, 1, K, w, n0, n1, out, N); break;                          \
        default: break;                                                                 \
        }                                                                               \
    }
TILES(Q4_0)
TILES(Q4_1)
TILES(Q8_0)

/* ---- Many rows: the interleaved layout ----
 * At a few rows and more, the products above spend more on dequantizing and on the x loads and
 * horizontal sums of one output at a time than on FMAs. For those, a copy of the weight is kept
 * interleaved (splitserve_interleave): 16 outputs side by side, so that one zmm holds one input
 * k of 16 outputs. A block of a group of 16 outputs is 16 blocks' bytes, rearranged:
 *   Q4_0  d[16] fp16, then 16 x 16 bytes: byte j of output o at 32 + 16 j + o
 *   Q4_1  d[16] fp16, m[16] fp16, then the bytes as Q4_0's from 64
 *   Q8_0  d[16] fp16, then 32 x 16 int8: weight k of output o at 32 + 16 k + o
 * (byte j holds weights j and j + 16, as in the file). The group count is even (a zero group
 * pads an odd one) and outputs past N are zero. The kernel takes two groups (32 outputs) and up
 * to IL_MT rows: per input k, two weight vectors dequantized with gguf's float32 operations (as
 * above: bit-identical weights), one broadcast of x per row, 2 IL_MT FMAs, no horizontal sums;
 * each (row, output) sums its products in one chain, inputs in the order 0, 16, 1, 17, ...
 * Passes of 8, 10, 11 and 12 rows ran within 5% of each other on SmolLM2's shapes (one Zen 5
 * thread); 8 was the fastest at 32 and 128 rows. */
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
INTERLEAVED(Q4_1) /* Q8_0 always takes the panel below */

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
 * slower from the 8 rows at which it takes the interleaved copy at all (the LM head: 2.43
 * against 2.28 ms at 8 rows, 3.60 against 3.15 at 12; one Zen 5 thread), so Q8_0 always takes
 * the panel. */
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
    } else {
        PASSES(IL_MT, il_rows_Q4_0(xm, rows, K, w, om, N, n, valid, p ? NULL : next));
    }
}

int splitserve_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

void splitserve_avx512_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t n0, int64_t n1, float *out, int64_t N) {
    if (qtype == Q4_1)
        tiles_Q4_1(x, M, K, w, n0, n1, out, N);
    else if (qtype == Q8_0)
        tiles_Q8_0(x, M, K, w, n0, n1, out, N);
    else
        tiles_Q4_0(x, M, K, w, n0, n1, out, N);
}

#else /* not x86-64: no AVX-512, and splitserve_block_matmul never asks for it */
void splitserve_avx512_interleaved(int qtype, const float *x, int64_t M, int64_t K,
                                   const uint8_t *il, int64_t pair, float *out, int64_t N) {
    (void)qtype, (void)x, (void)M, (void)K, (void)il, (void)pair, (void)out, (void)N;
}

int splitserve_has_avx512(void) { return 0; }

void splitserve_avx512_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t n0, int64_t n1, float *out, int64_t N) {
    (void)qtype, (void)x, (void)M, (void)K, (void)w, (void)n0, (void)n1, (void)out, (void)N;
}
#endif
