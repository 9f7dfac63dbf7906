/* Rotary position embedding on a CPU, float32, in place: the lab's counterpart of vLLM 0.26's rotary_embedding
 * (csrc/cpu/pos_encoding.cpp; RotaryEmbedding.forward_static in vllm/model_executor/layers/rotary_embedding/
 * base.py), neox style (transformers' rotate_half: the two halves of each head).
 *
 *   x    [rows, heads, D]  strides x_stride_t, x_stride_h (elements; D contiguous): q and k heads of the step
 *   cos, sin [rows, D]     row stride cs_stride, transformers' layout cat(freqs, freqs): the first D/2 are read
 *   x1, x2 = the halves of a head:  x1 <- x1·c - x2·s,  x2 <- x2·c + x1·s
 * The same products and sums as transformers' x·cos + rotate_half(x)·sin; a compiler may fuse a product and a sum
 * into one rounding (FMA), so the last bits may differ.
 */
#include "cpu_vec.h"

void rotary_embedding_f32(float *x, int64_t x_stride_t, int64_t x_stride_h, const float *cos, const float *sin,
                          int64_t cs_stride, int64_t rows, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2, h8 = half / 8 * 8;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * cs_stride, *s = sin + r * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * x_stride_t + h * x_stride_h, *x2 = x1 + half;
            int64_t j = 0;
            for (; j < h8; j += 8) {
                const f8v a = load8(x1 + j), b = load8(x2 + j), cj = load8(c + j), sj = load8(s + j);
                store8(x1 + j, a * cj - b * sj);
                store8(x2 + j, b * cj + a * sj);
            }
            for (; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}
