"""A worker's start: seconds from `processor.py`'s launch to its first completion served and to full
speed (its decode step's graphs all live), and its decode speed then, as it starts by default
(serving at once while its graphs compile in the background) and with `--compile-first`; from
empty compile caches (first start) and then from the caches that start filled (warm), with the
phases its log gives (docs/performance.md, "Start").

    python -m bench.start_bench                       # GPT-2 small's shape, float32, this CPU
    python -m bench.start_bench --dtype int8
    python -m bench.start_bench --decode-pairs 4      # the engine's decode speed after the switch

The CPU kernels are built first, as `make install` builds them, and that build is timed; a last
launch starts without them (nothing built, nothing compiled). Each launch has a job waiting in the
model's queue; the first completion is its `done` event. Full speed is the log's "decode step
compiled". The decode speed is the median over 3 greedy 64-token jobs, one at a time, after full
speed, from their first token's event to their `done` event; while warming up, the median over
the 64-token jobs run one after another from the first completion on that ended before full speed. The caches are private temporary
directories (NANOSERVE_EXTENSIONS, NANOSERVE_COMPILE_CACHE), so the machine's own are neither used
nor touched.

`--decode-pairs N`: N pairs of processes, alternating, each an engine launched as the worker launches
it, compiled before serving or in the background (from the machine's compile cache); once its
graphs are live, ms per token of 5 greedy 128-token jobs one at a time (each less a 1-token job's
time), their median; every process with the kernel plan the first measured (kept as the worker keeps it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import checkpoint, write_results
from bench.engine_bench import code_version

PHASES = ("weights loaded", "matmul kernels chosen", "CPU kernels built", "decode step compiled")


def launch(checkpoint_dir: Path, work: Path, caches: dict[str, Path], dtype: str, first: bool, label: str,
           compile: bool | None = None) -> dict:
    """One launch: seconds to the first completion and to full speed, the decode speed then, and the
    log's phases."""
    import redis

    from tests import rq_json
    from tests.stack import compiling, spawn_processor, write_models_toml
    from web.dev.local_redis import start_redis
    from worker import protocol

    work.mkdir(parents=True, exist_ok=True)
    models = write_models_toml(work / "models.toml", {"m": checkpoint_dir}, device="cpu", dtype=dtype, max_batch=8)
    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        env = {"NANOSERVE_EXTENSIONS": str(caches["extensions"]), "NANOSERVE_COMPILE_CACHE": str(caches["compile"])}
        (work / label).mkdir(parents=True)

        def run(max_tokens: int) -> tuple[float, float | None]:
            """A greedy job through the queue: when it ended (monotonic), and seconds per token after its first."""
            job = protocol.CompletionJob(id=protocol.new_completion_id(), model="m", prompts=[[464, 2068, 7586]],
                                         max_tokens=max_tokens, temperature=0.0, seed=0, ignore_eos=True,
                                         stream=True)
            rq_json.queue(protocol.queue_name("m"), r).enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),),
                                                                     job_id=job.id)
            last, first_token = "0-0", None
            while True:
                reply = r.xread({protocol.stream_key(job.id): last}, block=1000)
                entries = [entry for _, got in reply for entry in got]  # [] too where the attempt's fence woke it
                kinds = [protocol.decode_event(fields)[0] for _, fields in entries]
                if entries:
                    last = entries[-1][0]
                if first_token is None and "delta" in kinds:
                    first_token = time.monotonic()
                if "done" in kinds:
                    ended = time.monotonic()
                    return ended, (ended - first_token) / (max_tokens - 1) if first_token and max_tokens > 1 else None
                if not worker.alive():
                    raise RuntimeError(f"the worker exited: {worker.logs()[-2000:]}")

        launched, launched_at = time.monotonic(), time.time()
        worker = spawn_processor(server.url, models, concurrency=2, compile=compile, env=env, log_dir=work / label,
                                 wait=False, extra_args=["--compile-first"] if first else [])
        try:
            ended, _ = run(8)
            first_completion = ended - launched
            warming = []  # seconds per token of 64-token jobs that ended before the compile did
            while compiling(worker.logs()):
                _, per_token = run(64)
                if compiling(worker.logs()):
                    warming.append(per_token)
            tpot = statistics.median(run(64)[1] for _ in range(3))
            records = [json.loads(line) for line in worker.logs().splitlines() if line.startswith("{")]
        finally:
            worker.stop()
    finally:
        server.stop()
    full_speed = next((rec["ts"] - launched_at for rec in records if rec["msg"] == "decode step compiled"), None)
    phases = {rec["msg"]: rec["seconds"] for rec in records if rec["msg"] in PHASES}
    return {"start": label, "compile": "first" if first else "background", "first_completion_s": round(first_completion, 2),
            "full_speed_s": round(full_speed, 2) if full_speed is not None else None,
            "tpot_ms": round(tpot * 1000, 2),
            "tpot_warming_ms": round(statistics.median(warming) * 1000, 2) if warming else None,
            "jobs_warming": len(warming), "phases": phases}


def decode_speed(path: Path, dtype: str, background: bool) -> float:
    """This process: an engine compiled first or in the background, its median ms per token once live."""
    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels import planner
    from nanogpt.kernels.machine import cpu_flags
    from nanogpt.kernels.quantize import quantize_int8
    from nanogpt.runtime import compile_cache, precision
    from worker.engine import Engine
    from worker.protocol import CompletionJob

    chosen = precision.choose(dtype, "cpu", cpu_flags())
    planner.keep_plans(compile_cache.default_directory() / "kernel-plans")  # as the worker: one plan for every process

    def load():
        model = load_model(str(path), dtype=chosen.dtype)
        return quantize_int8(model) if chosen.int8 else model

    engine = Engine.launch(load, load_tokenizer(str(path)), max_batch=8, compile=True, compile_in_background=background)
    engine.runner.routes.wait_compiled()
    print(planner.describe(engine.runner.model), file=sys.stderr)

    def seconds(i: int, tokens: int) -> float:
        job = CompletionJob(id=f"j{i}", model="m", prompts=[[464, 2068, 7586]], max_tokens=tokens, temperature=0.0,
                            seed=0, ignore_eos=True)
        started = time.perf_counter()
        engine.submit(job).result()
        return time.perf_counter() - started

    seconds(0, 4)
    per_token = [(seconds(i, 129) - seconds(100 + i, 1)) / 128 * 1000 for i in range(1, 6)]
    engine.stop()
    return statistics.median(per_token)


def decode_pairs(path: Path, dtype: str, pairs: int) -> dict:
    """`pairs` alternating pairs of processes (decode_speed): their ms per token by way of compiling."""
    speeds = {"first": [], "background": []}
    for _ in range(pairs):
        for mode in speeds:
            done = subprocess.run([sys.executable, "-m", "bench.start_bench", "--checkpoint", str(path), "--dtype", dtype,
                                   "--decode-one", mode], check=True, capture_output=True, text=True)
            speeds[mode].append(float(done.stdout.strip().splitlines()[-1]))
    return {mode: {"ms_per_token": [round(x, 2) for x in xs], "median": round(statistics.median(xs), 2)}
            for mode, xs in speeds.items()}


def build_kernels(directory: Path) -> float:
    """`make install`'s kernel build into `directory`: seconds."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "nanogpt.kernels.extension"], check=True, capture_output=True,
                   env={**os.environ, "NANOSERVE_EXTENSIONS": str(directory)})
    return round(time.monotonic() - started, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gpt2-small")
    parser.add_argument("--checkpoint", help="a Hugging Face directory instead of --shape's random checkpoint")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="bench/.cache/start_bench.json", help="the results as JSON")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the worker's --compile / --no-compile (default: its own choice)")
    parser.add_argument("--skip-unbuilt", action="store_true", help="leave out the launch with nothing built")
    parser.add_argument("--decode-pairs", type=int, help="measure the decode speed after the switch instead")
    parser.add_argument("--decode-one", choices=("first", "background"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from nanogpt.kernels.machine import cpu_name

    path = Path(args.checkpoint) if args.checkpoint else checkpoint(args.shape)
    if args.decode_one:  # one process of --decode-pairs
        print(decode_speed(path, args.dtype, args.decode_one == "background"))
        return {}
    if args.decode_pairs:
        results = {"cpu": cpu_name(), "shape": str(args.checkpoint or args.shape), "dtype": args.dtype,
                   "code": code_version(), "decode_after_switch": decode_pairs(path, args.dtype, args.decode_pairs)}
        table = "\n".join(["| compiled | ms per token, each process | median |", "| --- | --- | ---: |"] +
                          [f"| {mode} | {', '.join(map(str, r['ms_per_token']))} | {r['median']} |"
                           for mode, r in results["decode_after_switch"].items()])
        write_results(results, table, args.out)
        return results
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanoserve-start-") as tmp:
        work = Path(tmp)
        built = work / "extensions"
        install_s = build_kernels(built)
        for first in (False, True):
            caches = {"extensions": built, "compile": work / f"compile-{first}"}
            for label in ("first start", "warm"):
                rows.append(launch(path, work / f"{label}-{first}", caches, args.dtype, first, label, args.compile))
        if not args.skip_unbuilt:
            caches = {"extensions": work / "unbuilt", "compile": work / "compile-unbuilt"}
            rows.append(launch(path, work / "unbuilt", caches, args.dtype, False, "nothing built", args.compile))
    results = {"cpu": cpu_name(), "shape": str(args.checkpoint or args.shape), "dtype": args.dtype,
               "compile": args.compile, "code": code_version(), "kernel_build_at_install_s": install_s, "rows": rows}
    table = "\n".join(["| start | compile | first completion s | full speed s | TPOT ms warming (jobs) | TPOT ms | "
                        + " | ".join(PHASES) + " |", "| --- | --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(PHASES)] +
                       [f"| {row['start']} | {row['compile']} | {row['first_completion_s']} | {row['full_speed_s']} | "
                        f"{row['tpot_warming_ms'] or ''} ({row['jobs_warming']}) | {row['tpot_ms']} | "
                        + " | ".join(str(row["phases"].get(p, "")) for p in PHASES) + " |" for row in rows])
    write_results(results, table + f"\n\nCPU kernels built at install: {install_s} s", args.out)
    return results


if __name__ == "__main__":
    main()
