"""The worker process: load each model once per device, run one batching engine per (model, device),
and feed the engines from the models' rq queues. On a GPU each engine runs in a process of its own
(--engine-process: worker/engine_process.py), this one keeping rq, the event writers and the heartbeats.

    python processor.py [--model NAME ...] [--device cpu|cuda:0|cuda:0,cuda:1|all]
                        [--concurrency N] [--batch-concurrency N] [--redis-url URL]

Several processors (on one machine or many) may serve the same model: they share its queue.
SIGTERM or Ctrl-C: take no new jobs, finish the running ones, exit 0 (a second signal exits at once;
the jobs it interrupts are re-queued by rq once their heartbeats expire). Logs are JSON lines.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
import time

from worker import protocol

log = logging.getLogger("processor")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra` fields."""

    _plain = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in self._plain})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # rq logs every job at INFO; ours already says what matters per job.
    for name in ("rq.worker", "rq.job", "rq.queue"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    # an exception that ends a thread (the engine's, a worker's) is logged like the rest
    threading.excepthook = lambda args: log.critical(
        "thread died", extra={"thread_name": args.thread.name if args.thread else None},
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def parse_devices(value: str) -> list[str]:
    """`cpu`, `cuda:0`, `cuda:0,cuda:1`, `all` (every visible GPU, else the CPU) or `auto`
    (the first GPU, else the CPU)."""
    if value in ("all", "auto"):
        import torch

        count = torch.cuda.device_count()
        if not count:
            return ["cpu"]
        return [f"cuda:{i}" for i in range(count)] if value == "all" else ["cuda:0"]
    return [d.strip() for d in value.split(",") if d.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", dest="models", metavar="NAME",
                        help="model id or alias from the registry (repeatable; default: every model)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda:0, cuda:0,cuda:1, all or auto (default: the model's registry "
                             "setting, whose default is auto: the first GPU, else the CPU)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="jobs one engine runs at once "
                             "(default: the engine's KV-cache slots, its model's max_batch)")
    parser.add_argument("--batch-concurrency", type=int, default=None,
                        help="of those jobs, how many may be batch jobs, taken when no interactive job "
                             "waits (default: all but a quarter, at least 1); the rest stay free for "
                             "interactive requests")
    parser.add_argument("--redis-url", default=None,
                        help="redis://…, rediss://… or redis+sentinel://host:port,…/master/db (default: "
                             "$REDIS_URL, or $REDIS_SENTINELS with $REDIS_SENTINEL_MASTER)")
    parser.add_argument("--models-file", default=None, help="models.toml (default: $NANOSERVE_MODELS)")
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="seconds between job heartbeats; a job is re-queued after 3 missed beats")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the decode step (faster steps); default: where it pays, "
                             "float32, bfloat16 and int8 on a CPU with a C++ compiler "
                             "(nanogpt/runtime/compile.py). The worker serves at once, eagerly, while its "
                             "graphs compile in the background (a minute or two on a first start, seconds "
                             "from the compile cache), each taken from the step after it is ready")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="run each engine step ahead of taking its tokens in, so that the host's work "
                             "(text, stops, events) runs while the GPU computes the next step; "
                             "default: on a GPU (docs/notes/overlap.md)")
    parser.add_argument("--decode-steps", type=_at_least_one, default=None, metavar="N",
                        help="with --overlap, the most decode forwards a step runs while no request waits "
                             "for a slot or a prefill, each fed the one before's draws on the device: the "
                             "scheduling, the take-in and the event write are paid once for them; default: 4 "
                             "on a GPU, 1 on a CPU (docs/notes/decode-steps.md)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run each engine in a process of its own, this one keeping rq and the event "
                             "writer, whose Python would otherwise hold the GIL the engine launches with; "
                             "default: on a GPU (worker/engine_process.py)")
    parser.add_argument("--compile-first", action="store_true",
                        help="compile every graph before taking jobs, instead of in the background")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics of the engines on this port")
    parser.add_argument("--warm-up", action="store_true",
                        help="load each model, build the kernels and compile its decode step into the "
                             "caches, then exit without serving (for image builds: a later start loads "
                             "them instead of building them, its graphs live in seconds; no Redis needed)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_engine(spec, device: str, sink, compile: bool | None = False, background: bool = False,
                 overlap: bool | None = None, decode_steps: int | None = None):
    """Load the model and tokenizer onto one device and wrap them in a started engine, in the
    precision nanogpt.runtime.precision chooses for the registry's dtype on this hardware (a CPU without
    native bf16 runs float32 for bfloat16, and says so); CPU matmuls get this machine's fastest
    kernels (nanogpt.kernels.planner). `compile`: compile the decode step, or None: where it pays
    (nanogpt.runtime.compile.compiles_by_default); `background`: compile it while the engine serves
    (Engine's compile_in_background). The model is loaded on the engine's thread (Engine.launch)."""
    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels import planner
    from nanogpt.kernels.machine import cpu_flags
    from nanogpt.kernels.quantize import quantize_int8
    from nanogpt.runtime import precision
    from nanogpt.runtime.compile import compiles_by_default
    from worker.engine import Engine

    flags = cpu_flags()
    try:
        chosen = precision.choose(spec.dtype, device, flags)
    except ValueError as err:
        raise SystemExit(f"model `{spec.id}`: {err}")
    if chosen.note:
        log.warning(chosen.note, extra={"model": spec.id, "device": device})
    if compile is None:
        compile = compiles_by_default(device, chosen.name)
    started = time.monotonic()

    def load():  # on the engine's thread (Engine.launch)
        log.info("loading weights", extra={"model": spec.id, "device": device, "dtype": chosen.name})
        began = time.monotonic()
        model = load_model(spec.checkpoint, device=device, dtype=chosen.dtype)
        if chosen.int8:
            quantize_int8(model)
        log.info("weights loaded", extra={"model": spec.id, "seconds": round(time.monotonic() - began, 2)})
        faster = precision.faster_options(chosen, device, flags)
        if faster:
            log_faster_options(spec.id, model, faster)
        return model

    engine = Engine.launch(load, load_tokenizer(spec), max_batch=spec.max_batch, max_len=spec.context_length,
                           event_sink=sink, compile=compile, compile_in_background=background,
                           prefix_caching=spec.prefix_caching, overlap=overlap, decode_steps=decode_steps)
    model = engine.runner.model
    log.info("engine ready", extra={"model": spec.id, "device": device, "dtype": chosen.name,
                                    "kernels": planner.describe(model), "max_batch": engine.runner.slots,
                                    "compiled": engine.runner.compiled, "warming_up": engine.warming,
                                    "overlap": engine.overlap, "decode_steps": engine.decode_steps,
                                    # keys and values: the model's dtype, float32 or bfloat16 (precision.cache_dtype)
                                    "kv_cache": str(engine.runner.cache.k[0].dtype).removeprefix("torch."),
                                    # decode steps replayed from CUDA graphs (a GPU; 0 where recording failed),
                                    # and the draws recorded beside them (0: the sampler draws every step)
                                    "cuda_graphs": len(engine.runner.graphs.graphs) if engine.runner.graphs else 0,
                                    "draw_graphs": len(engine.runner.graphs.draw_graphs) if engine.runner.graphs else 0,
                                    "load_seconds": round(time.monotonic() - started, 2)})
    return engine


def build_served_engine(spec, device: str, options: dict, sink):
    """`build_engine` for serving in an engine's own process (worker/engine_process.py): what it
    loaded frozen there, and once a background compile has ended, its graphs too."""
    engine = build_engine(spec, device, sink, **options)
    freeze_heap()
    if engine.warming:
        def freeze_when_compiled():
            engine.runner.routes.wait_compiled()
            freeze_heap(collect=False)

        threading.Thread(target=freeze_when_compiled, name="freeze-when-compiled", daemon=True).start()
    return engine


def freeze_heap(collect: bool = True) -> None:
    """Keep what loading built out of the garbage collector's full passes. A loaded, compiled
    engine leaves hundreds of thousands of tracked objects (modules, compiled graphs, their
    guards), and a full collection walks them all while holding the GIL, every thread of the
    worker (the engine's step included) stopped for a good part of a second (docs/notes/frozen-heap.md).
    Collected once, then frozen, a full pass walks only what serving allocates since. Once the
    background compile has ended its graphs are frozen too, without that collection (which would
    stop the serving engine)."""
    if collect:
        gc.collect()
    gc.freeze()
    log.info("loaded objects frozen", extra={"objects": gc.get_freeze_count()})


def batch_limit(concurrency: int, asked: int | None) -> int:
    """How many of an engine's `concurrency` jobs may be batch jobs: as asked (within those), or all
    but a quarter, so interactive requests always find room."""
    if asked is not None:
        return max(0, min(asked, concurrency))
    return max(1, concurrency - max(1, concurrency // 4))


def log_faster_options(model_id: str, model, options: list[str]) -> None:
    """Say once, at load, which faster precisions this CPU runs, with how they ran a
    sample of this model's weight matmuls just now against float32."""
    import torch

    from nanogpt.kernels import planner

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtypes = {"bfloat16": torch.bfloat16, "int8": torch.qint8}
    factors = planner.speedups(layers, [dtypes[o] for o in options]) if layers else {}
    measured = {o: {rows: round(f, 2) for rows, f in factors[dtypes[o]].items()} for o in options if factors}
    log.info(f"float32 on a CPU that runs {' and '.join(options)} faster (set dtype in "
             "models.toml; float32 is the exact one); this model's weight matmuls, "
             + ("measured just now, × float32 at 1 / 8 rows: "
                + "; ".join(f"{o} {' / '.join(map(str, by_rows.values()))}" for o, by_rows in measured.items())
                if measured else "not measured: other processes were busy"),
             extra={"model": model_id, "faster_dtypes": measured or dict.fromkeys(options)})


def check_engines(engines) -> int:
    """1 when an engine thread has died (an exception escaped its loop): the process then stops,
    exiting 1 so its supervisor restarts it. The dead engine's jobs fail within a second
    (consumer.Consumer._watch) and rq retries them, at the front of the queue, on any worker."""
    dead = [model_id for model_id, engine in engines if not engine.is_alive()]
    if dead:
        log.error("engine thread died; stopping so the process is restarted", extra={"models": dead})
    return 1 if dead else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        args.redis_url = args.redis_url or protocol.redis_url_from_env()
    except ValueError as err:
        log.error("cannot serve", extra={"error": str(err)})
        return 2

    from models.registry import ModelNotFoundError, Registry, RegistryError
    from nanogpt.checkpoint import CheckpointError
    from worker.consumer import Binding, WorkerPool
    from worker.engine_process import EngineBuildError, EngineProcess
    from worker.events import StreamWriter

    try:
        registry = Registry.from_file(args.models_file)
        specs = [registry.get(name) for name in args.models] if args.models else registry.models()
        for spec in specs:
            spec.resolved  # a missing or unreadable checkpoint fails here, before anything starts
    except (RegistryError, ModelNotFoundError) as err:
        log.error("cannot serve", extra={"error": str(err)})
        return 2
    targets = [(spec, device) for spec in specs for device in parse_devices(args.device or spec.device)]

    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            log.warning("second signal: exiting without finishing running jobs")
            os._exit(1)
        log.info("shutting down: finishing running jobs", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from nanogpt.kernels import planner
    from nanogpt.runtime import compile_cache

    # a later start on this CPU reads the kernel plans this one measures (seconds of timing)
    planner.keep_plans(compile_cache.default_directory() / "kernel-plans")
    pool = WorkerPool(args.redis_url, heartbeat_interval=args.heartbeat)
    engines = []
    status = 0
    try:
        for spec, device in targets:
            if stop.is_set():  # asked to stop while models were loading
                break
            # The writer's thread writes the engine's events: connect fast; a failed write is retried later.
            client = protocol.redis_client(args.redis_url, socket_connect_timeout=2, socket_timeout=5)
            writer = StreamWriter(client)
            options = dict(compile=args.compile, background=not (args.compile_first or args.warm_up),
                           overlap=args.overlap, decode_steps=args.decode_steps)
            apart = not args.warm_up and (args.engine_process if args.engine_process is not None
                                          else device.startswith("cuda"))
            try:
                if apart:
                    engine = EngineProcess(functools.partial(build_served_engine, spec, device, options), writer,
                                           setup=functools.partial(setup_logging, args.log_level))
                else:
                    engine = build_engine(spec, device, writer, **options)
            except (CheckpointError, EngineBuildError) as err:
                log.error("cannot load model", extra={"model": spec.id, "device": device, "error": str(err)})
                status = 2
                break
            engines.append((spec.id, engine))
            if args.warm_up:
                continue
            freeze_heap()
            concurrency = args.concurrency or engine.slots
            batch_concurrency = batch_limit(concurrency, args.batch_concurrency)
            pool.add(Binding(spec.id, engine, writer), device, concurrency, batch_concurrency)
            log.info("serving", extra={"model": spec.id, "device": device,
                                       "queue": protocol.queue_name(spec.id), "concurrency": concurrency,
                                       "batch_queue": protocol.batch_queue_name(spec.id),
                                       "batch_concurrency": batch_concurrency})
        if args.warm_up:  # built, compiled and cached: what a later start loads in seconds
            log.info("warmed up; exiting", extra={"models": [model_id for model_id, _ in engines]})
            return status
        if args.metrics_port and not status:
            from worker import metrics

            metrics.start(engines, args.metrics_port)
        warming = any(engine.warming for _, engine in engines)
        while not status and not stop.wait(0.5):
            status = check_engines(engines)
            if warming and not any(engine.warming for _, engine in engines):
                warming = False
                freeze_heap(collect=False)
        pool.stop()
        log.info("taking no new jobs; waiting for running ones", extra={"running": pool.running()})
        pool.join()
    finally:
        for _, engine in engines:
            engine.stop()
        # what an outage kept back gets a last chance to land (the writers' retry threads are daemons)
        if not all(engine.event_sink.wait_written(timeout=5.0) for _, engine in engines):
            log.warning("leaving with events Redis did not take")
    log.info("stopped")
    if any(engine.warming for _, engine in engines):
        # a compile still running on its thread would abort the interpreter's exit (std::terminate):
        # leave without the exit's handlers, stopping inductor's compile workers as its handler would
        async_compile = sys.modules.get("torch._inductor.async_compile")
        if async_compile is not None:
            async_compile.shutdown_compile_workers()
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
