/* y[M, N] = x[M, K] . W^T (+ bias), float32, for the few rows of a decode step.
 *
 * Built by small_gemm.py with -mavx2 -mfma and called through ctypes (which
 * releases the GIL for the call); one thread.
 *
 * Why: for 1 to 64 rows, oneDNN and MKL reach 15-30 GFLOP/s on this project's
 * AVX2 host, where the core does ~80: a decode step reads every weight once per
 * step, and at a few rows their kernels neither stream the weights at memory
 * speed nor keep the FMA units busy. This kernel does both:
 *
 * - W is packed once (at load) into panels of NR = 24 output columns, each
 *   panel [K][24] contiguous, so the whole weight is read as one sequential
 *   stream, exactly once per call whatever M is.
 * - Each panel is split into K chunks of KC rows (24 KB: L1-resident), and every
 *   block of up to 4 input rows runs over a chunk while it is in L1: 4 rows x 3
 *   vectors of 8 columns = 12 accumulators in registers, 12 FMAs per 3 loads
 *   and 4 broadcasts.
 * - While a block of 2 to 4 rows computes a chunk, the next one (the next bytes
 *   in memory) is prefetched, so the stream from memory overlaps the FMAs. A
 *   single row is left to the hardware prefetcher: measured here, one row
 *   streams its weights at 17-18 GB/s without the software prefetch (what a
 *   plain sum reads) and at 13-15 GB/s with it, at any distance tried.
 *
 * Every row is summed in the same order (k ascending within a chunk, chunks in
 * turn) whatever M is, so a row's result does not depend on the other rows of
 * the batch.
 */
#define _GNU_SOURCE /* pthread_getaffinity_np, pthread_setaffinity_np */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define NR 24
#define KC 256

/* Adds the chunk's sums into y (after the first chunk) or the bias (on it); writes ncols <= NR columns. */
static inline __attribute__((always_inline)) void store_row(__m256 a0, __m256 a1, __m256 a2, float *y, const float *bias, int ncols, int first) {
    float sums[NR] __attribute__((aligned(32)));
    _mm256_store_ps(sums, a0);
    _mm256_store_ps(sums + 8, a1);
    _mm256_store_ps(sums + 16, a2);
    if (ncols == NR) {
        __m256 b0, b1, b2;
        if (!first) {
            b0 = _mm256_loadu_ps(y), b1 = _mm256_loadu_ps(y + 8), b2 = _mm256_loadu_ps(y + 16);
        } else if (bias) {
            b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8), b2 = _mm256_loadu_ps(bias + 16);
        } else {
            b0 = b1 = b2 = _mm256_setzero_ps();
        }
        _mm256_storeu_ps(y, _mm256_add_ps(b0, a0));
        _mm256_storeu_ps(y + 8, _mm256_add_ps(b1, a1));
        _mm256_storeu_ps(y + 16, _mm256_add_ps(b2, a2));
        return;
    }
    for (int c = 0; c < ncols; c++)
        y[c] = (!first ? y[c] : bias ? bias[c] : 0.0f) + sums[c];
}

#define DECLARE(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps(), a##i##2 = _mm256_setzero_ps();
#define ACCUMULATE(i)                                                  \
    {                                                                  \
        __m256 xi = _mm256_broadcast_ss(x + (i) * ldx + k);            \
        a##i##0 = _mm256_fmadd_ps(xi, w0, a##i##0);                    \
        a##i##1 = _mm256_fmadd_ps(xi, w1, a##i##1);                    \
        a##i##2 = _mm256_fmadd_ps(xi, w2, a##i##2);                    \
    }
#define STORE(i) store_row(a##i##0, a##i##1, a##i##2, y + (i) * ldy, bias, ncols, first);
/* One chunk row of the panel (24 floats, 96 bytes). */
#define LOAD_W                                                         \
    const float *w = chunk + k * NR;                                   \
    __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8), w2 = _mm256_load_ps(w + 16);
/* The same, and a prefetch of the same row of the chunk after it. */
#define LOAD_W_PREFETCH                                                \
    _mm_prefetch((const char *)(chunk + k * NR + ahead), _MM_HINT_T0);      \
    _mm_prefetch((const char *)(chunk + k * NR + ahead + 16), _MM_HINT_T0); \
    LOAD_W

#define BLOCK(rows, load, declare, accumulate, store)                                                        \
    static void block##rows(const float *x, long ldx, const float *chunk, long kn, long ahead, float *y,     \
                            long ldy, const float *bias, int ncols, int first) {                            \
        (void)ahead;                                                                                         \
        declare for (long k = 0; k < kn; k++) { load accumulate } store                                     \
    }

BLOCK(4, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3), STORE(0) STORE(1) STORE(2) STORE(3))
BLOCK(3, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1) DECLARE(2), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2), STORE(0) STORE(1) STORE(2))
BLOCK(2, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1), ACCUMULATE(0) ACCUMULATE(1), STORE(0) STORE(1))
/* One row: after a block of 4 on the same chunk (M = 5, 9, ...) the chunk ahead is already on its way. */
BLOCK(1, LOAD_W, DECLARE(0), ACCUMULATE(0), STORE(0))

/* Panels [first, last) of the product (see small_gemm). */
static void panel_range(const float *x, long M, long K, const float *panels, long N, const float *bias, float *y, long first, long last) {
    for (long p = first; p < last; p++) {
        int ncols = N - p * NR < NR ? (int)(N - p * NR) : NR;
        const float *b = bias ? bias + p * NR : 0;
        for (long k0 = 0; k0 < K; k0 += KC) {
            long kn = K - k0 < KC ? K - k0 : KC;
            const float *chunk = panels + (p * K + k0) * NR;
            long ahead = kn * NR; /* the next chunk, or the next panel's first: the next bytes in memory */
            for (long m = 0; m < M; m += 4) {
                const float *xm = x + m * K + k0;
                float *ym = y + m * N + p * NR;
                switch (M - m >= 4 ? 4 : M - m) {
                case 4: block4(xm, K, chunk, kn, ahead, ym, N, b, ncols, k0 == 0); break;
                case 3: block3(xm, K, chunk, kn, ahead, ym, N, b, ncols, k0 == 0); break;
                case 2: block2(xm, K, chunk, kn, ahead, ym, N, b, ncols, k0 == 0); break;
                default: block1(xm, K, chunk, kn, ahead, ym, N, b, ncols, k0 == 0); break;
                }
            }
        }
    }
}

/* x: [M, K] row-major; panels: ceil(N / NR) panels of [K][NR] (columns past N zero);
 * bias: [N] or NULL; y: [M, N] row-major, written whole. */
void small_gemm(const float *x, long M, long K, const float *panels, long N, const float *bias, float *y) {
    panel_range(x, M, K, panels, N, bias, y, 0, (N + NR - 1) / NR);
}

/* The same product on two cores: a helper thread computes the second half of the
 * panels while the caller computes the first. Why: one row is bound by reading
 * the weights, and two cores of this host read 30 GB/s where one reads 18.
 * Each output column is computed exactly as small_gemm computes it, so the
 * result is the same bits.
 *
 * The helper spins for up to SPIN_NS after each job (a decode step calls ~200
 * products tens of microseconds apart, and waking a sleeping thread costs more
 * than that), then sleeps until the next one. Both spins yield the CPU every
 * few microseconds, so when the scheduler puts the caller and the helper on one
 * core (the other one busy with a prefill) neither holds it for a time slice
 * while the other waits. One caller at a time: a second concurrent caller
 * computes alone. */
#define SPIN_NS 2000000L

static struct {
    const float *x, *panels, *bias;
    float *y;
    long M, K, N, first, last;
    int adopt_cpus; /* a new caller: the helper first moves to the caller's CPUs */
    cpu_set_t cpus;
} job;
/* Callers by a number of their own (thread-local: a pthread_t is reused once its thread ends). */
static __thread long caller_id;
static atomic_long callers;
static long last_caller_id; /* whose CPUs the helper has */
static atomic_long posted, finished, helper_jobs;
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER;
static int helper_state; /* 0: not started, 1: running, -1: could not start */
static pthread_t helper_thread;

/* Every SPIN_CHECK pauses (a few microseconds) a spinning thread yields and checks the clock. */
#define SPIN_CHECK 256

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper(void *unused) {
    (void)unused;
    long seen = 0;
    for (;;) {
        long spin_until = now_ns() + SPIN_NS;
        for (long spins = 1; atomic_load_explicit(&posted, memory_order_acquire) == seen; spins++) {
            _mm_pause();
            if (spins % SPIN_CHECK != 0)
                continue;
            sched_yield();
            if (now_ns() > spin_until) {
                pthread_mutex_lock(&sleep_lock);
                while (atomic_load_explicit(&posted, memory_order_acquire) == seen)
                    pthread_cond_wait(&wake, &sleep_lock);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = atomic_load_explicit(&posted, memory_order_acquire);
        if (job.adopt_cpus)
            pthread_setaffinity_np(pthread_self(), sizeof job.cpus, &job.cpus);
        panel_range(job.x, job.M, job.K, job.panels, job.N, job.bias, job.y, job.first, job.last);
        atomic_fetch_add_explicit(&helper_jobs, 1, memory_order_relaxed);
        atomic_store_explicit(&finished, seen, memory_order_release);
    }
    return 0;
}

/* A forked child has no helper thread (fork copies only the caller): it starts its own on its first split. */
static void forget_helper_in_child(void) {
    helper_state = 0;
    last_caller_id = 0;
    atomic_store(&posted, 0);
    atomic_store(&finished, 0);
    atomic_store(&helper_jobs, 0);
    pthread_mutex_init(&sleep_lock, 0);
    pthread_mutex_init(&caller_lock, 0);
    pthread_cond_init(&wake, 0);
}

static void register_fork_handler(void) { pthread_atfork(0, 0, forget_helper_in_child); }

/* Returns 1 if the product ran on two cores, 0 if the caller computed it alone. */
int small_gemm_split(const float *x, long M, long K, const float *panels, long N, const float *bias, float *y) {
    long count = (N + NR - 1) / NR, half = count / 2;
    if (half == 0 || pthread_mutex_trylock(&caller_lock) != 0) {
        small_gemm(x, M, K, panels, N, bias, y);
        return 0;
    }
    if (helper_state == 0) {
        static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
        pthread_once(&fork_handler, register_fork_handler);
        helper_state = pthread_create(&helper_thread, 0, helper, 0) == 0 ? 1 : -1;
        if (helper_state == 1)
            pthread_detach(helper_thread);
    }
    if (helper_state < 0) {
        pthread_mutex_unlock(&caller_lock);
        small_gemm(x, M, K, panels, N, bias, y);
        return 0;
    }
    job.x = x, job.M = M, job.K = K, job.panels = panels, job.N = N, job.bias = bias, job.y = y;
    job.first = half, job.last = count;
    /* The helper runs where its caller may run (a worker pins its model thread with
     * --device-cpus after start-up, where the helper may have been started): the
     * caller's CPUs as they are at its first split after another thread's. */
    if (caller_id == 0)
        caller_id = atomic_fetch_add(&callers, 1) + 1;
    job.adopt_cpus = caller_id != last_caller_id;
    if (job.adopt_cpus) {
        job.adopt_cpus = pthread_getaffinity_np(pthread_self(), sizeof job.cpus, &job.cpus) == 0;
        last_caller_id = caller_id;
    }
    long ticket = atomic_load_explicit(&posted, memory_order_relaxed) + 1;
    atomic_store_explicit(&posted, ticket, memory_order_release);
    pthread_mutex_lock(&sleep_lock); /* wakes the helper if it sleeps; no lost wake-up: it checks `posted` under this lock */
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&sleep_lock);
    panel_range(x, M, K, panels, N, bias, y, 0, half);
    for (long spins = 1; atomic_load_explicit(&finished, memory_order_acquire) != ticket; spins++) {
        _mm_pause();
        if (spins % SPIN_CHECK == 0)
            sched_yield();
    }
    pthread_mutex_unlock(&caller_lock);
    return 1;
}

/* How many halves the helper thread has computed (for tests). */
long small_gemm_helper_jobs(void) { return atomic_load(&helper_jobs); }

/* The CPUs (0-63, a bit each) the helper thread may run on, 0 before it starts (for tests). */
unsigned long long small_gemm_helper_cpus(void) {
    cpu_set_t cpus;
    unsigned long long mask = 0;
    if (helper_state != 1 || pthread_getaffinity_np(helper_thread, sizeof cpus, &cpus) != 0)
        return 0;
    for (int cpu = 0; cpu < 64; cpu++)
        if (CPU_ISSET(cpu, &cpus))
            mask |= 1ULL << cpu;
    return mask;
}
