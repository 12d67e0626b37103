"""The model registry: which models this server runs, read from a `models.toml`, without torch.

    default = "shakespeare-char"                # optional; else the first model listed
    [models.shakespeare-char]
    checkpoint = "../checkpoints/shakespeare-char/ckpt.pt"
    [models.gpt2]
    checkpoint = "hf:gpt2"
    aliases = ["gpt-2"]

`checkpoint` is a nanoGPT `ckpt.pt` (or the directory holding it), a Hugging Face directory of a
supported family (GPT-2, GPT-Neo, GPT-J, OPT, GPT-NeoX/Pythia), or `hf:<repo>[@revision]` (read from
the local Hugging Face cache, never downloaded here), resolved by models/formats.py (torch-free) as
`nanogpt.checkpoint.load_model` resolves them. Relative paths resolve against the directory of the toml
file. Optional keys: `aliases`, `device` ("auto", "cpu", "cuda", "cuda:N", "mps"), `dtype`
(float32, bfloat16, float16, int8), `max_batch`, `prefix_caching` (true: a prompt reuses the keys
and values of a prefix a free slot still holds), `owned_by`, `created` (unix time; default the toml's
modification time), `context_length` (caps the checkpoint's; required with `vocab_size` for an `hf:`
repo that is neither cached nor a known size).

A model's shape (context length, vocabulary, end-of-text id, tokenizer files) is read from its files
the first time it is asked for, without loading weights: a model whose checkpoint is missing raises
`RegistryError` then, and the registry still lists and serves the others.
"""
from __future__ import annotations

import functools
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from models.tokenizer import TokenizerError, TokenizerSpec, find_tokenizer
from models.formats import (CheckpointError, cached_snapshot, hf_repo, local_checkpoint, positive_int,
                             read_hf_config)

DEFAULT_PATH = Path(__file__).with_name("models.toml")
DTYPES = ("float32", "bfloat16", "float16", "int8")
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
MODEL_KEYS = {"checkpoint", "aliases", "device", "dtype", "max_batch", "prefix_caching", "owned_by", "created",
              "context_length", "vocab_size"}
GPT2_EOS = 50256

# Shapes of published checkpoints whose tokenizer is tiktoken's GPT-2 BPE (GPT-2, GPT-Neo, GPT-J),
# for `hf:` repos not in the local cache: (context_length, vocab_size, eos_token_id). OPT and
# Pythia have vocabularies of their own, read from the cache.
KNOWN_HF_SHAPES = {
    **{repo: (1024, 50257, GPT2_EOS) for repo in (
        "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2",
        "openai-community/gpt2", "openai-community/gpt2-medium", "openai-community/gpt2-large",
        "openai-community/gpt2-xl", "distilbert/distilgpt2")},
    **{f"EleutherAI/gpt-neo-{size}": (2048, 50257, GPT2_EOS) for size in ("125m", "1.3B", "2.7B")},
    "EleutherAI/gpt-j-6b": (2048, 50400, GPT2_EOS),  # 50400 rows; the tokenizer has 50257
}


class RegistryError(ValueError):
    """A models.toml, or a checkpoint it names, is unusable; the message names the file."""


class ModelNotFoundError(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.model = name
        self.message = f"The model `{name}` does not exist or you do not have access to it."

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


@dataclass(frozen=True)
class CheckpointInfo:
    """What serving needs to know about a checkpoint, read without loading its weights."""

    path: Path | None  # the local file or directory read (None: an uncached `hf:` repo)
    context_length: int
    vocab_size: int  # the model's (nanoGPT pads GPT-2's 50257 to 50304); the tokenizer's may be smaller
    eos_token_id: int | None
    tokenizer: TokenizerSpec


@dataclass(frozen=True)
class ModelSpec:
    """One served model as configured; its checkpoint's shape is resolved on first use."""

    id: str
    checkpoint: str  # absolute path, or "hf:<repo>[@revision]"
    aliases: tuple[str, ...] = ()
    device: str = "auto"
    dtype: str = "float32"
    max_batch: int | None = None  # None: by the device (nanogpt/runtime/kv_cache.default_slots)
    prefix_caching: bool = True
    owned_by: str = "nanoserve"
    created: int = 0
    declared_context_length: int | None = None
    declared_vocab_size: int | None = None
    source: str = "<memory>"  # the models.toml this came from, for error messages

    @functools.cached_property  # not cached when it raises: a checkpoint trained later is picked up
    def resolved(self) -> CheckpointInfo:
        try:
            info = inspect_checkpoint(self.checkpoint, self.declared_context_length,
                                      self.declared_vocab_size)
        except _Unusable as err:
            raise RegistryError(f"{self.source}: model `{self.id}`: {err}") from None
        context, vocab = self.declared_context_length, self.declared_vocab_size
        if context is not None and context > info.context_length:
            raise RegistryError(f"{self.source}: model `{self.id}`: context_length {context} exceeds "
                                f"the checkpoint's {info.context_length}")
        if vocab is not None and vocab != info.vocab_size:
            raise RegistryError(f"{self.source}: model `{self.id}`: vocab_size {vocab} differs from "
                                f"the checkpoint's {info.vocab_size}")
        return info if context is None else replace(info, context_length=context)

    @property
    def context_length(self) -> int:
        return self.resolved.context_length

    @property
    def vocab_size(self) -> int:
        return self.resolved.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.resolved.eos_token_id

    @property
    def tokenizer(self) -> TokenizerSpec:
        return self.resolved.tokenizer


class Registry:
    def __init__(self, specs: list[ModelSpec], default: str | None = None):
        self._specs = list(specs)
        self._by_name = {name: spec for spec in self._specs for name in (spec.id, *spec.aliases)}
        self.default = self.get(default) if default is not None else self._specs[0]

    @classmethod
    def from_file(cls, path: str | os.PathLike | None = None) -> Registry:
        """Read `path`, else `$NANOSERVE_MODELS`, else the packaged `models/models.toml`."""
        path = Path(path or os.environ.get("NANOSERVE_MODELS") or DEFAULT_PATH)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            created = int(path.stat().st_mtime)
        except OSError as err:
            raise RegistryError(f"{path}: cannot read model registry: {err.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise RegistryError(f"{path}: invalid TOML: {err}") from None
        return cls._parse(data, path, created)

    @classmethod
    def _parse(cls, data: dict, path: Path, created: int) -> Registry:
        def fail(problem: str):
            raise RegistryError(f"{path}: {problem}")

        if unknown := set(data) - {"models", "default"}:
            fail(f"unknown top-level key(s) {_names(unknown)} (allowed: `models`, `default`)")
        tables = data.get("models")
        if not isinstance(tables, dict) or not tables:
            fail("no models defined (add a [models.<name>] table with a `checkpoint`)")
        specs, owner = [], {}
        for model_id, table in tables.items():
            spec = _parse_model(model_id, table, path, created, fail)
            for name in (spec.id, *spec.aliases):
                if name in owner:
                    fail(f"model `{spec.id}`: name `{name}` is already used by model `{owner[name]}`")
                owner[name] = spec.id
            specs.append(spec)
        default = data.get("default")
        if default is not None and default not in owner:
            fail(f"default model `{default}` is not defined")
        return cls(specs, default)

    def get(self, name: str) -> ModelSpec:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise ModelNotFoundError(name) from None

    def models(self) -> list[ModelSpec]:
        return list(self._specs)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._by_name


def _parse_model(model_id: str, table, path: Path, created: int, fail) -> ModelSpec:
    def bad(problem: str):
        fail(f"model `{model_id}`: {problem}")

    if not isinstance(table, dict):
        bad("expected a table ([models.<name>])")
    if not model_id or any(c.isspace() for c in model_id):
        bad("a model name must be non-empty and contain no whitespace")
    if unknown := set(table) - MODEL_KEYS:
        bad(f"unknown key(s) {_names(unknown)} (allowed: {_names(MODEL_KEYS)})")
    if "checkpoint" not in table:
        bad("missing `checkpoint` (a ckpt.pt, a Hugging Face directory or hf:<repo>)")

    def typed(key, kind, default, check=lambda v: True, expected=""):
        value = table.get(key, default)
        if value is not default and (type(value) is not kind or not check(value)):  # bool is no int
            bad(f"`{key}` must be {expected or kind.__name__}, got {value!r}")
        return value

    checkpoint = typed("checkpoint", str, None, bool, "a non-empty string")
    aliases = typed("aliases", list, [], lambda v: all(isinstance(a, str) and a for a in v),
                    "a list of non-empty strings")
    device = typed("device", str, "auto", DEVICE.fullmatch, '"auto", "cpu", "cuda", "cuda:N" or "mps"')
    dtype = typed("dtype", str, "float32", lambda v: v in DTYPES, " or ".join(DTYPES))
    positive = (lambda v: v > 0), "a positive integer"
    if not checkpoint.startswith("hf:"):
        checkpoint = os.path.normpath(path.parent / os.path.expanduser(checkpoint))
    return ModelSpec(
        id=model_id, checkpoint=checkpoint, aliases=tuple(aliases), device=device, dtype=dtype,
        max_batch=typed("max_batch", int, None, *positive),
        prefix_caching=typed("prefix_caching", bool, True, expected="true or false"),
        owned_by=typed("owned_by", str, "nanoserve"),
        created=typed("created", int, created, lambda v: v >= 0, "a unix time"),
        declared_context_length=typed("context_length", int, None, *positive),
        declared_vocab_size=typed("vocab_size", int, None, *positive),
        source=str(path))


# ---- reading a checkpoint's shape without torch ----

class _Unusable(Exception):
    """A checkpoint problem; ModelSpec.resolved prefixes the toml file and model."""


def inspect_checkpoint(checkpoint: str, context_length: int | None = None,
                       vocab_size: int | None = None) -> CheckpointInfo:
    """Shape and tokenizer of a checkpoint: `hf:<repo>`, a Hugging Face directory (any family
    models.formats knows) or a nanoGPT ckpt.pt. `context_length`/`vocab_size` stand in for an `hf:`
    repo that cannot be read."""
    try:
        if hf_repo(checkpoint) is not None:
            return _inspect_hf_repo(checkpoint, context_length, vocab_size)
        path = local_checkpoint(checkpoint)
        return _inspect_hf_dir(path) if path.is_dir() else _inspect_nanogpt(path)
    except (CheckpointError, TokenizerError) as err:
        raise _Unusable(str(err)) from None


def _inspect_hf_repo(checkpoint: str, context_length: int | None, vocab_size: int | None) -> CheckpointInfo:
    cached = cached_snapshot(checkpoint)
    if cached is not None:
        return _inspect_hf_dir(cached)
    repo, _ = hf_repo(checkpoint)
    if context_length is not None and vocab_size is not None:
        return CheckpointInfo(None, context_length, vocab_size, GPT2_EOS, TokenizerSpec("gpt2-bpe"))
    if repo in KNOWN_HF_SHAPES:
        context, vocab, eos = KNOWN_HF_SHAPES[repo]
        return CheckpointInfo(None, context, vocab, eos, TokenizerSpec("gpt2-bpe"))
    raise _Unusable(f"`{checkpoint}` is not in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE) and "
                    f"is not a known GPT-2, GPT-Neo or GPT-J size: fetch it first (`hf download {repo}`), or "
                    "give `context_length` and `vocab_size` in the registry")


def _inspect_hf_dir(directory: Path) -> CheckpointInfo:
    hf = read_hf_config(directory)
    return CheckpointInfo(directory, hf.context_length, hf.vocab_size, hf.eos_token_id, find_tokenizer(directory))


def _inspect_nanogpt(path: Path) -> CheckpointInfo:
    args = read_model_args(path)
    tokenizer = find_tokenizer(path.parent)  # meta.pkl beside it: characters; else GPT-2 BPE
    eos = None if tokenizer.kind == "char" else GPT2_EOS
    return CheckpointInfo(path, args["block_size"], args["vocab_size"], eos, tokenizer)


def read_model_args(path: Path) -> dict:
    """nanoGPT's `model_args` from a torch zip checkpoint, without torch: unpickle
    `<archive>/data.pkl` with every class replaced by an inert stand-in and tensor storages by None
    (the tensors themselves live in other zip members and are never read)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if not names:
                raise _Unusable(f"{path}: no data.pkl inside (not a torch.save checkpoint)")
            with archive.open(names[0]) as f:
                checkpoint = _InertUnpickler(f).load()
    except (zipfile.BadZipFile, OSError) as err:
        raise _Unusable(f"{path}: not a torch zip checkpoint ({err})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise _Unusable(f"{path}: corrupt checkpoint ({err})") from None
    args = checkpoint.get("model_args") if isinstance(checkpoint, dict) else None
    if not isinstance(args, dict):
        raise _Unusable(f"{path}: no `model_args` dict (not a nanoGPT checkpoint)")
    if not all(positive_int(args.get(key)) for key in ("block_size", "vocab_size")):
        raise _Unusable(f"{path}: model_args needs integer `block_size` and `vocab_size`")
    return args


class _Inert(dict):
    """Stands in for every class a checkpoint's pickle names (tensors, torch.Size, OrderedDict, …):
    accepts any construction and state. Never importing the real class also means loading runs no
    code from the file."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _Inert

    def persistent_load(self, pid):
        return None  # a tensor storage reference


def _names(keys) -> str:
    return ", ".join(f"`{k}`" for k in sorted(keys))

