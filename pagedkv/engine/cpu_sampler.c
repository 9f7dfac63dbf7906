/* Greedy sampling on a CPU, float32: the index of each row's largest logit. vLLM 0.26's Sampler.greedy_sample
 * (vllm/v1/sample/sampler.py) is logits.argmax(dim=-1); on a CPU at a decode step's 64 rows of a 4,096-token
 * vocabulary PyTorch's reduction costs about 0.3 ms a step, ten times this loop.
 *
 *   logits  [rows, vocab]  row stride l_stride (elements; the last dim contiguous)
 *   out     [rows] int64:  the lowest index of the row's maximum, as torch.argmax; a row holding NaN gives its
 *                          first NaN (PyTorch's max treats NaN as larger than any number)
 * Eight running maxima per row, one per lane, each with the first index it was seen at; the lanes are then
 * compared in index order, so ties go to the lowest index whatever lane holds them.
 */
#include "cpu_vec.h"

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t j = 0; j < n; j++) {
        if (x[j] != x[j]) return j;  /* NaN */
        if (x[j] > x[best]) best = j;
    }
    return best;
}

void argmax_rows_f32(const float *logits, int64_t l_stride, int64_t rows, int64_t vocab, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * l_stride;
        if (vocab < 64) {
            out[r] = argmax_row(x, vocab);
            continue;
        }
        const int64_t n8 = vocab / 8 * 8;
        f8v best = load8(x);
        i8v nan = best != best;
        i8v where = {0, 1, 2, 3, 4, 5, 6, 7};
        const i8v step = {8, 8, 8, 8, 8, 8, 8, 8};
        i8v at = where;
        for (int64_t j = 8; j < n8; j += 8) {
            const f8v v = load8(x + j);
            at += step;
            const i8v gt = v > best;  /* strictly larger: an equal value later keeps the earlier index */
            best = (f8v)((gt & (i8v)v) | (~gt & (i8v)best));
            where = (gt & at) | (~gt & where);
            nan |= v != v;
        }
        int64_t arg = where[0];
        float top = best[0];
        for (int k = 1; k < 8; k++)
            if (best[k] > top || (best[k] == top && where[k] < arg)) top = best[k], arg = where[k];
        int any_nan = 0;
        for (int k = 0; k < 8; k++) any_nan |= nan[k] != 0;
        for (int64_t j = n8; j < vocab; j++) {
            any_nan |= x[j] != x[j];
            if (x[j] > top) top = x[j], arg = j;
        }
        out[r] = any_nan ? argmax_row(x, vocab) : arg;  /* NaN: the scalar walk finds the first one */
    }
}
