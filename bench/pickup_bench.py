"""How fast a worker takes a burst of jobs: N jobs enqueued at once (one pipeline, as N web requests
arriving together would leave them) on a private Redis, taken by a real `WorkerPool` (the engine's
consumer, with room for N jobs) feeding the real engine (the tiny random-weight GPT-2, on the CPU, whose steps cost little), with
the jobs' own arguments as web queues them.

    python -m bench.pickup_bench [--jobs 64] [--bursts 8] [--max-tokens 64] [--[no-]overlap]
                                 [--decode-steps N] [--json PATH]

Reported per burst, from the enqueue: when the first and the last job reached the engine (its
`submit`) and when the last finished (rq's finished registry); then how long the same jobs take
submitted to the engine straight (`engine_alone_ms`), and what the worker keeps of that
(`keeps`: alone over all finished); medians over the bursts, after one burst to warm up. What it
measures is the worker's path around the engine: dequeue, rq's bookkeeping, the attempt opened on
the job's stream, the job's end recorded, and the GIL they take from the engine's thread.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from bench import checkpoint, write_results


def burst_times(jobs: int, bursts: int, max_tokens: int, **engine_options) -> list[dict[str, float]]:
    """Each burst's times (see the module docstring); `engine_options` go to the Engine (overlap,
    decode_steps)."""
    from rq import Queue, Retry

    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from web.dev.local_redis import start_redis
    from worker import protocol
    from worker.consumer import Binding, WorkerPool
    from worker.engine import Engine
    from worker.events import StreamWriter

    for name in ("rq.worker", "rq.job", "rq.queue"):  # as processor.py: rq logs every job
        logging.getLogger(name).setLevel(logging.WARNING)
    model_dir = checkpoint("tiny")
    server = start_redis()
    pool = engine = None
    try:
        client = protocol.redis_client(server.url)
        writer = StreamWriter(protocol.redis_client(server.url))
        engine = Engine.launch(lambda: load_model(model_dir, device="cpu", dtype=torch.float32),
                               load_tokenizer(model_dir), max_batch=jobs, max_len=128, event_sink=writer,
                               **engine_options)
        reached: dict[str, float] = {}
        submit = engine.submit

        def timed_submit(job, resume=None):
            reached[job.id] = time.perf_counter()
            return submit(job, resume)

        engine.submit = timed_submit

        def make_job(job_id: str, i: int) -> protocol.CompletionJob:
            return protocol.CompletionJob(id=job_id, model="m", prompts=[list(range(100 + i, 132 + i))],
                                          max_tokens=max_tokens, temperature=0.0, seed=0, ignore_eos=True)
        pool = WorkerPool(server.url)
        pool.add(Binding("m", engine, writer), "cpu", jobs)
        queue = Queue(protocol.queue_name("m"), connection=client, serializer=protocol.SERIALIZER)
        finished = queue.finished_job_registry
        results = []
        for b in range(bursts + 1):
            datas, ids = [], []
            for i in range(jobs):
                job = make_job(f"b{b}-{i}", i)
                datas.append(Queue.prepare_data(protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id,
                                                timeout=900, ttl=900, result_ttl=600, failure_ttl=600,
                                                retry=Retry(max=2, enqueue_at_front=True)))
                ids.append(job.id)
            before = finished.count
            start = time.perf_counter()
            queue.enqueue_many(datas)
            while finished.count < before + jobs:
                time.sleep(0.002)
            ended = time.perf_counter()
            alone = time.perf_counter()
            for handle in [submit(make_job(f"a{b}-{i}", i)) for i in range(jobs)]:
                handle.result()
            alone = time.perf_counter() - alone
            if b:  # the first burst warms up
                arrivals = sorted(reached[i] - start for i in ids)
                results.append({"first_in_engine_ms": 1000 * arrivals[0], "last_in_engine_ms": 1000 * arrivals[-1],
                                "all_finished_ms": 1000 * (ended - start), "engine_alone_ms": 1000 * alone,
                                "keeps": alone / (ended - start)})
        return results
    finally:
        if pool is not None:
            pool.stop()
            pool.join(idle_grace=2.0)
        if engine is not None:
            engine.stop()
        server.stop()


def main(argv: list[str] | None = None) -> None:
    from nanogpt.kernels.machine import cpu_name

    parser = argparse.ArgumentParser(prog="bench.pickup_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine runs a step ahead (default: the engine's, on a GPU)")
    parser.add_argument("--decode-steps", type=int, default=None, help="the engine's decode_steps (default: the engine's)")
    parser.add_argument("--json", default="bench/.cache/pickup_bench.json")
    args = parser.parse_args(argv)
    options = {"overlap": args.overlap, "decode_steps": args.decode_steps}
    bursts = burst_times(args.jobs, args.bursts, args.max_tokens, **options)
    median = {key: statistics.median(b[key] for b in bursts) for key in bursts[0]}
    results = {"cpu": cpu_name(), "jobs": args.jobs, "max_tokens": args.max_tokens, **options, "bursts": bursts,
               "median": median}
    table = (f"{args.jobs} jobs at once, medians of {args.bursts} bursts ({cpu_name()}): first in the engine "
             f"{median['first_in_engine_ms']:.1f} ms, last {median['last_in_engine_ms']:.1f} ms, all finished "
             f"{median['all_finished_ms']:.1f} ms; the same jobs straight to the engine {median['engine_alone_ms']:.1f} ms "
             f"(the worker keeps {median['keeps']:.2f} of it)")
    write_results(results, table, args.json)


if __name__ == "__main__":
    main()
