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
 *
 * Built with -DWIDE_F32 -mavx512f -mavx512vl as well (small_gemm.py's
 * float32-avx512), the float32 blocks use 512-bit vectors over the same panels
 * (wide_block): the same sums in the same order, so the same bits. With
 * -DWEIGHT_BF16 too (bf16-widen-avx512), the same blocks read bf16 panels,
 * each weight widened exactly as it is loaded: float32's bits over them.
 */
#define _GNU_SOURCE /* pthread_getaffinity_np, pthread_setaffinity_np */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NR 24
#define KC 256

/* How far ahead of its reads a block prefetches the panels (bytes; a chunk at least): they are one stream
 * through memory, and a prefetch one chunk ahead (6 KB of int8, 12 of bf16) came too late for one row.
 * Measured on a Zen 5 EPYC over SmolLM-135M's one-row products in a step's order (int8 layers, a bf16 LM
 * head), on one core: 6.24 ms one chunk ahead, 4.3-4.6 at 16-32 KB (as fast as a plain sum reads there);
 * split over two cores 4.30 against 3.0-3.3; 8 and 32 rows within 3%. A single row prefetches too: the
 * hardware prefetcher alone streamed int8 weights at 24-25 GB/s on one core, 35-41 with it. Float32 panels:
 * 32 KB; the AVX-512 build's one row prefetching too: SmolLM-135M's products 13.3 -> 12.6 ms at one row and
 * 14.4 -> 13.1 at 8 (two cores); the AVX2 build's 8 rows 16.9 -> 15.3 (its single row keeps the hardware
 * prefetcher, as measured on its own host class). */
#define AHEAD_BYTES (sizeof(weight_t) == 4 ? 32768L : 16384L)

/* The weights' element: float32, or (built with -DWEIGHT_BF16) bfloat16, widened to
 * float32 as it is loaded (a bf16 is a float32's upper half: shifted left 16 bits it
 * is that float exactly). The rows, the sums and y stay float32 either way, so a bf16
 * weight reads half the bytes and each output is still one float32 sum of exact
 * products (what oneDNN's bf16 products accumulate in, before their one rounding). */
#if defined(WEIGHT_BF16)
typedef unsigned short weight_t;
static inline __m256 load_weights(const weight_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
#elif defined(WEIGHT_INT8)
/* 8-bit weights (built with -DWEIGHT_INT8 or -DWEIGHT_FP8): each widened to float32 exactly as
 * it is read (a quarter of float32's bytes), multiplied as float32; the weight's scale, one per
 * output column, multiplies each chunk's sums before they are added into y (SCALED). */
typedef signed char weight_t;
static inline __m256 load_weights(const weight_t *w) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w))); }
#elif defined(WEIGHT_FP8)
/* e4m3 (no infinities; the loader refuses NaN): a normal's exponent and mantissa bits, shifted into
 * a float32's place, rebiased by 127 - 7; a subnormal (exponent 0) is its mantissa times 2^-9. */
typedef unsigned char weight_t;
static inline __m256 load_weights(const weight_t *w) {
    __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w));
    __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7f));
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
    __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512.0f));
    __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
    __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x80)), 24));
    return _mm256_or_ps(_mm256_blendv_ps(normal, subnormal, is_subnormal), sign);
}
#elif defined(WEIGHT_VNNI)
/* int8 weights for VPDPBUSD (-DWEIGHT_VNNI): each stored as q + 128, an unsigned byte (see vnni_block). */
typedef unsigned char weight_t;
#else
typedef float weight_t;
static inline __m256 load_weights(const weight_t *w) { return _mm256_load_ps(w); }
#endif

/* An 8-bit build's panel ends with its 24 columns' float32 scales: 96 bytes, 4 more rows of
 * the panel's 24 one-byte weights, so a panel is [K + 4][24] and carries its own scales
 * (groups of linears laid end to end keep each member's). */
#if defined(WEIGHT_INT8) || defined(WEIGHT_FP8) || defined(WEIGHT_VNNI)
#define SCALE_ROWS 4
#define SCALED(a, j) _mm256_mul_ps(a, _mm256_loadu_ps(scales + 8 * (j)))
#else
#define SCALE_ROWS 0
#define SCALED(a, j) (a)
#endif

/* The rows as the blocks read them. Built with -DDOT_BF16 as well (AVX512_BF16 CPUs):
 * the rows rounded to bf16 (to nearest, ties to even, as PyTorch's conversion) and
 * K padded to a multiple of 4; the panels hold each column's weights in pairs of k,
 * so that one VDPBF16PS multiplies 16 columns by a pair of k: twice the products per
 * instruction of a float32 FMA, on the bf16 inputs a bf16 model's own products take.
 * A panel is quads of k, each 192 bytes: columns 0-15 of pair k, k + 1 (64 bytes),
 * of pair k + 2, k + 3 (64), then columns 16-23 with each column's two pairs side by
 * side (64), so no load crosses a cache line. Otherwise the float32 rows themselves. */
#ifdef WEIGHT_VNNI
/* The VNNI build's rows (-DWEIGHT_VNNI): VPDPBUSD multiplies unsigned bytes by signed bytes, four pairs
 * a 32-bit lane, 64 products an instruction with nothing to widen. Why: on a Zen 4 EPYC (AVX-512 in
 * 256-bit halves) widening int8 weights to bf16 for VDPBF16PS held one core to 17-21 GB of weights a
 * second even from L2, below what the core reads from memory, so a one-row int8 step was bound by
 * its arithmetic. Each row becomes an integer exactly: its values (rounded to bf16 first with
 * -DROWS_BF16, as a bf16 model's own products take them) times 2^-s, s = the row's largest exponent
 * less 22, rounded to nearest even (exact for every value within 14 binades of the row's largest;
 * below that, off by at most 2^(s-1): float32's rounding of the largest value), then written as
 * three signed digits of base 256 (d0 + 256 d1 + 65536 d2, each -128..127), a plane of K bytes each.
 * The weights are stored as q + 128 (unsigned), so a plane's sum over a chunk is sum(d u) - 128 sum(d):
 * the second term, the row's own, is kept per chunk beside the planes. Every sum of a chunk is an
 * exact int32 (|d u| <= 128 * 255, 256 k a chunk: below 2^24, so exact in float32 too); the three
 * are joined in float32 and times 2^s. A row's prepared form: planes 0, 1, 2 (INPUT_K bytes each, K padded to 8),
 * the float 2^s, then per chunk the three planes' 128 sum(d) (int32). */
typedef signed char input_t;
/* Built with -DACT_INT8 as well (W8A8, `--quantization w8a8_int8`): each row quantized to int8 on the fly,
 * per row and symmetric (scale = max|x| / 127 in float32, q = x / scale rounded to nearest even, as
 * torch.round(x / scale) computes it), so a row is one plane of digits and each product one VPDPBUSD, a third
 * of the exact rows' work; the scale takes the place of 2^s. Not exact against the full-precision rows: it is
 * the W8A8 scheme's own numbers (quantization/schemes.py, quantize_rows). */
#ifdef ACT_INT8
#define PLANES 1
#else
#define PLANES 3
#endif
#define INPUT_K(K) (((K) + 7) & ~7L)
#define INPUT_CHUNKS(K) ((INPUT_K(K) + KC - 1) / KC)
#define INPUT_STRIDE(K) (PLANES * INPUT_K(K) + 4 + 4 * PLANES * INPUT_CHUNKS(K))
#ifdef ACT_INT8
static inline unsigned row_top_bits(const float *row, long K); /* the build's own (AVX2 or AVX-512), below */
/* A W8A8 row's scale, max|x| / 127 in float32 (NaN for a row holding an infinity or a NaN, whose products are then
 * NaN; 0 for an all-zero row), stored after its kp digits; returns whether its digits are computed (finite, not zero). */
static inline int store_row_scale(const float *row, long K, input_t *o, long kp, float *scale) {
    unsigned top = row_top_bits(row, K);
    union { unsigned u; float f; } largest = {top};
    *scale = top >= 0x7f800000u ? __builtin_nanf("") : largest.f / 127.0f;
    memcpy(o + kp, scale, sizeof *scale);
    return top < 0x7f800000u && top != 0;
}
#endif
#ifdef VNNI_AVX2
/* Built with -DVNNI_AVX2 as well (`w8a8-avx2`, `w8a8-avx2-bf16`: any AVX2 CPU): the same rows and the same
 * panels, through AVX2 alone. Why: a CPU without AVX512_VNNI (an AVX2-only EPYC) refused W8A8, and its int8
 * weight-only products (widened to float32 FMAs) were slower than float32's from 8 rows on. The VPDPBUSD of the
 * AVX-512 build becomes VPSIGNB, VPMADDUBSW and VPMADDWD over 32 bytes (avx2_dot): the same exact integer sums,
 * so the same bits (tests/test_quantization_w8a8.py compares the two builds bit for bit). */
#ifndef ACT_INT8
#error "-DVNNI_AVX2 is built for W8A8 only (-DACT_INT8): the exact rows' three planes need VPDPBUSD"
#endif
/* The bits of row[k .. k + 8) (zeros past K), rounded to bf16 with -DROWS_BF16: row_bits' 8 lanes. */
static inline __m256i row_bits8(const float *row, long K, long k) {
    __m256i bits;
    if (K - k >= 8) {
        bits = _mm256_loadu_si256((const __m256i *)(row + k));
    } else {
        __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K > k ? K - k : 0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        bits = _mm256_castps_si256(_mm256_maskload_ps(row + k, in));
    }
#ifdef ROWS_BF16
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), _mm256_set1_epi32((int)0xffff0000u));
#endif
    return bits;
}
static inline unsigned row_top_bits(const float *row, long K) {
    __m256i top = _mm256_setzero_si256();
    for (long k = 0; k < K; k += 8)
        top = _mm256_max_epu32(top, _mm256_and_si256(row_bits8(row, K, k), _mm256_set1_epi32(0x7fffffff)));
    unsigned lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, top);
    unsigned largest = 0;
    for (int i = 0; i < 8; i++)
        largest = lanes[i] > largest ? lanes[i] : largest;
    return largest;
}
/* As the AVX-512 build's ACT_INT8 prepare_input, 8 values at a time (the same division, the same rounding,
 * so the same digits); the chunks' corrections are not written: avx2_dot's sums are the weights' own q. */
static void prepare_input(const float *x, long M, long K, input_t *out) {
    long kp = INPUT_K(K), stride = INPUT_STRIDE(K);
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (long m = 0; m < M; m++) {
        const float *row = x + m * K;
        input_t *o = out + m * stride;
        float scale;
        int finite = store_row_scale(row, K, o, kp, &scale);
        __m256 divisor = _mm256_set1_ps(finite ? scale : 1.0f);
        for (long k = 0; k < kp; k += 8) { /* kp is a multiple of 8 */
            __m256 value = _mm256_castsi256_ps(row_bits8(row, K, k));
            __m256i q = finite ? _mm256_cvtps_epi32(_mm256_div_ps(value, divisor)) : _mm256_setzero_si256(); /* nearest even */
            q = _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
            __m256i bytes = _mm256_shuffle_epi8(q, low_bytes); /* each lane's low byte, four a 128-bit half */
            _mm_storel_epi64((__m128i *)(o + k), _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
        }
    }
}
#else
/* The bits of row[k .. k + 16) (zeros past K), rounded to bf16 with -DROWS_BF16 (to nearest, ties to even, as
 * PyTorch's conversion; an infinity or a NaN stays one of the two, which makes the row's products NaN). */
static inline __m512i row_bits(const float *row, long K, long k) {
    __mmask16 in = K - k >= 16 ? 0xFFFF : K > k ? (__mmask16)((1u << (K - k)) - 1) : 0;
    __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(in, row + k));
#ifdef ROWS_BF16
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), _mm512_set1_epi32((int)0xffff0000u));
#endif
    return bits;
}
/* The row's largest magnitude, as its bits (row_bits'; a NaN's are above every finite value's and infinity's). */
static inline unsigned row_top_bits(const float *row, long K) {
    __m512i top_bits = _mm512_setzero_si512();
    for (long k = 0; k < K; k += 16)
        top_bits = _mm512_max_epu32(top_bits, _mm512_and_si512(row_bits(row, K, k), _mm512_set1_epi32(0x7fffffff)));
    return (unsigned)_mm512_reduce_max_epu32(top_bits);
}
#ifdef ACT_INT8
static void prepare_input(const float *x, long M, long K, input_t *out) {
    long kp = INPUT_K(K), stride = INPUT_STRIDE(K);
    for (long m = 0; m < M; m++) {
        const float *row = x + m * K;
        input_t *o = out + m * stride;
        float scale;
        int finite = store_row_scale(row, K, o, kp, &scale);
        int *corrections = (int *)(o + kp + 4);
        __m512 divisor = _mm512_set1_ps(finite ? scale : 1.0f);
        __m512i sum = _mm512_setzero_si512();
        for (long k = 0; k < kp; k += 16) {
            __mmask16 kept = kp - k >= 16 ? 0xFFFF : (__mmask16)((1u << (kp - k)) - 1);
            __m512 value = _mm512_castsi512_ps(row_bits(row, K, k));
            __m512i q = finite ? _mm512_cvtps_epi32(_mm512_div_ps(value, divisor)) : _mm512_setzero_si512(); /* nearest even */
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
            _mm512_mask_cvtepi32_storeu_epi8(o + k, kept, q);
            sum = _mm512_add_epi32(sum, q);
            if ((k + 16) % KC == 0 || k + 16 >= kp) { /* a chunk's end */
                corrections[k / KC] = 128 * _mm512_reduce_add_epi32(sum);
                sum = _mm512_setzero_si512();
            }
        }
    }
}
#else
static void prepare_input(const float *x, long M, long K, input_t *out) {
    long kp = INPUT_K(K), stride = INPUT_STRIDE(K);
    for (long m = 0; m < M; m++) {
        const float *row = x + m * K;
        input_t *o = out + m * stride;
        unsigned top = row_top_bits(row, K);
        /* largest < 2^(e - 126), e its biased exponent: |value| / 2^shift < 2^22, three digits hold it (a row
         * below 2^-104 keeps shift -126, a normal float's least: fewer of its bits, none of them lost above 2^-127) */
        int shift = (int)(top >> 23) - 148 > -126 ? (int)(top >> 23) - 148 : -126;
        union { unsigned u; float f; } power = {(unsigned)(shift + 127) << 23};
        float nan = __builtin_nanf("");
        float scale = top >= 0x7f800000u ? nan /* an infinity or NaN: the row's products are NaN */ : top == 0 ? 0.0f : power.f;
        int *corrections = (int *)(o + 3 * kp + 4);
        memcpy(o + 3 * kp, &scale, sizeof scale);
        __m512 minus_shift = _mm512_set1_ps((float)-shift);
        __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (long k = 0; k < kp; k += 16) {
            __mmask16 kept = kp - k >= 16 ? 0xFFFF : (__mmask16)((1u << (kp - k)) - 1);
            __m512i bits = row_bits(row, K, k);
            /* a finite row: value * 2^-shift (exact, VSCALEFPS) rounded to the nearest integer, ties to even */
            __m512i whole = top < 0x7f800000u ? _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_castsi512_ps(bits), minus_shift)) : _mm512_setzero_si512();
            __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(whole, _mm512_set1_epi32(128)), _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
            __m512i rest = _mm512_srai_epi32(_mm512_sub_epi32(whole, d0), 8);
            __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(rest, _mm512_set1_epi32(128)), _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
            __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(rest, d1), 8);
            _mm512_mask_cvtepi32_storeu_epi8(o + k, kept, d0);
            _mm512_mask_cvtepi32_storeu_epi8(o + kp + k, kept, d1);
            _mm512_mask_cvtepi32_storeu_epi8(o + 2 * kp + k, kept, d2);
            sums[0] = _mm512_add_epi32(sums[0], d0), sums[1] = _mm512_add_epi32(sums[1], d1), sums[2] = _mm512_add_epi32(sums[2], d2);
            if ((k + 16) % KC == 0 || k + 16 >= kp) { /* a chunk's end (KC is a multiple of 16) */
                int *chunk = corrections + 3 * (k / KC);
                for (int p = 0; p < 3; p++) {
                    int total = _mm512_reduce_add_epi32(sums[p]);
                    chunk[p] = 128 * total;
                    sums[p] = _mm512_setzero_si512();
                }
            }
        }
    }
}
#endif
#endif /* VNNI_AVX2 */
#elif defined(DOT_BF16)
typedef unsigned short input_t;
#define INPUT_K(K) (((K) + 3) & ~3L)
#define INPUT_STRIDE(K) INPUT_K(K)
static void prepare_input(const float *x, long M, long K, input_t *out) {
    long kp = INPUT_K(K);
    for (long m = 0; m < M; m++) {
        const float *row = x + m * K;
        input_t *o = out + m * kp;
        long k = 0;
        for (; k + 32 <= K; k += 32)
            _mm512_storeu_si512((void *)(o + k), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k)));
        for (; k < K; k++) {
            union { float f; unsigned u; } bits = {row[k]};
            o[k] = (bits.u & 0x7fffffffu) > 0x7f800000u ? (input_t)((bits.u >> 16) | 0x40u) : (input_t)((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
        }
        for (; k < kp; k++)
            o[k] = 0;
    }
}
#else
typedef float input_t;
#define INPUT_K(K) (K)
#define INPUT_STRIDE(K) (K)
static void prepare_input(const float *x, long M, long K, input_t *out) { memcpy(out, x, (size_t)(M * K) * sizeof(float)); }
#endif

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
#define STORE(i) store_row(SCALED(a##i##0, 0), SCALED(a##i##1, 1), SCALED(a##i##2, 2), y + (i) * ldy, bias, ncols, first);
/* One chunk row of the panel (24 weights: 96 bytes in float32, 48 in bf16). */
#define LOAD_W                                                         \
    const weight_t *w = chunk + k * NR;                                \
    __m256 w0 = load_weights(w), w1 = load_weights(w + 8), w2 = load_weights(w + 16);
/* The same, and a prefetch of the same row of the chunk after it. */
#define LOAD_W_PREFETCH                                                \
    _mm_prefetch((const char *)(chunk + k * NR + ahead), _MM_HINT_T0);      \
    _mm_prefetch((const char *)(chunk + k * NR + ahead + 16), _MM_HINT_T0); \
    LOAD_W

#define BLOCK(rows, load, declare, accumulate, store)                                                        \
    static void block##rows(const input_t *x, long ldx, const weight_t *chunk, long kn, long ahead, float *y,     \
                            long ldy, const float *bias, int ncols, int first, const float *scales) {       \
        (void)ahead, (void)scales;                                                                           \
        declare for (long k = 0; k < kn; k++) { load accumulate } store                                     \
    }

#if !defined(DOT_BF16) && !SCALE_ROWS && !defined(WIDE_F32) /* the float32 rows' blocks over float32 or bf16 weights (the dot build's are dot_block, 8-bit's eight_bit_block, the wide build's wide_block) */
BLOCK(4, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3), STORE(0) STORE(1) STORE(2) STORE(3))
BLOCK(3, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1) DECLARE(2), ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2), STORE(0) STORE(1) STORE(2))
BLOCK(2, LOAD_W_PREFETCH, DECLARE(0) DECLARE(1), ACCUMULATE(0) ACCUMULATE(1), STORE(0) STORE(1))
/* One row: after a block of 4 on the same chunk (M = 5, 9, ...) the chunk ahead is already on its way. */
BLOCK(1, LOAD_W, DECLARE(0), ACCUMULATE(0), STORE(0))
#endif

#if defined(WEIGHT_VNNI) || defined(DOT_BF16)
/* Columns 0-7 and 8-15 of a zmm of sums, as ymm. */
#define LOW_HALF(v) _mm512_castps512_ps256(v)
#define HIGH_HALF(v) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))
#endif

#if defined(WEIGHT_VNNI) && defined(VNNI_AVX2)
/* acc + the sums of four products a 32-bit lane, as VPDPBUSD gives them: w the weights' bytes q + 128 (made q
 * by flipping their top bit, once per load), d a row's broadcast digits. VPMADDUBSW multiplies unsigned by
 * signed bytes into pairs' sums of 16 bits, which would saturate for q + 128 (255 x 127 x 2); so the
 * magnitudes |q| (at most 128) are the unsigned side and the digits take q's sign (VPSIGNB; a digit is at most
 * 127 in magnitude, so its negation fits): each pair's sum is within 2 x 128 x 127, exact. VPMADDWD by ones
 * adds the pairs into the lane: sum(q d), an exact int32 (the AVX-512 build's plane less its correction). */
#ifdef AVX_VNNI
/* Built with -DAVX_VNNI as well (`w8a8-avxvnni`, `w8a8-avxvnni-bf16`: CPUs with AVX-VNNI, the VEX-encoded VPDPBUSD
 * on 256-bit vectors, among them those without AVX-512 (Alder Lake and later Intel cores, Sierra Forest)): the
 * same magnitudes and signed digits, the three instructions' sum one VPDPBUSD. Its 32-bit lanes add the four
 * products exactly (no 16-bit pairs to saturate), so the same integers and the same bits. Without -mavxvnni
 * (a test on an AVX512_VNNI CPU, which has no AVX-VNNI) the same instruction in its EVEX form (AVX512_VNNI with
 * AVX512VL): the same arithmetic, the same source. */
static inline __attribute__((always_inline)) __m256i avx2_dot(__m256i acc, __m256i magnitudes, __m256i signs, __m256i d) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, magnitudes, _mm256_sign_epi8(d, signs));
#else
    return _mm256_dpbusd_epi32(acc, magnitudes, _mm256_sign_epi8(d, signs));
#endif
}
#else
static inline __attribute__((always_inline)) __m256i avx2_dot(__m256i acc, __m256i magnitudes, __m256i signs, __m256i d) {
    __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(d, signs));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
/* A row's chunk sums (columns 0-7, 8-15, and 16-23's two quads a column, side by side) times the row's scale
 * and the columns' scales, added into y: vnni_store's arithmetic on the same integers. */
static inline __attribute__((always_inline)) void avx2_store(const input_t *row, long kp, __m256i s0, __m256i s1, __m256i t0, __m256i t1, float *y,
                                                             const float *bias, int ncols, int first, const float *scales) {
    float scale;
    memcpy(&scale, row + kp, sizeof scale);
    /* hadd: columns 16, 17, 20, 21 | 18, 19, 22, 23; the 64-bit pairs put back in order */
    __m256i tail = _mm256_permute4x64_epi64(_mm256_hadd_epi32(t0, t1), 0xD8);
    __m256 factor = _mm256_set1_ps(scale);
    __m256 a0 = _mm256_mul_ps(_mm256_cvtepi32_ps(s0), factor), a1 = _mm256_mul_ps(_mm256_cvtepi32_ps(s1), factor);
    __m256 a2 = _mm256_mul_ps(_mm256_cvtepi32_ps(tail), factor);
    store_row(SCALED(a0, 0), SCALED(a1, 1), SCALED(a2, 2), y, bias, ncols, first);
}
/* Up to 4 rows over a chunk of octs (the AVX-512 build's panels: see vnni_block): each of an oct's six runs of
 * 32 bytes (columns 0-7 and 8-15 of k..k+3, of k+4..k+7, columns 16-19 and 20-23 of both quads) is loaded and
 * split into magnitudes and signs once for the block's rows. A row's sums: s<row>0 and s<row>1 (columns 0-7, 8-15:
 * both quads in one sum, exact integers in any order), t<row>0 and t<row>1 (16-19, 20-23, a lane a quad).
 * Blocks of 4 rows: their 16 sums take all of AVX2's 16 registers, so some live in L1, yet one core ran SmolLM-135M's
 * layer products 1.06-1.18x faster than in blocks of 2 (8 sums) and 1.03-1.14x than in blocks of 3 (at 4 to 32 rows). */
#define AVX2_DECLARE(r) __m256i s##r##0 = _mm256_setzero_si256(), s##r##1 = _mm256_setzero_si256(), t##r##0 = _mm256_setzero_si256(), \
                                t##r##1 = _mm256_setzero_si256();
#define AVX2_LOAD(at)                                                                                   \
    __m256i signs = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(w + (at))), flip); \
    __m256i magnitudes = _mm256_abs_epi8(signs);
#define BROADCAST4(p) _mm256_set1_epi32(*(const int *)(const void *)(p))
#define BROADCAST8(p) _mm256_set1_epi64x(*(const long long *)(const void *)(p))
#define AVX2_ROW(r, kind, half, broadcast, offset) \
    kind##r##half = avx2_dot(kind##r##half, magnitudes, signs, broadcast(x + (r) * ldx + k0 + k + (offset)));
#define AVX2_ONE_ROW(kind, half, broadcast, offset) AVX2_ROW(0, kind, half, broadcast, offset)
#define AVX2_TWO_ROWS(kind, half, broadcast, offset) AVX2_ROW(0, kind, half, broadcast, offset) AVX2_ROW(1, kind, half, broadcast, offset)
#define AVX2_THREE_ROWS(kind, half, broadcast, offset) AVX2_TWO_ROWS(kind, half, broadcast, offset) AVX2_ROW(2, kind, half, broadcast, offset)
#define AVX2_FOUR_ROWS(kind, half, broadcast, offset) AVX2_THREE_ROWS(kind, half, broadcast, offset) AVX2_ROW(3, kind, half, broadcast, offset)
#define AVX2_OCT(each_row)                                                                                      \
    { AVX2_LOAD(0) each_row(s, 0, BROADCAST4, 0) }                                                              \
    { AVX2_LOAD(32) each_row(s, 1, BROADCAST4, 0) }                                                             \
    { AVX2_LOAD(64) each_row(s, 0, BROADCAST4, 4) }                                                             \
    { AVX2_LOAD(96) each_row(s, 1, BROADCAST4, 4) }                                                             \
    { AVX2_LOAD(128) each_row(t, 0, BROADCAST8, 0) }                                                            \
    { AVX2_LOAD(160) each_row(t, 1, BROADCAST8, 0) }
#define AVX2_STORE(r) avx2_store(x + (r) * ldx, kp, s##r##0, s##r##1, t##r##0, t##r##1, y + (r) * ldy, bias, ncols, first, scales);
#define AVX2_BLOCK(rows, declare, each_row, store)                                                                      \
    static void avx2_block##rows(const input_t *x, long ldx, long kp, long k0, const weight_t *chunk, long kn, long ahead, float *y, \
                                 long ldy, const float *bias, int ncols, int first, const float *scales) {             \
        const __m256i flip = _mm256_set1_epi8((char)0x80);                                                               \
        declare for (long k = 0; k < kn; k += 8) {                                                                       \
            const weight_t *w = chunk + k * NR;                                                                          \
            _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);                                                        \
            _mm_prefetch((const char *)(w + ahead + 64), _MM_HINT_T0);                                                   \
            _mm_prefetch((const char *)(w + ahead + 128), _MM_HINT_T0);                                                  \
            AVX2_OCT(each_row)                                                                                           \
        }                                                                                                                \
        store                                                                                                            \
    }
AVX2_BLOCK(4, AVX2_DECLARE(0) AVX2_DECLARE(1) AVX2_DECLARE(2) AVX2_DECLARE(3), AVX2_FOUR_ROWS, AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2) AVX2_STORE(3))
AVX2_BLOCK(3, AVX2_DECLARE(0) AVX2_DECLARE(1) AVX2_DECLARE(2), AVX2_THREE_ROWS, AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2))
AVX2_BLOCK(2, AVX2_DECLARE(0) AVX2_DECLARE(1), AVX2_TWO_ROWS, AVX2_STORE(0) AVX2_STORE(1))
AVX2_BLOCK(1, AVX2_DECLARE(0), AVX2_ONE_ROW, AVX2_STORE(0))
#define BLOCK_CALL(rows) avx2_block##rows(xm - k0, ldx, kp, k0, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales)
#define BLOCK_ROWS 4
#elif defined(WEIGHT_VNNI)
/* Up to VNNI_ROWS rows over a chunk of octs of k, each oct 192 bytes: columns 0-15's k..k+3 (a 32-bit lane a
 * column), their k+4..k+7, then columns 16-23's two quads side by side (lane 2c: column 16 + c's k..k+3, lane
 * 2c + 1: its k+4..k+7), so that every product is a zmm VPDPBUSD: a row's digits of k..k+3 and of k+4..k+7 are
 * two 32-bit broadcasts, and of k..k+7 one 64-bit broadcast (all from memory) for the tail. Each row keeps a
 * sum per digit plane for columns 0-15 and one for 16-23's lanes (added in pairs at the chunk's end), in
 * variables of its own, not arrays (GCC then copied every accumulator between registers each quad). Sums of one chunk, exact integers, joined at its end (see prepare_input),
 * so every row's result is the same whatever the block's rows. */
#if PLANES == 1
#define VNNI_ROWS 4 /* one plane: 8 accumulators for 4 rows */
#else
#define VNNI_ROWS 2 /* 12 accumulators: at 3 and 4 rows (18, 24) GCC spilled them inside the loop */
#endif
/* Columns 16-23's sums from the tail's lanes: each column's two lanes (its two quads) added. */
static inline __m256i vnni_tail_columns(__m512i tails) {
    __m512i sums = _mm512_add_epi32(tails, _mm512_shuffle_epi32(tails, (_MM_PERM_ENUM)0xB1)); /* lane 2c + lane 2c + 1, in lane 2c */
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), sums));
}
/* A row's chunk sums joined (see prepare_input): the planes less their corrections, 65536 s2 + 256 s1 + s0,
 * times the row's 2^shift and the columns' scales, added into y. */
static inline __attribute__((always_inline)) void vnni_store(const input_t *row, long kp, long k0, __m512i l0, __m512i l1, __m512i l2, __m512i t0,
                                                             __m512i t1, __m512i t2, float *y, const float *bias, int ncols, int first,
                                                             const float *scales) {
    const int *correction = (const int *)(row + PLANES * kp + 4) + PLANES * (k0 / KC);
    float scale;
    memcpy(&scale, row + PLANES * kp, sizeof scale);
#if PLANES == 1
    (void)l1, (void)l2, (void)t1, (void)t2;
    __m512i c0 = _mm512_set1_epi32(correction[0]);
    __m512 head = _mm512_cvtepi32_ps(_mm512_sub_epi32(l0, c0));
    __m256 tail = _mm256_cvtepi32_ps(_mm256_sub_epi32(vnni_tail_columns(t0), _mm512_castsi512_si256(c0)));
#else
    __m512i c0 = _mm512_set1_epi32(correction[0]), c1 = _mm512_set1_epi32(correction[1]), c2 = _mm512_set1_epi32(correction[2]);
    __m256i h0 = vnni_tail_columns(t0), h1 = vnni_tail_columns(t1), h2 = vnni_tail_columns(t2);
    __m512 head = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l2, c2)), _mm512_set1_ps(65536.0f),
                                  _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l1, c1)), _mm512_set1_ps(256.0f),
                                                  _mm512_cvtepi32_ps(_mm512_sub_epi32(l0, c0))));
    __m256 tail = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(h2, _mm512_castsi512_si256(c2))), _mm256_set1_ps(65536.0f),
                                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(h1, _mm512_castsi512_si256(c1))), _mm256_set1_ps(256.0f),
                                                  _mm256_cvtepi32_ps(_mm256_sub_epi32(h0, _mm512_castsi512_si256(c0)))));
#endif
    head = _mm512_mul_ps(head, _mm512_set1_ps(scale)), tail = _mm256_mul_ps(tail, _mm256_set1_ps(scale));
    store_row(SCALED(LOW_HALF(head), 0), SCALED(HIGH_HALF(head), 1), SCALED(tail, 2), y, bias, ncols, first);
}
#define VNNI_DECLARE(r)                                                                                                  \
    __m512i l##r##0 = _mm512_setzero_si512(), l##r##1 = _mm512_setzero_si512(), l##r##2 = _mm512_setzero_si512();     \
    __m512i t##r##0 = _mm512_setzero_si512(), t##r##1 = _mm512_setzero_si512(), t##r##2 = _mm512_setzero_si512();
#define VNNI_PLANE(r, p)                                                                                                 \
    {                                                                                                                    \
        const input_t *digits = x + (r) * ldx + (p) * kp + k0 + k;                                                       \
        l##r##p = _mm512_dpbusd_epi32(l##r##p, low, _mm512_broadcastd_epi32(_mm_loadu_si32((const void *)digits)));     \
        l##r##p = _mm512_dpbusd_epi32(l##r##p, next, _mm512_broadcastd_epi32(_mm_loadu_si32((const void *)(digits + 4)))); \
        t##r##p = _mm512_dpbusd_epi32(t##r##p, tails, _mm512_broadcastq_epi64(_mm_loadu_si64((const void *)digits)));    \
    }
#if PLANES == 1
#define VNNI_ACCUMULATE(r) VNNI_PLANE(r, 0)
#define VNNI_STORE(r) vnni_store(x + (r) * ldx, kp, k0, l##r##0, l##r##0, l##r##0, t##r##0, t##r##0, t##r##0, y + (r) * ldy, bias, ncols, first, scales);
#else
#define VNNI_ACCUMULATE(r) VNNI_PLANE(r, 0) VNNI_PLANE(r, 1) VNNI_PLANE(r, 2)
#define VNNI_STORE(r) vnni_store(x + (r) * ldx, kp, k0, l##r##0, l##r##1, l##r##2, t##r##0, t##r##1, t##r##2, y + (r) * ldy, bias, ncols, first, scales);
#endif
#define VNNI_BLOCK(rows, declare, accumulate, store)                                                                     \
    static void vnni_block##rows(const input_t *x, long ldx, long kp, long k0, const weight_t *chunk, long kn, long ahead, float *y, \
                                 long ldy, const float *bias, int ncols, int first, const float *scales) {             \
        declare for (long k = 0; k < kn; k += 8) {                                                                       \
            const weight_t *w = chunk + k * NR;                                                                          \
            _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);                                                        \
            _mm_prefetch((const char *)(w + ahead + 64), _MM_HINT_T0);                                                   \
            _mm_prefetch((const char *)(w + ahead + 128), _MM_HINT_T0);                                                  \
            __m512i low = _mm512_loadu_si512((const void *)w), next = _mm512_loadu_si512((const void *)(w + 64));         \
            __m512i tails = _mm512_loadu_si512((const void *)(w + 128));                                                  \
            accumulate                                                                                                   \
        }                                                                                                                \
        store                                                                                                            \
    }
#if PLANES == 1
#define VNNI_DECLARE1(r) __m512i l##r##0 = _mm512_setzero_si512(), t##r##0 = _mm512_setzero_si512();
VNNI_BLOCK(4, VNNI_DECLARE1(0) VNNI_DECLARE1(1) VNNI_DECLARE1(2) VNNI_DECLARE1(3), VNNI_ACCUMULATE(0) VNNI_ACCUMULATE(1) VNNI_ACCUMULATE(2) VNNI_ACCUMULATE(3),
           VNNI_STORE(0) VNNI_STORE(1) VNNI_STORE(2) VNNI_STORE(3))
VNNI_BLOCK(3, VNNI_DECLARE1(0) VNNI_DECLARE1(1) VNNI_DECLARE1(2), VNNI_ACCUMULATE(0) VNNI_ACCUMULATE(1) VNNI_ACCUMULATE(2), VNNI_STORE(0) VNNI_STORE(1) VNNI_STORE(2))
VNNI_BLOCK(2, VNNI_DECLARE1(0) VNNI_DECLARE1(1), VNNI_ACCUMULATE(0) VNNI_ACCUMULATE(1), VNNI_STORE(0) VNNI_STORE(1))
VNNI_BLOCK(1, VNNI_DECLARE1(0), VNNI_ACCUMULATE(0), VNNI_STORE(0))
#else
VNNI_BLOCK(2, VNNI_DECLARE(0) VNNI_DECLARE(1), VNNI_ACCUMULATE(0) VNNI_ACCUMULATE(1), VNNI_STORE(0) VNNI_STORE(1))
VNNI_BLOCK(1, VNNI_DECLARE(0), VNNI_ACCUMULATE(0), VNNI_STORE(0))
#endif
#define BLOCK_CALL(rows) vnni_block##rows(xm - k0, ldx, kp, k0, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales)
#define BLOCK_ROWS VNNI_ROWS
#elif defined(DOT_BF16)
/* The dot build's weights as bf16 pairs: bf16 loaded as they are; int8 (-DWEIGHT_INT8 as well) widened
 * to bf16 exactly (every integer of -128..127 is a bf16), so each product is an int8 weight times the
 * row's bf16 value, exact, summed in float32 (the scale applied to the sums, SCALED). */
#if defined(WEIGHT_INT8)
static inline __m512 int8_floats16(const weight_t *w) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w))); }
static inline __m512bh dot_weights32(const weight_t *w) { return _mm512_cvtne2ps_pbh(int8_floats16(w + 16), int8_floats16(w)); }
#elif defined(WEIGHT_FP8)
/* e4m3 to bf16, exactly (3 mantissa bits and exponents 2^-9..2^8 all fit bf16), in 16-bit lanes: a normal's
 * exponent and mantissa bits shifted into bf16's place and rebiased by 127 - 7; a subnormal (exponent 0:
 * its mantissa m times 2^-9) looked up among the eight; then the sign. */
static const unsigned short FP8_SUBNORMALS[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
static inline __m512bh dot_weights32(const weight_t *w) {
    __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi16(0x7f));
    __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
    __m512i subnormal = _mm512_permutexvar_epi16(magnitude, _mm512_loadu_si512((const void *)FP8_SUBNORMALS));
    __m512i value = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), normal, subnormal);
    return (__m512bh)_mm512_or_si512(value, _mm512_slli_epi16(_mm512_and_si512(bits, _mm512_set1_epi16(0x80)), 8));
}
#else
static inline __m512bh dot_weights32(const weight_t *w) { return (__m512bh)_mm512_loadu_si512((const void *)w); }
#endif
/* Up to DOT_ROWS rows over a chunk of quads of k. Each row keeps three chains of sums, each taking one
 * VDPBF16PS a quad: columns 0-15 of the quad's first pair (first), of its second (second), and columns
 * 16-23 of both pairs in one zmm (both_tails: the layout interleaves them, a 32-bit lane of the first
 * pair's then one of the second's per column, so that one 64-bit broadcast of the row's two pairs meets
 * each lane with its own pair); at the chunk's end each column adds its two pairs' sums. The row's
 * values are broadcast straight from memory (a load each, no shuffle). Why three chains: an
 * accumulator waits for its last VDPBF16PS (several cycles), and with one chain for columns 0-15 (two
 * VDPBF16PS a quad into one register) one row multiplied 8 weights a cycle, a quarter of what the core
 * does. int8 weights in blocks of 8 rows: widening them costs more than their dot products, so a block
 * of more rows widens each weight for more of them (32 registers hold 8 rows' 24 sums, the 3 weights
 * and the broadcasts); each row's sums run in the same order at any block size. */
#if defined(WEIGHT_INT8) || defined(WEIGHT_FP8)
#define DOT_ROWS 8
#else
#define DOT_ROWS 4
#endif
/* Columns 16-23 from both_tails' sums: each column's two lanes (its pairs) added. */
static inline __m256 tail_columns(__m512 both_tails) {
    __m512 sums = _mm512_add_ps(both_tails, _mm512_permute_ps(both_tails, 0xB1)); /* lane 2c + lane 2c + 1, in lane 2c */
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), sums));
}
static inline __attribute__((always_inline)) void dot_block(int rows, const input_t *x, long ldx, const weight_t *chunk, long kn, long ahead, float *y,
                                                            long ldy, const float *bias, int ncols, int first, const float *scales,
                                                            int from_widened, const __m512bh *widened) {
    (void)scales, (void)widened;
    __m512 first_sums[DOT_ROWS], second_sums[DOT_ROWS], tail_sums[DOT_ROWS];
    for (int r = 0; r < DOT_ROWS; r++)
        first_sums[r] = second_sums[r] = tail_sums[r] = _mm512_setzero_ps();
    for (long k = 0; k < kn; k += 4) {
        __m512bh first_pair, second_pair, both_tails;
        if (from_widened) { /* the chunk widened once for all the product's rows (widen_chunk) */
            first_pair = widened[3 * (k / 4)], second_pair = widened[3 * (k / 4) + 1], both_tails = widened[3 * (k / 4) + 2];
        } else {
            const weight_t *w = chunk + k * NR; /* one quad: 4 k x 24 columns = 192 bytes */
            _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0); /* one row too (AHEAD_BYTES) */
            _mm_prefetch((const char *)(w + ahead + 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ahead + 64), _MM_HINT_T0);
            /* Columns 16-23 of both pairs lie together (w + 64 .. w + 95): one widening for the two. */
            first_pair = dot_weights32(w), second_pair = dot_weights32(w + 32), both_tails = dot_weights32(w + 64);
        }
        for (int r = 0; r < rows; r++) {
            const float *pairs = (const float *)(x + r * ldx + k); /* two bf16 pairs, x[k] in each one's low half */
            __m512bh x0 = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(pairs)), x1 = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(pairs + 1));
            __m512bh both = (__m512bh)_mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_load_sd((const double *)pairs)));
            first_sums[r] = _mm512_dpbf16_ps(first_sums[r], x0, first_pair);
            second_sums[r] = _mm512_dpbf16_ps(second_sums[r], x1, second_pair);
            tail_sums[r] = _mm512_dpbf16_ps(tail_sums[r], both, both_tails);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 head = _mm512_add_ps(first_sums[r], second_sums[r]);
        store_row(SCALED(LOW_HALF(head), 0), SCALED(HIGH_HALF(head), 1), SCALED(tail_columns(tail_sums[r]), 2), y + r * ldy, bias, ncols, first);
    }
}
/* bf16 weights, a product of PAIR_MIN_ROWS rows or more: two panels (48 columns) a block of up to
 * PAIR_DOT_ROWS rows, each broadcast of a row's pairs feeding both panels' chains. Why: on a Zen 4
 * EPYC a broadcast costs the FP pipes a slot as a VDPBF16PS does, so dot_block's three broadcasts
 * for three VDPBF16PS a row and quad held it to 73% of the core's VDPBF16PS peak with the weights
 * in L1 (at 4, 6 or 8 rows alike); three broadcasts for six reached 99-100% (at 3 and 4 rows; 2
 * rows, 73%). 4 rows' 24 sums, the 6 weight vectors and the 3 broadcasts fill the 32 registers.
 * Each column's chains are dot_block's, in its order, so a row's result is the same bits paired
 * or not, in any block (and the embedded-broadcast form, VDPBF16PS with {1to16}, measured slower:
 * 99 against 170 GFLOP/s). The 8-bit dot builds pair their panels where they widen each chunk once
 * (widen_chunk, from three blocks of DOT_ROWS rows): the blocks read both panels' widened chunks. */
#define PAIRED_DOT 1
#define PAIR_DOT_ROWS 4
#if defined(WEIGHT_INT8) || defined(WEIGHT_FP8)
#define PAIR_MIN_ROWS (2 * DOT_ROWS + 1)
#else
#define PAIR_MIN_ROWS 9 /* below, a product is bound by reading the weights, and two streams at once measured slower */
#endif
#define PAIR_AHEAD_K 128 /* each panel prefetched this far ahead: a whole chunk for both overflowed L1 and measured slower */
static inline __attribute__((always_inline)) void dot_pair_block(int rows, const input_t *x, long ldx, const weight_t *chunk, const weight_t *other,
                                                                 long kn, long ahead, long other_ahead, float *y, long ldy, const float *bias, int ncols,
                                                                 int first, const __m512bh *widened, const __m512bh *widened_other,
                                                                 const float *scales_of_first, const float *other_scales) {
    __m512 first_sums[PAIR_DOT_ROWS], second_sums[PAIR_DOT_ROWS], tail_sums[PAIR_DOT_ROWS];
    __m512 first_next[PAIR_DOT_ROWS], second_next[PAIR_DOT_ROWS], tail_next[PAIR_DOT_ROWS]; /* the other panel's */
    for (int r = 0; r < PAIR_DOT_ROWS; r++)
        first_sums[r] = second_sums[r] = tail_sums[r] = first_next[r] = second_next[r] = tail_next[r] = _mm512_setzero_ps();
    for (long k = 0; k < kn; k += 4) {
        __m512bh first_pair, second_pair, both_tails, first_other, second_other, tails_other;
        if (widened) { /* both chunks widened once for all the product's rows (widen_chunk) */
            first_pair = widened[3 * (k / 4)], second_pair = widened[3 * (k / 4) + 1], both_tails = widened[3 * (k / 4) + 2];
            first_other = widened_other[3 * (k / 4)], second_other = widened_other[3 * (k / 4) + 1], tails_other = widened_other[3 * (k / 4) + 2];
        } else {
            const weight_t *w = chunk + k * NR, *v = other + k * NR;
            long far = k + PAIR_AHEAD_K < kn ? PAIR_AHEAD_K * NR : ahead + (PAIR_AHEAD_K - kn) * NR; /* from w (and v) */
            long other_far = k + PAIR_AHEAD_K < kn ? PAIR_AHEAD_K * NR : other_ahead + (PAIR_AHEAD_K - kn) * NR;
            _mm_prefetch((const char *)(w + far), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + far + 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + far + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(v + other_far), _MM_HINT_T0);
            _mm_prefetch((const char *)(v + other_far + 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(v + other_far + 64), _MM_HINT_T0);
            first_pair = dot_weights32(w), second_pair = dot_weights32(w + 32), both_tails = dot_weights32(w + 64);
            first_other = dot_weights32(v), second_other = dot_weights32(v + 32), tails_other = dot_weights32(v + 64);
        }
        for (int r = 0; r < rows; r++) {
            const float *pairs = (const float *)(x + r * ldx + k);
            __m512bh x0 = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(pairs)), x1 = (__m512bh)_mm512_broadcastss_ps(_mm_load_ss(pairs + 1));
            __m512bh both = (__m512bh)_mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_load_sd((const double *)pairs)));
            first_sums[r] = _mm512_dpbf16_ps(first_sums[r], x0, first_pair);
            second_sums[r] = _mm512_dpbf16_ps(second_sums[r], x1, second_pair);
            tail_sums[r] = _mm512_dpbf16_ps(tail_sums[r], both, both_tails);
            first_next[r] = _mm512_dpbf16_ps(first_next[r], x0, first_other);
            second_next[r] = _mm512_dpbf16_ps(second_next[r], x1, second_other);
            tail_next[r] = _mm512_dpbf16_ps(tail_next[r], both, tails_other);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 head = _mm512_add_ps(first_sums[r], second_sums[r]), next = _mm512_add_ps(first_next[r], second_next[r]);
        {
            const float *scales = scales_of_first; /* SCALED's (an 8-bit build's) */
            (void)scales;
            store_row(SCALED(LOW_HALF(head), 0), SCALED(HIGH_HALF(head), 1), SCALED(tail_columns(tail_sums[r]), 2), y + r * ldy, bias, NR, first);
        }
        {
            const float *scales = other_scales;
            (void)scales;
            store_row(SCALED(LOW_HALF(next), 0), SCALED(HIGH_HALF(next), 1), SCALED(tail_columns(tail_next[r]), 2), y + r * ldy + NR, bias ? bias + NR : 0,
                      ncols - NR, first);
        }
    }
}
#if defined(WEIGHT_INT8) || defined(WEIGHT_FP8)
/* The chunk's 8-bit weights widened to bf16 once, for a product of three blocks of rows or more: each
 * block then reads the bf16 pairs from L1 rather than widening them again (at 32 rows, four times),
 * and multiplies exactly what it would have widened itself, so a row's result is the same bits whatever
 * the batch. Why: on a Zen 4 EPYC (AVX-512 in two halves) int8-dot's 32-row step was slower than bf16's
 * own. There, SmolLM-135M's int8 products at 24 / 32 / 64 rows took 0.96x / 0.92x / 0.90x the time
 * (bench/kernel_ab.py, before and after in one process); at 16 rows, two blocks, widening once was 7% slower. */
#define WIDEN_ONCE 1
static const __m512bh *widen_chunk(const weight_t *chunk, long kn, long ahead, int buffer) {
    static __thread __m512bh buffers[2][KC / 4 * 3]; /* the second: a pair's other panel (pair_range) */
    __m512bh *widened = buffers[buffer];
    for (long k = 0; k < kn; k += 4) {
        const weight_t *w = chunk + k * NR;
        _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + ahead + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + ahead + 64), _MM_HINT_T0);
        widened[3 * (k / 4)] = dot_weights32(w), widened[3 * (k / 4) + 1] = dot_weights32(w + 32), widened[3 * (k / 4) + 2] = dot_weights32(w + 64);
    }
    return widened;
}
#define BLOCK_CALL(rows)                                                                                                   \
    (widened ? dot_block(rows, xm, ldx, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales, 1, widened)                   \
             : dot_block(rows, xm, ldx, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales, 0, 0))
#else
#define BLOCK_CALL(rows) dot_block(rows, xm, ldx, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales, 0, 0)
#endif
#define BLOCK_ROWS DOT_ROWS
#elif SCALE_ROWS
/* Up to EIGHT_BIT_ROWS rows over a chunk of 8-bit weights. Widening a weight costs about what its FMA
 * does, so a single row's three chains of FMAs (each waiting for the last's 4-cycle latency) would
 * leave the core idle: each row sums even k and odd k into two sets of accumulators (six chains a
 * row), added at the chunk's end. Every row is summed so whatever the block's rows, as the other
 * builds do. Blocks of 4 rows where AVX-512VL gives 32 vector registers (24 accumulators, the
 * weights, a broadcast), else of 2 (12 accumulators in 16 registers). */
#ifdef __AVX512VL__
#define EIGHT_BIT_ROWS 4
#else
#define EIGHT_BIT_ROWS 2
#endif
static inline __attribute__((always_inline)) void eight_bit_block(int rows, const input_t *x, long ldx, const weight_t *chunk, long kn, long ahead,
                                                                  float *y, long ldy, const float *bias, int ncols, int first, const float *scales) {
    __m256 even[EIGHT_BIT_ROWS][3], odd[EIGHT_BIT_ROWS][3];
    for (int r = 0; r < EIGHT_BIT_ROWS; r++)
        for (int j = 0; j < 3; j++)
            even[r][j] = odd[r][j] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 2 <= kn; k += 2) {
        const weight_t *w = chunk + k * NR; /* two rows of the panel: 48 bytes */
        if (rows > 1)
            _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);
        __m256 e0 = load_weights(w), e1 = load_weights(w + 8), e2 = load_weights(w + 16);
        for (int r = 0; r < rows; r++) {
            __m256 xe = _mm256_broadcast_ss(x + r * ldx + k);
            even[r][0] = _mm256_fmadd_ps(xe, e0, even[r][0]);
            even[r][1] = _mm256_fmadd_ps(xe, e1, even[r][1]);
            even[r][2] = _mm256_fmadd_ps(xe, e2, even[r][2]);
        }
        __m256 o0 = load_weights(w + 24), o1 = load_weights(w + 32), o2 = load_weights(w + 40);
        for (int r = 0; r < rows; r++) {
            __m256 xo = _mm256_broadcast_ss(x + r * ldx + k + 1);
            odd[r][0] = _mm256_fmadd_ps(xo, o0, odd[r][0]);
            odd[r][1] = _mm256_fmadd_ps(xo, o1, odd[r][1]);
            odd[r][2] = _mm256_fmadd_ps(xo, o2, odd[r][2]);
        }
    }
    if (k < kn) { /* an odd chunk's last row of the panel */
        const weight_t *w = chunk + k * NR;
        __m256 e0 = load_weights(w), e1 = load_weights(w + 8), e2 = load_weights(w + 16);
        for (int r = 0; r < rows; r++) {
            __m256 xe = _mm256_broadcast_ss(x + r * ldx + k);
            even[r][0] = _mm256_fmadd_ps(xe, e0, even[r][0]);
            even[r][1] = _mm256_fmadd_ps(xe, e1, even[r][1]);
            even[r][2] = _mm256_fmadd_ps(xe, e2, even[r][2]);
        }
    }
    for (int r = 0; r < rows; r++)
        store_row(SCALED(_mm256_add_ps(even[r][0], odd[r][0]), 0), SCALED(_mm256_add_ps(even[r][1], odd[r][1]), 1),
                  SCALED(_mm256_add_ps(even[r][2], odd[r][2]), 2), y + r * ldy, bias, ncols, first);
}
#define BLOCK_CALL(rows) eight_bit_block(rows, xm, ldx, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales)
#define BLOCK_ROWS EIGHT_BIT_ROWS
#else
#define BLOCK_CALL(rows) block##rows(xm, ldx, chunk, kn, ahead, ym, N, b, ncols, k0 == 0, scales)
#define BLOCK_ROWS 4
#endif

#ifdef WIDE_F32
/* The float32 build for AVX-512 (-DWIDE_F32 -mavx512f -mavx512vl): the same panels of 24 columns and
 * blocks of up to WIDE_ROWS = 8 rows. A product of pair_rows rows or more reads the panels two at a
 * time, each row's 48 columns in three 16-float vectors (columns 0-15 of either panel, then 16-23 of
 * both, the two 8-float halves joined as they are loaded): 8 rows' 24 accumulators, the 3 weight
 * vectors and a broadcast fill the 32 registers, 24 FMAs of 16 lanes per 3 weight loads and 8
 * broadcasts (the AVX2 block: 12 FMAs of 8 lanes per 3 loads and 4 broadcasts). Fewer rows read one
 * panel at a time (a 16-float and an 8-float vector a row), as does a last panel without a partner.
 * Which is faster from how many rows depends on the CPU: on a Zen 5 EPYC pairs at 4 and 8 rows were
 * 6-30% slower than single panels, at 32 and 64 rows 6-19% faster; on an Ice Lake Xeon pairs were
 * faster from 2 rows (1.06x at 2-3 rows, 1.10-1.21x at 4-12, SmolLM-135M's products). So small_gemm.py
 * measures at first use and sets pair_rows (small_gemm_pair_from). Each column is still one chain of
 * FMAs over k within a chunk of KC, added into y chunk by chunk: the AVX2 build's bits, whatever the
 * rows, the block or the pairing. */
#define WIDE_ROWS 8
static atomic_long pair_rows = 16; /* read by the caller and the helper alike: either pairing gives the same bits */
void small_gemm_pair_from(long rows) { atomic_store_explicit(&pair_rows, rows < 2 ? 2 : rows, memory_order_relaxed); }
#ifdef WEIGHT_BF16
/* bf16 weights (-DWEIGHT_BF16 too: bf16-widen-avx512), widened to float32 exactly as they are loaded: 16 at a
 * time, and the two panels' 8-column tails joined as 16-bit values before the one widening. */
static inline __m512 widen16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
static inline __m512 wide_load16(const weight_t *w) { return widen16(_mm256_loadu_si256((const __m256i *)w)); }
static inline __m512 join_halves(const weight_t *first, const weight_t *second) {
    return widen16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)first)), _mm_loadu_si128((const __m128i *)second), 1));
}
#else
static inline __m512 wide_load16(const weight_t *w) { return _mm512_loadu_ps(w); }
static inline __m512 join_halves(const weight_t *first, const weight_t *second) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_load_ps(first))), _mm256_castps_pd(_mm256_load_ps(second)), 1));
}
#endif
#define WIDENED_PAIR_K 48 /* floats a k of a pair's widened chunk: its three vectors (see wide_block) */
#ifdef WEIGHT_BF16
/* From WIDEN_PAIRS_FROM rows, the first block of rows over a pair's chunk keeps the floats it widens here, and the
 * product's other blocks over that chunk read them. Why: widening a vector is two uops on the FMA ports (the zero
 * extension on port 5, the shift on port 0), 7 beside each k's 24 FMAs in a block of 8 rows, paid again by every
 * block; read back, the widened chunk costs loads alone, as float32 panels do. The same floats in the same order:
 * the same bits. Measured on an Ice Lake Xeon, SmolLM-135M's products (30 layers' and the LM head) on one core,
 * interleaved: 16 rows the same, 32 rows 1.08-1.09x, 64 rows 1.14-1.26x. A separate pass widening each chunk
 * before the blocks measured slower (0.83-0.87x at 16 rows): it waits on memory with no FMA beside it. */
#define WIDEN_PAIRS_FROM 16
static __thread float widened_pair[KC * WIDENED_PAIR_K] __attribute__((aligned(64))); /* 48 KB */
#endif

/* pair: 0 one panel; 1 two panels; 2 two panels read from their chunk as a first block widened it (widened); 3 two
 * panels, widened as they are read and kept in widened for the blocks after it (WIDEN_PAIRS_FROM). */
static inline __attribute__((always_inline)) void wide_block(int rows, int pair, const float *x, long ldx, const weight_t *chunk, long panel_stride, long kn,
                                                             long ahead, float *y, long ldy, const float *bias, int ncols, int first, float *widened) {
    __m512 low[WIDE_ROWS], next[WIDE_ROWS], high[WIDE_ROWS];
    __m256 tail[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++)
        low[r] = next[r] = high[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps();
    const weight_t *other = chunk + panel_stride; /* the second panel's same chunk */
    for (long k = 0; k < kn; k++) {
        const weight_t *w = chunk + k * NR, *v = other + k * NR;
        if (pair == 2) { /* its lines were asked for by the first block (the next chunk's among them) */
            const float *at = widened + k * WIDENED_PAIR_K;
            __m512 w0 = _mm512_load_ps(at), v0 = _mm512_load_ps(at + 16), both = _mm512_load_ps(at + 32);
            for (int r = 0; r < rows; r++) {
                __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
                low[r] = _mm512_fmadd_ps(xr, w0, low[r]);
                next[r] = _mm512_fmadd_ps(xr, v0, next[r]);
                high[r] = _mm512_fmadd_ps(xr, both, high[r]);
            }
            continue;
        }
        {   /* one row too (AHEAD_BYTES) */
            _mm_prefetch((const char *)(w + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ahead + 16), _MM_HINT_T0);
            if (pair) {
                _mm_prefetch((const char *)(v + ahead), _MM_HINT_T0);
                _mm_prefetch((const char *)(v + ahead + 16), _MM_HINT_T0);
            }
        }
        __m512 w0 = wide_load16(w);
        if (pair) {
            __m512 v0 = wide_load16(v), both = join_halves(w + 16, v + 16);
            if (pair == 3) { /* the first block of rows keeps what it widens for the others (widened) */
                float *keep = widened + k * WIDENED_PAIR_K;
                _mm512_store_ps(keep, w0), _mm512_store_ps(keep + 16, v0), _mm512_store_ps(keep + 32, both);
            }
            for (int r = 0; r < rows; r++) {
                __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
                low[r] = _mm512_fmadd_ps(xr, w0, low[r]);
                next[r] = _mm512_fmadd_ps(xr, v0, next[r]);
                high[r] = _mm512_fmadd_ps(xr, both, high[r]);
            }
        } else {
            __m256 w2 = load_weights(w + 16);
            for (int r = 0; r < rows; r++) {
                __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
                low[r] = _mm512_fmadd_ps(xr, w0, low[r]);
                tail[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(xr), w2, tail[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 low_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(low[r]), 1));
        if (!pair) {
            store_row(_mm512_castps512_ps256(low[r]), low_hi, tail[r], y + r * ldy, bias, ncols, first);
            continue;
        }
        __m256 next_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(next[r]), 1));
        __m256 high_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(high[r]), 1));
        store_row(_mm512_castps512_ps256(low[r]), low_hi, _mm512_castps512_ps256(high[r]), y + r * ldy, bias, NR, first);
        store_row(_mm512_castps512_ps256(next[r]), next_hi, high_hi, y + r * ldy + NR, bias ? bias + NR : 0, ncols - NR, first);
    }
}
#define UNIT 2 /* panels per claim of a split product: a pair */
#elif defined(PAIRED_DOT)
#define UNIT 1
#define PAIRED_UNIT 2 /* a product of PAIR_MIN_ROWS rows or more: dot_pair_block's pairs */
#else
#define UNIT 1
#endif
/* A split product of one or two rows is bound by reading the weights, and a claim costs a
 * compare-and-swap on a line the other core holds: its units are at least CLAIM_BYTES of
 * weights, a few panels. Larger units cost more at the end, where the caller takes back
 * the unit the helper is still computing. Measured on a Zen 5 EPYC, one row of bf16
 * weights, [960, 576] / [3072, 576]: 18.9 / 70.3 us a product in units of one panel,
 * 15.7 / 57.7 in pairs (28 KB), 16.6 / 61.6 in fours, 18.6 / 63.7 in eights. */
#define CLAIM_BYTES (32L << 10)
#define MAX_UNIT 8
/* Panels per unit for a split product of M rows over N columns of K: at most an eighth of the
 * panels, so that a weight of a few panels is still shared out in several units. */
static long split_unit(long M, long K, long N) {
    long panel_bytes = NR * (K + SCALE_ROWS) * (long)sizeof(weight_t), panels = (N + NR - 1) / NR;
    long unit = M > 2 ? UNIT : (CLAIM_BYTES + panel_bytes - 1) / panel_bytes;
#ifdef PAIRED_DOT
    if (M >= PAIR_MIN_ROWS)
        unit = PAIRED_UNIT;
#endif
    if (unit > MAX_UNIT)
        unit = MAX_UNIT;
    if (unit > panels / 8)
        unit = panels / 8;
    return unit < UNIT ? UNIT : unit;
}

#ifdef PAIRED_DOT
/* Two panels from `panel` on (the first's columns at y; cols: the columns left from it, more than NR)
 * over every chunk of k, the rows in blocks of PAIR_DOT_ROWS: as panel_range's single panels, paired. */
static void pair_range(const input_t *x, long ldx, long M, long kp, const weight_t *panel, long cols, const float *bias, float *y, long N) {
    int ncols = cols < 2 * NR ? (int)cols : 2 * NR;
    long stride = (kp + SCALE_ROWS) * NR; /* from one panel to the next */
    const float *scales = (const float *)(panel + kp * NR), *other_scales = (const float *)(panel + stride + kp * NR); /* 8-bit builds' */
    for (long k0 = 0; k0 < kp; k0 += KC) {
        long kn = kp - k0 < KC ? kp - k0 : KC;
        const weight_t *chunk = panel + k0 * NR, *other = chunk + stride;
        /* Each panel's next chunk is asked for while this one is read; after the last, the next pair's first chunks
         * (the first panel's end is the second's start, read now: one ahead in the weight's order is not enough). */
        const weight_t *next = k0 + KC < kp ? chunk + KC * NR : panel + 2 * stride;
        long ahead = next - chunk, other_ahead = next + stride - other;
        const __m512bh *widened = 0, *widened_other = 0;
#ifdef WIDEN_ONCE
        widened = widen_chunk(chunk, kn, ahead, 0), widened_other = widen_chunk(other, kn, other_ahead, 1);
#endif
        for (long m = 0; m < M; m += PAIR_DOT_ROWS) {
            const input_t *xm = x + m * ldx + k0;
            float *ym = y + m * N;
#define PAIR_CALL(r)                                                                                                        \
    dot_pair_block(r, xm, ldx, chunk, other, kn, ahead, other_ahead, ym, N, bias, ncols, k0 == 0, widened, widened_other, scales, \
                   other_scales)
            switch (M - m >= PAIR_DOT_ROWS ? PAIR_DOT_ROWS : M - m) {
            case 4: PAIR_CALL(4); break;
            case 3: PAIR_CALL(3); break;
            case 2: PAIR_CALL(2); break;
            default: PAIR_CALL(1); break;
            }
        }
    }
}
#endif

/* Panels [first, last) of the product (see small_gemm); x prepared (prepare_input). */
static void panel_range(const input_t *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y, long first, long last) {
    long ldx = INPUT_STRIDE(K), kp = INPUT_K(K);
#ifdef WIDE_F32
    int pairs = M >= atomic_load_explicit(&pair_rows, memory_order_relaxed);
    for (long p = first; p < last; p += 1 + pairs) {
        int pair = pairs && p + 1 < last, ncols = N - p * NR < (pair + 1) * NR ? (int)(N - p * NR) : (pair + 1) * NR;
        const float *b = bias ? bias + p * NR : 0;
        const weight_t *panel = panels + p * kp * NR;
        for (long k0 = 0; k0 < kp; k0 += KC) {
            long kn = kp - k0 < KC ? kp - k0 : KC;
            const weight_t *chunk = panel + k0 * NR;
            long ahead = kn * NR > AHEAD_BYTES / (long)sizeof(weight_t) ? kn * NR : AHEAD_BYTES / (long)sizeof(weight_t);
            float *widened = 0;
#ifdef WEIGHT_BF16
            if (pair && M >= WIDEN_PAIRS_FROM)
                widened = widened_pair;
#endif
            for (long m = 0; m < M; m += WIDE_ROWS) {
                const float *xm = x + m * ldx + k0;
                float *ym = y + m * N + p * NR;
                int rows = M - m >= WIDE_ROWS ? WIDE_ROWS : (int)(M - m);
#define WIDE_CALL(r) widened && m == 0 ? wide_block(r, 3, xm, ldx, chunk, kp * NR, kn, ahead, ym, N, b, ncols, k0 == 0, widened) \
                   : widened        ? wide_block(r, 2, xm, ldx, chunk, kp * NR, kn, ahead, ym, N, b, ncols, k0 == 0, widened) \
                   : pair           ? wide_block(r, 1, xm, ldx, chunk, kp * NR, kn, ahead, ym, N, b, ncols, k0 == 0, 0)       \
                                    : wide_block(r, 0, xm, ldx, chunk, kp * NR, kn, ahead, ym, N, b, ncols, k0 == 0, 0)
                switch (rows) {
                case 8: WIDE_CALL(8); break;
                case 7: WIDE_CALL(7); break;
                case 6: WIDE_CALL(6); break;
                case 5: WIDE_CALL(5); break;
                case 4: WIDE_CALL(4); break;
                case 3: WIDE_CALL(3); break;
                case 2: WIDE_CALL(2); break;
                default: WIDE_CALL(1); break;
                }
            }
        }
    }
#else
    for (long p = first; p < last; p++) {
#ifdef PAIRED_DOT
        if (M >= PAIR_MIN_ROWS && p + 1 < last) { /* panels p and p + 1 together (dot_pair_block) */
            pair_range(x, ldx, M, kp, panels + p * (kp + SCALE_ROWS) * NR, N - p * NR, bias ? bias + p * NR : 0, y + p * NR, N);
            p++;
            continue;
        }
#endif
        int ncols = N - p * NR < NR ? (int)(N - p * NR) : NR;
        const float *b = bias ? bias + p * NR : 0;
        const weight_t *panel = panels + p * (kp + SCALE_ROWS) * NR;
        const float *scales = (const float *)(panel + kp * NR); /* an 8-bit build's (SCALE_ROWS); unread otherwise */
        (void)scales;
        for (long k0 = 0; k0 < kp; k0 += KC) {
            long kn = kp - k0 < KC ? kp - k0 : KC;
            const weight_t *chunk = panel + k0 * NR;
            long ahead = kn * NR > AHEAD_BYTES / (long)sizeof(weight_t) ? kn * NR : AHEAD_BYTES / (long)sizeof(weight_t); /* a chunk at least */
#ifdef WIDEN_ONCE
            const __m512bh *widened = M > 2 * BLOCK_ROWS ? widen_chunk(chunk, kn, ahead, 0) : 0;
#endif
            for (long m = 0; m < M; m += BLOCK_ROWS) {
                const input_t *xm = x + m * ldx + k0;
                float *ym = y + m * N + p * NR;
                switch (M - m >= BLOCK_ROWS ? BLOCK_ROWS : M - m) {
#if BLOCK_ROWS == 8
                case 8: BLOCK_CALL(8); break;
                case 7: BLOCK_CALL(7); break;
                case 6: BLOCK_CALL(6); break;
                case 5: BLOCK_CALL(5); break;
#endif
#if BLOCK_ROWS >= 4
                case 4: BLOCK_CALL(4); break;
#endif
#if BLOCK_ROWS >= 3
                case 3: BLOCK_CALL(3); break;
#endif
                case 2: BLOCK_CALL(2); break;
                default: BLOCK_CALL(1); break;
                }
            }
        }
    }
#endif
}

/* Unit u of a split product: panels [u * unit, (u + 1) * unit) of the count the weight has. */
static void unit_range(const input_t *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y, long u, long unit) {
    long count = (N + NR - 1) / NR, last = (u + 1) * unit < count ? (u + 1) * unit : count;
    panel_range(x, M, K, panels, N, bias, y, u * unit, last);
}

/* A split job of rows rather than panels (small_gemm_split_rows): rows [first, first + n) of the job
 * described by `blob` computed into out (row r at out + r * N, N floats a row). */
typedef void (*row_fn)(const void *blob, long first, long n, float *out);

/* Unit u of a split job: a product's panels, or (rows) row u. */
static void job_unit(row_fn rows, const input_t *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y, long u, long unit) {
    if (rows)
        rows(x, u, 1, y);
    else
        unit_range(x, M, K, panels, N, bias, y, u, unit);
}

/* This thread's prepared rows (the dot build's bf16 copy; otherwise x itself). */
static const input_t *prepared(const float *x, long M, long K) {
#if defined(DOT_BF16) || defined(WEIGHT_VNNI)
    static __thread input_t *rows;
    static __thread long capacity;
    long need = M * INPUT_STRIDE(K);
    if (need > capacity) {
        free(rows);
        rows = malloc((size_t)need * sizeof(input_t));
        capacity = rows ? need : 0;
        if (!rows)
            abort(); /* a few hundred KB: a process that cannot get them is out of memory anyway */
    }
    prepare_input(x, M, K, rows);
    return rows;
#else
    (void)M, (void)K;
    return x;
#endif
}

/* x: [M, K] row-major float32; panels: ceil(N / NR) panels of [K][NR] (columns past N
 * zero; the dot build's [K / 2][NR][2], K padded to even); bias: [N] or NULL; y: [M, N]
 * row-major, written whole. */
void small_gemm(const float *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y) {
    panel_range(prepared(x, M, K), M, K, panels, N, bias, y, 0, (N + NR - 1) / NR);
}

/* The same product on two cores: the caller and a helper thread share out the
 * panels. Why: a decode step's product is bound by reading the weights (one
 * row) or by the FMAs of one core (a few rows), and two cores of this host read
 * 30 GB/s where one reads 18. Each output column is computed exactly as
 * small_gemm computes it, whoever computes it, so the result is the same bits.
 *
 * The helper runs at the lowest priority (SCHED_IDLE): it only ever takes a
 * core that nothing else wants, so it never slows another process (the prefill
 * worker beside a decode worker, and the other way round), and a worker gets the
 * other core whenever that one is idle.
 *
 * The panels are claimed in units of one or a few (split_unit), several units a
 * claim while many are left (claim): the caller from the front, the helper
 * from the back, until they meet. Both claims and the job's number (its ticket)
 * live in one 64-bit word, changed by compare-and-swap: a claim made for a
 * finished job fails. The helper, which may be preempted at any moment,
 * computes into a buffer of its own and marks each unit STARTED, then READY, in
 * the unit's state word (ticket and state, by compare-and-swap); the caller, once
 * no unit is left to claim, copies every READY unit into y, waits for a STARTED
 * one at most a little longer than a unit takes it (await_started_unit), and
 * computes any other the helper claimed (TAKEN), so a helper that lost its core
 * costs at most that wait and one unit computed twice. A helper
 * that resumes late on a finished job writes only to its own buffer and its
 * compare-and-swap fails; it reads the input from a copy that stays mapped (x
 * may be freed once the caller returns) and weights that live as long as the
 * model.
 *
 * The helper spins for up to SPIN_NS after each job (a decode step calls ~200
 * products tens of microseconds apart, and waking a sleeping thread costs more
 * than that), then sleeps until the next one; it yields the CPU every few
 * microseconds while it spins. One caller at a time: a second concurrent caller
 * computes alone. */
#define SPIN_NS 2000000L
/* A helper whose last wait outlasted SPIN_NS spins this long only, then sleeps: its jobs come further apart than
 * that (an 8-bit model's LM head in the model's dtype: once a step, in this build), and spinning on would take the
 * core from the helper of the build whose products come tens of microseconds apart (the layers'). Measured on
 * Zen 4, SmolLM-135M's int8 one-row step with its bf16 head: the two helpers' spinning took ~10% of the second
 * core, and their switches ~4%. */
#define SHORT_SPIN_NS 20000L

/* The claims word: the job's ticket (bits 40-63), the next panel from the front
 * (bits 20-39), one past the last unclaimed panel from the back (bits 0-19). */
#define PANEL_BITS 20
#define MAX_PANELS ((1L << PANEL_BITS) - 1)
#define TICKET(w) ((w) >> (2 * PANEL_BITS))
#define FRONT(w) (((w) >> PANEL_BITS) & MAX_PANELS)
#define BACK(w) ((w) & MAX_PANELS)
#define CLAIMS(ticket, front, back) (((unsigned long long)(ticket) << (2 * PANEL_BITS)) | ((unsigned long long)(front) << PANEL_BITS) | (unsigned long long)(back))
/* A panel's state word: the low 24 bits of its job's ticket, then OPEN, STARTED, READY or TAKEN.
 * Tickets wrap at 2^24: a helper would have to be held off between reading a ticket
 * and its claim for 16M products (hours at a decode step's ~2,000 a second, while
 * SCHED_IDLE still gets a slice of each scheduling period) to take one job for another. */
enum { OPEN = 0, READY = 1, TAKEN = 2, STARTED = 3 };
#define STATE(ticket, state) ((unsigned)(((ticket) & 0xFFFFFFu) << 8) | (unsigned)(state))
/* READY or STARTED (a helper computes it now), with the helper whose buffer holds the panel (bits 2-7 of the state byte). */
#define READY_BY(helper) (READY | ((unsigned)(helper) << 2))
#define STARTED_BY(helper) (STARTED | ((unsigned)(helper) << 2))
#define READY_HELPER(word) (((word) & 0xFFu) >> 2)
#define IS_STARTED(word) (((word) & 3u) == STARTED)
#define IS_READY(word) (((word) & 3u) == READY)

#define MAX_HELPERS 63 /* a helper's number fits the state byte's 6 bits */
/* The job, as the caller publishes it: every field atomic (relaxed), since a helper reads
 * it while the caller may already write the next job's (it then fails its claim: see
 * helper). A helper copies it into a job_view. */
struct job {
    _Atomic(const input_t *) x; /* the caller's prepared copy: x_slots[x_slot] */
    _Atomic long x_slot;
    _Atomic(const float *) bias;
    _Atomic(const weight_t *) panels;
    _Atomic(float *) helper_y[MAX_HELPERS]; /* each helper's own [M, N], row stride N, as y */
    _Atomic(_Atomic unsigned *) states;     /* one per panel */
    _Atomic long M, K, N;
    _Atomic(row_fn) rows; /* a job of rows (small_gemm_split_rows): x holds its blob; NULL: a product */
};
struct job_view {
    const input_t *x;
    long x_slot;
    const float *bias;
    const weight_t *panels;
    float *helper_y; /* this helper's */
    _Atomic unsigned *states;
    long M, K, N;
    row_fn rows;
};
static struct job job;
/* Buffers that only grow, and are never freed: a helper that resumes late may still read or write the old ones.
 * Each helper computes into its own buffer, so one that resumes late on a finished job
 * writes where no other helper's panel of the next job lies. The prepared rows go to one
 * of X_SLOTS buffers that no helper reads (x_readers: helpers that may still compute from
 * it), so the caller never writes rows a late helper reads. */
#define X_SLOTS 4
static input_t *x_slots[X_SLOTS];
static atomic_long x_readers[X_SLOTS];
static float *helper_ys[MAX_HELPERS];
static _Atomic unsigned *panel_states;
static long x_capacities[X_SLOTS], y_capacities[MAX_HELPERS], states_capacity;
static long helpers_started;

static void read_job(long helper, struct job_view *view) {
    view->x = atomic_load_explicit(&job.x, memory_order_relaxed);
    view->x_slot = atomic_load_explicit(&job.x_slot, memory_order_relaxed);
    view->bias = atomic_load_explicit(&job.bias, memory_order_relaxed);
    view->panels = atomic_load_explicit(&job.panels, memory_order_relaxed);
    view->helper_y = atomic_load_explicit(&job.helper_y[helper], memory_order_relaxed);
    view->states = atomic_load_explicit(&job.states, memory_order_relaxed);
    view->M = atomic_load_explicit(&job.M, memory_order_relaxed);
    view->K = atomic_load_explicit(&job.K, memory_order_relaxed);
    view->N = atomic_load_explicit(&job.N, memory_order_relaxed);
    view->rows = atomic_load_explicit(&job.rows, memory_order_relaxed);
}

static void write_job(long x_slot, const float *bias, const weight_t *panels, long M, long K, long N, row_fn rows) {
    atomic_store_explicit(&job.x, x_slots[x_slot], memory_order_relaxed);
    atomic_store_explicit(&job.x_slot, x_slot, memory_order_relaxed);
    atomic_store_explicit(&job.bias, bias, memory_order_relaxed);
    atomic_store_explicit(&job.panels, panels, memory_order_relaxed);
    for (long i = 0; i < helpers_started; i++)
        atomic_store_explicit(&job.helper_y[i], helper_ys[i], memory_order_relaxed);
    atomic_store_explicit(&job.states, panel_states, memory_order_relaxed);
    atomic_store_explicit(&job.M, M, memory_order_relaxed);
    atomic_store_explicit(&job.K, K, memory_order_relaxed);
    atomic_store_explicit(&job.N, N, memory_order_relaxed);
    atomic_store_explicit(&job.rows, rows, memory_order_relaxed);
}

/* A buffer for the prepared rows that no helper reads now, or -1 (every one still read by a late helper). */
static long free_x_slot(void) {
    for (long s = 0; s < X_SLOTS; s++)
        if (atomic_load(&x_readers[s]) == 0)
            return s;
    return -1;
}
static _Atomic unsigned long long claims;
/* Callers by a number of their own (thread-local: a pthread_t is reused once its thread ends). */
static __thread long caller_id;
static atomic_long callers;
static long last_caller_id; /* whose CPUs the helper has been given */
/* The CPUs the helper should run on, and a count of changes to them (under cpus_lock). */
static cpu_set_t helper_cpus;
static long cpus_changes;
static pthread_mutex_t cpus_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_long helper_jobs;
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER;
static int helper_state; /* 0: not started, 1: running, -1: could not start */
static atomic_int helper_priority; /* 1: the helper runs as SCHED_IDLE; -1: it could not (normal priority); 0: not yet known */
static long caller_panel_limit = MAX_PANELS; /* tests: the caller leaves the rest to the helper */
static atomic_long helper_stall_ns; /* tests: the helper sleeps this long after each claim */
static atomic_long helper_started_stall_ns; /* tests: the helper sleeps this long once it has started a unit */
static atomic_int caller_awaits_claim; /* tests: the caller starts once the helper has claimed a panel */
static atomic_long late_panels;     /* units the helper claimed and found taken back by the caller */
static pthread_t helper_thread; /* the first helper (tests read its CPUs) */
/* How many helper threads a split product is shared with: the calling worker's torch threads
 * but one (small_gemm_set_helpers, before the first split); each claims panels from the back. */
static long helper_count = 1;

/* Every SPIN_CHECK pauses (a few microseconds) a spinning thread yields and checks the clock. */
#define SPIN_CHECK 256

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Tests' stalls: sleeps ns (0: not at all). */
static void sleep_ns(long ns) {
    if (ns)
        nanosleep(&(struct timespec){ns / 1000000000L, ns % 1000000000L}, 0);
}

static unsigned long long current_ticket(void) { return TICKET(atomic_load_explicit(&claims, memory_order_acquire)); }

/* Claims units of job `ticket` from the front (caller) or the back (helper): a share of what is
 * left, at most `most` (guided: large claims first, one unit at the end), since each claim is a
 * compare-and-swap on a line both cores write. Returns the first unit claimed and sets *n to
 * how many; -1 when none is left. Measured on a Zen 5 EPYC, one row of bf16 weights (units of
 * two panels), [960, 576] / [3072, 576] / [576, 1536]: 16.1 / 61.0 / 29.1 us a product claiming
 * one unit at a time, 15.5 / 56.8 / 27.4 guided (weights partly in the L3 cache); SmolLM-135M's
 * one-row step 6.1-6.5 ms against 6.4-8.9 (three runs each, alternately), its int8 step 5.2-5.6
 * against 5.5-6.2. 8 rows: the same. The helper then walking its claims up rather than down
 * (weights streamed from memory): [3072, 2048] 274-290 us against 297-317, [576, 1536] 40-45
 * against 45-53, [960, 576] the same. */
static long claim(unsigned long long ticket, int from_back, long most, long *n) {
    unsigned long long word = atomic_load_explicit(&claims, memory_order_acquire);
    for (;;) {
        unsigned long long front = FRONT(word), back = BACK(word);
        if (TICKET(word) != ticket || front >= back)
            return -1;
        long take = (long)(back - front) / (2 * (1 + helper_count));
        take = take < 1 ? 1 : take > most ? most : take;
        unsigned long long next = from_back ? CLAIMS(ticket, front, back - take) : CLAIMS(ticket, front + take, back);
        if (atomic_compare_exchange_weak_explicit(&claims, &word, next, memory_order_seq_cst, memory_order_acquire)) {
            *n = take;
            return from_back ? (long)back - take : (long)front;
        }
    }
}

/* Warming. Between a decode step's products its caller works alone for microseconds (norms, rotations, its
 * share of the attention, each product's prepared input) while the helper waits: there the helper asks for
 * the weights it will claim first in the product the caller names next (small_gemm_warm), so they are in its
 * caches when that product comes. It prefetches (which never faults: a request that outlived its weights
 * costs nothing but reads), a few lines at a time, and stops as soon as a job is published. Measured on Zen 4,
 * SmolLM-135M's one-row step with and without, alternately in one process: 1-2% faster in bf16, int8 and int8
 * with an int8 head alike (up to 768 KB a product warmed measured no faster: the helper's waits are short). */
#define WARM_MAX_BYTES (256L << 10)
#define WARM_LINES 16 /* prefetched between two looks at the ticket */
static _Atomic(const char *) warm_from, warm_to; /* what small_gemm_warm asked for last */
static atomic_ulong warm_requests;
static atomic_long warmings_done; /* requests warmed to their end (tests) */

/* The helper's progress through the warming asked for (its own). */
struct warming {
    unsigned long request;
    const char *at, *to;
};

/* Prefetches the next few lines of the warming asked for last; 0 when none is left. */
static int warm_some(struct warming *w) {
    unsigned long request = atomic_load_explicit(&warm_requests, memory_order_acquire);
    if (request != w->request) {
        w->request = request;
        w->at = atomic_load_explicit(&warm_from, memory_order_relaxed);
        w->to = atomic_load_explicit(&warm_to, memory_order_relaxed);
    }
    if (w->at >= w->to)
        return 0;
    for (int i = 0; i < WARM_LINES && w->at < w->to; i++, w->at += 64)
        _mm_prefetch(w->at, _MM_HINT_T0);
    if (w->at >= w->to)
        atomic_fetch_add_explicit(&warmings_done, 1, memory_order_relaxed);
    return 1;
}

/* Moves the helper to the CPUs its caller was last given, if they changed. */
static void follow_caller_cpus(long *applied) {
    pthread_mutex_lock(&cpus_lock);
    if (*applied != cpus_changes) {
        pthread_setaffinity_np(pthread_self(), sizeof helper_cpus, &helper_cpus);
        *applied = cpus_changes;
    }
    pthread_mutex_unlock(&cpus_lock);
}

static void *helper(void *number) {
    long index = (long)number; /* which buffer is its own */
    struct sched_param lowest = {0};
    atomic_store(&helper_priority, pthread_setschedparam(pthread_self(), SCHED_IDLE, &lowest) == 0 ? 1 : -1);
    unsigned long long seen = 0; /* the ticket of the last job looked at */
    long applied_cpus = 0, spin_ns = SPIN_NS;
    struct warming warming = {0, 0, 0};
    for (;;) {
        long waited_from = now_ns(), spin_until = waited_from + spin_ns;
        for (long spins = 1; current_ticket() == seen; spins++) {
            if (warm_some(&warming))
                continue;
            _mm_pause();
            if (spins % SPIN_CHECK != 0)
                continue;
            sched_yield();
            if (now_ns() > spin_until) {
                pthread_mutex_lock(&sleep_lock);
                while (current_ticket() == seen)
                    pthread_cond_wait(&wake, &sleep_lock);
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = current_ticket();
        spin_ns = now_ns() - waited_from > SPIN_NS ? SHORT_SPIN_NS : SPIN_NS;
        /* Read before the first claim: a claim of job `seen` succeeds only while that job
         * is unfinished, and its caller writes the next job only once it is finished, so a
         * view mixing two jobs' fields is never computed from. The rows' buffer is marked
         * read before the claim (both seq_cst): a caller that finds the job finished, which
         * it does only after this claim, then sees the buffer read and leaves it alone. */
        struct job_view mine;
        read_job(index, &mine);
        follow_caller_cpus(&applied_cpus);
        long first, n, computed = 0, unit = mine.rows ? 1 : split_unit(mine.M, mine.K, mine.N), slot = mine.x_slot >= 0 && mine.x_slot < X_SLOTS ? mine.x_slot : 0;
        atomic_fetch_add(&x_readers[slot], 1);
        while ((first = claim(seen, 1, MAX_PANELS, &n)) >= 0) {
            sleep_ns(atomic_load_explicit(&helper_stall_ns, memory_order_relaxed)); /* tests: a helper that loses its core right after a claim */
            /* Its units in order, one stream up through the weights: a caller that has run out of its
             * own takes the helper's back from the last down, so the two meet in the middle, one unit
             * computed twice at most. */
            for (long u = first; u < first + n; u++) {
                unsigned open = STATE(seen, OPEN), started = STATE(seen, STARTED_BY(index));
                if (atomic_compare_exchange_strong(&mine.states[u], &open, started)) { /* the caller waits a while for a started unit */
                    sleep_ns(atomic_load_explicit(&helper_started_stall_ns, memory_order_relaxed)); /* tests: a helper that loses its core mid-unit */
                    job_unit(mine.rows, mine.x, mine.M, mine.K, mine.panels, mine.N, mine.bias, mine.helper_y, u, unit);
                    if (atomic_compare_exchange_strong(&mine.states[u], &started, STATE(seen, READY_BY(index)))) {
                        computed++;
                        continue;
                    }
                }
                atomic_fetch_add_explicit(&late_panels, 1, memory_order_relaxed); /* taken back by the caller */
            }
        }
        atomic_fetch_sub(&x_readers[slot], 1);
        if (computed)
            atomic_fetch_add_explicit(&helper_jobs, 1, memory_order_relaxed);
    }
    return 0;
}

/* A forked child has no helper thread (fork copies only the caller): it starts its own on its first split. */
static void forget_helper_in_child(void) {
    helper_state = 0;
    last_caller_id = 0;
    cpus_changes = 0;
    atomic_store(&claims, 0);
    atomic_store(&helper_jobs, 0);
    atomic_store(&late_panels, 0);
    atomic_store(&helper_priority, 0);
    for (long s = 0; s < X_SLOTS; s++) /* the parent's helpers, which may have been reading, are not here */
        atomic_store(&x_readers[s], 0);
    pthread_mutex_init(&sleep_lock, 0);
    pthread_mutex_init(&caller_lock, 0);
    pthread_mutex_init(&cpus_lock, 0);
    pthread_cond_init(&wake, 0);
}

static void register_fork_handler(void) { pthread_atfork(0, 0, forget_helper_in_child); }

/* Gives the helper the calling thread's CPUs when the caller is another thread than last time
 * (a worker pins its model thread with --device-cpus after start-up, when the helper may
 * already have been started from another thread). */
static void give_helper_my_cpus(void) {
    if (caller_id == 0)
        caller_id = atomic_fetch_add(&callers, 1) + 1;
    if (caller_id == last_caller_id)
        return;
    last_caller_id = caller_id;
    pthread_mutex_lock(&cpus_lock);
    if (pthread_getaffinity_np(pthread_self(), sizeof helper_cpus, &helper_cpus) == 0)
        cpus_changes++;
    pthread_mutex_unlock(&cpus_lock);
}

/* Buffers replaced by larger ones, kept (never freed: a helper that resumes late may still
 * use one) and reachable from here. Each growth at least doubles, so a few dozen suffice. */
#define RETIRED_MAX 256
void *small_gemm_retired[RETIRED_MAX]; /* exported: never read here, and a store to a static the compiler would drop */
static int retired_count;

/* Grows a buffer that is never freed (see above) to hold `need` elements; 0 if out of memory. */
static int grow(void **buffer, long *capacity, long need, long size) {
    if (need <= *capacity)
        return 1;
    long count = need > 2 * *capacity ? need : 2 * *capacity;
    void *bigger = aligned_alloc(64, (size_t)((count * size + 63) / 64 * 64));
    if (!bigger)
        return 0;
    if (*buffer && retired_count < RETIRED_MAX)
        small_gemm_retired[retired_count++] = *buffer; /* left to a late helper */
    *buffer = bigger, *capacity = count;
    return 1;
}

/* Puts unit p of the helper's buffer into y: a product's panels' columns of every row, or (rows) row p. */
static void copy_unit(row_fn rows, const float *from, float *y, long M, long N, long p, long unit) {
    if (rows) {
        memcpy(y + p * N, from + p * N, (size_t)N * sizeof(float));
        return;
    }
    long first = p * unit * NR, ncols = N - first < unit * NR ? N - first : unit * NR;
    for (long m = 0; m < M; m++)
        memcpy(y + m * N + first, from + m * N + first, (size_t)ncols * sizeof(float));
}

/* The whole job on the calling thread: the product, or every row. */
static void job_alone(row_fn rows, const float *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y) {
    if (rows)
        rows(x, 0, M, y);
    else
        small_gemm(x, M, K, panels, N, bias, y);
}

/* A unit's state once it is not STARTED, or STARTED still after `patience_ns` (-1: for ever). A helper computing a unit
 * when its caller runs out of its own usually finishes it within a unit's time: waiting for it, rather than taking it
 * back at once and computing it again, saves the caller that unit. A helper that lost its core costs the wait.
 * Measured on an Ice Lake Xeon, SmolLM-135M's bf16 products of 8-64 rows on two cores: taking each started unit back
 * at once, 26-122 of 150 products computed a unit twice; waiting, 0-8. The whole step, interleaved in one process:
 * 0.99-1.04x at 1-64 rows (within the host's noise). */
static unsigned await_started_unit(_Atomic unsigned *state, long patience_ns) {
    unsigned word = atomic_load_explicit(state, memory_order_acquire);
    long until = patience_ns < 0 ? -1 : now_ns() + patience_ns;
    for (long spins = 1; IS_STARTED(word); spins++) {
        _mm_pause();
        if (spins % 16 == 0 && until >= 0 && now_ns() > until) /* a clock read every microsecond or so: a one-row unit takes a few */
            break;
        word = atomic_load_explicit(state, memory_order_acquire);
    }
    return word;
}

/* A split job (a product, or with `rows` a job of M rows whose blob is `blob_bytes` at x) shared with the
 * helper as small_gemm_split describes; returns 1 if the helper was offered a share, 0 if the caller
 * computed it alone. */
static int split_job(const float *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y, row_fn rows, long blob_bytes) {
    /* units claimed one at a time: a product's of `unit` panels each, a job's rows one each */
    long unit = rows ? 1 : split_unit(M, K, N), count = rows ? M : ((N + NR - 1) / NR + unit - 1) / unit;
    long x_need = rows ? (blob_bytes + (long)sizeof(input_t) - 1) / (long)sizeof(input_t) : M * INPUT_STRIDE(K);
    /* A helper at normal priority (where SCHED_IDLE is refused) shares single rows only: more
     * would take the core from the process beside this one whenever it has work (measured). */
    int shares = (M == 1 && !rows) || atomic_load_explicit(&helper_priority, memory_order_relaxed) >= 0;
    if (!shares || count < 2 || count > MAX_PANELS || pthread_mutex_trylock(&caller_lock) != 0) {
        job_alone(rows, x, M, K, panels, N, bias, y);
        return 0;
    }
    if (helper_state == 0) {
        static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
        pthread_once(&fork_handler, register_fork_handler);
        helper_state = pthread_create(&helper_thread, 0, helper, (void *)0L) == 0 ? 1 : -1;
        if (helper_state == 1)
            pthread_detach(helper_thread);
        helpers_started = helper_state == 1;
        for (long i = 1; helper_state == 1 && i < helper_count; i++) { /* the others, numbered in turn: one that fails to start is one fewer */
            pthread_t more;
            if (pthread_create(&more, 0, helper, (void *)helpers_started) != 0)
                break;
            pthread_detach(more);
            helpers_started++;
        }
    }
    int buffers = helper_state > 0;
    for (long i = 0; buffers && i < helpers_started; i++)
        buffers = grow((void **)&helper_ys[i], &y_capacities[i], M * N, sizeof(float));
    long x_slot = free_x_slot();
    if (!buffers || x_slot < 0 || !grow((void **)&x_slots[x_slot], &x_capacities[x_slot], x_need, sizeof(input_t)) ||
        !grow((void **)&panel_states, &states_capacity, count, sizeof(unsigned))) {
        pthread_mutex_unlock(&caller_lock);
        job_alone(rows, x, M, K, panels, N, bias, y);
        return 0;
    }
    give_helper_my_cpus();
    input_t *x_copy = x_slots[x_slot];
    if (rows) /* the job's blob, kept where a late helper may still read it (x may be freed once the caller returns) */
        memcpy(x_copy, x, (size_t)blob_bytes);
    else
        prepare_input(x, M, K, x_copy); /* the caller computes from the copy too: both read the same prepared rows */
    unsigned long long ticket = (TICKET(atomic_load_explicit(&claims, memory_order_relaxed)) + 1) & ((1ULL << (64 - 2 * PANEL_BITS)) - 1);
    for (long p = 0; p < count; p++)
        atomic_store_explicit(&panel_states[p], STATE(ticket, OPEN), memory_order_relaxed);
    write_job(x_slot, bias, panels, M, K, N, rows);
    atomic_store_explicit(&claims, CLAIMS(ticket, 0, count), memory_order_seq_cst); /* publishes the job */
    pthread_mutex_lock(&sleep_lock); /* wakes the helper if it sleeps; no lost wake-up: it checks the ticket under this lock */
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    for (long spins = 1; atomic_load_explicit(&caller_awaits_claim, memory_order_relaxed) && BACK(atomic_load(&claims)) == (unsigned long long)count; spins++)
        if (spins % SPIN_CHECK == 0) /* tests: until the helper holds a panel */
            sched_yield();
    long first, n, mine = 0, claims_from = now_ns();
    while (mine < caller_panel_limit && (first = claim(ticket, 0, caller_panel_limit - mine, &n)) >= 0) {
        for (long u = first; u < first + n; u++)
            job_unit(rows, x_copy, M, K, panels, N, bias, y, u, unit);
        mine += n;
    }
    long unit_ns = mine ? (now_ns() - claims_from) / mine : 0; /* how long a unit takes here: the wait for one the helper started */
    int patient = caller_panel_limit < MAX_PANELS; /* tests: wait for the helper's panels, never take them */
    unsigned long long word;
    for (long spins = 1; word = atomic_load_explicit(&claims, memory_order_acquire), FRONT(word) < BACK(word); spins++) {
        _mm_pause(); /* only while the caller's share is limited: the helper claims the rest */
        if (spins % SPIN_CHECK == 0)
            sched_yield();
    }
    for (long p = count - 1; p >= (long)BACK(word); p--) { /* down: the helper's claims are done from the top, its last one from its first unit up */
        unsigned open = STATE(ticket, OPEN);
        for (long spins = 1; patient && atomic_load_explicit(&panel_states[p], memory_order_acquire) == open; spins++)
            if (spins % SPIN_CHECK == 0)
                sched_yield();
        long patience = patient ? -1 : unit_ns + unit_ns / 4;
        unsigned state = await_started_unit(&panel_states[p], patience);
        while (!IS_READY(state)) { /* OPEN, or STARTED still after the wait: taken back, unless the helper moves it on first */
            if (atomic_compare_exchange_strong(&panel_states[p], &state, STATE(ticket, TAKEN))) {
                job_unit(rows, x_copy, M, K, panels, N, bias, y, p, unit);
                break;
            }
            if (IS_STARTED(state)) /* the helper started it since: a unit's wait again */
                state = await_started_unit(&panel_states[p], patience);
        }
        if (IS_READY(state)) /* state names the helper whose buffer has it */
            copy_unit(rows, helper_ys[READY_HELPER(state)], y, M, N, p, unit);
    }
    pthread_mutex_unlock(&caller_lock);
    return 1;
}

/* Returns 1 if the helper was offered a share of the product, 0 if the caller computed it alone. */
int small_gemm_split(const float *x, long M, long K, const weight_t *panels, long N, const float *bias, float *y) {
    return split_job(x, M, K, panels, N, bias, y, 0, 0);
}

/* Rows [0, rows) of a job of rows (a decode step's attention, one row each: native_step.c), shared with the
 * helper as a product's panels are: each row computed by `fn` from `blob` (blob_bytes, copied where a late
 * helper may still read it; what it points to must outlive the job, as a product's weights do) into
 * y + r * row_floats, by the caller or the helper (into its own buffer, then copied). Returns as small_gemm_split. */
int small_gemm_split_rows(row_fn fn, const void *blob, long blob_bytes, long rows, long row_floats, float *y) {
    return split_job((const float *)blob, rows, 0, 0, row_floats, 0, y, fn, blob_bytes);
}

/* Asks the helper, while it waits, to warm the weights it will claim first when the product of M rows over these
 * panels is shared (see warm_some): the units its first claim takes from the back (claim: a share of all of
 * them), at most WARM_MAX_BYTES from their start. Single rows and pairs only, whose products read weights. */
void small_gemm_warm(long M, long K, const weight_t *panels, long N) {
    long unit = split_unit(M, K, N), panel_count = (N + NR - 1) / NR, count = (panel_count + unit - 1) / unit;
    if (M > 2 || count < 2 || helper_state != 1)
        return;
    long first_claim = count / (2 * (1 + helper_count)), panel_elements = (INPUT_K(K) + SCALE_ROWS) * NR;
    first_claim = first_claim < 1 ? 1 : first_claim;
    const char *from = (const char *)(panels + (count - first_claim) * unit * panel_elements), *to = (const char *)(panels + panel_count * panel_elements);
    atomic_store_explicit(&warm_from, from, memory_order_relaxed);
    atomic_store_explicit(&warm_to, to - from > WARM_MAX_BYTES ? from + WARM_MAX_BYTES : to, memory_order_relaxed);
    atomic_fetch_add_explicit(&warm_requests, 1, memory_order_release);
}

/* Tests: how many warming requests the helper has prefetched to their end. */
long small_gemm_warmings_done(void) { return atomic_load(&warmings_done); }

/* Whether the helper thread runs at the lowest priority (SCHED_IDLE), as it asks to; 0 before it starts (for tests). */
int small_gemm_helper_idle(void) { return atomic_load(&helper_priority) == 1; }

/* Tests: the helper sleeps `ns` after each panel it claims (0: never), as if it lost its core. */
void small_gemm_stall_helper(long ns) { atomic_store(&helper_stall_ns, ns); }

/* Tests: the helper sleeps `ns` once it has started each unit (0: never), as if it lost its core in the middle of one. */
void small_gemm_stall_started_helper(long ns) { atomic_store(&helper_started_stall_ns, ns); }

/* Tests: the caller of a split product starts once the helper has claimed a panel (0: at once). */
void small_gemm_await_helper_claim(int on) { atomic_store(&caller_awaits_claim, on); }

/* Tests: how many panels the helper computed after its caller had computed them itself. */
long small_gemm_late_panels(void) { return atomic_load(&late_panels); }

/* Tests: the caller of a split product computes at most `panels` of it (0: no limit), so
 * that the helper computes the rest whatever the scheduler does. */
void small_gemm_limit_caller_panels(long panels) { caller_panel_limit = panels > 0 ? panels : MAX_PANELS; }

/* The helper threads a split product is shared with (1 to MAX_HELPERS); takes effect when they start, at the first split. */
void small_gemm_set_helpers(long count) { helper_count = count < 1 ? 1 : count > MAX_HELPERS ? MAX_HELPERS : count; }

/* The calling thread's CPUs to the helper now (give_helper_my_cpus), before the thread narrows them for a while
 * (disagg.engine.threads.on_the_teams_cpu): the helper would otherwise take the narrowed set at the thread's first
 * shared product, and keep it, beside the caller on one CPU. */
void small_gemm_meet_caller(void) {
    pthread_mutex_lock(&caller_lock);
    give_helper_my_cpus();
    pthread_mutex_unlock(&caller_lock);
}

/* How many products the helper threads have computed a share of (for tests). */
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
