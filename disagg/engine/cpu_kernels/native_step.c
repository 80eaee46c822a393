/* One decode step of a Llama-shaped model in one call: every layer,
 * the final norm and the LM head, for the few rows of a continuous batch; or one
 * short prompt's prefill, its rows one slot of a K/V buffer of its own.
 *
 * Built by native_step.py with -mavx2 -mfma -ffp-contract=off and called through
 * ctypes (which releases the GIL for the call); the products and the attention
 * are small_gemm.c's and slot_attention.c's own functions, handed over as
 * pointers, so the helper thread that shares the products is the one process-wide.
 *
 * Why: in transformers' modules, at one row, the products take ~18 of a ~34 ms
 * step on this project's CPU (reading 538 MB at ~30 GB/s); the rest is
 * hundreds of small aten calls and the Python between them. Here the rest is a
 * few loops over a few KB per layer.
 *
 * The arithmetic follows transformers' Llama, Mistral and Qwen2 modules, in
 * their order of operations (no fused multiply-adds outside the kernels:
 * -ffp-contract=off keeps a * b + c two roundings, as PyTorch computes it):
 *     h = rmsnorm(x) = w * (x * (1 / sqrt(mean(x^2) + eps)))
 *     q, k, v = h Wq, h Wk, h Wv  (one product over their panels end to end)
 *     q, k = q cos + rotate_half(q) sin, the same for k; k and v into the slot
 *     x = x + attention(q, the slot's keys and values) Wo
 *     x = x + (silu(h Wgate) * (h Wup)) Wdown,  h = rmsnorm(x) with the second norm
 *     logits = rmsnorm(x) Wlm
 * The sums differ from PyTorch's only in order (the norm's mean, the kernels'
 * dots) and silu's exp comes from glibc's vector expf, not Sleef's: native_step.py
 * checks the logits against transformers' own step at start-up.
 *
 * Built with -DKV_INT8 or -DKV_FP8 (an --kv-cache-dtype cache), the decode step's cache
 * holds 8-bit codes and a float32 scale per block and KV head: each row's new K/V line
 * is appended with exactly QuantizedBlocks.append_lines' arithmetic (append_line below:
 * the eager step's and the C step's caches hold the same bytes for the same lines), and
 * the attention is slot_attention.c's 8-bit build, which applies the scales as it reads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

__m256 _ZGVdN8v_expf(__m256 x); /* libmvec's expf over 8 lanes, AVX2 */

/* What the model stores: its embedding and its K/V lines, float32, or (built with
 * -DMODEL_BF16) bfloat16. The step computes in float32 either way: a row's hidden
 * state, norms, rotations and sums never round to bf16; a K/V line rounds once as
 * it is written (to nearest, ties to even, as PyTorch's conversion), as a bf16
 * model's cache holds it. The weights' dtype is the products' business (their
 * panels go by pointer to small_gemm's build for that dtype). */
#ifdef MODEL_BF16
typedef unsigned short store_t;
static inline float widen(store_t x) {
    union { unsigned u; float f; } bits = {(unsigned)x << 16};
    return bits.f;
}
static inline store_t narrow(float f) {
    union { float f; unsigned u; } bits = {f};
    if ((bits.u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN (quiet) */
        return (store_t)((bits.u >> 16) | 0x40u);
    return (store_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
}
#else
typedef float store_t;
static inline float widen(store_t x) { return x; }
static inline store_t narrow(float f) { return f; }
#endif

static void load_line(float *to, const store_t *from, long n) {
    for (long i = 0; i < n; i++)
        to[i] = widen(from[i]);
}

static inline void store_line(store_t *to, const float *from, long n) {
    for (long i = 0; i < n; i++)
        to[i] = narrow(from[i]);
}

/* What the K/V cache holds: the model's dtype, or (-DKV_INT8, -DKV_FP8) 8-bit codes, each
 * block and KV head with a float32 scale (a value is code * scale). */
#if defined(KV_INT8) || defined(KV_FP8)
#define KV_SCALED 1
#endif

#if defined(KV_INT8)
typedef signed char kv_t;
#define LARGEST_CODE 127.0f
/* Clamped to +-127 and rounded half to even (nearbyintf, the default rounding mode), as to_codes' clamp().round(). */
static inline kv_t to_code(float x) {
    float c = x < -127.0f ? -127.0f : (x > 127.0f ? 127.0f : x);
    return (kv_t)nearbyintf(c);
}
static inline float code_value(kv_t c) { return (float)c; }
#elif defined(KV_FP8)
typedef unsigned char kv_t; /* float8 e4m3fn: S.EEEE.MMM, exponent bias 7, no infinities, S.1111.111 NaN */
#define LARGEST_CODE 448.0f
/* Clamped to +-448, then to the nearest e4m3fn value, ties to even, as torch's float32 -> float8_e4m3fn cast. */
static inline kv_t to_code(float x) {
    union { float f; unsigned u; } bits = {x < -448.0f ? -448.0f : (x > 448.0f ? 448.0f : x)};
    unsigned sign = (bits.u >> 24) & 0x80u, magnitude = bits.u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) /* NaN (clamp passes it through) */
        return (kv_t)(sign | 0x7fu);
    if (magnitude < (121u << 23)) { /* below 2^-6, e4m3's least normal: a multiple of 2^-9 (exact in float32), rounded; 8 is 2^-6 itself */
        union { unsigned u; float f; } m = {magnitude};
        return (kv_t)(sign | (unsigned)nearbyintf(m.f * 512.0f));
    }
    /* A normal: float32's 23 mantissa bits rounded to 3 (nearest, ties to even; a carry moves into the
     * exponent), the exponent rebiased from 127 to 7. 448 is the largest, so nothing reaches NaN's code. */
    unsigned rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
    return (kv_t)(sign | ((rounded - (120u << 23)) >> 20));
}
/* A code's value, exactly (as torch's float8_e4m3fn -> float32). */
static inline float code_value(kv_t c) {
    unsigned exponent = (c >> 3) & 15u, mantissa = c & 7u;
    union { unsigned u; float f; } bits = {((exponent + 120u) << 23) | (mantissa << 20)};
    float value = exponent ? bits.f : (float)mantissa * (1.0f / 512.0f);
    if ((c & 0x7fu) == 0x7fu)
        value = NAN;
    return c & 0x80u ? -value : value;
}
#else
typedef store_t kv_t;
#endif

#ifdef KV_SCALED
/* x[0, n) -> codes (the values already divided by their scale): the test's window on to_code. */
void native_codes(const float *x, long n, kv_t *codes) {
    for (long i = 0; i < n; i++)
        codes[i] = to_code(x[i]);
}

/* codes[0, n) coded again under a grown scale: code * (old / new), as append_lines recodes a block. */
static void recode(kv_t *codes, long n, float ratio) {
    for (long i = 0; i < n; i++)
        codes[i] = to_code(code_value(codes[i]) * ratio);
}

/* One row's new line at `offset` of one block and KV head: codes [block_size][d] (that block's and
 * head's), *scale their scale. QuantizedBlocks.append_lines' arithmetic, in its order, in float32:
 * the line first rounds to the model's dtype (the eager step's line is in it); the scale becomes
 * max|line| / LARGEST_CODE at a block's first position (whatever the block held before), else the
 * larger of that and the old; a scale grown from above zero codes the block's codes again under
 * old / new; the line is coded as line / scale (/ 1 for a zero scale: a line of zeros). */
void native_append_line(kv_t *codes, float *scale, long block_size, long d, long offset, const float *line) {
    float top = 0.0f;
    for (long i = 0; i < d; i++) {
        float magnitude = fabsf(widen(narrow(line[i])));
        top = magnitude > top ? magnitude : top;
    }
    float needed = top / LARGEST_CODE, old = *scale;
    float grown = offset == 0 ? needed : (needed > old ? needed : old);
    if (offset != 0 && grown > old && old > 0.0f)
        recode(codes, block_size * d, old / grown);
    *scale = grown;
    float divisor = grown > 0.0f ? grown : 1.0f;
    kv_t *to = codes + offset * d;
    for (long i = 0; i < d; i++)
        to[i] = to_code(widen(narrow(line[i])) / divisor);
}
#endif

typedef void (*product_fn)(const float *x, long M, long K, const void *panels, long N, const float *bias, float *y);
typedef int (*split_product_fn)(const float *x, long M, long K, const void *panels, long N, const float *bias, float *y);
typedef void (*warm_fn)(long M, long K, const void *panels, long N);
typedef void (*row_fn)(const void *blob, long first, long n, float *out);
typedef int (*split_rows_fn)(row_fn fn, const void *blob, long blob_bytes, long rows, long row_floats, float *y);
#ifdef KV_SCALED /* slot_attention.c's 8-bit build: slot_attention_scaled, with the layer's scales */
typedef void (*attention_fn)(const float *q, long rows, long q_heads, long kv_heads, long d, const kv_t *keys, const kv_t *values,
                             long block_stride, long head_stride, long pos_stride, const long *tables, long table_stride, long block_size,
                             long start, long length, const unsigned char *mask, float scale, float *out, float *scratch,
                             const float *key_scales, const float *value_scales, long scale_block_stride);
#else
typedef void (*attention_fn)(const float *q, long rows, long q_heads, long kv_heads, long d, const kv_t *keys, const kv_t *values,
                             long block_stride, long head_stride, long pos_stride, const long *tables, long table_stride, long block_size,
                             long start, long length, const unsigned char *mask, float scale, float *out, float *scratch);
#endif

#define NR 24
#define BLOCK_ROWS 64 /* rows per kernel call: small_gemm's blocks stay in the caches */

/* One product's weights: panels of NR columns (small_gemm's layout), N output columns, an optional bias. */
struct weights {
    const void *panels; /* float32, bf16 or 8-bit, as the product functions read them */
    const float *bias;
    long n;
    int shared; /* shared with the kernel's helper thread (small_gemm_split) where the caller may */
    /* The build of small_gemm that reads these panels, where it is not the model's own (8-bit weights
     * beside a full-precision LM head); NULL: the model's product and split_product. */
    product_fn product;
    split_product_fn split_product;
    warm_fn warm; /* small_gemm_warm of the same build */
};

struct layer {
    const float *attn_norm, *mlp_norm;
    struct weights qkv; /* q, k and v end to end */
    long q_col, k_col, v_col;
    struct weights o;
    struct weights gate_up; /* gate and up end to end */
    long gate_col, up_col;
    struct weights down;
    long window; /* a sliding layer's window; 0: full attention */
};

/* A verify step over an 8-bit cache: a sequence's input row and its guesses' rows at consecutive
 * positions. A guess's line may be rejected, yet appending it may have grown its block's scale and
 * coded the block's earlier lines again: a step of one row a sequence would not have. So with a log,
 * each row writes its lines and attends before the next row writes (row j reads the blocks as that
 * step would have left them at its position), and a guess row saves the block and head's codes and
 * scale before its append; native_roll_back puts back those of the rows whose guesses were not kept.
 * Index [row][layer][2: keys, values][kv_head]. */
struct undo_log {
    const unsigned char *guess; /* [rows]: nonzero where the row's token is a guess */
    unsigned char *saved;       /* nonzero where the row's append changed the block's scale (codes and scale saved) */
    kv_t *codes;                /* the block's codes before the append: block_size * head_dim each */
    float *scales;              /* and its scale */
};

/* Where the step's K/V lines go and its attention reads: per layer [blocks, kv_heads,
 * block_size, head_dim] with these strides (in floats); the decode worker's cache of
 * blocks, or one prompt's K/V (one block of all its positions). */
struct kv_cache {
    kv_t *const *keys, *const *values;
    long block_stride, head_stride, pos_stride, block_size;
    /* An 8-bit cache's scales, per layer [blocks][kv_heads] floats: block b's of head h at
     * b * scale_block_stride + h (NULL, and unread, where the cache holds the model's dtype). */
    float *const *key_scales, *const *value_scales;
    long scale_block_stride;
    /* A verify step's undo log over an 8-bit cache (speculation), or NULL: see struct undo_log. */
    const struct undo_log *undo;
};

/* Row line into the layer's `lines` (keys or values) at `offset` of block `block`, KV head kv:
 * stored in the model's dtype, or appended as codes under the block's scale (scales: the layer's). */
static void write_line(const struct kv_cache *c, kv_t *lines, float *scales, long block, long offset, long kv, const float *line, long d,
                       long undo_at) {
#ifdef KV_SCALED
    kv_t *codes = lines + block * c->block_stride + kv * c->head_stride;
    float *scale = scales + block * c->scale_block_stride + kv;
    const struct undo_log *u = c->undo;
    long n = c->block_size * d;
    if (undo_at >= 0) { /* a guess's line: the block as it was, in case the guess is not kept */
        memcpy(u->codes + undo_at * n, codes, (size_t)n * sizeof(kv_t));
        u->scales[undo_at] = *scale;
    }
    native_append_line(codes, scale, c->block_size, d, offset, line);
    if (undo_at >= 0) /* NaN != NaN: a NaN scale counts as changed */
        u->saved[undo_at] = !(*scale == u->scales[undo_at]);
#else
    (void)scales, (void)undo_at;
    store_line(lines + block * c->block_stride + offset * c->pos_stride + kv * c->head_stride, line, d);
#endif
}


/* Called once a layer's K/V lines are written (a prefill hands them on while later layers compute); nonzero stops the step. */
typedef int (*layer_done_fn)(long layer);

/* prefill_attention.c's job and entry (a bf16 prompt's causal attention, blocked, on torch's OpenMP threads). */
struct prefill_job {
    const unsigned short *query;
    long query_head_stride, query_row_stride, q_rows, q_heads;
    const unsigned short *packed_keys, *packed_values;
    long kv_heads, kv_len, d;
    float scale;
    unsigned short *out;
    long out_head_stride, out_row_stride;
};
typedef void (*prefill_attention_fn)(const struct prefill_job *job, const unsigned short *keys, long key_head_stride, long key_row_stride,
                                     const unsigned short *values, long value_head_stride, long value_row_stride, int threads, float *work);
typedef long (*prefill_size_fn)(long kv_len, long d);

struct model {
    long layers, hidden, q_heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const store_t *embed;                      /* [vocab, hidden] */
    const float *final_norm;
    struct weights lm_head;
    product_fn product;
    split_product_fn split_product;
    attention_fn attention;
    const struct layer *layer;
    /* A bf16 prompt of at least blocked_min_rows rows attends through prefill_attention.c (NULL: never):
     * its entry, its packed keys' size, its work per thread (floats), and how many threads it runs on. */
    prefill_attention_fn blocked_attention;
    prefill_size_fn blocked_packed_size;
    long blocked_min_rows, blocked_work_per_thread;
    int blocked_threads;
    long blocked_calls; /* how many steps attended that way (tests) */
    /* small_gemm_split_rows (NULL: never): a step of SPLIT_ATTENTION_ROWS rows or more shares its rows'
     * attention with the products' helper thread, as a product shares its panels (attend_rows_job). */
    split_rows_fn split_rows;
    long split_attention_bytes; /* ... when its rows read at least this many bytes of K and V a layer */
    long split_attention_calls; /* how many layers' attention went that way (tests) */
    /* A step of fewer rows shares it a KV head of a row a unit (attend_heads_job), when its rows read at least
     * this many bytes of K and V a layer and the model has several KV heads. */
    long split_heads_bytes;
    warm_fn warm; /* small_gemm_warm of the model's build (NULL: no warming) */
};

/* Asks the helper that will share the product of `rows` rows over w to warm its first weights while it waits (small_gemm_warm). */
static void warm(const struct model *m, int may_share, long rows, long k, const struct weights *w) {
    warm_fn fn = w->warm ? w->warm : m->warm;
    if (may_share && w->shared && fn)
        fn(rows, k, w->panels, w->n);
}

static void product(const struct model *m, int may_share, const float *x, long rows, long k, const struct weights *w, float *y) {
    for (long r = 0; r < rows; r += BLOCK_ROWS) {
        long n = rows - r < BLOCK_ROWS ? rows - r : BLOCK_ROWS;
        if (may_share && w->shared)
            (w->split_product ? w->split_product : m->split_product)(x + r * k, n, k, w->panels, w->n, w->bias, y + r * w->n);
        else
            (w->product ? w->product : m->product)(x + r * k, n, k, w->panels, w->n, w->bias, y + r * w->n);
    }
}

/* out = weight * (x * (1 / sqrt(mean(x^2) + eps))), per row, as LlamaRMSNorm. */
static void rms_norm(const float *x, long rows, long h, const float *weight, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * h;
        float *o = out + r * h;
        __m256 acc = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= h; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        for (; i < h; i++)
            sum += xr[i] * xr[i];
        float inverse = 1.0f / sqrtf(sum / (float)h + eps);
        for (i = 0; i < h; i++)
            o[i] = weight[i] * (xr[i] * inverse);
    }
}

/* out[0, heads * d) = x rotated: x cos + rotate_half(x) sin per head, rotate_half(x) = (-x2, x1). */
static void rotate(const float *x, long heads, long d, const float *cos, const float *sin, float *out) {
    long half = d / 2;
    for (long h = 0; h < heads; h++) {
        const float *xh = x + h * d;
        float *o = out + h * d;
        for (long i = 0; i < half; i++) {
            o[i] = xh[i] * cos[i] + (-xh[i + half]) * sin[i];
            o[i + half] = xh[i + half] * cos[i + half] + xh[i] * sin[i + half];
        }
    }
}

/* Row r's K and V lines of layer l, from its q/k/v product row (k rotated by its angles c, s; line: d floats of scratch)
 * into its position's block. */
static void write_row_lines(const struct model *m, const struct kv_cache *cache, const struct layer *L, long l, long r, const float *row,
                            const float *c, const float *s, const long *tables, long table_stride, const long *positions, float *line) {
    long d = m->head_dim, p = positions[r], bs = cache->block_size, block = tables[r * table_stride + p / bs];
    kv_t *keys = cache->keys[l], *values = cache->values[l];
    float *key_scales = cache->key_scales ? cache->key_scales[l] : 0, *value_scales = cache->value_scales ? cache->value_scales[l] : 0;
    long undo_at = -1; /* where this row's saved blocks go in the log: keys at undo_at + kv, values kv_heads further */
#ifdef KV_SCALED
    if (cache->undo && cache->undo->guess[r])
        undo_at = (r * m->layers + l) * 2 * m->kv_heads;
#endif
    for (long kv = 0; kv < m->kv_heads; kv++) {
        rotate(row + L->k_col + kv * d, 1, d, c, s, line);
        write_line(cache, keys, key_scales, block, p % bs, kv, line, d, undo_at < 0 ? -1 : undo_at + kv);
        write_line(cache, values, value_scales, block, p % bs, kv, row + L->v_col + kv * d, d, undo_at < 0 ? -1 : undo_at + m->kv_heads + kv);
    }
}

/* act[0, n) = silu(gate) * up = gate / (1 + exp(-gate)) * up, as PyTorch's silu. */
static void silu_times(const float *gate, const float *up, long n, float *act) {
    __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = _ZGVdN8v_expf(_mm256_xor_ps(g, sign));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++)
        act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void add_into(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++)
        x[i] = x[i] + y[i];
}

/* The widest product a row of the step holds at once: q, k and v, or gate and up. */
static long widest(const struct model *m) {
    long most = 0;
    for (long l = 0; l < m->layers; l++) {
        most = m->layer[l].qkv.n > most ? m->layer[l].qkv.n : most;
        most = m->layer[l].gate_up.n > most ? m->layer[l].gate_up.n : most;
    }
    return most;
}

#if defined(MODEL_BF16) && !defined(KV_SCALED)
/* Whether this step's rows are one prompt's, attending causally through blocked_attention (set only
 * for a model with no sliding layer, whose window is another mask): at least blocked_min_rows rows of
 * one sequence (one block table) at consecutive positions from 0 or past a prefix, every position up
 * to the last in the table's first block (one prompt's own K/V buffer). Then row r attends over
 * positions 0..its own, as the row-by-row attention does, with prefill_attention.c's bf16 arithmetic
 * (transformers' bf16 attention's: the scores' and values' sums in float32 over bf16 inputs, one rounding out). */
static int blocked_prompt(const struct model *m, const struct kv_cache *cache, long rows, const long *tables, long table_stride, const long *positions) {
    if (!m->blocked_attention || rows < m->blocked_min_rows || positions[rows - 1] >= cache->block_size)
        return 0;
    for (long r = 1; r < rows; r++)
        if (positions[r] != positions[0] + r || tables[r * table_stride] != tables[0])
            return 0;
    return 1;
}

/* The buffers a blocked prompt's attention needs (freed by the caller), or 0 if they cannot be had. */
struct blocked_buffers {
    unsigned short *q, *out, *packed;
    float *work;
};
static int blocked_buffers(const struct model *m, long rows, long kv_len, struct blocked_buffers *b) {
    long q_dim = m->q_heads * m->head_dim, packed = m->blocked_packed_size(kv_len, m->head_dim) * m->kv_heads;
    int threads = m->blocked_threads > 0 ? m->blocked_threads : 1;
    b->q = malloc((size_t)(2 * rows * q_dim + 2 * packed) * sizeof(unsigned short));
    b->work = malloc((size_t)(threads * m->blocked_work_per_thread) * sizeof(float));
    if (!b->q || !b->work) {
        free(b->q), free(b->work);
        return 0;
    }
    b->out = b->q + rows * q_dim, b->packed = b->out + rows * q_dim;
    return 1;
}

/* attended[rows, q_dim] = the prompt's causal attention for its rows (q [rows, q_dim] rotated), over
 * the layer's lines of the prompt's block (positions 0 .. positions[rows - 1]). */
static void blocked_attention(const struct model *m, const struct kv_cache *cache, const kv_t *keys, const kv_t *values, long rows, long block,
                              const long *positions, const float *q, struct blocked_buffers *b, float *attended) {
    long d = m->head_dim, q_dim = m->q_heads * d, kv_len = positions[rows - 1] + 1;
    for (long i = 0; i < rows * q_dim; i++)
        b->q[i] = narrow(q[i]);
    long packed = m->blocked_packed_size(kv_len, d) * m->kv_heads;
    struct prefill_job job = {b->q, d, q_dim, rows, m->q_heads, b->packed, b->packed + packed, m->kv_heads, kv_len, d, m->scale, b->out, d, q_dim};
    const kv_t *k0 = keys + block * cache->block_stride, *v0 = values + block * cache->block_stride;
    m->blocked_attention(&job, k0, cache->head_stride, cache->pos_stride, v0, cache->head_stride, cache->pos_stride, m->blocked_threads, b->work);
    for (long i = 0; i < rows * q_dim; i++)
        attended[i] = widen(b->out[i]);
}
#endif

/* The floats of workspace a step of `rows` rows needs (see native_step), its largest position below kv_len. */
long native_step_workspace(const struct model *m, long rows, long kv_len) {
    long q_dim = m->q_heads * m->head_dim;
    return rows * (3 * m->hidden + widest(m) + 2 * q_dim + m->intermediate) + (m->q_heads / m->kv_heads) * kv_len + m->head_dim;
}

/* A decode step's attention over its rows, one row a unit, shared with the products' helper thread
 * (small_gemm_split_rows). Why: at 32 rows of SmolLM-135M's shape the attention took 11 of a step's 31 ms
 * on the calling core (its reads of the scattered KV streams, more than its arithmetic) while the helper
 * waited. The blob holds what a late helper may read after the step has moved on (the rows' queries,
 * tables and positions: the step's workspace and its caller's tensors do not outlive it); the cache it
 * points to lives as long as the model. Each row is the call the caller would make itself, so the
 * results are the same bits whoever computes them. */
#define SPLIT_ATTENTION_ROWS 4

/* A row at `position` attends to positions first_attended(..) to its own: every one before it, or in a sliding
 * layer (window > 0) those > position - window (transformers' sliding mask). */
static inline long first_attended(long window, long position) { return window && position - window + 1 > 0 ? position - window + 1 : 0; }

/* What a layer's row-by-row attention reads besides each row's query, table and position (the same for
 * every row); as a shared job's blob, followed by the rows' queries, tables and positions. */
struct attend_job {
    attention_fn attention;
    const kv_t *keys, *values;
    const float *key_scales, *value_scales; /* an 8-bit cache's (the layer's); unread otherwise */
    long block_stride, head_stride, pos_stride, block_size, scale_block_stride;
    long q_heads, kv_heads, d, table_stride, window;
    float scale;
    long tables_at, positions_at; /* a blob's: byte offsets of its tables and positions; its queries follow this header */
};

static struct attend_job layer_attention(const struct model *m, const struct kv_cache *cache, const struct layer *L, const kv_t *keys,
                                         const kv_t *values, const float *key_scales, const float *value_scales, long table_stride) {
    return (struct attend_job){
        m->attention, keys, values, key_scales, value_scales, cache->block_stride, cache->head_stride, cache->pos_stride, cache->block_size,
        cache->scale_block_stride, m->q_heads, m->kv_heads, m->head_dim, table_stride, L->window, m->scale, 0, 0,
    };
}

/* Rows [first, first + n): each row's attention (q [rows, q_dim] rotated) over its positions, into out (row r at
 * out + r * q_dim); scores: group * (the rows' longest span) floats. */
static void attend_rows(const struct attend_job *j, const float *q, const long *tables, const long *positions, long first, long n, float *out,
                        float *scores) {
    long q_dim = j->q_heads * j->d;
    for (long r = first; r < first + n; r++) {
        long from = first_attended(j->window, positions[r]);
        j->attention(q + r * q_dim, 1, j->q_heads, j->kv_heads, j->d, j->keys, j->values, j->block_stride, j->head_stride, j->pos_stride,
                     tables + r * j->table_stride, j->table_stride, j->block_size, from, positions[r] + 1 - from, 0, j->scale, out + r * q_dim, scores
#ifdef KV_SCALED
                     , j->key_scales, j->value_scales, j->scale_block_stride
#endif
        );
    }
}

/* This thread's scratch for a shared job's scores, at least `need` floats. */
static float *thread_scores(long need) {
    static __thread float *scores;
    static __thread long capacity;
    if (need > capacity) {
        free(scores);
        scores = malloc((size_t)need * sizeof(float));
        capacity = scores ? need : 0;
        if (!scores)
            abort(); /* a few KB: a process that cannot get them is out of memory anyway */
    }
    return scores;
}

/* A shared job's rows, on whichever thread claims them (the caller's or the helper's scratch for the scores). */
static void attend_rows_job(const void *blob, long first, long n, float *out) {
    const struct attend_job *j = blob;
    const long *tables = (const long *)((const char *)blob + j->tables_at), *positions = (const long *)((const char *)blob + j->positions_at);
    long need = 0;
    for (long r = first; r < first + n; r++)
        need = positions[r] + 1 > need ? positions[r] + 1 : need;
    attend_rows(j, (const float *)(j + 1), tables, positions, first, n, out, thread_scores(need * (j->q_heads / j->kv_heads)));
}

/* A shared job's units of one KV head of one row each (unit u: row u / kv_heads, head u % kv_heads), for steps of
 * too few rows to share row by row: each unit is the attention of that head's query heads alone (its group, whose
 * outputs lie together in the row's), the call attend_rows makes for it within the row's, so the same bits.
 * Why: at one row of SmolLM-135M's shape (128 positions) the attention took ~0.5 of a 6.5 ms int8 step on the
 * calling core while the helper waited. */
static void attend_heads_job(const void *blob, long first, long n, float *out) {
    const struct attend_job *j = blob;
    const long *tables = (const long *)((const char *)blob + j->tables_at), *positions = (const long *)((const char *)blob + j->positions_at);
    long group = j->q_heads / j->kv_heads, unit_floats = group * j->d, q_dim = j->q_heads * j->d;
    long need = 0;
    for (long u = first; u < first + n; u++)
        need = positions[u / j->kv_heads] + 1 > need ? positions[u / j->kv_heads] + 1 : need;
    float *scores = thread_scores(need * group);
    const float *q = (const float *)(j + 1);
    for (long u = first; u < first + n; u++) {
        long r = u / j->kv_heads, h = u % j->kv_heads, from = first_attended(j->window, positions[r]);
        j->attention(q + r * q_dim + h * unit_floats, 1, group, 1, j->d, j->keys + h * j->head_stride, j->values + h * j->head_stride,
                     j->block_stride, j->head_stride, j->pos_stride, tables + r * j->table_stride, j->table_stride, j->block_size, from,
                     positions[r] + 1 - from, 0, j->scale, out + u * unit_floats, scores
#ifdef KV_SCALED
                     , j->key_scales + h, j->value_scales + h, j->scale_block_stride
#endif
        );
    }
}

/* The rows' attention into attended through the helper (job: the layer's, as layer_attention gives it), a row a
 * unit (by_heads 0) or a KV head of a row a unit: 0 where the blob cannot be had. */
static int split_attention(const struct model *m, struct attend_job job, long rows, const float *q, const long *tables, const long *positions,
                           float *attended, int by_heads) {
    long q_dim = m->q_heads * m->head_dim, queries = rows * q_dim * (long)sizeof(float);
    job.tables_at = (long)sizeof(struct attend_job) + (queries + 7) / 8 * 8;
    job.positions_at = job.tables_at + rows * job.table_stride * (long)sizeof(long);
    long bytes = job.positions_at + rows * (long)sizeof(long);
    static __thread char *blob;
    static __thread long capacity;
    if (bytes > capacity) {
        free(blob);
        blob = malloc((size_t)bytes);
        capacity = blob ? bytes : 0;
        if (!blob)
            return 0;
    }
    memcpy(blob, &job, sizeof job);
    memcpy(blob + sizeof job, q, (size_t)queries);
    memcpy(blob + job.tables_at, tables, (size_t)(rows * job.table_stride) * sizeof(long));
    memcpy(blob + job.positions_at, positions, (size_t)rows * sizeof(long));
    if (by_heads)
        m->split_rows(attend_heads_job, blob, bytes, rows * m->kv_heads, q_dim / m->kv_heads, attended);
    else
        m->split_rows(attend_rows_job, blob, bytes, rows, q_dim, attended);
    ((struct model *)m)->split_attention_calls++;
    return 1;
}

/* One step: row r is token ids[r] at position positions[r] of the sequence whose block
 * table is tables[r * table_stride ...] (position p in block table[p / block_size]);
 * cos and sin its rotary angles (transformers' rotary module's output), head_dim floats a row:
 * row r's at row positions[r] of a table of every position (angles_by_position), else at row r.
 * Row r writes its K/V line at its position and attends over its sequence's positions
 * up to it (the last `window` of them in a sliding layer), so every earlier position
 * must hold its K/V: a decode step's rows are different sequences; a prompt's rows are
 * one (table_stride 0), in order, each attending over the lines the rows before it wrote.
 * logits: [rows - logit_from, lm_head.n], the
 * rows from logit_from on (a prompt needs its last only); work: native_step_workspace
 * floats. may_share: whether products may be shared with the helper thread (the
 * calling thread may run on more than one CPU). Returns 0, or 1 if layer_done (if
 * given) stopped the step. */
int native_step(const struct model *m, const struct kv_cache *cache, long rows, const long *ids, const long *tables, long table_stride, const long *positions,
                const float *cos, const float *sin, int angles_by_position, int may_share, layer_done_fn layer_done, long logit_from, float *logits,
                float *work) {
    long hidden = m->hidden, d = m->head_dim, q_dim = m->q_heads * d;
#define ANGLES(r) ((angles_by_position ? positions[r] : (r)) * d)
    float *x = work, *h = x + rows * hidden, *mixed = h + rows * hidden, *wide = mixed + rows * hidden;
    float *q = wide + rows * widest(m), *attended = q + rows * q_dim, *act = attended + rows * q_dim;
    float *line = act + rows * m->intermediate; /* one rotated key: d floats */
    float *scores = line + d;                   /* the attention's: group * kv_len */
    long kv_bytes = 0; /* what the rows' attention reads a layer, without windows: whether to share it */
    for (long r = 0; r < rows; r++)
        kv_bytes += (positions[r] + 1) * m->kv_heads * d * 2 * (long)sizeof(kv_t);
    int share_rows = may_share && m->split_rows && rows >= SPLIT_ATTENTION_ROWS && kv_bytes >= m->split_attention_bytes;
    int share_heads = may_share && m->split_rows && rows < SPLIT_ATTENTION_ROWS && m->kv_heads > 1 && kv_bytes >= m->split_heads_bytes;
#if defined(MODEL_BF16) && !defined(KV_SCALED)
    struct blocked_buffers blocked = {0, 0, 0, 0};
    int blocked_rows = blocked_prompt(m, cache, rows, tables, table_stride, positions) &&
                       blocked_buffers(m, rows, positions[rows - 1] + 1, &blocked);
    if (blocked_rows)
        ((struct model *)m)->blocked_calls++;
#endif
    for (long r = 0; r < rows; r++)
        load_line(x + r * hidden, m->embed + ids[r] * hidden, hidden);
    int in_turn = cache->undo != 0; /* a verify step over an 8-bit cache: each row writes its lines, then attends, in order */
    for (long l = 0; l < m->layers; l++) {
        const struct layer *L = &m->layer[l];
        kv_t *keys = cache->keys[l], *values = cache->values[l];
        float *key_scales = cache->key_scales ? cache->key_scales[l] : 0, *value_scales = cache->value_scales ? cache->value_scales[l] : 0;
        rms_norm(x, rows, hidden, L->attn_norm, m->eps, h);
        product(m, may_share, h, rows, hidden, &L->qkv, wide);
        warm(m, may_share, rows, q_dim, &L->o); /* while the rows are rotated and attend (the helper takes a share of that first) */
        for (long r = 0; r < rows; r++) {
            rotate(wide + r * L->qkv.n + L->q_col, m->q_heads, d, cos + ANGLES(r), sin + ANGLES(r), q + r * q_dim);
            if (!in_turn)
                write_row_lines(m, cache, L, l, r, wide + r * L->qkv.n, cos + ANGLES(r), sin + ANGLES(r), tables, table_stride, positions, line);
        }
        if (layer_done && layer_done(l)) {
#if defined(MODEL_BF16) && !defined(KV_SCALED)
            free(blocked.q), free(blocked.work);
#endif
            return 1;
        }
#if defined(MODEL_BF16) && !defined(KV_SCALED)
        if (blocked_rows)
            blocked_attention(m, cache, keys, values, rows, tables[0], positions, q, &blocked, attended);
        else
#endif
        {
            struct attend_job job = layer_attention(m, cache, L, keys, values, key_scales, value_scales, table_stride);
            if (in_turn)
                for (long r = 0; r < rows; r++) {
                    write_row_lines(m, cache, L, l, r, wide + r * L->qkv.n, cos + ANGLES(r), sin + ANGLES(r), tables, table_stride, positions, line);
                    attend_rows(&job, q, tables, positions, r, 1, attended, scores);
                }
            else if (!((share_rows || share_heads) && split_attention(m, job, rows, q, tables, positions, attended, share_heads)))
                attend_rows(&job, q, tables, positions, 0, rows, attended, scores);
        }
        product(m, may_share, attended, rows, q_dim, &L->o, mixed);
        warm(m, may_share, rows, hidden, &L->gate_up);
        add_into(x, mixed, rows * hidden);
        rms_norm(x, rows, hidden, L->mlp_norm, m->eps, h);
        product(m, may_share, h, rows, hidden, &L->gate_up, wide);
        warm(m, may_share, rows, m->intermediate, &L->down);
        for (long r = 0; r < rows; r++)
            silu_times(wide + r * L->gate_up.n + L->gate_col, wide + r * L->gate_up.n + L->up_col, m->intermediate, act + r * m->intermediate);
        product(m, may_share, act, rows, m->intermediate, &L->down, mixed);
        if (l + 1 < m->layers)
            warm(m, may_share, rows, hidden, &m->layer[l + 1].qkv);
        else
            warm(m, may_share, rows - logit_from, hidden, &m->lm_head);
        add_into(x, mixed, rows * hidden);
    }
    long kept = rows - logit_from;
    rms_norm(x + logit_from * hidden, kept, hidden, m->final_norm, m->eps, h);
    product(m, may_share, h, kept, hidden, &m->lm_head, logits);
#if defined(MODEL_BF16) && !defined(KV_SCALED)
    free(blocked.q), free(blocked.work);
#endif
    return 0;
#undef ANGLES
}

/* Whether a step's rows are in range, as native_step reads them through raw pointers (a slot, block,
 * position or token id out of range would read past the buffers, not fail): every id below vocab,
 * every entry of the rows' tables (width entries a row, table_stride apart) below blocks, every
 * position below positions_below. Returns the largest position + 1, or -1 where a row is out of range.
 * Why here: the same checks as torch reductions cost a few hundred microseconds a step once the step's
 * weights have pushed torch's dispatch out of the caches. */
long native_rows_check(long rows, const long *ids, long vocab, const long *tables, long table_stride, long width, long blocks,
                       const long *positions, long positions_below) {
    long top = -1;
    for (long r = 0; r < rows; r++) {
        if (ids[r] < 0 || ids[r] >= vocab || positions[r] < 0 || positions[r] >= positions_below)
            return -1;
        for (long j = 0; j < width; j++)
            if (tables[r * table_stride + j] < 0 || tables[r * table_stride + j] >= blocks)
                return -1;
        top = positions[r] > top ? positions[r] : top;
    }
    return rows ? top + 1 : -1;
}

#ifdef KV_SCALED
/* After a verify step with an undo log (cache->undo): puts back, last row first, the codes and scale of every
 * block and head whose scale the append of a row `rejected` marks (a guess not kept) changed, so the cache holds
 * what steps of one row a sequence would have left. Lines past a sequence's kept length are never read. */
void native_roll_back(const struct model *m, const struct kv_cache *cache, long rows, const long *tables, long table_stride, const long *positions,
                      const unsigned char *rejected) {
    const struct undo_log *u = cache->undo;
    long n = cache->block_size * m->head_dim;
    for (long r = rows - 1; r >= 0; r--) {
        if (!rejected[r] || !u->guess[r])
            continue;
        long block = tables[r * table_stride + positions[r] / cache->block_size];
        for (long l = 0; l < m->layers; l++)
            for (long kind = 0; kind < 2; kind++)
                for (long kv = 0; kv < m->kv_heads; kv++) {
                    long at = ((r * m->layers + l) * 2 + kind) * m->kv_heads + kv;
                    if (!u->saved[at])
                        continue;
                    kv_t *codes = (kind ? cache->values : cache->keys)[l] + block * cache->block_stride + kv * cache->head_stride;
                    memcpy(codes, u->codes + at * n, (size_t)n * sizeof(kv_t));
                    (kind ? cache->value_scales : cache->key_scales)[l][block * cache->scale_block_stride + kv] = u->scales[at];
                }
    }
}
#endif
