/* Rotary embedding on the CPU, float32, in place on the query and key heads of each row, in
 * one call per layer (engine/cpu_rope.py):
 *
 *   row t:  | head 0 | head 1 | ... | head n-1 | (anything after: V, untouched)
 *           x[t * row_stride + h * dim + i]
 *   x = x * cos + roll(x, dim / 2) * sin_signed   (cos, sin_signed: [rows, dim] row-major)
 *
 * each element rounded as torch's `addcmul(x * cos, x.roll(dim / 2), sin_signed)` rounds it:
 * the product x * cos once, then the sum either once more with the other product exact (an
 * fma, as GCC contracts ATen's addcmul where torch is built with FMA) or twice; `fused` picks
 * which, found by comparing with torch at load. Built with -ffp-contract=off, so the fma is
 * the one written and the compiler contracts nothing else. Each element's arithmetic is fixed:
 * a row's result does not depend on the other rows or on the thread count. Rows are spread
 * over threads only when there are many (a prefill chunk).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ROWS 64

void pdserve_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
                  const float *cos, const float *sin, int fused, int threads) {
    int64_t half = dim / 2;
    int nt = rows >= PARALLEL_MIN_ROWS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *lo = x + t * row_stride + h * dim, *hi = lo + half;
            if (fused) {
                for (int64_t i = 0; i < half; i++) {
                    float a = lo[i], b = hi[i];
                    lo[i] = fmaf(b, s[i], a * c[i]);
                    hi[i] = fmaf(a, s[half + i], b * c[half + i]);
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    float a = lo[i], b = hi[i];
                    lo[i] = a * c[i] + b * s[i];
                    hi[i] = b * c[half + i] + a * s[half + i];
                }
            }
        }
    }
}
