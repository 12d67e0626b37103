"""GPT-2 in the style of nanoGPT, plus a serving forward over a ragged batch with a KV cache.

Numerically it matches Hugging Face's GPT2LMHeadModel: LayerNorm eps 1e-5, GELU with the tanh
approximation ("gelu_new"), Linear layers holding the transposes of HF's Conv1D weights.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from nanogpt.hf_weights import copy, transposed, weight_and_bias
from nanogpt.layers import MLP, CausalSelfAttention, add_norm, pre_norm_block, pre_norm_fed
from nanogpt.serving import GPT2Layout


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed (nanoGPT)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    layer_norm_epsilon: float = 1e-5


class LayerNorm(nn.LayerNorm):
    """nanoGPT's LayerNorm(ndim, bias, eps): PyTorch's, with an optional bias."""

    def __init__(self, ndim, bias, eps=1e-5):
        super().__init__(ndim, eps=eps, bias=bias)


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, bias=config.bias, dropout=config.dropout)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config.n_embd, 4 * config.n_embd, "gelu_new", bias=config.bias, dropout=config.dropout)

    def forward(self, x, pending=None, cache_layer=None):
        """(x, pending) -> (x, pending): the residual stream is x + pending (nanogpt/layers.py)."""
        return pre_norm_block(x, pending, cache_layer, self.ln_1, self.attn, self.ln_2, self.mlp)

    def norm_fed(self):
        return pre_norm_fed(self.ln_1, self.attn, self.ln_2, self.mlp)


class GPT(GPT2Layout):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the output projection is the token embedding
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # scaled init of the residual projections, per the GPT-2 paper
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        """Parameter count; position embeddings excluded by default (token embeddings are tied
        to lm_head, so they count)."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        """Training forward. idx (B, T) -> logits (B, T, V) and the loss when targets are given,
        else logits of the last position only, (B, 1, V), and None."""
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # (t,)

        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x, pending = self.transformer.drop(tok_emb + pos_emb), None
        for block in self.transformer.h:
            x, pending = block(x, pending)
        _, x = add_norm(x, pending, self.transformer.ln_f)

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position is needed
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        """Model surgery to use a smaller context than the checkpoint's (e.g. GPT-2's 1024)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on every 2D+ tensor (matmul weights, embeddings) and none on
        biases and LayerNorm gains; fused kernel when on CUDA and available."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay_params = [p for p in params if p.dim() >= 2]
        nodecay_params = [p for p in params if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        print(f"num decayed parameter tensors: {len(decay_params)}, with {sum(p.numel() for p in decay_params):,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {sum(p.numel() for p in nodecay_params):,} parameters")
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer


# --- Hugging Face GPT2LMHeadModel checkpoints ---------------------------------------------------

HF_PREFIX = "transformer."
HF_IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")  # causal-mask buffers; the tied head
MODEL = GPT


def config_from_hf(hf) -> GPTConfig:
    """GPTConfig from a config.json (models.formats.HFConfig), refusing what this model does not
    compute: anything else would load but give different logits."""
    n_embd = hf.get("n_embd", 768)
    supported = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
                 "scale_attn_by_inverse_layer_idx": (False,), "tie_word_embeddings": (True,),
                 "n_inner": (None, 4 * n_embd), "add_cross_attention": (False,)}
    hf.check(supported)
    return GPTConfig(block_size=hf.context_length, vocab_size=hf.vocab_size, n_layer=hf.get("n_layer", 12),
                     n_head=hf.get("n_head", 12), n_embd=n_embd, dropout=0.0, bias=True,
                     layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def hf_weights(config: GPTConfig):
    """Our parameters from Hugging Face's: the same names, Conv1D weights transposed, the head tied."""
    yield "transformer.wte.weight", copy("transformer.wte.weight")
    yield "transformer.wpe.weight", copy("transformer.wpe.weight")
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        yield from weight_and_bias(h + "ln_1", h + "ln_1")
        yield from weight_and_bias(h + "ln_2", h + "ln_2")
        for conv1d in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            yield h + conv1d + ".weight", transposed(h + conv1d + ".weight")
            yield h + conv1d + ".bias", copy(h + conv1d + ".bias")
    yield from weight_and_bias("transformer.ln_f", "transformer.ln_f")
    yield "lm_head.weight", copy("transformer.wte.weight")  # tied

