"""The project's own matmul for one or two rows (nanogpt/gemv.cpp): each weight row streamed once
through the widest vector registers the CPU has, on PyTorch's own threads; and the int8 mode's
(nanogpt/int8_gemv.cpp), which computes what fbgemm's dynamically quantized linear computes.

At one row a decode step is reading the weights, and PyTorch's kernels read them below the
machine's bandwidth: on an AVX-512 + BF16 EPYC, oneDNN's prepacked linear, PyTorch's fastest
there, ran GPT-2 small's decode matmuls 1.1-1.5x slower than this loop in float32 and 1.4-1.5x in
bfloat16 (docs/notes/gemv.md#why). Another library's GEMV would bring its own thread pool, which on a
small machine takes the cores from PyTorch's (measured with OpenBLAS); this one runs in
at::parallel_for. nanogpt/kernels.py offers them as the kernels "gemv" and "int8-gemv" beside
PyTorch's and its chooser decides by timing where they serve.
It is built with the project's other C++ kernels (nanogpt/extension.py).
"""
from __future__ import annotations

import torch

from nanogpt import extension

# The rows up to which it serves by rule in the plans (nanogpt/kernels.py), a decode step of one or
# two sequences: in the engine at one request on an AVX-512 + BF16 EPYC it gave 1.11-1.22x oneDNN's
# tokens/s in float32 and 1.10-1.68x in bfloat16; the int8 one ran GPT-2 small's 49 int8 matmuls
# 1.3-1.5x faster than fbgemm at one row, 1.2-1.5x at two, on an AVX2 EPYC (docs/notes/gemv.md, int8-gemv.md).
ROWS = 2


def available() -> bool:
    return extension.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
           algorithm: str = "", residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, for float32 or bfloat16 x and weight of one
    dtype; `activation`, `algorithm` as oneDNN's post-ops name them ("gelu" with "tanh" or "none",
    "relu", "none")."""
    return extension.extension().linear(x, weight, bias, activation, algorithm, residual)


def int8_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What `int8_linear` reads of an int8 layer (nanogpt/quantize.py): its weight's int8 values as a
    plain tensor (N, K), their sum per row (x's zero point times it leaves the exact sums), the
    weight's scale and the float bias. The weight must be quantized per tensor with zero point 0,
    as quantize_int8 quantizes it."""
    if weight.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric) or weight.q_zero_point() != 0:
        raise ValueError("the int8 gemv reads weights quantized per tensor around 0")
    values = weight.int_repr().contiguous()
    return values, values.sum(1, dtype=torch.int32), float(weight.q_scale()), bias


def int8_linear(x: torch.Tensor, pack: tuple, activation: str = "none", algorithm: str = "") -> torch.Tensor:
    """activation(the int8 layer `pack` (int8_pack) applied to float32 x) as torch.ao's dynamically
    quantized linear computes it with fbgemm, to the bit (nanogpt/int8_gemv.cpp)."""
    return extension.extension().int8_linear(x, *pack, activation, algorithm)
