/* Weight-only quantized matrix products on CPU, on GGML blocks repacked into row tiles (see
 * common.h for the formats, the tile layout and the activations' quantization).
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
 * batch (64 rows: larger products are dequantized and multiplied by torch's float32 GEMM,
 * quant.py). Work is split by chunks of PRODUCT_CHUNK output rows over the OpenMP threads
 * torch uses (torch.set_num_threads governs both; the fused decode steps share the chunks
 * out by claims, decode.c); every output is computed by one thread in a fixed order, so
 * results do not depend on the thread count.
 *
 * One activation row (batch-1 decode) sums each block into four integer accumulators (lo
 * and hi nibbles, even and odd units), so the 16 multiply-adds of a block form four short
 * chains instead of two long ones: Q4_1 8192 x 2048 from L3, one thread, 25.5 -> 29.1
 * GB/s on a 2-core AMD EPYC with AVX-512 VNNI (from DRAM unchanged: the bus is the limit).
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

int kernel_simd(void) {
#if defined(QAVX2)
    return 2;
#else
    return 0;
#endif
}

int64_t block_bytes(int qtype) { return qblock_bytes(qtype); }

/* Bytes of the tiles of N rows of width K (q_pack's output). */
int64_t q_tiled_bytes(int qtype, int64_t N, int64_t K) { return tiled_bytes_of(qtype, N, K); }

/* ----------------------------------------------------------------- activation quantization */

#if defined(QAVX2)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#endif

void quantize_act(const float *x, int64_t K, qact *a) {
    const int64_t nb = K / QK, pb = qact_blocks(K);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax, sx;
        int32_t sv = 0;
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
        __m256i vi[4], tot = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            vi[h] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_mul_ps(xs[h], vinv))));
            tot = _mm256_add_epi32(tot, vi[h]);
        }
        sv = hsum8i(tot);
        for (int h = 0; h < 2; h++) { /* packs interleaves 128-bit lanes; the permute undoes it */
            const __m256i half = _mm256_permute4x64_epi64(_mm256_packs_epi32(vi[2 * h], vi[2 * h + 1]), 0xd8);
            _mm256_store_si256((__m256i *)(a->v + b * QK + 16 * h), half);
        }
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
        }
#endif
        a->pair1[2 * b] = a->pair0[2 * b] = s;
        a->pair1[2 * b + 1] = sx;
        a->pair0[2 * b + 1] = -8.0f * s * (float)sv;
    }
    for (int64_t b = nb; b < pb; b++) a->pair1[2 * b] = a->pair1[2 * b + 1] = a->pair0[2 * b] = a->pair0[2 * b + 1] = 0.0f;
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

/* One tile block `tb` from the GGML blocks of its 8 rows (blk[r]; NULL: a zero row). */
static void pack_tile_block(const uint8_t *const blk[TILE], int qtype, uint8_t *tb) {
    static const uint8_t zero[34]; /* a block of zeros, as long as the longest (Q8_0) */
    const int units = tile_units(qtype), at = qblock_bytes(qtype) - 2 * units;
    const uint8_t *src[TILE];
    for (int r = 0; r < TILE; r++) {
        src[r] = blk[r] ? blk[r] : zero;
        memcpy(tb + 2 * r, src[r], 2);
        if (qtype == Q4_1) memcpy(tb + 2 * TILE + 2 * r, src[r] + 2, 2);
    }
#if defined(QAVX2)
    for (int g = 0; g < units; g += 8) { /* 8 units of 8 rows: one 8 x 8 transpose */
        __m128i x[8];
        for (int r = 0; r < TILE; r++) x[r] = _mm_loadu_si128((const __m128i *)(src[r] + at + 2 * g));
        transpose8x8_epi16(x);
        for (int u = 0; u < 8; u++) _mm_storeu_si128((__m128i *)tile_unit(tb, qtype, 0, g + u), x[u]);
    }
#else
    for (int r = 0; r < TILE; r++)
        for (int u = 0; u < units; u++) memcpy((uint8_t *)tile_unit(tb, qtype, r, u), src[r] + at + 2 * u, 2);
#endif
}

/* Row r's block from tile block `tb`, back in GGML's layout. */
static void unpack_block(const uint8_t *tb, int qtype, int r, uint8_t *blk) {
    const int units = tile_units(qtype), at = qblock_bytes(qtype) - 2 * units;
    memcpy(blk, tb + 2 * r, 2);
    if (qtype == Q4_1) memcpy(blk + 2, tb + 2 * TILE + 2 * r, 2);
    for (int u = 0; u < units; u++) memcpy(blk + at + 2 * u, tile_unit(tb, qtype, r, u), 2);
}

/* The tiles of N rows of width K whose GGML blocks start at rowptr[n] (any addresses: a
 * mapped file, several tensors stacked, rows in another order), into `out`
 * (q_tiled_bytes(qtype, N, K) bytes; the last tile's missing rows are zeros). */
void q_pack(const int64_t *rowptr, int qtype, int64_t K, int64_t N, uint8_t *out) {
    const int64_t nb = K / QK, bb = qblock_bytes(qtype), tbb = tile_block_bytes(qtype);
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

/* Rows of a matrix in GGML's layout copied out as contiguous blocks (`out`: [R, K/32 *
 * block bytes]; row r from rowptr[r]). */
void q_gather_rows(const int64_t *rowptr, int qtype, int64_t K, int64_t R, uint8_t *out) {
    const int64_t rb = K / QK * qblock_bytes(qtype);
    for (int64_t r = 0; r < R; r++) memcpy(out + r * rb, (const uint8_t *)rowptr[r], rb);
}

/* The GGML blocks of all N rows (`out`: [N, K/32 * block bytes]), as the file stored them. */
void q_unpack_rows(const uint8_t *tiles, int qtype, int64_t K, int64_t N, uint8_t *out) {
    const int64_t nb = K / QK, bb = qblock_bytes(qtype), tbb = tile_block_bytes(qtype);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            unpack_block(tiles + ((n / TILE) * nb + b) * tbb, qtype, (int)(n % TILE), out + (n * nb + b) * bb);
}

/* out[r, K] = the float32 weights of rows rows[r] (an embedding lookup), or of all rows. */
void q_dequant_rows(const uint8_t *tiles, int qtype, int64_t K, const int64_t *rows, int64_t R,
                    float *out) {
    const int64_t nb = K / QK, tbb = tile_block_bytes(qtype);
#pragma omp parallel for schedule(static) if (R * K >= 262144)
    for (int64_t i = 0; i < R; i++) {
        const int64_t n = rows ? rows[i] : i;
        const int r = (int)(n % TILE);
        float *o = out + i * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *tb = tiles + ((n / TILE) * nb + b) * tbb;
            uint8_t blk[34];
            unpack_block(tb, qtype, r, blk);
            const float d = block_d(blk), m = block_m(blk, qtype);
#if defined(QAVX2)
            __m256i w[2];
            if (qtype == Q8_0) {
                w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
                w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
            } else {
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2))));
                const __m256i z = _mm256_set1_epi16(qtype == Q4_0 ? 8 : 0);
                w[0] = _mm256_sub_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0xf)), z);
                w[1] = _mm256_sub_epi16(_mm256_srli_epi16(c, 4), z);
            }
            const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
            for (int h = 0; h < 2; h++) {
                const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(w[h]));
                const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w[h], 1));
                _mm256_storeu_ps(o + b * QK + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), vd, vm));
                _mm256_storeu_ps(o + b * QK + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), vd, vm));
            }
#else
            for (int j = 0; j < QK; j++) o[b * QK + j] = d * (float)block_code(blk, qtype, j) + m;
#endif
        }
    }
}

/* ------------------------------------------------------------------------ products: C */

#if !defined(QAVX2)
/* The same sums as the AVX2 path, in plain C: per tile block, each row's integer dot
 * product of its codes (Q4_0's unsigned: the -8 is the offset term) with the activation's
 * int16 values, scaled once by d s, plus the block's offset term. */
static void tiles_scalar(const qact *acts, int64_t M, int64_t nb, const uint8_t *tiles, int qtype,
                         int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                         int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype);
    for (int64_t t = n0 / TILE; t * TILE < n1; t++) {
        for (int64_t i = 0; i < M; i++) {
            const qact *a = acts + i;
            const float *pairs = qtype == Q4_0 ? a->pair0 : a->pair1;
            float sum[TILE] = {0}, off[TILE] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *tb = tiles + (t * nb + b) * tbb;
                for (int r = 0; r < TILE; r++) {
                    int32_t dot = 0;
                    for (int u = 0; u < tile_units(qtype); u++) {
                        const uint8_t *c = tile_unit(tb, qtype, r, u);
                        if (qtype == Q8_0) {
                            dot += (int8_t)c[0] * a->v[b * QK + 2 * u] + (int8_t)c[1] * a->v[b * QK + 2 * u + 1];
                        } else {
                            for (int e = 0; e < 2; e++)
                                dot += (c[e] & 0xf) * a->v[b * QK + 2 * u + e] + (c[e] >> 4) * a->v[b * QK + 16 + 2 * u + e];
                        }
                    }
                    const float d = fp16_to_f32(load_u16(tb + 2 * r));
                    const float m = qtype == Q4_1 ? fp16_to_f32(load_u16(tb + 2 * TILE + 2 * r)) : qtype == Q4_0 ? d : 0.0f;
                    sum[r] += (float)dot * (d * pairs[2 * b]);
                    off[r] += m * pairs[2 * b + 1];
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

/* --------------------------------------------------------------------- products: AVX2 */

#if defined(QAVX2)
/* acc + the pairwise products of a and b summed per 32-bit lane (VNNI: one instruction). */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* y[i][t*8 .. t*8+8) for MB activation rows (MB a constant once inlined) over tile t: per
 * block, the code pairs of 8 rows (one 16-byte load widened to 16-bit lanes: Q4's low
 * nibbles are one pair of codes, its high nibbles the pair 16 further on) times each row's
 * broadcast pair of activation values, summed in integer lanes (one per weight row), then
 * scaled once for the 8 rows. */
static inline __attribute__((always_inline)) void
tile_mb(const qact *acts, const int MB, int64_t nb, const uint8_t *tp, const int qtype,
        int64_t n0, int rows, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype), co = tile_codes_at(qtype);
    const __m256i lo4 = _mm256_set1_epi16(0xf);
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb = tp + b * tbb;
        for (int64_t o = 0; o < tbb; o += 64) _mm_prefetch((const char *)(tb + TILE_PF_BYTES + o), _MM_HINT_T0);
        __m256i iacc[TILE_MB][4];
        for (int i = 0; i < MB; i++) iacc[i][0] = iacc[i][1] = iacc[i][2] = iacc[i][3] = _mm256_setzero_si256();
        if (qtype == Q8_0) {
            for (int u = 0; u < 16; u++) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tb + co + 16 * u)));
                for (int i = 0; i < MB; i++) {
                    const int32_t *xv = (const int32_t *)(acts[i].v + b * QK);
                    const int c = MB == 1 ? (u & 3) : MB == 2 ? (u & 1) : 0; /* chains */
                    iacc[i][c] = madd_acc(iacc[i][c], w, _mm256_set1_epi32(xv[u]));
                }
            }
        } else {
            for (int u = 0; u < 8; u++) {
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(tb + co + 16 * u)));
                const __m256i lo = _mm256_and_si256(c, lo4), hi = _mm256_srli_epi16(c, 4);
                for (int i = 0; i < MB; i++) {
                    const int32_t *xv = (const int32_t *)(acts[i].v + b * QK);
                    /* chains: MB 1, four (lo / hi, even / odd u); MB 2, two (lo / hi) */
                    const int cl = MB == 1 ? 2 * (u & 1) : 0, ch = MB == 1 ? cl + 1 : MB == 2;
                    iacc[i][cl] = madd_acc(iacc[i][cl], lo, _mm256_set1_epi32(xv[u]));
                    iacc[i][ch] = madd_acc(iacc[i][ch], hi, _mm256_set1_epi32(xv[8 + u]));
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tb));
        /* the offset term's factor: m (Q4_1), d (Q4_0: times -8 s sum v), none (Q8_0) */
        const __m256 m = qtype == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 2 * TILE))) : d;
        for (int i = 0; i < MB; i++) {
            const float *pair = (qtype == Q4_0 ? acts[i].pair0 : acts[i].pair1) + 2 * b;
            const __m256i sums = MB == 1   ? _mm256_add_epi32(_mm256_add_epi32(iacc[i][0], iacc[i][1]), _mm256_add_epi32(iacc[i][2], iacc[i][3]))
                                 : MB == 2 ? _mm256_add_epi32(iacc[i][0], iacc[i][1])
                                           : iacc[i][0];
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_broadcast_ss(pair)), facc[i]);
            if (qtype != Q8_0) facc[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(pair + 1), facc[i]);
        }
    }
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

/* Each tile streamed once, TILE_MB activation rows a pass (the tile stays in L1/L2 between
 * passes). */
static inline __attribute__((always_inline)) void
tiles_q(const qact *acts, int64_t M, int64_t nb, const uint8_t *tiles, const int qtype, int64_t n0,
        int64_t n1, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tbb = tile_block_bytes(qtype);
    for (int64_t t = n0 / TILE; t * TILE < n1; t++) {
        const uint8_t *tp = tiles + t * nb * tbb;
        const int rows = n1 - t * TILE < TILE ? (int)(n1 - t * TILE) : TILE;
        int64_t i = 0;
        for (; i + TILE_MB <= M; i += TILE_MB)
            tile_mb(acts + i, TILE_MB, nb, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate);
        switch (M - i) {
        case 3: tile_mb(acts + i, 3, nb, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 2: tile_mb(acts + i, 2, nb, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 1: tile_mb(acts + i, 1, nb, tp, qtype, t * TILE, rows, y + i * ldy, ldy, bias, accumulate); break;
        default: break;
        }
    }
}
#endif

/* y[m, n] for m < M, n in [n0, n1) (n0 a multiple of TILE). */
void rows_product(const qact *acts, int64_t M, int64_t K, const uint8_t *tiles, int qtype,
                  int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                  int accumulate) {
    const int64_t nb = K / QK;
#if defined(QAVX2)
    switch (qtype) { /* qtype a constant inside each: the block decoding is branch-free */
    case Q4_1: tiles_q(acts, M, nb, tiles, Q4_1, n0, n1, y, ldy, bias, accumulate); break;
    case Q4_0: tiles_q(acts, M, nb, tiles, Q4_0, n0, n1, y, ldy, bias, accumulate); break;
    default: tiles_q(acts, M, nb, tiles, Q8_0, n0, n1, y, ldy, bias, accumulate); break;
    }
#else
    tiles_scalar(acts, M, nb, tiles, qtype, n0, n1, y, ldy, bias, accumulate);
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

/* Bytes of `scratch` q_matmul needs for M activation rows of width K. */
int64_t q_matmul_scratch_bytes(int64_t M, int64_t K) {
    return M * ((int64_t)sizeof(qact) + qact_bytes(K)) + 128;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W[N, K]^T (+ bias[N]), W as tiles
 * (q_pack); with accumulate, added to y instead (a residual add folded in). `scratch`: at
 * least q_matmul_scratch_bytes(M, K) bytes. */
void q_matmul(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *tiles, int qtype,
              int64_t N, float *y, int64_t ldy, const float *bias, int accumulate, void *scratch) {
    qact *acts = (qact *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    char *bufs = (char *)(acts + M);
    const int par = N * K * M >= 65536;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            acts[i] = qact_at(bufs + i * qact_bytes(K), K);
            quantize_act(x + i * ldx, K, &acts[i]);
        }
        int64_t n0, n1;
        thread_rows(N, &n0, &n1);
        rows_product(acts, M, K, tiles, qtype, n0, n1, y, ldy, bias, accumulate);
    }
}
