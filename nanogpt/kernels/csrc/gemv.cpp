// y = epilogue(x @ w.T + bias) for a few rows of x, streaming each weight row once from memory:
// the decode step's matmul, whose time is reading the weights. Built by ../extension.py for the
// vector width of the CPU it runs on (AVX-512: 16 floats, AVX2: 8; with AVX512_BF16 bfloat16 dot
// products too) and run on PyTorch's own thread pool (at::parallel_for), so it never competes
// with another pool for the cores.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#include "gemv.h"
#include "vec.h"

namespace {

using namespace nanoserve;

// MB: rows of x per pass over a tile of weights, their sums in registers. NT: weight rows per tile;
// a tile stays in the core's cache while every block of MB rows of x passes over it, so that the
// weights stream from memory once whatever the row count. NT is a multiple of the build's blocks of
// weight rows (dots_blocked: 8, 4, 2 on AVX-512; 8, 4, 3, 2 on AVX2), so no tile ends in single rows.
#if defined(__AVX512F__)
constexpr int MB = 8;
constexpr int64_t NT = 16;
#else
// AVX2's 16 registers hold 12 sums: six rows of x by two weight rows, or four (and three) by three,
// which beat four rows by two from 6 rows up (docs/notes/gemv.md#avx2-blocks).
constexpr int MB = 6;
constexpr int64_t NT = 24;
#endif

// Each load of NB weight rows also asks for the same bytes of the next NB rows (the next block, NB
// * K elements on): the hardware's prefetcher alone left the cores waiting on memory
// (docs/notes/gemv.md#prefetch). A prefetch past the weight's end is dropped, never a fault.
template <typename T, int NB>
inline void prefetch_next_block(const T* w, int64_t K, int64_t n, int64_t k) {
  if ((k * sizeof(T)) % 64 == 0)  // once per cache line
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (n + NB + j) * K + k), _MM_HINT_T0);
}

// out[m * NT + (n - n0)] = dot(w[n], x[m]) for M rows of x and the weight rows [n0, n1), NB weight
// rows at a time, so that every load of x feeds NB multiply-adds (loads, not multiplies, bound a
// vector unit fed from the cache) and NB weight rows stream from memory at once.
template <typename T, int M, int NB>
void dots(const T* __restrict w, const float* __restrict x, int64_t K, int64_t n0, int64_t n1,
          float* __restrict out) {
  const int64_t K_vec = K / L * L;
  for (int64_t n = n0; n < n1; n += NB) {
    vf acc[NB][M] = {};
    for (int64_t k = 0; k < K_vec; k += L) {
      vf wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load(w + (n + j) * K + k);
      // float32 at one row: the hardware's prefetcher keeps up alone (docs/notes/gemv.md#prefetch)
      if constexpr (M > 1 || !std::is_same_v<T, float>) prefetch_next_block<T, NB>(w, K, n, k);
      for (int m = 0; m < M; ++m) {
        vf xv = load(x + m * K + k);
#if !defined(__AVX512F__)
        // x loaded once into a register for its NB multiply-adds: GCC otherwise folds a load of it
        // into each one, and on AVX2 the loads, not the multiplies, set the pace
        asm("" : "+x"(xv));
#endif
        for (int j = 0; j < NB; ++j) acc[j][m] += wv[j] * xv;
      }
    }
    for (int j = 0; j < NB; ++j) {
      const T* wr = w + (n + j) * K;
      for (int m = 0; m < M; ++m) {
        float s = hsum(acc[j][m]);
        for (int64_t k = K_vec; k < K; ++k) s += scalar(wr[k]) * x[m * K + k];
        out[m * NT + (n + j - n0)] = s;
      }
    }
  }
}

// As many accumulators as the registers hold: NB * M of them, beside NB + 1 loaded vectors. At
// one or two rows, eight weight rows at a time: eight streams from memory in flight keep more of
// its bandwidth busy than one row read at a time (docs/notes/gemv.md#eight-rows).
template <typename T, int M>
void dots_blocked(const T* w, const float* x, int64_t K, int64_t n0, int64_t n1, float* out) {
#if defined(__AVX512F__)
  constexpr int NB = M <= 2 ? 8 : M <= 4 ? 4 : 2;
#else
  constexpr int NB = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 3 : 2;
#endif
  const int64_t n_blocked = n0 + (n1 - n0) / NB * NB;
  dots<T, M, NB>(w, x, K, n0, n_blocked, out);
  if (n_blocked < n1) dots<T, M, 1>(w, x, K, n_blocked, n1, out + (n_blocked - n0));
}

// The same sums, one weight row after another in memory order: each thread's share of the weight
// read as one stream, which on some CPUs the hardware prefetcher serves faster than eight streams
// a row's length apart (docs/notes/gemv.md#in-order). Two sums a row of x along K.
template <typename T, int M>
void dots_in_order(const T* __restrict w, const float* __restrict x, int64_t K, int64_t n0, int64_t n1,
                   float* __restrict out) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* wr = w + n * K;
    vf acc[M][2] = {};
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
      const vf w0 = load(wr + k), w1 = load(wr + k + L);
      for (int m = 0; m < M; ++m) {
        acc[m][0] += w0 * load(x + m * K + k);
        acc[m][1] += w1 * load(x + m * K + k + L);
      }
    }
    for (; k + L <= K; k += L) {
      const vf w0 = load(wr + k);
      for (int m = 0; m < M; ++m) acc[m][0] += w0 * load(x + m * K + k);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m][0] + acc[m][1]);
      for (int64_t r = k; r < K; ++r) s += scalar(wr[r]) * x[m * K + r];
      out[m * NT + (n - n0)] = s;
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 weights and x (a bfloat16 model's activations are bfloat16): vdpbf16ps multiplies 32
// pairs and adds them into 16 float sums in one instruction, where widening the weights to float
// first takes three per 16, which left the cores, not the memory, setting the pace
// (docs/notes/gemv.md#bfloat16). The products are the same exact float products; denormal inputs
// count as zero.
constexpr int P = 32;  // bfloat16 in a vector register

template <int M, int NB>
void dots_bf16(const c10::BFloat16* __restrict w, const c10::BFloat16* __restrict x, int64_t K, int64_t n0,
               int64_t n1, float* __restrict out) {
  for (int64_t n = n0; n < n1; n += NB) {
    __m512 acc[NB][M];
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + P <= K; k += P) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (n + j) * K + k);
      prefetch_next_block<c10::BFloat16, NB>(w, K, n, k);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const c10::BFloat16* wr = w + (n + j) * K;
      for (int m = 0; m < M; ++m) {
        float s = _mm512_reduce_add_ps(acc[j][m]);
        for (int64_t r = k; r < K; ++r) s += scalar(wr[r]) * scalar(x[m * K + r]);
        out[m * NT + (n + j - n0)] = s;
      }
    }
  }
}

// As many weight rows at a time as the registers hold accumulators for (NB * M of them, beside NB +
// 1 loaded vectors), up to eight, as for float32 (docs/notes/gemv.md#bfloat16).
template <int M>
void dots_bf16_blocked(const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, int64_t n0, int64_t n1,
                       float* out) {
  constexpr int NB = M <= 2 ? 8 : M <= 4 ? 4 : 2;
  const int64_t n_blocked = n0 + (n1 - n0) / NB * NB;
  dots_bf16<M, NB>(w, x, K, n0, n_blocked, out);
  if (n_blocked < n1) dots_bf16<M, 1>(w, x, K, n_blocked, n1, out + (n_blocked - n0));
}

template <int M>
void dots_bf16_in_order(const c10::BFloat16* __restrict w, const c10::BFloat16* __restrict x, int64_t K, int64_t n0,
                        int64_t n1, float* __restrict out) {
  for (int64_t n = n0; n < n1; ++n) {
    const c10::BFloat16* wr = w + n * K;
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * P <= K; k += 2 * P) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + P);
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + P));
      }
    }
    for (; k + P <= K; k += P) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
      for (int64_t r = k; r < K; ++r) s += scalar(wr[r]) * scalar(x[m * K + r]);
      out[m * NT + (n - n0)] = s;
    }
  }
}

template <int M>
void dots_bf16_pass(bool in_order, const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, int64_t n0, int64_t n1,
                    float* out) {
  if (in_order)
    dots_bf16_in_order<M>(w, x, K, n0, n1, out);
  else
    dots_bf16_blocked<M>(w, x, K, n0, n1, out);
}

void dots_rows(int rows, bool in_order, const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, int64_t n0,
               int64_t n1, float* out) {
  switch (rows) {
    case 1: return dots_bf16_pass<1>(in_order, w, x, K, n0, n1, out);
    case 2: return dots_bf16_pass<2>(in_order, w, x, K, n0, n1, out);
    case 3: return dots_bf16_pass<3>(in_order, w, x, K, n0, n1, out);
    case 4: return dots_bf16_pass<4>(in_order, w, x, K, n0, n1, out);
    case 5: return dots_bf16_pass<5>(in_order, w, x, K, n0, n1, out);
    case 6: return dots_bf16_pass<6>(in_order, w, x, K, n0, n1, out);
    case 7: return dots_bf16_pass<7>(in_order, w, x, K, n0, n1, out);
    case 8: return dots_bf16_pass<8>(in_order, w, x, K, n0, n1, out);
  }
}

#endif

// x as the dot products read it: float, or bfloat16 as it came where they multiply bfloat16
template <typename T> struct DotInput { using type = float; };
#if defined(__AVX512BF16__)
template <> struct DotInput<c10::BFloat16> { using type = c10::BFloat16; };
#endif

template <typename T, int M>
void dots_pass(bool in_order, const T* w, const float* x, int64_t K, int64_t n0, int64_t n1, float* out) {
  if (in_order)
    dots_in_order<T, M>(w, x, K, n0, n1, out);
  else
    dots_blocked<T, M>(w, x, K, n0, n1, out);
}

template <typename T>
void dots_rows(int rows, bool in_order, const T* w, const float* x, int64_t K, int64_t n0, int64_t n1, float* out) {
  switch (rows) {
    case 1: return dots_pass<T, 1>(in_order, w, x, K, n0, n1, out);
    case 2: return dots_pass<T, 2>(in_order, w, x, K, n0, n1, out);
    case 3: return dots_pass<T, 3>(in_order, w, x, K, n0, n1, out);
    case 4: return dots_pass<T, 4>(in_order, w, x, K, n0, n1, out);
    case 5: return dots_pass<T, 5>(in_order, w, x, K, n0, n1, out);
    case 6: return dots_pass<T, 6>(in_order, w, x, K, n0, n1, out);
#if defined(__AVX512F__)
    case 7: return dots_pass<T, 7>(in_order, w, x, K, n0, n1, out);
    case 8: return dots_pass<T, 8>(in_order, w, x, K, n0, n1, out);
#endif
  }
}

template <typename T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                  Activation act, const c10::optional<torch::Tensor>& residual, bool in_order) {
  using X = typename DotInput<T>::type;
  const int64_t N = w.size(0), K = w.size(1), M = x.numel() / K;
  auto xf = x.reshape({M, K}).to(c10::CppTypeToScalarType<X>::value).contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b, r;
  if (bias) b = bias->contiguous();
  if (residual) r = residual->reshape({M, N}).contiguous();
  const auto wc = w.contiguous();
  const T* wp = wc.data_ptr<T>();
  const T* bp = b.defined() ? b.data_ptr<T>() : nullptr;
  const T* rp = r.defined() ? r.data_ptr<T>() : nullptr;
  const X* xp = xf.template data_ptr<X>();
  T* yp = y.data_ptr<T>();
  for_each_block<MB, NT, float>(N, M, [&](int64_t m0, int rows, int64_t n0, int64_t n1, float* tile) {
    dots_rows(rows, in_order, wp, xp + m0 * K, K, n0, n1, tile);
    for (int m = 0; m < rows; ++m) {
      float* sums = tile + m * NT;
      if (bp)
        for (int64_t n = n0; n < n1; ++n) sums[n - n0] += scalar(bp[n]);
      activate(sums, n1 - n0, act);
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t at = (m0 + m) * N + n;
        yp[at] = static_cast<T>(rp ? sums[n - n0] + scalar(rp[at]) : sums[n - n0]);
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                     const std::string& activation, const std::string& algorithm,
                     const c10::optional<torch::Tensor>& residual, bool in_order) {
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1) && x.scalar_type() == w.scalar_type(),
              "gemv: x (..., K) and a weight (N, K) of one dtype");
  TORCH_CHECK(!bias || (bias->scalar_type() == w.scalar_type() && bias->numel() == w.size(0)), "gemv: bias");
  TORCH_CHECK(!residual || (residual->scalar_type() == w.scalar_type()
                            && residual->numel() == x.numel() / w.size(1) * w.size(0)), "gemv: residual");
  const Activation act = activation_of(activation, algorithm);
  switch (w.scalar_type()) {
    case torch::kFloat: return run<float>(x, w, bias, act, residual, in_order);
    case torch::kBFloat16: return run<c10::BFloat16>(x, w, bias, act, residual, in_order);
    default: TORCH_CHECK(false, "gemv: float32 or bfloat16 weights");
  }
}

