/* Weight-only quantized linear layers on the CPU: y[T, N] = x[T, K] W^T (+ bias), float32.
 *
 * W is an engine/quant/weights.py QuantWeight, read in its own layout (no repacking):
 *   kind 0 "i8": codes int8 [N, K];    w[n, k] = q * s[n, k / group]
 *   kind 1 "u4": codes uint8 [N, K/2]; w[n, k] = q * s[n, k / group] + m[n, k / group]
 *        each 32 weights take 16 bytes: byte j holds weight j (low nibble) and j + 16 (high)
 *   s, m float16 [N, K / group]; group a multiple of 32 dividing K
 * Built at run time by engine/quant/kernel.py (-O3 -march=native -fopenmp, no -ffast-math)
 * and called once per layer through ctypes.
 *
 * Arithmetic. Each weight is dequantized to float32 in registers: q * s for i8 and
 * fma(q, s, m) for u4 are exact (q has at most 8 bits, s and m 11), so the weights are
 * bit for bit weights.dequantize's. Output (t, n) is then always the same sequence:
 *     acc[0..7] = 0;  for k in 0, 8, .., K - 8:  acc[i] = fma(w[n, k + i], x[t, k + i], acc[i])
 *     y = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))  (+ bias[n])
 * whatever T, the tiling or the thread count, so a row's logits do not depend on the batch.
 *
 * Work. Threads split the output rows into blocks of RB. A block of rows is
 *   T <= FUSED_*_T: dequantized chunk by chunk in registers, each chunk used for up to 2 x
 *                 rows at once (batch 1 reads each weight byte once, from memory, while the
 *                 next block's codes are prefetched: without, ~4 GB/s, not ~10);
 *   otherwise:    dequantized once into a per-thread float32 buffer [RB, K] (L1/L2), then
 *                 multiplied by tiles of 4 weight rows x 2 x rows (8 accumulators, 6 loads a
 *                 chunk); x is walked in slices of TB rows (each slice reads the weights again).
 * No repacking and no path switch for large T (prefill): at T = 128 this takes 1.0-1.4x
 * oneDNN's fp32 time on the same shapes (bench/micro/quant_linear.py, shared machine), and a
 * dequantize + oneDNN path would give a decode row other bits in a step with a prefill chunk.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 4          /* weight rows a block holds */
#define GC 64         /* groups whose scales (and mins) a block converts to float at once */
#define FUSED_I8_T 4  /* at most this many x rows: the fused path, in tiles of up to 2 rows */
#define FUSED_U4_T 2  /* (above them the buffered path is faster, measured at 3 and 4 rows) */
#define TB 128 /* x rows per pass of the buffered path over a thread's rows (64, 512: slower) */

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *mins; /* mins NULL for i8 */
    int64_t K, group, groups, row_bytes;
    int kind;
} qweight;

/* ---- 8-float vectors: AVX2 + FMA + F16C, or plain C computing the same values ---------- */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
/* A loaded value kept in a register: left alone, GCC reloads it as a memory operand of each
 * FMA that uses it (12 loads, not 6, per 8 FMAs of a 4 x 2 tile: 30% slower, measured). */
static inline vf in_register(vf v) {
    __asm__("" : "+x"(v));
    return v;
}
static inline float vsum(vf v) { /* ((0+4)+(2+6)) + ((1+5)+(3+7)) */
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
static inline void halves(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
}
/* Weights 8j .. 8j+7 of the 32-weight block whose codes start at p, as floats. */
static inline vf deq8_i8(const uint8_t *p, int j, vf s, vf m) {
    (void)m;
    __m128i q = _mm_loadl_epi64((const __m128i *)(p + 8 * j));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
}
static inline vf deq8_u4(const uint8_t *p, int j, vf s, vf m) {
    __m128i raw = _mm_loadl_epi64((const __m128i *)(p + 8 * (j & 1)));
    if (j >= 2) raw = _mm_srli_epi16(raw, 4);
    __m128i q = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), s, m);
}
/* The same values, one shuffle placing bytes 0..7 (8..15 for odd j) each alone in a dword:
 * with one x row 1.35x faster, with two slower (more registers), measured. */
static inline vf deq8_u4_shuffled(const uint8_t *p, int j, vf s, vf m) {
    const __m256i pick = j & 1 ? _mm256_setr_epi32(-248, -247, -246, -245, -244, -243, -242, -241)
                               : _mm256_setr_epi32(-256, -255, -254, -253, -252, -251, -250, -249);
    __m256i bytes = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), pick);
    __m256i q = j >= 2 ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, m);
}
#else
#include <math.h>
typedef struct {
    float v[8];
} vf;
static inline vf vset1(float x) {
    vf r;
    for (int i = 0; i < 8; i++) r.v[i] = x;
    return r;
}
static inline vf vzero(void) { return vset1(0.0f); }
static inline vf vload(const float *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void vstore(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf in_register(vf v) { return v; }
static inline vf vfma(vf a, vf b, vf c) {
    for (int i = 0; i < 8; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
static inline float vsum(vf v) {
    float a[4];
    for (int i = 0; i < 4; i++) a[i] = v.v[i] + v.v[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}
static inline float half(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    float f;
    if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exact */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline void halves(const uint16_t *h, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = half(h[i]);
}
static inline vf deq8_i8(const uint8_t *p, int j, vf s, vf m) {
    (void)m;
    for (int i = 0; i < 8; i++) s.v[i] *= (float)(int8_t)p[8 * j + i];
    return s;
}
static inline vf deq8_u4(const uint8_t *p, int j, vf s, vf m) {
    for (int i = 0; i < 8; i++) {
        uint8_t byte = p[8 * (j & 1) + i];
        m.v[i] = fmaf((float)(j >= 2 ? byte >> 4 : byte & 15), s.v[i], m.v[i]);
    }
    return m;
}
#define deq8_u4_shuffled deq8_u4
#endif

/* Scales (and mins) of rows n0 .. n0+nr-1, groups g0 .. g0+ng-1: sf[r * GC + g], mf alike. */
static inline void block_params(const qweight *w, int64_t n0, int nr, int64_t g0, int ng,
                                float *sf, float *mf) {
    for (int r = 0; r < nr; r++) {
        int64_t at = (n0 + r) * w->groups + g0;
        halves(w->scales + at, ng, sf + r * GC);
        if (w->mins) halves(w->mins + at, ng, mf + r * GC);
        else memset(mf + r * GC, 0, sizeof(float) * ng);
    }
}

static inline void store(float *y, int64_t ys, int64_t t, int64_t n, vf acc, const float *bias) {
    float v = vsum(acc);
    y[t * ys + n] = bias ? v + bias[n] : v;
}

/* Rows n0 .. n0+NR-1 against x rows t0 .. t0+NT-1, dequantized in registers: each 8 weights
 * of a row are one vector, used for every x row at once. BYTES: a 32-weight block's codes;
 * DEQ1: the dequantizer with one x row, where a block's rows go one after the other (one
 * row's scale and min held at a time: u4 20% faster than chunk by chunk over the rows). */
#define FUSED(KIND, BYTES, NR, NT, DEQ1)                                                     \
    static void fused_##KIND##_##NR##_##NT(const qweight *w, int64_t n0, const float *x,    \
                                           int64_t xs, int64_t t0, const float *bias,       \
                                           float *y, int64_t ys) {                          \
        vf acc[NR][NT];                                                                      \
        float sf[NR * GC], mf[NR * GC];                                                      \
        const int64_t per_group = w->group / 32;                                             \
        const uint8_t *rows[NR], *ahead = w->codes + (n0 + RB) * w->row_bytes;               \
        for (int r = 0; r < NR; r++) {                                                       \
            rows[r] = w->codes + (n0 + r) * w->row_bytes;                                    \
            for (int t = 0; t < NT; t++) acc[r][t] = vzero();                                \
        }                                                                                    \
        for (int64_t g0 = 0; g0 < w->groups; g0 += GC) {                                     \
            int ng = w->groups - g0 < GC ? (int)(w->groups - g0) : GC;                       \
            block_params(w, n0, NR, g0, ng, sf, mf);                                         \
            for (int g = 0; g < ng; g++)                                                     \
                for (int64_t b = (g0 + g) * per_group; b < (g0 + g + 1) * per_group; b++) { \
                    for (int at = 0; at < NR * BYTES; at += 64) /* the next row block */     \
                        __builtin_prefetch(ahead + b * NR * BYTES + at, 0, 3);               \
                    if (NT == 1) { /* rows outer: a row's scale and min in 2 registers */    \
                        vf xv[4];                                                            \
                        for (int j = 0; j < 4; j++) xv[j] = vload(x + t0 * xs + b * 32 + 8 * j); \
                        for (int r = 0; r < NR; r++) {                                       \
                            vf sv = vset1(sf[r * GC + g]), mv = vset1(mf[r * GC + g]);         \
                            const uint8_t *p = rows[r] + b * BYTES;                          \
                            for (int j = 0; j < 4; j++)                                      \
                                acc[r][0] = vfma(DEQ1(p, j, sv, mv), xv[j], acc[r][0]);      \
                        }                                                                    \
                    } else                                                                   \
                    for (int j = 0; j < 4; j++) {                                            \
                        vf xv[NT];                                                           \
                        for (int t = 0; t < NT; t++)                                         \
                            xv[t] = vload(x + (t0 + t) * xs + b * 32 + 8 * j);               \
                        for (int r = 0; r < NR; r++) {                                       \
                            vf sv = vset1(sf[r * GC + g]), mv = vset1(mf[r * GC + g]);         \
                            const uint8_t *p = rows[r] + b * BYTES;                          \
                            vf wv = deq8_##KIND(p, j, sv, mv);                               \
                            for (int t = 0; t < NT; t++) acc[r][t] = vfma(wv, xv[t], acc[r][t]); \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
        }                                                                                    \
        for (int r = 0; r < NR; r++)                                                         \
            for (int t = 0; t < NT; t++) store(y, ys, t0 + t, n0 + r, acc[r][t], bias);      \
    }

/* Rows n0 .. n0+NR-1, dequantized in buf [RB, K], against x rows t0 .. t0+NT-1. */
#define BUFFERED(NR, NT)                                                                     \
    static void buffered_##NR##_##NT(const float *buf, int64_t K, int64_t n0, const float *x, \
                                     int64_t xs, int64_t t0, const float *bias, float *y,   \
                                     int64_t ys) {                                           \
        vf acc[NR][NT];                                                                      \
        for (int r = 0; r < NR; r++)                                                         \
            for (int t = 0; t < NT; t++) acc[r][t] = vzero();                                \
        for (int64_t k = 0; k < K; k += 8) {                                                 \
            vf wv[NR], xv[NT];                                                               \
            for (int r = 0; r < NR; r++) wv[r] = in_register(vload(buf + r * K + k));        \
            for (int t = 0; t < NT; t++) xv[t] = in_register(vload(x + (t0 + t) * xs + k));  \
            for (int r = 0; r < NR; r++)                                                     \
                for (int t = 0; t < NT; t++) acc[r][t] = vfma(wv[r], xv[t], acc[r][t]);      \
        }                                                                                    \
        for (int r = 0; r < NR; r++)                                                         \
            for (int t = 0; t < NT; t++) store(y, ys, t0 + t, n0 + r, acc[r][t], bias);      \
    }

#define FUSED_I8(NR, NT) FUSED(i8, 32, NR, NT, deq8_i8)
#define FUSED_U4(NR, NT) FUSED(u4, 16, NR, NT, deq8_u4_shuffled)
#define ROWS(M, NT) M(1, NT) M(2, NT) M(3, NT) M(4, NT)
ROWS(FUSED_I8, 1) ROWS(FUSED_I8, 2) ROWS(FUSED_U4, 1) ROWS(FUSED_U4, 2)
ROWS(BUFFERED, 1) ROWS(BUFFERED, 2)

typedef void (*fused_fn)(const qweight *, int64_t, const float *, int64_t, int64_t,
                         const float *, float *, int64_t);
typedef void (*buffered_fn)(const float *, int64_t, int64_t, const float *, int64_t, int64_t,
                            const float *, float *, int64_t);
#define TILES(P, K) {P##K##_1_1, P##K##_1_2}, {P##K##_2_1, P##K##_2_2}, \
                    {P##K##_3_1, P##K##_3_2}, {P##K##_4_1, P##K##_4_2}
static const fused_fn FUSED_FNS[2][RB][2] = {{TILES(fused_, i8)}, {TILES(fused_, u4)}};
static const buffered_fn BUFFERED_FNS[RB][2] = {TILES(buffered, )};

static void dequantize_rows(const qweight *w, int64_t n0, int nr, float *buf) {
    float sf[RB * GC], mf[RB * GC];
    const int64_t per_group = w->group / 32;
    for (int64_t g0 = 0; g0 < w->groups; g0 += GC) {
        int ng = w->groups - g0 < GC ? (int)(w->groups - g0) : GC;
        block_params(w, n0, nr, g0, ng, sf, mf);
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < ng; g++) {
                vf s = vset1(sf[r * GC + g]), m = vset1(mf[r * GC + g]);
                for (int64_t b = (g0 + g) * per_group; b < (g0 + g + 1) * per_group; b++) {
                    const uint8_t *p = w->codes + (n0 + r) * w->row_bytes;
                    for (int j = 0; j < 4; j++) {
                        vf v = w->kind ? deq8_u4(p + b * 16, j, s, m) : deq8_i8(p + b * 32, j, s, m);
                        vstore(buf + r * w->K + b * 32 + 8 * j, v);
                    }
                }
            }
    }
}

/* The thread's row blocks [b0, b1): T <= FUSED_T in registers, else through a buffer. */
static int run_blocks(const qweight *w, int64_t N, int64_t b0, int64_t b1, const float *x,
                      int64_t xs, int64_t T, const float *bias, float *y, int64_t ys) {
    if (T <= (w->kind ? FUSED_U4_T : FUSED_I8_T)) {
        for (int64_t blk = b0; blk < b1; blk++) {
            int64_t n0 = blk * RB;
            int nr = N - n0 < RB ? (int)(N - n0) : RB;
            for (int64_t t = 0; t < T; t += 2)
                FUSED_FNS[w->kind][nr - 1][T - t >= 2](w, n0, x, xs, t, bias, y, ys);
        }
        return 0;
    }
    float *buf = aligned_alloc(64, (size_t)(RB * w->K * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -1;
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
        int64_t t1 = t0 + TB < T ? t0 + TB : T;
        for (int64_t blk = b0; blk < b1; blk++) {
            int64_t n0 = blk * RB;
            int nr = N - n0 < RB ? (int)(N - n0) : RB;
            dequantize_rows(w, n0, nr, buf);
            if (blk + 1 < b1) /* the next block's codes arrive while this one computes */
                for (int64_t at = 0; at < RB * w->row_bytes; at += 64)
                    __builtin_prefetch(w->codes + (n0 + RB) * w->row_bytes + at, 0, 3);
            for (int64_t t = t0; t < t1; t += 2)
                BUFFERED_FNS[nr - 1][t1 - t >= 2](buf, w->K, n0, x, xs, t, bias, y, ys);
        }
    }
    free(buf);
    return 0;
}

/* y[t, n] for t < T, n < N; x rows x_stride floats apart, y rows y_stride; kind 0 i8, 1 u4;
 * mins ignored for i8. Returns 0, or -1 when a thread's buffer could not be allocated. */
int pdserve_qlinear(const float *x, int64_t x_stride, int64_t T, int64_t K, const void *codes,
                    const uint16_t *scales, const uint16_t *mins, int64_t group, int kind,
                    const float *bias, float *y, int64_t y_stride, int64_t N, int threads) {
    qweight w = {(const uint8_t *)codes, scales, kind ? mins : NULL, K, group, K / group,
                 kind ? K / 2 : K, kind};
    int64_t blocks = (N + RB - 1) / RB;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        int64_t id = 0, count = 1;
#endif
        int64_t b0 = blocks * id / count, b1 = blocks * (id + 1) / count;
        failed |= run_blocks(&w, N, b0, b1, x, x_stride, T, bias, y, y_stride) != 0;
    }
    return failed ? -1 : 0;
}

