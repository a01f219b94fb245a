/* The mixture-of-experts MLP of one layer in the fused decode steps (moe_step.c, called by
 * decode.c's decode_layers and decode_rows inside their parallel region).
 *
 * A layer's experts are described by int64 values (pointers as integers):
 *   MOE_E experts, MOE_K chosen per token, MOE_ROUTING (ROUTE_SOFTMAX_TOPK: softmax over all
 *   experts, the top k probabilities, renormalised to sum 1 when MOE_NORM; ROUTE_TOPK_SOFTMAX:
 *   the top k logits, softmax over those), MOE_INTER (each expert's width), the router
 *   (MOE_ROUTER_Q 1: a part descriptor with MOE_ROUTER_PARTS parts; 0: float32 [E, hidden]),
 *   the shared expert (Qwen2-MoE; MOE_SHARED_INTER 0: none) every row runs beside its chosen
 *   ones, scaled by the sigmoid of its gate (MOE_SHARED_GATE: float32 [hidden]): gate+up and
 *   down part descriptors and counts, then per expert MOE_EXPERT_FIELDS: gate+up part
 *   descriptor and part count (rows 0..inter-1 the gate, inter..2 inter-1 the up), down part
 *   descriptor and part count (one part).
 */
#ifndef RADIXLM_KERNEL_MOE_STEP_H
#define RADIXLM_KERNEL_MOE_STEP_H

#include "team.h"

enum {
    MOE_E, MOE_K, MOE_ROUTING, MOE_NORM, MOE_INTER, MOE_ROUTER_Q, MOE_ROUTER, MOE_ROUTER_PARTS,
    MOE_SHARED_INTER, MOE_SHARED_GU, MOE_SHARED_GU_PARTS, MOE_SHARED_DOWN, MOE_SHARED_DOWN_PARTS, MOE_SHARED_GATE,
    MOE_EXPERTS
};
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1 };
#define MOE_EXPERT_FIELDS 4
#define MOE_MAX_K 16    /* experts chosen per token */
#define MOE_MAX_E 4096  /* experts per layer */
#define MOE_MAX_ROWS 64 /* rows of one step (decode.c's MAX_ROWS) */

/* Floats of the shared scratch one layer's step over B rows needs. */
int64_t moe_work_floats(int64_t B, int64_t E, int64_t k, int64_t inter, int64_t shared_inter, int64_t hidden);

/* 0 if the descriptor is one moe_step takes for a residual of width `hidden`, else < 0;
 * checked once when the step's table is built (fused_decode.py), not every step. */
int moe_check(const int64_t *moe, int64_t hidden);

/* Inside the parallel region, every thread: x[b] += the layer's expert MLP of h[b] for the B
 * rows (h: the post-attention norms of x, row stride ldh; acts: their quantized copies,
 * read by every thread: shared, or for B = 1 each thread's own identical one). `area`:
 * moe_work_floats(B, ...) floats shared by the team. Ends at a barrier. */
void moe_step(const int64_t *moe, int64_t B, const float *h, int64_t ldh, const qact *acts, int64_t hidden,
              float *x, float *area, team *tm, member *me);

#endif
