"""Tokenizers of the served models, without torch: GPT-2 byte-level BPE (through tiktoken) and
nanoGPT's character vocabulary (`meta.pkl`).

Which files make a model's tokenizer, looked for in the checkpoint's directory (`find_tokenizer`):
- `meta.pkl` (nanoGPT's `{'vocab_size', 'itos', 'stoi'}`) → a character vocabulary;
- `vocab.json` + `merges.txt` (Hugging Face names), `encoder.json` + `vocab.bpe` (OpenAI's names for the
  same two files) or `tokenizer.json` → GPT-2 byte-level BPE built from the checkpoint's own files;
- none of these → GPT-2 BPE from tiktoken's `r50k_base` (nanoGPT's convention for checkpoints without
  meta.pkl). tiktoken downloads that file once into its cache (`TIKTOKEN_CACHE_DIR`), so a machine
  without internet needs the cache filled beforehand; checkpoints we produce carry their vocab files.

Special tokens written in a text (`"a<|endoftext|>b"`) become their ids, as transformers' tokenizers
and vLLM read prompts: a client that separates documents with the end-of-text token's text (as
lm-evaluation-harness does) is scored on the token the model was trained with. A checkpoint's special
tokens are `<|endoftext|>` and those its tokenizer files mark special (`added_tokens` of
tokenizer.json; tokenizer_config.json and special_tokens_map.json beside vocab.json). Training data
is encoded with `encode_ordinary`, where such text stays text.
"""
from __future__ import annotations

import codecs
import functools
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal

import tiktoken
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

# File names, in order of preference, for each way a checkpoint can ship its tokenizer.
CHAR_VOCAB = "meta.pkl"
BPE_FILE_SETS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"), ("tokenizer.json",))


class TokenizerError(ValueError):
    """A tokenizer's files are missing or unusable; the message names the file."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What to load: `kind` and the files it comes from (`files == ()`: tiktoken's r50k_base)."""

    kind: Literal["gpt2-bpe", "char"]
    files: tuple[Path, ...] = ()


def find_tokenizer(directory: str | Path) -> TokenizerSpec:
    """The tokenizer a checkpoint directory ships (see the module docstring for the rules)."""
    directory = Path(directory)
    if (directory / CHAR_VOCAB).is_file():
        return TokenizerSpec("char", (directory / CHAR_VOCAB,))
    for names in BPE_FILE_SETS:
        if all((directory / name).is_file() for name in names):
            return TokenizerSpec("gpt2-bpe", tuple(directory / name for name in names))
    return TokenizerSpec("gpt2-bpe")


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer of a `ModelSpec`, a `TokenizerSpec`, or a path (checkpoint directory, `ckpt.pt`,
    `meta.pkl`). Loaded tokenizers are shared while their files are unchanged."""
    spec = getattr(source, "tokenizer", source)  # a ModelSpec carries its TokenizerSpec
    if not isinstance(spec, TokenizerSpec):
        path = Path(source)
        if path.is_dir():
            spec = find_tokenizer(path)
        elif path.name == CHAR_VOCAB:
            spec = TokenizerSpec("char", (path,))
        elif path.is_file():
            spec = find_tokenizer(path.parent)  # a nanoGPT ckpt.pt: its vocabulary lies beside it
        else:
            raise TokenizerError(f"{path}: no such file or directory")
    return _load(spec, tuple(_mtime(f) for f in spec.files))


@functools.lru_cache(maxsize=16)
def _load(spec: TokenizerSpec, stamps: tuple[int, ...]) -> Tokenizer:
    if spec.kind == "char":
        return CharTokenizer.from_meta(spec.files[0])
    if not spec.files:
        return BPETokenizer.r50k_base()
    if spec.files[0].name == "tokenizer.json":
        return BPETokenizer.from_tokenizer_json(spec.files[0])
    return BPETokenizer.from_vocab_merges(*spec.files)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError as err:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {err.strerror}") from None


class Tokenizer:
    """Text ↔ token ids. Subclasses set `vocab_size`, `eos_token_id`, `special_ids` and implement
    `encode`, `decode_bytes` and `token_bytes`."""

    vocab_size: int
    eos_token_id: int | None
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        """Token ids of a text in which special tokens' text stands for the special tokens."""
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of a text taken as plain text throughout."""
        return self.encode(text)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        # Bytes that are not valid UTF-8 (a sequence cut mid-character) become U+FFFD, as in tiktoken.
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_string(self, token_id: int) -> str:
        """OpenAI's logprobs token: the token's text, or `bytes:\\xNN…` when its bytes are not valid
        UTF-8 on their own (part of a multi-byte character)."""
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")


class IncrementalDecoder:
    """Decodes a token stream one id at a time, emitting only whole UTF-8 characters: bytes of a
    character split across tokens wait for the token that completes it. The pushes and the final
    `flush()` concatenate to exactly `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The text held back at the end of the stream: U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)


class BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE on a tiktoken `Encoding` (GPT-2's split pattern, `<|endoftext|>` special)."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        self.eos_token_id = encoding.eot_token if ENDOFTEXT in encoding.special_tokens_set else None
        self.special_ids = frozenset(encoding.encode_single_token(name) for name in encoding.special_tokens_set)

    @classmethod
    def r50k_base(cls) -> BPETokenizer:
        try:
            return cls(tiktoken.get_encoding("r50k_base"))
        except Exception as err:  # tiktoken raises whatever its download raised
            raise TokenizerError(
                "the checkpoint ships no tokenizer files (vocab.json + merges.txt, tokenizer.json or "
                "meta.pkl) and tiktoken's r50k_base is not available: it needs internet once, or a "
                f"filled TIKTOKEN_CACHE_DIR ({type(err).__name__}: {err})") from err

    @classmethod
    def from_vocab_merges(cls, vocab_file: Path, merges_file: Path) -> BPETokenizer:
        vocab = _read_json(vocab_file)
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{vocab_file}: expected a JSON object mapping tokens to ids")
        lines = _read_text(merges_file).splitlines()
        merges = [line.split() for line in lines if line and not line.startswith("#version")]
        names, added = _config_special_tokens(vocab_file.parent)
        return cls._build(vocab, merges, _specials(vocab, names | {ENDOFTEXT}, added), merges_file)

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> BPETokenizer:
        data = _read_json(path)
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE":
            raise TokenizerError(f"{path}: not a BPE tokenizer (model.type is not 'BPE')")
        # merges are "a b" strings in older files, [a, b] pairs in newer ones
        merges = [m.split() if isinstance(m, str) else m for m in model.get("merges", [])]
        added = {t.get("content"): t.get("id") for t in data.get("added_tokens") or []
                 if isinstance(t, dict) and t.get("special")}
        vocab = model.get("vocab", {})
        return cls._build(vocab, merges, _specials(vocab, {ENDOFTEXT}, added), path)

    @classmethod
    def _build(cls, vocab: dict, merges: list, special: dict[str, int], origin: Path) -> BPETokenizer:
        """tiktoken ranks from a Hugging Face-style vocabulary and merge list. tiktoken merges the pair
        whose concatenation has the lowest id, so this is the same BPE only when every multi-byte token
        is made by exactly one merge and ids grow in merge order — true of GPT-2; checked here."""
        decoder = _gpt2_byte_decoder()
        try:
            ranks = {bytes(decoder[c] for c in name): i for name, i in vocab.items()
                     if name not in special}
            merged = [bytes(decoder[c] for c in a + b) for a, b in merges]
        except (KeyError, ValueError, TypeError):
            raise TokenizerError(f"{origin}: not a GPT-2 byte-level BPE vocabulary") from None
        ids = sorted([*ranks.values(), *special.values()])
        if ids != list(range(len(ids))):
            raise TokenizerError(f"{origin}: token ids are not the contiguous range 0..{len(ids) - 1}")
        merged_ranks = [ranks.get(token, -1) for token in merged]
        in_merge_order = all(a < b for a, b in zip(merged_ranks, merged_ranks[1:]))
        n_multibyte = sum(len(token) > 1 for token in ranks)
        if (min(merged_ranks, default=0) < 0 or not in_merge_order or n_multibyte != len(merged)
                or len(ranks) - n_multibyte != 256):
            raise TokenizerError(f"{origin}: vocabulary and merges disagree (token ids must follow "
                                 "merge order, one merge per multi-byte token, all 256 bytes present)")
        encoding = tiktoken.Encoding(f"gpt2-bpe:{origin}", pat_str=r50k_pat_str,
                                     mergeable_ranks=ranks, special_tokens=special)
        return cls(encoding)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = list(ids)
        self._check_ids(ids)
        return self.encoding.decode_bytes(ids)

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self.encoding.decode_single_token_bytes(token_id)


class CharTokenizer(Tokenizer):
    """nanoGPT's character vocabulary: one token per character, no end-of-text token."""

    eos_token_id = None

    def __init__(self, itos: dict[int, str]):
        self.itos = itos
        self.stoi = {ch: i for i, ch in itos.items()}
        self.vocab_size = len(itos)

    @classmethod
    def from_meta(cls, path: Path) -> CharTokenizer:
        try:
            with open(path, "rb") as f:
                meta = _PlainUnpickler(f).load()
        except OSError as err:
            raise TokenizerError(f"{path}: cannot read character vocabulary: {err.strerror}") from None
        except Exception as err:  # any unpickling failure means a corrupt or foreign file
            raise TokenizerError(f"{path}: not a nanoGPT meta.pkl ({err})") from None
        itos = meta.get("itos") if isinstance(meta, dict) else None
        if (not isinstance(itos, dict) or not itos
                or sorted(itos) != list(range(len(itos)))
                or not all(isinstance(ch, str) and len(ch) == 1 for ch in itos.values())
                or len(set(itos.values())) != len(itos)):
            raise TokenizerError(f"{path}: expected nanoGPT's meta.pkl with 'itos' mapping ids 0..N-1 "
                                 "to distinct single characters")
        return cls(itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            ch = err.args[0]
            raise ValueError(f"character {ch!r} (U+{ord(ch):04X}) at position {text.index(ch)} "
                             "is not in this model's vocabulary") from None

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = list(ids)
        self._check_ids(ids)
        return "".join(self.itos[i] for i in ids).encode("utf-8")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self.itos[token_id].encode("utf-8")


def bad_words_token_ids(words: Iterable[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences that spell each bad word, as vLLM finds them: the word without leading
    spaces, and, when a tokenizer marks word starts with a space (GPT-2's BPE), the same word after a
    space if that is a different first token and the same number of tokens."""
    spellings: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        spellings.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            spellings.append(spaced)
    return spellings


class _PlainUnpickler(pickle.Unpickler):
    """meta.pkl holds only dicts, strings and ints: refuse any class, so loading runs no code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2 spells token bytes as printable characters: printable Latin-1 bytes stand for
    themselves, the others map in order to chr(256), chr(257), … (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _specials(vocab: dict, names: set[str], added: dict) -> dict[str, int]:
    """Special tokens and their ids: those listed with an id (`added`), and those named in `names`
    that the vocabulary holds."""
    special = {name: vocab[name] for name in names if name in vocab}
    special.update({name: i for name, i in added.items() if isinstance(name, str) and name and type(i) is int})
    return special


def _config_special_tokens(directory: Path) -> tuple[set[str], dict[str, int]]:
    """The special tokens a Hugging Face tokenizer directory declares beside vocab.json: names
    (bos/eos/unk/pad/… and additional special tokens of tokenizer_config.json and
    special_tokens_map.json) and tokens with their ids (`added_tokens_decoder` entries marked special).
    A token is written either as its text or as `{"content": text, ...}`."""
    names: set[str] = set()
    added: dict[str, int] = {}

    def add(token) -> None:
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token:
            names.add(token)

    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / file
        if not path.is_file():
            continue
        data = _read_json(path)
        if not isinstance(data, dict):
            continue
        decoder = data.get("added_tokens_decoder")
        for i, token in (decoder.items() if isinstance(decoder, dict) else ()):
            if isinstance(token, dict) and token.get("special") and str(i).isdigit():
                added[token.get("content")] = int(i)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            add(data.get(key))
        for key in ("additional_special_tokens", "extra_special_tokens"):  # transformers 4's and 5's name
            extra = data.get(key)
            for token in (extra if isinstance(extra, list) else ()):
                add(token)
    return names, added


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise TokenizerError(f"{path}: not UTF-8 text ({err})") from None


def _read_json(path: Path):
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: invalid JSON ({err})") from None
