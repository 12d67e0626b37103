"""The project's own C++ kernels (csrc/): the GEMV for one or two rows (csrc/gemv.cpp) and the
int8 mode's for a few (csrc/int8_gemv.cpp), both served through gemv.py; the decode step's
attention over the slot cache (csrc/decode_attention.cpp, through decode_attention.py); each row's
first maximum for the sampler (csrc/first_max.cpp); and the C++ CPU kernels of the compiled graphs'
ops (csrc/layer_ops.cpp, ops.py). One module (csrc/extension.cpp) on PyTorch's own threads.

They are compiled at install (`make install` runs `python -m nanogpt.kernels.extension`), else on
first use, for the vector width this CPU has, and the GEMV's bfloat16 dot
products where it has AVX512_BF16 (torch.utils.cpp_extension, under a minute) into
~/.cache/nanoserve/extensions (or $NANOSERVE_EXTENSIONS), where later starts load them in
milliseconds; the directory's name carries the instruction set, the torch version and a hash of the
sources and their place, so a cache carried to another CPU or torch, or left by other sources or
another checkout, is never loaded.
Without a C++ compiler they are not offered, and PyTorch's kernels serve.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from filelock import FileLock

from nanogpt.kernels.machine import cpu_flags

log = logging.getLogger(__name__)

ENV = "NANOSERVE_EXTENSIONS"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "extension.cpp", CSRC / "gemv.cpp", CSRC / "decode_attention.cpp", CSRC / "first_max.cpp",
           CSRC / "layer_ops.cpp", CSRC / "int8_gemv.cpp"]
HEADERS = [CSRC / "vec.h", CSRC / "gemv.h", CSRC / "own_kernels.h"]
# torch's CPU capability -> the compiler's vector flags: the widths the kernels are written for
FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
         "AVX2": ["-mavx2", "-mfma"]}
# ... and where the CPU has bfloat16 dot products (the GEMV then multiplies bfloat16 with them)
BF16_FLAGS = ["-mavx512bf16"]


def directory() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "nanoserve" / "extensions")


@functools.cache
def extension():
    """The built kernels' module, or None where they cannot run here (said once in the log)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        log.info("own kernels not offered: no AVX2 or AVX-512 here (%s)", capability)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("own kernels not offered: no C++ compiler (%s)", os.environ.get("CXX", "c++"))
        return None
    _ninja_on_path()
    flags = FLAGS[capability]
    if capability == "AVX512" and "avx512_bf16" in cpu_flags():
        capability, flags = "AVX512_BF16", flags + BF16_FLAGS
    # torch rebuilds when a source changes, not a header: the hash of both names the build; and when
    # the sources' paths change (its build file names them): two checkouts sharing one directory
    # would rebuild it in turn, so their paths are part of the name too
    sources = hashlib.sha256(str(CSRC).encode() + b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:12]
    version = torch.__version__.replace(".", "_").replace("+", "_")
    name = f"nanoserve_kernels_{capability.lower()}_torch{version}_{sources}"
    build = directory() / name
    from torch.utils.cpp_extension import load

    try:
        build.mkdir(parents=True, exist_ok=True)
        # torch's build lock (the file `lock`, there while held) outlives a process killed holding
        # it, and every later start would wait on it forever. Under this lock, which the OS frees
        # with its holder, no other process is loading from here: a `lock` found is stale.
        with FileLock(build / "nanoserve.lock"):
            (build / "lock").unlink(missing_ok=True)
            fresh = not (build / f"{name}.so").exists()
            if fresh:
                log.info("building the CPU kernels (once per CPU, torch and sources; about a minute)",
                         extra={"directory": str(build)})
            started = time.monotonic()
            module = load(name, [str(path) for path in SOURCES], extra_cflags=["-O3", "-fopenmp", *flags],
                          build_directory=str(build))
            if fresh:
                log.info("CPU kernels built", extra={"seconds": round(time.monotonic() - started, 1)})
            return module
    except Exception as error:  # no place to build, a compiler that fails: PyTorch's kernels serve
        log.warning("own kernels not offered: their build failed (%s)",
                    str(error).splitlines()[0] if str(error) else error)
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


def loaded():
    """The kernels' module where this process has built or loaded it already, else None: for a hot
    path that must never wait for a build."""
    return extension() if extension.cache_info().currsize else None


if __name__ == "__main__":  # the install step builds them: `python -m nanogpt.kernels.extension`
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = extension()
    print(f"own CPU kernels: {'built in ' + str(directory()) if module is not None else 'not offered here'}")
