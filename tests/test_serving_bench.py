"""The serving-load benchmark: a seeded Poisson schedule and consistent metrics from a real stack.
Speed itself is measured by `python -m bench.serving_bench`, never asserted here."""
from __future__ import annotations

import json
import statistics

import pytest

from bench import llama_cpp, serving_bench
from bench.serving_bench import Request, arrivals, workload

# lengths that fit the tiny checkpoint's 128 positions
SMALL = dict(prompt_tokens=(4, 40), new_tokens=(2, 12))


def test_arrivals_are_a_seeded_poisson_process():
    schedule = arrivals(20_000, rate=4.0, seed=3)
    assert schedule == arrivals(20_000, rate=4.0, seed=3)  # reproducible
    assert schedule != arrivals(20_000, rate=4.0, seed=4)
    assert schedule[0] == 0 and all(a < b for a, b in zip(schedule, schedule[1:]))
    gaps = [b - a for a, b in zip(schedule, schedule[1:])]
    # exponential gaps: mean 1 / rate, standard deviation equal to the mean
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)
    # each rate draws its own gaps
    assert arrivals(50, rate=2.0, seed=3) != [2 * t for t in arrivals(50, rate=4.0, seed=3)]


def test_workload_lengths_are_seeded_and_uniform_in_their_ranges():
    requests = workload(4000, seed=1)
    assert requests == workload(4000, seed=1) and requests != workload(4000, seed=2)
    assert [r.index for r in requests] == list(range(4000))
    prompts, outputs = [r.prompt_tokens for r in requests], [r.max_tokens for r in requests]
    assert min(prompts) == 16 and max(prompts) == 384 and min(outputs) == 16 and max(outputs) == 128
    assert statistics.fmean(prompts) == pytest.approx(200, rel=0.03)
    assert statistics.fmean(outputs) == pytest.approx(72, rel=0.03)


@pytest.mark.slow
def test_serving_bench_runs_the_real_stack(hf_checkpoint, tmp_path):
    requests = workload(6, seed=0, **SMALL)
    rates = [50.0, 20.0]  # faster than the stack answers: requests overlap
    results = serving_bench.run_benchmark(["nanoserve:float32"], "tiny", requests, rates, model_dir=hf_checkpoint,
                                          max_concurrency=4, log=lambda msg: None)
    reports = results["servers"]["nanoserve:float32"]
    assert [r["rate"] for r in reports] == rates
    for report in reports:
        assert report["completed"] == report["requests"] == 6 and report["errors"] == 0
        assert report["usage_reported"] and report["wrong_length"] == 0
        samples = report["samples"]
        # every request got exactly the tokens it asked for, counted by the server's usage
        assert [s["completion_tokens"] for s in samples] == [r.max_tokens for r in requests]
        assert report["completion_tokens"] == sum(r.max_tokens for r in requests)
        # sent on the rate's Poisson schedule (threads start a little late, never early)
        schedule = arrivals(6, report["rate"], seed=0)
        assert all(due <= s["sent_s"] < due + 0.5 for due, s in zip(schedule, samples))
        for s in samples:
            assert 0 < s["ttft_s"] <= s["e2e_s"] and 1 <= s["chunks"] <= s["completion_tokens"]
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert 0 <= report[f"{metric}_p50_s"] <= report[f"{metric}_p99_s"]
        assert report["ttft_p99_s"] <= report["e2e_p99_s"] and report["tpot_p50_s"] <= report["e2e_p50_s"]
        assert report["e2e_p99_s"] == max(s["e2e_s"] for s in samples)  # nearest rank of 6
        # the run lasts from the first arrival to the last answer
        assert report["duration_s"] == max(s["sent_s"] + s["e2e_s"] for s in samples)
        assert report["duration_s"] >= schedule[-1]
        assert report["output_throughput"] == report["completion_tokens"] / report["duration_s"]
        assert report["request_throughput"] == 6 / report["duration_s"]
    assert serving_bench.arrivals(5, 1) == serving_bench.arrivals(5, 1.0)  # a rate typed either way
    # the single-sequence step the TPOTs are held against: requests alone, of the workload's mean lengths
    alone = results["solo"]["nanoserve:float32"]
    assert alone["prompt_tokens"] == int(statistics.fmean(r.prompt_tokens for r in requests))
    assert alone["max_tokens"] == int(statistics.fmean(r.max_tokens for r in requests))
    assert len(alone["tpot_s"]) == serving_bench.SOLO_REQUESTS and all(t > 0 for t in alone["tpot_s"])
    assert alone["tpot_median_s"] == sorted(alone["tpot_s"])[serving_bench.SOLO_REQUESTS // 2]

    table = serving_bench.markdown(results)
    assert table.count("| nanoserve:float32 |") == 2 and results["cpu"] in table
    ratio = reports[0]["tpot_p99_s"] / alone["tpot_median_s"]
    assert f"| {ratio:.1f}x |" in table and "alone (one request at a time" in table
    serving_bench.plot(results, tmp_path / "serving.png")
    assert (tmp_path / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(results)  # the results are plain JSON


def test_a_failed_request_is_counted_not_hidden():
    """A failed request counts as an error and adds nothing to the latencies; the run still lasts
    until it ended."""
    from bench.loadgen import Sample

    requests = [Request(0, 5, 3), Request(1, 6, 4)]
    samples = [Sample(0.5, 3, 0.1, chunk_times=[0.1, 0.3, 0.5], usage_reported=True),
               Sample(0.2, 0, error="NotFoundError: no such model")]
    report = serving_bench.report(requests, [0.0, 0.4], samples, rate=1.0)
    assert report["completed"] == 1 and report["errors"] == 1 and "NotFoundError" in report["first_error"]
    assert report["duration_s"] == pytest.approx(0.6) and report["completion_tokens"] == 3
    assert report["e2e_p99_s"] == 0.5 and report["ttft_p99_s"] == 0.1
    assert report["tpot_p50_s"] == pytest.approx(0.2) and report["itl_p99_s"] == pytest.approx(0.2)
    assert report["wrong_length"] == 0


def test_llama_cpp_converts_to_the_compared_precisions_only():
    with pytest.raises(ValueError, match="q4"):
        llama_cpp.convert(llama_cpp.ROOT, "q4_0")


@pytest.mark.skipif(not llama_cpp.SERVER.exists(),
                    reason="llama-server not built here (python -m bench.llama_cpp build: ~10+ minutes)")
def test_serving_bench_against_llama_server(hf_checkpoint):
    """The same client and requests against llama.cpp's server, on the tiny checkpoint converted."""
    requests = workload(4, seed=0, **SMALL)
    results = serving_bench.run_benchmark(["llama.cpp:f32"], "tiny", requests, [50.0], model_dir=hf_checkpoint,
                                          max_concurrency=4, log=lambda msg: None)
    (report,) = results["servers"]["llama.cpp:f32"]
    assert report["completed"] == 4 and report["usage_reported"] and report["wrong_length"] == 0
    assert 0 < report["ttft_p50_s"] <= report["e2e_p50_s"] <= report["e2e_p99_s"]
