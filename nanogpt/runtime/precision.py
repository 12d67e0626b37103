"""The precision a model runs in on a device, from what its registry entry asks and what the
hardware does natively.

- float32: the default, everywhere, and exact (greedy tokens equal transformers').
- bfloat16: on GPUs; on CPUs that multiply bf16 natively (AVX512_BF16, AMX), where it halves the
  weights read per token and the matmuls run 2-3x faster than float32. Elsewhere bf16 arithmetic
  is emulated and slower than float32, so such a CPU runs float32 and says so.
- float16: on GPUs; CPUs run float32 (PyTorch's CPU float16 matmuls are emulated).
- int8: CPUs only: float32 with the Linear weights quantized to int8 and activations quantized on
  the fly. fbgemm's int8 kernels need AVX2 and use VNNI (and AMX) where the CPU has it; without
  VNNI they still read a quarter of float32's weight bytes, so int8 pays on any CPU with AVX2
  (docs/performance.md#amd-epyc-avx2-only).

Keys and values are cached in the model's dtype, or where this CPU's attention runs clearly faster
or slower in bfloat16, in the other one (`cache_dtype`). How far bfloat16 and int8 drift from
float32: docs/performance.md#fidelity (bench/fidelity.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanogpt.kernels.decode_attention import bf16_attention_pays
from nanogpt.kernels.quantize import is_int8

NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 dot products
FAST_INT8 = "avx2"  # ... and with fbgemm's int8 kernels (every CPU with VNNI or AMX has AVX2 too)


@dataclass(frozen=True)
class Precision:
    """How a model runs: `dtype` of its weights, activations and KV cache, with the Linear layers
    quantized to int8 when `int8`. `note` says why this differs from what was asked (None when
    it does not)."""
    name: str  # what runs: float32, bfloat16, float16 or int8
    dtype: torch.dtype
    int8: bool = False
    note: str | None = None


def choose(requested: str, device: str, flags: frozenset[str] | set[str]) -> Precision:
    """What runs when the registry asks for `requested` (float32, bfloat16, float16, int8) on
    `device`, given the CPU's flags (`cpu_flags()`). ValueError for int8 on a GPU."""
    on_cpu = torch.device(device).type == "cpu"
    if requested == "int8":
        if not on_cpu:
            raise ValueError(f"dtype int8 runs on the CPU only, not on {device}")
        return Precision("int8", torch.float32, int8=True)
    if not on_cpu or requested == "float32":
        return Precision(requested, getattr(torch, requested))
    if requested == "bfloat16" and has_native_bf16(flags):
        return Precision("bfloat16", torch.bfloat16)
    why = ("this CPU has no native bfloat16 (none of the flags " + ", ".join(NATIVE_BF16) + "), so bf16 "
           "would be emulated and slower than float32" if requested == "bfloat16"
           else "PyTorch's float16 matmuls on a CPU are emulated and slower than float32")
    return Precision("float32", torch.float32, note=f"dtype {requested} asked for; running float32: {why}")


def faster_options(precision: Precision, device: str, flags: frozenset[str] | set[str]) -> list[str]:
    """The precisions faster than `precision` that this hardware runs: on a CPU running
    float32, bfloat16 where the CPU has native bf16 and int8 where fbgemm's int8 kernels run (AVX2 on)."""
    if torch.device(device).type != "cpu" or precision.name != "float32":
        return []
    return [name for name, native in (("bfloat16", has_native_bf16(flags)),
                                      ("int8", FAST_INT8 in flags)) if native]


def has_native_bf16(flags: frozenset[str] | set[str]) -> bool:
    return bool(set(NATIVE_BF16) & set(flags))


def cache_dtype(model_dtype: torch.dtype, device, int8: bool = False) -> torch.dtype:
    """The dtype a model's keys and values are cached and attended in: the model's own, except on a
    CPU whose attention runs clearly faster in bfloat16 or not (nanogpt/kernels/decode_attention.py
    `bf16_attention_pays`):
    - a bfloat16 model where it does not: float32, which holds the bfloat16 keys and values exactly,
      at twice the memory;
    - an int8 model (float32 activations) where it does: bfloat16, half the bytes each decode step
      reads (what llama.cpp's f16 cache does beside its q8_0 weights), at a drift of its own.
    A float32 model always caches in float32: it stays exact."""
    on_cpu = torch.device(device).type == "cpu"
    if model_dtype == torch.bfloat16 and on_cpu and not bf16_attention_pays():
        return torch.float32
    if int8 and on_cpu and bf16_attention_pays():
        return torch.bfloat16
    return model_dtype


def model_cache_dtype(model) -> torch.dtype:
    """cache_dtype for a serving model as loaded (int8 when its linear layers were quantized)."""
    return cache_dtype(model.dtype, model.device, int8=is_int8(model))
