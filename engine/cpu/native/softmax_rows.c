/* The softmax numerators of a layer's score rows, in place, and their sums.
 *
 * Why: a prefill chunk's or a warm agent's suffix attention over a long history is a
 * (queries x keys) score matrix per KV head; numpy takes four passes over it (max, subtract,
 * exp, sum), and MLX's CPU exp is scalar. Here each row is one pass for its maximum and one
 * for exp and sum together, rows split over threads. See engine/cpu/native_attention.py.
 *
 * Layout: scores is (rows, length) row-major. Rows come in groups of `queries` (the query
 * tokens of one head), and row r sees its first length - queries + r % queries + 1 keys
 * (causal: the queries are the last tokens of the keys; queries == 1: every key). Keys a row
 * does not see get 0.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "vector_math.h"

typedef struct {
    float *scores, *totals;
    int64_t length, queries, first, end; /* rows [first, end) */
} Rows;

static void *run_rows(void *arg) {
    const Rows *w = arg;
    for (int64_t r = w->first; r < w->end; r++) {
        const int64_t visible = w->length - w->queries + r % w->queries + 1;
        w->totals[r] = softmax_in_place(w->scores + r * w->length, visible, w->length);
    }
    return NULL;
}

/* Returns 0, or -1 for arguments it cannot take. A thread that cannot be started has its
 * rows run on the calling thread. */
int softmax_rows(float *scores, int64_t rows, int64_t length, int64_t queries, float *totals,
                 int threads) {
    enum { MAX_THREADS = 16 };
    if (queries < 1 || queries > length || threads < 1) return -1;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    Rows work[MAX_THREADS];
    pthread_t helpers[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < threads; i++)
        work[i] = (Rows){scores, totals, length, queries, rows * i / threads, rows * (i + 1) / threads};
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&helpers[i], NULL, run_rows, &work[i]) == 0;
    run_rows(&work[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i]) pthread_join(helpers[i], NULL);
        else run_rows(&work[i]);
    }
    return 0;
}
