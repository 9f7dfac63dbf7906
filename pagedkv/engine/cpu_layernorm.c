/* RMSNorm on a CPU, float32, with the residual add fused in: the lab's counterpart of vLLM 0.26's rms_norm and
 * fused_add_rms_norm (csrc/cpu/layernorm.cpp; RMSNorm.forward_native in vllm/model_executor/layers/layernorm.py
 * is the same arithmetic in PyTorch).
 *
 * One pass per row: the residual add, its sum of squares (eight lanes, added in a fixed order), then the scaled
 * row. In PyTorch the same is five or six operations, each a pass over the step's [T, H] activations and a new
 * tensor; at the engine's decode steps (64 rows of 256) each costs more in dispatch than in arithmetic.
 *
 *   x, residual, out  [rows, hidden]  row strides x_stride, r_stride, o_stride (elements; the last dim contiguous)
 *   out = weight * (s * 1/sqrt(mean(s^2) + eps)),  s = x + residual (written into residual), or s = x when residual
 *   is NULL (the first layer's input norm). out may be x itself (each row is read whole before it is written),
 *   not residual's row when residual is NULL. transformers' LlamaRMSNorm computes the same in float32; the sum of
 *   squares is added in another order, so the last bits may differ.
 */
#include "cpu_vec.h"

void fused_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t r_stride, const float *weight,
                            float eps, float *out, int64_t o_stride, int64_t rows, int64_t hidden) {
    const int64_t h8 = hidden / 8 * 8;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *s = residual ? residual + r * r_stride : xr;
        float *o = out + r * o_stride;
        f8v acc = splat8(0.0f);
        float tail = 0.0f;
        int64_t j = 0;
        for (; j < h8; j += 8) {
            f8v v = load8(xr + j);
            if (residual) v += load8(s + j), store8(residual + r * r_stride + j, v);
            acc += v * v;
        }
        for (; j < hidden; j++) {
            float v = xr[j];
            if (residual) v += s[j], residual[r * r_stride + j] = v;
            tail += v * v;
        }
        const float inv = 1.0f / sqrtf((hsum8(acc) + tail) / (float)hidden + eps);
        const f8v inv8 = splat8(inv);
        for (j = 0; j < h8; j += 8) store8(o + j, load8(weight + j) * (load8(s + j) * inv8));
        for (; j < hidden; j++) o[j] = weight[j] * (s[j] * inv);
    }
}
