"""A GPU's linear layers that apply their activation in the matmul's epilogue: cuBLASLt adds the
bias and applies a tanh GELU (GPT-2's, GPT-J's, GPT-Neo's) or a ReLU (OPT's) to the output as it
writes it (`torch._addmm_activation`), where PyTorch's nn.Linear then GELU are two kernels.
`fuse_epilogues` swaps a model's layers after a self-check; nanogpt/layers.py `project` calls their
`fused`. A model's layers import none of this.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


def activation_name(activation: nn.Module | None) -> str | None | bool:
    """The epilogue that computes `activation`: "gelu_tanh" (GPT-2's, GPT-J's, GPT-Neo's), "gelu"
    (the erf GELU, GPT-NeoX's: the Triton kernels' only), "relu" (OPT's), None for no activation,
    False for one no epilogue here has."""
    if activation is None:
        return None
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    if isinstance(activation, nn.ReLU):
        return "relu"
    return False


def _uses_gelu(activation: nn.Module | None) -> bool | None:
    """cuBLASLt's epilogue flag: True for a tanh GELU, False for a ReLU, None for anything else."""
    return {"gelu_tanh": True, "relu": False}.get(activation_name(activation))


class EpilogueLinear(nn.Linear):
    """An nn.Linear whose tanh GELU or ReLU runs in the matmul's own pass (`fused`)."""

    def fused(self, x: torch.Tensor, activation: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """activation(self(x)) by one matmul; None where that does not apply (no such activation, a
        residual, autograd, a graph being compiled, whose compiler chooses its own kernels)."""
        gelu = _uses_gelu(activation)
        if gelu is None or residual is not None or self.bias is None or torch.is_grad_enabled() \
                or torch.compiler.is_compiling() or x.dtype != self.weight.dtype:
            return None
        y = torch._addmm_activation(self.bias, x.reshape(-1, x.shape[-1]), self.weight.t(), use_gelu=gelu)
        return y.view(*x.shape[:-1], self.out_features)


def fuse_epilogues(model: nn.Module) -> int:
    """Make every nn.Linear of `model` on a GPU an EpilogueLinear (in place: the module's class
    changes, its parameters stay), where the epilogues compute on its device and dtype what the
    activations do (`epilogues_work`). Returns how many were swapped."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.is_cuda and epilogues_work(module.weight.device,
                                                                                   module.weight.dtype):
            module.__class__ = EpilogueLinear
            count += 1
    return count


@functools.cache
def epilogues_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._addmm_activation` gives what nn.Linear then a tanh GELU, and then a ReLU,
    give on `device` in `dtype` (tried once per process, at one row and at several): the GELU
    epilogue must be the tanh one, and any other leaves PyTorch's two kernels, said in the log."""
    what = {"device": str(device), "dtype": str(dtype)}
    try:
        generator = torch.Generator().manual_seed(0)
        layer = nn.Linear(64, 96).to(device, dtype)
        with torch.no_grad():
            for rows in (1, 5):
                x = torch.randn(rows, 64, generator=generator).to(device, dtype)
                for activation in (nn.GELU(approximate="tanh"), nn.ReLU()):
                    want = activation(layer(x)).float()
                    got = torch._addmm_activation(layer.bias, x, layer.weight.t(), use_gelu=_uses_gelu(activation))
                    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
                    if not torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance):
                        log.warning("the matmul's activation epilogue disagreed with PyTorch's activation; "
                                    "linear layers keep their activation as a kernel of its own",
                                    extra={**what, "activation": type(activation).__name__, "rows": rows})
                        return False
    except Exception as err:
        log.warning("the matmul's activation epilogue failed to run; linear layers keep their activation as "
                    "a kernel of its own", extra={**what, "error": f"{type(err).__name__}: {err}"})
        return False
    return True
