"""One decode step's attention over the slot cache by the project's own kernels: each row's keys and
values read once, in place, in its slot. On a CPU the C++ kernel (csrc/decode_attention.cpp), on a
GPU the Triton one (triton_decode.py). The decode step (nanogpt/runtime/kv_cache.py DecodeWindow)
calls it as one op, `nanoserve::decode_attention`, where the cache was made for it
(KVCache.own_attention: a float32 or bfloat16 cache; on a CPU a head size the kernel is built for, on
a GPU Triton installed); a CPU from ROWS rows (`pays`), a GPU at any. Elsewhere the step spells
attention out in PyTorch's ops, which gathers the rows' cache on a GPU and, compiled on a CPU, reads
it well below the memory's rate (docs/notes/decode-attention.md#why).

Also here: whether a decode step's attention pays in bfloat16 on this CPU (`bf16_attention_pays`),
which the KV cache's dtype follows (nanogpt/runtime/precision.py cache_dtype).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Callable

import torch
from torch.nn import functional as F

from nanogpt.kernels import extension, triton_decode
from nanogpt.kernels.machine import MARGIN, OtherProcesses

# The rows from which the CPU kernel attends: below them inductor's fused kernel, which also writes
# the new keys and values, costs less than the op's dispatch and a write of its own
# (docs/notes/decode-attention.md#rows).
ROWS = 8

# the library of the project's ops inside compiled graphs (ops.py defines it); the CPU kernel is
# the C++ one, registered when the extension loads (csrc/layer_ops.cpp)
_LIBRARY = torch.library.Library("nanoserve", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor slots, Tensor positions, "
                "SymInt span, float scale, int local) -> Tensor")
_LIBRARY.impl("decode_attention", lambda q, cache_k, cache_v, slots, positions, span, scale, local:
              q.new_empty(q.shape), "Meta")
# on a GPU the kernel also writes the step's keys and values (the CPU's takes them written)
_LIBRARY.define("decode_attention_write(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, "
                "Tensor slots, Tensor positions, SymInt span, float scale, int local) -> Tensor")
_LIBRARY.impl("decode_attention_write", lambda q, k, v, cache_k, cache_v, slots, positions, span, scale, local:
              q.new_empty(q.shape), "Meta")
_LIBRARY.impl("decode_attention_write", triton_decode.write_and_attend, "CUDA")


def serves(device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether a cache of `dtype` on `device` with heads of `head_size` is attended by a kernel."""
    device = torch.device(device)
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    if device.type == "cuda":
        return triton_decode.available() and torch.cuda.is_available()
    return device.type == "cpu" and extension.available() and extension.extension().decode_attention_serves(head_size)


def pays(rows: int, device: torch.device) -> bool:
    """Whether a decode step of `rows` rows on `device` (its cache served) attends by the kernel."""
    return rows >= ROWS or device.type != "cpu"


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, span, scale: float, local: int | None) -> torch.Tensor:
    """q (B, heads, head size), of the cache's dtype -> (B, heads, head size): row b attends to its slot's
    positions <= positions[b] (and > positions[b] - local where `local`), of the first `span`."""
    return torch.ops.nanoserve.decode_attention(q, cache_k, cache_v, slots, positions, span, scale, local or 0)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, span, scale: float,
                     local: int | None) -> torch.Tensor:
    """Write the step's k, v (B, heads, head size) at each row's slot and position, then `attend`.
    A GPU's kernel does both (rows sharing a slot then do not see each other's new positions: the
    GPU's decode steps have none but padding rows); a CPU's writes by indexed copies first."""
    if q.is_cuda:
        return torch.ops.nanoserve.decode_attention_write(q, k, v, cache_k, cache_v, slots, positions, span, scale,
                                                          local or 0)
    cache_k[slots, :, positions] = k.to(cache_k.dtype)
    cache_v[slots, :, positions] = v.to(cache_v.dtype)
    return attend(q, cache_k, cache_v, slots, positions, span, scale, local)


# The decode attention timed: a batch of sequences, GPT-2 small's heads, a hundred-odd positions,
# over as many layers' caches as GPT-2 small has, attended one after the other as a decode step does
ATTENTION_SHAPE = (16, 12, 128, 64)  # rows, heads, positions, head size
ATTENTION_LAYERS = 12
# Seconds the timing spans at least: other processes' CPU time is counted in 10 ms ticks, and over
# a few ms one tick of anything else would read as a busy machine (docs/notes/kv-cache.md#timing).
WINDOW = 0.3


@functools.cache
def bf16_attention_pays() -> bool:
    """Whether a decode step's attention over its cached keys and values runs MARGIN times faster
    in bfloat16 than in float32 on this CPU, timed once per process (`_attention_pass`, a few
    hundred milliseconds). bfloat16 reads half the bytes but widens every element, and CPUs differ
    in which wins (docs/notes/kv-cache.md#dtype). Timings taken while other
    processes were busy are not trusted: float32, the safe choice, then."""
    passes = {dtype: _attention_pass(dtype) for dtype in (torch.float32, torch.bfloat16)}
    others, best, rounds = OtherProcesses(), {}, 0
    began = time.perf_counter()
    while rounds < 4 or time.perf_counter() - began < WINDOW:  # alternating, so that a burst of load hits both
        for dtype, attend in passes.items():
            start = time.perf_counter()
            attend()
            best[dtype] = min(best.get(dtype, math.inf), time.perf_counter() - start)
        rounds += 1
    return others.quiet() and best[torch.bfloat16] * MARGIN < best[torch.float32]


def _attention_pass(dtype: torch.dtype) -> Callable[[], None]:
    """One decode step's attention in `dtype`, ATTENTION_LAYERS layers' caches one after the other
    (each layer's keys and values come from memory, as in a step, where the weights' matmuls run
    between them), by what a compiled step attends with: the project's kernel where it serves both
    dtypes, PyTorch's attention elsewhere."""
    rows, heads, positions, size = ATTENTION_SHAPE
    layers = [(torch.empty(rows, heads, positions, size, dtype=dtype).uniform_(-1, 1),
               torch.empty(rows, heads, positions, size, dtype=dtype).uniform_(-1, 1)) for _ in range(ATTENTION_LAYERS)]
    if all(serves("cpu", d, size) for d in (torch.float32, torch.bfloat16)):
        q = torch.randn(rows, heads, size).to(dtype)
        slots, ends = torch.arange(rows), torch.full((rows,), positions - 1)
        return lambda: [attend(q, k, v, slots, ends, positions, size ** -0.5, None) for k, v in layers]
    q, mask = torch.randn(rows, heads, 1, size).to(dtype), torch.zeros(rows, 1, 1, positions, dtype=dtype)
    return lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for k, v in layers]
