"""The benchmark harness runs on a tiny model and produces well-formed results. Speed itself is
measured by `make bench`, never asserted here."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch

from bench import SHAPES, engine_bench, gateway_bench, loadgen, model_shape
from bench.machine import ForeignCpu, Gate, ceiling, fastest_kernels, measure, wait_until_quiet, workload_ceiling
from nanogpt.kernels import machine, matmuls
from nanogpt.runtime import precision
from tests.stack import start_gunicorn, start_processor, write_models_toml

NATIVE_BF16 = precision.has_native_bf16(machine.cpu_flags())
TINY = (2, 64, 50257)  # n_layer, n_embd, vocab_size of the hf_checkpoint fixture


@pytest.fixture(scope="module")
def limits() -> dict:  # times every kernel: the tests using it are marked slow
    return measure(quick=True, shape=TINY)


@pytest.mark.slow
def test_machine_limits_are_measured(limits):
    assert limits["matmul_gflops"] > 0 and limits["copy_gbps"] > 0
    assert set(limits["decode_matmul_gflops"]) == {1, 8}
    assert limits["cores"] >= 1 and limits["torch_threads"] >= 1
    assert limits["cpu"] == machine.cpu_name() and "avx2" in limits["cpu_flags"]  # every CPU seen has AVX2
    assert ("avx512_bf16" in limits["cpu_flags"]) == ("avx512_bf16" in machine.cpu_flags())


@pytest.mark.slow
def test_a_ceiling_per_precision_the_machine_runs_natively(limits):
    ceilings = limits["ceilings"]
    assert list(ceilings) == ["float32"] + (["bfloat16"] if NATIVE_BF16 else []) + ["int8"]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.qint8}
    for name, c in ceilings.items():
        assert set(c["kernels"]["head"]) == set(matmuls.available(dtypes[name]))  # every kernel, timed
        assert set(c["step_seconds"]) == {1, 8} and set(c["blocks_seconds"]) == {1, 8, 256}
        pytorch = [k for k in c["kernels"]["blocks"] if k not in matmuls.OWN]  # the ceiling is PyTorch's
        for rows, seconds in c["step_seconds"].items():
            fastest = c["fastest_kernel"][rows]
            assert fastest in pytorch
            assert seconds == min(c["kernels"]["blocks"][k][rows] for k in pytorch) \
                + min(c["kernels"]["head"][k][rows] for k in pytorch)
            assert c["kernels"]["blocks"][fastest][rows] + c["kernels"]["head"][fastest][rows] >= seconds > 0
            assert c["tokens_per_s"][rows] == rows / seconds


def test_a_workloads_ceiling_is_its_prefill_chunks_and_decode_steps():
    ceiling = {"blocks_seconds": {1: 1.0, 8: 2.0, 256: 64.0}, "head_seconds": {1: 0.5, 8: 1.0},
               "step_seconds": {1: 1.5, 8: 3.0}}
    # one 32-token prompt: blocks at the 8-row rate (the largest measured up to 32 rows), the head
    # once, then 63 steps of one row
    assert workload_ceiling(ceiling, 1, 32, 64) == 64 / (2.0 / 8 * 32 + 0.5 + 63 * 1.5)
    # 8 prompts: 256 prompt rows at the chunk's rate; 5 requests are held to the 8-row step
    assert workload_ceiling(ceiling, 8, 32, 64) == 8 * 64 / (64.0 + 1.0 + 63 * 3.0)
    assert workload_ceiling(ceiling, 5, 32, 64) == 5 * 64 / (64.0 / 256 * 160 + 1.0 + 63 * 3.0)


def test_a_ceiling_measured_again_times_only_the_kernels_found_fastest():
    known = {"fastest_kernel": {"1": "onednn", "8": "onednn", "32": "mkl"},
             "kernels": {"blocks": {"linear": {"1": 3.0, "256": 9.0}, "mkl": {"1": 2.0, "256": 4.0},
                                    "onednn": {"1": 1.0, "256": 5.0}}}}
    assert fastest_kernels(known, 1) == ["mkl", "onednn"]  # onednn for the step, mkl for a prefill chunk
    assert fastest_kernels(known, 32) == ["mkl"]
    assert fastest_kernels(known, 24) == ["mkl"]  # the nearest measured row count's
    again = ceiling("float32", (1, 64, 128), rows=(2,), prefill_rows=16, repeats=1, only=["linear"])
    assert list(again["kernels"]["blocks"]) == ["linear"] and again["tokens_per_s"][2] > 0


def test_other_processes_cpu_is_measured():
    probe = ForeignCpu().start()
    time.sleep(0.5)
    assert 0 <= probe.stop() <= os.cpu_count() + 0.2  # /proc/stat counts in 10 ms ticks
    assert wait_until_quiet(max_wait=0) == pytest.approx(0, abs=0.1)
    # a run disturbed by more than max_foreign cores is redone, up to `attempts` tries
    calls = []
    result = Gate(max_foreign=-1.0, attempts=2).measure(lambda: {"call": calls.append(1) or len(calls)})
    assert result["call"] == 2 and result["attempts"] == 2 and result["foreign_cores"] >= 0
    assert Gate(max_foreign=None).measure(lambda: {})["attempts"] == 1


@pytest.mark.slow
def test_engine_bench_runs_every_system_on_a_tiny_model(hf_checkpoint, limits, tmp_path):
    workload = engine_bench.Workload(prompt_tokens=8, new_tokens=4)
    systems = ["transformers", "engine", "serial"] + (["engine-bf16"] if NATIVE_BF16 else [])
    results = engine_bench.run_benchmark(hf_checkpoint, systems, [1, 3], 1, workload, limits=limits,
                                         log=lambda msg: None)

    summary = results["summary"]["by_system"]
    assert set(summary) == set(systems) and not results["unavailable"]
    for name, by_c in summary.items():
        assert set(by_c) == {1, 3}
        for c, row in by_c.items():
            run = results["runs"][name][str(c)][0]
            assert run["completion_tokens"] == c * 4  # EOS banned: every request runs to max_tokens
            assert len(run["ttft"]) == c and all(0 < t <= run["seconds"] for t in run["ttft"])
            assert row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0 and row["gflops"] > 0
            # each run held against its precision's ceiling measured again in its round (one repeat: one run)
            assert run["ceiling_tokens_per_s"] > 0 and row["ceiling_tokens_per_s"] == run["ceiling_tokens_per_s"]
            assert row["ceiling_fraction"] == pytest.approx(row["tokens_per_s"] / row["ceiling_tokens_per_s"])
            if name != "transformers":
                assert row["x_transformers"] > 0
        assert "copy_bandwidth_fraction" in by_c[1] and "copy_bandwidth_fraction" not in by_c[3]
    # float32 greedy decoding is exact: the engine's tokens are transformers' tokens
    agreement = results["summary"]["greedy_equals_transformers"]
    assert agreement["engine"] and agreement["serial"] and agreement["transformers"]
    targets = {(t["system"], t["over"], t["concurrency"]): t for t in results["summary"]["targets"]}
    assert set(targets) == {(system, over, c) for system, over, c, _ in engine_bench.TARGETS}  # each, measured or not
    assert targets["engine", "transformers", 1]["met"] is not None and targets["engine", "transformers", 8]["met"] is None
    # the fractions of each precision's ceiling, read from the rows measured
    ceiling = targets["engine", "ceiling", 1]
    wanted = engine_bench.CEILING_TARGETS["float32"][0]
    assert ceiling["target"] == wanted and ceiling["ratio"] == summary["engine"][1]["ceiling_fraction"]
    assert ceiling["met"] == (ceiling["ratio"] >= wanted)
    assert targets["engine-int8", "ceiling", 32]["target"] == engine_bench.CEILING_TARGETS["int8"][1]
    assert targets["engine", "ceiling", 8]["met"] is None
    if NATIVE_BF16:
        assert results["systems"]["engine-bf16"]["weight_bytes"] * 2 == results["systems"]["engine"]["weight_bytes"]

    table = engine_bench.markdown(results)
    over_transformers = targets["engine", "transformers", 1]["target"]
    assert "| 3 | serial |" in table and f"engine ≥ {over_transformers}× transformers at 1" in table
    assert f"engine ≥ {wanted} of its ceiling at 1" in table
    assert limits["cpu"] in table and "| float32 | onednn |" in table
    engine_bench.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["opt", "gpt_neo"])
def test_engine_bench_serves_other_families(family, family_checkpoints, limits):
    """The engine rows of GPT-Neo and OPT shapes: each family's own EOS is banned (OPT's is 2), and
    the engine's greedy tokens equal transformers' AutoModelForCausalLM's."""
    checkpoint = family_checkpoints[family]
    shape = model_shape(checkpoint)
    assert shape["eos"] == {"opt": 2, "gpt_neo": 50256}[family] and shape["n_layer"] == 2 and shape["n_embd"] == 64
    workload = engine_bench.Workload(prompt_tokens=8, new_tokens=4, eos=shape["eos"])
    results = engine_bench.run_benchmark(checkpoint, ["transformers", "engine"], [2], 1, workload, limits=limits,
                                         log=lambda msg: None)
    assert results["workload"]["model"] == family and not results["unavailable"]
    assert all(results["runs"][name]["2"][0]["completion_tokens"] == 8 for name in ("transformers", "engine"))
    assert results["summary"]["greedy_equals_transformers"]["engine"]


def test_benchmark_shapes_are_the_published_models():
    assert {name: (family, args.get("n_layer", args.get("num_layers", args.get("num_hidden_layers"))))
            for name, (family, args) in SHAPES.items()} == {
        "gpt2-small": ("gpt2", 12), "gpt2-xl": ("gpt2", 48), "tiny": ("gpt2", 2), "gpt-neo-125m": ("gpt_neo", 12),
        "opt-125m": ("opt", 12), "gpt-j-6b": ("gptj", 28)}
    assert SHAPES["opt-125m"][1]["ffn_dim"] == 4 * SHAPES["opt-125m"][1]["hidden_size"] == 3072
    import transformers

    with torch.device("meta"):  # GPT-J-6B's 6.05B parameters, counted without allocating them
        gptj = transformers.GPTJForCausalLM(transformers.GPTJConfig(**SHAPES["gpt-j-6b"][1]))
    assert round(sum(p.numel() for p in gptj.parameters()) / 1e9, 2) == 6.05


def test_rounds_repeat_a_concurrency_until_enough_requests_are_timed():
    from bench import rounds

    assert rounds([1, 8, 32], 2) == [(0, 1, 2), (0, 8, 2), (0, 32, 2), (1, 1, 2), (1, 8, 2), (1, 32, 2)]
    # 8 requests at least: one request a round takes 8 rounds, interleaved with the others while they last
    assert rounds([1, 8], 2, min_requests=8) == [(0, 1, 8), (0, 8, 2), (1, 1, 8), (1, 8, 2)] + [
        (r, 1, 8) for r in range(2, 8)]
    assert rounds([3], 1, min_requests=8) == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_a_large_shape_is_saved_in_bfloat16(tmp_path, monkeypatch):
    import json

    import bench
    from safetensors import safe_open

    monkeypatch.setitem(SHAPES, "gptj-small", ("gptj", dict(n_embd=64, n_layer=2, n_head=2, rotary_dim=16)))
    monkeypatch.setattr(bench, "BFLOAT16_SHAPES", {"gptj-small"})
    directory = bench.checkpoint("gptj-small", cache=tmp_path)
    assert json.loads((directory / "config.json").read_text())["n_layer"] == 2
    with safe_open(directory / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    assert model_shape(directory)["eos"] == 50256


def test_int8_and_compile_modes_are_the_engines(hf_checkpoint):
    """int8 is the engine's quantization (every Linear becomes a dynamically quantized one, and
    nothing else changes), compile its compile option; a mode the engine lacks is said missing."""
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels.quantize import quantize_int8
    from worker.engine import Engine

    assert engine_bench.engine_mode("int8") == (quantize_int8, {})
    model = quantize_int8(load_model(hf_checkpoint))
    quantized = [m for m in model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert len(quantized) == 2 * 4 + 1  # 4 a block and the LM head
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert model.dtype == torch.float32  # embeddings, LayerNorms and the KV cache stay float32

    assert engine_bench.engine_mode("compile") == (None, {"compile": True})
    assert inspect.signature(Engine.__init__).parameters["compile"].default is False
    with pytest.raises(engine_bench.NotAvailable, match="fp8"):
        engine_bench.engine_mode("fp8")
    # the systems that combine them: a precision and the compiled step
    run = engine_bench.build_system("engine-int8-compile", hf_checkpoint, engine_bench.Workload())
    assert run.options == {"compile": True} and run._source[3] is quantize_int8
    assert engine_bench.PRECISION["engine-int8-compile"] == "int8"
    assert engine_bench.PRECISION["engine-bf16-compile"] == "bfloat16"
    with pytest.raises(ValueError, match="engine-bf16-compile"):
        engine_bench.build_system("engine-fp8", hf_checkpoint, engine_bench.Workload())


def test_int8_weights_read_are_a_quarter_of_float32(hf_checkpoint):
    from nanogpt.checkpoint import load_model

    prepare, _ = engine_bench.engine_mode("int8")
    model = load_model(hf_checkpoint)
    fp32 = engine_bench.weight_bytes_per_step(model)
    int8 = engine_bench.weight_bytes_per_step(prepare(model))
    assert 0.24 * fp32 < int8 < 0.3 * fp32


def test_flops_of_gpt2_small():
    config = {"n_embd": 768, "n_layer": 12, "vocab_size": 50257}
    flops = engine_bench.flops_per_request(config, engine_bench.Workload(32, 64))
    # ≈ 0.25 GFLOP per token for 95 tokens through the blocks and 64 through the head
    assert 2 * 85e6 * 95 + 2 * 38.6e6 * 64 < flops < 1.05 * (2 * 85e6 * 95 + 2 * 38.6e6 * 64)


@pytest.mark.slow
def test_gateway_bench_runs_the_real_stack(hf_checkpoint, tmp_path):
    result = gateway_bench.run_benchmark(latency_requests=3, clients=2, requests_per_client=1, max_tokens=4,
                                         repeats=1, throughput_model="tiny", workdir=tmp_path,
                                         checkpoints={"tiny": hf_checkpoint}, log=lambda msg: None)
    latency, throughput = result["latency"], result["throughput"]
    assert latency["requests"] == 3
    assert latency["gateway_p50_ms"] > 0 and latency["engine_p50_ms"] > 0 and latency["http_floor_p50_ms"] > 0
    assert latency["overhead_p50_ms"] == latency["gateway_p50_ms"] - latency["engine_p50_ms"]
    for name in ("gateway", "engine"):
        (run,) = throughput["runs"][name]
        assert run["errors"] == 0 and run["completion_tokens"] == 2 * 4
    assert throughput["fraction"] > 0
    assert "≤ 15 ms" in gateway_bench.markdown(result)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinned puts the worker and the rest on different CPUs")
def test_gateway_bench_pinned_holds_the_stack_against_its_engine_with_the_worker_on_its_own_cpu(tmp_path):
    # a process of its own: pinned pins the process that runs it and sets its torch threads
    path = tmp_path / "pinned.json"
    # two repeats (their medians), each client sending two requests, the next as the last is answered
    subprocess.run([sys.executable, "-m", "bench.gateway_bench", "pinned", "--concurrency", "1,2", "--repeats", "2",
                    "--requests-per-client", "2", "--max-tokens", "4", "--json", str(path)], check=True,
                   cwd=Path(__file__).resolve().parent.parent, timeout=600)
    result = json.loads(path.read_text())
    assert result["cpu_engine"] == [min(os.sched_getaffinity(0))] and min(os.sched_getaffinity(0)) not in result["cpus_rest"]
    assert result["requests_per_client"] == 2
    for c in ("1", "2"):
        row, requests = result["by_concurrency"][c], 2 * int(c)
        assert len(row["stack_runs"]) == len(row["engine_runs"]) == 2
        for run in row["stack_runs"]:
            assert run["errors"] == 0 and run["requests"] == requests and run["completion_tokens"] == requests * 4
        assert row["ratio"] == row["stack_tokens_per_s"] / row["engine_tokens_per_s"] > 0
        assert set(row["cpu_ms_per_request"]) == {"worker", "web", "redis", "client"}
        assert all(ms > 0 for ms in row["cpu_ms_per_request"].values())
        # the engine's time in its steps, alone and in the worker (from its metrics), against the round's wall
        for engine in (row["engine_alone"], row["engine_in_stack"]):
            assert 0 < engine["busy_share"] <= 1 and engine["ms_per_forward"] > 0
            # each request's prompt and its 4 tokens: 4 forwards a client's request at least, a batch's shared
            assert engine["forwards_per_request"] * requests >= 4 * 2
            # and where a forward's time went, by the step's phases
            assert sum(engine["step_phase_ms"].values()) == pytest.approx(engine["ms_per_forward"], rel=0.05)


def test_pickup_bench_times_bursts_of_jobs_through_a_real_worker_pool():
    from bench import pickup_bench

    bursts = pickup_bench.burst_times(jobs=4, bursts=2, max_tokens=2)
    assert len(bursts) == 2
    for burst in bursts:  # every job reached the engine, then all finished
        assert 0 < burst["first_in_engine_ms"] <= burst["last_in_engine_ms"] < burst["all_finished_ms"]
        # the same jobs straight to the engine, and what the worker keeps of that
        assert burst["engine_alone_ms"] > 0
        assert burst["keeps"] == pytest.approx(burst["engine_alone_ms"] / burst["all_finished_ms"])


@pytest.mark.slow
def test_loadgen_streams_through_the_openai_client(hf_checkpoint, redis_url, tmp_path):
    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint}, device="cpu", max_batch=4)
    with start_processor(redis_url, models, concurrency=4, log_dir=tmp_path), \
            start_gunicorn(redis_url, models, env={"NANOSERVE_AUTH": "disabled"}, log_dir=tmp_path) as web:
        reports = loadgen.main(["--base-url", web.url + "/v1", "--model", "tiny", "--concurrency", "1,3",
                                "--requests-per-client", "2", "--max-tokens", "5", "--stream",
                                "--json", str(tmp_path / "load.json")])
        bad_model = loadgen.run(loadgen.openai_sender(web.url + "/v1", "nope"), [loadgen.completion_body(0)], 1)
    assert [r["concurrency"] for r in reports] == [1, 3]
    for r in reports:
        assert r["requests"] == 2 * r["concurrency"] and r["errors"] == 0
        assert r["completion_tokens"] == 5 * r["requests"]
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] and r["latency_p50_s"] <= r["latency_p99_s"]
    assert (tmp_path / "load.json").exists()
    assert bad_model["errors"] == 1 and "NotFoundError" in bad_model["first_error"]


def test_fidelity_compares_each_precision_with_float32(hf_checkpoint, tmp_path):
    import numpy as np

    from bench import fidelity
    from nanogpt.runtime.precision import cache_dtype

    np.random.default_rng(0).integers(0, 50257, 5000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    result = fidelity.measure(str(hf_checkpoint), tmp_path, ["int8"], count=4, prompts=3, prompt_tokens=5,
                              new_tokens=6)
    assert result["positions"] == 4 * 128  # windows of the model's context
    int8 = result["int8"]
    assert 0 < int8["kl_nats"] < 0.5 and 0 < int8["logprob_change_mean"] <= int8["logprob_change_p99"]
    assert 0.5 < int8["argmax_agreement"] <= 1 and int8["greedy_completions"] == 3
    assert abs(int8["heldout_loss"] - result["float32"]["heldout_loss"]) < 0.5
    # against itself a precision agrees everywhere
    model = fidelity.load(str(hf_checkpoint), "float32")
    batch = fidelity.windows(tmp_path, 2, 16)
    run = {"logprobs": fidelity.next_token_logprobs(model, batch), "targets": batch[:, 1:],
           "greedy": fidelity.greedy(model, batch[:, :4], 3)}
    same = fidelity.compare(run, run)
    assert same["kl_nats"] == 0 and same["argmax_agreement"] == 1 and same["greedy_identical"] == 2
    # served (a prefill, then decode steps over the cache), float32 computes what the full forward does
    full, _ = model(batch[:, :-1], batch[:, 1:])  # the training forward: logits at every position
    assert torch.allclose(run["logprobs"], torch.log_softmax(full, -1), atol=1e-4)
    greedy = batch[:, :4]
    for _ in range(3):
        greedy = torch.cat([greedy, model(greedy)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(run["greedy"], greedy[:, 4:])
    # each precision's keys and values in the dtype the worker caches them in on this CPU
    assert result["float32"]["kv_cache"] == "float32"
    assert int8["kv_cache"] == str(cache_dtype(torch.float32, "cpu", int8=True)).removeprefix("torch.")
    assert "| int8 |" in fidelity.markdown(result)


def test_structured_bench_measures_both_ways_alike(hf_checkpoint):
    from bench import structured_bench

    results = structured_bench.main(["--checkpoint", str(hf_checkpoint), "--requests", "1", "3", "--new", "6",
                                     "--repeats", "2"])
    assert [row["requests"] for row in results["rows"]] == [1, 3]
    for row in results["rows"]:
        assert all(len(runs) == 2 and min(runs) > 0 for runs in row["runs"].values())
        assert row["ratio"] == pytest.approx(row["json_schema_tokens_per_s"] / row["plain_tokens_per_s"], abs=0.01)


def test_prefix_bench_times_first_tokens_with_and_without_the_cache(hf_checkpoint):
    from bench import prefix_bench

    results = prefix_bench.main(["--checkpoint", str(hf_checkpoint), "--only", "ttft", "--prefix", "64",
                                 "--prompts", "3", "--repeats", "1"])
    ttft = results["ttft"]
    assert ttft["prefix_tokens"] == 64 and ttft["prompts"] == 3
    assert ttft["p50_ms_off"] > 0 and ttft["p50_ms_on"] > 0
    pairs = prefix_bench.task(questions=3, choices=4, shots=2)
    assert len(pairs) == 12 and len({context for context, _ in pairs}) == 3
    assert len({context.rsplit("Question:", 1)[0] for context, _ in pairs}) == 1  # the shots, shared


@pytest.mark.slow  # builds the CPU kernels in a directory of its own and compiles twice: minutes
def test_start_bench_times_the_first_completion_and_full_speed_both_ways(hf_checkpoint):
    from bench import start_bench

    results = start_bench.main(["--checkpoint", str(hf_checkpoint), "--skip-unbuilt"])
    rows = results["rows"]
    assert [(row["start"], row["compile"]) for row in rows] == [
        ("first start", "background"), ("warm", "background"), ("first start", "first"), ("warm", "first")]
    assert results["kernel_build_at_install_s"] > 0
    for row in rows:
        assert 0 < row["first_completion_s"] and row["full_speed_s"] > 0 and row["tpot_ms"] > 0
        assert "weights loaded" in row["phases"] and "decode step compiled" in row["phases"]
        assert "CPU kernels built" not in row["phases"]  # built ahead, as `make install` builds them
    background, _, first, _ = rows
    assert background["first_completion_s"] < background["full_speed_s"]  # served before its graphs were live
    assert first["first_completion_s"] >= first["full_speed_s"]  # compiled, then served
