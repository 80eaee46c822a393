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
 * The dots go four positions at a time (one horizontal sum for four), the
 * exponentials through glibc's vector expf (libmvec, within a few ulp), and the
 * weighted values are summed in registers, 16 columns at a time. The group's heads
 * go through the keys and values together (up to 4 at a time), so each row is loaded
 * and widened once for them, not once per head; each head's sums keep the order they
 * have for one head alone (the results do not depend on how many go together).
 *
 * The 8-bit builds (-DKV_INT8, -DKV_FP8: an --kv-cache-dtype cache) read codes, one
 * float32 scale per block and KV head: a position's value is code * scale. The codes
 * are widened exactly in registers; the scales are not applied per element but once
 * per position: the key's to its dot (q . (c s) = (q . c) s), the value's to its
 * softmax weight (sum_t p[t] (c[t] s[t]) = sum_t (p[t] s[t]) c[t]), the normalizing
 * sum taken before, over the weights alone. These builds export slot_attention_scaled.
 */
#include <immintrin.h>
#include <math.h>

__m256 _ZGVdN8v_expf(__m256 x); /* libmvec's expf over 8 lanes, AVX2 */

/* The cache's element: float32, bfloat16 (-DKV_BF16) or an 8-bit code (-DKV_INT8, -DKV_FP8),
 * widened exactly to float32 as it is read; q, the scores and the sums are float32 either way.
 * A widened code times KV_UNIT is the code's value (multiplied in with its scale). */
#if defined(KV_INT8)
/* int8 codes: sign-extended to 32 bits, then converted (exact: |code| <= 128). */
#define KV_SCALED 1
#define KV_UNIT 1.0f
typedef signed char kv_t;
static inline __m256 load_kv(const kv_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline float kv_float(kv_t x) { return (float)x; }
#elif defined(KV_FP8)
/* e4m3fn codes (sign, 4 exponent bits of bias 7, 3 mantissa bits; S.1111.111 is NaN).
 * Moved into the top of a float16's fields (exponent bias 15), every code is exactly
 * its value / 2^8, subnormals included (F16C widens float16 subnormals whatever
 * MXCSR's DAZ says); KV_UNIT puts the 2^8 back with the scale. A code sign-extended to
 * 16 bits and shifted left by 7 has its sign at bits 15 and 14 and its other 7 bits at
 * 13..7: clearing bit 14 gives the float16. The NaN codes would land on 1.875; they are
 * the codes whose bits 13..7 are all ones there, found with one OR and one compare, and
 * their lanes set to all ones (a float16 NaN): two instructions fewer per vector than
 * the zero-extended fields and a separate mask (fp8's widening is most of its cost). */
#define KV_SCALED 1
#define KV_UNIT 256.0f
typedef unsigned char kv_t;
#define FP8_HALVES(bits, set1, and, or, cmpeq, slli)                                                           \
    {                                                                                                        \
        bits = slli(bits, 7);                                                                                \
        bits = or(and(bits, set1((short)0xbfff)), cmpeq(or(bits, set1((short)0xc07f)), set1((short)0xffff))); \
    }
static inline __m256 load_kv(const kv_t *p) {
    __m128i bits = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    FP8_HALVES(bits, _mm_set1_epi16, _mm_and_si128, _mm_or_si128, _mm_cmpeq_epi16, _mm_slli_epi16)
    return _mm256_cvtph_ps(bits);
}
/* Sixteen at once: the same steps on 16-bit lanes, half the instructions per code. */
#define HAVE_LOAD_KV16 1
static inline void load_kv16(const kv_t *p, __m256 *lo, __m256 *hi) {
    __m256i bits = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    FP8_HALVES(bits, _mm256_set1_epi16, _mm256_and_si256, _mm256_or_si256, _mm256_cmpeq_epi16, _mm256_slli_epi16)
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
}
static inline float kv_float(kv_t x) {
    unsigned half = ((x & 0x80u) << 8) | ((x & 0x7fu) << 7);
    return _cvtsh_ss((unsigned short)((x & 0x7f) == 0x7f ? half | 0x7c00 : half));
}
#elif defined(KV_BF16)
#define KV_UNIT 1.0f
typedef unsigned short kv_t;
static inline __m256 load_kv(const kv_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float kv_float(kv_t x) {
    union { unsigned u; float f; } bits = {(unsigned)x << 16};
    return bits.f;
}
#else
#define KV_UNIT 1.0f
typedef float kv_t;
static inline __m256 load_kv(const kv_t *p) { return _mm256_loadu_ps(p); }
static inline float kv_float(kv_t x) { return x; }
#endif

#ifndef HAVE_LOAD_KV16
/* Elements p[0, 16) as two vectors of 8 (a build widens them together where that is cheaper). */
static inline void load_kv16(const kv_t *p, __m256 *lo, __m256 *hi) {
    *lo = load_kv(p);
    *hi = load_kv(p + 8);
}
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const kv_t *b, long d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) {
        __m256 lo, hi;
        load_kv16(b + i, &lo, &hi);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), lo, s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), hi, s1);
    }
    for (; i + 8 <= d; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_kv(b + i), s0);
    float tail = 0.0f;
    for (; i < d; i++)
        tail += a[i] * kv_float(b[i]);
    return hsum(_mm256_add_ps(s0, s1)) + tail;
}

/* The GQA group's query heads are taken up to GROUP_MAX at a time ("nh" below): each key
 * and value row is loaded and widened once per nh heads, not once per head (an 8-bit or
 * bf16 row costs more to widen than a float32 row to load). Each head's sums still run in
 * the order of one head alone, so results do not depend on nh. With 4 heads, the score
 * accumulators and the values' 8 (16 columns each) still fit AVX2's 16 registers.
 * These helpers are inlined with nh a constant (see BY_HEADS), their head loops unrolled. */
#define GROUP_MAX 4
#define INLINE static inline __attribute__((always_inline))

/* a[h] = the 8 lanes of q_h . k (q_h = q + h * d, h < nh) over columns [0, d - d % 8), in
 * the order of the 16- then 8-column steps; k is widened once for all nh heads. */
INLINE void lane_dots(const float *q, long nh, long d, const kv_t *k, __m256 *a) {
    for (long h = 0; h < nh; h++)
        a[h] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) {
        __m256 lo, hi;
        load_kv16(k + i, &lo, &hi);
        for (long h = 0; h < nh; h++)
            a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i + 8), hi, _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), lo, a[h]));
    }
    for (; i + 8 <= d; i += 8) {
        __m256 x = load_kv(k + i);
        for (long h = 0; h < nh; h++)
            a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), x, a[h]);
    }
}

/* s[h * s_stride + j] = q_h . k[j] for the four positions j < 4 (rows pos_stride apart) and
 * heads h < nh: one horizontal sum for four positions. A position's dots are taken for all
 * heads before the next position's (its row widened once); the pairs' hadds are taken as
 * soon as both are done, which keeps fewer vectors live than four per head. */
INLINE void dot4_heads(const float *q, long nh, long d, const kv_t *k, long pos_stride, float *s, long s_stride) {
    __m256 a0[GROUP_MAX], a1[GROUP_MAX], h01[GROUP_MAX];
    lane_dots(q, nh, d, k, a0);
    lane_dots(q, nh, d, k + pos_stride, a1);
    for (long h = 0; h < nh; h++)
        h01[h] = _mm256_hadd_ps(a0[h], a1[h]);
    lane_dots(q, nh, d, k + 2 * pos_stride, a0);
    lane_dots(q, nh, d, k + 3 * pos_stride, a1);
    long i = d - d % 8;
    for (long h = 0; h < nh; h++) {
        __m256 both = _mm256_hadd_ps(h01[h], _mm256_hadd_ps(a0[h], a1[h]));
        __m128 sums = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
        if (i < d) {
            const float *qh = q + h * d;
            float tail[4] = {0, 0, 0, 0};
            for (long j = 0; j < 4; j++)
                for (long c = i; c < d; c++)
                    tail[j] += qh[c] * kv_float(k[j * pos_stride + c]);
            sums = _mm_add_ps(sums, _mm_loadu_ps(tail));
        }
        _mm_storeu_ps(s + h * s_stride, sums);
    }
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

/* Where position p of a row lies: its block (from the row's block table) and its offset in it. */
struct paged_rows {
    const long *tables; /* [rows][table_stride]: block ids */
    long table_stride, block_size, block_stride;
};

/* The start of the run of positions from p to the end of p's block (at most `left`), and its length. */
static inline long run_at(const struct paged_rows *g, const long *table, long p, long left, long *offset) {
    long off = p % g->block_size;
    *offset = table[p / g->block_size] * g->block_stride + off;
    long run = g->block_size - off;
    return run < left ? run : left;
}

/* Asks for the lines of positions [*cursor, until) of a row (the KV head's rows at base), advancing *cursor:
 * the caller keeps it PREFETCH_AHEAD positions ahead of those it reads. A row's blocks lie wherever the pool
 * had room: under load, sequences growing side by side take blocks in turn, so a row's next block is far
 * from its last, and the CPU's prefetchers, which follow a stream, lose it at every block's end. Measured on
 * the Llama-3.2-1B shape, 8 rows of 1,024 positions in blocks of 16: the step took 1.35x the slot layout's
 * without prefetching. Spread over the positions rather than a whole next block asked for at once at each
 * block's start: those 64 requests (a block of 16 float32 lines of 64) outnumber the core's line-fill
 * buffers, so the core stalled on them at every block, where spread they overlap the dots. Measured on an
 * Ice Lake Xeon, one core, SmolLM-135M's 3 KV heads of 64 over 30 layers, blocks in random order: 32 rows of
 * 128 positions 27.5 -> 23.7 ms, of 512 107.6 -> 94.1, 8 rows of 1,024 57.0 -> 51.5 (the same bits); 8, 16
 * or 32 positions ahead measured alike. */
#define PREFETCH_AHEAD 16
INLINE void prefetch_until(const kv_t *base, const struct paged_rows *g, const long *table, long *cursor, long until, long pos_stride, long d) {
    for (; *cursor < until; (*cursor)++) {
        long p = *cursor;
        const char *row = (const char *)(base + (table[p / g->block_size] * g->block_stride + p % g->block_size) * pos_stride);
        for (long line = 0; line < d * (long)sizeof(kv_t); line += 64)
            _mm_prefetch(row + line, _MM_HINT_T0);
    }
}

/* acc[h] (and acc[GROUP_MAX + h] where wide) += p_h[t] v[t][i, i + 8 or 16) for the position
 * at offset t of p_h = p + h * length, whose value row starts at vt, for heads h < nh; a head
 * whose weight is 0 is skipped (a masked position's value is never read into its sums, NaN
 * or not) unless every_head: the caller has checked that none is. */
INLINE void weigh_position(const float *p, long nh, long length, long t, const kv_t *vt, int wide, int every_head, __m256 *acc) {
    __m256 x0, x1 = _mm256_setzero_ps();
    if (wide)
        load_kv16(vt, &x0, &x1);
    else
        x0 = load_kv(vt);
    for (long h = 0; h < nh; h++) {
        float w = p[h * length + t];
        if (every_head || w != 0.0f) {
            __m256 wh = _mm256_set1_ps(w);
            acc[h] = _mm256_fmadd_ps(wh, x0, acc[h]);
            if (wide)
                acc[GROUP_MAX + h] = _mm256_fmadd_ps(wh, x1, acc[GROUP_MAX + h]);
        }
    }
}

/* out[h * d + c] = sum_t p_h[t] v[t][c] / sums[h] for columns c in [i, i + 8 or 16) and heads
 * h < nh, over positions start.. start + length of one row's blocks; v: the KV head's first value
 * (block 0, position 0), offsets from run_at in positions, scaled by pos_stride. The sums are held
 * in registers (16 columns by 4 heads: 8 of AVX2's 16), in position order. Which weights are 0 is
 * found 8 positions at a time, with a compare per head: none (the usual case) takes every head
 * without a test per head and position, all (masked positions) skips the 8 rows unread. */
INLINE void weighted_columns(const float *p, long nh, const kv_t *v, const struct paged_rows *g, const long *table, long start, long length,
                             long pos_stride, long i, int wide, const float *sums, float *out, long d) {
    __m256 acc[2 * GROUP_MAX];
    for (long h = 0; h < 2 * GROUP_MAX; h++)
        acc[h] = _mm256_setzero_ps();
    long cursor = start; /* the next position to prefetch */
    for (long t = 0, at, run; t < length; t += run) {
        run = run_at(g, table, start + t, length - t, &at);
        const kv_t *vt = v + at * pos_stride + i;
        long j = 0;
        for (; j + 8 <= run; j += 8) {
            if (i == 0) { /* the first columns' pass reads each line first; the later ones find it cached */
                long ahead = t + j + 8 + PREFETCH_AHEAD;
                prefetch_until(v, g, table, &cursor, start + (ahead < length ? ahead : length), pos_stride, d);
            }
            __m256 any = _mm256_setzero_ps(), all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (long h = 0; h < nh; h++) {
                __m256 zero = _mm256_cmp_ps(_mm256_loadu_ps(p + h * length + t + j), _mm256_setzero_ps(), _CMP_EQ_OQ);
                any = _mm256_or_ps(any, zero);
                all = _mm256_and_ps(all, zero);
            }
            if (_mm256_testz_ps(any, any)) {
                for (long u = j; u < j + 8; u++)
                    weigh_position(p, nh, length, t + u, vt + u * pos_stride, wide, 1, acc);
            } else if (!_mm256_testc_ps(all, _mm256_castsi256_ps(_mm256_set1_epi32(-1)))) {
                for (long u = j; u < j + 8; u++)
                    weigh_position(p, nh, length, t + u, vt + u * pos_stride, wide, 0, acc);
            }
        }
        for (; j < run; j++)
            weigh_position(p, nh, length, t + j, vt + j * pos_stride, wide, 0, acc);
    }
    for (long h = 0; h < nh; h++) {
        _mm256_storeu_ps(out + h * d + i, _mm256_div_ps(acc[h], _mm256_set1_ps(sums[h])));
        if (wide)
            _mm256_storeu_ps(out + h * d + i + 8, _mm256_div_ps(acc[GROUP_MAX + h], _mm256_set1_ps(sums[h])));
    }
}

/* out[h * d + c] = sum_t p_h[t] v[t][c] / sums[h], c < d, for heads h < nh (p_h = p + h * length):
 * 16 columns at a time, then 8, then the last d % 8 one by one. */
INLINE void weighted_values_heads(const float *p, long nh, const kv_t *v, const struct paged_rows *g, const long *table, long start, long length,
                                  long pos_stride, long d, const float *sums, float *out) {
    long i = 0;
    for (; i + 16 <= d; i += 16)
        weighted_columns(p, nh, v, g, table, start, length, pos_stride, i, 1, sums, out, d);
    for (; i + 8 <= d; i += 8)
        weighted_columns(p, nh, v, g, table, start, length, pos_stride, i, 0, sums, out, d);
    for (long h = 0; h < nh; h++) /* the last d % 8 columns: no skip of weight 0 here (as ever) */
        for (long c = i; c < d; c++) {
            float a = 0.0f;
            for (long t = 0, at, run; t < length; t += run) {
                run = run_at(g, table, start + t, length - t, &at);
                for (long j = 0; j < run; j++)
                    a += p[h * length + t + j] * kv_float(v[(at + j) * pos_stride + c]);
            }
            out[h * d + c] = a / sums[h];
        }
}

/* s[h * length + t] = q_h . k[p] for the row's positions p = start + t, t < length, and heads h < nh:
 * four positions at a time within a block, a run's last few one by one (dot, per head). */
INLINE void scores_heads(const float *q, long nh, const kv_t *k, const struct paged_rows *g, const long *table, long start, long length,
                         long pos_stride, long d, float *s) {
    long cursor = start; /* the next position to prefetch */
    for (long t = 0, at, run; t < length; t += run) {
        run = run_at(g, table, start + t, length - t, &at);
        const kv_t *kt = k + at * pos_stride;
        long j = 0;
        for (; j + 4 <= run; j += 4) {
            long ahead = t + j + 4 + PREFETCH_AHEAD;
            prefetch_until(k, g, table, &cursor, start + (ahead < length ? ahead : length), pos_stride, d);
            dot4_heads(q, nh, d, kt + j * pos_stride, pos_stride, s + t + j, length);
        }
        for (; j < run; j++)
            for (long h = 0; h < nh; h++)
                s[h * length + t + j] = dot(q + h * d, kt + j * pos_stride, d);
    }
}

/* One function per head count, so each has nh a constant (its head loops unrolled, its
 * accumulators in registers); BY_HEADS calls the one for n. */
#define HEADS_VARIANTS(n)                                                                                                                          \
    static __attribute__((noinline)) void scores_##n(const float *q, const kv_t *k, const struct paged_rows *g, const long *table, long start, long length, long pos_stride, \
                           long d, float *s) {                                                                                                      \
        scores_heads(q, n, k, g, table, start, length, pos_stride, d, s);                                                                          \
    }                                                                                                                                              \
    static __attribute__((noinline)) void weighted_values_##n(const float *p, const kv_t *v, const struct paged_rows *g, const long *table, long start, long length,          \
                                    long pos_stride, long d, const float *sums, float *out) {                                                      \
        weighted_values_heads(p, n, v, g, table, start, length, pos_stride, d, sums, out);                                                         \
    }
HEADS_VARIANTS(1)
HEADS_VARIANTS(2)
HEADS_VARIANTS(3)
HEADS_VARIANTS(4)
#define BY_HEADS(n, name, ...)                                                                                                                     \
    switch (n) {                                                                                                                                   \
    case 1: name##_1(__VA_ARGS__); break;                                                                                                          \
    case 2: name##_2(__VA_ARGS__); break;                                                                                                          \
    case 3: name##_3(__VA_ARGS__); break;                                                                                                          \
    default: name##_4(__VA_ARGS__); break;                                                                                                         \
    }

/* An 8-bit cache's scales: [blocks][kv_heads] floats, block b's of head h at b * block_stride + h. */
struct kv_scales {
    const float *keys, *values;
    long block_stride;
};

/* x[t] *= the scale (times KV_UNIT) of the block holding position start + t, for t < length;
 * head_scales: the head's scale of block 0. One multiply per position: the key's on its dot,
 * or the value's on its softmax weight. */
static void scale_positions(float *x, const float *head_scales, long scale_block_stride, const struct paged_rows *g, const long *table,
                            long start, long length) {
    for (long t = 0, at, run; t < length; t += run) {
        run = run_at(g, table, start + t, length - t, &at);
        float factor = head_scales[table[(start + t) / g->block_size] * scale_block_stride] * KV_UNIT;
        for (long j = 0; j < run; j++)
            x[t + j] *= factor;
    }
}

/* One row's `group` query heads q[gi * d] over one KV head (k, v: its first key and value) -> out[gi * d];
 * sc: NULL for a float cache, else the 8-bit cache's scales, advanced to the head's. The heads go
 * GROUP_MAX at a time through the keys and the values (each row widened once for them); between,
 * each head's scores are scaled, masked and exponentiated on their own, as one head's would be. */
static void attend_head(const float *q, long group, long d, const kv_t *k, const kv_t *v, const struct kv_scales *sc, const struct paged_rows *g,
                        const long *table, long start, long length, long pos_stride, const unsigned char *m, float scale, float *out, float *scratch) {
    for (long first = 0; first < group; first += GROUP_MAX) {
        long nh = group - first < GROUP_MAX ? group - first : GROUP_MAX;
        float sums[GROUP_MAX];
        BY_HEADS(nh, scores, q + first * d, k, g, table, start, length, pos_stride, d, scratch)
        for (long h = 0; h < nh; h++) {
            float *s = scratch + h * length, top = -INFINITY;
            if (sc)
                scale_positions(s, sc->keys, sc->block_stride, g, table, start, length);
            for (long t = 0; t < length; t++) {
                s[t] = (!m || m[t]) ? s[t] * scale : -INFINITY;
                top = s[t] > top ? s[t] : top;
            }
            sums[h] = exp_shifted(s, length, top);
            if (sc) /* after the sum: it normalizes the weights alone */
                scale_positions(s, sc->values, sc->block_stride, g, table, start, length);
        }
        BY_HEADS(nh, weighted_values, scratch, v, g, table, start, length, pos_stride, d, sums, out + first * d)
    }
}

static void attend_rows(const float *q, long rows, long q_heads, long kv_heads, long d, const kv_t *keys, const kv_t *values,
                        long block_stride, long head_stride, long pos_stride, const long *tables, long table_stride, long block_size,
                        long start, long length, const unsigned char *mask, float scale, float *out, float *scratch, const struct kv_scales *sc) {
    long group = q_heads / kv_heads;
    struct paged_rows g = {tables, table_stride, block_size, block_stride / pos_stride};
    for (long r = 0; r < rows; r++) {
        const unsigned char *m = mask ? mask + r * length : 0;
        const long *table = tables + r * table_stride;
        for (long h = 0; h < kv_heads; h++) {
            struct kv_scales head = sc ? (struct kv_scales){sc->keys + h, sc->values + h, sc->block_stride} : (struct kv_scales){0, 0, 0};
            long first = (r * q_heads + h * group) * d;
            attend_head(q + first, group, d, keys + h * head_stride, values + h * head_stride, sc ? &head : 0, &g, table, start, length, pos_stride,
                        m, scale, out + first, scratch);
        }
    }
}

/* q: [rows, q_heads, d] contiguous; keys/values: a layer's cache of blocks, element strides
 * block_stride, head_stride, pos_stride (d contiguous); row r reads positions [start, start +
 * length), position p in block tables[r * table_stride + p / block_size] at offset p % block_size
 * (the slot layout is one block of every position per slot: tables = slots, table_stride 1);
 * mask: [rows][length] bytes (1: attend), or NULL (every position); out: [rows, q_heads, d]
 * contiguous; scratch: group * length floats. A row whose mask hides every position gets NaN, as SDPA gives. */
#ifndef KV_SCALED
void slot_attention(const float *q, long rows, long q_heads, long kv_heads, long d, const kv_t *keys, const kv_t *values,
                    long block_stride, long head_stride, long pos_stride, const long *tables, long table_stride, long block_size,
                    long start, long length, const unsigned char *mask, float scale, float *out, float *scratch) {
    attend_rows(q, rows, q_heads, kv_heads, d, keys, values, block_stride, head_stride, pos_stride, tables, table_stride, block_size, start, length,
                mask, scale, out, scratch, 0);
}
#else
/* The same over 8-bit codes, with key_scales/value_scales [blocks][kv_heads] floats: block b's of
 * head h at b * scale_block_stride + h. */
void slot_attention_scaled(const float *q, long rows, long q_heads, long kv_heads, long d, const kv_t *keys, const kv_t *values,
                           long block_stride, long head_stride, long pos_stride, const long *tables, long table_stride, long block_size,
                           long start, long length, const unsigned char *mask, float scale, float *out, float *scratch,
                           const float *key_scales, const float *value_scales, long scale_block_stride) {
    struct kv_scales sc = {key_scales, value_scales, scale_block_stride};
    attend_rows(q, rows, q_heads, kv_heads, d, keys, values, block_stride, head_stride, pos_stride, tables, table_stride, block_size, start, length,
                mask, scale, out, scratch, &sc);
}
#endif
