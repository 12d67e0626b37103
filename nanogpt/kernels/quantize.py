"""Dynamic int8 quantization of a model's linear layers, for CPU serving (opt-in: `dtype = "int8"`)."""
from __future__ import annotations

import contextlib
import warnings

import torch


@contextlib.contextmanager
def quantized_engine(name: str):
    """Weights packed inside this block are packed for the quantized engine `name` ("x86":
    fbgemm's kernels, "onednn": oneDNN's). A packed weight keeps its engine's kernel wherever it
    is called, so layers packed for different engines run side by side."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


class Int8Linear(torch.ao.nn.quantized.dynamic.Linear):
    """torch.ao's dynamically quantized linear layer, packed for the default engine (fbgemm), which

    - runs, for the row counts its plan (`set_plan`, nanogpt/kernels.py) gives another int8 kernel,
      the same int8 weight packed for that kernel: oneDNN's engine, with AMX's int8 tiles, is up
      to twice fbgemm's speed at a batch or a prompt's rows on CPUs that have them, and slower at
      one row; the project's int8 GEMV is faster at a few rows. All quantize x alike and sum int8
      products exactly, so the outputs agree to float32 rounding (the GEMV's: to the bit);
    - is called by a compiled graph as one opaque op (`nanoserve::int8_linear`) running the same
      kernels: dynamo cannot put a packed weight (a TorchScript object) into a graph."""

    _handle: int | None = None
    _plan = None
    _packs: dict = {}  # {kernel name: the weight packed for it}, for the plan's kernels but the default
    _packed_from = None  # the default pack the others were made from: another means the weight changed

    def set_plan(self, plan) -> None:
        from nanogpt.kernels import INT8, int8_pack, publish

        weight, bias = self._weight_bias()
        packs = {name: int8_pack(name, weight, bias) for name in {name for _, name in plan.ranges} - {INT8}}
        self._plan, self._packs, self._packed_from = plan, packs, self._packed_params._packed_params
        publish(self, plan, {INT8: self._packed_from, **packs})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_post_hook(lambda layer, keys: layer._repack())

    def _repack(self) -> None:
        """A new weight (load_state_dict, set_weight_bias): the compiled graphs' op runs it too."""
        if self._handle is not None:
            from nanogpt.kernels import INT8, Plan
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


def quantize_int8(model):
    """nn.Linear weights to int8, activations quantized on the fly (torch.ao's quantize_dynamic, in
    place, into Int8Linear layers packed for the default engine; returns the model). It changes
    numerics, so it is never a default; embeddings and LayerNorms stay float32, attention runs in the
    KV cache's dtype (nanogpt/kv_cache.py cache_dtype: bfloat16 on CPUs where that pays). CPU
    only: quantized linears have no other kernels. Its drift from float32 and its speed are
    measured in docs/performance.md."""
    from nanogpt.kernels import INT8, INT8_ENGINES, Plan, publish, register

    with warnings.catch_warnings(), quantized_engine(INT8_ENGINES[INT8]):
        warnings.simplefilter("ignore")  # the deprecation notice points to torchao, not installed here
        torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True,
                                               mapping={torch.nn.Linear: Int8Linear})
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            layer._handle = register(layer)
            publish(layer, Plan.only(INT8, "default"), {INT8: layer._packed_params._packed_params})
    return model


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight quantized as quantize_int8 quantizes a layer's: by the observer of torch.ao's
    default dynamic qconfig (per tensor, symmetric, int8)."""
    observer = torch.ao.quantization.default_dynamic_qconfig.weight()
    observer(weight.detach().float())
    scale, zero_point = observer.calculate_qparams()
    return torch.quantize_per_tensor(weight.detach().float(), float(scale), int(zero_point), torch.qint8)


def is_int8(model) -> bool:
    """Whether quantize_int8 quantized the model's linear layers."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
