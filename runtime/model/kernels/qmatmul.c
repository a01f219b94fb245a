/* Weight-only quantized matrix products on CPU, on GGML blocks repacked into row tiles (see
 * common.h for the formats, the tile layout and the activations' quantization): packing,
 * exact dequantization, and the products of few activation rows (decode: int16
 * activations). Products of many rows (prefill) are gemm8.c's.
 *
 * A GGUF stores each row's blocks back to back; a product of one activation row then pays,
 * for every block of every row, its own scale arithmetic (convert the int32 sums to float,
 * broadcast d s, multiply-add) on top of the two 16-bit multiply-adds that do the work. In
 * the tile layout the same bytes are reordered (at load, once) so that one 16-bit
 * multiply-add takes two codes of each of 8 rows against one broadcast pair of activation
 * values, the 16 pairs of a block sum in integer lanes (one per row), and the scales are
 * applied once per block for 8 rows from 8 contiguous fp16 values. Per block of a row:
 * ~7 instructions instead of ~14 (AVX2), so that two cores keep up with the memory bus on
 * a batch-1 decode step: measured on a 2-core EPYC (Zen 3, AVX2), Q4_1 rows 2048 wide from
 * DRAM, 2 threads: 19.4 GB/s in the row layout, 24.5 GB/s tiled (a torch.sum: 24.2).
 *
 * Every product streams the weights once and multiplies each tile by all M activation rows,
 * 4 at a time straight from the tile's bytes (the tile stays in L1/L2 between passes). An
 * earlier path unpacked each tile to 16-bit codes once and swept it with 6 rows at a time:
 * on a 2-core EPYC with AVX-512 VNNI the passes were faster at every batch from 8 to 64
 * (SmolLM2 fused batched decode, batch 8: 467-486 vs 252-305 tok/s; 64: 463-475 vs
 * 334-453), the unpacked tile (512 bytes a block) spilling out of L1. M is at most a decode
 * batch (64 rows: larger products take gemm8.c's int8 path). Work is split by chunks of
 * PRODUCT_CHUNK output rows over the OpenMP threads torch uses (torch.set_num_threads
 * governs both; the fused decode steps share the chunks out by claims, decode.c); every
 * output is computed by one thread in a fixed order, so results do not depend on the
 * thread count.
 *
 * One activation row (batch-1 decode) sums each block into four integer accumulators (lo
 * and hi nibbles, even and odd units), so the 16 multiply-adds of a block form four short
 * chains instead of two long ones: Q4_1 8192 x 2048 from L3, one thread, 25.5 -> 29.1
 * GB/s on a 2-core AMD EPYC with AVX-512 VNNI (from DRAM unchanged: the bus is the limit).
 *
 * The K-quants (Q4_K, Q5_K, Q6_K) take the same steps per 64 codes of a super-block (a
 * 32-byte run of nibbles: one block of 32 in the low halves, the next in the high ones),
 * their 6-bit scales decoded for 8 rows at once from the [byte][row] table (one 64-bit
 * word per scale byte), and the fifth / sixth code bits merged from the high-bit tables
 * with a shift and a mask per unit.
 */
#include "common.h"
#include <omp.h>

#ifndef TILE_MB
#define TILE_MB 4 /* activation rows per pass over a streamed tile */
#endif
#ifndef TILE_PF_BYTES
/* How far ahead of its reads a product prefetches, in its own stream of tiles. On a 2-core
 * EPYC (Zen 3, Q4_1 tiles from DRAM) 1 KB gave 2 threads 22.7 GB/s, 2 KB 24.5, 4 KB 22.4:
 * a core needs that many lines in flight to cover DRAM's latency. */
#define TILE_PF_BYTES 2048
#endif
#ifndef PF_HINT
/* The weights' prefetch: non-temporal, so that a decode step's stream of its whole model
 * (667 MB on the 1B shape) does not evict the rest of the machine's cache (on Zen the L3
 * takes what the L2 evicts): the engine's Python, the frontend and the client find their
 * state still cached between kernel calls. Engine decode of the 1B Q4_K_M shape, T0 and
 * NTA alternating five times at a ~48 GB/s bus: 65.9 -> 68.3 tok/s (means of run medians);
 * in-process decode (no other work between steps) the same with either. */
#define PF_HINT _MM_HINT_NTA
#endif
#ifndef KQ_PF_BYTES
/* The same for the K-quants' super-block tiles (1152 to 1680 bytes), each prefetched whole
 * when the one this far behind it starts. */
#define KQ_PF_BYTES 4096
#endif

int kernel_simd(void) {
#if defined(QAVX2)
    return 2;
#else
    return 0;
#endif
}

int64_t block_bytes(int qtype) { return qblock_bytes(qtype); }
int q_kq_unit(void) { return KQ_UNIT; } /* the K-quant tables' layout (common.h) */
int block_elems(int qtype) { return qtype_known(qtype) ? qblock_elems(qtype) : 0; }

/* Bytes of the tiles of N rows of width K (q_pack's output). */
int64_t q_tiled_bytes(int qtype, int64_t N, int64_t K) { return tiled_bytes_of(qtype, N, K); }

/* ----------------------------------------------------------------- activation quantization */

#if defined(QAVX2)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif

void quantize_act(const float *x, int64_t K, qact *a) {
    const int64_t nb = K / QK, pb = qact_blocks(K);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax, sx;
        int32_t sv = 0, sv16 = 0;
#if defined(QAVX2)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 xs[4];
        for (int h = 0; h < 4; h++) xs[h] = _mm256_loadu_ps(xb + 8 * h);
        amax = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, xs[0]), _mm256_andnot_ps(sign, xs[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, xs[2]), _mm256_andnot_ps(sign, xs[3]))));
        sx = hsum8(_mm256_add_ps(_mm256_add_ps(xs[0], xs[1]), _mm256_add_ps(xs[2], xs[3])));
        const float s = amax / 32767.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i lim = _mm256_set1_epi32(32767), nlim = _mm256_set1_epi32(-32767);
        __m256i vi[4];
        for (int h = 0; h < 4; h++)
            vi[h] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_mul_ps(xs[h], vinv))));
        sv16 = hsum8i(_mm256_add_epi32(vi[0], vi[1]));
        sv = sv16 + hsum8i(_mm256_add_epi32(vi[2], vi[3]));
        for (int h = 0; h < 2; h++) { /* packs interleaves 128-bit lanes; the permute undoes it */
            const __m256i half = _mm256_permute4x64_epi64(_mm256_packs_epi32(vi[2 * h], vi[2 * h + 1]), 0xd8);
            _mm256_store_si256((__m256i *)(a->v + b * QK + 16 * h), half);
        }
#if defined(DEC8)
        const __m512i v32 = _mm512_loadu_si512((const void *)(a->v + b * QK));
        _mm256_storeu_si256((__m256i *)(a->dlo + b * QK), _mm512_cvtepi16_epi8(v32)); /* low bytes */
        _mm256_storeu_si256((__m256i *)(a->dhi + b * QK), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v32, 8)));
#endif
#else
        amax = 0.0f;
        sx = 0.0f;
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            sx += xb[j];
        }
        const float s = amax / 32767.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * inv); /* round half to even, as cvtps_epi32 */
            v = v > 32767 ? 32767 : (v < -32767 ? -32767 : v);
            a->v[b * QK + j] = (int16_t)v;
            sv += v;
            if (j < 16) sv16 += v;
        }
#endif
        a->pair1[2 * b] = a->pair0[2 * b] = s;
        a->pair1[2 * b + 1] = sx;
        a->pair0[2 * b + 1] = -8.0f * s * (float)sv;
        a->vsum16[2 * b] = sv16;
        a->vsum16[2 * b + 1] = sv - sv16;
    }
    for (int64_t b = nb; b < pb; b++) {
        a->pair1[2 * b] = a->pair1[2 * b + 1] = a->pair0[2 * b] = a->pair0[2 * b + 1] = 0.0f;
        a->vsum16[2 * b] = a->vsum16[2 * b + 1] = 0;
    }
}

/* ------------------------------------------------------------ tiles: packing and reading */

/* The 16-bit units of row r's code bytes in tile block `tb` are unit u of the block's
 * [units][TILE] table (unit u of a GGML row's code bytes is bytes 2u, 2u + 1). */
static inline const uint8_t *tile_unit(const uint8_t *tb, int qtype, int r, int u) {
    return tb + tile_codes_at(qtype) + 2 * (u * TILE + r);
}

#if defined(QAVX2)
/* x[r] (unit j of row r in 16-bit lane j) -> x[j] (unit j of every row, row r in lane r). */
static inline void transpose8x8_epi16(__m128i x[8]) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[i] = _mm_unpacklo_epi16(x[2 * i], x[2 * i + 1]);
        a[4 + i] = _mm_unpackhi_epi16(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) { /* rows 0-3 (i 0) and 4-7 (i 1); units 0-3 (h 0), 4-7 */
            b[4 * i + 2 * h] = _mm_unpacklo_epi32(a[4 * h + 2 * i], a[4 * h + 2 * i + 1]);
            b[4 * i + 2 * h + 1] = _mm_unpackhi_epi32(a[4 * h + 2 * i], a[4 * h + 2 * i + 1]);
        }
    for (int j = 0; j < 4; j++) {
        x[2 * j] = _mm_unpacklo_epi64(b[j], b[4 + j]);
        x[2 * j + 1] = _mm_unpackhi_epi64(b[j], b[4 + j]);
    }
}
#endif

static uint32_t qh_permute(uint32_t qh) {
    uint32_t out = 0;
    for (int j = 0; j < 32; j++) out |= ((qh >> j) & 1u) << qh_perm(j);
    return out;
}

static uint32_t qh_unpermute(uint32_t w) {
    uint32_t out = 0;
    for (int j = 0; j < 32; j++) out |= ((w >> qh_perm(j)) & 1u) << j;
    return out;
}

/* One tile block `tb` from the GGML blocks of its 8 rows (blk[r]; NULL: a zero row). */
static void pack_tile_block(const uint8_t *const blk[TILE], int qtype, uint8_t *tb) {
    static const uint8_t zero[256]; /* a block of zeros, as long as the longest */
    tile_field f[5];
    const int nf = tile_fields(qtype, f);
    const uint8_t *src[TILE];
    for (int r = 0; r < TILE; r++) src[r] = blk[r] ? blk[r] : zero;
    for (int i = 0; i < nf; i++) {
        const tile_field F = f[i];
        int k = 0;
#if defined(QAVX2)
        if (F.unit == 2)
            for (; 2 * (k + 8) <= F.len; k += 8) { /* 8 units of 8 rows: one 8 x 8 transpose */
                __m128i x[8];
                for (int r = 0; r < TILE; r++) x[r] = _mm_loadu_si128((const __m128i *)(src[r] + F.src + 2 * k));
                transpose8x8_epi16(x);
                for (int u = 0; u < 8; u++) _mm_storeu_si128((__m128i *)(tb + F.dst + 16 * (k + u)), x[u]);
            }
#endif
        if (F.unit == 8) /* (a constant size: no call per unit) */
            for (; 8 * k < F.len; k++)
                for (int r = 0; r < TILE; r++) memcpy(tb + F.dst + (k * TILE + r) * 8, src[r] + F.src + 8 * k, 8);
        for (; k * F.unit < F.len; k++)
            for (int r = 0; r < TILE; r++)
                memcpy(tb + F.dst + (k * TILE + r) * F.unit, src[r] + F.src + k * F.unit, F.unit);
    }
    if (qtype == Q5_0 || qtype == Q5_1) {
        uint8_t *qh = tb + (qtype == Q5_0 ? Q5_0_QH : Q5_1_QH);
        for (int r = 0; r < TILE; r++) {
            const uint32_t w = qh_permute(load_u32(qh + 4 * r));
            memcpy(qh + 4 * r, &w, 4);
        }
    }
}

/* Row r's block from tile block `tb`, back in GGML's layout. */
static void unpack_block(const uint8_t *tb, int qtype, int r, uint8_t *blk) {
    tile_field f[5];
    const int nf = tile_fields(qtype, f);
    for (int i = 0; i < nf; i++)
        for (int k = 0; k * f[i].unit < f[i].len; k++)
            memcpy(blk + f[i].src + k * f[i].unit, tb + f[i].dst + (k * TILE + r) * f[i].unit, f[i].unit);
    if (qtype == Q5_0 || qtype == Q5_1) {
        uint8_t *qh = blk + (qtype == Q5_0 ? 2 : 4);
        const uint32_t w = qh_unpermute(load_u32(qh));
        memcpy(qh, &w, 4);
    }
}

/* The tiles of N rows of width K whose GGML blocks start at rowptr[n] (any addresses: a
 * mapped file, several tensors stacked, rows in another order), into `out`
 * (q_tiled_bytes(qtype, N, K) bytes; the last tile's missing rows are zeros). */
void q_pack(const int64_t *rowptr, int qtype, int64_t K, int64_t N, uint8_t *out) {
    const int64_t nb = K / qblock_elems(qtype), bb = qblock_bytes(qtype), tbb = tile_block_bytes(qtype);
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) if (N * K >= 1 << 20)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *row[TILE];
        for (int r = 0; r < TILE; r++) row[r] = t * TILE + r < N ? (const uint8_t *)rowptr[t * TILE + r] : NULL;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk[TILE];
            for (int r = 0; r < TILE; r++) blk[r] = row[r] ? row[r] + b * bb : NULL;
            pack_tile_block(blk, qtype, out + (t * nb + b) * tbb);
        }
    }
}

/* Rows of a matrix in GGML's layout copied out as contiguous blocks (`out`: [R, row
 * bytes]; row r from rowptr[r]). */
void q_gather_rows(const int64_t *rowptr, int qtype, int64_t K, int64_t R, uint8_t *out) {
    const int64_t rb = row_bytes_of(qtype, K);
    for (int64_t r = 0; r < R; r++) memcpy(out + r * rb, (const uint8_t *)rowptr[r], rb);
}

/* The GGML blocks of all N rows (`out`: [N, row bytes]), as the file stored them. */
void q_unpack_rows(const uint8_t *tiles, int qtype, int64_t K, int64_t N, uint8_t *out) {
    const int64_t nb = K / qblock_elems(qtype), bb = qblock_bytes(qtype), tbb = tile_block_bytes(qtype);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            unpack_block(tiles + ((n / TILE) * nb + b) * tbb, qtype, (int)(n % TILE), out + (n * nb + b) * bb);
}

/* The weights of row r of tile block `tb` (one GGML block: 32 or 256 values) into `o`,
 * with gguf-py's float32 arithmetic (scale * code, then + offset; the products are exact). */
static void dequant_tile_row(const uint8_t *tb, int qtype, int r, float *o) {
    const int blocks = qblock_elems(qtype) / QK;
    for (int b = 0; b < blocks; b++) {
        const float off = tile_offset(tb, qtype, r, b);
        const int has_off = qtype == Q4_1 || qtype == Q5_1 || is_kquant(qtype);
        for (int h = 0; h < 2; h++) {
            const float sc = tile_scale(tb, qtype, r, b, h);
            for (int j = 16 * h; j < 16 * h + 16; j++) {
                const float w = sc * (float)tile_code(tb, qtype, r, QK * b + j);
                o[QK * b + j] = has_off ? w + off : w;
            }
        }
    }
}

/* out[r, K] = the float32 weights of rows rows[r] (an embedding lookup), or of all rows. */
void q_dequant_rows(const uint8_t *tiles, int qtype, int64_t K, const int64_t *rows, int64_t R,
                    float *out) {
    const int64_t be = qblock_elems(qtype), nb = K / be, tbb = tile_block_bytes(qtype);
#pragma omp parallel for schedule(static) if (R * K >= 262144)
    for (int64_t i = 0; i < R; i++) {
        const int64_t n = rows ? rows[i] : i;
        const int r = (int)(n % TILE);
        for (int64_t b = 0; b < nb; b++)
            dequant_tile_row(tiles + ((n / TILE) * nb + b) * tbb, qtype, r, out + i * K + b * be);
    }
}

/* ------------------------------------------------------------------------ products: C */

#if !defined(QAVX2)
/* The same sums as the AVX2 paths, in plain C: per block of 32 codes of a row, its integer
 * dot product with the activation's int16 values (the codes as the scale multiplies them,
 * Q4_0's -8 and the like included), scaled once by its scale times s (per 16 codes for
 * Q6_K), plus its offset times the exact sum of the block's x. */
static void tiles_scalar(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, int qtype,
                         int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                         int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype), be = qblock_elems(qtype), nsb = K / be;
    const int sub = (int)(be / QK);
    for (int64_t t = n0 / TILE; t * TILE < n1; t++) {
        for (int64_t i = 0; i < M; i++) {
            const qact *a = acts + i;
            float sum[TILE] = {0}, off[TILE] = {0};
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *tb = tiles + (t * nsb + sb) * tbb;
                for (int r = 0; r < TILE; r++)
                    for (int b = 0; b < sub; b++) {
                        const int64_t gb = sb * sub + b;
                        const int16_t *v = a->v + gb * QK;
                        for (int h = 0; h < 2; h++) {
                            int32_t dot = 0;
                            for (int j = 16 * h; j < 16 * h + 16; j++) dot += tile_code(tb, qtype, r, QK * b + j) * v[j];
                            sum[r] += (float)dot * (tile_scale(tb, qtype, r, b, h) * a->pair1[2 * gb]);
                        }
                        off[r] += tile_offset(tb, qtype, r, b) * a->pair1[2 * gb + 1];
                    }
            }
            for (int r = 0; r < TILE && t * TILE + r < n1; r++) {
                const int64_t n = t * TILE + r;
                const float v = sum[r] + off[r] + (bias ? bias[n] : 0.0f);
                float *out = y + i * ldy + n;
                *out = accumulate ? *out + v : v;
            }
        }
    }
}
#endif

/* ------------------------------------------------------------ products: AVX2, AVX-512 */

#if defined(QAVX2)
/* The loops below take UPV code units per vector: one (a 16-byte load of 8 rows widened to
 * 16-bit lanes in a 256-bit vector; the activation pair it multiplies broadcast), or with
 * AVX-512 two (32 bytes in a 512-bit vector: unit u's rows in the low half, unit u + 1's
 * in the high half; their activation pairs picked out of the block's 16 pairs by one
 * permute). Per block the two halves' integer sums are folded into one 256-bit vector of
 * 8 rows, and the float work is the same on both. */
#if defined(__AVX512BW__) && defined(__AVX512F__)
#define UPV 2
typedef __m512i vunit;
static inline vunit v_load_units(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vunit v_load_units_signed(const uint8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vunit v_zero(void) { return _mm512_setzero_si512(); }
static inline vunit v_and(vunit a, vunit b) { return _mm512_and_si512(a, b); }
static inline vunit v_or(vunit a, vunit b) { return _mm512_or_si512(a, b); }
static inline vunit v_add(vunit a, vunit b) { return _mm512_add_epi32(a, b); }
static inline vunit v_set16(short x) { return _mm512_set1_epi16(x); }
static inline vunit v_shift16(vunit x, const int n) { return n >= 0 ? _mm512_slli_epi16(x, n) : _mm512_srli_epi16(x, -n); }
static inline __m256i v_fold(vunit a) { return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)); }
/* Pairs u and u + 1 of the 16 int32 pairs at xv: lanes 0-7 and 8-15. */
static inline vunit v_pairs(const int32_t *xv, const int u) {
    return _mm512_permutexvar_epi32(_mm512_set_epi32(u + 1, u + 1, u + 1, u + 1, u + 1, u + 1, u + 1, u + 1,
                                                     u, u, u, u, u, u, u, u),
                                    _mm512_loadu_si512((const void *)xv));
}
static inline vunit v_madd(vunit acc, vunit a, vunit b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
/* Q5_0 / Q5_1: units u, u + 1's fifth bits from [qh, qh] (8 rows' permuted words twice):
 * rotated to bits 4 and 20 (common.h, qh_perm). */
static inline void v_q5_fifth(vunit qh2, const int u, vunit *lo, vunit *hi) {
    const vunit bit4 = _mm512_set1_epi32(0x00100010);
    const int a = (36 - u) & 31, b = (35 - u) & 31, c = (28 - u) & 31, d = (27 - u) & 31;
    const vunit rl = _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
    const vunit rh = _mm512_set_epi32(d, d, d, d, d, d, d, d, c, c, c, c, c, c, c, c);
    *lo = v_or(*lo, v_and(_mm512_rolv_epi32(qh2, rl), bit4));
    *hi = v_or(*hi, v_and(_mm512_rolv_epi32(qh2, rh), bit4));
}
static inline vunit v_q5_words(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
#else
#define UPV 1
typedef __m256i vunit;
static inline vunit v_load_units(const uint8_t *p) { return load_unit16(p); }
static inline vunit v_load_units_signed(const uint8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vunit v_zero(void) { return _mm256_setzero_si256(); }
static inline vunit v_and(vunit a, vunit b) { return _mm256_and_si256(a, b); }
static inline vunit v_or(vunit a, vunit b) { return _mm256_or_si256(a, b); }
static inline vunit v_add(vunit a, vunit b) { return _mm256_add_epi32(a, b); }
static inline vunit v_set16(short x) { return _mm256_set1_epi16(x); }
static inline vunit v_shift16(vunit x, const int n) { return shift16(x, n); }
static inline __m256i v_fold(vunit a) { return a; }
static inline vunit v_pairs(const int32_t *xv, const int u) { return _mm256_set1_epi32(xv[u]); }
static inline vunit v_madd(vunit acc, vunit a, vunit b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
static inline void v_q5_fifth(vunit qh, const int u, vunit *lo, vunit *hi) { q5_fifth(qh, u, lo, hi); }
static inline vunit v_q5_words(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
#endif

/* Code units u .. u + UPV - 1 at `p` (16 bytes apart): low nibbles and high ones. */
static inline void v_nibbles(const uint8_t *p, vunit *lo, vunit *hi) {
    const vunit c = v_load_units(p);
    *lo = v_and(c, v_set16(0xf));
    *hi = v_shift16(c, -4);
}

/* Q5_K: run c's fifth bits from the qh units at p. */
static inline void v_q5k_fifth(const uint8_t *p, const int c, vunit *lo, vunit *hi) {
    const vunit h = v_load_units(p), bit4 = v_set16(0x10);
    *lo = v_or(*lo, v_and(v_shift16(h, 4 - 2 * c), bit4));
    *hi = v_or(*hi, v_and(v_shift16(h, 3 - 2 * c), bit4));
}

/* Q6_K: run c = 2n + h's top two bits from the qh units at p. */
static inline void v_q6k_top(const uint8_t *p, const int h, vunit *lo, vunit *hi) {
    const vunit q = v_load_units(p), top2 = v_set16(0x30);
    *lo = v_or(*lo, v_and(v_shift16(q, 4 - 2 * h), top2));
    *hi = v_or(*hi, v_and(v_shift16(q, -2 * h), top2));
}

/* The MB rows' partial outputs of one tile (8 weight rows) into y. */
static inline __attribute__((always_inline)) void
store_tile(const __m256 *facc, const int MB, int64_t n0, int rows, float *y, int64_t ldy,
           const float *bias, int accumulate) {
    for (int i = 0; i < MB; i++) {
        float *yr = y + i * ldy + n0;
        if (rows == TILE && !bias && !accumulate) {
            _mm256_storeu_ps(yr, facc[i]);
            continue;
        }
        float out[TILE];
        _mm256_storeu_ps(out, facc[i]);
        for (int r = 0; r < rows; r++) {
            const float v = out[r] + (bias ? bias[n0 + r] : 0.0f);
            yr[r] = accumulate ? yr[r] + v : v;
        }
    }
}

/* Integer chains of one block: one activation row (MB 1) sums into four (lo / hi, even /
 * odd vector step), so a block's multiply-adds form short dependency chains; two rows into
 * two (lo, hi); more into one. Chain of a step's lo and hi sums, and the block's total. */
static inline int chain_lo(const int MB, int step) { return MB == 1 ? 2 * (step & 1) : 0; }
static inline int chain_hi(const int MB, int step) { return MB == 1 ? 2 * (step & 1) + 1 : MB == 2; }
static inline __m256i chain_sum(vunit c[4], const int MB) {
    return v_fold(MB == 1 ? v_add(v_add(c[0], c[1]), v_add(c[2], c[3])) : MB == 2 ? v_add(c[0], c[1]) : c[0]);
}

/* y[i][t*8 .. t*8+8) for MB activation rows (MB a constant once inlined) over tile t of a
 * type with blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): per block, the code pairs of 8
 * rows (a unit load widened to 16-bit lanes: a nibble type's low nibbles are one pair of
 * codes, its high nibbles the pair 16 further on, Q5's fifth bits shifted in from the
 * permuted qh) times each row's pair of activation values, summed in integer lanes (one
 * per weight row), then scaled once for the 8 rows. */
static inline __attribute__((always_inline)) void
tile_mb(const qact *acts, const int MB, int64_t nb, const uint8_t *tp, const int qtype,
        int64_t n0, int rows, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype), co = tile_codes_at(qtype);
    const int q5 = qtype == Q5_0 || qtype == Q5_1, moff = qtype == Q4_1 || qtype == Q5_1;
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tp + b * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + TILE_PF_BYTES + o), PF_HINT);
        vunit iacc[TILE_MB][4];
        for (int i = 0; i < MB; i++) iacc[i][0] = iacc[i][1] = iacc[i][2] = iacc[i][3] = v_zero();
        if (qtype == Q8_0) {
            for (int u = 0; u < 16; u += UPV) {
                const vunit w = v_load_units_signed(tb + co + 16 * u);
                for (int i = 0; i < MB; i++) {
                    const int32_t *xv = (const int32_t *)(acts[i].v + b * QK);
                    const int c = MB == 1 ? ((u / UPV) & 3) : MB == 2 ? ((u / UPV) & 1) : 0; /* chains */
                    iacc[i][c] = v_madd(iacc[i][c], w, v_pairs(xv, u));
                }
            }
        } else {
            const vunit qh = q5 ? v_q5_words(tb + (qtype == Q5_0 ? Q5_0_QH : Q5_1_QH)) : v_zero();
            for (int u = 0; u < 8; u += UPV) {
                vunit lo, hi;
                v_nibbles(tb + co + 16 * u, &lo, &hi);
                if (q5) v_q5_fifth(qh, u, &lo, &hi);
                for (int i = 0; i < MB; i++) {
                    const int32_t *xv = (const int32_t *)(acts[i].v + b * QK);
                    const int cl = chain_lo(MB, u / UPV), ch = chain_hi(MB, u / UPV);
                    iacc[i][cl] = v_madd(iacc[i][cl], lo, v_pairs(xv, u));
                    iacc[i][ch] = v_madd(iacc[i][ch], hi, v_pairs(xv, 8 + u));
                }
            }
        }
        const __m256 d = fp16x8(tb);
        /* the offset term's factor: m (Q4_1, Q5_1), d (Q4_0: times -8 s sum v), 2d (Q5_0:
         * -16 s sum v), none (Q8_0) */
        const __m256 m = moff ? fp16x8(tb + 16) : qtype == Q5_0 ? _mm256_add_ps(d, d) : d;
        for (int i = 0; i < MB; i++) {
            const float *pair = (qtype == Q4_0 || qtype == Q5_0 ? acts[i].pair0 : acts[i].pair1) + 2 * b;
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chain_sum(iacc[i], MB)), _mm256_mul_ps(d, _mm256_broadcast_ss(pair)), facc[i]);
            if (qtype != Q8_0) facc[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(pair + 1), facc[i]);
        }
    }
    store_tile(facc, MB, n0, rows, y, ldy, bias, accumulate);
}

/* The integer sum of a run's block k (0: its low-nibble block, 1: its high one). */
static inline __m256i run_sum(vunit c[4], const int MB, int k) {
    return v_fold(MB == 1 ? v_add(c[k], c[k + 2]) : c[k]);
}

#if defined(DEC8)
/* K-quant products of few rows (1-4 a pass) on bytes (DEC8). The int16 passes widen every
 * code to 16 bits and multiply 2 codes a lane (dpwssd); here the codes stay bytes and
 * dpbusd multiplies 4 a lane, each activation v taken as two bytes, v = 256 dhi + dlo (dlo
 * unsigned, dhi signed): sum q v = sum dlo q + 256 sum q dhi, two byte multiply-adds (q,
 * 0..63, is both a signed and an unsigned byte), the same integer sums exactly. On these
 * builds the code tables are packed in 8-byte units (common.h, KQ_UNIT): a 64-byte load
 * holds 8 code bytes of each of the 8 rows, row r's first 4 in 32-bit lane 2r and its next
 * 4 in lane 2r + 1 (lane (r, p)), so one 8-byte broadcast of the activation bytes matches
 * both. On a 2-core AMD EPYC (Zen 5), one thread, the 1B Q4_K_M shape's matrices from
 * DRAM: Q6_K 23.1 -> 34.5 GB/s, Q4_K unchanged (31-35) (with a byte permute a load, before
 * the layout); on a Zen 4 from L3, one thread, the layout in place of the permute: Q4_K
 * 30.3 -> 33.1 GB/s. */
/* acc += codes (bytes, 0..63) times the activation bytes of 8 positions from `pos`. */
static inline void d8_madd(__m512i *lo, __m512i *hi, __m512i codes, const qact *a, int64_t pos) {
    *lo = _mm512_dpbusd_epi32(*lo, _mm512_set1_epi64((long long)load_u64(a->dlo + pos)), codes);
    *hi = _mm512_dpbusd_epi32(*hi, codes, _mm512_set1_epi64((long long)load_u64((const uint8_t *)a->dhi + pos)));
}

/* Half k (0: lanes 0-7) of v. */
static inline __m256 half8(__m512 v, int k) {
    return k ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}

/* Lanes {x, x, ..} (0-7) and {y, y, ..} (8-15). */
static inline __m512 two8(float x, float y) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(x))),
                                               _mm256_castps_pd(_mm256_set1_ps(y)), 1));
}

/* A Q4_K / Q5_K tile block's scale factors, two sub-blocks a vector (lanes 0-7: sub-block
 * 2p's 8 rows, 8-15: 2p + 1's): dsc[p] = d sc, dmn[p] = dmin m, the 6-bit scales and mins
 * unpacked for all 8 sub-blocks at once (kq_vec's bits, and the same products, so the same
 * floats; a row's scale is then (d sc) s, s its block's, as the int16 passes form it). */
static inline void kq_scales16(const uint8_t *tb, __m512 dsc[4], __m512 dmn[4]) {
    const __m256i X = _mm256_loadu_si256((const __m256i *)(tb + QK_SCALES)), /* [byte][row] words 0-3 */
        Y = _mm256_loadu_si256((const __m256i *)(tb + QK_SCALES + 32)),
        Z = _mm256_loadu_si256((const __m256i *)(tb + QK_SCALES + 64));
    const __m256i lo6 = _mm256_set1_epi8(0x3f), lo4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    const __m256i sc[2] = {_mm256_and_si256(X, lo6),
                           _mm256_or_si256(_mm256_and_si256(Z, lo4), _mm256_and_si256(_mm256_srli_epi16(X, 2), top2))};
    const __m256i mn[2] = {_mm256_and_si256(Y, lo6),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(Z, 4), lo4),
                                           _mm256_and_si256(_mm256_srli_epi16(Y, 2), top2))};
    const __m256 d8 = fp16x8(tb), dmin8 = fp16x8(tb + 16);
    const __m512 d = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(d8)));
    const __m512 dmin = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(dmin8)));
    for (int p = 0; p < 4; p++) {
        const __m128i scb = p & 1 ? _mm256_extracti128_si256(sc[p >> 1], 1) : _mm256_castsi256_si128(sc[p >> 1]);
        const __m128i mnb = p & 1 ? _mm256_extracti128_si256(mn[p >> 1], 1) : _mm256_castsi256_si128(mn[p >> 1]);
        dsc[p] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scb)));
        dmn[p] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mnb)));
    }
}

/* tile_mb_k on bytes (Q4_K, Q5_K), for MB activation rows: each 64 bytes of codes split
 * into nibbles once, then 4 byte multiply-adds per row. A run's two blocks are not reduced
 * to their 8 rows' sums one by one: each block's 16 lanes (r, p) are scaled as they stand
 * (the row's scale duplicated into lanes 2r, 2r + 1) into a float accumulator of 16 lanes
 * per row, the mins into another of (block, row) lanes, and both are folded to the 8 rows
 * once per tile. The integer sums are the int16 passes'; only the float sums' order
 * differs (within a few ulps; test_quant_kernel.py). On a 2-core AMD EPYC (Zen 4), one
 * thread, a Q4_K matrix from L3, one row: 26.6 -> 30.3 GB/s with this order (Q5_K 23.5
 * -> 26.3), 33.1 with the 8-byte units in place of a byte permute a load. */
static inline __attribute__((always_inline)) void
tile_k_d8(const qact *acts, const int MB, int64_t nsb, const uint8_t *tp, const int qtype, int64_t n0, int rows,
          float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype), co = tile_codes_at(qtype);
    const __m512i m4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                  dup_hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    __m512 f16[TILE_MB], m16[TILE_MB];
    for (int i = 0; i < MB; i++) f16[i] = m16[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *tb = tp + sb * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + KQ_PF_BYTES + o), PF_HINT);
        __m512 dsc[4], dmn[4];
        kq_scales16(tb, dsc, dmn);
        for (int c = 0; c < 4; c++) {
            const uint8_t *run = tb + co + 256 * c;
            const int64_t x0 = sb * QKK + 64 * c; /* block 2c's positions; 2c + 1's from x0 + 32 */
            __m512i al[TILE_MB], ah[TILE_MB], bl[TILE_MB], bh[TILE_MB];
            for (int i = 0; i < MB; i++) al[i] = ah[i] = bl[i] = bh[i] = _mm512_setzero_si512();
            for (int it = 0; it < 4; it++) {
                const __m512i z = _mm512_loadu_si512((const void *)(run + 64 * it));
                __m512i lo = _mm512_and_si512(z, m4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
                if (qtype == Q5_K) {
                    const __m512i q = _mm512_loadu_si512((const void *)(tb + Q5_K_QH + 64 * it));
                    const int sl = 4 - 2 * c, sh = 3 - 2 * c;
                    lo = _mm512_or_si512(lo, _mm512_and_si512(sl >= 0 ? _mm512_slli_epi16(q, sl) : _mm512_srli_epi16(q, -sl), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(sh >= 0 ? _mm512_slli_epi16(q, sh) : _mm512_srli_epi16(q, -sh), bit4));
                }
                for (int i = 0; i < MB; i++) {
                    d8_madd(&al[i], &ah[i], lo, acts + i, x0 + 8 * it);
                    d8_madd(&bl[i], &bh[i], hi, acts + i, x0 + 32 + 8 * it);
                }
            }
            const __m512 da = _mm512_permutexvar_ps(dup_lo, dsc[c]), db = _mm512_permutexvar_ps(dup_hi, dsc[c]);
            for (int i = 0; i < MB; i++) {
                const float *pair = acts[i].pair1 + 2 * (sb * 8 + 2 * c); /* blocks 2c, 2c + 1: {s, sum x} */
                const __m512i s0 = _mm512_add_epi32(al[i], _mm512_slli_epi32(ah[i], 8)); /* block 2c */
                const __m512i s1 = _mm512_add_epi32(bl[i], _mm512_slli_epi32(bh[i], 8)); /* 2c + 1 */
                f16[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(da, _mm512_set1_ps(pair[0])), f16[i]);
                f16[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(db, _mm512_set1_ps(pair[2])), f16[i]);
                m16[i] = _mm512_fnmadd_ps(dmn[c], two8(pair[1], pair[3]), m16[i]);
            }
        }
    }
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) {
        const __m512 t = _mm512_add_ps(f16[i], _mm512_permute_ps(f16[i], 0xb1)); /* lanes 2r: row r's */
        const __m256 f = _mm256_castsi256_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps_si512(t))));
        facc[i] = _mm256_add_ps(f, _mm256_add_ps(half8(m16[i], 0), half8(m16[i], 1)));
    }
    store_tile(facc, MB, n0, rows, y, ldy, bias, accumulate);
}

/* A Q6_K tile block's scale factors: dsc[b] = d sc for block b of 32 (lanes 0-7: its first
 * 16 codes' scale of the 8 rows, 8-15: its second 16's), all 16 scales a row converted at
 * once (the same products as one at a time, so the same floats). */
static inline void q6k_scales16(const uint8_t *tb, __m512 dsc[8]) {
    const __m256 d8 = fp16x8(tb);
    const __m512 d = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(d8)));
    for (int b = 0; b < 8; b++) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(tb + Q6_K_SCALES + 2 * TILE * b)); /* [half][row] */
        dsc[b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    }
}

/* tile_mb_q6k on bytes, for MB activation rows. Per 16 codes (a scale each) the two blocks
 * of a run (low and high nibbles) are reduced together, into one vector of (block, row)
 * lanes, scaled and summed in 16 lanes, folded once per tile (as tile_k_d8's, the int16
 * passes' integer sums, the float sums in another order). One Zen 4 thread from L3: 24.0
 * -> 25.1 GB/s a row, 13.7 -> 14.9 two (against each block's 8 rows reduced alone; a
 * 16-lane sum per block, as Q4_K's, measured slower: twice the folds per code). */
static inline __attribute__((always_inline)) void
tile_q6k_d8(const qact *acts, const int MB, int64_t nsb, const uint8_t *tp, int64_t n0, int rows, float *y,
            int64_t ldy, const float *bias, int accumulate) {
    const int64_t tbb = tile_block_bytes(Q6_K);
    const __m512i m4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                  odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 f16[TILE_MB];
    for (int i = 0; i < MB; i++) f16[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *tb = tp + sb * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + KQ_PF_BYTES + o), PF_HINT);
        __m512 dsc[8];
        q6k_scales16(tb, dsc);
        for (int c = 0; c < 4; c++) {
            const int n = c >> 1, h = c & 1, bl = 4 * n + h, bh = bl + 2;
            const uint8_t *run = tb + Q6_K_CODES + 256 * c, *qhr = tb + Q6_K_QH + 256 * n;
            for (int half = 0; half < 2; half++) {
                __m512i ll[TILE_MB], lh[TILE_MB], hl[TILE_MB], hh[TILE_MB];
                for (int i = 0; i < MB; i++) ll[i] = lh[i] = hl[i] = hh[i] = _mm512_setzero_si512();
                for (int it = 0; it < 2; it++) {
                    const int64_t at = 128 * half + 64 * it;
                    const __m512i z = _mm512_loadu_si512((const void *)(run + at));
                    const __m512i q = _mm512_loadu_si512((const void *)(qhr + at));
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(z, m4),
                                                       _mm512_and_si512(_mm512_slli_epi16(q, 4 - 2 * h), top2));
                    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), m4),
                                                       _mm512_and_si512(_mm512_srli_epi16(q, 2 * h), top2));
                    const int64_t x = sb * QKK + 16 * half + 8 * it;
                    for (int i = 0; i < MB; i++) {
                        d8_madd(&ll[i], &lh[i], lo, acts + i, x + 32 * bl);
                        d8_madd(&hl[i], &hh[i], hi, acts + i, x + 32 * bh);
                    }
                }
                /* lanes 0-7: block bl's 8 rows, 8-15: block bh's, at this half's scale */
                const __m512 w2 = half ? _mm512_shuffle_f32x4(dsc[bl], dsc[bh], 0xee) : _mm512_shuffle_f32x4(dsc[bl], dsc[bh], 0x44);
                for (int i = 0; i < MB; i++) {
                    const __m512i sl = _mm512_add_epi32(ll[i], _mm512_slli_epi32(lh[i], 8));
                    const __m512i sh = _mm512_add_epi32(hl[i], _mm512_slli_epi32(hh[i], 8));
                    const __m512i t = _mm512_add_epi32(_mm512_permutex2var_epi32(sl, even, sh), _mm512_permutex2var_epi32(sl, odd, sh));
                    const int32_t *vs = acts[i].vsum16 + 2 * sb * 8 + half; /* the -32: 32 x the half's sum of v */
                    const __m512i off = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(32 * vs[2 * bl])),
                                                           _mm256_set1_epi32(32 * vs[2 * bh]), 1);
                    const float *pair = acts[i].pair1 + 2 * sb * 8;
                    f16[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t, off)),
                                             _mm512_mul_ps(w2, two8(pair[2 * bl], pair[2 * bh])), f16[i]);
                }
            }
        }
    }
    __m256 facc[TILE_MB]; /* the blocks' halves of each row's sums added */
    for (int i = 0; i < MB; i++) facc[i] = _mm256_add_ps(half8(f16[i], 0), half8(f16[i], 1));
    store_tile(facc, MB, n0, rows, y, ldy, bias, accumulate);
}
#endif

/* As tile_mb for Q4_K / Q5_K: per super-block, 4 runs of 64 codes (32 bytes of nibbles a
 * row: block 2c in the low halves, block 2c + 1 in the high ones; Q5_K's fifth bits from
 * bit 2c / 2c + 1 of the qh table's bytes), each run's two blocks scaled by d sc and
 * offset by dmin mn times the block's exact x sum. */
static inline __attribute__((always_inline)) void
tile_mb_k(const qact *acts, const int MB, int64_t nsb, const uint8_t *tp, const int qtype,
          int64_t n0, int rows, float *y, int64_t ldy, const float *bias, int accumulate) {
#if defined(DEC8) /* (the int16 passes below read 2-byte units) */
    tile_k_d8(acts, MB, nsb, tp, qtype, n0, rows, y, ldy, bias, accumulate);
#else
    const int64_t tbb = tile_block_bytes(qtype), co = tile_codes_at(qtype);
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *tb = tp + sb * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + KQ_PF_BYTES + o), PF_HINT);
        const __m256 d = fp16x8(tb), dmin = fp16x8(tb + 16);
        uint64_t B[12];
        kq_table(tb, B);
        for (int c = 0; c < 4; c++) {
            const uint8_t *run = tb + co + 256 * c;
            vunit iacc[TILE_MB][4];
            for (int i = 0; i < MB; i++) iacc[i][0] = iacc[i][1] = iacc[i][2] = iacc[i][3] = v_zero();
            for (int u = 0; u < 16; u += UPV) {
                vunit lo, hi;
                v_nibbles(run + 16 * u, &lo, &hi);
                if (qtype == Q5_K) v_q5k_fifth(tb + Q5_K_QH + 16 * u, c, &lo, &hi);
                for (int i = 0; i < MB; i++) {
                    const int32_t *xv = (const int32_t *)(acts[i].v + sb * QKK + 64 * c);
                    const int cl = MB == 1 ? 2 * ((u / UPV) & 1) : 0, ch = MB == 1 ? cl + 1 : 1;
                    iacc[i][cl] = v_madd(iacc[i][cl], lo, v_pairs(xv, u));
                    iacc[i][ch] = v_madd(iacc[i][ch], hi, v_pairs(xv + 16, u));
                }
            }
            for (int k = 0; k < 2; k++) { /* block 2c (low nibbles), 2c + 1 (high) */
                const int s = 2 * c + k;
                const __m256 dsc = kq_vec(B, s, 0, d), dmn = kq_vec(B, s, 1, dmin);
                for (int i = 0; i < MB; i++) {
                    const float *pair = acts[i].pair1 + 2 * (sb * 8 + s);
                    facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(run_sum(iacc[i], MB, k)), _mm256_mul_ps(dsc, _mm256_broadcast_ss(pair)), facc[i]);
                    facc[i] = _mm256_fnmadd_ps(dmn, _mm256_broadcast_ss(pair + 1), facc[i]);
                }
            }
        }
    }
    store_tile(facc, MB, n0, rows, y, ldy, bias, accumulate);
#endif
}

/* As tile_mb for Q6_K: per super-block, 4 runs of 32 ql bytes a row (c = 2n + h: block
 * 4n + h in the low nibbles, 4n + 2 + h in the high ones; their top two bits from bits 2h
 * and 4 + 2h of qh bytes 32n + l), summed per 16 codes (each half its own int8 scale), the
 * -32 applied as 32 times the half's integer sum of v. */
static inline __attribute__((always_inline)) void
tile_mb_q6k(const qact *acts, const int MB, int64_t nsb, const uint8_t *tp, int64_t n0, int rows,
            float *y, int64_t ldy, const float *bias, int accumulate) {
#if defined(DEC8) /* (the int16 passes below read 2-byte units) */
    tile_q6k_d8(acts, MB, nsb, tp, n0, rows, y, ldy, bias, accumulate);
#else
    const int64_t tbb = tile_block_bytes(Q6_K);
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *tb = tp + sb * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + KQ_PF_BYTES + o), PF_HINT);
        const __m256 d = fp16x8(tb);
        for (int c = 0; c < 4; c++) {
            const int n = c >> 1, h = c & 1, bl = 4 * n + h, bh = bl + 2;
            const uint8_t *run = tb + Q6_K_CODES + 256 * c, *qhr = tb + Q6_K_QH + 256 * n;
            for (int half = 0; half < 2; half++) {
                vunit iacc[TILE_MB][4];
                for (int i = 0; i < MB; i++) iacc[i][0] = iacc[i][1] = iacc[i][2] = iacc[i][3] = v_zero();
                for (int u = 8 * half; u < 8 * half + 8; u += UPV) {
                    vunit lo, hi;
                    v_nibbles(run + 16 * u, &lo, &hi);
                    v_q6k_top(qhr + 16 * u, h, &lo, &hi);
                    for (int i = 0; i < MB; i++) {
                        const int32_t *xl = (const int32_t *)(acts[i].v + sb * QKK + 32 * bl);
                        const int32_t *xh = (const int32_t *)(acts[i].v + sb * QKK + 32 * bh);
                        const int cl = MB == 1 ? 2 * ((u / UPV) & 1) : 0, ch = MB == 1 ? cl + 1 : 1;
                        iacc[i][cl] = v_madd(iacc[i][cl], lo, v_pairs(xl, u));
                        iacc[i][ch] = v_madd(iacc[i][ch], hi, v_pairs(xh, u));
                    }
                }
                for (int k = 0; k < 2; k++) { /* block bl (low nibbles), bh (high) */
                    const int b = k ? bh : bl, j16 = 2 * b + half;
                    const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(tb + Q6_K_SCALES + TILE * j16));
                    const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
                    for (int i = 0; i < MB; i++) {
                        const int64_t gb = sb * 8 + b;
                        const __m256i off = _mm256_set1_epi32(32 * acts[i].vsum16[2 * gb + half]);
                        facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(run_sum(iacc[i], MB, k), off)),
                                                  _mm256_mul_ps(dsc, _mm256_broadcast_ss(acts[i].pair1 + 2 * gb)), facc[i]);
                    }
                }
            }
        }
    }
    store_tile(facc, MB, n0, rows, y, ldy, bias, accumulate);
#endif
}

/* One tile by MB activation rows (MB a constant in each call below). */
static inline __attribute__((always_inline)) void
tile_any(const qact *acts, const int MB, int64_t K, const uint8_t *tp, const int qtype, int64_t n0,
         int rows, float *y, int64_t ldy, const float *bias, int accumulate) {
    if (qtype == Q6_K) tile_mb_q6k(acts, MB, K / QKK, tp, n0, rows, y, ldy, bias, accumulate);
    else if (is_kquant(qtype)) tile_mb_k(acts, MB, K / QKK, tp, qtype, n0, rows, y, ldy, bias, accumulate);
    else tile_mb(acts, MB, K / QK, tp, qtype, n0, rows, y, ldy, bias, accumulate);
}

/* Each tile streamed once, TILE_MB activation rows a pass (the tile stays in L1/L2 between
 * passes). */
static inline __attribute__((always_inline)) void
tiles_q(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, const int qtype, int64_t n0,
        int64_t n1, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tile_bytes = K / qblock_elems(qtype) * tile_block_bytes(qtype);
    for (int64_t t = n0 / TILE; t * TILE < n1; t++) {
        const uint8_t *tp = tiles + t * tile_bytes;
        const int rows = n1 - t * TILE < TILE ? (int)(n1 - t * TILE) : TILE;
        int64_t i = 0;
        for (; i + TILE_MB <= M; i += TILE_MB)
            tile_any(acts + i, TILE_MB, K, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate);
        switch (M - i) {
        case 3: tile_any(acts + i, 3, K, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 2: tile_any(acts + i, 2, K, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 1: tile_any(acts + i, 1, K, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        default: break;
        }
    }
}
#endif

/* y[m, n] for m < M, n in [n0, n1) (n0 a multiple of TILE). */
void rows_product(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, int qtype,
                  int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                  int accumulate) {
#if defined(QAVX2)
    switch (qtype) { /* qtype a constant inside each: the block decoding is branch-free */
    case Q4_1: tiles_q(acts, M, K, tiles, Q4_1, n0, n1, y, ldy, bias, accumulate); break;
    case Q4_0: tiles_q(acts, M, K, tiles, Q4_0, n0, n1, y, ldy, bias, accumulate); break;
    case Q5_0: tiles_q(acts, M, K, tiles, Q5_0, n0, n1, y, ldy, bias, accumulate); break;
    case Q5_1: tiles_q(acts, M, K, tiles, Q5_1, n0, n1, y, ldy, bias, accumulate); break;
    case Q4_K: tiles_q(acts, M, K, tiles, Q4_K, n0, n1, y, ldy, bias, accumulate); break;
    case Q5_K: tiles_q(acts, M, K, tiles, Q5_K, n0, n1, y, ldy, bias, accumulate); break;
    case Q6_K: tiles_q(acts, M, K, tiles, Q6_K, n0, n1, y, ldy, bias, accumulate); break;
    default: tiles_q(acts, M, K, tiles, Q8_0, n0, n1, y, ldy, bias, accumulate); break;
    }
#else
    tiles_scalar(acts, M, K, tiles, qtype, n0, n1, y, ldy, bias, accumulate);
#endif
}

/* ------------------------------------------------------------------------- q_matmul */

/* Inside a parallel region: the calling thread's output rows [n0, n1) of N: contiguous
 * chunks of PRODUCT_CHUNK rows (whole tiles, and each thread's writes off its neighbours'
 * lines), the same split OpenMP's static schedule would make, but as one range, so that
 * the product streams (and prefetches) across chunks. */
void thread_rows(int64_t N, int64_t *n0, int64_t *n1) {
    const int64_t chunks = (N + PRODUCT_CHUNK - 1) / PRODUCT_CHUNK;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
    *n0 = c0 * PRODUCT_CHUNK;
    *n1 = c1 * PRODUCT_CHUNK < N ? c1 * PRODUCT_CHUNK : N;
}

/* Activation rows from which a product takes gemm8.c's int8 path by default (a prefill's
 * rows); below, the int16 passes over streamed tiles (decode batches). Callers pass their
 * own threshold (quant.GEMM8_MIN_ROWS). */
#define GEMM8_MIN_ROWS 65
int64_t q_gemm8_min_rows(void) { return GEMM8_MIN_ROWS; }

/* Bytes of `scratch` a product of M activation rows of width K needs, int8 or not. */
int64_t q_matmul_scratch_bytes8(int64_t M, int64_t K, int int8) {
    if (int8) return gemm8_scratch_bytes(M, K);
    return M * ((int64_t)sizeof(qact) + qact_bytes(K)) + 128;
}

int64_t q_matmul_scratch_bytes(int64_t M, int64_t K) { return q_matmul_scratch_bytes8(M, K, M >= GEMM8_MIN_ROWS); }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias[N]), W a matrix of
 * `nparts` row blocks (common.h: `desc` {rows, qtype, tiles} each, stacked in order); with
 * accumulate, added to y instead (a residual add folded in); int8 activations when M >=
 * `min_rows8`. `scratch`: at least q_matmul_scratch_bytes8(M, K, M >= min_rows8) bytes. */
void q_matmul_rows(const float *x, int64_t M, int64_t ldx, int64_t K, const int64_t *desc, int nparts,
                   float *y, int64_t ldy, const float *bias, int accumulate, void *scratch, int64_t min_rows8) {
    const qmat w = {desc, nparts, bias};
    if (M >= min_rows8) {
        gemm8(x, M, ldx, K, w, y, ldy, accumulate, (g8input){G8_PLAIN, NULL, 0.0f}, scratch);
        return;
    }
    qact *acts = (qact *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    char *bufs = (char *)(acts + M);
    const int par = qmat_rows(w) * K * M >= 65536;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            acts[i] = qact_at(bufs + i * qact_bytes(K), K);
            quantize_act(x + i * ldx, K, &acts[i]);
        }
        int64_t off = 0;
        for (int p = 0; p < nparts; p++) { /* each part split over the threads in turn */
            const int64_t N = desc[3 * p];
            int64_t n0, n1;
            thread_rows(N, &n0, &n1);
            if (n0 < n1)
                rows_product(acts, M, K, (const uint8_t *)desc[3 * p + 2], (int)desc[3 * p + 1], n0, n1,
                             y + off, ldy, bias ? bias + off : NULL, accumulate);
            off += N;
        }
    }
}

/* y = in(x) @ W^T (+ bias; accumulate: added to y), W as in q_matmul_rows, int8
 * activations whatever M, in(x) per `kind` (common.h, g8input): G8_GLU, rows [gate K | up
 * K] as silu(gate) * up (a SwiGLU MLP's down projection); G8_NORM, x / sqrt(mean(x^2) +
 * eps) times norm_w [K] (a layer's input norm and the projections after it); G8_PLAIN, x.
 * The input is formed row by row as it is quantized, never stored. `scratch`: at least
 * gemm8_scratch_bytes(M, K) bytes. */
void q_gemm8_input(const float *x, int64_t M, int64_t ldx, int64_t K, const int64_t *desc, int nparts, float *y,
                   int64_t ldy, const float *bias, int accumulate, int kind, const float *norm_w, float eps,
                   void *scratch) {
    const qmat w = {desc, nparts, bias};
    gemm8(x, M, ldx, K, w, y, ldy, accumulate, (g8input){kind, norm_w, eps}, scratch);
}

/* q_matmul_rows at the default threshold. */
void q_matmul_parts(const float *x, int64_t M, int64_t ldx, int64_t K, const int64_t *desc,
                    int nparts, float *y, int64_t ldy, const float *bias, int accumulate,
                    void *scratch) {
    q_matmul_rows(x, M, ldx, K, desc, nparts, y, ldy, bias, accumulate, scratch, GEMM8_MIN_ROWS);
}

/* One matrix of one type (q_matmul_parts with one part). */
void q_matmul(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *tiles, int qtype,
              int64_t N, float *y, int64_t ldy, const float *bias, int accumulate, void *scratch) {
    const int64_t desc[3] = {N, qtype, (int64_t)(uintptr_t)tiles};
    q_matmul_parts(x, M, ldx, K, desc, 1, y, ldy, bias, accumulate, scratch);
}
