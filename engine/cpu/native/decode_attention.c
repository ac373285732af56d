/* One layer's attention for decoding rows (one query token each) that keep their own K/V.
 *
 * Why: on the CPU, MLX runs such a row's attention as ~10 small ops (~8 us each to run) and
 * its matmuls of 3 query rows read K/V at ~3.5 GB/s; here every row of the layer is one call
 * that reads each K and V line once, at close to memory bandwidth. See engine/cpu/native_attention.py.
 *
 * Layout: q[row] is (kv_heads * repeats, k_dim) contiguous; k[row] is (kv_heads, lengths[row],
 * k_dim) with head stride k_head_stride[row] floats, lines contiguous; v likewise; out is
 * (rows, kv_heads * repeats, v_dim). k_dim is a multiple of 8, repeats at most 64 (checked
 * here and by the caller).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "spans.h"
#include "vector_math.h"

/* Query heads per KV head, set by engine/cpu/native_attention.py; checked by the caller too. */
#ifndef KVRQ_MAX_REPEATS
#error "KVRQ_MAX_REPEATS is not set: engine/cpu/native_attention.py builds this code"
#endif
#define MAX_REPEATS KVRQ_MAX_REPEATS

typedef struct {
    Span span; /* first: run_spans sets it */
    const float *const *q, *const *k, *const *v;
    const int64_t *lengths, *k_head_stride, *v_head_stride;
    int kv_heads, repeats, k_dim, v_dim;
    float scale;
    float *out;
} Work;

/* One (row, KV head): its repeats query heads' scores, softmax and weighted sum. */
static void attend_unit(const Work *w, int64_t unit, float *weights, float *sums) {
    const int64_t row = unit / w->kv_heads, h = unit % w->kv_heads, length = w->lengths[row];
    const int repeats = w->repeats, k_dim = w->k_dim, v_dim = w->v_dim;
    const float *keys = w->k[row] + h * w->k_head_stride[row];
    const float *values = w->v[row] + h * w->v_head_stride[row];
    const float *queries = w->q[row] + h * repeats * k_dim;
    for (int64_t t = 0; t < length; t++)
        for (int r = 0; r < repeats; r++)
            weights[r * length + t] = dot(queries + r * k_dim, keys + t * k_dim, k_dim) * w->scale;
    float totals[MAX_REPEATS];
    for (int r = 0; r < repeats; r++) totals[r] = softmax_in_place(weights + r * length, length, length);
    memset(sums, 0, sizeof(float) * (size_t)(repeats * v_dim));
    for (int64_t t = 0; t < length; t++) {
        const float *line = values + t * v_dim;
        for (int r = 0; r < repeats; r++) {
            const float p = weights[r * length + t];
            float *acc = sums + r * v_dim;
            for (int d = 0; d < v_dim; d++) acc[d] += p * line[d];
        }
    }
    float *dst = w->out + (row * w->kv_heads + h) * repeats * v_dim;
    for (int r = 0; r < repeats; r++)
        for (int d = 0; d < v_dim; d++) dst[r * v_dim + d] = sums[r * v_dim + d] / totals[r];
}

static void *run_units(void *arg) {
    Work *w = arg;
    const int64_t longest = span_longest(&w->span, w->lengths, w->kv_heads);
    float *weights = malloc(sizeof(float) * (size_t)(longest * w->repeats + w->repeats * w->v_dim));
    if (weights == NULL) {
        w->span.status = -1;
        return NULL;
    }
    for (int64_t unit = w->span.first; unit < w->span.end; unit++)
        attend_unit(w, unit, weights, weights + longest * w->repeats);
    free(weights);
    w->span.status = 0;
    return NULL;
}

/* All rows' attention, the (row, KV head) units split into `threads` runs of about equal
 * numbers of K/V lines (spans.h). Returns 0, or -1 when memory or a thread could not be had
 * (the output is then incomplete). */
int decode_attention(int rows, const float *const *q, const float *const *k, const float *const *v,
                     const int64_t *lengths, const int64_t *k_head_stride,
                     const int64_t *v_head_stride, int kv_heads, int repeats, int k_dim, int v_dim,
                     float scale, float *out, int threads) {
    if (repeats > MAX_REPEATS || k_dim % LANES || threads < 1) return -1;
    Work work[MAX_THREADS];
    for (int i = 0; i < MAX_THREADS; i++)
        work[i] = (Work){{0, 0, -1}, q, k, v, lengths, k_head_stride, v_head_stride,
                         kv_heads, repeats, k_dim, v_dim, scale, out};
    return run_spans(work, sizeof(Work), threads, rows, lengths, kv_heads, run_units);
}
