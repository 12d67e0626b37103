"""A consumer's own bookkeeping (worker/consumer.py) against a real redis-server, with an engine
that sleeps for each job (max_tokens tenths of a second) standing in for the model: the heartbeats
and registry maintenance that re-queue a dead worker's jobs while the engine is busy, the batch
jobs' share of the engine, the round trips a burst of jobs costs, and what of a job in Redis a
consumer refuses to run."""
from __future__ import annotations

import threading
import time

import pytest
import redis
from rq import Retry
from rq.job import JobStatus

from tests import rq_json
from tests.conftest import redis_commands
from worker import consumer, protocol
from worker.consumer import Binding, CompletionRqJob, ForeignJob, WorkerPool
from worker.engine import RequestHandle
from worker.errors import RequestCancelled
from worker.events import StreamWriter

MODEL = "m"


class SleepingEngine:
    """Ends each job after max_tokens / 10 seconds with an empty completion, in steps of 20 ms as
    an engine does (every job due in a step ends in it); counts how many of its jobs ran at once."""

    def __init__(self):
        self.submitted = self.most = 0
        self.due: dict[RequestHandle, float] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._step, daemon=True).start()

    @property
    def running(self) -> int:
        return len(self.due)

    def is_alive(self) -> bool:
        return True

    def submit(self, job: protocol.CompletionJob, resume=None) -> RequestHandle:
        handle = RequestHandle(job.id, cancel=lambda job_id: self._end(handle, RequestCancelled(job_id)))
        with self._lock:
            self.submitted += 1
            self.due[handle] = time.monotonic() + job.max_tokens / 10
            self.most = max(self.most, len(self.due))
        return handle

    def _end(self, handle: RequestHandle, error=None) -> None:
        with self._lock:
            if self.due.pop(handle, None) is None:
                return
        handle.end({"id": handle.job_id, "choices": [], "usage": {"completion_tokens": 0}}, error)

    def _step(self) -> None:
        while True:
            time.sleep(0.02)
            now = time.monotonic()
            for handle in [h for h, due in list(self.due.items()) if due <= now]:
                self._end(handle)


@pytest.fixture()
def client(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def start_pool(redis_url, concurrency: int, batch_concurrency: int | None = None, heartbeat_interval: float = 0.5):
    engine = SleepingEngine()
    pool = WorkerPool(redis_url, heartbeat_interval=heartbeat_interval, maintenance_interval=1)
    binding = Binding(MODEL, engine, StreamWriter(protocol.redis_client(redis_url)))
    pool.add(binding, "cpu", concurrency=concurrency, batch_concurrency=batch_concurrency)
    return pool, engine


@pytest.fixture()
def pool(redis_url):
    """A consumer running one job at a time, with a heartbeat every half second and maintenance every second."""
    workers, _ = start_pool(redis_url, 1)
    yield workers
    workers.stop()
    workers.join(idle_grace=5)


def enqueue(queue, tenths: int, **options):
    job = protocol.CompletionJob(id=f"cmpl-{time.monotonic_ns()}", model=MODEL, prompts=[[1]], max_tokens=tenths,
                                 seed=0)
    return queue.enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id, **options)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_job_lost_between_taking_and_start_is_retried_while_the_engine_is_full(pool, client):
    """A worker killed between taking a job off the queue and starting it leaves the job in the
    queue's intermediate list, where registry maintenance finds it and retries it.
    That maintenance comes while the consumer's one place is taken by a long job: the long job keeps
    its heartbeats and its registry entry, ends once, and the lost job runs after it."""
    queue = rq_json.queue(protocol.queue_name(MODEL), client)
    started = rq_json.started(queue.name, client)
    busy = enqueue(queue, 60, retry=Retry(max=2))
    wait_until(lambda: busy.get_status() == JobStatus.STARTED, 10, "the long job never started")

    # a short job, so that the wait for it after the long one is all slack for its pickup
    short = protocol.CompletionJob(id="cmpl-lost", model=MODEL, prompts=[[1]], max_tokens=5, seed=0)
    lost = queue.create_job(protocol.JOB_FUNCTION, args=(short.to_payload(),), job_id=short.id, retry=Retry(max=2))
    lost.save()
    client.set(queue.intermediate_queue.get_first_seen_key(lost.id), time.time() - 120)  # seen there long ago
    client.rpush(queue.intermediate_queue.key, lost.id)
    wait_until(lambda: not client.lrange(queue.intermediate_queue.key, 0, -1), 5, "the lost job was never retried")
    assert lost.get_status() == JobStatus.QUEUED and busy.get_status() == JobStatus.STARTED

    # Beats go on: the long job's entry stays unexpired past several heartbeat TTLs.
    while busy.get_status() == JobStatus.STARTED:
        assert busy.id in started.get_job_ids(cleanup=False)
        assert busy.id not in started.get_expired_job_ids()
        time.sleep(0.1)
    wait_until(lambda: lost.get_status() == JobStatus.FINISHED, 10, "the lost job never ran")
    assert busy.get_status() == JobStatus.FINISHED
    assert [job.retries_left for job in rq_json.fetch_many([busy.id, lost.id], client)] == [2, 1]
    assert busy.return_value()["id"] == busy.id
    assert pool._heartbeat.is_alive()


def test_a_consumers_worker_writes_no_state_or_beat_redis_already_holds(client):
    """A consumer's rq worker writes a state only when it changes, beats at most every quarter TTL
    unless its record changes (its engine's warming flag), and always beats inside a transaction."""
    from rq.worker import WorkerStatus

    warming = [True]
    worker = consumer.EngineWorker([protocol.queue_name(MODEL)], connection=client, serializer=rq_json.SERIALIZER,
                                   heartbeat_ttl=60, warming=lambda: warming[0])
    worker.register_birth()
    try:
        worker.set_state(WorkerStatus.IDLE)
        worker.heartbeat()
        client.hset(worker.key, mapping={"state": "marked", "last_heartbeat": "marked"})
        worker.set_state(WorkerStatus.IDLE)
        worker.heartbeat()
        assert client.hmget(worker.key, "state", "last_heartbeat") == [b"marked", b"marked"]
        worker.set_state(WorkerStatus.BUSY)  # a change: written
        assert client.hget(worker.key, "state") == WorkerStatus.BUSY.encode()
        warming[0] = False  # its record changes: the beat goes out
        worker.heartbeat()
        assert client.hmget(worker.key, "last_heartbeat", protocol.WARMING_FIELD)[0] != b"marked"
        assert client.hget(worker.key, protocol.WARMING_FIELD) == b"0"
        client.hset(worker.key, "last_heartbeat", "marked")
        with client.pipeline() as pipe:  # in a transaction: always
            worker.heartbeat(pipeline=pipe)
            pipe.execute()
        assert client.hget(worker.key, "last_heartbeat") != b"marked"
    finally:
        worker.register_death()


def test_the_maintenance_lock_of_a_worker_that_died_while_cleaning_expires_soon(client):
    """rq holds a queue's maintenance lock for 15 minutes: a worker killed while it cleans would
    stop every other worker from re-queueing dead workers' jobs for that long."""
    from worker.priority import MAINTENANCE_LOCK_S, PriorityQueue

    queue = PriorityQueue(protocol.queue_name(MODEL), connection=client, serializer=rq_json.SERIALIZER)
    assert queue.acquire_maintenance_lock()
    assert not queue.acquire_maintenance_lock()
    assert 0 < client.ttl(queue.registry_cleaning_key) <= MAINTENANCE_LOCK_S <= 60


def test_a_job_in_the_intermediate_list_counts_as_lost_after_seconds_not_a_minute(client):
    """rq retries a job left between dequeue and start after a minute; a request whose worker died
    at that moment runs again once it has been seen there LOST_AFTER_S apart."""
    from worker.priority import LOST_AFTER_S, PriorityQueue

    assert LOST_AFTER_S < 60
    queue = PriorityQueue(protocol.queue_name(MODEL), connection=client, serializer=rq_json.SERIALIZER)
    intermediate = queue.intermediate_queue
    for job_id, seen_ago, lost in (("recent", LOST_AFTER_S - 5, False), ("old", LOST_AFTER_S + 1, True)):
        client.set(intermediate.get_first_seen_key(job_id), time.time() - seen_ago)
        assert intermediate.should_be_cleaned_up(job_id) is lost
    assert not intermediate.should_be_cleaned_up("never-seen")


def test_batch_jobs_take_their_share_of_the_engine_and_interactive_ones_the_rest(redis_url, client):
    """Eight batch jobs, an engine of eight places of which six may run batch jobs: six run, and an
    interactive job enqueued meanwhile starts at once in a place they left; one rq worker stands
    for the engine, whatever it runs."""
    pool, engine = start_pool(redis_url, 8, batch_concurrency=6)
    try:
        batch = rq_json.queue(protocol.batch_queue_name(MODEL), client)
        lines = [enqueue(batch, 20) for _ in range(8)]
        wait_until(lambda: engine.running == 6, 5, "the batch jobs never filled their share")
        interactive = enqueue(rq_json.queue(protocol.queue_name(MODEL), client), 5)
        wait_until(lambda: interactive.get_status() == JobStatus.STARTED, 1, "the interactive job waited")
        assert sum(job.get_status() == JobStatus.STARTED for job in lines) == 6
        wait_until(lambda: all(job.get_status() == JobStatus.FINISHED for job in [*lines, interactive]), 10,
                   "the jobs never ended")
        assert engine.most == 7
        assert len([w for w in pool.workers if w is not None and client.exists(w.key)]) == 1
    finally:
        pool.stop()
        pool.join(idle_grace=5)


def test_a_finished_job_reads_back_in_rq_as_rqs_worker_leaves_it(pool, client):
    """The consumer records a finish in rq's data model (the job's status and end, its result, the
    finished registry, the execution gone) without writing the job's unchanged fields again: what
    rq reads back is whole, the job's payload with it."""
    queue = rq_json.queue(protocol.queue_name(MODEL), client)
    job = enqueue(queue, 1, meta={"owner": "key:a"}, result_ttl=300)
    wait_until(lambda: job.get_status() == JobStatus.FINISHED, 10, "the job never finished")
    back = rq_json.fetch(job.id, client)
    assert back.get_status(refresh=False) == JobStatus.FINISHED
    assert back.started_at is not None and back.ended_at is not None and back.ended_at >= back.started_at
    assert list(back.args) == list(job.args) and back.meta == {"owner": "key:a"} and back.origin == queue.name
    assert back.return_value()["id"] == job.id
    result = back.latest_result()
    assert result.type == result.Type.SUCCESSFUL and result.worker_name == pool.workers[0].name
    assert job.id in rq_json.finished(queue.name, client).get_job_ids()
    assert job.id not in queue.started_job_registry.get_job_ids()
    assert not client.keys(f"rq:execution:{job.id}:*")
    assert 0 < client.ttl(back.key) <= 300


def test_a_burst_of_jobs_starts_and_ends_in_a_few_transactions(redis_url, client):
    """Sixteen jobs enqueued at once and ending together: the consumer takes, starts and records
    them in a few round trips, not a dozen per job as rq's worker does (every one holds the GIL the
    engine's thread steps with)."""
    pool, engine = start_pool(redis_url, 16, heartbeat_interval=30)  # no beat meanwhile
    try:
        wait_until(lambda: pool.workers[0] is not None, 5, "the consumer never registered")
        time.sleep(0.5)
        with redis_commands(redis_url) as commands:
            queue = rq_json.queue(protocol.queue_name(MODEL), client)
            with client.pipeline() as pipe:
                jobs = [enqueue(queue, 3, pipeline=pipe) for _ in range(16)]
                pipe.execute()
            wait_until(lambda: all(job.get_status() == JobStatus.FINISHED for job in jobs), 10,
                       "the burst never ended")
    finally:
        pool.stop()
        pool.join(idle_grace=5)
    transactions = sum(command == "MULTI" for command in commands)
    assert engine.most == 16
    assert 3 <= transactions <= 8, commands  # the enqueue, and a start and a record for each of a wake or few


class SlowWriter(StreamWriter):
    """A writer whose every write reaches Redis half a second late (a Redis under load)."""

    def _flush(self, active, due):
        time.sleep(0.5)
        return super()._flush(active, due)


class WritingEngine(SleepingEngine):
    """Ends each job as the engine does: its `done` event handed to the writer, then its handle."""

    def __init__(self, writer: StreamWriter):
        self.writer = writer
        super().__init__()

    def _end(self, handle: RequestHandle, error=None) -> None:
        self.writer([(handle.job_id, "done", {"completion": {"id": handle.job_id}})])
        super()._end(handle, error)


def test_rq_hears_a_job_finished_only_once_its_done_event_is_in_its_stream(redis_url, client):
    """The writer's thread writes a job's last events after the engine let it go: the consumer
    records the job finished in rq only once they are in its stream (web takes a job rq calls
    finished that left no terminal event for a failed one)."""
    writer = SlowWriter(protocol.redis_client(redis_url))
    pool = WorkerPool(redis_url, heartbeat_interval=30, maintenance_interval=1)
    pool.add(Binding(MODEL, WritingEngine(writer), writer), "cpu", concurrency=2)
    try:
        queue = rq_json.queue(protocol.queue_name(MODEL), client)
        jobs = [enqueue(queue, 1) for _ in range(3)]
        seen = set()
        deadline = time.monotonic() + 20
        while len(seen) < len(jobs):
            assert time.monotonic() < deadline, "the jobs never finished"
            for job in jobs:
                if job.id not in seen and job.get_status() == JobStatus.FINISHED:
                    last = client.xrevrange(protocol.stream_key(job.id), count=1)
                    assert last and protocol.decode_event(last[0][1])[0] == "done"
                    seen.add(job.id)
            time.sleep(0.01)
    finally:
        pool.stop()
        pool.join(idle_grace=5)


def test_a_job_past_rqs_timeout_is_taken_out_of_the_engine_failed_and_retried(redis_url, client):
    """rq's job timeout: the consumer takes the job out of the engine (no `cancelled` event in its
    stream), fails it so rq retries it, and once its retries run out its stream ends with an error."""
    from rq.job import Retry

    pool, engine = start_pool(redis_url, 2)
    try:
        queue = rq_json.queue(protocol.queue_name(MODEL), client)
        started = time.monotonic()
        slow = enqueue(queue, 80, timeout=1, retry=Retry(max=1))  # 8 s a run, 1 s allowed
        wait_until(lambda: slow.get_status() == JobStatus.FAILED, 10, "the job never failed")
        took = time.monotonic() - started
    finally:
        pool.stop()
        pool.join(idle_grace=5)
    assert engine.submitted == 2 and engine.running == 0  # run, retried once, each taken out
    assert took < 6, took  # two attempts taken out, not run to their end
    events = [fields[b"type"] for _, fields in client.xrange(protocol.stream_key(slow.id))]
    assert events == [b"error"]


def test_a_consumer_runs_the_job_function_and_nothing_else_a_job_names(redis_url, client, monkeypatch, tmp_path):
    """rq would import and call whatever function and callbacks a job's hash in Redis names, and
    send its webhooks: a consumer runs jobs that name the job function on its engine, and resolves,
    calls or sends nothing else. A job naming another function fails."""
    from rq.job import Callback
    from rq.webhook import Webhook

    sent = []
    monkeypatch.setattr(Webhook, "send", lambda self, job, **kw: sent.append(job.id))
    queue = rq_json.queue(protocol.queue_name(MODEL), client)
    target = tmp_path / "made"
    ours = enqueue(queue, 0, on_success=Callback("os.mkdir"), on_failure=Callback("os.mkdir"),
                   on_stopped=Callback("os.mkdir"), webhooks=[Webhook("http://127.0.0.1:9/hook", JobStatus.FINISHED)])
    foreign = queue.enqueue_call("os.mkdir", args=(str(target),))
    # as stored, the job names its callbacks and webhook: a plain rq job would call and send them
    plain = rq_json.fetch(ours.id, client)
    assert plain.success_callback is not None
    plain.send_webhooks(JobStatus.FINISHED)
    assert sent == [ours.id]

    ours_read, foreign_read = (CompletionRqJob.fetch(job.id, connection=client, serializer=rq_json.SERIALIZER)
                               for job in (ours, foreign))
    ours_read.check()
    assert (ours_read.success_callback, ours_read.failure_callback, ours_read.stopped_callback) == (None, None, None)
    with pytest.raises(ForeignJob):
        foreign_read.check()
    with pytest.raises(TypeError):
        ours_read.func  # nothing resolves the function a job names

    pool, _ = start_pool(redis_url, 2)
    try:
        wait_until(lambda: {ours.get_status(), foreign.get_status()} == {JobStatus.FINISHED, JobStatus.FAILED}, 10,
                   "the jobs never ended")
    finally:
        pool.stop()
        pool.join(idle_grace=5)
    assert ours.get_status() == JobStatus.FINISHED and foreign.get_status() == JobStatus.FAILED
    assert sent == [ours.id] and not target.exists()
