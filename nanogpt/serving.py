"""The serving contract every family's model keeps, implemented once.

worker/ relies on nothing else: `config` (block_size, vocab_size, n_layer, n_head, n_embd),
`device`, `dtype` (of the activations and the KV cache), `forward_cached`, `forward_packed`,
`forward_decode`, `align_head` (a GPU's), and nn.Linear and nn.LayerNorm layers (int8 quantization,
CPU prepacking and a GPU's fused norms walk them). A family subclasses `ServingModel` and defines:

    token_embedding        the nn.Embedding of the tokens (device and dtype are read from it)
    blocks                 its transformer blocks, each called as block(x, pending, (cache_k, cache_v,
                           window)) -> (x, pending): the residual stream is x + pending, pending the
                           last sub-layer's output, added by the next norm (nanogpt/layers.py add_norm)
    embed(tokens, pos)     (B, T) token ids and positions -> (B, T, n_embd); `embed_parts` may give
                           it as (x, pending), the first norm adding them
    final_hidden(x)        the last block's output (..., n_embd) -> the last hidden state: after the
                           final norm (and any projection before the output layer), what transformers
                           reports as hidden_states[-1]
    unembed(h)             the last hidden state (..., width) -> (..., vocab_size) logits
    final_norm             (optional) the final norm where final_hidden is that norm alone: the decode
                           step then adds the last sub-layer, normalizes and projects in
                           nanogpt/layers.py norm_project (a GPU's kernel does it in one pass)

`forward_cached(..., hidden=True)` also returns the last hidden state of every position (contrastive
search compares them); without it, nothing beyond the logits is computed.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nanogpt.layers import norm_project
from nanogpt.runtime.kv_cache import CacheWindow, DecodeWindow, FullWindow, KVCache, PackedWindow


class ServingModel(nn.Module):
    token_embedding: nn.Embedding
    blocks: nn.ModuleList

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    final_norm: nn.Module | None = None

    def embed_parts(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`embed` as the residual stream's (x, pending)."""
        return self.embed(tokens, positions), None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output (..., n_embd) -> logits (..., vocab_size)."""
        return self.logits(self.final_hidden(x))

    def head_of(self, x: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """`head` of the stream x + pending (the last sub-layer's output not added yet)."""
        if self.final_norm is None:
            return self.head(x if pending is None else x + pending)
        return self._cut(norm_project(x, pending, self.final_norm, self.output_layer)[1])

    def norm_fed(self) -> tuple[tuple, ...]:
        """What `head_of` feeds its final norm to (as a block's norm_fed: nanogpt/layers.py)."""
        return () if self.final_norm is None else ((self.final_norm, self.output_layer, None),)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """`unembed`, without the rows `align_head` added."""
        return self._cut(self.unembed(h))

    def _cut(self, out: torch.Tensor) -> torch.Tensor:
        return out if out.shape[-1] == self.config.vocab_size else out[..., :self.config.vocab_size]

    @torch.no_grad()
    def align_head(self, multiple: int = 64) -> None:
        """Pad the output layer to a multiple of `multiple` rows of zeros, whose logits `logits` cuts
        off: on a GPU the matmul then takes aligned kernels (docs/notes/gpu-step.md). A tied
        embedding keeps its own weight, so the head is a copy."""
        layer = self.output_layer
        rows, width = layer.weight.shape
        padded = -(-rows // multiple) * multiple
        if padded == rows:
            return
        weight = layer.weight.new_zeros(padded, width)
        weight[:rows] = layer.weight
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            bias = layer.bias.new_zeros(padded)
            bias[:rows] = layer.bias
            layer.bias = nn.Parameter(bias, requires_grad=False)
        layer.out_features = padded

    @property
    def output_layer(self) -> nn.Module:
        """The layer `unembed` projects with (vocab_size x n_embd)."""
        return self.lm_head

    def tie_weights(self) -> None:
        """Make tied parameters one again (after load_state_dict(assign=True) replaced them)."""

    @property
    def device(self) -> torch.device:
        return self.token_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.token_embedding.weight.dtype

    @torch.no_grad()
    def forward(self, idx):
        """The full forward without a cache: idx (B, T) -> float32 logits (B, T, V)."""
        window = FullWindow(idx.shape[1], idx.device)
        x = self.through_blocks(self.embed(idx, window.query_positions), None, window)
        return self.head(x).float()

    def through_blocks(self, x: torch.Tensor, cache: KVCache | None, window) -> torch.Tensor:
        """x through every block (over `cache`'s layers, None: no cache), the last sub-layer's
        output added."""
        x, pending = self.stream_through_blocks(x, None, cache, window)
        return x if pending is None else x + pending

    def stream_through_blocks(self, x, pending, cache: KVCache | None, window) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream (x, pending) through every block, as (x, pending)."""
        for i, block in enumerate(self.blocks):
            x, pending = block(x, pending, (None, None, window) if cache is None else (cache.k[i], cache.v[i], window))
        return x, pending

    @torch.no_grad()
    def forward_cached(self, tokens, lengths, slots, start_pos, cache: KVCache, all_logits=False, span=None,
                       hidden=False):
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
        when all_logits (padding positions then hold meaningless values); with `hidden`, the pair
        (logits, float32 last hidden states of every position (B, T, width)).
        """
        T = tokens.shape[1]
        window = CacheWindow(slots, start_pos, lengths, T, cache.max_len, span, own_kernel=cache.own_attention)
        if window.span > self.config.block_size:
            raise ValueError(f"batch reaches position {window.span - 1}, the model's context is "
                             f"{self.config.block_size} positions")
        pos = torch.where(window.valid, window.positions, 0)  # (B, T); padding may lie past the context

        x = self.through_blocks(self.embed(tokens, pos), cache, window)  # (B, T, n_embd)
        if hidden:
            h = self.final_hidden(x)  # (B, T, width)
            return self.logits(h if all_logits else _last(h, lengths)).float(), h.float()
        return self.head(x if all_logits else _last(x, lengths)).float()

    @torch.no_grad()
    def forward_packed(self, batches: list[tuple], cache: KVCache) -> list[torch.Tensor]:
        """Several ragged batches in one forward, each (tokens, lengths, slots, start_pos, span) as
        forward_cached takes them (every length at least 1): their real tokens are packed into one
        row, so each weight matmul runs once over all of them (PackedWindow). Returns each batch's
        float32 logits of its rows' last real tokens (B, V), as forward_cached would."""
        parts = [CacheWindow(slots, start_pos, lengths, tokens.shape[1], cache.max_len, span,
                             own_kernel=cache.own_attention) for tokens, lengths, slots, start_pos, span in batches]
        if max(part.span for part in parts) > self.config.block_size:
            raise ValueError(f"batch reaches position {max(part.span for part in parts) - 1}, the model's "
                             f"context is {self.config.block_size} positions")
        window = PackedWindow(parts)
        x = self.embed(torch.cat([part.real(tokens) for (tokens, *_), part in zip(batches, parts)])[None],
                       window.query_positions)  # (1, N, n_embd)
        x = self.through_blocks(x, cache, window)
        ends = torch.cat([lengths for _, lengths, *_ in batches]).cumsum(0) - 1  # each row's last token
        logits = self.head(x[0, ends]).float()
        return list(logits.split([len(lengths) for _, lengths, *_ in batches]))

    @torch.no_grad()
    def forward_decode(self, tokens, slots, positions, cache: KVCache, keys, out=None):
        """The decode step alone, for torch.compile: one new token per row, no host syncs, no
        padding logic (see DecodeWindow; rows of one slot at consecutive positions are a prompt
        chunk). tokens, slots, positions (B,) long; keys = arange(span) with span > every position
        (and <= the context). Returns float32 logits (B, V), or of the rows `out` (R,) only."""
        window = DecodeWindow(slots, positions, keys, own_kernel=cache.own_attention)
        x, pending = self.stream_through_blocks(*self.embed_parts(tokens[:, None], positions[:, None]), cache, window)
        if out is None:  # (B, 1, n_embd): every row's logits, the last add in the final norm's pass
            return self.head_of(x[:, 0], None if pending is None else pending[:, 0]).float()
        x = x if pending is None else x + pending
        return self.head(x[out, 0]).float()


def _last(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T, d) -> (B, d): each row's last real position, the only one whose logits are needed."""
    return x[torch.arange(x.shape[0], device=x.device), (lengths - 1).clamp(min=0)]


class GPT2Layout(ServingModel):
    """The modules laid out as GPT-2's (and GPT-Neo's, GPT-J's): `transformer` holds `wte`, `wpe`
    (learned positions; absent where rotary embeddings carry them), the blocks `h` and `ln_f`, then
    `lm_head`, tied to `wte` when `tied`."""

    tied = True

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.transformer.wte

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def embed(self, tokens, positions):
        x, pending = self.embed_parts(tokens, positions)
        return x if pending is None else x + pending

    def embed_parts(self, tokens, positions):
        """The token and position embeddings, added by the first block's norm."""
        return self.transformer.wte(tokens), self.transformer.wpe(positions) if "wpe" in self.transformer else None

    @property
    def final_norm(self):
        return self.transformer.ln_f

    def final_hidden(self, x):
        return self.transformer.ln_f(x)

    def unembed(self, h):
        return self.lm_head(h)

    def tie_weights(self):
        if self.tied:
            self.transformer.wte.weight = self.lm_head.weight
