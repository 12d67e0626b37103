"""The rq worker threads' own bookkeeping (worker/consumer.py's WorkerPool) against a real
redis-server, with a sleep standing in for the job function: the heartbeats and registry maintenance
that re-queue a dead worker's jobs, while every worker thread of the pool is busy; and what of a job
in Redis a worker refuses to call."""
from __future__ import annotations

import time

import pytest
import redis
from rq import Retry
from rq.job import JobStatus

from tests import rq_json
from worker import consumer, protocol
from worker.consumer import Binding, CompletionRqJob, ForeignJob, WorkerPool

MODEL = "m"


@pytest.fixture()
def client(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(autouse=True)
def sleeping_jobs(monkeypatch):
    """Jobs here name the job function, as every job must; each sleeps the seconds it is given."""
    monkeypatch.setattr(consumer, "run_completion", time.sleep)


@pytest.fixture()
def pool(redis_url):
    """One busy-able rq worker thread with a heartbeat every half second and maintenance every second."""
    workers = WorkerPool(redis_url, heartbeat_interval=0.5, maintenance_interval=1)
    workers.add(Binding(MODEL, engine=None, writer=None), "cpu", concurrency=1)
    yield workers
    workers.stop()
    workers.join(idle_grace=5)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_job_lost_between_dequeue_and_start_is_retried_while_the_only_worker_is_busy(pool, client):
    """A worker killed between taking a job off the queue and starting it leaves the job in the
    queue's intermediate list, where registry maintenance finds it and retries it.
    That maintenance comes while the pool's one worker runs a long job: the long job keeps its
    heartbeats and its registry entry, ends once, and the lost job runs after it."""
    queue = rq_json.queue(protocol.queue_name(MODEL), client)
    started = rq_json.started(queue.name, client)
    busy = queue.enqueue_call(protocol.JOB_FUNCTION, args=(6,), retry=Retry(max=2))
    wait_until(lambda: busy.get_status() == JobStatus.STARTED, 10, "the long job never started")

    lost = queue.create_job(protocol.JOB_FUNCTION, args=(0,), retry=Retry(max=2))
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
    assert pool._heartbeat.is_alive()


def test_a_worker_thread_writes_no_state_or_beat_redis_already_holds(client):
    """rq sets a worker IDLE after every job and again before every dequeue, and beats its key
    several times a job: round trips on the path that takes the next job. A thread writes a state
    only when it changes, beats at most every quarter TTL unless its record changes (its engine's
    warming flag), and always beats inside a transaction rq builds (a job's start)."""
    from rq.worker import WorkerStatus

    warming = [True]
    worker = consumer.EngineWorker([protocol.queue_name(MODEL)], connection=client, serializer=rq_json.SERIALIZER,
                                   heartbeat_ttl=60, poll_interval=1, warming=lambda: warming[0])
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
        with client.pipeline() as pipe:  # in rq's transaction: always
            worker.heartbeat(pipeline=pipe)
            pipe.execute()
        assert client.hget(worker.key, "last_heartbeat") != b"marked"
        assert not worker.should_run_maintenance_tasks  # the pool's heartbeat thread cleans the registries
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


def test_idle_threads_take_turns_to_listen_and_stay_registered(redis_url, client):
    """Of eight idle threads only LISTENERS of each kind wait on Redis; the others wait their turn,
    and the heartbeat thread keeps their rq keys alive past several TTLs. A burst of eight jobs
    still runs on all eight threads at once."""
    from worker.consumer import LISTENERS

    pool = WorkerPool(redis_url, heartbeat_interval=0.5, maintenance_interval=1)
    pool.add(Binding(MODEL, engine=None, writer=None), "cpu", concurrency=8, batch_concurrency=6)
    try:
        wait_until(lambda: all(w is not None for w in pool.workers), 5, "the threads never started")
        listening = []
        deadline = time.monotonic() + 2 * pool.heartbeat_ttl  # past the TTL of keys nobody beats
        while time.monotonic() < deadline:
            listening.append(sum(1 for w in pool.workers if not w._waiting and not w.busy))
            time.sleep(0.02)
        assert sorted(listening)[len(listening) // 2] <= 2 * LISTENERS < 8
        assert all(client.exists(w.key) for w in pool.workers)  # every thread still a live worker

        queue = rq_json.queue(protocol.queue_name(MODEL), client)
        jobs = [queue.enqueue_call(protocol.JOB_FUNCTION, args=(2,)) for _ in range(8)]
        wait_until(lambda: all(job.get_status() == JobStatus.STARTED for job in jobs), 2,
                   "the burst did not start on every thread")
        wait_until(lambda: all(job.get_status() == JobStatus.FINISHED for job in jobs), 10, "the burst never ended")
    finally:
        pool.stop()
        pool.join(idle_grace=5)


def test_a_worker_calls_the_job_function_and_nothing_else_a_job_names(client, monkeypatch):
    """rq would import and call whatever function and callbacks a job's hash in Redis names, and
    send its webhooks: a worker's jobs call the job function, and resolve or send nothing else."""
    from rq.job import Callback
    from rq.webhook import Webhook

    sent = []
    monkeypatch.setattr(Webhook, "send", lambda self, job, **kw: sent.append(job.id))
    queue = rq_json.queue(protocol.queue_name(MODEL), client)
    ours = queue.enqueue_call(protocol.JOB_FUNCTION, args=(0,), on_success=Callback("os.mkdir"),
                              on_failure=Callback("os.mkdir"), on_stopped=Callback("os.mkdir"),
                              webhooks=[Webhook("http://127.0.0.1:9/hook", JobStatus.FINISHED)])
    foreign = queue.enqueue_call("os.mkdir", args=("/nowhere",))
    # as stored, the job names its callbacks and webhook: a plain rq job would call and send them
    plain = rq_json.fetch(ours.id, client)
    assert plain.success_callback is not None
    plain.send_webhooks(JobStatus.FINISHED)
    assert sent == [ours.id]

    ours, foreign = (CompletionRqJob.fetch(job.id, connection=client, serializer=rq_json.SERIALIZER)
                     for job in (ours, foreign))
    assert ours.func is time.sleep  # the job function (here, its stand-in)
    assert (ours.success_callback, ours.failure_callback, ours.stopped_callback) == (None, None, None)
    ours.send_webhooks(JobStatus.FINISHED)
    assert sent == [ours.id]
    with pytest.raises(ForeignJob):
        foreign.func
