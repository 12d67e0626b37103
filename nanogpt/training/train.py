"""Train a GPT, nanoGPT style: from scratch, resumed, or fine-tuned from a GPT-2 checkpoint.

    python -m nanogpt.training.train nanogpt/training/configs/shakespeare_char.py
    python -m nanogpt.training.train nanogpt/training/configs/shakespeare_char.py --max_iters=500 --device=cpu

The defaults below are overridden by a config file (a Python file of assignments to these names)
and then by `--name=value` flags, in that order. The output directory holds `ckpt.pt` (nanoGPT's
format) and the tokenizer files (`meta.pkl`, or `vocab.json` + `merges.txt`), so it can be served as is.
"""
from __future__ import annotations

import ast
import json
import math
import os
import runpy
import shutil
import sys
import time
import types
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

# -----------------------------------------------------------------------------
# default config: the GPT-2 small (124M) shape and nanoGPT's optimizer settings
# I/O
out_dir = "out"
eval_interval = 2000
eval_iters = 200
log_interval = 10  # iterations between progress-bar loss updates (each one syncs the device)
always_save_checkpoint = True  # else only when the validation loss improves
init_from = "scratch"  # 'scratch', 'resume' (from out_dir), or a checkpoint load_model accepts
# data: data_dir holds train.bin/val.bin; when it has none they are prepared from input_file
data_dir = "data/shakespeare_char"
tokenizer = "char"  # 'char' (meta.pkl) or 'bpe' (GPT-2 vocab.json + merges.txt)
input_file = ""  # text to prepare data from; '' = the Shakespeare plays (char only)
vocab_dir = ""  # bpe vocabulary; '' = init_from when that is a directory
gradient_accumulation_steps = 1
batch_size = 12
block_size = 1024
# model (from scratch; a loaded checkpoint brings its own shape)
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
# AdamW
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile = False  # torch.compile the model (pays on GPUs; on CPU it did not for small models)
threads = 0  # CPU threads; 0 = every core this process may use
seed = 1337
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str))}

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "shakespeare_char.py"


def load_config(args: list[str]) -> dict:
    """DEFAULTS, updated by config files and `--name=value` flags in the order given."""
    config = dict(DEFAULTS)
    for arg in args:
        if arg.startswith("--"):
            name, eq, text = arg[2:].partition("=")
            if not eq:
                raise SystemExit(f"expected --name=value, got {arg!r}")
            updates = {name: _parse_value(text)}
        else:
            # every name the file assigns must be a config key; its imports and helpers are skipped
            updates = {k: v for k, v in runpy.run_path(arg).items()
                       if not k.startswith("_") and not isinstance(v, (types.ModuleType, type, types.FunctionType))}
        for name, value in updates.items():
            config[name] = _check_type(name, value)
    return config


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)  # numbers, booleans, quoted strings
    except (ValueError, SyntaxError):
        return text  # a bare string: --device=cpu


def _check_type(name: str, value):
    if name not in DEFAULTS:
        raise SystemExit(f"unknown config key: {name}")
    expected = type(DEFAULTS[name])
    if expected is float and type(value) is int:
        value = float(value)
    if type(value) is not expected:
        raise SystemExit(f"{name} must be {expected.__name__}, got {value!r}")
    return value


# -----------------------------------------------------------------------------
# data


def ensure_data(config: dict) -> Path:
    """The data directory, prepared from the configured text when it holds no train.bin yet."""
    from nanogpt.training import prepare

    data = Path(config["data_dir"])
    if (data / "train.bin").exists():
        return data
    source = Path(config["input_file"]) if config["input_file"] else None
    texts = [source.read_text(encoding="utf-8")] if source else prepare.shakespeare_plays()
    print(f"preparing {config['tokenizer']} data in {data} from {source or 'the Shakespeare plays'}")
    if config["tokenizer"] == "char":
        prepare.prepare_char("".join(texts), data)
    elif config["tokenizer"] == "bpe":
        prepare.prepare_bpe(prepare.split_documents(texts), bpe_vocab_dir(config), data)
    else:
        raise SystemExit(f"tokenizer must be 'char' or 'bpe', got {config['tokenizer']!r}")
    return data


def bpe_vocab_dir(config: dict) -> Path:
    """vocab_dir, else the directory of the checkpoint being fine-tuned (its vocabulary)."""
    from nanogpt.checkpoint import resolve_checkpoint

    if config["vocab_dir"]:
        return Path(config["vocab_dir"])
    if config["init_from"] not in ("scratch", "resume"):
        path = resolve_checkpoint(config["init_from"])
        return path if path.is_dir() else path.parent
    raise SystemExit("tokenizer='bpe' needs vocab_dir: a directory with GPT-2's vocab.json and merges.txt")


def tokenizer_files(data: Path) -> tuple[Path, ...]:
    """The files in the data directory that say how to turn ids into text (meta.pkl, or the BPE
    vocabulary), by the serving tokenizer's rules."""
    from models.tokenizer import find_tokenizer

    spec = find_tokenizer(data)
    if not spec.files:
        raise SystemExit(f"{data} has no tokenizer files (meta.pkl, or vocab.json + merges.txt)")
    return spec.files


def get_batch(data: Path, split: str, batch_size: int, block_size: int, device: str):
    """A random batch of (inputs, targets), each (B, T) long, targets shifted by one token."""
    # A fresh memmap per batch: keeping one open grows memory (numpy issue, see nanoGPT).
    ids = np.memmap(data / f"{split}.bin", dtype=np.uint16, mode="r")
    if len(ids) <= block_size:
        raise SystemExit(f"{data / f'{split}.bin'} has {len(ids)} tokens, block_size is {block_size}")
    ix = torch.randint(len(ids) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(ids[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(ids[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# model


def init_model(config: dict, vocab_size: int):
    """(model, checkpoint or None): a new GPT, the one in out_dir to resume, or a loaded one."""
    from nanogpt.checkpoint import load_model
    from nanogpt.model import GPT, GPTConfig

    init_from = config["init_from"]
    if init_from == "scratch":
        model_args = {k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "dropout")}
        return GPT(GPTConfig(vocab_size=vocab_size, **model_args)), None
    if init_from == "resume":
        path = Path(config["out_dir"]) / "ckpt.pt"
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # for the optimizer state
        return load_model(path), checkpoint
    model = load_model(init_from)  # fine-tuning
    if not isinstance(model, GPT):  # the other families have the serving forward only
        raise SystemExit(f"{init_from} is a {type(model).__name__} checkpoint: fine-tuning takes GPT-2 and nanoGPT ones")
    if model.config.vocab_size < vocab_size:
        raise SystemExit(f"{init_from} has {model.config.vocab_size} tokens, the data uses {vocab_size}")
    if config["block_size"] < model.config.block_size:
        model.crop_block_size(config["block_size"])
    return model, None


def get_lr(it: int, config: dict) -> float:
    """Linear warmup, then cosine decay from learning_rate to min_lr at lr_decay_iters."""
    if not config["decay_lr"]:
        return config["learning_rate"]
    lr, min_lr = config["learning_rate"], config["min_lr"]
    if it < config["warmup_iters"]:
        return lr * (it + 1) / (config["warmup_iters"] + 1)
    if it > config["lr_decay_iters"]:
        return min_lr
    ratio = (it - config["warmup_iters"]) / max(1, config["lr_decay_iters"] - config["warmup_iters"])
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@torch.no_grad()
def estimate_loss(model, batch, eval_iters: int, ctx) -> dict[str, float]:
    """Mean loss over eval_iters random batches of each split."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = batch(split)
            with ctx:
                _, loss = model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def save_checkpoint(path: Path, raw_model, optimizer, iter_num: int, best_val_loss: float, config: dict):
    from nanogpt.checkpoint import save_nanogpt_checkpoint

    save_nanogpt_checkpoint(path, raw_model, optimizer=optimizer.state_dict(), iter_num=iter_num,
                            best_val_loss=best_val_loss, config=config)


# -----------------------------------------------------------------------------


def train(config: dict) -> dict:
    """Run one training job; returns the final {'iter_num', 'train_loss', 'val_loss', 'best_val_loss',
    'checkpoint', 'seconds', 'model'}."""
    from tqdm import tqdm

    started = time.time()
    c = config
    out_dir = Path(c["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(c["seed"])
    device, device_type = c["device"], "cuda" if "cuda" in c["device"] else "cpu"
    if device_type == "cpu":
        torch.set_num_threads(c["threads"] or len(os.sched_getaffinity(0)))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[c["dtype"]]
    ctx = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type, dtype=ptdtype)

    data = ensure_data(c)
    for f in tokenizer_files(data):  # the checkpoint directory must be servable on its own
        shutil.copyfile(f, out_dir / f.name)
    from models.tokenizer import load_tokenizer

    vocab_size = load_tokenizer(data).vocab_size

    model, checkpoint = init_model(c, vocab_size)
    block_size = min(c["block_size"], model.config.block_size)
    model.to(device).train()
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]),
                                           device_type)
    iter_num, best_val_loss = 0, float("inf")
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        checkpoint = None  # free the memory
    # float16 needs loss scaling to keep small gradients from flushing to zero
    scaler = torch.amp.GradScaler(device_type, enabled=(c["dtype"] == "float16"))
    raw_model = model
    if c["compile"]:
        model = torch.compile(model)

    def batch(split):
        return get_batch(data, split, c["batch_size"], block_size, device)

    ckpt_path = out_dir / "ckpt.pt"
    log_path = out_dir / "train_log.jsonl"
    tokens_per_iter = c["gradient_accumulation_steps"] * c["batch_size"] * block_size
    print(f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters, "
          f"{tokens_per_iter:,} tokens per iteration, device {device}, {torch.get_num_threads()} threads")

    x, y = batch("train")
    losses = {"train": float("nan"), "val": float("nan")}
    progress = tqdm(total=c["max_iters"], initial=iter_num, desc="train", unit="it", dynamic_ncols=True)
    while True:
        lr = get_lr(iter_num, c)
        for group in optimizer.param_groups:
            group["lr"] = lr

        if iter_num % c["eval_interval"] == 0 or iter_num >= c["max_iters"]:
            losses = estimate_loss(model, batch, c["eval_iters"], ctx)
            progress.write(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            with open(log_path, "a") as f:
                f.write(json.dumps({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                                    "seconds": round(time.time() - started, 1)}) + "\n")
            improved = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            if iter_num > 0 and (improved or c["always_save_checkpoint"]):
                save_checkpoint(ckpt_path, raw_model, optimizer, iter_num, best_val_loss, c)
        if iter_num >= c["max_iters"]:
            break

        # One optimizer step over gradient_accumulation_steps micro-batches; the next batch is
        # fetched while the device still works on this one.
        for _ in range(c["gradient_accumulation_steps"]):
            with ctx:
                _, loss = model(x, y)
                loss = loss / c["gradient_accumulation_steps"]
            x, y = batch("train")
            scaler.scale(loss).backward()
        if c["grad_clip"]:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        iter_num += 1
        progress.update(1)
        if iter_num % c["log_interval"] == 0:
            progress.set_postfix(loss=f"{loss.item() * c['gradient_accumulation_steps']:.4f}", lr=f"{lr:.2e}")
    progress.close()

    seconds = time.time() - started
    print(f"done: {iter_num} iterations in {seconds:.0f} s, final val loss {losses['val']:.4f} "
          f"(best {best_val_loss:.4f}), checkpoint {ckpt_path}")
    return {"iter_num": iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
            "best_val_loss": best_val_loss, "checkpoint": ckpt_path, "seconds": seconds, "model": raw_model}


def ensure_default_model(out_dir: str | Path, overrides: list[str] = ()) -> Path:
    """The checkpoint of the default shakespeare-char model in out_dir, trained first if missing
    (`overrides`: extra `--name=value` flags, e.g. for a quick run).

    Training writes to a sibling `.partial` directory whose files move into out_dir only when it
    is done (ckpt.pt last), so an interrupted run never leaves a model that looks finished.
    """
    out_dir = Path(out_dir)
    ckpt = out_dir / "ckpt.pt"
    if ckpt.exists():
        return ckpt
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    config = load_config([str(DEFAULT_CONFIG), f"--data_dir={REPO / 'data' / 'shakespeare_char'}", *overrides,
                          f"--out_dir={partial}", "--init_from=scratch"])
    print(f"no model at {ckpt}: training the default shakespeare-char model (minutes on a CPU)")
    train(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(partial.iterdir(), key=lambda f: f.name == "ckpt.pt"):
        os.replace(f, out_dir / f.name)
    partial.rmdir()
    return ckpt


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__ + "\nconfig keys and defaults:\n" +
              "\n".join(f"  --{k}={v!r}" for k, v in DEFAULTS.items()))
        raise SystemExit(0)
    return train(load_config(args))


if __name__ == "__main__":
    main()
