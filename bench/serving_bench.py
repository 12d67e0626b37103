"""A serving load: random requests arriving as a Poisson process, against any OpenAI-compatible server.

    python -m bench.serving_bench [--server nanoserve:float32,llama.cpp:f32,...] [--model gpt2-small]
                                  [--rates 0.5,1,2] [--requests 48] [--seed 0] [--max-concurrency 16]
                                  [--device cpu|cuda]
                                  [--json PATH] [--markdown PATH] [--plot PATH]
    python -m bench.serving_bench --server http://127.0.0.1:8080/v1 --model-name NAME   # any server

The workload, as vLLM's serving benchmark draws it: N requests (default 48), each with a prompt
length uniform in [16, 384] tokens and a number of new tokens uniform in [16, 128], drawn from
`--seed`; they arrive as a Poisson process at each `--rates` value (requests/s; exponential gaps,
also seeded, the first at time 0), each on its own thread, whether or not earlier ones are done.
Prompts are token-id lists (`prompt: [ids]`, request i's random GPT-2 ids from bench.prompt_ids,
never EOS), which nanoserve and llama.cpp's llama-server both take as is, so every server sees
exactly the asked prompt length with no tokenizer in between; each rate gets prompts of its own
(same lengths), so no server answers from a prompt cache filled by the rate before. Every request
streams (`stream_options.include_usage`), greedy, with EOS banned (`logit_bias {"50256": -100}`) so
that it generates exactly `max_tokens`; the completion tokens come from the server's usage, and a
request that got fewer or more than it asked counts as `wrong_length`.

Per rate (the definitions of vLLM's benchmark_serving):
- TTFT: time to the first chunk carrying text, from the request's arrival;
- TPOT: (end-to-end - TTFT) / (completion tokens - 1), per request;
- ITL: the gaps between successive text chunks, all requests' pooled;
- E2E: end-to-end latency of the request;
- TPOT p99 / alone: against the server's single-sequence decode step, the median TPOT of requests
  of the workload's mean lengths sent one at a time before the rates (`solo`);
- p50 and p99 of each (nearest rank), request throughput (completed requests / duration) and output
  token throughput (completion tokens / duration), where the duration runs from the first arrival
  to the last request's end.

Servers: `nanoserve:DTYPE` starts nanoserve's whole stack (a private Redis, `processor.py`, gunicorn:
bench.gateway_bench.stack) on the random-weight checkpoint of `--model` with `dtype = DTYPE`
(float32, bfloat16 or int8), `max_batch` = `--max-concurrency` and `device` = `--device` (default
the CPU), its worker compiling the decode
step where it does by default (`nanoserve:DTYPE+compile` or `+eager`: started with `--compile` or
`--no-compile`); `llama.cpp:PRECISION` starts
llama.cpp's `llama-server` (bench/llama_cpp.py: built once from source) on the same checkpoint
converted to GGUF (f32, f16 or q8_0) with `--parallel` = `--max-concurrency` slots; a URL is a
server already running (ask it for `--model-name`). Several servers run one after another in the same invocation, each through every rate, with the same
client and requests. Results go to JSON, a markdown table (stdout) and a plot.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from bench import checkpoint, output_arguments, save_figure, write_results
from bench.loadgen import Sample, Send, completion_body, openai_sender, percentile

PROMPT_TOKENS = (16, 384)
NEW_TOKENS = (16, 128)
PERCENTILES = (50, 99)
# The single-sequence decode step a server's TPOT is held against: requests sent one at a time, alone
# on the server, with the workload's mean lengths (their median TPOT).
SOLO_REQUESTS = 5


@dataclass(frozen=True)
class Request:
    index: int
    prompt_tokens: int
    max_tokens: int


def workload(requests: int, seed: int = 0, prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
             new_tokens: tuple[int, int] = NEW_TOKENS) -> list[Request]:
    """The requests' lengths, uniform in the given inclusive ranges; a seed always draws the same."""
    rng = random.Random(f"workload-{seed}")
    return [Request(i, rng.randint(*prompt_tokens), rng.randint(*new_tokens)) for i in range(requests)]


def arrivals(requests: int, rate: float, seed: int = 0) -> list[float]:
    """When each request arrives (seconds from the first, which comes at 0): a Poisson process of
    `rate` requests per second, i.e. independent exponential gaps of mean 1 / rate, drawn from
    (seed, rate)."""
    rng = random.Random(f"arrivals-{seed}-{float(rate)}")  # 1 and 1.0: one schedule
    times, t = [], 0.0
    for _ in range(requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def run_rate(send: Send, requests: list[Request], rate: float, *, seed: int = 0, prompt_offset: int = 0,
             logit_bias: dict | None = None) -> dict:
    """Send every request at its Poisson arrival time, each on a thread of its own; the rate's report.
    Request i's prompt is prompt_ids(prompt_offset + i): another offset, other prompts."""
    schedule = arrivals(len(requests), rate, seed)
    bodies = [completion_body(prompt_offset + r.index, r.prompt_tokens, r.max_tokens, logit_bias) for r in requests]
    samples: list[Sample | None] = [None] * len(requests)

    def fire(i: int) -> None:
        samples[i] = send(bodies[i])

    threads = []
    start = time.perf_counter()
    for i, due in enumerate(schedule):
        delay = start + due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=fire, args=(i,), name=f"serving-{i}")
        thread.start()
        threads.append((thread, time.perf_counter() - start))  # the actual send time
    for thread, _ in threads:
        thread.join()
    sent = [t for _, t in threads]
    return report(requests, sent, samples, rate)


def tpot_of(sample: Sample) -> float:
    """Time per output token after the first: (end-to-end - TTFT) / (completion tokens - 1)."""
    return (sample.latency - sample.ttft) / (sample.completion_tokens - 1)


def report(requests: list[Request], sent: list[float], samples: list[Sample], rate: float) -> dict:
    """The rate's metrics from each request's send time (seconds from the first) and sample."""
    ok = [(r, s) for r, s in zip(requests, samples) if s.error is None]
    duration = max(t + s.latency for t, s in zip(sent, samples))
    ttft = [s.ttft for _, s in ok if s.ttft is not None]
    tpot = [tpot_of(s) for _, s in ok if s.ttft is not None and s.completion_tokens > 1]
    itl = [b - a for _, s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    e2e = [s.latency for _, s in ok]
    tokens = sum(s.completion_tokens for _, s in ok)
    out = {"rate": rate, "requests": len(requests), "completed": len(ok), "errors": len(samples) - len(ok),
           "first_error": next((s.error for s in samples if s.error), None),
           "wrong_length": sum(s.completion_tokens != r.max_tokens for r, s in ok),
           "usage_reported": all(s.usage_reported for _, s in ok),
           "duration_s": duration, "completion_tokens": tokens,
           "prompt_tokens": sum(r.prompt_tokens for r, _ in ok),
           "request_throughput": len(ok) / duration, "output_throughput": tokens / duration}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in PERCENTILES:
            out[f"{name}_p{q}_s"] = percentile(values, q)
    out["samples"] = [{"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "sent_s": t,
                       "completion_tokens": s.completion_tokens, "ttft_s": s.ttft, "e2e_s": s.latency,
                       "chunks": len(s.chunk_times), "error": s.error}
                      for r, t, s in zip(requests, sent, samples)]
    return out


def solo(send: Send, requests: list[Request], logit_bias=None) -> dict:
    """The server's single-sequence decode step: SOLO_REQUESTS requests one after another, each alone,
    with the workload's mean prompt length and mean new tokens (rounded down: within the longest
    request's context); their TPOTs and median."""
    length = sum(r.prompt_tokens for r in requests) // len(requests)
    new_tokens = max(2, sum(r.max_tokens for r in requests) // len(requests))
    tpots = []
    for i in range(SOLO_REQUESTS):
        s = send(completion_body(-1_000 - i, length, new_tokens, logit_bias))
        if s.error or s.ttft is None or s.completion_tokens < 2:
            raise RuntimeError(f"solo request failed: {s.error or 'no tokens streamed'}")
        tpots.append(tpot_of(s))
    return {"prompt_tokens": length, "max_tokens": new_tokens, "tpot_s": tpots,
            "tpot_median_s": percentile(tpots, 50)}


def sweep(send: Send, requests: list[Request], rates: list[float], *, seed: int = 0, logit_bias=None,
          gate=None, log=print) -> tuple[list[dict], dict]:
    """One run per rate against one server, after warm-up requests at both prompt-length extremes
    and the single-sequence run (`solo`); (the rates' reports, the solo run)."""
    from bench.machine import Gate

    gate = gate or Gate()
    for length in (min(r.prompt_tokens for r in requests), max(r.prompt_tokens for r in requests)):
        warm = send(completion_body(-1 - length, length, 4, logit_bias))
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    alone = solo(send, requests, logit_bias)
    log(f"alone: TPOT median {_ms(alone['tpot_median_s'])} ({len(alone['tpot_s'])} requests of "
        f"{alone['prompt_tokens']} + {alone['max_tokens']} tokens)")
    reports = []
    for position, rate in enumerate(rates):
        r = gate.measure(lambda: run_rate(send, requests, rate, seed=seed, prompt_offset=(position + 1) * 100_000,
                                          logit_bias=logit_bias))
        reports.append(r)
        log(f"rate {rate:g}/s: {r['completed']}/{r['requests']} done in {r['duration_s']:.1f} s, "
            f"{r['output_throughput']:.1f} tok/s, TTFT p50 {_ms(r['ttft_p50_s'])} p99 {_ms(r['ttft_p99_s'])}, "
            f"TPOT p50 {_ms(r['tpot_p50_s'])} p99 {_ms(r['tpot_p99_s'])}, E2E p50 {_s(r['e2e_p50_s'])}, "
            f"wrong length {r['wrong_length']}, others {r['foreign_cores']:.2f} cores, "
            f"TPOT p99 {r['tpot_p99_s'] / alone['tpot_median_s']:.1f}x alone")
    return reports, alone


# ---- the servers -----------------------------------------------------------------------------

# `nanoserve:DTYPE+MODE`: the worker's decode step by default, compiled, or eager
COMPILE_MODES = {"": None, "compile": True, "eager": False}


def served_models(model_dir: Path, model: str, dtype: str, max_concurrency: int, context_length: int,
                  workdir: Path, device: str = "cpu") -> Path:
    """The registry `nanoserve` serves from: `model_dir` as `model`, in `dtype` on `device`, with
    `max_concurrency` KV-cache slots of `context_length` positions (workdir/models.toml)."""
    from tests.stack import write_models_toml

    return write_models_toml(workdir / "models.toml", {model: model_dir}, device=device, dtype=dtype,
                             max_batch=max_concurrency, context_length=context_length)


@contextmanager
def nanoserve(model_dir: Path, model: str, dtype: str, max_concurrency: int, context_length: int,
              workdir: Path, compile: bool | None = None, device: str = "cpu", web_workers: int = 2,
              worker_args: Sequence[str] = ()):
    """nanoserve's whole stack serving `model_dir` as `model` in `dtype` on `device` (with the decode
    step compiled or not by `compile`, None: the worker's default; `web_workers` gunicorn processes;
    `worker_args`: processor.py's further options); yields its web service (`.url`; `.info` names
    Redis's URL and the worker's pid)."""
    from bench.gateway_bench import stack

    models_file = served_models(model_dir, model, dtype, max_concurrency, context_length, workdir, device)
    with stack(models_file, workdir, concurrency=max_concurrency, compile=compile, web_workers=web_workers,
               worker_args=worker_args) as web:
        yield web


@contextmanager
def server(spec: str, model: str, max_concurrency: int, context_length: int, workdir: Path,
           model_dir: Path | None = None, device: str = "cpu") -> Iterator[str]:
    """The server a `--server` item names, serving `model_dir` (default: the random-weight checkpoint
    of shape `model`) as `model`: `nanoserve:DTYPE` (on `device`) or `llama.cpp:PRECISION` (started
    here, stopped after), or the base URL of one already running. Yields its base URL."""
    kind, _, precision = spec.partition(":")
    if spec.startswith(("http://", "https://")):
        yield spec
        return
    model_dir = model_dir or checkpoint(model)
    if kind == "nanoserve":
        dtype, _, option = precision.partition("+")
        if option not in COMPILE_MODES:
            raise ValueError(f"unknown nanoserve option {option!r} in {spec!r}: +compile or +eager")
        with nanoserve(model_dir, model, dtype or "float32", max_concurrency, context_length, workdir,
                       compile=COMPILE_MODES[option], device=device) as web:
            yield web.url + "/v1"
    elif kind == "llama.cpp":
        from bench import llama_cpp

        gguf = llama_cpp.convert(model_dir, precision or "f32")
        with llama_cpp.llama_server(gguf, slots=max_concurrency, slot_context=context_length, alias=model,
                                    log_dir=workdir) as url:
            yield url
    else:
        raise ValueError(f"unknown server {spec!r}: nanoserve:DTYPE, llama.cpp:PRECISION or a base URL")


def run_benchmark(servers: list[str], model: str, requests: list[Request], rates: list[float], *,
                  model_name: str | None = None, model_dir: Path | None = None, seed: int = 0,
                  max_concurrency: int = 16, device: str = "cpu", gate=None, log=print) -> dict:
    """Every server in turn through every rate, with the same client and requests (asking for
    `model_name`, default `model`; the servers started here serve `model_dir`, default the
    random-weight checkpoint of shape `model`)."""
    from bench.machine import cpu_flags
    from nanogpt.kernels.machine import cpu_name

    context_length = max(r.prompt_tokens + r.max_tokens for r in requests)
    results = {"model": model, "rates": rates, "seed": seed, "max_concurrency": max_concurrency,
               "workload": _describe(requests), "servers": {}, "solo": {}, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
               "cores": os.cpu_count(), "load_average_before": os.getloadavg()}
    for spec in servers:
        log(f"== {spec}")
        with tempfile.TemporaryDirectory(prefix="nanoserve-serving-bench-") as tmp, \
                server(spec, model, max_concurrency, context_length, Path(tmp), model_dir, device) as base_url:
            send = openai_sender(base_url, model_name or model, stream=True)
            results["servers"][spec], results["solo"][spec] = sweep(send, requests, rates, seed=seed, gate=gate,
                                                                    log=log)
    results["load_average_after"] = os.getloadavg()
    return results


def _describe(requests: list[Request]) -> dict:
    return {"requests": len(requests), "prompt_tokens": [r.prompt_tokens for r in requests],
            "max_tokens": [r.max_tokens for r in requests]}


# ---- output ----------------------------------------------------------------------------------

def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.0f}" if seconds >= 0.1 else f"{1000 * seconds:.1f}"


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.2f}"


def markdown(results: dict) -> str:
    lines = ["| server | rate (req/s) | req/s done | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "TPOT p99 / alone | ITL p50 / p99 (ms) | E2E p50 / p99 (s) | errors | wrong length | others' cores |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    solo_tpot = {spec: run["tpot_median_s"] for spec, run in results.get("solo", {}).items()}
    for rate_index, rate in enumerate(results["rates"]):
        for spec, reports in results["servers"].items():
            r = reports[rate_index]
            alone = f"{r['tpot_p99_s'] / solo_tpot[spec]:.1f}x" if spec in solo_tpot and r["tpot_p99_s"] else "–"
            lines.append(
                f"| {spec} | {rate:g} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} | {_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p99_s'])} | {alone} | "
                f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])} | {_s(r['e2e_p50_s'])} / {_s(r['e2e_p99_s'])} | "
                f"{r['errors']} | {r['wrong_length']} | {r.get('foreign_cores', 0):.2f} |")
    w = results["workload"]
    lines += ["", f"{w['requests']} requests per rate, prompts {min(w['prompt_tokens'])}–{max(w['prompt_tokens'])} "
              f"tokens (mean {sum(w['prompt_tokens']) / len(w['prompt_tokens']):.0f}), "
              f"{min(w['max_tokens'])}–{max(w['max_tokens'])} new tokens "
              f"(mean {sum(w['max_tokens']) / len(w['max_tokens']):.0f}), Poisson arrivals (seed {results['seed']}), "
              f"at most {results['max_concurrency']} sequences batched per server; model {results['model']}. "
              + "".join(f"{spec} alone (one request at a time, {run['prompt_tokens']} + {run['max_tokens']} tokens): "
                        f"TPOT median {_ms(run['tpot_median_s'])}. " for spec, run in results.get("solo", {}).items())
              + 
              f"CPU: {results['cpu']}, {results['cores']} cores (flags: {' '.join(results['cpu_flags'])}); "
              f"load average {results['load_average_before'][0]:.2f} before, "
              f"{results['load_average_after'][0]:.2f} after."]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e", "end-to-end latency (s)")]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    rates = results["rates"]
    for spec, reports in results["servers"].items():
        for ax, (metric, label) in zip(axes, panels):
            line, = ax.plot(rates, [r[f"{metric}_p50_s"] for r in reports], marker="o", label=f"{spec} p50")
            ax.plot(rates, [r[f"{metric}_p99_s"] for r in reports], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{spec} p99")
            ax.set_ylabel(label)
        axes[3].plot(rates, [r["output_throughput"] for r in reports], marker="o", label=spec)
    axes[3].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(True, alpha=0.3)
    for ax in axes[:3]:
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    w = results["workload"]
    fig.suptitle(f"{results['model']}, {w['requests']} requests, prompts {min(w['prompt_tokens'])}–"
                 f"{max(w['prompt_tokens'])} tokens, {min(w['max_tokens'])}–{max(w['max_tokens'])} new tokens, "
                 f"Poisson arrivals; {results['cpu']}, {results['cores']} cores", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from bench.machine import Gate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="nanoserve:float32",
                        help="comma-separated, run in turn: nanoserve:float32|bfloat16|int8[+compile|+eager], "
                             "llama.cpp:f32|f16|q8_0, or the base URL of a server already running")
    parser.add_argument("--model-name", default=None, help="the model to ask the servers for (default: --model)")
    parser.add_argument("--model", default="gpt2-small", help="the random-weight checkpoint's shape (bench.SHAPES)")
    parser.add_argument("--rates", default="0.5,1,2", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=16,
                        help="nanoserve's max_batch and rq workers, llama-server's --parallel slots")
    parser.add_argument("--device", default="cpu", help="where nanoserve's worker runs: cpu, cuda, cuda:N")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each rate, wait up to this many seconds for other processes to go quiet")
    output_arguments(parser, "serving_bench")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    requests = workload(args.requests, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    gate = Gate(args.quiet_wait, args.quiet_wait * len(rates) * 4)
    results = run_benchmark(args.server.split(","), args.model, requests, rates, model_name=args.model_name,
                            seed=args.seed, max_concurrency=args.max_concurrency, device=args.device, gate=gate,
                            log=log)
    write_results(results, markdown(results), args.json, args.markdown, plot, args.plot)
    return results


if __name__ == "__main__":
    main()
