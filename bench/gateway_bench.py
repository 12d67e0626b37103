"""Gateway overhead: what HTTP + Redis + rq + the worker process add to the engine's own time.

    python -m bench.gateway_bench [--quick] [--latency-requests 50] [--clients 32]
                                  [--requests-per-client 2] [--repeats 3] [--json PATH]

The real stack (tests/stack.py): a private redis-server, `processor.py` and gunicorn (2 workers ×
64 threads, as `make serve` runs it), with two random-weight models registered: `tiny` (2 layers,
64 wide) and `gpt2-small` (GPT-2 124M shape), both `device = "cpu"`, `max_batch = 32`, `context_length = 128`. The engine
alone is built in this process by `processor.build_engine` from the same registry entry (the
worker's own construction), without an event sink. Both are driven by bench/loadgen.py's closed
loop through the real `openai` client (gateway) or `engine.submit(...).result()` (engine alone),
alternating, in the same run.

1. Latency: p50 of a `max_tokens: 1` request (32-token prompt, greedy) on `tiny`, one request at a
   time, through the gateway minus the p50 of the same request on the engine alone. Also the p50
   of `GET /v1/models` (HTTP and Flask, no Redis round trip for the job, no worker): the floor.
2. Throughput: 32 closed-loop clients × 2 requests (32-token prompts, 64 new tokens, greedy, EOS
   banned) on `gpt2-small`: the gateway's aggregate tokens/s as a fraction of the engine alone's,
   median over the repeats.

    python -m bench.gateway_bench pinned [--concurrency 1,8,32,64] [--repeats 3] [--requests-per-client 1]
                                         [--json PATH]

`pinned`: whether the stack keeps up with an engine whose steps cost what a GPU's do, as a GPU host
runs it. The tiny model (a step of about a millisecond on one core, as a GPU's) in one torch
thread; the engine alone, and then the stack's worker process, on CPU 0; web, Redis and the
`openai` client on the other CPUs. Per concurrency C, C clients each sending `--requests-per-client`
requests of 64 tokens, the next as the last is answered (1: bursts of C; more: the steady state): the
stack's tokens/s against the engine alone's under the same load; the engine's busy share of each round, its forwards a
request and its time a forward, alone and in the worker (`busy_share`); and each process's CPU
milliseconds a request.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from bench import checkpoint, rounds
from bench.loadgen import Sample, completion_body, openai_sender, percentile, run
from bench.machine import Gate

if TYPE_CHECKING:
    from tests.stack import Service

API_KEY = "unused"  # auth is disabled in the benchmark's stack


def engine_sender(engine, model_id: str):
    """`send` that puts a loadgen body straight into an in-process engine."""
    from worker.protocol import CompletionJob

    ids = itertools.count()

    def send(body: dict) -> Sample:
        job = CompletionJob(id=f"bench-{next(ids)}", model=model_id, prompts=[body["prompt"]],
                            max_tokens=body["max_tokens"], temperature=body["temperature"],
                            logit_bias={int(k): v for k, v in body["logit_bias"].items()}, seed=0)
        start = time.perf_counter()
        result = engine.submit(job).result()
        return Sample(time.perf_counter() - start, result["usage"]["completion_tokens"])

    return send


@contextmanager
def stack(models_file: Path, workdir: Path, *, concurrency: int = 32, compile: bool | None = None,
          web_workers: int = 2, worker_args: Sequence[str] = ()) -> Iterator[Service]:
    """nanoserve's whole stack serving every model of `models_file`, as `make serve` runs it: a
    private redis-server, `processor.py` with `concurrency` rq workers per model (its decode step
    compiled or not by `compile`, None: where the worker compiles it by default), gunicorn
    (`web_workers` processes × 64 threads, auth disabled); `worker_args`: processor.py's further
    options; logs in `workdir`. Yields the gunicorn service (its `.url`; its `.info` names Redis's
    URL and pid, the worker's pid and its metrics' URL: see `engine_busy`)."""
    from models.registry import Registry
    from tests.stack import start_gunicorn, start_processor
    from web.dev.local_redis import free_port, start_redis

    models = sorted(spec.id for spec in Registry.from_file(models_file).models())
    server = start_redis()
    metrics_port = free_port()
    try:
        # measured at full speed: after the worker's background compile (a minute or two on a first start)
        with start_processor(server.url, models_file, models=models, concurrency=concurrency, log_dir=workdir,
                             compile=compile, timeout=600.0, warmed=True,
                             extra_args=["--metrics-port", str(metrics_port), *worker_args]) as worker, \
                start_gunicorn(server.url, models_file, workers=web_workers, threads=64,
                               env={"NANOSERVE_AUTH": "disabled"}, log_dir=workdir) as web:
            web.info.update(redis_url=server.url, redis_pid=server.process.pid, worker_pid=worker.pid,
                            worker_metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
            yield web
    finally:
        server.stop()


def engine_busy(metrics_url: str) -> dict[str, float]:
    """The worker's engines' time in their steps and their forwards so far, all models together
    (`nanoserve_worker_busy_seconds_total`, `nanoserve_worker_steps_total`): between two reads, busy
    seconds against the wall clock say whether a stack lost its time in the engine's steps or
    around them, and over forwards what a forward took there."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    out = {"busy_s": 0.0, "forwards": 0.0, "phases_s": {}, "kinds": {}}
    kinds = {f"nanoserve_worker_step_kind_{key}_total": key for key in ("steps", "forwards", "seconds")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nanoserve_worker_busy_seconds_total":
                out["busy_s"] += sample.value
            elif sample.name == "nanoserve_worker_steps_total":
                out["forwards"] += sample.value
            elif sample.name == "nanoserve_worker_step_phase_seconds_total":
                phase = sample.labels["phase"]
                out["phases_s"][phase] = out["phases_s"].get(phase, 0.0) + sample.value
            elif sample.name in kinds:
                counts = out["kinds"].setdefault(sample.labels["kind"], {})
                counts[kinds[sample.name]] = counts.get(kinds[sample.name], 0.0) + sample.value
    return out


def busy_share(before: dict[str, float], after: dict[str, float], wall_s: float, requests: int) -> dict[str, float]:
    """Between two `engine_busy` reads over `wall_s` seconds of `requests`: the engine's busy share
    of the wall clock, its busy ms a request, its ms a forward and its forwards a request (more than
    alone where a burst's requests reach it spread out: its batch runs part full for longer); and by
    what its steps ran (worker/engine.py STEP_KINDS), their share of the forwards, their forwards a
    step and their ms a forward: a step that feeds arriving prompts runs one forward, where one that
    only decodes runs several when the engine runs ahead (a GPU's)."""
    from bench.engine_bench import phase_ms_per_forward

    busy, forwards = after["busy_s"] - before["busy_s"], after["forwards"] - before["forwards"]
    phases = {phase: s - before.get("phases_s", {}).get(phase, 0.0) for phase, s in after.get("phases_s", {}).items()}
    kinds = {}
    for kind, counts in after.get("kinds", {}).items():
        was = before.get("kinds", {}).get(kind, {})
        steps, kind_forwards, seconds = (counts[key] - was.get(key, 0.0) for key in ("steps", "forwards", "seconds"))
        if steps:
            kinds[kind] = {"forward_share": kind_forwards / forwards if forwards else 0.0,
                           "forwards_per_step": kind_forwards / steps, "ms_per_forward": 1000 * seconds / kind_forwards}
    return {"busy_share": busy / wall_s if wall_s else 0.0, "busy_ms_per_request": 1000 * busy / max(requests, 1),
            "ms_per_forward": 1000 * busy / forwards if forwards else 0.0,
            "forwards_per_request": forwards / max(requests, 1),
            "step_phase_ms": phase_ms_per_forward(phases, forwards), "step_kinds": kinds}


def median_busy(shares: list[dict]) -> dict:
    """`busy_share`s' medians, field by field (phase by phase for the step's phases)."""
    from bench.engine_bench import median_phases

    return {key: median_phases(shares) if key == "step_phase_ms" else statistics.median(s[key] for s in shares)
            for key in shares[0] if key != "step_kinds"}


def engine_as_served(models_file: Path, name: str, device: str, compile: bool | None,
                     schedule: list[tuple[int, int, int]], bodies, steady: int = 0) -> Iterator[tuple[int, dict]]:
    """The engine of `models_file`'s model `name` built as the worker builds it
    (processor.build_engine: its precision, slots, context, kernels and compile), in this process,
    without an event sink; each body of `bodies(c)` put straight into it by `c` closed-loop threads.
    Yields, for each round (_, c, _) of `schedule` (bench.rounds), c and its loadgen report, with the
    engine's busy share of it as `engine` (`busy_share`); then, with `steady`, a round at each
    concurrency c of c * `steady` bodies (each thread sending its next as its last ends), its report
    marked `steady`. A round of c bodies at every concurrency warms it first; the engine is stopped
    after the last."""
    from models.registry import Registry
    from processor import build_engine

    engine = build_engine(Registry.from_file(models_file).get(name), device, None, compile=compile)

    def busy() -> dict[str, float]:  # as `engine_busy` reads the worker's
        stats = engine.stats()
        return {"busy_s": stats["busy_seconds"], "forwards": stats["steps"], "phases_s": stats["step_phase_seconds"],
                "kinds": stats["step_kinds"]}

    try:
        send = engine_sender(engine, name)
        for c in sorted({c for _, c, _ in schedule}):
            run(send, bodies(c)[:c], c)
        steady_rounds = [(c, True) for c in sorted({c for _, c, _ in schedule})] if steady else []
        for c, is_steady in [(c, False) for _, c, _ in schedule] + steady_rounds:
            batch, before = bodies(c * steady if is_steady else c), busy()
            report = run(send, batch, c)
            report["engine"] = busy_share(before, busy(), report["wall_s"], len(batch))
            if is_steady:
                report["steady"] = True
            yield c, report
    finally:
        engine.stop()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency(gateway, engine, http_floor, requests: int, gate: Gate, log) -> dict:
    """p50s of one-at-a-time `max_tokens: 1` requests, the systems alternating request by request."""
    body = completion_body(0, 32, 1)
    for _ in range(3):  # warm up connections, threads, the first forward
        gateway(body), engine(body), http_floor()

    def measure() -> dict:
        seconds = {"gateway": [], "engine": [], "http_floor": []}
        for _ in range(requests):
            for name, sample in (("gateway", gateway(body)), ("engine", engine(body))):
                if sample.error:
                    raise RuntimeError(f"{name} request failed: {sample.error}")
                seconds[name].append(sample.latency)
            seconds["http_floor"].append(timed(http_floor))
        out = {f"{name}_p50_ms": 1000 * percentile(values, 50) for name, values in seconds.items()}
        out.update({f"{name}_p90_ms": 1000 * percentile(values, 90) for name, values in seconds.items()})
        out["overhead_p50_ms"] = out["gateway_p50_ms"] - out["engine_p50_ms"]
        out["requests"] = requests
        return out

    out = gate.measure(measure)
    log(f"latency (max_tokens 1): gateway p50 {out['gateway_p50_ms']:.1f} ms, engine p50 "
        f"{out['engine_p50_ms']:.1f} ms, overhead {out['overhead_p50_ms']:.1f} ms, "
        f"HTTP floor {out['http_floor_p50_ms']:.1f} ms, others {out['foreign_cores']:.2f} cores")
    return out


def throughput(gateway, engine, clients: int, requests_per_client: int, max_tokens: int, repeats: int,
               gate: Gate, log) -> dict:
    bodies = [completion_body(i, 32, max_tokens) for i in range(clients * requests_per_client)]
    runs = {"gateway": [], "engine": []}
    for r in range(repeats):
        order = [("engine", engine), ("gateway", gateway)]
        for name, send in order if r % 2 == 0 else order[::-1]:
            report = gate.measure(lambda: run(send, bodies, clients))
            if report["errors"]:
                raise RuntimeError(f"{name}: {report['errors']} requests failed: {report['first_error']}")
            runs[name].append(report)
            log(f"throughput repeat {r + 1}/{repeats} {name:<8} {report['tokens_per_s']:7.1f} tok/s  "
                f"latency p50 {report['latency_p50_s']:.2f} s  others {report['foreign_cores']:.2f} cores")
    out = {f"{name}_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    out["fraction"] = out["gateway_tokens_per_s"] / out["engine_tokens_per_s"]
    out["runs"] = runs
    return out


def run_benchmark(*, latency_requests: int, clients: int, requests_per_client: int, max_tokens: int,
                  repeats: int, throughput_model: str, workdir: Path, checkpoints: dict[str, Path] | None = None,
                  gate: Gate | None = None, log=print) -> dict:
    """Start the stack, measure, stop it. `checkpoints`: model name -> HF directory (default: the
    bench's cached random-weight checkpoints of `tiny` and the throughput model); `gate`: see
    bench.machine.Gate (default: no waiting)."""
    gate = gate or Gate()
    from models.registry import Registry
    from processor import build_engine
    from tests.stack import write_models_toml

    checkpoints = checkpoints or {name: checkpoint(name) for name in sorted({"tiny", throughput_model})}
    models_file = write_models_toml(workdir / "models.toml", checkpoints, device="cpu", max_batch=32,
                                    context_length=128)
    registry = Registry.from_file(models_file)
    # built as the stack's worker builds them, compiled where it compiles by default
    engines = {name: build_engine(registry.get(name), "cpu", None, compile=None) for name in checkpoints}
    load_before = os.getloadavg()
    try:
        with stack(models_file, workdir, concurrency=32) as web:
            import openai

            client = openai.OpenAI(base_url=web.url + "/v1", api_key=API_KEY, max_retries=0)
            result = {
                "latency": latency(openai_sender(web.url + "/v1", "tiny", api_key=API_KEY),
                                   engine_sender(engines["tiny"], "tiny"), client.models.list,
                                   latency_requests, gate, log),
                "throughput": throughput(openai_sender(web.url + "/v1", throughput_model, api_key=API_KEY),
                                         engine_sender(engines[throughput_model], throughput_model),
                                         clients, requests_per_client, max_tokens, repeats, gate, log),
            }
    finally:
        for engine in engines.values():
            engine.stop()
    result["throughput"].update(model=throughput_model, clients=clients,
                                requests_per_client=requests_per_client, max_tokens=max_tokens)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    return result


def markdown(result: dict) -> str:
    lat, thr = result["latency"], result["throughput"]
    return "\n".join([
        "| measurement | gateway | engine alone | difference / ratio | target |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| p50 latency, `max_tokens: 1`, tiny model | {lat['gateway_p50_ms']:.1f} ms | "
        f"{lat['engine_p50_ms']:.1f} ms | {lat['overhead_p50_ms']:.1f} ms | ≤ 15 ms |",
        f"| p90 latency, same | {lat['gateway_p90_ms']:.1f} ms | {lat['engine_p90_ms']:.1f} ms | "
        f"{lat['gateway_p90_ms'] - lat['engine_p90_ms']:.1f} ms | |",
        f"| tokens/s, {thr['clients']} clients, {thr['model']} | {thr['gateway_tokens_per_s']:.1f} | "
        f"{thr['engine_tokens_per_s']:.1f} | {thr['fraction']:.2f} | ≥ 0.9 |",
        "",
        f"HTTP floor (`GET /v1/models` p50): {lat['http_floor_p50_ms']:.1f} ms; other processes took "
        f"{lat['foreign_cores']:.2f} cores during the latency runs and "
        f"{statistics.median(r['foreign_cores'] for rs in thr['runs'].values() for r in rs):.2f} (median) during "
        f"the throughput runs; load average "
        f"{result['load_average']['before'][0]:.2f} before, {result['load_average']['after'][0]:.2f} after.",
    ])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (a process's affinity is its threads')."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, OSError):  # a thread that ended meanwhile
            pass


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds each live thread of process `pid` has used (Linux /proc): schedstat's
    nanoseconds, or stat's clock ticks (10 ms) where schedstat is absent."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "schedstat").exists():
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            else:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return out


def cpu_seconds(pids: dict[int, str]) -> dict[str, dict[tuple[int, int], float]]:
    """CPU seconds each role's processes have used, by (pid, thread): this process's as one, from
    getrusage (its client threads end with each run), the others' threads' (`thread_cpu_seconds`)."""
    import resource

    used: dict[str, dict[tuple[int, int], float]] = {}
    for pid, role in pids.items():
        if pid == os.getpid():
            own = resource.getrusage(resource.RUSAGE_SELF)
            used.setdefault(role, {})[pid, 0] = own.ru_utime + own.ru_stime
        else:
            used.setdefault(role, {}).update({(pid, tid): s for tid, s in thread_cpu_seconds(pid).items()})
    return used


def used_since(before: dict, after: dict) -> float:
    """CPU seconds from `before` to `after` (`cpu_seconds`' maps of one role): those of the threads
    alive at `after`. A thread that ended in between is left out, with what it used since `before`;
    summing the live threads' totals instead would count its whole life as negative."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items())


def pinned(concurrency: list[int], repeats: int, max_tokens: int, workdir: Path, log=print,
           requests_per_client: int = 1) -> dict:
    """See the module docstring (`pinned`). Needs two CPUs or more."""
    import psutil
    import torch

    from tests.stack import write_models_toml

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("pinned needs two CPUs or more")
    engine_cpu, rest = {cpus[0]}, set(cpus[1:])
    os.environ["OMP_NUM_THREADS"] = "1"  # the worker's, started below
    torch.set_num_threads(1)
    model, context = checkpoint("tiny"), 32 + max_tokens
    bodies = {c: [completion_body(i, 32, max_tokens) for i in range(c * requests_per_client)] for c in concurrency}
    me = os.getpid()
    pin(me, engine_cpu)  # the engine's thread, started below, and the threads that submit to it
    models_file = write_models_toml(workdir / "alone.toml", {"tiny": model}, device="cpu", dtype="float32",
                                    max_batch=max(concurrency), context_length=context)
    alone: dict[int, list[float]] = {c: [] for c in concurrency}
    alone_busy: dict[int, list[dict]] = {c: [] for c in concurrency}
    for c, report in engine_as_served(models_file, "tiny", "cpu", None, rounds(concurrency, repeats),
                                      lambda c: bodies[c]):
        alone[c].append(report["tokens_per_s"])
        alone_busy[c].append(report["engine"])
    result = {"cpu_engine": sorted(engine_cpu), "cpus_rest": sorted(rest), "max_tokens": max_tokens,
              "requests_per_client": requests_per_client, "by_concurrency": {}}
    with stack(models_file, workdir, concurrency=max(concurrency)) as web:  # the same model, as the worker serves it
        roles = {web.info["worker_pid"]: "worker", me: "client"}
        for process in psutil.Process(me).children(recursive=True):  # this stack's, not another's on the host
            command = " ".join(process.cmdline())
            if "gunicorn" in command or "redis-server" in command:
                roles[process.pid] = "web" if "gunicorn" in command else "redis"
        for pid, role in roles.items():
            pin(pid, engine_cpu if role == "worker" else rest)
        send = openai_sender(web.url + "/v1", "tiny", api_key=API_KEY)
        for c in concurrency:
            run(send, [completion_body(i, 32, 4) for i in range(c)], c)
        runs: dict[int, list[dict]] = {c: [] for c in concurrency}
        for r in range(repeats):
            for c in concurrency:
                before, busy_before = cpu_seconds(roles), engine_busy(web.info["worker_metrics_url"])
                report = run(send, bodies[c], c)
                after = cpu_seconds(roles)
                if report["errors"]:
                    raise RuntimeError(f"{report['errors']} requests failed: {report['first_error']}")
                report["cpu_ms_per_request"] = {role: 1000 * used_since(before.get(role, {}), after[role]) / len(bodies[c])
                                                for role in after}
                report["engine"] = busy_share(busy_before, engine_busy(web.info["worker_metrics_url"]),
                                              report["wall_s"], len(bodies[c]))
                runs[c].append(report)
                log(f"pinned repeat {r + 1}/{repeats} C={c:<3} stack {report['tokens_per_s']:8.1f} tok/s, "
                    f"engine alone {alone[c][r]:8.1f}")
    for c in concurrency:
        engine_tps = statistics.median(alone[c])
        stack_tps = statistics.median(r["tokens_per_s"] for r in runs[c])
        roles_seen = runs[c][0]["cpu_ms_per_request"]
        result["by_concurrency"][str(c)] = {
            "engine_tokens_per_s": engine_tps, "stack_tokens_per_s": stack_tps, "ratio": stack_tps / engine_tps,
            "cpu_ms_per_request": {role: statistics.median(r["cpu_ms_per_request"][role] for r in runs[c])
                                   for role in roles_seen},
            "engine_alone": median_busy(alone_busy[c]), "engine_in_stack": median_busy([r["engine"] for r in runs[c]]),
            "engine_runs": alone[c], "stack_runs": runs[c]}
    return result


def pinned_markdown(result: dict) -> str:
    lines = ["| clients | engine alone tok/s | stack tok/s | stack / engine | engine busy, alone / in the "
             "stack | forwards a request, alone / in the stack | ms a forward, alone / in the stack | CPU ms a "
             "request: worker / web / Redis / client |", "| ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for c, row in result["by_concurrency"].items():
        ms, alone, inside = row["cpu_ms_per_request"], row["engine_alone"], row["engine_in_stack"]
        lines.append(f"| {c} | {row['engine_tokens_per_s']:.0f} | {row['stack_tokens_per_s']:.0f} | "
                     f"{row['ratio']:.2f} | {alone['busy_share']:.2f} / {inside['busy_share']:.2f} | "
                     f"{alone['forwards_per_request']:.2f} / {inside['forwards_per_request']:.2f} | "
                     f"{alone['ms_per_forward']:.2f} / {inside['ms_per_forward']:.2f} | "
                     f"{ms['worker']:.1f} / {ms['web']:.1f} / {ms['redis']:.1f} / {ms['client']:.1f} |")
    return "\n".join(lines)


def pinned_main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="bench.gateway_bench pinned")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=1,
                        help="requests each of the C clients sends, the next as its last is answered (1: a "
                             "burst of C; more: the steady state of C clients)")
    parser.add_argument("--json", default="bench/.cache/gateway_bench_pinned.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="nanoserve-gateway-bench-") as tmp:
        result = pinned([int(c) for c in args.concurrency.split(",")], args.repeats, args.max_tokens, Path(tmp),
                        log=lambda msg: print(msg, file=sys.stderr, flush=True),
                        requests_per_client=args.requests_per_client)
    from bench.engine_bench import code_version
    from bench.machine import cpu_flags
    from nanogpt.kernels.machine import cpu_name

    result.update(cpu=cpu_name(), cpu_flags=cpu_flags(), code=code_version())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(pinned_markdown(result))
    print(f"\nEach client sent {args.requests_per_client} request(s), the next as the last was answered.")
    print(f"\nCPU: {result['cpu']} ({' '.join(result['cpu_flags'])}); code {result['code']['commit']}")
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pinned"]:
        return pinned_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few requests, tiny model only (a smoke run)")
    parser.add_argument("--latency-requests", type=int, default=50)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-model", default="gpt2-small", choices=["gpt2-small", "tiny"])
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="wait up to this many seconds for other processes to go quiet before each "
                             "measurement (the machine is shared; 0: never wait)")
    parser.add_argument("--quiet-budget", type=float, default=300.0, help="seconds of such waiting in all")
    parser.add_argument("--max-foreign", type=float, default=0.25,
                        help="redo a measurement (up to 3 tries) during which other processes took more cores")
    parser.add_argument("--json", default="bench/.cache/gateway_bench.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.latency_requests, args.clients, args.requests_per_client = 5, 4, 1
        args.max_tokens, args.repeats, args.throughput_model = 8, 1, "tiny"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="nanoserve-gateway-bench-") as tmp:
        result = run_benchmark(latency_requests=args.latency_requests, clients=args.clients,
                               requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
                               repeats=args.repeats, throughput_model=args.throughput_model,
                               workdir=Path(tmp),
                               gate=Gate(args.quiet_wait, args.quiet_budget, args.max_foreign),
                               log=lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
