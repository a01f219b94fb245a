/* Shared by the kernel's sources (qmatmul.c: products; decode.c: the fused decode steps).
 *
 * Weights are GGML blocks, as a GGUF file stores them, one block per 32 weights of a row:
 *   Q8_0 (34 bytes): fp16 d, int8 q[32]             w = d * q
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles    w = d * (q - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes       w = d * q + m
 * (nibbles: byte j holds weight j in its low half and weight j + 16 in its high half).
 *
 * The products read them repacked into tiles of TILE (8) rows (`q_pack`, once at load):
 * tile t holds rows 8t .. 8t+7, block after block; a tile block is the same bytes as the 8
 * rows' GGML blocks, reordered: the 8 scales d (fp16), for Q4_1 the 8 offsets m, then the
 * code bytes as a table of 16-bit units [unit u][row r] (unit u of a row: its code bytes
 * 2u and 2u + 1). So one 16-byte load holds one unit of all 8 rows: two codes of each
 * (Q8_0), or for Q4 two codes in the low nibbles and the two 16 further on in the high
 * ones. Rows past the matrix's end in its last tile are zeros.
 *
 * Activations are quantized per block of 32 to one int16 each: s = max|x| / 32767,
 * v = round(x / s) (half to even), so x = v s to within s / 2 (1.5e-5 of the block's
 * largest value; the products stay within ~1e-5 of float32's). Per block the kernel
 * multiplies integer codes by v exactly (16-bit multiply-adds, 32-bit sums) and scales
 * once:
 *   sum_j w_j x_j = d s sum_j q_j v_j  (+ m sum_j x_j for Q4_1, with the exact float sum;
 *                                       - 8 d s sum_j v_j for Q4_0).
 *
 * SIMD: AVX2 + FMA + F16C (x86-64-v3) when the compiler targets it, else the same
 * arithmetic in plain C (the portable path, tested against the AVX2 one).
 */
#ifndef RADIXLM_KERNEL_COMMON_H
#define RADIXLM_KERNEL_COMMON_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QAVX2 1
#include <immintrin.h>
#endif

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 };
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* KV pool element types */
#define QK 32
#define TILE 8 /* weight rows per tile */

static inline int64_t qblock_bytes(int qtype) {
    return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 0;
}

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            const float f = ldexpf((float)man, -24);
            return (h & 0x8000) ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Block b of row `row`: its scale d, its offset m (Q4_1; 0 otherwise), and code j as the
 * signed integer the scale multiplies (q - 8 for Q4_0). */
static inline float block_d(const uint8_t *blk) { return fp16_to_f32(load_u16(blk)); }
static inline float block_m(const uint8_t *blk, int qtype) {
    return qtype == Q4_1 ? fp16_to_f32(load_u16(blk + 2)) : 0.0f;
}
static inline int block_code(const uint8_t *blk, int qtype, int j) {
    if (qtype == Q8_0) return (int8_t)blk[2 + j];
    const uint8_t byte = blk[(qtype == Q4_1 ? 4 : 2) + (j & 15)];
    const int q = j < 16 ? (byte & 0xf) : (byte >> 4);
    return qtype == Q4_0 ? q - 8 : q;
}

/* Tile layout (see the top): bytes of a tile block, where its code units start, how many
 * 16-bit units of codes a row has per block, and bytes of a matrix of N rows of width K. */
static inline int64_t tile_block_bytes(int qtype) { return TILE * qblock_bytes(qtype); }
static inline int64_t tile_codes_at(int qtype) { return qtype == Q4_1 ? 4 * TILE : 2 * TILE; }
static inline int tile_units(int qtype) { return qtype == Q8_0 ? 16 : 8; }
static inline int64_t tiled_bytes_of(int qtype, int64_t N, int64_t K) {
    return (N + TILE - 1) / TILE * (K / QK) * tile_block_bytes(qtype);
}

/* One activation row quantized for the products: v [K] int16, and per block b (arrays
 * padded to a multiple of 8 blocks): pair1 = {s, exact sum of x} (Q8_0, Q4_1), pair0 =
 * {s, -8 s sum v} (Q4_0): a block's d (and its offset factor) times its pair give the
 * block's scale d s and its offset term. */
typedef struct {
    int16_t *v;
    float *pair1, *pair0;
} qact;

static inline int64_t qact_blocks(int64_t K) { return (K / QK + 7) / 8 * 8; }

/* Bytes of scratch one activation row of width K needs (64-byte aligned pieces). */
static inline int64_t qact_bytes(int64_t K) {
    return (2 * K + 63) / 64 * 64 + 2 * (int64_t)sizeof(float) * 2 * qact_blocks(K) + 64;
}

static inline qact qact_at(void *scratch, int64_t K) {
    const uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63, vb = (2 * K + 63) / 64 * 64;
    qact a;
    a.v = (int16_t *)p;
    a.pair1 = (float *)(p + vb);
    a.pair0 = a.pair1 + 2 * qact_blocks(K);
    return a;
}

void quantize_act(const float *x, int64_t K, qact *a);

/* y[m, n] for m < M (M activation rows, row stride ldy) and weight rows [n0, n1) (n0 a
 * multiple of TILE) of a tiled matrix (+ bias; added to y with `accumulate`). */
void rows_product(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, int qtype,
                  int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                  int accumulate);
#define PRODUCT_CHUNK 16 /* output rows of a split's unit (two tiles) */
void thread_rows(int64_t N, int64_t *n0, int64_t *n1);

#endif
