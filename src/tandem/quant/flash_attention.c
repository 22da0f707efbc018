// Flash attention over an f16 cache on the CPU, bit for bit ggml's FLASH_ATTN_EXT as llama.cpp's x86 builds without
// AVX512-FP16 arithmetic compute it, on two shapes: one query row over 512 keys and more (a decode step: ggml's
// split-KV path, one chunk of keys per thread, the chunks' partial sums merged in thread order), and 64 query rows
// and more (a prompt chunk: ggml's tiled path, below).
//
// ggml walks the keys once per query head; here the heads that share a key head (GQA) walk them together, so each
// key and value row is converted from f16 once for all of them instead of once a head. Every head's arithmetic is
// ggml's, in its order. Decode: the f16-rounded query, the dot product's four float32 accumulators and their
// reduction, the online softmax with glibc's expf, the f16 accumulator of the weighted values (each update rounded to
// f16), the fused multiply-adds ggml's compiled code makes of `S = S*ms + vs` and of the merge.
//
// Decode is two graph nodes (custom ops; ggml's barrier between nodes stands for the one inside its kernel):
//   flash_decode_partials: dst [2 + Dv, H, capacity] f32 of (M, S, values) per head and chunk;
//       src q [Dk, 1, H] f32, k [Dk, n, G] f16, v [Dv, n, G] f16, mask [n, >=1] f16 or none, sinks [H] f32 or none
//   flash_decode_merge: dst [Dv, H, 1] f32; src: the partials
// and a prompt chunk one (flash_prefill). userdata: the float attention scale. Requires AVX-512F, Dk and Dv
// multiples of 64 (no leftover lanes) up to FLASH_MAX_D, H / G up to FLASH_MAX_GROUP, one mask for every head: the
// Python side (quant/flash_attention.py) checks before it builds a node.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FLASH_MAX_D 512
#define FLASH_MAX_GROUP 32

// ggml 0.25.3's tensor header (ggml.h); quant/flash_attention.py checks the offsets against ggml-python's at load
struct ggml_tensor {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor *src[10];
    struct ggml_tensor *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

size_t flash_attention_offset(int field) {
    switch (field) {
    case 0: return offsetof(struct ggml_tensor, ne);
    case 1: return offsetof(struct ggml_tensor, nb);
    case 2: return offsetof(struct ggml_tensor, src);
    case 3: return offsetof(struct ggml_tensor, data);
    default: return sizeof(struct ggml_tensor);
    }
}

typedef uint16_t f16_t;

static inline __m512 load_f16(const f16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void store_f16(f16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, 0)); }

void flash_decode_partials(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3],
                             *sinks = dst->src[4];
    const int64_t dk = k->ne[0], dv = v->ne[0], n = k->ne[1], heads = q->ne[2], groups = k->ne[2];
    const int64_t per = heads / groups, stride = 2 + dv;
    const float scale = *(const float *)userdata;
    if (nth > dst->ne[2]) return;  // more threads than the node has room for: the merge writes NaN
    const int64_t chunk = (n + nth - 1) / nth, c0 = ith * chunk, c1 = c0 + chunk < n ? c0 + chunk : n;
    const f16_t *mp = mask ? (const f16_t *)mask->data : NULL;
    float *partials = (float *)dst->data + ith * stride;  // head h's at partials + h * nth * stride
    float qf[FLASH_MAX_GROUP][FLASH_MAX_D] __attribute__((aligned(64)));
    f16_t acc[FLASH_MAX_GROUP][FLASH_MAX_D] __attribute__((aligned(64)));
    float kf[FLASH_MAX_D] __attribute__((aligned(64)));
    float M[FLASH_MAX_GROUP], S[FLASH_MAX_GROUP], score[FLASH_MAX_GROUP], weight[FLASH_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        if (c0 >= n) {  // no keys for this thread: an empty partial, as ggml leaves it
            for (int64_t r = 0; r < per; r++) {
                float *p = partials + (g * per + r) * nth * stride;
                p[0] = -INFINITY;
                p[1] = 0.0f;
            }
            continue;
        }
        for (int64_t r = 0; r < per; r++) {  // the query as ggml's dot product reads it: rounded to f16
            const float *pq = (const float *)((const char *)q->data + (g * per + r) * q->nb[2]);
            for (int64_t d = 0; d < dk; d += 16)
                _mm512_store_ps(&qf[r][d], _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(pq + d), 0)));
            memset(acc[r], 0, dv * sizeof(f16_t));
            M[r] = -INFINITY;
            S[r] = 0.0f;
        }
        const char *kg = (const char *)k->data + g * k->nb[2], *vg = (const char *)v->data + g * v->nb[2];
        for (int64_t ic = c0; ic < c1; ic++) {
            const float mv = mp ? _cvtsh_ss(mp[ic]) : 0.0f;
            if (mv == -INFINITY) continue;
            const f16_t *kr = (const f16_t *)(kg + ic * k->nb[1]), *vr = (const f16_t *)(vg + ic * v->nb[1]);
            for (int64_t d = 0; d < dk; d += 16) _mm512_store_ps(kf + d, load_f16(kr + d));
            for (int64_t r = 0; r < per; r++) {  // ggml_vec_dot_f16: 4 accumulators of 16 lanes, then its tree
                __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int64_t i = 0; i < dk; i += 64)
                    for (int j = 0; j < 4; j++)
                        sum[j] = _mm512_fmadd_ps(_mm512_load_ps(kf + i + 16 * j), _mm512_load_ps(&qf[r][i + 16 * j]),
                                                 sum[j]);
                sum[0] = _mm512_add_ps(sum[0], sum[2]);
                sum[1] = _mm512_add_ps(sum[1], sum[3]);
                sum[0] = _mm512_add_ps(sum[0], sum[1]);
                float s = _mm512_reduce_add_ps(sum[0]);
                s = s * scale;
                score[r] = s + mv;
            }
            for (int64_t r = 0; r < per; r++) {  // online softmax; a new maximum rescales the f16 accumulator
                const float s = score[r], m_old = M[r];
                float ms = 1.0f, vs = 1.0f;
                if (s > m_old) {
                    M[r] = s;
                    ms = expf(m_old - s);
                    const __m512 f = _mm512_set1_ps(ms);
                    for (int64_t d = 0; d < dv; d += 16) store_f16(&acc[r][d], _mm512_mul_ps(load_f16(&acc[r][d]), f));
                } else {
                    vs = expf(s - m_old);
                }
                weight[r] = vs;
                S[r] = fmaf(S[r], ms, vs);
            }
            for (int64_t d = 0; d < dv; d += 16) {  // ggml_vec_mad_f16, one value row for every head
                const __m512 x = load_f16(vr + d);
                for (int64_t r = 0; r < per; r++)
                    store_f16(&acc[r][d], _mm512_fmadd_ps(x, _mm512_set1_ps(weight[r]), load_f16(&acc[r][d])));
            }
        }
        for (int64_t r = 0; r < per; r++) {
            const int64_t h = g * per + r;
            float *p = partials + h * nth * stride, *values = p + 2;
            for (int64_t d = 0; d < dv; d++) values[d] = _cvtsh_ss(acc[r][d]);
            if (sinks && c0 == 0) {  // the sink logit joins the first chunk
                const float s = ((const float *)sinks->data)[h];
                float ms = 1.0f, vs = 1.0f;
                if (s > M[r]) {
                    ms = expf(M[r] - s);
                    M[r] = s;
                    for (int64_t d = 0; d < dv; d++) values[d] *= ms;
                } else {
                    vs = expf(s - M[r]);
                }
                S[r] = fmaf(S[r], ms, vs);
            }
            p[0] = M[r];
            p[1] = S[r];
        }
    }
}

void flash_decode_merge(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *pt = dst->src[0];
    const int64_t dv = dst->ne[0], heads = dst->ne[1], stride = 2 + dv;
    float acc[FLASH_MAX_D] __attribute__((aligned(64)));
    for (int64_t h = ith; h < heads; h += nth) {
        float *out = (float *)((char *)dst->data + h * dst->nb[1]);
        if (nth > pt->ne[2]) {
            for (int64_t d = 0; d < dv; d++) out[d] = NAN;
            continue;
        }
        float m = -INFINITY, s = 0.0f;
        memset(acc, 0, dv * sizeof(float));
        const float *base = (const float *)pt->data + h * nth * stride;
        for (int64_t c = 0; c < nth; c++) {
            const float *p = base + c * stride;
            const float mc = p[0], sc = p[1];
            if (sc == 0.0f) continue;
            const float mn = fmaxf(m, mc), f_old = expf(m - mn), f_new = expf(mc - mn);
            for (int64_t d = 0; d < dv; d++) acc[d] = fmaf(acc[d], f_old, p[2 + d] * f_new);
            s = fmaf(s, f_old, sc * f_new);
            m = mn;
        }
        const float inv = s != 0.0f ? 1.0f / s : 0.0f;
        for (int64_t d = 0; d < dv; d++) out[d] = s != 0.0f ? acc[d] * inv : acc[d];
    }
}

// ---- prefill: 64 query rows and more, ggml's tiled path -------------------------------------------------------
// ggml computes each head's tile of 64 query rows against tiles of 64 keys: the keys converted to float32
// (transposed), q.k by a register-blocked GEMM (each product a chain of fused multiply-adds over the head size),
// scale, mask, the online softmax with its vectorized exp, the values converted, p.v by the same GEMM. Here the
// query heads of a key head share each converted key and value tile; every row's arithmetic is ggml's.

#define TILE 64

// ggml_v_expf's arithmetic (AVX-512): exp(x) as 2^n * p(b), b = x - n ln 2 in two parts, p a degree-5 polynomial
static inline __m512 exp_ps(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 lo = _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f));
    const __m512 hi = _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f));
    const __m512 top = _mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f));
    const __m512 j = _mm512_fmadd_ps(_mm512_fmadd_ps(top, u, hi), u, lo);
    const __m512 res = _mm512_scalef_ps(j, n);
    if (_mm512_kortestz(big, big)) return res;
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                            _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(big, res, alt);
}

// c[rows x cols] += a[rows x k] b[k x cols], cols a multiple of 64: each element a chain of fused multiply-adds in
// k's order (ggml's simd_gemm computes each element so, whatever its blocking)
static void gemm(float *c, int ldc, const float *a, int lda, const float *b, int ldb, int rows, int k, int cols) {
    for (int j0 = 0; j0 < cols; j0 += 64) {
        int i = 0;
        for (; i + 4 <= rows; i += 4) {
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_loadu_ps(c + (i + r) * ldc + j0 + 16 * v);
            for (int kk = 0; kk < k; kk++) {
                __m512 bv[4];
                for (int v = 0; v < 4; v++) bv[v] = _mm512_loadu_ps(b + kk * ldb + j0 + 16 * v);
                for (int r = 0; r < 4; r++) {
                    const __m512 p = _mm512_set1_ps(a[(i + r) * lda + kk]);
                    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(bv[v], p, acc[r][v]);
                }
            }
            for (int r = 0; r < 4; r++)
                for (int v = 0; v < 4; v++) _mm512_storeu_ps(c + (i + r) * ldc + j0 + 16 * v, acc[r][v]);
        }
        for (; i < rows; i++) {
            __m512 acc[4];
            for (int v = 0; v < 4; v++) acc[v] = _mm512_loadu_ps(c + i * ldc + j0 + 16 * v);
            for (int kk = 0; kk < k; kk++) {
                const __m512 p = _mm512_set1_ps(a[i * lda + kk]);
                for (int v = 0; v < 4; v++)
                    acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(b + kk * ldb + j0 + 16 * v), p, acc[v]);
            }
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(c + i * ldc + j0 + 16 * v, acc[v]);
        }
    }
}

// dst [Dv, H, N] f32 (ggml's flash-attention output); src q [Dk, N, H] f32, k [Dk, n, G] f16, v [Dv, n, G] f16,
// mask [n, >=N] f16 or none, sinks [H] f32 or none; userdata: the float scale
void flash_prefill(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3],
                             *sinks = dst->src[4];
    const int64_t dk = k->ne[0], dv = v->ne[0], n = k->ne[1], rows = q->ne[1], heads = q->ne[2], groups = k->ne[2];
    const int64_t per = heads / groups, tiles = (rows + TILE - 1) / TILE;
    const float scale = *(const float *)userdata;
    // work units: (key head, tile of rows, part of its query heads), enough of them for every thread, taken in a
    // snake order (a causal mask makes later tiles heavier)
    int64_t parts = 1;
    while (parts < per && groups * tiles * parts < 2 * nth) parts *= 2;
    if (per % parts) parts = 1;
    const int64_t units = groups * tiles * parts, heads_per_part = per / parts;
    const size_t floats = dk * TILE + TILE * dv + 2 * TILE * TILE + heads_per_part * TILE * (dv + 2);
    float *scratch = aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
    if (!scratch) {  // out of memory: NaN, not stale values
        for (int64_t i = 0; i < rows; i++)
            for (int64_t h = ith; h < heads; h += nth) {
                float *out = (float *)((char *)dst->data + (h + i * dst->ne[1]) * dst->nb[1]);
                for (int64_t d = 0; d < dv; d++) out[d] = NAN;
            }
        return;
    }
    float *kt = scratch;                      // a tile of keys, transposed [Dk][64]
    float *vt = kt + dk * TILE;               // its values [64][Dv]
    float *kq = vt + TILE * dv;               // one head's scores, then probabilities [64][64]
    float *mk = kq + TILE * TILE;             // the mask's tile [64][64]
    float *accs = mk + TILE * TILE;           // per query head of the unit: the weighted values [64][Dv]
    float *Ms = accs + heads_per_part * TILE * dv, *Ss = Ms + heads_per_part * TILE;
    for (int64_t step = 0; step * nth < units; step++) {
        const int64_t u = (step & 1) ? (step + 1) * nth - 1 - ith : step * nth + ith;
        if (u >= units) continue;
        const int64_t g = u / (tiles * parts), t = (u / parts) % tiles, part = u % parts;
        const int64_t r0 = t * TILE, tr = rows - r0 < TILE ? rows - r0 : TILE;
        const int64_t h0 = g * per + part * heads_per_part;
        for (int64_t j = 0; j < heads_per_part; j++) {
            memset(accs + j * TILE * dv, 0, TILE * dv * sizeof(float));
            for (int64_t i = 0; i < TILE; i++) Ms[j * TILE + i] = -INFINITY, Ss[j * TILE + i] = 0.0f;
        }
        memset(kt, 0, dk * TILE * sizeof(float));
        memset(vt, 0, TILE * dv * sizeof(float));
        const char *kg = (const char *)k->data + g * k->nb[2], *vg = (const char *)v->data + g * v->nb[2];
        for (int64_t c = 0; c < n; c += TILE) {
            const int64_t kv = n - c < TILE ? n - c : TILE;
            if (mask) {
                int skip = 1;
                for (int64_t i = 0; i < tr; i++) {
                    const f16_t *mr = (const f16_t *)((const char *)mask->data + (r0 + i) * mask->nb[1]);
                    for (int64_t j = 0; j < kv; j++) {
                        const float m = 1.0f * _cvtsh_ss(mr[c + j]);
                        mk[i * TILE + j] = m;
                        if (m != -INFINITY) skip = 0;
                    }
                    for (int64_t j = kv; j < TILE; j++) mk[i * TILE + j] = -INFINITY;
                }
                if (skip) continue;
            }
            for (int64_t j = 0; j < kv; j++) {
                const f16_t *kr = (const f16_t *)(kg + (c + j) * k->nb[1]);
                for (int64_t d = 0; d < dk; d++) kt[d * TILE + j] = _cvtsh_ss(kr[d]);
            }
            for (int64_t j = 0; j < kv; j++) {
                const f16_t *vr = (const f16_t *)(vg + (c + j) * v->nb[1]);
                for (int64_t d = 0; d < dv; d += 16) _mm512_store_ps(vt + j * dv + d, load_f16(vr + d));
            }
            for (int64_t hj = 0; hj < heads_per_part; hj++) {
                const int64_t h = h0 + hj;
                // the head's query rows where they lie (rows nb[1] apart: a multiple of the float's size)
                const float *qh = (const float *)((const char *)q->data + r0 * q->nb[1] + h * q->nb[2]);
                memset(kq, 0, tr * TILE * sizeof(float));
                gemm(kq, TILE, qh, (int)(q->nb[1] / sizeof(float)), kt, TILE, (int)tr, (int)dk, TILE);
                const __m512 sv = _mm512_set1_ps(scale);
                for (int64_t i = 0; i < tr; i++) {
                    float *row = kq + i * TILE;
                    for (int vv = 0; vv < 4; vv++) {
                        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * vv), sv);
                        _mm512_storeu_ps(row + 16 * vv, x);
                    }
                    for (int64_t j = kv; j < TILE; j++) row[j] = -INFINITY;
                    if (mask)
                        for (int vv = 0; vv < 4; vv++)
                            _mm512_storeu_ps(row + 16 * vv, _mm512_add_ps(_mm512_loadu_ps(row + 16 * vv),
                                                                         _mm512_loadu_ps(mk + i * TILE + 16 * vv)));
                    float mx = -INFINITY;
                    for (int64_t j = 0; j < TILE; j++) mx = row[j] > mx ? row[j] : mx;
                    if (mx == -INFINITY) {
                        memset(row, 0, TILE * sizeof(float));
                        continue;
                    }
                    const float m_old = Ms[hj * TILE + i], m_new = fmaxf(m_old, mx);
                    if (m_new > m_old) {
                        const float ms = expf(m_old - m_new);
                        float *a = accs + hj * TILE * dv + i * dv;
                        const __m512 f = _mm512_set1_ps(ms);
                        for (int64_t d = 0; d < dv; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), f));
                        Ss[hj * TILE + i] *= ms;
                    }
                    Ms[hj * TILE + i] = m_new;
                    double sum = 0;
                    for (int vv = 0; vv < 4; vv++) {
                        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * vv), _mm512_set1_ps(m_new)));
                        _mm512_storeu_ps(row + 16 * vv, e);
                        sum += (double)_mm512_reduce_add_ps(e);
                    }
                    Ss[hj * TILE + i] += sum;
                }
                gemm(accs + hj * TILE * dv, (int)dv, kq, TILE, vt, (int)dv, (int)tr, TILE, (int)dv);
            }
        }
        for (int64_t hj = 0; hj < heads_per_part; hj++) {
            const int64_t h = h0 + hj;
            for (int64_t i = 0; i < tr; i++) {
                float *a = accs + hj * TILE * dv + i * dv;
                if (sinks) {
                    const float s = ((const float *)sinks->data)[h];
                    float ms = 1.0f, vs = 1.0f;
                    if (s > Ms[hj * TILE + i]) {
                        ms = expf(Ms[hj * TILE + i] - s);
                        for (int64_t d = 0; d < dv; d++) a[d] *= ms;
                    } else {
                        vs = expf(s - Ms[hj * TILE + i]);
                    }
                    Ss[hj * TILE + i] = fmaf(Ss[hj * TILE + i], ms, vs);
                }
                const float inv = Ss[hj * TILE + i] == 0.0f ? 0.0f : 1.0f / Ss[hj * TILE + i];
                float *out = (float *)((char *)dst->data + (h + (r0 + i) * dst->ne[1]) * dst->nb[1]);
                for (int64_t d = 0; d < dv; d++) out[d] = a[d] * inv;
            }
        }
    }
    free(scratch);
}
