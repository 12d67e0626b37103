"""The project's own matmul for one or two rows (nanogpt/gemv.cpp): each weight row streamed once
through the widest vector registers the CPU has, on PyTorch's own threads.

At one row a decode step is reading the weights, and PyTorch's kernels read them below the
machine's bandwidth: on an AVX-512 + BF16 EPYC, oneDNN's prepacked linear, PyTorch's fastest
there, ran GPT-2 small's decode matmuls 1.1-1.5x slower than this loop in float32 and 1.4-1.5x in
bfloat16 (docs/benchmarks.md). Another library's GEMV would bring its own thread pool, which on a
small machine takes the cores from PyTorch's (measured with OpenBLAS); this one runs in
at::parallel_for. nanogpt/kernels.py offers it as the kernel "gemv" beside PyTorch's and its
chooser decides by timing where it serves.
It is built with the project's other C++ kernels (nanogpt/extension.py).
"""
from __future__ import annotations

import torch

from nanogpt import extension

# The rows up to which it serves by rule in the float kernels' plans (nanogpt/kernels.py), a decode
# step of one or two sequences: in the engine at one request on an AVX-512 + BF16 EPYC it gave
# 1.11-1.22x oneDNN's tokens/s in float32 and 1.10-1.68x in bfloat16 (docs/benchmarks.md).
ROWS = 2


def available() -> bool:
    return extension.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
           algorithm: str = "", residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, for float32 or bfloat16 x and weight of one
    dtype; `activation`, `algorithm` as oneDNN's post-ops name them ("gelu" with "tanh" or "none",
    "relu", "none")."""
    return extension.extension().linear(x, weight, bias, activation, algorithm, residual)
