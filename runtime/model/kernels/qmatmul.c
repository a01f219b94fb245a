/* Weight-only quantized matrix products on CPU, on GGML blocks as GGUF stores them (see
 * common.h for the formats, the row addressing and the activations' quantization).
 *
 * Two ways through a product, chosen by the number of activation rows M:
 * - streaming (M < TILE_MIN_M, decode): each weight block is read once and multiplied by
 *   the M quantized rows at once; with one row, each thread reads its rows as one
 *   sequential stream with four sums per row (a 576-wide row is only 18 blocks, too short
 *   to hide an accumulator's latency alone) and a prefetch a fixed distance ahead.
 *   This is what a batch-1 decode step is made of, so it is written to be limited by the
 *   memory bus: a block costs ~13 instructions per activation row (AVX2), ~7 with
 *   AVX-512's two blocks a step (one row).
 * - tiled (M >= TILE_MIN_M, batched decode and prefill): 8 weight rows at a time are
 *   unpacked once into int16 pairs interleaved across the 8 rows ([block][pair][row][2]),
 *   so that one 16-bit multiply-add gives 8 output rows 2 products each; every activation
 *   row then sweeps that tile from L1/L2 with one broadcast and one multiply-add per pair
 *   of its values, and the scales are applied once per block for 8 rows. Per product of
 *   a weight and an activation this is a quarter of the streaming path's instructions,
 *   and about half of a float32 FMA GEMM's multiply-port time.
 * Work is split by chunks of PRODUCT_CHUNK output rows over the OpenMP threads torch uses
 * (torch.set_num_threads governs both); every output is computed by one thread in a fixed
 * order, so results do not depend on the thread count.
 */
#include "common.h"
#include <omp.h>

#define TILE_ROWS 8
#ifndef TILE_MIN_M
#define TILE_MIN_M 8 /* activation rows from which products take the tiled path */
#endif
#ifndef TILE_MB
#define TILE_MB 6    /* activation rows per sweep of a tile (registers: 2 per row) */
#endif

int kernel_simd(void) {
#if defined(QAVX512)
    return 3;
#elif defined(QAVX2)
    return 2;
#else
    return 0;
#endif
}

int64_t block_bytes(int qtype) { return qblock_bytes(qtype); }

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
#if defined(QAVX512)
            if ((b | 1) < nb) /* a whole pair: an odd last block takes the 256-bit step */
                _mm256_store_si256((__m256i *)(a->v2 + b / 2 * 64 + 16 * (b & 1) + 32 * h), half);
#endif
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

/* ------------------------------------------------------------------------ dequantization */

/* out[r, K] = the float32 weights of rows rows[r] (an embedding lookup), or of all rows. */
void q_dequant_rows(const int64_t *rowptr, int qtype, int64_t K, const int64_t *rows, int64_t R,
                    float *out) {
    const int64_t nb = K / QK, bb = qblock_bytes(qtype);
#pragma omp parallel for schedule(static) if (R * K >= 262144)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = (const uint8_t *)rowptr[rows ? rows[r] : r];
        float *o = out + r * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
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

/* Rows of a matrix copied out as contiguous GGML blocks (`out`: [R, K/32 * block bytes]). */
void q_gather_rows(const int64_t *rowptr, int qtype, int64_t K, int64_t R, uint8_t *out) {
    const int64_t rb = K / QK * qblock_bytes(qtype);
    for (int64_t r = 0; r < R; r++) memcpy(out + r * rb, (const uint8_t *)rowptr[r], rb);
}

/* ------------------------------------------------------------------------ products: C */

#if !defined(QAVX2)
static void rows_scalar(const qact *acts, int64_t M, int64_t K, const int64_t *rowptr, int qtype,
                        int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                        int accumulate) {
    const int64_t nb = K / QK, bb = qblock_bytes(qtype);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)rowptr[n];
        for (int64_t i = 0; i < M; i++) {
            const qact *a = acts + i;
            float sum = 0.0f, off = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bb;
                int32_t dot = 0;
                for (int j = 0; j < QK; j++) dot += block_code(blk, qtype, j) * a->v[b * QK + j];
                sum += (float)dot * (block_d(blk) * a->pair1[2 * b]);
                off += block_m(blk, qtype) * a->pair1[2 * b + 1];
            }
            const float v = sum + off + (bias ? bias[n] : 0.0f);
            float *out = y + i * ldy + n;
            *out = accumulate ? *out + v : v;
        }
    }
}
#endif

/* --------------------------------------------------------------------- products: AVX2 */

#if defined(QAVX2)
typedef int32_t __attribute__((may_alias, aligned(1))) i32_alias;

/* {d, m, 0, 0} (Q4_1), {d, d, d, d} (Q4_0: times pair0 gives the -8 d s sum v term), {d, 0,..}. */
static inline __m128 block_dm(const uint8_t *blk, int qtype) {
    if (qtype == Q4_1) return _mm_cvtph_ps(_mm_cvtsi32_si128(*(const i32_alias *)blk));
    if (qtype == Q4_0) return _mm_cvtph_ps(_mm_set1_epi16((short)load_u16(blk)));
    return _mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(blk)));
}

/* sum over the block of code_j * v_j as 8 int32 lanes (Q4 codes unsigned, Q8_0 signed). */
static inline __m256i block_dot(const uint8_t *blk, int qtype, __m256i x0, __m256i x1) {
    if (qtype == Q8_0) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    }
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2))));
    const __m256i lo = _mm256_and_si256(c, _mm256_set1_epi16(0xf)), hi = _mm256_srli_epi16(c, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) /* the same sums, one instruction fewer */
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, x0), hi, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
#endif
}

/* acc/off += block `blk`'s product with activation block (v, pair). */
static inline __attribute__((always_inline)) void
block_step(const uint8_t *blk, const int qtype, const int16_t *v, const float *pair, __m256 *acc,
          __m128 *off) {
    const __m128 prod = _mm_mul_ps(block_dm(blk, qtype), _mm_castpd_ps(_mm_load_sd((const double *)pair)));
    *off = _mm_add_ps(*off, prod);
    const __m256i p = block_dot(blk, qtype, _mm256_load_si256((const __m256i *)v),
                                _mm256_load_si256((const __m256i *)(v + 16)));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), *acc);
}

/* y[i][n] for i < M (1 to 4) activation rows and weight row n (M a constant once inlined). */
static inline __attribute__((always_inline)) void
stream_block(const qact *acts, const int M, int64_t nb, const int64_t *rowptr, const int qtype,
             int64_t n, float *y, int64_t ldy, const float *bias, int accumulate,
             const int64_t *ahead) {
    const int64_t bb = qblock_bytes(qtype);
    const uint8_t *row = (const uint8_t *)rowptr[n], *pf = ahead ? (const uint8_t *)*ahead : NULL;
    __m256 acc[4];
    __m128 off[4];
    for (int i = 0; i < M; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        /* The row two ahead, at the same offset: a row is a few hundred bytes to a few
         * KB, too short a stream for the hardware prefetchers to get ahead of. */
        if (pf) _mm_prefetch((const char *)(pf + b * bb), _MM_HINT_T0);
        const uint8_t *blk = row + b * bb;
        for (int i = 0; i < M; i++)
            block_step(blk, qtype, acts[i].v + b * QK,
                      (qtype == Q4_0 ? acts[i].pair0 : acts[i].pair1) + 2 * b, &acc[i], &off[i]);
    }
    for (int i = 0; i < M; i++) {
        float v = hsum8(acc[i]) + _mm_cvtss_f32(_mm_shuffle_ps(off[i], off[i], 1));
        v += bias ? bias[n] : 0.0f;
        float *out = y + i * ldy + n;
        *out = accumulate ? *out + v : v;
    }
}

#ifndef SEQ_PF_BYTES
/* How far ahead of its reads the one-row product prefetches. On an EPYC (Zen, 2 threads,
 * Q4_1 rows from DRAM, AVX-512 step) 1 KB gave one core 22 GB/s, 4 KB 28 GB/s, 8 KB the
 * same: a core needs that many lines in flight to cover DRAM's latency. */
#define SEQ_PF_BYTES 4096
#endif
#define SEQ_CHAINS 4 /* independent sums per row */

/* y[n] for one activation row over rows [n0, n1) that lie back to back in memory: read as
 * one sequential stream, row after row, with a prefetch a fixed distance ahead of the
 * reads (across row ends), and SEQ_CHAINS independent sums per row (blocks b, b+1, ... in
 * turn). Measured on one core of an EPYC, Q4_1 rows 2048 wide from DRAM: 11 GB/s with
 * four rows interleaved and a prefetch of the next group (short streams of 1,280 bytes,
 * four at a time), 14 GB/s as one stream. */
static inline __attribute__((always_inline)) void
seq_rows(const qact *a, int64_t nb, const uint8_t *base, const int qtype, int64_t n0, int64_t n1,
         float *y, const float *bias, int accumulate) {
    const int64_t bb = qblock_bytes(qtype), rb = nb * bb;
    const float *pairs = qtype == Q4_0 ? a->pair0 : a->pair1;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = base + n * rb;
        __m256 acc[SEQ_CHAINS];
        __m128 off[SEQ_CHAINS];
        for (int c = 0; c < SEQ_CHAINS; c++) {
            acc[c] = _mm256_setzero_ps();
            off[c] = _mm_setzero_ps();
        }
        int64_t b = 0;
        for (; b + SEQ_CHAINS <= nb; b += SEQ_CHAINS) {
            /* SEQ_CHAINS blocks are 72 to 136 bytes: two lines ahead cover them */
            _mm_prefetch((const char *)(row + b * bb + SEQ_PF_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(row + b * bb + SEQ_PF_BYTES + 64), _MM_HINT_T0);
            for (int c = 0; c < SEQ_CHAINS; c++)
                block_step(row + (b + c) * bb, qtype, a->v + (b + c) * QK, pairs + 2 * (b + c),
                          &acc[c], &off[c]);
        }
        for (; b < nb; b++) block_step(row + b * bb, qtype, a->v + b * QK, pairs + 2 * b, &acc[0], &off[0]);
        for (int c = 1; c < SEQ_CHAINS; c++) {
            acc[0] = _mm256_add_ps(acc[0], acc[c]);
            off[0] = _mm_add_ps(off[0], off[c]);
        }
        float v = hsum8(acc[0]) + _mm_cvtss_f32(_mm_shuffle_ps(off[0], off[0], 1));
        v += bias ? bias[n] : 0.0f;
        y[n] = accumulate ? y[n] + v : v;
    }
}

#if defined(QAVX512)
/* Block blk's fp16 {d, m} (Q4_1), {d, d} (Q4_0) or {d, 0} (Q8_0) as one 32-bit lane. */
static inline __attribute__((always_inline)) int dm_lane(const uint8_t *blk, const int qtype) {
    if (qtype == Q4_1) return *(const i32_alias *)blk;
    const uint32_t d = load_u16(blk);
    return (int)(qtype == Q4_0 ? d | (d << 16) : d);
}

/* Code-times-v sums of Q4 blocks blk and blk1 (b, b + 1): lanes 0-7 b's, 8-15 b + 1's. */
static inline __attribute__((always_inline)) __m512i
q4_pair_sums(const uint8_t *blk, const uint8_t *blk1, const int qtype, const int16_t *v2) {
    const int64_t o = qtype == Q4_1 ? 4 : 2;
    const __m256i c8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + o))),
                                               _mm_loadu_si128((const __m128i *)(blk1 + o)), 1);
    const __m512i c = _mm512_cvtepu8_epi16(c8);
    const __m512i lo = _mm512_and_si512(c, _mm512_set1_epi16(0xf)), hi = _mm512_srli_epi16(c, 4);
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_load_si512(v2)), hi, _mm512_load_si512(v2 + 32));
#else
    return _mm512_add_epi32(_mm512_madd_epi16(lo, _mm512_load_si512(v2)),
                            _mm512_madd_epi16(hi, _mm512_load_si512(v2 + 32)));
#endif
}

/* Code-times-v sums of Q8_0 block blk (16 lanes). */
static inline __attribute__((always_inline)) __m512i q8_sums(const uint8_t *blk, const int16_t *v) {
    return _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2))),
                             _mm512_load_si512(v));
}

/* acc/off += blocks b and b + 1 (b even) of a row, `blk` at b, times activation row a:
 * one 512-bit multiply-add per half of both blocks' codes (Q4) or per block (Q8_0), their
 * two {d s, offset} pairs from one 128-bit multiply, lanes 1 and 3 of `off` the offsets. */
static inline __attribute__((always_inline)) void
block2_step(const uint8_t *blk, const int qtype, const qact *a, int64_t b, __m512 *acc,
            __m128 *off) {
    const int64_t bb = qblock_bytes(qtype);
    const __m128i h = _mm_insert_epi32(_mm_cvtsi32_si128(dm_lane(blk, qtype)), dm_lane(blk + bb, qtype), 1);
    const float *pairs = (qtype == Q4_0 ? a->pair0 : a->pair1) + 2 * b;
    const __m128 prod = _mm_mul_ps(_mm_cvtph_ps(h), _mm_load_ps(pairs));
    *off = _mm_add_ps(*off, prod);
    const __m512 wide = _mm512_castps128_ps512(prod);
    if (qtype == Q8_0) {
        for (int i = 0; i < 2; i++) {
            const __m512i p = q8_sums(blk + i * bb, a->v + (b + i) * QK);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), wide), *acc);
        }
        return;
    }
    const __m512i p = q4_pair_sums(blk, blk + bb, qtype, a->v2 + b / 2 * 64);
    const __m512i which = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(which, wide), *acc);
}

/* Blocks b .. b + 3 (b a multiple of 4): as two block2_steps, with the four blocks'
 * scales from one 256-bit multiply (lanes 1, 3, 5, 7 of `off` the offsets). */
static inline __attribute__((always_inline)) void
block4_step(const uint8_t *blk, const int qtype, const qact *a, int64_t b, __m512 *acc0,
            __m512 *acc1, __m256 *off) {
    const int64_t bb = qblock_bytes(qtype);
    __m128i h = _mm_cvtsi32_si128(dm_lane(blk, qtype));
    h = _mm_insert_epi32(h, dm_lane(blk + bb, qtype), 1);
    h = _mm_insert_epi32(h, dm_lane(blk + 2 * bb, qtype), 2);
    h = _mm_insert_epi32(h, dm_lane(blk + 3 * bb, qtype), 3);
    const float *pairs = (qtype == Q4_0 ? a->pair0 : a->pair1) + 2 * b;
    const __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_load_ps(pairs));
    *off = _mm256_add_ps(*off, prod);
    const __m512 wide = _mm512_castps256_ps512(prod);
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++) {
            const __m512i p = q8_sums(blk + i * bb, a->v + (b + i) * QK);
            __m512 *acc = i & 1 ? acc1 : acc0;
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), wide), *acc);
        }
        return;
    }
    const __m512i p01 = q4_pair_sums(blk, blk + bb, qtype, a->v2 + b / 2 * 64);
    const __m512i p23 = q4_pair_sums(blk + 2 * bb, blk + 3 * bb, qtype, a->v2 + (b / 2 + 1) * 64);
    const __m512i w01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i w23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    *acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_permutexvar_ps(w01, wide), *acc0);
    *acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_permutexvar_ps(w23, wide), *acc1);
}

/* seq_rows with 512-bit steps (the same stream, prefetch and results to within float
 * rounding): four blocks a step (scales once for four), then a pair, then an odd block;
 * about 7 instructions a block instead of 13. Measured on one core of the same EPYC with
 * the 4 KB prefetch: 28-31 GB/s (22 with seq_rows), a 1-thread torch.sum 33-39; scales
 * for four instead of two added 2-6%. */
static inline __attribute__((always_inline)) void
seq_rows2(const qact *a, int64_t nb, const uint8_t *base, const int qtype, int64_t n0, int64_t n1,
          float *y, const float *bias, int accumulate) {
    const int64_t bb = qblock_bytes(qtype), rb = nb * bb;
    const float *pairs = qtype == Q4_0 ? a->pair0 : a->pair1;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = base + n * rb;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m128 off0 = _mm_setzero_ps();
        __m256 off4 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            const char *pf = (const char *)(row + b * bb + SEQ_PF_BYTES);
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            if (4 * bb > 128) _mm_prefetch(pf + 128, _MM_HINT_T0); /* Q8_0: 136 bytes */
            block4_step(row + b * bb, qtype, a, b, &acc0, &acc1, &off4);
        }
        if (b + 2 <= nb) {
            block2_step(row + b * bb, qtype, a, b, &acc0, &off0);
            b += 2;
        }
        off0 = _mm_add_ps(off0, _mm_add_ps(_mm256_castps256_ps128(off4), _mm256_extractf128_ps(off4, 1)));
        float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) +
                  _mm_cvtss_f32(_mm_shuffle_ps(off0, off0, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(off0, off0, 3));
        if (b < nb) { /* an odd last block */
            __m256 acc = _mm256_setzero_ps();
            __m128 off = _mm_setzero_ps();
            block_step(row + b * bb, qtype, a->v + b * QK, pairs + 2 * b, &acc, &off);
            v += hsum8(acc) + _mm_cvtss_f32(_mm_shuffle_ps(off, off, 1));
        }
        v += bias ? bias[n] : 0.0f;
        y[n] = accumulate ? y[n] + v : v;
    }
}
#define SEQ_ROWS seq_rows2
#else
#define SEQ_ROWS seq_rows
#endif

static inline __attribute__((always_inline)) void
stream_rows_q(const qact *acts, int64_t M, int64_t nb, const int64_t *rowptr, const int qtype,
              int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias, int accumulate) {
    if (M == 1) { /* runs of rows back to back (a matrix may stack several tensors' rows) */
        const int64_t rb = nb * qblock_bytes(qtype);
        for (int64_t n = n0; n < n1;) {
            int64_t e = n + 1;
            while (e < n1 && rowptr[e] == rowptr[e - 1] + rb) e++;
            SEQ_ROWS(acts, nb, (const uint8_t *)rowptr[n] - n * rb, qtype, n, e, y, bias, accumulate);
            n = e;
        }
        return;
    }
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
        const int64_t k = M - i0 < 4 ? M - i0 : 4;
        float *yi = y + i0 * ldy;
        for (int64_t n = n0; n < n1; n++) {
            const int64_t *a = n + 2 < n1 ? rowptr + n + 2 : NULL;
            switch (k) {
            case 2: stream_block(acts + i0, 2, nb, rowptr, qtype, n, yi, ldy, bias, accumulate, a); break;
            case 3: stream_block(acts + i0, 3, nb, rowptr, qtype, n, yi, ldy, bias, accumulate, a); break;
            case 4: stream_block(acts + i0, 4, nb, rowptr, qtype, n, yi, ldy, bias, accumulate, a); break;
            default: stream_block(acts + i0, 1, nb, rowptr, qtype, n, yi, ldy, bias, accumulate, a); break;
            }
        }
    }
}

static void stream_rows(const qact *acts, int64_t M, int64_t K, const int64_t *rowptr, int qtype,
                        int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                        int accumulate) {
    const int64_t nb = K / QK;
    switch (qtype) { /* qtype a constant inside each: the block decoding is branch-free */
    case Q4_1: stream_rows_q(acts, M, nb, rowptr, Q4_1, n0, n1, y, ldy, bias, accumulate); break;
    case Q4_0: stream_rows_q(acts, M, nb, rowptr, Q4_0, n0, n1, y, ldy, bias, accumulate); break;
    default: stream_rows_q(acts, M, nb, rowptr, Q8_0, n0, n1, y, ldy, bias, accumulate); break;
    }
}

/* 8x8 transpose of 32-bit elements: r[i] = row i in, r[j] = column j out. */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* Tile of weight rows [n0, n0 + rows) (rows <= 8; missing rows are zeros): int16 codes
 * minus the zero point, wt[((b * 16 + p) * 8 + r) * 2 + e] = code 2p + e of row r's block
 * b; dt[b * 8 + r] = its scale, mt[b * 8 + r] = its offset (Q4_1). */
static void tile_pack(const int64_t *rowptr, int qtype, int64_t nb, int64_t n0, int rows,
                      int16_t *wt, float *dt, float *mt) {
    const int64_t bb = qblock_bytes(qtype);
    const __m256i z = _mm256_set1_epi16(qtype == Q4_0 ? 8 : 0), lo4 = _mm256_set1_epi16(0xf);
    for (int64_t b = 0; b < nb; b++) {
        __m256i lo[8], hi[8];
        for (int r = 0; r < TILE_ROWS; r++) {
            if (r >= rows) {
                lo[r] = hi[r] = _mm256_setzero_si256();
                dt[b * 8 + r] = mt[b * 8 + r] = 0.0f;
                continue;
            }
            const uint8_t *blk = (const uint8_t *)rowptr[n0 + r] + b * bb;
            if (qtype == Q8_0) {
                lo[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
                hi[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
            } else {
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2))));
                lo[r] = _mm256_sub_epi16(_mm256_and_si256(c, lo4), z);
                hi[r] = _mm256_sub_epi16(_mm256_srli_epi16(c, 4), z);
            }
            dt[b * 8 + r] = block_d(blk);
            mt[b * 8 + r] = block_m(blk, qtype);
        }
        transpose8(lo);
        transpose8(hi);
        __m256i *out = (__m256i *)(wt + b * 256);
        for (int p = 0; p < 8; p++) {
            _mm256_store_si256(out + p, lo[p]);
            _mm256_store_si256(out + 8 + p, hi[p]);
        }
    }
}

/* y[i][n0 .. n0 + rows) for MB activation rows from a packed tile (MB a constant). */
static inline __attribute__((always_inline)) void
tile_mb(const qact *acts, const int MB, int64_t nb, int with_m, const int16_t *wt,
        const float *dt, const float *mt, int64_t n0, int rows, float *y, int64_t ldy,
        const float *bias, int accumulate) {
    __m256 facc[TILE_MB];
    for (int i = 0; i < MB; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i iacc[TILE_MB];
        for (int i = 0; i < MB; i++) iacc[i] = _mm256_setzero_si256();
        const __m256i *w = (const __m256i *)(wt + b * 256);
        const float *xs[TILE_MB];
        for (int i = 0; i < MB; i++) xs[i] = (const float *)(acts[i].v + b * QK);
        for (int p = 0; p < 16; p++) {
            const __m256i wv = _mm256_load_si256(w + p);
            for (int i = 0; i < MB; i++) {
                /* vbroadcastss: a load-port broadcast (vpbroadcastd also takes a shuffle) */
                const __m256i xv = _mm256_castps_si256(_mm256_broadcast_ss(xs[i] + p));
                iacc[i] = _mm256_add_epi32(iacc[i], _mm256_madd_epi16(wv, xv));
                /* keeps the sums a chain: otherwise gcc reassociates them into a tree of
                 * 16 * MB live products and spills them */
                __asm__("" : "+x"(iacc[i]));
            }
        }
        const __m256 dv = _mm256_load_ps(dt + b * 8);
        for (int i = 0; i < MB; i++) {
            const __m256 sc = _mm256_mul_ps(dv, _mm256_broadcast_ss(acts[i].pair1 + 2 * b));
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), sc, facc[i]);
        }
        if (with_m) {
            const __m256 mv = _mm256_load_ps(mt + b * 8);
            for (int i = 0; i < MB; i++)
                facc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(acts[i].pair1 + 2 * b + 1), facc[i]);
        }
    }
    for (int i = 0; i < MB; i++) {
        float out[8];
        _mm256_storeu_ps(out, facc[i]);
        float *yr = y + i * ldy + n0;
        for (int r = 0; r < rows; r++) {
            const float v = out[r] + (bias ? bias[n0 + r] : 0.0f);
            yr[r] = accumulate ? yr[r] + v : v;
        }
    }
}

static void tile_rows(const qact *acts, int64_t M, int64_t K, const int64_t *rowptr, int qtype,
                      int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                      int accumulate, void *tile) {
    const int64_t nb = K / QK;
    const uintptr_t base = ((uintptr_t)tile + 63) & ~(uintptr_t)63;
    int16_t *wt = (int16_t *)base;
    float *dt = (float *)(base + nb * 512), *mt = dt + nb * 8;
    const int with_m = qtype == Q4_1;
    for (int64_t t = n0; t < n1; t += TILE_ROWS) {
        const int rows = n1 - t < TILE_ROWS ? (int)(n1 - t) : TILE_ROWS;
        tile_pack(rowptr, qtype, nb, t, rows, wt, dt, mt);
        int64_t i = 0;
        for (; i + TILE_MB <= M; i += TILE_MB)
            tile_mb(acts + i, TILE_MB, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate);
        switch (M - i) {
#if TILE_MB > 5
        case 5: tile_mb(acts + i, 5, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate); break;
#endif
#if TILE_MB > 4
        case 4: tile_mb(acts + i, 4, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate); break;
#endif
        case 3: tile_mb(acts + i, 3, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 2: tile_mb(acts + i, 2, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate); break;
        case 1: tile_mb(acts + i, 1, nb, with_m, wt, dt, mt, t, rows, y + i * ldy, ldy, bias, accumulate); break;
        default: break;
        }
    }
}
#endif

int64_t tile_bytes(int64_t K) { return K / QK * (512 + 64) + 64; }

void rows_product(const qact *acts, int64_t M, int64_t K, const int64_t *rowptr, int qtype,
                  int64_t n0, int64_t n1, float *y, int64_t ldy, const float *bias,
                  int accumulate, void *tile) {
#if defined(QAVX2)
    if (M >= TILE_MIN_M && tile != NULL)
        tile_rows(acts, M, K, rowptr, qtype, n0, n1, y, ldy, bias, accumulate, tile);
    else
        stream_rows(acts, M, K, rowptr, qtype, n0, n1, y, ldy, bias, accumulate);
#else
    (void)tile;
    rows_scalar(acts, M, K, rowptr, qtype, n0, n1, y, ldy, bias, accumulate);
#endif
}

/* ------------------------------------------------------------------------- q_matmul */

/* Inside a parallel region: the calling thread's output rows [n0, n1) of N: contiguous
 * chunks of PRODUCT_CHUNK rows (which keep each thread's writes off its neighbours'
 * lines), the same split OpenMP's static schedule would make, but as one range, so that
 * the streaming product can prefetch across chunks. */
void thread_rows(int64_t N, int64_t *n0, int64_t *n1) {
    const int64_t chunks = (N + PRODUCT_CHUNK - 1) / PRODUCT_CHUNK;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
    *n0 = c0 * PRODUCT_CHUNK;
    *n1 = c1 * PRODUCT_CHUNK < N ? c1 * PRODUCT_CHUNK : N;
}

/* Bytes of `scratch` q_matmul needs for M activation rows of width K on `threads` threads. */
int64_t q_matmul_scratch_bytes(int64_t M, int64_t K, int64_t threads) {
    return M * ((int64_t)sizeof(qact) + qact_bytes(K)) + threads * tile_bytes(K) + 128;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W[N, K]^T (+ bias[N]); with
 * accumulate, added to y instead (a residual add folded in). `scratch`: at least
 * q_matmul_scratch_bytes(M, K, omp_get_max_threads()) bytes. */
void q_matmul(const float *x, int64_t M, int64_t ldx, int64_t K, const int64_t *rowptr, int qtype,
              int64_t N, float *y, int64_t ldy, const float *bias, int accumulate, void *scratch) {
    qact *acts = (qact *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    char *bufs = (char *)(acts + M);
    char *tiles = bufs + M * qact_bytes(K);
    const int par = N * K * M >= 65536;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            acts[i] = qact_at(bufs + i * qact_bytes(K), K);
            quantize_act(x + i * ldx, K, &acts[i]);
        }
        void *tile = tiles + (int64_t)omp_get_thread_num() * tile_bytes(K);
        int64_t n0, n1;
        thread_rows(N, &n0, &n1);
        rows_product(acts, M, K, rowptr, qtype, n0, n1, y, ldy, bias, accumulate, tile);
    }
}
