// The Python module of the project's C++ kernels (built by nanogpt/extension.py).
#include <torch/extension.h>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                     const std::string& activation, const std::string& algorithm,
                     const c10::optional<torch::Tensor>& residual);  // nanogpt/gemv.cpp

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                               const torch::Tensor& slots, const torch::Tensor& positions, int64_t span,
                               double scale, int64_t local);  // nanogpt/decode_attention.cpp
bool decode_attention_serves(int64_t head_size);
void set_layer(int64_t handle, const c10::optional<torch::Tensor>& weight, const std::vector<double>& most,
               const std::vector<std::string>& kinds, const std::vector<py::object>& packs);  // nanogpt/layer_ops.cpp
void drop_layer(int64_t handle);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "epilogue(x @ w.T + bias), each weight row read once",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("activation") = "none",
        py::arg("algorithm") = "", py::arg("residual") = py::none());
  m.def("decode_attention", &decode_attention, "one decode step's attention, read in place from the slot cache",
        py::arg("q"), py::arg("cache_k"), py::arg("cache_v"), py::arg("slots"), py::arg("positions"),
        py::arg("span"), py::arg("scale"), py::arg("local") = 0);
  m.def("decode_attention_serves", &decode_attention_serves, "whether decode_attention is built for this head size");
  m.def("set_layer", &set_layer, "what a packed layer's op runs for each range of row counts",
        py::arg("handle"), py::arg("weight"), py::arg("most"), py::arg("kinds"), py::arg("packs"));
  m.def("drop_layer", &drop_layer, "forget a packed layer", py::arg("handle"));
}
