/* Rotary embedding of a prefill's q and k heads, in place in the rows of its qkv product
 * (torch's roll / multiply / addcmul made three [T, heads, hd] temporaries of them: 4% of
 * a 2,000-token prefill of the 1B shape). Each head optionally RMS-normed first (Qwen3's
 * q/k norms), as the fused decode step's norm_rope does for one row. */
#include "vec.h"
#include <omp.h>

#define MAX_ROPE_HD 1024

/* For t < T: heads [0, heads) of row x + t ldx (each hd floats, consecutive) become
 * rope(head) (vec.h), with cos / sin the row's factors at cos + t ldcs / sin + t ldcs (sin
 * signed for rotate-half); with qkn ([heads, hd]), rope(rms_norm(head) qkn[head]). Returns
 * 0 (nothing done) if hd is odd or above MAX_ROPE_HD. */
int rope_rows(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t hd, const float *cos, const float *sin,
              int64_t ldcs, const float *qkn, float eps) {
    if (hd % 2 || hd > MAX_ROPE_HD || hd <= 0) return 0;
#pragma omp parallel for schedule(static) if (T * heads * hd >= 65536)
    for (int64_t t = 0; t < T; t++) {
        float buf[MAX_ROPE_HD];
        const float *c = cos + t * ldcs, *s = sin + t * ldcs;
        for (int64_t h = 0; h < heads; h++) {
            float *head = x + t * ldx + h * hd;
            if (qkn) rms_norm(head, qkn + h * hd, hd, eps, buf);
            else memcpy(buf, head, (size_t)hd * sizeof(float));
            rope(buf, c, s, hd, head);
        }
    }
    return 1;
}
