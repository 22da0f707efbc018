// One query row per head over an f16 cache (a decode step's attention on the CPU), bit for bit ggml's FLASH_ATTN_EXT
// as llama.cpp's x86 builds without AVX512-FP16 arithmetic compute it on that shape (512 keys and more: ggml's
// split-KV path, one chunk of keys per thread, the chunks' partial sums merged in thread order).
//
// ggml walks the keys once per query head; here the heads that share a key head (GQA) walk them together, so each
// key and value row is converted from f16 once for all of them instead of once a head. Every head's arithmetic is
// ggml's, in its order: the f16-rounded query, the dot product's four float32 accumulators and their reduction, the
// online softmax with glibc's expf, the f16 accumulator of the weighted values (each update rounded to f16), the
// fused multiply-adds ggml's compiled code makes of `S = S*ms + vs` and of the merge.
//
// Two graph nodes (custom ops; ggml's barrier between nodes stands for the one inside its kernel):
//   flash_decode_partials: dst [2 + Dv, H, capacity] f32 of (M, S, values) per head and chunk;
//       src q [Dk, 1, H] f32, k [Dk, n, G] f16, v [Dv, n, G] f16, mask [n, >=1] f16 or none, sinks [H] f32 or none
//   flash_decode_merge: dst [Dv, H, 1] f32; src: the partials
// userdata: the float attention scale. Requires AVX-512F, Dk and Dv multiples of 64 (no leftover lanes) up to
// FLASH_MAX_D, H / G up to FLASH_MAX_GROUP: the Python side (quant/flash_decode.py) checks before it builds a node.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define FLASH_MAX_D 512
#define FLASH_MAX_GROUP 32

// ggml 0.25.3's tensor header (ggml.h); quant/flash_decode.py checks the offsets against ggml-python's at load
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

size_t flash_decode_offset(int field) {
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
