/* Vector helpers shared by the lab's compiled CPU ops (cpu_attention.c, cpu_layernorm.c, cpu_activation.c,
 * cpu_pos_encoding.c): the lab's counterpart of vLLM 0.26's csrc/cpu/cpu_types_x86.hpp (FP32Vec8/FP32Vec16).
 *
 * f8v is 8 floats as one value (GCC and clang vector extensions): one AVX register, two SSE or NEON ones. Every
 * op is written with it, so the code is vector code whatever the auto-vectoriser does, and the same source
 * builds with -march=native or without it. Only the transposed sum of eight vectors (reduce8) has an AVX
 * version of its own; the portable one adds the same lanes in a fixed order too.
 */
#ifndef PAGEDKV_CPU_VEC_H
#define PAGEDKV_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float f8v __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

static inline f8v load8(const float *p) { f8v v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, f8v v) { memcpy(p, &v, sizeof v); }
static inline f8v splat8(float x) { return (f8v){x, x, x, x, x, x, x, x}; }
static inline f8v max8(f8v a, f8v b) { i8v m = a > b; return (f8v)((m & (i8v)a) | (~m & (i8v)b)); }

static inline float hmax8(f8v v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum8(f8v v) {  /* lanes added in a fixed order: the same bits on every run */
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* The eight lane sums of a[0..7], as one vector: out[j] = sum of a[j]'s lanes. The dot products of eight keys,
 * each accumulated lane-wise, become eight scores with a handful of shuffles instead of eight horizontal sums. */
static inline f8v reduce8(const f8v a[8]) {
#if defined(__AVX__)
    __m256 h0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), h1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 h2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), h3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);  /* [a0..a3 | a4..a7] per 128-bit half */
    return (f8v)_mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
#else
    f8v out;
    for (int j = 0; j < 8; j++) out[j] = hsum8(a[j]);
    return out;
#endif
}

/* exp(x), 8 lanes: Cephes' expf (x = n·ln2 + r, |r| <= ln2/2, a polynomial in r, times 2^n); relative error
 * below 2e-7 (1-2 ulp; the float64 tests check it). Below -87 (where exp(x) < 1.7e-38) it returns 0; above
 * 88.72 (past FLT_MAX) a value that overflows to +inf or stays just below FLT_MAX; -inf gives 0. The softmax and
 * SiLU of the lab's kernels use it: libm's scalar expf, called once per value, costs more than the score's
 * multiply-adds. With AVX2 and FMA the clamps and the floor are single instructions; the portable version does
 * the same arithmetic with compares and masks. */
static inline f8v exp8(f8v x) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 xv = (__m256)x;
    const __m256 under = _mm256_cmp_ps(xv, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(xv, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.72283f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_set1_ps(2.0f));
    return (f8v)_mm256_andnot_ps(under, y);  /* 2^(n-1) · 2: a normal float for every n in [-125, 128] */
#else
    const f8v lo = splat8(-87.0f), hi = splat8(88.72283f);
    const i8v under = x < lo, over = x > hi;
    x = max8(x, lo);
    x = -max8(-x, -hi);  /* min(x, hi) */
    const f8v t = x * splat8(1.44269504088896341f) + splat8(0.5f);
    f8v n = __builtin_convertvector(__builtin_convertvector(t, i8v), f8v);  /* truncated */
    n -= (f8v)((i8v)splat8(1.0f) & (n > t));  /* floor(t): n in [-125, 128] */
    const f8v r = x - n * splat8(0.693359375f) - n * splat8(-2.12194440e-4f);
    f8v p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * (r * r) + r + splat8(1.0f);
    const i8v bits = (__builtin_convertvector(n, i8v) + 126) << 23;  /* 2^(n-1), a normal float for every n */
    f8v scale;
    memcpy(&scale, &bits, sizeof scale);
    f8v y = p * scale * splat8(2.0f);
    y = (f8v)((i8v)y & ~under);
    return (f8v)(((i8v)y & ~over) | ((i8v)splat8(INFINITY) & over));
#endif
}

#endif
