/* The small vector helpers both attention loops use, written so that gcc vectorizes them. */
#ifndef KVRQ_VECTOR_MATH_H
#define KVRQ_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The loops' vector width (key dims are multiples of it), set by engine/cpu/native_attention.py. */
#ifndef KVRQ_LANES
#error "KVRQ_LANES is not set: engine/cpu/native_attention.py builds this code"
#endif
#define LANES KVRQ_LANES
#if LANES < 1 || (LANES & (LANES - 1)) != 0
#error "KVRQ_LANES must be a power of two (the dot products' tree)"
#endif

/* exp(x) for x <= 0 (scores less their maximum): Cody-Waite range reduction and the
 * classic single-precision polynomial (Cephes' expf), written so that it vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The dot product of two float vectors of dim values (a multiple of LANES). */
static inline float dot(const float *a, const float *b, int dim) {
    float lanes[LANES] = {0};
    for (int d = 0; d < dim; d += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += a[d + j] * b[d + j];
    /* A tree, not a chain of LANES dependent adds: the reduction is on every score's path. */
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    return lanes[0];
}

static inline float lane_max(const float *x, int64_t n) {
    float lanes[LANES];
    for (int j = 0; j < LANES; j++) lanes[j] = -INFINITY;
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
    float top = -INFINITY;
    for (; t < n; t++) top = x[t] > top ? x[t] : top;
    for (int j = 0; j < LANES; j++) top = lanes[j] > top ? lanes[j] : top;
    return top;
}

/* A softmax row in place: its first `visible` scores become exp(score - max) (one pass for
 * the max, one for exp and sum together), the rest 0; returns their sum. */
static inline float softmax_in_place(float *x, int64_t visible, int64_t length) {
    const float top = lane_max(x, visible);
    float sums[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= visible; t += LANES)
        for (int j = 0; j < LANES; j++) {
            const float e = exp_nonpositive(x[t + j] - top);
            x[t + j] = e;
            sums[j] += e;
        }
    float sum = 0.0f;
    for (; t < visible; t++) {
        x[t] = exp_nonpositive(x[t] - top);
        sum += x[t];
    }
    for (; t < length; t++) x[t] = 0.0f;
    for (int j = 0; j < LANES; j++) sum += sums[j];
    return sum;
}

#endif
