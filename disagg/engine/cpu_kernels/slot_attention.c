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
 * weighted values are summed in registers, 32 columns at a time.
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
 * MXCSR's DAZ says); KV_UNIT puts the 2^8 back with the scale. The NaN codes would
 * land on 1.875: their exponent is set to all ones, a float16 NaN. */
#define KV_SCALED 1
#define KV_UNIT 256.0f
typedef unsigned char kv_t;
static inline __m128i fp8_halves(__m128i codes) { /* 8 codes in 16-bit lanes -> their float16s */
    __m128i half = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(codes, 8), 1), _mm_set1_epi16((short)0xbfff)); /* sign at 15, the rest at 7..13 */
    __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(half, _mm_set1_epi16(0x3f80)), _mm_set1_epi16(0x3f80));
    return _mm_or_si128(half, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
}
static inline __m256 load_kv(const kv_t *p) { return _mm256_cvtph_ps(fp8_halves(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)))); }
/* Sixteen at once: the same steps on 16-bit lanes, half the instructions per code. */
#define HAVE_LOAD_KV16 1
static inline void load_kv16(const kv_t *p, __m256 *lo, __m256 *hi) {
    __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 1), _mm256_set1_epi16((short)0xbfff));
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(half, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x3f80));
    half = _mm256_or_si256(half, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
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

/* The four dots q . k[t + j], j < 4, rows pos_stride apart, as one vector of 4. */
static inline __m128 dot4(const float *q, const kv_t *k, long pos_stride, long d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) { /* the sums in the order of the 8-column steps below */
        __m256 qlo = _mm256_loadu_ps(q + i), qhi = _mm256_loadu_ps(q + i + 8), lo, hi;
        load_kv16(k + i, &lo, &hi);
        a0 = _mm256_fmadd_ps(qhi, hi, _mm256_fmadd_ps(qlo, lo, a0));
        load_kv16(k + pos_stride + i, &lo, &hi);
        a1 = _mm256_fmadd_ps(qhi, hi, _mm256_fmadd_ps(qlo, lo, a1));
        load_kv16(k + 2 * pos_stride + i, &lo, &hi);
        a2 = _mm256_fmadd_ps(qhi, hi, _mm256_fmadd_ps(qlo, lo, a2));
        load_kv16(k + 3 * pos_stride + i, &lo, &hi);
        a3 = _mm256_fmadd_ps(qhi, hi, _mm256_fmadd_ps(qlo, lo, a3));
    }
    for (; i + 8 <= d; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qi, load_kv(k + i), a0);
        a1 = _mm256_fmadd_ps(qi, load_kv(k + pos_stride + i), a1);
        a2 = _mm256_fmadd_ps(qi, load_kv(k + 2 * pos_stride + i), a2);
        a3 = _mm256_fmadd_ps(qi, load_kv(k + 3 * pos_stride + i), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (i < d) {
        float tail[4] = {0, 0, 0, 0};
        for (long j = 0; j < 4; j++)
            for (long c = i; c < d; c++)
                tail[j] += q[c] * kv_float(k[j * pos_stride + c]);
        sums = _mm_add_ps(sums, _mm_loadu_ps(tail));
    }
    return sums;
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

/* out[0, d) = sum_t p[t] v[t] / sum over positions start.. start + length of one row's blocks,
 * the sums held in registers 32 columns at a time, in position order. v: the head's first
 * value (block 0, position 0); offsets from run_at are in positions, scaled by pos_stride. */
static void weighted_values(const float *p, const kv_t *v, const struct paged_rows *g, const long *table, long start, long length,
                            long pos_stride, long d, float sum, float *out) {
    __m256 divisor = _mm256_set1_ps(sum);
    long i = 0;
    for (; i + 32 <= d; i += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (long t = 0, at, run; t < length; t += run) {
            run = run_at(g, table, start + t, length - t, &at);
            for (long j = 0; j < run; j++) {
                if (p[t + j] == 0.0f)
                    continue;
                __m256 pt = _mm256_set1_ps(p[t + j]), x0, x1, x2, x3;
                const kv_t *vt = v + (at + j) * pos_stride + i;
                load_kv16(vt, &x0, &x1);
                load_kv16(vt + 16, &x2, &x3);
                a0 = _mm256_fmadd_ps(pt, x0, a0);
                a1 = _mm256_fmadd_ps(pt, x1, a1);
                a2 = _mm256_fmadd_ps(pt, x2, a2);
                a3 = _mm256_fmadd_ps(pt, x3, a3);
            }
        }
        _mm256_storeu_ps(out + i, _mm256_div_ps(a0, divisor));
        _mm256_storeu_ps(out + i + 8, _mm256_div_ps(a1, divisor));
        _mm256_storeu_ps(out + i + 16, _mm256_div_ps(a2, divisor));
        _mm256_storeu_ps(out + i + 24, _mm256_div_ps(a3, divisor));
    }
    for (; i + 8 <= d; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (long t = 0, at, run; t < length; t += run) {
            run = run_at(g, table, start + t, length - t, &at);
            for (long j = 0; j < run; j++)
                if (p[t + j] != 0.0f)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(p[t + j]), load_kv(v + (at + j) * pos_stride + i), a);
        }
        _mm256_storeu_ps(out + i, _mm256_div_ps(a, divisor));
    }
    for (; i < d; i++) {
        float a = 0.0f;
        for (long t = 0, at, run; t < length; t += run) {
            run = run_at(g, table, start + t, length - t, &at);
            for (long j = 0; j < run; j++)
                a += p[t + j] * kv_float(v[(at + j) * pos_stride + i]);
        }
        out[i] = a / sum;
    }
}

/* s[0, length) = q . k[p] for the row's positions p = start.. start + length, four at a time within a block. */
static void scores(const float *q, const kv_t *k, const struct paged_rows *g, const long *table, long start, long length, long pos_stride, long d, float *s) {
    for (long t = 0, at, run; t < length; t += run) {
        run = run_at(g, table, start + t, length - t, &at);
        const kv_t *kt = k + at * pos_stride;
        long j = 0;
        for (; j + 4 <= run; j += 4)
            _mm_storeu_ps(s + t + j, dot4(q, kt + j * pos_stride, pos_stride, d));
        for (; j < run; j++)
            s[t + j] = dot(q, kt + j * pos_stride, d);
    }
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
 * sc: NULL for a float cache, else the 8-bit cache's scales, advanced to the head's. */
static void attend_head(const float *q, long group, long d, const kv_t *k, const kv_t *v, const struct kv_scales *sc, const struct paged_rows *g,
                        const long *table, long start, long length, long pos_stride, const unsigned char *m, float scale, float *out, float *scratch) {
    for (long gi = 0; gi < group; gi++) {
        float *s = scratch + gi * length, top = -INFINITY;
        scores(q + gi * d, k, g, table, start, length, pos_stride, d, s);
        if (sc)
            scale_positions(s, sc->keys, sc->block_stride, g, table, start, length);
        for (long t = 0; t < length; t++) {
            s[t] = (!m || m[t]) ? s[t] * scale : -INFINITY;
            top = s[t] > top ? s[t] : top;
        }
        float sum = exp_shifted(s, length, top);
        if (sc) /* after the sum: it normalizes the weights alone */
            scale_positions(s, sc->values, sc->block_stride, g, table, start, length);
        weighted_values(s, v, g, table, start, length, pos_stride, d, sum, out + gi * d);
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
