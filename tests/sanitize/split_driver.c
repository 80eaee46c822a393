/* Drives small_gemm.c's split product (the caller and its helper threads) for the
 * sanitizer builds of tests/test_sanitizers.py. Many products of varied shapes from
 * one caller, each compared bit for bit with small_gemm alone, and jobs of rows
 * (small_gemm_split_rows, as the native step's attention), each compared with its
 * rows computed in turn, its blob freed as soon as the call returns; rounds in which the
 * caller computes at most one panel, so the helpers compute the rest; and (argument
 * "stall") rounds in which each helper sleeps after a claim, or once it has started a
 * unit, as if it lost its core, so the caller takes its panels back (a started one after
 * waiting a unit's time for it) and the helper finishes them late.
 *
 *     split_driver HELPERS BYTES_PER_WEIGHT [stall]
 *
 * Weights and biases stay allocated to the end, as a model's do: a helper that
 * resumes late still reads them. Prints "ok: J helper jobs, L late panels". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void small_gemm(const float *x, long M, long K, const void *panels, long N, const float *bias, float *y);
int small_gemm_split(const float *x, long M, long K, const void *panels, long N, const float *bias, float *y);
void small_gemm_set_helpers(long count);
void small_gemm_limit_caller_panels(long panels);
void small_gemm_stall_helper(long ns);
void small_gemm_stall_started_helper(long ns);
long small_gemm_helper_jobs(void);
long small_gemm_late_panels(void);
int small_gemm_split_rows(void (*fn)(const void *blob, long first, long n, float *out), const void *blob, long blob_bytes, long rows, long row_floats,
                          float *y);

static float random_float(void);

/* A job of rows: row r of `width` floats from the blob's value r (some work a row, as an attention's). */
struct rows_blob {
    long width;
    float values[];
};
static void rows_fn(const void *blob, long first, long n, float *out) {
    const struct rows_blob *b = blob;
    for (long r = first; r < first + n; r++)
        for (long c = 0; c < b->width; c++) {
            float a = 0.0f;
            for (long k = 0; k < 64; k++)
                a += b->values[r] * (float)(c + k);
            out[r * b->width + c] = a;
        }
}

static int run_rows(void) {
    static const long jobs[3][2] = {{4, 72}, {9, 576}, {33, 40}}; /* rows, width */
    for (int j = 0; j < 3; j++) {
        long rows = jobs[j][0], width = jobs[j][1], bytes = (long)sizeof(struct rows_blob) + rows * (long)sizeof(float);
        struct rows_blob *blob = malloc((size_t)bytes);
        float *alone = malloc((size_t)(rows * width) * sizeof(float)), *split = malloc((size_t)(rows * width) * sizeof(float));
        blob->width = width;
        for (long r = 0; r < rows; r++)
            blob->values[r] = random_float();
        rows_fn(blob, 0, rows, alone);
        small_gemm_split_rows(rows_fn, blob, bytes, rows, width, split);
        free(blob); /* a late helper reads the kernel's copy, never this */
        int same = memcmp(alone, split, (size_t)(rows * width) * sizeof(float)) == 0;
        free(alone), free(split);
        if (!same) {
            fprintf(stderr, "split rows differ from the rows computed in turn: %ld rows of %ld\n", rows, width);
            return 1;
        }
    }
    return 0;
}

#define SHAPES 6
/* M, K, N; 17 rows of 9 panels over two chunks of K: the bf16-dot build's pairs, and a panel alone */
static const long shapes[SHAPES][3] = {{1, 96, 200}, {3, 600, 100}, {8, 256, 480}, {64, 40, 72}, {5, 7, 50}, {17, 300, 200}};
static unsigned char *weights[SHAPES];
static float *biases[SHAPES];

static float random_float(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

/* Panels for any build: K padded to a multiple of 4 (the dot build's), bf16 as a float's upper half. */
static void make_weights(int element) {
    for (int s = 0; s < SHAPES; s++) {
        long K = (shapes[s][1] + 3) & ~3L, N = shapes[s][2], count = (N + 23) / 24 * 24 * K;
        weights[s] = malloc((size_t)(count * element));
        biases[s] = malloc((size_t)N * sizeof(float));
        for (long i = 0; i < count; i++) {
            float f = random_float();
            memcpy(weights[s] + i * element, (unsigned char *)&f + (4 - element), (size_t)element);
        }
        for (long i = 0; i < N; i++)
            biases[s][i] = random_float();
    }
}

static int run_round(int caller_panels, long stall_ns, long started_stall_ns) {
    small_gemm_limit_caller_panels(caller_panels);
    small_gemm_stall_helper(stall_ns);
    small_gemm_stall_started_helper(started_stall_ns);
    for (int rep = 0; rep < 30; rep++)
        for (int s = 0; s < SHAPES; s++) {
            long M = shapes[s][0], K = shapes[s][1], N = shapes[s][2];
            float *x = malloc((size_t)(M * K) * sizeof(float)), *alone = malloc((size_t)(M * N) * sizeof(float)),
                  *split = malloc((size_t)(M * N) * sizeof(float));
            for (long i = 0; i < M * K; i++)
                x[i] = random_float();
            small_gemm(x, M, K, weights[s], N, rep % 2 ? biases[s] : 0, alone);
            small_gemm_split(x, M, K, weights[s], N, rep % 2 ? biases[s] : 0, split);
            int same = memcmp(alone, split, (size_t)(M * N) * sizeof(float)) == 0;
            free(x), free(alone), free(split);
            if (!same) {
                fprintf(stderr, "split product differs from small_gemm's: M %ld K %ld N %ld\n", M, K, N);
                return 1;
            }
            if (s == 0 && run_rows())
                return 1;
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    small_gemm_set_helpers(atol(argv[1]));
    make_weights(atoi(argv[2]));
    int stall = argc > 3 && strcmp(argv[3], "stall") == 0;
    if (run_round(0, 0, 0) || run_round(1, 0, 0) || (stall && (run_round(0, 200000, 0) || run_round(0, 0, 200000))))
        return 1;
    small_gemm_stall_helper(0);
    small_gemm_stall_started_helper(0);
    small_gemm_limit_caller_panels(0);
    printf("ok: %ld helper jobs, %ld late panels\n", small_gemm_helper_jobs(), small_gemm_late_panels());
    return 0;
}
