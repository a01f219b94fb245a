/* Cycles of one block of gemm8's int8 micro-kernel (runtime/model/kernels/gemm8.c,
 * block_mb on AVX-512 VNNI: 6 activation rows by 2 groups of 16 weight rows, 8 vpdpbusd a
 * pair and block of 32), with its data in L1, for each variant of the float work a pair
 * pays after its integer sums, beside the baseline of the vpdpbusd alone. It shows which
 * float operations share the vector pipes with vpdpbusd (multiplies and FMAs) and which run
 * beside them (converts, adds): see BENCHMARKS.md, issue 39.
 *
 *   gcc -O2 -march=native benchmarks/bench_gemm8_block.c -o /tmp/bench_gemm8_block && /tmp/bench_gemm8_block [GHz]
 *
 * Cycles are wall time x the clock given (default 4.4, this VM's boost clock; the ratios
 * do not depend on it). Needs AVX-512 VNNI.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MB 6      /* activation rows a pass */
#define NG 2      /* groups of 16 weight rows a pass */
#define QB 64     /* bytes of one quad (4 codes) of a group's 16 rows */
#define CB (8 * QB + 4 * 16 * 4) /* a group's block of 32: codes, then ws, ws2, wo, spare */
#define NBLK 64   /* blocks a pass (one slice of K) */

static uint8_t W[NG][NBLK * CB] __attribute__((aligned(64)));
static int8_t X[MB][NBLK * 32] __attribute__((aligned(64)));
static float XS[MB][NBLK * 4] __attribute__((aligned(64)));

enum { INT_ONLY, CVT_ADD, CVT_FMA, CVT_FMA_FMA, KERNEL };
static const char *const NAMES[] = {"vpdpbusd alone (baseline)", "+ convert, add", "+ convert, FMA",
                                    "+ convert, 2 FMAs", "+ convert, multiply, 2 FMAs (gemm8)"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline __attribute__((always_inline)) void pass(const int variant, float *y) {
    __m512 f[NG][MB];
    for (int k = 0; k < NG; k++)
        for (int i = 0; i < MB; i++) f[k][i] = _mm512_setzero_ps();
    for (int b = 0; b < NBLK; b++) {
        __m512i acc[NG][MB];
#pragma GCC unroll 8
        for (int k = 0; k < NG; k++)
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++) acc[k][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            __m512i w[NG];
#pragma GCC unroll 8
            for (int k = 0; k < NG; k++) w[k] = _mm512_load_si512(W[k] + b * CB + q * QB);
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++) {
                int32_t xq;
                memcpy(&xq, X[i] + b * 32 + 4 * q, 4);
                const __m512i x = _mm512_set1_epi32(xq);
#pragma GCC unroll 8
                for (int k = 0; k < NG; k++) acc[k][i] = _mm512_dpbusd_epi32(acc[k][i], w[k], x);
            }
        }
#pragma GCC unroll 8
        for (int k = 0; k < NG; k++) {
            const __m512 ws = _mm512_load_ps((const float *)(W[k] + b * CB + 8 * QB));
            const __m512 wo = _mm512_load_ps((const float *)(W[k] + b * CB + 8 * QB) + 32);
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++) {
                const __m512 s = _mm512_set1_ps(XS[i][4 * b]), sx = _mm512_set1_ps(XS[i][4 * b + 1]);
                if (variant == INT_ONLY) /* (an integer add keeps the sums live) */
                    f[k][i] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(f[k][i]), acc[k][i]));
                else if (variant == CVT_ADD)
                    f[k][i] = _mm512_add_ps(_mm512_cvtepi32_ps(acc[k][i]), f[k][i]);
                else if (variant == CVT_FMA)
                    f[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]), s, f[k][i]);
                else if (variant == CVT_FMA_FMA)
                    f[k][i] = _mm512_fmadd_ps(wo, sx, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]), s, f[k][i]));
                else
                    f[k][i] = _mm512_fmadd_ps(wo, sx, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]), _mm512_mul_ps(ws, s), f[k][i]));
            }
        }
    }
    for (int k = 0; k < NG; k++)
        for (int i = 0; i < MB; i++) _mm512_storeu_ps(y + (k * MB + i) * 16, f[k][i]);
}

#define VARIANT(v) static __attribute__((noinline)) void pass_##v(float *y) { pass(v, y); }
VARIANT(INT_ONLY)
VARIANT(CVT_ADD)
VARIANT(CVT_FMA)
VARIANT(CVT_FMA_FMA)
VARIANT(KERNEL)
static void (*const PASSES[])(float *) = {pass_INT_ONLY, pass_CVT_ADD, pass_CVT_FMA, pass_CVT_FMA_FMA, pass_KERNEL};

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 4.4;
    memset(W, 1, sizeof W);
    memset(X, 1, sizeof X);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NBLK * 4; j++) XS[i][j] = 1.0f;
    float y[NG * MB * 16];
    const long reps = 100000;
    const double ideal = 8.0 * NG * MB / 2; /* two vpdpbusd a cycle */
    double base = 0;
    printf("one block of 32, %d rows x %d weight rows, data in L1 (cycles at %.1f GHz; %g = the vpdpbusd at two a cycle)\n",
           MB, 16 * NG, ghz, ideal);
    for (int v = 0; v <= KERNEL; v++) {
        double best = 1e30;
        for (int round = 0; round < 3; round++) {
            PASSES[v](y);
            const double t = now();
            for (long r = 0; r < reps; r++) PASSES[v](y);
            const double c = (now() - t) * ghz * 1e9 / ((double)reps * NBLK);
            best = c < best ? c : best;
        }
        if (v == INT_ONLY) base = best;
        printf("%-40s %6.1f cycles  %4.0f%% of the vpdpbusd peak  x%.2f the baseline  (%g)\n", NAMES[v], best,
               100.0 * ideal / best, best / base, (double)y[0]);
    }
    return 0;
}
