/* One decode step's attention, read in place from the slot KV cache (float32).
 *
 * Built by slot_attention.py with -mavx2 -mfma and called through ctypes (which
 * releases the GIL for the call); one thread.
 *
 * Why: PyTorch's attention needs each row's keys and values as one batch, so a
 * step whose slots are not one contiguous run first copies every row's span out
 * of the cache (index_select), then reads the copy again. Here each row reads its
 * own slot's span where it lies: one pass over the bytes, no copy.
 *
 * Per row r and KV head h, for each of the `group` query heads that share h
 * (query head i reads KV head i / group, as transformers' repeat_kv expands them):
 *     s[t] = (q . k[t]) * scale where mask[r][t], else -inf
 *     out  = sum_t exp(s[t] - max s) v[t] / sum_t exp(s[t] - max s)
 * The exponentials come from glibc's vector expf (libmvec, within a few ulp).
 */
#include <immintrin.h>
#include <math.h>

__m256 _ZGVdN8v_expf(__m256 x); /* libmvec's expf over 8 lanes, AVX2 */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, long d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= d; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float tail = 0.0f;
    for (; i < d; i++)
        tail += a[i] * b[i];
    return hsum(_mm256_add_ps(s0, s1)) + tail;
}

/* scores[0, n) <- exp(scores - top), returns their sum (masked entries are -inf: exp gives 0). */
static float exp_shifted(float *scores, long n, float top) {
    __m256 shift = _mm256_set1_ps(top), total = _mm256_setzero_ps();
    long t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
        _mm256_storeu_ps(scores + t, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; t < n; t++) {
        scores[t] = expf(scores[t] - top);
        sum += scores[t];
    }
    return sum;
}

/* acc[0, d) += p * v[0, d) */
static inline void axpy(float *acc, float p, const float *v, long d) {
    __m256 pv = _mm256_set1_ps(p);
    long i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < d; i++)
        acc[i] += p * v[i];
}

/* q: [rows, q_heads, d] contiguous; keys/values: the layer's cache, element strides
 * slot_stride, head_stride, pos_stride (d contiguous); slots: [rows]; each row reads
 * positions [start, start + length) of its slot; mask: [rows][length] bytes (1: attend),
 * or NULL (every position); out: [rows, q_heads, d] contiguous; scratch: group *
 * (length + d) floats. A row whose mask hides every position gets NaN, as SDPA gives. */
void slot_attention(const float *q, long rows, long q_heads, long kv_heads, long d, const float *keys, const float *values,
                    long slot_stride, long head_stride, long pos_stride, const long *slots, long start, long length,
                    const unsigned char *mask, float scale, float *out, float *scratch) {
    long group = q_heads / kv_heads;
    float *scores = scratch, *acc = scratch + group * length;
    for (long r = 0; r < rows; r++) {
        const unsigned char *m = mask ? mask + r * length : 0;
        for (long h = 0; h < kv_heads; h++) {
            long base = slots[r] * slot_stride + h * head_stride + start * pos_stride;
            const float *k = keys + base, *v = values + base;
            const float *qh = q + (r * q_heads + h * group) * d;
            for (long g = 0; g < group; g++) {
                float *s = scores + g * length, top = -INFINITY;
                for (long t = 0; t < length; t++) {
                    s[t] = (!m || m[t]) ? dot(qh + g * d, k + t * pos_stride, d) * scale : -INFINITY;
                    top = s[t] > top ? s[t] : top;
                }
                float sum = exp_shifted(s, length, top);
                float *a = acc + g * d;
                for (long i = 0; i < d; i++)
                    a[i] = 0.0f;
                for (long t = 0; t < length; t++)
                    if (s[t] != 0.0f)
                        axpy(a, s[t], v + t * pos_stride, d);
                float *o = out + (r * q_heads + h * group + g) * d;
                for (long i = 0; i < d; i++)
                    o[i] = a[i] / sum;
            }
        }
    }
}
