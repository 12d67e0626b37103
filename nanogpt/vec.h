// The vector registers the project's kernels are written with (nanogpt/gemv.cpp,
// nanogpt/decode_attention.cpp): GCC's vector extensions at the width the build targets (AVX-512: 16
// floats, AVX2: 8), float32 and bfloat16 loads into float32 lanes, and a horizontal sum.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <immintrin.h>

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

}  // namespace nanoserve
