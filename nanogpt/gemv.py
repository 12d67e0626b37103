"""The project's own matmul for one or two rows (nanogpt/gemv.cpp): each weight row streamed once
through the widest vector registers the CPU has, on PyTorch's own threads.

At one row a decode step is reading the weights, and PyTorch's kernels read them below the
machine's bandwidth: on an AVX-512 + BF16 EPYC, oneDNN's prepacked linear, PyTorch's fastest
there, ran GPT-2 small's decode matmuls 1.1-1.5x slower than this loop in float32 and 1.4-1.5x in
bfloat16 (docs/benchmarks.md). Another library's GEMV would bring its own thread pool, which on a
small machine takes the cores from PyTorch's (measured with OpenBLAS); this one runs in
at::parallel_for. nanogpt/kernels.py offers it as the kernel "gemv" beside PyTorch's and its
chooser decides by timing where it serves.

It is compiled on first use for the vector width this CPU has, and its bfloat16 dot products where
it has AVX512_BF16 (torch.utils.cpp_extension, about half a minute) into ~/.cache/nanoserve/extensions
(or $NANOSERVE_EXTENSIONS), where later starts load it in milliseconds; the directory's name carries
the instruction set and the torch version, so a cache carried to another CPU or torch is never
loaded there. Without a C++ compiler it is not offered.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from nanogpt.precision import cpu_flags

log = logging.getLogger(__name__)

ENV = "NANOSERVE_EXTENSIONS"
# The rows up to which it serves by rule in the float kernels' plans (nanogpt/kernels.py), a decode
# step of one or two sequences: in the engine at one request on an AVX-512 + BF16 EPYC it gave
# 1.11-1.22x oneDNN's tokens/s in float32 and 1.10-1.68x in bfloat16 (docs/benchmarks.md).
ROWS = 2
SOURCE = Path(__file__).with_name("gemv.cpp")
# torch's CPU capability -> the compiler's vector flags: the widths the kernel is written for
FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
         "AVX2": ["-mavx2", "-mfma"]}
# ... and where the CPU has bfloat16 dot products (the kernel then multiplies bfloat16 with them)
BF16_FLAGS = ["-mavx512bf16"]


def directory() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "nanoserve" / "extensions")


@functools.cache
def extension():
    """The built kernel's module, or None where it cannot run here (said once in the log)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        log.info("gemv kernel not offered: no AVX2 or AVX-512 here (%s)", capability)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("gemv kernel not offered: no C++ compiler (%s)", os.environ.get("CXX", "c++"))
        return None
    _ninja_on_path()
    flags = FLAGS[capability]
    if capability == "AVX512" and "avx512_bf16" in cpu_flags():
        capability, flags = "AVX512_BF16", flags + BF16_FLAGS
    name = f"nanoserve_gemv_{capability.lower()}_torch{torch.__version__.replace('.', '_').replace('+', '_')}"
    build = directory() / name
    from torch.utils.cpp_extension import load

    try:
        build.mkdir(parents=True, exist_ok=True)
        return load(name, [str(SOURCE)], extra_cflags=["-O3", "-fopenmp", *flags],
                    build_directory=str(build))
    except Exception as error:  # no place to build, a compiler that fails: PyTorch's kernels serve
        log.warning("gemv kernel not offered: its build failed (%s)", str(error).splitlines()[0] if str(error) else error)
        return None


def _ninja_on_path() -> None:
    # torch builds extensions with ninja, which it looks for on PATH; the project depends on the
    # ninja package, whose binary sits beside the interpreter when its virtualenv is not activated
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def available() -> bool:
    return extension() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
           algorithm: str = "", residual: torch.Tensor | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias) + residual, for float32 or bfloat16 x and weight of one
    dtype; `activation`, `algorithm` as oneDNN's post-ops name them ("gelu" with "tanh" or "none",
    "relu", "none")."""
    return extension().linear(x, weight, bias, activation, algorithm, residual)
