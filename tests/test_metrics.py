"""Prometheus metrics: the web tier's request counters, latency/TTFT histograms and queue depth (one
process and merged across gunicorn processes), and the worker's engine metrics on their own port."""
from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests import rq_json
from tests.stack import spawn_gunicorn, write_models_toml
from web.dev.local_redis import free_port
from worker import protocol
from worker.engine import STEP_KINDS, STEP_PHASES
from worker.metrics import EngineCollector, batch_size_histogram, start


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} from a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture()
def models_toml(tmp_path, hf_checkpoint) -> Path:
    return write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint})


def make_app(redis_url: str, models_toml: Path):
    from web import metrics
    from web.app import create_app

    app = create_app({"redis_url": redis_url, "models_path": str(models_toml)})
    if "metrics" not in app.view_functions:  # create_app may already call metrics.init_app
        metrics.init_app(app)
    return app


def scrape(client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain")
    return response.get_data(as_text=True)


def test_requests_counted_by_route_and_status(redis_url, models_toml):
    client = make_app(redis_url, models_toml).test_client()
    before = scrape(client)
    for _ in range(3):
        assert client.get("/health").status_code == 200
    assert client.get("/v1/models/no-such-model").status_code == 404
    assert client.get("/no/such/path").status_code == 404
    after = scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("nanoserve_http_requests_total", method="GET", route="/health", status="200") == 3
    assert delta("nanoserve_http_requests_total", method="GET", route="/v1/models/<path:model_id>",
                 status="404") == 1
    assert delta("nanoserve_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert delta("nanoserve_http_request_duration_seconds_count", method="GET", route="/health") == 3
    assert delta("nanoserve_http_request_duration_seconds_bucket", method="GET", route="/health", le="+Inf") == 3


def test_queue_depth_and_workers_read_from_redis(redis_url, models_toml):
    client = make_app(redis_url, models_toml).test_client()
    queue = rq_json.queue(protocol.queue_name("tiny"), redis.Redis.from_url(redis_url))
    for _ in range(3):  # no worker runs: the jobs stay queued
        queue.enqueue_call(protocol.JOB_FUNCTION, args=({},))
    text = scrape(client)
    assert value(text, "nanoserve_queue_depth", model="tiny") == 3
    assert value(text, "nanoserve_queue_workers", model="tiny") == 0
    assert value(text, "nanoserve_redis_up") == 1


def test_metrics_answer_while_redis_is_down(models_toml):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    client = make_app(dead, models_toml).test_client()
    text = scrape(client)
    assert value(text, "nanoserve_redis_up") == 0
    assert ("nanoserve_queue_depth", (("model", "tiny"),)) not in samples(text)


def test_ttft_histogram(redis_url, models_toml):
    from web.metrics import observe_ttft

    client = make_app(redis_url, models_toml).test_client()
    before = scrape(client)
    observe_ttft("tiny", 0.3)
    after = scrape(client)
    count = "nanoserve_time_to_first_token_seconds_count"
    assert value(after, count, model="tiny") - value(before, count, model="tiny") == 1
    le_half = "nanoserve_time_to_first_token_seconds_bucket"
    assert value(after, le_half, model="tiny", le="0.5") - value(before, le_half, model="tiny", le="0.5") == 1
    assert value(after, le_half, model="tiny", le="0.25") == value(before, le_half, model="tiny", le="0.25")


def test_metrics_can_require_an_api_key(redis_url, models_toml, monkeypatch):
    from web.access import keys

    monkeypatch.setenv("NANOSERVE_METRICS_AUTH", "required")
    client = make_app(redis_url, models_toml).test_client()
    assert client.get("/metrics").status_code == 401
    token, _ = keys.create(redis.Redis.from_url(redis_url, decode_responses=True), "prometheus")
    response = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    assert "nanoserve_http_requests_total" in response.get_data(as_text=True)


def _get(url: str) -> str:
    # A new connection per request, so gunicorn's processes share the work.
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_gunicorn_processes_are_merged(redis_url, models_toml, tmp_path):
    """Two gunicorn processes each count what they served; any scrape reports the sum."""
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    web = spawn_gunicorn(redis_url, models_toml, workers=2, threads=4,
                         env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}, log_dir=tmp_path)
    try:
        health = {"method": "GET", "route": "/health", "status": "200"}
        before = value(_get(web.url + "/metrics"), "nanoserve_http_requests_total", **health)
        sent = 0
        # Keep going until both processes have served (each keeps its own sample file).
        while sent < 400 and (sent < 20 or len(list(metrics_dir.glob("counter_*.db"))) < 2):
            _get(web.url + "/health")
            sent += 1
        assert len(list(metrics_dir.glob("counter_*.db"))) == 2, web.logs()[-2000:]
        for _ in range(4):  # every scrape, whichever process answers it, sees all of them
            text = _get(web.url + "/metrics")
            assert value(text, "nanoserve_http_requests_total", **health) - before == sent
            assert value(text, "nanoserve_redis_up") == 1
    finally:
        web.stop()


# ---- worker metrics ----

def test_batch_size_histogram_is_cumulative():
    buckets, total = batch_size_histogram({1: 5, 3: 2, 8: 1, 300: 1})
    as_dict = dict(buckets)
    assert as_dict["1"] == 5 and as_dict["2"] == 5 and as_dict["4"] == 7 and as_dict["8"] == 8
    assert as_dict["256"] == 8 and as_dict["+Inf"] == 9
    assert total == 5 * 1 + 3 * 2 + 8 + 300


class StatsSource:
    """Something with the engine's `stats()` snapshot; the real engine is tested end to end below."""

    def __init__(self):
        self.snapshot = {"model": "tiny", "device": "cpu", "running": 0, "waiting": 0, "kv_slots_used": 0,
                         "kv_slots_total": 8, "tokens_generated": 0, "batch_size_counts": {}}
        self.lock = threading.Lock()

    def stats(self) -> dict:
        with self.lock:
            return dict(self.snapshot)


def test_worker_metrics_served_on_a_port():
    engine = StatsSource()
    port = free_port()
    server = start([engine], port, addr="127.0.0.1")
    try:
        engine.snapshot.update(running=3, waiting=2, kv_slots_used=3, tokens_generated=120,
                               batch_size_counts={1: 4, 3: 10}, warming_up=1, compiled_graphs_live=2)
        text = _get(f"http://127.0.0.1:{port}/metrics")
        labels = {"model": "tiny", "device": "cpu"}
        assert value(text, "nanoserve_worker_running_sequences", **labels) == 3
        assert value(text, "nanoserve_worker_waiting_requests", **labels) == 2
        assert value(text, "nanoserve_worker_kv_slots_used", **labels) == 3
        assert value(text, "nanoserve_worker_kv_slots_total", **labels) == 8
        assert value(text, "nanoserve_worker_warming_up", **labels) == 1
        assert value(text, "nanoserve_worker_compiled_graphs_live", **labels) == 2
        assert value(text, "nanoserve_worker_tokens_generated_total", **labels) == 120
        assert value(text, "nanoserve_worker_tokens_per_second", **labels) > 0
        assert value(text, "nanoserve_worker_batch_size_count", **labels) == 14
        assert value(text, "nanoserve_worker_batch_size_sum", **labels) == 34
        assert value(text, "nanoserve_worker_batch_size_bucket", le="2", **labels) == 4
        assert value(text, "process_resident_memory_bytes") > 0
    finally:
        server.shutdown()


def test_tokens_per_second_is_measured_between_scrapes():
    engine = StatsSource()
    collector = EngineCollector([engine], min_window=0.0)
    engine.snapshot["tokens_generated"] = 50
    before_first = time.monotonic()
    list(collector.collect())  # the sample the next rate is measured from
    engine.snapshot["tokens_generated"] = 150
    time.sleep(0.5)
    families = {f.name: f for f in collector.collect()}
    after_second = time.monotonic()
    rate = families["nanoserve_worker_tokens_per_second"].samples[0].value
    # 100 new tokens over the time between the two scrapes, which lies in these bounds:
    assert 100 / (after_second - before_first) <= rate <= 100 / 0.5


def test_worker_metrics_of_a_real_engine(models_toml):
    """Counters from the engine's own stats after it ran a request (tiny random GPT-2, CPU)."""
    from models.registry import Registry
    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from worker.engine import Engine

    spec = Registry.from_file(models_toml).get("tiny")
    engine = Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=4)
    engine.start()
    port = free_port()
    server = start([("tiny", engine)], port, addr="127.0.0.1")
    try:
        job = protocol.CompletionJob(id=protocol.new_completion_id(), model="tiny", prompts=[[464, 2068, 7586]] * 2,
                                     max_tokens=7, temperature=0.0, seed=0, n=1)
        labels = {"model": "tiny", "device": "cpu"}
        idle = value(_get(f"http://127.0.0.1:{port}/metrics"), "nanoserve_worker_busy_seconds_total", **labels)
        sent = time.perf_counter()
        usage = engine.submit(job).result(timeout=120)["usage"]
        took = time.perf_counter() - sent
        time.sleep(0.2)  # idle: the engine's busy time stands still
        text = _get(f"http://127.0.0.1:{port}/metrics")
        busy = value(text, "nanoserve_worker_busy_seconds_total", **labels) - idle
        assert 0 < busy <= took  # the request's steps, not the wait around them
        phases = {phase: value(text, "nanoserve_worker_step_phase_seconds_total", phase=phase, **labels)
                  for phase in STEP_PHASES}
        assert all(seconds >= 0 for seconds in phases.values()) and phases["forward"] > 0
        # every busy second in one phase (the idle scrape's busy seconds were the warm-up's, none)
        assert sum(phases.values()) == pytest.approx(value(text, "nanoserve_worker_busy_seconds_total", **labels),
                                                     rel=1e-6)
        assert value(text, "nanoserve_worker_steps_total", **labels) >= 7  # a prefill and six decode forwards at least
        # the steps by what they ran: the prefill's step fed prompt tokens, a CPU's decode steps one forward each
        kinds = {kind: {key: value(text, f"nanoserve_worker_step_kind_{key}_total", kind=kind, **labels)
                        for key in ("steps", "forwards", "seconds")} for kind in STEP_KINDS}
        assert kinds["prompt"]["steps"] >= 1 and kinds["decode"]["steps"] >= 6
        assert kinds["decode"]["forwards"] == kinds["decode"]["steps"]
        assert sum(k["forwards"] for k in kinds.values()) == value(text, "nanoserve_worker_steps_total", **labels)
        assert sum(k["seconds"] for k in kinds.values()) == pytest.approx(
            value(text, "nanoserve_worker_busy_seconds_total", **labels), rel=1e-6)
        assert value(text, "nanoserve_worker_tokens_generated_total", **labels) == usage["completion_tokens"] == 14
        assert value(text, "nanoserve_worker_prompt_tokens_total", **labels) == usage["prompt_tokens"]
        assert value(text, "nanoserve_worker_kv_slots_total", **labels) == 4
        assert value(text, "nanoserve_worker_kv_slots_used", **labels) == 0  # the request is done
        assert value(text, "nanoserve_worker_running_sequences", **labels) == 0
        assert value(text, "nanoserve_worker_batch_size_count", **labels) > 0
        # Every token but each sequence's first (sampled from its prefill) came from a decode step.
        assert 14 - 2 <= value(text, "nanoserve_worker_batch_size_sum", **labels) <= 14
        # the same prompt again: all its tokens but the last come from the prefix cache
        again = engine.submit(job.model_copy(update={"id": protocol.new_completion_id(), "prompts": [[464, 2068, 7586]]}))
        assert again.result(timeout=120)["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert value(text, "nanoserve_worker_prefix_cache_hit_tokens_total", **labels) == 2
        assert value(text, "nanoserve_worker_prefix_cache_queried_tokens_total", **labels) == 9
    finally:
        server.shutdown()
        engine.stop()
