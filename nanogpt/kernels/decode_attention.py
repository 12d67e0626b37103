"""One decode step's attention over the slot cache on a CPU, by the project's own kernel
(nanogpt/decode_attention.cpp): each row's keys and values read once, in place, in its slot. The
compiled decode step (nanogpt/kv_cache.py DecodeWindow) calls it as one op,
`nanoserve::decode_attention`, for batches of ROWS rows or more where the cache was made for it
(KVCache.own_attention: a CPU, a float32 or bfloat16 cache, a head size the kernel is built for);
elsewhere the step spells attention out in PyTorch's ops. At 32 rows on an AMX Xeon inductor's
fused kernel for those ops read a bfloat16 cache at ~10 GB/s and a float32 one at ~16, about a
third and three fifths of the memory's rate (docs/notes/decode-attention.md#why)."""
from __future__ import annotations

import torch

from nanogpt import extension

# The rows from which the kernel attends: a compiled step's batch is fixed per graph, and below it
# inductor's fused kernel (which also writes the new keys and values) costs less than the op's
# dispatch and a write of its own (bfloat16, 12 heads, span 64: 44 against 68 µs a layer at 2
# rows, 81 against 87 at 4; 149 against 114 at 8; the int8 step at one row 7.2-7.7 against
# 7.4-8.5 ms).
ROWS = 8

# the library of the project's ops inside compiled graphs (nanogpt/kernels.py defines it); the CPU
# kernel is the C++ one, registered when the extension loads (nanogpt/layer_ops.cpp)
_LIBRARY = torch.library.Library("nanoserve", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor slots, Tensor positions, "
                "SymInt span, float scale, int local) -> Tensor")
_LIBRARY.impl("decode_attention", lambda q, cache_k, cache_v, slots, positions, span, scale, local:
              q.new_empty(q.shape), "Meta")


def serves(device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether a cache of `dtype` on `device` with heads of `head_size` is attended by the kernel."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and extension.available() and extension.extension().decode_attention_serves(head_size))


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, span, scale: float, local: int | None) -> torch.Tensor:
    """q (B, heads, head size), of the cache's dtype -> (B, heads, head size): row b attends to its slot's
    positions <= positions[b] (and > positions[b] - local where `local`), of the first `span`."""
    return torch.ops.nanoserve.decode_attention(q, cache_k, cache_v, slots, positions, span, scale, local or 0)
