"""Dynamic int8 quantization of a model's linear layers, for CPU serving (opt-in: `dtype = "int8"`):
a module swap at load, every nn.Linear replaced by an `Int8Linear`."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from nanogpt.kernels import ops
from nanogpt.kernels.matmuls import INT8, INT8_ENGINES, Plan, int8_pack, post_op, quantized_engine


class Int8Linear(torch.ao.nn.quantized.dynamic.Linear):
    """torch.ao's dynamically quantized linear layer, packed for the default engine (fbgemm), which

    - runs, for the row counts its plan (`set_plan`, planner.py) gives another int8 kernel, the same
      int8 weight packed for that kernel (oneDNN's engine, with AMX's int8 tiles where the CPU has
      them; the project's int8 GEMV at a few rows). All quantize x alike and sum int8 products
      exactly, so the outputs agree to float32 rounding (the GEMV's: to the bit);
    - is called by a compiled graph as one opaque op (`nanoserve::int8_linear`, ops.py) running
      the same kernels: dynamo cannot put a packed weight (a TorchScript object) into a graph."""

    _handle: int | None = None
    _plan = None
    _packs: dict = {}  # {kernel name: the weight packed for it}, for the plan's kernels but the default
    _packed_from = None  # the default pack the others were made from: another means the weight changed

    def set_plan(self, plan: Plan) -> None:
        weight, bias = self._weight_bias()
        packs = {name: int8_pack(name, weight, bias) for name in {name for _, name in plan.ranges} - {INT8}}
        self._plan, self._packs, self._packed_from = plan, packs, self._packed_params._packed_params
        ops.publish(self, plan, {INT8: self._packed_from, **packs})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda layer, keys: layer._repack())

    def _repack(self) -> None:
        """A new weight (load_state_dict, set_weight_bias): the compiled graphs' op runs it too."""
        if self._handle is not None:
            self.set_plan(self._plan or Plan.only(INT8, "default"))

    def set_weight_bias(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().set_weight_bias(weight, bias)
        self._repack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self._handle is not None:
            return torch.ops.nanoserve.int8_linear(x, self._handle, self.out_features)
        if self._packs and self._packed_from is self._packed_params._packed_params:
            kernel = self._plan.kernel_for(x.numel() // x.shape[-1])
            packed = self._packs.get(kernel.name)
            if packed is not None:
                return kernel.linear(x, packed, None, None).to(x.dtype)
        return super().forward(x)

    def fused(self, x: torch.Tensor, activation: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """activation(self(x)) applied as the output leaves the project's op, without a pass of
        its own; None where there is no such post-op (or no op: a layer never registered)."""
        post = post_op(activation)
        if self._handle is None or post is None:
            return None
        return torch.ops.nanoserve.int8_linear(x, self._handle, self.out_features, post[0], post[2])


def quantize_int8(model):
    """nn.Linear weights to int8, activations quantized on the fly (torch.ao's quantize_dynamic, in
    place, into Int8Linear layers packed for the default engine; returns the model). It changes
    numerics, so it is never a default; embeddings and LayerNorms stay float32, attention runs in the
    KV cache's dtype (nanogpt/runtime/precision.py cache_dtype). CPU only: quantized linears have
    no other kernels."""
    with warnings.catch_warnings(), quantized_engine(INT8_ENGINES[INT8]):
        warnings.simplefilter("ignore")  # the deprecation notice points to torchao, not installed here
        torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True,
                                               mapping={torch.nn.Linear: Int8Linear})
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            layer._handle = ops.register(layer)
            ops.publish(layer, Plan.only(INT8, "default"), {INT8: layer._packed_params._packed_params})
    return model


def is_int8(model) -> bool:
    """Whether quantize_int8 quantized the model's linear layers."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
