"""Tokenizers of the served models, without torch: byte-level BPE (GPT-2's, and the vocabularies of
the other families) through tiktoken, or through Hugging Face's `tokenizers` where tiktoken cannot
express a `tokenizer.json` exactly; and nanoGPT's character vocabulary (`meta.pkl`).

Which files make a model's tokenizer, looked for in the checkpoint's directory (`find_tokenizer`):
- `meta.pkl` (nanoGPT's `{'vocab_size', 'itos', 'stoi'}`) → a character vocabulary;
- `vocab.json` + `merges.txt` (Hugging Face names), `encoder.json` + `vocab.bpe` (OpenAI's names for the
  same two files) or `tokenizer.json` → byte-level BPE built from the checkpoint's own files: GPT-2's,
  GPT-Neo's and GPT-J's (GPT-2's vocabulary; GPT-J's 143 padding rows are no tokens), OPT's (GPT-2's
  merges with other ids), GPT-NeoX's (`tokenizer.json` only: NFC-normalized text and tokens for runs
  of spaces, so `tokenizers` runs it);
- none of these → GPT-2 BPE from tiktoken's `r50k_base` (nanoGPT's convention for checkpoints without
  meta.pkl). tiktoken downloads that file once into its cache (`TIKTOKEN_CACHE_DIR`), so a machine
  without internet needs the cache filled beforehand; checkpoints we produce carry their vocab files.

Special tokens written in a text (`"a<|endoftext|>b"`) become their ids, as transformers' tokenizers
and vLLM read prompts: a client that separates documents with the end-of-text token's text (as
lm-evaluation-harness does) is scored on the token the model was trained with. A checkpoint's special
tokens are `<|endoftext|>` and those its tokenizer files mark special (`added_tokens` of
tokenizer.json; tokenizer_config.json and special_tokens_map.json beside vocab.json). Training data
and bad words are encoded with `encode_ordinary`, where such text stays text (and no BOS is added).

A Hugging Face checkpoint's config.json gives the end-of-text id, and for OPT the BOS token that
starts every text prompt (`</s>`, as OPT was trained and as its API servers send it): `encode`
prepends it, so it is counted in usage; it shows as no text (a completion's echo is the prompt as
sent) and by its name in logprobs.
"""
from __future__ import annotations

import codecs
import functools
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal

import tiktoken
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

from models.formats import CheckpointError, read_hf_config

# File names, in order of preference, for each way a checkpoint can ship its tokenizer.
CHAR_VOCAB = "meta.pkl"
BPE_FILE_SETS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"), ("tokenizer.json",))


class TokenizerError(ValueError):
    """A tokenizer's files are missing or unusable; the message names the file."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What to load: `kind` and the files it comes from (`files == ()`: tiktoken's r50k_base), and
    from a Hugging Face config.json the end-of-text id (None: the vocabulary's `<|endoftext|>`) and
    the BOS id text prompts start with (None: none)."""

    kind: Literal["gpt2-bpe", "char"]
    files: tuple[Path, ...] = ()
    eos_token_id: int | None = None
    prompt_bos: int | None = None


def find_tokenizer(directory: str | Path) -> TokenizerSpec:
    """The tokenizer a checkpoint directory ships (see the module docstring for the rules)."""
    directory = Path(directory)
    if (directory / CHAR_VOCAB).is_file():
        return TokenizerSpec("char", (directory / CHAR_VOCAB,))
    files = next((tuple(directory / name for name in names) for names in BPE_FILE_SETS
                  if all((directory / name).is_file() for name in names)), ())
    if not (directory / "config.json").is_file():
        return TokenizerSpec("gpt2-bpe", files)
    try:
        hf = read_hf_config(directory)
    except CheckpointError as err:
        raise TokenizerError(str(err)) from None
    return TokenizerSpec("gpt2-bpe", files, hf.eos_token_id, hf.bos_token_id if hf.family.prompt_bos else None)


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
        tokenizer = BPETokenizer.r50k_base()
    elif spec.files[0].name == "tokenizer.json":
        tokenizer = from_tokenizer_json(spec.files[0])
    else:
        tokenizer = BPETokenizer.from_vocab_merges(*spec.files)
    return tokenizer.with_specials(spec.eos_token_id, spec.prompt_bos)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError as err:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {err.strerror}") from None


class Tokenizer:
    """Text ↔ token ids. Subclasses set `vocab_size`, `eos_token_id`, `special_ids` and implement
    `_encode`, `decode_bytes` and `token_bytes`."""

    vocab_size: int
    eos_token_id: int | None
    special_ids: frozenset[int] = frozenset()
    prompt_bos: int | None = None  # starts every encoded text (OPT's BOS)

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids: the family's BOS first when it has one, as it was trained, and
        special tokens' text standing for the special tokens."""
        ids = self._encode(text, specials=True)
        return ids if self.prompt_bos is None else [self.prompt_bos, *ids]

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of a text taken as plain text throughout, without a BOS."""
        return self._encode(text, specials=False)

    def _encode(self, text: str, specials: bool) -> list[int]:
        raise NotImplementedError

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


class ByteLevelTokenizer(Tokenizer):
    """A byte-level BPE vocabulary: every token is a byte string (`names` spells them as GPT-2 does,
    bytes as printable characters). Decoding joins token bytes; ids are checked."""

    def __init__(self, names: dict[str, int], literal: set[str], special: set[str], origin):
        ids = sorted(names.values())
        if ids != list(range(len(ids))):
            raise TokenizerError(f"{origin}: token ids are not the contiguous range 0..{len(ids) - 1}")
        self.vocab_size = len(ids)
        self.names = {i: name for name, i in names.items()}
        # `literal` names (special and added tokens) are their own text
        self._bytes = [name.encode() if name in literal else _spelled(name) for name in (self.names[i] for i in ids)]
        if None in self._bytes:
            raise TokenizerError(f"{origin}: not a byte-level BPE vocabulary")
        self.eos_token_id = names.get(ENDOFTEXT)
        self._special = {name: names[name] for name in special if name in names}
        self.special_ids = frozenset(self._special.values())
        # the longest first, so that a special token containing another is matched whole
        self._special_pattern = re.compile("(" + "|".join(map(re.escape, sorted(self._special, key=len, reverse=True)))
                                           + ")") if self._special else None

    def _encode(self, text: str, specials: bool) -> list[int]:
        if not specials or self._special_pattern is None:
            return self._encode_text(text)
        ids: list[int] = []
        for i, piece in enumerate(self._special_pattern.split(text)):  # odd pieces: the special tokens
            if i % 2:
                ids.append(self._special[piece])
            elif piece:
                ids.extend(self._encode_text(piece))
        return ids

    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def with_specials(self, eos_token_id: int | None, prompt_bos: int | None) -> ByteLevelTokenizer:
        """The model's end-of-text id (from its config.json, when it gives one) and the BOS id that
        starts its text prompts."""
        for token_id in (eos_token_id, prompt_bos):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"special token id {token_id} is outside the vocabulary "
                                     f"(0..{self.vocab_size - 1})")
        if eos_token_id is not None:
            self.eos_token_id = eos_token_id
        self.prompt_bos = prompt_bos
        return self

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = list(ids)
        self._check_ids(ids)
        return b"".join(self.token_bytes(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        # the BOS that encode() adds is no text of the prompt: an echo shows the prompt as sent
        return b"" if token_id == self.prompt_bos else self._bytes[token_id]

    def token_string(self, token_id: int) -> str:
        return self.names[token_id] if token_id == self.prompt_bos else super().token_string(token_id)


# tokens a BPE vocabulary may hold that no merge makes (special tokens, fairseq's filler words)
MAX_UNMERGED = 64


class BPETokenizer(ByteLevelTokenizer):
    """Byte-level BPE with GPT-2's split pattern on a tiktoken `Encoding`.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, so the ranks are
    the merge order (the 256 bytes first): the same BPE as Hugging Face's when each multi-byte token
    is made by exactly one merge, as in GPT-2's vocabulary. Token ids are the vocabulary's; where
    they do not follow merge order (OPT's), tiktoken's ranks are mapped to them."""

    def __init__(self, encoding: tiktoken.Encoding, names: dict[str, int], rank_ids: list[int] | None,
                 literal: set[str], special: set[str], origin):
        super().__init__(names, literal, special, origin)
        self.encoding = encoding
        self._rank_ids = rank_ids  # tiktoken rank -> token id; None where they are equal (GPT-2)

    @classmethod
    def r50k_base(cls) -> BPETokenizer:
        try:
            encoding = tiktoken.get_encoding("r50k_base")
        except Exception as err:  # tiktoken raises whatever its download raised
            raise TokenizerError(
                "the checkpoint ships no tokenizer files (vocab.json + merges.txt, tokenizer.json or "
                "meta.pkl) and tiktoken's r50k_base is not available: it needs internet once, or a "
                f"filled TIKTOKEN_CACHE_DIR ({type(err).__name__}: {err})") from err
        spell = {b: c for c, b in _gpt2_byte_decoder().items()}
        names = {"".join(spell[b] for b in encoding.decode_single_token_bytes(i)): i
                 for i in range(encoding.n_vocab) if i != encoding.eot_token}
        return cls(encoding, {**names, ENDOFTEXT: encoding.eot_token}, None, {ENDOFTEXT}, {ENDOFTEXT}, "r50k_base")

    @classmethod
    def from_vocab_merges(cls, vocab_file: Path, merges_file: Path) -> BPETokenizer:
        vocab = _read_json(vocab_file)
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{vocab_file}: expected a JSON object mapping tokens to ids")
        lines = _read_text(merges_file).splitlines()
        merges = [line.split() for line in lines if line and not line.startswith("#version")]
        names, added = _config_special_tokens(vocab_file.parent)
        special = _specials(vocab, names | {ENDOFTEXT}, added)
        return cls.build({**vocab, **special}, merges, set(special), set(special), merges_file)

    @classmethod
    def build(cls, vocab: dict, merges: list, literal: set[str], special: set[str], origin: Path) -> BPETokenizer:
        """tiktoken ranks (merge order) from a Hugging Face-style vocabulary and merge list. Tokens no
        merge makes (`<|endoftext|>`, OPT's `</s>`, fairseq's filler words) are `literal`: their own
        text; the `special` ones among them are also read as themselves in a text."""
        try:
            merged = [_spelled(a + b) for a, b in merges]
        except (TypeError, ValueError):
            raise TokenizerError(f"{origin}: not a GPT-2 byte-level BPE merge list") from None
        made, pieces, literal = set(merged), {}, set(literal)
        for name, token_id in vocab.items():
            data = None if name in literal else _spelled(name)
            if data is not None and (len(data) == 1 or data in made):
                pieces[data] = token_id
            else:
                literal.add(name)
        singles = sorted((b for b in pieces if len(b) == 1), key=pieces.get)
        if (len(singles) != 256 or None in made or len(made) != len(merged) or not made <= pieces.keys()
                or len(literal) > MAX_UNMERGED):
            raise TokenizerError(f"{origin}: vocabulary and merges disagree (every merge must make a token "
                                 "of the vocabulary, one merge per multi-byte token, all 256 bytes present)")
        order = singles + merged
        rank_ids = [pieces[token] for token in order]
        encoding = tiktoken.Encoding(f"bpe:{origin}", pat_str=r50k_pat_str,
                                     mergeable_ranks={token: rank for rank, token in enumerate(order)},
                                     special_tokens={})
        return cls(encoding, vocab, None if rank_ids == list(range(len(order))) else rank_ids, literal, special,
                   origin)

    def _encode_text(self, text: str) -> list[int]:
        ranks = self.encoding.encode_ordinary(text)
        return ranks if self._rank_ids is None else [self._rank_ids[r] for r in ranks]


class HFTokenizer(ByteLevelTokenizer):
    """A `tokenizer.json` that tiktoken cannot express exactly (GPT-NeoX's normalizes text to NFC and
    has tokens for runs of spaces, matched before the BPE), run by Hugging Face's `tokenizers`
    (Rust, torch-free)."""

    def __init__(self, path: Path, data: dict):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._rust = RustTokenizer.from_file(str(path))
        except Exception as err:
            raise TokenizerError(f"{path}: not a tokenizer `tokenizers` can load ({err})") from None
        self._rust.encode_special_tokens = True  # ByteLevelTokenizer._encode finds the special tokens
        added = data.get("added_tokens") or []
        names = self._rust.get_vocab(with_added_tokens=True)
        super().__init__(names, {t["content"] for t in added}, _added_special(added) | {ENDOFTEXT}, path)

    def _encode_text(self, text: str) -> list[int]:
        return self._rust.encode(text, add_special_tokens=False).ids


def from_tokenizer_json(path: Path) -> ByteLevelTokenizer:
    """tiktoken where it computes exactly what this tokenizer.json says (GPT-2's), else `tokenizers`."""
    data = _read_json(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise TokenizerError(f"{path}: not a BPE tokenizer (model.type is not 'BPE')")
    added = data.get("added_tokens") or []
    pre = data.get("pre_tokenizer") or {}
    gpt2_like = (data.get("normalizer") is None and all(t.get("special") for t in added)
                 and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
                 and not any(model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix",
                                                    "byte_fallback")))
    if not gpt2_like:
        return HFTokenizer(path, data)
    # merges are "a b" strings in older files, [a, b] pairs in newer ones
    merges = [m.split() if isinstance(m, str) else m for m in model.get("merges", [])]
    vocab = {**model.get("vocab", {}), **{t["content"]: t["id"] for t in added}}
    return BPETokenizer.build(vocab, merges, {t["content"] for t in added}, _added_special(added) | {ENDOFTEXT}, path)


def _added_special(added: list) -> set[str]:
    """The names of tokenizer.json's added tokens marked special."""
    return {t.get("content") for t in added if isinstance(t, dict) and t.get("special")} - {None}


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

    def _encode(self, text: str, specials: bool) -> list[int]:  # a character vocabulary has no special tokens
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


def _spelled(name: str) -> bytes | None:
    """The bytes a GPT-2 token name spells; None when it is no such spelling (a literal token)."""
    decoder = _gpt2_byte_decoder()
    return bytes(decoder[c] for c in name) if all(c in decoder for c in name) else None


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
