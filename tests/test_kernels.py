"""CPU matmul kernels chosen per machine (nanogpt/kernels/) and the compile-friendly decode step
(GPT.forward_decode) against the plain model."""
from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_hf_checkpoint
from nanogpt.checkpoint import load_model
from nanogpt.kernels import gemv, machine, matmuls, planner
from nanogpt.kernels.linear import KernelLinear
from nanogpt.kernels.ops import publish
from nanogpt.layers import project
from nanogpt.runtime.kv_cache import KVCache

FLOAT_KERNELS = matmuls.available(torch.float32)
BF16_KERNELS = matmuls.available(torch.bfloat16)
INT8_KERNELS = matmuls.available(torch.qint8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("kernels"), n_layer=2, n_embd=64, n_head=2, with_tokenizer=False)


def test_this_torch_build_offers_the_packed_kernels():
    # the CPU wheels this project installs ship both MKL and oneDNN: a build without them would
    # silently lose the fast paths, so say so here rather than skip their tests
    assert {"linear", "mkl", "onednn"} <= set(FLOAT_KERNELS)
    assert "mkl" not in BF16_KERNELS  # MKL's packed GEMM is float32 only
    assert INT8_KERNELS[:2] == ["int8-dynamic", "int8-onednn"]


def test_the_own_kernel_is_built_wherever_a_compiler_and_its_vector_width_are():
    # every machine this project runs its tests on has g++ and AVX2 at least: a failed build
    # would silently leave the one-row matmul to PyTorch's slower kernels
    import shutil

    from nanogpt.kernels import extension

    expected = torch.backends.cpu.get_cpu_capability() in extension.FLAGS and shutil.which("c++") is not None
    assert expected == ("gemv" in FLOAT_KERNELS) == ("gemv" in BF16_KERNELS) \
        == ("int8-gemv" in INT8_KERNELS)
    if expected:  # built with the CPU's bfloat16 dot products where it has them, and only there
        with_bf16 = torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_bf16" in machine.cpu_flags()
        assert ("_avx512_bf16_" in Path(extension.extension().__file__).parent.name) == with_bf16


def test_without_a_compiler_or_a_place_to_build_the_gemv_is_not_offered(monkeypatch, tmp_path, caplog):
    from nanogpt.kernels import extension

    def offered():
        return {name for dtype in (torch.float32, torch.bfloat16, torch.qint8) for name in matmuls.available(dtype)}

    (tmp_path / "a-file").write_text("")
    cases = [("CXX", str(tmp_path / "no-such-compiler"), "no C++ compiler"),
             (extension.ENV, str(tmp_path / "a-file" / "extensions"), "their build failed")]
    try:
        for variable, value, said in cases:
            with monkeypatch.context() as patch:
                patch.setenv(variable, value)
                extension.extension.cache_clear()
                assert not gemv.available() and "gemv" not in matmuls.available(torch.float32)
                assert any(said in record.getMessage() for record in caplog.records)
                without = offered()
    finally:
        extension.extension.cache_clear()  # built (or not) again as this machine allows
    assert ("gemv" in matmuls.available(torch.float32)) == ("gemv" in FLOAT_KERNELS)
    # what the build adds is what the benchmarks' ceiling leaves out as not PyTorch's
    assert offered() - without == (set(matmuls.OWN) if gemv.available() else set())


@pytest.mark.skipif("gemv" not in FLOAT_KERNELS, reason="the gemv kernel cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_order", [False, True])
def test_gemv_at_every_row_count_and_ragged_shapes(dtype, in_order):
    """Every row count the kernel keeps in registers (1-8) and blocks beyond, a reduction length
    that is no multiple of the vector width, output rows that fill no whole tile or block, and
    every epilogue, against F.linear in float32; its weight rows read eight at a time or in order."""
    def linear(*args, **kwargs):
        return gemv.linear(*args, **kwargs, in_order=in_order)

    torch.manual_seed(0)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for out_features, in_features in ((37, 70), (21, 120), (50, 3), (16, 2048)):
        w, b = (torch.randn(out_features, in_features) * 0.1).to(dtype), torch.randn(out_features).to(dtype)
        for rows in (*range(1, 10), 17):
            x = torch.randn(rows, in_features).to(dtype)
            want = F.linear(x.float(), w.float(), b.float())
            assert_close(linear(x, w, b).float(), want, **tolerance)
            assert_close(linear(x, w, None).float(), F.linear(x.float(), w.float()), **tolerance)
            residual = torch.randn(rows, out_features).to(dtype)
            assert_close(linear(x, w, b, residual=residual).float(), want + residual.float(), **tolerance)
            for activation, algorithm, f in (("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
                                             ("gelu", "none", F.gelu), ("relu", "", F.relu)):
                got = linear(x, w, b, activation, algorithm)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                assert_close(got.float(), f(want), **tolerance)
    x = torch.randn(2, 3, 64).to(dtype)  # leading dimensions kept; a weight that is a view
    w = torch.randn(64, 32).to(dtype).t()
    assert_close(linear(x, w).float(), F.linear(x.float(), w.float()), **tolerance)
    with pytest.raises(RuntimeError, match="gemv"):
        linear(x, w.float() if dtype == torch.bfloat16 else w.bfloat16())


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_every_float32_kernel_computes_what_linear_computes(name):
    kernel = matmuls.KERNELS[name]
    torch.manual_seed(0)
    for out_features, in_features, bias in ((192, 64, True), (50257, 64, False)):
        w = torch.randn(out_features, in_features) * 0.1
        b = torch.randn(out_features) if bias else None
        packed = kernel.pack_of(w, b)
        for shape in ((1, 64), (2, 64), (5, 1, 64), (64, 64), (3, 100, 64), (300, 64)):
            x = torch.randn(*shape)
            assert_close(kernel.linear(x, packed, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", BF16_KERNELS)
def test_every_bfloat16_kernel_computes_what_linear_computes_in_bfloat16(name):
    kernel = matmuls.KERNELS[name]
    torch.manual_seed(0)
    w, b = (torch.randn(192, 64) * 0.1).bfloat16(), torch.randn(192).bfloat16()
    packed = kernel.pack_of(w, b)
    for rows in (1, 8, 300):
        x = torch.randn(rows, 64).bfloat16()
        got = kernel.linear(x, packed, w, b)
        assert got.dtype == torch.bfloat16
        # bf16 has an 8-bit mantissa: results may differ by its rounding of the float32 sum
        assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)


EPILOGUES = [("gelu_tanh", torch.nn.GELU(approximate="tanh"), False), ("gelu_erf", torch.nn.GELU(), False),
             ("relu", torch.nn.ReLU(), False), ("residual", None, True), ("both", torch.nn.GELU(approximate="tanh"), True)]


def packed_with_counted_epilogues(monkeypatch, name):
    """A 64 -> 192 layer packed with kernel `name`, and the list of the epilogues its kernel runs itself."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 192).eval()
    planner.pack_linears(layer, kernel=name)
    calls = []
    kernel = matmuls.KERNELS[name]
    counted = {field: (lambda f, field: lambda *a: calls.append(field) or f(*a))(getattr(kernel, field), field)
               for field in ("with_activation", "with_residual") if getattr(kernel, field) is not None}
    monkeypatch.setitem(matmuls.KERNELS, name, replace(kernel, **counted))
    return layer, calls


@pytest.mark.parametrize("name", FLOAT_KERNELS)
@pytest.mark.parametrize("what, activation, with_residual", EPILOGUES, ids=[e[0] for e in EPILOGUES])
def test_an_epilogue_in_the_kernel_computes_what_follows_the_linear(monkeypatch, name, what, activation, with_residual):
    layer, calls = packed_with_counted_epilogues(monkeypatch, name)
    for shape in ((1, 64), (5, 1, 64), (3, 100, 64)):
        x = torch.randn(*shape)
        residual = torch.randn(*shape[:-1], 192) if with_residual else None
        want = F.linear(x, layer.weight, layer.bias)
        want = activation(want) if activation is not None else want
        want = residual + want if with_residual else want
        with torch.no_grad():
            assert_close(project(layer, x, activation, residual), want, rtol=1e-5, atol=1e-5)
    # oneDNN and gemv run the activation (or the add) in their own pass: what the serving forward relies on
    if matmuls.KERNELS[name].with_activation is not None:
        assert set(calls) == {"with_activation" if activation is not None else "with_residual"}
    else:
        assert calls == []


def test_an_epilogue_of_a_layer_that_cannot_take_it_is_applied_after():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 192).eval()
    planner.pack_linears(layer, kernel="onednn")
    x, sigmoid = torch.randn(4, 64), torch.nn.Sigmoid()  # no oneDNN post-op for it here
    with torch.no_grad():
        assert_close(project(layer, x, sigmoid), torch.sigmoid(F.linear(x, layer.weight, layer.bias)))
        residual = torch.randn(192, 4).t()  # not contiguous: added after the kernel
        assert_close(project(layer, x, residual=residual), residual + F.linear(x, layer.weight, layer.bias),
                     rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2)  # a stale pack: the plain layer, then the epilogue
        assert_close(project(layer, x, torch.nn.ReLU()), F.linear(x, layer.weight, layer.bias).relu())


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_a_model_on_each_kernel_gives_transformers_logits(checkpoint, name):
    from transformers import GPT2LMHeadModel

    reference = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    model = load_model(str(checkpoint))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = 0 if name == "linear" else 2 * 4 + 1  # 4 Linears a block, and the LM head
    assert planner.pack_linears(model, kernel=name) == expected
    assert type(model.lm_head) is KernelLinear
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.state_dict().keys() == state.keys()
    tokens = torch.randint(0, 50257, (3, 20))
    cache = KVCache(model.config, max_slots=3, max_len=32)
    with torch.no_grad():
        want = reference(tokens).logits
        got = model.forward_cached(tokens, torch.full((3,), 20), torch.arange(3), torch.zeros(3, dtype=torch.long),
                                   cache, all_logits=True)
        assert_close(got, want, rtol=1e-5, atol=1e-4)
        step = model.forward_cached(want[:, -1].argmax(-1, keepdim=True), torch.ones(3, dtype=torch.long),
                                    torch.arange(3), torch.full((3,), 20), cache)  # decode rows
        full = reference(torch.cat([tokens, want[:, -1].argmax(-1, keepdim=True)], 1)).logits[:, -1]
        assert_close(step, full, rtol=1e-5, atol=1e-4)


def test_only_cpu_layers_are_packed():
    """The packed kernels are CPU ones: a layer on another device (a GPU; here the meta device,
    which every machine has) stays a plain nn.Linear."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, device="meta"))
    assert planner.pack_linears(model, kernel="onednn") == 1
    assert type(model[0]) is KernelLinear and type(model[1]) is torch.nn.Linear


def test_the_choice_takes_only_kernels_this_machine_runs(checkpoint):
    model = load_model(str(checkpoint))
    planner.pack_linears(model)  # measured here
    plan = model.lm_head._plan
    assert set(plan.seconds) == set(FLOAT_KERNELS)
    assert all(all(0 < s < math.inf for s in by_rows.values()) for by_rows in plan.seconds.values())
    assert plan.packed in FLOAT_KERNELS and {name for _, name in plan.ranges} <= {plan.packed, "linear", *matmuls.OWN}
    head = model.lm_head._plan  # the output head is planned on its own timings
    plan = model.transformer.h[0].attn.c_attn._plan
    assert set(head.seconds) == set(plan.seconds) and head.seconds != plan.seconds
    assert all(m._plan is plan for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head)
    with pytest.raises(ValueError, match=f"available: {', '.join(BF16_KERNELS)}$"):
        planner.pack_linears(model.to(torch.bfloat16), kernel="mkl")  # float32 only


def test_the_plan_follows_the_timings():
    # seconds per pass at 1 / 8 / 64 / 256 rows. Within the margin, the rule's kernel (oneDNN)
    # serves every row count; F.linear takes the row counts where it was clearly faster
    seconds = {"linear": {1: 1.0, 8: 2.0, 64: 8.0, 256: 30.0},
               "mkl": {1: 1.1, 8: 1.7, 64: 7.0, 256: 20.0},
               "onednn": {1: 1.5, 8: 1.9, 64: 6.0, 256: 26.0}}
    plan = planner.plan_from(seconds)
    assert plan.packed == "onednn"
    assert plan.ranges == ((2, "linear"), (22, "onednn"), (128, "onednn"), (math.inf, "onednn"))
    assert plan.describe() == "linear up to 2 rows, onednn above (measured)"
    # another packed kernel clearly faster overall replaces it
    seconds["mkl"] = {1: 0.5, 8: 1.0, 64: 4.0, 256: 15.0}
    assert planner.plan_from(seconds) == matmuls.Plan("mkl", ((2, "mkl"), (22, "mkl"), (128, "mkl"), (math.inf, "mkl")))
    # packed kernels that never clearly beat F.linear are not packed (no memory spent on them)
    slow = planner.plan_from({"linear": {1: 1.0, 8: 1.0}, "mkl": {1: 1.5, 8: 1.3}, "onednn": {1: 2.0, 8: 1.4}})
    assert slow == matmuls.Plan("linear", ((math.inf, "linear"),)) and slow.describe().startswith("linear at every")


def test_the_gemv_serves_one_or_two_rows_unless_clearly_slower():
    seconds = {"linear": {1: 2.0, 8: 2.0, 64: 8.0}, "onednn": {1: 1.1, 8: 1.0, 64: 4.0},
               "gemv": {1: 1.0, 8: 0.9, 64: 9.0}}
    plan = planner.plan_from(seconds)
    # the rule's at 1-2 rows; within the margin at 8 (0.9 against 1.0): oneDNN, the packed kernel
    assert plan == matmuls.Plan("onednn", ((2, "gemv"), (22, "onednn"), (math.inf, "onednn")))
    assert plan.describe() == "gemv up to 2 rows, onednn above (measured)" and not plan.plain
    seconds["onednn"][1] = 0.7  # clearly faster than gemv at one row: it serves it
    assert planner.plan_from(seconds).ranges[0] == (2, "onednn")
    # the packed kernel's choice ignores gemv, which needs no pack
    seconds["gemv"] = {1: 0.1, 8: 0.1, 64: 0.1}
    plan = planner.plan_from(seconds)
    assert plan == matmuls.Plan("linear", ((2, "gemv"), (22, "gemv"), (math.inf, "gemv")))  # nothing packed
    assert planner.plan_from({"linear": {1: 1.0}, "onednn": {1: 2.0}, "gemv": {1: 1.3}}).plain  # F.linear fastest


def test_the_gemvs_rows_go_to_the_faster_of_its_two_orders_without_a_margin():
    seconds = {"linear": {1: 2.0, 8: 2.0}, "onednn": {1: 1.5, 8: 1.0}, "gemv": {1: 1.0, 8: 1.2},
               "gemv-in-order": {1: 0.95, 8: 1.1}}
    # the same sums read in another order: 5% faster is enough; above the GEMV's rows, the packed kernel
    plan = planner.plan_from(seconds)
    assert plan.ranges == ((2, "gemv-in-order"), (math.inf, "onednn"))
    assert plan.describe() == "gemv-in-order up to 2 rows, onednn above (measured)"
    seconds["gemv-in-order"][1] = 1.05
    assert planner.plan_from(seconds).ranges[0] == (2, "gemv")
    # a kernel clearly faster than both still takes the rows
    seconds["linear"][1] = 0.5
    assert planner.plan_from(seconds).ranges[0] == (2, "linear")


def test_a_kernel_that_reads_the_weights_right_after_another_does_not_time_the_others_cache(monkeypatch):
    # the second of two kernels that read the same weights as they are would find the end of the
    # first's pass in the cache: what it reads before its timed pass is other memory
    calls = []

    def kernel(name, pack):
        return matmuls.Kernel(name, (torch.float32,), lambda dtype: True, pack,
                              lambda x, packed, w, b: calls.append(name))

    for name, pack in (("raw-a", None), ("raw-b", None), ("packed", lambda w, b: w.clone())):
        monkeypatch.setitem(matmuls.KERNELS, name, kernel(name, pack))
    monkeypatch.setattr(planner, "_evictor", lambda device: lambda: calls.append("evict"))
    weights = [(torch.randn(8, 4), None)]
    planner.time_kernels(weights, ["raw-a", "raw-b", "packed"], rows=(1,), repeats=2)
    # a warm-up pass and two timed ones; raw-a follows the packed kernel, raw-b follows raw-a
    assert calls == ["raw-a", "evict", "raw-b", "packed"] * 3
    calls.clear()
    planner.time_kernels(weights, ["raw-a", "raw-b"], rows=(1,), repeats=1)
    assert calls == ["evict", "raw-a", "evict", "raw-b"] * 2  # each follows the other, across passes too
    calls.clear()
    planner.time_kernels(weights, ["raw-a", "packed"], rows=(1,), repeats=1)
    assert "evict" not in calls


def test_the_timed_sample_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    # a sample that fits the cache is timed from it: the sample is twice the largest cache reported
    for index, size in enumerate(["48K", "2048K", "491520K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(machine.glob, "glob", lambda pattern: [str(p) for p in tmp_path.glob("index*/size")])
    assert machine.last_level_cache_bytes() == 491520 << 10
    planner.sample_bytes.cache_clear()
    try:
        assert planner.sample_bytes() == 2 * (491520 << 10)
        (tmp_path / "index2" / "size").write_text("8192K\n")  # a small cache: the fixed floor
        planner.sample_bytes.cache_clear()
        assert planner.sample_bytes() == planner.SAMPLE_BYTES
    finally:
        planner.sample_bytes.cache_clear()
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]  # 4 MiB each
    assert planner._sample(layers, 8 << 20) == layers[:2] and planner._sample(layers, 1 << 30) == layers


@pytest.mark.parametrize("int8", [False, True])
def test_the_output_head_is_planned_on_its_own_timings(checkpoint, monkeypatch, int8):
    """Kernels cross over at other row counts on the head's shape (vocabulary x width) than in the
    blocks: here one kernel is faster from 8 rows on the head only, and only the head takes it there."""
    model = _int8_model(checkpoint)[0] if int8 else load_model(str(checkpoint))
    dtype = torch.qint8 if int8 else torch.float32
    other = "int8-onednn" if int8 else "mkl"
    if other not in matmuls.available(dtype):
        pytest.skip(f"{other} does not run here")
    vocab = model.lm_head.out_features

    def timings(weights, names, rows):
        head = any(w.shape[0] == vocab for w, _ in weights)
        return {name: {r: 1.0 if name != other or r < 8 else (0.5 if head else 2.0) for r in rows} for name in names}

    monkeypatch.setattr(planner, "time_kernels", timings)
    monkeypatch.setattr(machine, "QUIET_CORES", math.inf)
    monkeypatch.setattr(planner, "_plans", {})
    monkeypatch.delenv(planner.ENV, raising=False)
    planner.pack_linears(model)
    head, blocks = model.lm_head._plan, model.transformer.h[0].mlp.c_fc._plan
    assert head.kernel_for(1).name == blocks.kernel_for(1).name != other
    assert head.kernel_for(8).name == head.kernel_for(64).name == other
    assert other not in (blocks.kernel_for(8).name, blocks.kernel_for(64).name)
    assert planner.describe(model).startswith(("int8: " if int8 else "float32: ") + blocks.describe())
    assert planner.describe(model).endswith(" head: " + head.describe())


def test_a_plan_measured_on_a_quiet_machine_is_read_back_by_a_later_start_on_the_same_cpu(checkpoint, monkeypatch,
                                                                                        tmp_path):
    """keep_plans: the worker's next start reads the plan instead of timing; another CPU, a busy
    machine's rule, or a kernel no longer offered never comes back from the disk."""
    timed = []

    def timings(weights, names, rows):
        timed.append(names)
        return {name: {r: 1.0 if name == "onednn" else 2.0 for r in rows} for name in names}

    monkeypatch.setattr(planner, "time_kernels", timings)
    monkeypatch.setattr(machine, "QUIET_CORES", math.inf)
    monkeypatch.setattr(planner, "_plans", {})
    planner.keep_plans(tmp_path)
    try:
        model = load_model(str(checkpoint))
        planner.pack_linears(model)
        measured, first = model.lm_head._plan, len(timed)
        assert first >= 1 and len(list(tmp_path.glob("*.json"))) == first
        monkeypatch.setattr(planner, "_plans", {})  # a new process
        again = load_model(str(checkpoint))
        planner.pack_linears(again)
        plan = again.lm_head._plan
        assert len(timed) == first  # nothing timed
        assert plan == measured and plan.seconds == measured.seconds and plan.fused_gelu == measured.fused_gelu
        assert plan.describe().endswith("(measured before on this CPU)")
        assert planner.row_costs(again) == planner.row_costs(model)

        monkeypatch.setattr(planner, "_plans", {})
        monkeypatch.setattr(machine, "cpu_identity", lambda: "another CPU")
        planner.pack_linears(load_model(str(checkpoint)))
        assert len(timed) == 2 * first  # timed again, and kept beside the first CPU's
        assert len(list(tmp_path.glob("*.json"))) == 2 * first

        monkeypatch.setattr(planner, "_plans", {})
        monkeypatch.setattr(machine, "cpu_identity", lambda: "a third CPU")
        monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # busy: the rule's plan is not kept
        planner.pack_linears(load_model(str(checkpoint)))
        assert len(list(tmp_path.glob("*.json"))) == 2 * first

        monkeypatch.setattr(machine, "cpu_identity", lambda: "another CPU")
        monkeypatch.setattr(planner, "_plans", {})
        monkeypatch.setattr(planner, "available", lambda dtype: ["linear", "mkl"])  # onednn no longer offered
        monkeypatch.setattr(machine, "QUIET_CORES", math.inf)
        assert planner.choose([load_model(str(checkpoint)).lm_head]).packed != "onednn"
    finally:
        planner.keep_plans(None)


def test_busy_timings_give_way_to_the_rule(checkpoint, monkeypatch):
    model = load_model(str(checkpoint))
    monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # as if other processes had been busy
    monkeypatch.setattr(planner, "_plans", {})
    planner.pack_linears(model)
    plan = model.lm_head._plan
    one_row = "gemv" if "gemv" in FLOAT_KERNELS else "onednn"
    assert plan.ranges == ((2, one_row), (5, "onednn"), (22, "onednn"), (128, "onednn"), (math.inf, "onednn"))
    assert plan.source.startswith("rule: other processes used")
    assert set(plan.seconds) == set(FLOAT_KERNELS)  # measured all the same, for the record


def test_the_forced_kernel_comes_from_the_environment(checkpoint, monkeypatch):
    model = load_model(str(checkpoint))
    monkeypatch.setenv(planner.ENV, "mkl")
    planner.pack_linears(model)
    assert model.lm_head._plan == matmuls.Plan.only("mkl")


@pytest.mark.skipif("onednn" not in BF16_KERNELS, reason="oneDNN runs no bfloat16 on this CPU (no native bf16)")
def test_a_bfloat16_model_is_packed_in_bfloat16(checkpoint):
    model = load_model(str(checkpoint), dtype=torch.bfloat16)
    assert planner.pack_linears(model, kernel="onednn") == 9
    reference = load_model(str(checkpoint), dtype=torch.bfloat16)
    tokens = torch.randint(0, 50257, (2, 6))
    caches = [KVCache(m.config, 2, 16, dtype=torch.bfloat16) for m in (model, reference)]
    args = (torch.full((2,), 6), torch.arange(2), torch.zeros(2, dtype=torch.long))
    got = model.forward_cached(tokens, *args, caches[0])
    want = reference.forward_cached(tokens, *args, caches[1])
    assert got.dtype == torch.float32  # logits leave the model in float32
    assert_close(got, want, rtol=0.05, atol=0.1)


def test_a_changed_weight_is_not_served_from_a_stale_pack(checkpoint):
    model = load_model(str(checkpoint))
    planner.pack_linears(model, kernel="onednn")
    layer = model.transformer.h[0].attn.c_proj
    x = torch.randn(8, 64)
    with torch.no_grad():
        layer.weight.mul_(2)
        assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        planner.pack_linears(model, kernel="onednn")  # repacks what changed
        assert layer.is_current()
        assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        model.to(torch.bfloat16)  # another tensor in the weight's place
        assert not layer.is_current()
        assert_close(layer(x.bfloat16()), F.linear(x.bfloat16(), layer.weight, layer.bias))


def test_autograd_goes_around_the_pack(checkpoint):
    model = load_model(str(checkpoint))
    planner.pack_linears(model, kernel="onednn")
    layer = model.transformer.h[0].mlp.c_fc
    layer.weight.requires_grad_(True)
    layer(torch.randn(4, 64)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_speedups_of_other_precisions_are_measured(checkpoint, monkeypatch):
    model = load_model(str(checkpoint))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    monkeypatch.setattr(machine, "QUIET_CORES", math.inf)  # whatever else runs on the machine
    factors = planner.speedups(layers, [torch.bfloat16, torch.qint8], rows=(1, 8))
    assert set(factors) == {torch.bfloat16, torch.qint8}
    assert all(set(f) == {1, 8} and all(0 < v < math.inf for v in f.values()) for f in factors.values())
    monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # as if other processes had been busy
    assert planner.speedups(layers, [torch.bfloat16], rows=(1,)) == {}


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


COMPILE_SCRIPT = """
import sys, torch
from torch._dynamo.utils import counters
from nanogpt.checkpoint import load_model
from nanogpt.kernels import planner
from nanogpt.runtime import compile_cache
from nanogpt.runtime.kv_cache import KVCache
compile_cache.enable(sys.argv[2])
model = load_model(sys.argv[1])
planner.pack_linears(model, kernel="onednn")
cache = KVCache(model.config, max_slots=4, max_len=32)
step = torch.compile(model.forward_decode)
tokens, slots, positions = torch.tensor([5, 7]), torch.tensor([0, 2]), torch.tensor([0, 0])
with torch.no_grad():
    got = step(tokens, slots, positions, cache, torch.arange(2))
torch.save(got, sys.argv[3])
print(dict(counters["inductor"]), dict(counters["aot_autograd"]))
"""


@pytest.mark.slow
def test_a_compiled_decode_step_runs_the_packs_and_a_second_start_loads_it_from_the_cache(checkpoint, tmp_path):
    """Compiled without weight freezing, the packed layers are calls of nanoserve::linear, whose
    graph the compile cache stores: a second process finds it there (nothing compiled again)."""
    import subprocess
    import sys

    from conftest import REPO

    def start(n: int) -> tuple[str, torch.Tensor]:
        out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(checkpoint), str(tmp_path / "cache"),
                              str(tmp_path / f"logits{n}.pt")], cwd=REPO, capture_output=True, text=True,
                             timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout, torch.load(tmp_path / f"logits{n}.pt")

    first, logits = start(1)
    assert "'fxgraph_cache_miss': 1" in first and "autograd_cache_saved" in first
    second, again = start(2)
    assert "'fxgraph_cache_hit': 1" in second and "'autograd_cache_hit': 1" in second
    assert "miss" not in second
    # the same logits as the eager step
    model = load_model(str(checkpoint))
    cache = KVCache(model.config, max_slots=4, max_len=32)
    want = model.forward_decode(torch.tensor([5, 7]), torch.tensor([0, 2]), torch.tensor([0, 0]), cache, torch.arange(2))
    assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert_close(again, want, rtol=1e-5, atol=1e-5)


def test_compiled_packed_layers_call_their_kernel(checkpoint):
    model = load_model(str(checkpoint))
    planner.pack_linears(model, kernel="onednn")
    layer = model.transformer.h[0].mlp.c_fc
    graphs = []

    def backend(gm, inputs):  # what dynamo hands a compiler
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(3, 64)
    with torch.no_grad():
        got = torch.compile(layer, backend=backend)(x)
    assert "torch.ops.nanoserve.linear" in graphs[0] and "torch._C._nn.linear" not in graphs[0]
    assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


ACTIVATIONS = [e for e in EPILOGUES if e[1] is not None and not e[2]]


def recording_backend():
    """A torch.compile backend that runs each graph as traced, and the list it appends each graph's
    operator nodes to (dynamo reset first, so nothing compiled earlier answers instead)."""
    graphs = []

    def backend(gm, inputs):
        graphs.append([node for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")])
        return gm.forward

    torch._dynamo.reset()
    return backend, graphs


@pytest.mark.parametrize("name", FLOAT_KERNELS)
@pytest.mark.parametrize("what, activation, _", ACTIVATIONS, ids=[e[0] for e in ACTIVATIONS])
def test_a_compiled_activation_runs_in_the_layers_op(name, what, activation, _):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 192).eval()
    planner.pack_linears(layer, kernel=name)
    backend, graphs = recording_backend()
    x = torch.randn(3, 64)
    with torch.no_grad():
        compiled = torch.compile(lambda x: project(layer, x, activation), backend=backend)
        compiled(x)
        with torch.profiler.profile() as profile:
            got = compiled(x)
        assert_close(got, activation(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2)  # a stale pack: the plain product, then the activation, in the same op
        stale = torch.compile(lambda x: project(layer, x, activation), backend="eager")(x)
        assert_close(stale, activation(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
    ops = graphs[0]
    if name == matmuls.PLAIN:  # nothing packed: the plain layer and the activation, as written
        assert len(ops) == 2 and torch.ops.nanoserve.linear not in [op.target for op in ops]
        return
    # the graph's one op: the packed layer's, the activation its argument
    post = matmuls.ONEDNN_ACTIVATIONS[(type(activation).__name__, getattr(activation, "approximate", None))]
    assert [(op.target, op.args[4:]) for op in ops] == [(torch.ops.nanoserve.linear, (post[0], post[2]))]
    # a kernel with the epilogue applies it in its own pass over the output (no operator of its own);
    # without, the op applies it to the kernel's output in place (PyTorch's, or the GELU of nanogpt/kernels/csrc/vec.h)
    ran = [event.name for event in profile.events()]
    assert ran.count("nanoserve::linear") == 1
    if matmuls.KERNELS[name].with_activation is not None:
        assert not any(op in ran for op in ("aten::gelu", "aten::relu", "aten::gelu_", "aten::relu_"))
    if name == "onednn":
        assert ran.count("mkldnn::_linear_pointwise") == 1


def onednn_layer_with_gelu_after(monkeypatch):
    """A 64 -> 192 layer packed with oneDNN whose plan leaves GELU out of oneDNN's pass (gemv, where
    built, at 1-2 rows), and the list of the epilogues its kernels run themselves."""
    layer, calls = packed_with_counted_epilogues(monkeypatch, "onednn")
    ranges = ((2, matmuls.GEMV), (math.inf, "onednn")) if matmuls.GEMV in FLOAT_KERNELS else ((math.inf, "onednn"),)
    layer._plan = replace(layer._plan, ranges=ranges, fused_gelu=False)
    return layer, calls


@pytest.mark.skipif("onednn" not in FLOAT_KERNELS, reason="this torch build has no oneDNN prepacked linear")
def test_a_gelu_the_packed_kernel_runs_slower_follows_it_as_an_operator(monkeypatch):
    layer, calls = onednn_layer_with_gelu_after(monkeypatch)
    assert layer._plan.describe().endswith("GELU after onednn's matmul (forced)")
    gelu, x = torch.nn.GELU(approximate="tanh"), torch.randn(5, 64)
    with torch.no_grad():
        assert_close(project(layer, x, gelu), gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
        assert calls == []  # oneDNN's rows: the matmul, then GELU
        assert_close(project(layer, x, torch.nn.ReLU()), F.linear(x, layer.weight, layer.bias).relu(),
                     rtol=1e-5, atol=1e-5)
        assert calls == ["with_activation"]  # any other activation stays in its pass
        if matmuls.GEMV in FLOAT_KERNELS:  # the GEMV's rows keep the GELU in its own pass
            monkeypatch.setitem(matmuls.KERNELS, matmuls.GEMV, replace(
                matmuls.KERNELS[matmuls.GEMV], with_activation=lambda *a: calls.append("gemv") or gemv_gelu(*a)))
            one = x[:1]
            assert_close(project(layer, one, gelu), gelu(F.linear(one, layer.weight, layer.bias)),
                         rtol=1e-5, atol=1e-5)
            assert calls[-1] == "gemv"


def gemv_gelu(x, packed, w, b, activation):
    from nanogpt.kernels import gemv

    return gemv.linear(x, w, b, activation[0], activation[2])


@pytest.mark.skipif("onednn" not in FLOAT_KERNELS, reason="this torch build has no oneDNN prepacked linear")
def test_a_compiled_gelu_the_packed_kernel_runs_slower_is_an_operator_of_the_graph(monkeypatch):
    layer, _ = onednn_layer_with_gelu_after(monkeypatch)
    gelu, (backend, graphs) = torch.nn.GELU(approximate="tanh"), recording_backend()
    x = torch.randn(6, 64)
    with torch.no_grad():
        got = torch.compile(lambda x: project(layer, x, gelu), backend=backend)(x)
    assert_close(got, gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
    (ops,) = graphs
    # the layer's op without an activation, then GELU as the graph's own operator
    assert [op.target for op in ops] == [torch.ops.nanoserve.linear, F.gelu]
    assert "gelu" not in ops[0].args[4:]


@pytest.mark.skipif("onednn" not in FLOAT_KERNELS, reason="this torch build has no oneDNN prepacked linear")
def test_a_graph_whose_rows_vary_is_not_split_at_the_plans_row_ranges(monkeypatch):
    """Where a compiled graph's rows vary, its trace leaves them out of the plan's ranges: compared
    with them, each range would be a guard of the graph, and a step crossing one would compile
    another graph while serving. The packed kernel's choice of where the GELU runs then holds."""
    layer, _ = onednn_layer_with_gelu_after(monkeypatch)  # GELU in the GEMV's pass at 1-2 rows, else after
    gelu, (backend, graphs) = torch.nn.GELU(approximate="tanh"), recording_backend()
    compiled = torch.compile(lambda x: project(layer, x, gelu), backend=backend)
    with torch.no_grad():
        for rows in (3, 30, 2, 300):
            x = torch.randn(rows, 64)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            assert_close(compiled(x), gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)
    (ops,) = graphs  # one graph for every row count
    assert [op.target for op in ops if op.op == "call_function"] == [torch.ops.nanoserve.linear, F.gelu]


def test_the_gelu_leaves_the_packed_kernels_pass_where_it_was_clearly_slower(monkeypatch):
    """`gelu_fuses` times the packed kernel with its GELU against the kernel then torch's GELU, on the
    widest layer, at the row counts the kernel serves."""
    torch.manual_seed(0)
    weights = [(torch.randn(48, 16), torch.randn(48)), (torch.randn(16, 48), torch.randn(16))]
    plan = matmuls.Plan("onednn", ((2, "linear"), (math.inf, "onednn")), {"linear": {1: 1.0, 8: 1.0}})
    kernel, shapes = matmuls.KERNELS["onednn"], []

    def slow_epilogue(x, packed, w, b, activation):
        shapes.append((x.shape[0], tuple(w.shape)))
        time.sleep(0.002)
        return kernel.with_activation(x, packed, w, b, activation)

    monkeypatch.setitem(matmuls.KERNELS, "onednn", replace(kernel, with_activation=slow_epilogue))
    assert planner.gelu_fuses(weights, plan) is False
    assert set(shapes) == {(8, (48, 16))}  # onednn's timed rows only, on the widest layer
    monkeypatch.setitem(matmuls.KERNELS, "onednn", replace(kernel, linear=lambda *a: time.sleep(0.002) or kernel.linear(*a)))
    assert planner.gelu_fuses(weights, plan) is True
    assert planner.gelu_fuses(weights, replace(plan, packed="linear", ranges=((math.inf, "linear"),))) is True


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_the_compiled_graphs_op_runs_the_layers_plan_at_every_row_count(name):
    """nanoserve::linear, as a compiled graph calls it, gives what the layer gives for every kernel,
    row count and post-op, and a plain product once the weight changed or the layer is gone."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 192).eval()
    planner.pack_linears(layer, kernel=name)
    with torch.no_grad():
        for rows in (1, 2, 3, 40, 300):
            x = torch.randn(rows, 64)
            want = F.linear(x, layer.weight, layer.bias)
            for post, algorithm, f in (("none", "", lambda y: y), ("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
                                       ("gelu", "none", F.gelu), ("relu", "", F.relu)):
                got = torch.ops.nanoserve.linear(x, layer.weight, layer.bias, layer._handle, post, algorithm)
                assert_close(got, f(want), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-1)
        assert_close(torch.ops.nanoserve.linear(x, layer.weight, layer.bias, layer._handle),
                     F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        weight, bias, handle = layer.weight.clone(), layer.bias.clone(), layer._handle
        del layer
        assert_close(torch.ops.nanoserve.linear(x, weight, bias, handle), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_an_int8_decode_step_compiles_into_one_graph_of_its_quantized_kernels(checkpoint):
    """Every quantized linear is one opaque call of its own kernel inside the graph (dynamo cannot
    trace their packed weights), and the graph is the whole step: no breaks, the eager logits."""
    from nanogpt.kernels.quantize import Int8Linear, quantize_int8

    model = quantize_int8(load_model(str(checkpoint)))
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * model.config.n_layer + 1 and all(m._handle is not None for m in layers)
    graphs = []

    def backend(gm, inputs):  # what dynamo hands a compiler
        graphs.append(str(gm.graph))
        return gm.forward

    cache, again = KVCache(model.config, max_slots=4, max_len=32), KVCache(model.config, max_slots=4, max_len=32)
    args = torch.tensor([5, 7]), torch.tensor([0, 2]), torch.tensor([0, 0])
    with torch.no_grad():
        got = torch.compile(model.forward_decode, backend=backend, fullgraph=True)(*args, cache, torch.arange(2))
        want = model.forward_decode(*args, again, torch.arange(2))
    assert len(graphs) == 1 and graphs[0].count("torch.ops.nanoserve.int8_linear") == len(layers)
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_int8_plan_follows_the_timings():
    # fbgemm's pack (INT8) serves every row count unless another int8 kernel was clearly faster
    seconds = {"int8-dynamic": {1: 1.0, 8: 2.0, 64: 7.0, 256: 22.0},
               "int8-onednn": {1: 1.4, 8: 1.9, 64: 4.6, 256: 10.0}}
    plan = planner.plan_int8(seconds)
    assert plan == matmuls.Plan("int8-dynamic", ((2, "int8-dynamic"), (22, "int8-dynamic"), (128, "int8-onednn"),
                                                 (math.inf, "int8-onednn")))
    assert plan.describe() == "int8-dynamic up to 22 rows, int8-onednn above (measured)"
    seconds["int8-onednn"] = {1: 0.9, 8: 1.8, 64: 6.0, 256: 20.0}  # faster, within the margin
    assert planner.plan_int8(seconds).describe() == "int8-dynamic at every row count (measured)"


def test_the_int8_plan_gives_the_int8_gemv_one_or_two_rows_unless_clearly_slower():
    seconds = {"int8-dynamic": {1: 1.0, 4: 1.1, 8: 2.0, 64: 7.0},
               "int8-onednn": {1: 1.4, 4: 1.5, 8: 1.9, 64: 4.6},
               "int8-gemv": {1: 1.1, 4: 0.7, 8: 2.5, 64: 20.0}}
    plan = planner.plan_int8(seconds)  # by rule at one row though slower there; at 4 clearly faster
    assert plan.describe() == "int8-gemv up to 5 rows, int8-dynamic up to 22 rows, int8-onednn above (measured)"
    seconds["int8-dynamic"][1] = 0.8  # fbgemm clearly faster than the GEMV at one row: it serves it
    assert planner.plan_int8(seconds).ranges[0] == (2, "int8-dynamic")


@pytest.mark.skipif("int8-gemv" not in INT8_KERNELS, reason="the int8 gemv cannot be built here")
def test_the_int8_gemv_computes_what_fbgemm_computes_to_the_bit():
    """x quantized as fbgemm's dynamic linear quantizes it (one scale over all rows, 7-bit), the
    products summed exactly, the same float epilogue: equal outputs at every row count the kernel
    blocks (1-4) and beyond, a reduction length that is no multiple of its 32 bytes, no bias,
    inputs all positive or all zero; the activation applied to that output."""
    from nanogpt.kernels import gemv
    from nanogpt.kernels.matmuls import quantize_weight

    torch.manual_seed(0)
    for out_features, in_features in ((37, 70), (50, 3), (96, 768), (24, 3072)):
        weight, bias = quantize_weight(torch.randn(out_features, in_features) * 0.1), torch.randn(out_features)
        for with_bias in (bias, None):
            fbgemm = torch.ops.quantized.linear_prepack(weight, with_bias)
            pack = gemv.int8_pack(weight, with_bias)
            for rows in (*range(1, 10), 17):
                for x in (torch.randn(rows, in_features) * 3 + 0.5, torch.rand(rows, in_features),
                          torch.zeros(rows, in_features)):
                    want = torch.ops.quantized.linear_dynamic(x, fbgemm, reduce_range=True)
                    assert torch.equal(gemv.int8_linear(x, pack), want)
                for activation, algorithm, f in (("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
                                                 ("gelu", "none", F.gelu), ("relu", "", F.relu)):
                    assert_close(gemv.int8_linear(x * 8, pack, activation, algorithm),
                                 f(torch.ops.quantized.linear_dynamic(x * 8, fbgemm, reduce_range=True)),
                                 rtol=0, atol=2e-6)
    x = torch.randn(2, 3, 70)  # leading dimensions kept
    weight = quantize_weight(torch.randn(37, 70))
    assert torch.equal(gemv.int8_linear(x, gemv.int8_pack(weight, None)),
                       torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(weight, None), True))
    per_channel = torch.quantize_per_channel(torch.randn(8, 32), torch.rand(8) + 0.1, torch.zeros(8, dtype=torch.long),
                                             0, torch.qint8)
    with pytest.raises(ValueError, match="per tensor"):
        gemv.int8_pack(per_channel, None)


@pytest.mark.skipif("int8-gemv" not in INT8_KERNELS, reason="the int8 gemv cannot be built here")
def test_an_int8_layer_and_the_compiled_graphs_op_run_the_int8_gemv_where_planned(checkpoint):
    """The rows its plan gives the int8 GEMV are served from its pack, eagerly and through
    nanoserve::int8_linear (with and without a post-op), with fbgemm's outputs to the bit."""
    from nanogpt.kernels.quantize import Int8Linear

    model, layers = _int8_model(checkpoint)
    layer = layers[0]
    x = {rows: torch.randn(rows, layer.in_features) for rows in (1, 4, 5, 64)}
    want = {rows: layer(x) for rows, x in x.items()}  # the default pack's (fbgemm)
    layer.set_plan(matmuls.Plan("int8-dynamic", ((4, "int8-gemv"), (math.inf, "int8-dynamic"))))
    assert set(layer._packs) == {"int8-gemv"}

    def op(x, activation="none", algorithm=""):
        return torch.ops.nanoserve.int8_linear(x, layer._handle, layer.out_features, activation, algorithm)

    for rows in x:
        assert torch.equal(layer(x[rows]), want[rows]) and torch.equal(op(x[rows]), want[rows])
        assert_close(op(x[rows], "gelu", "tanh"), F.gelu(want[rows], approximate="tanh"), rtol=0, atol=2e-6)
    # the rows up to 4 are served from the GEMV's pack: a pack of another weight shows it
    weight, bias = layer._weight_bias()
    negated = torch.quantize_per_tensor(-weight.dequantize(), weight.q_scale(), 0, torch.qint8)
    layer._packs["int8-gemv"] = gemv.int8_pack(negated, bias)
    publish(layer, layer._plan, {"int8-dynamic": layer._packed_from, **layer._packs})
    for rows, served in ((4, False), (5, True)):
        assert torch.equal(layer(x[rows]), want[rows]) == served
        assert torch.equal(op(x[rows]), want[rows]) == served
    fresh = Int8Linear(layer.in_features, layer.out_features)  # a new weight: a new pack of it
    fresh.set_weight_bias(negated, bias)
    layer.load_state_dict(fresh.state_dict())
    assert torch.equal(layer(x[1]), fresh(x[1])) and torch.equal(op(x[1]), fresh(x[1]))


def _int8_model(checkpoint):
    from nanogpt.kernels.quantize import Int8Linear, quantize_int8

    model = quantize_int8(load_model(str(checkpoint)))
    return model, [m for m in model.modules() if isinstance(m, Int8Linear)]


def test_an_int8_layer_runs_the_kernel_its_plan_gives_each_row_count(checkpoint):
    from nanogpt.kernels.matmuls import quantized_engine
    from nanogpt.kernels.quantize import Int8Linear

    model, layers = _int8_model(checkpoint)
    plan = matmuls.Plan("int8-dynamic", ((8, "int8-dynamic"), (math.inf, "int8-onednn")))
    layer = layers[0]
    x = {rows: torch.randn(rows, layer.in_features) for rows in (1, 8, 9, 64)}
    want = {rows: layer(x) for rows, x in x.items()}  # the default pack's (fbgemm)
    layer.set_plan(plan)
    assert set(layer._packs) == {"int8-onednn"}  # fbgemm's is the layer's own
    for rows in x:  # the same int8 products, summed exactly: float32 rounding apart
        assert_close(layer(x[rows]), want[rows], rtol=1e-5, atol=1e-5)
    # the rows above 8 are served from oneDNN's pack: a pack of another weight shows it
    weight, bias = layer._weight_bias()
    negated = torch.quantize_per_tensor(-weight.dequantize(), weight.q_scale(), 0, torch.qint8)
    with quantized_engine("onednn"):
        layer._packs["int8-onednn"] = torch.ops.quantized.linear_prepack(negated, bias)
    assert_close(layer(x[8]), want[8], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x[9]), want[9], atol=1e-3)
    # a new weight loaded into the layer is served by its own new pack, not the stale other one
    fresh = Int8Linear(layer.in_features, layer.out_features)
    fresh.set_weight_bias(negated, bias)
    layer.load_state_dict(fresh.state_dict())
    assert_close(layer(x[64]), fresh(x[64]), rtol=1e-5, atol=1e-5)


def test_the_compiled_graphs_int8_op_runs_the_layers_plan(checkpoint):
    """nanoserve::int8_linear, as a compiled graph calls it, runs the pack the layer's plan gives
    each row count, before any plan (fbgemm's) and after a new weight is loaded."""
    from nanogpt.kernels.matmuls import quantized_engine
    from nanogpt.kernels.quantize import Int8Linear

    model, layers = _int8_model(checkpoint)
    layer = layers[0]
    x = {rows: torch.randn(rows, layer.in_features) for rows in (1, 8, 9, 64)}

    def op(x):
        return torch.ops.nanoserve.int8_linear(x, layer._handle, layer.out_features)

    for rows in x:
        assert_close(op(x[rows]), layer(x[rows]), rtol=1e-5, atol=1e-5)
    layer.set_plan(matmuls.Plan("int8-dynamic", ((8, "int8-dynamic"), (math.inf, "int8-onednn"))))
    weight, bias = layer._weight_bias()
    negated = torch.quantize_per_tensor(-weight.dequantize(), weight.q_scale(), 0, torch.qint8)
    want = {rows: layer(x[rows]) for rows in x}
    with quantized_engine("onednn"):  # another weight in oneDNN's pack shows which rows it serves
        layer._packs["int8-onednn"] = torch.ops.quantized.linear_prepack(negated, bias)
    publish(layer, layer._plan, {"int8-dynamic": layer._packed_from, **layer._packs})
    assert_close(op(x[8]), want[8], rtol=1e-5, atol=1e-5)
    assert_close(op(x[9]), layer(x[9]), rtol=1e-5, atol=1e-5)  # the eager layer runs the same pack
    assert not torch.allclose(op(x[9]), want[9], atol=1e-3)
    fresh = Int8Linear(layer.in_features, layer.out_features)
    fresh.set_weight_bias(negated, bias)
    layer.load_state_dict(fresh.state_dict())
    for rows in x:
        assert_close(op(x[rows]), fresh(x[rows]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", [nn.GELU(approximate="tanh"), nn.GELU(), nn.ReLU()])
def test_the_int8_op_applies_the_activation_as_its_output_leaves_it(checkpoint, activation):
    """activation(int8 layer(x)) in one op (nanoserve::int8_linear with a post-op), as `project` calls
    it eagerly and inside compiled graphs: GPT-2's GELU by its exp form (nanogpt/kernels/csrc/vec.h) agrees with
    PyTorch's to float32 rounding, over every row count and a width that leaves a partial vector."""
    model, layers = _int8_model(checkpoint)
    layer = next(m for m in layers if m.out_features % 16)  # a tail past the last whole vector
    planner.pack_linears(model)
    for rows in (1, 3, 32, 300):
        x = torch.randn(rows, layer.in_features) * 8  # outputs far out on both sides of the GELU
        want = activation(layer(x))
        assert_close(project(layer, x, activation), want, rtol=0, atol=2e-6)
        compiled = torch.compile(lambda x: project(layer, x, activation), fullgraph=True)
        assert_close(compiled(x), want, rtol=0, atol=2e-6)


def test_an_int8_model_gets_a_measured_or_forced_int8_plan(checkpoint, monkeypatch):
    model, layers = _int8_model(checkpoint)
    assert planner.pack_linears(model) == len(layers)  # measured here
    plan, head = layers[0]._plan, model.lm_head._plan
    assert set(plan.seconds) == set(INT8_KERNELS) and plan.packed == "int8-dynamic"
    assert all(m._plan is plan for m in layers if m is not model.lm_head)
    assert set(head.seconds) == set(plan.seconds) and head.packed == "int8-dynamic"
    assert planner.describe(model) == f"int8: {plan.describe()}; int8 head: {head.describe()}"
    assert planner.row_costs(model) == {r: plan.seconds[plan.kernel_for(r).name][r] for r in planner.TIMED_ROWS}
    planner.pack_linears(model, kernel="int8-onednn")
    assert all(m._plan == matmuls.Plan.only("int8-onednn") and set(m._packs) == {"int8-onednn"} for m in layers)
    with pytest.raises(ValueError, match="available: " + ", ".join(INT8_KERNELS)):
        planner.pack_linears(model, kernel="onednn")  # a float kernel
    monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # as if other processes had been busy
    monkeypatch.setattr(planner, "_plans", {})
    planner.pack_linears(model)
    if "int8-gemv" in INT8_KERNELS:  # the int8 GEMV serves one or two rows by rule, fbgemm the rest
        assert layers[0]._plan.describe().startswith("int8-gemv up to 2 rows, int8-dynamic above (rule: other processes")
        assert all(set(m._packs) == {"int8-gemv"} for m in layers)
    else:
        assert layers[0]._plan.describe().startswith("int8-dynamic at every row count (rule: other processes used")
        assert all(m._packs == {} for m in layers)  # no second pack where fbgemm's serves every row


def test_bfloat16_and_int8_models_on_a_cpu_cache_in_the_dtype_its_attention_runs_fastest_in(monkeypatch):
    from nanogpt.kernels import decode_attention
    from nanogpt.runtime.precision import cache_dtype

    pays = decode_attention.bf16_attention_pays()  # measured here: either answer is this CPU's
    assert cache_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if pays else torch.float32)
    assert cache_dtype(torch.float32, "cpu", int8=True) == (torch.bfloat16 if pays else torch.float32)
    assert cache_dtype(torch.float32, "cpu") == torch.float32  # float32 stays exact, whatever pays
    assert cache_dtype(torch.bfloat16, "cuda") == torch.bfloat16  # GPU attention kernels run bf16 natively
    decode_attention.bf16_attention_pays.cache_clear()
    timed = []

    def attention_pass(dtype):  # bfloat16 as fast as float32: within the margin
        def attend():
            timed.append(dtype)
            time.sleep(0.002)  # long enough that the timer's noise cannot make either clearly faster
        return attend

    monkeypatch.setattr(decode_attention, "_attention_pass", attention_pass)
    try:
        assert cache_dtype(torch.bfloat16, "cpu") == torch.float32
        assert cache_dtype(torch.float32, "cpu", int8=True) == torch.float32
        assert set(timed) == {torch.float32, torch.bfloat16}
        decode_attention.bf16_attention_pays.cache_clear()
        monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # as if other processes had been busy
        monkeypatch.setattr(decode_attention, "_attention_pass",
                            lambda dtype: lambda: time.sleep(0.004 if dtype == torch.float32 else 0.0))
        assert cache_dtype(torch.bfloat16, "cpu") == torch.float32  # busy timings are not trusted
        decode_attention.bf16_attention_pays.cache_clear()
        monkeypatch.setattr(machine, "QUIET_CORES", math.inf)
        assert cache_dtype(torch.bfloat16, "cpu") == torch.bfloat16  # clearly faster in bfloat16
        assert cache_dtype(torch.float32, "cpu", int8=True) == torch.bfloat16
        assert cache_dtype(torch.float32, "cpu") == torch.float32
    finally:
        decode_attention.bf16_attention_pays.cache_clear()


def test_a_bfloat16_model_attends_alike_over_a_float32_and_a_bfloat16_cache(checkpoint):
    model = load_model(str(checkpoint), dtype=torch.bfloat16)
    reference = load_model(str(checkpoint), dtype=torch.bfloat16)
    tokens = torch.randint(0, 1000, (2, 9))
    ones, slots = torch.ones(2, dtype=torch.long), torch.arange(2)
    # the same forwards over a float32 cache and over a bfloat16 one: the keys and values are the
    # same bfloat16 numbers either way, only the attention's arithmetic is wider
    wide, narrow = KVCache(model.config, 2, 16, dtype=torch.float32), KVCache(model.config, 2, 16, dtype=torch.bfloat16)
    for cache, m in ((wide, model), (narrow, reference)):
        m.forward_cached(tokens[:, :8], torch.full((2,), 8), slots, torch.zeros(2, dtype=torch.long), cache)
    assert torch.equal(wide.k[0][:, :, :8], narrow.k[0][:, :, :8].float())  # the first layer: same inputs
    got = model.forward_cached(tokens[:, 8:], ones, slots, torch.full((2,), 8), wide)
    want = reference.forward_cached(tokens[:, 8:], ones, slots, torch.full((2,), 8), narrow)
    assert got.dtype == torch.float32
    assert_close(got, want, rtol=0.05, atol=0.05)  # bfloat16 rounding of the attention output
    with torch.no_grad():
        full, _ = model(tokens)  # the training forward, no cache: logits of the last position (2, 1, V)
    assert_close(got, full[:, -1].float(), rtol=0.05, atol=0.05)


def test_the_attention_timed_for_the_cache_dtype_is_what_a_decode_step_runs():
    """The project's kernel where it serves both dtypes (a compiled step's attention from
    decode_attention.ROWS rows), PyTorch's attention elsewhere; each pass attends over every
    layer's cache in turn and gives what the kernel computes."""
    from nanogpt.kernels import decode_attention

    rows, heads, positions, size = decode_attention.ATTENTION_SHAPE
    calls = []
    own = all(decode_attention.serves("cpu", d, size) for d in (torch.float32, torch.bfloat16))
    target = (decode_attention, "attend") if own else (decode_attention.F, "scaled_dot_product_attention")
    original = getattr(*target)

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(*target, counted)
        for dtype in (torch.float32, torch.bfloat16):
            outputs = decode_attention._attention_pass(dtype)()
            assert len(outputs) == decode_attention.ATTENTION_LAYERS and all(torch.isfinite(o.float()).all() for o in outputs)
    assert calls == [torch.float32] * decode_attention.ATTENTION_LAYERS + [torch.bfloat16] * decode_attention.ATTENTION_LAYERS


@pytest.mark.skipif("gemv" not in FLOAT_KERNELS, reason="the kernels cannot be built here")
def test_a_build_lock_left_by_a_killed_process_does_not_stop_the_next_start(tmp_path):
    """torch's build lock (`lock` in the build directory) stays behind when a process is killed
    while it loads the kernels; the next start loads them anyway instead of waiting forever."""
    import shutil
    import subprocess
    import sys

    from nanogpt.kernels import extension

    built = Path(extension.extension().__file__).parent
    copy = tmp_path / "extensions" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "nanoserve.lock"))
    (copy / "lock").write_text("")  # as a killed holder leaves it
    probe = "from nanogpt.kernels import extension; print(extension.available())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240,
                          env={**os.environ, extension.ENV: str(tmp_path / "extensions")})
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert not (copy / "lock").exists()


def test_the_compile_cache_has_a_directory_per_version_of_the_model_code(tmp_path, monkeypatch):
    from nanogpt.runtime import compile_cache

    code = tmp_path / "code"
    (code / "kernels").mkdir(parents=True)
    (code / "model.py").write_text("x = 1\n")
    (code / "kernels" / "k.cpp").write_text("int f();\n")
    first = compile_cache.code_key.__wrapped__(code)
    assert compile_cache.code_key.__wrapped__(code) == first  # the same sources, the same directory
    (code / "kernels" / "k.cpp").write_text("int g();\n")
    assert compile_cache.code_key.__wrapped__(code) != first
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "cache"))
    assert compile_cache.default_directory() == tmp_path / "cache" / compile_cache.code_key()


def test_a_gpu_layer_takes_the_activation_epilogue_only_where_it_computes_that_activation(monkeypatch):
    """nanogpt/kernels/epilogue.py: the self-check accepts the epilogue exactly where its GELU is the
    tanh one (a CPU's `torch._addmm_activation` may compute the erf GELU) and refuses a wrong one; no
    CPU layer is swapped; an EpilogueLinear's ReLU in the matmul is nn.Linear then ReLU, and it leaves
    to PyTorch what it has no epilogue for (the erf GELU, a residual, autograd)."""
    from nanogpt.kernels import epilogue

    probe, x2 = nn.Linear(64, 96), torch.randn(5, 64)
    with torch.no_grad():
        tanh_here = torch.allclose(torch._addmm_activation(probe.bias, x2, probe.weight.t(), use_gelu=True),
                                   nn.GELU(approximate="tanh")(probe(x2)), rtol=1e-5, atol=1e-5)
    epilogue.epilogues_work.cache_clear()
    assert epilogue.epilogues_work(torch.device("cpu"), torch.float32) == tanh_here
    monkeypatch.setattr(torch, "_addmm_activation", lambda bias, x, w, use_gelu: torch.addmm(bias, x, w))
    epilogue.epilogues_work.cache_clear()
    assert not epilogue.epilogues_work(torch.device("cpu"), torch.float32)  # no activation at all: refused
    monkeypatch.undo()
    epilogue.epilogues_work.cache_clear()
    assert epilogue.fuse_epilogues(nn.Sequential(nn.Linear(8, 8))) == 0  # no layer of a CPU's taken
    layer = nn.Linear(64, 96)
    layer.__class__ = epilogue.EpilogueLinear
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        want = torch.relu(nn.functional.linear(x, layer.weight, layer.bias))
        assert torch.allclose(layer.fused(x, nn.ReLU()), want, rtol=1e-5, atol=1e-5)
        assert layer.fused(x, nn.GELU()) is None and layer.fused(x, nn.ReLU(), residual=want) is None
    assert layer.fused(x, nn.ReLU()) is None  # autograd on
