"""Weights in and out: Hugging Face GPT-2 directories, nanoGPT ckpt.pt files, and `hf:<repo>` names.

    load_model("path/to/hf-gpt2-dir")        # config.json + model.safetensors (or pytorch_model.bin)
    load_model("out-shakespeare-char/ckpt.pt")  # nanoGPT's train.py output (or its directory)
    load_model("hf:openai-community/gpt2@main")  # from the local Hugging Face cache, or downloaded

Every tensor is checked against the config (names and shapes) before it is used: a checkpoint that
does not fit raises CheckpointError naming the file and what is wrong, never a silently broken model.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from nanogpt.model import GPT, GPTConfig

HF_FILES = ["config.json", "*.safetensors", "*.bin", "vocab.json", "merges.txt", "tokenizer.json"]
# HF GPT-2 uses Conv1D modules, whose weights are stored (in, out): the transpose of nn.Linear's
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# causal-mask buffers some GPT-2 checkpoints carry; the model builds its mask itself
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def load_model(checkpoint: str | Path, device="cpu", dtype=torch.float32) -> GPT:
    """A GPT in eval mode from a Hugging Face GPT-2 directory, a nanoGPT ckpt.pt (or a directory
    holding one), or `hf:<repo>[@revision]`."""
    path = resolve_checkpoint(checkpoint)
    if path.is_dir() and not (path / "config.json").exists() and (path / "ckpt.pt").exists():
        path = path / "ckpt.pt"
    model = _load_hf_dir(path) if path.is_dir() else _load_nanogpt(path)
    return model.to(device=device, dtype=dtype).eval()


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """The local path of a checkpoint: the path itself, or for `hf:<repo>[@revision]` the snapshot
    directory in the Hugging Face cache (downloaded first unless HF_HUB_OFFLINE is set)."""
    if str(checkpoint).startswith("hf:"):
        return _hub_snapshot(str(checkpoint))
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    return path


def save_nanogpt_checkpoint(path, model: GPT, model_args: dict | None = None, **extra) -> Path:
    """Write nanoGPT's ckpt.pt format: {'model', 'model_args', 'iter_num', 'best_val_loss',
    'config', ...extra} (extra may also carry 'optimizer'). Written to a temporary file first, so an
    interrupted save never leaves a truncated checkpoint behind."""
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    checkpoint = {"iter_num": 0, "best_val_loss": float("inf"), "config": {}, **extra,
                  "model": model.state_dict(), "model_args": model_args or asdict(model.config)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)
    return path


# --- nanoGPT ckpt.pt ---------------------------------------------------------------------------

def _load_nanogpt(path: Path) -> GPT:
    try:
        # weights_only: a checkpoint is data, never code; nanoGPT's ckpt.pt is plain tensors/dicts/numbers
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable nanoGPT checkpoint (torch.save file): {e}") from e
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get("model"), dict)
            and isinstance(checkpoint.get("model_args"), dict)):
        raise CheckpointError(f"{path}: not a nanoGPT checkpoint: expected a dict with 'model' and 'model_args'")
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(checkpoint["model_args"]) - known)
    if unknown:
        raise CheckpointError(f"{path}: unknown model_args {unknown}; GPTConfig takes {sorted(known)}")
    config = _checked_config(GPTConfig(**checkpoint["model_args"]), path)
    state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}  # torch.compile prefix
    model = _empty_model(config)
    _check_tensors(state, _shapes(model), path)
    if not (state["lm_head.weight"] is state["transformer.wte.weight"]
            or torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])):
        raise CheckpointError(f"{path}: lm_head.weight differs from transformer.wte.weight; this model ties them")
    return _assign(model, state)


# --- Hugging Face GPT-2 directory --------------------------------------------------------------

def _load_hf_dir(directory: Path) -> GPT:
    config_file = directory / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{directory}: neither config.json (Hugging Face GPT-2) nor ckpt.pt (nanoGPT) here")
    config = _hf_config(config_file)
    hf_state, weights_file = _hf_weights(directory)

    # name and layout each tensor of our model has in the HF file (nanoGPT's from_pretrained, checked)
    prefix = "transformer." if any(k.startswith("transformer.") for k in hf_state) else ""
    model = _empty_model(config)
    file_name = {name: prefix + name.removeprefix("transformer.") for name in _shapes(model) if name != "lm_head.weight"}
    expected = {file_name[name]: shape[::-1] if name.endswith(CONV1D) else shape
                for name, shape in _shapes(model).items() if name in file_name}
    present = {k: v for k, v in hf_state.items() if not k.endswith(HF_BUFFERS) and k != "lm_head.weight"}
    _check_tensors(present, expected, weights_file)

    state = {}
    for name, hf_name in file_name.items():
        tensor = hf_state[hf_name]
        state[name] = tensor.t() if name.endswith(CONV1D) else tensor
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied
    return _assign(model, state)


def _hf_config(config_file: Path) -> GPTConfig:
    try:
        c = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_file}: not readable JSON: {e}") from e
    if not isinstance(c, dict):
        raise CheckpointError(f"{config_file}: not a GPT-2 config (expected a JSON object)")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k not in c]
    if "n_positions" not in c and "n_ctx" not in c:
        missing.append("n_positions")
    if missing:
        raise CheckpointError(f"{config_file}: missing {missing}; not a GPT-2 config")
    # what this model implements; anything else would load but compute something different
    supported = {"model_type": ("gpt2",), "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
                 "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
                 "tie_word_embeddings": (True,), "n_inner": (None, 4 * c["n_embd"]),
                 "add_cross_attention": (False,)}
    for key, allowed in supported.items():
        if key in c and c[key] not in allowed:
            raise CheckpointError(f"{config_file}: unsupported {key}={c[key]!r} (supported: {list(allowed)})")
    config = GPTConfig(block_size=c.get("n_positions", c.get("n_ctx")), vocab_size=c["vocab_size"],
                       n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], dropout=0.0, bias=True,
                       layer_norm_epsilon=c.get("layer_norm_epsilon", 1e-5))
    return _checked_config(config, config_file)


def _hf_weights(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of the directory's weights (single file or sharded, safetensors preferred)."""
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"):
        if (directory / name).exists():
            break
    else:
        raise CheckpointError(f"{directory}: no model.safetensors or pytorch_model.bin next to config.json")
    path = directory / name
    if name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a readable shard index: {e}") from e
    else:
        shards = [name]
    state = {}
    for shard in shards:
        state.update(_read_tensors(directory / shard))
    return state, path


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read weights: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return state


# --- hf:<repo>[@revision] ----------------------------------------------------------------------

def _hub_snapshot(spec: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo, _, revision = spec.removeprefix("hf:").partition("@")
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=HF_FILES,
                                      local_files_only=offline))
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if offline
               else "and the Hub could not be reached")
        raise CheckpointError(f"{spec}: {repo} is not in the local Hugging Face cache ({why}); fetch it "
                              f"where the Hub is reachable (`hf download {repo}`) and share the cache "
                              f"(HF_HOME), or use a local checkpoint directory") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise CheckpointError(f"{spec}: no such repository or revision on the Hub: {e}") from e
    except ValueError as e:  # huggingface_hub's HFValidationError: a malformed repo id
        raise CheckpointError(f"{spec}: invalid Hugging Face repository name: {e}") from e


# --- shared ------------------------------------------------------------------------------------

def _checked_config(config: GPTConfig, source: Path) -> GPTConfig:
    for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        value = getattr(config, key)
        if not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    if config.n_embd % config.n_head:
        raise CheckpointError(f"{source}: n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    return config


def _empty_model(config: GPTConfig) -> GPT:
    # built on the meta device, without init: no time or memory spent on weights the checkpoint's replace
    with torch.device("meta"), _SkipInit():
        return GPT(config)


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's functions as no-ops. Even on the meta device they are not free: `normal_`
    there runs through torch._refs, whose first use imports torch._dynamo (seconds per process)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _shapes(model: GPT) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], source: Path):
    """The checkpoint's tensors must be exactly the expected names with the expected shapes."""
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: missing tensors: {_some(missing)}")
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors: {_some(unexpected)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"the config needs {tuple(shape)}")


def _assign(model: GPT, state: dict[str, torch.Tensor]) -> GPT:
    model.load_state_dict(state, assign=True)
    model.transformer.wte.weight = model.lm_head.weight  # assign replaced the tied parameter: tie again
    return model


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
