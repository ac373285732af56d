/* Splitting a layer's (row, KV head) units over threads: what both decode loops share. */
#ifndef KVRQ_SPANS_H
#define KVRQ_SPANS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

enum { MAX_THREADS = 16 };

/* The first member of each loop's work record: its units [first, end) and how it went. */
typedef struct {
    int64_t first, end;
    int status;
} Span;

/* The longest row among a span's units (units are row * kv_heads + head). */
static inline int64_t span_longest(const Span *span, const int64_t *lengths, int kv_heads) {
    int64_t longest = 0;
    for (int64_t unit = span->first; unit < span->end; unit++) {
        const int64_t length = lengths[unit / kv_heads];
        longest = length > longest ? length : longest;
    }
    return longest;
}

/* Split rows * kv_heads units into `threads` spans of about equal numbers of lines, set in the
 * Span at the start of each of the `threads` records of `stride` bytes at `works`, and run
 * `run` on each (the calling thread takes the first; a thread that cannot be had runs here).
 * Returns the first nonzero status, else 0. */
static inline int run_spans(void *works, size_t stride, int threads, int rows, const int64_t *lengths,
                            int kv_heads, void *(*run)(void *)) {
    threads = threads > MAX_THREADS ? MAX_THREADS : threads;
    const int64_t units = (int64_t)rows * kv_heads;
    int64_t lines = 0;
    for (int row = 0; row < rows; row++) lines += lengths[row] * kv_heads;
    pthread_t helpers[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t unit = 0, done_lines = 0;
    for (int i = 0; i < threads; i++) {
        Span *span = (Span *)((char *)works + (size_t)i * stride);
        span->first = unit;
        span->status = -1;
        const int64_t target = lines * (i + 1) / threads;
        while (unit < units && (i == threads - 1 || done_lines < target)) {
            done_lines += lengths[unit / kv_heads];
            unit++;
        }
        span->end = unit;
    }
    for (int i = 1; i < threads; i++) {
        Span *span = (Span *)((char *)works + (size_t)i * stride);
        if (span->first < span->end) started[i] = pthread_create(&helpers[i], NULL, run, span) == 0;
    }
    run(works);
    int status = ((Span *)works)->status;
    for (int i = 1; i < threads; i++) {
        Span *span = (Span *)((char *)works + (size_t)i * stride);
        if (span->first >= span->end) continue;
        if (started[i]) pthread_join(helpers[i], NULL);
        else run(span);
        status = span->status ? span->status : status;
    }
    return status;
}

#endif
