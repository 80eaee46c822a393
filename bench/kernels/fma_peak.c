/* The host's peak for the decode step's products, measured in each bench/decode_step.py run on a CPU:
 * independent chains of the instruction each product build multiplies with, on one
 * thread or on `threads` threads at once, nothing read from memory. 24 chains
 * hide the instruction's latency (up to 12 cycles here) behind its throughput (1-2 a cycle).
 *
 *   fma_peak_f32(threads, iterations): VFMADD231PS on 256-bit vectors (AVX2's float32 products)
 *   fma_peak_f32_512(...):            the same on 512-bit vectors (AVX-512F)
 *   fma_peak_bf16(...):               VDPBF16PS on 512-bit vectors (AVX512_BF16: the bf16-dot build)
 * Each returns the FLOPs it did (a multiply and an add each count); the caller times it. */
#include <immintrin.h>
#include <pthread.h>

#define CHAINS 24

struct job { long iterations; int kind; float sink; };

/* One instruction's chains: acc[c] = STEP(acc[c]) `iterations` times over vectors of VEC, started
 * at c and summed at the end (what is left of each, FIRST lane or REDUCE, so the loop is not dropped).
 * The chains' loop is unrolled so that every chain lives in a register: rolled (as -O2 left it), the
 * chains went through memory, a load and a store around each instruction, and the "peak" measured on a
 * Zen 5 EPYC was 244 GFLOP/s of VDPBF16PS on one core, below what small_gemm's bf16 blocks reach. */
#define CHAIN_LOOP(VEC, STEP, SUM)                                       \
    VEC acc[CHAINS];                                                     \
    for (int c = 0; c < CHAINS; c++) acc[c] = (VEC)SET_FLOAT((float)c);  \
    for (long i = 0; i < iterations; i++)                                \
        _Pragma("GCC unroll 32")                                         \
        for (int c = 0; c < CHAINS; c++) acc[c] = STEP(acc[c]);          \
    float s = 0;                                                         \
    for (int c = 0; c < CHAINS; c++) s += SUM(acc[c]);                   \
    return s

__attribute__((target("avx2,fma"))) static float f32_256(long iterations) {
    __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
#define SET_FLOAT _mm256_set1_ps
#define STEP(x) _mm256_fmadd_ps(a, b, x)
    CHAIN_LOOP(__m256, STEP, _mm256_cvtss_f32);
#undef STEP
#undef SET_FLOAT
}

#define SET_FLOAT _mm512_set1_ps
__attribute__((target("avx512f"))) static float f32_512(long iterations) {
    __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
#define STEP(x) _mm512_fmadd_ps(a, b, x)
    CHAIN_LOOP(__m512, STEP, _mm512_reduce_add_ps);
#undef STEP
}

__attribute__((target("avx512f,avx512bf16"))) static float bf16_512(long iterations) {
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
#define STEP(x) _mm512_dpbf16_ps(x, a, b)
    CHAIN_LOOP(__m512, STEP, _mm512_reduce_add_ps);
#undef STEP
}
#undef SET_FLOAT

static void *run(void *arg) {
    struct job *j = arg;
    j->sink = j->kind == 0 ? f32_256(j->iterations) : j->kind == 1 ? f32_512(j->iterations) : bf16_512(j->iterations);
    return 0;
}

static double on_threads(int threads, long iterations, int kind, double flops_per_chain_step) {
    pthread_t ids[64];
    struct job jobs[64];
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){iterations, kind, 0};
        if (t) pthread_create(&ids[t], 0, run, &jobs[t]);
    }
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(ids[t], 0);
    return (double)threads * iterations * CHAINS * flops_per_chain_step;
}

double fma_peak_f32(int threads, long iterations) { return on_threads(threads, iterations, 0, 8 * 2); }
double fma_peak_f32_512(int threads, long iterations) { return on_threads(threads, iterations, 1, 16 * 2); }
double fma_peak_bf16(int threads, long iterations) { return on_threads(threads, iterations, 2, 32 * 2); }
