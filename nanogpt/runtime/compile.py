"""torch.compile of the model's decode step (`forward_decode`), and where the worker compiles it
without being told."""
from __future__ import annotations

import os
import shutil

import torch

from nanogpt.runtime import compile_cache


def compile_decode(model):
    """The compiled `model.forward_decode`, its graphs kept in the compile cache that outlives the
    process (compile_cache.py). Without inductor's weight freezing: the prepacked layers of
    nanogpt/kernels/ are one opaque op each inside the graph, and a frozen graph could not be
    cached. The recompile limit is a setting of the whole process.

    On a CPU the graph's wrapper is inductor's C++ one: the step's few hundred calls around its
    kernels (buffers, views, the opaque layers) run in C++ rather than Python, a few percent off
    every precision's step (docs/notes/compiled-decode.md#c-wrapper); its first compile takes
    longer (the wrapper is compiled too), later starts load it from the cache as fast."""
    # every batch size a caller pads to is a graph, and so is each model of the process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile_cache.enable()
    options = {"cpp_wrapper": True} if torch.device(model.device).type == "cpu" else None
    return torch.compile(model.forward_decode, options=options)


# The precisions (precision.py's names) whose compiled decode step was measured ahead of the eager
# one on a CPU under serving load (docs/notes/compiled-decode.md#default); the GPU's
# compiled step has not been measured.
COMPILED_ON_CPU = ("float32", "bfloat16", "int8")


def compiles_by_default(device, precision: str) -> bool:
    """Whether a worker compiles its decode step unless told otherwise: for COMPILED_ON_CPU on a
    CPU, and only where inductor finds the C++ compiler it builds its kernels with."""
    return (torch.device(device).type == "cpu" and precision in COMPILED_ON_CPU
            and shutil.which(os.environ.get("CXX", "g++")) is not None)
