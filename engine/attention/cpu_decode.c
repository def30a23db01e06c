/* Paged decode attention on the CPU: one query token per sequence, GQA; q float32 or bfloat16,
 * the cache the same dtype or int8 with a float32 scale per row (engine/attention/kv_quant.py).
 *
 * Reads K and V in place through each sequence's block table (no gather copy), with an online
 * softmax over chunks of whole blocks, summing in float32. Built at run time by
 * engine/attention/cpu_kernel.py (-O3 -march=native -fopenmp, no -ffast-math; GCC 12+ or
 * clang for __builtin_shufflevector) and called once per layer through ctypes.
 *
 *   kv   [num_blocks, 2, block_size, KV, W]   K (0) and V (1); block_size a power of two
 *        W = D values; int8: W = D + 4 bytes, D int8 then the row's float32 scale
 *   q    [T, H, D], rows q_stride values apart (a view of the fused QKV projection)
 *   out  [T, H, D], rows out_stride values apart; only the rows of decode sequences are written
 *   q and out share one dtype: float32, or bfloat16 (out rounded to nearest even); kv is q's
 *   dtype or int8. An int8 row is never dequantized whole: q.k sums q times the int8 values
 *   and is scaled once by the row's scale; p V adds the int8 values times p * scale.
 *   plan int32: rows[B] | lens[B] | indptr[B + 1] | pages[indptr[B]]
 *        sequence b reads q row rows[b], attends its first lens[b] positions; its token t
 *        lives in block pages[indptr[b] + t / block_size], row t % block_size
 *
 * Work item = one sequence, all heads (OpenMP spreads sequences over threads): a token's K
 * row of all KV heads is KV * D contiguous values, so a block is read front to back once, and
 * rows ahead are prefetched (blocks are scattered: the hardware prefetcher stops at each).
 * Per chunk of up to CHUNK tokens and query head:  s = q.k scaled;  m' = max(m, max s);
 * p = exp(s - m');  l = l exp(m - m') + sum p;  acc = acc exp(m - m') + p V;  out = acc / l.
 * Dot products and V sums run on 16-float vectors (GCC/clang vector extensions: one AVX-512
 * register, or two / four narrower ones) in a fixed order, so nothing needs -ffast-math; exp
 * is a polynomial the compiler vectorises (relative error ~1e-7). Needs D % 16 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define CHUNK 128  /* tokens scored per softmax update (at least one whole block) */
#define PREFETCH 8 /* tokens ahead; 4 to 16 measured alike */

/* exp(x) for x <= 0: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
 * (truncation < 7e-8 relative), 2^k from the exponent bits. Below -87 it returns ~1e-38, not 0:
 * harmless next to the chunk maximum's weight of 1. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 }; /* the cache's element type */

/* Values i..i+15 of a float32, bfloat16 or int8 array, as floats (memcpy: unaligned loads). A
 * bf16 value is the upper half of its float: interleaved with zeros (one permute; converting to
 * uint32 and shifting compiled to four instructions); int8 values are sign-extended and
 * converted by the AVX-512 / AVX2 instructions for it (GCC 12 compiled __builtin_convertvector
 * from int8, and shuffles into int32 lanes, a value at a time: 4-8x slower), else by the
 * generic conversion. kvt is a constant wherever this is inlined, so each kernel has one branch. */
static inline v16 load16(const void *p, int64_t i, const int kvt) {
    v16 x;
    if (kvt == KV_I8) {
        i8x16 b;
        memcpy(&b, (const int8_t *)p + i, sizeof b);
#if defined(__AVX512F__)
        __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)b));
        memcpy(&x, &f, sizeof x);
#elif defined(__AVX2__)
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((__m128i)b));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)b, 8)));
        memcpy(&x, &lo, sizeof lo);
        memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
#else
        x = __builtin_convertvector(b, v16);
#endif
    } else if (kvt == KV_BF16) {
        u16x16 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const u16x16 z = {0};
        u16x32 w = __builtin_shufflevector(z, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                           7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                                           14, 30, 15, 31);
        memcpy(&x, &w, sizeof x);
    } else {
        memcpy(&x, (const float *)p + i, sizeof x);
    }
    return x;
}

static inline float load1(const void *p, int64_t i, const int bf16) {
    float x;
    if (bf16) {
        uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16;
        memcpy(&x, &w, sizeof x);
        return x;
    }
    return ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float x, const int bf16) {
    if (bf16) {
        uint32_t w;
        memcpy(&w, &x, sizeof w);
        ((uint16_t *)p)[i] = (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
    } else {
        ((float *)p)[i] = x;
    }
}

/* the float32 scale of the int8 row starting at byte k (after its D values) */
static inline float row_scale(const void *kv, int64_t k, const int D) {
    float s;
    memcpy(&s, (const int8_t *)kv + k + D, sizeof s);
    return s;
}

/* q . k: products summed in 16 lanes, then the lanes added pairwise (int8: unscaled) */
static inline float dot(const float *q, const void *kv, int64_t k, const int D, const int kvt) {
    v16 acc = {0}, x;
    for (int d = 0; d < D; d += 16) {
        memcpy(&x, q + d, sizeof x);
        acc += x * load16(kv, k + d, kvt);
    }
    v8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) +
            __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

struct args {
    const void *q, *kv;
    const int32_t *rows, *lens, *indptr, *pages;
    void *out;
    int64_t q_stride, out_stride;
    int heads, kv_heads, head_dim, block_size;
    float scale;
};

/* One sequence, all its heads. always_inline: called with D = 64 / 128, bf16 (q and out) and
 * kvt as constants, so those loops are fully unrolled and a head's V sums stay in registers. */
static inline __attribute__((always_inline)) void attend(const struct args *a, int b,
                                                         const int D, const int bf16,
                                                         const int kvt) {
    const int H = a->heads, G = a->heads / a->kv_heads, bs = a->block_size;
    const int chunk = bs > CHUNK ? bs : CHUNK, shift = __builtin_ctz(bs); /* whole blocks */
    const int len = a->lens[b];
    const int32_t *pages = a->pages + a->indptr[b];
    const int W = kvt == KV_I8 ? D + 4 : D; /* values a (token, head) row takes */
    const int64_t row = (int64_t)a->kv_heads * W, plane = (int64_t)bs * row; /* in values */
    const int64_t q0 = a->rows[b] * a->q_stride, out0 = a->rows[b] * a->out_stride;
    const int64_t row_bytes = row * (kvt == KV_F32 ? 4 : kvt == KV_BF16 ? 2 : 1);
    const int64_t plane_bytes = bs * row_bytes;
    float qs[H * D], acc[H * D], s[H * chunk], m[H], l[H];
    int kv_off[H]; /* query head -> its KV head's values within a row */

    for (int i = 0; i < H * D; i++) {
        qs[i] = load1(a->q, q0 + i, bf16) * a->scale;
        acc[i] = 0.0f;
    }
    for (int hq = 0; hq < H; hq++) {
        m[hq] = -INFINITY;
        l[hq] = 0.0f;
        kv_off[hq] = hq / G * W;
    }
    for (int start = 0; start < len; start += chunk) {
        const int n = len - start < chunk ? len - start : chunk;
        for (int i = 0; i < n; i++) { /* scores */
            const int t = start + i;
            const int64_t k = pages[t >> shift] * 2 * plane + (t & (bs - 1)) * row;
            if (t + PREFETCH < len) { /* K row PREFETCH tokens on into L1, its V row into L2 */
                const int tp = t + PREFETCH;
                const char *pk = (const char *)a->kv + (pages[tp >> shift] * 2 * plane_bytes +
                                                        (tp & (bs - 1)) * row_bytes);
                for (int64_t c = 0; c < row_bytes; c += 64) {
                    __builtin_prefetch(pk + c, 0, 3);
                    __builtin_prefetch(pk + plane_bytes + c, 0, 2);
                }
            }
            for (int hq = 0; hq < H; hq++) {
                float qk = dot(qs + hq * D, a->kv, k + kv_off[hq], D, kvt);
                if (kvt == KV_I8) qk *= row_scale(a->kv, k + kv_off[hq], D);
                s[hq * chunk + i] = qk;
            }
        }
        for (int hq = 0; hq < H; hq++) { /* online softmax */
            float *sh = s + hq * chunk, mx = m[hq], sum = 0.0f;
#pragma omp simd reduction(max : mx)
            for (int i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; i++) {
                sh[i] = exp_neg(sh[i] - mx);
                sum += sh[i];
            }
            const float alpha = exp_neg(m[hq] - mx); /* m = -inf at the first chunk: ~0 */
            l[hq] = l[hq] * alpha + sum;
            m[hq] = mx;
            for (int d = 0; d < D; d++) acc[hq * D + d] *= alpha;
        }
        for (int hq = 0; hq < H; hq++) { /* acc += p V, the head's sums held in registers */
            const float *sh = s + hq * chunk;
            v16 ah[D / 16];
            memcpy(ah, acc + hq * D, sizeof ah);
            for (int i = 0; i < n; i++) {
                const int t = start + i;
                const int64_t v =
                    (pages[t >> shift] * 2 + 1) * plane + (t & (bs - 1)) * row + kv_off[hq];
                const float p = kvt == KV_I8 ? sh[i] * row_scale(a->kv, v, D) : sh[i];
                for (int j = 0; j < D / 16; j++) ah[j] += p * load16(a->kv, v + 16 * j, kvt);
            }
            memcpy(acc + hq * D, ah, sizeof ah);
        }
    }
    for (int hq = 0; hq < H; hq++) {
        const float inv = 1.0f / l[hq];
        for (int d = 0; d < D; d++) store1(a->out, out0 + hq * D + d, acc[hq * D + d] * inv, bf16);
    }
}

/* one sequence in each supported (head size, q dtype, cache dtype), the common head sizes as
 * constants */
#define ATTEND_D(bf16, kvt)                                                                    \
    (head_dim == 64 ? attend(&a, b, 64, bf16, kvt)                                             \
     : head_dim == 128 ? attend(&a, b, 128, bf16, kvt)                                         \
                       : attend(&a, b, head_dim, bf16, kvt))

/* dtype (q and out): 0 = float32, 1 = bfloat16; kv_dtype: 0 = float32, 1 = bfloat16 (q's),
 * 2 = int8 rows with their scale */
void pdserve_paged_decode(const void *q, int64_t q_stride, const void *kv, const int32_t *plan,
                          int num_seqs, int heads, int kv_heads, int head_dim, int block_size,
                          float scale, void *out, int64_t out_stride, int dtype, int kv_dtype,
                          int num_threads) {
    const struct args a = {
        .q = q, .kv = kv, .rows = plan, .lens = plan + num_seqs, .indptr = plan + 2 * num_seqs,
        .pages = plan + 3 * num_seqs + 1, .out = out, .q_stride = q_stride,
        .out_stride = out_stride, .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim,
        .block_size = block_size, .scale = scale,
    };
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int b = 0; b < num_seqs; b++) {
        if (kv_dtype == KV_I8)
            dtype == 1 ? ATTEND_D(1, KV_I8) : ATTEND_D(0, KV_I8);
        else
            dtype == 1 ? ATTEND_D(1, KV_BF16) : ATTEND_D(0, KV_F32);
    }
}
