"""A static key/value cache for serving: one fixed row of positions per sequence slot.

Memory: 2 (keys and values) * n_layer * max_slots * max_len * n_embd * bytes per element.
GPT-2 small (12 layers, 768 wide) in float32 holds 2 * 12 * 768 * 4 B = 72 KiB per token, so
32 slots of 1024 positions take 2.25 GiB (1.125 GiB in bfloat16). The cache holds the dtype it is
given (nanogpt/runtime/precision.py cache_dtype chooses it).
"""
from __future__ import annotations

import functools
import logging
import math

import torch
from torch.nn import functional as F

from nanogpt.kernels import decode_attention, triton_decode

log = logging.getLogger(__name__)

RUN_TOKENS = 8  # a prompt chunk's row of at least this many tokens is written to the cache as a slice
# Slots of an engine given no max_batch: on a CPU, whose steps grow with their rows, CPU_SLOTS; on a
# GPU as many as GPU_MEMORY_SHARE of the memory free once the weights are loaded holds (vLLM's
# gpu_memory_utilization), at most GPU_SLOTS. The rest of that memory is the steps' activations',
# the sampler's tables' and the CUDA graphs' pool's.
CPU_SLOTS = 32
GPU_SLOTS = 256
GPU_MEMORY_SHARE = 0.8


def default_slots(config, dtype, max_len: int, device) -> int:
    """The KV-cache slots of `max_len` positions an engine of this model takes on `device` by default."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_SLOTS
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(GPU_SLOTS, int(free * GPU_MEMORY_SHARE) // (KVCache.bytes_per_token(config, dtype) * max_len)))


@functools.cache
def gpu_kernel_works(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether the GPU's decode attention (nanogpt/kernels/triton_decode.py) compiles and attends as
    PyTorch's ops do on `device` for a cache of `dtype` with heads of `head_size`: tried once per
    process on a small case before an engine takes it, so that a Triton the kernel does not suit
    leaves that engine on PyTorch's ops, said in the log, instead of failing every decode step."""
    what = {"device": str(device), "dtype": str(dtype), "head_size": head_size}
    try:
        generator = torch.Generator().manual_seed(0)
        cache = [torch.randn(3, 2, 70, head_size, generator=generator).to(device, dtype) for _ in range(2)]
        q, k, v = (torch.randn(3, 2, 1, head_size, generator=generator).to(device, dtype) for _ in range(3))
        slots, positions = torch.tensor([2, 0, 1], device=device), torch.tensor([69, 3, 0], device=device)
        written = [c.clone() for c in cache]
        want = DecodeWindow(slots, positions, torch.arange(70, device=device)).attend(q, k, v, *written)[:, :, 0]
        got = triton_decode.write_and_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], *cache, slots, positions, 70,
                                             head_size ** -0.5, 0)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        if torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance) and \
                all(torch.equal(a, b) for a, b in zip(cache, written)):
            return True
        log.warning("the GPU's decode attention kernel disagrees with PyTorch's ops here; decode steps use "
                    "PyTorch's", extra=what)
    except Exception as exc:
        log.warning("the GPU's decode attention kernel failed here; decode steps use PyTorch's ops",
                    extra={**what, "error": repr(exc)})
    return False


class KVCache:
    """Per-layer key and value tensors of shape (max_slots, n_head, max_len, head_dim).

    Which positions of a slot are valid is the caller's bookkeeping (the engine knows how many
    tokens each sequence has); a slot is reused by simply writing from position 0 again. Zeros
    at start so that positions never written stay finite (masked attention still multiplies them by 0).
    """

    def __init__(self, config, max_slots: int, max_len: int, device="cpu", dtype=torch.float32):
        head_dim = config.n_embd // config.n_head
        shape = (max_slots, config.n_head, max_len, head_dim)
        self.max_slots, self.max_len = max_slots, max_len
        with torch.inference_mode(False):  # ordinary tensors even if made under inference_mode,
            # so that forward_cached (under no_grad) may write them
            self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
            self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        # the decode step attends by the project's own kernel where it is built for this cache (on a
        # GPU, where Triton's kernel passes its check)
        self.own_attention = decode_attention.serves(device, dtype, head_dim) and (
            torch.device(device).type != "cuda" or gpu_kernel_works(torch.device(device), dtype, head_dim))

    @staticmethod
    def bytes_per_token(config, dtype=torch.float32) -> int:
        """Cache bytes one position of one slot costs (keys and values of every layer)."""
        return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Window:
    """What every window gives the attention of a layer: each query's position (`query_positions`,
    (B, T)), and a memo for what all layers of one forward share (rotary angles, local masks)."""

    query_positions: torch.Tensor

    def remember(self, key, make):
        """make() once per forward (the window lives as long as one forward), then its result."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]


class FullWindow(Window):
    """A forward without a cache: T tokens from position 0, each attending to itself and those
    before it (to the last `local` of them in a local layer)."""

    def __init__(self, T: int, device):
        self.query_positions = torch.arange(T, device=device)[None]  # (1, T)

    def attend(self, q, k, v, cache_k=None, cache_v=None, scale=None, local=None) -> torch.Tensor:
        if local is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        pos = self.query_positions[0]
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - local)  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class CacheWindow(Window):
    """How one ragged batch meets the cache: where its new keys/values are written, and which
    cached positions each query may attend to. Built once per forward, shared by every layer.

    tokens of row b sit at positions start_pos[b] .. start_pos[b] + lengths[b] - 1 of slot slots[b];
    the rest of the row is padding, which is never written to the cache. `span` (the furthest
    position + 1) saves a host sync when the caller knows it.
    """

    def __init__(self, slots, start_pos, lengths, T: int, max_len: int, span: int | None = None,
                 own_kernel: bool = False):
        """own_kernel (a cache KVCache.own_attention): a batch of one token a row attends by the
        project's decode kernel (nanogpt/kernels/decode_attention.py) rather than SDPA over a mask."""
        device = slots.device
        self.positions = start_pos[:, None] + torch.arange(T, device=device)  # (B, T)
        self.query_positions = self.positions
        self.valid = torch.arange(T, device=device) < lengths[:, None]        # (B, T) real tokens
        # attention reads only the cache positions some real query of this batch can see
        self.span = max(1, int((start_pos + lengths).max()) if span is None else span)
        if self.span > max_len:
            raise ValueError(f"batch reaches position {self.span - 1}, the cache holds {max_len} positions")
        rows, cols = self.valid.nonzero(as_tuple=True)     # real tokens only: padding writes nothing
        self.write_from = (rows, cols)
        # no padding (every decode): the real tokens in row-major order are the batch itself, a
        # reshape (for T = 1 a view) rather than a gather in every layer
        self.dense = len(rows) == self.valid.numel()
        # A prompt chunk's row holds consecutive positions of one slot: on a CPU a row of
        # RUN_TOKENS or more is written as one slice (a plain copy), the other rows' tokens by one
        # index_put of (slot, position) pairs, which costs more per token but less per row
        # (docs/notes/kv-cache.md#writes). Decodes (T = 1) write by index_put alone.
        self.runs: list[tuple[int, int, int, int]] = []
        scattered = rows
        if T > 1 and device.type == "cpu":
            long = lengths >= RUN_TOKENS
            if bool(long.any()):
                self.runs = [(b, slot, start, n) for b, slot, start, n in zip(
                    long.nonzero().flatten().tolist(), slots[long].tolist(), start_pos[long].tolist(),
                    lengths[long].tolist())]
                short = ~long[rows]
                scattered, cols = rows[short], cols[short]
        self.write_at = (slots[scattered], self.positions[scattered, cols])  # (slot, position) of each
        self.scattered = (scattered, cols) if self.runs else None  # ... token not in a run, if any runs
        self.keys = torch.arange(self.span, device=device)
        # Rows in consecutive slots read the cache in place (a view). Rows in ascending slots with
        # a few unused slots between them read the whole slot range in place too, the unused
        # slots as extra rows whose output is dropped: cheaper than copying out the rows' keys and
        # values in every layer, which is what any other order costs.
        B = len(slots)
        first, last = int(slots[0]), int(slots[-1])
        self.rows, self.pick = slots, None
        if last - first + 1 <= 2 * B and bool((slots[1:] > slots[:-1]).all()):
            self.rows = slice(first, last + 1)
            if last - first + 1 > B:
                self.pick = slots - first  # each row's place in the slot range
        # Eagerly, at every row count: the kernel reads each row's keys and values once, in place,
        # where SDPA also applies a mask built per forward (docs/notes/decode-attention.md#eager);
        # such a window builds no mask
        self.decode_rows = (slots, self.positions[:, 0]) if own_kernel and T == 1 and self.dense else None
        if self.decode_rows is None:
            self.mask = self._spread(self.keys <= self.positions[:, None, :, None])  # (B, 1, T, span): key pos <= query pos

    def _spread(self, mask: torch.Tensor) -> torch.Tensor:
        """A (B, 1, T, span) mask laid out on the rows attention reads (the slot range, when read in place)."""
        if self.pick is None:
            return mask
        spread = torch.ones((self.rows.stop - self.rows.start, *mask.shape[1:]), dtype=torch.bool, device=mask.device)
        spread[self.pick] = mask  # unused slots attend to anything: finite, then dropped
        return spread

    def _local_mask(self, local: int) -> torch.Tensor:
        """The causal mask cut to each query's last `local` positions (padding queries see everything,
        so that no row is empty)."""
        def make():
            q = self.positions[:, None, :, None]
            recent = (self.keys > q - local) | ~self.valid[:, None, :, None]
            return self._spread((self.keys <= q) & recent)
        return self.remember(("local", local), make)

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """The real tokens of a (B, T, ...) tensor, in row-major order: (N, ...)."""
        return t.reshape(-1, *t.shape[2:]) if self.dense else t[self.write_from]

    def update(self, cache_layer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write new (B, nh, T, hs) into cache_layer (max_slots, nh, max_len, hs); return the rows'
        slots (or their slot range) up to the batch's furthest position, (B or range, nh, span, hs)."""
        self._write(cache_layer, new)
        return cache_layer[self.rows, :, :self.span]

    def _write(self, cache_layer: torch.Tensor, new: torch.Tensor) -> None:
        for b, slot, start, n in self.runs:
            cache_layer[slot, :, start:start + n] = new[b, :, :n]  # copy_ casts to the cache's dtype
        slot, pos = self.write_at
        if self.scattered is None:
            cache_layer[slot, :, pos] = self.real(new.transpose(1, 2)).to(cache_layer.dtype)  # (N, nh, hs)
        elif len(slot):
            cache_layer[slot, :, pos] = new.transpose(1, 2)[self.scattered].to(cache_layer.dtype)

    def _additive(self, dtype: torch.dtype, local: int | None) -> torch.Tensor:
        """The mask as attention adds it (0 where allowed, -inf elsewhere, in the cache's dtype),
        made once per forward: given a boolean mask, SDPA converts it in every layer."""
        def make():
            allowed = self.mask if local is None else self._local_mask(local)
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return self.remember(("additive", dtype, local), make)

    def attend(self, q, k, v, cache_k, cache_v, scale=None, local=None) -> torch.Tensor:
        """Store this batch's k, v (B, nh, T, hs) and attend q (B, nh, T, hs) to the cache: (B, nh, T, hs)
        in q's dtype, computed in the cache's (cache_dtype). scale: of q·k (default 1/sqrt(hs));
        local: attend only to the last `local` positions."""
        dtype, q = q.dtype, q.to(cache_k.dtype)
        if self.decode_rows is not None:
            slots, positions = self.decode_rows
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            out = decode_attention.write_and_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], cache_k, cache_v, slots,
                                                    positions, self.span, scale, local)
            return out[:, :, None].to(dtype)  # (B, nh, 1, hs)
        k, v = self.update(cache_k, k), self.update(cache_v, v)  # (B or the slot range, nh, span, hs)
        mask = self._additive(q.dtype, local)
        if self.pick is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).to(dtype)
        spread = q.new_zeros((k.shape[0], *q.shape[1:]))
        spread[self.pick] = q
        return F.scaled_dot_product_attention(spread, k, v, attn_mask=mask, scale=scale)[self.pick].to(dtype)


class PackedWindow(Window):
    """Several ragged batches over the cache (`CacheWindow` parts: the decoding rows, a prefill
    chunk) packed into one forward: their real tokens side by side in one row (1, N), part after
    part and row-major within a part, so that every weight matmul reads its weights once for all of
    them. Attention runs part by part, each on its own (B, T) layout."""

    def __init__(self, parts: list[CacheWindow]):
        self.parts = parts
        self.query_positions = torch.cat([part.real(part.positions) for part in parts])[None]  # (1, N)
        self.sizes = [len(part.write_from[0]) for part in parts]

    def attend(self, q, k, v, cache_k, cache_v, scale=None, local=None) -> torch.Tensor:
        """q, k, v (1, nh, N, hs) of the packed tokens -> (1, nh, N, hs)."""
        outputs = []
        for part, (qp, kp, vp) in zip(self.parts, zip(*(t.split(self.sizes, dim=2) for t in (q, k, v)))):
            y = part.attend(*(self._unpack(part, t) for t in (qp, kp, vp)), cache_k, cache_v, scale=scale, local=local)
            outputs.append(part.real(y.transpose(1, 2)).transpose(0, 1)[None])  # (1, nh, n, hs)
        return torch.cat(outputs, dim=2)

    @staticmethod
    def _unpack(part: CacheWindow, t: torch.Tensor) -> torch.Tensor:
        """A part's packed tokens (1, nh, n, hs) laid out as its batch (B, nh, T, hs), padding zero."""
        B, T = part.valid.shape
        _, nh, n, hs = t.shape
        if n == B * T:  # no padding: the packed order is the batch's row-major order
            return t[0].view(nh, B, T, hs).transpose(0, 1)
        full = t.new_zeros((B, T, nh, hs))
        full[part.write_from] = t[0].transpose(0, 1)
        return full.transpose(1, 2)


class DecodeWindow(Window):
    """The decode step's window (one new token per row, T = 1), written for torch.compile: no host
    syncs, and every shape fixed but the span. Row b writes slot slots[b] at positions[b] and
    attends to its slot's positions <= its own among `keys` = arange(span). Rows may share a slot
    at distinct positions: every row writes before any attends, so the tokens of a prompt chunk fed
    as rows (worker/decode_routes.py, KERNEL) see each other causally; padding rows may share a spare
    slot and position.

    With `own_kernel` (a cache KVCache.own_attention) the project's kernel attends where it pays
    (nanogpt/kernels/decode_attention.py: on a CPU from ROWS rows, on a GPU always); else attention is
    spelled as reductions over the gathered cache rows: compiled, inductor fuses the gather into
    them, so the slots' keys and values are read once, in place, in any slot order.
    """

    def __init__(self, slots, positions, keys, own_kernel: bool = False):
        self.slots, self.positions, self.keys = slots, positions, keys  # (B,), (B,), (span,)
        self.own_kernel = own_kernel
        self.query_positions = positions[:, None]  # (B, 1)
        self.mask = keys <= positions[:, None, None]  # (B, 1, span)

    def attend(self, q, k, v, cache_k, cache_v, scale=None, local=None) -> torch.Tensor:
        B, nh, _, hs = q.shape
        dtype, q = q.dtype, q.to(cache_k.dtype)  # attended in the cache's dtype, as CacheWindow does
        span = self.keys.shape[0]
        scale = 1.0 / math.sqrt(hs) if scale is None else scale
        if self.own_kernel and decode_attention.pays(B, q.device):
            out = decode_attention.write_and_attend(q[:, :, 0], k[:, :, 0], v[:, :, 0], cache_k, cache_v, self.slots,
                                                    self.positions, span, scale, local)
            return out[:, :, None].to(dtype)  # (B, nh, 1, hs)
        cache_k[self.slots, :, self.positions] = k[:, :, 0].to(cache_k.dtype)  # (B, nh, hs)
        cache_v[self.slots, :, self.positions] = v[:, :, 0].to(cache_v.dtype)
        keys, values = cache_k[self.slots, :, :span], cache_v[self.slots, :, :span]  # (B, nh, span, hs)
        scores = (q * keys).sum(-1) * scale  # (B, nh, span)
        mask = self.mask if local is None else self.mask & (self.keys > self.positions[:, None, None] - local)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return (p[..., None] * values).sum(-2)[:, :, None].to(dtype)  # (B, nh, 1, hs)
