/* RMSNorm on the CPU, float32, optionally with the residual add before it fused in.
 *
 *   x   [rows, dim] row-major: with a residual r, x += r first (in place), then
 *   out [rows, dim] = x / sqrt(mean(x^2) + eps) * weight
 *
 * torch's own CPU rms_norm runs ~5 small kernels per call (pow, mean, add, rsqrt, mul), ~65 us
 * for one 576-wide row on the cores this project runs on; a decoder layer has two, and a
 * batch-1 decode step of SmolLM2 spent ~4.5 ms in them. This is one pass over the row, read
 * twice from L1. Built at run time by engine/native_build.py (-O3 -march=native -fopenmp,
 * no -ffast-math): the sum of squares runs in 8 float lanes in a fixed order, then the lanes are
 * added in a fixed order, so a row's result does not depend on how many rows the call has or on
 * the thread count. Rows are spread over threads only when there are many.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define PARALLEL_MIN_ROWS 64

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static void norm_row(float *x, const float *r, const float *w, float *out, int64_t dim,
                     float eps) {
    v8 acc = {0};
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= dim; i += LANES) {
        v8 v = load8(x + i);
        if (r) {
            v += load8(r + i);
            store8(x + i, v);
        }
        acc += v * v;
    }
    for (; i < dim; i++) {
        if (r) x[i] += r[i];
        tail += x[i] * x[i];
    }
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    float scale = 1.0f / sqrtf((sum + tail) / (float)dim + eps);
    for (i = 0; i + LANES <= dim; i += LANES) store8(out + i, load8(x + i) * scale * load8(w + i));
    for (; i < dim; i++) out[i] = x[i] * scale * w[i];
}

/* residual may be NULL (no add); x, residual and out rows are `stride` floats apart. */
void pdserve_rms_norm(float *x, const float *residual, const float *weight, float *out,
                      int64_t rows, int64_t dim, int64_t stride, float eps, int threads) {
    int nt = rows >= PARALLEL_MIN_ROWS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t row = 0; row < rows; row++) {
        const float *r = residual ? residual + row * stride : 0;
        norm_row(x + row * stride, r, weight, out + row * stride, dim, eps);
    }
}
