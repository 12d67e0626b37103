"""Prepacked CPU matmul weights (nanogpt/packed.py) and the compile-friendly decode step
(GPT.forward_decode) against the plain model."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from conftest import make_hf_checkpoint
from nanogpt import packed
from nanogpt.checkpoint import load_model
from nanogpt.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not packed.available(), reason="MKL's packed GEMM is not in this torch build")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("packed"), n_layer=2, n_embd=64, n_head=2, with_tokenizer=False)


def test_packed_layers_compute_what_linear_computes(checkpoint):
    plain, model = load_model(str(checkpoint)), load_model(str(checkpoint))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert packed.pack_linears(model) == 2 * 4 + 1  # 4 Linears a block, and the LM head
    assert type(model.lm_head) is packed.PackedLinear
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.state_dict().keys() == state.keys()
    layer, reference = model.transformer.h[0].mlp.c_fc, plain.transformer.h[0].mlp.c_fc
    with torch.no_grad():
        for rows in (1, 2, 5, 64, 256, 300):  # one row, the packed range, past it
            x = torch.randn(rows, 1, 64)
            assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_not_served_from_a_stale_pack(checkpoint):
    model = load_model(str(checkpoint))
    packed.pack_linears(model)
    layer = model.transformer.h[0].attn.c_proj
    x = torch.randn(8, 64)
    with torch.no_grad():
        layer.weight.mul_(2)
        assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        packed.pack_linears(model)  # repacks what changed
        assert layer._packed_version == layer.weight._version
        assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_decode_step_matches_the_serving_forward(checkpoint):
    """forward_decode (what the engine compiles) against forward_cached, uncompiled: rows in
    scattered slots at different positions, and padding rows sharing a spare slot."""
    model = load_model(str(checkpoint))
    cache = KVCache(model.config, max_slots=6, max_len=32)
    twin = KVCache(model.config, max_slots=6, max_len=32)
    prompts = {4: torch.randint(0, 50257, (7,)), 1: torch.randint(0, 50257, (3,)), 2: torch.randint(0, 50257, (5,))}
    slots = torch.tensor(list(prompts))
    for c in (cache, twin):
        for slot, prompt in prompts.items():
            model.forward_cached(prompt[None], torch.tensor([len(prompt)]), torch.tensor([slot]), torch.tensor([0]), c)
    positions = torch.tensor([len(p) for p in prompts.values()])
    tokens = torch.randint(0, 50257, (3,))
    for step in range(3):
        want = model.forward_cached(tokens[:, None], torch.ones(3, dtype=torch.long), slots, positions + step, cache)
        spare = torch.tensor([5, 5])  # two padding rows, as a batch bucket adds them
        got = model.forward_decode(torch.cat([tokens, torch.zeros(2, dtype=torch.long)]), torch.cat([slots, spare]),
                                   torch.cat([positions + step, torch.zeros(2, dtype=torch.long)]), twin,
                                   torch.arange(int(positions.max()) + step + 1))
        assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
        tokens = want.argmax(-1)
    for layer in range(model.config.n_layer):
        for slot in prompts:
            assert_close(twin.k[layer][slot], cache.k[layer][slot], rtol=1e-5, atol=1e-6)
