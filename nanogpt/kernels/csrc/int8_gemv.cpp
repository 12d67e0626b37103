// The int8 mode's matmul for a few rows (../quantize.py): what torch.ao's dynamically quantized
// linear computes with fbgemm, x quantized to uint8 on the fly and the int8 products summed exactly
// in int32, with each weight row streamed once from memory. At one row fbgemm's calls take longer
// than reading their int8 weights (packing x, the row offsets, a GEMM's blocking), where this loop
// reads them at about the memory's pace (docs/notes/int8-gemv.md#why).
//
// The result is fbgemm's to the bit: x's scale and zero point from the same function
// (quant_utils::ChooseQuantizationParams over the whole of x, the 7-bit range of `reduce_range`),
// the same rounding of x (fma(x, 1/scale, zero point), to nearest even), the same exact int32
// sums, and the same float epilogue (fma(sum - zero point * the weight row's sum, x's scale *
// the weight's, bias)). AVX2's vpmaddubsw multiplies the uint8 by the int8 and adds pairs into
// int16: with x in 0..128 a pair cannot leave int16, which is why the range is 7-bit.
#include <torch/extension.h>
#include <ATen/native/quantized/cpu/QuantUtils.h>

#include <algorithm>
#include <cstdint>
#include <immintrin.h>

#include "gemv.h"

namespace {

using namespace nanoserve;

// MB: rows of x per pass over a tile of NT weight rows (for_each_block)
constexpr int MB = 4;
constexpr int64_t NT = 32;
constexpr int64_t V = 32;  // int8 in an AVX2 register

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// x (M x K floats) -> uint8, as fbgemm's QuantizeAvx2 (its default, "legacy" form) rounds it
void quantize(const float* x, int64_t n, float scale, int32_t zero_point, uint8_t* out) {
  const float inverse = 1.f / scale;
  const __m256 inverse_v = _mm256_set1_ps(inverse), zero_v = _mm256_set1_ps(static_cast<float>(zero_point));
  const __m256 top = _mm256_set1_ps(static_cast<float>(INT32_MAX - 127));  // cvtps_epi32 stays in range
  const __m256i lo = _mm256_set1_epi32(0), hi = _mm256_set1_epi32(255);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 t = _mm256_min_ps(_mm256_fmadd_ps(_mm256_loadu_ps(x + i), inverse_v, zero_v), top);
    __m256i q = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), lo), hi);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), q);
    for (int l = 0; l < 8; ++l) out[i + l] = static_cast<uint8_t>(lanes[l]);
  }
  for (; i < n; ++i) {
    const float t = std::min(std::nearbyint(std::fmaf(x[i], inverse, static_cast<float>(zero_point))),
                             static_cast<float>(INT32_MAX - 127));
    out[i] = static_cast<uint8_t>(std::clamp(static_cast<int32_t>(t), 0, 255));
  }
}

// Each weight row in turn, read front to back, with the next kilobyte asked for ahead: int8 rows are
// short (768 bytes in GPT-2 small's blocks), and reading several at once, as the float GEMV does,
// left the hardware's prefetcher behind (docs/notes/int8-gemv.md#row-order).
constexpr int64_t AHEAD = 1024;

// out[m * NT + (n - n0)] = sum over k of x[m][k] * w[n][k], exactly, for M rows of x and the weight
// rows [n0, n1); U sums per row of x along k, so that the adds do not wait on one another.
template <int M, int U>
void dots(const int8_t* __restrict w, const uint8_t* __restrict x, int64_t K, int64_t n0, int64_t n1,
          int32_t* __restrict out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K_unrolled = K / (V * U) * (V * U), K_vec = K / V * V;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m256i acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_si256();
    auto step = [&](int64_t k, int u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k));
        acc[m][u] = _mm256_add_epi32(acc[m][u], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wv), ones));
      }
    };
    int64_t k = 0;
    for (; k < K_unrolled; k += V * U) {
      for (int u = 0; u < U; u += 2) _mm_prefetch(reinterpret_cast<const char*>(row + k + V * u) + AHEAD, _MM_HINT_T0);
      for (int u = 0; u < U; ++u) step(k + V * u, u);
    }
    for (; k < K_vec; k += V) step(k, 0);
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) acc[m][0] = _mm256_add_epi32(acc[m][0], acc[m][u]);
      int32_t s = hsum(acc[m][0]);
      for (int64_t r = K_vec; r < K; ++r) s += static_cast<int32_t>(x[m * K + r]) * row[r];
      out[m * NT + (n - n0)] = s;
    }
  }
}

void dots_rows(int rows, const int8_t* w, const uint8_t* x, int64_t K, int64_t n0, int64_t n1, int32_t* out) {
  switch (rows) {  // M * U sums, U of them per row of x, in AVX2's 16 registers beside the loads
    case 1: return dots<1, 4>(w, x, K, n0, n1, out);
    case 2: return dots<2, 2>(w, x, K, n0, n1, out);
    case 3: return dots<3, 2>(w, x, K, n0, n1, out);
    case 4: return dots<4, 2>(w, x, K, n0, n1, out);
  }
}

}  // namespace

torch::Tensor int8_linear_rows(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& row_sums,
                               double weight_scale, const c10::optional<torch::Tensor>& bias,
                               const std::string& activation, const std::string& algorithm) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous()
              && x.scalar_type() == at::kFloat && x.size(-1) == weight.size(1),
              "int8 gemv: float32 x (..., K) and a contiguous int8 weight (N, K)");
  TORCH_CHECK(row_sums.scalar_type() == at::kInt && row_sums.numel() == weight.size(0), "int8 gemv: row sums");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)), "int8 gemv: bias");
  const Activation act = activation_of(activation, algorithm);
  const int64_t N = weight.size(0), K = weight.size(1), M = x.numel() / K;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  if (M == 0) return y;

  float lowest = xp[0], highest = xp[0];
  for (int64_t i = 0; i < M * K; ++i) {
    lowest = std::min(lowest, xp[i]);
    highest = std::max(highest, xp[i]);
  }
  const auto params = quant_utils::ChooseQuantizationParams(lowest, highest, 0, 255, /*preserve_sparsity=*/false,
                                                            /*force_scale_power_of_two=*/false, /*reduce_range=*/true);
  const float x_scale = static_cast<float>(params.scale);
  const int32_t zero_point = params.zero_point;
  std::vector<uint8_t> xq(M * K);
  quantize(xp, M * K, x_scale, zero_point, xq.data());

  const float multiplier = x_scale * static_cast<float>(weight_scale);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int32_t* sums = row_sums.data_ptr<int32_t>();
  const torch::Tensor b = bias ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_each_block<MB, NT, int32_t>(N, M, [&](int64_t m0, int rows, int64_t n0, int64_t n1, int32_t* tile) {
    dots_rows(rows, wp, xq.data() + m0 * K, K, n0, n1, tile);
    for (int m = 0; m < rows; ++m) {
      float* out = yp + (m0 + m) * N;
      for (int64_t n = n0; n < n1; ++n) {
        const float sum = static_cast<float>(tile[m * NT + (n - n0)] - zero_point * sums[n]);
        out[n] = bp ? std::fmaf(sum, multiplier, bp[n]) : sum * multiplier;
      }
      activate(out + n0, n1 - n0, act);
    }
  });
  return y;
}
