"""Checkpoint formats, read without torch: where a checkpoint's files are and what its model is.
The registry (registry.py, which the web tier imports) and the loader (nanogpt/checkpoint.py) both
resolve checkpoints here, so they cannot disagree.

A checkpoint is named by one of
- a nanoGPT `ckpt.pt`, or nanoGPT's out_dir holding one (and no config.json);
- a Hugging Face directory: `config.json`, whose `model_type` picks the family, and the weights;
- `hf:<repo>[@revision]`: a Hugging Face Hub repository, read from the local Hugging Face cache.

`config.json` is read the way transformers reads it: a key it does not hold has the family's
default (transformers writes only the values that differ from the defaults).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

HF_FILES = ["*.json", "*.safetensors", "*.bin", "merges.txt"]  # config, weights, shard indexes, tokenizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class Family:
    """One model family: the module of nanogpt/ that builds it, and transformers' defaults for what
    serving must know before loading weights."""

    model_type: str  # config.json's `model_type`
    module: str  # nanogpt.<module> holds the model and its Hugging Face weight mapping
    context_keys: tuple[str, ...]  # config.json keys of the context length, the first present wins
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    prompt_bos: bool = False  # text prompts start with the BOS token (as the family was trained)


FAMILIES = {f.model_type: f for f in (
    Family("gpt2", "model", ("n_positions", "n_ctx"), 1024, 50257, 50256, 50256),
    Family("gpt_neo", "gpt_neo", ("max_position_embeddings",), 2048, 50257, 50256, 50256),
    Family("gptj", "gptj", ("n_positions",), 2048, 50400, 50256, 50256),
    Family("opt", "opt", ("max_position_embeddings",), 2048, 50272, 2, 2, prompt_bos=True),
    Family("gpt_neox", "gpt_neox", ("max_position_embeddings",), 2048, 50432, 0, 2),
)}


@dataclass(frozen=True)
class HFConfig:
    """A Hugging Face config.json: its family, what serving needs from it, and the whole of it."""

    path: Path
    family: Family
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    values: dict

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def check(self, supported: dict) -> None:
        """Refuse a value the model code does not compute (it would load, and give other logits)."""
        for key, allowed in supported.items():
            if key in self.values and self.values[key] not in allowed:
                raise CheckpointError(f"{self.path / 'config.json'}: unsupported {key}={self.values[key]!r} "
                                      f"(supported: {list(allowed)})")


def read_hf_config(directory: str | Path) -> HFConfig:
    directory = Path(directory)
    path = directory / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: neither config.json (Hugging Face) nor ckpt.pt (nanoGPT) here") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path}: not readable JSON (not an object)")
    model_type = values.get("model_type", "gpt2")  # the oldest GPT-2 configs carry none
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(f"{path}: model_type `{model_type}` is not supported (supported: "
                              f"{', '.join(FAMILIES)})")
    context = next((values[k] for k in family.context_keys if k in values), family.context_length)
    vocab = values.get("vocab_size", family.vocab_size)
    bos = _first(values.get("bos_token_id", family.bos_token_id))
    eos = _first(values.get("eos_token_id", family.eos_token_id))
    if not (positive_int(context) and positive_int(vocab) and _token_id(bos) and _token_id(eos)):
        raise CheckpointError(f"{path}: {family.context_keys[0]}, vocab_size, bos_token_id and eos_token_id "
                              "must be integers")
    return HFConfig(directory, family, context, vocab, bos, eos, values)


def local_checkpoint(checkpoint: str | Path) -> Path:
    """The file or directory a local checkpoint name stands for: nanoGPT's out_dir means the ckpt.pt
    inside it."""
    path = Path(checkpoint).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (path / "ckpt.pt").exists():
        return path / "ckpt.pt"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    return path


def hf_repo(checkpoint: str) -> tuple[str, str | None] | None:
    """(repo, revision) of an `hf:<repo>[@revision]` name; None for a local path."""
    if not str(checkpoint).startswith("hf:"):
        return None
    repo, _, revision = str(checkpoint)[3:].partition("@")
    return repo, revision or None


def cached_snapshot(checkpoint: str) -> Path | None:
    """The local Hugging Face cache's snapshot of an `hf:` name, if it holds its config.json; never
    downloads."""
    from huggingface_hub import try_to_load_from_cache

    repo, revision = hf_repo(checkpoint)
    try:
        config = try_to_load_from_cache(repo, "config.json", revision=revision)
    except ValueError as err:  # huggingface_hub's HFValidationError: a malformed repo id
        raise CheckpointError(f"invalid Hugging Face repo id `{repo}`: {err}") from None
    return Path(config).parent if isinstance(config, str) else None


def snapshot(checkpoint: str) -> Path:
    """The snapshot directory of an `hf:` name in the Hugging Face cache, downloaded first unless
    HF_HUB_OFFLINE is set."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo, revision = hf_repo(checkpoint)
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HF_FILES, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set, so nothing is downloaded" if offline else "and the Hub could not be reached"
        raise CheckpointError(f"{checkpoint}: {repo} is not in the local Hugging Face cache ({why}); fetch it "
                              f"where the Hub is reachable (`hf download {repo}`) and share the cache "
                              f"(HF_HOME), or use a local checkpoint directory") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise CheckpointError(f"{checkpoint}: no such repository or revision on the Hub: {e}") from e
    except ValueError as e:  # huggingface_hub's HFValidationError: a malformed repo id
        raise CheckpointError(f"{checkpoint}: invalid Hugging Face repository name: {e}") from e


def _first(token_id):
    if isinstance(token_id, list):  # transformers allows several; the first is the main one
        return token_id[0] if token_id else None
    return token_id


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _token_id(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
