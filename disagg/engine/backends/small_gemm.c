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
 * - While a chunk is computed, the next one (the next bytes in memory) is
 *   prefetched, so the stream from memory overlaps the FMAs.
 *
 * Every row is summed in the same order (k ascending within a chunk, chunks in
 * turn) whatever M is, so a row's result does not depend on the other rows of
 * the batch.
 */
#include <immintrin.h>

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
/* One chunk row of the panel (24 floats, 96 bytes), and a prefetch of the same row of the chunk after it. */
#define LOAD_W                                                         \
    const float *w = chunk + k * NR;                                   \
    _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);              \
    _mm_prefetch((const char *)(w + ahead + 16), _MM_HINT_T0);         \
    __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8), w2 = _mm256_load_ps(w + 16);

#define BLOCK(rows, declare, accumulate, store)                                                              \
    static void block##rows(const float *x, long ldx, const float *chunk, long kn, long ahead, float *y,     \
                            long ldy, const float *bias, int ncols, int first) {                            \
        declare for (long k = 0; k < kn; k++) { LOAD_W accumulate } store                                   \
    }

BLOCK(4, DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3), STORE(0) STORE(1) STORE(2) STORE(3))
BLOCK(3, DECLARE(0) DECLARE(1) DECLARE(2), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2), STORE(0) STORE(1) STORE(2))
BLOCK(2, DECLARE(0) DECLARE(1), ACCUMULATE(0) ACCUMULATE(1), STORE(0) STORE(1))
BLOCK(1, DECLARE(0), ACCUMULATE(0), STORE(0))

/* x: [M, K] row-major; panels: ceil(N / NR) panels of [K][NR] (columns past N zero);
 * bias: [N] or NULL; y: [M, N] row-major, written whole. */
void small_gemm(const float *x, long M, long K, const float *panels, long N, const float *bias, float *y) {
    long count = (N + NR - 1) / NR;
    for (long p = 0; p < count; p++) {
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
