"""The precision a model runs in on a device, from what its registry entry asks and what the
hardware does natively.

- float32: the default, everywhere, and exact (greedy tokens equal transformers').
- bfloat16: on GPUs; on CPUs that multiply bf16 natively (AVX512_BF16, AMX), where it halves the
  weights read per token and the matmuls run 2-3x faster than float32. Elsewhere bf16 arithmetic
  is emulated and slower than float32, so such a CPU runs float32 and says so.
- float16: on GPUs; CPUs run float32 (PyTorch's CPU float16 matmuls are emulated).
- int8: CPUs only: float32 with the Linear weights quantized to int8 and activations quantized on
  the fly. fbgemm's int8 kernels need AVX2 and use VNNI (and AMX) where the CPU has it; on an
  AVX2-only CPU without VNNI they still read a quarter of float32's weight bytes and ran 2.4-3.0x
  float32 (docs/performance.md#amd-epyc-avx2-only), so int8 pays on any CPU with AVX2.

The fidelity of bfloat16 and int8 against float32 is in docs/performance.md#fidelity (bench/fidelity.py).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (where there is no /proc/cpuinfo:
    the ones PyTorch itself detects)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    detected = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
                "avx512_vnni": "_is_vnni_supported", "avx512_bf16": "_is_avx512_bf16_supported",
                "amx_tile": "_is_amx_tile_supported"}
    return frozenset(flag for flag, probe in detected.items()
                     if getattr(torch.cpu, probe, lambda: False)())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
