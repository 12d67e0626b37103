"""models/registry.py: models.toml parsing and its errors, aliases, and checkpoint shapes read
without torch and without loading weights (nanoGPT ckpt.pt, Hugging Face directories, the HF cache)."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile

import pytest

from conftest import REPO, write_gpt2_tokenizer
from models.registry import (DEFAULT_PATH, ModelNotFoundError, ModelSpec, Registry, RegistryError,
                             read_model_args)
from models.tokenizer import TokenizerSpec, load_tokenizer

TINY_ARGS = dict(n_layer=1, n_head=2, n_embd=8, block_size=32, bias=False, vocab_size=65, dropout=0.0)


def write_toml(directory, text: str):
    path = directory / "models.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def run_python(code: str, **env) -> dict:
    """Run `code` in a fresh interpreter (so imports and environment are its own); it prints JSON."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def save_nanogpt_ckpt(path, model_args=TINY_ARGS):
    """A ckpt.pt shaped like nanoGPT train.py's: real tensors, an optimizer state after one step, a
    tensor best_val_loss, and the model_args dict."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(model_args["vocab_size"], 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": model_args,
                "iter_num": 1, "best_val_loss": torch.tensor(1.25),
                "config": {"dataset": "shakespeare_char", "device": torch.device("cpu")}}, path)
    return path


# ---- torch-free ----

def test_registry_and_tokenizer_import_without_torch():
    loaded = run_python("""
        import json, sys
        import models.registry, models.tokenizer
        print(json.dumps(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)))
    """)
    assert loaded == []


# ---- models.toml ----

def test_default_models_toml_parses(monkeypatch):
    monkeypatch.delenv("NANOSERVE_MODELS", raising=False)
    registry = Registry.from_file()
    assert [m.id for m in registry.models()] == ["shakespeare-char", "gpt2"]
    assert registry.default.id == "shakespeare-char"
    shakespeare = registry.get("shakespeare-char")
    assert shakespeare.checkpoint == str(REPO / "checkpoints" / "shakespeare-char" / "ckpt.pt")
    # no max_batch: the engine sizes its batch by its device (nanogpt/runtime/kv_cache.default_slots)
    assert (shakespeare.device, shakespeare.dtype, shakespeare.max_batch) == ("auto", "float32", None)
    gpt2 = registry.get("gpt-2")
    assert gpt2.id == "gpt2" and gpt2.checkpoint == "hf:gpt2"
    # cached or not, GPT-2 small has this shape
    assert (gpt2.context_length, gpt2.vocab_size, gpt2.eos_token_id) == (1024, 50257, 50256)
    assert gpt2.tokenizer.kind == "gpt2-bpe"
    assert Registry.from_file(DEFAULT_PATH).models() == registry.models()


def test_registry_path_from_environment(tmp_path, monkeypatch):
    path = write_toml(tmp_path, """
        [models.only]
        checkpoint = "hf:gpt2"
    """)
    monkeypatch.setenv("NANOSERVE_MODELS", str(path))
    assert [m.id for m in Registry.from_file().models()] == ["only"]


def test_all_options_and_aliases(tmp_path):
    path = write_toml(tmp_path, """
        default = "big"
        [models.small]
        checkpoint = "ckpts/small/ckpt.pt"
        [models.big]
        checkpoint = "/abs/big"
        aliases = ["large", "the-big-one"]
        device = "cuda:1"
        dtype = "bfloat16"
        max_batch = 64
        prefix_caching = false
        owned_by = "me"
        created = 1700000000
    """)
    registry = Registry.from_file(path)
    big = registry.get("the-big-one")
    assert big is registry.get("big") is registry.get("large") is registry.default
    assert big == ModelSpec(id="big", checkpoint="/abs/big", aliases=("large", "the-big-one"),
                            device="cuda:1", dtype="bfloat16", max_batch=64, prefix_caching=False, owned_by="me",
                            created=1700000000, source=str(path))
    small = registry.get("small")
    assert small.checkpoint == str(tmp_path / "ckpts" / "small" / "ckpt.pt")  # relative to the toml
    assert small.created == int(path.stat().st_mtime) and small.owned_by == "nanoserve"
    assert "large" in registry and "small-1" not in registry
    with pytest.raises(dataclasses.FrozenInstanceError):
        big.max_batch = 1


def test_relative_checkpoints_resolve_against_the_toml_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = write_toml(tmp_path / "conf", """
        [models.m]
        checkpoint = "../ckpts/m/ckpt.pt"
    """)
    monkeypatch.chdir(tmp_path / "conf")
    assert Registry.from_file(path).get("m").checkpoint == str(tmp_path / "ckpts" / "m" / "ckpt.pt")


def test_unknown_model_uses_openai_wording(tmp_path):
    registry = Registry.from_file(write_toml(tmp_path, '[models.a]\ncheckpoint = "hf:gpt2"\n'))
    with pytest.raises(ModelNotFoundError) as caught:
        registry.get("gpt-5")
    assert isinstance(caught.value, KeyError)
    assert str(caught.value) == "The model `gpt-5` does not exist or you do not have access to it."
    assert caught.value.model == "gpt-5"
    with pytest.raises(ModelNotFoundError):
        registry.get(None)


BAD_REGISTRIES = {
    "syntax": ('[models.a]\ncheckpoint = "x"\ndtype = \n', r"invalid TOML: .*line 3"),
    "no models": ('default = "a"\n', r"no models defined"),
    "top-level key": ('colour = "red"\n[models.a]\ncheckpoint = "x"\n', r"unknown top-level key\(s\) `colour`"),
    "missing checkpoint": ('[models.a]\ndtype = "float16"\n', r"model `a`: missing `checkpoint`"),
    "empty checkpoint": ('[models.a]\ncheckpoint = ""\n', r"model `a`: `checkpoint` must be a non-empty string"),
    "unknown key": ('[models.a]\ncheckpoint = "x"\nbatch = 3\nfoo = 1\n',
                    r"model `a`: unknown key\(s\) `batch`, `foo` \(allowed: `aliases`, "),
    "bad dtype": ('[models.a]\ncheckpoint = "x"\ndtype = "float64"\n',
                  r"model `a`: `dtype` must be float32 or bfloat16 or float16 or int8, got 'float64'"),
    "bad device": ('[models.a]\ncheckpoint = "x"\ndevice = "gpu0"\n', r"model `a`: `device` must be"),
    "zero max_batch": ('[models.a]\ncheckpoint = "x"\nmax_batch = 0\n', r"`max_batch` must be a positive integer"),
    "bool max_batch": ('[models.a]\ncheckpoint = "x"\nmax_batch = true\n', r"`max_batch` must be a positive"),
    "string max_batch": ('[models.a]\ncheckpoint = "x"\nmax_batch = "8"\n', r"`max_batch` must be a positive"),
    "string prefix_caching": ('[models.a]\ncheckpoint = "x"\nprefix_caching = "off"\n',
                              r"`prefix_caching` must be true or false, got 'off'"),
    "bad aliases": ('[models.a]\ncheckpoint = "x"\naliases = "b"\n', r"`aliases` must be a list of non-empty"),
    "duplicate alias": ('[models.a]\ncheckpoint = "x"\naliases = ["z"]\n[models.b]\ncheckpoint = "y"\naliases = ["z"]\n',
                        r"model `b`: name `z` is already used by model `a`"),
    "alias is a model": ('[models.a]\ncheckpoint = "x"\n[models.b]\ncheckpoint = "y"\naliases = ["a"]\n',
                         r"model `b`: name `a` is already used by model `a`"),
    "not a table": ('[models]\na = "x"\n', r"model `a`: expected a table"),
    "bad name": ('[models."a b"]\ncheckpoint = "x"\n', r"no whitespace"),
    "undefined default": ('default = "c"\n[models.a]\ncheckpoint = "x"\n', r"default model `c` is not defined"),
}


@pytest.mark.parametrize("name", BAD_REGISTRIES)
def test_bad_registry_files_are_named_and_explained(tmp_path, name):
    text, message = BAD_REGISTRIES[name]
    path = tmp_path / "models.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RegistryError, match=message) as caught:
        Registry.from_file(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_missing_registry_file(tmp_path):
    with pytest.raises(RegistryError, match=r"nope\.toml: cannot read model registry: No such file"):
        Registry.from_file(tmp_path / "nope.toml")


# ---- checkpoint shapes, resolved lazily ----

def test_a_missing_checkpoint_fails_alone_and_only_when_used(tmp_path):
    path = write_toml(tmp_path, """
        [models.untrained]
        checkpoint = "out/ckpt.pt"
        [models.gpt2]
        checkpoint = "hf:gpt2"
    """)
    registry = Registry.from_file(path)
    assert [m.id for m in registry.models()] == ["untrained", "gpt2"]
    untrained = registry.get("untrained")
    with pytest.raises(RegistryError, match=rf"^{path}: model `untrained`: {tmp_path / 'out' / 'ckpt.pt'}: "
                                            "no such file or directory$"):
        untrained.context_length
    assert registry.get("gpt2").context_length == 1024
    # resolution is retried, so a checkpoint trained after startup is picked up
    save_nanogpt_ckpt(tmp_path / "out" / "ckpt.pt")
    assert untrained.context_length == 32


def test_nanogpt_checkpoint_read_without_torch(tmp_path):
    ckpt = save_nanogpt_ckpt(tmp_path / "char" / "ckpt.pt")
    (tmp_path / "char" / "meta.pkl").write_bytes(pickle.dumps(
        {"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}}))
    save_nanogpt_ckpt(tmp_path / "bpe" / "ckpt.pt", dict(TINY_ARGS, vocab_size=50304, block_size=64))
    write_gpt2_tokenizer(tmp_path / "bpe")
    save_nanogpt_ckpt(tmp_path / "bare" / "ckpt.pt", dict(TINY_ARGS, vocab_size=50304))
    path = write_toml(tmp_path, """
        [models.char]
        checkpoint = "char/ckpt.pt"
        [models.bpe]
        checkpoint = "bpe"                  # nanoGPT's out_dir: the ckpt.pt inside is used
        [models.bare]
        checkpoint = "bare/ckpt.pt"
        context_length = 16
    """)
    shapes = run_python(f"""
        import json, sys
        from models.registry import Registry, read_model_args
        registry = Registry.from_file({str(path)!r})
        shapes = {{m.id: [m.context_length, m.vocab_size, m.eos_token_id, m.tokenizer.kind,
                          [f.name for f in m.tokenizer.files]] for m in registry.models()}}
        shapes["args"] = read_model_args(__import__("pathlib").Path({str(ckpt)!r}))
        shapes["torch"] = "torch" in sys.modules
        print(json.dumps(shapes))
    """)
    assert shapes == {
        "char": [32, 65, None, "char", ["meta.pkl"]],
        "bpe": [64, 50304, 50256, "gpt2-bpe", ["vocab.json", "merges.txt"]],
        "bare": [16, 50304, 50256, "gpt2-bpe", []],  # no vocabulary files: tiktoken's r50k_base
        "args": TINY_ARGS,
        "torch": False,
    }


def test_reading_a_checkpoint_runs_no_code_from_it(tmp_path):
    """data.pkl is unpickled with inert stand-ins: a pickle that would call os.system does nothing."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    ckpt = tmp_path / "ckpt.pt"
    with zipfile.ZipFile(ckpt, "w") as archive:
        archive.writestr("ckpt/data.pkl", pickle.dumps({"model_args": TINY_ARGS, "x": Exploit()}, protocol=2))
    assert read_model_args(ckpt) == TINY_ARGS
    assert not marker.exists()


@pytest.mark.parametrize("kind, message", [
    ("garbage", r"not a torch zip checkpoint"),
    ("zip without data.pkl", r"no data\.pkl inside"),
    ("truncated pickle", r"corrupt checkpoint"),
    ("no model_args", r"no `model_args` dict \(not a nanoGPT checkpoint\)"),
    ("bad model_args", r"model_args needs integer `block_size` and `vocab_size`"),
])
def test_bad_nanogpt_checkpoints(tmp_path, kind, message):
    ckpt = tmp_path / "ckpt.pt"
    if kind == "garbage":
        ckpt.write_bytes(b"\x80\x02not a zip")
    else:
        payload = {"zip without data.pkl": None,
                   "truncated pickle": pickle.dumps({"model_args": TINY_ARGS})[:-5],
                   "no model_args": pickle.dumps({"model": {}}),
                   "bad model_args": pickle.dumps({"model_args": dict(TINY_ARGS, block_size="32")})}[kind]
        with zipfile.ZipFile(ckpt, "w") as archive:
            archive.writestr("ckpt/data.pkl" if payload else "ckpt/version", payload or b"3\n")
    path = write_toml(tmp_path, '[models.m]\ncheckpoint = "ckpt.pt"\n')
    with pytest.raises(RegistryError, match=rf"^{path}: model `m`: {ckpt}: {message}"):
        Registry.from_file(path).get("m").vocab_size


def test_hugging_face_directory(tmp_path, hf_checkpoint):
    path = write_toml(tmp_path, f"""
        [models.tiny]
        checkpoint = "{hf_checkpoint}"
        [models.tiny-short]
        checkpoint = "{hf_checkpoint}"
        context_length = 64
        vocab_size = 50257
    """)
    registry = Registry.from_file(path)
    tiny = registry.get("tiny")
    assert (tiny.context_length, tiny.vocab_size, tiny.eos_token_id) == (128, 50257, 50256)
    assert tiny.resolved.path == hf_checkpoint
    assert tiny.tokenizer == TokenizerSpec("gpt2-bpe", (hf_checkpoint / "vocab.json", hf_checkpoint / "merges.txt"),
                                           eos_token_id=50256)
    assert load_tokenizer(tiny).encode("Hello world") == [15496, 995]
    assert registry.get("tiny-short").context_length == 64


@pytest.mark.parametrize("config, extra, message", [
    ("{not json", "", r"config\.json: not readable JSON"),
    ('{"n_positions": "1024"}', "", r"config\.json: n_positions, vocab_size, bos_token_id and eos_token_id must be "),
    ('{"model_type": "llama"}', "", r"model_type `llama` is not supported \(supported: gpt2, gpt_neo, gptj, opt, "
                                    r"gpt_neox\)"),
    (None, "", r"neither config\.json \(Hugging Face\) nor ckpt\.pt \(nanoGPT\) here"),
    ('{"n_positions": 128}', "context_length = 256", r"context_length 256 exceeds the checkpoint's 128"),
    ('{"n_positions": 128}', "vocab_size = 100", r"vocab_size 100 differs from the checkpoint's 50257"),
])
def test_bad_hugging_face_directories(tmp_path, config, extra, message):
    (tmp_path / "ckpt").mkdir()
    if config is not None:
        (tmp_path / "ckpt" / "config.json").write_text(config)
    path = write_toml(tmp_path, f'[models.m]\ncheckpoint = "ckpt"\n{extra}\n')
    with pytest.raises(RegistryError, match=rf"^{path}: model `m`: .*{message}"):
        Registry.from_file(path).get("m").context_length


def test_hf_repos_from_the_local_cache(tmp_path):
    """`hf:` names read a hand-built Hugging Face cache (HF_HUB_CACHE); uncached GPT-2 sizes fall back
    to their known shapes, other uncached repos need context_length and vocab_size."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-gpt2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (cache / "models--acme--tiny-gpt2" / "refs").mkdir()
    (cache / "models--acme--tiny-gpt2" / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_positions": 256, "vocab_size": 50257, "eos_token_id": 50256}))
    write_gpt2_tokenizer(snapshot)
    other = cache / "models--acme--tiny-gpt2" / "snapshots" / "feedbeef"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"n_positions": 512}))
    path = write_toml(tmp_path, """
        [models.tiny]
        checkpoint = "hf:acme/tiny-gpt2"
        [models.tiny-old]
        checkpoint = "hf:acme/tiny-gpt2@feedbeef"
        [models.medium]
        checkpoint = "hf:openai-community/gpt2-medium"
        [models.neo]
        checkpoint = "hf:EleutherAI/gpt-neo-125m"
        [models.gptj]
        checkpoint = "hf:EleutherAI/gpt-j-6b"
        [models.opt]
        checkpoint = "hf:facebook/opt-125m"
        [models.declared]
        checkpoint = "hf:acme/not-cached"
        context_length = 2048
        vocab_size = 50257
        [models.unknown]
        checkpoint = "hf:acme/not-cached"
        [models.malformed]
        checkpoint = "hf:a//b"
    """)
    shapes = run_python(f"""
        import json
        from models.registry import Registry, RegistryError
        out = {{}}
        for m in Registry.from_file({str(path)!r}).models():
            try:
                out[m.id] = [m.context_length, m.vocab_size, m.eos_token_id, len(m.tokenizer.files),
                             str(m.resolved.path)]
            except RegistryError as err:
                out[m.id] = str(err)
        print(json.dumps(out))
    """, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    assert shapes["tiny"] == [256, 50257, 50256, 2, str(snapshot)]
    assert shapes["tiny-old"] == [512, 50257, 50256, 0, str(other)]
    assert shapes["medium"] == [1024, 50257, 50256, 0, "None"]
    assert shapes["declared"] == [2048, 50257, 50256, 0, "None"]
    # GPT-Neo and GPT-J use GPT-2's tokenizer; OPT's vocabulary is its own: it must be in the cache
    assert shapes["neo"] == [2048, 50257, 50256, 0, "None"]
    assert shapes["gptj"] == [2048, 50400, 50256, 0, "None"]
    assert "not in the local Hugging Face cache" in shapes["opt"]
    assert shapes["unknown"].startswith(f"{path}: model `unknown`: `hf:acme/not-cached` is not in the local "
                                        "Hugging Face cache")
    assert "context_length" in shapes["unknown"]
    assert shapes["malformed"].startswith(f"{path}: model `malformed`: invalid Hugging Face repo id `a//b`")


def test_every_family_is_read_without_torch_or_weights(tmp_path, family_checkpoints):
    """Context length, vocabulary, EOS and tokenizer of each family's checkpoint, read by the registry
    in a process where importing torch fails; the tokenizer loads and encodes there too."""
    for checkpoint in family_checkpoints.values():
        os.rename(checkpoint / "model.safetensors", checkpoint / "model.safetensors.away")  # no weights at all
    try:
        path = write_toml(tmp_path, "".join(f'[models.{name}]\ncheckpoint = "{checkpoint}"\n'
                                            for name, checkpoint in family_checkpoints.items()))
        shapes = run_python(f"""
            import json, sys
            sys.modules["torch"] = None  # any import of torch raises ImportError
            from models.registry import Registry
            from models.tokenizer import load_tokenizer
            out = {{}}
            for m in Registry.from_file({str(path)!r}).models():
                tok = load_tokenizer(m)
                out[m.id] = [m.context_length, m.vocab_size, m.eos_token_id, tok.vocab_size, tok.eos_token_id,
                             tok.encode("Hello world")]
            print(json.dumps(out))
        """)
    finally:
        for checkpoint in family_checkpoints.values():
            os.rename(checkpoint / "model.safetensors.away", checkpoint / "model.safetensors")
    assert shapes["gpt_neo"] == [128, 50257, 50256, 50257, 50256, [15496, 995]]
    assert shapes["gptj"] == [128, 50400, 50256, 50257, 50256, [15496, 995]]  # 143 padding rows
    assert shapes["opt"][:5] == [128, 50272, 2, 50261, 2]  # OPT: `</s>`, before every text prompt too
    assert shapes["opt"][5][0] == 2 and len(shapes["opt"][5]) == 3
    assert shapes["gpt_neox"][:5] == [128, 50304, 0, 50281, 0]  # 2 specials + GPT-2's 50256 + 23 runs of spaces
    assert shapes["gpt_neox"][5] == [15496 + 2, 995 + 2]  # GPT-2's ids after `<|endoftext|>`, `<|padding|>`
