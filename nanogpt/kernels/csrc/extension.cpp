// The Python module of the project's C++ kernels (built by ../extension.py).
#include <torch/extension.h>

#include "own_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "epilogue(x @ w.T + bias), each weight row read once",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("activation") = "none",
        py::arg("algorithm") = "", py::arg("residual") = py::none(), py::arg("in_order") = false);
  m.def("int8_linear", &int8_linear_rows, "epilogue(an int8 layer(x)) as fbgemm computes it, each weight row read once",
        py::arg("x"), py::arg("weight"), py::arg("row_sums"), py::arg("weight_scale"), py::arg("bias"),
        py::arg("activation") = "none", py::arg("algorithm") = "");
  m.def("decode_attention", &decode_attention, "one decode step's attention, read in place from the slot cache",
        py::arg("q"), py::arg("cache_k"), py::arg("cache_v"), py::arg("slots"), py::arg("positions"),
        py::arg("span"), py::arg("scale"), py::arg("local") = 0);
  m.def("decode_attention_serves", &decode_attention_serves, "whether decode_attention is built for this head size");
  m.def("first_max", &first_max, "each row's first maximum, as x.max(-1).indices", py::arg("x"));
  m.def("set_layer", &set_layer, "what a packed layer's op runs for each range of row counts",
        py::arg("handle"), py::arg("weight"), py::arg("most"), py::arg("kinds"), py::arg("packs"));
  m.def("drop_layer", &drop_layer, "forget a packed layer", py::arg("handle"));
}
