# A small character-level model of Shakespeare's plays, sized for a CPU: on 2 cores it trains in
# under 10 minutes to a validation loss under 2.0. The default model that `make serve` serves.
#   python -m nanogpt.train nanogpt/configs/shakespeare_char.py

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
max_iters = 2000
lr_decay_iters = 2000  # = max_iters, as Chinchilla suggests
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # few tokens per iteration
warmup_iters = 100

device = "cpu"
dtype = "float32"
compile = False
