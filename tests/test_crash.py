"""Crash safety: a worker killed with SIGKILL while jobs run loses none of them.

Two `processor.py` workers share a model's queue; 40 seeded jobs are enqueued with rq `Retry`; one
worker is killed (its whole process group) while it runs jobs. rq re-queues the dead worker's jobs
once their heartbeats expire, the survivor resumes each from the tokens its stream already holds,
and every job ends with exactly the text of an uninterrupted run, streamed without a duplicated or
missing piece.
"""
from __future__ import annotations

import json
import socket
import time

import pytest
import redis
from rq import Retry
from rq.job import JobStatus

from models.registry import Registry
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from tests import rq_json
from tests.stack import spawn_processor, write_models_toml
from web.dev.local_redis import start_redis
from worker import protocol
from worker.engine import Engine

pytestmark = pytest.mark.slow

MODEL = "tiny"
JOBS = 40
MAX_TOKENS = 48
EOS = 50256


def make_jobs() -> list[protocol.CompletionJob]:
    # Sampled (temperature 1, seeded) and greedy jobs; no end-of-text, so each runs to max_tokens.
    return [protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464, 318 + i]],
                                   max_tokens=MAX_TOKENS, seed=1000 + i, temperature=0.0 if i % 4 == 0 else 1.0,
                                   logit_bias={EOS: -100.0}, stream=True)
            for i in range(JOBS)]


def reference_texts(models_file, jobs) -> dict[str, str]:
    """The uninterrupted results: the engine alone, every job in one batch."""
    spec = Registry.from_file(models_file).get(MODEL)
    engine = Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=JOBS, max_len=spec.context_length)
    handles = [engine.submit(job) for job in jobs]
    while not all(h.done for h in handles):
        engine.step()
    return {job.id: h.result()["choices"][0]["text"] for job, h in zip(jobs, handles)}


def running_on(r, service) -> list[str]:
    """Ids of the jobs a processor is running now (its rq workers are named host:pid:…)."""
    prefix = f"{socket.gethostname()}:{service.pid}:"
    ids = rq_json.started(protocol.queue_name(MODEL), r).get_job_ids(cleanup=False)
    return [job.id for job in rq_json.fetch_many(ids, r)
            if job is not None and (job.worker_name or "").startswith(prefix)]


def stream(r, job_id) -> list[tuple[str, dict]]:
    return [protocol.decode_event(fields) for _, fields in r.xrange(protocol.stream_key(job_id))]


def test_kill_9_during_40_jobs_loses_no_token(redis_server, hf_checkpoint, tmp_path):
    url = redis_server.url.rsplit("/", 1)[0] + "/2"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    models = write_models_toml(tmp_path / "models.toml", {MODEL: hf_checkpoint}, device="cpu", max_batch=8)
    jobs = make_jobs()

    victim = survivor = None
    try:
        victim = spawn_processor(url, models, concurrency=8, log_dir=tmp_path, wait=False)
        survivor = spawn_processor(url, models, concurrency=8, log_dir=tmp_path, wait=False)
        reference = reference_texts(models, jobs)  # while the workers load
        victim.wait_ready()
        survivor.wait_ready()
        queue = rq_json.queue(protocol.queue_name(MODEL), r)
        rq_jobs = [queue.enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id,
                                      retry=Retry(max=2), result_ttl=protocol.RESULT_TTL) for job in jobs]

        # Kill the victim once it is streaming several jobs.
        deadline = time.monotonic() + 60
        while True:
            busy = [job_id for job_id in running_on(r, victim) if r.xlen(protocol.stream_key(job_id))]
            if len(busy) >= 4:
                break
            assert time.monotonic() < deadline, "the victim never ran jobs"
            time.sleep(0.01)
        victim.kill()
        interrupted = set(running_on(r, victim))
        assert interrupted

        deadline = time.monotonic() + 90
        while any(j.get_status() not in (JobStatus.FINISHED, JobStatus.FAILED) for j in rq_jobs):
            assert survivor.alive() and time.monotonic() < deadline, [j.get_status().value for j in rq_jobs]
            time.sleep(0.2)
        survivor_log = survivor.logs()
    finally:
        for service in (victim, survivor):
            if service is not None:
                service.stop()

    for job, rq_job in zip(jobs, rq_jobs):
        assert rq_job.get_status() == JobStatus.FINISHED, job.id
        result = rq_job.return_value()
        assert result["usage"]["completion_tokens"] == MAX_TOKENS
        assert result["choices"][0]["text"] == reference[job.id], job.id
        # The stream, as a client would have read it through the crash: every piece exactly once.
        events = stream(r, job.id)
        kinds = [kind for kind, _ in events]
        assert kinds.count("finish") == 1 and kinds[-2:] == ["usage", "done"], job.id
        assert "".join(data["text"] for kind, data in events if kind == "delta") == reference[job.id], job.id
        assert sum(len(data["token_ids"]) for kind, data in events if kind == "delta") == MAX_TOKENS

    # The interrupted jobs were re-run by rq and resumed mid-stream by the survivor.
    for job_id in interrupted:
        assert rq_json.fetch(job_id, r).retries_left == 1
    resumed = {entry["job_id"] for entry in log_entries(survivor_log)
               if entry.get("msg") == "job finished" and entry.get("resumed_tokens")}
    assert resumed & interrupted


def log_entries(text: str) -> list[dict]:
    entries = []
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            pass  # not one of our JSON lines (a library's progress bar)
    return entries


def test_workers_ride_out_a_redis_restart(hf_checkpoint, tmp_path):
    """Redis (with its append-only file) restarts while 8 jobs run, away longer than the jobs'
    heartbeat TTL: the worker keeps generating, holds the events until Redis is back, reconnects
    its rq workers, and every job ends complete, run once (not re-queued as abandoned), its stream
    without a duplicated or missing piece; new jobs run afterwards."""
    (tmp_path / "redis").mkdir()
    server = start_redis(persist_dir=str(tmp_path / "redis"))
    models = write_models_toml(tmp_path / "models.toml", {MODEL: hf_checkpoint}, device="cpu", max_batch=8)
    jobs = make_jobs()[:8]
    worker = None
    try:
        worker = spawn_processor(server.url, models, concurrency=4, heartbeat=1, log_dir=tmp_path, wait=False)
        reference = reference_texts(models, jobs)
        worker.wait_ready()
        r = redis.Redis.from_url(server.url)
        queue = rq_json.queue(protocol.queue_name(MODEL), r)
        rq_jobs = [queue.enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id,
                                      retry=Retry(max=2), result_ttl=protocol.RESULT_TTL) for job in jobs]
        while not r.xlen(protocol.stream_key(jobs[0].id)):
            time.sleep(0.005)
        server.stop()
        time.sleep(4)  # the running jobs' registry entries (3 s: heartbeat 1) lapse meanwhile
        server = start_redis(port=server.port, persist_dir=str(tmp_path / "redis"))

        deadline = time.monotonic() + 90
        while any(j.get_status() not in (JobStatus.FINISHED, JobStatus.FAILED) for j in rq_jobs):
            assert worker.alive() and time.monotonic() < deadline, [j.get_status().value for j in rq_jobs]
            time.sleep(0.2)
        for job, rq_job in zip(jobs, rq_jobs):
            assert rq_job.get_status() == JobStatus.FINISHED, job.id
            assert rq_job.retries_left == 2, job.id  # never re-queued
            assert rq_job.return_value()["choices"][0]["text"] == reference[job.id]
            events = stream(r, job.id)
            assert "".join(data["text"] for kind, data in events if kind == "delta") == reference[job.id]
            assert sum(len(data["token_ids"]) for kind, data in events if kind == "delta") == MAX_TOKENS
            assert [kind for kind, _ in events].count("done") == 1

        after = make_jobs()[8]
        rq_after = queue.enqueue_call(protocol.JOB_FUNCTION, args=(after.to_payload(),), job_id=after.id)
        deadline = time.monotonic() + 60
        while rq_after.get_status() != JobStatus.FINISHED:
            assert time.monotonic() < deadline, rq_after.get_status()
            time.sleep(0.1)
        assert "event stream writes recovered" in worker.logs()
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
