"""torch.compile of the model's decode step (`forward_decode`), and where the worker compiles it
without being told."""
from __future__ import annotations

import os
import shutil

import torch

from nanogpt import compile_cache


def compile_decode(model):
    """The compiled `model.forward_decode`, its graphs kept in the compile cache that outlives the
    process (nanogpt/compile_cache.py). Without inductor's weight freezing: the prepacked layers of
    nanogpt/kernels.py are one opaque op each inside the graph, and a frozen graph could not be
    cached. The recompile limit is a setting of the whole process."""
    # every batch size a caller pads to is a graph, and so is each model of the process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile_cache.enable()
    return torch.compile(model.forward_decode)


def compiles_by_default(device, dtype: torch.dtype, int8: bool = False) -> bool:
    """Whether a worker compiles its decode step unless told otherwise: float32 on a CPU, where the
    compiled step (prompt chunks still packed beside the decode, eagerly) was measured ahead of the
    eager one under a serving load and on whole batches (docs/benchmarks.md), and only where
    inductor finds the C++ compiler it builds its kernels with. Not measured to pay elsewhere:
    bfloat16 and the GPU; int8's quantized layers are not the packed op a graph calls."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and not int8
            and shutil.which(os.environ.get("CXX", "g++")) is not None)
