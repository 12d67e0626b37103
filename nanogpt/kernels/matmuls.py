"""The CPU kernels that compute a linear layer, x @ weight.T + bias, and the `Plan` that says which
of them serves which row counts of a layer (chosen by timing in planner.py).

PyTorch's plain `F.linear` (a GEMM that lays the weight out anew on every call), MKL's packed GEMM
and oneDNN's prepacked linear (what inductor's weight freezing emits) each pack a weight once, and
they rank differently by CPU and row count; the project's own GEMV (gemv.py) reads the weight as
nn.Linear holds it. The int8 mode's kernels: torch.ao's dynamically quantized linear with its
weight packed by one of PyTorch's quantized engines, and the project's int8 GEMV, which computes
what fbgemm's does. Every kernel multiplies in the weights' dtype with the same products and
differs only in summation order, so float32 results stay within float32 rounding of `F.linear`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.kernels import gemv

PLAIN = "linear"
GEMV = "gemv"
GEMV_IN_ORDER = "gemv-in-order"  # the same, its weight rows read in memory order (gemv.py `in_order`)
INT8_GEMV = "int8-gemv"  # the int8 mode's (csrc/int8_gemv.cpp)
# The kernels that are not PyTorch's: left out of the benchmarks' ceiling, the fastest kernel
# PyTorch offers
OWN = (GEMV, GEMV_IN_ORDER, INT8_GEMV)
# The packed kernels lay a weight out for a row count they are told; one pack serves every row
# count as fast as a pack per count (docs/notes/kernel-ops.md#one-pack).
PACK_ROWS = 64
# INT8, fbgemm's (through the "x86" engine), is what every int8 layer holds; oneDNN's engine runs
# the same int8 products on AMX's tiles where the CPU has them.
INT8 = "int8-dynamic"
INT8_ENGINES = {INT8: "x86", "int8-onednn": "onednn"}


@dataclass(frozen=True)
class Kernel:
    """One way to compute x @ weight.T + bias: `pack(weight, bias)` once per layer (None: the
    kernel reads the weight as it is), then `linear(x, packed, weight, bias)` per call, for weights
    of the given dtypes (torch.qint8: the weight quantized to int8, x quantized on the fly)."""
    name: str
    dtypes: tuple[torch.dtype, ...]
    available: Callable[[torch.dtype], bool]
    pack: Callable | None
    linear: Callable
    # the same product followed, in the kernel's own pass over the output, by an activation
    # (`with_activation(x, packed, w, b, ONEDNN_ACTIVATIONS[...])`) or by `+ residual`
    # (`with_residual(x, packed, w, b, residual)`); None where the kernel has no such epilogue
    with_activation: Callable | None = None
    with_residual: Callable | None = None

    def pack_of(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return None if self.pack is None else self.pack(weight, bias)


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


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight quantized as the int8 mode quantizes a layer's (quantize.py): by the observer
    of torch.ao's default dynamic qconfig (per tensor, symmetric, int8)."""
    observer = torch.ao.quantization.default_dynamic_qconfig.weight()
    observer(weight.detach().float())
    scale, zero_point = observer.calculate_qparams()
    return torch.quantize_per_tensor(weight.detach().float(), float(scale), int(zero_point), torch.qint8)


def int8_pack(name: str, weight: torch.Tensor, bias: torch.Tensor | None):
    """An int8 layer's quantized weight and float bias packed for the int8 kernel `name`: for a
    quantized engine's kernel, its packed parameters; for the int8 GEMV, what it reads."""
    if name == INT8_GEMV:
        return gemv.int8_pack(weight, bias)
    with quantized_engine(INT8_ENGINES[name]):
        return torch.ops.quantized.linear_prepack(weight, bias)


def _has_onednn(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _int8_kernel(name: str, available: Callable[[torch.dtype], bool], linear: Callable,
                 with_activation: Callable | None = None) -> Kernel:
    """An int8 kernel, which `pack`s a float weight (a sample timed) as the int8 mode quantizes it."""
    return Kernel(name, (torch.qint8,), available, lambda w, b: int8_pack(name, quantize_weight(w), b), linear,
                  with_activation)


def _engine_kernel(name: str) -> Kernel:
    engine = INT8_ENGINES[name]
    return _int8_kernel(name, lambda dtype: engine in torch.backends.quantized.supported_engines,
                        lambda x, packed, w, b: torch.ops.quantized.linear_dynamic(x, packed, reduce_range=True))


KERNELS = {kernel.name: kernel for kernel in [
    Kernel(PLAIN, (torch.float32, torch.bfloat16), lambda dtype: True, None, lambda x, packed, w, b: F.linear(x, w, b)),
    Kernel("mkl", (torch.float32,), lambda dtype: torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear"),
           lambda w, b: torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS),
           lambda x, packed, w, b: torch.ops.mkl._mkl_linear(x, packed, w, b, x.numel() // x.shape[-1])),
    Kernel("onednn", (torch.float32, torch.bfloat16), _has_onednn,
           lambda w, b: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
           lambda x, packed, w, b: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
           lambda x, packed, w, b, activation: torch.ops.mkldnn._linear_pointwise(x, packed, b, *activation),
           lambda x, packed, w, b, residual: torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, b, "add")),
    # The project's own, for one or two rows (gemv.py): reads the weight as nn.Linear holds it.
    Kernel(GEMV, (torch.float32, torch.bfloat16), lambda dtype: gemv.available(), None,
           lambda x, packed, w, b: gemv.linear(x, w, b),
           lambda x, packed, w, b, activation: gemv.linear(x, w, b, activation[0], activation[2]),
           lambda x, packed, w, b, residual: gemv.linear(x, w, b, residual=residual)),
    Kernel(GEMV_IN_ORDER, (torch.float32, torch.bfloat16), lambda dtype: gemv.available(), None,
           lambda x, packed, w, b: gemv.linear(x, w, b, in_order=True),
           lambda x, packed, w, b, activation: gemv.linear(x, w, b, activation[0], activation[2], in_order=True),
           lambda x, packed, w, b, residual: gemv.linear(x, w, b, residual=residual, in_order=True)),
    # The int8 mode's (INT8_ENGINES, as torch.ao's dynamic linear calls them, and the int8 GEMV).
    # Weight-only int8 (aten._weight_int8pack_mm) is left out: far slower at a decode's rows
    # (docs/notes/kernel-ops.md#weight-only-int8).
    *[_engine_kernel(name) for name in INT8_ENGINES],
    _int8_kernel(INT8_GEMV, lambda dtype: gemv.available(), lambda x, packed, w, b: gemv.int8_linear(x, packed),
                 lambda x, packed, w, b, activation: gemv.int8_linear(x, packed, activation[0], activation[2])),
]}


def available(dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the kernels this torch build runs on the CPU for weights of `dtype`."""
    return [k.name for k in KERNELS.values() if dtype in k.dtypes and k.available(dtype)]


# The activations oneDNN applies in its matmul's pass over the output: (module class, its
# `approximate`) -> (post-op, scalars, algorithm); each the same function as the module's
ONEDNN_ACTIVATIONS = {("GELU", "tanh"): ("gelu", [], "tanh"), ("GELU", "none"): ("gelu", [], "none"),
                      ("ReLU", None): ("relu", [], "")}


def post_op(activation: nn.Module | None) -> tuple | None:
    """The ONEDNN_ACTIVATIONS post-op that computes `activation` (None: none, or no such post-op)."""
    if activation is None:
        return None
    return ONEDNN_ACTIVATIONS.get((type(activation).__name__, getattr(activation, "approximate", None)))


@dataclass(frozen=True)
class Plan:
    """Which kernel serves which row counts: `ranges` holds (most rows, kernel name) in rising
    order, the last one unbounded; each is `packed` or a kernel that needs no pack (PLAIN, the GEMVs).
    `packed` is the one kernel the layers hold a pack of (PLAIN: none); int8 layers hold INT8's
    and a pack of their own for any other int8 kernel named. `seconds` holds what the
    choice was made from: {kernel: {rows: seconds}}; `source` says how it was made (measured,
    the rule, forced)."""
    packed: str
    ranges: tuple[tuple[float, str], ...]
    seconds: dict = field(default_factory=dict, compare=False)
    source: str = field(default="measured", compare=False)
    # whether `packed` applies a GELU in its own pass over the output, or the GELU runs after it as
    # an operator of its own: measured (planner.py gelu_fuses)
    fused_gelu: bool = True

    def describe(self) -> str:
        """e.g. "linear up to 2 rows, onednn above (measured)"."""
        spans = []  # consecutive ranges of one kernel merged
        for most, name in self.ranges:
            if spans and spans[-1][1] == name:
                spans[-1] = (most, name)
            else:
                spans.append((most, name))
        words = [f"{name} up to {most} rows" for most, name in spans[:-1]]
        words.append(spans[-1][1] + (" above" if words else " at every row count"))
        gelu = "" if self.fused_gelu or KERNELS[self.packed].pack is None else f", GELU after {self.packed}'s matmul"
        return f"{', '.join(words)}{gelu} ({self.source})"

    @property
    def plain(self) -> bool:
        """Whether F.linear serves every row count."""
        return all(name == PLAIN for _, name in self.ranges)

    def kernel_for(self, rows: int) -> Kernel:
        for most, name in self.ranges:
            if rows <= most:
                return KERNELS[name]
        return KERNELS[self.ranges[-1][1]]

    @classmethod
    def only(cls, name: str, source: str = "forced") -> "Plan":
        return cls(name, ((math.inf, name),), source=source)
