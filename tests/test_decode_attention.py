"""The decode step's attention by the project's own kernels (the CPU's, nanogpt/kernels/csrc/decode_attention.cpp;
the GPU's, nanogpt/kernels/triton_decode.py, in Triton's interpreter) against the same attention spelled in
PyTorch's ops (nanogpt/runtime/kv_cache.py DecodeWindow without it)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from nanogpt.kernels import decode_attention, extension, triton_decode
from nanogpt.runtime.kv_cache import CacheWindow, DecodeWindow, KVCache

built = pytest.mark.skipif(not extension.available(), reason="the project's CPU kernels cannot be built here")

# 16-128 in steps of 16, GPT-J's 256 (in AVX2's 8-float vectors also 8-64 and 80)
HEAD_SIZES = (16, 32, 64, 80, 128, 256)


def _attend(how: str, q, k, v, cache, slots, positions, span, local):
    """One layer's decode attention on a copy of the cache, after writing k and v into it: through
    DecodeWindow with or without the kernel ("window+own", "window"), or by the kernel directly
    ("own"); returns the output and the cache written."""
    cache_k, cache_v = (c.clone() for c in cache)
    if how == "own":
        cache_k[slots, :, positions], cache_v[slots, :, positions] = k[:, :, 0], v[:, :, 0]
        out = decode_attention.attend(q[:, :, 0], cache_k, cache_v, slots, positions, span,
                                      1 / math.sqrt(q.shape[-1]), local)
        return out[:, :, None], (cache_k, cache_v)
    window = DecodeWindow(slots, positions, torch.arange(span), own_kernel=how == "window+own")
    return window.attend(q, k, v, cache_k, cache_v, local=local), (cache_k, cache_v)


def decode_rows(rows: int, max_slots: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A decode step's rows (slots, positions, span) in any slot order: the first at the span's
    last position, the second at its slot's first, the last two padding rows sharing the spare slot
    (max_slots - 1) at position 0."""
    slots = torch.randperm(max_slots - 1)[:rows]
    positions = torch.randint(0, max_len - 1, (rows,))
    positions[0] = max_len - 2  # the span's last position
    if rows > 1:
        positions[1] = 0
        slots[-2:], positions[-2:] = max_slots - 1, 0  # padding rows
    return slots, positions, int(positions.max()) + 1


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [3, 12])  # 3: no whole group of four heads; 12: groups of four
def test_the_kernel_attends_as_pytorchs_ops_do(dtype, heads):
    """Rows of different slots and positions (one at its slot's first position, one at the last
    the span holds), two padding rows sharing the spare slot at position 0, a local window, every
    head size served; 1 row and 24 (which takes the kernel's grouped heads). DecodeWindow hands the
    kernel batches of decode_attention.ROWS rows or more, and attends to fewer itself."""
    torch.manual_seed(0)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    max_slots, max_len = 30, 50
    for hs in HEAD_SIZES:
        assert decode_attention.serves("cpu", dtype, hs)
        cache = [torch.randn(max_slots, heads, max_len, hs).to(dtype) for _ in range(2)]
        for rows in (1, 24):
            slots, positions, span = decode_rows(rows, max_slots, max_len)
            q, k, v = (torch.randn(rows, heads, 1, hs).to(dtype) for _ in range(3))
            for local in (None, 5):
                want, written = _attend("window", q, k, v, cache, slots, positions, span, local)
                got, own_written = _attend("own", q, k, v, cache, slots, positions, span, local)
                assert got.dtype == dtype and got.shape == (rows, heads, 1, hs)
                assert_close(got.float(), want.float(), **tolerance)
                assert all(torch.equal(a, b) for a, b in zip(own_written, written))
                routed, _ = _attend("window+own", q, k, v, cache, slots, positions, span, local)
                assert torch.equal(routed, got if rows >= decode_attention.ROWS else want)


@built
def test_the_kernel_refuses_what_it_cannot_attend():
    q, cache = torch.randn(2, 2, 32), torch.randn(4, 2, 8, 32)
    slots, positions = torch.tensor([0, 1]), torch.tensor([3, 5])
    op = extension.extension().decode_attention
    assert op(q, cache, cache, slots, positions, 6, 0.5).shape == (2, 2, 32)
    for bad, match in (((q.bfloat16(), cache, cache, slots, positions, 6, 0.5), "dtype"),
                       ((q, cache, cache, torch.tensor([0, 4]), positions, 6, 0.5), "out of range"),
                       ((q, cache, cache, slots, torch.tensor([3, 8]), 6, 0.5), "out of range"),
                       ((q, cache, cache, slots, positions, 9, 0.5), "span"),
                       ((q, torch.randn(2, 4, 8, 32).transpose(0, 1), cache, slots, positions, 6, 0.5), "contiguous")):
        with pytest.raises(RuntimeError, match=match):
            op(*bad)
    # head sizes it is not built for, float16: the decode step spells attention out instead
    for device, dtype, head_size in (("cpu", torch.float32, 20), ("cpu", torch.float32, 1024),
                                     ("cpu", torch.float16, 64), ("cuda", torch.float16, 64)):
        assert not decode_attention.serves(device, dtype, head_size)
    # a GPU's kernel is Triton's, at any head size, where it works there (tests/test_cuda.py)
    assert decode_attention.serves("cuda", torch.bfloat16, 80) == (triton_decode.available() and torch.cuda.is_available())


@built
def test_a_cache_says_whether_its_decode_step_attends_by_the_kernel():
    from nanogpt.model import GPTConfig

    config = GPTConfig(block_size=16, vocab_size=10, n_layer=1, n_head=2, n_embd=64)
    assert KVCache(config, 2, 16).own_attention and KVCache(config, 2, 16, dtype=torch.bfloat16).own_attention
    assert not KVCache(config, 2, 16, dtype=torch.float16).own_attention
    assert not KVCache(GPTConfig(block_size=16, vocab_size=10, n_layer=1, n_head=2, n_embd=40), 2, 16).own_attention


@built
@pytest.mark.parametrize("local", [None, 3])
@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 0, 2]], ids=["in-place", "any-order"])
def test_an_eager_decode_batch_attends_by_the_kernel_as_sdpa_does(slots, local):
    """CacheWindow (the eager forwards: steps feeding prompt chunks, eager workers) sends a batch of
    one token a row to the kernel where the cache allows it; same cache writes, same output as SDPA."""
    torch.manual_seed(0)
    B, heads, hs, max_len = 3, 4, 64, 24
    slots, start_pos, lengths = torch.tensor(slots), torch.tensor([5, 11, 0]), torch.ones(3, dtype=torch.long)
    q, k, v = (torch.randn(B, heads, 1, hs) for _ in range(3))
    cache = [torch.randn(5, heads, max_len, hs) for _ in range(2)]
    outs = {}
    for own in (False, True):
        window = CacheWindow(slots, start_pos, lengths, 1, max_len, own_kernel=own)
        assert (window.decode_rows is not None) == own
        cache_k, cache_v = (c.clone() for c in cache)
        outs[own] = window.attend(q, k, v, cache_k, cache_v, local=local), cache_k, cache_v
    (want, want_k, want_v), (got, got_k, got_v) = outs[False], outs[True]
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a window with padding (a row of length 0) or more than one token a row keeps SDPA
    assert CacheWindow(slots, start_pos, torch.tensor([1, 0, 1]), 1, max_len, own_kernel=True).decode_rows is None
    assert CacheWindow(slots, start_pos, lengths * 2, 2, max_len, own_kernel=True).decode_rows is None


# tests/triton_interpreted.py's checks in two processes at once, of about the same time each: GPT-J's
# decode steps (512-wide matmuls that normalize as they read) with the kernel's cases, and the rest
INTERPRETED = (["kernel", "decode-step 2"],
               ["chunk-row", "self-check", "add-norm", "few-row matmul", "norm-fed matmul",
                *(f"decode-step {i}" for i in (0, 1, 3, 4, 5))])


@pytest.mark.skipif(not triton_decode.available(), reason="Triton is not installed (the dev extras install it)")
def test_the_gpu_kernel_attends_as_pytorchs_ops_and_transformers_do():
    """tests/triton_interpreted.py in Triton's interpreter, in processes of their own (Triton reads
    TRITON_INTERPRET once, at import): the kernel against PyTorch's ops (outputs and the cache it
    writes; prompt chunks as rows), the self-check an engine runs before taking it, the fused add and layer norm and the
    few-row matmul, and every family's decode steps through all three against transformers."""
    script = Path(__file__).with_name("triton_interpreted.py")
    root = Path(__file__).parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, str(script), *names], cwd=root, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for names in INTERPRETED]
    try:
        outputs = [run.communicate(timeout=600) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, out[-2000:] + err[-4000:]
    printed = "".join(out for out, _ in outputs)
    # the parts together run every check the script has, each once
    assert {name for names in INTERPRETED for name in names} == set(re.search(r"^checks: (.+)$", printed, re.M)[1].split("; "))
    assert sum(map(len, INTERPRETED)) == len({name for names in INTERPRETED for name in names})
    checked = {name: int(n) for name, n in re.findall(r"^checked (.+): (\d+)$", printed, re.M)}
    assert {name: n for name, n in checked.items() if "matmul" not in name} == {
        "kernel": 48, "chunk-row": 16, "self-check": 6, "add-norm": 35, **{f"decode-step {i}": 20 for i in range(6)}}
    # as many as the kernels have block configurations
    assert checked["few-row matmul"] > 0 and checked["norm-fed matmul"] > 0, checked


@pytest.mark.skipif(not triton_decode.available(), reason="Triton is not installed (the dev extras install it)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_gpu_kernels_compile_for_a_hopper_gpu(dtype):
    """Every Triton kernel of the project compiled, without a GPU, to a cubin for an H100 / H200
    (sm_90) by Triton's own compiler and ptxas: the interpreter runs code the compiler would refuse
    (a branch whose tensors differ in type, an op Triton lacks on a GPU), which only a GPU session
    would otherwise see. One block configuration each, the widest the few-row kernels take."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanogpt.kernels import triton_gemv, triton_norm

    widest = max(triton_gemv.CONFIGS, key=lambda c: c.block_n * c.block_k)
    flags = dict(HAS_BIAS=True, HAS_Y=True, HAS_BETA=True, ACTIVATION=triton_gemv.ACTIVATIONS["gelu"],
                 BLOCK_M=2, BLOCK_N=widest.block_n, BLOCK_K=widest.block_k, BLOCK=1024)
    kernels = [(triton_decode._decode_attention, dict(BLOCK_N=triton_decode.BLOCK_KEYS, BLOCK_D=64)),
               (triton_gemv._one_row, {}), (triton_gemv._few_rows, {}), (triton_gemv._norm_rows, {}),
               (triton_norm._add_layer_norm, {})]
    for kernel, blocks in kernels:
        parameters = inspect.signature(kernel.fn).parameters
        names = list(parameters)
        constexprs = {name: blocks.get(name, flags.get(name)) for name, p in parameters.items()
                      if "constexpr" in str(p.annotation)}
        signature = {name: "constexpr" if name in constexprs else "*i64" if name in ("slots", "positions") else
                     "fp32" if name in ("scale", "eps") else f"*{dtype}" if name in POINTERS else "i32"
                     for name in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constexprs.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.fn.__name__


# the kernels' tensor parameters (the rest are sizes, strides and flags)
POINTERS = {"q", "k_new", "v_new", "cache_k", "cache_v", "out", "x", "w", "bias", "y", "gamma", "beta", "total",
            "weight", "normed"}
