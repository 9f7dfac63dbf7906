/* Decode attention over the paged KV cache on a CPU, float32: the lab's small counterpart of vLLM 0.26's
 * cpu_attention_with_kv_cache (vllm/_custom_ops.py, called by CPUAttentionBackendImpl.forward in
 * vllm/v1/attention/backends/cpu_attn.py; the kernels are C++ in vLLM's csrc/cpu/).
 *
 * Why C: a decode row's attention reads each of its K and V vectors once and does a handful of multiply-adds
 * per byte, so its floor is the machine's read bandwidth. PyTorch can only get there through batched
 * products of tiny matrices (a block's 16 keys against 4 query heads), and those spend more time per matrix
 * than the bytes take to read. This loop walks each row's block table directly: no gather, no padding, no
 * scores spread into a padded row, and a block shared by two rows is simply read twice.
 *
 * Layout (the engine's, pagedkv.engine.attention):
 *   query      [T, Hq, D]      element strides q_stride_t, q_stride_h (the last is 1)
 *   key_cache  [N, bs, Hkv, D] contiguous; value_cache the same
 *   block_tables [B, table_width] int32 (row stride table_stride); seq_lens [B] int32; query_start_loc [B + 1] int32
 *   decode_req_idx [num_decodes] int64: the requests with one new token (at query_start_loc[b])
 *   out        [T, Hq, D]      element strides o_stride_t, o_stride_h
 * Query head h*G + g reads KV head h (G = Hq / Hkv; transformers' repeat_kv order). A sliding window W > 0
 * keeps the keys at positions >= seq_len - W. Returns 0; -1 when its scratch rows cannot be allocated; or 1 + the
 * index of the first decode row whose table is shorter than its seq_len or names a block outside [0, num_blocks)
 * (nothing is read through it; the rows before it are written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 floats as one value (GCC and clang vector extensions: one AVX-512 register, two AVX ones, four NEON
 * ones), so the dot products and P·V updates are vector code whatever the compiler's auto-vectoriser does. */
typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

static inline f16v load16(const float *p) { f16v v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, f16v v) { memcpy(p, &v, sizeof v); }

static inline float hsum16(f16v v) {  /* halves added in a fixed order: the same bits on every run */
    f8v a, b; memcpy(&a, &v, 32); memcpy(&b, (char *)&v + 32, 32); a += b;
    f4v c, d; memcpy(&c, &a, 16); memcpy(&d, (char *)&a + 16, 16); c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* The address of position pos's Hkv·D values in a pool laid out [N, bs, Hkv, D]. */
static inline const float *slot(const float *cache, const int32_t *table, int64_t pos, int64_t block_size,
                                int64_t token_stride) {
    return cache + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * token_stride;
}

/* Ask for the values PREFETCH positions ahead: the next block is anywhere in the pool, where the hardware's own
 * prefetcher, which follows addresses in order, does not look. */
#define PREFETCH 32
static inline void prefetch(const float *p, int64_t floats) {
    for (int64_t c = 0; c < floats; c += 16) __builtin_prefetch(p + c);
}

static inline float dot(const float *a, const float *b, int64_t n) {  /* n a multiple of 16 */
    f16v acc = load16(a) * load16(b);
    for (int64_t i = 16; i < n; i += 16) acc += load16(a + i) * load16(b + i);
    return hsum16(acc);
}

static inline float dot_any(const float *a, const float *b, int64_t n) {  /* any n */
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float p, const float *x, int64_t n, int vec) {  /* y += p·x */
    int64_t i = 0;
    if (vec)
        for (; i < n; i += 16) store16(y + i, load16(y + i) + p * load16(x + i));
    for (; i < n; i++) y[i] += p * x[i];
}

int64_t decode_attention_f32(const float *query, int64_t q_stride_t, int64_t q_stride_h, const float *key_cache,
                             const float *value_cache, int64_t num_blocks, const int32_t *block_tables,
                             int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                             const int32_t *query_start_loc, const int64_t *decode_req_idx, int64_t num_decodes,
                             float *out, int64_t o_stride_t, int64_t o_stride_h, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                             int64_t sliding_window) {
    const int64_t g_size = num_heads / num_kv_heads, d = head_dim, token_stride = num_kv_heads * head_dim;
    const int vec = d % 16 == 0;
    int64_t max_len = 1;
    for (int64_t i = 0; i < num_decodes; i++)
        if (seq_lens[decode_req_idx[i]] > max_len) max_len = seq_lens[decode_req_idx[i]];
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));  /* [Hq, L] */
    float *acc = malloc(sizeof(float) * (size_t)(num_heads * d));           /* [Hq, D] */
    float *row_max = malloc(sizeof(float) * (size_t)num_heads), *row_sum = malloc(sizeof(float) * (size_t)num_heads);
    int64_t status = 0;
    if (!scores || !acc || !row_max || !row_sum) status = -1;
    for (int64_t i = 0; i < num_decodes && status == 0; i++) {
        const int64_t b = decode_req_idx[i], len = seq_lens[b], tok = query_start_loc[b];
        const int64_t start = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0, n = len - start;
        const int32_t *table = block_tables + b * table_stride;
        if ((len + block_size - 1) / block_size > table_width) status = 1 + i;
        for (int64_t t = start / block_size; t * block_size < len && !status; t++)
            if (table[t] < 0 || table[t] >= num_blocks) status = 1 + i;
        if (status) break;
        const float *q = query + tok * q_stride_t;
        for (int64_t h = 0; h < num_heads; h++) row_max[h] = -INFINITY, row_sum[h] = 0.0f;
        /* pass 1: every head's scores against each key, the token's Hkv·D values read once, in order */
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = start + t;
            const float *k = slot(key_cache, table, pos, block_size, token_stride);
            if (t + PREFETCH < n)
                prefetch(slot(key_cache, table, pos + PREFETCH, block_size, token_stride), token_stride);
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = q + h * q_stride_h, *kh = k + (h / g_size) * d;
                const float s = (vec ? dot(qh, kh, d) : dot_any(qh, kh, d)) * scale;
                scores[h * n + t] = s;
                if (s > row_max[h]) row_max[h] = s;
            }
        }
        for (int64_t h = 0; h < num_heads; h++)  /* the softmax's numerators and sums */
            for (int64_t t = 0; t < n; t++) {
                const float p = expf(scores[h * n + t] - row_max[h]);
                scores[h * n + t] = p;
                row_sum[h] += p;
            }
        memset(acc, 0, sizeof(float) * (size_t)(num_heads * d));
        for (int64_t t = 0; t < n; t++) {  /* pass 2: the probabilities times V, the same order */
            const int64_t pos = start + t;
            const float *v = slot(value_cache, table, pos, block_size, token_stride);
            if (t + PREFETCH < n)
                prefetch(slot(value_cache, table, pos + PREFETCH, block_size, token_stride), token_stride);
            for (int64_t h = 0; h < num_heads; h++) axpy(acc + h * d, scores[h * n + t], v + (h / g_size) * d, d, vec);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *o = out + tok * o_stride_t + h * o_stride_h;
            const float inv = 1.0f / row_sum[h];
            for (int64_t j = 0; j < d; j++) o[j] = acc[h * d + j] * inv;
        }
    }
    free(scores), free(acc), free(row_max), free(row_sum);
    return status;
}
