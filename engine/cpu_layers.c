/* A decode step's decoder layers in one C call on the CPU (engine/cpu_layers.py).
 *
 * A step of decode rows alone, float32, through the engine's own kernels (each from its own
 * library, passed in as function pointers): per layer
 *
 *     h = rms_norm(x += pending)              pdserve_rms_norm      (the first layer: x alone)
 *     qkv = h Wqkv^T                          pdserve_qdot_call     [T, (H + 2 KV) D]
 *     rope on qkv's query and key heads       pdserve_rope          in place
 *     K, V rows -> their cache slots          a copy                [blocks, 2, bs, KV, D]
 *     a = attention(q, cache)                 pdserve_paged_decode  [T, H D]
 *     h = rms_norm(x += a Wo^T)
 *     g = h Wgu^T;  pending = (silu(gate) * up) Wdown^T
 *
 * and at the end hidden = rms_norm(x += pending). These are the calls the Python layers make
 * (engine/model.py), on the same buffers in the same order, so the bits are the same: a step
 * here and the same rows in a mixed step through Python give one token. What this saves is the
 * Python between the kernels: ~25 calls a layer, ~2 ms of a ~7 ms batch-1 step of SmolLM2.
 *
 * SiLU(gate) * up rounds each element as torch's F.silu(gate) * up: exp is SLEEF's expf_u10
 * (what ATen's Vectorized<float>::exp calls on AVX2 / AVX-512, step by step below) as far as
 * torch's vector loop reaches, libm's expf for the rest of a row; `silu_step` is that loop's
 * step, found at load by comparing with torch (engine/cpu_layers.py). Built with
 * -ffp-contract=off: every fma is written as one and nothing else is contracted.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*norm_fn)(float *, const float *, const float *, float *, int64_t, int64_t,
                        int64_t, float, int);
typedef int (*qdot_fn)(const void *, const float *, int64_t, float *, int);
typedef void (*rope_fn)(float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *,
                        int, int);
typedef void (*attn_fn)(const void *, int64_t, const void *, const int32_t *, int, int, int, int,
                        int, float, void *, int64_t, int, int, int);

typedef struct { /* one decoder layer: its norms' weights, its linear layers, its cache */
    const float *in_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down; /* pdserve_qdot_layer handles */
    float *kv;                            /* [num_blocks, 2, block_size, KV, D] float32 */
} layer;

typedef struct { /* the model's shape and the kernels */
    int64_t hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int rope_fma, silu_step;
    norm_fn norm;
    qdot_fn qdot;
    rope_fn rope;
    attn_fn attn;
} model;

/* ---- SiLU(gate) * up as torch rounds it ------------------------------------------------- */

static inline float pow2i(int32_t q) {
    uint32_t bits = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* SLEEF's xexpf (sleefsimdsp.c), whose vmla is an fma on AVX2 and AVX-512. Its q = rint(d /
 * ln 2) comes from adding and taking away 1.5 * 2^23 (round to nearest even, as cvtps2dq),
 * after a clamp that moves only inputs the last two lines overwrite (and NaN, kept NaN). */
static inline float sleef_expf(float d) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    float v = d * 1.442695040888963407359924681001892137f;
    v = v > -256.0f ? v : -256.0f;
    v = v < 256.0f ? v : 256.0f;
    float qf = (v + magic) - magic;
    int32_t q = (int32_t)qf;
    float s = fmaf(qf, -0.693145751953125f, d);
    s = fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    int32_t q1 = q >> 1;
    u = u * pow2i(q1) * pow2i(q - q1);
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? INFINITY : u;
}

/* rows of [gate | up] (inter floats each) -> out [rows, inter]; step: torch's vector step
 * in floats (0: its scalar loop throughout) */
void pdserve_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
                      int64_t step) {
    int64_t vec_end = step > 0 ? inter - inter % step : 0;
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (int64_t i = 0; i < vec_end; i++) o[i] = g[i] / (1.0f + sleef_expf(-g[i])) * u[i];
        for (int64_t i = vec_end; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- the layers --------------------------------------------------------------------------- */

/* x [T, hidden]: the step's embeddings, the residual stream after (updated in place); out
 * [T, hidden]: the final norm's input normed (its weight final_norm); cos, sin [T, head_dim];
 * blocks, offsets [T]: each row's new K/V slot; plan: the attention kernel's (KernelPlan);
 * qdot_threads: the quantized layers' threads now (one for a small layer: the kernel's rule), attn_threads the attention's, norm_threads
 * the norms' and rope's. Returns 0, -1 for no memory. */
int pdserve_decode_layers(const model *m, const layer *layers, int num_layers, float *x,
                          int64_t T, const float *final_norm, float *out, const float *cos,
                          const float *sin, const int64_t *blocks, const int64_t *offsets,
                          const int32_t *plan, int num_seqs, int qdot_threads, int attn_threads,
                          int norm_threads) {
    const int64_t E = m->hidden, H = m->heads, KV = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t row = (H + 2 * KV) * D, bs = m->block_size;
    size_t floats = (size_t)T * (size_t)(E + row + H * D + E + 2 * I + I + E);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    float *h = buf, *qkv = h + T * E, *att = qkv + T * row, *o = att + T * H * D;
    float *gu = o + T * E, *act = gu + T * 2 * I, *pending = act + T * I;
    int status = 0;
    for (int l = 0; l < num_layers && !status; l++) {
        const layer *ly = &layers[l];
        m->norm(x, l ? pending : NULL, ly->in_norm, h, T, E, E, m->eps, norm_threads);
        status |= m->qdot(ly->qkv, h, T, qkv, qdot_threads);
        m->rope(qkv, T, row, H + KV, D, cos, sin, m->rope_fma, norm_threads);
        for (int64_t t = 0; t < T; t++) /* K and V rows into their slot, as written */
            for (int sel = 0; sel < 2; sel++) {
                float *dst = ly->kv + ((blocks[t] * 2 + sel) * bs + offsets[t]) * KV * D;
                memcpy(dst, qkv + t * row + (H + sel * KV) * D, sizeof(float) * KV * D);
            }
        m->attn(qkv, row, ly->kv, plan, num_seqs, (int)H, (int)KV, (int)D, (int)bs, m->scale, att,
                H * D, 0, 0, attn_threads);
        status |= m->qdot(ly->o, att, T, o, qdot_threads);
        m->norm(x, o, ly->post_norm, h, T, E, E, m->eps, norm_threads);
        status |= m->qdot(ly->gate_up, h, T, gu, qdot_threads);
        pdserve_silu_mul(gu, T, I, act, m->silu_step);
        status |= m->qdot(ly->down, act, T, pending, qdot_threads);
    }
    if (!status) m->norm(x, num_layers ? pending : NULL, final_norm, out, T, E, E, m->eps, norm_threads);
    free(buf);
    return status ? -1 : 0;
}
