/* Fused per-token decode steps of the converted attention kinds on CPU, float32.

   One call per layer and token does what the decode path's PyTorch operations do (linearize/ops/dsla.py
   dsla_decode_step, linearize/ops/hybrid.py hybrid_decode_step, and the Hedgehog feature maps and
   DSLA gates before them), in one OpenMP region: each state is read and written once, and nothing is
   dispatched per operation. Built and loaded by linearize/ops/cpu_kernels.py, which also defines the
   argument structs below as ctypes structures (same field order) and tests hold against the
   reference ops. Tasks are (row, query head) pairs; the team is the caller's OpenMP team (torch's
   intra-op threads: the process links one OpenMP runtime). */

#include <math.h>
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

#define ABI_VERSION 1

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
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* acc += w x */
static inline void axpy(float *restrict acc, const float *restrict x, float w, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += w * x[i];
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

/* Hedgehog map of one head: out = [softmax(p), softmax(-p)], p = x W + b, W (d x half) row-major. */
static void hedgehog(const float *restrict x, const float *restrict w, const float *restrict b, int64_t d, int64_t half,
                     float *restrict out) {
    float *restrict p = out; /* the projection, in the first half until the end */
    for (int64_t j = 0; j < half; j++) p[j] = b[j];
    for (int64_t i = 0; i < d; i++) axpy(p, w + i * half, x[i], half);
    float hi = p[0], lo = p[0];
    for (int64_t j = 1; j < half; j++) {
        hi = p[j] > hi ? p[j] : hi;
        lo = p[j] < lo ? p[j] : lo;
    }
    float pos = 0.0f, neg = 0.0f;
    for (int64_t j = 0; j < half; j++) {
        const float a = exp_f(p[j] - hi), c = exp_f(lo - p[j]);
        out[j] = a;
        out[half + j] = c;
        pos += a;
        neg += c;
    }
    const float rp = 1.0f / pos, rn = 1.0f / neg;
    for (int64_t j = 0; j < half; j++) {
        out[j] *= rp;
        out[half + j] *= rn;
    }
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
    const float *wq, *bq;       /* Hedgehog map of q: (Hq, D, F/2), (Hq, F/2) (normalize) */
    const float *wk, *bk;       /* ... of k, per query head */
    const float *down;          /* (2, R, hidden): gate down projections, history first */
    const float *up, *up_bias;  /* (2, Hq F, R), (2, Hq F) */
    const float *mix;           /* (2,): weights of the two reads (gamma, 1 - gamma), times the scale without normalize */
    float *states;              /* (2, B, Hq, F, Dv [+ 1]), history first: updated in place */
    float *scratch;             /* (B, 2 R) */
    float *out;                 /* (B, Hq, Dv) */
} dsla_args;

void linearize_dsla_step(const dsla_args *a) {
    const int64_t B = a->batch, H = a->heads, n_rep = a->heads / a->kv_heads, D = a->head_dim, Dv = a->value_dim;
    const int64_t F = a->features, R = a->rank, hidden = a->hidden, W = Dv + (a->normalize ? 1 : 0);
#pragma omp parallel num_threads(a->threads)
    {
        SAVE_FLUSH_DENORMALS();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * 2 * R; i++) {
            const int64_t b = i / (2 * R), r = i % (2 * R);
            a->scratch[i] = dot(a->down + r * hidden, a->x + b * hidden, hidden);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H; task++) {
            const int64_t b = task / H, h = task % H, g = h / n_rep;
            float qf[F], kf[F], alpha[2][F], vv[W], o[2][W], qr[D], kr[D];
            const float *q = a->q + (b * H + h) * D, *k = a->k + (b * a->kv_heads + g) * D;
            if (a->rope) {
                rope(q, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, qr);
                rope(k, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, kr);
                q = qr;
                k = kr;
            }
            if (a->normalize) {
                hedgehog(q, a->wq + h * D * (F / 2), a->bq + h * (F / 2), D, F / 2, qf);
                hedgehog(k, a->wk + h * D * (F / 2), a->bk + h * (F / 2), D, F / 2, kf);
            } else {
                memcpy(qf, q, F * sizeof(float));
                memcpy(kf, k, F * sizeof(float));
            }
            for (int64_t s = 0; s < 2; s++) {
                const float *gz = a->scratch + b * 2 * R + s * R;
                const float *up = a->up + (s * H * F + h * F) * R, *bias = a->up_bias + s * H * F + h * F;
                for (int64_t j = 0; j < F; j++) {
                    /* alpha = exp(logsigmoid(z) / 16) = sigmoid(z) ** (1/16); below z = -80 sigmoid(z)
                       leaves float32's normal range, where logsigmoid(z) = z to float precision */
                    const float z = bias[j] + dot(up + j * R, gz, R);
                    const float sg = 1.0f / (1.0f + exp_f(-z));
                    const float root = sqrtf(sqrtf(sqrtf(sqrtf(sg))));
                    alpha[s][j] = z > -80.0f ? root : exp_f(z * 0.0625f);
                }
            }
            memcpy(vv, a->v + (b * a->kv_heads + g) * Dv, Dv * sizeof(float));
            if (a->normalize) vv[Dv] = 1.0f;
            for (int64_t s = 0; s < 2; s++) {
                float *S = a->states + ((s * B + b) * H + h) * F * W;
                float *os = o[s];
                for (int64_t c = 0; c < W; c++) os[c] = 0.0f;
                for (int64_t j = 0; j < F; j++) update_read(S + j * W, vv, os, alpha[s][j], kf[j], qf[j], W);
            }
            float w0 = a->mix[0], w1 = a->mix[1];
            if (a->normalize) {
                w0 = o[0][Dv] > a->empty ? w0 / o[0][Dv] : 0.0f;
                w1 = o[1][Dv] > a->empty ? w1 / o[1][Dv] : 0.0f;
            }
            float *out = a->out + (b * H + h) * Dv;
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
    const float *wq, *bq, *wk, *bk;  /* Hedgehog maps (Hq, D, F/2), (Hq, F/2) */
    const float *factor;        /* (Hq,): the window factor (joint) or the gate g (gate) */
    float *keys;                /* (B Hkv, W, D): ring buffer, RoPE applied */
    float *linear_keys;         /* (B Hkv, W, D) or NULL: keys before RoPE */
    float *values;              /* (B Hkv, W, Dv + 1): [v, 1], zero at empty slots */
    float *feats;               /* (B Hkv, W, n_rep F): phi_k of each slot's key per query head */
    float *linear;              /* (B Hq, F, Dv + 1): [S | z] over the tokens older than the window */
    uint8_t *valid;             /* (B, W) */
    float *scratch;             /* (B, Hq, D + F + Dv + 1) */
    float *out;                 /* (B, Hq, Dv) */
} hybrid_args;

static inline void read_into(const float *x, int64_t dv, float empty, float *out) {
    const float den = x[dv];
    for (int64_t c = 0; c < dv; c++) out[c] = den > empty ? x[c] / den : 0.0f;
}

void linearize_hybrid_step(const hybrid_args *a) {
    const int64_t B = a->batch, H = a->heads, Hkv = a->kv_heads, n_rep = a->heads / a->kv_heads;
    const int64_t D = a->head_dim, Dv = a->value_dim, V = Dv + 1, F = a->features, Wn = a->window, i = a->slot;
    const int64_t per = D + F + V;
#pragma omp parallel num_threads(a->threads)
    {
        SAVE_FLUSH_DENORMALS();
        /* 1. per query head: features; the token leaving the window (slot i) joins [S | z], read by
              phi(q) in the same pass; the new token's key features take its place */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * H; task++) {
            const int64_t b = task / H, h = task % H, g = h / n_rep, rep = h % n_rep, bk = b * Hkv + g;
            float *qr = a->scratch + task * per, *qf = qr + D, *lin = qf + F;
            float kr[D], kf[F];
            const float *q = a->q + task * D, *k = a->k + bk * D;
            rope(q, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, qr);
            hedgehog(a->linear_rope ? qr : q, a->wq + h * D * (F / 2), a->bq + h * (F / 2), D, F / 2, qf);
            if (a->linear_rope) rope(k, a->cos + b * a->rope_stride, a->sin + b * a->rope_stride, D, kr);
            hedgehog(a->linear_rope ? kr : k, a->wk + h * D * (F / 2), a->bk + h * (F / 2), D, F / 2, kf);
            float *fo = a->feats + ((bk * Wn + i) * n_rep + rep) * F;
            const float *vo = a->values + (bk * Wn + i) * V;
            float *S = a->linear + task * F * V;
            for (int64_t c = 0; c < V; c++) lin[c] = 0.0f;
            for (int64_t j = 0; j < F; j++) add_read(S + j * V, vo, lin, fo[j], qf[j], V);
            memcpy(fo, kf, F * sizeof(float));
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
                const float f = a->factor[h];
                for (int64_t c = 0; c < V; c++) sw[c] = lin[c] + f * sw[c];
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
