"""GPT-J (EleutherAI, 2021) in the style of nanoGPT: attention and MLP side by side from one
LayerNorm (x + attn(ln(x)) + mlp(ln(x))), rotary position embeddings on the first `rotary_dim`
features of each head (interleaved pairs), no biases in attention, and an untied LM head with a bias.

Numerically it matches transformers' GPTJForCausalLM. The published checkpoint's vocabulary is
padded to 50400 rows; its tokenizer has 50257 tokens, and the engine samples only those.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from nanogpt.hf_weights import copy, stacked, weight_and_bias
from nanogpt.layers import ACTIVATIONS, MLP, CausalSelfAttention, Rotary, parallel_block, pre_norm_fed
from nanogpt.serving import GPT2Layout


@dataclass
class GPTJConfig:
    block_size: int = 2048
    vocab_size: int = 50400
    n_layer: int = 28
    n_head: int = 16
    n_embd: int = 4096
    n_inner: int | None = None  # 4 * n_embd
    rotary_dim: int | None = 64  # None: the whole head
    activation: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5


class Block(nn.Module):

    def __init__(self, config: GPTJConfig):
        super().__init__()
        rotary = Rotary(config.rotary_dim or config.n_embd // config.n_head, interleaved=True)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, bias=False, rotary=rotary)
        self.mlp = MLP(config.n_embd, config.n_inner or 4 * config.n_embd, config.activation)

    def forward(self, x, pending, cache_layer):
        return parallel_block(x, pending, cache_layer, self.ln_1, self.attn, self.ln_1, self.mlp)

    def norm_fed(self):
        return pre_norm_fed(self.ln_1, self.attn, self.ln_1, self.mlp)


class GPTJ(GPT2Layout):
    tied = False  # an LM head of its own, with a bias; no wpe: rotary embeddings carry the positions

    def __init__(self, config: GPTJConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=True)


# --- Hugging Face GPTJForCausalLM checkpoints ---------------------------------------------------

HF_PREFIX = "transformer."
HF_IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older checkpoints
MODEL = GPTJ


def config_from_hf(hf) -> GPTJConfig:
    hf.check({"activation_function": tuple(ACTIVATIONS), "tie_word_embeddings": (False,)})
    return GPTJConfig(block_size=hf.context_length, vocab_size=hf.vocab_size, n_layer=hf.get("n_layer", 28),
                      n_head=hf.get("n_head", 16), n_embd=hf.get("n_embd", 4096), n_inner=hf.get("n_inner"),
                      rotary_dim=hf.get("rotary_dim", 64), activation=hf.get("activation_function", "gelu_new"),
                      layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def hf_weights(config: GPTJConfig):
    """Our parameters from Hugging Face's: q, k, v fused into c_attn, out_proj as c_proj, the MLP's
    fc_in and fc_out as c_fc and c_proj."""
    yield "transformer.wte.weight", copy("transformer.wte.weight")
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        yield from weight_and_bias(h + "ln_1", h + "ln_1")
        yield h + "attn.c_attn.weight", stacked(h + "attn.q_proj.weight", h + "attn.k_proj.weight", h + "attn.v_proj.weight")
        yield h + "attn.c_proj.weight", copy(h + "attn.out_proj.weight")
        yield from weight_and_bias(h + "mlp.c_fc", h + "mlp.fc_in")
        yield from weight_and_bias(h + "mlp.c_proj", h + "mlp.fc_out")
    yield from weight_and_bias("transformer.ln_f", "transformer.ln_f")
    yield from weight_and_bias("lm_head", "lm_head")
