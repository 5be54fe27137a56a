/* One thread pool per process for Kiln's parallel C kernels and for numpy's OpenBLAS.
 *
 * Why: OpenBLAS's own worker threads busy-wait (a loop of nops, no yield) for about 2^28 cycles after
 * every threaded call, so on a small machine any other thread started between two BLAS calls shares a
 * core with a spinning OpenBLAS worker and runs at about half speed. Kiln registers this pool with
 * OpenBLAS (openblas_set_threads_callback_function, native_ext.blas) so that OpenBLAS's threaded jobs
 * and Kiln's own kernels (native_ext/attention.h) run on the same threads, which spin only briefly
 * between tasks (0.2 ms, KILN_POOL_SPIN_US) and then sleep.
 *
 * kiln_pool_run(n, task, arg) calls task(arg, i) for i = 0..n-1, all at once on n threads (the caller
 * is thread 0), and returns when every call has returned; OpenBLAS's jobs wait on each other, so they
 * must run together, never one after another. Calls from several threads take turns (a mutex): OpenBLAS
 * gives every job of a call the same per-thread buffers. A forked child starts with no pool threads and
 * makes them again on its first call. What a task computes never depends on this pool: work is split
 * by the caller, so the bytes are the same for any thread count.
 */
#ifndef KILN_POOL_H
#define KILN_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KILN_POOL_MAX 64
/* how long an idle pool thread (or the caller waiting for one) spins before it sleeps, in microseconds:
 * KILN_POOL_SPIN_US, read once, else this */
#define KILN_POOL_SPIN_US 200

static int64_t kiln_pool_spin_ns(void) {
    static int64_t spin = -1;
    if (spin < 0) {
        const char *asked = getenv("KILN_POOL_SPIN_US");
        long value = asked ? strtol(asked, NULL, 10) : KILN_POOL_SPIN_US;
        spin = (value >= 0 && value <= 1000000 ? value : KILN_POOL_SPIN_US) * 1000;
    }
    return spin;
}

typedef void (*kiln_pool_task)(void *arg, int thread);

static struct {
    pthread_mutex_t turn;   /* one kiln_pool_run at a time */
    pthread_mutex_t lock;   /* guards sleeping on wake / done */
    pthread_cond_t wake, done;
    int started;            /* pool threads alive (thread i + 1 runs task(arg, i + 1)) */
    int sleeping, waiting;  /* pool threads asleep on wake; the caller asleep on done */
    uint64_t generation;    /* bumped by every run */
    int n;                  /* threads the current run uses */
    int pending;            /* pool threads of the current run still computing */
    kiln_pool_task task;
    void *arg;
    uint64_t first_generation[KILN_POOL_MAX]; /* the generation before a thread's first run */
} kiln_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
               PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, NULL, NULL, {0}};

static int64_t kiln_pool_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void kiln_pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *kiln_pool_thread(void *arg) {
    const int thread = (int)(intptr_t)arg;
    uint64_t seen = kiln_pool.first_generation[thread];
    for (;;) {
        const int64_t until = kiln_pool_now() + kiln_pool_spin_ns();
        int spins = 0;
        while (__atomic_load_n(&kiln_pool.generation, __ATOMIC_ACQUIRE) == seen) {
            kiln_pool_pause();
            if (++spins % 256 || kiln_pool_now() < until) continue;
            pthread_mutex_lock(&kiln_pool.lock);
            __atomic_add_fetch(&kiln_pool.sleeping, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&kiln_pool.generation, __ATOMIC_SEQ_CST) == seen)
                pthread_cond_wait(&kiln_pool.wake, &kiln_pool.lock);
            __atomic_sub_fetch(&kiln_pool.sleeping, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&kiln_pool.lock);
        }
        seen = __atomic_load_n(&kiln_pool.generation, __ATOMIC_ACQUIRE);
        if (thread >= kiln_pool.n) continue;
        kiln_pool.task(kiln_pool.arg, thread);
        if (__atomic_sub_fetch(&kiln_pool.pending, 1, __ATOMIC_SEQ_CST) == 0 &&
            __atomic_load_n(&kiln_pool.waiting, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&kiln_pool.lock);
            pthread_cond_signal(&kiln_pool.done);
            pthread_mutex_unlock(&kiln_pool.lock);
        }
    }
    return NULL;
}

/* In a forked child the pool threads are gone and the locks are in the state fork found them (held:
 * kiln_pool_prepare took them): start from nothing. */
static void kiln_pool_prepare(void) {
    pthread_mutex_lock(&kiln_pool.turn);
    pthread_mutex_lock(&kiln_pool.lock);
}
static void kiln_pool_parent(void) {
    pthread_mutex_unlock(&kiln_pool.lock);
    pthread_mutex_unlock(&kiln_pool.turn);
}
static void kiln_pool_child(void) {
    pthread_mutex_init(&kiln_pool.turn, NULL);
    pthread_mutex_init(&kiln_pool.lock, NULL);
    pthread_cond_init(&kiln_pool.wake, NULL);
    pthread_cond_init(&kiln_pool.done, NULL);
    kiln_pool.started = kiln_pool.sleeping = kiln_pool.waiting = kiln_pool.pending = 0;
}

/* task(arg, i) for i = 0..n-1 at once; 0, or -1 when the threads it needs could not be started (nothing
 * was run then). */
static void kiln_pool_register(void) {
    pthread_atfork(kiln_pool_prepare, kiln_pool_parent, kiln_pool_child);
}

static pthread_once_t kiln_pool_registered = PTHREAD_ONCE_INIT;

static int kiln_pool_run_threads(int n, kiln_pool_task task, void *arg) {
    if (n <= 1) {
        task(arg, 0);
        return 0;
    }
    if (n > KILN_POOL_MAX) n = KILN_POOL_MAX;
    pthread_once(&kiln_pool_registered, kiln_pool_register);
    kiln_pool_spin_ns(); /* read before any pool thread does */
    pthread_mutex_lock(&kiln_pool.turn);
    while (kiln_pool.started < n - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        kiln_pool.first_generation[kiln_pool.started + 1] = kiln_pool.generation;
        int failed = pthread_create(&thread, &attributes, kiln_pool_thread, (void *)(intptr_t)(kiln_pool.started + 1));
        pthread_attr_destroy(&attributes);
        if (failed) {
            pthread_mutex_unlock(&kiln_pool.turn);
            return -1;
        }
        kiln_pool.started++;
    }
    kiln_pool.task = task;
    kiln_pool.arg = arg;
    kiln_pool.n = n;
    __atomic_store_n(&kiln_pool.pending, n - 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&kiln_pool.generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&kiln_pool.sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&kiln_pool.lock);
        pthread_cond_broadcast(&kiln_pool.wake);
        pthread_mutex_unlock(&kiln_pool.lock);
    }
    task(arg, 0);
    const int64_t until = kiln_pool_now() + kiln_pool_spin_ns();
    int spins = 0;
    while (__atomic_load_n(&kiln_pool.pending, __ATOMIC_SEQ_CST)) {
        kiln_pool_pause();
        if (++spins % 256 || kiln_pool_now() < until) continue;
        pthread_mutex_lock(&kiln_pool.lock);
        __atomic_store_n(&kiln_pool.waiting, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&kiln_pool.pending, __ATOMIC_SEQ_CST))
            pthread_cond_wait(&kiln_pool.done, &kiln_pool.lock);
        __atomic_store_n(&kiln_pool.waiting, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&kiln_pool.lock);
    }
    pthread_mutex_unlock(&kiln_pool.turn);
    return 0;
}

/* Kiln's kernels on GNU OpenMP's threads instead (kiln_pool_use_openmp), when oneDNN computes the float32
 * products (native_ext.blas, KILN_CPU_GEMM): oneDNN's GNU OpenMP threads spin for milliseconds after each
 * product, so the kernels run on those same threads rather than beside them. GOMP_parallel (the entry point
 * GCC compiles `#pragma omp parallel` to) and omp_get_thread_num are found in the libgomp oneDNN loaded, so
 * this library links no OpenMP of its own. The kernels' tasks take work items from a shared counter
 * (parallel.h, attention.h), so they are correct on a team of any size; OpenBLAS's jobs, which wait on each
 * other, always run on the pthreads above (kiln_pool_openblas_callback). */
typedef void (*kiln_gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
static kiln_gomp_parallel_fn kiln_gomp_parallel = NULL; /* libgomp's, once named (kiln_pool_find_openmp) */
static int (*kiln_omp_thread_num)(void) = NULL;
static int kiln_pool_openmp = 0; /* the process's kernels run on OpenMP (kiln_pool_use_openmp) */
/* the calling thread's own choice, whatever the process does: 0 follows the process, 1 the pthreads (a serving
 * thread: native_ext.blas.serve_on_openblas), 2 OpenMP (the bfloat16 scope, whose products only oneDNN computes:
 * native_ext.blas.kernels_on_openmp) */
static __thread int kiln_pool_here = 0;

/* Sets the calling thread's choice (0, 1 or 2 as above) and returns the one it replaces. */
static int kiln_pool_choose_here(int choice) {
    int before = kiln_pool_here;
    kiln_pool_here = choice;
    return before;
}

/* PARALLEL and THREAD_NUM: libgomp's GOMP_parallel and omp_get_thread_num, or both NULL (a forked child, where
 * GNU OpenMP cannot run): without them every kernel runs on the pthreads */
static void kiln_pool_find_openmp(void *parallel, void *thread_num) {
    pthread_once(&kiln_pool_registered, kiln_pool_register); /* a fork while a kernel runs leaves turn usable */
    pthread_mutex_lock(&kiln_pool.turn);
    kiln_omp_thread_num = (int (*)(void))thread_num;
    kiln_gomp_parallel = (kiln_gomp_parallel_fn)parallel;
    pthread_mutex_unlock(&kiln_pool.turn);
}

/* ON: every thread that made no choice of its own runs its kernels on OpenMP (once found), else on the pthreads */
static void kiln_pool_use_openmp(int on) {
    pthread_once(&kiln_pool_registered, kiln_pool_register);
    pthread_mutex_lock(&kiln_pool.turn);
    kiln_pool_openmp = on;
    pthread_mutex_unlock(&kiln_pool.turn);
}

typedef struct {
    kiln_pool_task task;
    void *arg;
} kiln_gomp_call;

static void kiln_gomp_task(void *data) {
    kiln_gomp_call *call = (kiln_gomp_call *)data;
    call->task(call->arg, kiln_omp_thread_num());
}

/* task(arg, i) for i = 0..n-1 at once: on GNU OpenMP's threads where the caller's choice says so (a team
 * of up to n; the kernels' tasks share their work through a counter), else on the pthreads above. */
static int kiln_pool_run(int n, kiln_pool_task task, void *arg) {
    if (n <= 1) {
        task(arg, 0);
        return 0;
    }
    pthread_mutex_lock(&kiln_pool.turn);
    int openmp = kiln_pool_here ? kiln_pool_here == 2 : kiln_pool_openmp;
    kiln_gomp_parallel_fn parallel = openmp ? kiln_gomp_parallel : NULL;
    if (parallel != NULL) {
        kiln_gomp_call call = {task, arg};
        parallel(kiln_gomp_task, &call, (unsigned)(n > KILN_POOL_MAX ? KILN_POOL_MAX : n), 0);
        pthread_mutex_unlock(&kiln_pool.turn);
        return 0;
    }
    pthread_mutex_unlock(&kiln_pool.turn);
    return kiln_pool_run_threads(n, task, arg);
}

/* OpenBLAS's threads callback: dojob(i, job i, dojob_data) for its numjobs jobs, all at once. */
typedef void (*kiln_openblas_dojob)(int thread, void *job, int data);
typedef struct {
    kiln_openblas_dojob dojob;
    char *jobs;
    size_t size;
    int data;
} kiln_openblas_call;

static void kiln_pool_openblas_task(void *arg, int thread) {
    kiln_openblas_call *call = (kiln_openblas_call *)arg;
    call->dojob(thread, call->jobs + (size_t)thread * call->size, call->data);
}

static void kiln_pool_openblas_callback(int sync, kiln_openblas_dojob dojob, int numjobs, size_t size, void *jobs,
                                        int data) {
    (void)sync; /* OpenBLAS always waits (sync = 1); so does kiln_pool_run */
    kiln_openblas_call call = {dojob, (char *)jobs, size, data};
    if (kiln_pool_run_threads(numjobs, kiln_pool_openblas_task, &call) != 0) {
        fprintf(stderr, "kiln: could not start %d threads for OpenBLAS\n", numjobs);
        abort();
    }
}

#endif
