"""Training and data preparation: tiny real runs (a few dozen iterations of a tiny model), their
checkpoints loaded back through nanogpt.checkpoint, fine-tuning from a Hugging Face checkpoint."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from nanogpt.training import prepare, train
from nanogpt.checkpoint import load_model
from tests.conftest import make_hf_checkpoint, write_gpt2_tokenizer

TEXT = prepare.shakespeare_plays()[0][:40_000]  # All's Well That Ends Well, first 40k characters

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8",
        "--learning_rate=1e-2", "--min_lr=1e-3", "--warmup_iters=5", "--lr_decay_iters=60",
        "--eval_iters=5", "--device=cpu", "--dtype=float32", "--compile=False"]


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


def read_ids(data: Path) -> np.ndarray:
    return np.concatenate([np.fromfile(data / f"{split}.bin", dtype=np.uint16) for split in ("train", "val")])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """40 iterations of a tiny character model on one play; returns (config, result)."""
    root = tmp_path_factory.mktemp("tiny-run")
    (root / "input.txt").write_text(TEXT)
    config = train.load_config(TINY + [f"--out_dir={root / 'out'}", f"--data_dir={root / 'data'}",
                                       f"--input_file={root / 'input.txt'}", "--max_iters=40",
                                       "--eval_interval=20"])
    return config, train.train(config)


def test_config_file_then_flags_override_defaults(tmp_path):
    config_file = tmp_path / "cfg.py"
    config_file.write_text("import math\nn_layer = 3\nlearning_rate = 1e-3\nout_dir = 'somewhere'\n"
                           "dropout = math.sqrt(0.01)\n")
    config = train.load_config([str(config_file), "--n_layer=5", "--device=cpu", "--learning_rate=1",
                                "--decay_lr=False", "--out_dir='quoted'"])
    assert config["n_layer"] == 5 and config["device"] == "cpu" and config["out_dir"] == "quoted"
    assert config["learning_rate"] == 1.0 and isinstance(config["learning_rate"], float)
    assert config["decay_lr"] is False
    assert config["n_head"] == train.DEFAULTS["n_head"] and config["dropout"] == pytest.approx(0.1)
    config_file.write_text("n_layers = 3\n")
    with pytest.raises(SystemExit, match="unknown config key: n_layers"):
        train.load_config([str(config_file)])
    with pytest.raises(SystemExit, match="unknown config key: n_layers"):
        train.load_config(["--n_layers=2"])
    with pytest.raises(SystemExit, match="n_layer must be int"):
        train.load_config(["--n_layer=2.5"])
    with pytest.raises(SystemExit, match="expected --name=value"):
        train.load_config(["--compile"])


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    config = dict(train.DEFAULTS, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [train.get_lr(it, config) for it in range(0, 130)]
    assert lrs[0] < lrs[5] < lrs[9] < 1.0
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # halfway through the cosine
    assert all(a >= b for a, b in zip(lrs[10:111], lrs[11:111]))
    assert lrs[110] == pytest.approx(0.1) and lrs[129] == 0.1


def test_prepare_char_round_trip(tmp_path):
    meta = prepare.prepare_char(TEXT, tmp_path)
    with open(tmp_path / "meta.pkl", "rb") as f:
        assert pickle.load(f) == meta
    assert meta["vocab_size"] == len(set(TEXT)) == len(meta["itos"]) == len(meta["stoi"])
    assert all(meta["stoi"][ch] == i for i, ch in meta["itos"].items())
    train_ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert len(train_ids) == int(len(TEXT) * 0.9)
    ids = read_ids(tmp_path)
    assert "".join(meta["itos"][int(i)] for i in ids) == TEXT


def test_shakespeare_plays_are_the_modern_texts():
    plays = prepare.shakespeare_plays()
    assert len(plays) == 42
    text = "".join(plays)
    assert len(text) == 5_057_198 and len(set(text)) == 84


def test_prepare_bpe_matches_transformers_tokenizer(tmp_path):
    from transformers import GPT2TokenizerFast

    vocab = write_gpt2_tokenizer(tmp_path / "vocab")
    texts = [TEXT[:3000], "First document.<|endoftext|>Second document, with ünïcödé."]
    documents = prepare.split_documents(texts)
    assert len(documents) == 3
    n = prepare.prepare_bpe(documents, vocab, tmp_path / "data")

    reference = GPT2TokenizerFast.from_pretrained(vocab)
    expected = [i for doc in documents for i in reference.encode(doc) + [reference.eos_token_id]]
    assert n == len(expected)
    assert read_ids(tmp_path / "data").tolist() == expected
    for name in ("vocab.json", "merges.txt"):
        assert (tmp_path / "data" / name).read_bytes() == (vocab / name).read_bytes()


def test_prepare_cli_char(tmp_path):
    (tmp_path / "in.txt").write_text("hello world\n" * 20)
    prepare.main(["char", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out")])
    with open(tmp_path / "out" / "meta.pkl", "rb") as f:
        assert pickle.load(f)["vocab_size"] == len(set("hello world\n"))


@pytest.mark.slow
def test_training_lowers_the_loss(tiny_run):
    config, result = tiny_run
    log = read_log(Path(config["out_dir"]))
    assert [row["iter"] for row in log] == [0, 20, 40]
    assert log[0]["val_loss"] > 3.5  # ~ln(vocab size) at random init
    assert result["val_loss"] == log[-1]["val_loss"] < log[0]["val_loss"] - 0.5
    assert result["iter_num"] == 40


@pytest.mark.slow
def test_checkpoint_is_self_contained_and_loads(tiny_run):
    config, result = tiny_run
    out = Path(config["out_dir"])
    assert (out / "meta.pkl").read_bytes() == (Path(config["data_dir"]) / "meta.pkl").read_bytes()
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    assert {"model", "model_args", "iter_num", "best_val_loss", "config", "optimizer"} <= set(ckpt)
    assert ckpt["iter_num"] == 40 and ckpt["config"]["n_layer"] == 2
    assert ckpt["best_val_loss"] == pytest.approx(result["best_val_loss"])

    model = result["model"].eval()
    loaded = load_model(str(out / "ckpt.pt"))
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        expected, _ = model(idx, idx)
        actual, _ = loaded(idx, idx)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(tiny_run, tmp_path):
    config, _ = tiny_run
    resumed = dict(config, init_from="resume", max_iters=50, eval_interval=10)
    result = train.train(resumed)
    log = read_log(Path(config["out_dir"]))
    assert [row["iter"] for row in log] == [0, 20, 40, 40, 50]
    assert log[3]["val_loss"] == pytest.approx(log[2]["val_loss"], abs=0.15)  # same weights, new batches
    assert result["iter_num"] == 50
    assert torch.load(Path(config["out_dir"]) / "ckpt.pt", weights_only=True)["iter_num"] == 50


@pytest.mark.slow
def test_finetune_from_hugging_face_checkpoint(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "hf", n_layer=2, n_head=2, n_embd=64, n_positions=128)
    (tmp_path / "input.txt").write_text(TEXT[:20_000])
    config = train.load_config(TINY + [
        f"--init_from={hf}", "--tokenizer=bpe", f"--input_file={tmp_path / 'input.txt'}",
        f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--batch_size=4",
        "--learning_rate=1e-3", "--decay_lr=False", "--max_iters=12", "--eval_interval=12"])
    result = train.train(config)

    log = read_log(tmp_path / "out")
    assert result["val_loss"] < log[0]["val_loss"] - 0.5
    out = tmp_path / "out"
    for name in ("vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (hf / name).read_bytes()
    loaded = load_model(str(out / "ckpt.pt"))
    assert loaded.config.vocab_size == 50257 and loaded.config.block_size == 32  # cropped
    assert loaded.config.n_embd == 64


def test_ensure_default_model_trains_once(tmp_path):
    out = tmp_path / "checkpoints" / "default"
    overrides = TINY + ["--max_iters=4", "--eval_interval=4", f"--data_dir={tmp_path / 'data'}",
                        f"--input_file={tmp_path / 'input.txt'}"]
    (tmp_path / "input.txt").write_text(TEXT[:5000])
    ckpt = train.ensure_default_model(out, overrides)
    assert ckpt == out / "ckpt.pt" and ckpt.exists() and (out / "meta.pkl").exists()
    assert not out.with_name("default.partial").exists()
    stamp = ckpt.stat().st_mtime_ns
    assert train.ensure_default_model(out, overrides) == ckpt
    assert ckpt.stat().st_mtime_ns == stamp  # not trained again
