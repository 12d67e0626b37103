"""Training a GPT nanoGPT style (train.py, with configs/) and preparing its data (prepare.py)."""
