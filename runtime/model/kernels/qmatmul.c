/* Weight-only quantized matrix products on CPU, on GGML's block formats as stored in GGUF.
 *
 * A weight matrix [N, K] is N rows of K/32 blocks; each block holds 32 weights:
 *   Q8_0 (34 bytes): fp16 d, int8 q[32]             w = d * q
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles    w = d * (q - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes       w = d * q + m
 * (nibbles: byte j holds weight j in its low half and weight j + 16 in its high half).
 *
 * Activations stay float32: every block is widened to floats in registers and multiplied
 * with FMAs, so the only error is the weights' own quantization. Batch-1 decode is bound by
 * reading the weights; a row is read once for all M activation rows, and output rows are
 * split across the OpenMP threads (the runtime torch itself uses, so torch.set_num_threads
 * governs both).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 };
#define QK 32
#define MAX_M 8 /* activation rows per pass over the weights */

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
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
}

int64_t block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    default: return 0;
    }
}

/* The 32 weights of one block as floats. */
static inline void dequant_block(const uint8_t *b, int qtype, float *out) {
    uint16_t h0, h1;
    memcpy(&h0, b, 2);
    float d = fp16_to_f32(h0);
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) out[j] = d * q[j];
    } else if (qtype == Q4_0) {
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((q[j] & 0xf) - 8);
            out[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    } else {
        memcpy(&h1, b + 2, 2);
        float m = fp16_to_f32(h1);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(q[j] & 0xf) + m;
            out[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}

#if defined(__AVX512F__)
/* One block as two vectors of 16 floats (weights 0..15 and 16..31). */
static inline void block_vec(const uint8_t *b, int qtype, __m512 *lo, __m512 *hi) {
    uint16_t h0, h1;
    memcpy(&h0, b, 2);
    __m512 d = _mm512_set1_ps(fp16_to_f32(h0));
    if (qtype == Q8_0) {
        __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(a));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(c));
        return;
    }
    const uint8_t *q = b + (qtype == Q4_1 ? 4 : 2);
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    __m512i nib = _mm512_set1_epi32(0xf);
    __m512 a = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nib));
    __m512 c = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    __m512 m;
    if (qtype == Q4_1) {
        memcpy(&h1, b + 2, 2);
        m = _mm512_set1_ps(fp16_to_f32(h1));
    } else {
        m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    }
    *lo = _mm512_fmadd_ps(d, a, m);
    *hi = _mm512_fmadd_ps(d, c, m);
}
#endif

/* y[m, n] for rows n in [n0, n1) and M <= MAX_M activation rows. */
static void rows_product(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                         int qtype, int64_t n0, int64_t n1, float *y, int64_t ldy,
                         const float *bias, int accumulate) {
    const int64_t nb = K / QK, bb = block_bytes(qtype), row_bytes = nb * bb;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        float sum[MAX_M];
#if defined(__AVX512F__)
        __m512 acc[MAX_M];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m512 lo, hi;
            block_vec(row + b * bb, qtype, &lo, &hi);
            for (int64_t m = 0; m < M; m++) {
                const float *xb = x + m * ldx + b * QK;
                acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m]);
                acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[m]);
            }
        }
        for (int64_t m = 0; m < M; m++) sum[m] = _mm512_reduce_add_ps(acc[m]);
#else
        float wb[QK];
        for (int64_t m = 0; m < M; m++) sum[m] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            dequant_block(row + b * bb, qtype, wb);
            for (int64_t m = 0; m < M; m++) {
                const float *xb = x + m * ldx + b * QK;
                float s = 0.0f;
                for (int j = 0; j < QK; j++) s += wb[j] * xb[j];
                sum[m] += s;
            }
        }
#endif
        for (int64_t m = 0; m < M; m++) {
            float v = sum[m] + (bias ? bias[n] : 0.0f);
            float *out = y + m * ldy + n;
            *out = accumulate ? *out + v : v;
        }
    }
}


#if defined(__AVX512F__)
/* M = 1 (batch-1 decode): the block scale is applied once per block to the partial dot
 * product, and Q4_1's offset via the block sums of x (sx), which the caller computes. */
static void row_dot1(const float *x, const float *sx, int64_t K, const uint8_t *w, int qtype,
                     int64_t n0, int64_t n1, float *y, const float *bias, int accumulate) {
    const int64_t nb = K / QK, bb = block_bytes(qtype), row_bytes = nb * bb;
    const __m512i nib = _mm512_set1_epi32(0xf);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        float moff = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            const float *xb = x + b * QK;
            uint16_t h0;
            memcpy(&h0, blk, 2);
            __m512 d = _mm512_set1_ps(fp16_to_f32(h0));
            __m512 a, c;
            if (qtype == Q8_0) {
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
                c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
            } else {
                const uint8_t *q = blk + (qtype == Q4_1 ? 4 : 2);
                __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                a = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nib));
                c = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
                if (qtype == Q4_0) {
                    a = _mm512_sub_ps(a, eight);
                    c = _mm512_sub_ps(c, eight);
                } else {
                    uint16_t h1;
                    memcpy(&h1, blk + 2, 2);
                    moff += fp16_to_f32(h1) * sx[b];
                }
            }
            __m512 p = _mm512_mul_ps(a, _mm512_loadu_ps(xb));
            p = _mm512_fmadd_ps(c, _mm512_loadu_ps(xb + 16), p);
            if (b & 1) acc1 = _mm512_fmadd_ps(d, p, acc1);
            else acc0 = _mm512_fmadd_ps(d, p, acc0);
        }
        float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + moff + (bias ? bias[n] : 0.0f);
        y[n] = accumulate ? y[n] + v : v;
    }
}
#endif

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T (+ bias[N]);
 * with accumulate, added to y instead (a residual add folded in). */
void q_matmul(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int qtype,
              int64_t N, float *y, int64_t ldy, const float *bias, int accumulate) {
    /* Chunks of 16 output rows keep each thread's writes off its neighbours' cache lines. */
    const int64_t chunks = (N + 15) / 16;
#if defined(__AVX512F__)
    if (M == 1) {
        float sx[K / QK];
        for (int64_t b = 0; b < K / QK; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[b * QK + j];
            sx[b] = s;
        }
#pragma omp parallel for schedule(static) if (N * K >= 65536)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
            row_dot1(x, sx, K, w, qtype, n0, n1, y, bias, accumulate);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (N * K >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            int64_t mm = M - m0 < MAX_M ? M - m0 : MAX_M;
            rows_product(x + m0 * ldx, mm, ldx, K, w, qtype, n0, n1, y + m0 * ldy, ldy, bias,
                         accumulate);
        }
    }
}

/* out[r, K] = the float32 weights of rows rows[r] (an embedding lookup, or all rows). */
void q_dequant_rows(const uint8_t *w, int qtype, int64_t K, const int64_t *rows, int64_t R,
                    float *out) {
    const int64_t nb = K / QK, bb = block_bytes(qtype), row_bytes = nb * bb;
#pragma omp parallel for schedule(static) if (R * K >= 262144)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = w + (rows ? rows[r] : r) * row_bytes;
        for (int64_t b = 0; b < nb; b++) dequant_block(row + b * bb, qtype, out + r * K + b * QK);
    }
}

/* ------------------------------------------------------------------------------------------
 * One decode step of one request through all layers (batch 1), in one call.
 *
 * A batch-1 step is a few hundred small operations; issued one by one from Python each
 * costs more than its arithmetic. Here the whole layer stack runs inside one OpenMP
 * parallel region. The matrix products split their rows across the threads; the small
 * vector work between them (norms, RoPE, SiLU, block sums) is repeated by every thread
 * on its own copy, which costs less than making the others wait for one thread: a layer
 * has 5 barriers (after each product whose whole output the next step reads, and after
 * attention). That matters most on a busy machine, where a barrier waits for a thread
 * that lost its core: there OMP_WAIT_POLICY=passive (sleep, not spin, at barriers) made
 * 2-thread steps ~4x faster than OpenMP's default spinning.
 *
 * Per layer, `table` holds 14 int64 values (pointers as integers, 0 = absent):
 *   in_norm, w_qkv, qkv_type, b_qkv, w_o, o_type, b_o, post_norm, w_gu, gu_type, b_gu,
 *   w_down, down_type, b_down
 * and `kv_ptrs` 2 per layer: that layer's K and V pool ([capacity, nkv, hd] float32).
 * x: the residual stream [hidden], updated in place. cos / sin: RoPE factors of this
 * position ([hd], sin signed for rotate-half), so rope(v)[j] = v[j] cos[j] +
 * v[(j + hd/2) mod hd] sin[j]. slots: the request's L pool rows, the new token's last.
 * work: scratch of at least decode_work_floats(...) floats.
 * ---------------------------------------------------------------------------------------- */
#define LAYER_FIELDS 14

/* Floats of one thread's private area, and of the shared one (see decode_layers). */
static int64_t private_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd,
                              int64_t inter) {
    int64_t wide = hidden > inter ? hidden : inter;
    return wide + (nh + nkv) * hd + wide / QK + 16; /* h, roped q/k, block sums */
}

static int64_t shared_floats(int64_t nh, int64_t nkv, int64_t hd, int64_t inter, int64_t L) {
    return (nh + 2 * nkv) * hd + nh * hd + 2 * inter + nh * L + 16; /* qkv, att, gu, scores */
}

int64_t decode_work_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                           int64_t L) {
    return shared_floats(nh, nkv, hd, inter, L) +
           (int64_t)omp_get_max_threads() * private_floats(hidden, nh, nkv, hd, inter);
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void block_sums(const float *x, int64_t K, float *sx) {
    for (int64_t b = 0; b < K / QK; b++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += x[b * QK + j];
        sx[b] = s;
    }
}

/* Rows [n0, n1) of y = W x (+ bias), W [N, K] in blocks; y accumulated when asked. */
static void gemv_rows(const float *x, const float *sx, int64_t K, const uint8_t *w, int qtype,
                      int64_t n0, int64_t n1, float *y, const float *bias, int accumulate) {
#if defined(__AVX512F__)
    row_dot1(x, sx, K, w, qtype, n0, n1, y, bias, accumulate);
#else
    (void)sx;
    rows_product(x, 1, K, K, w, qtype, n0, n1, y, K, bias, accumulate);
#endif
}

/* Inside a parallel region: the threads share the rows of one product (16-row chunks),
 * then wait for each other (the omp for's barrier). */
static void par_gemv(const float *x, const float *sx, int64_t K, const uint8_t *w, int qtype,
                     int64_t N, float *y, const float *bias, int accumulate) {
    const int64_t chunks = (N + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * 16, n1 = n0 + 16 < N ? n0 + 16 : N;
        gemv_rows(x, sx, K, w, qtype, n0, n1, y, bias, accumulate);
    }
}

static void rope(const float *v, const float *cos, const float *sin, int64_t hd, float *out) {
    int64_t half = hd / 2;
    for (int64_t j = 0; j < hd; j++) out[j] = v[j] * cos[j] + v[(j + half) % hd] * sin[j];
}

int decode_layers(float *x, int64_t hidden, int64_t n_layers, const int64_t *table,
                  const int64_t *kv_ptrs, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                  float eps, const float *cos, const float *sin, const int64_t *slots, int64_t L,
                  float *work) {
    if (nh % nkv || hidden % QK || inter % QK || (nh * hd) % QK) return -1;
    const int64_t nqkv = (nh + 2 * nkv) * hd, group = nh / nkv;
    const float scale = 1.0f / sqrtf((float)hd);
    float *qkv = work;              /* shared: [nqkv] QKV product (unroped) */
    float *att = qkv + nqkv;        /* [nh * hd] attention output */
    float *gu = att + nh * hd;      /* [2 * inter] */
    float *scores = gu + 2 * inter; /* [nh * L] */
    float *priv0 = work + shared_floats(nh, nkv, hd, inter, L);
    const int64_t priv_n = private_floats(hidden, nh, nkv, hd, inter);
    const int64_t wide = hidden > inter ? hidden : inter, new_slot = slots[L - 1];

#pragma omp parallel
    {
        float *h = priv0 + (int64_t)omp_get_thread_num() * priv_n; /* [wide] */
        float *qk = h + wide;                                      /* [(nh + nkv) * hd] roped */
        float *sx = qk + (nh + nkv) * hd;                          /* [wide / 32] */
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *t = table + l * LAYER_FIELDS;
            float *kp = (float *)kv_ptrs[2 * l], *vp = (float *)kv_ptrs[2 * l + 1];
            rms_norm(x, (const float *)t[0], hidden, eps, h);
            block_sums(h, hidden, sx);
            par_gemv(h, sx, hidden, (const uint8_t *)t[1], (int)t[2], nqkv, qkv,
                     (const float *)t[3], 0); /* barrier 1 */
            for (int64_t i = 0; i < nh + nkv; i++) rope(qkv + i * hd, cos, sin, hd, qk + i * hd);
            const float *k_new = qk + nh * hd, *v_new = qkv + (nh + nkv) * hd;
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < nh; i++) {
                const float *q = qk + i * hd;
                const int64_t g = i / group;
                float *s = scores + i * L, mx = -INFINITY, den = 0.0f;
                for (int64_t p = 0; p < L; p++) { /* the new token's K from the local copy */
                    const float *k = p == L - 1 ? k_new + g * hd : kp + (slots[p] * nkv + g) * hd;
                    float d = 0.0f;
                    for (int64_t j = 0; j < hd; j++) d += q[j] * k[j];
                    s[p] = d * scale;
                    mx = s[p] > mx ? s[p] : mx;
                }
                for (int64_t p = 0; p < L; p++) {
                    s[p] = expf(s[p] - mx);
                    den += s[p];
                }
                float *o = att + i * hd;
                for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
                for (int64_t p = 0; p < L; p++) {
                    const float *v = p == L - 1 ? v_new + g * hd : vp + (slots[p] * nkv + g) * hd;
                    const float a = s[p] / den;
                    for (int64_t j = 0; j < hd; j++) o[j] += a * v[j];
                }
            }
#pragma omp single nowait
            { /* nobody reads the new slot from the pool in this step */
                memcpy(kp + new_slot * nkv * hd, k_new, nkv * hd * sizeof(float));
                memcpy(vp + new_slot * nkv * hd, v_new, nkv * hd * sizeof(float));
            }
#pragma omp barrier
            /* barrier 2: att complete */
            block_sums(att, nh * hd, sx);
            par_gemv(att, sx, nh * hd, (const uint8_t *)t[4], (int)t[5], hidden, x,
                     (const float *)t[6], 1); /* barrier 3: x complete */
            rms_norm(x, (const float *)t[7], hidden, eps, h);
            block_sums(h, hidden, sx);
            par_gemv(h, sx, hidden, (const uint8_t *)t[8], (int)t[9], 2 * inter, gu,
                     (const float *)t[10], 0); /* barrier 4 */
            for (int64_t i = 0; i < inter; i++) {
                float g = gu[i];
                h[i] = g / (1.0f + expf(-g)) * gu[inter + i];
            }
            block_sums(h, inter, sx);
            par_gemv(h, sx, inter, (const uint8_t *)t[11], (int)t[12], hidden, x,
                     (const float *)t[13], 1); /* barrier 5: x complete */
        }
    }
    return 0;
}
