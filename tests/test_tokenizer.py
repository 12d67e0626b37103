"""models/tokenizer.py: GPT-2 BPE equal to transformers' tokenizer, nanoGPT character vocabularies,
OpenAI's token strings, streaming-safe incremental decoding, and clear errors for bad files."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import unicodedata

import pytest

from conftest import REPO, gpt2_vocab_files, write_gpt2_tokenizer
from models.tokenizer import (BPETokenizer, CharTokenizer, TokenizerError, TokenizerSpec,
                              find_tokenizer, load_tokenizer)

CORPUS = [
    "Hello world",
    "Hello, my name is",
    "",
    " ",
    "   leading and trailing spaces   ",
    "many     spaces\tand\ttabs\t\t here",
    "line one\nline two\n\n\nafter blank lines\r\nwindows line\n",
    "\n\n\n",
    "def greet(name: str) -> str:\n    return f\"Hello, {name}!\"  # comment\n\nif x<=3 and y!=4: pass\n",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}',
    "Café, naïve, façade, Ångström, jalapeño, Übermensch, Œuvre",
    "日本語のテキストと中文文本，還有한국어 텍스트。",
    "emoji: 🎉👍🏽🧑‍🚀 🇫🇷 ❤️ done",
    "Numbers 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 2024-01-31",
    "Contractions: I'm, you're, they'll, we've, it's, He'd, can't, DON'T, O'Neil's",
    "trailing newline and spaces \n  ",
    "Ünïcödé\u00a0non-breaking\u2003em-space\u200bzero-width",
    "Mixed: naïve café 日本 🎉 123 it's\tdone",
    "Punctuation!!! ??? ... --- ((()))[]{} @#$%^&*_+=~`|\\/<>",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return write_gpt2_tokenizer(tmp_path_factory.mktemp("gpt2-tokenizer"))


@pytest.fixture(scope="module")
def bpe(gpt2_dir):
    return load_tokenizer(gpt2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(gpt2_dir):
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(gpt2_dir)


def partial_utf8_ids(tokenizer) -> list[int]:
    """Token ids whose bytes are not valid UTF-8 on their own (pieces of multi-byte characters)."""
    ids = []
    for text in ("🎉👍🏽", "日本語", "한국어", "🧑‍🚀"):
        for i in tokenizer.encode(text):
            try:
                tokenizer.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                ids.append(i)
    return ids


# ---- GPT-2 BPE ----

def test_bpe_matches_transformers(bpe, hf_tokenizer):
    for text in CORPUS + ["\n".join(CORPUS)]:
        assert bpe.encode(text) == hf_tokenizer.encode(text), text


def test_bpe_matches_transformers_on_a_long_mixed_text(bpe, hf_tokenizer):
    rng = random.Random(0)
    words = " ".join(CORPUS).split(" ")
    text = "".join(rng.choice(words) + rng.choice([" ", "  ", "\n", "\t", "", ", "]) for _ in range(3000))
    ids = bpe.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert len(ids) > 3000


def test_bpe_shape_and_round_trip(bpe):
    assert isinstance(bpe, BPETokenizer)
    assert bpe.vocab_size == 50257
    assert bpe.eos_token_id == 50256
    assert bpe.encode("Hello world") == [15496, 995]
    for text in CORPUS:
        assert bpe.decode(bpe.encode(text)) == text


SPECIAL_TEXTS = [
    "a<|endoftext|>b",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    " <|endoftext|> x",
    "First document.\n\n<|endoftext|>\n\nSecond document",
    "<|endoftext|>Hello world<|endoftext|>",
    "<|endoftext|",  # not the whole token's text: ordinary text
    "<|endoftext|>>",
    "end<|endoftext|>日本語 🎉<|endoftext|>  spaces",
]


def test_special_token_text_becomes_its_id_as_in_transformers(bpe, hf_tokenizer):
    for text in SPECIAL_TEXTS:
        assert bpe.encode(text) == hf_tokenizer.encode(text), text
        assert bpe.decode(bpe.encode(text)) == text
    assert bpe.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert bpe.special_ids == {50256}
    assert bpe.token_string(50256) == "<|endoftext|>"


def test_encode_ordinary_keeps_special_token_text_as_text(bpe):
    ids = bpe.encode_ordinary("a<|endoftext|>b")
    assert 50256 not in ids and bpe.decode(ids) == "a<|endoftext|>b"
    assert bpe.encode_ordinary(CORPUS[8]) == bpe.encode(CORPUS[8])


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.json"])
def test_a_checkpoints_own_special_tokens_become_their_ids(tmp_path, gpt2_dir, layout):
    """Special tokens a checkpoint adds (`<|sep|>` and `<|pad|>`, ids 50257 and 50258) are read from
    tokenizer.json's added_tokens, or from tokenizer_config.json's added_tokens_decoder beside
    vocab.json; transformers reads the same files."""
    from transformers import GPT2TokenizerFast

    if layout == "tokenizer.json":
        hf = GPT2TokenizerFast.from_pretrained(gpt2_dir)
        hf.add_special_tokens({"additional_special_tokens": ["<|sep|>"], "pad_token": "<|pad|>"})
        hf.save_pretrained(tmp_path)
        assert not (tmp_path / "vocab.json").exists()
    else:
        write_gpt2_tokenizer(tmp_path)
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"] = {
            str(i): {"content": name, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False, "special": True}
            for i, name in [(50256, "<|endoftext|>"), (50257, "<|sep|>"), (50258, "<|pad|>")]}
        config.update(pad_token="<|pad|>", additional_special_tokens=["<|sep|>"])
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = GPT2TokenizerFast.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert len(hf) == tokenizer.vocab_size == 50259 and tokenizer.special_ids == {50256, 50257, 50258}
    for text in SPECIAL_TEXTS + ["q<|sep|>a<|pad|><|pad|>", "<|sep|> <|endoftext|>\n<|sep|"]:
        assert tokenizer.encode(text) == hf.encode(text), text
    assert {tokenizer.decode([i]) for i in (50257, 50258)} == {"<|sep|>", "<|pad|>"}
    assert [tokenizer.decode([i]) for i in (50257, 50258)] == [hf.decode([i]) for i in (50257, 50258)]


def test_char_vocabulary_has_no_special_tokens(tmp_path):
    path = tmp_path / "meta.pkl"
    chars = sorted(set("<|endoftext|> ab"))
    path.write_bytes(pickle.dumps({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                                   "stoi": {c: i for i, c in enumerate(chars)}}))
    tokenizer = load_tokenizer(path)
    assert tokenizer.special_ids == frozenset()
    assert tokenizer.encode("a<|endoftext|>") == tokenizer.encode_ordinary("a<|endoftext|>")
    assert len(tokenizer.encode("a<|endoftext|>")) == 14


def test_token_string_uses_openai_bytes_form_for_partial_characters(bpe):
    partial = partial_utf8_ids(bpe)
    assert partial, "the emoji/CJK corpus must contain tokens that split a character"
    for i in partial:
        data = bpe.token_bytes(i)
        assert bpe.token_string(i) == "bytes:" + "".join("\\x%02x" % b for b in data)
    # the emoji 🎉 (f0 9f 8e 89) is three GPT-2 tokens; the last two are lone continuation bytes
    assert [bpe.token_string(i) for i in bpe.encode("🎉")] == ["bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    assert bpe.token_string(bpe.encode(" world")[0]) == " world"


def test_incremental_decoding_emits_only_whole_characters(bpe):
    for text in ["emoji 🎉👍🏽🧑‍🚀 and 日本語のテキスト, 한국어!", "🇫🇷❤️", "naïve café"]:
        ids = bpe.encode(text)
        decoder = bpe.incremental_decoder()
        pieces = [decoder.push(i) for i in ids]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + decoder.flush() == text
    decoder = bpe.incremental_decoder()
    assert [decoder.push(i) for i in bpe.encode("🎉")] == ["", "", "🎉"]


def test_incremental_decoding_equals_decode_on_random_ids(bpe):
    # Random ids include stray continuation bytes and unfinished characters: the replacement
    # characters must come out exactly where decode() puts them.
    rng = random.Random(1)
    partial = partial_utf8_ids(bpe)
    for _ in range(200):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(bpe.vocab_size)
               for _ in range(rng.randrange(1, 12))]
        decoder = bpe.incremental_decoder()
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == bpe.decode(ids)


def test_flush_returns_replacement_for_an_unfinished_character(bpe):
    first = bpe.encode("🎉")[0]
    decoder = bpe.incremental_decoder()
    assert decoder.push(first) == ""
    assert decoder.flush() == "\ufffd" == bpe.decode([first])


def test_ids_outside_the_vocabulary_are_rejected(bpe):
    for bad in (50257, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            bpe.decode([15496, bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            bpe.token_bytes(bad)


def test_tokenizer_json_gives_the_same_ids(tmp_path, gpt2_dir, bpe, hf_tokenizer):
    hf_tokenizer.save_pretrained(tmp_path)
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
    spec = find_tokenizer(tmp_path)
    assert spec == TokenizerSpec("gpt2-bpe", (tmp_path / "tokenizer.json",))
    tokenizer = load_tokenizer(spec)
    assert tokenizer.eos_token_id == 50256 and tokenizer.vocab_size == 50257
    for text in CORPUS:
        assert tokenizer.encode(text) == bpe.encode(text)


def test_openai_file_names_are_accepted(tmp_path, bpe):
    encoder, merges = gpt2_vocab_files()
    (tmp_path / "encoder.json").write_bytes(encoder.read_bytes())
    (tmp_path / "vocab.bpe").write_bytes(merges.read_bytes())
    tokenizer = load_tokenizer(tmp_path)
    assert find_tokenizer(tmp_path).files == (tmp_path / "encoder.json", tmp_path / "vocab.bpe")
    assert tokenizer.encode(CORPUS[-2]) == bpe.encode(CORPUS[-2])


def test_loaded_tokenizers_are_shared_until_their_files_change(tmp_path):
    write_gpt2_tokenizer(tmp_path)
    first = load_tokenizer(tmp_path)
    assert load_tokenizer(str(tmp_path)) is first
    os.utime(tmp_path / "vocab.json", ns=(0, 0))
    assert load_tokenizer(tmp_path) is not first


def test_r50k_base_is_used_when_the_checkpoint_ships_no_vocabulary(tmp_path, bpe, monkeypatch):
    """Fill tiktoken's cache with r50k_base (rebuilt from the real GPT-2 files, checked by tiktoken
    against OpenAI's hash) and load a directory without tokenizer files, in a fresh process."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the files directly, cache nothing
    encoder, merges = gpt2_vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(str(merges), str(encoder))
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"".join(
        base64.b64encode(token) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])))
    empty = tmp_path / "checkpoint"
    empty.mkdir()
    assert find_tokenizer(empty) == TokenizerSpec("gpt2-bpe", ())
    text = "\n".join(CORPUS)
    out = run_python(
        "import json, sys; from models.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(empty)!r})\n"
        f"print(json.dumps([t.vocab_size, t.eos_token_id, t.encode({text!r})]))",
        TIKTOKEN_CACHE_DIR=str(cache), **NO_NETWORK)
    assert json.loads(out) == [50257, 50256, bpe.encode(text)]


def test_r50k_base_unavailable_is_a_clear_error(tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    result = run_python(
        "from models.tokenizer import load_tokenizer, TokenizerError\n"
        f"try: load_tokenizer({str(tmp_path)!r})\n"
        "except TokenizerError as err: print(err)",
        TIKTOKEN_CACHE_DIR=str(cache), **NO_NETWORK)
    assert "r50k_base is not available" in result and "TIKTOKEN_CACHE_DIR" in result


# ---- errors for missing or corrupt files ----

def test_missing_vocab_file_is_named(tmp_path):
    write_gpt2_tokenizer(tmp_path)
    spec = find_tokenizer(tmp_path)
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match=r"merges\.txt: cannot read tokenizer file"):
        load_tokenizer(spec)
    with pytest.raises(TokenizerError, match="no such file or directory"):
        load_tokenizer(tmp_path / "missing" / "ckpt.pt")


@pytest.mark.parametrize("name, content, message", [
    ("vocab.json", b'{"a": 1,', r"vocab\.json: invalid JSON"),
    ("vocab.json", b'["a", "b"]', r"vocab\.json: expected a JSON object"),
    ("vocab.json", b"\xff\xfe\x00", r"vocab\.json: not UTF-8"),
    ("merges.txt", b"#version: 0.2\n\xc4\xa0 t\n", r"merges\.txt: vocabulary and merges disagree"),
])
def test_corrupt_vocab_files_are_named(tmp_path, name, content, message):
    write_gpt2_tokenizer(tmp_path)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)


def test_merge_order_decides_even_where_ids_do_not_follow_it(tmp_path):
    """Two merges swapped: a valid BPE whose ids no longer follow merge order; it tokenizes as
    transformers does from the same files (tiktoken's ranks mapped to the ids)."""
    from transformers import GPT2TokenizerFast

    write_gpt2_tokenizer(tmp_path)
    lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    lines[1], lines[2] = lines[2], lines[1]
    (tmp_path / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    reference = GPT2TokenizerFast.from_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text), text


def test_tokenizer_json_that_is_not_bpe(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a BPE tokenizer"):
        load_tokenizer(tmp_path)


# ---- nanoGPT character vocabularies ----

def write_meta(directory, text: str):
    """meta.pkl exactly as nanoGPT's shakespeare_char/prepare.py writes it."""
    chars = sorted(set(text))
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
            "stoi": {ch: i for i, ch in enumerate(chars)}}
    with open(directory / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return directory / "meta.pkl"


SHAKESPEARE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def test_char_vocabulary_from_meta_pkl(tmp_path):
    meta = write_meta(tmp_path, SHAKESPEARE)
    assert find_tokenizer(tmp_path) == TokenizerSpec("char", (meta,))
    (tmp_path / "ckpt.pt").write_bytes(b"")  # a nanoGPT checkpoint path: meta.pkl lies beside it
    tokenizer = load_tokenizer(tmp_path / "ckpt.pt")
    assert isinstance(tokenizer, CharTokenizer)
    chars = sorted(set(SHAKESPEARE))
    assert tokenizer.vocab_size == len(chars)
    assert tokenizer.eos_token_id is None
    assert tokenizer.encode("Speak") == [chars.index(c) for c in "Speak"]
    assert tokenizer.decode(tokenizer.encode(SHAKESPEARE)) == SHAKESPEARE
    assert tokenizer.token_string(chars.index("\n")) == "\n"
    assert load_tokenizer(meta) is tokenizer


def test_char_vocabulary_rejects_unknown_characters_by_name(tmp_path):
    tokenizer = load_tokenizer(write_meta(tmp_path, SHAKESPEARE))
    with pytest.raises(ValueError, match=r"character '!' \(U\+0021\) at position 5 is not in this "
                                         r"model's vocabulary"):
        tokenizer.encode("Speak!")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_char_vocabulary_with_non_ascii_characters(tmp_path):
    tokenizer = load_tokenizer(write_meta(tmp_path, "naïve 日本 🎉"))
    ids = tokenizer.encode("日本 🎉 naïve")
    decoder = tokenizer.incremental_decoder()
    assert [decoder.push(i) for i in ids] == list("日本 🎉 naïve")
    assert decoder.flush() == ""
    assert tokenizer.token_bytes(tokenizer.encode("🎉")[0]) == "🎉".encode()


@pytest.mark.parametrize("content, message", [
    (b"not a pickle", r"meta\.pkl: not a nanoGPT meta\.pkl"),
    (pickle.dumps({"stoi": {"a": 0}}), r"meta\.pkl: expected nanoGPT's meta\.pkl"),
    (pickle.dumps({"itos": {0: "a", 2: "b"}}), r"meta\.pkl: expected nanoGPT's meta\.pkl"),
    (pickle.dumps({"itos": {0: "a", 1: "a"}}), r"meta\.pkl: expected nanoGPT's meta\.pkl"),
    # a pickle naming a class is refused before anything is imported or called
    (pickle.dumps({"itos": {0: "a"}, "x": os.path.join}), r"meta\.pkl: not a nanoGPT meta\.pkl.*posixpath"),
])
def test_corrupt_meta_pkl_is_named(tmp_path, content, message):
    (tmp_path / "meta.pkl").write_bytes(content)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)


# ---- helpers ----

# Any attempt to reach the internet fails at once instead of hanging or downloading.
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}


def run_python(code: str, **env) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


# ---- the other families' vocabularies: OPT's ids, GPT-NeoX's tokenizer.json ----

def mixed_text(seed: int) -> str:
    rng = random.Random(seed)
    words = " ".join(CORPUS).split(" ")
    return "".join(rng.choice(words) + rng.choice([" ", "  ", "   ", "\n", "\t", "", ", ", "\n\n  "])
                   for _ in range(2000))


# NFC matters to NeoX's normalizer: decomposed accents, compatibility characters
NEOX_EXTRA = ["Cafe\u0301 nai\u0308ve", "ﬁnance Ａ１ ℌ", "tabs\t\t and     five spaces", " " * 30 + "x"]


@pytest.fixture(scope="module", params=["opt", "gpt_neox"])
def family_tokenizers(request, tmp_path_factory):
    """Ours and transformers' AutoTokenizer from the same directory (config.json included: it
    decides OPT's BOS)."""
    from transformers import AutoTokenizer

    from conftest import FAMILY_CONFIGS, write_neox_tokenizer, write_opt_tokenizer

    directory = tmp_path_factory.mktemp(request.param)
    {"opt": write_opt_tokenizer, "gpt_neox": write_neox_tokenizer}[request.param](directory)
    kwargs = FAMILY_CONFIGS[request.param][2]
    (directory / "config.json").write_text(json.dumps({"model_type": request.param, **kwargs}))
    return request.param, load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)


def test_family_ids_match_transformers(family_tokenizers):
    name, ours, reference = family_tokenizers
    for text in CORPUS + NEOX_EXTRA + [mixed_text(0), mixed_text(1)]:
        assert ours.encode(text) == reference(text).input_ids, text[:80]
    assert type(ours).__name__ == {"opt": "BPETokenizer", "gpt_neox": "HFTokenizer"}[name]


def test_family_decoding_and_token_strings(family_tokenizers):
    name, ours, reference = family_tokenizers
    for text in CORPUS + [mixed_text(2)]:
        ids = ours.encode(text)
        generated = ids[1:] if name == "opt" else ids  # OPT's BOS is no text of the prompt
        normalized = unicodedata.normalize("NFC", text) if name == "gpt_neox" else text  # NeoX's normalizer
        assert ours.decode(ids) == reference.decode(generated) == normalized
        decoder = ours.incremental_decoder()
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == ours.decode(ids)
    for token_id in ours.encode("naïve 日本 🎉 it's   spaced"):
        if token_id == ours.prompt_bos:
            continue  # no text, named in logprobs (test_family_special_token_text_becomes_its_id_as_in_transformers)
        data = ours.token_bytes(token_id)
        assert ours.token_string(token_id) == (data.decode() if _utf8(data) else
                                               "bytes:" + "".join("\\x%02x" % b for b in data))


def test_family_special_token_text_becomes_its_id_as_in_transformers(family_tokenizers):
    name, ours, reference = family_tokenizers
    special = {"opt": "</s>", "gpt_neox": "<|endoftext|>"}[name]
    for text in (f"a{special}b", special, f" {special}{special} x", f"{special[:-1]}", f"end{special}日本 🎉"):
        assert ours.encode(text) == reference(text).input_ids, text
    ids = ours.encode(f"a{special}b")
    assert ours.eos_token_id in ids[1:] and ours.eos_token_id in ours.special_ids
    assert ours.eos_token_id not in ours.encode_ordinary(f"a{special}b")
    assert ours.decode(ours.encode_ordinary(f"a{special}b")) == f"a{special}b"
    assert ours.token_string(ours.eos_token_id) == special
    if name == "opt":  # the BOS that starts every prompt: named in logprobs, no text in an echo
        assert ids[0] == ours.eos_token_id and ours.token_bytes(ids[0]) == b""
        assert ours.encode_ordinary("a")[0] != ours.prompt_bos  # no BOS: bad words, training text


def test_neox_tokenizer_runs_through_tokenizers(tmp_path, bpe):
    """Why GPT-NeoX's tokenizer.json goes through `tokenizers`: its runs of spaces are tokens of
    their own, matched before the BPE, which GPT-2's split pattern (tiktoken) does not produce."""
    from conftest import write_neox_tokenizer

    ours = load_tokenizer(write_neox_tokenizer(tmp_path))
    run = ours._rust.token_to_id(" " * 5)
    assert run is not None and run in ours.encode("a     b")
    assert [i + 2 for i in bpe.encode("a     b")] != ours.encode("a     b")  # GPT-2's ids, shifted as NeoX's


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
