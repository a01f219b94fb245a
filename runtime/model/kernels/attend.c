/* Prefill attention on CPU (the torch backend's prompt chunks): causal, grouped-query,
 * optionally within a sliding window, K/V read from the pool (float32, float16 or bfloat16
 * rows, by slot) or from the chunk's own new rows. AVX-512 builds only: elsewhere
 * `attend_supported` is 0 and the backend keeps torch's SDPA.
 *
 * Work items are (KV head, tile of AQ query positions), split over the threads, the
 * longest (last) tiles first. A tile's R = AQ x G query rows (the G heads sharing the KV
 * head) are the vector lanes: its queries are transposed once ([hd][R], scaled), and each
 * block of AK keys is read once (converted from the pool's type) for all R rows. Scores:
 * 4 keys by 64 rows a pass (16 accumulators; each key value broadcast, each query vector
 * loaded once per 4 keys); the online softmax (flash attention's running max and sum, keys
 * outside a row's [first, own position] masked) runs 16 rows a vector, so its exp and
 * masks are vector work too; then P V into the transposed outputs, 4 values by 64 rows a
 * pass. Outputs are divided by the row's sum once at the end.
 */
#include "vec.h"
#include <omp.h>
#include <stdlib.h>

#define AQ 16         /* query positions a work item */
#define AK 64         /* keys a block */
#define MAX_ATT_HD 512

int attend_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
/* Rows of K or V: row r (0 .. S) of KV head g at element (slot(r) * row_stride + g * hd) of
 * base, slot(r) = slots[r] or start + r. */
typedef struct {
    const void *base;
    int64_t row_stride;
    int type; /* KV_F32, KV_F16, KV_BF16 */
    const int64_t *slots;
    int64_t start;
} kvsrc;

/* hd floats of row r, head g, into dst. */
static inline void kv_load(kvsrc s, int64_t r, int64_t g, int64_t hd, float *dst) {
    const int64_t at = (s.slots ? s.slots[r] : s.start + r) * s.row_stride + g * hd;
    if (s.type == KV_F32) {
        memcpy(dst, (const float *)s.base + at, (size_t)hd * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)s.base + at;
    for (int64_t j = 0; j < hd; j += 16) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(h + j));
        const __m512 f = s.type == KV_F16 ? _mm512_cvtph_ps(w)
                                          : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
        _mm512_storeu_ps(dst + j, f);
    }
}

/* One thread's buffers for a work item, query rows as lanes (R = AQ x G rows: row
 * (i - i0) G + h is position i, head g G + h). */
typedef struct {
    float *qt;        /* [hd][R] the tile's queries, scaled, transposed */
    float *k;         /* [AK][hd] the key block (rows past the keys: zeros) */
    float *v;         /* [AK][hd] the value block */
    float *pt;        /* [AK][R] scores, then probabilities */
    float *ot;        /* [hd][R] unnormalized outputs, transposed */
    float *m, *l;     /* [R] running max and sum */
    int32_t *pos, *lo; /* [R] each row's own key (its position) and first key */
} abuf;

/* pt[j][rows] = k[j] . qt[:, rows] for keys [0, AK), rows [r0, r0 + 16 nz): 4 keys by nz
 * vectors of rows a pass. */
static inline __attribute__((always_inline)) void scores_nz(const abuf *b, int64_t R, int64_t hd, int64_t r0,
                                                            const int nz) {
    for (int j = 0; j < AK; j += 4) {
        __m512 acc[4][4];
        for (int jj = 0; jj < 4; jj++)
            for (int c = 0; c < nz; c++) acc[jj][c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d++) {
            __m512 qv[4];
            for (int c = 0; c < nz; c++) qv[c] = _mm512_load_ps(b->qt + d * R + r0 + 16 * c);
            for (int jj = 0; jj < 4; jj++) {
                const __m512 kv = _mm512_set1_ps(b->k[(j + jj) * hd + d]);
                for (int c = 0; c < nz; c++) acc[jj][c] = _mm512_fmadd_ps(kv, qv[c], acc[jj][c]);
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int c = 0; c < nz; c++) _mm512_store_ps(b->pt + (j + jj) * R + r0 + 16 * c, acc[jj][c]);
    }
}

/* ot[d][rows] += sum_j v[j][d] pt[j][rows] for keys [0, nk): 4 values by nz vectors. */
static inline __attribute__((always_inline)) void add_pv_nz(const abuf *b, int64_t R, int64_t hd, int64_t r0,
                                                            int nk, const int nz) {
    for (int64_t d = 0; d < hd; d += 4) {
        __m512 acc[4][4];
        for (int dd = 0; dd < 4; dd++)
            for (int c = 0; c < nz; c++) acc[dd][c] = _mm512_load_ps(b->ot + (d + dd) * R + r0 + 16 * c);
        for (int j = 0; j < nk; j++) {
            __m512 pv[4];
            for (int c = 0; c < nz; c++) pv[c] = _mm512_load_ps(b->pt + j * R + r0 + 16 * c);
            for (int dd = 0; dd < 4; dd++) {
                const __m512 vv = _mm512_set1_ps(b->v[j * hd + d + dd]);
                for (int c = 0; c < nz; c++) acc[dd][c] = _mm512_fmadd_ps(vv, pv[c], acc[dd][c]);
            }
        }
        for (int dd = 0; dd < 4; dd++)
            for (int c = 0; c < nz; c++) _mm512_store_ps(b->ot + (d + dd) * R + r0 + 16 * c, acc[dd][c]);
    }
}

static void scores(const abuf *b, int64_t R, int64_t hd) {
    for (int64_t r0 = 0; r0 < R; r0 += 64) {
        const int64_t left = (R - r0) / 16;
        if (left >= 4) scores_nz(b, R, hd, r0, 4);
        else if (left == 3) scores_nz(b, R, hd, r0, 3);
        else if (left == 2) scores_nz(b, R, hd, r0, 2);
        else scores_nz(b, R, hd, r0, 1);
    }
}

static void add_pv(const abuf *b, int64_t R, int64_t hd, int nk) {
    for (int64_t r0 = 0; r0 < R; r0 += 64) {
        const int64_t left = (R - r0) / 16;
        if (left >= 4) add_pv_nz(b, R, hd, r0, nk, 4);
        else if (left == 3) add_pv_nz(b, R, hd, r0, nk, 3);
        else if (left == 2) add_pv_nz(b, R, hd, r0, nk, 2);
        else add_pv_nz(b, R, hd, r0, nk, 1);
    }
}

/* The online softmax over keys [k0, k0 + nk), 16 rows a vector: scores of keys outside a
 * row's [lo, pos] masked, the running max and sum updated, the probabilities (exact zeros
 * where masked) left in pt, the outputs so far rescaled. */
static void softmax_block(const abuf *b, int64_t R, int64_t hd, int64_t k0, int nk) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
        const __m512i pos = _mm512_load_si512((const void *)(b->pos + r0));
        const __m512i lo = _mm512_load_si512((const void *)(b->lo + r0));
        const __m512 mold = _mm512_load_ps(b->m + r0);
        __m512 mx = mold;
        for (int j = 0; j < nk; j++) {
            const __m512i key = _mm512_set1_epi32((int32_t)(k0 + j));
            const __mmask16 ok = _mm512_cmple_epi32_mask(key, pos) & _mm512_cmpge_epi32_mask(key, lo);
            float *sp = b->pt + j * R + r0;
            const __m512 sv = _mm512_mask_mov_ps(ninf, ok, _mm512_load_ps(sp));
            _mm512_store_ps(sp, sv);
            mx = _mm512_max_ps(mx, sv);
        }
        /* rows with no key yet keep max -inf; their exponents use 0 (all their terms are 0) */
        const __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmpeq_ps_mask(mx, ninf), _mm512_setzero_ps());
        const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(mold, ninf), exp512(_mm512_sub_ps(mold, base)));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nk; j++) {
            float *sp = b->pt + j * R + r0;
            const __m512 sv = _mm512_load_ps(sp);
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(sv, ninf), exp512(_mm512_sub_ps(sv, base)));
            _mm512_store_ps(sp, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_store_ps(b->l + r0, _mm512_fmadd_ps(_mm512_load_ps(b->l + r0), corr, sum));
        _mm512_store_ps(b->m + r0, mx);
        for (int64_t d = 0; d < hd; d++) {
            float *o = b->ot + d * R + r0;
            _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), corr));
        }
    }
}

/* One work item: KV head g, query positions [i0, i1) of the chunk (n of them, after
 * prefix = S - n cached keys), its G query heads. */
static void attend_item(const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd, kvsrc ks, kvsrc vs,
                        int64_t S, int64_t n, int64_t window, float scale, int64_t g, int64_t i0, int64_t i1,
                        float *out, const abuf *b) {
    const int64_t G = nh / nkv, prefix = S - n, R = AQ * G;
    for (int64_t r = 0; r < R; r++) {
        int64_t i = i0 + r / G;
        if (i >= i1) i = i1 - 1; /* a last tile's missing positions: copies of its last (not written) */
        const float *src = q + i * ldq + (g * G + r % G) * hd;
        for (int64_t d = 0; d < hd; d++) b->qt[d * R + r] = src[d] * scale;
        b->pos[r] = (int32_t)(prefix + i);
        b->lo[r] = (int32_t)(window > 0 && prefix + i - window + 1 > 0 ? prefix + i - window + 1 : 0);
        b->m[r] = -INFINITY;
        b->l[r] = 0.0f;
    }
    memset(b->ot, 0, (size_t)(hd * R) * sizeof(float));
    const int64_t klo = b->lo[0], khi = prefix + i1; /* the keys the tile reads: [klo, khi) */
    for (int64_t k0 = klo / AK * AK; k0 < khi; k0 += AK) {
        const int nk = khi - k0 < AK ? (int)(khi - k0) : AK;
        for (int j = 0; j < nk; j++) {
            kv_load(ks, k0 + j, g, hd, b->k + j * hd);
            kv_load(vs, k0 + j, g, hd, b->v + j * hd);
        }
        if (nk < AK) memset(b->k + nk * hd, 0, (size_t)((AK - nk) * hd) * sizeof(float));
        scores(b, R, hd);
        softmax_block(b, R, hd, k0, nk);
        add_pv(b, R, hd, nk);
    }
    for (int64_t r = 0; r < (i1 - i0) * G; r++) {
        const float inv = 1.0f / b->l[r];
        float *dst = out + (i0 + r / G) * nh * hd + (g * G + r % G) * hd;
        for (int64_t d = 0; d < hd; d++) dst[d] = b->ot[d * R + r] * inv;
    }
}
#endif

/* out [n, nh * hd] = attention of q's n rows (row stride ldq; head h at h * hd) over S keys
 * (K and V rows: bases, elements from one slot to the next of each, the pool's type, slots
 * or NULL and the first slot), the last n of them the queries' own: query i sees keys [lo, S - n +
 * i], lo = S - n + i - window + 1 with a window (> 0), else 0; scale multiplies the
 * scores. Returns 0 (nothing done) where unsupported: not AVX-512, hd not a multiple of 16
 * or above MAX_ATT_HD, nh not a multiple of nkv; or when its buffers cannot be allocated. */
int attend_prefill(const float *q, int64_t ldq, int64_t n, int64_t nh, int64_t nkv, int64_t hd, const void *kbase,
                   const void *vbase, int64_t k_stride, int64_t v_stride, int kv_type, const int64_t *slots,
                   int64_t start, int64_t S, int64_t window, float scale, float *out) {
#if defined(__AVX512F__)
    if (hd % 16 || hd > MAX_ATT_HD || nkv <= 0 || nh % nkv || n <= 0 || S < n) return 0;
    const kvsrc ks = {kbase, k_stride, kv_type, slots, start}, vs = {vbase, v_stride, kv_type, slots, start};
    const int64_t G = nh / nkv, tiles = (n + AQ - 1) / AQ, items = nkv * tiles, R = AQ * G;
    /* each thread's buffers, allocated before the threads start (no memory: nothing done) */
    const size_t per = ((size_t)(2 * hd * R + 2 * AK * hd + AK * R + 4 * R) * sizeof(float) + 63) / 64 * 64;
    char *all = (char *)aligned_alloc(64, per * (size_t)omp_get_max_threads());
    if (!all) return 0;
#pragma omp parallel
    {
        float *mem = (float *)(all + per * (size_t)omp_get_thread_num());
        abuf b;
        b.qt = mem;
        b.ot = b.qt + hd * R;
        b.k = b.ot + hd * R;
        b.v = b.k + AK * hd;
        b.pt = b.v + AK * hd;
        b.m = b.pt + AK * R;
        b.l = b.m + R;
        b.pos = (int32_t *)(b.l + R);
        b.lo = b.pos + R;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t t = tiles - 1 - it / nkv, g = it % nkv; /* the longest tiles first */
            const int64_t i0 = t * AQ, i1 = i0 + AQ < n ? i0 + AQ : n;
            attend_item(q, ldq, nh, nkv, hd, ks, vs, S, n, window, scale, g, i0, i1, out, &b);
        }
    }
    free(all);
    return 1;
#else
    (void)q, (void)ldq, (void)n, (void)nh, (void)nkv, (void)hd, (void)kbase, (void)vbase, (void)k_stride, (void)v_stride;
    (void)kv_type, (void)slots, (void)start, (void)S, (void)window, (void)scale, (void)out;
    return 0;
#endif
}
