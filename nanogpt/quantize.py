"""Dynamic int8 quantization of a model's linear layers, for CPU serving (opt-in: `dtype = "int8"`)."""
from __future__ import annotations

import warnings

import torch


def quantize_int8(model):
    """nn.Linear weights to int8, activations quantized on the fly (torch.ao's quantize_dynamic, in
    place; returns the model). It changes numerics, so it is never a default; embeddings,
    LayerNorms and attention stay float32. CPU only: quantized linears have no other kernels.
    Its drift from float32 and its speed are measured in docs/benchmarks.md."""
    with warnings.catch_warnings():  # the deprecation notice points to torchao, not installed here
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
