"""The packed layers as ops of compiled graphs: `nanoserve::linear` (a float layer, linear.py) and
`nanoserve::int8_linear` (an int8 layer, quantize.py), each naming its layer by a handle.

A handle is a constant of the graph, so the graph and its compile-cache entry stay free of the
packed tensors, which cannot be pickled, and dynamo never traces a packed weight (an int8 one is a
TorchScript object). Where the project's extension is built, the ops' CPU kernels are C++
(csrc/layer_ops.cpp), told each layer's plan by `publish`; elsewhere they are Python's.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.kernels import extension
from nanogpt.kernels.matmuls import Plan

# Packed layers by handle
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
    and that kernel's pack (`packs`, by kernel name). Where the project's C++ ops serve they hold
    this copy; `weight`, the float weight packed, is checked on every call (another tensor or an
    in-place change: a plain linear), an int8 layer's packs are used as given."""
    if _own_ops():
        extension.extension().set_layer(layer._handle, weight, [float(most) for most, _ in plan.ranges],
                                        [name for _, name in plan.ranges],
                                        [packs.get(name) for _, name in plan.ranges])


@functools.cache
def _own_ops() -> bool:
    """Whether the ops' CPU kernels are the C++ ones of the project's extension (registered when it
    loads); else `_define_cpu_ops` gives them Python's."""
    return extension.available()


# Defined through torch.library.Library rather than torch.library.custom_op: a compiled step calls
# the op once per layer, and Library's dispatch costs a third of custom_op's
# (docs/notes/kernel-ops.md#ops-in-compiled-graphs).
_LIBRARY = torch.library.Library("nanoserve", "DEF")
# `activation`, `algorithm`: an ONEDNN_ACTIVATIONS post-op applied to the output ("none": none), in
# the kernel's own pass over the output where it has one, which saves a pass of its own
_LIBRARY.define("linear(Tensor x, Tensor weight, Tensor? bias, int handle, str activation='none', "
                "str algorithm='') -> Tensor")
_LIBRARY.impl("linear", lambda x, weight, bias, handle, activation="none", algorithm="":
              x.new_empty(*x.shape[:-1], weight.shape[0]), "Meta")
# `out_features` gives the output's shape without running the layer; `activation`, `algorithm` as
# for `linear`, applied to the int8 kernel's output as it leaves the op
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
    """The ops' CPU kernels in Python, where the project's C++ ones are not built (each call then
    enters the interpreter)."""
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
