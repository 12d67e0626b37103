"""A GPU's layer norms, each adding the residual stream's pending sub-layer output in its own pass
(triton_norm.py): `fuse_layer_norms` swaps a model's nn.LayerNorm modules for ones with an
`add_fused`, which nanogpt/layers.py `add_norm` calls. A model's layers import none of this.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.kernels import triton_norm

log = logging.getLogger(__name__)


class AddsInOnePass:
    """What a swapped layer norm adds to its class: `add_fused`."""

    def add_fused(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + y, self(x + y)) by one kernel; None where it does not apply (autograd, a graph being
        compiled, whose compiler fuses the two itself, or operands it was not checked for)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != y.dtype \
                or x.dtype != self.weight.dtype or x.shape != y.shape:
            return None
        return triton_norm.add_layer_norm(x, y, self.weight, self.bias, self.eps)


@functools.cache
def _fused(cls: type) -> type:
    return type(f"Fused{cls.__name__}", (cls, AddsInOnePass), {})


def fuse_layer_norms(model: nn.Module) -> int:
    """Give every affine nn.LayerNorm of `model` on a GPU its one-pass add (in place: the module's
    class changes, its parameters stay), where the kernel serves its device, dtype and width
    (`add_norm_works`). Returns how many were swapped."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and not isinstance(module, AddsInOnePass) and module.weight is not None \
                and len(module.normalized_shape) == 1 and module.weight.is_cuda \
                and add_norm_works(module.weight.device, module.weight.dtype, module.normalized_shape[0]):
            module.__class__ = _fused(type(module))
            count += 1
    return count


@functools.cache
def add_norm_works(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether the kernel adds and normalizes as PyTorch's add and layer norm do on `device` for rows
    of `width` in `dtype`: tried once per process before a model takes it, so that a Triton it does
    not suit leaves PyTorch's ops, said in the log."""
    what = {"device": str(device), "dtype": str(dtype), "width": width}
    if not triton_norm.available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x, y = (torch.randn(3, width, generator=generator).to(device, dtype) for _ in range(2))
        weight, bias = (torch.randn(width, generator=generator).to(device, dtype) for _ in range(2))
        total, normed = triton_norm.add_layer_norm(x, y, weight, bias, 1e-5)
        want = x + y
        # float32 exact; bfloat16 within a rounding (Triton's interpreter truncates where a GPU rounds to nearest)
        close = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        works = torch.allclose(total.float(), want.float(), **close) and torch.allclose(
            normed.float(), F.layer_norm(want, (width,), weight, bias, 1e-5).float(),
            **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)))
    except Exception as err:  # a Triton or driver that cannot build or run it
        log.warning("the fused add and layer norm failed to run; PyTorch's ops add and normalize",
                    extra={**what, "error": f"{type(err).__name__}: {err}"})
        return False
    if not works:
        log.warning("the fused add and layer norm disagreed with PyTorch's ops; those add and normalize", extra=what)
    return works
