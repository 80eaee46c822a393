/* Each row's greedy token: the index of its first maximum, as torch.argmax gives it.
 *
 * Why: PyTorch's argmax over the last dimension on CPU is a scalar loop. Over SmolLM-135M's
 * 49,152 logits it took 106 us a row on one core of an Ice Lake Xeon (its amax 6 us): 3.2 ms
 * of a 32-row decode step, 0.8 ms of an 8-row one. Here the maximum comes first, eight lanes
 * at a time, then the first index holding it: two reads of a row that is still in the caches.
 *
 * torch.argmax's answer exactly: the lowest index among equal maxima (-0.0 equals +0.0, so
 * the first of either), and where a row holds a NaN, the first NaN (NaN counts as the largest).
 *
 * Built by small_gemm.load_library with -mavx2 (every host a kernel of this package runs on). */
#include <immintrin.h>

/* The largest value of x[0, n), and whether any is NaN. */
static float row_max(const float *x, long n, int *has_nan) {
    __m256 best = _mm256_set1_ps(-__builtin_inff()), unordered = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float lanes[8], m = -__builtin_inff();
    _mm256_storeu_ps(lanes, best);
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (int j = 0; j < 8; j++)
        m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *has_nan = nan;
    return m;
}

/* The first index i with x[i] == target (or, nan, with x[i] a NaN); n if none. */
static long first_index(const float *x, long n, float target, int nan) {
    __m256 t = _mm256_set1_ps(target);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        if (hits)
            return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == target)
            return i;
    return n;
}

/* out[r] = the first maximum's index of row r of x ([rows, n], row stride ld), for rows with n > 0. */
void greedy_rows(const float *x, long rows, long n, long ld, long *out) {
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * ld;
        int nan;
        float m = row_max(row, n, &nan);
        out[r] = first_index(row, n, m, nan);
    }
}
