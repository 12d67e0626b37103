"""OPT (Meta, 2022) in the style of nanoGPT: learned positions offset by 2 (positions 0 and 1 of
the table are never used), ReLU, LayerNorm before (pre-LN) or after (post-LN, 350m) each sublayer,
and for 350m a projection from the 512-wide embeddings into the 1024-wide blocks and back out.

Numerically it matches transformers' OPTForCausalLM. OPT was trained with `</s>` starting every
document: the tokenizer puts it before every text prompt (models/tokenizer.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from nanogpt.hf_weights import copy, stacked, weight_and_bias
from nanogpt.layers import ACTIVATIONS, MLP, CausalSelfAttention, add_norm, pre_norm_block, pre_norm_fed
from nanogpt.serving import ServingModel

POSITION_OFFSET = 2  # fairseq's learned positions start after the padding index


@dataclass
class OPTConfig:
    block_size: int = 2048
    vocab_size: int = 50272
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    ffn_dim: int = 3072
    word_embed_proj_dim: int | None = None  # the embeddings' width when not n_embd (350m: 512)
    do_layer_norm_before: bool = True  # pre-LN; False: post-LN (350m)
    final_layer_norm: bool = True  # after the last block (pre-LN models only)
    layer_norm_affine: bool = True
    bias: bool = True
    activation: str = "relu"


class Block(nn.Module):

    def __init__(self, config: OPTConfig):
        super().__init__()
        self.pre_ln = config.do_layer_norm_before
        self.self_attn_layer_norm = nn.LayerNorm(config.n_embd, elementwise_affine=config.layer_norm_affine)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, bias=config.bias)
        self.final_layer_norm = nn.LayerNorm(config.n_embd, elementwise_affine=config.layer_norm_affine)
        self.mlp = MLP(config.n_embd, config.ffn_dim, config.activation, bias=config.bias)

    def forward(self, x, pending, cache_layer):
        if self.pre_ln:
            return pre_norm_block(x, pending, cache_layer, self.self_attn_layer_norm, self.attn,
                                  self.final_layer_norm, self.mlp)
        # post-LN (350m): each norm's output is the stream, nothing pending between blocks
        _, x = add_norm(x, self.attn(x, cache_layer), self.self_attn_layer_norm)
        _, x = add_norm(x, self.mlp(x), self.final_layer_norm)
        return x, None

    def norm_fed(self):
        return pre_norm_fed(self.self_attn_layer_norm, self.attn, self.final_layer_norm, self.mlp) if self.pre_ln else ()


class OPT(ServingModel):

    def __init__(self, config: OPTConfig):
        super().__init__()
        self.config = config
        width = config.word_embed_proj_dim or config.n_embd
        projected = width != config.n_embd
        self.embed_tokens = nn.Embedding(config.vocab_size, width)
        self.embed_positions = nn.Embedding(config.block_size + POSITION_OFFSET, config.n_embd)
        self.project_in = nn.Linear(width, config.n_embd, bias=False) if projected else None
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.final_layer_norm = (nn.LayerNorm(config.n_embd, elementwise_affine=config.layer_norm_affine)
                                 if config.do_layer_norm_before and config.final_layer_norm else None)
        self.project_out = nn.Linear(config.n_embd, width, bias=False) if projected else None
        self.lm_head = nn.Linear(width, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def token_embedding(self):
        return self.embed_tokens

    @property
    def blocks(self):
        return self.layers

    def embed(self, tokens, positions):
        x = self.embed_tokens(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def final_hidden(self, x):
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def unembed(self, h):
        return self.lm_head(h)

    def tie_weights(self):
        self.embed_tokens.weight = self.lm_head.weight


# --- Hugging Face OPTForCausalLM checkpoints ----------------------------------------------------

HF_PREFIX = "model."
HF_IGNORED = ("lm_head.weight",)  # tied
MODEL = OPT


def config_from_hf(hf) -> OPTConfig:
    hf.check({"activation_function": tuple(ACTIVATIONS), "tie_word_embeddings": (True,)})
    n_embd = hf.get("hidden_size", 768)
    return OPTConfig(block_size=hf.context_length, vocab_size=hf.vocab_size,
                     n_layer=hf.get("num_hidden_layers", 12), n_head=hf.get("num_attention_heads", 12),
                     n_embd=n_embd, ffn_dim=hf.get("ffn_dim", 3072),
                     word_embed_proj_dim=hf.get("word_embed_proj_dim") or n_embd,
                     do_layer_norm_before=hf.get("do_layer_norm_before", True),
                     final_layer_norm=not hf.get("_remove_final_layer_norm", False),
                     layer_norm_affine=hf.get("layer_norm_elementwise_affine", True),
                     bias=hf.get("enable_bias", True), activation=hf.get("activation_function", "relu"))


def hf_weights(config: OPTConfig):
    """Our parameters from Hugging Face's: q, k, v fused into c_attn, out_proj as c_proj, fc1 and
    fc2 as the MLP's c_fc and c_proj."""
    d = "model.decoder."
    yield "embed_tokens.weight", copy(d + "embed_tokens.weight")
    yield "embed_positions.weight", copy(d + "embed_positions.weight")
    if config.word_embed_proj_dim != config.n_embd:
        yield "project_in.weight", copy(d + "project_in.weight")
        yield "project_out.weight", copy(d + "project_out.weight")
    for i in range(config.n_layer):
        ours, hf = f"layers.{i}.", f"{d}layers.{i}."
        for norm in ("self_attn_layer_norm", "final_layer_norm") if config.layer_norm_affine else ():
            yield from weight_and_bias(ours + norm, hf + norm)
        for p in ("weight", "bias") if config.bias else ("weight",):
            attn = hf + "self_attn."
            yield f"{ours}attn.c_attn.{p}", stacked(f"{attn}q_proj.{p}", f"{attn}k_proj.{p}", f"{attn}v_proj.{p}")
            yield f"{ours}attn.c_proj.{p}", copy(f"{attn}out_proj.{p}")
            yield f"{ours}mlp.c_fc.{p}", copy(f"{hf}fc1.{p}")
            yield f"{ours}mlp.c_proj.{p}", copy(f"{hf}fc2.{p}")
    if config.do_layer_norm_before and config.final_layer_norm and config.layer_norm_affine:
        yield from weight_and_bias("final_layer_norm", d + "final_layer_norm")
    yield "lm_head.weight", copy(d + "embed_tokens.weight")  # tied
