"""A load generator for any OpenAI-compatible completions server, through the official `openai`
client: the same client measures this stack and any peer server (llama.cpp's llama-server, vLLM).

    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --model NAME
                            [--concurrency 1,8,32] [--requests-per-client 2] [--prompt-tokens 32]
                            [--max-tokens 64] [--stream] [--api-key KEY] [--json PATH]

Closed loop: C clients, each sending its next request as soon as its last one is answered, until
C × requests-per-client requests are done. Per concurrency it reports aggregate completion tokens/s
(over the run's wall time), requests/s, latency p50/p99, time to first token p50/p99 (`--stream`
only: the first chunk carrying text) and errors.

Requests: a `prompt` of token ids (request i's own random GPT-2 ids, as in bench/engine_bench.py),
`max_tokens`, `temperature: 0` and `logit_bias {"50256": -100}` (EOS banned, so every request
generates max_tokens; `--logit-bias '{}'` for a model with another vocabulary).

`run(send, bodies, concurrency)` takes any `send(body) -> Sample`, so a benchmark can put the same
load on something that is not an HTTP server (bench/gateway_bench.py drives the engine alone).
`ClientProcesses` puts it from several processes (bench/gpu_check.py's `--client-processes`): one
Python process's `openai` client sends under its one GIL, and spends milliseconds of CPU a request
(`python -m bench.gateway_bench pinned`'s client column), so a burst of 64 from one process can take
longer to send than a GPU engine takes to answer it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from bench import EOS, prompt_ids


@dataclass
class Sample:
    """One request as the client saw it (seconds from just before it was sent)."""

    latency: float
    completion_tokens: int
    ttft: float | None = None
    error: str | None = None
    # streaming only: when each chunk carrying text arrived (its gaps: inter-token latency),
    # and whether the server reported usage (else completion_tokens counts chunks)
    chunk_times: list[float] = field(default_factory=list)
    usage_reported: bool = False


Send = Callable[[dict], Sample]


def completion_body(index: int, prompt_tokens: int = 32, max_tokens: int = 64,
                    logit_bias: dict | None = None) -> dict:
    """The body of request `index` (everything but `model` and `stream`)."""
    return {"prompt": prompt_ids(index, prompt_tokens), "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": {str(EOS): -100} if logit_bias is None else logit_bias}


def openai_sender(base_url: str, model: str, *, api_key: str = "unused", stream: bool = False,
                  timeout: float = 600.0) -> Send:
    """`send` over one shared `openai.OpenAI` client (no retries: a failure is a failure)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)

    def send(body: dict) -> Sample:
        start = time.perf_counter()
        try:
            if not stream:
                response = client.completions.create(model=model, **body)
                return Sample(time.perf_counter() - start, response.usage.completion_tokens)
            chunk_times, usage = [], None
            for chunk in client.completions.create(model=model, stream=True,
                                                   stream_options={"include_usage": True}, **body):
                if any(choice.text for choice in chunk.choices):  # not a closing chunk
                    chunk_times.append(time.perf_counter() - start)
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            # a server that sends no usage: one token per chunk, as most do
            return Sample(time.perf_counter() - start, len(chunk_times) if usage is None else usage,
                          chunk_times[0] if chunk_times else None, chunk_times=chunk_times,
                          usage_reported=usage is not None)
        except openai.OpenAIError as err:
            return Sample(time.perf_counter() - start, 0, error=f"{type(err).__name__}: {err}")

    return send


def run(send: Send, bodies: list[dict], concurrency: int) -> dict:
    """Send every body from `concurrency` closed-loop client threads; the run's report."""
    start = time.perf_counter()
    samples = closed_loop(send, bodies, concurrency)
    return report(samples, time.perf_counter() - start, concurrency)


def closed_loop(send: Send, bodies: list[dict], concurrency: int) -> list[Sample]:
    """Every body sent by `concurrency` client threads, each sending its next as its last is answered."""
    pending = list(reversed(bodies))
    lock = threading.Lock()
    samples: list[Sample] = []

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                body = pending.pop()
            sample = send(body)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client, name=f"loadgen-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples


class ClientProcesses:
    """`run` from `processes` processes, each with its own `openai_sender(base_url, model,
    **options)`: the concurrency's clients and the bodies shared among them round robin, the wall
    time from the first process's start to the last one's end."""

    def __init__(self, base_url: str, model: str, processes: int, **options):
        self.processes = processes
        self.cpu_s = 0.0  # the CPU seconds its processes spent in runs, so far
        self._pool = concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_sender,
            initargs=(base_url, model, options))
        # every process started (and its client imported) before the first measured run
        list(self._pool.map(time.sleep, [0.5] * processes))

    def run(self, bodies: list[dict], concurrency: int) -> dict:
        return report(*self.samples(bodies, concurrency), concurrency)

    def samples(self, bodies: list[dict], concurrency: int) -> tuple[list[Sample], float]:
        """`run`'s samples, and its wall time. Client k runs in process k % processes, and body j goes
        to client j % concurrency's process (more bodies than clients: each client sends several)."""
        shares = [([body for j, body in enumerate(bodies) if j % concurrency % self.processes == i],
                   concurrency // self.processes + (i < concurrency % self.processes)) for i in range(self.processes)]
        done = [f.result() for f in [self._pool.submit(_run_share, part, clients)
                                     for part, clients in shares if part and clients]]
        samples = [sample for part, _, _, _ in done for sample in part]
        self.cpu_s += sum(cpu for _, _, _, cpu in done)
        return samples, max(end for _, _, end, _ in done) - min(start for _, start, _, _ in done)

    def close(self) -> None:
        self._pool.shutdown()

    def __enter__(self) -> "ClientProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_send: Send | None = None  # a client process's sender (ClientProcesses)


def _start_sender(base_url: str, model: str, options: dict) -> None:
    global _send
    _send = openai_sender(base_url, model, **options)


def _run_share(bodies: list[dict], concurrency: int) -> tuple[list[Sample], float, float, float]:
    """A client process's share of a run: its samples, start, end and CPU seconds (its threads'
    ended ones included)."""
    cpu = time.process_time()
    started = time.time()  # a clock every process shares
    samples = closed_loop(_send, bodies, concurrency)
    return samples, started, time.time(), time.process_time() - cpu


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def report(samples: list[Sample], wall: float, concurrency: int) -> dict:
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    latencies = [s.latency for s in ok]
    tokens = sum(s.completion_tokens for s in ok)
    return {"concurrency": concurrency, "requests": len(samples), "errors": len(samples) - len(ok),
            "first_error": next((s.error for s in samples if s.error), None),
            "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": len(ok) / wall,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "latency_mean_s": statistics.fmean(latencies) if latencies else None}


def sweep(send: Send, concurrency: list[int], requests_per_client: int, prompt_tokens: int,
          max_tokens: int, logit_bias: dict | None = None, log=print) -> list[dict]:
    """One closed-loop run per concurrency, after one warm-up request."""
    send(completion_body(0, prompt_tokens, 1, logit_bias))
    reports = []
    for c in concurrency:
        bodies = [completion_body(i, prompt_tokens, max_tokens, logit_bias) for i in range(c * requests_per_client)]
        reports.append(run(send, bodies, c))
        r = reports[-1]
        ttft = "" if r["ttft_p50_s"] is None else f"  ttft p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s"
        log(f"C={c:<4} {r['tokens_per_s']:8.1f} tok/s  latency p50 {r['latency_p50_s'] or 0:.3f} s "
            f"p99 {r['latency_p99_s'] or 0:.3f} s{ttft}  errors {r['errors']}")
    return reports


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logit-bias", type=json.loads, default=None,
                        help='JSON object (default: {"50256": -100}, GPT-2\'s EOS banned)')
    parser.add_argument("--stream", action="store_true", help="stream, and measure time to first token")
    parser.add_argument("--json", default=None, help="write the reports here")
    args = parser.parse_args(argv)
    send = openai_sender(args.base_url, args.model, api_key=args.api_key, stream=args.stream)
    reports = sweep(send, [int(c) for c in args.concurrency.split(",")], args.requests_per_client,
                    args.prompt_tokens, args.max_tokens, args.logit_bias)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base_url": args.base_url, "model": args.model, "stream": args.stream,
                       "reports": reports}, f, indent=1)
    return reports


if __name__ == "__main__":
    main()
