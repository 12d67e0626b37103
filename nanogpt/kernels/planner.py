"""Matmul kernels for CPU inference, chosen per machine when a model is loaded.

A decode step multiplies a few rows (one per running sequence) by every weight matrix, and which
kernel does that fastest depends on the CPU and on the row count: PyTorch's plain `F.linear`
(a GEMM that lays the weight out anew on every call), MKL's packed GEMM and oneDNN's prepacked
linear (`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`, what inductor's weight
freezing emits) each pack a weight once, and they rank differently on AVX2, AVX-512 and AVX-512
+ BF16 CPUs, at one row, at a few dozen and at a prefill's hundreds. At one or two rows the
project's own GEMV (nanogpt/gemv.py), which reads the weight as nn.Linear holds it, is faster than
all of them where it is built. So `pack_linears` times the kernels this machine offers on a sample
of the model's own weights at a few row counts (1-5 s for GPT-2 small: the sample outgrows the
last-level cache), and every nn.Linear then holds the chosen kernel's packed weight and uses it
for the row counts where no kernel that needs no pack (F.linear, the GEMV) serves them better. Where the timing cannot be
trusted (other processes busy), a rule measured on this project's CPUs decides (RULE).
docs/notes/kernel-plan.md has the measurements.

Every kernel multiplies in the weights' dtype (float32 or bfloat16) with the same products; the
kernels differ only in summation order, so float32 results stay within float32 rounding of
`F.linear`. A packed copy costs as much memory as the weights it packs. Under torch.compile a
packed layer is one opaque op (`nanoserve::linear`), so compiled graphs run the same kernels
and stay storable in the compile cache (nanogpt/compile_cache.py); the op's CPU kernel is C++
(nanogpt/layer_ops.cpp) where the project's extension is built, handed each layer's plan by
`publish`.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn import functional as F

from nanogpt import extension, gemv
from nanogpt.quantize import Int8Linear, quantize_weight, quantized_engine

PLAIN = "linear"
GEMV = "gemv"
INT8_GEMV = "int8-gemv"  # the int8 mode's (nanogpt/int8_gemv.cpp)
# The kernels that are not PyTorch's: left out of the benchmarks' ceiling, which the issue's
# targets define as the fastest kernel PyTorch offers
OWN = (GEMV, INT8_GEMV)
# The packed kernels lay a weight out for a row count they are told; packed for 64 rows, both
# served 1-1024 rows as fast as packed for each count (measured; MKL packed for 8 is slow at 32+).
PACK_ROWS = 64
# Row counts timed when choosing; each stands for the rows up to the geometric mean with the
# next (1: 1-2, 4: 3-5, 8: 6-22, 64: 23-128, 256: the rest), i.e. one sequence, a few, a small
# batch, a large batch, a prefill chunk (the engine feeds at most 256 prompt tokens a step). 4 has
# its own timing because the GEMV's lead over the packed kernels is largest there on some CPUs
# (1.3-1.4x oneDNN at 4 rows on an AVX2 EPYC, 1.2-1.5x at 8: docs/notes/kernel-plan.md#timed-rows).
TIMED_ROWS = (1, 4, 8, 64, 256)
# The sample of the model's weights timed: the first layers in module order up to this size or
# twice the CPU's last-level cache, whichever is larger (`sample_bytes`), so that the timed weights
# stream from memory as in a real step rather than sit in the cache.
SAMPLE_BYTES = 32 << 20
# Timing stops repeating after this many seconds (at least one timed pass each), so that a busy
# machine does not hold up a start for long.
TIME_BUDGET = 1.0
ENV = "NANOSERVE_KERNEL"  # force one kernel at every row count (benchmarks, diagnosis)
# Where the timing cannot be trusted, the first available of these serves every row count: on an
# AVX-512 + BF16 CPU oneDNN's prepacked linear measured fastest at 1-1024 rows in float32 and
# bfloat16, ahead of MKL's packed GEMM, itself ahead of F.linear from 8 rows on an AVX-512 Xeon.
RULE = ("onednn", "mkl", PLAIN)
# ... except at up to gemv.ROWS rows, which the project's own GEMV serves where it is built (int8:
# its int8 GEMV, before INT8).
# A 2-thread matmul waits for its second thread at every call when another process holds a core,
# which slows some kernels tenfold at one row and others hardly: timings taken while other
# processes used more than this many cores are not trusted.
QUIET_CORES = 0.3
# The int8 mode's kernels: torch.ao's dynamically quantized linear (x quantized on the fly) with
# its weight packed by one of PyTorch's quantized engines, and the project's int8 GEMV, which
# computes what fbgemm's does. INT8, fbgemm's (through the "x86" engine), is what every int8 layer
# holds; oneDNN's runs the same int8 products on AMX's tiles where the CPU has them (int8 layers
# pack for the others where their plan gives them rows).
INT8 = "int8-dynamic"
INT8_ENGINES = {INT8: "x86", "int8-onednn": "onednn"}
# Timings of one kernel move by up to ~20% between runs on these machines: a measurement departs
# from RULE only where another kernel was faster by more than that.
MARGIN = 1.25
# A GELU leaves the packed kernel's own pass only where that pass was this much slower (`gelu_fuses`):
# fused saves an operator call and a pass over the output, which the timing of one layer ignores.
GELU_MARGIN = 1.1


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


def _has_onednn(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def int8_pack(name: str, weight: torch.Tensor, bias: torch.Tensor | None):
    """An int8 layer's quantized weight and float bias (nanogpt/quantize.py) packed for the int8 kernel
    `name`: for a quantized engine's kernel, its packed parameters; for the int8 GEMV, what it reads."""
    if name == INT8_GEMV:
        return gemv.int8_pack(weight, bias)
    with quantized_engine(INT8_ENGINES[name]):
        return torch.ops.quantized.linear_prepack(weight, bias)


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
    # The project's own, for one or two rows (nanogpt/gemv.py): reads the weight as nn.Linear holds it.
    Kernel(GEMV, (torch.float32, torch.bfloat16), lambda dtype: gemv.available(), None,
           lambda x, packed, w, b: gemv.linear(x, w, b),
           lambda x, packed, w, b, activation: gemv.linear(x, w, b, activation[0], activation[2]),
           lambda x, packed, w, b, residual: gemv.linear(x, w, b, residual=residual)),
    # The int8 mode's (INT8_ENGINES, as torch.ao's dynamic linear calls them, and the int8 GEMV).
    # Weight-only int8 (aten._weight_int8pack_mm) is left out: 6 tok/s for GPT-2 small's decode matmuls.
    *[_engine_kernel(name) for name in INT8_ENGINES],
    _int8_kernel(INT8_GEMV, lambda dtype: gemv.available(), lambda x, packed, w, b: gemv.int8_linear(x, packed),
                 lambda x, packed, w, b, activation: gemv.int8_linear(x, packed, activation[0], activation[2])),
]}


def available(dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the kernels this torch build runs on the CPU for weights of `dtype`."""
    return [k.name for k in KERNELS.values() if dtype in k.dtypes and k.available(dtype)]


@dataclass(frozen=True)
class Plan:
    """Which kernel serves which row counts: `ranges` holds (most rows, kernel name) in rising
    order, the last one unbounded; each is `packed` or a kernel that needs no pack (PLAIN, GEMV).
    `packed` is the one kernel the layers hold a pack of (PLAIN: none); int8 layers hold INT8's
    and a pack of their own for any other int8 kernel named. `seconds` holds what the
    choice was made from: {kernel: {rows: seconds}}; `source` says how it was made (measured,
    the rule, forced)."""
    packed: str
    ranges: tuple[tuple[float, str], ...]
    seconds: dict = field(default_factory=dict, compare=False)
    source: str = field(default="measured", compare=False)
    # whether `packed` applies a GELU in its own pass over the output (`project`), or the GELU
    # runs after it as an operator of its own: measured (`gelu_fuses`)
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
        gelu = "" if self.fused_gelu or self.packed in (PLAIN, GEMV) else f", GELU after {self.packed}'s matmul"
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


class KernelLinear(nn.Linear):
    """An nn.Linear that also holds its weight packed for its plan's kernel (not a parameter: the
    state_dict is unchanged). The pack is a snapshot: once the weight changes, or under autograd,
    the layer computes as a plain nn.Linear again. Under torch.compile it is one opaque call
    (`nanoserve::linear`) to the same kernel, so that a compiled graph runs the packed weights
    without inductor's weight freezing, whose packed constants its compile cache cannot store."""

    def set_plan(self, plan: Plan) -> None:
        self._plan = plan
        with torch.no_grad():
            self._packed = KERNELS[plan.packed].pack_of(self.weight.detach(), None)
        self._packed_from = self._weight_state()
        if getattr(self, "_handle", None) is None:
            self._handle = register(self)
        publish(self, plan, {plan.packed: self._packed}, self.weight)

    def _weight_state(self) -> tuple:
        # what identifies the weight packed: in-place changes bump _version; model.to() and
        # load_state_dict(assign=True) put another tensor in its place
        return self.weight.data_ptr(), self.weight._version, self.weight.dtype

    def is_current(self) -> bool:
        return self._plan is not None and self._packed_from == self._weight_state()

    def kernel(self, x: torch.Tensor) -> Kernel | None:
        """The kernel that multiplies x with the packed weight, or None where the layer computes as
        a plain nn.Linear (no pack, a changed weight, autograd, another dtype). Read on every call
        of every layer, so the parameters are read from _parameters (nn.Module's __getattr__ costs
        microseconds, a forward calls this ~50 times)."""
        w = self._parameters["weight"]
        if self._plan is None or (w.requires_grad and torch.is_grad_enabled()) or x.dtype != w.dtype \
                or self._packed_from != (w.data_ptr(), w._version, w.dtype):
            return None
        return self._plan.kernel_for(x.numel() // x.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self._plan is None or self._plan.plain:
                return F.linear(x, self.weight, self.bias)
            return torch.ops.nanoserve.linear(x, self.weight, self.bias, self._handle)
        kernel = self.kernel(x)
        if kernel is None:
            return F.linear(x, self.weight, self.bias)
        return kernel.linear(x, self._packed, self._parameters["weight"], self._parameters["bias"])


# The activations oneDNN applies in its matmul's pass over the output: (module class, its
# `approximate`) -> (post-op, scalars, algorithm); each the same function as the module's
ONEDNN_ACTIVATIONS = {("GELU", "tanh"): ("gelu", [], "tanh"), ("GELU", "none"): ("gelu", [], "none"),
                      ("ReLU", None): ("relu", [], "")}


def project(layer: nn.Module, x: torch.Tensor, activation: nn.Module | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(layer(x)), or residual + layer(x): in the matmul's own pass over the output where
    the layer's kernel has such an epilogue (oneDNN), which saves a pass over the output and an
    operator call per layer, or as the output leaves the project's int8 op; else as written. `layer` is any linear module (packed or not,
    quantized); the activation an nn.GELU or nn.ReLU (others are applied after)."""
    if activation is not None and residual is not None:
        return residual + project(layer, x, activation)
    post = None if activation is None else \
        ONEDNN_ACTIVATIONS.get((type(activation).__name__, getattr(activation, "approximate", None)))
    if type(layer) is Int8Linear and layer._handle is not None and post is not None:
        return torch.ops.nanoserve.int8_linear(x, layer._handle, layer.out_features, post[0], post[2])
    if type(layer) is KernelLinear and torch.compiler.is_compiling():
        if post is not None and layer._plan is not None and not layer._plan.plain \
                and _fuses(layer._plan, post, _traced_kernel(layer._plan, x.numel() // x.shape[-1])):
            return torch.ops.nanoserve.linear(x, layer.weight, layer.bias, layer._handle, post[0], post[2])
    elif type(layer) is KernelLinear:
        kernel = layer.kernel(x)
        if kernel is not None and post is not None and kernel.with_activation is not None \
                and _fuses(layer._plan, post, kernel.name):
            return kernel.with_activation(x, layer._packed, layer._parameters["weight"], layer._parameters["bias"], post)
        if kernel is not None and residual is not None and kernel.with_residual is not None \
                and residual.dtype == x.dtype and residual.is_contiguous() \
                and residual.shape == (*x.shape[:-1], layer.out_features):
            return kernel.with_residual(x, layer._packed, layer._parameters["weight"], layer._parameters["bias"],
                                        residual)
    y = layer(x)
    if activation is not None:
        y = activation(y)
    return y if residual is None else residual + y


def _traced_kernel(plan: Plan, rows) -> str | None:
    """The kernel `plan` gives `rows` where a graph being traced knows them; None (the packed one's
    choice) where its rows vary. Compared as plain sizes, the plan's ranges would become the
    graph's guards, and a step whose rows crossed one would compile another graph mid-serving."""
    for most, name in plan.ranges:
        if most == math.inf or statically_known_true(rows <= most):
            return name
        if not statically_known_true(rows > most):
            return None
    return plan.ranges[-1][1]


def _fuses(plan: Plan, post: tuple, kernel: str | None) -> bool:
    """Whether `kernel` (the one `plan` gives the rows; None: the packed one) applies the activation
    `post` in its own pass: all but a GELU in a packed kernel whose plan measured that pass slower
    than a GELU of its own (`gelu_fuses`)."""
    return plan.fused_gelu or post[0] != "gelu" or kernel not in (None, plan.packed)


# Packed layers by handle: a compiled graph names a layer by its handle (a constant of the graph,
# so the graph and its cache entry stay free of the packed tensors, which cannot be pickled)
_LAYERS: list[weakref.ref] = []


def register(layer: nn.Module) -> int:
    """A handle by which compiled graphs call `layer` (`nanoserve::linear`, `nanoserve::int8_linear`)."""
    _define_cpu_ops()
    _LAYERS.append(weakref.ref(layer))
    handle = len(_LAYERS) - 1
    if _own_ops():
        weakref.finalize(layer, extension.extension().drop_layer, handle)
    return handle


def publish(layer: nn.Module, plan: Plan, packs: dict[str, object], weight: torch.Tensor | None = None) -> None:
    """What the ops of compiled graphs run for `layer` at each range of row counts: its plan's kernel
    and that kernel's pack (`packs`, by kernel name). Where the project's C++ ops serve (nanogpt/
    layer_ops.cpp) they hold this copy; `weight`, the float weight packed, is checked on every call
    (another tensor or an in-place change: a plain linear), an int8 layer's packs are used as given."""
    if _own_ops():
        extension.extension().set_layer(layer._handle, weight, [float(most) for most, _ in plan.ranges],
                                        [name for _, name in plan.ranges],
                                        [packs.get(name) for _, name in plan.ranges])


@functools.cache
def _own_ops() -> bool:
    """Whether the ops' CPU kernels are the C++ ones of the project's extension (registered when it
    loads); else `_define_cpu_ops` gives them Python's."""
    return extension.available()


# The packed layers' op inside compiled graphs, defined through torch.library.Library rather than
# torch.library.custom_op: a compiled step calls it once per layer, and its dispatch costs ~7 µs a
# call against custom_op's ~20 (measured on 49 calls of a compiled function).
_LIBRARY = torch.library.Library("nanoserve", "DEF")
# `activation`, `algorithm`: an ONEDNN_ACTIVATIONS post-op applied to the output ("none": none), in
# the kernel's own pass over the output where it has one (about 1 ms a step at 32 rows for GPT-2
# small's GELUs as a pass of their own).
_LIBRARY.define("linear(Tensor x, Tensor weight, Tensor? bias, int handle, str activation='none', "
                "str algorithm='') -> Tensor")
_LIBRARY.impl("linear", lambda x, weight, bias, handle, activation="none", algorithm="":
              x.new_empty(*x.shape[:-1], weight.shape[0]), "Meta")
# An int8 layer (nanogpt/quantize.py) as one op of a compiled graph: dynamo cannot trace its packed
# weight (a TorchScript object); `out_features` gives the output's shape without running it.
# `activation`, `algorithm` as for `linear`: applied to the int8 kernel's output as it leaves the op
# (in C++, GPT-2's GELU by a form ~2.5x faster than PyTorch's, nanogpt/vec.h).
_LIBRARY.define("int8_linear(Tensor x, int handle, int out_features, str activation='none', str algorithm='') "
                "-> Tensor")
_LIBRARY.impl("int8_linear", lambda x, handle, out_features, activation="none", algorithm="":
              x.new_empty(*x.shape[:-1], out_features), "Meta")
# the post-ops as functions, for the kernels without that epilogue
_POST_OPS = {"gelu": lambda y, algorithm: F.gelu(y, approximate=algorithm), "relu": lambda y, algorithm: F.relu(y)}


def _post_op(y: torch.Tensor, activation: str, algorithm: str) -> torch.Tensor:
    return y if activation == "none" else _POST_OPS[activation](y, algorithm)


@functools.cache
def _define_cpu_ops() -> None:
    """The ops' CPU kernels in Python, where the project's C++ ones are not built: each call enters
    the interpreter (15-25 µs, against ~1 in C++)."""
    if not _own_ops():
        _LIBRARY.impl("linear", _compiled_linear, "CPU")
        _LIBRARY.impl("int8_linear", lambda x, handle, out_features, activation="none", algorithm="":
                      _post_op(_LAYERS[handle]()(x), activation, algorithm), "CPU")


def _compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: int,
                     activation: str = "none", algorithm: str = "") -> torch.Tensor:
    layer = _LAYERS[handle]()
    kernel = None if layer is None or layer._parameters["weight"].data_ptr() != weight.data_ptr() else layer.kernel(x)
    if activation != "none" and kernel is not None and kernel.with_activation is not None:
        return kernel.with_activation(x, layer._packed, weight, bias, (activation, [], algorithm))
    y = F.linear(x, weight, bias) if kernel is None else kernel.linear(x, layer._packed, weight, bias)
    return _post_op(y, activation, algorithm)


def pack_linears(model: nn.Module, kernel: str | None = None) -> int:
    """Give every CPU float32 / bfloat16 nn.Linear of `model` the fastest kernel this machine has
    for it (in place: the class of the same module object changes; parameters, weight tying and
    state_dict stay as they are), and repack those whose weights changed since; likewise every
    int8 layer (nanogpt/quantize.py) the fastest int8 kernel for each row count. The kernel is
    chosen by timing (`choose`), or forced by `kernel` or the NANOSERVE_KERNEL environment
    variable. Returns how many layers hold a current pack (0 where plain F.linear won)."""
    kernel = kernel or os.environ.get(ENV) or None
    layers = [m for m in model.modules() if type(m) in (nn.Linear, KernelLinear)
              and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32, torch.bfloat16)]
    count = 0
    for dtype in {m.weight.dtype for m in layers}:
        for group in _planned_together(model, [m for m in layers if m.weight.dtype == dtype]):
            plan = Plan.only(_check(kernel, dtype)) if kernel else \
                choose(group, gelu=getattr(model, "output_layer", None) not in group)
            for module in group:
                if type(module) is nn.Linear:
                    module.__class__ = KernelLinear
                    module._plan = None
                if module._plan != plan or not module.is_current():
                    module.set_plan(plan)
                count += plan.packed != PLAIN
    for group in _planned_together(model, [m for m in model.modules() if isinstance(m, Int8Linear)]):
        plan = Plan.only(_check(kernel, torch.qint8)) if kernel else choose(group)
        for module in group:
            if module._plan != plan or module._packed_from is not module._packed_params._packed_params:
                module.set_plan(plan)
        count += len(group)
    return count


def _planned_together(model: nn.Module, layers: list[nn.Module]) -> list[list[nn.Module]]:
    """The groups of `layers` that share one plan: the output head (a serving model's
    `output_layer`, vocabulary x width) on its own, the others together. Kernels cross over at other
    row counts on the head's shape: int8's at 2-8 rows there, at ~22 in GPT-2 small's blocks
    (docs/notes/kernel-plan.md#head)."""
    head = getattr(model, "output_layer", None)
    groups = [[m for m in layers if m is not head], [m for m in layers if m is head]]
    return [group for group in groups if group]


def _plans_of(model: nn.Module) -> dict[str, Plan]:
    """{weight dtype's name ("int8" for int8 layers; "... head" for the output head's): plan} of the
    model's planned layers, the blocks' first."""
    head = getattr(model, "output_layer", None)
    plans = {}
    for m in model.modules():
        if isinstance(m, (KernelLinear, Int8Linear)) and m._plan is not None:
            dtype = "int8" if isinstance(m, Int8Linear) else str(m.weight.dtype).removeprefix("torch.")
            plans.setdefault(dtype + " head" if m is head else dtype, m._plan)
    return dict(sorted(plans.items(), key=lambda item: item[0].endswith(" head")))


def describe(model: nn.Module) -> str | None:
    """The plans of the model's packed layers, for a log line (None when it has none)."""
    return "; ".join(f"{dtype}: {plan.describe()}" for dtype, plan in _plans_of(model).items()) or None


def row_costs(model: nn.Module) -> dict[int, float] | None:
    """How the cost of the model's weight matmuls grows with the rows of a forward: {rows: seconds}
    of the timed sample at TIMED_ROWS, each with the kernel its plan gives those rows (None where
    no plan was timed: forced, GPU)."""
    plan = next((plan for plan in _plans_of(model).values() if plan.seconds), None)
    if plan is None:
        return None
    return {rows: plan.seconds[plan.kernel_for(rows).name][rows] for rows in _timed_rows(plan.seconds)}


def _check(name: str, dtype: torch.dtype) -> str:
    if name not in available(dtype):
        raise ValueError(f"kernel {name!r} does not run {str(dtype).removeprefix('torch.')} here; "
                         f"available: {', '.join(available(dtype))}")
    return name


# ---- choosing by measurement ----

_plans: dict[tuple, Plan] = {}  # one measurement per weight shapes, dtype and thread count


def choose(layers: list[nn.Module], gelu: bool = False) -> Plan:
    """Time every available kernel on a sample of `layers` (all float32, all bfloat16 or all int8)
    at TIMED_ROWS and choose from the timings (`plan_from`, `plan_int8`); timings taken while
    other processes were busy give way to RULE (int8: INT8). `gelu`: the layers include MLPs'
    first layers, whose GELU the packed kernel may take into its pass (`gelu_fuses`)."""
    int8 = isinstance(layers[0], Int8Linear)
    # int8's kernels both read packed int8 weights, which a cached sample favours alike (the plans
    # from 32 MB and from every layer agreed), and each int8 layer timed costs a repacking: the
    # fixed sample there
    sample = _sample(layers, SAMPLE_BYTES if int8 else sample_bytes())
    weights = [(m.weight().dequantize(), m.bias()) if int8 else
               (m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in sample]
    dtype = torch.qint8 if int8 else weights[0][0].dtype
    key = (dtype, tuple(tuple(w.shape) for w, _ in weights), torch.get_num_threads(), gelu)
    if key not in _plans:
        others = OtherProcesses()
        seconds = time_kernels(weights, available(dtype), TIMED_ROWS)
        busy = others.cores()
        if busy <= QUIET_CORES:
            plan = plan_int8(seconds) if int8 else plan_from(seconds)
            if gelu and not int8:
                fused = gelu_fuses(weights, plan)
                if others.cores() <= QUIET_CORES:  # still quiet while the GELU was timed
                    plan = replace(plan, fused_gelu=fused)
            _plans[key] = plan
        else:
            source = f"rule: other processes used {busy:.1f} cores while timing"
            packed = INT8 if int8 else next(name for name in RULE if name in seconds)
            _plans[key] = Plan(packed, tuple((most, _rule(seconds, packed, r)) for most, r in _row_ranges(seconds)),
                               seconds, source)
    return _plans[key]


def _rule(names, packed: str, rows: int) -> str:
    """The kernel RULE gives `rows` where `names` are available and `packed` is packed (INT8: int8's)."""
    own = INT8_GEMV if packed == INT8 else GEMV
    return own if own in names and rows <= gemv.ROWS else packed


def _timed_rows(seconds: dict[str, dict[int, float]]) -> list[int]:
    return sorted(next(iter(seconds.values())))


def _row_ranges(seconds: dict[str, dict[int, float]]) -> list[tuple[float, int]]:
    """(most rows, timed rows) for each timed row count: it stands for the rows up to the geometric
    mean with the next."""
    rows = _timed_rows(seconds)
    return [(math.floor(math.sqrt(r * rows[i + 1])) if i + 1 < len(rows) else math.inf, r) for i, r in enumerate(rows)]


def plan_from(seconds: dict[str, dict[int, float]]) -> Plan:
    """The plan measured times {kernel: {rows: seconds}} give (PLAIN among the kernels): RULE's
    kernels unless the timings clearly say otherwise, i.e. another packed kernel was MARGIN times
    faster over all row counts (it is packed instead), or at some row count another kernel was
    MARGIN times faster than the rule's (it serves those rows; no pack is made where kernels
    that need none serve them all)."""
    plain = seconds[PLAIN]
    rows = sorted(plain)
    relative = {name: sum(by_rows[r] / plain[r] for r in rows) for name, by_rows in seconds.items()}
    unpacked = [name for name in seconds if KERNELS[name].pack is None]
    packed = next(name for name in RULE if name in seconds)
    challenger = min((name for name in relative if name not in unpacked and name != packed), key=relative.get,
                     default=None)
    if challenger and relative[challenger] * MARGIN < relative[packed]:
        packed = challenger
    ranges = []
    for most, r in _row_ranges(seconds):
        rule = _rule(seconds, packed, r)
        fastest = min([*unpacked, packed], key=lambda name: seconds[name][r])
        ranges.append((most, fastest if seconds[fastest][r] * MARGIN < seconds[rule][r] else rule))
    if all(name == PLAIN for _, name in ranges):
        return Plan(PLAIN, ((math.inf, PLAIN),), seconds)
    if all(name != packed for _, name in ranges):
        packed = PLAIN
    return Plan(packed, tuple(ranges), seconds)


def gelu_fuses(weights: list[tuple[torch.Tensor, torch.Tensor | None]], plan: Plan) -> bool:
    """Whether `plan`'s packed kernel should apply a GELU in its own pass over the output rather than
    leave it to an operator of its own, timed on the widest of `weights` (an MLP's first layer) at
    the TIMED_ROWS the kernel serves: fused unless that pass was GELU_MARGIN times slower, as
    oneDNN's tanh-GELU post-op was on an AVX2-only CPU (docs/notes/kernel-plan.md#gelu)."""
    kernel = KERNELS[plan.packed]
    rows = [r for most, r in _row_ranges(plan.seconds) if plan.kernel_for(r).name == plan.packed] if plan.seconds else []
    if kernel.with_activation is None or not rows:
        return True
    w, b = max(weights, key=lambda wb: (wb[0].shape[0] > wb[0].shape[1], wb[0].numel()))
    packed, gelu = kernel.pack_of(w, b), ONEDNN_ACTIVATIONS[("GELU", "tanh")]
    fused = separate = 0.0
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, w.shape[1], dtype=w.dtype)
            fused += best_seconds(lambda: kernel.with_activation(x, packed, w, b, gelu), 3, 0.01)
            separate += best_seconds(lambda: F.gelu(kernel.linear(x, packed, w, b), approximate="tanh"), 3, 0.01)
    return fused <= separate * GELU_MARGIN


def best_seconds(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """Best time of one call of fn over `repeats` timed batches (each long enough to time)."""
    fn()  # warm up: allocation, thread pool, packing
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    per_batch = max(1, calls)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        best = min(best, (time.perf_counter() - start) / per_batch)
    return best


def plan_int8(seconds: dict[str, dict[int, float]]) -> Plan:
    """The plan measured times {int8 kernel: {rows: seconds}} give: RULE's (INT8, whose pack every
    int8 layer holds, and the int8 GEMV up to gemv.ROWS rows) unless at some row count another int8
    kernel was MARGIN times faster (it serves those rows, from a pack of its own)."""
    ranges = []
    for most, r in _row_ranges(seconds):
        rule = _rule(seconds, INT8, r)
        fastest = min(seconds, key=lambda name: seconds[name][r])
        ranges.append((most, fastest if seconds[fastest][r] * MARGIN < seconds[rule][r] else rule))
    return Plan(INT8, tuple(ranges), seconds)


def time_kernels(weights: list[tuple[torch.Tensor, torch.Tensor | None]], kernels: list[str], rows,
                 repeats: int = 3, budget: float = TIME_BUDGET) -> dict[str, dict[int, float]]:
    """Best seconds of one pass of x @ W.T + b over every (W, b) of `weights`, in order, per kernel
    and row count, over `repeats` timed passes of each row count in turn (fewer once `budget`
    seconds have gone, at least one): the passes of many rows, the longest by far (an output head
    at 256 rows: 0.3 s), never take the repeats of the few rows a decode step runs. The kernels
    take turns within each repeat, so that a burst of other load on a shared machine hits them
    alike. On a GPU only PLAIN runs, timed to the device's completion."""
    device = weights[0][0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    packs = {name: [KERNELS[name].pack_of(w, b) for w, b in weights] for name in kernels}
    inputs = {r: {w.shape[1]: torch.randn(r, w.shape[1], dtype=w.dtype, device=device) for w, _ in weights}
              for r in rows}
    best = {name: {r: math.inf for r in rows} for name in kernels}
    started = time.perf_counter()
    with torch.no_grad():
        for i, r in enumerate(rows):
            xs = inputs[r]
            for repeat in range(-1 if i == 0 else 0, repeats):  # -1: a first pass warms up (allocations, thread pool)
                if repeat > 0 and time.perf_counter() - started > budget:
                    break
                for name in kernels:
                    linear = KERNELS[name].linear
                    sync()
                    start = time.perf_counter()
                    for (w, b), packed in zip(weights, packs[name]):
                        linear(xs[w.shape[1]], packed, w, b)
                    sync()
                    if repeat >= 0:
                        best[name][r] = min(best[name][r], time.perf_counter() - start)
    return best


def _sample(layers: list[nn.Module], enough: int = SAMPLE_BYTES) -> list[nn.Module]:
    """The first of `layers` up to `enough` bytes of weights."""
    sample, size = [], 0
    for module in layers:
        sample.append(module)
        weight = module.weight() if isinstance(module, Int8Linear) else module.weight
        size += weight.numel() * weight.element_size()
        if size >= enough:
            break
    return sample


@functools.cache
def sample_bytes() -> int:
    """How many bytes of a model's weights `choose` times: SAMPLE_BYTES, or twice the last-level
    cache where the CPU reports a larger one. A sample that fits the cache is read from it on every
    timed pass, which favours kernels that compute well over those that stream well: on a Xeon
    reporting a 480 MiB L3, GPT-2 small's first 33 MB timed the GEMV 1.6x faster than oneDNN at 8
    rows, where over all the blocks it is 1.2x slower (docs/notes/kernel-plan.md#sample)."""
    return max(SAMPLE_BYTES, 2 * last_level_cache_bytes())


def last_level_cache_bytes() -> int:
    """The largest cache the first CPU reports (sysfs; 0 where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=0)


def speedups(layers: list[nn.Linear], dtypes: list[torch.dtype], rows=(1, 8)) -> dict[torch.dtype, dict[int, float]]:
    """How many times faster the fastest kernel for each of `dtypes` (torch.bfloat16, torch.qint8)
    runs a sample of these float32 layers than the fastest float32 kernel: {dtype: {rows: factor}};
    {} when other processes were too busy for the timings to mean anything."""
    weights = [(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in _sample(layers, sample_bytes())]
    others = OtherProcesses()

    def fastest(weights, dtype):
        seconds = time_kernels(weights, available(dtype), rows, budget=TIME_BUDGET / 2)
        return {r: min(by_rows[r] for by_rows in seconds.values()) for r in rows}

    base = fastest(weights, torch.float32)
    out = {}
    for dtype in dtypes:
        cast = weights if dtype == torch.qint8 else [(w.to(dtype), None if b is None else b.to(dtype)) for w, b in weights]
        out[dtype] = {r: base[r] / s for r, s in fastest(cast, dtype).items()}
    return out if others.cores() <= QUIET_CORES else {}


# ---- how busy the machine is ----

def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait); 0 where
    there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except OSError:
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherProcesses:
    """Cores used by other processes than this one since it was made (/proc/stat counts 10 ms
    ticks, so a window of a few hundred ms or more is needed)."""

    def __init__(self):
        self._t, self._busy, self._own = time.monotonic(), busy_cpu_seconds(), time.process_time()

    def cores(self) -> float:
        wall = time.monotonic() - self._t
        foreign = (busy_cpu_seconds() - self._busy) - (time.process_time() - self._own)
        return max(0.0, foreign / wall) if wall > 0 else 0.0
