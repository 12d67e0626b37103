"""GPT-NeoX / Pythia (EleutherAI, 2022-23) in the style of nanoGPT: rotary position embeddings on
the first `rotary_pct` of each head's features (rotating its two halves), attention and MLP in
parallel from two LayerNorms (`use_parallel_residual`, else one after the other), and an untied
output embedding. Numerically it matches transformers' GPTNeoXForCausalLM.

The checkpoint's fused q, k, v projection is laid out per head; it is regrouped into our fused
layout (all q, all k, all v) when loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from models.formats import CheckpointError
from nanogpt.hf_weights import copy, per_head_qkv, weight_and_bias
from nanogpt.layers import ACTIVATIONS, MLP, CausalSelfAttention, Rotary, parallel_block, pre_norm_block, pre_norm_fed
from nanogpt.serving import ServingModel


@dataclass
class GPTNeoXConfig:
    block_size: int = 2048
    vocab_size: int = 50432
    n_layer: int = 44
    n_head: int = 64
    n_embd: int = 6144
    n_inner: int = 24576
    rotary_pct: float = 0.25
    rotary_base: float = 10000.0
    parallel_residual: bool = True
    bias: bool = True
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


class Block(nn.Module):

    def __init__(self, config: GPTNeoXConfig):
        super().__init__()
        rotary = Rotary(int(config.n_embd // config.n_head * config.rotary_pct), base=config.rotary_base)
        self.parallel = config.parallel_residual
        self.input_layernorm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attention = CausalSelfAttention(config.n_embd, config.n_head, bias=config.bias, rotary=rotary)
        self.post_attention_layernorm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config.n_embd, config.n_inner, config.activation)

    def forward(self, x, pending, cache_layer):
        block = parallel_block if self.parallel else pre_norm_block
        return block(x, pending, cache_layer, self.input_layernorm, self.attention, self.post_attention_layernorm,
                     self.mlp)

    def norm_fed(self):
        return pre_norm_fed(self.input_layernorm, self.attention, self.post_attention_layernorm, self.mlp)


class GPTNeoX(ServingModel):

    def __init__(self, config: GPTNeoXConfig):
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.final_layer_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.embed_out = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def token_embedding(self):
        return self.embed_in

    @property
    def blocks(self):
        return self.layers

    def embed(self, tokens, positions):
        return self.embed_in(tokens)  # positions enter through the rotary embeddings

    def final_hidden(self, x):
        return self.final_layer_norm(x)

    @property
    def final_norm(self):
        return self.final_layer_norm

    def unembed(self, h):
        return self.embed_out(h)

    @property
    def output_layer(self):
        return self.embed_out

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.embed_in.weight = self.embed_out.weight


# --- Hugging Face GPTNeoXForCausalLM checkpoints ------------------------------------------------

HF_PREFIX = "gpt_neox."
# buffers older checkpoints carry (causal mask, rotary frequencies), and a tied head's copy
HF_IGNORED = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq", "embed_out.weight")
MODEL = GPTNeoX


def config_from_hf(hf) -> GPTNeoXConfig:
    hf.check({"hidden_act": tuple(ACTIVATIONS)})
    # transformers 5 writes rope_parameters; older config.json files rotary_pct and rotary_emb_base
    rope = hf.get("rope_parameters") or {}
    hf.check({"rope_scaling": (None,)})
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{hf.path / 'config.json'}: unsupported rope_type={rope['rope_type']!r} "
                              "(supported: ['default'])")
    n_embd = hf.get("hidden_size", 6144)
    return GPTNeoXConfig(block_size=hf.context_length, vocab_size=hf.vocab_size,
                         n_layer=hf.get("num_hidden_layers", 44), n_head=hf.get("num_attention_heads", 64),
                         n_embd=n_embd, n_inner=hf.get("intermediate_size", 4 * n_embd),
                         rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
                         rotary_base=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
                         parallel_residual=hf.get("use_parallel_residual", True),
                         bias=hf.get("attention_bias", True), activation=hf.get("hidden_act", "gelu"),
                         layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
                         tie_word_embeddings=hf.get("tie_word_embeddings", False))


def hf_weights(config: GPTNeoXConfig):
    """Our parameters from Hugging Face's: the fused q, k, v regrouped from per head; dense as
    c_proj; the MLP's dense_h_to_4h and dense_4h_to_h as c_fc and c_proj."""
    yield "embed_in.weight", copy("gpt_neox.embed_in.weight")
    for i in range(config.n_layer):
        ours, hf = f"layers.{i}.", f"gpt_neox.layers.{i}."
        yield from weight_and_bias(ours + "input_layernorm", hf + "input_layernorm")
        yield from weight_and_bias(ours + "post_attention_layernorm", hf + "post_attention_layernorm")
        for p in ("weight", "bias") if config.bias else ("weight",):
            yield f"{ours}attention.c_attn.{p}", per_head_qkv(f"{hf}attention.query_key_value.{p}", config.n_head)
            yield f"{ours}attention.c_proj.{p}", copy(f"{hf}attention.dense.{p}")
        yield from weight_and_bias(ours + "mlp.c_fc", hf + "mlp.dense_h_to_4h")
        yield from weight_and_bias(ours + "mlp.c_proj", hf + "mlp.dense_4h_to_h")
    yield from weight_and_bias("final_layer_norm", "gpt_neox.final_layer_norm")
    tied = "gpt_neox.embed_in.weight" if config.tie_word_embeddings else "embed_out.weight"
    yield "embed_out.weight", copy(tied)
