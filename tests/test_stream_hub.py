"""The web process's stream hub (web/api/stream_hub.py) against a real redis-server: one blocking
read serves every followed stream, a new follower is taken into a read already blocked, a second
reader of one stream is left to read on its own, and a Redis failure reaches every follower."""
from __future__ import annotations

import time

import pytest
import redis

from web.api.stream_hub import StreamHub
from web.dev.local_redis import start_redis


@pytest.fixture()
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def xread_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def read_all(follower, count: int, timeout_s: float = 5.0) -> list:
    entries, until = [], time.monotonic() + timeout_s
    while len(entries) < count and time.monotonic() < until:
        entries += follower.read(until - time.monotonic())
    return entries


def test_one_read_serves_every_stream(redis_url, r):
    hub = StreamHub(redis_url)
    keys = [f"test-hub:{i}" for i in range(20)]
    followers = [hub.follow(key, "0-0", r) for key in keys]
    time.sleep(0.3)  # the hub's read now includes every stream
    before = xread_calls(r)
    for step in range(3):  # a worker's steps: every job's event in one transaction
        with r.pipeline(transaction=True) as pipe:
            for key in keys:
                pipe.xadd(key, {"step": step})
            pipe.execute()
        time.sleep(0.05)
    got = [read_all(f, 3) for f in followers]
    reads = xread_calls(r) - before
    for key, entries in zip(keys, got):
        assert [fields[b"step"] for _, fields in entries] == [b"0", b"1", b"2"], key
    # a few per step (Redis counts a blocked XREAD again when an entry serves it), not one per
    # stream and step as 60 threads of their own would
    assert reads <= 2 * 3 + 1, reads
    for f in followers:
        hub.leave(f)


def test_a_follower_joins_a_read_already_blocked(redis_url, r):
    hub = StreamHub(redis_url, block_s=30)
    first = hub.follow("test-hub:a", "0-0", r)
    time.sleep(0.2)  # blocked on the first stream alone, for up to 30 s
    r.xadd("test-hub:b", {"n": 1})
    started = time.monotonic()
    second = hub.follow("test-hub:b", "0-0", r)
    assert [fields[b"n"] for _, fields in second.read(5)] == [b"1"]
    assert time.monotonic() - started < 2
    hub.leave(first)
    hub.leave(second)


def test_a_follower_woken_for_by_another_transaction_reads_its_stream(redis_url, r):
    """A request registers its follower, then wakes the hub in its job's enqueue transaction
    (queue_wake): the hub's read, blocked on other streams, takes the new stream in."""
    hub = StreamHub(redis_url, block_s=30)
    first = hub.follow("test-hub:w1", "0-0", r)
    time.sleep(0.2)  # blocked on the first stream alone, for up to 30 s
    second = hub.register("test-hub:w2", "0-0")
    with r.pipeline(transaction=True) as pipe:
        pipe.set("test-hub:a-job", 1)
        hub.queue_wake(pipe, "test-hub:w2")
        pipe.execute()
    r.xadd("test-hub:w2", {"n": 1})
    assert [fields[b"n"] for _, fields in second.read(5)] == [b"1"]
    hub.leave(first)
    hub.leave(second)


def test_a_stream_that_ended_is_no_longer_read_though_its_reader_never_came(redis_url, r):
    """A request that failed between registering its follower and reading it never leaves: the
    hub stops reading the stream at its terminal event all the same."""
    hub = StreamHub(redis_url)
    orphan = hub.follow("test-hub:orphan", "0-0", r)
    r.xadd("test-hub:orphan", {"type": "delta", "data": "{}"})
    time.sleep(0.3)
    assert "test-hub:orphan" in hub._followers
    r.xadd("test-hub:orphan", {"type": "done", "data": "{}"})
    until = time.monotonic() + 5
    while "test-hub:orphan" in hub._followers and time.monotonic() < until:
        time.sleep(0.02)
    assert "test-hub:orphan" not in hub._followers
    assert [fields[b"type"] for _, fields in read_all(orphan, 2)] == [b"delta", b"done"]  # what was read is kept


def test_reads_from_the_given_entry(redis_url, r):
    hub = StreamHub(redis_url)
    ids = [r.xadd("test-hub:from", {"n": n}) for n in range(3)]
    follower = hub.follow("test-hub:from", ids[0].decode(), r)
    assert [entry_id for entry_id, _ in read_all(follower, 2)] == ids[1:]
    hub.leave(follower)


def test_a_second_reader_of_one_stream_reads_on_its_own(redis_url, r):
    hub = StreamHub(redis_url)
    first = hub.follow("test-hub:same", "0-0", r)
    assert hub.follow("test-hub:same", "0-0", r) is None
    hub.leave(first)
    again = hub.follow("test-hub:same", "0-0", r)
    assert again is not None
    hub.leave(again)


def test_the_thread_ends_without_followers_and_starts_again(redis_url, r):
    hub = StreamHub(redis_url, block_s=0.2)
    follower = hub.follow("test-hub:idle", "0-0", r)
    hub.leave(follower)
    until = time.monotonic() + 5
    while hub._thread is not None and time.monotonic() < until:
        time.sleep(0.05)
    assert hub._thread is None
    follower = hub.follow("test-hub:idle", "0-0", r)
    r.xadd("test-hub:idle", {"n": 1})
    assert len(read_all(follower, 1)) == 1
    hub.leave(follower)


def test_a_redis_failure_reaches_every_follower(tmp_path):
    server = start_redis()
    try:
        client = redis.Redis.from_url(server.url)
        hub = StreamHub(server.url)
        followers = [hub.follow(f"test-hub:down:{i}", "0-0", client) for i in range(3)]
        time.sleep(0.2)
        server.stop()
        for follower in followers:
            with pytest.raises(redis.RedisError):
                follower.read(5)
    finally:
        server.stop()
