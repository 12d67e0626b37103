# Fine-tune a GPT-2 checkpoint on the Shakespeare plays (nanoGPT's finetune_shakespeare, GPT-2 BPE).
#   python -m nanogpt.training.train nanogpt/training/configs/finetune_gpt2.py --init_from=path/to/hf-gpt2-dir
# init_from takes whatever nanogpt.checkpoint.load_model takes: a Hugging Face GPT-2 directory, a
# nanoGPT ckpt.pt, or hf:<repo> (from the Hugging Face cache; downloaded when the Hub is reachable).
# The data is tokenized with the checkpoint's own vocabulary files, which are copied beside the
# new checkpoint. A GPU is advised; on a CPU lower block_size and gradient_accumulation_steps.

init_from = "hf:openai-community/gpt2"
out_dir = "checkpoints/gpt2-shakespeare"
data_dir = "data/shakespeare_gpt2"
tokenizer = "bpe"
input_file = ""  # '' = the Shakespeare plays, one document each; or any UTF-8 text file

eval_interval = 5
eval_iters = 40
always_save_checkpoint = False  # keep the checkpoint with the best validation loss

# 1 * 32 * 1024 = 32,768 tokens per iteration; one epoch of the plays (~1.6M tokens) is ~50 iterations
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024  # smaller values crop the checkpoint's position table
max_iters = 20

# a small constant learning rate: the model already knows English
learning_rate = 3e-5
decay_lr = False
