"""How a Hugging Face tensor becomes one of ours: the vocabulary of each family's weight mapping.

A family's `hf_weights(config)` yields (our parameter name, Source) for every parameter; a Source
names the checkpoint tensors it is made from, the shape each must have there, and how they combine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]  # checkpoint tensors, in the order `combine` takes them
    combine: Callable[..., torch.Tensor]
    layout: Callable[[tuple], list[tuple]]  # our shape -> the shape each named tensor has in the file


def copy(name: str) -> Source:
    return Source((name,), lambda t: t, lambda shape: [shape])


def transposed(name: str) -> Source:
    """GPT-2's Conv1D weights are stored (in, out): the transpose of nn.Linear's, laid out as
    nn.Linear's (a transposed view would make every kernel that reads the weight row by row, the
    one-row GEMV of nanogpt/kernels/gemv.py among them, copy it on each call)."""
    return Source((name,), lambda t: t.t().contiguous(), lambda shape: [shape[::-1]])


def stacked(*names: str) -> Source:
    """Separate q, k, v projections (rows of each) as one fused projection: q rows, then k, then v."""
    return Source(names, lambda *ts: torch.cat(ts), lambda shape: [(shape[0] // len(names), *shape[1:])] * len(names))


def per_head_qkv(name: str, n_head: int) -> Source:
    """GPT-NeoX's fused projection holds q, k, v per head ([q0 k0 v0 q1 k1 v1 ...]); ours holds all
    heads' q, then k, then v."""
    def regroup(t):
        return t.view(n_head, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return Source((name,), regroup, lambda shape: [shape])


def weight_and_bias(ours: str, hf: str):
    """A layer's weight and bias copied under our name (a LayerNorm's, a Linear's)."""
    yield ours + ".weight", copy(hf + ".weight")
    yield ours + ".bias", copy(hf + ".bias")
