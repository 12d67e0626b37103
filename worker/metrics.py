"""Prometheus metrics of a worker process, served on their own port (`processor.py --metrics-port`).

Read from each engine's stats snapshot (`engine.stats()`) when scraped, so the engine's hot loop
pays nothing for them:

- `nanoserve_worker_running_sequences{model,device}`: sequences in the running batch
- `nanoserve_worker_waiting_requests{model,device}`: submitted, not yet admitted
- `nanoserve_worker_kv_slots_used{model,device}`, `nanoserve_worker_kv_slots_total{model,device}`
- `nanoserve_worker_tokens_generated_total{model,device}`: completion tokens since start
- `nanoserve_worker_prompt_tokens_total{model,device}`, `nanoserve_worker_steps_total{model,device}`
  (batched forwards)
- `nanoserve_worker_busy_seconds_total{model,device}`: time the engine spent in its steps; its rate
  is the engine's utilization, and busy seconds over steps its time a forward
- `nanoserve_worker_prefix_cache_queried_tokens_total{model,device}`, `…_hit_tokens_total`: the
  prompt tokens that looked for a cached prefix, and those found (the hit rate is their ratio; the
  hits are the prefill tokens saved)
- `nanoserve_worker_warming_up{model,device}`: 1 while the engine compiles its decode step's graphs
  in the background (serving eagerly meanwhile), else 0; `nanoserve_worker_compiled_graphs_live`:
  the compiled graphs its steps take so far
- `nanoserve_worker_tokens_per_second{model,device}`: over the time since the previous scrape
  (at least `min_window` seconds; `rate(nanoserve_worker_tokens_generated_total[1m])` is the
  Prometheus way to get it over a fixed window)
- `nanoserve_worker_batch_size{model,device}`: histogram of the batch size of every decode step
- `nanoserve_worker_step_phase_seconds_total{model,device,phase}`: where the busy seconds went
  (worker/engine.py STEP_PHASES: schedule, forward, wait, take_in, events)
- `nanoserve_worker_step_kind_steps_total{model,device,kind}`, `…_forwards_total`, `…_seconds_total`:
  the steps, their forwards and busy seconds by what they ran (worker/engine.py STEP_KINDS: only
  decoding rows, prompt tokens fed, anything else)

The snapshot is a dict; keys it lacks are simply not reported:
    {"device": str, "running": int, "waiting": int, "kv_slots_used": int, "kv_slots_total": int,
     "tokens_generated": int, "prompt_tokens": int, "steps": int, "busy_seconds": float,
     "batch_size_counts": {size: steps},
     "prefix_cache_queried_tokens": int, "prefix_cache_hit_tokens": int, "warming_up": int,
     "compiled_graphs_live": int, "step_phase_seconds": {phase: float},
     "step_kinds": {kind: {"steps": int, "forwards": int, "seconds": float}}}
The `model` label comes from passing `(model_id, engine)` pairs to `start` (or a "model" key).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_GAUGES = {
    "running": ("nanoserve_worker_running_sequences", "Sequences in the engine's running batch."),
    "waiting": ("nanoserve_worker_waiting_requests", "Requests submitted to the engine, not yet admitted."),
    "kv_slots_used": ("nanoserve_worker_kv_slots_used", "KV-cache sequence slots in use."),
    "kv_slots_total": ("nanoserve_worker_kv_slots_total", "KV-cache sequence slots allocated."),
    "warming_up": ("nanoserve_worker_warming_up", "1 while the decode step's graphs compile in the background."),
    "compiled_graphs_live": ("nanoserve_worker_compiled_graphs_live", "Compiled decode graphs the engine's steps take."),
}
_COUNTERS = {
    "tokens_generated": ("nanoserve_worker_tokens_generated", "Completion tokens generated."),
    "prompt_tokens": ("nanoserve_worker_prompt_tokens", "Prompt tokens prefilled."),
    "steps": ("nanoserve_worker_steps", "Batched forwards the engine ran."),
    "busy_seconds": ("nanoserve_worker_busy_seconds", "Seconds the engine spent in its steps (the rest it waited "
                                                      "for work)."),
    "prefix_cache_queried_tokens": ("nanoserve_worker_prefix_cache_queried_tokens",
                                    "Prompt tokens of the prefills that looked for a cached prefix."),
    "prefix_cache_hit_tokens": ("nanoserve_worker_prefix_cache_hit_tokens",
                                "Prompt tokens whose keys and values came from the prefix cache."),
}
LABELS = ["model", "device"]
_KIND_COUNTERS = {"steps": "Engine steps, by what they ran.", "forwards": "Batched forwards, by what their step ran.",
                  "seconds": "Seconds of the engine's steps, by what they ran."}


def _named(engines: Iterable[Any]) -> list[tuple[str | None, Any]]:
    """[(model_id or None, engine)] from engines or (model_id, engine) pairs."""
    return [item if isinstance(item, tuple) else (None, item) for item in engines]


def batch_size_histogram(counts: dict) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum from {batch_size: steps}."""
    counts = {int(size): int(steps) for size, steps in counts.items()}
    buckets = [(str(bound), float(sum(n for size, n in counts.items() if size <= bound)))
               for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets, float(sum(size * n for size, n in counts.items()))


class EngineCollector:
    """Turns engine stats snapshots into metric families at scrape time."""

    def __init__(self, engines: Iterable[Any], min_window: float = 1.0):
        self.engines = _named(engines)
        self.min_window = min_window
        self._lock = threading.Lock()  # the HTTP server scrapes from its own threads
        now = time.monotonic()
        # Per engine: (time, tokens_generated) of the sample tokens/s is measured from.
        self._since = [(now, int(e.stats().get("tokens_generated", 0))) for _, e in self.engines]

    def collect(self):
        gauges = {key: GaugeMetricFamily(name, doc, labels=LABELS) for key, (name, doc) in _GAUGES.items()}
        counters = {key: CounterMetricFamily(name, doc, labels=LABELS) for key, (name, doc) in _COUNTERS.items()}
        rate = GaugeMetricFamily("nanoserve_worker_tokens_per_second",
                                 "Completion tokens per second since the previous scrape.", labels=LABELS)
        batch = HistogramMetricFamily("nanoserve_worker_batch_size", "Batch size of each decode step.",
                                      labels=LABELS)
        phases = CounterMetricFamily("nanoserve_worker_step_phase_seconds",
                                     "Seconds of the engine's steps, by phase.", labels=[*LABELS, "phase"])
        kinds = {key: CounterMetricFamily(f"nanoserve_worker_step_kind_{key}", doc, labels=[*LABELS, "kind"])
                 for key, doc in _KIND_COUNTERS.items()}
        with self._lock:
            for i, (model, engine) in enumerate(self.engines):
                stats = engine.stats()
                labels = [str(model or stats.get("model") or f"engine{i}"), str(stats.get("device", "unknown"))]
                for key, family in {**gauges, **counters}.items():
                    if key in stats:
                        family.add_metric(labels, float(stats[key]))
                if "tokens_generated" in stats:
                    generated = int(stats["tokens_generated"])
                    now = time.monotonic()
                    then, before = self._since[i]
                    rate.add_metric(labels, (generated - before) / max(now - then, 1e-9))
                    if now - then >= self.min_window:
                        self._since[i] = (now, generated)
                if "batch_size_counts" in stats:
                    buckets, total = batch_size_histogram(stats["batch_size_counts"])
                    batch.add_metric(labels, buckets, total)
                for phase, seconds in stats.get("step_phase_seconds", {}).items():
                    phases.add_metric([*labels, phase], float(seconds))
                for kind, counts in stats.get("step_kinds", {}).items():
                    for key, family in kinds.items():
                        family.add_metric([*labels, kind], float(counts[key]))
        yield from gauges.values()
        yield from counters.values()
        yield from (rate, batch, phases)
        yield from kinds.values()


def start(engines: Iterable[Any], port: int, addr: str = "0.0.0.0"):
    """Serve the engines' metrics (plus this process's CPU and memory) on `addr:port`.

    `engines`: engines, or `(model_id, engine)` pairs so the metrics carry the model's name.

    Returns the HTTP server; it runs on a daemon thread, `server.shutdown()` stops it.
    """
    registry = CollectorRegistry()
    registry.register(EngineCollector(engines))
    ProcessCollector(registry=registry)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
