/* One layer's attention for decoding rows whose K/V are held quantized (a pool with kv_bits).
 *
 * Why: MLX's CPU quantized matmul runs a row's attention at about the speed of its float32
 * attention (and twice as slow at 4 bits), far from the float32 C loop (decode_attention.c);
 * here each row's packed K/V line is unpacked and scaled once into a small float buffer and
 * used by all the query heads that share its KV head, so a step reads 1/4 (8 bits) or 1/8
 * (4 bits) of the float32 bytes. See engine/cpu/native_attention.py (attend_quantized_rows).
 *
 * Layout (MLX's affine quantization, engine/kv/quant.py): a line of dim values is dim * bits / 8
 * bytes, value d in byte d (8 bits) or in the low (even d) / high (odd d) nibble of byte d / 2
 * (4 bits); value = q * scale[g] + bias[g] for its group g = d / group_size, scales and biases
 * float32. Per row: q (kv_heads * repeats, k_dim); packed K (kv_heads, >= length lines) with head
 * strides in bytes, K scales and biases (kv_heads, >= length, k_dim / group_size) with head
 * strides in floats; V likewise; out (rows, kv_heads * repeats, v_dim).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "spans.h"
#include "vector_math.h"

#ifndef KVRQ_MAX_REPEATS
#error "KVRQ_MAX_REPEATS is not set: engine/cpu/native_attention.py builds this code"
#endif
#define MAX_REPEATS KVRQ_MAX_REPEATS

/* One packed line as floats: unpacked, then scaled and shifted group by group. */
static inline void unpack_line(const uint8_t *packed, const float *scales, const float *biases,
                               int dim, int bits, int group_size, float *out) {
    if (bits == 8) {
        for (int d = 0; d < dim; d++) out[d] = (float)packed[d];
    } else {
        for (int i = 0; i < dim / 2; i++) {
            out[2 * i] = (float)(packed[i] & 15);
            out[2 * i + 1] = (float)(packed[i] >> 4);
        }
    }
    for (int g = 0; g < dim / group_size; g++) {
        const float s = scales[g], b = biases[g];
        float *x = out + g * group_size;
        for (int d = 0; d < group_size; d++) x[d] = x[d] * s + b;
    }
}

typedef struct {
    Span span; /* first: run_spans sets it */
    const float *const *q;
    const uint8_t *const *kq, *const *vq;
    const float *const *ks, *const *kb, *const *vs, *const *vb;
    const int64_t *lengths, *kq_stride, *kg_stride, *vq_stride, *vg_stride;
    int kv_heads, repeats, k_dim, v_dim, bits, group_size;
    float scale;
    float *out;
} Work;

static void attend_unit(const Work *w, int64_t unit, float *weights, float *sums, float *line) {
    const int64_t row = unit / w->kv_heads, h = unit % w->kv_heads, length = w->lengths[row];
    const int repeats = w->repeats, k_dim = w->k_dim, v_dim = w->v_dim, bits = w->bits;
    const int gs = w->group_size, k_groups = k_dim / gs, v_groups = v_dim / gs;
    const int64_t k_line = k_dim * bits / 8, v_line = v_dim * bits / 8;
    const uint8_t *kq = w->kq[row] + h * w->kq_stride[row];
    const float *ks = w->ks[row] + h * w->kg_stride[row], *kb = w->kb[row] + h * w->kg_stride[row];
    const uint8_t *vq = w->vq[row] + h * w->vq_stride[row];
    const float *vs = w->vs[row] + h * w->vg_stride[row], *vb = w->vb[row] + h * w->vg_stride[row];
    const float *queries = w->q[row] + h * repeats * k_dim;
    for (int64_t t = 0; t < length; t++) {
        unpack_line(kq + t * k_line, ks + t * k_groups, kb + t * k_groups, k_dim, bits, gs, line);
        for (int r = 0; r < repeats; r++)
            weights[r * length + t] = dot(queries + r * k_dim, line, k_dim) * w->scale;
    }
    float totals[MAX_REPEATS];
    for (int r = 0; r < repeats; r++) totals[r] = softmax_in_place(weights + r * length, length, length);
    memset(sums, 0, sizeof(float) * (size_t)(repeats * v_dim));
    for (int64_t t = 0; t < length; t++) {
        unpack_line(vq + t * v_line, vs + t * v_groups, vb + t * v_groups, v_dim, bits, gs, line);
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
    const int64_t dim = w->k_dim > w->v_dim ? w->k_dim : w->v_dim;
    float *weights = malloc(sizeof(float) * (size_t)(longest * w->repeats + w->repeats * w->v_dim + dim));
    if (weights == NULL) {
        w->span.status = -1;
        return NULL;
    }
    float *sums = weights + longest * w->repeats, *line = sums + w->repeats * w->v_dim;
    for (int64_t unit = w->span.first; unit < w->span.end; unit++) attend_unit(w, unit, weights, sums, line);
    free(weights);
    w->span.status = 0;
    return NULL;
}

/* All rows' attention, split over `threads` as decode_attention.c's (spans.h). Returns 0, or -1
 * for arguments it does not take or when memory or a thread could not be had. */
int decode_attention_quantized(int rows, const float *const *q, const uint8_t *const *kq,
                               const float *const *ks, const float *const *kb,
                               const uint8_t *const *vq, const float *const *vs,
                               const float *const *vb, const int64_t *lengths,
                               const int64_t *kq_stride, const int64_t *kg_stride,
                               const int64_t *vq_stride, const int64_t *vg_stride, int kv_heads,
                               int repeats, int k_dim, int v_dim, int bits, int group_size,
                               float scale, float *out, int threads) {
    if (repeats > MAX_REPEATS || k_dim % LANES || threads < 1 || (bits != 8 && bits != 4) ||
        group_size % LANES || k_dim % group_size || v_dim % group_size)
        return -1;
    Work work[MAX_THREADS];
    for (int i = 0; i < MAX_THREADS; i++)
        work[i] = (Work){{0, 0, -1}, q, kq, vq, ks, kb, vs, vb, lengths, kq_stride, kg_stride,
                         vq_stride, vg_stride, kv_heads, repeats, k_dim, v_dim, bits, group_size,
                         scale, out};
    return run_spans(work, sizeof(Work), threads, rows, lengths, kv_heads, run_units);
}

/* One row's packed K or V as float32, (heads, length, dim) contiguous in `out`: for the rows the
 * loop above does not take (prefill chunks), whose attention then runs on the float32 path. */
int dequantize_heads(const uint8_t *packed, const float *scales, const float *biases, int heads,
                     int64_t length, int64_t packed_head_stride, int64_t group_head_stride, int dim,
                     int bits, int group_size, float *out) {
    if ((bits != 8 && bits != 4) || group_size % LANES || dim % group_size) return -1;
    const int64_t line = dim * bits / 8, groups = dim / group_size;
    for (int h = 0; h < heads; h++)
        for (int64_t t = 0; t < length; t++)
            unpack_line(packed + h * packed_head_stride + t * line,
                        scales + h * group_head_stride + t * groups,
                        biases + h * group_head_stride + t * groups, dim, bits, group_size,
                        out + ((int64_t)h * length + t) * dim);
    return 0;
}
