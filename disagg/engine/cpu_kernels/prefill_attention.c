/* A long prompt's causal attention in bf16, blocked, on VDPBF16PS (AVX512_BF16).
 *
 * Why: at 1,024 tokens PyTorch's SDPA for CPU computes a bf16 prefill's attention at
 * ~50 GFLOP/s on this project's CPU (the same speed as in float32), ~40% of the whole
 * prefill. Here the scores and the weighted sum are each one VDPBF16PS per 16 lanes
 * and pair of products.
 *
 * The arithmetic follows PyTorch's flash attention for CPU in bf16 (its order of
 * roundings, not of sums): the scores are bf16 products summed in float32, scaled in
 * float32; the softmax runs online over blocks of KEYS keys in float32 (running
 * maximum, exp, running sum of the unrounded exps); the exps are rounded to bf16 for
 * the weighted sum of values, summed in float32; the output is that sum over the
 * running sum, rounded once to bf16. Query row i stands at position kv_len - q_rows + i
 * and attends over keys 0..its position (a prompt past a cached prefix included).
 *
 * Built by prefill_attention.py with -mavx512f -mavx512bf16 -fopenmp and called through
 * ctypes (which releases the GIL): the keys and values of each kv head packed once
 * (prefill_pack), then tasks of ROWS query rows of one head, on torch's threads.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <string.h>

typedef unsigned short bf16;

__m512 _ZGVeN16v_expf(__m512 x); /* libmvec's expf over 16 lanes, AVX-512 */

#define ROWS 4     /* query rows in a task: ROWS x 4 score vectors and ROWS x 4 output vectors in registers */
#define CHUNK 16   /* keys per score vector */
#define KEYS 64    /* keys per block: 4 score vectors */

/* The floats of work one thread needs, and the bf16 elements one kv head's packed keys (as many for its values) take. */
long prefill_attention_work(long d) { return ROWS * d; }
long prefill_packed_size(long kv_len, long d) { return (kv_len + KEYS - 1) / KEYS * KEYS * d; }

static inline unsigned pair_at(const bf16 *p) { /* two bf16 as one 32-bit lane, for a broadcast */
    unsigned u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* One kv head's keys [len, d] (rows key_row_stride apart) for the scores: for key block b,
 * pair of dimensions p and chunk c of 16 keys, 32 bf16 at ((b * d/2 + p) * 4 + c) * 32:
 * key j's dimensions 2p and 2p+1 at 2j and 2j+1, what VDPBF16PS multiplies by a query's
 * pair broadcast. Its values [len, d] for the output: for pair of keys q and 16 dimensions
 * g, 32 bf16 at (q * d/16 + g) * 32: dimension 16g + i of keys 2q and 2q+1 at 2i and 2i+1.
 * Both padded with zeros to whole blocks (a padded key's score is masked, its value 0). */
void prefill_pack(const bf16 *keys, long key_row_stride, const bf16 *values, long value_row_stride, long len, long d, bf16 *packed_keys,
                  bf16 *packed_values) {
    long padded = (len + KEYS - 1) / KEYS * KEYS, pairs = d / 2, groups = d / 16;
    for (long b = 0; b < padded / KEYS; b++)
        for (long p = 0; p < pairs; p++)
            for (long c = 0; c < KEYS / CHUNK; c++) {
                bf16 *to = packed_keys + ((b * pairs + p) * (KEYS / CHUNK) + c) * 2 * CHUNK;
                for (long j = 0; j < CHUNK; j++) {
                    long key = b * KEYS + c * CHUNK + j;
                    to[2 * j] = key < len ? keys[key * key_row_stride + 2 * p] : 0;
                    to[2 * j + 1] = key < len ? keys[key * key_row_stride + 2 * p + 1] : 0;
                }
            }
    for (long q = 0; q < padded / 2; q++)
        for (long g = 0; g < groups; g++) {
            bf16 *to = packed_values + (q * groups + g) * 32;
            for (long i = 0; i < 16; i++) {
                long dim = g * 16 + i;
                to[2 * i] = 2 * q < len ? values[2 * q * value_row_stride + dim] : 0;
                to[2 * i + 1] = 2 * q + 1 < len ? values[(2 * q + 1) * value_row_stride + dim] : 0;
            }
        }
}

struct prefill_job {
    const bf16 *query; /* [q_heads, q_rows, d]: these strides, d contiguous */
    long query_head_stride, query_row_stride, q_rows, q_heads;
    const bf16 *packed_keys, *packed_values; /* per kv head, prefill_packed_size apart */
    long kv_heads, kv_len, d;
    float scale;
    bf16 *out; /* [q_rows, q_heads, d]: these strides, d contiguous */
    long out_head_stride, out_row_stride;
};

/* Rows row0.. row0 + rows - 1 (at most ROWS) of one head. o: ROWS * d floats. */
static void task(const struct prefill_job *job, long head, long row0, long rows, float *o) {
    long d = job->d, pairs = d / 2, groups = d / 16, offset = job->kv_len - job->q_rows;
    long packed = prefill_packed_size(job->kv_len, d), kv_head = head / (job->q_heads / job->kv_heads);
    const bf16 *keys = job->packed_keys + kv_head * packed, *values = job->packed_values + kv_head * packed;
    const bf16 *q[ROWS];
    long position[ROWS];
    float maximum[ROWS], sum[ROWS];
    bf16 probs[ROWS][KEYS] __attribute__((aligned(64)));
    for (long r = 0; r < ROWS; r++) { /* a short task repeats its last row: computed, never stored */
        long row = row0 + (r < rows ? r : rows - 1);
        q[r] = job->query + head * job->query_head_stride + row * job->query_row_stride;
        position[r] = offset + row;
        maximum[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    memset(o, 0, ROWS * d * sizeof(float));
    const __m512 scale = _mm512_set1_ps(job->scale), minus_infinity = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    long blocks = position[ROWS - 1] / KEYS + 1; /* every block holding a key some row attends to */
    for (long b = 0; b < blocks; b++) {
        __m512 s[ROWS][4];
        for (long r = 0; r < ROWS; r++)
            for (long c = 0; c < 4; c++)
                s[r][c] = _mm512_setzero_ps();
        const bf16 *kb = keys + b * pairs * KEYS * 2;
        for (long p = 0; p < pairs; p++) {
            const bf16 *kp = kb + p * KEYS * 2;
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp), k1 = (__m512bh)_mm512_loadu_si512(kp + 32);
            __m512bh k2 = (__m512bh)_mm512_loadu_si512(kp + 64), k3 = (__m512bh)_mm512_loadu_si512(kp + 96);
            for (long r = 0; r < ROWS; r++) {
                __m512bh qp = (__m512bh)_mm512_set1_epi32((int)pair_at(q[r] + 2 * p));
                s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qp);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qp);
                s[r][2] = _mm512_dpbf16_ps(s[r][2], k2, qp);
                s[r][3] = _mm512_dpbf16_ps(s[r][3], k3, qp);
            }
        }
        /* The online softmax: keys past a row's position score -inf (exp 0). Block 0 holds key 0,
         * which every row attends to, so a row's maximum is finite from block 0 on. */
        for (long r = 0; r < ROWS; r++) {
            __m512 x[4], top = minus_infinity;
            __m512i last = _mm512_set1_epi32((int)(position[r] - b * KEYS));
            for (long c = 0; c < 4; c++) {
                __mmask16 attended = _mm512_cmp_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32((int)(c * CHUNK))), last, _MM_CMPINT_LE);
                x[c] = _mm512_mask_mul_ps(minus_infinity, attended, s[r][c], scale);
                top = _mm512_max_ps(top, x[c]);
            }
            float block_max = _mm512_reduce_max_ps(top);
            float new_max = block_max > maximum[r] ? block_max : maximum[r];
            float correction = expf(maximum[r] - new_max); /* 0 at block 0 (exp(-inf)) */
            __m512 m = _mm512_set1_ps(new_max), total = _mm512_setzero_ps();
            for (long c = 0; c < 4; c++) {
                __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(x[c], m));
                total = _mm512_add_ps(total, e);
                _mm256_store_si256((__m256i *)(probs[r] + c * CHUNK), (__m256i)_mm512_cvtneps_pbh(e));
            }
            sum[r] = sum[r] * correction + _mm512_reduce_add_ps(total);
            maximum[r] = new_max;
            if (correction != 1.0f) {
                __m512 scaled = _mm512_set1_ps(correction);
                for (long i = 0; i < d; i += 16)
                    _mm512_storeu_ps(o + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + i), scaled));
            }
        }
        /* o += probs (bf16) x the block's values, 4 groups of 16 dimensions at a time. */
        for (long g0 = 0; g0 < groups; g0 += 4) {
            __m512 acc[ROWS][4];
            for (long r = 0; r < ROWS; r++)
                for (long g = 0; g < 4; g++)
                    acc[r][g] = _mm512_loadu_ps(o + r * d + (g0 + g) * 16);
            for (long pair = 0; pair < KEYS / 2; pair++) {
                const bf16 *vp = values + ((b * KEYS / 2 + pair) * groups + g0) * 32;
                __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp), v1 = (__m512bh)_mm512_loadu_si512(vp + 32);
                __m512bh v2 = (__m512bh)_mm512_loadu_si512(vp + 64), v3 = (__m512bh)_mm512_loadu_si512(vp + 96);
                for (long r = 0; r < ROWS; r++) {
                    __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair_at(probs[r] + 2 * pair));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, pp);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, pp);
                    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], v2, pp);
                    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], v3, pp);
                }
            }
            for (long r = 0; r < ROWS; r++)
                for (long g = 0; g < 4; g++)
                    _mm512_storeu_ps(o + r * d + (g0 + g) * 16, acc[r][g]);
        }
    }
    for (long r = 0; r < rows; r++) {
        bf16 *to = job->out + (row0 + r) * job->out_row_stride + head * job->out_head_stride;
        __m512 inverse = _mm512_set1_ps(1.0f / sum[r]);
        for (long i = 0; i < d; i += 16)
            _mm256_storeu_si256((__m256i *)(to + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * d + i), inverse)));
    }
}

/* The job on `threads` threads of OpenMP's team: first each kv head's keys and values
 * packed (into the job's buffers; keys and values [kv_heads, kv_len, d], each with its
 * strides), then the q_heads * ceil(q_rows / ROWS) tasks, each claimed by whichever thread
 * is free (a thread that shares its core with another process claims fewer, where an even
 * split would leave the others waiting for it): task t is rows ROWS * (t % tiles).. of head
 * t / tiles (one head's tiles in a row, so its packed keys and values stay in the caches).
 * Each task computes its rows whole, so the output does not depend on who claimed what.
 * Built with -fopenmp, the team is the one torch's own products run on: PyTorch's wheel
 * loads libgomp.so.1, which this library's needs then resolve to, so its threads, still
 * spinning from the last product, take this job rather than competing with other threads
 * for the cores. work: threads * prefill_attention_work floats. */
void prefill_attention(const struct prefill_job *job, const bf16 *keys, long key_head_stride, long key_row_stride, const bf16 *values,
                       long value_head_stride, long value_row_stride, int threads, float *work) {
    long tiles = (job->q_rows + ROWS - 1) / ROWS, packed = prefill_packed_size(job->kv_len, job->d);
    long next_head = 0, next_task = 0; /* what the team claims next */
#pragma omp parallel num_threads(threads)
    {
        long me = omp_get_thread_num(), h, t;
        while ((h = __atomic_fetch_add(&next_head, 1, __ATOMIC_RELAXED)) < job->kv_heads)
            prefill_pack(keys + h * key_head_stride, key_row_stride, values + h * value_head_stride, value_row_stride, job->kv_len, job->d,
                         (bf16 *)job->packed_keys + h * packed, (bf16 *)job->packed_values + h * packed);
#pragma omp barrier
        while ((t = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED)) < job->q_heads * tiles) {
            long head = t / tiles, row0 = (t % tiles) * ROWS;
            long rows = job->q_rows - row0 < ROWS ? job->q_rows - row0 : ROWS;
            task(job, head, row0, rows, work + me * prefill_attention_work(job->d));
        }
    }
}
