/* Products of many activation rows (a prefill's) with 8-bit activations, as llama.cpp
 * multiplies: each row is quantized per block of 32 to int8 (s = max|x| / 127, v =
 * round(x / s)), and each block of a weight row is multiplied in integers, u8 codes by s8
 * activations: VNNI's vpdpbusd (four products summed into a 32-bit lane per instruction,
 * 512-bit with AVX-512: 64 a step), AVX2's vpmaddubsw + vpmaddwd otherwise, plain C on the
 * portable path. Per block and weight row, the codes are unsigned (a type's offset, e.g.
 * Q4_0's -8, moved into the block's float offset) and
 *   sum_j w_j x_j = ws s sum_j u_j v_j + wo sum_j x_j      (ws, wo: the block's scale and
 *                                                          offset, sum x exact),
 * per 16 codes for Q6_K (its scales are per 16; its offset, -32 a code, subtracted from
 * the integer sums: 32 sum_j v_j per half, no float offset). int8 activations hold x to
 * within s / 2 = max|x| / 254 of its block (its outliers aside, which are exact), so these
 * products are not float32's: the accuracy is
 * measured (benchmarks/bench_quant_accuracy.py: perplexity and top-1 agreement against
 * the float32-dequantized model), not exact.
 *
 * The weights are read in the tile layout (common.h) and unpacked, a chunk of rows and a
 * slice of K (64 blocks of 32) at a time (about 256 KB, in L2), into a canonical form any
 * type shares: per group of GR rows (16 with AVX-512, else 8) and block of 32, the codes as
 * bytes [quad][row][4] (one vector load holds 4 codes of each of the group's rows), then
 * the GR rows' ws and wo (and the second half's, Q6_K). Each thread takes the activation
 * rows MC8 (512) at a time through every slice and chunk; a chunk is multiplied by each of
 * those rows, MB8 rows by NG8 groups a micro-kernel pass (AVX-512: 6 rows by 32 weight rows,
 * 12 integer and 12 float accumulators): each quad of codes loaded once for the MB8 rows,
 * each activation quad broadcast once for the NG8 groups. The rows' slice stays in L1/L2
 * while the chunk's groups pass, the chunk in L2 while the rows pass; the unpacking is paid
 * once per weight row per MC8 rows. Outliers (see below) are multiplied after each chunk's
 * main pass: per OG groups of the chunk, the slice's weight columns dequantized once, then
 * each row's outliers in the slice. Threads split the output rows as q_matmul's
 * (thread_rows); every sum's order depends on K alone, so a row's product does not depend
 * on M or the rows beside it.
 *
 * Measured on the 1B Q4_K_M shape (2 cores, AMD EPYC Zen 5, AVX-512 VNNI; one forward of
 * 365 / 2,000 tokens): products 1.04 s -> 0.70 s / 6.3 s -> 4.3 s. The gains, in order:
 * quantizing rows with vector code (the scalar sums and maxima cost 7 ms of a down
 * projection's 28 at 365 rows); the accuracy's extra pass by block of 32 (then a second
 * digit per hot block; a row's hot block alone was 8 dependent multiply-adds); MC8 rows at a
 * time (at 2,000 rows every activation row came back from L3 for each chunk); outliers in
 * place of second digits (forward 850 -> 790 ms / 5.35 -> 4.8 s).
 */
#include "common.h"
#include "vec.h"
#include <omp.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define G8_512 1 /* 512-bit vectors: groups of 16 rows */
#define GR 16
#define MB8 6 /* activation rows a micro-kernel pass multiplies, */
#define NG8 2 /* by this many groups (2 x 6 integer and 2 x 6 float accumulators of 32 registers) */
#elif defined(QAVX2)
#define GR 8
#define MB8 4
#define NG8 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define G8_VNNI256 1
#endif
#else
#define GR 8
#define MB8 4
#define NG8 1
#endif

/* Q8_0's codes stay signed where only vpmaddubsw multiplies (its u8 x s8 pair sums
 * saturate at 2 x 255 x 127): the sign moves onto the activation instead. */
#if defined(QAVX2) && !defined(G8_512) && !defined(G8_VNNI256)
#define G8_SIGNED_Q8 1
#endif

#define QUAD_BYTES (4 * GR)                  /* one quad (4 codes) of a group's rows */
#define CB_CODES (8 * QUAD_BYTES)            /* codes of one block of 32 of a group */
#define CB_BYTES (CB_CODES + 4 * GR * 4)     /* + ws, ws2 (Q6_K), wo, one unused (float [GR] each) */
#define CHUNK_BYTES (256 << 10)              /* canonical bytes a thread unpacks at a time */

/* Whether a type's codes stay signed in the canonical form (Q8_0 without VNNI). */
static inline int codes_signed(int qtype) {
#if defined(G8_SIGNED_Q8)
    return qtype == Q8_0;
#else
    (void)qtype;
    return 0;
#endif
}

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

/* Outliers. SmolLM2's norm outputs, like many models', carry a few channels far larger
 * than the rest, and an MLP's SiLU(gate) x up input is heavy-tailed; in their blocks of 32 an
 * int8 step (max|x| / 127) is coarse for the other 31 values. A row's outliers -- values whose
 * |x| exceeds OUTLIER_RMS times the row's RMS (OUTLIER_RMS_GLU for SiLU(gate) x up formed in
 * the product) -- are kept out of the int8 codes and multiplied exactly, in float32, by the
 * weights' dequantized columns (outlier_pass); the rest of their block is quantized with its
 * own max|x| (at most the threshold, as in every other block). Each row keeps its outliers'
 * positions and values by slice of K, so a row's product does not depend on the rows beside
 * it and costs only its own outliers. Measured on SmolLM2 (bench_quant_accuracy.py's text,
 * 1024 tokens, every position's logits against float32, simulated in float64 over the Q4_1,
 * Q4_K_M, Q6_K and Q5_1 files; mean KL divergence): int8 alone 2.0-2.3e-3 (top-1 96.3-97.5%);
 * outliers above 3 x RMS, 2.5 x in SiLU(gate) x up (2.2% of the values): 4.0-5.3e-4; above 2.5
 * x everywhere: 3.7-4.7e-4; the scheme this replaced (a second int8 digit of the residual in
 * every block whose max|x| passed 3 x RMS): 3.5-4.4e-4. That scheme's second pass cost 1.4
 * main-pass blocks a hot block, and on the 1B shape's down projection 57% of the blocks were
 * hot (one down projection of 365 rows: 19 ms, 16 ms with outliers, 10 ms with neither);
 * an outlier costs one broadcast and an FMA per 16 weight rows. */
#ifndef OUTLIER_RMS
#define OUTLIER_RMS 3.0f
#endif
#ifndef OUTLIER_RMS_GLU
#define OUTLIER_RMS_GLU 2.5f /* SiLU(gate) x up, formed in the product: heavier tails */
#endif
#define OUTLIER_RMS_MIN (OUTLIER_RMS < OUTLIER_RMS_GLU ? OUTLIER_RMS : OUTLIER_RMS_GLU)

/* The threshold of inputs of a kind (G8_PLAIN, G8_GLU, G8_NORM). */
float gemm8_outlier_rms(int kind) { return kind == G8_GLU ? OUTLIER_RMS_GLU : OUTLIER_RMS; }

/* Blocks of 32 a pass multiplies: MB8 activation rows' share of them stays in L1 and a
 * chunk of weight rows' (CHUNK_BYTES) holds enough rows to use each activation row many
 * times, whatever K (a down projection's 8,192 columns whole left 16 rows a chunk, and every
 * activation row came back from memory for each 16 weight rows). A multiple of 8 (whole
 * K-quant super-blocks). */
#define KC_BLOCKS 64

static int64_t slice_blocks(int64_t K) { return K / QK < KC_BLOCKS ? K / QK : KC_BLOCKS; }
static int64_t slices(int64_t K) { return (K / QK + KC_BLOCKS - 1) / KC_BLOCKS; }

/* A row has fewer than K / t^2 outliers at t x its RMS (each holds more than t^2 / K of the
 * row's sum of squares): room for that at the lower t, with a margin for float rounding
 * (and split_outliers stops at it whatever the rounding). */
static inline int64_t max_outliers(int64_t K) {
    return (int64_t)((float)K / (0.9f * OUTLIER_RMS_MIN * OUTLIER_RMS_MIN)) + 1;
}

/* One quantized activation row (K = 32 nb values), in a8_bytes(K) bytes: v [nb blocks of
 * 32] int8; per block of v {s, s sum v, and as int32 32 times the sum of v over codes
 * 0..15, over 16..31}; per slice of K (KC_BLOCKS blocks) the index of its first outlier
 * (and one past the last); the outliers' positions in their slice (uint16) and values, in
 * order. */
static inline int64_t a8_v(int64_t K) { return (K + 63) / 64 * 64; }
static inline int64_t a8_cut(int64_t K) { return (4 * (slices(K) + 1) + 63) / 64 * 64; }
static inline int64_t a8_pos(int64_t K) { return (2 * max_outliers(K) + 63) / 64 * 64; }
static inline int64_t a8_bytes(int64_t K) { return a8_v(K) + K / QK * 16 + a8_cut(K) + a8_pos(K) + 4 * max_outliers(K); }

typedef struct {
    int8_t *v;
    float *sc;
    int32_t *cut; /* cut[s] .. cut[s + 1]: slice s's outliers */
    uint16_t *pos;
    float *val;
} arow;

static inline arow arow_at(uint8_t *row, int64_t K) {
    uint8_t *sc = row + a8_v(K), *cut = sc + K / QK * 16, *pos = cut + a8_cut(K), *val = pos + a8_pos(K);
    const arow a = {(int8_t *)row, (float *)sc, (int32_t *)cut, (uint16_t *)pos, (float *)val};
    return a;
}

/* Block xb's values above lim (at offsets at0 + j of their slice) appended to the row's
 * outliers (n of them so far, at most cap), the others into small (zeros at the outliers);
 * returns max |x| of small. */
static float split_outliers_scalar(const float *xb, float lim, int at0, float *small, arow a, int32_t *n,
                                   int32_t cap) {
    float m = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float ax = fabsf(xb[j]);
        if (ax > lim && *n < cap) {
            a.pos[*n] = (uint16_t)(at0 + j);
            a.val[(*n)++] = xb[j];
            small[j] = 0.0f;
        } else {
            small[j] = xb[j];
            m = ax > m ? ax : m;
        }
    }
    return m;
}

#if defined(QAVX2)
static float split_outliers(const float *xb, float lim, int at0, float *small, arow a, int32_t *n, int32_t cap) {
    const __m256 sign = _mm256_set1_ps(-0.0f), vlim = _mm256_set1_ps(lim);
    __m256 m = _mm256_setzero_ps();
    uint32_t mask = 0;
    for (int h = 0; h < 4; h++) {
        const __m256 x = _mm256_loadu_ps(xb + 8 * h), ax = _mm256_andnot_ps(sign, x);
        const __m256 out = _mm256_cmp_ps(ax, vlim, _CMP_GT_OQ);
        mask |= (uint32_t)_mm256_movemask_ps(out) << (8 * h);
        _mm256_storeu_ps(small + 8 * h, _mm256_andnot_ps(out, x));
        m = _mm256_max_ps(m, _mm256_andnot_ps(out, ax));
    }
    if (*n + __builtin_popcount(mask) > cap) return split_outliers_scalar(xb, lim, at0, small, a, n, cap);
    for (; mask; mask &= mask - 1) {
        const int j = __builtin_ctz(mask);
        a.pos[*n] = (uint16_t)(at0 + j);
        a.val[(*n)++] = xb[j];
    }
    return hmax8(m);
}
#else
#define split_outliers split_outliers_scalar
#endif

#if defined(QAVX2)
/* max |x| over a block of 32 */
static inline float block_amax(const float *xb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
    for (int h = 1; h < 4; h++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * h)));
    return hmax8(m);
}
#else
static inline float block_amax(const float *xb) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    return amax;
}
#endif

/* x [32] (max |x| amax) as int8 v and its block's 4 floats (see a8_bytes). */
static void quantize8_block(const float *xb, float amax, int8_t *v, float *sc) {
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
    const int32_t off[2] = {32 * sa, 32 * sb}; /* Q6_K's -32 per code, in integers (block_mb) */
    memcpy(sc + 2, off, sizeof(off));
}

/* sum of x[j]^2 over K (a multiple of 32) */
static float sum_squares(const float *x, int64_t K) {
#if defined(QAVX2)
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int64_t j = 0; j < K; j += 16) {
        const __m256 u = _mm256_loadu_ps(x + j), w = _mm256_loadu_ps(x + j + 8);
        a = _mm256_fmadd_ps(u, u, a);
        b = _mm256_fmadd_ps(w, w, b);
    }
    return hsum8f(_mm256_add_ps(a, b));
#else
    float ss = 0.0f;
    for (int64_t j = 0; j < K; j++) ss += x[j] * x[j];
    return ss;
#endif
}

/* Row x [K] into `row` (a8_bytes(K) bytes): its blocks, less its outliers (|x| above t
 * times the row's RMS), and the outliers by slice. */
static void quantize8(const float *x, int64_t K, float t, uint8_t *row) {
    const int64_t nb = K / QK, kc = slice_blocks(K);
    const arow a = arow_at(row, K);
    const float lim = t * sqrtf(sum_squares(x, K) / (float)K);
    int32_t n = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (b % kc == 0) a.cut[b / kc] = n;
        const float *xb = x + b * QK, amax = block_amax(xb);
        if (amax <= lim) {
            quantize8_block(xb, amax, a.v + b * QK, a.sc + 4 * b);
            continue;
        }
        float small[QK];
        const float amax_small = split_outliers(xb, lim, (int)(b % kc) * QK, small, a, &n, (int32_t)max_outliers(K));
        quantize8_block(small, amax_small, a.v + b * QK, a.sc + 4 * b);
    }
    a.cut[slices(K)] = n;
}

/* ------------------------------------------------------------- canonical unpacking */

/* The blocks of 32 [b0, b1) of rows of nb blocks that one pass multiplies (see gemm8). */
typedef struct {
    int64_t b0, b1, nb;
} kslice;

/* Block b of a group at `g`: its codes, and its float vectors (ws, ws2, wo). */
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

#if defined(DEC8)
/* Byte o of 64 in 2-byte units (unit o / 16, row (o / 2) mod 8) is byte KQ_UNITS2[o] of the
 * same 64 in 8-byte units. */
static const uint8_t KQ_UNITS2[64] __attribute__((aligned(64))) = {
    0, 1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57,
    2, 3, 10, 11, 18, 19, 26, 27, 34, 35, 42, 43, 50, 51, 58, 59,
    4, 5, 12, 13, 20, 21, 28, 29, 36, 37, 44, 45, 52, 53, 60, 61,
    6, 7, 14, 15, 22, 23, 30, 31, 38, 39, 46, 47, 54, 55, 62, 63};

/* Tile block `tb` of a K-quant with its code and high-bit tables in 2-byte units (common.h,
 * KQ_UNIT), in `buf` (tile_block_bytes(qtype) bytes), for the unpacking below, which was
 * made for that layout (one permute a 64 bytes, once per chunk and MC8 rows). */
static inline const uint8_t *kq_units2(const uint8_t *tb, int qtype, uint8_t *buf) {
    const int64_t from = qtype == Q6_K ? Q6_K_QH : Q4_K_CODES, end = tile_block_bytes(qtype);
    const __m512i idx = _mm512_load_si512((const void *)KQ_UNITS2);
    memcpy(buf, tb, (size_t)from); /* d, dmin, scales */
    for (int64_t o = from; o < end; o += 64)
        _mm512_storeu_si512((void *)(buf + o), _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)(tb + o))));
    return buf;
}
#define KQ_TILE_MAX 1680 /* Q6_K's tile block */
#endif

/* Tile block `tb` (one GGML block of 8 rows) into the group at `g`, blocks from b0. */
static void unpack_tile_block(const uint8_t *tb, int qtype, uint8_t *g, int64_t b0, int row0) {
    __m256i units[2][16];
    const float bias = (float)code_bias(qtype);
#if defined(DEC8)
    uint8_t units2[KQ_TILE_MAX] __attribute__((aligned(64)));
    if (is_kquant(qtype)) tb = kq_units2(tb, qtype, units2);
#endif
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
                put_floats(g, b0 + b, half, row0, ws); /* (its offset: in integers, block_mb) */
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
            cfloats(g, b0 + b, 2)[row0 + r] = tile_offset(tb, qtype, r, b) - (float)bias * ws; /* (not Q6_K's) */
        }
}
#endif

/* Rows [n0, n0 + GR * groups) of a part (its tiles), blocks of 32 [b0, b1) (whole GGML
 * blocks), into `buf`, group after group (b1 - b0 blocks each); tiles past the part's end as
 * zeros. */
static void unpack_rows(const uint8_t *tiles, int qtype, int64_t K, int64_t N, int64_t n0, int64_t groups,
                        int64_t b0, int64_t b1, uint8_t *buf) {
    const int64_t nsb = K / qblock_elems(qtype), nb = b1 - b0, tbb = tile_block_bytes(qtype);
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
            for (int64_t sb = b0 / sub; sb < b1 / sub; sb++)
                unpack_tile_block(tiles + (t * nsb + sb) * tbb, qtype, g, sb * sub - b0, TILE * tt);
        }
    }
}

/* A chunk's tiles (unpack_rows' reads), fetched toward L2 a share at a time while the chunk
 * before it is multiplied: unpacking otherwise waits on DRAM for each tile's first bytes
 * (profiled: half of unpack_tile_block's time in its first loads of tile bytes). A 365-row
 * forward of the 1B Q4_K_M shape: 784-788 -> 760-779 ms; prefetcht0 and prefetcht2 measured
 * no better. */
typedef struct {
    const uint8_t *tiles; /* the part's tiles; NULL: nothing to fetch */
    int64_t nsb, tbb, sb0; /* each tile's super-blocks from sb0 */
    int64_t span;          /* one tile's bytes of the slice (more than a line) */
    int64_t t, off;        /* the next line: tile t, byte off of its span */
    int64_t at, end;       /* bytes fetched so far, of end */
} tile_fetch;

/* The tiles of rows [r0, r1) (r0 a multiple of TILE; none past row `last`), super-blocks of
 * blocks [b0, b1). */
static tile_fetch tile_fetch_of(const uint8_t *tiles, int qtype, int64_t K, int64_t last, int64_t r0, int64_t r1,
                                int64_t b0, int64_t b1) {
    const int64_t sub = qblock_elems(qtype) / QK, tbb = tile_block_bytes(qtype), t0 = r0 / TILE;
    const int64_t t1 = ((r1 < last ? r1 : last) + TILE - 1) / TILE, span = (b1 / sub - b0 / sub) * tbb;
    const tile_fetch f = {tiles, K / qblock_elems(qtype), tbb, b0 / sub, span, t0, 0, 0, t1 > t0 ? (t1 - t0) * span : 0};
    return f;
}

/* The next `bytes` of f's tiles prefetched (by lines; a cursor, not a division a line). */
static inline void tile_fetch_some(tile_fetch *f, int64_t bytes) {
    if (!f->tiles) return;
    const int64_t stop = f->at + bytes < f->end ? f->at + bytes : f->end;
    for (; f->at < stop; f->at += 64) {
        __builtin_prefetch(f->tiles + (f->t * f->nsb + f->sb0) * f->tbb + f->off, 0, 2); /* (prefetcht1: toward L2) */
        if ((f->off += 64) >= f->span) {
            f->off -= f->span;
            f->t++;
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
#define V_SUB_I(a, b) _mm512_sub_epi32(a, b)
#define V_SET1_F(x) _mm512_set1_ps(x)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_CVT(a) _mm512_cvtepi32_ps(a)
#define V_STORE_F(p, v) _mm512_storeu_ps(p, v)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_AND(a, b) _mm512_and_si512(a, b)
#define V_SRL_N(a, n) _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)) /* (n not a constant) */
#define V_SLL_N(a, n) _mm512_sll_epi32(a, _mm_cvtsi32_si128(n))
#define V_SRA_N(a, n) _mm512_sra_epi32(a, _mm_cvtsi32_si128(n))
static inline vint dp_acc(vint acc, vint w, vint x) { return _mm512_dpbusd_epi32(acc, w, x); }
#elif defined(QAVX2)
typedef __m256i vint;
typedef __m256 vflt;
#define V_ZERO_I() _mm256_setzero_si256()
#define V_ZERO_F() _mm256_setzero_ps()
#define V_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_LOAD_F(p) _mm256_loadu_ps(p)
#define V_SET1_I(x) _mm256_set1_epi32(x)
#define V_SUB_I(a, b) _mm256_sub_epi32(a, b)
#define V_SET1_F(x) _mm256_set1_ps(x)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_CVT(a) _mm256_cvtepi32_ps(a)
#define V_STORE_F(p, v) _mm256_storeu_ps(p, v)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_AND(a, b) _mm256_and_si256(a, b)
#define V_SRL_N(a, n) _mm256_srl_epi32(a, _mm_cvtsi32_si128(n))
#define V_SLL_N(a, n) _mm256_sll_epi32(a, _mm_cvtsi32_si128(n))
#define V_SRA_N(a, n) _mm256_sra_epi32(a, _mm_cvtsi32_si128(n))
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
#define UNROLL _Pragma("GCC unroll 8")

/* f[k][i] += one canonical block of NG groups (group k's at cb + k gstride) times MB
 * activation blocks (xv[i]: 32 int8, xs[i]: its 4 floats); NG, MB, halves and sgn are
 * constants once inlined. Per quad, each group's u8 codes are loaded once and each row's s8
 * quad broadcast once: NG x MB multiply-adds (one integer lane per weight row), then each
 * block's sums are scaled once (per half with `halves`: Q6_K). `sgn`: signed codes (Q8_0
 * without VNNI). */
static inline __attribute__((always_inline)) void
block_mb(const uint8_t *cb, int64_t gstride, const int NG, const int MB, const int halves, const int sgn,
         const int8_t *const *xv, const float *const *xs, vflt f[NG8][MB8]) {
    (void)sgn; /* (read by the signed-Q8_0 build only) */
    UNROLL for (int h = 0; h < (halves ? 2 : 1); h++) {
        vint acc[NG8][MB8];
        UNROLL for (int k = 0; k < NG; k++) UNROLL for (int i = 0; i < MB; i++) acc[k][i] = V_ZERO_I();
        UNROLL for (int q = 4 * h; q < (halves ? 4 * h + 4 : 8); q++) {
            vint w[NG8];
            UNROLL for (int k = 0; k < NG; k++) w[k] = V_LOAD_I(cb + k * gstride + q * QUAD_BYTES);
            UNROLL for (int i = 0; i < MB; i++) {
                int32_t xq;
                memcpy(&xq, xv[i] + 4 * q, 4);
                const vint x = V_SET1_I(xq);
                UNROLL for (int k = 0; k < NG; k++) {
#if defined(G8_SIGNED_Q8)
                    if (sgn)
                        acc[k][i] = _mm256_add_epi32(acc[k][i], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[k], w[k]), _mm256_sign_epi8(x, w[k])), _mm256_set1_epi16(1)));
                    else
#endif
                        acc[k][i] = dp_acc(acc[k][i], w[k], x);
                }
            }
        }
        if (halves) /* Q6_K: its unsigned codes' 32 x the half's sum of v, subtracted in integers */
            UNROLL for (int i = 0; i < MB; i++) {
                int32_t off;
                memcpy(&off, xs[i] + 2 + h, 4);
                const vint o = V_SET1_I(off);
                UNROLL for (int k = 0; k < NG; k++) acc[k][i] = V_SUB_I(acc[k][i], o);
            }
        UNROLL for (int k = 0; k < NG; k++) {
            const vflt ws = V_LOAD_F((const float *)(cb + k * gstride + CB_CODES) + h * GR);
            UNROLL for (int i = 0; i < MB; i++) f[k][i] = V_FMA(V_CVT(acc[k][i]), V_MUL(ws, V_SET1_F(xs[i][0])), f[k][i]);
        }
    }
    if (!halves)
        UNROLL for (int k = 0; k < NG; k++) {
            const vflt wo = V_LOAD_F((const float *)(cb + k * gstride + CB_CODES) + 2 * GR);
            UNROLL for (int i = 0; i < MB; i++) f[k][i] = V_FMA(wo, V_SET1_F(xs[i][1]), f[k][i]);
        }
}

/* y[i, n0 .. n0 + rows) for MB activation rows over NG groups' canonical blocks (group k's
 * at g + k gstride; the slice ks of the rows' blocks), every block by all MB rows in
 * registers. (The rows' outliers are added after, by outlier_pass.) */
static inline __attribute__((always_inline)) void
micro(const uint8_t *g, int64_t gstride, const int NG, kslice ks, const arow *rw, const int MB, const int halves,
      const int sgn, float *y, int64_t ldy, int64_t n0, int rows, int accumulate) {
    vflt f[NG8][MB8];
    const int8_t *xv[MB8];
    const float *xs[MB8];
    UNROLL for (int k = 0; k < NG; k++) UNROLL for (int i = 0; i < MB; i++) f[k][i] = V_ZERO_F();
    for (int64_t b = ks.b0; b < ks.b1; b++) {
        UNROLL for (int i = 0; i < MB; i++) {
            xv[i] = rw[i].v + b * QK;
            xs[i] = rw[i].sc + 4 * b;
        }
        block_mb(g + (b - ks.b0) * CB_BYTES, gstride, NG, MB, halves, sgn, xv, xs, f);
    }
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int k = 0; k < NG; k++) {
        const int64_t r0 = n0 + k * GR;
        const int rk = rows - k * GR < GR ? rows - k * GR : GR;
        float *yr = y + i * ldy + r0;
        if (rk == GR) {
            V_STORE_F(yr, accumulate ? V_ADD(V_LOAD_F(yr), f[k][i]) : f[k][i]);
            continue;
        }
        float out[GR];
        V_STORE_F(out, f[k][i]);
        for (int r = 0; r < rk; r++) yr[r] = accumulate ? yr[r] + out[r] : out[r];
    }
}

#else
/* Portable: row r's dot with one canonical block (4 floats of the activation block). */
static float block_dot(const uint8_t *cb, int r, const int8_t *xv, const float *xs, int qtype) {
    const float *fl = (const float *)(cb + CB_CODES);
    int32_t dot[2] = {0, 0};
    for (int j = 0; j < QK; j++) dot[j / 16] += cb[(j / 4) * QUAD_BYTES + 4 * r + j % 4] * xv[j];
    if (qtype == Q6_K) {
        int32_t off[2];
        memcpy(off, xs + 2, sizeof(off));
        return (float)(dot[0] - off[0]) * (fl[r] * xs[0]) + (float)(dot[1] - off[1]) * (fl[GR + r] * xs[0]);
    }
    return (float)(dot[0] + dot[1]) * (fl[r] * xs[0]) + fl[2 * GR + r] * xs[1];
}
#endif

/* ng (1 or NG8) groups (group k at g + k gstride, rows in all) by MB (<= MB8) activation
 * rows; qtype picks the constants. */
static void micro_any(const uint8_t *g, int64_t gstride, int ng, kslice ks, const arow *rw, int MB, int qtype,
                      float *y, int64_t ldy, int64_t n0, int rows, int accumulate) {
#if defined(G8_512) || defined(QAVX2)
    const int halves = qtype == Q6_K, sgn = codes_signed(qtype);
#define MICRO(ngc, mb, hv, sg) micro(g, gstride, ngc, ks, rw, mb, hv, sg, y, ldy, n0, rows, accumulate)
#define MICRO_ALL(ngc, hv, sg)                                                               \
    if (MB == MB8) MICRO(ngc, MB8, hv, sg);                                                  \
    else if (MB >= 4) {                                                                      \
        MICRO(ngc, 4, hv, sg);                                                               \
        if (MB > 4) micro_any(g, gstride, ng, ks, rw + 4, MB - 4, qtype, y + 4 * ldy, ldy, n0, rows, accumulate); \
    } else if (MB == 3) MICRO(ngc, 3, hv, sg);                                               \
    else if (MB == 2) MICRO(ngc, 2, hv, sg);                                                 \
    else MICRO(ngc, 1, hv, sg);
#define MICRO_NG(hv, sg)                                                                     \
    if (ng == NG8) { MICRO_ALL(NG8, hv, sg) }                                                \
    else { MICRO_ALL(1, hv, sg) }
    if (halves) { MICRO_NG(1, 0) }
    else if (sgn) { MICRO_NG(0, 1) }
    else { MICRO_NG(0, 0) }
#undef MICRO_NG
#undef MICRO_ALL
#undef MICRO
#else
    for (int i = 0; i < MB; i++)
        for (int r = 0; r < rows; r++) {
            float f = 0.0f;
            for (int64_t b = ks.b0; b < ks.b1; b++)
                f += block_dot(g + (b - ks.b0) * CB_BYTES, r, rw[i].v + b * QK, rw[i].sc + 4 * b, qtype);
            float *out = y + i * ldy + n0 + r;
            *out = accumulate ? *out + f : f;
        }
#endif
}

/* Activation rows a thread takes through every slice and chunk before the next ones: their
 * slice (MC8 x 64 blocks, ~1.5 MB) stays in L2 while the chunks pass, and so do their
 * outputs, which the outlier pass updates again (with all of a long prefill's rows at once,
 * both came back from L3 for each chunk). The weights are unpacked once per MC8 rows. */
#ifndef MC8
#define MC8 512
#endif

/* ------------------------------------------------------------------ outliers */

#define OG 2 /* groups of weight rows an outlier pass takes at once (each value broadcast once) */
#define OCH 4 /* chains an outlier pass keeps a group (FMA latency) */

#if defined(G8_512) || defined(QAVX2)
/* Column 4q + t of a group's block as floats: code t of each row in quad c (the quad's
 * codes), times ws plus wo (Q6_K: ws (u - 32)). */
static inline vflt quad_column(vint c, int t, int qtype, vflt ws, vflt wo) {
    const vint u = codes_signed(qtype) ? V_SRA_N(V_SLL_N(c, 24 - 8 * t), 24) : V_AND(V_SRL_N(c, 8 * t), V_SET1_I(0xff));
    const vflt uf = V_CVT(u);
    return qtype == Q6_K ? V_MUL(ws, V_SUB(uf, V_SET1_F(32.0f))) : V_FMA(ws, uf, wo);
}
#endif

/* A group's blocks [0, nblk) (at blk, CB_BYTES apart) dequantized by column as the
 * canonical form holds them (ws u + wo; Q6_K: ws_h (u - 32), h the half of j), the columns
 * that need[b] (bit j: column 32 b + j) asks for: col[(32 b + j) ldc + r] = w[r][32 b + j],
 * r < GR. */
static void group_columns(const uint8_t *blk, int64_t nblk, int qtype, const uint32_t *need, float *col,
                          int64_t ldc) {
#if defined(G8_512) || defined(QAVX2)
    const int q6 = qtype == Q6_K;
    for (int64_t b = 0; b < nblk; b++, blk += CB_BYTES) {
        const float *fl = (const float *)(blk + CB_CODES);
        const vflt wo = V_LOAD_F(fl + 2 * GR);
        if (__builtin_popcount(need[b]) < 24) { /* sparse: column by column */
            for (uint32_t m = need[b]; m; m &= m - 1) {
                const int j = __builtin_ctz(m), q = j / 4;
                const vflt ws = V_LOAD_F(fl + (q6 && q >= 4) * GR);
                V_STORE_F(col + (QK * b + j) * ldc, quad_column(V_LOAD_I(blk + q * QUAD_BYTES), j % 4, qtype, ws, wo));
            }
            continue;
        }
        for (int q = 0; q < 8; q++) {
            const vint c = V_LOAD_I(blk + q * QUAD_BYTES);
            const vflt ws = V_LOAD_F(fl + (q6 && q >= 4) * GR);
            UNROLL for (int t = 0; t < 4; t++) V_STORE_F(col + (QK * b + 4 * q + t) * ldc, quad_column(c, t, qtype, ws, wo));
        }
    }
#else
    for (int64_t b = 0; b < nblk; b++, blk += CB_BYTES) {
        const float *fl = (const float *)(blk + CB_CODES);
        for (int j = 0; j < QK; j++)
            for (int r = 0; r < GR && (need[b] >> j & 1); r++) {
                const float u = (float)blk[(j / 4) * QUAD_BYTES + 4 * r + j % 4];
                col[(QK * b + j) * ldc + r] = qtype == Q6_K ? fl[(j >= 16) * GR + r] * (u - 32.0f)
                                                            : fl[r] * u + fl[2 * GR + r];
            }
    }
#endif
}

#if defined(G8_512) || defined(QAVX2)
/* yo [rows] += v, rows <= GR (none if rows <= 0) */
static inline void add_rows(float *yo, vflt v, int rows) {
    if (rows >= GR) {
        V_STORE_F(yo, V_ADD(V_LOAD_F(yo), v));
        return;
    }
    float out[GR];
    V_STORE_F(out, v);
    for (int r = 0; r < rows; r++) yo[r] += out[r];
}
#endif

/* One row's n outliers of a slice (positions pos, values val) times OG groups' columns of
 * the slice (col, OG GR floats a column), added to yo [rows] (the row's outputs of those
 * groups, rows <= OG GR). */
static void outliers_into(const float *col, int32_t n, const uint16_t *pos, const float *val, float *yo, int rows) {
#if defined(G8_512) || defined(QAVX2)
    vflt a[OCH][OG];
    UNROLL for (int c = 0; c < OCH; c++) UNROLL for (int k = 0; k < OG; k++) a[c][k] = V_ZERO_F();
    int32_t t = 0;
    for (; t + OCH <= n; t += OCH)
        UNROLL for (int c = 0; c < OCH; c++) {
            const vflt x = V_SET1_F(val[t + c]);
            const float *cl = col + pos[t + c] * (OG * GR);
            UNROLL for (int k = 0; k < OG; k++) a[c][k] = V_FMA(x, V_LOAD_F(cl + k * GR), a[c][k]);
        }
    for (int c = 0; t < n; t++, c++) {
        const vflt x = V_SET1_F(val[t]);
        const float *cl = col + pos[t] * (OG * GR);
        UNROLL for (int k = 0; k < OG; k++) a[c][k] = V_FMA(x, V_LOAD_F(cl + k * GR), a[c][k]);
    }
    UNROLL for (int k = 0; k < OG; k++) {
        vflt sum = a[0][k];
        UNROLL for (int c = 1; c < OCH; c++) sum = V_ADD(sum, a[c][k]);
        add_rows(yo + k * GR, sum, rows - k * GR);
    }
#else
    for (int r = 0; r < rows; r++) {
        float f = 0.0f;
        for (int32_t t = 0; t < n; t++) f += val[t] * col[pos[t] * (OG * GR) + r];
        yo[r] += f;
    }
#endif
}

/* Per thread, for outlier_pass: OG groups' columns of a slice (32 KC_BLOCKS columns of OG
 * GR floats), the columns any row needs (a bit each) and the rows with outliers. */
typedef struct {
    float *col;
    uint32_t *need;
    int32_t *rows;
} olbuf;

static int64_t olbuf_bytes(void) { return (int64_t)QK * KC_BLOCKS * OG * GR * 4 + KC_BLOCKS * 4 + MC8 * 4; }

static olbuf olbuf_at(uint8_t *p) {
    const olbuf o = {(float *)p, (uint32_t *)(p + (int64_t)QK * KC_BLOCKS * OG * GR * 4),
                     (int32_t *)(p + (int64_t)QK * KC_BLOCKS * OG * GR * 4 + KC_BLOCKS * 4)};
    return o;
}

/* The rows of [m0, m1) with outliers in slice s (ob.rows, their count returned) and the
 * slice's columns any of them needs (ob.need). */
static int32_t outlier_rows(uint8_t *base, int64_t ab, int64_t K, int64_t m0, int64_t m1, int64_t s, olbuf ob) {
    int32_t nrows = 0;
    memset(ob.need, 0, KC_BLOCKS * sizeof(uint32_t));
    for (int64_t i = m0; i < m1; i++) {
        const arow a = arow_at(base + i * ab, K);
        if (a.cut[s + 1] == a.cut[s]) continue;
        ob.rows[nrows++] = (int32_t)i;
        uint32_t w = 0;
        int blk = a.pos[a.cut[s]] / QK;
        for (int32_t t = a.cut[s]; t < a.cut[s + 1]; t++) { /* (positions ascend: one block's bits at once) */
            if (a.pos[t] / QK != blk) {
                ob.need[blk] |= w;
                blk = a.pos[t] / QK;
                w = 0;
            }
            w |= 1u << (a.pos[t] % QK);
        }
        ob.need[blk] |= w;
    }
    return nrows;
}

/* The outliers of rows ob.rows [nrows] in slice ks times a chunk's weight rows [c0, c1)
 * (its groups unpacked at buf), added to their outputs y[i][c0 ..]: per OG groups, the
 * slice's columns that any of the rows needs dequantized once, then each row's outliers. */
static void outlier_pass(uint8_t *base, int64_t ab, int64_t K, int32_t nrows, kslice ks, const uint8_t *buf,
                         int64_t gstride, int qtype, olbuf ob, float *y, int64_t ldy, int64_t c0, int64_t c1) {
    const int64_t s = ks.b0 / slice_blocks(K), groups = (c1 - c0 + GR - 1) / GR, nblk = ks.b1 - ks.b0;
    for (int64_t g0 = 0; g0 < groups && nrows; g0 += OG) {
        const int64_t r0 = g0 * GR;
        const int rows = c1 - c0 - r0 < OG * GR ? (int)(c1 - c0 - r0) : OG * GR;
        for (int64_t k = 0; k < OG && g0 + k < groups; k++)
            group_columns(buf + (g0 + k) * gstride, nblk, qtype, ob.need, ob.col + k * GR, OG * GR);
        for (int32_t e = 0; e < nrows; e++) {
            const int64_t i = ob.rows[e];
            const arow a = arow_at(base + i * ab, K);
            const int32_t t0 = a.cut[s], t1 = a.cut[s + 1];
            outliers_into(ob.col, t1 - t0, a.pos + t0, a.val + t0, y + i * ldy + c0 + r0, rows);
        }
    }
}

/* --------------------------------------------------------------------------- gemm8 */


static int64_t chunk_rows(int64_t kc) {
    const int64_t step = GR * NG8, rows = CHUNK_BYTES / (kc * CB_BYTES / GR) / step * step;
    return rows < step ? step : rows > 256 ? 256 : rows;
}

/* Per thread: its unpacked chunk, one row's formed input (K floats) and olbuf. */
static int64_t thread_bytes(int64_t K) {
    const int64_t kc = slice_blocks(K);
    return chunk_rows(kc) / GR * kc * CB_BYTES + K * 4 + olbuf_bytes() + 64;
}

/* Scratch: the quantized rows and each thread's bytes. */
int64_t gemm8_scratch_bytes(int64_t M, int64_t K) {
    return M * a8_bytes(K) + (int64_t)omp_get_max_threads() * thread_bytes(K) + 128;
}

/* y = x w^T (+ bias; accumulate: y +=). Per thread (its output rows), per slice of K
 * (KC_BLOCKS blocks), per chunk of rows unpacked: every activation row, MB8 at a time.
 * The slices are fixed by K alone, so a row's sums do not depend on M. */
void gemm8(const float *x, int64_t M, int64_t ldx, int64_t K, qmat w, float *y, int64_t ldy,
           int accumulate, g8input in, void *scratch) {
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const int64_t nb = K / QK, kc = slice_blocks(K), crows = chunk_rows(kc), ab = a8_bytes(K);
    const int64_t canon = crows / GR * kc * CB_BYTES;
    uint8_t *canon0 = base + M * ab;
#pragma omp parallel
    {
        uint8_t *buf = canon0 + (int64_t)omp_get_thread_num() * thread_bytes(K);
        float *act = (float *)(buf + canon); /* one row's input, unless G8_PLAIN */
        const olbuf ob = olbuf_at((uint8_t *)(act + K));
        const float t = gemm8_outlier_rms(in.kind);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            const float *xi = x + i * ldx;
            if (in.kind == G8_GLU) swiglu(xi, xi + K, K, act);
            else if (in.kind == G8_NORM) rms_norm(xi, in.norm_w, K, in.eps, act);
            quantize8(in.kind == G8_PLAIN ? xi : act, K, t, base + i * ab);
        } /* (its barrier: every row quantized before any product) */
        int64_t off = 0;
        for (int p = 0; p < w.nparts; p++) {
            const int64_t N = w.desc[3 * p];
            const int qtype = (int)w.desc[3 * p + 1];
            const uint8_t *tiles = (const uint8_t *)w.desc[3 * p + 2];
            int64_t n0, n1;
            thread_rows(N, &n0, &n1);
            for (int64_t m0 = 0; m0 < M; m0 += MC8) {
                const int64_t m1 = m0 + MC8 < M ? m0 + MC8 : M;
                for (int64_t b0 = 0; b0 < nb; b0 += kc) {
                    const kslice ks = {b0, b0 + kc < nb ? b0 + kc : nb, nb};
                    const int64_t gstride = (ks.b1 - ks.b0) * CB_BYTES; /* one group's blocks */
                    const int first = b0 == 0;
                    const int32_t nrows = outlier_rows(base, ab, K, m0, m1, b0 / kc, ob);
                    for (int64_t c0 = n0; c0 < n1; c0 += crows) {
                        const int64_t c1 = c0 + crows < n1 ? c0 + crows : n1, groups = (c1 - c0 + GR - 1) / GR;
                        unpack_rows(tiles, qtype, K, N, c0, groups, ks.b0, ks.b1, buf);
                        /* the next chunk's tiles (of this slice, else of the next slice's first
                         * chunk), spread over this chunk's passes */
                        tile_fetch nf = {0};
                        if (c1 < n1)
                            nf = tile_fetch_of(tiles, qtype, K, n1, c1, c1 + crows, ks.b0, ks.b1);
                        else if (ks.b1 < nb)
                            nf = tile_fetch_of(tiles, qtype, K, n1, n0, n0 + crows, ks.b1, ks.b1 + kc < nb ? ks.b1 + kc : nb);
                        const int64_t share = (nf.end / ((m1 - m0 + MB8 - 1) / MB8) + 64) / 64 * 64;
                        for (int64_t i0 = m0; i0 < m1; i0 += MB8) {
                            tile_fetch_some(&nf, share);
                            const int mb = m1 - i0 < MB8 ? (int)(m1 - i0) : MB8;
                            arow rw[MB8];
                            for (int i = 0; i < mb; i++) rw[i] = arow_at(base + (i0 + i) * ab, K);
                            for (int64_t gi = 0; gi < groups;) {
                                const int ng = groups - gi >= NG8 ? NG8 : 1; /* (a chunk's last, odd group alone) */
                                const int64_t g0 = c0 + gi * GR;
                                const int rows = c1 - g0 < ng * GR ? (int)(c1 - g0) : ng * GR;
                                micro_any(buf + gi * gstride, gstride, ng, ks, rw, mb, qtype, y + i0 * ldy + off, ldy,
                                          g0, rows, accumulate || !first);
                                gi += ng;
                            }
                        }
                        /* the panel's outliers in the slice */
                        outlier_pass(base, ab, K, nrows, ks, buf, gstride, qtype, ob, y + off, ldy, c0, c1);
                    }
                }
            }
            if (w.bias) /* last, so that a product with a bias is the product plus the bias */
                for (int64_t i = 0; i < M; i++)
                    for (int64_t n = n0; n < n1; n++) y[i * ldy + off + n] += w.bias[off + n];
            off += N;
        }
    }
}
