# A small character-level model of Shakespeare's plays (0.81M parameters), sized for a CPU; the
# default model that `make serve` serves.
#   python -m nanogpt.training.train nanogpt/training/configs/shakespeare_char.py
# Its validation loss and training time: docs/training.md.

out_dir = "checkpoints/shakespeare-char"
data_dir = "data/shakespeare_char"  # prepared from the Shakespeare plays on first use
tokenizer = "char"
eval_interval = 250
eval_iters = 20
log_interval = 10
always_save_checkpoint = False  # small data: keep the best validation loss, not the last

batch_size = 32
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3  # small models tolerate a larger rate
max_iters = 1500
lr_decay_iters = 1500  # = max_iters, as nanoGPT does
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # few tokens per iteration
warmup_iters = 100

device = "cpu"
dtype = "float32"
compile = False  # measured: compiling took 146 s and saved ~5% per iteration, so it does not pay here
