"""Dynamic int8 quantization of a model's linear layers, for CPU serving (opt-in: `dtype = "int8"`)."""
from __future__ import annotations

import warnings

import torch


class Int8Linear(torch.ao.nn.quantized.dynamic.Linear):
    """torch.ao's dynamically quantized linear layer, which a compiled graph calls as one opaque op
    (`nanoserve::layer`, nanogpt/kernels.py) running the same kernel: dynamo cannot put its packed
    weight (a TorchScript object) into a graph."""

    _handle: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self._handle is not None:
            return torch.ops.nanoserve.layer(x, self._handle, self.out_features)
        return super().forward(x)


def quantize_int8(model):
    """nn.Linear weights to int8, activations quantized on the fly (torch.ao's quantize_dynamic, in
    place, into Int8Linear layers; returns the model). It changes numerics, so it is never a
    default; embeddings, LayerNorms and attention stay float32. CPU only: quantized linears have
    no other kernels. Its drift from float32 and its speed are measured in docs/benchmarks.md."""
    from nanogpt.kernels import register

    with warnings.catch_warnings():  # the deprecation notice points to torchao, not installed here
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True,
                                               mapping={torch.nn.Linear: Int8Linear})
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            layer._handle = register(layer)
    return model
