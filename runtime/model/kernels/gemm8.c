/* Products of many activation rows (a prefill's) with 8-bit activations, as llama.cpp
 * multiplies: each row is quantized per block of 32 to int8 (s = max|x| / 127, v =
 * round(x / s)), and each block of a weight row is multiplied in integers, u8 codes by s8
 * activations: VNNI's vpdpbusd (four products summed into a 32-bit lane per instruction,
 * 512-bit with AVX-512: 64 a step), AVX2's vpmaddubsw + vpmaddwd otherwise, plain C on the
 * portable path. Per block and weight row, the codes are unsigned (a type's offset, e.g.
 * Q4_0's -8, moved into the block's float offset) and
 *   sum_j w_j x_j = ws s sum_j u_j v_j + wo sum_j x_j      (ws, wo: the block's scale and
 *                                                          offset, sum x exact),
 * per 16 codes for Q6_K (its scales are per 16). int8 activations hold x to within s / 2 =
 * max|x| / 254 of its block, so these products are not float32's: the accuracy is
 * measured (benchmarks/bench_quant_accuracy.py: perplexity and top-1 agreement against
 * the float32-dequantized model), not exact.
 *
 * The weights are read in the tile layout (common.h) and unpacked, a chunk of rows at a
 * time (about 256 KB, in L2), into a canonical form any type shares: per group of GR rows
 * (16 with AVX-512, else 8) and block of 32, the codes as bytes [quad][row][4] (one vector
 * load holds 4 codes of each of the group's rows), then the GR rows' ws and wo (and the
 * second half's, Q6_K). Each chunk is then multiplied by every activation row, MB rows at a
 * time: the MB rows' blocks stay in L1 while the chunk's groups pass, the chunk in L2 while
 * all activation rows pass. The unpacking is paid once per weight row per product, the
 * multiply-adds M times. Threads split the output rows as q_matmul's (thread_rows).
 */
#include "common.h"
#include <omp.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define G8_512 1 /* 512-bit vectors: groups of 16 rows */
#define GR 16
#define MB8 8
#elif defined(QAVX2)
#define GR 8
#define MB8 4
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define G8_VNNI256 1
#endif
#else
#define GR 8
#define MB8 4
#endif

/* Q8_0's codes stay signed where only vpmaddubsw multiplies (its u8 x s8 pair sums
 * saturate at 2 x 255 x 127): the sign moves onto the activation instead. */
#if defined(QAVX2) && !defined(G8_512) && !defined(G8_VNNI256)
#define G8_SIGNED_Q8 1
#endif

#define QUAD_BYTES (4 * GR)                  /* one quad (4 codes) of a group's rows */
#define CB_CODES (8 * QUAD_BYTES)            /* codes of one block of 32 of a group */
#define CB_BYTES (CB_CODES + 4 * GR * 4)     /* + ws, ws2, wo, wo2 (float [GR] each) */
#define CHUNK_BYTES (256 << 10)              /* canonical bytes a thread unpacks at a time */

/* The unsigned code of a type is its signed code plus this (the offset moves to wo). */
static inline int code_bias(int qtype) {
    switch (qtype) {
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q6_K: return 32;
#if defined(G8_SIGNED_Q8)
    case Q8_0: return 0;
#else
    case Q8_0: return 128;
#endif
    default: return 0;
    }
}

/* ------------------------------------------------------------------ activations */

/* Hot blocks. SmolLM2's norm outputs, like many models', carry a few channels far larger
 * than the rest; in their blocks of 32 an int8 step (max|x| / 127) is coarse for the other
 * 31 values. A row's hot blocks -- those whose max|x| exceeds HOT_RMS times the row's RMS
 * -- get a second int8 digit: the residual x - s v quantized again (its own scale). Each
 * row keeps its hot blocks' list and second digits after its nb blocks, and the product
 * adds, row by row, each second digit times the same weight block: a row's product does
 * not depend on the rows beside it, and costs only its own hot blocks. Measured on SmolLM2
 * (README text, 1024 tokens, every position's logits, float32 reference): top-1 agreement
 * 96.4% with one digit; at 4 x RMS (18.5% of the row blocks hot) 98.1-99.3% for the
 * shipped Q4_1 file and its Q4_K_M, Q5_K_M and Q6_K requantizations, perplexity within
 * 0.1%; at 6 x (9.9%) 97.3-98.4%. */
#ifndef HOT_RMS
#define HOT_RMS 4.0f
#endif

/* One quantized activation row of nb blocks, in a8_bytes(nb) bytes: v [2 nb blocks of 32]
 * int8 (its blocks, then its hot blocks' second digits), per block of v {s, s sum v, s
 * times the sum of v over codes 0..15, over 16..31}, the hot blocks' count and list. */
static inline int64_t a8_v(int64_t nb) { return (2 * QK * nb + 63) / 64 * 64; }
static inline int64_t a8_bytes(int64_t nb) { return a8_v(nb) + 2 * nb * 16 + 4 * nb + 64; }

typedef struct {
    const int8_t *v;
    const float *sc;
    const int32_t *hot; /* hot[0]: their count, hot[1 ..]: the blocks */
} arow;

static inline arow arow_at(uint8_t *row, int64_t nb) {
    const arow a = {(const int8_t *)row, (const float *)(row + a8_v(nb)),
                    (const int32_t *)(row + a8_v(nb) + 2 * nb * 16)};
    return a;
}

/* x [32] as int8 v and its block's 4 floats (see a8_bytes). */
static void quantize8_block(const float *xb, int8_t *v, float *sc) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    int32_t sa = 0, sb = 0;
#if defined(QAVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i q[4];
    /* |x inv| <= 127 (x within max|x|): no value rounds past +-127 */
    for (int h = 0; h < 4; h++) q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * h), vinv));
    sa = hsum8i(_mm256_add_epi32(q[0], q[1]));
    sb = hsum8i(_mm256_add_epi32(q[2], q[3]));
    const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b8 = _mm256_packs_epi16(w16, w16b); /* 4-byte groups 0 2 4 6 | 1 3 5 7 */
    _mm256_storeu_si256((__m256i *)v, _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int j = 0; j < QK; j++) {
        const int q = (int)nearbyintf(xb[j] * inv); /* half to even, as cvtps_epi32 */
        v[j] = (int8_t)q;
        if (j < 16) sa += q;
        else sb += q;
    }
#endif
    sc[0] = s;
    sc[1] = s * (float)(sa + sb);
    sc[2] = s * (float)sa;
    sc[3] = s * (float)sb;
}

/* Row x [K] into `row` (a8_bytes(K / 32) bytes): its blocks, its hot blocks (max|x| above
 * HOT_RMS times the row's RMS) and their second digits. */
static void quantize8(const float *x, int64_t K, uint8_t *row) {
    const int64_t nb = K / QK;
    int8_t *v = (int8_t *)row;
    float *sc = (float *)(row + a8_v(nb));
    int32_t *hot = (int32_t *)(row + a8_v(nb) + 2 * nb * 16);
    float ss = 0.0f;
    for (int64_t j = 0; j < K; j++) ss += x[j] * x[j];
    const float lim = HOT_RMS * sqrtf(ss / (float)K);
    int32_t n = 0;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        quantize8_block(xb, v + b * QK, sc + 4 * b);
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        if (amax > lim) {
            float res[QK];
            for (int j = 0; j < QK; j++) res[j] = xb[j] - sc[4 * b] * (float)v[b * QK + j];
            quantize8_block(res, v + (nb + n) * QK, sc + 4 * (nb + n));
            hot[1 + n++] = (int32_t)b;
        }
    }
    hot[0] = n;
}

/* ------------------------------------------------------------- canonical unpacking */

/* Block b of a group at `g`: its codes, and its float vectors (ws, ws2, wo, wo2). */
static inline uint8_t *cblock(uint8_t *g, int64_t b) { return g + b * CB_BYTES; }
static inline float *cfloats(uint8_t *g, int64_t b, int which) {
    return (float *)(cblock(g, b) + CB_CODES) + which * GR;
}

#if defined(QAVX2)
/* Two code units of 8 rows (16-bit lanes: codes 2u, 2u+1 and 2u+2, 2u+3 of each row) as one
 * quad of the group (row r's 4 bytes at 4r, rows 0-3 in the low 128 bits). */
static inline __m256i quad_of(__m256i a, __m256i b) {
    const __m256i pat = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm256_shuffle_epi8(_mm256_packus_epi16(a, b), pat);
}

static inline void put_quad(uint8_t *g, int64_t b, int q, int row0, __m256i v) {
    _mm256_storeu_si256((__m256i *)(cblock(g, b) + q * QUAD_BYTES + 4 * row0), v);
}

/* Unit-pair codes of one block of 32 (lo[u]: codes 2u, 2u + 1 of 8 rows, u < 16) into
 * the group's block b, rows row0 .. row0 + 7. */
static inline void put_units(uint8_t *g, int64_t b, int row0, const __m256i u[16]) {
    for (int q = 0; q < 8; q++) put_quad(g, b, q, row0, quad_of(u[2 * q], u[2 * q + 1]));
}

static inline void put_floats(uint8_t *g, int64_t b, int which, int row0, __m256 v) {
    _mm256_storeu_ps(cfloats(g, b, which) + row0, v);
}

/* Tile block `tb` (one GGML block of 8 rows) into the group at `g`, blocks from b0. */
static void unpack_tile_block(const uint8_t *tb, int qtype, uint8_t *g, int64_t b0, int row0) {
    __m256i units[2][16];
    const float bias = (float)code_bias(qtype);
    if (qtype == Q8_0) {
        const __m256i pat = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                             0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
        for (int q = 0; q < 8; q++) { /* units 2q, 2q + 1 are 32 contiguous bytes */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(tb + Q8_0_CODES + 32 * q));
            __m256i v = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(x, 0xd8), pat);
            if (code_bias(Q8_0)) v = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
            put_quad(g, b0, q, row0, v);
        }
        const __m256 d = fp16x8(tb);
        put_floats(g, b0, 0, row0, d);
        put_floats(g, b0, 2, row0, _mm256_mul_ps(d, _mm256_set1_ps(-bias)));
        return;
    }
    if (!is_kquant(qtype)) { /* Q4_0, Q4_1, Q5_0, Q5_1 */
        const int64_t co = tile_codes_at(qtype);
        const int q5 = qtype == Q5_0 || qtype == Q5_1;
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(tb + (qtype == Q5_0 ? Q5_0_QH : Q5_1_QH)))
                              : _mm256_setzero_si256();
        for (int u = 0; u < 8; u++) {
            unit_nibbles(tb + co + 16 * u, &units[0][u], &units[0][8 + u]);
            if (q5) q5_fifth(qh, u, &units[0][u], &units[0][8 + u]);
        }
        put_units(g, b0, row0, units[0]);
        const __m256 d = fp16x8(tb);
        const __m256 off = qtype == Q4_1 || qtype == Q5_1 ? fp16x8(tb + 16) : _mm256_setzero_ps();
        put_floats(g, b0, 0, row0, d);
        put_floats(g, b0, 2, row0, _mm256_fnmadd_ps(d, _mm256_set1_ps(bias), off));
        return;
    }
    const __m256 d = fp16x8(tb);
    if (qtype == Q6_K) {
        for (int c = 0; c < 4; c++) {
            const int n = c >> 1, h = c & 1, bl = 4 * n + h;
            for (int u = 0; u < 16; u++) {
                unit_nibbles(tb + Q6_K_CODES + 256 * c + 16 * u, &units[0][u], &units[1][u]);
                q6k_top(tb + Q6_K_QH + 256 * n + 16 * u, h, &units[0][u], &units[1][u]);
            }
            put_units(g, b0 + bl, row0, units[0]);
            put_units(g, b0 + bl + 2, row0, units[1]);
        }
        for (int b = 0; b < 8; b++)
            for (int half = 0; half < 2; half++) {
                const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(tb + Q6_K_SCALES + TILE * (2 * b + half)));
                const __m256 ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
                put_floats(g, b0 + b, half, row0, ws);
                put_floats(g, b0 + b, 2 + half, row0, _mm256_mul_ps(ws, _mm256_set1_ps(-bias)));
            }
        return;
    }
    const __m256 dmin = fp16x8(tb + 16); /* Q4_K, Q5_K */
    uint64_t B[12];
    kq_table(tb, B);
    for (int c = 0; c < 4; c++) {
        for (int u = 0; u < 16; u++) {
            unit_nibbles(tb + tile_codes_at(qtype) + 256 * c + 16 * u, &units[0][u], &units[1][u]);
            if (qtype == Q5_K) q5k_fifth(tb + Q5_K_QH + 16 * u, c, &units[0][u], &units[1][u]);
        }
        put_units(g, b0 + 2 * c, row0, units[0]);
        put_units(g, b0 + 2 * c + 1, row0, units[1]);
    }
    for (int s = 0; s < 8; s++) {
        put_floats(g, b0 + s, 0, row0, kq_vec(B, s, 0, d));
        put_floats(g, b0 + s, 2, row0, _mm256_sub_ps(_mm256_setzero_ps(), kq_vec(B, s, 1, dmin)));
    }
}
#else
/* Portable: the same canonical form, code by code. */
static void unpack_tile_block(const uint8_t *tb, int qtype, uint8_t *g, int64_t b0, int row0) {
    const int bias = code_bias(qtype), blocks = qblock_elems(qtype) / QK;
    for (int r = 0; r < TILE; r++)
        for (int b = 0; b < blocks; b++) {
            uint8_t *codes = cblock(g, b0 + b);
            for (int j = 0; j < QK; j++)
                codes[(j / 4) * QUAD_BYTES + 4 * (row0 + r) + j % 4] = (uint8_t)(tile_code(tb, qtype, r, QK * b + j) + bias);
            const float ws = tile_scale(tb, qtype, r, b, 0), ws2 = tile_scale(tb, qtype, r, b, 1);
            cfloats(g, b0 + b, 0)[row0 + r] = ws;
            cfloats(g, b0 + b, 1)[row0 + r] = ws2;
            cfloats(g, b0 + b, 2)[row0 + r] = tile_offset(tb, qtype, r, b) - (float)bias * ws;
            cfloats(g, b0 + b, 3)[row0 + r] = -(float)bias * ws2;
        }
}
#endif

/* Rows [n0, n0 + GR * groups) of a part (its tiles) into `buf`, group after group (nb
 * blocks each); tiles past the part's end as zeros. */
static void unpack_rows(const uint8_t *tiles, int qtype, int64_t K, int64_t N, int64_t n0, int64_t groups,
                        uint8_t *buf) {
    const int64_t nsb = K / qblock_elems(qtype), nb = K / QK, tbb = tile_block_bytes(qtype);
    const int sub = qblock_elems(qtype) / QK;
    for (int64_t gi = 0; gi < groups; gi++) {
        uint8_t *g = buf + gi * nb * CB_BYTES;
        for (int tt = 0; tt < GR / TILE; tt++) {
            const int64_t t = (n0 + gi * GR) / TILE + tt;
            if (t * TILE >= N) { /* a missing tile: zero codes and scales */
                for (int64_t b = 0; b < nb; b++) {
                    for (int q = 0; q < 8; q++) memset(cblock(g, b) + q * QUAD_BYTES + 4 * TILE * tt, 0, 4 * TILE);
                    for (int w = 0; w < 4; w++) memset(cfloats(g, b, w) + TILE * tt, 0, TILE * sizeof(float));
                }
                continue;
            }
            for (int64_t sb = 0; sb < nsb; sb++)
                unpack_tile_block(tiles + (t * nsb + sb) * tbb, qtype, g, sb * sub, TILE * tt);
        }
    }
}

/* ------------------------------------------------------------------ micro-kernels */

#if defined(G8_512)
typedef __m512i vint;
typedef __m512 vflt;
#define V_ZERO_I() _mm512_setzero_si512()
#define V_ZERO_F() _mm512_setzero_ps()
#define V_LOAD_I(p) _mm512_loadu_si512((const void *)(p))
#define V_LOAD_F(p) _mm512_loadu_ps(p)
#define V_SET1_I(x) _mm512_set1_epi32(x)
#define V_SET1_F(x) _mm512_set1_ps(x)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_CVT(a) _mm512_cvtepi32_ps(a)
#define V_STORE_F(p, v) _mm512_storeu_ps(p, v)
static inline vint dp_acc(vint acc, vint w, vint x) { return _mm512_dpbusd_epi32(acc, w, x); }
#elif defined(QAVX2)
typedef __m256i vint;
typedef __m256 vflt;
#define V_ZERO_I() _mm256_setzero_si256()
#define V_ZERO_F() _mm256_setzero_ps()
#define V_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_LOAD_F(p) _mm256_loadu_ps(p)
#define V_SET1_I(x) _mm256_set1_epi32(x)
#define V_SET1_F(x) _mm256_set1_ps(x)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_CVT(a) _mm256_cvtepi32_ps(a)
#define V_STORE_F(p, v) _mm256_storeu_ps(p, v)
static inline vint dp_acc(vint acc, vint w, vint x) {
#if defined(G8_VNNI256) && defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(G8_VNNI256)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
#endif

#if defined(G8_512) || defined(QAVX2)
/* f[i] += one canonical block `cb` of the group times MB activation blocks (xv[i]: 32
 * int8, xs[i]: its 4 floats), MB, halves and sgn constants once inlined: the 8 quads' u8
 * codes times each row's broadcast s8 quad, summed in integer lanes (one per weight row),
 * then scaled once per block (per half with `halves`: Q6_K). `sgn`: signed codes (Q8_0
 * without VNNI). */
static inline __attribute__((always_inline)) void
block_mb(const uint8_t *cb, const int MB, const int halves, const int sgn, const int8_t *const *xv,
         const float *const *xs, vflt *f) {
    (void)sgn; /* (read by the signed-Q8_0 build only) */
    const float *fl = (const float *)(cb + CB_CODES);
    for (int h = 0; h < (halves ? 2 : 1); h++) {
        vint acc[MB8];
        for (int i = 0; i < MB; i++) acc[i] = V_ZERO_I();
        for (int q = 4 * h; q < (halves ? 4 * h + 4 : 8); q++) {
            const vint w = V_LOAD_I(cb + q * QUAD_BYTES);
#if defined(G8_SIGNED_Q8)
            const vint wa = sgn ? _mm256_sign_epi8(w, w) : w;
#endif
            for (int i = 0; i < MB; i++) {
                int32_t xq;
                memcpy(&xq, xv[i] + 4 * q, 4);
#if defined(G8_SIGNED_Q8)
                if (sgn)
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(V_SET1_I(xq), w)), _mm256_set1_epi16(1)));
                else
#endif
                    acc[i] = dp_acc(acc[i], w, V_SET1_I(xq));
            }
        }
        const vflt ws = V_LOAD_F(fl + h * GR);
        for (int i = 0; i < MB; i++) f[i] = V_FMA(V_CVT(acc[i]), V_MUL(ws, V_SET1_F(xs[i][0])), f[i]);
    }
    if (halves) {
        const vflt wo = V_LOAD_F(fl + 2 * GR), wo2 = V_LOAD_F(fl + 3 * GR);
        for (int i = 0; i < MB; i++) f[i] = V_FMA(wo2, V_SET1_F(xs[i][3]), V_FMA(wo, V_SET1_F(xs[i][2]), f[i]));
    } else {
        const vflt wo = V_LOAD_F(fl + 2 * GR);
        for (int i = 0; i < MB; i++) f[i] = V_FMA(wo, V_SET1_F(xs[i][1]), f[i]);
    }
}

/* y[i, n0 .. n0 + rows) for MB activation rows over one group's canonical blocks `g`:
 * every block by all MB rows, then each row's hot blocks by its second digits. */
static inline __attribute__((always_inline)) void
micro(const uint8_t *g, int64_t nb, const arow *rw, const int MB, const int halves, const int sgn, float *y,
      int64_t ldy, int64_t n0, int rows, const float *bias, int accumulate) {
    vflt f[MB8];
    const int8_t *xv[MB8];
    const float *xs[MB8];
    for (int i = 0; i < MB; i++) f[i] = V_ZERO_F();
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < MB; i++) {
            xv[i] = rw[i].v + b * QK;
            xs[i] = rw[i].sc + 4 * b;
        }
        block_mb(g + b * CB_BYTES, MB, halves, sgn, xv, xs, f);
    }
    for (int i = 0; i < MB; i++)
        for (int32_t k = 0; k < rw[i].hot[0]; k++) {
            const int8_t *hv = rw[i].v + (nb + k) * QK;
            const float *hs = rw[i].sc + 4 * (nb + k);
            block_mb(g + (int64_t)rw[i].hot[1 + k] * CB_BYTES, 1, halves, sgn, &hv, &hs, f + i);
        }
    for (int i = 0; i < MB; i++) {
        float *yr = y + i * ldy + n0;
        if (rows == GR && !bias && !accumulate) {
            V_STORE_F(yr, f[i]);
            continue;
        }
        float out[GR];
        V_STORE_F(out, f[i]);
        for (int r = 0; r < rows; r++) {
            const float v = out[r] + (bias ? bias[n0 + r] : 0.0f);
            yr[r] = accumulate ? yr[r] + v : v;
        }
    }
}
#else
/* Portable: row r's dot with one canonical block (4 floats of the activation block). */
static float block_dot(const uint8_t *cb, int r, const int8_t *xv, const float *xs, int qtype) {
    const float *fl = (const float *)(cb + CB_CODES);
    int32_t dot[2] = {0, 0};
    for (int j = 0; j < QK; j++) dot[j / 16] += cb[(j / 4) * QUAD_BYTES + 4 * r + j % 4] * xv[j];
    if (qtype == Q6_K)
        return (float)dot[0] * (fl[r] * xs[0]) + (float)dot[1] * (fl[GR + r] * xs[0]) + fl[2 * GR + r] * xs[2] +
               fl[3 * GR + r] * xs[3];
    return (float)(dot[0] + dot[1]) * (fl[r] * xs[0]) + fl[2 * GR + r] * xs[1];
}
#endif

/* One group by MB (<= MB8) activation rows; qtype picks the constants. */
static void micro_any(const uint8_t *g, int64_t nb, const arow *rw, int MB, int qtype, float *y, int64_t ldy,
                      int64_t n0, int rows, const float *bias, int accumulate) {
#if defined(G8_512) || defined(QAVX2)
    const int halves = qtype == Q6_K;
#if defined(G8_SIGNED_Q8)
    const int sgn = qtype == Q8_0;
#else
    const int sgn = 0;
#endif
#define MICRO(mb, hv, sg) micro(g, nb, rw, mb, hv, sg, y, ldy, n0, rows, bias, accumulate)
#define MICRO_MB(hv, sg)                                                                    \
    if (MB == MB8) MICRO(MB8, hv, sg);                                                      \
    else if (MB > 4) { /* (MB8 8) 5..7 rows: 4, then the rest */                            \
        MICRO(4, hv, sg);                                                                   \
        micro_any(g, nb, rw + 4, MB - 4, qtype, y + 4 * ldy, ldy, n0, rows, bias, accumulate); \
    } else if (MB == 4) MICRO(4, hv, sg);                                                   \
    else if (MB == 3) MICRO(3, hv, sg);                                                     \
    else if (MB == 2) MICRO(2, hv, sg);                                                     \
    else MICRO(1, hv, sg);
    if (halves) { MICRO_MB(1, 0) }
    else if (sgn) { MICRO_MB(0, 1) }
    else { MICRO_MB(0, 0) }
#undef MICRO_MB
#undef MICRO
#else
    for (int i = 0; i < MB; i++)
        for (int r = 0; r < rows; r++) {
            float f = 0.0f;
            for (int64_t b = 0; b < nb; b++) f += block_dot(g + b * CB_BYTES, r, rw[i].v + b * QK, rw[i].sc + 4 * b, qtype);
            for (int32_t k = 0; k < rw[i].hot[0]; k++)
                f += block_dot(g + (int64_t)rw[i].hot[1 + k] * CB_BYTES, r, rw[i].v + (nb + k) * QK,
                               rw[i].sc + 4 * (nb + k), qtype);
            const float v = f + (bias ? bias[n0 + r] : 0.0f);
            float *out = y + i * ldy + n0 + r;
            *out = accumulate ? *out + v : v;
        }
#endif
}

/* --------------------------------------------------------------------------- gemm8 */

static int64_t chunk_rows(int64_t K) {
    int64_t rows = CHUNK_BYTES / (K / QK * CB_BYTES / GR) / 16 * 16;
    return rows < 16 ? 16 : rows > 256 ? 256 : rows;
}

/* Scratch: the quantized rows (room for every block hot) and each thread's unpacked chunk. */
int64_t gemm8_scratch_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / QK, canon = chunk_rows(K) / GR * nb * CB_BYTES;
    return M * a8_bytes(nb) + (int64_t)omp_get_max_threads() * (canon + 64) + 128;
}

void gemm8(const float *x, int64_t M, int64_t ldx, int64_t K, qmat w, float *y, int64_t ldy,
           int accumulate, void *scratch) {
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const int64_t nb = K / QK, crows = chunk_rows(K), ab = a8_bytes(nb);
    const int64_t canon = crows / GR * nb * CB_BYTES;
    uint8_t *canon0 = base + M * ab;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize8(x + i * ldx, K, base + i * ab);
        uint8_t *buf = canon0 + (int64_t)omp_get_thread_num() * (canon + 64);
        int64_t off = 0;
        for (int p = 0; p < w.nparts; p++) {
            const int64_t N = w.desc[3 * p];
            const int qtype = (int)w.desc[3 * p + 1];
            const uint8_t *tiles = (const uint8_t *)w.desc[3 * p + 2];
            int64_t n0, n1;
            thread_rows(N, &n0, &n1);
            for (int64_t c0 = n0; c0 < n1; c0 += crows) {
                const int64_t c1 = c0 + crows < n1 ? c0 + crows : n1, groups = (c1 - c0 + GR - 1) / GR;
                unpack_rows(tiles, qtype, K, N, c0, groups, buf);
                for (int64_t i0 = 0; i0 < M; i0 += MB8) {
                    const int mb = M - i0 < MB8 ? (int)(M - i0) : MB8;
                    arow rw[MB8];
                    for (int i = 0; i < mb; i++) rw[i] = arow_at(base + (i0 + i) * ab, nb);
                    for (int64_t gi = 0; gi < groups; gi++) {
                        const int64_t g0 = c0 + gi * GR;
                        const int rows = c1 - g0 < GR ? (int)(c1 - g0) : GR;
                        micro_any(buf + gi * nb * CB_BYTES, nb, rw, mb, qtype, y + i0 * ldy + off, ldy, g0, rows,
                                  w.bias ? w.bias + off : NULL, accumulate);
                    }
                }
            }
            off += N;
        }
    }
}
