// Routed experts of a MoE layer on the CPU for a few tokens per expert: each expert's quantized blocks are unpacked
// once for all of the tokens routed to it (ggml's mul_mat_id unpacks them once per token below 8 tokens an expert).
//
// The arithmetic is ggml's: activations quantized to Q8_K exactly as quantize_row_q8_K_ref does, integer dot
// products of the K-quant codes with them per sub-block, scaled by the blocks' float16 scales and summed in float32.
// Only the order of the float32 sums differs from ggml's, as between any two of ggml's own SIMD paths.
//
// Built by tandem.quant.moe_kernel (cc -O3 -march=native -fopenmp); the AVX-512 path needs AVX512BW, the portable path
// (plain C) computes the same integers everywhere else.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || (defined(__AVX512BW__) && defined(__AVX512F__))
#include <immintrin.h>
#endif
#if defined(__AVX512BW__) && defined(__AVX512F__)
#define MOE_AVX512 1
#else
#define MOE_AVX512 0
#endif

#define QK 256

typedef uint16_t f16_t;
typedef struct { f16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;    // 144 bytes
typedef struct { f16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_K;  // 176 bytes
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; f16_t d; } block_q6_K;  // 210 bytes
typedef struct { float d; int8_t qs[QK]; int16_t bsums[16]; } block_q8_K;                  // 292 bytes

enum { TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14 };  // ggml_type values

#if defined(__F16C__)
static float f16_to_f32(f16_t h) { return _cvtsh_ss(h); }
#else
static float f16_to_f32(f16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: value man * 2^-24
            float f = (float)man * (1.0f / 16777216.0f);
            return (h & 0x8000) ? -f : f;
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

// ggml's get_scale_min_k4 for all eight sub-blocks at once
static void q4k_scales_mins(const uint8_t *packed, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[4];
    memcpy(u, packed, 12);
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = uaux;
    u[0] &= kmask1;
    memcpy(sc, &u[0], 8);
    memcpy(mn, &u[2], 8);
}

// quantize_row_q8_K_ref, with the bsums of an all-zero block zeroed as well
static void quantize_q8_K(const float *x, block_q8_K *y, int nb) {
    for (int i = 0; i < nb; i++, x += QK) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (!amax) {
            memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK; j++) {
            const int v = (int)lrintf(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int k = 0; k < 16; k++) sum += y[i].qs[j * 16 + k];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

// Up to MAX_TOKENS tokens share one unpacking of a row's blocks; more are taken in groups of that many.
#define MAX_TOKENS 8

#if MOE_AVX512
// A block's 256 unsigned codes (q[j]: codes 64j..64j+63) times a token's 256 Q8_K codes, each pair of 16-bit
// products multiplied by its lane's scale in s[j]: 16 int32 partial sums
static inline __m512i block_dot(const __m512i q[4], const __m512i s[4], const int8_t *y) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i p = _mm512_maddubs_epi16(q[j], _mm512_loadu_si512((const void *)(y + 64 * j)));
        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(p, s[j]));
    }
    return sum;
}
#endif

// dot(row, x[t]) for t < n of one Q4_K (fifth = 0) or Q5_K (fifth = 1: each code's fifth bit in qh) row of nb blocks;
// x[t] points at token t's nb Q8_K blocks. Both blocks are {d, dmin, scales[12], [qh[32],] qs[128]}.
static inline __attribute__((always_inline)) void dot_q45_K(const uint8_t *row, int fifth, int nb,
                                                            const block_q8_K *const *x, int n, float *out) {
    const size_t bsize = fifth ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const size_t qs_at = fifth ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
#if MOE_AVX512
    __m512 acc[MAX_TOKENS];
    __m128 accm[MAX_TOKENS];
    for (int t = 0; t < n; t++) {
        acc[t] = _mm512_setzero_ps();
        accm[t] = _mm_setzero_ps();
    }
    const __m512i low4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(0x01);
    // lane i of a [sub-block 2j: 16 int16 | 2j+1: 16 int16] pair takes scale 2j or 2j+1
    const __m512i pick0 = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i pick[4];
    for (int j = 0; j < 4; j++) pick[j] = _mm512_add_epi16(pick0, _mm512_set1_epi16((short)(2 * j)));
    for (int b = 0; b < nb; b++) {
        const block_q4_K *head = (const block_q4_K *)(row + b * bsize);  // d, dmin and scales lead both types
        const uint8_t *qs = row + b * bsize + qs_at;
        uint8_t sc[8], mn[8];
        q4k_scales_mins(head->scales, sc, mn);
        const __m512i sc16 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)sc)));
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
        __m512i q[4], s[4];
        for (int j = 0; j < 4; j++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
            q[j] = _mm512_and_si512(both, low4);
            if (fifth) {  // bit 2j of qh[l] tops code l of sub-block 2j, bit 2j + 1 code l of sub-block 2j + 1
                const __m256i qh = _mm256_loadu_si256((const __m256i *)((const block_q5_K *)head)->qh);
                const __m256i lo = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j));
                const __m256i hi = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1));
                const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                q[j] = _mm512_or_si512(q[j], _mm512_slli_epi16(_mm512_and_si512(bits, one), 4));
            }
            s[j] = _mm512_permutexvar_epi16(pick[j], sc16);
        }
        const float d = f16_to_f32(head->d), dmin = f16_to_f32(head->dmin);
        for (int t = 0; t < n; t++) {
            const block_q8_K *y = &x[t][b];
            __m512i sum = block_dot(q, s, y->qs);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * y->d), acc[t]);
            // the mins against the sums of the activations' 32-value sub-blocks
            const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            const __m128i bs32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            const __m128i m = _mm_madd_epi16(mn16, bs32);
            accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(dmin * y->d), accm[t]);
        }
    }
    for (int t = 0; t < n; t++) {
        __m128 m = accm[t];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[t] = _mm512_reduce_add_ps(acc[t]) - _mm_cvtss_f32(m);
    }
#else
    float acc[MAX_TOKENS] = {0};
    for (int b = 0; b < nb; b++) {
        const block_q4_K *head = (const block_q4_K *)(row + b * bsize);
        const uint8_t *qs = row + b * bsize + qs_at;
        uint8_t sc[8], mn[8];
        q4k_scales_mins(head->scales, sc, mn);
        uint8_t q[QK];
        for (int j = 0; j < 4; j++) {
            for (int l = 0; l < 32; l++) {
                q[64 * j + l] = qs[32 * j + l] & 0xf;
                q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
                if (fifth) {
                    const uint8_t h = ((const block_q5_K *)head)->qh[l];
                    q[64 * j + l] += ((h >> (2 * j)) & 1) << 4;
                    q[64 * j + 32 + l] += ((h >> (2 * j + 1)) & 1) << 4;
                }
            }
        }
        const float d = f16_to_f32(head->d), dmin = f16_to_f32(head->dmin);
        for (int t = 0; t < n; t++) {
            const block_q8_K *y = &x[t][b];
            int sumi = 0, summ = 0;
            for (int s = 0; s < 8; s++) {
                int dot = 0;
                for (int l = 0; l < 32; l++) dot += q[32 * s + l] * y->qs[32 * s + l];
                sumi += sc[s] * dot;
                summ += mn[s] * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
            }
            acc[t] += d * y->d * (float)sumi - dmin * y->d * (float)summ;
        }
    }
    for (int t = 0; t < n; t++) out[t] = acc[t];
#endif
}

// dot(row, x[t]) for t < n of one Q6_K row of nb blocks
static inline __attribute__((always_inline)) void dot_q6_K(const block_q6_K *w, int nb, const block_q8_K *const *x,
                                                           int n, float *out) {
#if MOE_AVX512
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
    // lane i (int16, two codes each) of a 64-code run takes the scale of its 16 codes
    const __m512i pick = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                          1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int b = 0; b < nb; b++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[b].scales));
        const __m512i sc512 = _mm512_castsi256_si512(sc16);
        __m512i q[4], s[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(w[b].ql + 64 * h));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w[b].qh + 32 * h));
            // codes 0-63 of the half: the low nibbles of ql[0..63] and bits 0-1 (codes 0-31) or 2-3 (32-63) of qh
            const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)),
                                                   _mm256_srli_epi16(qh, 6), 1);
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(h01, two), 4));
            q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                           _mm512_slli_epi16(_mm512_and_si512(h23, two), 4));
            for (int r = 0; r < 2; r++) {
                const int first = 8 * h + 4 * r;  // the run's first scale
                s[2 * h + r] = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16((short)first)), sc512);
            }
        }
        const float d = f16_to_f32(w[b].d);
        for (int t = 0; t < n; t++) {
            const block_q8_K *y = &x[t][b];
            __m512i sum = block_dot(q, s, y->qs);
            // codes are stored +32: subtract 32 * sum(scale * bsum) over the 16 runs of 16
            const __m256i bsum = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)y->bsums));
            sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_slli_epi32(bsum, 5)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * y->d), acc[t]);
        }
    }
    for (int t = 0; t < n; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
#else
    float acc[MAX_TOKENS] = {0};
    for (int b = 0; b < nb; b++) {
        int8_t q[QK];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[b].ql + 64 * h, *qh = w[b].qh + 32 * h;
            int8_t *o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (int8_t)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        const float d = f16_to_f32(w[b].d);
        for (int t = 0; t < n; t++) {
            const block_q8_K *y = &x[t][b];
            int sumi = 0;
            for (int s = 0; s < 16; s++) {
                int dot = 0;
                for (int l = 0; l < 16; l++) dot += q[16 * s + l] * y->qs[16 * s + l];
                sumi += w[b].scales[s] * dot;
            }
            acc[t] += d * y->d * (float)sumi;
        }
    }
    for (int t = 0; t < n; t++) out[t] = acc[t];
#endif
}

// dot products of rows [r0, r1) with N tokens, N a constant in each instance (the accumulators stay in registers)
#define ROWS_DOT(N)                                                                                                  \
    static void rows_dot_##N(int type, const uint8_t *mat, size_t rb, int k, int r0, int r1,                      \
                             const block_q8_K *const *x, float *const *out) {                                        \
        float part[MAX_TOKENS];                                                                                      \
        for (int r = r0; r < r1; r++) {                                                                              \
            if (type == TYPE_Q4_K) {                                                                                 \
                dot_q45_K(mat + r * rb, 0, k / QK, x, N, part);                                                      \
            } else if (type == TYPE_Q5_K) {                                                                          \
                dot_q45_K(mat + r * rb, 1, k / QK, x, N, part);                                                      \
            } else {                                                                                                 \
                dot_q6_K((const block_q6_K *)(mat + r * rb), k / QK, x, N, part);                                   \
            }                                                                                                        \
            for (int t = 0; t < N; t++) out[t][r] = part[t];                                                          \
        }                                                                                                            \
    }
ROWS_DOT(1)
ROWS_DOT(2)
ROWS_DOT(3)
ROWS_DOT(4)
ROWS_DOT(5)
ROWS_DOT(6)
ROWS_DOT(7)
ROWS_DOT(8)

static size_t row_bytes(int type, int k) {
    const size_t block = type == TYPE_Q4_K   ? sizeof(block_q4_K)
                         : type == TYPE_Q5_K ? sizeof(block_q5_K)
                                             : sizeof(block_q6_K);
    return (size_t)(k / QK) * block;
}

// out[t][r] = dot(row r, x[t]) for rows [r0, r1) of a matrix of `type` and tokens t < n <= MAX_TOKENS
static void rows_dot(int type, const uint8_t *mat, int k, int r0, int r1, const block_q8_K *const *x, int n,
                     float *const *out) {
    static void (*const by_count[MAX_TOKENS])(int, const uint8_t *, size_t, int, int, int, const block_q8_K *const *,
                                              float *const *) = {rows_dot_1, rows_dot_2, rows_dot_3, rows_dot_4,
                                                                 rows_dot_5, rows_dot_6, rows_dot_7, rows_dot_8};
    by_count[n - 1](type, mat, row_bytes(type, k), k, r0, r1, x, out);
}

static int moe_experts_supports(int type) { return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K; }

int moe_experts_simd(void) { return MOE_AVX512; }

// Rows of one product per work item: as many as leave each thread ~8 items (dynamic scheduling evens out experts of
// different token counts), at most 256 (a long contiguous read per item: smaller items cost their dispatch and
// shorter streams), at least 32.
static int rows_per_item(size_t total_rows, int n_threads) {
    size_t r = total_rows / (8 * (size_t)(n_threads > 0 ? n_threads : 1));
    r = (r + 31) / 32 * 32;
    return r < 32 ? 32 : r > 256 ? 256 : (int)r;
}

// The working memory moe_experts_swiglu needs for t tokens of a slots each, e experts, sizes k, f, d.
size_t moe_experts_scratch_bytes(int t, int a, int e, int k, int f, int d) {
    const size_t slots = (size_t)t * a;
    return (size_t)t * (k / QK) * sizeof(block_q8_K)  // the tokens, quantized
           + slots * (f / QK) * sizeof(block_q8_K)     // the gated units, quantized
           + slots * (size_t)f * 2 * sizeof(float)     // gate and up outputs
           + slots * (size_t)d * sizeof(float)         // the experts' outputs
           + (slots + 3 * (size_t)e + 1) * sizeof(int32_t)  // the slots grouped by expert, the experts in use
           + 64 * 8;                                         // alignment
}

static void *take(uint8_t **p, size_t n) {
    uint8_t *q = (uint8_t *)(((uintptr_t)*p + 63) & ~(uintptr_t)63);
    *p = q + n;
    return q;
}

// The SwiGLU routed experts of t tokens: out[i] = sum_j weights[i, j] * down_e(silu(gate_e(x_i)) * up_e(x_i)),
// e = ids[i, j] (j < a, e < E). gate and up are (E, F, K) stacks, or one (E, 2F, K) stack `gate_up` with the gate
// rows first (pass it as gate and up = NULL); down is (E, D, F). K and F are multiples of 256. scratch holds
// moe_experts_scratch_bytes(...) bytes (not read before written). Returns 0, or -1 for a type or shape this kernel
// does not take or an expert id out of range.
int moe_experts_swiglu(int t, int a, int e, int k, int f, int d, const void *gate, int gate_type, const void *up,
                       int up_type, const void *down, int down_type, const float *x, const int32_t *ids,
                       const float *weights, float *out, void *scratch, int n_threads) {
    if (!moe_experts_supports(gate_type) || !moe_experts_supports(down_type) || k % QK || f % QK ||
        (up && !moe_experts_supports(up_type)) || t <= 0 || a <= 0 || e <= 0) {
        return -1;
    }
    const int fused = up == NULL;
    if (fused) up_type = gate_type;
    const int slots = t * a;
    uint8_t *p = (uint8_t *)scratch;
    block_q8_K *xq = take(&p, (size_t)t * (k / QK) * sizeof(block_q8_K));
    block_q8_K *hq = take(&p, (size_t)slots * (f / QK) * sizeof(block_q8_K));
    float *gu = take(&p, (size_t)slots * f * 2 * sizeof(float));
    float *y = take(&p, (size_t)slots * d * sizeof(float));
    int32_t *order = take(&p, (size_t)slots * sizeof(int32_t));  // slot numbers, grouped by expert
    int32_t *start = take(&p, (size_t)(e + 1) * sizeof(int32_t));  // expert i's slots: order[start[i]:start[i+1]]
    int32_t *fill = take(&p, (size_t)e * sizeof(int32_t));
    int32_t *active = take(&p, (size_t)e * sizeof(int32_t));  // the experts with slots, in order

    for (int i = 0; i <= e; i++) start[i] = 0;
    for (int s = 0; s < slots; s++) {
        if (ids[s] < 0 || ids[s] >= e) return -1;
        start[ids[s] + 1]++;
    }
    for (int i = 0; i < e; i++) start[i + 1] += start[i];
    memcpy(fill, start, sizeof(int32_t) * (size_t)e);
    for (int s = 0; s < slots; s++) order[fill[ids[s]]++] = s;
    // work items: (expert, block of rows); listed by expert so that consecutive items share a stack's pages
    int n_active = 0;
    for (int i = 0; i < e; i++) {
        if (start[i + 1] > start[i]) active[n_active++] = i;
    }
    const size_t gate_stack = (size_t)(fused ? 2 * f : f) * row_bytes(gate_type, k);
    const size_t up_stack = (size_t)f * row_bytes(up_type, k);
    const size_t down_stack = (size_t)d * row_bytes(down_type, f);
    const int up_rows = rows_per_item((size_t)n_active * 2 * f, n_threads);
    const int down_rows = rows_per_item((size_t)n_active * d, n_threads);
    const int up_items = (f + up_rows - 1) / up_rows;
    const int down_items = (d + down_rows - 1) / down_rows;

#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < t; i++) quantize_q8_K(x + (size_t)i * k, xq + (size_t)i * (k / QK), k / QK);
        // gate and up: item (expert, product, rows) over the expert's tokens, MAX_TOKENS at a time
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_active * up_items * 2; it++) {
            const int ex = active[it / (up_items * 2)], rest = it % (up_items * 2);
            const int which = rest / up_items, r0 = (rest % up_items) * up_rows;
            const int r1 = r0 + up_rows < f ? r0 + up_rows : f;
            const uint8_t *mat = which == 0 ? (const uint8_t *)gate + ex * gate_stack
                                 : fused    ? (const uint8_t *)gate + ex * gate_stack + (size_t)f * row_bytes(gate_type, k)
                                            : (const uint8_t *)up + ex * up_stack;
            const int type = which == 0 ? gate_type : up_type;
            for (int j = start[ex]; j < start[ex + 1]; j += MAX_TOKENS) {
                const int m = start[ex + 1] - j < MAX_TOKENS ? start[ex + 1] - j : MAX_TOKENS;
                const block_q8_K *xs[MAX_TOKENS];
                for (int q = 0; q < m; q++) xs[q] = xq + (size_t)(order[j + q] / a) * (k / QK);
                float *outs[MAX_TOKENS];
                for (int q = 0; q < m; q++) outs[q] = gu + (size_t)order[j + q] * 2 * f + (size_t)which * f;
                rows_dot(type, mat, k, r0, r1, xs, m, outs);
            }
        }
        // the gated unit silu(g) * u, quantized for the down product
#pragma omp for schedule(static)
        for (int s = 0; s < slots; s++) {
            float *g = gu + (size_t)s * 2 * f, *u = g + f;
            for (int i = 0; i < f; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            quantize_q8_K(g, hq + (size_t)s * (f / QK), f / QK);
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_active * down_items; it++) {
            const int ex = active[it / down_items], r0 = (it % down_items) * down_rows;
            const int r1 = r0 + down_rows < d ? r0 + down_rows : d;
            const uint8_t *mat = (const uint8_t *)down + ex * down_stack;
            for (int j = start[ex]; j < start[ex + 1]; j += MAX_TOKENS) {
                const int m = start[ex + 1] - j < MAX_TOKENS ? start[ex + 1] - j : MAX_TOKENS;
                const block_q8_K *hs[MAX_TOKENS];
                for (int q = 0; q < m; q++) hs[q] = hq + (size_t)order[j + q] * (f / QK);
                float *outs[MAX_TOKENS];
                for (int q = 0; q < m; q++) outs[q] = y + (size_t)order[j + q] * d;
                rows_dot(down_type, mat, f, r0, r1, hs, m, outs);
            }
        }
        // the mix: out[t] = sum_a weights[t, a] * y[t, a]
#pragma omp for schedule(static)
        for (int i = 0; i < t; i++) {
            float *o = out + (size_t)i * d;
            for (int c = 0; c < d; c++) o[c] = 0;
            for (int j = 0; j < a; j++) {
                const float w = weights[i * a + j];
                const float *ys = y + ((size_t)i * a + j) * d;
                for (int c = 0; c < d; c++) o[c] += w * ys[c];
            }
        }
    }
    return 0;
}
