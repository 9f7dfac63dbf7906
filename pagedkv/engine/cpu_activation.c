/* SiLU-and-multiply on a CPU, float32: the lab's counterpart of vLLM 0.26's silu_and_mul (csrc/cpu/activation.cpp;
 * SiluAndMul in vllm/model_executor/layers/activation.py).
 *
 *   x    [rows, 2·inter]  row stride x_stride: [gate | up], the output of the fused gate/up product
 *   out  [rows, inter]    row stride o_stride:  gate / (1 + exp(-gate)) · up
 * One pass, eight values at a time with exp8 (cpu_vec.h); PyTorch reads the strided gate half through its slow
 * path, then makes a second pass for the product.
 */
#include "cpu_vec.h"

void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t o_stride, int64_t rows, int64_t inter) {
    const int64_t i8 = inter / 8 * 8;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + inter;
        float *o = out + r * o_stride;
        int64_t j = 0;
        for (; j < i8; j += 8) {
            const f8v g = load8(gate + j);
            store8(o + j, g / (splat8(1.0f) + exp8(-g)) * load8(up + j));
        }
        for (; j < inter; j++) o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}
