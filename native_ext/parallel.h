/* Work cut into fixed chunks and run on native_ext/pool.h's pool, which lives in native_ext._attention (one
 * pool per process, shared with OpenBLAS): a module that includes this header gets kiln_pool_run's address
 * at import (kiln_rows_use_pool, from native_ext.kernels and native_ext.nf4); without it everything runs on
 * one thread. Chunks are taken in any order by any thread, so a chunk must write only its own part; chunk
 * sizes are constants of the caller, never a function of the thread count.
 */
#ifndef KILN_PARALLEL_H
#define KILN_PARALLEL_H

#include <stdint.h>

typedef void (*kiln_rows_task)(void *arg, int thread);
typedef int (*kiln_rows_pool_run)(int n, kiln_rows_task task, void *arg);
static kiln_rows_pool_run kiln_rows_pool = NULL;

static void kiln_rows_use_pool(void *run) { kiln_rows_pool = (kiln_rows_pool_run)run; }

typedef void (*kiln_rows_body)(const void *ctx, int64_t r0, int64_t r1, int64_t chunk);

typedef struct {
    kiln_rows_body body;
    const void *ctx;
    int64_t rows, chunk, next;
} kiln_rows_job;

static void kiln_rows_run_task(void *arg, int thread) {
    kiln_rows_job *job = (kiln_rows_job *)arg;
    (void)thread;
    for (;;) {
        const int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        const int64_t r0 = i * job->chunk;
        if (r0 >= job->rows) break;
        job->body(job->ctx, r0, r0 + job->chunk < job->rows ? r0 + job->chunk : job->rows, i);
    }
}

/* body(ctx, r0, r1, chunk index) over every chunk of `rows`, on up to `threads` threads. */
static void kiln_rows(int threads, int64_t rows, int64_t chunk, kiln_rows_body body, const void *ctx) {
    const int64_t chunks = (rows + chunk - 1) / chunk;
    if (threads > chunks) threads = (int)chunks;
    kiln_rows_job job = {body, ctx, rows, chunk, 0};
    if (threads > 1 && kiln_rows_pool != NULL && kiln_rows_pool(threads, kiln_rows_run_task, &job) == 0) return;
    job.next = 0;
    kiln_rows_run_task(&job, 0);
}

#endif
