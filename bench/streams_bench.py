"""Open streams on one web host: N streamed completions opened at once against one web host (gunicorn
with `--worker-class` gthread or gevent) while `/health` and `/v1/models` are probed every 100 ms.

    python -m bench.streams_bench [--streams 2000] [--classes gthread] [--web-workers 4]
                                  [--threads 1024] [--max-tokens 8] [--connect-rate 500] [--json PATH]

(gevent, a class gunicorn also has, needs the gevent package, which the project does not install.)

Per worker class: a private Redis, one worker (`processor.py`, the tiny random-weight GPT-2, batch 64)
and gunicorn on one host; the client opens the streams over raw asyncio sockets (one process, no
client-side pool limit), `--connect-rate` new connections a second (a burst of thousands of SYNs in
one millisecond overflows the kernel's SYN backlog before any server sees them), and reads each to
`data: [DONE]`. Reported: streams completed,
failed, the wall time, and the probes' latency (p50, p99, max; a probe unanswered in 5 s counts as
5 s), which is what a liveness probe would see under that load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from bench import EOS, checkpoint, write_results

PROBES = ("/health", "/v1/models")
PROBE_TIMEOUT_S = 5.0


async def _request(host: str, port: int, method: str, path: str, body: bytes = b"",
                   timeout: float = 600.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection; (status, whole body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        writer.write(head + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data.partition(b"\r\n\r\n")[2]


async def _stream(host: str, port: int, index: int, max_tokens: int, connect_rate: float) -> bool:
    await asyncio.sleep(index / connect_rate)
    body = json.dumps({"model": "tiny", "prompt": [index % 50000 + 1, 11, 12], "max_tokens": max_tokens,
                       "stream": True, "temperature": 0, "logit_bias": {str(EOS): -100}}).encode()
    status, data = await _request(host, port, "POST", "/v1/completions", body)
    return status == 200 and b"data: [DONE]" in data and b'"error"' not in data


async def _probe(host: str, port: int, stop: asyncio.Event, latencies: dict[str, list[float]]) -> None:
    while not stop.is_set():
        for path in PROBES:
            started = time.perf_counter()
            try:
                status, _ = await _request(host, port, "GET", path, timeout=PROBE_TIMEOUT_S)
                took = time.perf_counter() - started if status == 200 else PROBE_TIMEOUT_S
            except (asyncio.TimeoutError, OSError):
                took = PROBE_TIMEOUT_S
            latencies[path].append(took)
        await asyncio.sleep(0.1)


async def _load(url: str, streams: int, max_tokens: int, connect_rate: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    latencies: dict[str, list[float]] = {path: [] for path in PROBES}
    stop = asyncio.Event()
    prober = asyncio.create_task(_probe(host, port, stop, latencies))
    started = time.perf_counter()
    results = await asyncio.gather(*(_stream(host, port, i, max_tokens, connect_rate) for i in range(streams)),
                                   return_exceptions=True)
    wall = time.perf_counter() - started
    stop.set()
    await prober
    ok = sum(r is True for r in results)
    probes = {path: _summary(values) for path, values in latencies.items()}
    return {"streams": streams, "completed": ok, "failed": streams - ok, "wall_s": round(wall, 2),
            "probes": probes, "probe_max_s": max(p["max_s"] for p in probes.values())}


def _summary(values: list[float]) -> dict:
    values = sorted(values)
    pick = lambda q: round(values[min(len(values) - 1, int(q * len(values)))], 3)  # noqa: E731
    return {"count": len(values), "p50_s": pick(0.5), "p99_s": pick(0.99), "max_s": round(values[-1], 3)}


def run_class(worker_class: str, streams: int, *, web_workers: int = 4, threads: int = 1024, max_tokens: int = 8,
              connect_rate: float = 500.0, log=print) -> dict:
    """One worker class's round on a stack of its own."""
    from tests.stack import start_gunicorn, start_processor, write_models_toml
    from web.dev.local_redis import start_redis

    env = {"NANOSERVE_MAX_QUEUE_DEPTH": str(streams + 100), "NANOSERVE_KEY_MAX_JOBS": "0",
           "NANOSERVE_KEY_MAX_OPEN": "0", "NANOSERVE_KEY_RPM": "0", "NANOSERVE_KEY_TPM": "0",
           "NANOSERVE_LOG_LEVEL": "WARNING"}
    redis_server = start_redis()
    try:
        with tempfile.TemporaryDirectory(prefix="nanoserve-streams-bench-") as tmp:
            models = write_models_toml(Path(tmp) / "models.toml", {"tiny": checkpoint("tiny")}, device="cpu",
                                       max_batch=64)
            with start_processor(redis_server.url, models, concurrency=64, log_dir=Path(tmp)), \
                 start_gunicorn(redis_server.url, models, workers=web_workers, threads=threads,
                                worker_class=worker_class, env=env, log_dir=Path(tmp)) as web:
                log(f"== {worker_class}: {streams} streams on {web_workers} processes")
                result = asyncio.run(_load(web.url, streams, max_tokens, connect_rate))
    finally:
        redis_server.stop()
    log(f"   {result['completed']}/{streams} completed in {result['wall_s']} s; probes max "
        f"{result['probe_max_s']} s")
    return {"worker_class": worker_class, "web_workers": web_workers, "connect_rate": connect_rate,
            "threads": threads if worker_class == "gthread" else None, **result}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.streams_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--classes", default="gthread")
    parser.add_argument("--web-workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1024, help="gthread's threads per process")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--connect-rate", type=float, default=500.0, help="new connections a second")
    parser.add_argument("--json", default="bench/.cache/streams_bench.json")
    args = parser.parse_args(argv)
    from nanogpt.kernels.machine import cpu_name

    results = {"cpu": cpu_name(), "cores": os.cpu_count(), "rounds": [
        run_class(worker_class, args.streams, web_workers=args.web_workers, threads=args.threads,
                  max_tokens=args.max_tokens, connect_rate=args.connect_rate)
        for worker_class in args.classes.split(",")]}
    table = "\n".join(["| worker class | streams | completed | wall s | /health max s | /v1/models max s |",
                       "| --- | ---: | ---: | ---: | ---: | ---: |"] +
                      [f"| {r['worker_class']} | {r['streams']} | {r['completed']} | {r['wall_s']} | "
                       f"{r['probes']['/health']['max_s']} | {r['probes']['/v1/models']['max_s']} |"
                       for r in results["rounds"]])
    write_results(results, table, args.json)
    return results


if __name__ == "__main__":
    main()
