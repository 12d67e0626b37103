"""The layers every family is built from: causal self-attention over the slot KV cache (with the
scale, local window and rotary embeddings the families differ in), the MLP, rotary embeddings.

Attention always runs through a window (nanogpt/runtime/kv_cache.py): `FullWindow` for a forward without a cache,
`CacheWindow` for a ragged batch over the cache, `DecodeWindow` for the compiled decode step; the
layer itself only projects, rotates and re-assembles heads.

The layers are plain nn.Linear and nn.LayerNorm modules, as nanoGPT writes them. Loading may swap
them for a kernel's (nanogpt/kernels/): a CPU's linear layers, which `project` lets apply an
activation or add a residual in the matmul's own pass over the output, and a GPU's layer norms,
which `add_norm` lets add the residual stream's last sub-layer in the norm's own pass.

Blocks keep the residual stream as (x, pending): pending is the last sub-layer's output not added
yet (None: nothing), which the next norm adds (`add_norm`) so that every add but the last runs in
a norm's pass. A pre-norm block (`pre_norm_block`) goes one further where a GPU's kernel can: the
matmul after each norm normalizes its rows as it reads them (`norm_project`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F


# transformers' activation names -> the function each stands for
ACTIVATIONS = {
    "gelu_new": lambda: nn.GELU(approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu": nn.GELU,  # the exact (erf) form
    "relu": nn.ReLU,
}


def project(linear: nn.Module, x: torch.Tensor, activation: nn.Module | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(linear(x)), or residual + linear(x). A linear layer that a kernel swapped in at load
    computes either in its own pass over the output where it can (its `fused`, None where not)."""
    if activation is not None and residual is not None:
        return residual + project(linear, x, activation)
    if activation is None and residual is None:
        return linear(x)  # nothing to fuse
    fused = getattr(type(linear), "fused", None)  # on the class: nn.Module's __getattr__ costs microseconds
    y = None if fused is None else fused(linear, x, activation, residual)
    if y is not None:
        return y
    y = linear(x)
    if activation is not None:
        y = activation(y)
    return y if residual is None else residual + y


def add_norm(x: torch.Tensor, y: torch.Tensor | None, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream with a sub-layer's output added, and its norm: (x + y, norm(x + y)); (x,
    norm(x)) without y. A norm that a kernel swapped in at load computes both in one pass (its
    `add_fused`, None where it cannot)."""
    if y is None:
        return x, norm(x)
    fused = getattr(type(norm), "add_fused", None)  # on the class, as `project` reads `fused`
    out = None if fused is None else fused(norm, x, y)
    if out is not None:
        return out
    x = x + y
    return x, norm(x)


def norm_project(x: torch.Tensor, y: torch.Tensor | None, norm: nn.Module, linear: nn.Module,
                 activation: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm`, then `project` of the norm: (x + y, activation(linear(norm(x + y)))). A linear layer
    that a kernel swapped in at load computes both in one pass where it can (its `norm_fused`)."""
    fused = getattr(type(linear), "norm_fused", None)  # on the class, as `project` reads `fused`
    out = None if fused is None else fused(linear, x, y, norm, activation)
    if out is not None:
        return out
    x, h = add_norm(x, y, norm)
    return x, project(linear, h, activation)


def pre_norm_block(x, pending, cache_layer, ln_1, attn, ln_2, mlp):
    """GPT-2's block, (x, pending) -> (x, pending): the stream plus attn(ln_1(stream)), then plus
    mlp(ln_2(that)), each norm fed to the matmul after it by `norm_project`."""
    x, qkv = norm_project(x, pending, ln_1, attn.c_attn)
    x, hidden = norm_project(x, attn(None, cache_layer, qkv=qkv), ln_2, mlp.c_fc, mlp.act)
    return x, mlp(None, hidden=hidden)


def pre_norm_fed(ln_1, attn, ln_2, mlp) -> tuple[tuple, ...]:
    """What `pre_norm_block` (and `parallel_block`) feeds its norms to, (norm, linear layer,
    activation) each: a block's `norm_fed()`, which nanogpt/kernels/few_rows.py `fuse_norm_linears`
    reads."""
    return (ln_1, attn.c_attn, None), (ln_2, mlp.c_fc, mlp.act)


def parallel_block(x, pending, cache_layer, ln_attn, attn, ln_mlp, mlp):
    """GPT-NeoX's and GPT-J's parallel block, (x, pending) -> (x, pending): the stream plus
    attn(ln_attn(stream)) plus mlp(ln_mlp(stream)), added as transformers adds them (the stream +
    (mlp + attn)), each norm fed to its matmul by `norm_project`. GPT-J's one norm feeding both
    (ln_attn is ln_mlp) is computed once where the attention's matmul does not take it, and its
    output feeds the MLP's too."""
    if ln_mlp is ln_attn:
        fused = getattr(type(attn.c_attn), "norm_fused", None)
        out = None if fused is None else fused(attn.c_attn, x, pending, ln_attn)
        if out is None:
            x, h = add_norm(x, pending, ln_attn)
            hidden = project(mlp.c_fc, h, mlp.act)
            return x, mlp(None, residual=attn(h, cache_layer), hidden=hidden)
        x, qkv = out
    else:
        x, qkv = norm_project(x, pending, ln_attn, attn.c_attn)
    _, hidden = norm_project(x, None, ln_mlp, mlp.c_fc, mlp.act)
    return x, mlp(None, residual=attn(None, cache_layer, qkv=qkv), hidden=hidden)


class Rotary:
    """Rotary position embeddings (RoFormer) on the first `dim` features of each head, the rest
    left as they are. GPT-J rotates interleaved pairs (0, 1), (2, 3), ...; GPT-NeoX the two halves
    (i, i + dim/2). The angles are computed in float32 once per forward and shared by all layers."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        self.dim, self.base, self.interleaved = dim, base, interleaved

    def __call__(self, q, k, window):
        cos, sin = window.remember(("rotary", self.dim, self.base), lambda: self._angles(window.query_positions))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _angles(self, positions):
        """cos and sin (B, 1, T, dim/2) of each position's angle per rotated pair."""
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=positions.device).float() / self.dim))
        angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, T, dim/2)
        return angles.cos(), angles.sin()

    def _rotate(self, x, cos, sin):  # x (B, nh, T, hs)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rot, rest), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q, k, v projection (`c_attn`, rows q then k
    then v, each head's features contiguous) and the output projection `c_proj`.

    scale: of q·k (default 1/sqrt(head size); GPT-Neo uses 1); local: attend only to the last
    `local` positions (GPT-Neo's local layers); rotary: applied to q and k before the cache write."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, out_bias: bool | None = None,
                 dropout: float = 0.0, scale: float | None = None, local: int | None = None,
                 rotary: Rotary | None = None):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias if out_bias is None else out_bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.scale, self.local, self.rotary = scale, local, rotary

    def forward(self, x, cache_layer=None, residual=None, qkv=None):
        """cache_layer: None for the training forward (causal over x itself, with dropout), else
        (keys, values, window): one layer of a KVCache (None, None for a FullWindow) and the window.
        residual: added to the output (residual + attention(x)), by the output projection's kernel
        where it can (`project`). qkv: c_attn(x) already (x then unused: `pre_norm_block`)."""
        qkv = self.c_attn(x) if qkv is None else qkv
        B, T, C = qkv.size(0), qkv.size(1), self.n_embd
        q, k, v = qkv.split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if cache_layer is None:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, scale=self.scale)
        else:
            cache_k, cache_v, window = cache_layer
            if self.rotary is not None:
                q, k = self.rotary(q, k, window)
            y = window.attend(q, k, v, cache_k, cache_v, scale=self.scale, local=self.local)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        if self.training:
            y = self.resid_dropout(self.c_proj(y))
            return y if residual is None else residual + y
        return project(self.c_proj, y, residual=residual)


class MLP(nn.Module):

    def __init__(self, n_embd: int, n_inner: int, activation: str = "gelu_new", bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, n_inner, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.c_proj = nn.Linear(n_inner, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, residual=None, hidden=None):
        """c_proj(act(c_fc(x))), plus `residual` when given; at inference the activation and the
        residual add run in the matmuls' own kernels where they can (`project`). hidden:
        act(c_fc(x)) already (x then unused: `pre_norm_block`)."""
        if self.training:
            y = self.dropout(self.c_proj(self.act(self.c_fc(x)) if hidden is None else hidden))
            return y if residual is None else residual + y
        hidden = project(self.c_fc, x, self.act) if hidden is None else hidden
        return project(self.c_proj, hidden, residual=residual)
