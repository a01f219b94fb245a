/* The fused decode steps: every layer of a decoder for one (decode_layers) or several
 * (decode_rows) new tokens in one call, over quantized weights (qmatmul.c) and a KV pool
 * of float32, float16 or bfloat16 rows.
 *
 * A decode step is a few hundred small operations; issued one by one from Python each
 * costs more than its arithmetic. Here the whole layer stack runs inside one OpenMP
 * parallel region. The matrix products split their rows across the threads; the small
 * vector work between them (norms, RoPE, SiLU, activation quantization) is repeated by
 * every thread on its own copy for one row (cheaper than making the others wait), shared
 * out by rows for several. A product's rows are claimed, each thread its own share first,
 * then what is left of the others' (`par_product`), so a thread that lost its core does
 * not hold the step up by its whole share. Attention is split by KV head and chunk of
 * positions, so each K/V row is read (and converted to float) once for the query heads
 * sharing it. The threads meet at `team_wait` (spin briefly, then sleep on a futex), not
 * OpenMP's barrier, whose cost follows OMP_WAIT_POLICY.
 *
 * Per layer, `table` holds LAYER_FIELDS int64 values (pointers as integers, 0 = absent):
 *   in_norm, post_norm, then for each of qkv, o, gate_up, down: the matrix's part
 *   descriptor (common.h's qmat: {rows, qtype, tiles} per part), its part count, bias
 * and `kv_ptrs` 2 per layer: that layer's K and V pool ([capacity, nkv, hd] of kv_type).
 * cos / sin: RoPE factors of each row's position ([hd], sin signed for rotate-half), so
 * rope(v)[j] = v[j] cos[j] + v[(j + hd/2) mod hd] sin[j].
 */
#define _GNU_SOURCE /* syscall (futex) and clock_gettime under -std=c11 */
#include "team.h"
#include "vec.h"
#include "moe_step.h"

#define LAYER_FIELDS 16
#define QK_NORM_FIELD 14 /* [nh + nkv, hd] float32 per-head q/k RMS-norm weights, or 0 */
#define MOE_FIELD 15     /* the layer's experts (moe_step.h; moe_check passed at load), or 0: the dense MLP */
#define MAT_FIELDS 3
#define ATT_CHUNK 64      /* positions per attention work item */
#define MAX_GROUP 32      /* query heads per KV head */
#define MAX_HD 512        /* head_dim the attention buffers allow */
#define MAX_ROWS MOE_MAX_ROWS /* rows of one decode_rows call */

/* ------------------------------------------------------------------------------- inputs */

/* A step's inputs for T tokens, in one call instead of a dozen tensor operations a step:
 * x[t] = row ids[t] of the packed embedding (`rows` rows of `hidden`, one type), and the
 * RoPE factors of position pos[t] as rope.py's Rotary.cos_sin makes them (cos / sin [T, hd]:
 * cos, cos | -sin, sin of pos * inv_freq[j] in float32, times scale; long_inv_freq instead
 * from position long_from on, longrope's, or NULL). tiles NULL: the factors only. Returns -1,
 * writing nothing, if an id is outside the embedding. */
int decode_inputs(const uint8_t *tiles, int qtype, int64_t rows, int64_t hidden, const int64_t *ids,
                  const int64_t *pos, int64_t T, const float *inv_freq, const float *long_inv_freq,
                  int64_t long_from, int64_t hd, float scale, float *x, float *cos, float *sin) {
    const int64_t half = hd / 2;
    if (tiles) {
        for (int64_t t = 0; t < T; t++)
            if (ids[t] < 0 || ids[t] >= rows) return -1;
        q_dequant_rows(tiles, qtype, hidden, ids, T, x);
    }
    for (int64_t t = 0; t < T; t++) {
        const float p = (float)pos[t], *f = long_inv_freq && pos[t] >= long_from ? long_inv_freq : inv_freq;
        float *c = cos + t * hd, *s = sin + t * hd;
        for (int64_t j = 0; j < half; j++) {
            const float a = p * f[j], cj = cosf(a) * scale, sj = sinf(a) * scale;
            c[j] = c[j + half] = cj;
            s[j] = -sj;
            s[j + half] = sj;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------ weights */

static qmat mat_at(const int64_t *t, int i) {
    const int64_t *f = t + 2 + i * MAT_FIELDS;
    qmat w = {(const int64_t *)f[0], (int)f[1], (const float *)f[2]};
    return w;
}

/* ------------------------------------------------------------------------ KV pool rows */

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if !defined(__F16C__)
static uint16_t f32_to_fp16(float f) { /* round to nearest even (IEEE), as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000;
    const uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds to >= 65520: inf */
    if (a < 0x38800000) { /* below the smallest normal: a subnormal (or zero) */
        if (a < 0x33000000) return (uint16_t)sign;
        const uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112 << 10));
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}
#endif

/* Store n floats as pool elements of kv_type (n a multiple of 8). */
static void kv_store(void *dst, int kvt, const float *src, int64_t n) {
    if (kvt == KV_F32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (kvt == KV_F16) {
        uint16_t *o = (uint16_t *)dst;
#if defined(__F16C__)
        for (int64_t j = 0; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i *)(o + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#else
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_fp16(src[j]);
#endif
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(src[j]);
    }
}

/* Pool row `row` (element index row * hd) as floats: the row itself (float32 pool) or its
 * conversion into `buf`. */
static inline const float *kv_row(const void *base, int kvt, int64_t row, int64_t hd, float *buf) {
    if (kvt == KV_F32) return (const float *)base + row * hd;
    const uint16_t *h = (const uint16_t *)base + row * hd;
    int64_t j = 0;
#if defined(QAVX2)
    if (kvt == KV_F16) {
        for (; j + 8 <= hd; j += 8) _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    } else {
        for (; j + 8 <= hd; j += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + j)));
            _mm256_storeu_ps(buf + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    }
#endif
    for (; j < hd; j++) buf[j] = kvt == KV_F16 ? fp16_to_f32(h[j]) : bf16_to_f32(h[j]);
    return buf;
}

static inline int64_t kv_elem_bytes(int kvt) { return kvt == KV_F32 ? 4 : 2; }

/* `src` [hd] as the pool would hold it, read back: rounded to kv_type (into `buf`), so
 * the new token attends to its own K/V exactly as later steps will read it. */
static inline const float *kv_rounded(const float *src, int kvt, int64_t hd, float *buf) {
    if (kvt == KV_F32) return src;
    uint16_t tmp[MAX_HD];
    kv_store(tmp, kvt, src, hd);
    return kv_row(tmp, kvt, 0, hd, buf);
}

/* -------------------------------------------------------------------------- attention */


/* out[i] = scale * q . rows[i] for i < n. With AVX2 four rows at a time, their four sums
 * reduced together (a dot product's own horizontal sum cost as much as its FMAs). */
static void scores(const float *q, const float *const *rows, int64_t n, int64_t hd, float scale,
                   float *out) {
    int64_t i = 0;
#if defined(QAVX2)
    if (hd % 8 == 0) {
        const __m128 vs = _mm_set1_ps(scale);
        for (; i + 4 <= n; i += 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < hd; j += 8) {
                const __m256 qv = _mm256_loadu_ps(q + j);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i] + j), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i + 1] + j), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i + 2] + j), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i + 3] + j), a3);
            }
            /* [a0 a1 a2 a3] lane sums: two hadds, then the two 128-bit halves added */
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(out + i, _mm_mul_ps(sum, vs));
        }
    }
#endif
    for (; i < n; i++) out[i] = dot_f32(q, rows[i], hd) * scale;
}

/* Ask for the pool rows of work item (g, c) (see att_item) ahead of it. They are scattered
 * (one slot's row per position, nkv rows apart) and, between steps, evicted by the
 * weights' stream, so each is a DRAM miss the hardware prefetchers do not see coming:
 * waited for one by one they were ~75% of attention's time. Called one item (or, for
 * the first, one matrix product) before the item runs. */
static void prefetch_item(const void *kp, const void *vp, int kvt, const int64_t *slots,
                          int64_t L, int64_t nkv, int64_t hd, int64_t g, int64_t c) {
    const int64_t p0 = c * ATT_CHUNK, p1 = p0 + ATT_CHUNK < L - 1 ? p0 + ATT_CHUNK : L - 1;
    const int64_t row_bytes = hd * kv_elem_bytes(kvt);
    for (int64_t p = p0; p < p1; p++) {
        const char *kr = (const char *)kp + (slots[p] * nkv + g) * row_bytes;
        const char *vr = (const char *)vp + (slots[p] * nkv + g) * row_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64) {
            __builtin_prefetch(kr + o);
            __builtin_prefetch(vr + o);
        }
    }
}

/* One attention work item: KV head g's query heads over positions [c * ATT_CHUNK, ...) of
 * a new token's L (its own K/V, not yet in the pool, from k_new / v_new): for each query
 * head, the chunk's max score, sum of exponentials and unnormalised output, at
 * part(head, chunk) = parts + ((g * group + h) * nchunk + c) * (hd + 2). `buf`: per
 * thread, 2 * ATT_CHUNK * hd floats (K/V rows converted from a 16-bit pool). */
static void att_item(const float *q, const float *k_new, const float *v_new, const void *kp,
                     const void *vp, int kvt, const int64_t *slots, int64_t L, int64_t nh,
                     int64_t nkv, int64_t hd, float scale, int64_t g, int64_t c, float *parts,
                     float *buf) {
    const int64_t group = nh / nkv, nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK, p0 = c * ATT_CHUNK;
    const int64_t p1 = p0 + ATT_CHUNK < L ? p0 + ATT_CHUNK : L, n = p1 - p0;
    float sc[MAX_GROUP][ATT_CHUNK] __attribute__((aligned(32)));
    const float *rk[ATT_CHUNK], *rv[ATT_CHUNK];
    float *kb = buf, *vb = buf + ATT_CHUNK * hd;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t i = p - p0;
        if (p == L - 1) {
            rk[i] = kv_rounded(k_new + g * hd, kvt, hd, kb + i * hd);
            rv[i] = kv_rounded(v_new + g * hd, kvt, hd, vb + i * hd);
        } else {
            const int64_t row = slots[p] * nkv + g;
            rk[i] = kv_row(kp, kvt, row, hd, kb + i * hd);
            rv[i] = kv_row(vp, kvt, row, hd, vb + i * hd);
        }
    }
    for (int64_t h = 0; h < group; h++) scores(q + (g * group + h) * hd, rk, n, hd, scale, sc[h]);
    for (int64_t h = 0; h < group; h++) {
        float *part = parts + ((g * group + h) * nchunk + c) * (hd + 2), *row = sc[h];
        float mx = -INFINITY, den = 0.0f;
        for (int64_t i = 0; i < n; i++) mx = row[i] > mx ? row[i] : mx;
        int64_t i = 0;
#if defined(QAVX2)
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 vden = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(row + i), m8));
            _mm256_store_ps(row + i, e);
            vden = _mm256_add_ps(vden, e);
        }
        den = hsum8f(vden);
#endif
        for (; i < n; i++) {
            row[i] = expf(row[i] - mx);
            den += row[i];
        }
        part[0] = mx;
        part[1] = den;
        float *o = part + 2;
        int64_t j0 = 0;
#if defined(QAVX2)
        for (; j0 + 64 <= hd; j0 += 64) { /* 64 dims of the head's output held in registers */
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
            for (int64_t p = 0; p < n; p++) {
                const __m256 w = _mm256_set1_ps(row[p]);
                for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rv[p] + j0 + 8 * v), acc[v]);
            }
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(o + j0 + 8 * v, acc[v]);
        }
#endif
        for (int64_t j = j0; j < hd; j++) {
            float s = 0.0f;
            for (int64_t p = 0; p < n; p++) s += row[p] * rv[p][j];
            o[j] = s;
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

/* Inside a parallel region: the calling thread's attention work items [i0, i1) of `items`
 * (contiguous, so each prefetches its own next one). */
static void att_span(int64_t items, int64_t *i0, int64_t *i1) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *i0 = items * t / nt;
    *i1 = items * (t + 1) / nt;
}

/* Attention of one new token over its L positions, inside the parallel region: its (KV
 * head, chunk of positions) items split over the threads into `parts`, a barrier, then
 * every thread combines them into its own `out` [nh, hd]. Split even at short contexts:
 * on a 2-core EPYC a 1B-shape step's attention at 130 positions took 1.6 ms computed
 * whole by each thread, 0.9 ms split. The thread's first item was asked for before the
 * QKV product. */
static void decode_attention(const float *q, const float *k_new, const float *v_new,
                             const void *kp, const void *vp, int kvt, const int64_t *slots,
                             int64_t L, int64_t nh, int64_t nkv, int64_t hd, float scale,
                             float *parts, float *buf, float *out, team_bar *bar, int64_t *spin) {
    const int64_t nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK;
    int64_t i0, i1;
    att_span(nkv * nchunk, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        if (it + 1 < i1) prefetch_item(kp, vp, kvt, slots, L, nkv, hd, (it + 1) / nchunk, (it + 1) % nchunk);
        att_item(q, k_new, v_new, kp, vp, kvt, slots, L, nh, nkv, hd, scale, it / nchunk,
                 it % nchunk, parts, buf);
    }
    team_wait(bar, omp_get_num_threads(), spin);
    att_combine(parts, L, nh, hd, out);
}

/* out[i] = rope(head i of v) for n heads; with qkn ([n, hd]), each head RMS-normed first
 * (Qwen3's q/k norms) into buf [hd]. */
static void norm_rope(const float *v, const float *qkn, int64_t n, int64_t hd, float eps, const float *cos,
                      const float *sin, float *buf, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *head = v + i * hd;
        if (qkn) {
            rms_norm(head, qkn + i * hd, hd, eps, buf);
            head = buf;
        }
        rope(head, cos, sin, hd, out + i * hd);
    }
}

static int bad_shapes(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, int kvt) {
    return nkv < 1 || nh % nkv || hidden % QK || inter % QK || (nh * hd) % QK ||
           nh / nkv > MAX_GROUP || hd % 8 || hd > MAX_HD || kvt < KV_F32 || kvt > KV_BF16;
}

/* ------------------------------------------------------------------------------------------
 * decode_layers: one request, one new token (batch 1). x: the residual stream [hidden],
 * updated in place. slots: the request's L pool rows, the new token's last. work: scratch
 * of at least decode_work_floats(...) floats.
 * ---------------------------------------------------------------------------------------- */

static inline int64_t wide_of(int64_t hidden, int64_t inter, int64_t nh, int64_t hd) {
    int64_t w = hidden > inter ? hidden : inter;
    return w > nh * hd ? w : nh * hd;
}

/* Floats of one thread's private area, and of the shared one. */
static int64_t private_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd, int64_t inter) {
    /* h, roped q/k, own attention output, K/V row buffers, the quantized h */
    const int64_t wide = wide_of(hidden, inter, nh, hd);
    return wide + (nh + nkv) * hd + nh * hd + 2 * ATT_CHUNK * hd +
           qact_bytes(wide) / (int64_t)sizeof(float) + 32;
}

static int64_t parts_floats(int64_t nh, int64_t hd, int64_t L) {
    return (L + ATT_CHUNK - 1) / ATT_CHUNK * nh * (hd + 2);
}

static int64_t shared_floats(int64_t nh, int64_t nkv, int64_t hd, int64_t inter, int64_t L) {
    /* qkv, gu, attention partials */
    return (nh + 2 * nkv) * hd + nh * hd + 2 * inter + parts_floats(nh, hd, L) + 16;
}

int64_t decode_work_floats(int64_t hidden, int64_t nh, int64_t nkv, int64_t hd, int64_t inter,
                           int64_t L) {
    return shared_floats(nh, nkv, hd, inter, L) +
           (int64_t)omp_get_max_threads() * private_floats(hidden, nh, nkv, hd, inter);
}

/* head: {final norm weight, LM head part descriptor, its part count} as int64s, or NULL; with it,
 * logits[vocab] = head(rms_norm(x)) in the same parallel region (no second one to start,
 * and the head's rows stream while the threads are warm). */
int decode_layers(float *x, int64_t hidden, int64_t n_layers, const int64_t *table,
                  const int64_t *kv_ptrs, int kvt, int64_t nh, int64_t nkv, int64_t hd,
                  int64_t inter, float eps, const float *cos, const float *sin,
                  const int64_t *slots, int64_t L, float *work, const int64_t *head,
                  float *logits) {
    if (bad_shapes(hidden, nh, nkv, hd, inter, kvt)) return -1;
    const int64_t nqkv = (nh + 2 * nkv) * hd, es = kv_elem_bytes(kvt);
    const float scale = 1.0f / sqrtf((float)hd);
    float *moe_area = work + decode_work_floats(hidden, nh, nkv, hd, inter, L); /* moe_work_floats' */
    float *qkv = work;                /* shared: [nqkv] QKV product (unroped) */
    float *gu = qkv + nqkv + nh * hd; /* [2 * inter] */
    float *parts = gu + 2 * inter;    /* attention partials */
    float *priv0 = work + shared_floats(nh, nkv, hd, inter, L);
    const int64_t priv_n = private_floats(hidden, nh, nkv, hd, inter);
    const int64_t wide = wide_of(hidden, inter, nh, hd), new_slot = slots[L - 1];
    const int64_t nchunk = (L + ATT_CHUNK - 1) / ATT_CHUNK;
    team tm;
    team_init(&tm);

#pragma omp parallel
    {
        float *h = priv0 + (int64_t)omp_get_thread_num() * priv_n; /* [wide] */
        float *qk = h + wide;                                      /* [(nh + nkv) * hd] roped */
        float *att = qk + (nh + nkv) * hd;                         /* [nh * hd] attention out */
        float *kvbuf = att + nh * hd;
        qact a = qact_at(kvbuf + 2 * ATT_CHUNK * hd, wide);
        member me = {BAR_SPIN_NS, 0};
        int64_t first, last;
        att_span(nkv * nchunk, &first, &last);
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *t = table + l * LAYER_FIELDS;
            char *kp = (char *)kv_ptrs[2 * l], *vp = (char *)kv_ptrs[2 * l + 1];
            rms_norm(x, (const float *)t[0], hidden, eps, h);
            quantize_act(h, hidden, &a);
            if (first < last) /* this thread's first attention rows */
                prefetch_item(kp, vp, kvt, slots, L, nkv, hd, first / nchunk, first % nchunk);
            par_product(&a, 1, hidden, mat_at(t, 0), qkv, 0, 0, &tm, &me);
            norm_rope(qkv, (const float *)t[QK_NORM_FIELD], nh + nkv, hd, eps, cos, sin, kvbuf, qk);
            const float *k_new = qk + nh * hd, *v_new = qkv + (nh + nkv) * hd;
            decode_attention(qk, k_new, v_new, kp, vp, kvt, slots, L, nh, nkv, hd, scale, parts,
                             kvbuf, att, &tm.bar, &me.spin);
#pragma omp single nowait
            { /* nobody reads the new slot from the pool in this step */
                kv_store(kp + new_slot * nkv * hd * es, kvt, k_new, nkv * hd);
                kv_store(vp + new_slot * nkv * hd * es, kvt, v_new, nkv * hd);
            }
            quantize_act(att, nh * hd, &a);
            par_product(&a, 1, nh * hd, mat_at(t, 1), x, 0, 1, &tm, &me);
            rms_norm(x, (const float *)t[1], hidden, eps, h);
            quantize_act(h, hidden, &a);
            if (t[MOE_FIELD]) {
                moe_step((const int64_t *)t[MOE_FIELD], 1, h, 0, &a, hidden, x, moe_area, &tm, &me);
                continue;
            }
            par_product(&a, 1, hidden, mat_at(t, 2), gu, 0, 0, &tm, &me);
            swiglu(gu, gu + inter, inter, h);
            quantize_act(h, inter, &a);
            par_product(&a, 1, inter, mat_at(t, 3), x, 0, 1, &tm, &me);
        }
        if (head) {
            const qmat w = {(const int64_t *)head[1], (int)head[2], NULL};
            rms_norm(x, (const float *)head[0], hidden, eps, h);
            quantize_act(h, hidden, &a);
            par_product(&a, 1, hidden, w, logits, 0, 0, &tm, &me);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * decode_rows: B >= 2 requests with one new token each, all layers in one call. As
 * decode_layers, with the rows' small work shared out by rows, the products taking all rows
 * per pass over the weights, and attention split into (row, KV head, chunk of positions)
 * items. x: [B, hidden], updated in place; cos /
 * sin: [B, hd]; the rows' pool slots: kv_indices[kv_indptr[b] : kv_indptr[b + 1]], the
 * new token's last. work: at least decode_rows_work_floats(...) floats.
 * ---------------------------------------------------------------------------------------- */

static int64_t rows_items(int64_t B, const int64_t *kv_indptr, int64_t nkv) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) n += nkv * ((kv_indptr[b + 1] - kv_indptr[b] + ATT_CHUNK - 1) / ATT_CHUNK);
    return n;
}

static int64_t rows_private_floats(int64_t hd) {
    return 2 * ATT_CHUNK * hd + 32;
}

int64_t decode_rows_work_floats(int64_t B, int64_t hidden, int64_t nh, int64_t nkv, int64_t hd,
                                int64_t inter, const int64_t *kv_indptr) {
    const int64_t wide = wide_of(hidden, inter, nh, hd), items = rows_items(B, kv_indptr, nkv);
    return B * ((nh + 2 * nkv) * hd + (nh + nkv) * hd + nh * hd + 2 * inter + wide +
                qact_bytes(wide) / (int64_t)sizeof(float) + 16) +
           items / nkv * nh * (hd + 2) + 2 * items + 2 * B + 64 +
           (int64_t)omp_get_max_threads() * rows_private_floats(hd);
}

int decode_rows(float *x, int64_t B, int64_t hidden, int64_t n_layers, const int64_t *table,
                const int64_t *kv_ptrs, int kvt, int64_t nh, int64_t nkv, int64_t hd,
                int64_t inter, float eps, const float *cos, const float *sin,
                const int64_t *kv_indices, const int64_t *kv_indptr, float *work) {
    if (bad_shapes(hidden, nh, nkv, hd, inter, kvt) || B < 1 || B > MAX_ROWS) return -1;
    float *moe_area = work + decode_rows_work_floats(B, hidden, nh, nkv, hd, inter, kv_indptr); /* moe_work_floats' */
    const int64_t nqkv = (nh + 2 * nkv) * hd, nqk = (nh + nkv) * hd, es = kv_elem_bytes(kvt);
    const int64_t wide = wide_of(hidden, inter, nh, hd);
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t items = rows_items(B, kv_indptr, nkv);
    float *qkv = work;             /* [B, nqkv] */
    float *qk = qkv + B * nqkv;    /* [B, nqk] roped q and k */
    float *att = qk + B * nqk;     /* [B, nh * hd] */
    float *gu = att + B * nh * hd; /* [B, 2 * inter] */
    float *h = gu + B * 2 * inter; /* [B, wide] */
    char *act0 = (char *)(h + B * wide);
    float *parts = (float *)(act0 + B * qact_bytes(wide) + 64);
    int32_t *item_row = (int32_t *)(parts + items / nkv * nh * (hd + 2));
    int32_t *item_c = item_row + items;
    int64_t *parts_at = (int64_t *)(((uintptr_t)(item_c + items) + 7) & ~(uintptr_t)7);
    float *priv0 = (float *)(((uintptr_t)(parts_at + B) + 63) & ~(uintptr_t)63);
    qact acts[MAX_ROWS];
    for (int64_t b = 0, it = 0, off = 0; b < B; b++) {
        acts[b] = qact_at(act0 + b * qact_bytes(wide), wide);
        const int64_t nc = (kv_indptr[b + 1] - kv_indptr[b] + ATT_CHUNK - 1) / ATT_CHUNK;
        parts_at[b] = off;
        off += nc * nh * (hd + 2);
        for (int64_t g = 0; g < nkv; g++)
            for (int64_t c = 0; c < nc; c++, it++) {
                item_row[it] = (int32_t)b;
                item_c[it] = (int32_t)(g * nc + c);
            }
    }

    team tm;
    team_init(&tm);

#pragma omp parallel
    {
        member me = {BAR_SPIN_NS, 0};
        const int nt = omp_get_num_threads();
        float *kvbuf = priv0 + (int64_t)omp_get_thread_num() * rows_private_floats(hd);
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t *t = table + l * LAYER_FIELDS;
            char *kp = (char *)kv_ptrs[2 * l], *vp = (char *)kv_ptrs[2 * l + 1];
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                rms_norm(x + b * hidden, (const float *)t[0], hidden, eps, h + b * wide);
                quantize_act(h + b * wide, hidden, &acts[b]);
            }
            team_wait(&tm.bar, nt, &me.spin);
            par_product(acts, B, hidden, mat_at(t, 0), qkv, nqkv, 0, &tm, &me);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++)
                norm_rope(qkv + b * nqkv, (const float *)t[QK_NORM_FIELD], nh + nkv, hd, eps, cos + b * hd,
                          sin + b * hd, kvbuf, qk + b * nqk);
            team_wait(&tm.bar, nt, &me.spin);
            /* attention items: (row, KV head, chunk); K/V of the new token from the row's copy */
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < items; it++) {
                const int64_t b = item_row[it], L = kv_indptr[b + 1] - kv_indptr[b];
                const int64_t nc = (L + ATT_CHUNK - 1) / ATT_CHUNK;
                if (it + 1 < items) { /* the next item's rows (often this thread's next) */
                    const int64_t b1 = item_row[it + 1], L1 = kv_indptr[b1 + 1] - kv_indptr[b1];
                    const int64_t nc1 = (L1 + ATT_CHUNK - 1) / ATT_CHUNK;
                    prefetch_item(kp, vp, kvt, kv_indices + kv_indptr[b1], L1, nkv, hd,
                                  item_c[it + 1] / nc1, item_c[it + 1] % nc1);
                }
                const float *q = qk + b * nqk;
                att_item(q, q + nh * hd, qkv + b * nqkv + nqk, kp, vp, kvt, kv_indices + kv_indptr[b],
                         L, nh, nkv, hd, scale, item_c[it] / nc, item_c[it] % nc, parts + parts_at[b],
                         kvbuf);
            }
            team_wait(&tm.bar, nt, &me.spin);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) { /* per row: combine, new K/V into the pool, quantize */
                const int64_t slot = kv_indices[kv_indptr[b + 1] - 1];
                att_combine(parts + parts_at[b], kv_indptr[b + 1] - kv_indptr[b], nh, hd, att + b * nh * hd);
                kv_store(kp + slot * nkv * hd * es, kvt, qk + b * nqk + nh * hd, nkv * hd);
                kv_store(vp + slot * nkv * hd * es, kvt, qkv + b * nqkv + nqk, nkv * hd);
                quantize_act(att + b * nh * hd, nh * hd, &acts[b]);
            }
            team_wait(&tm.bar, nt, &me.spin);
            par_product(acts, B, nh * hd, mat_at(t, 1), x, hidden, 1, &tm, &me);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                rms_norm(x + b * hidden, (const float *)t[1], hidden, eps, h + b * wide);
                quantize_act(h + b * wide, hidden, &acts[b]);
            }
            team_wait(&tm.bar, nt, &me.spin);
            if (t[MOE_FIELD]) {
                moe_step((const int64_t *)t[MOE_FIELD], B, h, wide, acts, hidden, x, moe_area, &tm, &me);
                continue;
            }
            par_product(acts, B, hidden, mat_at(t, 2), gu, 2 * inter, 0, &tm, &me);
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < B; b++) {
                const float *gb = gu + b * 2 * inter;
                float *hb = h + b * wide;
                swiglu(gb, gb + inter, inter, hb);
                quantize_act(hb, inter, &acts[b]);
            }
            team_wait(&tm.bar, nt, &me.spin);
            par_product(acts, B, inter, mat_at(t, 3), x, hidden, 1, &tm, &me);
        }
    }
    return 0;
}
