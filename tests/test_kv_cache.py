"""How a ragged batch's new keys/values land in the slot cache (nanogpt/runtime/kv_cache.py CacheWindow): long
prompt rows as slices, short rows and decodes by index_put, padding nowhere, in the cache's dtype."""
from __future__ import annotations

import pytest
import torch

from nanogpt.runtime import kv_cache
from nanogpt.runtime.kv_cache import CacheWindow

HEADS, WIDTH, MAX_LEN = 3, 4, 40


def written_token_by_token(cache, slots, start_pos, lengths, new):
    want = cache.clone()
    for b, (slot, start, n) in enumerate(zip(slots.tolist(), start_pos.tolist(), lengths.tolist())):
        for t in range(n):
            want[slot, :, start + t] = new[b, :, t].to(cache.dtype)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[12, 3, 1, 9], [8, 8, 8, 8], [2, 5, 1, 7]], ids=["mixed", "all-runs", "no-runs"])
def test_a_prompt_chunk_writes_each_real_token_once_where_it_belongs(dtype, lengths):
    torch.manual_seed(0)
    slots, start_pos, lengths = torch.tensor([0, 2, 3, 5]), torch.tensor([0, 7, 20, 4]), torch.tensor(lengths)
    T = int(lengths.max())
    new = torch.randn(4, HEADS, T, WIDTH)
    cache = torch.randn(6, HEADS, MAX_LEN, WIDTH).to(dtype)  # anything already cached stays
    window = CacheWindow(slots, start_pos, lengths, T, MAX_LEN)
    assert [run[0] for run in window.runs] == [b for b, n in enumerate(lengths.tolist()) if n >= kv_cache.RUN_TOKENS]
    want = written_token_by_token(cache, slots, start_pos, lengths, new)
    seen = window.update(cache, new)
    assert torch.equal(cache, want)  # padding (past each row's length) wrote nothing
    assert torch.equal(seen, cache[slots.min():slots.max() + 1, :, :window.span])


def test_decodes_write_by_index_put():
    slots, start_pos, lengths = torch.tensor([1, 4]), torch.tensor([3, 10]), torch.tensor([1, 1])
    new = torch.randn(2, HEADS, 1, WIDTH)
    cache = torch.zeros(6, HEADS, MAX_LEN, WIDTH)
    window = CacheWindow(slots, start_pos, lengths, 1, MAX_LEN)
    assert window.runs == [] and window.scattered is None
    window.update(cache, new)
    assert torch.equal(cache, written_token_by_token(torch.zeros_like(cache), slots, start_pos, lengths, new))


def test_an_engine_without_max_batch_takes_the_cpu_default_of_slots(hf_checkpoint):
    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from worker.engine import Engine

    engine = Engine(load_model(str(hf_checkpoint)), load_tokenizer(hf_checkpoint), max_batch=None)
    assert engine.runner.slots == kv_cache.CPU_SLOTS
    assert engine.runner.cache.max_slots >= kv_cache.CPU_SLOTS
