"""The GPU's Triton kernels, the decode attention (nanogpt/kernels/triton_decode.py), the fused add
and layer norm (triton_norm.py) and the few-row matmul (triton_gemv.py), checked on a CPU, in
Triton's interpreter: run by tests/test_decode_attention.py in two processes of their own with
TRITON_INTERPRET=1, which Triton reads once, at import. Its arguments name the checks to run (`CHECKS`;
none: all of them); exits non-zero on the first mismatch; prints the cases each checked.

1. The kernel against the same attention spelled in PyTorch's ops (DecodeWindow without a kernel),
   outputs and the cache written: float32 and bfloat16, rows in any slot order, padding rows sharing
   the spare slot, a row at its slot's first position and one at the span's last, local windows of
   1 and 5, head sizes of GPT-2, Pythia and GPT-J (64, 80, 256), 1 row and 24; and prompt chunks
   fed as rows beside decoding rows, the grid's programs run in order and in reverse.
2. The self-check an engine runs before it takes the kernel (`kv_cache.gpu_kernel_works`).
3. The fused add and layer norm against PyTorch's add and F.layer_norm: float32 and bfloat16, widths
   of a power of two and not (64, 100, 768, 1600), with a bias and without, 1 row and 5; and its
   self-check (`norms.add_norm_works`).
4. The few-row matmul against F.linear and the activations: float32 and bfloat16, 1 to 8 rows (3:
   a block of 4 with a masked row), sizes of a block and not, every block configuration a row count
   may take, with a bias and without, no activation, the tanh and the erf GELU and ReLU; and a
   swapped layer (few_rows.py) taking the kernel at its row blocks, cuBLAS's op past them, and its
   parent's `fused` elsewhere.
5. The norm-fed matmul (triton_gemv.norm_linear) against PyTorch's add, F.layer_norm and F.linear:
   float32 and bfloat16, widths of a block and not, 1, 3 and 8 rows, with the sum to write and
   without, with and without the norm's bias, the tanh and the erf GELU; a swapped layer's
   `norm_fused` at the row blocks chosen and declining elsewhere; and its choice by timing
   (few_rows.fastest_norm).
6. The prefill and decode steps of every family (GPT-2, GPT-Neo's local layers, GPT-J's rotary
   256-wide heads, GPT-NeoX's parallel residual and its sequential one, OPT) through all three
   kernels against transformers' logits, as tests/test_families.py checks PyTorch's ops, with a
   prompt fed in chunks as rows beside the decoding ones.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from torch.testing import assert_close  # noqa: E402

from nanogpt.kernels import decode_attention, few_rows, norms, triton_decode, triton_gemv, triton_norm  # noqa: E402
from nanogpt.layers import norm_project  # noqa: E402
from test_decode_attention import decode_rows  # noqa: E402
from nanogpt.runtime.kv_cache import DecodeWindow, KVCache  # noqa: E402


def kernel(q, k, v, cache_k, cache_v, slots, positions, span, scale, local):
    return triton_decode.write_and_attend(q, k, v, cache_k, cache_v, slots, positions, span, scale, local or 0)


def check_kernel() -> int:
    torch.manual_seed(0)
    checked = 0
    max_slots, max_len = 30, 50
    for dtype in (torch.float32, torch.bfloat16):
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for heads, hs in ((3, 64), (12, 64), (2, 80), (2, 256)):
            cache = [torch.randn(max_slots, heads, max_len, hs).to(dtype) for _ in range(2)]
            for rows in (1, 24):
                slots, positions, span = decode_rows(rows, max_slots, max_len)
                # the model's dtype may differ from the cache's (a float32 model, a bfloat16 cache)
                q, k, v = (torch.randn(rows, heads, 1, hs) for _ in range(3))
                k[-2:], v[-2:] = k[-1], v[-1]  # padding rows write token 0's key and value: all the same
                for local in (None, 1, 5):
                    want_k, want_v = (c.clone() for c in cache)
                    window = DecodeWindow(slots, positions, torch.arange(span))
                    want = window.attend(q.to(dtype), k, v, want_k, want_v, local=local)
                    got_k, got_v = (c.clone() for c in cache)
                    got = kernel(q[:, :, 0].to(dtype), k[:, :, 0], v[:, :, 0], got_k, got_v, slots, positions, span,
                                 1 / math.sqrt(hs), local)
                    assert got.dtype == dtype and got.shape == (rows, heads, hs), (got.dtype, got.shape)
                    assert_close(got.float(), want[:, :, 0].float(), **tolerance)
                    # the same cache written
                    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (dtype, heads, hs, rows, local)
                    checked += 1
    return checked


def check_chunk_rows() -> int:
    """Prompt chunks fed as rows beside decoding rows (worker/decode_routes.py, a graphed step with
    prompts riding along): each chunk's tokens at consecutive positions of one slot in consecutive
    rows, every row seeing the chunk's rows before it, as PyTorch's ops, which write every row's key
    and value before any row attends, do. Chunks from a slot's first position and from later ones,
    one of a single token, one longer than a block of keys, after the decoding rows and between
    them; then padding rows. The interpreter runs a grid's programs one by one, rows in order; the
    GPU's run at once: here also in the reverse order, so that a row that read its chunk's keys from
    the cache before their rows' programs wrote them would be seen."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    in_order = builder.set_grid_idx

    def reversed_rows(x, y, z):
        in_order(builder.grid_dim[0] - 1 - x, y, z)

    torch.manual_seed(0)
    checked = 0
    max_slots, max_len = 9, 160
    # (slot, first position, tokens): decoding rows are chunks of one token
    layouts = [[(3, 40, 1), (5, 0, 7), (1, 12, 66), (8, 0, 1), (8, 0, 1)],
               [(2, 9, 3), (4, 100, 1), (6, 0, 1), (0, 5, 20), (8, 0, 1)]]
    for dtype, heads, hs in ((torch.float32, 3, 64), (torch.bfloat16, 2, 80)):
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        cache = [torch.randn(max_slots, heads, max_len, hs).to(dtype) for _ in range(2)]
        for layout in layouts:
            slots = torch.tensor([slot for slot, _, n in layout for _ in range(n)])
            positions = torch.tensor([p for _, first, n in layout for p in range(first, first + n)])
            rows, span = len(slots), int(positions.max()) + 1
            q, k, v = (torch.randn(rows, heads, 1, hs) for _ in range(3))
            k[slots == 8], v[slots == 8] = k[-1].clone(), v[-1].clone()  # padding rows: token 0's key and value
            for local in (None, 5):
                want_k, want_v = (c.clone() for c in cache)
                want = DecodeWindow(slots, positions, torch.arange(span)).attend(q.to(dtype), k, v, want_k, want_v,
                                                                                 local=local)
                for order in (in_order, reversed_rows):
                    builder.set_grid_idx = order
                    got_k, got_v = (c.clone() for c in cache)
                    try:
                        got = kernel(q[:, :, 0].to(dtype), k[:, :, 0], v[:, :, 0], got_k, got_v, slots, positions,
                                     span, 1 / math.sqrt(hs), local)
                    finally:
                        builder.set_grid_idx = in_order
                    assert_close(got.float(), want[:, :, 0].float(), **tolerance)
                    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (dtype, heads, hs, local)
                    checked += 1
    return checked


def check_self_check() -> int:
    """What an engine tries before it takes the kernel (kv_cache.gpu_kernel_works): true where it
    attends right, false (and said) where it raises or disagrees."""
    from nanogpt.runtime import kv_cache

    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for hs in (64, 80):
            assert kv_cache.gpu_kernel_works(torch.device("cpu"), dtype, hs)
            checked += 1
    right = triton_decode.write_and_attend
    for broken in (lambda *args: right(*args) + 1, lambda *args: 1 / 0):
        triton_decode.write_and_attend = broken
        kv_cache.gpu_kernel_works.cache_clear()
        assert not kv_cache.gpu_kernel_works(torch.device("cpu"), torch.float32, 64)
        checked += 1
    triton_decode.write_and_attend = right
    kv_cache.gpu_kernel_works.cache_clear()
    return checked


def check_add_norm() -> int:
    from torch.nn import functional as F

    torch.manual_seed(0)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for width in (64, 100, 768, 1600):
            for rows in (1, 5):
                x, y = (torch.randn(rows, 1, width).to(dtype) for _ in range(2))
                weight, bias = (torch.randn(width).to(dtype) for _ in range(2))
                for b in (bias, None):
                    total, normed = triton_norm.add_layer_norm(x, y, weight, b, 1e-5)
                    assert total.shape == normed.shape == x.shape and normed.dtype == dtype
                    # float32 exact; bfloat16 within a rounding: the interpreter truncates where a GPU rounds to nearest
                    assert_close(total.float(), (x + y).float(), **(dict(rtol=0, atol=0) if dtype == torch.float32
                                                                     else dict(rtol=1e-2, atol=1e-2)))
                    assert_close(normed.float(), F.layer_norm(x + y, (width,), weight, b, 1e-5).float(), **tolerance)
                    checked += 1
    for dtype in (torch.float32, torch.bfloat16):
        assert norms.add_norm_works(torch.device("cpu"), dtype, 768)
        checked += 1
    right = triton_norm.add_layer_norm
    triton_norm.add_layer_norm = lambda *args: (args[0] + args[1], args[0])  # a wrong norm: refused
    norms.add_norm_works.cache_clear()
    assert not norms.add_norm_works(torch.device("cpu"), torch.float32, 768)
    triton_norm.add_layer_norm = right
    norms.add_norm_works.cache_clear()
    return checked + 1


def check_few_rows() -> int:
    from torch.nn import functional as F

    torch.manual_seed(0)
    checked = 0
    want_of = {None: lambda y: y, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "gelu": F.gelu,
               "relu": F.relu}
    for dtype in (torch.float32, torch.bfloat16):
        # bfloat16 within a rounding of the float32 result: the interpreter truncates where a GPU rounds to nearest
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for out_features, in_features in ((96, 64), (100, 600)):
            weight, bias = torch.randn(out_features, in_features).to(dtype), torch.randn(out_features).to(dtype)
            for rows in (1, 3, 8):
                x = torch.randn(rows, in_features).to(dtype)
                for config in triton_gemv.configs(rows):
                    for b in (bias, None):
                        for activation, want_fn in want_of.items():
                            got = triton_gemv.linear(x, weight, b, activation, config)
                            want = want_fn(F.linear(x.float(), weight.float(), None if b is None else b.float()))
                            assert got.dtype == dtype and got.shape == (rows, out_features)
                            assert_close(got.float(), want.to(dtype).float(), **tolerance)
                            checked += 1
    # a swapped layer: the kernel at the row blocks it won, F.linear past them and at the others
    layer = torch.nn.Linear(64, 96)
    layer.__class__ = few_rows._few_rows(torch.nn.Linear)
    layer.kernel_rows = {1: triton_gemv.CONFIGS[0], 4: triton_gemv.CONFIGS[1]}
    calls, linear = [], triton_gemv.linear
    triton_gemv.linear = lambda x, *args: calls.append(x.shape[0]) or linear(x, *args)
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 9):
            x = torch.randn(rows, 1, 64)
            assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            gelu, fused = torch.nn.GELU(approximate="tanh"), layer.fused(x, torch.nn.GELU(approximate="tanh"))
            if rows in (2, 9):  # nn.Linear, the layer's own class, fuses nothing: `project` applies the GELU
                assert fused is None
            else:
                assert_close(fused, gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
            erf = layer.fused(x, torch.nn.GELU())  # the erf GELU: the kernel's at its rows, nothing of nn.Linear's
            if rows in (2, 9):
                assert erf is None
            else:
                assert_close(erf, F.gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
            checked += 1
    triton_gemv.linear = linear
    assert calls == [1, 1, 1, 3, 3, 3, 4, 4, 4], calls
    assert few_rows.describe(torch.nn.Sequential(layer, torch.nn.Linear(2, 2))) == "96x64 few-row kernel at 1,4 rows"
    return checked + check_choice()


def kernel_timer(name: str, layers: int):
    """A timer for few_rows' choices: a run through triton_gemv's `name` kernel takes kernel_ms(its
    blocks), any other 1.0; each timed run goes through every one of the shape's `layers` or none."""
    def timer(kernel_ms):
        def time_run(run):
            used, kernel = [], getattr(triton_gemv, name)
            setattr(triton_gemv, name, lambda *args: used.append(args[-1]) or kernel(*args))
            try:
                run()
            finally:
                setattr(triton_gemv, name, kernel)
            assert len(used) in (0, layers)
            return 1.0 if not used else kernel_ms(used[0])
        return time_run
    return timer


def check_choice() -> int:
    """few_rows.fastest, with a timer that says how long each run takes: the kernel's fastest blocks
    where they beat cuBLAS, none where cuBLAS is faster, none where the kernel gives wrong outputs."""
    layers = [torch.nn.Linear(64, 96) for _ in range(3)]
    quick = triton_gemv.configs(2)[2]
    timer = kernel_timer("linear", len(layers))

    with torch.no_grad():
        assert few_rows.fastest(layers, 2, timer(lambda c: 0.5 if c == quick else 0.8)) == quick
        assert few_rows.fastest(layers, 2, timer(lambda c: 1.5)) is None
        right = triton_gemv.linear
        triton_gemv.linear = lambda *args: right(*args) * 2  # a kernel that computes something else
        try:
            assert few_rows.fastest(layers, 2, timer(lambda c: 0.1)) is None
        finally:
            triton_gemv.linear = right
    return 3


def check_norm_linear() -> int:
    from torch.nn import functional as F

    torch.manual_seed(0)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        # bfloat16 within a rounding: the interpreter truncates where a GPU rounds to nearest
        tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2.0)
        for out_features, width in ((96, 64), (40, 600)):
            weight, bias = torch.randn(out_features, width).to(dtype), torch.randn(out_features).to(dtype)
            gamma, beta = torch.randn(width).to(dtype), torch.randn(width).to(dtype)
            for rows in (1, 3, 8):
                x, y = (torch.randn(rows, width) * 4 + 3).to(dtype), torch.randn(rows, width).to(dtype)
                for config in triton_gemv.configs(rows)[:2]:
                    for pending, norm_bias, approximate in ((y, beta, "tanh"), (None, beta, "none"),
                                                            (y, None, "none"), (None, None, "tanh")):
                        total, out = triton_gemv.norm_linear(x, pending, gamma, norm_bias, 1e-5, weight, bias,
                                                             "gelu_tanh" if approximate == "tanh" else "gelu",
                                                             config)
                        stream = x if pending is None else x + pending
                        h = F.layer_norm(stream.float(), (width,), gamma.float(),
                                         None if norm_bias is None else norm_bias.float(), 1e-5).to(dtype)
                        want = F.gelu(F.linear(h.float(), weight.float(), bias.float()), approximate=approximate)
                        assert total.dtype == out.dtype == dtype and out.shape == (rows, out_features)
                        assert_close(total.float(), stream.float(), **(tolerance if dtype == torch.float32
                                                                       else dict(rtol=1e-2, atol=1e-2)))
                        # bfloat16: the norm's output rounded (truncated here) before the matmul sums it,
                        # so an output's error follows the row's largest, not its own size
                        scale = 1.0 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
                        assert_close(out.float(), want.to(dtype).float(), rtol=tolerance["rtol"],
                                     atol=tolerance["atol"] * scale)
                        checked += 1
    # a swapped layer: the kernel at the row blocks chosen for it, None (the norm and the layer as
    # they are) elsewhere and for a norm it cannot read
    layer, norm = torch.nn.Linear(64, 96), torch.nn.LayerNorm(64)
    layer.__class__ = few_rows._few_rows(torch.nn.Linear)
    layer.norm_rows = {1: triton_gemv.CONFIGS[0], 4: triton_gemv.CONFIGS[1]}
    with torch.no_grad():
        for rows in (1, 3, 8):
            x, y = torch.randn(rows, 1, 64), torch.randn(rows, 1, 64)
            got = layer.norm_fused(x, y, norm, torch.nn.GELU(approximate="tanh"))
            assert (got is None) == (rows == 8), rows
            total, out = norm_project(x, y, norm, layer, torch.nn.GELU(approximate="tanh"))
            assert_close(total, x + y)
            assert_close(out, F.gelu(layer(norm(x + y)), approximate="tanh"), rtol=1e-5, atol=1e-5)
            assert layer.norm_fused(x, y, torch.nn.LayerNorm(64, elementwise_affine=False)) is None
            erf = layer.norm_fused(x, y, norm, torch.nn.GELU())  # the erf GELU, GPT-NeoX's
            if rows == 8:
                assert erf is None
            else:
                assert_close(erf[1], F.gelu(layer(norm(x + y))), rtol=1e-5, atol=1e-5)
            assert layer.norm_fused(x, y, norm, torch.nn.SiLU()) is None  # an activation with no epilogue
            checked += 1
    return checked + check_norm_choice()


def check_norm_choice() -> int:
    """few_rows.fastest_norm, with a timer that says how long each run takes: the fastest blocks where
    they beat the norm and the layer as they are, none where those are faster or the kernel is wrong."""
    fed = [(torch.nn.LayerNorm(64), torch.nn.Linear(64, 96), None) for _ in range(3)]
    quick = triton_gemv.configs(2)[1]
    timer = kernel_timer("norm_linear", len(fed))

    candidates = few_rows._norm_candidates(fed[0][1], 2)  # a layer without its own kernel: two blocks
    assert quick in candidates and len(candidates) == 2
    with torch.no_grad():
        assert few_rows.fastest_norm(fed, 2, timer(lambda c: 0.5 if c == quick else 0.8), candidates, norm_project) == quick
        assert few_rows.fastest_norm(fed, 2, timer(lambda c: 1.5), candidates, norm_project) is None
        right = triton_gemv.norm_linear
        triton_gemv.norm_linear = lambda *args: (lambda t, o: (t, o * 2))(*right(*args))  # a wrong output
        try:
            assert few_rows.fastest_norm(fed, 2, timer(lambda c: 0.1), candidates, norm_project) is None
        finally:
            triton_gemv.norm_linear = right
    # a layer whose own kernel won at these rows: its blocks alone
    layer = fed[0][1]
    layer.__class__ = few_rows._few_rows(torch.nn.Linear)
    layer.kernel_rows = {2: triton_gemv.CONFIGS[3]}
    assert few_rows._norm_candidates(layer, 2) == [triton_gemv.CONFIGS[3]]
    return 4


# the families whose decode steps check_decode_steps runs (GPT-J with 256-wide heads, as GPT-J-6B's)
STEP_FAMILIES = (("gpt2", {}), ("gpt_neo", {}), ("gptj", dict(n_embd=512, n_head=2, rotary_dim=64)),
                 ("gpt_neox", {}), ("gpt_neox", dict(use_parallel_residual=False)), ("opt", {}))


def check_decode_steps(families=range(len(STEP_FAMILIES))) -> int:
    import transformers

    from conftest import make_family_checkpoint, make_hf_checkpoint
    from nanogpt.checkpoint import load_model

    # kv_cache.py reaches the op through these names; on a CPU they would take the C++ kernel
    attend, pays = decode_attention.write_and_attend, decode_attention.pays
    decode_attention.write_and_attend = kernel
    decode_attention.pays = lambda rows, device: True
    checked = 0
    for family, overrides in [STEP_FAMILIES[i] for i in families]:
        with tempfile.TemporaryDirectory() as directory:
            if family == "gpt2":
                make_hf_checkpoint(Path(directory), with_tokenizer=False)
            else:
                make_family_checkpoint(Path(directory), family, with_tokenizer=False, **overrides)
            ours = load_model(directory)
            hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        # fuse_layer_norms swaps only a GPU's norms: these are swapped as it would
        fused = [m for m in ours.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is not None]
        for module in fused:
            module.__class__ = norms._fused(type(module))
        assert fused, family
        # and fuse_few_rows swaps a GPU's linear layers where it times the kernel faster: those of the
        # blocks here (the 50257-row head's thousands of programs would take minutes in the interpreter)
        linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear) and m is not ours.output_layer]
        for module in linears:
            module.__class__ = few_rows._few_rows(type(module))
            module.kernel_rows = {rows: max(triton_gemv.configs(rows), key=lambda c: c.block_n)
                                  for rows in few_rows.ROW_COUNTS}
        # and fuse_norm_linears gives the norm-fed ones the kernel that normalizes as it reads
        fed = [layer for block in ours.modules() for _, layer, _ in getattr(block, "norm_fed", lambda: ())()
               if layer is not ours.output_layer]
        for layer in fed:
            layer.norm_rows = layer.kernel_rows
        assert fed or family == "opt", family  # this OPT normalizes after its sub-layers
        normed, norm_linear = [0], triton_gemv.norm_linear
        triton_gemv.norm_linear = lambda *args: normed.__setitem__(0, normed[0] + 1) or norm_linear(*args)
        calls, add_layer_norm = [0], triton_norm.add_layer_norm
        triton_norm.add_layer_norm = lambda *args: calls.__setitem__(0, calls[0] + 1) or add_layer_norm(*args)
        matmuls, linear = [0], triton_gemv.linear
        triton_gemv.linear = lambda *args: matmuls.__setitem__(0, matmuls[0] + 1) or linear(*args)
        cache = KVCache(ours.config, max_slots=4, max_len=64)
        cache.own_attention = True
        torch.manual_seed(1)
        seqs = [torch.randint(0, ours.config.vocab_size, (24,)).tolist() for _ in range(4)]
        with torch.no_grad():
            refs = [hf(torch.tensor([seq])).logits[0] for seq in seqs]
        slots, prefilled = [3, 0, 2], [9, 4, 12]  # past GPT-Neo's local window (5 positions here)
        for slot, seq, n in zip(slots, seqs, prefilled):
            ours.forward_cached(torch.tensor([seq[:n]]), torch.tensor([n]), torch.tensor([slot]),
                                torch.tensor([0]), cache)
        # beside the decoding rows, the last sequence's prompt fed in chunks of 2 tokens as rows of
        # its slot (1), as a GPU's graphs feed prompts (worker/decode_routes.py)
        for step in range(4):
            positions = [n + step for n in prefilled]
            chunk = list(range(2 * step, 2 * step + 2))
            logits = ours.forward_decode(torch.tensor([seq[p] for seq, p in zip(seqs, positions)]
                                                      + [seqs[3][p] for p in chunk]),
                                         torch.tensor(slots + [1] * len(chunk)), torch.tensor(positions + chunk),
                                         cache, torch.arange(max(positions) + 1))
            for b, (ref, p) in enumerate(zip(refs[:3] + [refs[3]] * len(chunk), positions + chunk)):
                assert_close(logits[b], ref[p], rtol=1e-5, atol=1e-5)
                checked += 1
        triton_norm.add_layer_norm = add_layer_norm
        triton_gemv.linear, triton_gemv.norm_linear = linear, norm_linear
        assert calls[0] > 0, family  # the norms added in their own pass (the last one, and prefill's)
        # every layer through a kernel at each decode step, the norm-fed ones through the norm's
        assert matmuls[0] >= 4 * (len(linears) - len(fed)) and normed[0] >= 4 * len(fed), family
    decode_attention.write_and_attend, decode_attention.pays = attend, pays  # a later check's reference is PyTorch's
    return checked


# what a run checks, by name; tests/test_decode_attention.py runs them in two parts at once
CHECKS = {"kernel": check_kernel, "chunk-row": check_chunk_rows, "self-check": check_self_check,
          "add-norm": check_add_norm, "few-row matmul": check_few_rows, "norm-fed matmul": check_norm_linear,
          **{f"decode-step {i}": (lambda i=i: check_decode_steps([i])) for i in range(len(STEP_FAMILIES))}}


if __name__ == "__main__":
    print(f"checks: {'; '.join(CHECKS)}", flush=True)  # every one, for a caller that runs them in parts
    for name in sys.argv[1:] or CHECKS:  # each line: the check's name, then the cases it checked
        print(f"checked {name}: {CHECKS[name]()}", flush=True)
