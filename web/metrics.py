"""Prometheus metrics of the web tier, served at `/metrics`.

- `nanoserve_http_requests_total{method,route,status}`: requests answered; `route` is the URL rule
  (`/v1/jobs/<job_id>`), so the label set stays bounded.
- `nanoserve_http_request_duration_seconds{method,route}`: until the last byte, streams included.
- `nanoserve_time_to_first_token_seconds{model}`: request start to the first token, reported by the
  completions route through `observe_ttft`.
- `nanoserve_queue_depth{model}`, `nanoserve_queue_workers{model}`, `nanoserve_redis_up`: read from
  Redis when scraped, so every web process reports the same numbers.

Multi-process safe: when `PROMETHEUS_MULTIPROC_DIR` is set (gunicorn with several workers), each
process writes its samples to files there and a scrape merges them (prometheus_client's multiprocess
mode). The variable must be set before this module is first imported, and the directory must be
empty when the server starts; `python -m web.dev.devserver` and docker-compose.yml do both.

`NANOSERVE_METRICS_AUTH=required` puts `/metrics` behind an API key (`web.access.authorize_metrics`);
by default it is open, like `/health`, for a Prometheus on the private network.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable

import redis
from flask import Flask, Response, g, request
from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram,
                               generate_latest, multiprocess)
from prometheus_client.core import GaugeMetricFamily
from rq import Queue
from rq.worker_registration import get_keys

from web import access
from worker.protocol import SERIALIZER, queue_name

MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if MULTIPROC_DIR:
    os.makedirs(MULTIPROC_DIR, exist_ok=True)

REQUESTS = Counter("nanoserve_http_requests_total", "HTTP requests answered, by route and status.",
                   ["method", "route", "status"])
LATENCY = Histogram("nanoserve_http_request_duration_seconds",
                    "Time from request start to the last byte of the response (streams included).",
                    ["method", "route"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
TTFT = Histogram("nanoserve_time_to_first_token_seconds",
                 "Time from request start to the first generated token, by model.", ["model"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))


def observe_ttft(model: str, seconds: float) -> None:
    """Record one request's time to first token (called by the completions route)."""
    TTFT.labels(model).observe(seconds)


class QueueCollector:
    """Queue depth and registered workers of each model's rq queue, read from Redis at scrape time."""

    def __init__(self, model_ids: Callable[[], Iterable[str]], connection: Callable[[], redis.Redis]):
        self.model_ids = model_ids
        self.connection = connection

    def collect(self):
        depth = GaugeMetricFamily("nanoserve_queue_depth", "Jobs waiting in each model's queue.", labels=["model"])
        workers = GaugeMetricFamily("nanoserve_queue_workers", "Live rq workers on each model's queue.",
                                    labels=["model"])
        up = GaugeMetricFamily("nanoserve_redis_up", "1 when Redis answered this scrape, else 0.")
        try:
            conn = self.connection()
            for model in self.model_ids():
                queue = Queue(queue_name(model), connection=conn, serializer=SERIALIZER)
                depth.add_metric([model], queue.count)
                # A crashed worker's registration outlives it until its key expires: count live keys.
                keys = get_keys(queue)
                workers.add_metric([model], conn.exists(*keys) if keys else 0)
        except redis.RedisError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield from (depth, workers, up)


class _ProcessRegistry:
    """This process's own metrics (single-process mode), as a collector for a scrape registry."""

    def collect(self):
        return REGISTRY.collect()


def scrape(queue_collector: QueueCollector | None = None) -> bytes:
    """The Prometheus text exposition of this web tier: every process's samples plus the queues."""
    registry = CollectorRegistry()
    if MULTIPROC_DIR:
        multiprocess.MultiProcessCollector(registry, path=MULTIPROC_DIR)
    else:
        registry.register(_ProcessRegistry())
    if queue_collector is not None:
        registry.register(queue_collector)
    return generate_latest(registry)


def _route() -> str:
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def init_app(app: Flask, model_ids: Callable[[], Iterable[str]] | None = None,
             connection: Callable[[], redis.Redis] | None = None) -> None:
    """Count and time every request and serve `/metrics`.

    `model_ids` and `connection` say which queues to report and how to reach Redis; by default the
    app's served models and its queue's Redis connection (`web.api.models`, `web.api.queue`).
    """
    if model_ids is None:
        served = app.extensions["nanoserve.models"]
        model_ids = lambda: [spec.id for spec in served.registry.models()]  # noqa: E731
    if connection is None:
        connection = lambda: app.extensions["nanoserve.queue"].redis  # noqa: E731
    queues = QueueCollector(model_ids, connection)

    @app.before_request
    def _start_timer():
        g.metrics_started = time.perf_counter()

    @app.after_request
    def _count(response):
        labels = (request.method, _route())
        status = str(response.status_code)
        started = g.get("metrics_started", time.perf_counter())

        def observe():
            REQUESTS.labels(*labels, status).inc()
            LATENCY.labels(*labels).observe(time.perf_counter() - started)

        # A streamed body is still being produced: time it when the server closes it.
        if response.is_streamed:
            response.call_on_close(observe)
        else:
            observe()
        return response

    @app.get("/metrics")
    def metrics():
        access.authorize_metrics(request)  # open unless NANOSERVE_METRICS_AUTH=required
        return Response(scrape(queues), content_type=CONTENT_TYPE_LATEST)
