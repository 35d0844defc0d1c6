/* The matrix products of a small CPU decode step read straight from the model's own weights: y = x W^T (+ b) for
 * a few rows x, each weight row streamed from memory once and multiplied into every row of x while it is in L1.
 * Built into the same library as lean_cpu.c (asyncbatch/model/lean_kernels.py); lean_step.py calls it.
 *
 * Why: at one or two rows a product is a read of its weight, and torch's float32 paths read SmolLM2's weights at
 * 11-20 GB/s on a 2-vCPU Zen 4 where a sum() reads 27-50 (profiles/lean-products-amd-epyc-zen4-2core); this one
 * reads them at about sum()'s rate, in bfloat16 too (fbgemm's float16 kernel: ~24 GB/s). It splits the weight's
 * rows over `threads` OpenMP threads; the library links the libgomp torch has already loaded (one soname, so one
 * runtime and the same pool of threads as torch's own ops).
 *
 * Numerics: products and sums in float32 (fused multiply-adds, sixteen partial sums a row, then their total:
 * another order than oneDNN's or MKL's, a float32 rounding apart); bfloat16 weights are widened exactly (or, on
 * a CPU with AVX512-BF16, multiplied as bfloat16 pairs: the same exact products); the output is float32,
 * unrounded (the kernel that reads it rounds, as the torch ops' .to(dtype) would).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GEMV_ROWS 5 /* rows of x multiplied per pass over a weight row (more rows: more passes, from L1) */

static inline float widen_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* sums[r] = x[r] . w_row for r < rows (<= GEMV_ROWS); w_row has K values of dtype wd (0 float32, 1 bfloat16).
 * Inlined with `rows` a constant (gemv_span), so that the loop over rows unrolls into registers. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t rows, int64_t K,
                                                            const void *w_row, int wd, float *sums) {
#if defined(__AVX512F__)
    __m512 acc[GEMV_ROWS];
    for (int r = 0; r < GEMV_ROWS; r++) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv = wd ? _mm512_castsi512_ps(_mm512_slli_epi32(
                             _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w_row + k))),
                             16))
                       : _mm512_loadu_ps((const float *)w_row + k);
        for (int r = 0; r < GEMV_ROWS; r++)
            if (r < rows) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[r]);
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
#else
    int64_t k = 0;
    for (int r = 0; r < rows; r++) {
        float s = 0.0f;
        const float *xr = x + r * K;
        if (wd) {
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < K - K % 16; i++) s += widen_bf16(((const uint16_t *)w_row)[i]) * xr[i];
        } else {
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < K - K % 16; i++) s += ((const float *)w_row)[i] * xr[i];
        }
        sums[r] = s;
    }
    k = K - K % 16;
#endif
    for (; k < K; k++) {
        float wk = wd ? widen_bf16(((const uint16_t *)w_row)[k]) : ((const float *)w_row)[k];
        for (int r = 0; r < rows; r++) sums[r] += wk * x[r * K + k];
    }
}

#if defined(__AVX512BF16__)
/* dot_rows for bfloat16 weights and rows xb given as bfloat16 too: vdpbf16ps multiplies 32 pairs a call (each
 * product exact in float32, summed in float32; subnormal inputs read as zero), twice the pairs of a float32
 * fused multiply-add and no widening: a step of several rows (a verify step) is bound by these, not by memory. */
static inline __attribute__((always_inline)) void dot_rows_bf16(const uint16_t *xb, int64_t rows, int64_t K,
                                                                 const uint16_t *w_row, float *sums) {
    __m512 acc[GEMV_ROWS];
    for (int r = 0; r < GEMV_ROWS; r++) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w_row + k));
        for (int r = 0; r < GEMV_ROWS; r++)
            if (r < rows)
                acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512((const void *)(xb + r * K + k)));
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
    for (; k < K; k++)
        for (int r = 0; r < rows; r++) sums[r] += widen_bf16(w_row[k]) * widen_bf16(xb[r * K + k]);
}
#endif

/* Weight rows n0 .. n1 of y = x W^T + b (xb: x as bfloat16, or NULL). */
static void gemv_span(const float *x, const uint16_t *xb, int64_t R, int64_t K, const void *w, int wd,
                      const void *bias, int bd, int64_t N, int64_t n0, int64_t n1, float *y) {
    size_t row_bytes = (size_t)K * (wd ? 2 : 4);
    float sums[GEMV_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        const char *w_row = (const char *)w + (size_t)n * row_bytes;
        float b = bias == NULL ? 0.0f : (bd ? widen_bf16(((const uint16_t *)bias)[n]) : ((const float *)bias)[n]);
        for (int64_t r0 = 0; r0 < R; r0 += GEMV_ROWS) {
            int64_t rows = R - r0 < GEMV_ROWS ? R - r0 : GEMV_ROWS;
#if defined(__AVX512BF16__)
            if (xb != NULL) {
                switch (rows) {
                case 1: dot_rows_bf16(xb + r0 * K, 1, K, (const uint16_t *)w_row, sums); break;
                case 2: dot_rows_bf16(xb + r0 * K, 2, K, (const uint16_t *)w_row, sums); break;
                case 3: dot_rows_bf16(xb + r0 * K, 3, K, (const uint16_t *)w_row, sums); break;
                case 4: dot_rows_bf16(xb + r0 * K, 4, K, (const uint16_t *)w_row, sums); break;
                default: dot_rows_bf16(xb + r0 * K, 5, K, (const uint16_t *)w_row, sums); break;
                }
            } else
#endif
                switch (rows) {
                case 1: dot_rows(x + r0 * K, 1, K, w_row, wd, sums); break;
                case 2: dot_rows(x + r0 * K, 2, K, w_row, wd, sums); break;
                case 3: dot_rows(x + r0 * K, 3, K, w_row, wd, sums); break;
                case 4: dot_rows(x + r0 * K, 4, K, w_row, wd, sums); break;
                default: dot_rows(x + r0 * K, 5, K, w_row, wd, sums); break;
                }
            for (int64_t r = 0; r < rows; r++) y[(r0 + r) * N + n] = bias == NULL ? sums[r] : sums[r] + b;
        }
    }
}

/* y ([R, N] float32) = x ([R, K] float32) W^T (W: [N, K], row-major, dtype wd) + bias ([N], dtype bd, or NULL),
 * the N weight rows split into `threads` contiguous spans of whole cache lines. With bfloat16 weights the rows
 * must hold bfloat16 values (the lean step's do: every kernel before a product rounds to the model's dtype),
 * which a CPU with AVX512-BF16 takes as bfloat16 (their upper halves, exact). */
void ab_gemv(const float *x, int64_t R, int64_t K, const void *w, int wd, const void *bias, int bd, int64_t N,
             float *y, int threads) {
    uint16_t *xb = NULL;
#if defined(__AVX512BF16__)
    if (wd) {
        xb = malloc(sizeof(uint16_t) * R * K);
        for (int64_t i = 0; i < R * K; i++) {
            uint32_t u;
            memcpy(&u, x + i, 4);
            xb[i] = (uint16_t)(u >> 16);
        }
    }
#endif
#ifdef _OPENMP
    if (threads > 1 && N >= 64) {
#pragma omp parallel num_threads(threads)
        {
            int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
            int64_t span = ((N + team - 1) / team + 15) / 16 * 16;
            int64_t n0 = t * span < N ? t * span : N, n1 = n0 + span < N ? n0 + span : N;
            gemv_span(x, xb, R, K, w, wd, bias, bd, N, n0, n1, y);
        }
    } else
#endif
        gemv_span(x, xb, R, K, w, wd, bias, bd, N, 0, N, y);
    (void)threads;
    free(xb);
}
