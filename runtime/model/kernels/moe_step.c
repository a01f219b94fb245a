/* The batch-1 step of a mixture-of-experts MLP (moe_step.h), inside the fused decode step's
 * parallel region: the router, the choice of experts, the chosen experts' gate+up products as
 * one sequence of claims, and their down projections summed into the residual.
 *
 * Only the chosen experts' weights are read. Every thread chooses the same experts from
 * the shared logits (the same code on the same floats), so no thread waits for a choice.
 * The down projections share their output rows: a claim covers some rows of x for all k
 * experts in turn, so no two threads add to the same row and no partial sums need adding
 * up afterwards. As moe.py's per-op step, the routing weight scales an expert's activations
 * before its down projection (the same sum: the projection is linear).
 */
#define _GNU_SOURCE /* syscall (futex) and clock_gettime under -std=c11 */
#include "moe_step.h"
#include "vec.h"

int64_t moe_work_floats(int64_t E, int64_t k, int64_t inter) {
    return E + 2 * k * inter + k * (qact_bytes(inter) / (int64_t)sizeof(float) + 16) + 32;
}

static const int64_t *expert_at(const int64_t *moe, int64_t e) { return moe + MOE_EXPERTS + e * MOE_EXPERT_FIELDS; }

int moe_check(const int64_t *moe, int64_t hidden) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K], inter = moe[MOE_INTER];
    if (E < 1 || k < 1 || k > MOE_MAX_K || k > E || inter < QK || inter % QK) return -1;
    if (moe[MOE_ROUTING] != ROUTE_SOFTMAX_TOPK && moe[MOE_ROUTING] != ROUTE_TOPK_SOFTMAX) return -1;
    for (int64_t e = 0; e < E; e++) {
        const int64_t *x = expert_at(moe, e);
        const int64_t *gu = (const int64_t *)x[0], *down = (const int64_t *)x[2];
        if (x[1] < 1 || x[1] > MAX_PARTS || x[3] != 1 || down[0] != hidden) return -1;
        int64_t rows = 0;
        for (int64_t p = 0; p < x[1]; p++) rows += gu[3 * p];
        if (rows != 2 * inter) return -1;
    }
    return 0;
}

/* The k chosen experts (largest first) and their weights, from the router's logits[E]. */
static void choose(const int64_t *moe, const float *logits, int64_t *chosen, float *weights) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K];
    float m = logits[0];
    for (int64_t e = 1; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int64_t j = 0; j < k; j++) { /* k passes: k is small (2 to 8) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
    }
    float sum = 0.0f;
    if (moe[MOE_ROUTING] == ROUTE_TOPK_SOFTMAX) { /* softmax over the k chosen logits */
        for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(logits[chosen[j]] - logits[chosen[0]]);
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
        return;
    }
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - m); /* softmax over all, top k */
    float top = 0.0f;
    for (int64_t j = 0; j < k; j++) top += weights[j] = expf(logits[chosen[j]] - m) / sum;
    if (moe[MOE_NORM])
        for (int64_t j = 0; j < k; j++) weights[j] /= top;
}

typedef struct { /* the down projections' claims: rows of x, all k experts each */
    const qact *acts;
    const int64_t *const *desc;
    int64_t k, K, hidden, rows;
    float *x;
} down_sum;

static void run_down_claim(const void *ctx, int64_t i) {
    const down_sum *d = (const down_sum *)ctx;
    const int64_t n0 = i * d->rows, n1 = n0 + d->rows < d->hidden ? n0 + d->rows : d->hidden;
    for (int64_t j = 0; j < d->k; j++)
        rows_product(&d->acts[j], 1, d->K, (const uint8_t *)d->desc[j][2], (int)d->desc[j][1], n0, n1, d->x, 0,
                     NULL, 1);
}

void moe_step(const int64_t *moe, const float *h, const qact *a, int64_t hidden, float *x,
              float *area, float *tmp, team *tm, member *me) {
    const int64_t E = moe[MOE_E], k = moe[MOE_K], inter = moe[MOE_INTER];
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float *logits = area, *gu = area + E;
    char *qbase = (char *)(gu + 2 * k * inter);

    if (moe[MOE_ROUTER_Q]) {
        const qmat r = {(const int64_t *)moe[MOE_ROUTER], (int)moe[MOE_ROUTER_PARTS], NULL};
        par_product(a, 1, hidden, r, logits, 0, 0, tm, me);
    } else { /* float32 [E, hidden]: a share of the experts' rows each */
        const float *r = (const float *)moe[MOE_ROUTER];
        for (int64_t e = E * t / nt; e < E * (t + 1) / nt; e++) logits[e] = dot_f32(h, r + e * hidden, hidden);
        team_wait(&tm->bar, nt, &me->spin);
    }
    int64_t chosen[MOE_MAX_K];
    float weights[MOE_MAX_K];
    choose(moe, logits, chosen, weights);

    product_job jobs[MOE_MAX_K];
    const int64_t *down[MOE_MAX_K];
    qact acts[MOE_MAX_K];
    for (int64_t j = 0; j < k; j++) {
        const int64_t *ex = expert_at(moe, chosen[j]);
        const qmat w = {(const int64_t *)ex[0], (int)ex[1], NULL};
        jobs[j] = (product_job){.acts = a, .B = 1, .K = hidden, .w = w, .y = gu + j * 2 * inter};
        down[j] = (const int64_t *)ex[2];
        acts[j] = qact_at(qbase + j * (qact_bytes(inter) + 64), inter);
    }
    par_products(jobs, (int)k, tm, me);

    for (int64_t j = t; j < k; j += nt) { /* each expert's activations, scaled by its weight */
        const float *g = gu + j * 2 * inter;
        swiglu(g, g + inter, inter, tmp);
        for (int64_t i = 0; i < inter; i++) tmp[i] *= weights[j];
        quantize_act(tmp, inter, &acts[j]);
    }
    team_wait(&tm->bar, nt, &me->spin);

    const down_sum d = {acts, down, k, inter, hidden, claim_rows(inter, (int)down[0][1]), x};
    share_claims((hidden + d.rows - 1) / d.rows, run_down_claim, &d, tm, me);
}
