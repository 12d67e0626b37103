"""The nn.Linear a planned layer becomes at load (planner.py pack_linears swaps its class): it holds its
weight packed for its plan's kernel and computes with that kernel, in its own pass over the output
applying an activation or adding a residual where the kernel can (`fused`, which the model's layers
call through nanogpt/layers.py `project`)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn import functional as F

from nanogpt.kernels import ops
from nanogpt.kernels.matmuls import KERNELS, Kernel, Plan, post_op


class KernelLinear(nn.Linear):
    """An nn.Linear that also holds its weight packed for its plan's kernel (not a parameter: the
    state_dict is unchanged). The pack is a snapshot: once the weight changes, or under autograd,
    the layer computes as a plain nn.Linear again. Under torch.compile it is one opaque call
    (`nanoserve::linear`, ops.py) to the same kernel, so that a compiled graph runs the packed
    weights without inductor's weight freezing, whose packed constants its compile cache cannot store."""

    def set_plan(self, plan: Plan) -> None:
        self._plan = plan
        with torch.no_grad():
            self._packed = KERNELS[plan.packed].pack_of(self.weight.detach(), None)
        self._packed_from = self._weight_state()
        if getattr(self, "_handle", None) is None:
            self._handle = ops.register(self)
        ops.publish(self, plan, {plan.packed: self._packed}, self.weight)

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

    def fused(self, x: torch.Tensor, activation: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """activation(self(x)) or residual + self(x) in the matmul's own pass over the output, where
        the kernel serving x has that epilogue (oneDNN's, the GEMV's): it saves a pass over the
        output and an operator call. None where it has not."""
        post = post_op(activation)
        if torch.compiler.is_compiling():
            if post is not None and self._plan is not None and not self._plan.plain \
                    and _fuses(self._plan, post, _traced_kernel(self._plan, x.numel() // x.shape[-1])):
                return torch.ops.nanoserve.linear(x, self.weight, self.bias, self._handle, post[0], post[2])
            return None
        kernel = self.kernel(x)
        if kernel is None:
            return None
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        if post is not None and kernel.with_activation is not None and _fuses(self._plan, post, kernel.name):
            return kernel.with_activation(x, self._packed, weight, bias, post)
        if residual is not None and kernel.with_residual is not None and residual.dtype == x.dtype \
                and residual.is_contiguous() and residual.shape == (*x.shape[:-1], self.out_features):
            return kernel.with_residual(x, self._packed, weight, bias, residual)
        return None


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
    than a GELU of its own (planner.py gelu_fuses)."""
    return plan.fused_gelu or post[0] != "gelu" or kernel not in (None, plan.packed)
