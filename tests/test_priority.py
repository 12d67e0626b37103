"""Interactive before batch: the worker's dequeue over two queues, against a real redis-server."""
from __future__ import annotations

import threading
import time

import pytest
import redis
from rq import Queue
from rq.exceptions import DequeueTimeout

from tests import rq_json
from worker import protocol
from worker.priority import SLICE_S, PriorityQueue


@pytest.fixture()
def queues(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client, rq_json.queue(protocol.queue_name("m"), client), rq_json.queue(protocol.batch_queue_name("m"),
                                                                                  client)
    client.close()


def enqueue(queue: Queue, job_id: str):
    return queue.enqueue_call(protocol.JOB_FUNCTION, args=({},), job_id=job_id)


def dequeue(client: redis.Redis, queues: list[Queue], timeout: float | None):
    """A worker's dequeue (rq passes the worker's serializer)."""
    return PriorityQueue.dequeue_any(queues, timeout, connection=client, serializer=rq_json.SERIALIZER)


def test_interactive_jobs_go_first(queues):
    client, interactive, batch = queues
    enqueue(batch, "b1")
    enqueue(batch, "b2")
    enqueue(interactive, "i1")
    order = []
    for _ in range(3):
        job, queue = dequeue(client, [interactive, batch], 1)
        order.append((job.id, queue.name))
        # like rq's one-queue dequeue, the job waits in the intermediate list until it starts
        assert client.lrange(queue.intermediate_queue_key, 0, -1)[-1] == job.id.encode()
    assert order == [("i1", interactive.name), ("b1", batch.name), ("b2", batch.name)]
    assert dequeue(client, [interactive, batch], None) is None
    with pytest.raises(DequeueTimeout):
        dequeue(client, [interactive, batch], 1)


@pytest.mark.parametrize("late", ["interactive", "batch"])
def test_a_waiting_worker_takes_a_job_as_it_arrives(queues, late):
    client, interactive, batch = queues
    target = interactive if late == "interactive" else batch
    threading.Timer(0.3, enqueue, args=(target, "late")).start()
    started = time.monotonic()
    job, queue = dequeue(client, [interactive, batch], 5)
    waited = time.monotonic() - started
    assert job.id == "late" and queue.name == target.name
    # an interactive job at once; a batch job within a slice
    assert 0.25 < waited < 0.3 + (0.1 if late == "interactive" else SLICE_S + 0.1)


def test_a_vanished_job_is_skipped(queues):
    client, interactive, batch = queues
    enqueue(interactive, "gone").delete(remove_from_queue=False)
    enqueue(interactive, "here")
    job, _ = dequeue(client, [interactive, batch], 1)
    assert job.id == "here"


def test_the_last_slice_of_a_wait_never_blocks_for_ever(redis_url, monkeypatch):
    """Redis reads a blocking timeout in whole milliseconds and 0 as "for ever": a wait whose last
    slice is under a millisecond must still end (it held a listening worker until its socket timed
    out, and its rq key expired meanwhile)."""
    import worker.priority as priority

    client = redis.Redis.from_url(redis_url, socket_timeout=2)  # the wrong wait ends in a TimeoutError
    interactive, batch = (rq_json.queue(name, client) for name in
                          (protocol.queue_name("m"), protocol.batch_queue_name("m")))
    # the clock: 0 when the wait starts (deadline 1 s), 0.4 ms before the deadline until the wait
    # blocks, then long past it
    blocked = []
    ticks = iter([0.0])
    monkeypatch.setattr(priority.time, "monotonic", lambda: next(ticks, 5.0 if blocked else 0.9996))
    blmove = client.blmove
    monkeypatch.setattr(client, "blmove", lambda *args: blocked.append(args) or blmove(*args))
    started = time.perf_counter()
    with pytest.raises(DequeueTimeout):
        dequeue(client, [interactive, batch], 1)
    assert time.perf_counter() - started < 0.5 and len(blocked) == 1
    client.close()
