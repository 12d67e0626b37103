// One decode step's attention over the slot cache: for each row b and head h, the softmax of
// q . keys over the positions its slot holds, times the values, read in place from the cache
// (slots, heads, positions, head size) in one pass over each row's keys and one over its values.
// Written as vector sums in registers with the scores kept in float32: the same sums that PyTorch's
// ops and inductor's fused kernel spell out, which on an AMX Xeon read the cache at about a third of
// the memory's rate (docs/notes/decode-attention.md#why). Built by ../extension.py; run on PyTorch's
// threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace nanoserve;

// The head sizes served, in vectors of L floats: every one up to 8 (AVX-512: 16-128 floats, AVX2:
// 8-64) and the larger sizes of the families served (GPT-J's 256, Pythia's 80, 128, 256)
#define NANOSERVE_HEAD_VECTORS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(10) X(16) X(20) X(32)

// scores[s] = e^(scores[s] - max) for s in [first, last); returns their sum. In vectors of L (the
// exp of vec.h), the last few one at a time: one libm exp per score cost ~15% of the kernel
// at 32 rows of GPT-2 small.
inline float softmax_numerators(float* scores, int64_t first, int64_t last) {
  const float top = max_of(scores + first, last - first);
  vf sums = {};
  int64_t s = first;
  for (; s + L <= last; s += L) {
    const vf e = nanoserve::exp(load(scores + s) - top);
    std::memcpy(scores + s, &e, sizeof e);
    sums += e;
  }
  float total = hsum(sums);
  for (; s < last; ++s) total += scores[s] = std::exp(scores[s] - top);
  return total;
}

// For G heads of one row at once (G streams from memory in flight, as the GEMV reads eight
// weight rows at a time): out[g] = softmax(scale * q[g] . K[g][s] for s in [first, last)) @ V[g],
// K[g] and V[g] the slot's rows of head g (rows of C * L elements, `stride` elements apart).
template <typename T, int C, int G>
void attend(const T* q, const T* K, const T* V, int64_t stride, int64_t first, int64_t last, float scale,
            float* scores, int64_t span, T* out) {
  constexpr int64_t hs = C * L;
  vf qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load(q + g * hs + c * L) * scale;
  for (int64_t s = first; s < last; ++s) {
    vf a[G] = {};
    for (int c = 0; c < C; ++c)
      for (int g = 0; g < G; ++g) a[g] += qv[g][c] * load(K + g * stride + s * hs + c * L);
    for (int g = 0; g < G; ++g) scores[g * span + s] = hsum(a[g]);
  }
  float total[G];
  for (int g = 0; g < G; ++g) total[g] = softmax_numerators(scores + g * span, first, last);
  vf acc[G][C] = {};
  for (int64_t s = first; s < last; ++s)
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * span + s];
      for (int c = 0; c < C; ++c) acc[g][c] += p * load(V + g * stride + s * hs + c * L);
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      const vf o = acc[g][c] * (1.f / total[g]);
      for (int l = 0; l < L; ++l) out[g * hs + c * L + l] = static_cast<T>(o[l]);
    }
}

template <typename T, int C, int G>
void run(const T* q, const T* K, const T* V, const int64_t* slots, const int64_t* positions,
         int64_t B, int64_t nh, int64_t max_len, int64_t span, float scale, int64_t local, T* out) {
  constexpr int64_t hs = C * L;
  const int64_t groups = (nh + G - 1) / G;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * span);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / groups, h = i % groups * G;
      // positions <= the row's own, within `local` of it where the layer attends locally
      const int64_t last = std::min(span, positions[b] + 1);
      const int64_t first = local > 0 ? std::max<int64_t>(0, positions[b] + 1 - local) : 0;
      const int64_t at = (slots[b] * nh + h) * max_len * hs, row = (b * nh + h) * hs;
      if (h + G <= nh)
        attend<T, C, G>(q + row, K + at, V + at, max_len * hs, first, last, scale, scores.data(), span, out + row);
      else
        for (int64_t g = 0; h + g < nh; ++g)
          attend<T, C, 1>(q + row + g * hs, K + at + g * max_len * hs, V + at + g * max_len * hs, max_len * hs,
                          first, last, scale, scores.data(), span, out + row + g * hs);
    }
  });
}

// Heads in groups of G where the rows' groups still give every thread several; else single heads
// (one row's twelve heads are three groups of four, which two threads cannot share evenly).
template <typename T, int C>
void run(const T* q, const T* K, const T* V, const int64_t* slots, const int64_t* positions,
         int64_t B, int64_t nh, int64_t max_len, int64_t span, float scale, int64_t local, T* out) {
  constexpr int G = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // the accumulators G * C within the registers
  if (B * (nh / G) >= 4 * at::get_num_threads())
    run<T, C, G>(q, K, V, slots, positions, B, nh, max_len, span, scale, local, out);
  else
    run<T, C, 1>(q, K, V, slots, positions, B, nh, max_len, span, scale, local, out);
}

template <typename T>
void dispatch(const T* q, const T* K, const T* V, const int64_t* slots, const int64_t* positions,
              int64_t B, int64_t nh, int64_t max_len, int64_t hs, int64_t span, float scale, int64_t local,
              T* out) {
  switch (hs / L) {
#define NANOSERVE_CASE(C) case C: return run<T, C>(q, K, V, slots, positions, B, nh, max_len, span, scale, local, out);
    NANOSERVE_HEAD_VECTORS(NANOSERVE_CASE)
#undef NANOSERVE_CASE
    default: TORCH_CHECK(false, "decode_attention: head size ", hs, " is not served");
  }
}

}  // namespace

bool decode_attention_serves(int64_t head_size) {
  if (head_size % L) return false;
  switch (head_size / L) {
#define NANOSERVE_CASE(C) case C:
    NANOSERVE_HEAD_VECTORS(NANOSERVE_CASE) return true;
#undef NANOSERVE_CASE
    default: return false;
  }
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                               const torch::Tensor& slots, const torch::Tensor& positions, int64_t span,
                               double scale, int64_t local) {
  TORCH_CHECK(q.dim() == 3 && cache_k.dim() == 4 && q.scalar_type() == cache_k.scalar_type() && cache_k.sizes() == cache_v.sizes()
              && cache_k.scalar_type() == cache_v.scalar_type() && cache_k.is_contiguous() && cache_v.is_contiguous()
              && q.size(1) == cache_k.size(1) && q.size(2) == cache_k.size(3),
              "decode_attention: q (B, heads, head size) and contiguous caches of its dtype (slots, heads, positions, head size)");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong
              && slots.numel() == q.size(0) && positions.numel() == q.size(0), "decode_attention: slots, positions (B,)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), max_len = cache_k.size(2);
  TORCH_CHECK(hs % L == 0 && span >= 1 && span <= max_len, "decode_attention: head size ", hs, ", span ", span);
  const auto qc = q.contiguous();
  const auto sl = slots.contiguous(), ps = positions.contiguous();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl.data_ptr<int64_t>()[b] >= 0 && sl.data_ptr<int64_t>()[b] < cache_k.size(0)
                && ps.data_ptr<int64_t>()[b] >= 0 && ps.data_ptr<int64_t>()[b] < max_len,
                "decode_attention: slot or position out of range");
  auto out = torch::empty({B, nh, hs}, q.options());
  const float s = static_cast<float>(scale);
  switch (cache_k.scalar_type()) {
    case torch::kFloat:
      dispatch<float>(qc.data_ptr<float>(), cache_k.data_ptr<float>(), cache_v.data_ptr<float>(), sl.data_ptr<int64_t>(),
                      ps.data_ptr<int64_t>(), B, nh, max_len, hs, span, s, local, out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      dispatch<c10::BFloat16>(qc.data_ptr<c10::BFloat16>(), cache_k.data_ptr<c10::BFloat16>(),
                              cache_v.data_ptr<c10::BFloat16>(), sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(), B, nh,
                              max_len, hs, span, s, local, out.data_ptr<c10::BFloat16>());
      break;
    default: TORCH_CHECK(false, "decode_attention: a float32 or bfloat16 cache");
  }
  return out;
}
