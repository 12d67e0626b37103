"""GPT-Neo (EleutherAI, 2021) in the style of nanoGPT: GPT-2's blocks, with layers that alternate
between global attention and local attention (each token sees only the last `window_size`
positions), no scaling of q·k, and no biases on the q, k, v projections.

Numerically it matches transformers' GPTNeoForCausalLM (learned positions, LayerNorm eps 1e-5,
"gelu_new", the LM head tied to the token embedding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from models.formats import CheckpointError
from nanogpt.hf_weights import copy, stacked, weight_and_bias
from nanogpt.layers import ACTIVATIONS, MLP, CausalSelfAttention, pre_norm_block, pre_norm_fed
from nanogpt.serving import GPT2Layout


@dataclass
class GPTNeoConfig:
    block_size: int = 2048
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: int | None = None  # 4 * n_embd
    attention_layers: tuple[str, ...] = ("global", "local") * 6  # one per layer
    window_size: int = 256  # positions a local layer sees, its own included
    activation: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5


class Block(nn.Module):

    def __init__(self, config: GPTNeoConfig, kind: str):
        super().__init__()
        local = config.window_size if kind == "local" else None
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, bias=False, out_bias=True, scale=1.0, local=local)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config.n_embd, config.n_inner or 4 * config.n_embd, config.activation)

    def forward(self, x, pending, cache_layer):
        return pre_norm_block(x, pending, cache_layer, self.ln_1, self.attn, self.ln_2, self.mlp)

    def norm_fed(self):
        return pre_norm_fed(self.ln_1, self.attn, self.ln_2, self.mlp)


class GPTNeo(GPT2Layout):

    def __init__(self, config: GPTNeoConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config, kind) for kind in config.attention_layers]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()


# --- Hugging Face GPTNeoForCausalLM checkpoints -------------------------------------------------

HF_PREFIX = "transformer."
HF_IGNORED = (".attn.attention.bias", ".attn.attention.masked_bias", "lm_head.weight")  # mask buffers; tied head
MODEL = GPTNeo


def config_from_hf(hf) -> GPTNeoConfig:
    hf.check({"activation_function": tuple(ACTIVATIONS), "tie_word_embeddings": (True,)})
    n_layer = hf.get("num_layers", 24)
    layers = tuple(kind for kinds, repeat in hf.get("attention_types", [[["global", "local"], 12]])
                   for _ in range(repeat) for kind in kinds)
    if len(layers) != n_layer or not set(layers) <= {"global", "local"}:
        raise CheckpointError(f"{hf.path / 'config.json'}: attention_types must give `global` or `local` "
                              f"for each of the {n_layer} layers")
    return GPTNeoConfig(block_size=hf.context_length, vocab_size=hf.vocab_size, n_layer=n_layer,
                        n_head=hf.get("num_heads", 16), n_embd=hf.get("hidden_size", 2048),
                        n_inner=hf.get("intermediate_size"), attention_layers=layers,
                        window_size=hf.get("window_size", 256), activation=hf.get("activation_function", "gelu_new"),
                        layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def hf_weights(config: GPTNeoConfig):
    """Our parameters from Hugging Face's: q, k, v fused into c_attn, out_proj as c_proj."""
    yield "transformer.wte.weight", copy("transformer.wte.weight")
    yield "transformer.wpe.weight", copy("transformer.wpe.weight")
    for i in range(config.n_layer):
        h, attn = f"transformer.h.{i}.", f"transformer.h.{i}.attn.attention."
        yield from weight_and_bias(h + "ln_1", h + "ln_1")
        yield h + "attn.c_attn.weight", stacked(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        yield from weight_and_bias(h + "attn.c_proj", attn + "out_proj")
        yield from weight_and_bias(h + "ln_2", h + "ln_2")
        yield from weight_and_bias(h + "mlp.c_fc", h + "mlp.c_fc")
        yield from weight_and_bias(h + "mlp.c_proj", h + "mlp.c_proj")
    yield from weight_and_bias("transformer.ln_f", "transformer.ln_f")
    yield "lm_head.weight", copy("transformer.wte.weight")  # tied
