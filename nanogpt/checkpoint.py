"""Weights in and out: Hugging Face checkpoints of every family, nanoGPT ckpt.pt files, and
`hf:<repo>` names (resolved as models/formats.py says).

    load_model("path/to/hf-dir")                 # config.json + model.safetensors (or shards, or .bin)
    load_model("out-shakespeare-char/ckpt.pt")   # nanoGPT's train.py output (or its directory)
    load_model("hf:EleutherAI/pythia-160m")      # from the local Hugging Face cache, or downloaded

A Hugging Face directory's `model_type` picks the family module of nanogpt/, whose `hf_weights`
maps every one of our parameters to the checkpoint's tensors. Each tensor is converted to the
serving dtype as it is read (an fp16/bf16 checkpoint served in its own precision is never copied
to float32), and every tensor is checked against the config (names and shapes) before it is used:
a checkpoint that does not fit raises CheckpointError naming the file and what is wrong, never a
silently broken model.
"""
from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from models.formats import CheckpointError, hf_repo, local_checkpoint, read_hf_config, snapshot
from nanogpt.model import GPT, GPTConfig

__all__ = ["CheckpointError", "load_model", "resolve_checkpoint", "save_nanogpt_checkpoint"]


def load_model(checkpoint: str | Path, device="cpu", dtype=torch.float32):
    """A model in eval mode from a Hugging Face directory, a nanoGPT ckpt.pt (or a directory
    holding one), or `hf:<repo>[@revision]`."""
    path = resolve_checkpoint(checkpoint)
    model = _load_hf_dir(path, dtype) if path.is_dir() else _load_nanogpt(path)
    return model.to(device=device, dtype=dtype).eval()


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """The local path of a checkpoint: the path itself (the ckpt.pt inside nanoGPT's out_dir), or
    for `hf:<repo>[@revision]` the snapshot directory in the Hugging Face cache (downloaded first
    unless HF_HUB_OFFLINE is set)."""
    if hf_repo(str(checkpoint)) is not None:
        return snapshot(str(checkpoint))
    return local_checkpoint(checkpoint)


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
    model = _empty_model(GPT, config)
    _check_tensors(state, _shapes(model), path)
    if not (state["lm_head.weight"] is state["transformer.wte.weight"]
            or torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])):
        raise CheckpointError(f"{path}: lm_head.weight differs from transformer.wte.weight; this model ties them")
    return _assign(model, state)


# --- Hugging Face directories ------------------------------------------------------------------

def _load_hf_dir(directory: Path, dtype: torch.dtype):
    hf = read_hf_config(directory)
    family = importlib.import_module(f"nanogpt.{hf.family.module}")
    config = _checked_config(family.config_from_hf(hf), hf.path / "config.json")
    model = _empty_model(family.MODEL, config)
    shapes = _shapes(model)
    tensors, weights_file = _hf_weights(directory, dtype)

    # checkpoints of the bare model (GPT2Model, OPTModel, ...) lack the prefix of the causal-LM class
    prefix = family.HF_PREFIX if any(k.startswith(family.HF_PREFIX) for k in tensors) else ""
    def file_name(name):
        return prefix + name.removeprefix(family.HF_PREFIX) if name.startswith(family.HF_PREFIX) else name

    sources = {ours: source for ours, source in family.hf_weights(config)}
    expected = {}
    for ours, source in sources.items():
        for name, shape in zip(source.names, source.layout(shapes[ours])):
            expected[file_name(name)] = shape
    present = {k: v for k, v in tensors.items() if k in expected or not k.endswith(family.HF_IGNORED)}
    _check_tensors(present, expected, weights_file)
    state = {ours: source.combine(*(tensors[file_name(n)] for n in source.names)) for ours, source in sources.items()}
    return _assign(model, state)


SHARD = re.compile(r"(model|pytorch_model)-(\d+)-of-(\d+)\.(safetensors|bin)")


def _hf_weights(directory: Path, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of the directory's weights (single file or shards, safetensors preferred)."""
    files, described_by = _weight_files(directory)
    state = {}
    for path in files:
        state.update(_read_tensors(path, dtype))
    return state, described_by


def _weight_files(directory: Path) -> tuple[list[Path], Path]:
    """The weight files, and the file that names them (for error messages)."""
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json"):
        path = directory / name
        if not path.exists():
            continue
        if not name.endswith(".index.json"):
            return [path], path
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{path}: not a readable shard index: {e}") from e
        return [directory / shard for shard in shards], path
    for kind in ("safetensors", "bin"):  # shards without their index
        shards = sorted(p for p in directory.iterdir() if (m := SHARD.fullmatch(p.name)) and m[4] == kind)
        if shards:
            total = int(SHARD.fullmatch(shards[0].name)[3])
            if len(shards) != total:
                raise CheckpointError(f"{directory}: {len(shards)} of the {total} {kind} shards are here")
            return shards, directory
    raise CheckpointError(f"{directory}: no model.safetensors or pytorch_model.bin (nor shards of them) "
                          "next to config.json")


def _read_tensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A weights file's tensors, floating-point ones converted to `dtype` one at a time as they are
    read (so no second copy of the whole file exists in another precision)."""
    def convert(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(path, "pt") as f:
                return {name: convert(f.get_tensor(name)) for name in f.keys()}
        try:  # memory-mapped: each tensor is read when it is converted
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) torch.save format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read weights: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return {name: convert(t) for name, t in state.items()}


# --- shared ------------------------------------------------------------------------------------

def _checked_config(config, source: Path):
    for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        value = getattr(config, key)
        if not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{source}: {key} must be a positive integer, got {value!r}")
    if config.n_embd % config.n_head:
        raise CheckpointError(f"{source}: n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    return config


def _empty_model(model_class, config):
    # built on the meta device, without init: no time or memory spent on weights the checkpoint's replace
    with torch.device("meta"), _SkipInit():
        return model_class(config)


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's functions as no-ops. Even on the meta device they are not free: `normal_`
    there runs through torch._refs, whose first use imports torch._dynamo (seconds per process)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _shapes(model) -> dict[str, tuple[int, ...]]:
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


def _assign(model, state: dict[str, torch.Tensor]):
    model.load_state_dict(state, assign=True)
    model.tie_weights()  # assign replaced a tied parameter by two: tie them again
    return model


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
