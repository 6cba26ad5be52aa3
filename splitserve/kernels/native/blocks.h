/* Shared by blocks.c and blocks_avx512.c: the block formats (blocks.c describes them). */
#ifndef SPLITSERVE_BLOCKS_H
#define SPLITSERVE_BLOCKS_H
#include <stdint.h>

#define QK 32
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static inline int block_bytes(int qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : -1;
}
int splitserve_block_bytes(int qtype);

/* Bytes of a block before its quants: d (and m for Q4_1), fp16 each. */
static inline int block_header(int qtype) { return qtype == Q4_1 ? 4 : 2; }

/* The AVX-512 path (blocks_avx512.c): whether this CPU runs it, and outputs [n0, n1) of
 * out[M, N] = x[M, K] @ dequant(w[N, K]).T, which it may only be asked for where it does. */
int splitserve_has_avx512(void);
void splitserve_avx512_range(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t n0, int64_t n1, float *out, int64_t N);
/* The many-row product on the interleaved copy (blocks_avx512.c describes the layout):
 * outputs [32 pair, 32 pair + 32) of out[M, N]. AVX-512 only. */
void splitserve_avx512_interleaved(int qtype, const float *x, int64_t M, int64_t K,
                                   const uint8_t *il, int64_t pair, float *out, int64_t N);
#endif
