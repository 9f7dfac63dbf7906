/* Paged attention on a CPU, float32, decode rows and prefill chunks alike: the lab's small counterpart of vLLM
 * 0.26's cpu_attention_with_kv_cache (vllm/_custom_ops.py, called by CPUAttentionBackendImpl.forward in
 * vllm/v1/attention/backends/cpu_attn.py; the kernels are C++ in vLLM's csrc/cpu/).
 *
 * Why C: a decode row's attention reads each of its K and V vectors once and does a handful of multiply-adds
 * per byte, so its floor is the machine's read bandwidth. PyTorch can only get there through batched products
 * of tiny matrices (a block's 16 keys against 4 query heads), and those spend more time per matrix than the
 * bytes take to read. This loop walks each request's block table directly: no gather, no padding, no mask; a
 * block shared by two requests is simply read twice. A prefill chunk is the same loop, once per query token,
 * over the keys up to its own position (causal), so one kernel serves every row of a mixed step.
 *
 * How a row is computed (each of the Hq heads; query head h*G + g reads KV head h, transformers' repeat_kv):
 *   1. scores, eight keys at a time: each key's K row (all its heads, contiguous) is read once into the cache
 *      and every head's dot product with it accumulated lane-wise; reduce8 turns eight accumulators into eight
 *      scores. The query heads that share a KV head (grouped-query attention: G = Hq / Hkv) go two at a time
 *      (qk4_pair): each K vector loaded once serves both heads' multiply-adds, four keys by two heads in the
 *      eight accumulators; a head without a partner goes alone (qk8);
 *   2. the softmax's numerators with exp8 (cpu_vec.h), eight scores at a time, and their sums;
 *   3. P·V, sixteen positions at a time, two heads' 32 output values each held in eight registers (pv_pair; one
 *      load of each V vector for both when the two heads share their KV head, pv_pair_shared).
 * Every score and output is summed in the same order whichever of these computes it: the same bits.
 * Each position's offset in the pool is computed once per request (one division per request, not per key), and
 * each head's KV offset once per call. The inner loops are functions of their own (noinline): inlined into one
 * large function they ran short of registers and spilled their pointers to the stack on every key.
 *
 * Memory: decode attention waits on its K and V, which the rest of the step (other layers' K and V, the weights)
 * has pushed out of the caches, in 16-position blocks anywhere in the pool. Within a block a position's K row
 * (Hkv·D floats) follows the previous one, so the hardware prefetcher streams a block once it has seen its first
 * lines; what it cannot guess is where the next block lies. So the kernel asks for one line of each row PREFETCH
 * positions ahead (K in pass 1, then the first V rows; V in pass 3): the start of every block early, the rest left
 * to the hardware. An earlier version asked for every line of every row, and for the next request's
 * rows as well (a cursor walking its table): on an Intel Xeon (Sapphire Rapids, 2 cores, 300 MiB L3) those
 * prefetch instructions and the cursor's bookkeeping took more time than the waits they saved (a decode step's
 * four layers, 64 rows of 20-263 positions: 2.05 ms with them, 1.58 ms with one line per row; 0.93 ms with every
 * K and V already in the core's L2 cache, so the arithmetic, not the memory, is most of it). A prefill chunk's
 * later rows re-read keys the first row brought in: no prefetch.

 * Layout (the engine's, pagedkv.engine.attention):
 *   query      [T, Hq, D]      element strides q_stride_t, q_stride_h (the last is 1)
 *   key_cache  [N, bs, Hkv, D] contiguous; value_cache the same
 *   block_tables [B, table_width] int32 (row stride table_stride); seq_lens [B] int32; query_start_loc [B + 1] int32
 *   req_idx    [num_reqs] int64: the requests to attend; request b's query tokens are query_start_loc[b] ..
 *              query_start_loc[b + 1] - 1, the last q_len of its seq_len positions
 *   out        [T, Hq, D]      element strides o_stride_t, o_stride_h (only the listed requests' rows written)
 * A sliding window W > 0 keeps, for the query at position p, the keys at positions > p - W. Returns 0; -1 when its
 * scratch rows cannot be allocated; or 1 + the index (in req_idx) of the first request whose table is shorter
 * than its seq_len, names a block outside [0, num_blocks), or has more query tokens than positions (nothing is
 * read through it; the requests before it are written).
 */
#include <stdlib.h>

#include "cpu_vec.h"

#ifndef PREFETCH
#define PREFETCH 32  /* positions ahead (16 and 32 measured alike, 64 a little slower) */
#endif

typedef struct {
    int64_t num_heads, head_dim, token_stride;  /* token_stride = Hkv·D: one position's K (or V) */
    const int64_t *kv;                          /* [Hq]: query head h's KV head's offset in a row, (h / G)·D */
    float scale;
} Shape;


static inline float dot_any(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One head's scores against eight keys: eight lane-wise dot products, then their sums in one vector (reduce8).
 * Kept out of line, as the other inner loops: inlined into one large function they ran short of registers. */
static __attribute__((noinline)) void qk8(const float *qh, const float *const kp[8], int64_t kv, int64_t d,
                                          float scale, float *row) {
    f8v acc[8], qv = load8(qh);
    for (int j = 0; j < 8; j++) acc[j] = qv * load8(kp[j] + kv);
    for (int64_t c = 8; c < d; c += 8) {
        qv = load8(qh + c);
        for (int j = 0; j < 8; j++) acc[j] += qv * load8(kp[j] + kv + c);
    }
    store8(row, reduce8(acc) * splat8(scale));
}

/* Two query heads that read the same KV head (qh0, qh1), four keys: acc[j] is head 0's lane-wise dot product with
 * key j, acc[4 + j] head 1's, so each K vector is loaded once for two multiply-adds. reduce8 sums each accumulator
 * as qk8 does (the same bits); its lanes 0-3 are head 0's four scores, 4-7 head 1's. */
static __attribute__((noinline)) void qk4_pair(const float *qh0, const float *qh1, const float *const kp[4], int64_t kv,
                                               int64_t d, float scale, float *row0, float *row1) {
    f8v acc[8];
    f8v q0 = load8(qh0), q1 = load8(qh1);
    for (int j = 0; j < 4; j++) {
        const f8v k = load8(kp[j] + kv);
        acc[j] = q0 * k, acc[4 + j] = q1 * k;
    }
    for (int64_t c = 8; c < d; c += 8) {
        q0 = load8(qh0 + c), q1 = load8(qh1 + c);
        for (int j = 0; j < 4; j++) {
            const f8v k = load8(kp[j] + kv + c);
            acc[j] += q0 * k, acc[4 + j] += q1 * k;
        }
    }
    const f8v r = reduce8(acc) * splat8(scale);
    for (int j = 0; j < 4; j++) row0[j] = r[j], row1[j] = r[4 + j];
}

/* Pass 1: scores[head][t] for t < n (padded to a multiple of 8 with -inf), every head. */
static void row_scores(const float *q, int64_t q_stride_h, const float *kc, const float *vc, const int64_t *offs,
                       int64_t n, int64_t n_pad, int64_t ahead, const Shape *s, float *scores) {
    const int64_t d = s->head_dim, vec = d % 8 == 0;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const float *kp[8];
        for (int j = 0; j < 8; j++) kp[j] = kc + offs[t0 + j < n ? t0 + j : n - 1];
        for (int64_t u = t0 + PREFETCH; u < t0 + PREFETCH + 8 && u < ahead; u++)  /* K rows ahead, then V's first */
            __builtin_prefetch(u < n ? kc + offs[u] : vc + offs[u - n]);
        for (int64_t head = 0; head < s->num_heads;) {
            const float *qh = q + head * q_stride_h;
            float *row = scores + head * n_pad + t0;
            if (vec && head + 1 < s->num_heads && s->kv[head + 1] == s->kv[head]) {  /* two heads, one KV head */
                float *row1 = row + n_pad;
                qk4_pair(qh, qh + q_stride_h, kp, s->kv[head], d, s->scale, row, row1);
                qk4_pair(qh, qh + q_stride_h, kp + 4, s->kv[head], d, s->scale, row + 4, row1 + 4);
                head += 2;
                continue;
            }
            if (vec)
                qk8(qh, kp, s->kv[head], d, s->scale, row);
            else
                for (int j = 0; j < 8; j++) row[j] = dot_any(qh, kp[j] + s->kv[head], d) * s->scale;
            head++;
        }
    }
    for (int64_t head = 0; head < s->num_heads; head++)
        for (int64_t t = n; t < n_pad; t++) scores[head * n_pad + t] = -INFINITY;
}

/* Pass 2: scores -> exp(score - max) in place (the padding -> 0); returns nothing, writes each head's sum. */
static void row_softmax(float *scores, int64_t n_pad, int64_t num_heads, float *sums) {
    for (int64_t head = 0; head < num_heads; head++) {
        float *row = scores + head * n_pad;
        f8v m = load8(row);
        for (int64_t t = 8; t < n_pad; t += 8) m = max8(m, load8(row + t));
        const f8v mx = splat8(hmax8(m));
        f8v sum = splat8(0.0f);
        for (int64_t t = 0; t < n_pad; t += 8) {
            const f8v p = exp8(load8(row + t) - mx);
            store8(row + t, p);
            sum += p;
        }
        sums[head] = hsum8(sum);
    }
}

/* acc[0..d) += sum over t < nt of p[t] · (vp[t] + kv)[0..d), eight values at a time (d a multiple of 8). */
static __attribute__((noinline)) void pv_one(float *acc, const float *p, const float *const *vp, int64_t nt,
                                             int64_t kv, int64_t d) {
    for (int64_t c = 0; c + 8 <= d; c += 8) {
        f8v a0 = load8(acc + c);
        for (int64_t t = 0; t < nt; t++) a0 += splat8(p[t]) * load8(vp[t] + kv + c);
        store8(acc + c, a0);
    }
}

/* The same for two heads at once, 32 values each: eight accumulators, so the multiply-adds of one position do not
 * wait for the previous position's (four would: one chain per register, each add waiting for the last). */
static __attribute__((noinline)) void pv_pair(float *acc0, float *acc1, const float *p0, const float *p1,
                                              const float *const *vp, int64_t nt, int64_t kv0, int64_t kv1, int64_t d) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) {
        f8v a0 = load8(acc0 + c), a1 = load8(acc0 + c + 8), a2 = load8(acc0 + c + 16), a3 = load8(acc0 + c + 24);
        f8v b0 = load8(acc1 + c), b1 = load8(acc1 + c + 8), b2 = load8(acc1 + c + 16), b3 = load8(acc1 + c + 24);
        for (int64_t t = 0; t < nt; t++) {
            const float *v0 = vp[t] + kv0 + c, *v1 = vp[t] + kv1 + c;
            const f8v q0 = splat8(p0[t]), q1 = splat8(p1[t]);
            a0 += q0 * load8(v0), a1 += q0 * load8(v0 + 8), a2 += q0 * load8(v0 + 16), a3 += q0 * load8(v0 + 24);
            b0 += q1 * load8(v1), b1 += q1 * load8(v1 + 8), b2 += q1 * load8(v1 + 16), b3 += q1 * load8(v1 + 24);
        }
        store8(acc0 + c, a0), store8(acc0 + c + 8, a1), store8(acc0 + c + 16, a2), store8(acc0 + c + 24, a3);
        store8(acc1 + c, b0), store8(acc1 + c + 8, b1), store8(acc1 + c + 16, b2), store8(acc1 + c + 24, b3);
    }
    if (c < d) {
        pv_one(acc0 + c, p0, vp, nt, kv0 + c, d - c);
        pv_one(acc1 + c, p1, vp, nt, kv1 + c, d - c);
    }
}

/* pv_pair for two heads that read the same KV head: each V vector loaded once for both (the same sums in the
 * same order as pv_pair's). */
static __attribute__((noinline)) void pv_pair_shared(float *acc0, float *acc1, const float *p0, const float *p1,
                                                     const float *const *vp, int64_t nt, int64_t kv, int64_t d) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) {
        f8v a0 = load8(acc0 + c), a1 = load8(acc0 + c + 8), a2 = load8(acc0 + c + 16), a3 = load8(acc0 + c + 24);
        f8v b0 = load8(acc1 + c), b1 = load8(acc1 + c + 8), b2 = load8(acc1 + c + 16), b3 = load8(acc1 + c + 24);
        for (int64_t t = 0; t < nt; t++) {
            const float *v = vp[t] + kv + c;
            const f8v q0 = splat8(p0[t]), q1 = splat8(p1[t]);
            const f8v v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
            a0 += q0 * v0, a1 += q0 * v1, a2 += q0 * v2, a3 += q0 * v3;
            b0 += q1 * v0, b1 += q1 * v1, b2 += q1 * v2, b3 += q1 * v3;
        }
        store8(acc0 + c, a0), store8(acc0 + c + 8, a1), store8(acc0 + c + 16, a2), store8(acc0 + c + 24, a3);
        store8(acc1 + c, b0), store8(acc1 + c + 8, b1), store8(acc1 + c + 16, b2), store8(acc1 + c + 24, b3);
    }
    if (c < d) {
        pv_one(acc0 + c, p0, vp, nt, kv + c, d - c);
        pv_one(acc1 + c, p1, vp, nt, kv + c, d - c);
    }
}

/* Pass 3: out[head] = sum_t p[head][t] · V_t / sums[head], sixteen positions at a time, heads in pairs. */
static void row_pv(const float *vc, const int64_t *offs, int64_t n, int64_t n_pad, int64_t ahead, const Shape *s,
                   const float *probs, const float *sums, float *acc, float *out, int64_t o_stride_h) {
    const int64_t d = s->head_dim, hq = s->num_heads;
    memset(acc, 0, sizeof(float) * (size_t)(hq * d));
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t nt = t0 + 16 < n ? 16 : n - t0;
        const float *vp[16];
        for (int64_t t = 0; t < nt; t++) vp[t] = vc + offs[t0 + t];
        for (int64_t t = t0 + PREFETCH; t < t0 + nt + PREFETCH && t < ahead; t++) __builtin_prefetch(vc + offs[t]);
        if (d % 8 == 0) {
            int64_t head = 0;
            for (; head + 2 <= hq; head += 2) {
                float *a0 = acc + head * d, *a1 = a0 + d;
                const float *p0 = probs + head * n_pad + t0, *p1 = p0 + n_pad;
                if (s->kv[head] == s->kv[head + 1])
                    pv_pair_shared(a0, a1, p0, p1, vp, nt, s->kv[head], d);
                else
                    pv_pair(a0, a1, p0, p1, vp, nt, s->kv[head], s->kv[head + 1], d);
            }
            if (head < hq) pv_one(acc + head * d, probs + head * n_pad + t0, vp, nt, s->kv[head], d);
        } else {
            for (int64_t head = 0; head < hq; head++) {
                const float *p = probs + head * n_pad + t0;
                for (int64_t c = 0; c < d; c++)
                    for (int64_t t = 0; t < nt; t++) acc[head * d + c] += p[t] * vp[t][s->kv[head] + c];
            }
        }
    }
    for (int64_t head = 0; head < hq; head++)
        for (int64_t j = 0; j < d; j++) out[head * o_stride_h + j] = acc[head * d + j] / sums[head];
}

int64_t paged_attention_f32(const float *query, int64_t q_stride_t, int64_t q_stride_h, const float *key_cache,
                            const float *value_cache, int64_t num_blocks, const int32_t *block_tables,
                            int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                            const int32_t *query_start_loc, const int64_t *req_idx, int64_t num_reqs, float *out,
                            int64_t o_stride_t, int64_t o_stride_h, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int64_t sliding_window) {
    int64_t *kv = malloc(sizeof(int64_t) * (size_t)num_heads);
    if (kv)
        for (int64_t h = 0; h < num_heads; h++) kv[h] = h / (num_heads / num_kv_heads) * head_dim;
    const Shape s = {num_heads, head_dim, num_kv_heads * head_dim, kv, scale};
    int64_t max_len = 8;
    for (int64_t i = 0; i < num_reqs; i++)
        if (seq_lens[req_idx[i]] > max_len) max_len = seq_lens[req_idx[i]];
    const int64_t max_pad = (max_len + 7) / 8 * 8;
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_pad));  /* [Hq, n_pad] */
    float *acc = malloc(sizeof(float) * (size_t)(num_heads * head_dim));    /* [Hq, D] */
    float *sums = malloc(sizeof(float) * (size_t)num_heads);
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)(max_pad + 8));        /* each position's offset in the pool */
    int64_t status = 0;
    if (!scores || !acc || !sums || !offs || !kv) status = -1;
    for (int64_t i = 0; i < num_reqs && status == 0; i++) {
        const int64_t b = req_idx[i], len = seq_lens[b], tok0 = query_start_loc[b];
        const int64_t q_len = query_start_loc[b + 1] - tok0;
        /* the first position any of its rows reads: its first query's window start */
        const int64_t first = sliding_window > 0 && len - q_len + 1 > sliding_window ? len - q_len + 1 - sliding_window : 0;
        const int32_t *table = block_tables + b * table_stride;
        if (q_len < 1 || q_len > len || (len + block_size - 1) / block_size > table_width) status = 1 + i;
        for (int64_t t = first / block_size; t * block_size < len && !status; t++)
            if (table[t] < 0 || table[t] >= num_blocks) status = 1 + i;
        if (status) break;
        for (int64_t pos = first, blk = first / block_size, in = first % block_size; pos < len; pos++) {
            offs[pos - first] = ((int64_t)table[blk] * block_size + in) * s.token_stride;
            if (++in == block_size) in = 0, blk++;
        }
        for (int64_t j = 0; j < q_len; j++) {
            const int64_t pos = len - q_len + j;  /* the query's position: it sees keys start .. pos */
            const int64_t start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
            const int64_t n = pos + 1 - start, n_pad = (n + 7) / 8 * 8;
            const int64_t *o = offs + (start - first);
            /* the first row reads the keys cached before this step: ask for them ahead; the later rows of a chunk
             * read them again, and this step's own, from the core's caches */
            const int64_t ahead = j == 0 ? n : 0;
            row_scores(query + (tok0 + j) * q_stride_t, q_stride_h, key_cache, value_cache, o, n, n_pad, 2 * ahead, &s,
                       scores);
            row_softmax(scores, n_pad, num_heads, sums);
            row_pv(value_cache, o, n, n_pad, ahead, &s, scores, sums, acc, out + (tok0 + j) * o_stride_t, o_stride_h);
        }
    }
    free(scores), free(acc), free(sums), free(offs), free(kv);
    return status;
}
