"""Prepacked weights for the small matmuls of CPU decoding (float32).

A decode step multiplies a few rows (one per running sequence) by every weight matrix. MKL's plain
sgemm repacks the whole weight into its blocked layout on every call, which at 4-64 rows costs
about as much as the multiplication itself; packing each weight once (MKL's packed GEMM, what
inductor's weight freezing emits for float32 linears) measured 1.5-2.2x faster for the weight
matmuls of a GPT-2 small decode step at 8-64 rows. One row (a GEMV) gains nothing, and large
prefills are faster unpacked, so those keep the ordinary path.

The packed copy costs about as much memory as the weights themselves. The results differ from
the unpacked ones only by float32 rounding (a different summation order).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

# The layout MKL packs for depends on the row count it is told; packed for 64 rows it serves
# 2-256 rows at least as fast as packed for each count (measured; packed for 8 it is slow at 32+).
PACK_ROWS = 64
PACKED_ROWS = range(2, 257)  # rows of one call that use the packed weight


def available() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight in MKL's packed layout (not a parameter: the
    state_dict is unchanged). The pack is a snapshot: once the weight changes, or under autograd,
    the layer computes as a plain nn.Linear again."""

    def pack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), PACK_ROWS)
        self._packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:  # training: the pack has no gradient
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        # a compiled graph (inductor with weight freezing, per batch size) always takes the pack
        if torch.compiler.is_compiling() or (rows in PACKED_ROWS and self._packed_version == self.weight._version):
            return torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Turn every float32 nn.Linear of a CPU model into a PackedLinear in place (the class of the
    same module object changes: parameters, weight tying and state_dict stay as they are), and
    repack those whose weights changed since. Returns how many layers hold a current pack; 0
    where MKL's packed GEMM is not available."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, PackedLinear) and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear
                module._packed_version = None
            if module._packed_version != module.weight._version:
                module.pack()
            count += 1
    return count
