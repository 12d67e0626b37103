"""Interactive before batch: a consumer's `take` over two queues, against a real redis-server."""
from __future__ import annotations

import threading
import time

import pytest
import redis
from rq import Queue

from tests import rq_json
from worker import protocol
from worker.consumer import CompletionRqJob
from worker.priority import SLICE_S, take


@pytest.fixture()
def queues(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client, rq_json.queue(protocol.queue_name("m"), client), rq_json.queue(protocol.batch_queue_name("m"),
                                                                                  client)
    client.close()


def enqueue(queue: Queue, job_id: str):
    return queue.enqueue_call(protocol.JOB_FUNCTION, args=({},), job_id=job_id)


def taken(client: redis.Redis, queues: list[Queue], room: list[int], timeout: float) -> list[tuple[str, str]]:
    """(job id, queue name) of what a consumer with this room takes (rq's job hash read back whole)."""
    jobs = take(queues, room, timeout, client, CompletionRqJob, rq_json.SERIALIZER)
    for job, _ in jobs:
        assert job.func_name == protocol.JOB_FUNCTION and list(job.args) == [{}]
    return [(job.id, queue.name) for job, queue in jobs]


def test_interactive_jobs_go_first_and_batch_lines_only_when_none_wait(queues):
    client, interactive, batch = queues
    for job_id in ("b1", "b2", "b3"):
        enqueue(batch, job_id)
    enqueue(interactive, "i1")
    enqueue(interactive, "i2")
    # room for one: the interactive queue still holds a job, so no batch line
    assert taken(client, [interactive, batch], [1, 3], 1) == [("i1", interactive.name)]
    # room for four, two of them for batch lines: the last interactive job, then two lines
    assert taken(client, [interactive, batch], [4, 2], 1) == [("i2", interactive.name), ("b1", batch.name),
                                                              ("b2", batch.name)]
    # like rq's one-queue dequeue, each job waits in its queue's intermediate list until it starts
    assert client.lrange(interactive.intermediate_queue_key, 0, -1) == [b"i1", b"i2"]
    assert client.lrange(batch.intermediate_queue_key, 0, -1) == [b"b1", b"b2"]
    assert taken(client, [interactive, batch], [4, 0], 0.2) == []  # no room for a line
    assert taken(client, [interactive, batch], [4, 4], 1) == [("b3", batch.name)]
    started = time.monotonic()
    assert taken(client, [interactive, batch], [4, 4], 0.3) == []
    assert 0.25 < time.monotonic() - started < 1


@pytest.mark.parametrize("late", ["interactive", "batch"])
def test_a_waiting_consumer_takes_a_job_as_it_arrives(queues, late):
    client, interactive, batch = queues
    target = interactive if late == "interactive" else batch
    threading.Timer(0.3, enqueue, args=(target, "late")).start()
    started = time.monotonic()
    assert taken(client, [interactive, batch], [2, 2], 5) == [("late", target.name)]
    waited = time.monotonic() - started
    # an interactive job at once; a batch job within a slice
    assert 0.25 < waited < 0.3 + (0.1 if late == "interactive" else SLICE_S + 0.1)


def test_a_vanished_job_is_skipped(queues):
    client, interactive, batch = queues
    enqueue(interactive, "gone").delete(remove_from_queue=False)
    enqueue(interactive, "here")
    assert taken(client, [interactive, batch], [2, 2], 1) == [("here", interactive.name)]


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
    assert take([interactive, batch], [1, 1], 1, client, CompletionRqJob, rq_json.SERIALIZER) == []
    assert time.perf_counter() - started < 0.5 and len(blocked) == 1
    client.close()
