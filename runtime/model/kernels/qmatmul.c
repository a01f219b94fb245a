/* Weight-only quantized matrix products on CPU, for GGML's block formats as stored in GGUF.
 *
 * GGUF stores a weight matrix [N, K] as N rows of K/32 blocks of 32 weights:
 *   Q8_0 (34 bytes): fp16 d, int8 q[32]             w = d * q
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles    w = d * (q - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes       w = d * q + m
 * (nibbles: byte j holds weight j in its low half and weight j + 16 in its high half).
 * `q_repack` splits each row into the arrays this kernel reads (the same bytes in all):
 *   codes [N, nb * cb]: unsigned codes u, cb = 16 bytes a block for Q4 (the nibble bytes
 *                       as stored), 32 for Q8_0 (u = q + 128, as uint8);
 *   d     [N, nb]:      fp16 scales;  m [N, nb]: fp16 offsets (Q4_1 only);
 * so that w = d * (u - z) + m with z = 0 (Q4_1), 8 (Q4_0), 128 (Q8_0), m = 0 but for Q4_1.
 * Q8_0 codes are interleaved by pairs of blocks (b, b+1): u(b)[0:16], u(b+1)[0:16],
 * u(b)[16:32], u(b+1)[16:32] (a last unpaired block stays in order); that is the order in
 * which a pair of Q4 blocks' nibbles come out of one 32-byte load (low halves, then high).
 *
 * Products: the activation row x is quantized per block of 32 into two int8 digits
 * (q = round(x / dx), dx = max|x| / 127, and r = round((x - q dx) * 256 / dx): x is
 * (256 q + r) dx / 256 to within dx / 512), in the same pair order. AVX-512 VNNI's vpdpbusd
 * multiplies 64 unsigned weight codes by 64 int8 digits and sums them by fours, so a pair
 * of blocks costs about a dozen instructions (two vpdpbusd, one for each digit) instead of
 * the thirty of widening the weights to floats. Per block:
 *   sum_j w_j x_j = d dx/256 (sum_j u_j (256 q_j + r_j) - z sum_j (256 q_j + r_j)) + m sum_j x_j,
 * with the exact float block sums of x for the offset term. llama.cpp keeps one digit
 * (q only); its rounding (0.4% of a block's largest activation) cost SmolLM2 8% of its
 * top-1 agreement with float32 in decode, the second digit brings that back to 100% (the
 * error is ~1e-5 of the products' magnitude). Without AVX-512 VNNI the same arithmetic
 * runs in plain C (slow, same results up to float summation order).
 *
 * Work is split by chunks of 16 output rows over the OpenMP threads torch uses
 * (torch.set_num_threads governs both).
 */
#define _GNU_SOURCE /* syscall (futex) and clock_gettime under -std=c11 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define QVNNI 1
#endif

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 };
#define QK 32
#define MAX_M 4 /* activation rows per pass over the weights */

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else { /* subnormal */
            float f = ldexpf((float)man, -24);
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

int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    default: return 0;
    }
}

static inline int64_t code_bytes(int qtype) { return qtype == Q8_0 ? 32 : 16; }
static inline int zero_point(int qtype) { return qtype == Q8_0 ? 128 : qtype == Q4_0 ? 8 : 0; }
int kernel_has_vnni(void) {
#if defined(QVNNI)
    return 1;
#else
    return 0;
#endif
}

/* Where weight j (0..31) of block b sits among a Q8_0 row's codes (the pair order). */
static inline int64_t q8_pos(int64_t b, int64_t nb, int j) {
    const int64_t base = b / 2 * 64;
    if ((b & 1) == 0 && b + 1 == nb) return base + j; /* the last block, unpaired */
    return base + (j < 16 ? 0 : 32) + (b & 1) * 16 + (j & 15);
}

/* ---------------------------------------------------------------------------- layouts */

/* GGUF blocks [N, nb * block_bytes] -> codes, d, m (see the top of the file). */
void q_repack(const uint8_t *blocks, int qtype, int64_t N, int64_t K, uint8_t *codes,
              uint16_t *d, uint16_t *m) {
    const int64_t nb = K / QK, bb = block_bytes(qtype), cb = code_bytes(qtype);
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = blocks + (n * nb + b) * bb;
            uint8_t *c = codes + n * nb * cb;
            memcpy(d + n * nb + b, blk, 2);
            if (qtype == Q8_0) {
                for (int j = 0; j < QK; j++) c[q8_pos(b, nb, j)] = (uint8_t)(blk[2 + j] ^ 0x80);
            } else if (qtype == Q4_0) {
                memcpy(c + b * cb, blk + 2, 16);
            } else {
                memcpy(m + n * nb + b, blk + 2, 2);
                memcpy(c + b * cb, blk + 4, 16);
            }
        }
    }
}

/* The inverse: GGUF blocks from codes, d, m. */
void q_unpack(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int qtype, int64_t N,
              int64_t K, uint8_t *blocks) {
    const int64_t nb = K / QK, bb = block_bytes(qtype), cb = code_bytes(qtype);
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = blocks + (n * nb + b) * bb;
            const uint8_t *c = codes + n * nb * cb;
            memcpy(blk, d + n * nb + b, 2);
            if (qtype == Q8_0) {
                for (int j = 0; j < QK; j++) blk[2 + j] = (uint8_t)(c[q8_pos(b, nb, j)] ^ 0x80);
            } else if (qtype == Q4_0) {
                memcpy(blk + 2, c + b * cb, 16);
            } else {
                memcpy(blk + 2, m + n * nb + b, 2);
                memcpy(blk + 4, c + b * cb, 16);
            }
        }
    }
}

/* The unsigned code of weight j of block b of a row. */
static inline int code_at(const uint8_t *codes, int qtype, int64_t nb, int64_t b, int j) {
    if (qtype == Q8_0) return codes[q8_pos(b, nb, j)];
    const uint8_t byte = codes[b * 16 + (j & 15)];
    return j < 16 ? (byte & 0xf) : (byte >> 4);
}

/* Weight j of block b of a row, as a float. */
static inline float weight_at(const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                              int qtype, int64_t nb, int64_t b, int j) {
    const int u = code_at(codes, qtype, nb, b, j);
    float w = fp16_to_f32(d[b]) * (float)(u - zero_point(qtype));
    return qtype == Q4_1 ? w + fp16_to_f32(m[b]) : w;
}

/* out[r, K] = the float32 weights of rows rows[r] (an embedding lookup), or of all rows. */
void q_dequant_rows(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int qtype,
                    int64_t K, const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / QK, cb = code_bytes(qtype);
#pragma omp parallel for schedule(static) if (R * K >= 262144)
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = rows ? rows[r] : r;
        const uint8_t *c = codes + n * nb * cb;
        const uint16_t *dn = d + n * nb, *mn = m ? m + n * nb : NULL;
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < QK; j++) out[r * K + b * QK + j] = weight_at(c, dn, mn, qtype, nb, b, j);
    }
}

/* ------------------------------------------------------------------ quantized activations */

/* One activation row quantized for the products, in two int8 digits per value: per block,
 * d = max|x| / 127, q = round(x / d) and r = round((x - q d) / (d / 256)), so that
 * x = (256 q + r) d / 256 to within d / 512 (about 4e-5 of the block's largest value).
 * `q` and `r` are in pair order; per block (arrays padded to a multiple of 16): dx = d /
 * 256, the exact sum of x, and the sum of the combined codes 256 q + r. */
typedef struct {
    int8_t *q, *r;
    float *dx, *sx, *sq;
} qact;

static inline int64_t padded_blocks(int64_t K) { return (K / QK + 15) / 16 * 16; }

/* Bytes of scratch one activation row of width K needs (64-byte aligned pieces). */
static inline int64_t act_bytes(int64_t K) {
    return 2 * ((K + 63) / 64 * 64) + 3 * padded_blocks(K) * (int64_t)sizeof(float) + 64;
}

static qact act_at(void *scratch, int64_t K) {
    uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    qact a;
    a.q = (int8_t *)p;
    a.r = a.q + (K + 63) / 64 * 64;
    a.dx = (float *)(p + 2 * ((K + 63) / 64 * 64));
    a.sx = a.dx + padded_blocks(K);
    a.sq = a.sx + padded_blocks(K);
    return a;
}

/* Where code j of block b goes in `q` (pair order, as Q8_0 weights). */
static inline int64_t act_pos(int64_t b, int64_t nb, int j) { return q8_pos(b, nb, j); }

#if defined(QVNNI)
/* 16 int32 values in [-127, 127] as int8, stored at `dst`. */
static inline void store16(int8_t *dst, __m512i v) {
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(v));
}

/* quantize_act, vectorised: the same codes (IEEE products, round half to even). */
static void quantize_act(const float *x, int64_t K, qact *a) {
    const int64_t nb = K / QK, pb = padded_blocks(K);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int64_t b = 0; b < nb; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f, inv2 = inv * 256.0f;
        const __m512 vinv = _mm512_set1_ps(inv), vinv2 = _mm512_set1_ps(inv2), vdx = _mm512_set1_ps(dx);
        __m512i q[2], r[2];
        const __m512 xs[2] = {x0, x1};
        for (int h = 0; h < 2; h++) {
            q[h] = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(xs[h], vinv))));
            const __m512 rest = _mm512_sub_ps(xs[h], _mm512_mul_ps(_mm512_cvtepi32_ps(q[h]), vdx));
            r[h] = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(rest, vinv2))));
            store16(a->q + act_pos(b, nb, 16 * h), q[h]);
            store16(a->r + act_pos(b, nb, 16 * h), r[h]);
        }
        const __m512i comb = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(q[0], q[1]), 8),
                                              _mm512_add_epi32(r[0], r[1]));
        a->dx[b] = dx / 256.0f;
        a->sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
        a->sq[b] = (float)_mm512_reduce_add_epi32(comb);
    }
    for (int64_t b = nb; b < pb; b++) a->dx[b] = a->sx[b] = a->sq[b] = 0.0f;
}
#else
static void quantize_act(const float *x, int64_t K, qact *a) {
    const int64_t nb = K / QK, pb = padded_blocks(K);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f, s = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : s)
        for (int j = 0; j < QK; j++) {
            amax = fmaxf(amax, fabsf(xb[j]));
            s += xb[j];
        }
        const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f, inv2 = inv * 256.0f;
        int sq = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * inv); /* round half to even */
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            const float rest = xb[j] - (float)v * dx; /* (no FMA contraction under -std=c11) */
            int w = (int)nearbyintf(rest * inv2);
            w = w > 127 ? 127 : (w < -127 ? -127 : w);
            a->q[act_pos(b, nb, j)] = (int8_t)v;
            a->r[act_pos(b, nb, j)] = (int8_t)w;
            sq += 256 * v + w;
        }
        a->dx[b] = dx / 256.0f;
        a->sx[b] = s;
        a->sq[b] = (float)sq;
    }
    for (int64_t b = nb; b < pb; b++) a->dx[b] = a->sx[b] = a->sq[b] = 0.0f;
}
#endif

/* --------------------------------------------------------------------------- products */

#if defined(QVNNI)
/* 64 codes of the block pair starting at block b: Q4 nibbles widened to bytes (low halves
 * of both blocks, then high halves), Q8_0 codes as stored (already in that order). */
static inline __m512i pair_codes(const uint8_t *c, int qtype) {
    if (qtype == Q8_0) return _mm512_loadu_si512((const void *)c);
    const __m256i v = _mm256_loadu_si256((const __m256i *)c), lo4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, lo4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The 32 codes of a last, unpaired block (low half in bytes 0..15, high in 16..31). */
static inline __m256i lone_codes(const uint8_t *c, int qtype) {
    if (qtype == Q8_0) return _mm256_loadu_si256((const __m256i *)c);
    const __m128i v = _mm_loadu_si128((const __m128i *)c), lo4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* Lane i of a pair's 16 dot lanes belongs to block 2p + (i / 4) % 2 of a 16-block group. */
static inline __m512i pair_lanes(int p) {
    const int a = 2 * p, b = 2 * p + 1;
    return _mm512_set_epi32(b, b, b, b, a, a, a, a, b, b, b, b, a, a, a, a);
}

/* 256 sum(u q) + sum(u r) by groups of four, for a pair's 64 codes (16 int32 lanes). */
static inline __m512i pair_dot(__m512i w, const int8_t *q, const int8_t *r) {
    const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                           _mm512_loadu_si512((const void *)q));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), w, _mm512_loadu_si512((const void *)r));
}

static inline __m256i lone_dot(__m256i w, const int8_t *q, const int8_t *r) {
    const __m256i hi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w,
                                           _mm256_loadu_si256((const __m256i *)q));
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(hi, 8), w, _mm256_loadu_si256((const __m256i *)r));
}

/* y[m][n] for M <= MAX_M quantized activation rows and weight rows [n0, n1). */
/* (always inlined with a constant M, so that the accumulators live in registers) */
static inline __attribute__((always_inline)) void
rows_vnni_m(const qact *acts, const int64_t M, int64_t K, const uint8_t *codes,
            const uint16_t *d, const uint16_t *mins, int qtype, int64_t n0, int64_t n1,
            float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t nb = K / QK, cb = code_bytes(qtype);
    const __m512 negz = _mm512_set1_ps(-(float)zero_point(qtype));
    __m512i lanes[8];
    for (int p = 0; p < 8; p++) lanes[p] = pair_lanes(p);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = codes + n * nb * cb;
        const uint16_t *dn = d + n * nb, *mn = mins ? mins + n * nb : NULL;
        __m512 acc[MAX_M], off[MAX_M];
        for (int64_t i = 0; i < M; i++) acc[i] = off[i] = _mm512_setzero_ps();
        for (int64_t g = 0; g < nb; g += 16) {
            const int64_t left = nb - g < 16 ? nb - g : 16;
            const __mmask16 k = (__mmask16)((1u << left) - 1);
            const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dn + g));
            const __m512 mw = mn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + g))
                                 : _mm512_setzero_ps();
            __m512 s[MAX_M];
            for (int64_t i = 0; i < M; i++) {
                s[i] = _mm512_mul_ps(dw, _mm512_loadu_ps(acts[i].dx + g));
                off[i] = _mm512_fmadd_ps(_mm512_mul_ps(s[i], negz), _mm512_loadu_ps(acts[i].sq + g), off[i]);
                if (mn) off[i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(acts[i].sx + g), off[i]);
            }
            const int64_t pairs = left / 2;
            for (int p = 0; p < pairs; p++) {
                const int64_t b = g + 2 * p;
                const __m512i w = pair_codes(row + b * cb, qtype);
                for (int64_t i = 0; i < M; i++) {
                    const __m512i dot = pair_dot(w, acts[i].q + b * QK, acts[i].r + b * QK);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_permutexvar_ps(lanes[p], s[i]), acc[i]);
                }
            }
            if (left & 1) { /* the row's last block, unpaired */
                const int64_t b = g + left - 1;
                const __m256i w = lone_codes(row + b * cb, qtype);
                for (int64_t i = 0; i < M; i++) {
                    const __m256i dot = lone_dot(w, acts[i].q + b * QK, acts[i].r + b * QK);
                    const float sb = fp16_to_f32(dn[b]) * acts[i].dx[b];
                    acc[i] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(dot)),
                                             _mm512_set1_ps(sb), acc[i]);
                }
            }
        }
        for (int64_t i = 0; i < M; i++) {
            float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], off[i]));
            v += bias ? bias[n] : 0.0f;
            float *out = y + i * ldy + n;
            *out = accumulate ? *out + v : v;
        }
    }
}

static void rows_vnni(const qact *acts, int64_t M, int64_t K, const uint8_t *codes,
                      const uint16_t *d, const uint16_t *mins, int qtype, int64_t n0, int64_t n1,
                      float *y, int64_t ldy, const float *bias, int accumulate) {
    switch (M) {
    case 1: rows_vnni_m(acts, 1, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate); break;
    case 2: rows_vnni_m(acts, 2, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate); break;
    case 3: rows_vnni_m(acts, 3, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate); break;
    default: rows_vnni_m(acts, 4, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate); break;
    }
}

/* One activation row times NR weight rows at once: a row of a decode GEMV is only a few
 * block pairs long, and interleaving rows gives the core independent chains of dot
 * products (one row alone waits on its accumulator's latency). */
#define NR 4
static void rows_vnni_1xnr(const qact *a, int64_t K, const uint8_t *codes, const uint16_t *d,
                           const uint16_t *mins, int qtype, int64_t n0, int64_t n1, float *y,
                           const float *bias, int accumulate) {
    const int64_t nb = K / QK, cb = code_bytes(qtype);
    const __m512 negz = _mm512_set1_ps(-(float)zero_point(qtype));
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        __m512 acc[NR];
        for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < nb; g += 16) {
            const int64_t left = nb - g < 16 ? nb - g : 16;
            const __mmask16 k = (__mmask16)((1u << left) - 1);
            const __m512 dx = _mm512_maskz_loadu_ps(k, a->dx + g);
            const __m512 zq = _mm512_mul_ps(negz, _mm512_maskz_loadu_ps(k, a->sq + g));
            const __m512 sx = _mm512_maskz_loadu_ps(k, a->sx + g);
            __m512 s[NR];
            for (int r = 0; r < NR; r++) {
                const int64_t row = (n + r) * nb + g;
                s[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + row)), dx);
                acc[r] = _mm512_fmadd_ps(s[r], zq, acc[r]);
                if (mins)
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mins + row)),
                                             sx, acc[r]);
            }
            const int64_t pairs = left / 2;
            for (int p = 0; p < pairs; p++) {
                const int64_t b = g + 2 * p;
                const __m512i xq = _mm512_loadu_si512((const void *)(a->q + b * QK));
                const __m512i xr = _mm512_loadu_si512((const void *)(a->r + b * QK));
                const __m512i lanes = pair_lanes(p);
                for (int r = 0; r < NR; r++) {
                    const __m512i w = pair_codes(codes + ((n + r) * nb + b) * cb, qtype);
                    const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), w, xr);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_permutexvar_ps(lanes, s[r]), acc[r]);
                }
            }
            if (left & 1) {
                const int64_t b = g + left - 1;
                for (int r = 0; r < NR; r++) {
                    const __m256i w = lone_codes(codes + ((n + r) * nb + b) * cb, qtype);
                    const __m256i dot = lone_dot(w, a->q + b * QK, a->r + b * QK);
                    const float sb = fp16_to_f32(d[(n + r) * nb + b]) * a->dx[b];
                    acc[r] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(dot)),
                                             _mm512_set1_ps(sb), acc[r]);
                }
            }
        }
        for (int r = 0; r < NR; r++) {
            float v = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[n + r] : 0.0f);
            y[n + r] = accumulate ? y[n + r] + v : v;
        }
    }
    if (n < n1) {
        rows_vnni(a, 1, K, codes, d, mins, qtype, n, n1, y, 0, bias, accumulate);
    }
}
#endif

#if !defined(QVNNI)
/* The same arithmetic in plain C. */
static void rows_scalar(const qact *acts, int64_t M, int64_t K, const uint8_t *codes,
                        const uint16_t *d, const uint16_t *mins, int qtype, int64_t n0,
                        int64_t n1, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t nb = K / QK, cb = code_bytes(qtype);
    const int z = zero_point(qtype);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = codes + n * nb * cb;
        const uint16_t *dn = d + n * nb, *mn = mins ? mins + n * nb : NULL;
        for (int64_t i = 0; i < M; i++) {
            const qact *a = acts + i;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < QK; j++)
                    dot += code_at(row, qtype, nb, b, j) *
                           (256 * a->q[act_pos(b, nb, j)] + a->r[act_pos(b, nb, j)]);
                const float s = fp16_to_f32(dn[b]) * a->dx[b];
                sum += s * ((float)dot - (float)z * a->sq[b]);
                if (mn) sum += fp16_to_f32(mn[b]) * a->sx[b];
            }
            float v = sum + (bias ? bias[n] : 0.0f);
            float *out = y + i * ldy + n;
            *out = accumulate ? *out + v : v;
        }
    }
}
#endif

static inline void rows_product(const qact *acts, int64_t M, int64_t K, const uint8_t *codes,
                                const uint16_t *d, const uint16_t *mins, int qtype, int64_t n0,
                                int64_t n1, float *y, int64_t ldy, const float *bias,
                                int accumulate) {
#if defined(QVNNI)
    if (M == 1)
        rows_vnni_1xnr(acts, K, codes, d, mins, qtype, n0, n1, y, bias, accumulate);
    else
        rows_vnni(acts, M, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate);
#else
    rows_scalar(acts, M, K, codes, d, mins, qtype, n0, n1, y, ldy, bias, accumulate);
#endif
}

/* Bytes of `scratch` q_matmul needs for M activation rows of width K. */
int64_t q_matmul_scratch_bytes(int64_t M, int64_t K) { return M * act_bytes(K); }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W[N, K]^T (+ bias[N]); with
 * accumulate, added to y instead (a residual add folded in). `scratch`: at least
 * q_matmul_scratch_bytes(M, K) bytes. */
void q_matmul(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *codes,
              const uint16_t *d, const uint16_t *mins, int qtype, int64_t N, float *y,
              int64_t ldy, const float *bias, int accumulate, void *scratch) {
    qact acts[64];
    const int64_t chunks = (N + 15) / 16;
    for (int64_t m0 = 0; m0 < M; m0 += 64) {
        const int64_t mm = M - m0 < 64 ? M - m0 : 64;
        for (int64_t i = 0; i < mm; i++) {
            acts[i] = act_at((char *)scratch + i * act_bytes(K), K);
            quantize_act(x + (m0 + i) * ldx, K, &acts[i]);
        }
        /* Chunks of 16 output rows keep each thread's writes off its neighbours' lines. */
#pragma omp parallel for schedule(static) if (N * K * mm >= 65536)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
            for (int64_t i0 = 0; i0 < mm; i0 += MAX_M) {
                const int64_t k = mm - i0 < MAX_M ? mm - i0 : MAX_M;
                rows_product(acts + i0, k, K, codes, d, mins, qtype, n0, n1,
                             y + (m0 + i0) * ldy, ldy, bias, accumulate);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------
 * The barrier of the fused decode steps' parallel regions: spin a while, then sleep on a
 * futex. A step has ~120 barriers; libgomp's own sleep at once under OMP_WAIT_POLICY=passive
 * (the engine's default, so that idle threads and threads waiting for a pre-empted one leave
 * the cores to others), and a futex sleep + wake-up costs tens of us here. Threads that
 * arrive together meet within a few us, so a short spin catches them. The spin budget adapts
 * per thread within a step: a spin that runs out (the other thread lost its core) quarters
 * it, a spin that succeeds wins some back, so on a busy machine the threads soon sleep at
 * once again. Measured on SmolLM2 (fused step p50, 2 threads, interleaved rounds): quiet,
 * 12.7 ms (libgomp passive) -> 11.6 ms (50 us fixed spin); with one other busy process,
 * 21.8 -> 26.5 ms with a fixed 50 us spin, the cost this adaptation takes away.
 * ---------------------------------------------------------------------------------------- */
#define BAR_SPIN_NS 50000 /* the budget a step starts with, and its ceiling */
#define BAR_SPIN_MIN_NS 1000

typedef struct {
    atomic_int arrived, gen, sleepers;
} team_bar;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* All `n` threads of the team call it; none returns before the last has arrived, and each
 * then sees every write the others made before arriving (acquire/release on gen). `spin`:
 * the calling thread's spin budget (ns), adapted here. */
static void team_wait(team_bar *b, int n, int64_t *spin) {
    if (n <= 1) return;
    const int gen = atomic_load_explicit(&b->gen, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store(&b->gen, gen + 1); /* seq_cst: ordered before reading sleepers */
        if (atomic_load(&b->sleepers)) {
#if defined(__linux__)
            syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#endif
        }
        return;
    }
    const int64_t until = now_ns() + *spin;
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != gen) {
            *spin = *spin + BAR_SPIN_NS / 16 < BAR_SPIN_NS ? *spin + BAR_SPIN_NS / 16 : BAR_SPIN_NS;
            return;
        }
        cpu_relax();
        if ((i & 63) == 0 && now_ns() > until) break;
    }
    *spin = *spin / 4 > BAR_SPIN_MIN_NS ? *spin / 4 : BAR_SPIN_MIN_NS;
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load_explicit(&b->gen, memory_order_acquire) == gen) {
#if defined(__linux__)
        /* returns at once if gen moved on since the load (the kernel compares it) */
        syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&b->sleepers, 1);
}

/* ------------------------------------------------------------------------------------------
 * One decode step of one request through all layers (batch 1), in one call.
 *
 * A batch-1 step is a few hundred small operations; issued one by one from Python each
 * costs more than its arithmetic. Here the whole layer stack runs inside one OpenMP
 * parallel region. The matrix products split their rows across the threads; the small
 * vector work between them (norms, RoPE, SiLU, activation quantization) is repeated by
 * every thread on its own copy, which costs less than making the others wait for one
 * thread: a layer has 6 barriers (after each product whose whole output the next step
 * reads, and two in attention, which is split by KV head and chunk of positions so that
 * each K/V row is read once for the query heads sharing it). The barriers are `team_wait`
 * (spin briefly, then sleep), not OpenMP's, whose cost follows OMP_WAIT_POLICY.
 *
 * Per layer, `table` holds LAYER_FIELDS int64 values (pointers as integers, 0 = absent):
 *   in_norm, post_norm, then for each of qkv, o, gate_up, down: codes, d, m, qtype, bias
 * and `kv_ptrs` 2 per layer: that layer's K and V pool ([capacity, nkv, hd] float32).
 * x: the residual stream [hidden], updated in place. cos / sin: RoPE factors of this
 * position ([hd], sin signed for rotate-half), so rope(v)[j] = v[j] cos[j] +
 * v[(j + hd/2) mod hd] sin[j]. slots: the request's L pool rows, the new token's last.
 * work: scratch of at least decode_work_floats(...) floats.
 * ---------------------------------------------------------------------------------------- */
#define LAYER_FIELDS 22
#define ATT_CHUNK 64      /* positions per attention work item */
#define MAX_GROUP 32      /* query heads per KV head */
#define ATT_ALONE_MAX 256 /* a batch-1 step's attention up to this context: not split */
#define MAT_FIELDS 5

typedef struct {
    const uint8_t *codes;
    const uint16_t *d, *m;
    int qtype;
    const float *bias;
} qmat;

static qmat mat_at(const int64_t *t, int i) {
    const int64_t *f = t + 2 + i * MAT_FIELDS;
    qmat w = {(const uint8_t *)f[0], (const uint16_t *)f[1], (const uint16_t *)f[2], (int)f[3],
              (const float *)f[4]};
    return w;
}

/* Floats of one thread's private area, and of the shared one (see decode_layers). */
static int64_t private_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd,
                              int64_t inter) {
    /* h, roped q/k, the quantized h, own attention output and partials (short contexts) */
    int64_t wide = hidden > inter ? hidden : inter;
    return wide + (nh + nkv) * hd + act_bytes(wide) / (int64_t)sizeof(float) + 32 + nh * hd +
           nh * (ATT_ALONE_MAX / ATT_CHUNK) * (hd + 2);
}


static int64_t parts_floats(int64_t nh, int64_t hd, int64_t L) {
    return (L + ATT_CHUNK - 1) / ATT_CHUNK * nh * (hd + 2);
}

static int64_t shared_floats(int64_t nh, int64_t nkv, int64_t hd, int64_t inter, int64_t L) {
    /* qkv, att, gu, attention partials */
    return (nh + 2 * nkv) * hd + nh * hd + 2 * inter + parts_floats(nh, hd, L) + 16;
}

#if defined(QVNNI)
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
}
#endif

#if defined(QVNNI)
#define ATT_VMAX 8 /* head_dim / 16 up to which att_item_512 keeps a head's output in registers */

/* att_item with AVX-512 for hd a multiple of 16, <= 16 * ATT_VMAX: each K/V row loaded once
 * for the group's query heads, exponentials 16 at a time, and each head's output summed
 * in registers over the chunk (the scalar-loop version spent ~40% of a long-context step
 * here). Same arithmetic as att_item up to summation order. */
static void att_item_512(const float *q, const float *k_new, const float *v_new,
                         const float *kp, const float *vp, const int64_t *slots, int64_t L,
                         int64_t nh, int64_t nkv, int64_t hd, float scale, int64_t g, int64_t c,
                         float *parts) {
    const int64_t group = nh / nkv, nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK, p0 = c * ATT_CHUNK;
    const int64_t p1 = p0 + ATT_CHUNK < L ? p0 + ATT_CHUNK : L, n = p1 - p0, nv = hd / 16;
    float sc[MAX_GROUP][ATT_CHUNK] __attribute__((aligned(64)));
    const float *rows_k[ATT_CHUNK], *rows_v[ATT_CHUNK];
    for (int64_t p = p0; p < p1; p++) {
        rows_k[p - p0] = p == L - 1 ? k_new + g * hd : kp + (slots[p] * nkv + g) * hd;
        rows_v[p - p0] = p == L - 1 ? v_new + g * hd : vp + (slots[p] * nkv + g) * hd;
    }
    for (int64_t p = 0; p < n; p++) {
        __m512 kv[ATT_VMAX];
        for (int64_t v = 0; v < nv; v++) kv[v] = _mm512_loadu_ps(rows_k[p] + 16 * v);
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + (g * group + h) * hd;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
            for (int64_t v = 1; v < nv; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), kv[v], acc);
            sc[h][p] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *part = parts + ((g * group + h) * nchunk + c) * (hd + 2), *row = sc[h];
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        int64_t p = 0;
        for (; p + 16 <= n; p += 16) vmx = _mm512_max_ps(vmx, _mm512_load_ps(row + p));
        float mx = _mm512_reduce_max_ps(vmx);
        for (; p < n; p++) mx = row[p] > mx ? row[p] : mx;
        const __m512 m16 = _mm512_set1_ps(mx);
        __m512 vden = _mm512_setzero_ps();
        for (p = 0; p + 16 <= n; p += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(row + p), m16));
            _mm512_store_ps(row + p, e);
            vden = _mm512_add_ps(vden, e);
        }
        float den = _mm512_reduce_add_ps(vden);
        for (; p < n; p++) {
            row[p] = expf(row[p] - mx);
            den += row[p];
        }
        __m512 o[ATT_VMAX];
        for (int64_t v = 0; v < nv; v++) o[v] = _mm512_setzero_ps();
        for (p = 0; p < n; p++) {
            const __m512 w = _mm512_set1_ps(row[p]);
            for (int64_t v = 0; v < nv; v++) o[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows_v[p] + 16 * v), o[v]);
        }
        part[0] = mx;
        part[1] = den;
        for (int64_t v = 0; v < nv; v++) _mm512_storeu_ps(part + 2 + 16 * v, o[v]);
    }
}
#endif

/* One attention work item: KV head g's query heads over positions [c * ATT_CHUNK, ...) of
 * a new token's L (its own K/V, not yet in the pool, from k_new / v_new): for each query
 * head, the chunk's max score, sum of exponentials and unnormalised output, at
 * part(head, chunk) = parts + ((g * group + h) * nchunk + c) * (hd + 2). */
static void att_item(const float *q, const float *k_new, const float *v_new, const float *kp,
                     const float *vp, const int64_t *slots, int64_t L, int64_t nh, int64_t nkv,
                     int64_t hd, float scale, int64_t g, int64_t c, float *parts) {
#if defined(QVNNI)
    if (hd % 16 == 0 && hd <= 16 * ATT_VMAX) {
        att_item_512(q, k_new, v_new, kp, vp, slots, L, nh, nkv, hd, scale, g, c, parts);
        return;
    }
#endif
    const int64_t group = nh / nkv, nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK, p0 = c * ATT_CHUNK;
    const int64_t p1 = p0 + ATT_CHUNK < L ? p0 + ATT_CHUNK : L;
    float sc[MAX_GROUP][ATT_CHUNK];
    for (int64_t p = p0; p < p1; p++) {
        const float *k = p == L - 1 ? k_new + g * hd : kp + (slots[p] * nkv + g) * hd;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + (g * group + h) * hd;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < hd; j++) dot += qh[j] * k[j];
            sc[h][p - p0] = dot * scale;
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *part = parts + ((g * group + h) * nchunk + c) * (hd + 2);
        float mx = -INFINITY, den = 0.0f;
        for (int64_t p = 0; p < p1 - p0; p++) mx = sc[h][p] > mx ? sc[h][p] : mx;
        for (int64_t p = 0; p < p1 - p0; p++) {
            sc[h][p] = expf(sc[h][p] - mx);
            den += sc[h][p];
        }
        part[0] = mx;
        part[1] = den;
        for (int64_t j = 0; j < hd; j++) part[2 + j] = 0.0f;
    }
    for (int64_t p = p0; p < p1; p++) {
        const float *v = p == L - 1 ? v_new + g * hd : vp + (slots[p] * nkv + g) * hd;
        for (int64_t h = 0; h < group; h++) {
            float *o = parts + ((g * group + h) * nchunk + c) * (hd + 2) + 2;
            const float w = sc[h][p - p0];
#pragma omp simd
            for (int64_t j = 0; j < hd; j++) o[j] += w * v[j];
        }
    }
}

/* The softmax over all chunks of every query head (rescaled to one max): out [nh, hd]. */
static void att_combine(const float *parts, int64_t L, int64_t nh, int64_t hd, float *out) {
    const int64_t nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK;
    for (int64_t i = 0; i < nh; i++) {
        const float *first = parts + i * nchunk * (hd + 2);
        float mx = -INFINITY, den = 0.0f;
        for (int64_t c = 0; c < nchunk; c++) mx = first[c * (hd + 2)] > mx ? first[c * (hd + 2)] : mx;
        float *o = out + i * hd;
        for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
        for (int64_t c = 0; c < nchunk; c++) {
            const float *part = first + c * (hd + 2), f = expf(part[0] - mx);
            den += part[1] * f;
#pragma omp simd
            for (int64_t j = 0; j < hd; j++) o[j] += f * part[2 + j];
        }
        const float inv = 1.0f / den;
        for (int64_t j = 0; j < hd; j++) o[j] *= inv;
    }
}

/* Attention of one new token over its L positions, inside the parallel region, into each
 * thread's own `out` [nh, hd]. Short contexts (L <= ATT_ALONE_MAX) every thread computes
 * whole, into its own `own_parts`: cheaper than a barrier. Longer ones are split into
 * (KV head, chunk) items over the threads (each K/V row read once for the query heads
 * sharing it) into `shared_parts`, then a barrier, then every thread combines them. */
static void decode_attention(const float *q, const float *k_new, const float *v_new,
                             const float *kp, const float *vp, const int64_t *slots, int64_t L,
                             int64_t nh, int64_t nkv, int64_t hd, float scale,
                             float *shared_parts, float *own_parts, float *out,
                             team_bar *bar, int64_t *spin) {
    const int64_t nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK;
    if (L <= ATT_ALONE_MAX) {
        for (int64_t it = 0; it < nkv * nchunk; it++)
            att_item(q, k_new, v_new, kp, vp, slots, L, nh, nkv, hd, scale, it / nchunk,
                     it % nchunk, own_parts);
        att_combine(own_parts, L, nh, hd, out);
        return;
    }
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < nkv * nchunk; it++)
        att_item(q, k_new, v_new, kp, vp, slots, L, nh, nkv, hd, scale, it / nchunk,
                 it % nchunk, shared_parts);
    team_wait(bar, omp_get_num_threads(), spin);
    att_combine(shared_parts, L, nh, hd, out);
}

int64_t decode_work_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                           int64_t L) {
    return shared_floats(nh, nkv, hd, inter, L) +
           (int64_t)omp_get_max_threads() * private_floats(hidden, nh, nkv, hd, inter);
}

/* out[i] = silu(gate[i]) * up[i] (SwiGLU), n a multiple of 16 with AVX-512: exp by range
 * reduction (x = k ln2 + r, |r| <= ln2/2) and a degree-6 polynomial, scaled by 2^k, within
 * ~2 ulp of expf (libm's scalar expf for 1,536 values a layer cost ~0.7 ms a step). */

static void swiglu(const float *gate, const float *up, int64_t n, float *out) {
    int64_t i = 0;
#if defined(QVNNI)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                                _mm512_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Inside a parallel region: the threads share the rows of one product (16-row chunks),
 * then wait for each other (`bar`). */
static void par_gemv(const qact *a, int64_t K, qmat w, int64_t N, float *y, int accumulate,
                     team_bar *bar, int64_t *spin) {
    const int64_t chunks = (N + 15) / 16;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        rows_product(a, 1, K, w.codes, w.d, w.m, w.qtype, n0, n1, y, 0, w.bias, accumulate);
    }
    team_wait(bar, omp_get_num_threads(), spin);
}

static void rope(const float *v, const float *cos, const float *sin, int64_t hd, float *out) {
    int64_t half = hd / 2;
    for (int64_t j = 0; j < hd; j++) out[j] = v[j] * cos[j] + v[(j + half) % hd] * sin[j];
}

int decode_layers(float *x, int64_t hidden, int64_t n_layers, const int64_t *table,
                  const int64_t *kv_ptrs, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                  float eps, const float *cos, const float *sin, const int64_t *slots, int64_t L,
                  float *work) {
    if (nh % nkv || hidden % QK || inter % QK || (nh * hd) % QK || nh / nkv > MAX_GROUP) return -1;
    const int64_t nqkv = (nh + 2 * nkv) * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float *qkv = work;              /* shared: [nqkv] QKV product (unroped) */
    float *gu = qkv + nqkv + nh * hd; /* [2 * inter] */
    float *parts = gu + 2 * inter;  /* attention partials (long contexts) */
    float *priv0 = work + shared_floats(nh, nkv, hd, inter, L);
    const int64_t priv_n = private_floats(hidden, nh, nkv, hd, inter);
    const int64_t wide = hidden > inter ? hidden : inter, new_slot = slots[L - 1];
    team_bar bar = {0, 0, 0};

#pragma omp parallel
    {
        float *h = priv0 + (int64_t)omp_get_thread_num() * priv_n; /* [wide] */
        float *qk = h + wide;                                      /* [(nh + nkv) * hd] roped */
        float *att = qk + (nh + nkv) * hd;                         /* [nh * hd] attention out */
        float *own_parts = att + nh * hd;                          /* short-context partials */
        qact a = act_at(own_parts + nh * (ATT_ALONE_MAX / ATT_CHUNK) * (hd + 2), wide);
        int64_t spin = BAR_SPIN_NS;
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *t = table + l * LAYER_FIELDS;
            float *kp = (float *)kv_ptrs[2 * l], *vp = (float *)kv_ptrs[2 * l + 1];
            rms_norm(x, (const float *)t[0], hidden, eps, h);
            quantize_act(h, hidden, &a);
            par_gemv(&a, hidden, mat_at(t, 0), nqkv, qkv, 0, &bar, &spin); /* barrier 1 */
            for (int64_t i = 0; i < nh + nkv; i++) rope(qkv + i * hd, cos, sin, hd, qk + i * hd);
            const float *k_new = qk + nh * hd, *v_new = qkv + (nh + nkv) * hd;
            decode_attention(qk, k_new, v_new, kp, vp, slots, L, nh, nkv, hd, scale, parts,
                             own_parts, att, &bar, &spin);
#pragma omp single nowait
            { /* nobody reads the new slot from the pool in this step */
                memcpy(kp + new_slot * nkv * hd, k_new, nkv * hd * sizeof(float));
                memcpy(vp + new_slot * nkv * hd, v_new, nkv * hd * sizeof(float));
            }
            quantize_act(att, nh * hd, &a);
            par_gemv(&a, nh * hd, mat_at(t, 1), hidden, x, 1, &bar, &spin); /* barrier 3: x complete */
            rms_norm(x, (const float *)t[1], hidden, eps, h);
            quantize_act(h, hidden, &a);
            par_gemv(&a, hidden, mat_at(t, 2), 2 * inter, gu, 0, &bar, &spin); /* barrier 4 */
            swiglu(gu, gu + inter, inter, h);
            quantize_act(h, inter, &a);
            par_gemv(&a, inter, mat_at(t, 3), hidden, x, 1, &bar, &spin); /* barrier 5: x complete */
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * One decode step of B requests at once (B >= 2), all layers in one call.
 *
 * As decode_layers, with the B rows' small work (norms, RoPE, activation quantization,
 * SiLU, the pool writes) shared out by rows instead of repeated, the products taking all
 * rows per pass over the weights (MAX_M at a time), and attention split into (row, KV
 * head, chunk of positions) items. x: [B, hidden], updated in place; cos / sin: [B, hd];
 * the rows' pool slots: kv_indices[kv_indptr[b] : kv_indptr[b + 1]], the new token's
 * last. work: at least decode_rows_work_floats(...) floats.
 * ---------------------------------------------------------------------------------------- */

static int64_t rows_items(int64_t B, const int64_t *kv_indptr, int64_t nkv) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) n += nkv * ((kv_indptr[b + 1] - kv_indptr[b] + ATT_CHUNK - 1) / ATT_CHUNK);
    return n;
}

int64_t decode_rows_work_floats(int64_t B, int64_t hidden, int64_t nh, int64_t nkv, int64_t hd,
                                int64_t inter, const int64_t *kv_indptr) {
    const int64_t wide = hidden > inter ? hidden : inter, items = rows_items(B, kv_indptr, nkv);
    return B * ((nh + 2 * nkv) * hd + (nh + nkv) * hd + nh * hd + 2 * inter + wide +
                act_bytes(wide) / (int64_t)sizeof(float) + 16) +
           items / nkv * nh * (hd + 2) + 2 * items + 2 * B + 64;
}

/* Inside a parallel region: y[B, N] (row stride ldy) from B quantized rows, then `bar`. */
static void par_gemm(const qact *acts, int64_t B, int64_t K, qmat w, int64_t N, float *y,
                     int64_t ldy, int accumulate, team_bar *bar, int64_t *spin) {
    const int64_t chunks = (N + 15) / 16;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t i0 = 0; i0 < B; i0 += MAX_M) {
            const int64_t k = B - i0 < MAX_M ? B - i0 : MAX_M;
            rows_product(acts + i0, k, K, w.codes, w.d, w.m, w.qtype, n0, n1, y + i0 * ldy, ldy,
                         w.bias, accumulate);
        }
    }
    team_wait(bar, omp_get_num_threads(), spin);
}

int decode_rows(float *x, int64_t B, int64_t hidden, int64_t n_layers, const int64_t *table,
                const int64_t *kv_ptrs, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                float eps, const float *cos, const float *sin, const int64_t *kv_indices,
                const int64_t *kv_indptr, float *work) {
    if (nh % nkv || hidden % QK || inter % QK || (nh * hd) % QK || nh / nkv > MAX_GROUP ||
        B < 1 || B > 64)
        return -1;
    const int64_t nqkv = (nh + 2 * nkv) * hd, nqk = (nh + nkv) * hd;
    const int64_t wide = hidden > inter ? hidden : inter;
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t items = rows_items(B, kv_indptr, nkv);
    float *qkv = work;                /* [B, nqkv] */
    float *qk = qkv + B * nqkv;       /* [B, nqk] roped q and k */
    float *att = qk + B * nqk;        /* [B, nh * hd] */
    float *gu = att + B * nh * hd;    /* [B, 2 * inter] */
    float *h = gu + B * 2 * inter;    /* [B, wide] */
    char *act0 = (char *)(h + B * wide);
    float *parts = (float *)(act0 + B * act_bytes(wide) + 64);
    int32_t *item_row = (int32_t *)(parts + items / nkv * nh * (hd + 2));
    int32_t *item_c = item_row + items;
    int64_t *parts_at = (int64_t *)(((uintptr_t)(item_c + items) + 7) & ~(uintptr_t)7);
    qact acts[64];
    for (int64_t b = 0, it = 0, off = 0; b < B; b++) {
        acts[b] = act_at(act0 + b * act_bytes(wide), wide);
        const int64_t nc = (kv_indptr[b + 1] - kv_indptr[b] + ATT_CHUNK - 1) / ATT_CHUNK;
        parts_at[b] = off;
        off += nc * nh * (hd + 2);
        for (int64_t g = 0; g < nkv; g++)
            for (int64_t c = 0; c < nc; c++, it++) {
                item_row[it] = (int32_t)b;
                item_c[it] = (int32_t)(g * nc + c);
            }
    }

    team_bar bar = {0, 0, 0};

#pragma omp parallel
    {
        int64_t spin = BAR_SPIN_NS;
        const int nt = omp_get_num_threads();
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *t = table + l * LAYER_FIELDS;
            float *kp = (float *)kv_ptrs[2 * l], *vp = (float *)kv_ptrs[2 * l + 1];
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                rms_norm(x + b * hidden, (const float *)t[0], hidden, eps, h + b * wide);
                quantize_act(h + b * wide, hidden, &acts[b]);
            }
            team_wait(&bar, nt, &spin);
            par_gemm(acts, B, hidden, mat_at(t, 0), nqkv, qkv, nqkv, 0, &bar, &spin);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < nh + nkv; i++)
                    rope(qkv + b * nqkv + i * hd, cos + b * hd, sin + b * hd, hd, qk + b * nqk + i * hd);
            team_wait(&bar, nt, &spin);
            /* attention items: (row, KV head, chunk); K/V of the new token from the row's copy */
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < items; it++) {
                const int64_t b = item_row[it], L = kv_indptr[b + 1] - kv_indptr[b];
                const int64_t nc = (L + ATT_CHUNK - 1) / ATT_CHUNK;
                const float *q = qk + b * nqk;
                att_item(q, q + nh * hd, qkv + b * nqkv + nqk, kp, vp, kv_indices + kv_indptr[b], L,
                         nh, nkv, hd, scale, item_c[it] / nc, item_c[it] % nc, parts + parts_at[b]);
            }
            team_wait(&bar, nt, &spin);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) { /* per row: combine, new K/V into the pool, quantize */
                const int64_t slot = kv_indices[kv_indptr[b + 1] - 1];
                att_combine(parts + parts_at[b], kv_indptr[b + 1] - kv_indptr[b], nh, hd, att + b * nh * hd);
                memcpy(kp + slot * nkv * hd, qk + b * nqk + nh * hd, nkv * hd * sizeof(float));
                memcpy(vp + slot * nkv * hd, qkv + b * nqkv + nqk, nkv * hd * sizeof(float));
                quantize_act(att + b * nh * hd, nh * hd, &acts[b]);
            }
            team_wait(&bar, nt, &spin);
            par_gemm(acts, B, nh * hd, mat_at(t, 1), hidden, x, hidden, 1, &bar, &spin);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                rms_norm(x + b * hidden, (const float *)t[1], hidden, eps, h + b * wide);
                quantize_act(h + b * wide, hidden, &acts[b]);
            }
            team_wait(&bar, nt, &spin);
            par_gemm(acts, B, hidden, mat_at(t, 2), 2 * inter, gu, 2 * inter, 0, &bar, &spin);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                const float *gb = gu + b * 2 * inter;
                float *hb = h + b * wide;
                swiglu(gb, gb + inter, inter, hb);
                quantize_act(hb, inter, &acts[b]);
            }
            team_wait(&bar, nt, &spin);
            par_gemm(acts, B, inter, mat_at(t, 3), hidden, x, hidden, 1, &bar, &spin);
        }
    }
    return 0;
}
