"""Benchmarks of nanoserve (results and method in docs/performance.md).

    python -m bench.machine          # this machine's limits: the decode matmuls' ceiling per precision
                                     # and kernel, matmul GFLOP/s, copy bandwidth, the CPU and its flags
    python -m bench.engine_bench     # `make bench`: the engine vs transformers vs one-at-a-time
    python -m bench.fidelity         # bfloat16 and int8 against float32 on a trained checkpoint
    python -m bench.gateway_bench    # HTTP + Redis + worker overhead over the engine alone
    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --model NAME   # any OpenAI server
    python -m bench.serving_bench    # a serving load: Poisson arrivals, random lengths, TTFT/TPOT/ITL/E2E,
                                     # against nanoserve's stack, llama.cpp or any OpenAI base URL
    python -m bench.llama_cpp build  # llama.cpp's llama-server from source (the peer compared against),
                                     # GGUF conversion (f32, f16, q8_0), `serve` for any client
    python -m bench.gpu_check --out DIR   # one call on a GPU machine: the CUDA tests, the engine on
                                     # GPT-2 small and XL shapes, the whole stack, a profiled step

Checkpoints are random-weight Hugging Face directories of known shapes (GPT-2 small and XL, and the
125M GPT-Neo and OPT beside GPT-2 small), built once with `transformers` into `bench/.cache/` (or
$NANOSERVE_BENCH_CACHE) and reused: nothing downloads.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("NANOSERVE_BENCH_CACHE", Path(__file__).resolve().parent / ".cache"))

EOS = 50256  # GPT-2's <|endoftext|>, banned in every benchmark request (logit_bias -100)

# (family, the shape in transformers' config names) of the checkpoints the benchmarks use
SHAPES = {
    "gpt2-small": ("gpt2", dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024)),  # GPT-2 124M
    "gpt2-xl": ("gpt2", dict(n_layer=48, n_head=25, n_embd=1600, n_positions=1024)),  # GPT-2 1.5B
    "tiny": ("gpt2", dict(n_layer=2, n_head=2, n_embd=64, n_positions=128)),  # engine time near zero: the gateway's
    # EleutherAI/gpt-neo-125m's shape: global and local (window 256) layers alternating
    "gpt-neo-125m": ("gpt_neo", dict(vocab_size=50257, max_position_embeddings=2048, hidden_size=768, num_layers=12,
                                     num_heads=12, attention_types=[[["global", "local"], 6]], window_size=256)),
    # facebook/opt-125m's shape
    "opt-125m": ("opt", dict(vocab_size=50272, max_position_embeddings=2048, hidden_size=768, num_hidden_layers=12,
                             ffn_dim=3072, num_attention_heads=12, word_embed_proj_dim=768,
                             do_layer_norm_before=True)),
    # EleutherAI/gpt-j-6b's shape (6.05B): saved in bfloat16, drawn on a GPU where there is one
    "gpt-j-6b": ("gptj", dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64)),
}
BFLOAT16_SHAPES = {"gpt-j-6b"}  # 24 GB in float32


def checkpoint(shape: str = "gpt2-small", cache: Path | None = None) -> Path:
    """A random-weight checkpoint of a known shape with its family's tokenizer files (the real GPT-2
    vocabulary), built on first use (seconds) and then read from the cache."""
    # The tests' builders are the one place that knows how to make such checkpoints.
    from tests.conftest import make_family_checkpoint, make_hf_checkpoint

    directory = (cache or CACHE) / f"{shape}-random"
    if not (directory / "config.json").exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        family, shape_args = SHAPES[shape]
        # build beside the target, then rename: an interrupted build never looks finished
        tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=directory.parent))
        if family == "gpt2":
            make_hf_checkpoint(tmp, **shape_args)
        elif shape in BFLOAT16_SHAPES:
            import torch

            make_family_checkpoint(tmp, family, dtype=torch.bfloat16,
                                   device="cuda" if torch.cuda.is_available() else "cpu", **shape_args)
        else:
            make_family_checkpoint(tmp, family, **shape_args)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    return directory


def model_shape(checkpoint: Path) -> dict:
    """A Hugging Face checkpoint's model type, layers, width, heads, vocabulary and end-of-text id,
    whatever its family calls them."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())

    def first(*names):
        return next(config[n] for n in names if config.get(n) is not None)

    return {"model_type": config["model_type"], "n_layer": first("n_layer", "num_layers", "num_hidden_layers"),
            "n_embd": first("n_embd", "hidden_size"), "n_head": first("n_head", "num_heads", "num_attention_heads"),
            "vocab_size": config["vocab_size"], "eos": config.get("eos_token_id", EOS)}


def prompt_ids(index: int, length: int = 32) -> list[int]:
    """Request `index`'s prompt: random GPT-2 token ids (never EOS), the same in every benchmark,
    every system and every run."""
    rng = random.Random(1000 + index)
    return [rng.randrange(EOS) for _ in range(length)]


def rounds(concurrency: list[int], repeats: int, min_requests: int = 0) -> list[tuple[int, int, int]]:
    """A benchmark's rounds in the order to run them, (round, concurrency, rounds of it): `repeats`
    of each concurrency, or more where that many would time fewer than `min_requests` requests (a
    round of one request is a single sample of tens of milliseconds on a GPU)."""
    count = {c: max(repeats, -(-min_requests // max(c, 1))) for c in concurrency}
    return [(r, c, count[c]) for r in range(max(count.values(), default=0)) for c in concurrency if r < count[c]]


def output_arguments(parser, name: str) -> None:
    """A benchmark's --json (default: the bench cache's NAME.json), --markdown and --plot, which
    `write_results` writes."""
    parser.add_argument("--json", default=str(CACHE / f"{name}.json"))
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    parser.add_argument("--plot", default=None, help="write the plot here (a .png)")


def write_results(results: dict, table: str, json_path: str | Path, markdown_path: str | Path | None = None,
                  plot=None, plot_path: str | Path | None = None) -> None:
    """A benchmark's outputs: `results` as JSON, its markdown `table` on stdout (and in
    `markdown_path`), and `plot(results, path)` drawn to `plot_path`."""
    out = Path(json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if markdown_path:
        Path(markdown_path).write_text(table + "\n")
    if plot_path:
        plot(results, Path(plot_path))
    print(table)


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """Lay out a matplotlib figure, write it to `path` (its folder made) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
