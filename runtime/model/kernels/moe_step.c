/* The decode step of a mixture-of-experts MLP (moe_step.h) over B rows, inside a fused
 * decode step's parallel region: the router, each row's choice of experts, the chosen
 * experts' gate+up products, their down projections added into the residual.
 *
 * Only the chosen experts' weights are read, each once a step: the (row, expert) pairs are
 * grouped by expert (a counting sort) and an expert multiplies all of its rows per pass
 * over its weights; the experts' gate+up products are one sequence of claims. The down
 * projections share the residual's columns out: a claim covers some columns of every row
 * for all chosen experts (an expert with one row adds straight into x; one with several
 * writes its rows to `ys`, added in order), so no two threads add to one value, no
 * partial sums need adding up afterwards, and the bits do not depend on the thread count.
 * As moe.py's per-op step, the routing weight scales an expert's activations before its
 * down projection (the same sum: the projection is linear). A shared expert (Qwen2-MoE)
 * is one more product of every row in each phase, scaled by the sigmoid of its gate.
 */
#define _GNU_SOURCE /* syscall (futex) and clock_gettime under -std=c11 */
#include "moe_step.h"
#include "vec.h"

#ifndef CHOOSE_ALONE
/* Router logits up to which one thread makes every row's choice (a barrier fewer: one
 * row of 128 experts takes ~1 us); above, the rows are shared out first. A build with
 * -DCHOOSE_ALONE=0 shares them out always (the tests' tiny models). */
#define CHOOSE_ALONE 4096
#endif

static const int64_t *expert_at(const int64_t *moe, int64_t e) { return moe + MOE_EXPERTS + e * MOE_EXPERT_FIELDS; }

/* The shared scratch, carved from `area` in 64-byte aligned pieces. */
typedef struct {
    float *logits;     /* [B, E] */
    float *weights;    /* [B, k] the chosen experts' routing weights */
    int32_t *chosen;   /* [B, k] */
    int32_t *order;    /* [B k] pair ids (b k + j) grouped by expert */
    int32_t *starts;   /* [E + 1] each expert's first place in `order` */
    int32_t *fill;     /* [E + 1] the counting sort's next places */
    int64_t *plan;     /* {products, their claims} */
    product_job *jobs; /* [E] the gate+up products, one per expert with rows */
    qact *rows_in;     /* [B k] the pairs' quantized rows, grouped (gate+up inputs) */
    float *gu;         /* [B k, 2 inter] gate+up outputs, grouped; then the activations */
    char *down_in;     /* [B k] quantized activations (qact_bytes(inter) + 64 bytes each) */
    float *ys;         /* [B k, hidden] outputs of experts with several rows */
    float *sgate;      /* [B] the shared expert's gate logits */
    float *sgu;        /* [B, 2 shared_inter] its gate+up outputs; then its activations */
    char *sdown_in;    /* [B] its quantized activations */
    float *sys;        /* [B, hidden] its down outputs (B > 1) */
    char *end;
} moe_area;

static char *carve(char **p, int64_t bytes) {
    char *at = (char *)(((uintptr_t)*p + 63) & ~(uintptr_t)63);
    *p = at + bytes;
    return at;
}

static moe_area layout(void *base, int64_t B, int64_t E, int64_t k, int64_t inter, int64_t sinter,
                       int64_t hidden) {
    char *p = (char *)base;
    moe_area a;
    const int64_t P = B * k;
    a.logits = (float *)carve(&p, B * E * 4);
    a.weights = (float *)carve(&p, P * 4);
    a.chosen = (int32_t *)carve(&p, P * 4);
    a.order = (int32_t *)carve(&p, P * 4);
    a.starts = (int32_t *)carve(&p, (E + 1) * 4);
    a.fill = (int32_t *)carve(&p, (E + 1) * 4);
    a.plan = (int64_t *)carve(&p, 2 * 8);
    a.jobs = (product_job *)carve(&p, (E + 1) * (int64_t)sizeof(product_job));
    a.rows_in = (qact *)carve(&p, P * (int64_t)sizeof(qact));
    a.gu = (float *)carve(&p, P * 2 * inter * 4);
    a.down_in = carve(&p, P * (qact_bytes(inter) + 64));
    a.ys = (float *)carve(&p, P * hidden * 4);
    a.sgate = (float *)carve(&p, B * 4);
    a.sgu = (float *)carve(&p, B * 2 * sinter * 4);
    a.sdown_in = carve(&p, sinter ? B * (qact_bytes(sinter) + 64) : 0);
    a.sys = (float *)carve(&p, sinter ? B * hidden * 4 : 0);
    a.end = p;
    return a;
}

int64_t moe_work_floats(int64_t B, int64_t E, int64_t k, int64_t inter, int64_t shared_inter, int64_t hidden) {
    const moe_area a = layout(NULL, B, E, k, inter, shared_inter, hidden);
    return (int64_t)(uintptr_t)a.end / 4 + 16; /* + 16: the area itself may start unaligned */
}

/* An MLP's {gate+up descriptor, parts, down descriptor, parts}: gate+up of 2 inter rows in
 * at most MAX_PARTS parts, down of `hidden` rows in one. */
static int mlp_ok(const int64_t *m, int64_t inter, int64_t hidden) {
    const int64_t *gu = (const int64_t *)m[0], *down = (const int64_t *)m[2];
    if (!gu || !down || m[1] < 1 || m[1] > MAX_PARTS || m[3] != 1 || down[0] != hidden) return 0;
    int64_t rows = 0;
    for (int64_t p = 0; p < m[1]; p++) rows += gu[3 * p];
    return rows == 2 * inter;
}

int moe_check(const int64_t *moe, int64_t hidden) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K], inter = moe[MOE_INTER];
    if (E < 1 || E > MOE_MAX_E || k < 1 || k > MOE_MAX_K || k > E || inter < QK || inter % QK) return -1;
    if (moe[MOE_ROUTING] != ROUTE_SOFTMAX_TOPK && moe[MOE_ROUTING] != ROUTE_TOPK_SOFTMAX) return -1;
    const int64_t sinter = moe[MOE_SHARED_INTER];
    if (sinter && (sinter % QK || !moe[MOE_SHARED_GATE] ||
                   !mlp_ok(moe + MOE_SHARED_GU, sinter, hidden))) return -1;
    for (int64_t e = 0; e < E; e++) {
        if (!mlp_ok(expert_at(moe, e), inter, hidden)) return -1;
    }
    return 0;
}

/* One row's k chosen experts (largest logit first, the lower index on ties) and their
 * routing weights, from its router logits[E]. */
static void choose(const int64_t *moe, const float *logits, int32_t *chosen, float *weights) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K];
    for (int64_t j = 0; j < k; j++) { /* k passes: k is small (2 to 8) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = (int32_t)best;
    }
    const float top = logits[chosen[0]];
    float sum = 0.0f;
    if (moe[MOE_ROUTING] == ROUTE_TOPK_SOFTMAX) { /* softmax over the k chosen logits */
        for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(logits[chosen[j]] - top);
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
        return;
    }
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - top); /* softmax over all, top k */
    float kept = 0.0f;
    for (int64_t j = 0; j < k; j++) kept += weights[j] = expf(logits[chosen[j]] - top) / sum;
    if (moe[MOE_NORM])
        for (int64_t j = 0; j < k; j++) weights[j] /= kept;
}

/* One thread: the pairs grouped by expert and the experts' gate+up products planned. */
static void group(const int64_t *moe, int64_t B, const float *h, int64_t ldh, const qact *acts, int64_t hidden,
                  const moe_area *a) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K], inter = moe[MOE_INTER], P = B * k;
    memset(a->starts, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t p = 0; p < P; p++) a->starts[a->chosen[p] + 1]++;
    for (int64_t e = 0; e < E; e++) a->starts[e + 1] += a->starts[e];
    memcpy(a->fill, a->starts, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t p = 0; p < P; p++) a->order[a->fill[a->chosen[p]]++] = (int32_t)p;
    int n = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t s = a->starts[e], c = a->starts[e + 1] - s;
        if (c == 0) continue;
        for (int64_t i = s; i < s + c; i++) a->rows_in[i] = acts[a->order[i] / k];
        const int64_t *ex = expert_at(moe, e);
        const qmat w = {(const int64_t *)ex[0], (int)ex[1], NULL};
        a->jobs[n++] = (product_job){.acts = a->rows_in + s, .B = c, .K = hidden, .w = w,
                                     .y = a->gu + s * 2 * inter, .ldy = 2 * inter};
    }
    const int64_t sinter = moe[MOE_SHARED_INTER];
    if (sinter) { /* the shared expert: every row, and each row's gate */
        const qmat w = {(const int64_t *)moe[MOE_SHARED_GU], (int)moe[MOE_SHARED_GU_PARTS], NULL};
        a->jobs[n++] = (product_job){.acts = acts, .B = B, .K = hidden, .w = w, .y = a->sgu, .ldy = 2 * sinter};
        for (int64_t b = 0; b < B; b++) a->sgate[b] = dot_f32(h + b * ldh, (const float *)moe[MOE_SHARED_GATE], hidden);
    }
    a->plan[0] = n;
    a->plan[1] = plan_products(a->jobs, n);
}

typedef struct { /* the down projections' claims: columns of x, every chosen expert each */
    const int64_t *moe;
    const moe_area *a;
    int64_t B, hidden, cols;
    float *x;
} down_sum;

static qact down_act(const moe_area *a, int64_t inter, int64_t i) {
    return qact_at(a->down_in + i * (qact_bytes(inter) + 64), inter);
}

static qact shared_act(const moe_area *a, int64_t sinter, int64_t b) {
    return qact_at(a->sdown_in + b * (qact_bytes(sinter) + 64), sinter);
}

/* Columns [n0, n1) of one down projection of c rows (quantized `in`) added into x: row r is
 * row pair[r] / k of x (the pairs' rows), or row r without `pair`. One row goes straight
 * into x; several through `ys` ([c, hidden]), then added in order. */
static void add_down(const qact *in, int64_t c, int64_t K, const int64_t *down, int64_t n0, int64_t n1,
                     const int32_t *pair, int64_t k, float *ys, float *x, int64_t hidden) {
    const uint8_t *tiles = (const uint8_t *)down[2];
    if (c == 1) {
        rows_product(in, 1, K, tiles, (int)down[1], n0, n1, x + (pair ? pair[0] / k : 0) * hidden, 0, NULL, 1);
        return;
    }
    rows_product(in, c, K, tiles, (int)down[1], n0, n1, ys, hidden, NULL, 0);
    for (int64_t r = 0; r < c; r++) {
        float *xr = x + (pair ? pair[r] / k : r) * hidden;
        const float *yr = ys + r * hidden;
        for (int64_t n = n0; n < n1; n++) xr[n] += yr[n];
    }
}

static void run_down_claim(const void *ctx, int64_t i) {
    const down_sum *d = (const down_sum *)ctx;
    const moe_area *a = d->a;
    const int64_t E = d->moe[MOE_E], k = d->moe[MOE_K], inter = d->moe[MOE_INTER], hidden = d->hidden;
    const int64_t sinter = d->moe[MOE_SHARED_INTER];
    const int64_t n0 = i * d->cols, n1 = n0 + d->cols < hidden ? n0 + d->cols : hidden;
    qact in[MOE_MAX_ROWS];
    for (int64_t e = 0; e < E; e++) {
        const int64_t s = a->starts[e], c = a->starts[e + 1] - s;
        if (c == 0) continue;
        for (int64_t r = 0; r < c; r++) in[r] = down_act(a, inter, s + r);
        add_down(in, c, inter, (const int64_t *)expert_at(d->moe, e)[2], n0, n1, a->order + s, k,
                 a->ys + s * hidden, d->x, hidden);
    }
    if (!sinter) return;
    for (int64_t r = 0; r < d->B; r++) in[r] = shared_act(a, sinter, r);
    add_down(in, d->B, sinter, (const int64_t *)d->moe[MOE_SHARED_DOWN], n0, n1, NULL, 1, a->sys, d->x, hidden);
}

void moe_step(const int64_t *moe, int64_t B, const float *h, int64_t ldh, const qact *acts, int64_t hidden,
              float *x, float *area, team *tm, member *me) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K], inter = moe[MOE_INTER], sinter = moe[MOE_SHARED_INTER];
    const int64_t P = B * k;
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const moe_area a = layout(area, B, E, k, inter, sinter, hidden);

    if (moe[MOE_ROUTER_Q]) {
        const qmat r = {(const int64_t *)moe[MOE_ROUTER], (int)moe[MOE_ROUTER_PARTS], NULL};
        par_product(acts, B, hidden, r, a.logits, E, 0, tm, me);
    } else { /* float32 [E, hidden]: a share of the (row, expert) logits each */
        const float *r = (const float *)moe[MOE_ROUTER];
        for (int64_t i = B * E * t / nt; i < B * E * (t + 1) / nt; i++)
            a.logits[i] = dot_f32(h + i / E * ldh, r + i % E * hidden, hidden);
        team_wait(&tm->bar, nt, &me->spin);
    }
    if (B * E > CHOOSE_ALONE) { /* the rows' choices shared out, then grouped by one thread */
        for (int64_t b = B * t / nt; b < B * (t + 1) / nt; b++)
            choose(moe, a.logits + b * E, a.chosen + b * k, a.weights + b * k);
        team_wait(&tm->bar, nt, &me->spin);
    }
    if (t == 0) {
        if (B * E <= CHOOSE_ALONE)
            for (int64_t b = 0; b < B; b++) choose(moe, a.logits + b * E, a.chosen + b * k, a.weights + b * k);
        group(moe, B, h, ldh, acts, hidden, &a);
    }
    team_wait(&tm->bar, nt, &me->spin);
    run_products(a.jobs, (int)a.plan[0], a.plan[1], tm, me);

    const int64_t items = P + (sinter ? B : 0); /* the pairs, then the shared expert's rows */
    for (int64_t i = items * t / nt; i < items * (t + 1) / nt; i++) { /* activations, weighted, in place */
        const int64_t width = i < P ? inter : sinter;
        float *g = i < P ? a.gu + i * 2 * inter : a.sgu + (i - P) * 2 * sinter;
        const float w = i < P ? a.weights[a.order[i]] : 1.0f / (1.0f + expf(-a.sgate[i - P]));
        swiglu(g, g + width, width, g);
        for (int64_t n = 0; n < width; n++) g[n] *= w;
        qact q = i < P ? down_act(&a, inter, i) : shared_act(&a, sinter, i - P);
        quantize_act(g, width, &q);
    }
    team_wait(&tm->bar, nt, &me->spin);

    const int64_t *down0 = (const int64_t *)expert_at(moe, a.chosen[0])[2];
    const down_sum d = {moe, &a, B, hidden, claim_rows(inter, (int)down0[1]), x};
    share_claims((hidden + d.cols - 1) / d.cols, run_down_claim, &d, tm, me);
}
