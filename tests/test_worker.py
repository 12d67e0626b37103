"""The worker process for real: jobs enqueued with rq on a real redis-server are run by a real
`processor.py` subprocess serving a tiny random-weight GPT-2 checkpoint; results and streams are
checked against the engine run directly in this process."""
from __future__ import annotations

import itertools
import signal
import time
import urllib.request
import zlib

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue, Retry
from rq.exceptions import AbandonedJobError
from rq.job import Job, JobStatus
from rq.serializers import PickleSerializer

from models.registry import Registry
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from tests import rq_json
from tests.compare import assert_same_completion
from tests.stack import registered_workers, start_processor, write_models_toml
from web.dev.local_redis import free_port
from worker import protocol
from worker.consumer import report_given_up
from worker.engine import Engine

MODEL = "tiny"
_seeds = itertools.count(100)


@pytest.fixture(scope="module")
def models_file(hf_checkpoint, tmp_path_factory):
    return write_models_toml(tmp_path_factory.mktemp("worker") / "models.toml", {MODEL: hf_checkpoint},
                             device="cpu", max_batch=8)


@pytest.fixture(scope="module")
def worker(redis_server, models_file, tmp_path_factory):
    """One processor.py for the module (4 jobs at once), on database 0 of the session Redis."""
    port = free_port()
    with start_processor(redis_server.url, models_file, concurrency=4, extra_args=["--metrics-port", str(port)],
                         log_dir=tmp_path_factory.mktemp("worker-logs")) as service:
        service.info["metrics_url"] = f"http://127.0.0.1:{port}/metrics"
        yield service


def steps_with_more_than(worker, batch: int) -> int:
    """Decode steps whose batch held more than `batch` sequences, from the worker's metrics."""
    text = urllib.request.urlopen(worker.info["metrics_url"], timeout=10).read().decode()
    buckets = {float(sample.labels["le"]): sample.value for family in text_string_to_metric_families(text)
               if family.name == "nanoserve_worker_batch_size" for sample in family.samples
               if sample.name.endswith("_bucket")}
    return int(buckets[float("inf")] - buckets[float(batch)])


@pytest.fixture(scope="module")
def r(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(models_file):
    """The engine alone, in this process, on the same checkpoint."""
    spec = Registry.from_file(models_file).get(MODEL)
    engine = Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=8, max_len=spec.context_length)
    return engine.generate


def make_job(**kw) -> protocol.CompletionJob:
    kw.setdefault("prompts", [[464, 2068, 7586, 21831]])  # "The quick brown fox"
    kw.setdefault("seed", next(_seeds))
    kw.setdefault("max_tokens", 24)
    return protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, **kw)


def enqueue(r, job: protocol.CompletionJob | dict, retries: int = 2, model: str = MODEL) -> Job:
    payload = job.to_payload() if isinstance(job, protocol.CompletionJob) else job
    return rq_json.queue(protocol.queue_name(model), r).enqueue_call(
        protocol.JOB_FUNCTION, args=(payload,), job_id=payload["id"], retry=Retry(max=retries) if retries else None,
        result_ttl=protocol.RESULT_TTL)


def wait_ended(jobs: list[Job], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(j.get_status() not in (JobStatus.FINISHED, JobStatus.FAILED) for j in jobs):
        assert time.monotonic() < deadline, [j.get_status() for j in jobs]
        time.sleep(0.05)


def events(r, job_id: str) -> list[tuple[str, str, dict]]:
    """(entry id, type, data) of every event of a job's stream."""
    return [(entry_id.decode(), *protocol.decode_event(fields))
            for entry_id, fields in r.xrange(protocol.stream_key(job_id))]


def wait_for_delta(r, job_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(kind == "delta" for _, kind, _ in events(r, job_id)):
        assert time.monotonic() < deadline, "no delta"
        time.sleep(0.01)


def stream_texts(evts) -> dict[int, str]:
    texts: dict[int, str] = {}
    for _, kind, data in evts:
        if kind == "delta":
            texts[data["index"]] = texts.get(data["index"], "") + data["text"]
    return texts


def test_stream_has_deltas_then_finish_usage_done_and_the_engines_result(worker, r, reference):
    job = make_job(n=2, temperature=0.9, logprobs=2, max_tokens=20, stream=True)
    rq_job = enqueue(r, job)
    wait_ended([rq_job])

    assert rq_job.get_status() == JobStatus.FINISHED
    result = rq_job.return_value()
    assert_same_completion(result, reference(job))

    evts = events(r, job.id)
    kinds = [kind for _, kind, _ in evts]
    assert kinds[-2:] == ["usage", "done"]
    for index in (0, 1):
        mine = [kind for _, kind, data in evts if data.get("index") == index]
        assert mine[-1] == "finish" and mine.count("finish") == 1 and set(mine[:-1]) == {"delta"}
    assert evts[-1][2]["completion"] == result
    assert evts[-2][2] == result["usage"]
    assert stream_texts(evts) == {c["index"]: c["text"] for c in result["choices"]}
    deltas = [data for _, kind, data in evts if kind == "delta" and data["index"] == 0]
    assert sum(len(d["token_ids"]) for d in deltas) == 20
    assert sum(len(d["logprobs"]["tokens"]) for d in deltas) == 20


def test_concurrent_jobs_share_the_batch_and_keep_their_seeded_results(worker, r, reference):
    before = steps_with_more_than(worker, 2)
    jobs = [make_job(max_tokens=24, temperature=1.0) for _ in range(4)]
    rq_jobs = [enqueue(r, job) for job in jobs]
    wait_ended(rq_jobs)

    for job, rq_job in zip(jobs, rq_jobs):
        assert_same_completion(rq_job.return_value(), reference(job))
    # Nothing else runs on this worker: only these jobs can have made a step of 3 or 4 sequences.
    assert steps_with_more_than(worker, 2) > before


def test_cancel_flag_stops_a_running_job_within_a_few_steps(worker, r):
    # Streamed: every step is written as it is made, and each write reads the flag (a job that is
    # not streamed writes its tokens every StreamWriter.DEFER_S and reads its flag at least every
    # CHECK_S: tests/test_events.py).
    job = make_job(max_tokens=120, prompts=[[464]], stream=True)
    rq_job = enqueue(r, job)
    wait_for_delta(r, job.id)
    with r.pipeline(transaction=True) as pipe:
        pipe.set(protocol.cancel_key(job.id), 1, ex=60)
        pipe.xlen(protocol.stream_key(job.id))
        _, length_at_cancel = pipe.execute()
    wait_ended([rq_job])

    evts = events(r, job.id)
    kinds = [kind for _, kind, _ in evts]
    assert kinds[-1] == "cancelled" and "done" not in kinds
    # The engine learns of the flag from the write after the one under way when it was set: the
    # steps made meanwhile (a few a write, of the 100 and more the job had left) add their deltas.
    assert kinds.count("delta") < 120
    assert len([k for k in kinds[length_at_cancel:] if k == "delta"]) <= 16
    assert rq_job.get_status() == JobStatus.FINISHED and rq_job.return_value() is None


def test_a_job_delivered_again_while_it_runs_ends_once_as_the_running_attempt_does(worker, r, reference):
    """Its id back in the queue while it runs (as a job queued again by a lost-line recovery
    would be): the second delivery waits for the running attempt, never fails as a copy of it."""
    job = make_job(max_tokens=120, prompts=[[464]], stream=True)
    rq_job = enqueue(r, job)
    wait_for_delta(r, job.id)
    rq_json.queue(protocol.queue_name(MODEL), r).push_job_id(job.id)  # delivered again
    deadline = time.monotonic() + 30
    while "job delivered again while it runs" not in worker.logs():  # the second delivery taken
        assert time.monotonic() < deadline, "the second delivery was not taken while the job ran"
        time.sleep(0.02)
    wait_ended([rq_job])
    started = rq_json.started(protocol.queue_name(MODEL), r)
    while job.id in started.get_job_ids():  # both deliveries ended
        assert time.monotonic() < deadline, "the second delivery did not end"
        time.sleep(0.02)

    kinds = [kind for _, kind, _ in events(r, job.id)]
    assert "error" not in kinds and kinds.count("done") == 1 and kinds[-1] == "done", kinds
    finished = rq_json.fetch(job.id, r)
    assert finished.get_status() == JobStatus.FINISHED and finished.retries_left == 2  # no attempt failed
    assert_same_completion(finished.return_value(), reference(job))


def test_a_cancelled_job_that_was_still_queued_never_runs(worker, r):
    job = make_job()
    r.set(protocol.cancel_key(job.id), 1, ex=60)
    rq_job = enqueue(r, job)
    wait_ended([rq_job])
    assert [kind for _, kind, _ in events(r, job.id)] == ["cancelled"]


def test_refused_requests_end_with_an_error_event_and_are_not_retried(worker, r):
    too_long = make_job(prompts=[[464] * 120], max_tokens=20)  # the checkpoint's context is 128
    malformed = {"id": protocol.new_completion_id(), "model": MODEL, "prompts": "not token ids"}
    rq_jobs = [enqueue(r, too_long), enqueue(r, malformed)]
    wait_ended(rq_jobs)

    for rq_job in rq_jobs:
        assert rq_job.get_status() == JobStatus.FINISHED and rq_job.return_value() is None
        assert rq_json.fetch(rq_job.id, r).retries_left == 2
    [(_, kind, data)] = events(r, too_long.id)
    assert kind == "error"
    assert data["error"]["code"] == "context_length_exceeded" and data["error"]["param"] == "max_tokens"
    assert "maximum context length is 128 tokens" in data["error"]["message"]
    [(_, kind, data)] = events(r, malformed["id"])
    assert kind == "error" and data["error"]["type"] == "invalid_request_error"
    assert "prompts" in data["error"]["message"]


def test_a_job_rq_gives_up_on_gets_an_error_event(r):
    """The exception handler every worker installs, as rq calls it for a dead worker's job."""
    queue = rq_json.queue("completions:nobody-serves-this", r)
    retried = queue.enqueue_call(protocol.JOB_FUNCTION, args=({},), job_id=protocol.new_completion_id(),
                                 retry=Retry(max=1))
    given_up = queue.enqueue_call(protocol.JOB_FUNCTION, args=({},), job_id=protocol.new_completion_id())

    report_given_up(retried, AbandonedJobError, AbandonedJobError(), None)
    report_given_up(given_up, AbandonedJobError, AbandonedJobError(), None)
    report_given_up(given_up, AbandonedJobError, AbandonedJobError(), None)  # once is enough

    assert events(r, retried.id) == []  # rq will run it again
    [(_, kind, data)] = events(r, given_up.id)
    assert kind == "error" and data["error"]["type"] == "server_error"


def test_a_worker_never_unpickles_a_job_nor_calls_a_function_the_job_names(worker, r, reference, tmp_path):
    """Anyone who can write to Redis can queue a job: one pickled (rq's default serializer) whose
    unpickling would run code, and one in JSON naming a function other than the job function, fail
    without either running; ordinary jobs around them run as ever."""
    pickled_file, pickled_meta, called = tmp_path / "pickled", tmp_path / "meta", tmp_path / "called"
    queue = protocol.queue_name(MODEL)
    pickled = Queue(queue, connection=r, serializer=PickleSerializer).enqueue_call(
        protocol.JOB_FUNCTION, args=(rq_json.Touch(pickled_file),), meta={"owner": rq_json.Touch(pickled_meta)},
        job_id=protocol.new_completion_id())
    foreign = rq_json.queue(queue, r).enqueue_call("os.mkdir", args=(str(called),), job_id=protocol.new_completion_id())
    job = make_job()
    rq_jobs = [rq_json.fetch(pickled.id, r), foreign, enqueue(r, job)]
    wait_ended(rq_jobs)

    assert [j.get_status() for j in rq_jobs] == [JobStatus.FAILED, JobStatus.FAILED, JobStatus.FINISHED]
    assert_same_completion(rq_jobs[2].return_value(), reference(job))
    assert not pickled_file.exists() and not pickled_meta.exists() and not called.exists()
    for failed in rq_jobs[:2]:  # their streams end, as any failed job's do
        [(_, kind, data)] = events(r, failed.id)
        assert kind == "error" and data["error"]["type"] == "server_error"
    # and the pickle was live: unpickled, it creates its file
    PickleSerializer.loads(zlib.decompress(r.hget(pickled.key, "data")))
    assert pickled_file.exists()


@pytest.mark.slow
def test_one_engine_per_device_all_pulling_from_the_model_queue(redis_server, models_file, tmp_path, reference):
    """`--device cpu,cpu`: two engine replicas in one process, 2 jobs at once each, one queue."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    jobs = [make_job(max_tokens=60, prompts=[[464]], temperature=1.0) for _ in range(4)]
    with start_processor(url, models_file, device="cpu,cpu", concurrency=2, log_dir=tmp_path) as service:
        assert len(service.info["workers"][MODEL]) == 2  # one rq worker per engine
        rq_jobs = [enqueue(r, job) for job in jobs]
        wait_ended(rq_jobs)
    engines = set()
    for job, rq_job in zip(jobs, rq_jobs):
        assert_same_completion(rq_job.return_value(), reference(job))
        engines.add(rq_json.fetch(job.id, r).worker_name)
    assert len(engines) == 2


@pytest.mark.slow
def test_sigterm_finishes_running_jobs_takes_no_new_ones_and_exits_0(worker, r):
    """Last in this file: it stops the module's worker (2 of its 4 threads busy, 2 idle)."""
    running = [make_job(max_tokens=100, prompts=[[464]]) for _ in range(2)]
    rq_running = [enqueue(r, job) for job in running]
    for job in running:
        wait_for_delta(r, job.id)
    worker.signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "taking no new jobs" not in worker.logs():
        assert time.monotonic() < deadline and worker.alive()
        time.sleep(0.05)
    late = enqueue(r, make_job())
    assert worker.wait(timeout=60) == 0

    for job, rq_job in zip(running, rq_running):
        assert rq_job.get_status() == JobStatus.FINISHED
        assert rq_job.return_value()["usage"]["completion_tokens"] == 100
        assert [kind for _, kind, _ in events(r, job.id)][-1] == "done"
    assert late.get_status() == JobStatus.QUEUED
    assert events(r, late.id) == []
    assert registered_workers(worker.info["redis_url"], MODEL) == set()
    assert '"msg": "stopped"' in worker.logs()


def test_warm_up_builds_the_engines_and_exits_without_serving(models_file, tmp_path):
    """`processor.py --warm-up` (an image build's step): the engine is built and its decode step
    compiled into the cache, then the process exits 0 without a Redis to serve from."""
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "compile-cache"
    env = {**os.environ, "NANOSERVE_COMPILE_CACHE": str(cache), "REDIS_URL": "redis://127.0.0.1:1/0"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # an earlier test's compile_cache.enable() sets it here
    done = subprocess.run([sys.executable, "processor.py", "--models-file", str(models_file), "--warm-up", "--compile"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    messages = [r["msg"] for r in records]
    assert "engine ready" in messages and messages[-1] == "warmed up; exiting", messages
    assert "serving" not in messages and "decode step compiled" in messages
    assert any(cache.rglob("*"))  # the compiled graphs' cache entries, for the next start
