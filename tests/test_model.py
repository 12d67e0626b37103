"""nanogpt.model against transformers' GPT2LMHeadModel loaded from the same checkpoint: the training
forward, and the serving forward (ragged batches through the KV cache) at every position."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from conftest import make_hf_checkpoint
from nanogpt.checkpoint import load_model
from nanogpt.runtime.kv_cache import KVCache
from nanogpt.model import GPT, GPTConfig

SHAPES = {
    "2x64x2h": dict(n_layer=2, n_embd=64, n_head=2, n_positions=64),
    "3x96x4h-ctx32": dict(n_layer=3, n_embd=96, n_head=4, n_positions=32),
}
TOL = dict(rtol=1e-5, atol=1e-5)  # float32


class Pair:
    """Our model and the transformers reference, loaded from one random-weight checkpoint."""

    def __init__(self, directory, n_positions, device="cpu"):
        from transformers import GPT2LMHeadModel

        self.directory = directory
        self.ours = load_model(str(directory), device=device)
        self.hf = GPT2LMHeadModel.from_pretrained(directory).to(device).eval()
        self.n_positions = n_positions
        self._ref = {}

    def reference(self, seq: list[int]) -> torch.Tensor:
        """transformers' logits (len(seq), V) of a whole sequence in one full forward."""
        key = tuple(seq)
        if key not in self._ref:
            with torch.no_grad():
                self._ref[key] = self.hf(torch.tensor([seq], device=self.hf.device)).logits[0]
        return self._ref[key]


def make_pair(name: str, tmp_path_factory, device="cpu") -> Pair:
    """The Pair of a random-weight checkpoint of SHAPES[name], both models on `device`."""
    shape = SHAPES[name]
    directory = make_hf_checkpoint(tmp_path_factory.mktemp(name), with_tokenizer=False, **shape)
    return Pair(directory, shape["n_positions"], device)


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    return make_pair(request.param, tmp_path_factory)


def random_seq(n, seed):
    return torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_call(model, cache, rows, all_logits=False):
    """One forward_cached call. rows: (slot, seq, start, n) = feed seq[start:start+n] into slot."""
    tokens, lengths, slots, start, _ = cached_batch(rows, cache.k[0].device)
    return model.forward_cached(tokens, lengths, slots, start, cache, all_logits=all_logits)


def cached_batch(rows, device) -> tuple:
    """forward_cached's (tokens, lengths, slots, start_pos, span=None) for rows (slot, seq, start, n).
    Padding is filled with random tokens, so that a leak of it into real results would show."""
    T = max(n for _, _, _, n in rows)
    tokens = torch.randint(0, 50257, (len(rows), T))
    for b, (_, seq, start, n) in enumerate(rows):
        tokens[b, :n] = torch.tensor(seq[start:start + n], dtype=torch.long)
    as_tensor = lambda i: torch.tensor([row[i] for row in rows], dtype=torch.long, device=device)  # noqa: E731
    return tokens.to(device), as_tensor(3), as_tensor(0), as_tensor(2), None


def test_full_forward_matches_transformers(pair):
    idx = torch.randint(0, 50257, (3, pair.n_positions))
    logits, loss = pair.ours(idx[:, :-1], targets=idx[:, 1:])
    with torch.no_grad():
        ref = pair.hf(idx, labels=idx)
    assert logits.shape == (3, pair.n_positions - 1, 50257)
    assert_close(logits, ref.logits[:, :-1], **TOL)
    assert_close(loss, ref.loss, **TOL)

    last, no_loss = pair.ours(idx)  # inference form: only the last position
    assert no_loss is None and last.shape == (3, 1, 50257)
    assert_close(last[:, 0], ref.logits[:, -1], **TOL)


@pytest.mark.parametrize("slot_of", [dict(a=5, b=1, c=3), dict(a=1, b=2, c=3), dict(a=1, b=3, c=4)],
                         ids=["scattered", "consecutive", "ascending-with-gaps"])
def test_ragged_batch_decoding_matches_full_forward(pair, slot_of):
    """Prefill of different lengths into non-contiguous slots, decode steps, a sequence joining in
    the middle (its prefill batched with the others' decode), a chunked continuation, and an empty
    padding row: every row's logits equal transformers' at that position. Rows in consecutive
    slots (read in place), in ascending slots with an unused one between them (the slot range read
    in place, the unused slot's output dropped) and in any other order (gathered) all occur."""
    model, max_slots = pair.ours, 6
    cache = KVCache(model.config, max_slots=max_slots, max_len=pair.n_positions, device="cpu", dtype=torch.float32)
    seqs = {name: random_seq(pair.n_positions, seed) for seed, name in enumerate("abc", start=1)}
    done = {name: 0 for name in seqs}  # tokens cached per sequence
    pad_slot = 0

    def step(plan, pad_row=False):
        rows = [(slot_of[name], seqs[name], done[name], n) for name, n in plan]
        if pad_row:  # a row with no real tokens, e.g. a finished request's place in a fixed batch
            rows.append((pad_slot, seqs["a"], 0, 0))
        out = cached_call(model, cache, rows)
        assert out.dtype == torch.float32 and out.shape == (len(rows), 50257)
        for i, (name, n) in enumerate(plan):
            assert_close(out[i], pair.reference(seqs[name])[done[name] + n - 1], **TOL)
            done[name] += n

    step([("a", 9), ("b", 3)])                         # prefill, lengths 9 and 3
    for _ in range(3):
        step([("a", 1), ("b", 1)], pad_row=True)       # decode
    step([("a", 1), ("c", 6), ("b", 1)])               # c joins: its prefill among the others' decode
    for _ in range(3):
        step([("a", 1), ("b", 1), ("c", 1)])
    step([("b", 4), ("a", 1), ("c", 1)])               # a chunked continuation of b's prompt

    unused = set(range(max_slots)) - set(slot_of.values())  # includes the padding row's slot
    for layer in range(model.config.n_layer):
        for slot in unused:
            assert not cache.k[layer][slot].any() and not cache.v[layer][slot].any()


def test_all_logits_and_padding_at_the_end_of_the_cache(pair):
    """all_logits gives every real position; a row that fills the cache to its last position,
    padded beyond it, neither fails nor spoils its cache entries."""
    model, n = pair.ours, pair.n_positions
    cache = KVCache(model.config, max_slots=3, max_len=n, device="cpu", dtype=torch.float32)
    x, y = random_seq(n, 7), random_seq(n, 8)

    out = cached_call(model, cache, [(2, x, 0, n - 2), (0, y, 0, 3)], all_logits=True)
    assert out.shape == (2, n - 2, 50257)
    assert_close(out[0], pair.reference(x)[:n - 2], **TOL)
    assert_close(out[1, :3], pair.reference(y)[:3], **TOL)

    # x's last two tokens, padded to T=5: padding would sit at positions n..n+2, outside the cache
    out = cached_call(model, cache, [(2, x, n - 2, 2), (0, y, 3, 5)], all_logits=True)
    assert_close(out[0, :2], pair.reference(x)[n - 2:], **TOL)
    assert_close(out[1], pair.reference(y)[3:8], **TOL)
    # x's cache is intact: replaying its last token gives the same logits
    assert_close(cached_call(model, cache, [(2, x, n - 1, 1)])[0], pair.reference(x)[n - 1], **TOL)

    with pytest.raises(ValueError, match="cache holds"):
        cached_call(model, cache, [(2, x + x, n - 1, 2)])


def test_context_limit_is_checked():
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    cache = KVCache(model.config, max_slots=1, max_len=16, device="cpu", dtype=torch.float32)
    seq = list(range(10))
    cached_ok = cached_call(model, cache, [(0, seq, 0, 8)])
    assert torch.isfinite(cached_ok).all()
    with pytest.raises(ValueError, match="context is 8"):
        cached_call(model, cache, [(0, seq, 8, 1)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close(pair, dtype):
    model = load_model(str(pair.directory), dtype=dtype)
    cache = KVCache(model.config, max_slots=2, max_len=pair.n_positions, device="cpu", dtype=dtype)
    seq = random_seq(12, 11)
    prefill = cached_call(model, cache, [(1, seq, 0, 8)])
    decode = cached_call(model, cache, [(1, seq, 8, 1)])
    assert prefill.dtype == decode.dtype == torch.float32
    ref = pair.reference(seq)
    # logits span about +-12 here; half precision keeps them within a few hundredths
    assert_close(prefill[0], ref[7], rtol=0.02, atol=0.2)
    assert_close(decode[0], ref[8], rtol=0.02, atol=0.2)
    assert prefill[0].argmax() == ref[7].argmax()


def test_training_pieces():
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.1, bias=False)
    model = GPT(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    idx = torch.randint(0, 40, (4, 16))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (4, 16, 40)
    assert abs(loss.item() - torch.log(torch.tensor(40.0)).item()) < 0.5  # small init: near uniform
    loss.backward()
    assert model.transformer.wte.weight.grad is not None

    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])

    model.crop_block_size(8)
    assert model.transformer.wpe.weight.shape == (8, 32) and model.config.block_size == 8
    logits, _ = model(idx[:, :8])
    assert logits.shape == (4, 1, 40)


def test_kv_cache_size():
    config = GPTConfig(n_layer=12, n_head=12, n_embd=768)
    cache = KVCache(config, max_slots=2, max_len=16, device="cpu", dtype=torch.bfloat16)
    assert cache.k[0].shape == (2, 12, 16, 64) and len(cache.k) == len(cache.v) == 12
    assert cache.nbytes() == 2 * 16 * KVCache.bytes_per_token(config, torch.bfloat16)
    assert KVCache.bytes_per_token(config, torch.float32) == 2 * 12 * 768 * 4
