"""A worker's start: seconds from `processor.py`'s launch to its first completion served, from empty
caches (cold: nothing built, nothing compiled) and then from the caches that start filled (warm),
with the phases its log gives (docs/performance.md, "Start").

    python -m bench.start_bench                       # GPT-2 small's shape, float32, this CPU
    python -m bench.start_bench --dtype int8 --no-compile

A job waits in the model's queue from the launch on; the time is until its `done` event. The
caches are private temporary directories (NANOSERVE_EXTENSIONS, NANOSERVE_COMPILE_CACHE), so the
machine's own are neither used nor touched.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import checkpoint, write_results
from bench.engine_bench import code_version

PHASES = ("weights loaded", "matmul kernels chosen", "CPU kernels built", "decode step compiled", "engine ready")


def first_completion(checkpoint_dir: Path, work: Path, caches: Path, dtype: str, compile: bool | None,
                     label: str) -> dict:
    """One launch: seconds to the first completion, and the log's phases."""
    import redis

    from tests import rq_json
    from tests.stack import spawn_processor, write_models_toml
    from web.dev.local_redis import start_redis
    from worker import protocol

    models = write_models_toml(work / "models.toml", {"m": checkpoint_dir}, device="cpu", dtype=dtype, max_batch=8)
    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        env = {"NANOSERVE_EXTENSIONS": str(caches / "extensions"), "NANOSERVE_COMPILE_CACHE": str(caches / "compile")}
        (work / label).mkdir()
        started = time.monotonic()
        worker = spawn_processor(server.url, models, concurrency=2, compile=compile, env=env, log_dir=work / label,
                                 wait=False)
        try:
            job = protocol.CompletionJob(id=protocol.new_completion_id(), model="m", prompts=[[464, 2068, 7586]],
                                         max_tokens=8, temperature=0.0, seed=0)
            rq_json.queue(protocol.queue_name("m"), r).enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),),
                                                                     job_id=job.id)
            last = "0-0"
            while True:
                reply = r.xread({protocol.stream_key(job.id): last}, block=1000)
                entries = [entry for _, got in reply for entry in got]  # [] too where the attempt's fence woke it
                kinds = [protocol.decode_event(fields)[0] for _, fields in entries]
                if entries:
                    last = entries[-1][0]
                if "done" in kinds:
                    seconds = time.monotonic() - started
                    break
                if not worker.alive():
                    raise RuntimeError(f"the worker exited: {worker.logs()[-2000:]}")
            records = [json.loads(line) for line in worker.logs().splitlines() if line.startswith("{")]
        finally:
            worker.stop()
    finally:
        server.stop()
    phases = {r["msg"]: r.get("seconds", r.get("load_seconds")) for r in records if r["msg"] in PHASES}
    return {"start": label, "first_completion_s": round(seconds, 2), "phases": phases}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gpt2-small")
    parser.add_argument("--checkpoint", help="a Hugging Face directory instead of --shape's random checkpoint")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the worker's --compile / --no-compile (default: its own choice)")
    parser.add_argument("--out", default="bench/.cache/start_bench.json", help="the results as JSON")
    args = parser.parse_args(argv)
    from nanogpt.kernels.machine import cpu_name

    path = Path(args.checkpoint) if args.checkpoint else checkpoint(args.shape)
    with tempfile.TemporaryDirectory(prefix="nanoserve-start-") as tmp:
        work, caches = Path(tmp), Path(tmp) / "caches"
        rows = [first_completion(path, work, caches, args.dtype, args.compile, label) for label in ("cold", "warm")]
    results = {"cpu": cpu_name(), "shape": str(args.checkpoint or args.shape), "dtype": args.dtype,
               "compile": args.compile, "code": code_version(), "rows": rows}
    table = "\n".join(["| start | first completion s | " + " | ".join(PHASES) + " |",
                       "| --- | ---: |" + " ---: |" * len(PHASES)] +
                      [f"| {row['start']} | {row['first_completion_s']} | " +
                       " | ".join(str(row["phases"].get(p, "")) for p in PHASES) + " |" for row in rows])
    write_results(results, table, args.out)
    return results


if __name__ == "__main__":
    main()
