// The CPU kernels of the project's ops inside compiled graphs (their schemas: ../ops.py and
// ../decode_attention.py), so that a compiled step calls its packed layers and its attention
// without entering Python, whose interpreter, GIL and plan lookup cost each call more than a
// small kernel (docs/notes/kernel-ops.md#ops-in-compiled-graphs).
//
// A layer is named by its handle (../ops.py `register`); `set_layer` tells this file what the
// kernel plan (../planner.py) gave it: for each range of row counts, the kernel and its packed weight.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "own_kernels.h"
#include "vec.h"

namespace {

enum class Kind { Plain, Mkl, Onednn, Gemv, GemvInOrder, Int8, Int8Gemv };

struct Range {
  double most;  // the most rows it serves
  Kind kind;
  // the packed weight (a tensor, an int8 engine's packed parameters, or the int8 GEMV's tuple of its
  // weight's values, their row sums, its scale and the bias: ../gemv.py int8_pack); none for Plain, Gemv
  c10::IValue pack;
};

struct Layer {
  // the weight that was packed (float layers): another tensor or version is served as a plain linear
  const void* weight = nullptr;
  int64_t version = 0;
  std::vector<Range> ranges;
};

std::mutex registry_lock;
std::unordered_map<int64_t, Layer> registry;

Kind kind_of(const std::string& name) {
  if (name == "linear") return Kind::Plain;
  if (name == "mkl") return Kind::Mkl;
  if (name == "onednn") return Kind::Onednn;
  if (name == "gemv") return Kind::Gemv;
  if (name == "gemv-in-order") return Kind::GemvInOrder;
  if (name == "int8-gemv") return Kind::Int8Gemv;
  if (name.rfind("int8", 0) == 0) return Kind::Int8;
  TORCH_CHECK(false, "nanoserve: no kernel named ", name);
}

// the range serving `rows`, copied out under the lock (a later set_layer may replace the layer)
c10::optional<Range> range_for(int64_t handle, int64_t rows, const torch::Tensor* weight) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(handle);
  if (found == registry.end()) return c10::nullopt;
  const Layer& layer = found->second;
  if (weight != nullptr && (weight->data_ptr() != layer.weight || weight->_version() != layer.version))
    return c10::nullopt;
  for (const Range& range : layer.ranges)
    if (static_cast<double>(rows) <= range.most) return range;
  return layer.ranges.back();
}

torch::Tensor call(const char* name, const char* overload, c10::Stack stack) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// GPT-2's GELU over y in place, by the vector form (vec.h): PyTorch's own runs a vector tanh that
// costs more than twice as much (docs/notes/kernel-ops.md#ops-in-compiled-graphs)
void gelu_tanh_(torch::Tensor& y) {
  using nanoserve::L;
  float* data = y.data_ptr<float>();
  const int64_t vectors = y.numel() / L;
  at::parallel_for(0, vectors, 4096, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      float* p = data + i * L;
      nanoserve::vf v = nanoserve::gelu_tanh(nanoserve::load(p));
      std::memcpy(p, &v, sizeof v);
    }
  });
  for (int64_t i = vectors * L; i < y.numel(); ++i) data[i] = nanoserve::gelu_tanh(data[i]);  // the tail
}

// activation(y), in place: y is the kernel's fresh output
torch::Tensor post_op(torch::Tensor y, const std::string& activation, const std::string& algorithm) {
  if (activation == "gelu" && algorithm == "tanh" && y.scalar_type() == at::kFloat && y.is_contiguous()) {
    gelu_tanh_(y);
    return y;
  }
  if (activation == "gelu") return at::gelu_(y, algorithm);
  if (activation == "relu") return at::relu_(y);
  return y;
}

// nanoserve::linear: activation(x @ weight.T + bias) by the layer's planned kernel for x's rows
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                            int64_t handle, c10::string_view activation_view, c10::string_view algorithm_view) {
  const std::string activation(activation_view), algorithm(algorithm_view);
  const int64_t rows = x.numel() / x.size(-1);
  c10::optional<Range> range;
  if (x.scalar_type() == weight.scalar_type() && !(weight.requires_grad() && at::GradMode::is_enabled()))
    range = range_for(handle, rows, &weight);
  const Kind kind = range ? range->kind : Kind::Plain;
  switch (kind) {
    case Kind::Gemv:
    case Kind::GemvInOrder:
      return linear(x, weight, bias, activation, algorithm, c10::nullopt, kind == Kind::GemvInOrder);
    case Kind::Onednn:
      return call("mkldnn::_linear_pointwise", "",
                  {x, range->pack, bias, activation, c10::List<c10::optional<at::Scalar>>(),
                   algorithm});
    case Kind::Mkl:
      return post_op(call("mkl::_mkl_linear", "", {x, range->pack, weight, bias, rows}), activation, algorithm);
    default:
      return post_op(at::linear(x, weight, bias), activation, algorithm);
  }
}

// nanoserve::int8_linear: activation(an int8 layer (../quantize.py)), by its planned kernel for
// x's rows
torch::Tensor int8_linear(const torch::Tensor& x, int64_t handle, int64_t out_features,
                          c10::string_view activation, c10::string_view algorithm) {
  c10::optional<Range> range = range_for(handle, x.numel() / x.size(-1), nullptr);
  TORCH_CHECK(range.has_value(), "nanoserve: int8 layer ", handle, " is not registered");
  if (range->kind == Kind::Int8Gemv) {
    const auto& pack = range->pack.toTupleRef().elements();
    return int8_linear_rows(x, pack[0].toTensor(), pack[1].toTensor(), pack[2].toDouble(),
                            pack[3].toOptional<torch::Tensor>(), std::string(activation), std::string(algorithm));
  }
  return post_op(call("quantized::linear_dynamic", "", {x, range->pack, true}), std::string(activation),
                 std::string(algorithm));
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                        const torch::Tensor& slots, const torch::Tensor& positions, int64_t span, double scale,
                        int64_t local) {
  return decode_attention(q, cache_k, cache_v, slots, positions, span, scale, local);
}

}  // namespace

// What the kernel plan (../planner.py) gave layer `handle`: per range (most rows: inf for the last), the
// kernel's name and its pack (None, a tensor, or an int8 kernel's packed parameters); `weight` the
// float weight packed (None for an int8 layer).
void set_layer(int64_t handle, const c10::optional<torch::Tensor>& weight, const std::vector<double>& most,
               const std::vector<std::string>& kinds, const std::vector<py::object>& packs) {
  TORCH_CHECK(!most.empty() && most.size() == kinds.size() && most.size() == packs.size(),
              "nanoserve: a plan of one or more ranges");
  Layer layer;
  if (weight) {
    layer.weight = weight->data_ptr();
    layer.version = weight->_version();
  }
  for (size_t i = 0; i < most.size(); ++i) {
    c10::IValue pack;
    if (!packs[i].is_none()) pack = torch::jit::toIValue(packs[i], c10::AnyType::get());
    layer.ranges.push_back({most[i], kind_of(kinds[i]), pack});
  }
  std::lock_guard<std::mutex> guard(registry_lock);
  registry[handle] = std::move(layer);
}

void drop_layer(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(handle);
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("linear", &packed_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("decode_attention", &attention);
}
