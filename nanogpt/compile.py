"""torch.compile of the model's decode step (`forward_decode`)."""
from __future__ import annotations

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
