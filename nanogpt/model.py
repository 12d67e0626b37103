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

from nanogpt.kv_cache import CacheWindow, DecodeWindow, KVCache


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


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x, cache_layer=None):
        """cache_layer: None for the training forward (causal over x itself), else
        (keys, values, window) of one layer of a KVCache and the batch's CacheWindow."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache_layer is None:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            cache_k, cache_v, window = cache_layer
            y = window.attend(q, k, v, cache_k, cache_v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, cache_layer=None):
        x = x + self.attn(self.ln_1(x), cache_layer)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

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

    # The serving contract every family's model keeps (worker/ relies on nothing else): `config`
    # (block_size, vocab_size, n_layer, n_head, n_embd), `device`, `dtype` (of the activations and
    # the KV cache), `forward_cached`, `forward_decode`.
    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

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
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position is needed
            loss = None
        return logits, loss

    @torch.no_grad()
    def forward_cached(self, tokens, lengths, slots, start_pos, cache: KVCache, all_logits=False, span=None):
        """Serving forward over a ragged batch; prefill (T > 1) and decode (T = 1) alike.

        tokens (B, T) long: row b holds lengths[b] real tokens, left-aligned, then padding.
        slots (B,) long: each row's KV-cache slot; start_pos (B,) long: position of each row's first
        token (= tokens already cached in that slot). Each row's keys/values are written to its slot
        at start_pos[b] .. start_pos[b] + lengths[b] - 1, and each query attends to its slot's
        positions <= its own. Padding is never written to the cache; a row may have length 0 (its
        logits are then meaningless). Rows in ascending slots read the cache in place (with few
        unused slots between them); any other slot order costs a gather (a copy) per layer.
        span: max(start_pos + lengths) when the caller knows it (saves a host sync).
        Returns float32 logits of each row's last real token (B, V), or of every position (B, T, V)
        when all_logits (padding positions then hold meaningless values).
        """
        B, T = tokens.shape
        window = CacheWindow(slots, start_pos, lengths, T, cache.max_len, span)
        if window.span > self.config.block_size:
            raise ValueError(f"batch reaches position {window.span - 1}, the model's context is "
                             f"{self.config.block_size} positions")
        pos = torch.where(window.valid, window.positions, 0)  # (B, T); padding may lie past the context

        x = self.transformer.wte(tokens) + self.transformer.wpe(pos)  # (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i], window))
        if not all_logits:
            last = (lengths - 1).clamp(min=0)
            x = x[torch.arange(B, device=x.device), last]  # (B, n_embd): only what lm_head must see
        return self.lm_head(self.transformer.ln_f(x)).float()

    @torch.no_grad()
    def forward_decode(self, tokens, slots, positions, cache: KVCache, keys):
        """The decode step alone, for torch.compile: one new token per row, no host syncs, no
        padding logic (see DecodeWindow). tokens, slots, positions (B,) long; keys = arange(span)
        with span > every position (and <= the context). Returns float32 logits (B, V)."""
        window = DecodeWindow(slots, positions, keys)
        x = self.transformer.wte(tokens[:, None]) + self.transformer.wpe(positions[:, None])  # (B, 1, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, (cache.k[i], cache.v[i], window))
        return self.lm_head(self.transformer.ln_f(x[:, 0])).float()

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
