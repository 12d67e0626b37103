"""Resilience of the whole stack (gunicorn + `processor.py` + a real redis-server, called with the
real `openai` client): Redis restarting under the web tier, 200 concurrent streams through a worker
crash and restart, and a worker whose engine thread dies. Keepalives come every second, so the
streams that wait through a crash get keepalive comments between their frames, as a client must
parse them.

Covered elsewhere: kill -9 of one of two workers with jobs in flight and the seeded stream resuming
(test_crash.py), workers riding out a Redis restart mid-job (test_crash.py), SIGTERM finishing
in-flight jobs (test_worker.py), a full queue as `openai.RateLimitError` with Retry-After
(test_e2e_openai.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis
import requests
from rq.job import JobStatus

from models.registry import Registry
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from tests import rq_json
from tests.stack import REPO, spawn_gunicorn, spawn_processor, write_models_toml
from web.dev.local_redis import start_redis
from worker import protocol
from worker.engine import Engine

pytestmark = pytest.mark.slow

MODEL = "tiny"
EOS = 50256
WEB_ENV = {"NANOSERVE_AUTH": "disabled", "NANOSERVE_KEEPALIVE": "1"}


@pytest.fixture(scope="module")
def models_file(hf_checkpoint, tmp_path_factory):
    return write_models_toml(tmp_path_factory.mktemp("resilience") / "models.toml", {MODEL: hf_checkpoint},
                             device="cpu", max_batch=8)


@pytest.fixture(scope="module")
def engine(models_file):
    """The engine alone, in this process: what an uninterrupted run gives."""
    spec = Registry.from_file(models_file).get(MODEL)
    return Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=64, max_len=spec.context_length)


def request(i: int, max_tokens: int) -> dict:
    """The i-th request: seeded sampling (every fourth greedy), no end-of-text, so it runs to max_tokens."""
    return {"model": MODEL, "prompt": [464, 318 + i], "max_tokens": max_tokens, "seed": 1000 + i,
            "temperature": 0.0 if i % 4 == 0 else 1.0, "logit_bias": {str(EOS): -100}}


def reference_texts(engine, requests_: list[dict]) -> list[str]:
    """The texts of the requests run together by the engine alone (a request's seeded tokens do not
    depend on what shares its batch)."""
    jobs = [protocol.CompletionJob(id=protocol.new_completion_id(), model=r["model"], prompts=[r["prompt"]],
                                   max_tokens=r["max_tokens"], seed=r["seed"], temperature=r["temperature"],
                                   logit_bias={EOS: -100.0})
            for r in requests_]
    handles = [engine.submit(job) for job in jobs]
    while not all(h.done for h in handles):
        engine.step()
    return [h.result()["choices"][0]["text"] for h in handles]


def stream(client: openai.OpenAI, body: dict) -> dict:
    """One streamed completion as the client saw it: its id(s), text, finish reasons and usage."""
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    choices = [choice for chunk in chunks for choice in chunk.choices]
    return {"ids": {chunk.id for chunk in chunks}, "text": "".join(c.text for c in choices),
            "finish": [c.finish_reason for c in choices if c.finish_reason], "usage": chunks[-1].usage}


def finished_on(r: redis.Redis, job_ids, service) -> list[str]:
    """The jobs among `job_ids` that ended on one of a processor's rq workers (named host:pid:…)."""
    prefix = f"{socket.gethostname()}:{service.pid}:"
    return [job.id for job in rq_json.fetch_many(list(job_ids), r)
            if job is not None and (job.worker_name or "").startswith(prefix)]


def wait_finished(r: redis.Redis, job_ids, timeout: float = 60) -> None:
    """Until rq has recorded every job as finished: after its worker logged "job finished" (a
    stream's `done` reaches its reader before that)."""
    deadline = time.monotonic() + timeout
    while any(job.get_status() != JobStatus.FINISHED for job in rq_json.fetch_many(list(job_ids), r)):
        assert time.monotonic() < deadline, "jobs not finished for rq"
        time.sleep(0.2)


def log_entries(text: str) -> list[dict]:
    """A processor's JSON log lines (other lines skipped)."""
    entries = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entries.append(json.loads(line))
    return entries


def stop_all(*services) -> None:
    for service in services:
        if service is not None:
            service.stop()


# ---- Redis restarts under the web tier ------------------------------------------------------

def test_redis_restart_is_503_with_retry_after_then_recovers_without_restarts(models_file, engine, tmp_path):
    """While Redis is down every request that needs it is a 503 in OpenAI's envelope with
    Retry-After (never a 500); a client that retries (openai's default behaviour) rides the outage
    out; afterwards the same gunicorn and the same worker serve again."""
    (tmp_path / "redis").mkdir()
    server = start_redis(persist_dir=str(tmp_path / "redis"))  # AOF, as in docker-compose.yml
    worker = web = None
    try:
        worker = spawn_processor(server.url, models_file, concurrency=2, log_dir=tmp_path, wait=False)
        web = spawn_gunicorn(server.url, models_file, env=WEB_ENV, workers=2, threads=4, log_dir=tmp_path)
        worker.wait_ready()
        client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        body = request(1, max_tokens=16)
        [expected] = reference_texts(engine, [body])
        before = client.completions.create(**body)
        assert before.choices[0].text == expected

        server.stop()
        for _ in range(4):  # more requests than gunicorn processes: each of them answers
            for call in (lambda: client.completions.create(**body),
                         lambda: client.completions.create(stream=True, **body)):
                with pytest.raises(openai.InternalServerError) as info:
                    call()
                assert info.value.status_code == 503 and info.value.code == "service_unavailable"
                assert info.value.type == "server_error" and info.value.response.headers["Retry-After"] == "1"
        for response in (requests.post(web.url + "/v1/completions", json=body, timeout=30),
                         requests.post(web.url + "/v1/jobs", json=body, timeout=30),
                         requests.get(f"{web.url}/v1/jobs/{before.id}", timeout=30)):
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "service_unavailable"
            assert "Traceback" not in error["message"] and response.headers["x-request-id"]
        ready = requests.get(web.url + "/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["redis"] is False
        assert requests.get(web.url + "/health", timeout=30).status_code == 200

        patient = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=30, timeout=60)
        with ThreadPoolExecutor(1) as pool:
            during = pool.submit(patient.completions.create, **body)  # answered 503, retrying
            time.sleep(2)
            server = start_redis(port=server.port, persist_dir=str(tmp_path / "redis"))
            assert during.result(timeout=120).choices[0].text == expected

        after = stream(client, request(2, max_tokens=16))
        assert after["text"] == reference_texts(engine, [request(2, max_tokens=16)])[0]
        assert after["usage"].completion_tokens == 16
        assert requests.get(web.url + "/ready", timeout=30).status_code == 200
        assert web.alive() and worker.alive()
        assert "unhandled error" not in web.logs()
    finally:
        stop_all(web, worker)
        server.stop()


# ---- 200 concurrent requests through a worker crash and restart -----------------------------

REQUESTS = 200
DISTINCT = 50  # each request body is sent 4 times (the reference run costs seconds per 50 jobs)
MAX_TOKENS = 16
CLIENTS = 24  # concurrent openai clients: more than one processor's rq workers, so the queue holds jobs


def streaming_on(r: redis.Redis, service) -> list[str]:
    """Jobs a processor runs now whose streams have begun."""
    ids = rq_json.started(protocol.queue_name(MODEL), r).get_job_ids(cleanup=False)
    prefix = f"{socket.gethostname()}:{service.pid}:"
    return [job.id for job in rq_json.fetch_many(ids, r)
            if job is not None and (job.worker_name or "").startswith(prefix)
            and r.xlen(protocol.stream_key(job.id))]


def test_200_concurrent_streams_through_a_worker_crash_and_restart(models_file, engine, tmp_path):
    """Two processors serve 200 seeded streams (24 at a time); one is killed with SIGKILL while it
    streams, a replacement is started, and the second half of the requests is sent once it is up.
    Every request gets exactly one complete stream, equal to the uninterrupted run, and each job
    ran to completion once."""
    server = start_redis()
    r = redis.Redis.from_url(server.url)
    bodies = [request(i % DISTINCT, MAX_TOKENS) for i in range(REQUESTS)]
    victim = survivor = replacement = web = None
    try:
        victim = spawn_processor(server.url, models_file, concurrency=8, heartbeat=1, log_dir=tmp_path, wait=False)
        survivor = spawn_processor(server.url, models_file, concurrency=8, heartbeat=1, log_dir=tmp_path,
                                   wait=False)
        web = spawn_gunicorn(server.url, models_file, env=WEB_ENV, workers=2, threads=16, log_dir=tmp_path)
        expected = reference_texts(engine, bodies[:DISTINCT])  # while the workers load
        victim.wait_ready()
        survivor.wait_ready()
        client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        with ThreadPoolExecutor(CLIENTS) as pool:
            first = [pool.submit(stream, client, body) for body in bodies[:REQUESTS // 2]]
            deadline = time.monotonic() + 60
            while len(streaming_on(r, victim)) < 4:  # it streams several of them
                assert time.monotonic() < deadline, "the victim never streamed"
                time.sleep(0.01)
            victim.kill()
            replacement = spawn_processor(server.url, models_file, concurrency=8, heartbeat=1, log_dir=tmp_path)
            second = [pool.submit(stream, client, body) for body in bodies[REQUESTS // 2:]]
            results = [future.result(timeout=180) for future in first + second]

        ids = [next(iter(result["ids"])) for result in results]
        assert all(len(result["ids"]) == 1 for result in results)
        assert len(set(ids)) == REQUESTS  # no request answered twice, none with another's stream
        for i, result in enumerate(results):
            assert result["text"] == expected[i % DISTINCT], i
            assert result["finish"] == ["length"] and result["usage"].completion_tokens == MAX_TOKENS, i
        # One rq job per request, each finished once, its stream ended by a single `done`. (A worker
        # killed after writing a job's `done` but before rq recorded its end leaves the job to be
        # re-queued and concluded from its stream by another worker: wait for that.)
        wait_finished(r, ids)
        queue = protocol.queue_name(MODEL)
        assert sorted(rq_json.finished(queue, r).get_job_ids()) == sorted(ids)
        for job_id in ids:
            kinds = [protocol.decode_event(fields)[0] for _, fields in r.xrange(protocol.stream_key(job_id))]
            assert kinds.count("done") == 1 and kinds[-1] == "done", job_id
        # The crash really interrupted jobs (rq retried them) and the replacement took its share.
        retried = [job for job in rq_json.fetch_many(ids, r) if job.retries_left < 2]
        assert retried and all(job.enqueue_at_front_on_retry for job in retried)
        assert finished_on(r, ids, replacement)
        resumed = {entry["job_id"] for entry in log_entries(survivor.logs() + replacement.logs())
                   if entry.get("msg") == "job finished" and entry.get("resumed_tokens")}
        assert resumed and resumed <= {job.id for job in retried}
        assert "unhandled error" not in web.logs()
    finally:
        stop_all(web, victim, survivor, replacement)
        server.stop()


# ---- an engine thread that dies -------------------------------------------------------------

# Injected into one processor through `sitecustomize`: its engine thread raises out of its loop at
# the 10th step that has work, as a bug in the engine would.
ENGINE_FAULT = '''
from worker import engine

_step = engine.Engine.step

def step(self):
    if self.scheduler.requests:
        self.busy_steps = getattr(self, "busy_steps", 0) + 1
        if self.busy_steps == 10:
            raise RuntimeError("injected engine fault")
    _step(self)

engine.Engine.step = step
'''


@pytest.mark.parametrize("apart", [False, True], ids=["engine-thread", "engine-process"])
def test_a_dead_engine_thread_exits_the_process_and_its_stream_resumes_elsewhere(models_file, engine, tmp_path, apart):
    """The engine thread of the processor running a stream dies (in the processor's own process, or
    in the engine's process of its own: --engine-process): the processor logs it and exits 1 (for
    its supervisor to restart it), the job is retried at once rather than at its rq timeout, and a
    healthy processor resumes it: the client's stream is the uninterrupted text."""
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(ENGINE_FAULT)
    server = start_redis()
    r = redis.Redis.from_url(server.url)
    faulty = healthy = web = None
    try:
        faulty = spawn_processor(server.url, models_file, concurrency=2, log_dir=tmp_path, wait=False,
                                 extra_args=["--engine-process"] if apart else [],
                                 env={"PYTHONPATH": f"{tmp_path / 'fault'}:{REPO}"})
        web = spawn_gunicorn(server.url, models_file, env=WEB_ENV, workers=1, threads=4, log_dir=tmp_path)
        faulty.wait_ready()
        client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        body = request(7, max_tokens=48)
        [expected] = reference_texts(engine, [body])

        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(stream, client, body)
            assert faulty.wait(timeout=60) == 1
            healthy = spawn_processor(server.url, models_file, concurrency=2, log_dir=tmp_path)
            result = result.result(timeout=120)

        assert result["text"] == expected and result["usage"].completion_tokens == 48
        [job_id] = result["ids"]
        wait_finished(r, [job_id])
        assert finished_on(r, [job_id], healthy) == [job_id]
        events = [protocol.decode_event(fields) for _, fields in r.xrange(protocol.stream_key(job_id))]
        assert sum(len(data["token_ids"]) for kind, data in events if kind == "delta") == 48
        assert "injected engine fault" in faulty.logs() and "thread died" in faulty.logs()
        assert "engine thread died; stopping so the process is restarted" in faulty.logs()
        [finished] = [entry for entry in log_entries(healthy.logs()) if entry.get("msg") == "job finished"]
        assert finished["job_id"] == job_id and 0 < finished["resumed_tokens"] < 48
    finally:
        stop_all(web, faulty, healthy)
        server.stop()


# ---- a worker told to stop while its Redis is gone -------------------------------------------

def test_a_killed_engine_process_loses_no_job(models_file, engine, tmp_path):
    """A worker's engine process (--engine-process) is killed (SIGKILL: the OOM killer) while it holds
    a synchronous request's job: the worker fails the job at once, so rq retries it, exits 1, and a
    healthy processor answers the request with the uninterrupted text. The engine is held stopped
    (SIGSTOP) until the job is in it, so the kill lands while it runs."""
    server = start_redis()
    r = redis.Redis.from_url(server.url)
    doomed = healthy = web = None
    try:
        doomed = spawn_processor(server.url, models_file, concurrency=2, log_dir=tmp_path,
                                 extra_args=["--engine-process"])
        [child] = [entry["pid"] for entry in log_entries(doomed.logs())
                   if entry.get("msg") == "engine in a process of its own"]
        web = spawn_gunicorn(server.url, models_file, env=WEB_ENV, workers=1, threads=4, log_dir=tmp_path)
        client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        body = request(5, max_tokens=24)
        [expected] = reference_texts(engine, [body])

        os.kill(child, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, **body)
            deadline = time.monotonic() + 30
            while not rq_json.started(protocol.queue_name(MODEL), r).count:  # the job started on the worker
                assert time.monotonic() < deadline, "the job never started"
                time.sleep(0.05)
            os.kill(child, signal.SIGKILL)
            assert doomed.wait(timeout=60) == 1
            healthy = spawn_processor(server.url, models_file, concurrency=2, log_dir=tmp_path)
            answer = answer.result(timeout=120)

        assert answer.choices[0].text == expected and answer.usage.completion_tokens == 24
        wait_finished(r, [answer.id])
        assert finished_on(r, [answer.id], healthy) == [answer.id]
        assert "the engine's process died" in doomed.logs()
        assert "engine thread died; stopping so the process is restarted" in doomed.logs()
    finally:
        stop_all(web, doomed, healthy)
        server.stop()


def test_a_worker_whose_redis_is_gone_stops_within_seconds(models_file, tmp_path):
    """SIGTERM with Redis unreachable: nothing runs and nothing can be taken, so nothing is waited for
    (rq's reconnect loop would hold the process past a container's grace period)."""
    server = start_redis()
    worker = spawn_processor(server.url, models_file, concurrency=4, log_dir=tmp_path)
    try:
        server.stop()
        time.sleep(2)  # the worker's threads are now failing to reach Redis
        started = time.monotonic()
        worker.signal(15)
        assert worker.wait(timeout=60) == 0
        took = time.monotonic() - started
        print(f"\nstopped {took:.1f} s after SIGTERM with Redis gone")
        assert took < 8, worker.logs()[-2000:]
    finally:
        stop_all(worker)
        server.stop()
