"""The engine's event sink (worker/events.py StreamWriter) against a real redis-server: a streamed
job's every step is written as it is made; a job read whole at its end has its tokens written at
most every DEFER_S after its own last write, its first token and its end at once, and its cancel
flag read with each write and at least every CHECK_S between writes. The writer's own thread
writes: `step` hands a step's events over as the engine does and waits for what was due."""
from __future__ import annotations

import threading
import time

import pytest
import redis
from rq.job import Job

from worker import protocol
from web.dev.local_redis import start_redis
from worker.events import StreamWriter, open_attempt, read_history


@pytest.fixture()
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def delta(job_id: str, token: int):
    return (job_id, "delta", {"index": 0, "text": f"<{token}>", "token_ids": [token]})


def step(writer: StreamWriter, events) -> set[str]:
    """One engine step's events handed over, and what was due written: the jobs to cancel that the
    engine has by then (from this call, or from the write it asked for)."""
    cancelled = writer(events)
    assert writer.wait_written(timeout=10)
    return cancelled | writer.cancelled()


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def length(client, job_id: str) -> int:
    return client.xlen(protocol.stream_key(job_id))


def test_a_streamed_job_is_written_every_step(client):
    writer = StreamWriter(client)
    writer.track("s", streamed=True)
    for token in range(5):
        step(writer, [delta("s", token)])
        assert length(client, "s") == token + 1


def test_a_job_read_at_its_end_writes_its_tokens_every_defer_s_and_its_first_and_last_at_once(client):
    writer = StreamWriter(client)
    writer.DEFER_S = 0.5  # a whole test's steps fit in it on a slow machine
    writer.track("w", streamed=False)
    step(writer, [delta("w", 0)])
    assert length(client, "w") == 1  # the first token: web times the answer's first token by it
    started = time.monotonic()
    for token in range(1, 4):
        step(writer, [delta("w", token)])
    assert time.monotonic() - started < writer.DEFER_S
    assert length(client, "w") == 1  # waiting with the job's next tokens
    step(writer, [("w", "usage", {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5})])
    # any other event takes the waiting tokens with it, in order, as one delta
    assert events(client, "w")[1:] == [("delta", {"index": 0, "text": "<1><2><3>", "token_ids": [1, 2, 3]}),
                                       ("usage", {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5})]
    step(writer, [delta("w", 4)])
    assert length(client, "w") == 3
    time.sleep(writer.DEFER_S)
    step(writer, [delta("w", 5)])
    assert length(client, "w") == 4  # DEFER_S after the last write, the next step writes
    step(writer, [delta("w", 6)])
    step(writer, [("w", "done", {"completion": {}})])
    assert length(client, "w") == 6  # its end at once
    assert read_history(client, "w").tokens == {0: list(range(7))}


def events(client, job_id: str) -> list[tuple[str, dict]]:
    return [protocol.decode_event(fields) for _, fields in client.xrange(protocol.stream_key(job_id))]


def test_waiting_deltas_join_per_choice_with_their_logprobs(client):
    def scored(index: int, token: int):
        lists = {"tokens": [f"<{token}>"], "token_logprobs": [-token / 10], "top_logprobs": [{f"<{token}>": -token / 10}],
                 "text_offset": [3 * token]}
        return ("w", "delta", {"index": index, "text": f"<{token}>", "token_ids": [token], "logprobs": lists})

    writer = StreamWriter(client)
    writer.DEFER_S = 60.0
    writer.track("w", streamed=False)
    writer.track("s", streamed=True)
    step(writer, [scored(0, 0), scored(1, 0)])  # the first step is written at once
    for token in range(1, 4):
        step(writer, [scored(0, token), scored(1, 10 + token)])
    step(writer, [delta("s", 0)])  # a streamed job's step writes at once
    step(writer, [delta("s", 1)])
    assert length(client, "s") == 2  # never joined
    usage = {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}
    step(writer, [("w", "usage", usage)])  # the job's own next event takes its waiting deltas along
    written = events(client, "w")
    assert [data.get("index") for _, data in written] == [0, 1, 0, 1, None]
    assert written[2][1] == {"index": 0, "text": "<1><2><3>", "token_ids": [1, 2, 3], "logprobs": {
        "tokens": ["<1>", "<2>", "<3>"], "token_logprobs": [-0.1, -0.2, -0.3],
        "top_logprobs": [{"<1>": -0.1}, {"<2>": -0.2}, {"<3>": -0.3}], "text_offset": [3, 6, 9]}}
    assert written[3][1]["token_ids"] == [11, 12, 13] and written[3][1]["logprobs"]["text_offset"] == [33, 36, 39]
    # a choice's end closes its waiting delta: nothing after it joins what came before it
    step(writer, [scored(0, 4)])
    step(writer, [("w", "delta", {"index": 0, "text": "", "token_ids": [], "finish_reason": "length", "stop_reason": None})])
    step(writer, [scored(0, 5)])
    step(writer, [("w", "done", {"completion": {}})])
    assert [data.get("token_ids") for _, data in events(client, "w")[5:]] == [[4], [], [5], None]


def test_another_jobs_write_leaves_a_jobs_waiting_tokens_waiting(client):
    """Jobs start and end a few steps apart: each one's first token and end is a write, which must
    not take every other job's waiting tokens along (each would be written nearly every step)."""
    writer = StreamWriter(client)
    writer.DEFER_S = 60.0
    writer.track("w", streamed=False)
    writer.track("v", streamed=False)
    writer.track("s", streamed=True)
    step(writer, [delta("w", 0)])
    step(writer, [delta("w", 1)])
    assert length(client, "w") == 1
    step(writer, [delta("w", 2), delta("s", 0), delta("v", 0), ("s", "done", {"completion": {}})])
    assert (length(client, "w"), length(client, "s"), length(client, "v")) == (1, 2, 1)
    step(writer, [("w", "done", {"completion": {}})])  # its end takes its waiting tokens along, as one delta
    assert [kind for kind, _ in events(client, "w")] == ["delta", "delta", "done"]
    assert read_history(client, "w").tokens == {0: [0, 1, 2]}


def test_the_cancel_flag_of_a_job_read_at_its_end_is_read_within_check_s_though_no_write_is_due(client):
    writer = StreamWriter(client)
    writer.DEFER_S, writer.CHECK_S = 60.0, 0.2
    writer.track("w", streamed=False)
    assert step(writer, [delta("w", 0)]) == set()  # its first token: written
    client.set(protocol.cancel_key("w"), 1)
    assert step(writer, [delta("w", 1)]) == set()  # read within CHECK_S of the write: not yet
    time.sleep(writer.CHECK_S)
    assert step(writer, [delta("w", 2)]) == {"w"}  # read, though its tokens still wait
    assert length(client, "w") == 1
    assert step(writer, [delta("w", 3)]) == set()  # and not again within CHECK_S


def test_the_cancel_flag_of_a_job_read_at_its_end_is_read_with_the_next_write(client):
    writer = StreamWriter(client)
    writer.DEFER_S = 0.3
    writer.CHECK_S = 60.0  # only the writes read the flags here
    writer.track("w", streamed=False)
    writer.track("s", streamed=True)
    assert step(writer, [delta("w", 0)]) == set()
    client.set(protocol.cancel_key("w"), 1)
    assert step(writer, [delta("w", 1)]) == set()  # no write this step: the flag waits too
    assert step(writer, [delta("s", 0)]) == {"w"}  # a streamed job's write reads every running job's flag
    client.set(protocol.cancel_key("s"), 1)
    time.sleep(writer.DEFER_S)
    assert step(writer, [delta("w", 2)]) == {"w", "s"}
    writer.untrack("s")
    writer.untrack("w")
    time.sleep(writer.DEFER_S)
    assert step(writer, []) == set()  # untracked: no flag read for them


def test_a_new_attempts_deltas_never_join_an_earlier_attempts(client):
    writer = StreamWriter(client)
    writer.DEFER_S = 60.0
    writer.track("w", open_attempt(client, "w").attempt_ms, streamed=False)
    step(writer, [delta("w", 0)])
    step(writer, [delta("w", 1)])  # waiting
    # the job taken up again (its retry) before that was written
    writer.track("w", open_attempt(client, "w").attempt_ms, streamed=False)
    step(writer, [delta("w", 7)])  # the new attempt's first token: written at once; the waiting one is the old attempt's
    assert [data["token_ids"] for _, data in events(client, "w")] == [[0], [7]]


def test_once_a_newer_attempt_opens_an_older_ones_writes_are_refused(client):
    """Two workers think they run the job (one was wrongly thought dead): what the older attempt
    writes after the newer one opened never lands, whether it had written before or not."""
    for job_id, written_before in (("a", 1), ("b", 0)):
        older, newer = StreamWriter(client), StreamWriter(client)
        older.track(job_id, open_attempt(client, job_id).attempt_ms)
        for token in range(written_before):
            step(older, [delta(job_id, token)])
        history = open_attempt(client, job_id)
        assert history.tokens == ({0: [0]} if written_before else {})
        newer.track(job_id, history.attempt_ms)
        step(older, [delta(job_id, 50), (job_id, "done", {"completion": {}})])
        step(newer, [delta(job_id, written_before)])
        assert [data["token_ids"] for _, data in events(client, job_id)] == [[t] for t in range(written_before + 1)]


def test_a_streams_ttl_is_set_by_its_first_write_and_its_end_and_refreshed_every_ttl_refresh_s(client):
    writer = StreamWriter(client)
    writer.TTL_REFRESH_S = 0.5
    writer.track("s", streamed=True)
    key = protocol.stream_key("s")
    step(writer, [delta("s", 0)])
    assert protocol.STREAM_TTL - 2 <= client.ttl(key) <= protocol.STREAM_TTL
    client.expire(key, 100)
    step(writer, [delta("s", 1)])
    assert client.ttl(key) <= 100  # within TTL_REFRESH_S of the last EXPIRE: the XADD alone
    time.sleep(writer.TTL_REFRESH_S)
    step(writer, [delta("s", 2)])
    assert protocol.STREAM_TTL - 2 <= client.ttl(key) <= protocol.STREAM_TTL
    client.expire(key, 100)
    step(writer, [delta("s", 3), ("s", "done", {"completion": {}})])
    assert protocol.STREAM_TTL - 2 <= client.ttl(key) <= protocol.STREAM_TTL  # from its end
    assert [kind for kind, _ in events(client, "s")] == ["delta"] * 4 + ["done"]


def test_a_jobs_first_attempt_wakes_no_reader_and_its_next_one_fences_the_first_out(client, redis_url):
    """A job's first attempt has no earlier one to fence out: it leaves the stream to its first
    write, so a reader blocked on the stream (the web tier's hub) waits on for that write instead of
    waking for nothing. A second attempt fences the first out, though the first wrote nothing."""
    client.hset(Job.key_for("j"), mapping={"status": "started"})  # the job's rq hash, which keeps its attempts' ms
    reader = redis.Redis.from_url(redis_url, socket_timeout=None)
    woken = []

    def read() -> None:
        reply = reader.xread({protocol.stream_key("j"): "0-0"}, block=10_000)
        woken.append((time.monotonic(), reply))

    blocked = threading.Thread(target=read)
    blocked.start()
    wait_until(lambda: client.info("clients")["blocked_clients"] == 1)
    first = open_attempt(client, "j")
    assert first.attempt_ms is not None and not client.exists(protocol.stream_key("j"))
    opened = time.monotonic()
    older = StreamWriter(client)
    older.track("j", first.attempt_ms)
    time.sleep(0.2)
    step(older, [delta("j", 0)])
    blocked.join()
    (at, reply), = woken
    assert at - opened >= 0.2 and [fields[b"type"] for _, fields in reply[0][1]] == [b"delta"]  # the write woke it
    assert 0 < client.ttl(protocol.stream_key("j")) <= protocol.STREAM_TTL
    fresh = "k"  # a first attempt that wrote nothing, then a second one
    client.hset(Job.key_for(fresh), mapping={"status": "started"})
    quiet = StreamWriter(client)
    quiet.track(fresh, open_attempt(client, fresh).attempt_ms)
    newer = StreamWriter(client)
    newer.track(fresh, open_attempt(client, fresh).attempt_ms)
    step(quiet, [delta(fresh, 50), (fresh, "done", {"completion": {}})])
    step(newer, [delta(fresh, 0)])
    assert [data["token_ids"] for _, data in events(client, fresh)] == [[0]]
    reader.close()


def test_an_attempts_fence_is_no_entry_and_a_finished_job_gets_none(client):
    history = open_attempt(client, "f")
    assert history.attempt_ms is not None and history.terminal is None and not history.cancelled
    assert length(client, "f") == 0 and client.xread({protocol.stream_key("f"): "0-0"}) == []
    assert 0 < client.ttl(protocol.stream_key("f")) <= protocol.STREAM_TTL
    writer = StreamWriter(client)
    writer.track("f", history.attempt_ms)
    step(writer, [delta("f", 3), ("f", "done", {"completion": {"id": "f"}})])
    last = client.xinfo_stream(protocol.stream_key("f"))["last-generated-id"]
    ended = open_attempt(client, "f")
    assert ended.terminal == ("done", {"completion": {"id": "f"}}) and ended.attempt_ms is None
    assert client.xinfo_stream(protocol.stream_key("f"))["last-generated-id"] == last  # no fence after the end
    client.set(protocol.cancel_key("c"), 1)
    assert open_attempt(client, "c").cancelled


def test_events_kept_through_an_outage_land_without_another_step(tmp_path):
    """Redis goes away while a step is written: the writer keeps the events and its thread writes
    them once Redis is back, though the engine (idle now) never calls it again."""
    server = start_redis(persist_dir=str(tmp_path))
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    writer = StreamWriter(client)
    writer.RETRY_S = 0.1
    writer.track("o", open_attempt(client, "o").attempt_ms)
    step(writer, [delta("o", 0)])
    server.stop()
    try:
        assert writer([delta("o", 1), ("o", "done", {"completion": {}})]) == set()
        assert not writer.wait_written(timeout=0.5)
        server = start_redis(port=server.port, persist_dir=str(tmp_path))
        assert writer.wait_written(timeout=20)
        assert [kind for kind, _ in events(client, "o")] == ["delta", "delta", "done"]
    finally:
        server.stop()


def test_an_outage_past_max_pending_loses_the_oldest_events_and_later_deltas_join_no_stale_place(tmp_path):
    """Redis away with more events kept than `max_pending`: the oldest job's oldest events go, and a
    waiting delta cut so is never joined again (the job's next token is its own delta)."""
    server = start_redis(persist_dir=str(tmp_path))
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    writer = StreamWriter(client, max_pending=1)
    writer.DEFER_S, writer.RETRY_S = 60.0, 0.1
    writer.track("w", open_attempt(client, "w").attempt_ms, streamed=False)
    writer.track("s", open_attempt(client, "s").attempt_ms, streamed=True)
    step(writer, [delta("w", 0)])  # its first token: written
    step(writer, [delta("w", 1)])  # waiting
    server.stop()
    try:
        writer([delta("s", 0)])  # fails: s's and w's events kept, one over max_pending
        wait_until(lambda: writer.failing)  # the failed write cut the events kept to max_pending
        # back before the next token: a retry failing after it would cut again, the token itself
        server = start_redis(port=server.port, persist_dir=str(tmp_path))
        writer([delta("w", 2)])
        assert writer.wait_written(timeout=20)
        step(writer, [("w", "done", {"completion": {}})])
        assert [data.get("token_ids") for _, data in events(client, "w")] == [[0], [2], None]
        assert [data["token_ids"] for _, data in events(client, "s")] == [[0]]
    finally:
        server.stop()


def test_the_engines_call_never_waits_for_redis_and_what_comes_during_a_write_goes_with_the_next(tmp_path):
    """Redis frozen (SIGSTOP) while a step is written: the engine's calls return all the same, and
    the steps it hands over meanwhile are written, in order, in one transaction once Redis answers."""
    import os
    import signal
    import threading

    server = start_redis(persist_dir=str(tmp_path))
    client = redis.Redis.from_url(server.url)  # no socket timeout: a call that waited would wait for good
    writer = StreamWriter(client)
    writer.track("s", open_attempt(client, "s").attempt_ms, streamed=True)
    step(writer, [delta("s", 0)])
    execs = client.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        calls = threading.Thread(target=lambda: [writer([delta("s", token)]) for token in range(1, 6)], daemon=True)
        calls.start()
        calls.join(timeout=10)
        assert not calls.is_alive()  # five steps handed over while Redis answers nothing
        assert not writer.wait_written(timeout=0.2)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    try:
        assert writer.wait_written(timeout=10)
        assert [data["token_ids"] for _, data in events(client, "s")] == [[t] for t in range(6)]
        # what a write under way held, then every step that came meanwhile: not a write a step
        assert 1 <= client.info("commandstats")["cmdstat_exec"]["calls"] - execs <= 2
    finally:
        server.stop()


def test_a_write_that_fails_for_another_reason_than_redis_loses_its_events_and_the_writer_goes_on(client, caplog):
    """An event Redis never sees (it cannot be encoded): that write's events are lost and said so,
    as a failed write of the engine's own thread lost them, and the writer writes what follows."""
    writer = StreamWriter(client)
    writer.track("x", streamed=True)
    writer.track("y", streamed=True)
    writer([("x", "delta", {"index": 0, "text": "", "token_ids": {1, 2}})])  # a set: no JSON for it
    assert writer.wait_written(timeout=10) and writer.wait_written(timeout=10, job_ids=["x"])
    assert "events are lost" in caplog.text
    step(writer, [delta("y", 0), ("y", "done", {"completion": {}})])
    assert [kind for kind, _ in events(client, "y")] == ["delta", "done"] and length(client, "x") == 0
