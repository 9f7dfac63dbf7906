/* Writing a step's new K and V into the paged cache on a CPU, float32: the lab's counterpart of vLLM 0.26's
 * reshape_and_cache (csrc/cpu/cache.cpp; called by CPUAttentionBackendImpl.forward in
 * vllm/v1/attention/backends/cpu_attn.py before the attention).
 *
 *   key, value   [T, Hkv, D]    strides k_stride_t, k_stride_h / v_stride_t, v_stride_h (D contiguous): views into
 *                               the q/k/v product's output, written without a copy first
 *   key_cache    [N, bs, Hkv, D] contiguous, seen as num_slots = N·bs slots of Hkv·D values; value_cache the same
 *   slot_mapping [T] int64: token t's slot; -1 (padding) is skipped
 * Returns 0, or 1 + the first token whose slot is outside [-1, num_slots) (nothing written for it or after it).
 * PyTorch's path is two index_copy_ calls plus a check for padding, each its own pass and dispatch per layer.
 */
#include "cpu_vec.h"

int64_t reshape_and_cache_f32(const float *key, int64_t k_stride_t, int64_t k_stride_h, const float *value,
                              int64_t v_stride_t, int64_t v_stride_h, float *key_cache, float *value_cache,
                              const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                              int64_t head_dim, int64_t num_slots) {
    const int64_t row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot == -1) continue;
        if (slot < -1 || slot >= num_slots) return 1 + t;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(key_cache + slot * row + h * head_dim, key + t * k_stride_t + h * k_stride_h,
                   sizeof(float) * (size_t)head_dim);
            memcpy(value_cache + slot * row + h * head_dim, value + t * v_stride_t + h * v_stride_h,
                   sizeof(float) * (size_t)head_dim);
        }
    }
    return 0;
}
