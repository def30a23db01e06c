/* Quantized linear layers by integer dot products on the CPU: y[T, N] = x[T, K] W^T (+ bias).
 *
 * The activations are quantized on the fly, per row, per 32 values (bits = 8: llama.cpp's
 * Q8_0; bits = 16: the same in int16, 1/256 of its rounding),
 *     d = max|x| / 127 (int16: / 32767),  q = round(x / d) (to nearest even, via x * (1 / d))
 * and each 32-weight block's products are summed in integers, exactly, then scaled once:
 *
 *     y[t, n] = sum over blocks b, in order:
 *         acc = fma((float) isum(t, n, b), s[n, b] * d[t, b], acc)      isum = sum q_w * q_x
 *         acc = fma(m[n, b], d[t, b] * sumq(t, b), acc)                  u4 only (its min)
 *
 * Weights are repacked once at load (engine/quant/qdot.py) so that one vector lane is one
 * weight row: 16 rows interleave, 4 weights of each row side by side,
 *
 *     chunk c (k = 4c .. 4c+3) of block b, rows 0..15:  r0k0 r0k1 r0k2 r0k3 r1k0 .. r15k3
 *     i8: [G][NB][8 chunks][64]   int8 codes
 *     u4: [G][NB][4 pairs][64]    byte = code(chunk p) | code(chunk p + 4) << 4
 *     scales, mins: float16 [G][NB][16]   (a group's scale repeated for each of its blocks)
 *
 * so that a 4-byte run of x, broadcast, times a chunk gives 16 rows' partial sums in 16 int32
 * lanes: no horizontal sums, and each lane does exactly the scalar reference's float steps.
 * Every path (AVX-512 VNNI, AVX-VNNI, AVX2, plain C) therefore gives the same bits, and a
 * row's result depends neither on T, the tile, nor the thread count: batch invariant.
 *
 * int8, u8 x s8 products: VNNI (vpdpbusd) takes the nibble codes as the unsigned operand; an
 * i8 weight is made unsigned by w ^ 0x80 = w + 128, its sum corrected by 128 * sumq (exact).
 * Plain AVX2 (vpmaddubsw, int16 pairs that saturate) takes |w| and x with w's sign for i8,
 * and for u4 (pairs at most 2 * 15 * 127) sums 8 chunks in int16 before widening: exact.
 * int16: the codes widened to int16, pairs of products by vpdpwssd / vpmaddwd (a row's two
 * lanes added at the block's end): every sum fits int32 (32 x 32767 x 255), exact too.
 * Built by engine/quant/qdot.py in the engine's way (engine/native_build.py,
 * -O3 -march=native -fopenmp, no -ffast-math); AMX is not used.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 16 /* weight rows a group interleaves (one 512-bit vector of int32) */
#define PARALLEL_MIN_WORK (1 << 18) /* N * K * T below which one thread does the layer */
#define BK 32   /* weights per block */

enum { PATH_C = 0, PATH_AVX2 = 1, PATH_AVXVNNI = 2, PATH_AVX512VNNI = 3 };

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *mins; /* mins NULL for i8 */
    int64_t nb, block_bytes;       /* blocks per row; bytes of one (group, block) */
    int u4;
} packed;

typedef struct {
    const int8_t *q;    /* [T][K]: int8 activations (NULL in int16 mode) */
    const int16_t *q16; /* [T][K]: int16 activations (NULL in int8 mode) */
    const float *d;     /* [T][NB] */
    const float *xs;    /* [T][NB] d * sumq: the min term's factor (u4) */
    const int32_t *sq;  /* [T][NB] 128 * sumq: the i8 offset's correction */
    int64_t K, nb;
} acts;

static inline float half_to_float(uint16_t h) {
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

/* ---- activations ---------------------------------------------------------------------- */

/* One row's activations, block by block: q (into q8, or q16 when given), d, xs and sq. */
static void quantize_row(const float *x, int64_t K, int8_t *q8, int16_t *q16, float *d, float *xs,
                         int32_t *sq) {
    const float top = q16 ? 32767.0f : 127.0f;
    for (int64_t b = 0; b < K / BK; b++) {
        const float *v = x + b * BK;
        float amax = 0.0f;
        for (int i = 0; i < BK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float db = amax / top, inv = db > 0.0f ? 1.0f / db : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < BK; i++) {
            float r = nearbyintf(v[i] * inv);
            int32_t qi = r >= -top && r <= top ? (int32_t)r : (r > 0.0f ? (int32_t)top : -(int32_t)top);
            if (q16) q16[b * BK + i] = (int16_t)qi;
            else q8[b * BK + i] = (int8_t)qi;
            sum += qi;
        }
        d[b] = db;
        xs[b] = db * (float)sum;
        sq[b] = 128 * sum; /* int8's offset correction (unused for int16; fits int32 either way) */
    }
}

/* ---- the plain C reference of every path ----------------------------------------------- */

static inline int code_at(const packed *w, const uint8_t *blk, int r, int k) {
    int c = k / 4, j = k % 4;
    if (!w->u4) return (int8_t)blk[c * 64 + r * 4 + j];
    uint8_t byte = blk[(c % 4) * 64 + r * 4 + j];
    return c >= 4 ? byte >> 4 : byte & 15;
}

static void group_c(const packed *w, int64_t g, const acts *x, int64_t t0, int tt, float *acc) {
    for (int i = 0; i < tt * ROWS; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < w->nb; b++) {
        const uint8_t *blk = w->codes + (g * w->nb + b) * w->block_bytes;
        const uint16_t *sh = w->scales + (g * w->nb + b) * ROWS;
        for (int r = 0; r < ROWS; r++) {
            float s = half_to_float(sh[r]);
            float m = w->u4 ? half_to_float(w->mins[(g * w->nb + b) * ROWS + r]) : 0.0f;
            for (int t = 0; t < tt; t++) {
                int64_t at0 = (t0 + t) * x->K + b * BK;
                int32_t isum = 0;
                if (x->q16)
                    for (int k = 0; k < BK; k++) isum += code_at(w, blk, r, k) * x->q16[at0 + k];
                else
                    for (int k = 0; k < BK; k++) isum += code_at(w, blk, r, k) * x->q[at0 + k];
                int64_t at = (t0 + t) * x->nb + b;
                float *a = acc + t * ROWS + r;
                *a = fmaf((float)isum, s * x->d[at], *a);
                if (w->u4) *a = fmaf(m, x->xs[at], *a);
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- 256-bit: rows 0..7 or 8..15 of a group (half h), up to 2 x rows at once ----------- */

/* The 8 chunks of a block's half h, as unsigned bytes (u4 codes; i8 as stored, signed) */
static inline void chunks256(const packed *w, const uint8_t *blk, int h, __m256i out[8]) {
    if (w->u4) {
        const __m256i low = _mm256_set1_epi8(15);
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + p * 64 + h * 32));
            out[p] = _mm256_and_si256(v, low);
            out[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    } else {
        for (int c = 0; c < 8; c++)
            out[c] = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + h * 32));
    }
}

/* isum of 8 rows against x's 32 values q, exact, by vpmaddubsw (plain AVX2) */
static inline __m256i isum_avx2(const packed *w, const __m256i c[8], const int8_t *q) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (w->u4) { /* pairs <= 2 * 15 * 127: 8 chunks sum in int16 without overflow */
        __m256i s16 = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[k], _mm256_set1_epi32(load4(q + 4 * k))));
        return _mm256_madd_epi16(s16, ones);
    }
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) { /* |w| x (x with w's sign): pairs <= 2 * 128 * 127 */
        __m256i xb = _mm256_set1_epi32(load4(q + 4 * k));
        __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(c[k]), _mm256_sign_epi8(xb, c[k]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAVE_AVXVNNI 1
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
/* the same isum by vpdpbusd (an i8 chunk is flipped to unsigned; the caller corrects) */
static inline __m256i isum_vnni256(const packed *w, const __m256i c[8], const int8_t *q) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        __m256i u = w->u4 ? c[k] : _mm256_xor_si256(c[k], flip);
        s = dpbusd256(s, u, _mm256_set1_epi32(load4(q + 4 * k)));
    }
    return s;
}
#endif

/* the same isum against int16 activations, by vpmaddwd: each chunk's codes widened to int16
 * (4 rows x 4 weights a vector), int32 pairs of one row, summed at the end of the block */
static inline __m256i isum16_256(const packed *w, const __m256i c[8], const int16_t *q) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        int64_t xv;
        memcpy(&xv, q + 4 * k, sizeof xv);
        __m256i xb = _mm256_set1_epi64x(xv);
        __m128i c0 = _mm256_castsi256_si128(c[k]), c1 = _mm256_extracti128_si256(c[k], 1);
        __m256i w0 = w->u4 ? _mm256_cvtepu8_epi16(c0) : _mm256_cvtepi8_epi16(c0);
        __m256i w1 = w->u4 ? _mm256_cvtepu8_epi16(c1) : _mm256_cvtepi8_epi16(c1);
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(w0, xb)); /* rows 0-3, 2 lanes each */
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(w1, xb)); /* rows 4-7 */
    }
    __m256i h = _mm256_hadd_epi32(lo, hi); /* rows 0 1 4 5 | 2 3 6 7 */
    return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

static inline void group256(const packed *w, int64_t g, const acts *x, int64_t t0, int tt,
                            float *acc, int vnni) {
    for (int h = 0; h < 2; h++) {
        __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < w->nb; b++) {
            int64_t wb = g * w->nb + b;
            __m256i c[8];
            chunks256(w, w->codes + wb * w->block_bytes, h, c);
            __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales + wb * ROWS + h * 8)));
            __m256 m = w->u4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + wb * ROWS + h * 8)))
                             : _mm256_setzero_ps();
            for (int t = 0; t < tt; t++) {
                int64_t at = (t0 + t) * x->nb + b;
                __m256i is;
                if (x->q16) {
                    is = isum16_256(w, c, x->q16 + (t0 + t) * x->K + b * BK);
                    goto scaled;
                }
                const int8_t *q = x->q + (t0 + t) * x->K + b * BK;
#ifdef HAVE_AVXVNNI
                if (vnni) {
                    is = isum_vnni256(w, c, q);
                    if (!w->u4) is = _mm256_sub_epi32(is, _mm256_set1_epi32(x->sq[at]));
                } else
#endif
                    is = isum_avx2(w, c, q);
                (void)vnni;
            scaled:
                a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(s, _mm256_set1_ps(x->d[at])), a[t]);
                if (w->u4) a[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->xs[at]), a[t]);
            }
        }
        for (int t = 0; t < tt; t++) _mm256_storeu_ps(acc + t * ROWS + h * 8, a[t]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_AVX512VNNI 1
#define TT512 4 /* x rows a 512-bit tile takes at once */

static inline __attribute__((always_inline)) void group512_tile(
    const packed *w, int64_t g, const acts *x, int64_t t0, const int tt, float *acc) {
    __m512 a[TT512];
    for (int t = 0; t < tt; t++) a[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < w->nb; b++) {
        int64_t wb = g * w->nb + b;
        const uint8_t *blk = w->codes + wb * w->block_bytes;
        __m512i c[8];
        if (w->u4) {
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512(blk + p * 64);
                c[p] = _mm512_and_si512(v, low);
                c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int k = 0; k < 8; k++) c[k] = _mm512_xor_si512(_mm512_loadu_si512(blk + k * 64), flip);
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + wb * ROWS)));
        __m512 m = w->u4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + wb * ROWS)))
                         : _mm512_setzero_ps();
        for (int t = 0; t < tt; t++) {
            int64_t at = (t0 + t) * x->nb + b;
            const int8_t *q = x->q + (t0 + t) * x->K + b * BK;
            __m512i is = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++)
                is = _mm512_dpbusd_epi32(is, c[k], _mm512_set1_epi32(load4(q + 4 * k)));
            if (!w->u4) is = _mm512_sub_epi32(is, _mm512_set1_epi32(x->sq[at]));
            a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(s, _mm512_set1_ps(x->d[at])), a[t]);
            if (w->u4) a[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->xs[at]), a[t]);
        }
    }
    for (int t = 0; t < tt; t++) _mm512_storeu_ps(acc + t * ROWS, a[t]);
}

/* int16 activations: each chunk widened to int16 once a block (rows 0-7, 8-15), vpdpwssd into
 * pairs of lanes per row, summed and gathered into one vector of 16 rows at the block's end */
static inline __attribute__((always_inline)) void group512_tile16(
    const packed *w, int64_t g, const acts *x, int64_t t0, const int tt, float *acc) {
    __m512 a[TT512];
    for (int t = 0; t < tt; t++) a[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int64_t b = 0; b < w->nb; b++) {
        int64_t wb = g * w->nb + b;
        const uint8_t *blk = w->codes + wb * w->block_bytes;
        __m512i wide[16];
        for (int k = 0; k < 8; k++) {
            __m512i c;
            if (w->u4) {
                __m512i v = _mm512_loadu_si512(blk + (k % 4) * 64);
                c = k < 4 ? _mm512_and_si512(v, low) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                c = _mm512_loadu_si512(blk + k * 64);
            }
            __m256i c0 = _mm512_castsi512_si256(c), c1 = _mm512_extracti64x4_epi64(c, 1);
            wide[2 * k] = w->u4 ? _mm512_cvtepu8_epi16(c0) : _mm512_cvtepi8_epi16(c0);
            wide[2 * k + 1] = w->u4 ? _mm512_cvtepu8_epi16(c1) : _mm512_cvtepi8_epi16(c1);
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + wb * ROWS)));
        __m512 m = w->u4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + wb * ROWS)))
                         : _mm512_setzero_ps();
        for (int t = 0; t < tt; t++) {
            int64_t at = (t0 + t) * x->nb + b;
            const int16_t *q = x->q16 + (t0 + t) * x->K + b * BK;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) {
                int64_t xv;
                memcpy(&xv, q + 4 * k, sizeof xv);
                __m512i xb = _mm512_set1_epi64(xv);
                lo = _mm512_dpwssd_epi32(lo, wide[2 * k], xb);
                hi = _mm512_dpwssd_epi32(hi, wide[2 * k + 1], xb);
            }
            lo = _mm512_add_epi32(lo, _mm512_srli_epi64(lo, 32)); /* a row's pair, even lanes */
            hi = _mm512_add_epi32(hi, _mm512_srli_epi64(hi, 32));
            __m512i is = _mm512_permutex2var_epi32(lo, even, hi);
            a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(s, _mm512_set1_ps(x->d[at])), a[t]);
            if (w->u4) a[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->xs[at]), a[t]);
        }
    }
    for (int t = 0; t < tt; t++) _mm512_storeu_ps(acc + t * ROWS, a[t]);
}

static void group512(const packed *w, int64_t g, const acts *x, int64_t t0, int tt, float *acc) {
    if (x->q16) {
        switch (tt) {
        case 1: group512_tile16(w, g, x, t0, 1, acc); return;
        case 2: group512_tile16(w, g, x, t0, 2, acc); return;
        case 3: group512_tile16(w, g, x, t0, 3, acc); return;
        default: group512_tile16(w, g, x, t0, 4, acc); return;
        }
    }
    switch (tt) { /* constant tile heights: the accumulators stay in registers */
    case 1: group512_tile(w, g, x, t0, 1, acc); break;
    case 2: group512_tile(w, g, x, t0, 2, acc); break;
    case 3: group512_tile(w, g, x, t0, 3, acc); break;
    default: group512_tile(w, g, x, t0, 4, acc); break;
    }
}
#endif

/* Bit i set: path i compiled here and granted by this CPU and OS (probed, not assumed). */
int pdserve_qdot_paths(void) {
    int paths = 1 << PATH_C;
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths |= 1 << PATH_AVX2;
#ifdef HAVE_AVXVNNI
#if defined(__AVXVNNI__)
    if (__builtin_cpu_supports("avxvnni")) paths |= 1 << PATH_AVXVNNI;
#else
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
        paths |= 1 << PATH_AVXVNNI;
#endif
#endif
#ifdef HAVE_AVX512VNNI
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        paths |= 1 << PATH_AVX512VNNI;
#endif
#endif
    return paths;
}

static int tile_rows(int path) { return path == PATH_AVX512VNNI ? 4 : 2; }

static void run_group(int path, const packed *w, int64_t g, const acts *x, int64_t t0, int tt,
                      float *acc) {
    switch (path) {
#ifdef HAVE_AVX512VNNI
    case PATH_AVX512VNNI: group512(w, g, x, t0, tt, acc); return;
#endif
#ifdef HAVE_AVX2
#ifdef HAVE_AVXVNNI
    case PATH_AVXVNNI: group256(w, g, x, t0, tt, acc, 1); return;
#endif
    case PATH_AVX2: group256(w, g, x, t0, tt, acc, 0); return;
#endif
    default: group_c(w, g, x, t0, tt, acc); return;
    }
}

/* A layer's constant part: its packed weight, bias, shape and path (pdserve_qdot_layer). */
typedef struct {
    packed w;
    const float *bias;
    int64_t K, N;
    int path, bits; /* bits: the activations', 8 or 16 */
} layer;

static int qdot(const layer *l, const float *x, int64_t x_stride, int64_t T, float *y,
                int64_t y_stride, int threads) {
    const packed *w = &l->w;
    int64_t K = l->K, N = l->N, nb = K / BK, groups = (N + ROWS - 1) / ROWS;
    size_t q_bytes = (size_t)(T * K) * (l->bits / 8), f_bytes = (size_t)(T * nb) * sizeof(float);
    char *buf = malloc(q_bytes + 3 * f_bytes + 64);
    if (!buf) return -1;
    float *d = (float *)buf, *xs = d + T * nb;
    int32_t *sq = (int32_t *)(xs + T * nb);
    int8_t *q = l->bits == 8 ? (int8_t *)(sq + T * nb) : NULL;
    int16_t *q16 = l->bits == 16 ? (int16_t *)(sq + T * nb) : NULL;
    if (threads > groups) threads = (int)groups;
    if (threads < 1 || N * K * T < PARALLEL_MIN_WORK) threads = 1; /* waking one costs more */
    int par_rows = T >= 8 * threads ? threads : 1;
#pragma omp parallel for num_threads(par_rows) if (par_rows > 1) schedule(static)
    for (int64_t t = 0; t < T; t++)
        quantize_row(x + t * x_stride, K, q ? q + t * K : NULL, q16 ? q16 + t * K : NULL,
                     d + t * nb, xs + t * nb, sq + t * nb);
    acts a = {q, q16, d, xs, sq, K, nb};
    int th = tile_rows(l->path);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
#else
        int64_t id = 0, count = 1;
#endif
        float acc[4 * ROWS];
        for (int64_t g = groups * id / count; g < groups * (id + 1) / count; g++) {
            int64_t n0 = g * ROWS, nr = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t t0 = 0; t0 < T; t0 += th) {
                int tt = T - t0 < th ? (int)(T - t0) : th;
                run_group(l->path, w, g, &a, t0, tt, acc);
                for (int t = 0; t < tt; t++)
                    for (int64_t r = 0; r < nr; r++) {
                        float v = acc[t * ROWS + r];
                        y[(t0 + t) * y_stride + n0 + r] = l->bias ? v + l->bias[n0 + r] : v;
                    }
            }
        }
    }
    free(buf);
    return 0;
}

static layer make_layer(int64_t K, int64_t N, const void *codes, const uint16_t *scales,
                        const uint16_t *mins, const float *bias, int path, int bits) {
    layer l = {{(const uint8_t *)codes, scales, mins, K / BK, mins ? 4 * 64 : 8 * 64, mins != NULL},
               bias, K, N, path, bits == 16 ? 16 : 8};
    return l;
}

/* y[t, n] for t < T, n < N (x rows x_stride floats apart, y rows y_stride); weights packed as
 * the header says (u4: mins given; i8: mins NULL). path: one of pdserve_qdot_paths()' bits;
 * bits: the activations' (8, or 16: int16 per 32 values, d = max|x| / 32767, by vpdpwssd).
 * Returns 0; -1 when the activations' buffer could not be allocated; -2 for a path not here. */
int pdserve_qdot(const float *x, int64_t x_stride, int64_t T, int64_t K, const void *codes,
                 const uint16_t *scales, const uint16_t *mins, const float *bias, float *y,
                 int64_t y_stride, int64_t N, int threads, int path, int bits) {
    if (!(pdserve_qdot_paths() >> path & 1)) return -2;
    layer l = make_layer(K, N, codes, scales, mins, bias, path, bits);
    return qdot(&l, x, x_stride, T, y, y_stride, threads);
}

/* The same for a layer called step after step: its constants held once (a serving model's
 * calls then pass 5 arguments, not 13); NULL for a path not here or no memory. */
void *pdserve_qdot_layer(int64_t K, int64_t N, const void *codes, const uint16_t *scales,
                         const uint16_t *mins, const float *bias, int path, int bits) {
    if (!(pdserve_qdot_paths() >> path & 1)) return NULL;
    layer *l = malloc(sizeof *l);
    if (l) *l = make_layer(K, N, codes, scales, mins, bias, path, bits);
    return l;
}

/* x [T, K] and y [T, N] contiguous. */
int pdserve_qdot_call(const void *l, const float *x, int64_t T, float *y, int threads) {
    const layer *ly = l;
    return qdot(ly, x, ly->K, T, y, ly->N, threads);
}

void pdserve_qdot_free(void *l) { free(l); }
