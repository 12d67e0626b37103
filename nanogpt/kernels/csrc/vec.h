// The vector registers the project's kernels are written with (gemv.cpp,
// decode_attention.cpp): GCC's vector extensions at the width the build targets (AVX-512: 16
// floats, AVX2: 8), float32 and bfloat16 loads into float32 lanes, and a horizontal sum.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>

namespace nanoserve {

#if defined(__AVX512F__)
constexpr int L = 16;  // floats in a vector register
#else
constexpr int L = 8;
#endif

typedef float vf __attribute__((vector_size(L * 4)));
typedef uint16_t vh __attribute__((vector_size(L * 2)));
typedef uint32_t vu __attribute__((vector_size(L * 4)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }

inline vf load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  vh h; std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof v); return v;
}

inline float scalar(float v) { return v; }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(vf v) {  // in a tree: a chain of L additions would take longer than the dot
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(reinterpret_cast<__m256>(v)),
                        _mm256_extractf128_ps(reinterpret_cast<__m256>(v), 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

typedef int32_t vi __attribute__((vector_size(L * 4)));

inline bool any(vi mask) {  // whether a lane of a comparison's result is true
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(mask), reinterpret_cast<__m512i>(mask)) != 0;
#else
  return _mm256_movemask_ps(reinterpret_cast<__m256>(mask)) != 0;
#endif
}

// The largest of p[0..n), NaN where one of them is (as torch's max): in vectors, the last few one at a time.
inline bool above(float x, float top) { return x > top || x != x; }

inline float max_of(const float* p, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vf tops = vf{} + lowest;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const vf v = load(p + i);
    tops = (v > tops) | (v != v) ? v : tops;
  }
  float top = lowest;
  for (int l = 0; l < L; ++l) top = above(tops[l], top) ? tops[l] : top;
  for (; i < n; ++i) top = above(p[i], top) ? p[i] : top;
  return top;
}

// e^x in every lane, as Cephes' expf computes it (x = n ln 2 + r with |r| <= ln 2 / 2, a degree-5
// polynomial for e^r, 2^n put into the exponent bits; within ~2 ulp). The standard library has no
// vector exp, and one call per lane would cost more than the rest of a GELU.
inline vf exp(vf x) {
  x = x < -87.33654f ? vf{} - 87.33654f : x;  // e^x stays a normal float: no 2^n below 2^-126
  x = x > 88.72283f ? vf{} + 88.72283f : x;
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);  // truncated: floor(fx) for fx >= 0,
  vf fn = __builtin_convertvector(n, vf);
  vi above = fn > fx;                      // one too many where fx < 0 was not whole
  n += above;                              // (true is -1)
  fn = __builtin_convertvector(n, vf);
  vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * r * r + r + 1.0f;
  vi bits = (n + 127) << 23;
  vf scale; std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// GPT-2's GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3): one float as written,
inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// and a vector of them as x / (1 + e^(-2u)): the same function with an exp, which costs less than a tanh
inline vf gelu_tanh(vf x) {
  vf u = x * (0.7978845608028654f + 0.0356774081363001f * x * x);
  return x / (1.0f + exp(-2.0f * u));
}

}  // namespace nanoserve
