/* The team of a fused step's OpenMP threads (decode.c, moe_step.c): its barrier and its
 * products' rows shared out by claims. Included by each source that runs inside a step's
 * parallel region; the sources define _GNU_SOURCE before any include (futex, clock_gettime). */
#ifndef RADIXLM_KERNEL_TEAM_H
#define RADIXLM_KERNEL_TEAM_H

#include "common.h"
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

#define MAX_PARTS 8 /* row blocks of different types in one matrix */

/* ------------------------------------------------------------------------------------------
 * The barrier: spin a while, then sleep on a futex. A step has ~6 barriers a layer;
 * libgomp's own sleep at once under OMP_WAIT_POLICY=passive (the engine's default, so that
 * idle threads and threads waiting for a pre-empted one leave the cores to others), and a
 * futex sleep + wake-up costs tens of us. Threads that arrive together meet within a few
 * us, so a short spin catches them. The spin budget adapts per thread within a step: a
 * spin that runs out (the other thread lost its core) quarters it, a spin that succeeds
 * wins some back, so on a busy machine the threads soon sleep at once again.
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

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* All `n` threads of the team call it; none returns before the last has arrived, and each
 * then sees every write the others made before arriving (acquire/release on gen). `spin`:
 * the calling thread's spin budget (ns), adapted here. */
static inline void team_wait(team_bar *b, int n, int64_t *spin) {
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
 * A product's rows shared out with stealing. Each thread owns a contiguous range of claims
 * (the static split, so it streams its own weights in order, prefetching ahead) and takes
 * them one by one from a counter on its own cache line; a thread done with its range takes
 * what is left of the others'. On a 2-core machine that also runs the frontend and the
 * client, one thread often loses its core for a while: with a fixed split the other
 * finished its half and waited at the barrier; now it does the rest.
 *
 * Each product uses one of two sets of counters, alternating (`phase`), and a thread resets
 * its own counter of the other set during it: that set's last users passed the barrier
 * that ended the previous product, its next ones start after the barrier that ends this one.
 * ---------------------------------------------------------------------------------------- */
#define MAX_TEAM 64 /* threads with counters (more: the plain static split) */
#ifndef CLAIM_BYTES
/* Weight bytes a claim covers at least: the counter's cost small against the claim's work
 * on narrow rows (SmolLM2's 576-wide ones). A build with -DCLAIM_BYTES=1 (one chunk a
 * claim) makes stealing common in the tests' tiny models. */
#define CLAIM_BYTES 32768
#endif

typedef struct {
    _Alignas(64) atomic_long next;
} claim_counter;

typedef struct {
    team_bar bar;
    claim_counter claim[2][MAX_TEAM];
} team;

typedef struct { /* one thread's own state inside the parallel region */
    int64_t spin; /* team_wait's spin budget */
    int phase;    /* products done: which counter set the next one uses */
} member;

static inline void team_init(team *tm) {
    memset(tm, 0, sizeof(*tm));
}

/* The rows one claim covers: whole chunks, and at least CLAIM_BYTES of weights. */
static inline int64_t claim_rows(int64_t K, int qtype) {
    const int64_t row_bytes = row_bytes_of(qtype, K);
    int64_t chunks = (CLAIM_BYTES + PRODUCT_CHUNK * row_bytes - 1) / (PRODUCT_CHUNK * row_bytes);
    return (chunks < 1 ? 1 : chunks) * PRODUCT_CHUNK;
}

/* A matrix's claims, part after part: claim i of the matrix is claim i - first of the
 * part it falls in. */
typedef struct {
    int64_t first[MAX_PARTS + 1], rows[MAX_PARTS], out[MAX_PARTS];
} claim_map;

static inline int64_t map_claims(qmat w, int64_t K, claim_map *cm) {
    int64_t total = 0, out = 0;
    for (int p = 0; p < w.nparts; p++) {
        const int64_t N = w.desc[3 * p];
        cm->rows[p] = claim_rows(K, (int)w.desc[3 * p + 1]);
        cm->first[p] = total;
        cm->out[p] = out;
        total += (N + cm->rows[p] - 1) / cm->rows[p];
        out += N;
    }
    cm->first[w.nparts] = total;
    return total;
}

/* Claim i (of map_claims' sequence) computed: its rows of its part. */
static inline void run_claim(const qact *acts, int64_t B, int64_t K, qmat w, const claim_map *cm, int64_t i,
                      float *y, int64_t ldy, int accumulate) {
    int p = 0;
    while (i >= cm->first[p + 1]) p++;
    const int64_t N = w.desc[3 * p], n0 = (i - cm->first[p]) * cm->rows[p];
    const int64_t n1 = n0 + cm->rows[p] < N ? n0 + cm->rows[p] : N, off = cm->out[p];
    rows_product(acts, B, K, (const uint8_t *)w.desc[3 * p + 2], (int)w.desc[3 * p + 1], n0, n1, y + off, ldy,
                 w.bias ? w.bias + off : NULL, accumulate);
}

/* Inside a parallel region: claims 0 .. claims-1 shared out with stealing (above), each
 * run as run(ctx, i), then the team's barrier. */
static inline void share_claims(int64_t claims, void (*run)(const void *ctx, int64_t i), const void *ctx,
                         team *tm, member *me) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (nt == 1 || nt > MAX_TEAM) {
        for (int64_t i = claims * t / nt; i < claims * (t + 1) / nt; i++) run(ctx, i);
        team_wait(&tm->bar, nt, &me->spin);
        return;
    }
    const int set = me->phase & 1;
    me->phase++;
    atomic_store_explicit(&tm->claim[set ^ 1][t].next, 0, memory_order_relaxed);
    for (int k = 0; k < nt; k++) { /* own range first, then the others' leftovers */
        const int o = (t + k) % nt;
        const int64_t c0 = claims * o / nt, n_o = claims * (o + 1) / nt - c0;
        for (;;) {
            const int64_t i = atomic_fetch_add_explicit(&tm->claim[set][o].next, 1, memory_order_relaxed);
            if (i >= n_o) break;
            run(ctx, c0 + i);
        }
    }
    team_wait(&tm->bar, nt, &me->spin);
}

/* One product of a parallel step: y[B, N] (row stride ldy) = B quantized rows @ w^T (added
 * to y with accumulate), its claims numbered from `first` among the step's. */
typedef struct {
    const qact *acts;
    int64_t B, K;
    qmat w;
    float *y;
    int64_t ldy;
    int accumulate;
    claim_map cm;
    int64_t first;
} product_job;

typedef struct {
    product_job *jobs;
    int n;
} job_list;

static inline void run_job_claim(const void *ctx, int64_t i) {
    const job_list *jl = (const job_list *)ctx;
    int lo = 0, hi = jl->n - 1; /* the last job whose first claim is <= i */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (jl->jobs[mid].first <= i) lo = mid;
        else hi = mid - 1;
    }
    const product_job *p = &jl->jobs[lo];
    run_claim(p->acts, p->B, p->K, p->w, &p->cm, i - p->first, p->y, p->ldy, p->accumulate);
}

/* Number the claims of n products one after the other (their claim maps and firsts); the
 * total. */
static inline int64_t plan_products(product_job *jobs, int n) {
    int64_t total = 0;
    for (int j = 0; j < n; j++) {
        jobs[j].first = total;
        total += map_claims(jobs[j].w, jobs[j].K, &jobs[j].cm);
    }
    return total;
}

/* Inside a parallel region: n products with distinct outputs, planned (plan_products,
 * `total` claims), their rows shared out as one sequence of claims, then the barrier. */
static inline void run_products(product_job *jobs, int n, int64_t total, team *tm, member *me) {
    const job_list jl = {jobs, n};
    share_claims(total, run_job_claim, &jl, tm, me);
}

/* Inside a parallel region, every thread with its own `jobs`: plan and run them. */
static inline void par_products(product_job *jobs, int n, team *tm, member *me) {
    run_products(jobs, n, plan_products(jobs, n), tm, me);
}

/* Inside a parallel region: y[B, N] (row stride ldy) from B quantized rows, the rows shared
 * out by claims (above), then the team's barrier. */
static inline void par_product(const qact *acts, int64_t B, int64_t K, qmat w, float *y, int64_t ldy,
                        int accumulate, team *tm, member *me) {
    product_job job = {.acts = acts, .B = B, .K = K, .w = w, .y = y, .ldy = ldy, .accumulate = accumulate};
    par_products(&job, 1, tm, me);
}

#endif
