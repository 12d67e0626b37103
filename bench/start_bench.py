"""A worker's start: seconds from `processor.py`'s launch to its first completion served and to full
speed (its decode step's graphs all live), and its decode speed then, as it starts by default
(serving at once while its graphs compile in the background) and with `--compile-first`; from
empty compile caches (first start) and then from the caches that start filled (warm), with the
phases its log gives (docs/performance.md, "Start").

    python -m bench.start_bench                       # GPT-2 small's shape, float32, this CPU
    python -m bench.start_bench --dtype int8

The CPU kernels are built first, as `make install` builds them, and that build is timed; a last
launch starts without them (nothing built, nothing compiled). Each launch has a job waiting in the
model's queue; the first completion is its `done` event. Full speed is the log's "decode step
compiled". The decode speed is the median over 3 greedy 64-token jobs, one at a time, after full
speed, from their first token's event to their `done` event. The caches are private temporary
directories (NANOSERVE_EXTENSIONS, NANOSERVE_COMPILE_CACHE), so the machine's own are neither used
nor touched.
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


def launch(checkpoint_dir: Path, work: Path, caches: dict[str, Path], dtype: str, first: bool, label: str) -> dict:
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
        worker = spawn_processor(server.url, models, concurrency=2, compile=None, env=env, log_dir=work / label,
                                 wait=False, extra_args=["--compile-first"] if first else [])
        try:
            ended, _ = run(8)
            first_completion = ended - launched
            while compiling(worker.logs()):
                time.sleep(0.2)
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
            "tpot_ms": round(tpot * 1000, 2), "phases": phases}


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
    args = parser.parse_args(argv)
    from nanogpt.kernels.machine import cpu_name

    path = Path(args.checkpoint) if args.checkpoint else checkpoint(args.shape)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nanoserve-start-") as tmp:
        work = Path(tmp)
        built = work / "extensions"
        install_s = build_kernels(built)
        for first in (False, True):
            caches = {"extensions": built, "compile": work / f"compile-{first}"}
            for label in ("first start", "warm"):
                rows.append(launch(path, work / f"{label}-{first}", caches, args.dtype, first, label))
        caches = {"extensions": work / "unbuilt", "compile": work / "compile-unbuilt"}
        rows.append(launch(path, work / "unbuilt", caches, args.dtype, False, "nothing built"))
    results = {"cpu": cpu_name(), "shape": str(args.checkpoint or args.shape), "dtype": args.dtype,
               "code": code_version(), "kernel_build_at_install_s": install_s, "rows": rows}
    table = "\n".join(["| start | compile | first completion s | full speed s | TPOT ms | " + " | ".join(PHASES) + " |",
                       "| --- | --- | ---: | ---: | ---: |" + " ---: |" * len(PHASES)] +
                      [f"| {row['start']} | {row['compile']} | {row['first_completion_s']} | {row['full_speed_s']} | "
                       f"{row['tpot_ms']} | " + " | ".join(str(row["phases"].get(p, "")) for p in PHASES) + " |"
                       for row in rows])
    write_results(results, table + f"\n\nCPU kernels built at install: {install_s} s", args.out)
    return results


if __name__ == "__main__":
    main()
