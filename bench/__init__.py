"""Benchmarks of nanoserve (results and method in docs/benchmarks.md).

    python -m bench.machine          # this machine's limits: the decode matmuls' ceiling per precision
                                     # and kernel, matmul GFLOP/s, copy bandwidth, the CPU and its flags
    python -m bench.engine_bench     # `make bench`: the engine vs transformers vs one-at-a-time
    python -m bench.fidelity         # bfloat16 and int8 against float32 on a trained checkpoint
    python -m bench.gateway_bench    # HTTP + Redis + worker overhead over the engine alone
    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --model NAME   # any OpenAI server

Checkpoints are random-weight GPT-2-shaped Hugging Face directories, built once with
`transformers` into `bench/.cache/` (or $NANOSERVE_BENCH_CACHE) and reused: nothing downloads.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("NANOSERVE_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))

EOS = 50256  # GPT-2's <|endoftext|>, banned in every benchmark request (logit_bias -100)

# (n_layer, n_head, n_embd, n_positions) of the checkpoints the benchmarks use
SHAPES = {
    "gpt2-small": (12, 12, 768, 1024),  # GPT-2 124M
    "tiny": (2, 2, 64, 128),  # engine time near zero: what is left is the gateway's
}


def checkpoint(shape: str = "gpt2-small", cache: Path | None = None) -> Path:
    """A random-weight GPT-2 checkpoint of a known shape with the real GPT-2 vocabulary, built on
    first use (a few seconds) and then read from the cache."""
    # The tests' builder is the one place that knows how to make such a checkpoint.
    from tests.conftest import make_hf_checkpoint

    directory = (cache or CACHE) / f"{shape}-random"
    if not (directory / "config.json").exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        n_layer, n_head, n_embd, n_positions = SHAPES[shape]
        # build beside the target, then rename: an interrupted build never looks finished
        tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=directory.parent))
        make_hf_checkpoint(tmp, n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    return directory


def prompt_ids(index: int, length: int = 32) -> list[int]:
    """Request `index`'s prompt: random GPT-2 token ids (never EOS), the same in every benchmark,
    every system and every run."""
    rng = random.Random(1000 + index)
    return [rng.randrange(EOS) for _ in range(length)]
