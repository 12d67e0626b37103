"""nanogpt.checkpoint: every supported format loads to the same model as transformers; every broken
one raises CheckpointError naming the file; `hf:` names resolve from the local hub cache only."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from nanogpt.checkpoint import CheckpointError, load_model, resolve_checkpoint, save_nanogpt_checkpoint
from nanogpt.model import GPT, GPTConfig

IDS = torch.tensor([[15496, 995, 11, 428, 318, 281, 1332, 13]])


def logits(model):
    return model(IDS, targets=IDS)[0]


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    """transformers' logits for the shared tiny checkpoint."""
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()(IDS).logits


@pytest.fixture()
def hf_copy(hf_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint's config and weights, free to break."""
    directory = tmp_path / "hf"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_checkpoint / name, directory / name)
    return directory


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


# --- Hugging Face directories ------------------------------------------------------------------

def test_hf_safetensors_directory(hf_checkpoint, reference):
    model = load_model(str(hf_checkpoint))
    assert not model.training
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size) == (2, 2, 64, 128, 50257)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_close(logits(model), reference, rtol=1e-5, atol=1e-5)


def test_hf_pytorch_bin_in_original_gpt2_layout(hf_copy, reference):
    """pytorch_model.bin as OpenAI's GPT-2 repos ship it: no 'transformer.' prefix, causal-mask
    buffers present, no lm_head."""
    state = load_file(hf_copy / "model.safetensors")
    original = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    for layer in range(2):
        original[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    (hf_copy / "model.safetensors").unlink()
    torch.save(original, hf_copy / "pytorch_model.bin")
    assert_close(logits(load_model(hf_copy)), reference, rtol=1e-5, atol=1e-5)


def test_hf_sharded_safetensors(hf_copy, reference):
    state = load_file(hf_copy / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, hf_copy / shard)
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf_copy / "model.safetensors").unlink()
    assert_close(logits(load_model(hf_copy)), reference, rtol=1e-5, atol=1e-5)


def test_dtype_and_device(hf_checkpoint):
    model = load_model(hf_checkpoint, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.transformer.wte.weight


# --- nanoGPT ckpt.pt ---------------------------------------------------------------------------

def test_nanogpt_round_trip(tmp_path):
    torch.manual_seed(0)
    model_args = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, vocab_size=65, dropout=0.1)
    model = GPT(GPTConfig(**model_args)).eval()
    path = save_nanogpt_checkpoint(tmp_path / "out" / "ckpt.pt", model, model_args,
                                   iter_num=250, best_val_loss=1.5, config={"dataset": "shakespeare_char"},
                                   optimizer=model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu").state_dict())
    saved = torch.load(path, weights_only=True)
    assert {"model", "model_args", "iter_num", "best_val_loss", "config", "optimizer"} <= set(saved)
    assert saved["model_args"] == model_args and saved["iter_num"] == 250
    assert not list(tmp_path.glob("out/*.tmp"))

    ids = torch.randint(0, 65, (2, 16))
    for checkpoint in (path, tmp_path / "out"):  # the file, or nanoGPT's out_dir holding it
        loaded = load_model(str(checkpoint))
        assert loaded.config.bias is False and loaded.config.vocab_size == 65
        assert torch.equal(loaded(ids, ids)[0], model(ids, ids)[0])


def test_nanogpt_compiled_prefix_is_stripped(hf_checkpoint, tmp_path, reference):
    """train.py with compile=True saves keys as '_orig_mod.<name>'."""
    model = load_model(hf_checkpoint)
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    model_args = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, bias=True, vocab_size=50257, dropout=0.0)
    torch.save({"model": state, "model_args": model_args, "iter_num": 0, "best_val_loss": 1e9, "config": {}},
               tmp_path / "ckpt.pt")
    assert_close(logits(load_model(tmp_path / "ckpt.pt")), reference, rtol=1e-5, atol=1e-5)


# --- errors: each names the file and the problem -----------------------------------------------

def check_error(checkpoint, file, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_model(checkpoint)
    message = str(info.value)
    assert str(file) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_path(tmp_path):
    check_error(tmp_path / "nope", tmp_path / "nope", "no such file or directory")


def test_directory_without_a_checkpoint(tmp_path):
    check_error(tmp_path, tmp_path, "config.json", "ckpt.pt")


def test_config_without_weights(hf_copy):
    (hf_copy / "model.safetensors").unlink()
    check_error(hf_copy, hf_copy, "no model.safetensors or pytorch_model.bin")


def test_corrupt_config(hf_copy):
    (hf_copy / "config.json").write_text("{not json")
    check_error(hf_copy, hf_copy / "config.json", "not readable JSON")


def test_missing_config_fields_take_transformers_defaults(hf_copy):
    """A key config.json does not hold has GPT2Config's default, as transformers reads it: the
    context (n_positions: 1024, as the registry reads it too) and n_embd (768), which then no
    longer fit this checkpoint's tensors."""
    config = json.loads((hf_copy / "config.json").read_text())
    del config["n_positions"]
    (hf_copy / "config.json").write_text(json.dumps(config))
    check_error(hf_copy, hf_copy / "model.safetensors", "transformer.wpe.weight", "(128, 64)", "(1024, 64)")
    config["n_positions"] = 128
    del config["n_embd"]
    (hf_copy / "config.json").write_text(json.dumps(config))
    check_error(hf_copy, hf_copy / "model.safetensors", "transformer.wte.weight", "(50257, 64)", "(50257, 768)")


def test_unsupported_activation(hf_copy):
    edit_config(hf_copy, activation_function="relu")
    check_error(hf_copy, hf_copy / "config.json", "activation_function", "relu")


def test_corrupt_safetensors(hf_copy):
    (hf_copy / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    check_error(hf_copy, hf_copy / "model.safetensors", "cannot read weights")


def test_truncated_safetensors(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    check_error(hf_copy, hf_copy / "model.safetensors", "cannot read weights")


def test_shape_mismatch_names_tensor_and_shapes(hf_copy):
    edit_config(hf_copy, vocab_size=50000)
    check_error(hf_copy, hf_copy / "model.safetensors", "transformer.wte.weight", "(50257, 64)", "(50000, 64)")


def test_conv1d_shape_mismatch_is_reported_in_file_layout(hf_copy):
    state = load_file(hf_copy / "model.safetensors")
    state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 128)  # Conv1D (in, out); needs (64, 256)
    save_file(state, hf_copy / "model.safetensors")
    check_error(hf_copy, hf_copy / "model.safetensors", "transformer.h.1.mlp.c_fc.weight", "(64, 128)", "(64, 256)")


def test_missing_tensor(hf_copy):
    state = load_file(hf_copy / "model.safetensors")
    del state["transformer.h.1.ln_2.weight"]
    save_file(state, hf_copy / "model.safetensors")
    check_error(hf_copy, hf_copy / "model.safetensors", "missing tensors", "transformer.h.1.ln_2.weight")


def test_more_layers_in_the_file_than_the_config(hf_copy):
    edit_config(hf_copy, n_layer=1)
    check_error(hf_copy, hf_copy / "model.safetensors", "unexpected tensors", "transformer.h.1.")


def test_unexpected_tensor(hf_copy):
    state = load_file(hf_copy / "model.safetensors")
    state["transformer.h.0.attn.extra"] = torch.zeros(3)
    save_file(state, hf_copy / "model.safetensors")
    check_error(hf_copy, hf_copy / "model.safetensors", "unexpected tensors", "transformer.h.0.attn.extra")


def test_corrupt_nanogpt_checkpoint(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a zip file at all")
    check_error(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", "not a readable nanoGPT checkpoint")


def test_not_a_nanogpt_dict(tmp_path):
    torch.save([1, 2, 3], tmp_path / "ckpt.pt")
    check_error(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", "'model' and 'model_args'")


def test_nanogpt_model_args_do_not_fit_the_weights(tmp_path):
    model_args = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, bias=False, vocab_size=65, dropout=0.0)
    model = GPT(GPTConfig(**model_args))
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", model, {**model_args, "n_layer": 2})
    check_error(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", "missing tensors", "transformer.h.1.")
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", model, {**model_args, "vocab_size": 100})
    check_error(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", "transformer.wte.weight", "(65, 32)", "(100, 32)")
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", model, {**model_args, "n_kv_head": 1})
    check_error(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", "unknown model_args", "n_kv_head")


# --- hf:<repo> from the local hub cache ---------------------------------------------------------

@pytest.fixture()
def empty_hub(tmp_path, monkeypatch):
    """HF_HOME in a fresh directory, offline. huggingface_hub reads its cache path when imported,
    so its constant is pointed there too."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = tmp_path / "hf-home" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


def test_hf_name_not_cached_offline(empty_hub):
    with pytest.raises(CheckpointError) as info:
        load_model("hf:openai-community/gpt2")
    message = str(info.value)
    assert "openai-community/gpt2" in message and "HF_HUB_OFFLINE" in message and "not in the local" in message


def test_hf_name_resolves_from_a_populated_cache(empty_hub, hf_checkpoint, reference):
    """The hub cache layout built by hand: models--org--name/snapshots/<rev>/ and refs/main."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = empty_hub / "models--test-org--tiny-gpt2"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt"):
        shutil.copy(hf_checkpoint / name, snapshot / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)

    assert resolve_checkpoint("hf:test-org/tiny-gpt2") == snapshot
    assert (resolve_checkpoint("hf:test-org/tiny-gpt2") / "vocab.json").exists()  # for the tokenizer
    assert resolve_checkpoint(f"hf:test-org/tiny-gpt2@{revision}") == snapshot
    assert_close(logits(load_model("hf:test-org/tiny-gpt2")), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="test-org/tiny-gpt2"):
        load_model("hf:test-org/tiny-gpt2@other-branch")
