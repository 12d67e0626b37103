"""The precision a model runs in (nanogpt/runtime/precision.py): bfloat16 on CPUs with native bf16 only,
and a worker that says so once when it runs slower than its hardware could. The CPU's flags are
passed in, so both sides of every choice are tested on any machine."""
from __future__ import annotations

import logging
import math

import pytest
import torch

import processor
from models.registry import ModelSpec
from nanogpt.kernels import machine
from nanogpt.kernels.quantize import is_int8
from nanogpt.runtime import precision
from nanogpt.runtime.precision import cache_dtype
from worker.protocol import CompletionJob

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_VNNI = AVX2 | {"avx512f", "avx512_vnni"}  # an AVX-512 + VNNI Xeon without bf16
ZEN4 = AVX512_VNNI | {"avx512_bf16"}  # AVX-512 with native bf16
SAPPHIRE_RAPIDS = AVX512_VNNI | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags", [ZEN4, SAPPHIRE_RAPIDS])
def test_bfloat16_runs_bfloat16_on_a_cpu_with_native_bf16(flags):
    chosen = precision.choose("bfloat16", "cpu", flags)
    assert (chosen.name, chosen.dtype, chosen.int8, chosen.note) == ("bfloat16", torch.bfloat16, False, None)


@pytest.mark.parametrize("flags", [AVX2, AVX512_VNNI])
def test_bfloat16_runs_float32_on_a_cpu_without_and_says_why(flags):
    chosen = precision.choose("bfloat16", "cpu", flags)
    assert (chosen.name, chosen.dtype) == ("float32", torch.float32)
    assert "running float32" in chosen.note and "avx512_bf16" in chosen.note


def test_the_other_dtypes():
    assert precision.choose("float32", "cpu", ZEN4) == precision.Precision("float32", torch.float32)
    assert precision.choose("int8", "cpu", AVX2) == precision.Precision("int8", torch.float32, int8=True)
    float16 = precision.choose("float16", "cpu", SAPPHIRE_RAPIDS)
    assert float16.dtype == torch.float32 and "float16" in float16.note


@pytest.mark.parametrize("flags", [AVX2, AVX512_VNNI, ZEN4, SAPPHIRE_RAPIDS], ids=["avx2", "vnni", "zen4", "spr"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_runs_the_precision_asked_whatever_its_host_cpu(flags, device):
    for name in ("float32", "bfloat16", "float16"):
        chosen = precision.choose(name, device, flags)
        assert chosen == precision.Precision(name, getattr(torch, name))  # no note: nothing was replaced
        assert precision.faster_options(chosen, device, flags) == []  # the CPU's modes are no GPU's


def test_int8_on_a_gpu_is_refused_with_the_reason_before_anything_loads(tmp_path):
    """The worker exits naming the model and why; the engine benchmark calls the system not
    available. The checkpoint does not exist, so a load tried first would fail differently."""
    from bench import engine_bench

    with pytest.raises(ValueError, match="int8 runs on the CPU only, not on cuda:0"):
        precision.choose("int8", "cuda:0", ZEN4)
    spec = ModelSpec(id="tiny", checkpoint=str(tmp_path / "missing"), device="cuda:0", dtype="int8", max_batch=2)
    with pytest.raises(SystemExit, match="model `tiny`: dtype int8 runs on the CPU only, not on cuda:0"):
        processor.build_engine(spec, "cuda:0", None)
    with pytest.raises(engine_bench.NotAvailable, match="int8 runs on the CPU only, not on cuda"):
        engine_bench.build_system("engine-int8", tmp_path / "missing", engine_bench.Workload(), device="cuda")


def test_faster_options_are_what_the_cpu_runs_natively():
    f32 = precision.Precision("float32", torch.float32)
    assert precision.faster_options(f32, "cpu", ZEN4) == ["bfloat16", "int8"]
    assert precision.faster_options(f32, "cpu", AVX512_VNNI) == ["int8"]
    assert precision.faster_options(f32, "cpu", AVX2) == ["int8"]  # fbgemm's AVX2 kernels: 2.4-3.0x float32
    assert precision.faster_options(f32, "cpu", {"sse4_2"}) == []  # fbgemm has no int8 kernels there
    assert precision.faster_options(precision.choose("bfloat16", "cpu", ZEN4), "cpu", ZEN4) == []
    assert precision.faster_options(f32, "cuda:0", ZEN4) == []


def test_the_flags_read_agree_with_what_torch_detects():
    flags = machine.cpu_flags()
    assert ("avx2" in flags) == torch.cpu._is_avx2_supported()
    assert precision.has_native_bf16(flags) == (torch.cpu._is_avx512_bf16_supported() or "amx_bf16" in flags)
    assert machine.cpu_name()


@pytest.fixture()
def spec(hf_checkpoint):
    return lambda dtype: ModelSpec(id="tiny", checkpoint=str(hf_checkpoint), device="cpu", dtype=dtype, max_batch=2)


def run_one(engine) -> str:
    try:
        job = CompletionJob(id="j", model="tiny", prompts=[[464, 3290, 318]], max_tokens=4, temperature=0.0, seed=0)
        return engine.generate(job)["choices"][0]["text"]
    finally:
        engine.stop()


def test_a_worker_asked_for_bfloat16_on_a_cpu_without_runs_float32_and_logs_it(spec, monkeypatch, caplog):
    monkeypatch.setattr(machine, "cpu_flags", lambda: AVX2)
    with caplog.at_level(logging.INFO, logger="processor"):
        engine = processor.build_engine(spec("bfloat16"), "cpu", None)
    assert engine.runner.model.dtype == torch.float32 and run_one(engine)
    notes = [r for r in caplog.records if "running float32" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert [r.dtype for r in caplog.records if r.getMessage() == "engine ready"] == ["float32"]


@pytest.mark.skipif(not precision.has_native_bf16(machine.cpu_flags()), reason="this CPU has no native bf16")
def test_a_worker_asked_for_bfloat16_on_a_cpu_with_native_bf16_runs_it(spec, caplog):
    with caplog.at_level(logging.INFO, logger="processor"):
        engine = processor.build_engine(spec("bfloat16"), "cpu", None)
    # the weights and activations in bfloat16; keys and values cached and attended in the dtype
    # this CPU's attention runs fastest in (precision.cache_dtype), which the log names
    cached = engine.runner.cache.k[0].dtype
    assert engine.runner.model.dtype == torch.bfloat16 and cached == cache_dtype(torch.bfloat16, "cpu")
    assert run_one(engine)
    ready = [r for r in caplog.records if r.getMessage() == "engine ready"]
    assert [(r.dtype, r.kv_cache) for r in ready] == [("bfloat16", str(cached).removeprefix("torch."))]
    assert not [r for r in caplog.records if "running float32" in r.getMessage()]


def test_an_int8_worker_caches_in_the_dtype_its_attention_runs_fastest_in(spec, caplog):
    with caplog.at_level(logging.INFO, logger="processor"):
        engine = processor.build_engine(spec("int8"), "cpu", None)
    # float32 activations around int8 matmuls; keys and values cached and attended in bfloat16 where
    # this CPU's attention runs clearly faster in it (precision.cache_dtype), else float32
    model, cached = engine.runner.model, engine.runner.cache.k[0].dtype
    assert model.dtype == torch.float32 and is_int8(model)
    assert cached == cache_dtype(torch.float32, "cpu", int8=True)
    assert run_one(engine)
    ready = [r for r in caplog.records if r.getMessage() == "engine ready"]
    assert [(r.dtype, r.kv_cache) for r in ready] == [("int8", str(cached).removeprefix("torch."))]


def test_a_float32_worker_on_a_cpu_with_faster_modes_says_so_once(spec, monkeypatch, caplog):
    from nanogpt.kernels import planner

    monkeypatch.setattr(machine, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(machine, "QUIET_CORES", math.inf)  # measured whatever else runs
    monkeypatch.setattr(planner, "_plans", {})  # not one an earlier test measured
    with caplog.at_level(logging.INFO, logger="processor"):
        run_one(processor.build_engine(spec("float32"), "cpu", None))
    (advice,) = [r for r in caplog.records if getattr(r, "faster_dtypes", None)]
    assert set(advice.faster_dtypes) == {"bfloat16", "int8"} and "measured just now" in advice.getMessage()
    assert all(set(f) == {1, 8} and all(x > 0 for x in f.values()) for f in advice.faster_dtypes.values())
    (ready,) = [r for r in caplog.records if r.getMessage() == "engine ready"]
    assert ready.kernels.startswith("float32: ") and ready.kernels.endswith("(measured)")

    monkeypatch.setattr(machine, "QUIET_CORES", -1.0)  # a busy machine: said, not measured
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="processor"):
        run_one(processor.build_engine(spec("float32"), "cpu", None))
    (advice,) = [r for r in caplog.records if getattr(r, "faster_dtypes", None)]
    assert advice.faster_dtypes == {"bfloat16": None, "int8": None} and "not measured" in advice.getMessage()

    monkeypatch.setattr(machine, "cpu_flags", lambda: AVX2)  # fbgemm's int8 kernels, no bf16
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="processor"):
        run_one(processor.build_engine(spec("float32"), "cpu", None))
    (advice,) = [r for r in caplog.records if getattr(r, "faster_dtypes", None)]
    assert set(advice.faster_dtypes) == {"int8"}

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"sse4_2"}))  # neither
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="processor"):
        run_one(processor.build_engine(spec("float32"), "cpu", None))
    assert not [r for r in caplog.records if getattr(r, "faster_dtypes", None)]


def test_the_decode_step_is_compiled_by_default_where_it_was_measured_to_pay(monkeypatch):
    from nanogpt.runtime.compile import COMPILED_ON_CPU, compiles_by_default

    monkeypatch.setenv("CXX", "sh")  # a program every machine has, standing for the C++ compiler
    assert COMPILED_ON_CPU and all(compiles_by_default("cpu", precision) for precision in COMPILED_ON_CPU)
    assert not compiles_by_default("cpu", "float16")
    assert not compiles_by_default("cuda:0", "float32") and not compiles_by_default("cuda", "bfloat16")
    monkeypatch.setenv("CXX", "no-such-compiler-here")  # inductor could build no kernel: run eagerly
    assert not compiles_by_default("cpu", "float32")
