"""The project's own matmul for one or two rows (csrc/gemv.cpp): each weight row streamed once
through the widest vector registers the CPU has, on PyTorch's own threads; and the int8 mode's
(csrc/int8_gemv.cpp), which computes what fbgemm's dynamically quantized linear computes.

At one row a decode step is reading the weights, and PyTorch's kernels read them below the
machine's bandwidth; another library's GEMV would bring its own thread pool, which on a small
machine takes the cores from PyTorch's (docs/notes/gemv.md#why, int8-gemv.md#why). The kernel plan
(planner.py) offers them as the kernels "gemv" (and "gemv-in-order", the same sums with the weight
rows read in memory order) and "int8-gemv" beside PyTorch's and decides by timing where they serve.
"""
from __future__ import annotations

import torch

from nanogpt.kernels import extension

# The rows it serves by rule in the plans (planner.py RULE): a decode step of one or two sequences,
# where it led PyTorch's kernels on every CPU measured (docs/notes/gemv.md#rows, int8-gemv.md#rows).
ROWS = 2


def available() -> bool:
    return extension.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
           algorithm: str = "", residual: torch.Tensor | None = None, in_order: bool = False) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, for float32 or bfloat16 x and weight of one
    dtype; `activation`, `algorithm` as oneDNN's post-ops name them ("gelu" with "tanh" or "none",
    "relu", "none"). `in_order`: the weight rows read one after another in memory order, not eight
    at a time (which of the two reads faster depends on the CPU: docs/notes/gemv.md#in-order)."""
    return extension.extension().linear(x, weight, bias, activation, algorithm, residual, in_order)


def int8_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What `int8_linear` reads of an int8 layer (quantize.py): its weight's int8 values as a
    plain tensor (N, K), their sum per row (x's zero point times it leaves the exact sums), the
    weight's scale and the float bias. The weight must be quantized per tensor with zero point 0,
    as quantize_int8 quantizes it."""
    if weight.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric) or weight.q_zero_point() != 0:
        raise ValueError("the int8 gemv reads weights quantized per tensor around 0")
    values = weight.int_repr().contiguous()
    return values, values.sum(1, dtype=torch.int32), float(weight.q_scale()), bias


def int8_linear(x: torch.Tensor, pack: tuple, activation: str = "none", algorithm: str = "") -> torch.Tensor:
    """activation(the int8 layer `pack` (int8_pack) applied to float32 x) as torch.ao's dynamically
    quantized linear computes it with fbgemm, to the bit (csrc/int8_gemv.cpp)."""
    return extension.extension().int8_linear(x, *pack, activation, algorithm)
