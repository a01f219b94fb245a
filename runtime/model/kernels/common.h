/* Shared by the kernel's sources (qmatmul.c: packing and the products of few rows;
 * gemm8.c: products of many rows; decode.c: the fused decode steps).
 *
 * Weights are GGML blocks, as a GGUF file stores them (w: a weight, q: its code, d, m,
 * dmin: fp16 scales; nibbles: byte j holds code j in its low half and code j + 16 (Q4_0,
 * Q4_1, Q5_0, Q5_1) in its high half):
 *   Q8_0 (32 weights, 34 bytes): d, int8 q[32]                       w = d q
 *   Q4_0 (32, 18): d, 16 bytes of nibbles                            w = d (q - 8)
 *   Q4_1 (32, 20): d, m, nibbles                                     w = d q + m
 *   Q5_0 (32, 22): d, qh (u32: bit j = bit 4 of code j), nibbles     w = d (q - 16)
 *   Q5_1 (32, 24): d, m, qh, nibbles                                 w = d q + m
 *   Q4_K (256, 144): d, dmin, 12 bytes of 6-bit scales sc[8] and mins mn[8], qs[128]:
 *       sub-block s (32 codes) w = d sc[s] q - dmin mn[s]; qs byte 32c + l holds code
 *       64c + l (low nibble) and 64c + 32 + l (high nibble)
 *   Q5_K (256, 176): as Q4_K, plus qh[32]: bit b of qh[l] is bit 4 of code 32b + l
 *   Q6_K (256, 210): ql[128], qh[64], int8 scales sc[16], d: code j (6 bits, 0..63) of
 *       128-half n, quarter k, position l (j = 128n + 32k + l) has its low 4 bits in
 *       ql[64n + 32(k & 1) + l] (low nibble for k < 2, high for k >= 2) and its top 2 in
 *       bits 2k, 2k+1 of qh[32n + l]; w = d sc[j / 16] (q - 32)
 *
 * The products read them repacked into tiles of TILE (8) rows (`q_pack`, once at load):
 * tile t holds rows 8t .. 8t+7, block after block; a tile block is the same bytes as the 8
 * rows' GGML blocks, reordered field by field into tables [unit][row] (`tile_fields`): the
 * 8 d (fp16) side by side, then the 8 m or dmin, the scale bytes of K-quants as [byte][row]
 * (a byte of 8 rows in one 64-bit load), high-bit tables, and the code bytes as 16-bit
 * units [unit u][row r] (unit u of a row: its code bytes 2u and 2u + 1). So one 16-byte
 * load holds one unit of all 8 rows: two codes of each (Q8_0), or for the nibble types
 * two codes in the low nibbles and two more in the high ones. Q5_0 / Q5_1 store qh with its
 * bits permuted (`qh_perm`): the bits of unit u's codes then sit at bits u, u + 16 (low
 * nibbles) and u + 8, u + 24 (high ones), one shift away from where they are added. On
 * AVX-512 VBMI builds the K-quants' code and high-bit tables have 8-byte units instead
 * (`KQ_UNIT`; one 64-byte load: 8 bytes of each row, as their byte multiply-adds take them),
 * so a tile file is one build's (the tile cache's key names it). Rows past the matrix's
 * end in its last tile are zeros.
 *
 * Few activation rows (decode, qmatmul.c) are quantized per block of 32 to one int16 each:
 * s = max|x| / 32767, v = round(x / s) (half to even), so x = v s to within s / 2 (1.5e-5
 * of the block's largest value; the products stay within ~1e-5 of float32's). Per block
 * the kernel multiplies integer codes by v exactly (16-bit multiply-adds, 32-bit sums) and
 * scales once:
 *   sum_j w_j x_j = d s sum_j q_j v_j  (+ m sum_j x_j with the exact float sum, Q4_1, Q5_1,
 *                   K-quant mins; - 8 d s sum_j v_j for Q4_0, - 16 d s ... for Q5_0, and
 *                   per 16 codes d sc s (sum q v - 32 sum v) for Q6_K).
 * Many rows (prefill, gemm8.c) are quantized to int8 per block of 32 instead (see there).
 *
 * SIMD: AVX2 + FMA + F16C (x86-64-v3) when the compiler targets it (with VNNI's fused
 * multiply-adds where the CPU has them, and 512-bit vectors with AVX-512), else the same
 * arithmetic in plain C (the portable path; every build tested against the references).
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

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* KV pool element types */
#define QK 32
#define QKK 256
#define TILE 8 /* weight rows per tile */

static inline int qtype_known(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 ||
           qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
}

static inline int is_kquant(int qtype) { return qtype >= Q4_K; }

/* Weights of one GGML block (a K-quant's super-block: 8 blocks of 32), and its bytes. */
static inline int qblock_elems(int qtype) { return is_kquant(qtype) ? QKK : QK; }

static inline int64_t qblock_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t row_bytes_of(int qtype, int64_t K) { return K / qblock_elems(qtype) * qblock_bytes(qtype); }

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

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* ------------------------------------------------------------------------ tile layout */

/* Few-row K-quant products with VNNI's byte multiply-adds (qmatmul.c: tile_k_d8): AVX-512
 * with VNNI and VBMI. */
#if defined(QAVX2) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define DEC8 1
#endif

/* The unit of the K-quants' code and high-bit tables (below): 8 bytes of a row on DEC8
 * builds, so that one 64-byte load holds 8 bytes of each of the 8 rows, row r's in 32-bit
 * lanes 2r and 2r + 1, as the byte multiply-adds take them (2 bytes elsewhere: the int16
 * passes widen 16 bytes of 8 rows at once). The layout is a build's, so the tile cache's
 * key names it (q_kq_unit). */
#if defined(DEC8)
#define KQ_UNIT 8
#else
#define KQ_UNIT 2
#endif

/* One field of a GGML block as a tile stores it: `len` bytes at `src` in the block become
 * a table [len / unit][TILE][unit] at `dst` in the tile block. */
typedef struct {
    int src, len, unit, dst;
} tile_field;

/* The fields of `qtype` (returns how many; at most 5). Offsets in the tile block: */
enum {
    Q8_0_CODES = 16,
    Q4_0_CODES = 16,
    Q4_1_CODES = 32,
    Q5_0_QH = 16, Q5_0_CODES = 48,
    Q5_1_QH = 32, Q5_1_CODES = 64,
    QK_SCALES = 32, Q4_K_CODES = 128, /* Q4_K and Q5_K: d at 0, dmin at 16, scales [12][8] */
    Q5_K_QH = 128, Q5_K_CODES = 384,
    Q6_K_SCALES = 16, Q6_K_QH = 144, Q6_K_CODES = 656,
};

static inline int tile_fields(int qtype, tile_field f[5]) {
    switch (qtype) {
    case Q8_0: f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 32, 2, Q8_0_CODES}; return 2;
    case Q4_0: f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 16, 2, Q4_0_CODES}; return 2;
    case Q4_1:
        f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 2, 2, 16};
        f[2] = (tile_field){4, 16, 2, Q4_1_CODES}; return 3;
    case Q5_0:
        f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 4, 4, Q5_0_QH};
        f[2] = (tile_field){6, 16, 2, Q5_0_CODES}; return 3;
    case Q5_1:
        f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 2, 2, 16};
        f[2] = (tile_field){4, 4, 4, Q5_1_QH}; f[3] = (tile_field){8, 16, 2, Q5_1_CODES}; return 4;
    case Q4_K:
        f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 2, 2, 16};
        f[2] = (tile_field){4, 12, 1, QK_SCALES}; f[3] = (tile_field){16, 128, KQ_UNIT, Q4_K_CODES}; return 4;
    case Q5_K:
        f[0] = (tile_field){0, 2, 2, 0}; f[1] = (tile_field){2, 2, 2, 16};
        f[2] = (tile_field){4, 12, 1, QK_SCALES}; f[3] = (tile_field){16, 32, KQ_UNIT, Q5_K_QH};
        f[4] = (tile_field){48, 128, KQ_UNIT, Q5_K_CODES}; return 5;
    case Q6_K:
        f[0] = (tile_field){208, 2, 2, 0}; f[1] = (tile_field){192, 16, 1, Q6_K_SCALES};
        f[2] = (tile_field){128, 64, KQ_UNIT, Q6_K_QH}; f[3] = (tile_field){0, 128, KQ_UNIT, Q6_K_CODES}; return 4;
    default: return 0;
    }
}

/* Where the code units start, and how many 16-bit code units a row has per tile block. */
static inline int64_t tile_codes_at(int qtype) {
    switch (qtype) {
    case Q4_1: return Q4_1_CODES;
    case Q5_0: return Q5_0_CODES;
    case Q5_1: return Q5_1_CODES;
    case Q4_K: return Q4_K_CODES;
    case Q5_K: return Q5_K_CODES;
    case Q6_K: return Q6_K_CODES;
    default: return 16; /* Q8_0, Q4_0 */
    }
}
static inline int tile_units(int qtype) {
    return qtype == Q8_0 ? 16 : is_kquant(qtype) ? 64 : 8;
}
static inline int64_t tile_block_bytes(int qtype) { return TILE * qblock_bytes(qtype); }

/* Bytes of a matrix of N rows of width K as tiles. */
static inline int64_t tiled_bytes_of(int qtype, int64_t N, int64_t K) {
    return (N + TILE - 1) / TILE * (K / qblock_elems(qtype)) * tile_block_bytes(qtype);
}

/* Q5_0 / Q5_1 qh: bit j (code j) moves to bit qh_perm(j): a low-nibble code 2u + e to
 * u + 16e, a high-nibble code 16 + 2u + e to u + 8 + 16e. */
static inline int qh_perm(int j) {
    const int n = j & 15;
    return (n >> 1) + 16 * (n & 1) + (j >= 16 ? 8 : 0);
}

/* Byte `i` of a tile block's table field starting at `at` with `unit`-byte units, row r. */
static inline const uint8_t *tile_byte(const uint8_t *tb, int at, int unit, int r, int i) {
    return tb + at + ((i / unit) * TILE + r) * unit + i % unit;
}

/* K-quant scale and min of sub-block s (0..7) of row r (6 bits each). */
static inline void kq_scale_min(const uint8_t *tb, int r, int s, int *sc, int *mn) {
    const uint8_t *b = tb + QK_SCALES + r; /* byte k of row r: b[8 k] */
    if (s < 4) {
        *sc = b[8 * s] & 63;
        *mn = b[8 * (s + 4)] & 63;
    } else {
        *sc = (b[8 * (s + 4)] & 0xf) | ((b[8 * (s - 4)] >> 6) << 4);
        *mn = (b[8 * (s + 4)] >> 4) | ((b[8 * s] >> 6) << 4);
    }
}

/* Code j of row r in tile block `tb`, as the signed integer the block's scale multiplies
 * (q - 8 for Q4_0, q - 16 for Q5_0, q - 32 for Q6_K; K-quant codes 0..15 / 0..31). */
static inline int tile_code(const uint8_t *tb, int qtype, int r, int j) {
    const int64_t co = tile_codes_at(qtype);
    switch (qtype) {
    case Q8_0: return (int8_t)*tile_byte(tb, (int)co, 2, r, j);
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        const uint8_t byte = *tile_byte(tb, (int)co, 2, r, j & 15);
        int q = j < 16 ? (byte & 0xf) : (byte >> 4);
        if (qtype == Q5_0 || qtype == Q5_1) {
            const uint32_t qh = load_u32(tb + (qtype == Q5_0 ? Q5_0_QH : Q5_1_QH) + 4 * r);
            q |= (int)((qh >> qh_perm(j)) & 1) << 4;
        }
        return qtype == Q4_0 ? q - 8 : qtype == Q5_0 ? q - 16 : q;
    }
    case Q4_K: case Q5_K: {
        const int c = j / 64, l = j % 64;
        const uint8_t byte = *tile_byte(tb, (int)co, KQ_UNIT, r, 32 * c + (l & 31));
        int q = l < 32 ? (byte & 0xf) : (byte >> 4);
        if (qtype == Q5_K) q |= ((*tile_byte(tb, Q5_K_QH, KQ_UNIT, r, l & 31) >> (2 * c + (l >= 32))) & 1) << 4;
        return q;
    }
    case Q6_K: {
        const int n = j / 128, k = (j % 128) / 32, l = j % 32;
        const uint8_t byte = *tile_byte(tb, Q6_K_CODES, KQ_UNIT, r, 64 * n + 32 * (k & 1) + l);
        const int lo = k < 2 ? (byte & 0xf) : (byte >> 4);
        const int hi = (*tile_byte(tb, Q6_K_QH, KQ_UNIT, r, 32 * n + l) >> (2 * k)) & 3;
        return (lo | (hi << 4)) - 32;
    }
    default: return 0;
    }
}

/* Block b's (32 codes of row r) scale for the codes of its half h (Q6_K: 16 codes a
 * scale; the others: one for both), and its offset: w = scale * code + offset. As gguf-py
 * computes them (products of an fp16 value and a small integer: exact in float32). */
static inline float tile_scale(const uint8_t *tb, int qtype, int r, int b, int h) {
    const float d = fp16_to_f32(load_u16(tb + 2 * r));
    if (qtype == Q4_K || qtype == Q5_K) {
        int sc, mn;
        kq_scale_min(tb, r, b, &sc, &mn);
        return d * (float)sc;
    }
    if (qtype == Q6_K) return d * (float)(int8_t)tb[Q6_K_SCALES + (2 * b + h) * TILE + r];
    return d;
}

static inline float tile_offset(const uint8_t *tb, int qtype, int r, int b) {
    if (qtype == Q4_1 || qtype == Q5_1) return fp16_to_f32(load_u16(tb + 16 + 2 * r));
    if (qtype == Q4_K || qtype == Q5_K) {
        int sc, mn;
        kq_scale_min(tb, r, b, &sc, &mn);
        return -(fp16_to_f32(load_u16(tb + 16 + 2 * r)) * (float)mn);
    }
    return 0.0f;
}

#if defined(QAVX2)
/* SIMD pieces both product paths use to read tiles (AVX2). Lanes: a 16-byte unit load of 8
 * rows widened to 16-bit lanes holds row r's two code bytes in lanes 2r, 2r + 1. */

/* 16-bit (32-bit) lanes shifted left by n (right by -n), n a constant once inlined. */
static inline __m256i shift16(__m256i x, const int n) {
    return n >= 0 ? _mm256_slli_epi16(x, n) : _mm256_srli_epi16(x, -n);
}

static inline __m256i shift32(__m256i x, const int n) {
    return n >= 0 ? _mm256_slli_epi32(x, n) : _mm256_srli_epi32(x, -n);
}

static inline __m256i load_unit16(const uint8_t *p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* The codes of one code unit of 8 rows (at `p`): low nibbles (*lo) and high ones (*hi). */
static inline void unit_nibbles(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i c = load_unit16(p);
    *lo = _mm256_and_si256(c, _mm256_set1_epi16(0xf));
    *hi = _mm256_srli_epi16(c, 4);
}

/* Q5_0 / Q5_1: unit u's fifth bits from the 8 rows' permuted qh words (one per 32-bit lane,
 * common.h's qh_perm: at u, u + 16 for the low nibbles, u + 8, u + 24 for the high). */
static inline void q5_fifth(__m256i qh, const int u, __m256i *lo, __m256i *hi) {
    const __m256i bit4 = _mm256_set1_epi32(0x00100010);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(shift32(qh, 4 - u), bit4));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(shift32(qh, -(u + 4)), bit4));
}

/* Q5_K: run c's fifth bits (bits 2c and 2c + 1 of the qh bytes in unit `p`). */
static inline void q5k_fifth(const uint8_t *p, const int c, __m256i *lo, __m256i *hi) {
    const __m256i h = load_unit16(p), bit4 = _mm256_set1_epi16(0x10);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(shift16(h, 4 - 2 * c), bit4));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(shift16(h, 3 - 2 * c), bit4));
}

/* Q6_K: run c = 2n + h's top two bits (bits 2h, 2h + 1 and 4 + 2h, 5 + 2h of the qh bytes in
 * unit `p`). */
static inline void q6k_top(const uint8_t *p, const int h, __m256i *lo, __m256i *hi) {
    const __m256i q = load_unit16(p), top2 = _mm256_set1_epi16(0x30);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(shift16(q, 4 - 2 * h), top2));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(shift16(q, -2 * h), top2));
}

/* 8 rows' K-quant scales or mins (6 bits each) of sub-block s from the [byte][row] table
 * B (12 words of 8 rows), as floats times `f` (d or dmin). */
static inline __m256 kq_vec(const uint64_t B[12], int s, int mins, __m256 f) {
    const uint64_t lo6 = 0x3f3f3f3f3f3f3f3full, lo4 = 0x0f0f0f0f0f0f0f0full, top2 = 0x3030303030303030ull;
    uint64_t w;
    if (s < 4) w = (mins ? B[s + 4] : B[s]) & lo6;
    else if (!mins) w = (B[s + 4] & lo4) | ((B[s - 4] >> 2) & top2);
    else w = ((B[s + 4] >> 4) & lo4) | ((B[s] >> 2) & top2);
    return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)w))));
}

static inline void kq_table(const uint8_t *tb, uint64_t B[12]) {
    for (int k = 0; k < 12; k++) B[k] = load_u64(tb + QK_SCALES + 8 * k);
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* 8 rows' fp16 values at p as floats. */
static inline __m256 fp16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* ---------------------------------------------------------- activations (few rows) */

/* One activation row quantized for the products of few rows: v [K] int16, and per block b
 * (arrays padded to a multiple of 8 blocks): pair1 = {s, exact sum of x}, pair0 = {s, -8 s
 * sum v}: a block's d (and its offset factor) times its pair give the block's scale d s
 * and its offset term; vsum16 = {sum of v over codes 0..15, over 16..31} (Q6_K). */
typedef struct {
    int16_t *v;
    float *pair1, *pair0;
    int32_t *vsum16;
    uint8_t *dlo; /* (DEC8 builds) v as two bytes, v = 256 dhi + dlo: dlo unsigned, dhi signed */
    int8_t *dhi;
} qact;

static inline int64_t qact_blocks(int64_t K) { return (K / QK + 7) / 8 * 8; }

/* Bytes of scratch one activation row of width K needs (64-byte aligned pieces). */
static inline int64_t qact_bytes(int64_t K) {
    return 2 * ((K + 63) / 64 * 64) + (2 * K + 63) / 64 * 64 + 3 * (int64_t)sizeof(float) * 2 * qact_blocks(K) + 64;
}

static inline qact qact_at(void *scratch, int64_t K) {
    const uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63, vb = (2 * K + 63) / 64 * 64;
    qact a;
    a.v = (int16_t *)p;
    a.pair1 = (float *)(p + vb);
    a.pair0 = a.pair1 + 2 * qact_blocks(K);
    a.vsum16 = (int32_t *)(a.pair0 + 2 * qact_blocks(K));
    a.dlo = (uint8_t *)(((uintptr_t)(a.vsum16 + 2 * qact_blocks(K)) + 63) & ~(uintptr_t)63);
    a.dhi = (int8_t *)(a.dlo + (K + 63) / 64 * 64);
    return a;
}

void quantize_act(const float *x, int64_t K, qact *a);

/* out[i] = row rows[i] of a tiled [*, K] matrix as float32, i < R (rows NULL: rows 0 .. R-1). */
void q_dequant_rows(const uint8_t *tiles, int qtype, int64_t K, const int64_t *rows, int64_t R, float *out);

/* y[m, n] for m < M (M activation rows, row stride ldy) and weight rows [n0, n1) (n0 a
 * multiple of TILE) of a tiled matrix (+ bias; added to y with `accumulate`). */
void rows_product(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, int qtype,
                  int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                  int accumulate);
#define PRODUCT_CHUNK 16 /* output rows of a split's unit (two tiles) */
void thread_rows(int64_t N, int64_t *n0, int64_t *n1);

/* ------------------------------------------------------ matrices of several parts */

/* A matrix as the fused steps and q_matmul_parts take it: row blocks of possibly different
 * types stacked (a fused QKV whose V rows are Q6_K and Q/K rows Q4_K, as llama.cpp's mixes
 * store them): `desc` holds 3 int64 per part, {rows, qtype, tiles address}. */
typedef struct {
    const int64_t *desc;
    int nparts;
    const float *bias;
} qmat;

static inline int64_t qmat_rows(qmat w) {
    int64_t n = 0;
    for (int p = 0; p < w.nparts; p++) n += w.desc[3 * p];
    return n;
}

/* ---------------------------------------------------------- many rows (gemm8.c) */

int64_t gemm8_scratch_bytes(int64_t M, int64_t K);
/* What gemm8 makes of a row of x before it quantizes it (formed row by row, never stored):
 * the row itself; silu(gate) * up of a row [gate K | up K] (a SwiGLU MLP's down
 * projection); or the row RMS-normed, times norm_w (a layer's input norm before its
 * projections). */
enum { G8_PLAIN, G8_GLU, G8_NORM };
typedef struct {
    int kind;
    const float *norm_w; /* G8_NORM: [K] */
    float eps;           /* G8_NORM */
} g8input;

/* y[M, N] = in(x)[M, K] @ W^T (+ bias; added to y with accumulate) with int8 activations.
 * Must be called outside a parallel region. */
void gemm8(const float *x, int64_t M, int64_t ldx, int64_t K, qmat w, float *y, int64_t ldy,
           int accumulate, g8input in, void *scratch);

#endif
