// What the project's two GEMVs (gemv.cpp, int8_gemv.cpp) share: their pass over the
// weights, and the activations they apply as each output leaves them, named as oneDNN's post-ops
// name them.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "vec.h"

namespace nanoserve {

// Tiles of NT weight rows split among PyTorch's threads, and per tile each block of up to MB rows of
// x in turn, so that the tile stays in the core's cache while the blocks pass over it and the weights
// stream from memory once whatever the row count: `block(m0, rows, n0, n1, tile)` computes and
// writes the outputs of x's rows [m0, m0 + rows) for the weight rows [n0, n1), `tile` its scratch
// of MB * NT sums.
template <int MB, int64_t NT, typename Sum, typename Block>
void for_each_block(int64_t N, int64_t M, const Block& block) {
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    Sum tile[MB * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, n1 = std::min(N, n0 + NT);
      for (int64_t m0 = 0; m0 < M; m0 += MB) block(m0, static_cast<int>(std::min<int64_t>(MB, M - m0)), n0, n1, tile);
    }
  });
}

enum class Activation { none, gelu_tanh, gelu_erf, relu };

inline Activation activation_of(const std::string& name, const std::string& algorithm) {
  if (name == "none") return Activation::none;
  if (name == "relu") return Activation::relu;
  if (name == "gelu") return algorithm == "tanh" ? Activation::gelu_tanh : Activation::gelu_erf;
  TORCH_CHECK(false, "gemv: no activation ", name);
}

inline float activate(float v, Activation a) {
  switch (a) {
    case Activation::none: return v;
    case Activation::relu: return v > 0.f ? v : 0.f;
    case Activation::gelu_tanh: return gelu_tanh(v);
    case Activation::gelu_erf: return 0.5f * v * (1.f + std::erf(v * 0.7071067811865476f));
  }
  return v;
}

// activation(p[0..n)) in place, GPT-2's GELU by its vector form (vec.h): one std::tanh per output
// costs more than the vector form's pass (docs/notes/gemv.md#epilogue)
inline void activate(float* p, int64_t n, Activation a) {
  if (a == Activation::none) return;
  int64_t i = 0;
  if (a == Activation::gelu_tanh)
    for (; i + L <= n; i += L) {
      const vf v = gelu_tanh(load(p + i));
      std::memcpy(p + i, &v, sizeof v);
    }
  for (; i < n; ++i) p[i] = activate(p[i], a);
}

}  // namespace nanoserve
