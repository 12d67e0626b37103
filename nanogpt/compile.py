"""torch.compile of the model's decode step (`GPT.forward_decode`)."""
from __future__ import annotations

import torch


def compile_decode(model):
    """The compiled `model.forward_decode`: on CPU with inductor's weight freezing (the weights
    become constants of the graph), which lets the matmuls use the prepacked weights of
    nanogpt/packed.py (or inductor packs them itself). Freezing is a setting of the whole
    process, as is the recompile limit."""
    # every batch size a caller pads to is a graph, and so is each model of the process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if model.device.type == "cpu":
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True
    return torch.compile(model.forward_decode)
