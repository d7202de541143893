/* Fused per-token decode steps of the converted attention kinds on CPU, float32.

   One call per layer and token does what the decode path's PyTorch operations do (linearize/ops/dsla.py
   dsla_decode_step, linearize/ops/hybrid.py hybrid_decode_step, and the Hedgehog feature maps and
   DSLA gates before them), in one OpenMP region: each state is read and written once, and nothing is
   dispatched per operation. Built and loaded by linearize/ops/cpu_kernels.py, which also defines the
   argument structs below as ctypes structures (same field order) and tests hold against the
   reference ops. Tasks are (row, query head) pairs; the team is the caller's OpenMP team (torch's
   intra-op threads: the process links one OpenMP runtime). */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define SAVE_FLUSH_DENORMALS() unsigned int saved_csr_ = _mm_getcsr(); _mm_setcsr(saved_csr_ | 0x8040)
#define RESTORE_FLUSH_DENORMALS() _mm_setcsr(saved_csr_)
#else
#define SAVE_FLUSH_DENORMALS() (void)0
#define RESTORE_FLUSH_DENORMALS() (void)0
#endif

#define ABI_VERSION 2

int linearize_abi_version(void) { return ABI_VERSION; }

int linearize_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* exp(x) within 1 ulp for x in [-87.3, 88.4] (inputs are clamped to that range: exp of anything
   below is the smallest normal float instead of 0, which every caller here adds to a sum of terms
   >= 1 or multiplies by a zero weight). Branch-free so loops over it vectorise. */
static inline float exp_f(float x) {
    x = x < -87.3365f ? -87.3365f : x;
    x = x > 88.3762f ? 88.3762f : x;
    float n = x * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* sum a b, in 16 interleaved partial sums (a float sum in one order cannot be vectorised) */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int64_t l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* sum x, in 16 interleaved partial sums */
static inline float sum(const float *restrict x, int64_t n) {
    float acc[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t l = 0; l < 16; l++) acc[l] += x[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += x[i];
    for (int64_t l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* max x (n >= 1), in 16 interleaved partial maxima */
static inline float maximum(const float *restrict x, int64_t n) {
    float acc[16];
    for (int64_t l = 0; l < 16; l++) acc[l] = x[0];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t l = 0; l < 16; l++) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
    float m = x[0];
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int64_t l = 0; l < 16; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

/* acc += w x */
static inline void axpy(float *restrict acc, const float *restrict x, float w, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += w * x[i];
}

/* Weight matrices come as float32 or, where every value is one, as bfloat16 (half the bytes to
   read; the same numbers): element i of matrix m is m_at(m, bf16, i). */
static inline float bf16_value(uint16_t bits) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)bits << 16;
    return u.f;
}

static inline void axpy_bf16(float *restrict acc, const uint16_t *restrict x, float w, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += w * bf16_value(x[i]);
}

/* acc += w m[offset : offset + n] */
static inline void axpy_m(float *restrict acc, const void *m, int64_t bf16, int64_t offset, float w, int64_t n) {
    if (bf16)
        axpy_bf16(acc, (const uint16_t *)m + offset, w, n);
    else
        axpy(acc, (const float *)m + offset, w, n);
}

/* sum m[offset : offset + n] x, in 16 interleaved partial sums */
static inline float dot_m(const void *m, int64_t bf16, int64_t offset, const float *restrict x, int64_t n) {
    if (!bf16) return dot((const float *)m + offset, x, n);
    const uint16_t *restrict a = (const uint16_t *)m + offset;
    float acc[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t l = 0; l < 16; l++) acc[l] += bf16_value(a[i + l]) * x[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += bf16_value(a[i]) * x[i];
    for (int64_t l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* row = decay row + w x, acc += r row (the updated row): one pass over a state row */
static inline void update_read(float *restrict row, const float *restrict x, float *restrict acc, float decay, float w, float r,
                               int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float y = w * x[i] + decay * row[i];
        row[i] = y;
        acc[i] += r * y;
    }
}

/* row = row + w x, acc += r row (the updated row) */
static inline void add_read(float *restrict row, const float *restrict x, float *restrict acc, float w, float r, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float y = row[i] + w * x[i];
        row[i] = y;
        acc[i] += r * y;
    }
}

/* One half of a Hedgehog map of one head: out = softmax(p) (sign 0) or softmax(-p) (sign 1),
   p = x W + b, W = w[offset:] (d x half) row-major: features [0, half) or [half, 2 half) of
   [softmax(p), softmax(-p)]. */
static void hedgehog_half(const float *restrict x, const void *w, int64_t bf16, int64_t offset, const float *restrict b, int64_t d,
                          int64_t half, int64_t sign, float *restrict out) {
    for (int64_t j = 0; j < half; j++) out[j] = b[j];
    for (int64_t i = 0; i < d; i++) axpy_m(out, w, bf16, offset + i * half, x[i], half);
    if (sign)
        for (int64_t j = 0; j < half; j++) out[j] = -out[j];
    const float hi = maximum(out, half);
    for (int64_t j = 0; j < half; j++) out[j] = exp_f(out[j] - hi);
    const float inv = 1.0f / sum(out, half);
    for (int64_t j = 0; j < half; j++) out[j] *= inv;
}

/* The features [j0, j0 + n) of a query or key x (D) in a head: of its Hedgehog map (w[offset:], b),
   whose halves these rows lie in one of (n = half), or x itself (identity: w NULL). */
static void features(const float *restrict x, const void *w, int64_t bf16, int64_t offset, const float *restrict b, int64_t d,
                     int64_t j0, int64_t n, float *restrict out) {
    if (w == NULL) {
        memcpy(out, x + j0, n * sizeof(float));
        return;
    }
    hedgehog_half(x, w, bf16, offset, b, d, n, j0 / n, out);
}

/* RoPE as transformers' apply_rotary_pos_emb: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]. */
static void rope(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * cos[i] - x[i + h] * sin[i];
    for (int64_t i = h; i < d; i++) out[i] = x[i] * cos[i] + x[i - h] * sin[i];
}

/* ------------------------------------------------------------------------------------------- DSLA */

typedef struct {
    int64_t threads;            /* OpenMP threads (torch's intra-op thread count) */
    int64_t batch, heads, kv_heads, head_dim, value_dim, features, rank, hidden, normalize;
    int64_t rope;               /* apply RoPE (cos, sin) to q and k first */
    int64_t rope_stride;        /* elements between two rows' cos (sin): D, or 0 when all rows share one */
    float empty;                /* EMPTY_DENOMINATOR */
    const float *x;             /* (B, hidden): the token's hidden state (gates) */
    const float *q, *k, *v;     /* (B, Hq, D), (B, Hkv, D), (B, Hkv, Dv): projections, before RoPE */
    const float *cos, *sin;     /* (B or 1, D) (rope) */
    int64_t bf16_weights;       /* wq, wk, down and up hold bfloat16 values (else float32) */
    const void *wq;             /* Hedgehog map of q: (Hq, D, F/2) (normalize) */
    const float *bq;            /* its bias (Hq, F/2) */
    const void *wk;             /* ... of k, per query head */
    const float *bk;
    const void *down;           /* (2, R, hidden): gate down projections, history first */
    const void *up;             /* (2, R, Hq F): up projections transposed */
    const float *up_bias;       /* (2, Hq F) */
    const float *mix;           /* (2,): weights of the two reads (gamma, 1 - gamma), times the scale without normalize */
    float *states;              /* (2, B, Hq, F, Dv [+ 1]), history first: updated in place */
    float *scratch;             /* (B, 2 R) + (B, Hq, 2, 2, Dv [+ 1]) */
    float *out;                 /* (B, Hq, Dv) */
} dsla_args;

void linearize_dsla_step(const dsla_args *a) {
    const int64_t B = a->batch, H = a->heads, Hkv = a->kv_heads, n_rep = H / Hkv, D = a->head_dim, Dv = a->value_dim;
    const int64_t F = a->features, R = a->rank, hidden = a->hidden, W = Dv + (a->normalize ? 1 : 0);
    const int64_t P = F % 2 == 0 ? 2 : 1, n = F / P; /* each head's features in P parts (a Hedgehog map's halves) */
    float *gates = a->scratch, *partial = a->scratch + B * 2 * R; /* (B, 2 R), (B, H, P, 2, W) */
#pragma omp parallel num_threads(a->threads)
    {
        SAVE_FLUSH_DENORMALS();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * 2 * R; i++) {
            const int64_t b = i / (2 * R), r = i % (2 * R);
            gates[i] = dot_m(a->down, a->bf16_weights, r * hidden, a->x + b * hidden, hidden);
        }
        /* per (row, head, part of the features): the part's features and gates, and both states'
           rows of those features decayed, written and read in one pass */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H * P; task++) {
            const int64_t b = task / (H * P), h = task / P % H, j0 = task % P * n;
            float qf[n], kf[n], alpha[2][n], vv[W], qr[D], kr[D];
            const float *q = a->q + (b * H + h) * D, *k = a->k + (b * Hkv + h / n_rep) * D;
            if (a->rope) {
                rope(q, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, qr);
                rope(k, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, kr);
                q = qr;
                k = kr;
            }
            const int64_t f = F / 2; /* a Hedgehog map's projection width */
            if (a->normalize) {
                features(q, a->wq, a->bf16_weights, h * D * f, a->bq + h * f, D, j0, n, qf);
                features(k, a->wk, a->bf16_weights, h * D * f, a->bk + h * f, D, j0, n, kf);
            } else {
                features(q, NULL, 0, 0, NULL, D, j0, n, qf);
                features(k, NULL, 0, 0, NULL, D, j0, n, kf);
            }
            for (int64_t s = 0; s < 2; s++) {
                /* z = up_bias + up gz, then alpha = exp(logsigmoid(z) / 16) = sigmoid(z) ** (1/16); below
                   z = -80 sigmoid(z) leaves float32's normal range, where logsigmoid(z) = z to float precision */
                const float *gz = gates + b * 2 * R + s * R;
                float *z = alpha[s];
                memcpy(z, a->up_bias + s * H * F + h * F + j0, n * sizeof(float));
                for (int64_t r = 0; r < R; r++) axpy_m(z, a->up, a->bf16_weights, (s * R + r) * H * F + h * F + j0, gz[r], n);
                for (int64_t j = 0; j < n; j++) {
                    const float sg = 1.0f / (1.0f + exp_f(-z[j]));
                    const float root = sqrtf(sqrtf(sqrtf(sqrtf(sg))));
                    z[j] = z[j] > -80.0f ? root : exp_f(z[j] * 0.0625f);
                }
            }
            memcpy(vv, a->v + (b * Hkv + h / n_rep) * Dv, Dv * sizeof(float));
            if (a->normalize) vv[Dv] = 1.0f;
            for (int64_t s = 0; s < 2; s++) {
                float *S = a->states + (((s * B + b) * H + h) * F + j0) * W;
                float *o = partial + (task * 2 + s) * W;
                for (int64_t c = 0; c < W; c++) o[c] = 0.0f;
                for (int64_t j = 0; j < n; j++) update_read(S + j * W, vv, o, alpha[s][j], kf[j], qf[j], W);
            }
        }
        /* per (row, head): the two states' reads (their parts summed), each over its normaliser, mixed */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H; task++) {
            float o[2][W];
            for (int64_t s = 0; s < 2; s++) {
                for (int64_t c = 0; c < W; c++) o[s][c] = 0.0f;
                for (int64_t part = 0; part < P; part++) axpy(o[s], partial + ((task * P + part) * 2 + s) * W, 1.0f, W);
            }
            float w0 = a->mix[0], w1 = a->mix[1];
            if (a->normalize) {
                w0 = o[0][Dv] > a->empty ? w0 / o[0][Dv] : 0.0f;
                w1 = o[1][Dv] > a->empty ? w1 / o[1][Dv] : 0.0f;
            }
            float *out = a->out + task * Dv;
            for (int64_t c = 0; c < Dv; c++) out[c] = o[1][c] * w1 + o[0][c] * w0;
        }
        RESTORE_FLUSH_DENORMALS();
    }
}

/* ----------------------------------------------------------------------------------------- hybrid */

typedef struct {
    int64_t threads;            /* OpenMP threads (torch's intra-op thread count) */
    int64_t batch, heads, kv_heads, head_dim, value_dim, features, window, slot;
    int64_t gate_mix;           /* 0: joint (shared denominator, window factor), 1: gate */
    int64_t overlap;            /* the linear part also covers the window's tokens */
    int64_t branches;           /* 0: both, 1: window only, 2: linear only (over all tokens) */
    int64_t linear_rope;        /* the feature maps see q/k after RoPE (1) or before (0) */
    int64_t rope_stride;        /* elements between two rows' cos (sin): D, or 0 when all rows share one */
    float scale, empty;
    const float *q, *k, *v;     /* (B, Hq, D), (B, Hkv, D), (B, Hkv, Dv), before RoPE */
    const float *cos, *sin;     /* (B or 1, D) */
    int64_t bf16_weights;       /* wq and wk hold bfloat16 values (else float32) */
    const void *wq;             /* Hedgehog maps (Hq, D, F/2) */
    const float *bq;            /* their biases (Hq, F/2) */
    const void *wk;
    const float *bk;
    const float *factor;        /* (Hq,): the window factor (joint) or the gate g (gate) */
    float *keys;                /* (B Hkv, W, D): ring buffer, RoPE applied */
    float *linear_keys;         /* (B Hkv, W, D) or NULL: keys before RoPE */
    float *values;              /* (B Hkv, W, Dv + 1): [v, 1], zero at empty slots */
    float *feats;               /* (B Hkv, W, n_rep F): phi_k of each slot's key per query head */
    float *linear;              /* (B Hq, F, Dv + 1): [S | z] over the tokens older than the window */
    uint8_t *valid;             /* (B, W) */
    float *scratch;             /* (B, Hq, D + F + 2 (Dv + 1)) */
    float *out;                 /* (B, Hq, Dv) */
} hybrid_args;

static inline void read_into(const float *x, int64_t dv, float empty, float *out) {
    const float den = x[dv];
    for (int64_t c = 0; c < dv; c++) out[c] = den > empty ? x[c] / den : 0.0f;
}

void linearize_hybrid_step(const hybrid_args *a) {
    const int64_t B = a->batch, H = a->heads, Hkv = a->kv_heads, n_rep = a->heads / a->kv_heads;
    const int64_t D = a->head_dim, Dv = a->value_dim, V = Dv + 1, F = a->features, f = F / 2, Wn = a->window, i = a->slot;
    const int64_t per = D + F + 2 * V; /* scratch per (row, head): q after RoPE, phi(q), the two halves' linear reads */
#pragma omp parallel num_threads(a->threads)
    {
        SAVE_FLUSH_DENORMALS();
        /* 1. per (row, query head, half of the features): the half's features; the token leaving the
              window (slot i) joins those rows of [S | z], read by phi(q) in the same pass; the new
              token's key features take its place */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H * 2; task++) {
            const int64_t bh = task / 2, half = task % 2, b = bh / H, h = bh % H, g = h / n_rep, rep = h % n_rep;
            const int64_t bk = b * Hkv + g, j0 = half * f;
            float *qr = a->scratch + bh * per, *qf = qr + D, *lin = qf + F + half * V;
            float qrot[D], kr[D], kf[f];
            const float *q = a->q + bh * D, *k = a->k + bk * D;
            const float *cos = a->cos + b * a->rope_stride, *sin = a->sin + b * a->rope_stride;
            rope(q, cos, sin, D, qrot);
            if (half == 0) memcpy(qr, qrot, D * sizeof(float));
            hedgehog_half(a->linear_rope ? qrot : q, a->wq, a->bf16_weights, h * D * f, a->bq + h * f, D, f, half, qf + j0);
            if (a->linear_rope) rope(k, cos, sin, D, kr);
            hedgehog_half(a->linear_rope ? kr : k, a->wk, a->bf16_weights, h * D * f, a->bk + h * f, D, f, half, kf);
            float *fo = a->feats + ((bk * Wn + i) * n_rep + rep) * F + j0;
            const float *vo = a->values + (bk * Wn + i) * V;
            float *S = a->linear + (bh * F + j0) * V;
            for (int64_t c = 0; c < V; c++) lin[c] = 0.0f;
            for (int64_t j = 0; j < f; j++) add_read(S + j * V, vo, lin, fo[j], qf[j0 + j], V);
            memcpy(fo, kf, f * sizeof(float));
        }
        /* 2. per KV head: the new token takes slot i */
#pragma omp for schedule(static)
        for (int64_t bk = 0; bk < B * Hkv; bk++) {
            const int64_t b = bk / Hkv;
            const float *k = a->k + bk * D;
            float *key = a->keys + (bk * Wn + i) * D;
            rope(k, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, key);
            if (a->linear_keys) memcpy(a->linear_keys + (bk * Wn + i) * D, a->linear_rope ? key : k, D * sizeof(float));
            float *vs = a->values + (bk * Wn + i) * V;
            memcpy(vs, a->v + bk * Dv, Dv * sizeof(float));
            vs[Dv] = 1.0f;
            if (bk % Hkv == 0) a->valid[b * Wn + i] = 1;
        }
        /* 3. per query head: the window softmax, the window's linear part where read, the mix */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H; task++) {
            const int64_t b = task / H, h = task % H, g = h / n_rep, rep = h % n_rep, bk = b * Hkv + g;
            const float *qr = a->scratch + task * per, *qf = qr + D;
            float *lin = (float *)qf + F;
            axpy(lin, lin + V, 1.0f, V); /* the two halves' reads */
            const float *keys = a->keys + bk * Wn * D, *values = a->values + bk * Wn * V;
            const uint8_t *valid = a->valid + b * Wn;
            float *out = a->out + task * Dv;
            float e[Wn], sw[V], r1[Dv], r2[Dv];
            if (a->overlap || a->branches == 2) {
                const float *feats = a->feats + (bk * Wn * n_rep + rep) * F;
                for (int64_t j = 0; j < Wn; j++) axpy(lin, values + j * V, dot(qf, feats + j * n_rep * F, F), V);
            }
            if (a->branches == 2) {
                read_into(lin, Dv, a->empty, out);
                continue;
            }
            float m = -INFINITY;
            for (int64_t j = 0; j < Wn; j++) {
                e[j] = valid[j] ? dot(qr, keys + j * D, D) * a->scale : -INFINITY;
                m = e[j] > m ? e[j] : m;
            }
            for (int64_t j = 0; j < Wn; j++) e[j] = valid[j] ? exp_f(e[j] - m) : 0.0f;
            for (int64_t c = 0; c < V; c++) sw[c] = 0.0f;
            for (int64_t j = 0; j < Wn; j++) axpy(sw, values + j * V, e[j], V);
            if (a->branches == 1) {
                read_into(sw, Dv, a->empty, out);
            } else if (!a->gate_mix) {
                const float fh = a->factor[h];
                for (int64_t c = 0; c < V; c++) sw[c] = lin[c] + fh * sw[c];
                read_into(sw, Dv, a->empty, out);
            } else {
                const float gh = a->factor[h];
                read_into(lin, Dv, a->empty, r1);
                read_into(sw, Dv, a->empty, r2);
                for (int64_t c = 0; c < Dv; c++) out[c] = r1[c] + gh * (r2[c] - r1[c]);
            }
        }
        RESTORE_FLUSH_DENORMALS();
    }
}

/* The argument structs' layout, which the ctypes structures must match: (size, offset of the
   weights' dtype flag, offset of the last field) of each. */
void linearize_layout(int64_t *out) {
    out[0] = sizeof(dsla_args);
    out[1] = offsetof(dsla_args, bf16_weights);
    out[2] = offsetof(dsla_args, out);
    out[3] = sizeof(hybrid_args);
    out[4] = offsetof(hybrid_args, bf16_weights);
    out[5] = offsetof(hybrid_args, out);
}
