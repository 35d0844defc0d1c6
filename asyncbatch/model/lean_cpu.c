/* The small operations of a CPU decode step, one call each (asyncbatch/model/lean_kernels.py builds this file
 * and binds it with ctypes; asyncbatch/model/lean_step.py calls it between the matrix products).
 *
 * Every function computes in float32 and rounds where the torch ops it replaces round: with `bf` set (a
 * bfloat16 model) a value is rounded to bfloat16 (round to nearest even, as torch's conversion) after each
 * operation that torch would give a bfloat16 result; with `bf` clear (float32) nothing is rounded. Tensors
 * are dense and row-major; a dtype code is 0 for float32 and 1 for bfloat16. Built with -ffp-contract=off
 * (lean_kernels.FLAGS), so a product and a sum are never fused into one rounding where torch rounds twice (the
 * attention's fmaf calls are its own order of sums, not torch's in any case).
 *
 * Each function takes its scratch with one malloc a call (the attention: two a call and one a thread) and frees
 * it; none takes a lock, none keeps state: any thread may call them, each on its own tensors.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded; /* NaN stays NaN */
}

/* The value torch would hold after an operation whose result has the model's dtype. */
static inline float rnd(float x, int bf) { return bf ? bf16_to_float(float_to_bf16(x)) : x; }

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* transformers' RMSNorm of one row `x` (already in the model's precision): the variance in float32, the
 * normalised value rounded to the model's dtype, then times the weight, rounded again. */
static void norm_row(const float *x, int64_t n, const void *w, int wd, float eps, int bf, void *out, int64_t o0,
                     int od) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += x[i + k] * x[i + k];
    float sum = 0.0f;
    for (int k = 0; k < 16; k++) sum += acc[k];
    for (; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) store(out, o0 + i, rnd(load(w, i, wd) * rnd(x[i] * inv, bf), bf), od);
}

/* out[r] = RMSNorm(x[r]) * w for `rows` rows of width n. */
void ab_rms_norm(const void *x, int xd, int64_t rows, int64_t n, const void *w, int wd, float eps, int bf, void *out,
                 int od) {
    float *row = malloc(sizeof(float) * n);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) row[i] = rnd(load(x, r * n + i, xd), bf);
        norm_row(row, n, w, wd, eps, bf, out, r * n, od);
    }
    free(row);
}

/* The residual stream x (model dtype, updated in place) += y rounded to the model's dtype (a product's output);
 * then, with a weight, out = RMSNorm(x) * w (the next norm); without one (NULL) only the sum. */
void ab_add_rms_norm(const void *y, int yd, void *x, int xd, int64_t rows, int64_t n, const void *w, int wd,
                     float eps, int bf, void *out, int od) {
    float *row = malloc(sizeof(float) * n);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) {
            float s = rnd(load(x, r * n + i, xd) + rnd(load(y, r * n + i, yd), bf), bf);
            store(x, r * n + i, s, xd);
            row[i] = s;
        }
        if (w) norm_row(row, n, w, wd, eps, bf, out, r * n, od);
    }
    free(row);
}

/* One step's q/k/v product output `qkv` ([T, H + 2 KVH, D]) rounded to the model's dtype; q and k rotated
 * (x * cos + swap_halves(x) * signed_sin, each product rounded, then the sum: rope.apply_rope), q into q_out
 * ([T, H, D], model dtype), k and v into the caches ([blocks * block_size, KVH, D], model dtype) at each token's
 * slot. cos and sin: [T, D] in the model's dtype. */
void ab_qkv_rope_write(const void *qkv, int qd, int64_t T, int64_t H, int64_t KVH, int64_t D, const void *cos,
                       const void *sin, void *k_cache, void *v_cache, const int64_t *slots, void *q_out, int md,
                       int bf) {
    int64_t width = (H + 2 * KVH) * D, half = D / 2;
    float *x = malloc(sizeof(float) * D);
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        for (int64_t h = 0; h < H + KVH; h++) {
            for (int64_t i = 0; i < D; i++) x[i] = rnd(load(qkv, t * width + h * D + i, qd), bf);
            for (int64_t i = 0; i < D; i++) {
                float c = load(cos, t * D + i, md), s = load(sin, t * D + i, md);
                float swapped = x[i < half ? i + half : i - half];
                float v = rnd(rnd(x[i] * c, bf) + rnd(swapped * s, bf), bf);
                if (h < H)
                    store(q_out, (t * H + h) * D + i, v, md);
                else
                    store(k_cache, (slot * KVH + h - H) * D + i, v, md);
            }
        }
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t i = 0; i < D; i++)
                store(v_cache, (slot * KVH + h) * D + i, load(qkv, t * width + (H + KVH + h) * D + i, qd), md);
    }
    free(x);
}

/* `n` values of dtype `dtype` from element `i` of `p`, as float32. */
static inline void load_row(const void *p, int64_t i, int64_t n, int dtype, float *out) {
    if (dtype) {
        const uint16_t *src = (const uint16_t *)p + i;
        for (int64_t k = 0; k < n; k++) out[k] = bf16_to_float(src[k]);
    } else {
        memcpy(out, (const float *)p + i, sizeof(float) * n);
    }
}

/* exp(x) within ~1e-7 relative (8.0e-8 measured over [-87, 88]): Cephes' expf (Cody-Waite reduction by ln 2, a
 * degree-6 polynomial, the power of two set in the exponent bits), written so that a loop over it vectorises,
 * where libm's expf is one call per value (the softmax's and SiLU's largest cost). Past the float32 range it
 * gives 0 (below -87, where exp is under 1.7e-38) and infinity (above 88), as their exact values round. */
static inline float exp_fast(float x) {
    float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    float e = p * scale;
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : e);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

static inline float sum(const float *a, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i];
    return s;
}

/* Sixteen floats as one vector (GCC's and Clang's vector extension: one AVX-512 register, two AVX2 ones, four
 * SSE or NEON ones), loaded from any alignment. */
typedef float vf16 __attribute__((vector_size(64)));

static inline vf16 vld(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of a vector's sixteen lanes, as a tree of halves. */
static inline float hsum16(vf16 v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
    typedef float vf8 __attribute__((vector_size(32)));
    typedef float vf4 __attribute__((vector_size(16)));
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float a[16];
    memcpy(a, &v, sizeof a);
    for (int w = 8; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
#endif
}

/* Ask for the cache lines of `n` values of dtype `dtype` from element `i` of `p` (the same position of a row's next
 * block: blocks lie anywhere in the cache, and a hardware prefetcher does not follow a row from one to the next). */
static inline void prefetch_span(const void *p, int64_t i, int64_t n, int dtype) {
    const char *first = (const char *)p + i * (dtype ? 2 : 4), *last = first + n * (dtype ? 2 : 4);
    for (const char *c = first; c < last; c += 64) __builtin_prefetch(c, 0, 3);
}

/* Positions a work item of the attention takes: a row's context is cut at fixed multiples of this, whatever the
 * step's rows and threads, so that every sum of a row is the same in any step (docs/reproducibility.md). */
#define ATTENTION_CHUNK 256

/* One row's query heads (qf: [H, D] float32; each KV head's `group` query heads share its keys and values) over
 * its positions [p_begin, p_end) (block-aligned start): for each head h, top[h] = the largest score, total[h] =
 * the sum of exp(score - top[h]) and acc[h] ([H, D]) = the sum of exp(score - top[h]) v, in float32. A position's
 * keys (and values) of all KV heads lie side by side in the cache, so one pass over the positions reads each cache
 * line once. Inlined with D a constant (64, 128) where it is one, so that the dot products and the weighted sums
 * unroll into whole vectors. */
static inline __attribute__((always_inline)) void attend_chunk(const float *qf, const void *k_cache,
                                                                 const void *v_cache, int md, const int64_t *table,
                                                                 int64_t p_begin, int64_t p_end, int64_t KVH,
                                                                 const int64_t D, int64_t bs, int64_t group,
                                                                 float scale, float *scores, float *row, float *top,
                                                                 float *total, float *acc) {
    int64_t heads = KVH * group, n_pos = p_end - p_begin;
    for (int64_t p0 = p_begin; p0 < p_end; p0 += bs) {
        int64_t first = table[p0 / bs] * bs * KVH * D, n = p_end - p0 < bs ? p_end - p0 : bs;
        int64_t ahead = p0 + bs < p_end ? table[p0 / bs + 1] * bs * KVH * D : -1;
        for (int64_t p = 0; p < n; p++) {
            if (ahead >= 0) prefetch_span(k_cache, ahead + p * KVH * D, KVH * D, md);
            const float *k = md ? row : (const float *)k_cache + first + p * KVH * D;
            if (md) load_row(k_cache, first + p * KVH * D, KVH * D, md, row);
            for (int64_t h = 0, g = 0; g < KVH; g++)
                for (int64_t j = 0; j < group; j++, h++) {
                    const float *qh = qf + h * D, *kh = k + g * D;
                    float s;
                    if (D % 16 == 0) {
                        vf16 v = vld(qh) * vld(kh);
                        for (int64_t c = 16; c < D; c += 16) v += vld(qh + c) * vld(kh + c);
                        s = hsum16(v);
                    } else
                        s = dot(qh, kh, D);
                    scores[h * n_pos + p0 - p_begin + p] = s * scale;
                }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * n_pos, t = -INFINITY;
        for (int64_t p = 0; p < n_pos; p++) t = sh[p] > t ? sh[p] : t;
        for (int64_t p = 0; p < n_pos; p++) sh[p] = exp_fast(sh[p] - t);
        top[h] = t;
        total[h] = sum(sh, n_pos);
    }
    memset(acc, 0, sizeof(float) * heads * D);
    for (int64_t p0 = p_begin; p0 < p_end; p0 += bs) {
        int64_t first = table[p0 / bs] * bs * KVH * D, n = p_end - p0 < bs ? p_end - p0 : bs;
        int64_t ahead = p0 + bs < p_end ? table[p0 / bs + 1] * bs * KVH * D : -1;
        for (int64_t p = 0; p < n; p++) {
            if (ahead >= 0) prefetch_span(v_cache, ahead + p * KVH * D, KVH * D, md);
            const float *v = md ? row : (const float *)v_cache + first + p * KVH * D;
            if (md) load_row(v_cache, first + p * KVH * D, KVH * D, md, row);
            for (int64_t h = 0, g = 0; g < KVH; g++)
                for (int64_t j = 0; j < group; j++, h++) {
                    float w = scores[h * n_pos + p0 - p_begin + p], *ah = acc + h * D;
                    const float *vh = v + g * D;
                    for (int64_t i = 0; i < D; i++) ah[i] = fmaf(w, vh[i], ah[i]);
                }
        }
    }
}

/* Decode attention: row b's H query heads (q: [B, H, D], model dtype) over the first ctx_lens[b] positions of
 * its blocks (tables: [B, >= ceil(ctx / bs)] with row stride table_stride; caches [blocks, bs, KVH, D]); the
 * query heads of one KV head's group share its keys and values, read once. Scores, softmax and the weighted sum
 * in float32 (fused multiply-adds: this is not torch's order of sums in any case); the output ([B, H * D])
 * rounded to the model's dtype (what scaled_dot_product_attention returns) and stored in dtype od. A row with
 * no context gets zeros.
 *
 * The work items are (row, chunk of ATTENTION_CHUNK positions), split over `threads` OpenMP threads: one row of
 * a long context keeps every thread busy, and a row's chunks, cut at fixed positions, are merged in their order
 * (each chunk's sums rescaled to the row's largest score), so a row's result is the same whatever the step's rows
 * and threads. The chunks must start on a block boundary (ATTENTION_CHUNK a multiple of bs; else one chunk a
 * row). */
void ab_decode_attention(const void *q, const void *k_cache, const void *v_cache, int md, const int64_t *tables,
                         int64_t table_stride, const int64_t *ctx_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale, void *out, int od, int bf, int threads) {
    int64_t group = H / KVH, chunk = ATTENTION_CHUNK % bs == 0 ? ATTENTION_CHUNK : 0, longest = 1, items = 0;
    int64_t *first_item = malloc(sizeof(int64_t) * (B + 1));
    for (int64_t b = 0; b < B; b++) {
        int64_t L = ctx_lens[b];
        if (L > longest) longest = L;
        first_item[b] = items;
        items += chunk && L > chunk ? (L + chunk - 1) / chunk : 1;
    }
    first_item[B] = items;
    int64_t span = chunk && longest > chunk ? chunk : longest, stride = H * (D + 2);
    float *parts = malloc(sizeof(float) * items * stride); /* each item: top [H], total [H], acc [H, D] */
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(items > 1 && threads > 1 ? threads : 1)
#endif
    {
        float *scores = malloc(sizeof(float) * (H * (span + D) + KVH * D));
        float *qf = scores + H * span, *row = qf + H * D;
        int64_t b = 0;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < items; item++) {
            while (first_item[b + 1] <= item) b++;
            int64_t L = ctx_lens[b], c = item - first_item[b];
            int64_t p_begin = c * chunk, p_end = chunk && L > chunk && p_begin + chunk < L ? p_begin + chunk : L;
            float *part = parts + item * stride;
            if (L <= 0) continue;
            load_row(q, b * H * D, H * D, md, qf);
            const int64_t *table = tables + b * table_stride;
            if (D == 64)
                attend_chunk(qf, k_cache, v_cache, md, table, p_begin, p_end, KVH, 64, bs, group, scale, scores, row,
                             part, part + H, part + 2 * H);
            else if (D == 128)
                attend_chunk(qf, k_cache, v_cache, md, table, p_begin, p_end, KVH, 128, bs, group, scale, scores,
                             row, part, part + H, part + 2 * H);
            else
                attend_chunk(qf, k_cache, v_cache, md, table, p_begin, p_end, KVH, D, bs, group, scale, scores, row,
                             part, part + H, part + 2 * H);
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < B; r++) {
            int64_t o0 = r * H * D, n = first_item[r + 1] - first_item[r];
            const float *first = parts + first_item[r] * stride;
            if (ctx_lens[r] <= 0) { /* no context: its one item computed nothing */
                for (int64_t i = 0; i < H * D; i++) store(out, o0 + i, 0.0f, od);
                continue;
            }
            for (int64_t h = 0; h < H; h++) {
                float *o = row; /* the head's merged sum, [D] (row holds KVH * D >= D floats) */
                float top = first[h], total = 0.0f;
                for (int64_t c = 1; c < n; c++) top = first[c * stride + h] > top ? first[c * stride + h] : top;
                memset(o, 0, sizeof(float) * D);
                for (int64_t c = 0; c < n; c++) {
                    const float *part = first + c * stride;
                    float w = n == 1 ? 1.0f : exp_fast(part[h] - top);
                    total += w * part[H + h];
                    for (int64_t i = 0; i < D; i++) o[i] = fmaf(w, part[2 * H + h * D + i], o[i]);
                }
                for (int64_t i = 0; i < D; i++) store(out, o0 + h * D + i, rnd(o[i] / total, bf), od);
            }
        }
        free(scores);
    }
    free(parts);
    free(first_item);
}

/* out = SiLU(gate) * up, gate and up rounded to the model's dtype, SiLU's value rounded, then the product
 * (F.silu(gate) * up); gate and up: rows of n with their own row strides (halves of one fused product, or two). */
void ab_silu_mul(const void *gate, const void *up, int gd, int64_t stride, int64_t rows, int64_t n, int bf, void *out,
                 int od) {
    float *buffer = malloc(sizeof(float) * 3 * n);
    float *restrict g = buffer, *restrict u = buffer + n, *restrict o = buffer + 2 * n;
    for (int64_t r = 0; r < rows; r++) {
        load_row(gate, r * stride, n, gd, g);
        load_row(up, r * stride, n, gd, u);
        if (bf) /* two loops, so that neither branches inside and both vectorise */
            for (int64_t i = 0; i < n; i++) {
                float gi = rnd(g[i], 1);
                o[i] = rnd(rnd(gi / (1.0f + exp_fast(-gi)), 1) * rnd(u[i], 1), 1);
            }
        else
            for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
        if (od)
            for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[r * n + i] = float_to_bf16(o[i]);
        else
            memcpy((float *)out + r * n, o, sizeof(float) * n);
    }
    free(buffer);
}
