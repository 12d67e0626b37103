// The project's C++ kernels as the other sources of its extension call them (../extension.py).
#pragma once
#include <torch/extension.h>

#include <string>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                     const std::string& activation, const std::string& algorithm,
                     const c10::optional<torch::Tensor>& residual, bool in_order);  // gemv.cpp

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                               const torch::Tensor& slots, const torch::Tensor& positions, int64_t span,
                               double scale, int64_t local);  // decode_attention.cpp
bool decode_attention_serves(int64_t head_size);

torch::Tensor int8_linear_rows(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& row_sums,
                               double weight_scale, const c10::optional<torch::Tensor>& bias,
                               const std::string& activation, const std::string& algorithm);  // int8_gemv.cpp

torch::Tensor first_max(const torch::Tensor& x);  // first_max.cpp

void set_layer(int64_t handle, const c10::optional<torch::Tensor>& weight, const std::vector<double>& most,
               const std::vector<std::string>& kinds, const std::vector<pybind11::object>& packs);  // layer_ops.cpp
void drop_layer(int64_t handle);
