"""The batch dispatcher's state machine against a real redis-server.

The executor here stands in for the request path and the queue: its "worker" (`work`) takes jobs
off a Redis list and ends each with the terminal event a real worker writes to the job's stream
(worker/protocol.py), honouring cancel flags. The end-to-end tests (tests/test_e2e_batch.py) run the
real stack."""
from __future__ import annotations

import json

import pytest
import redis

from web.batch.dispatcher import Dispatcher, Outcome, Prepared
from web.batch.files import FileStore
from web.batch.store import BatchStore
from worker import protocol
from worker.protocol import APIError, bad_request

QUEUE = "test:batch-queue"


class Executor:
    def __init__(self, r: redis.Redis):
        self.r = r
        self.limited = 0  # the next this-many admissions are refused with 429
        self.settled: list[tuple[int, int, int]] = []  # (line, reserved, used)

    def resolve_model(self, name):
        return {"tiny": "tiny"}.get(name)

    def prepare(self, batch, body, job_id):
        if not isinstance(body.get("prompt"), str):
            raise bad_request("prompt must be a string here", "prompt")
        return Prepared(job_id, {"id": job_id, "prompt": body["prompt"]}, reserved=10, user=body.get("user"))

    def admit(self, batch, prepared):
        if prepared.user == "blocked":
            raise APIError(403, "This user is blocked from using this service.", "permission_error", code="blocked")
        if prepared.user == "huge":  # more tokens than the caller's whole limit: it can never run
            raise APIError(429, "Request too large", "tokens", code="rate_limit_exceeded",
                           headers={"x-should-retry": "false"})
        if self.limited:
            self.limited -= 1
            raise APIError(429, "Rate limit reached", "requests", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    def settle(self, batch, inflight, used):
        self.settled.append((inflight.index, inflight.reserved, used))

    def enqueue(self, batch, prepared):
        self.r.rpush(QUEUE, json.dumps(prepared.job))
        self.r.set(f"test:job:{prepared.job_id}", 1)

    def exists(self, job_id):
        return bool(self.r.exists(f"test:job:{job_id}"))

    def outcomes(self, job_ids):
        ended = {}
        for job_id in job_ids:
            entries = self.r.xrevrange(protocol.stream_key(job_id), count=1)
            if not entries:
                if not self.exists(job_id):
                    ended[job_id] = Outcome("lost")
                continue
            kind, data = protocol.decode_event(entries[0][1])
            if kind == "done":
                ended[job_id] = Outcome("done", completion=data["completion"])
            elif kind == "error":
                err = APIError.from_body(data)
                ended[job_id] = Outcome("error", error=err.body(), status=err.status)
            elif kind == "cancelled":
                ended[job_id] = Outcome("cancelled")
        return ended

    def cancel(self, job_ids):
        for job_id in job_ids:
            self.r.set(protocol.cancel_key(job_id), 1)

    def work(self, n=1000) -> int:
        """Run up to `n` queued jobs as a worker would: one terminal event each."""
        ran = 0
        while ran < n and (raw := self.r.lpop(QUEUE)) is not None:
            job = json.loads(raw)
            key = protocol.stream_key(job["id"])
            if self.r.exists(protocol.cancel_key(job["id"])):
                self.r.xadd(key, protocol.encode_event("cancelled", {}))
            elif job["prompt"] == "fail":
                self.r.xadd(key, protocol.encode_event("error", protocol.error_body("engine refused", param="prompt")))
            else:
                usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
                completion = {"id": job["id"], "object": "text_completion", "model": "tiny",
                              "choices": [{"index": 0, "text": job["prompt"].upper(), "finish_reason": "length",
                                           "logprobs": None}], "usage": usage}
                self.r.xadd(key, protocol.encode_event("done", {"completion": completion}))
            ran += 1
        return ran


@pytest.fixture()
def r(batch_redis):
    return batch_redis


@pytest.fixture()
def store(r):
    return BatchStore(r, FileStore(r))


@pytest.fixture()
def executor(r):
    return Executor(r)


def dispatcher(store, executor, **kwargs):
    return Dispatcher(store, executor, **{"max_inflight": 4, "lease_s": 5.0, **kwargs})


def submit(store, lines, window_s=3600, owner="key:a"):
    content = b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "tiny", **body}}).encode() + b"\n" for cid, body in lines)
    stored = store.files.create(owner, "in.jsonl", "batch", content)
    return store.create(owner=owner, caller={}, input_file_id=stored.id, endpoint="/v1/completions",
                        completion_window="24h", window_s=window_s, metadata=None, output_expires_after=None)


def results(store, file_id):
    if file_id is None:
        return {}
    return {row["custom_id"]: row for row in map(json.loads, store.files.read(file_id).splitlines())}


def run(d, executor, store, batch_id, steps=100):
    for _ in range(steps):
        d.tick()
        executor.work()
        batch = store.get(batch_id)
        if batch.finished:
            return batch
    raise AssertionError(f"batch not finished: {store.get(batch_id)}")


def test_every_line_runs_once_bounded_in_flight(store, executor):
    batch = submit(store, [(f"c{i}", {"prompt": f"p{i}"}) for i in range(10)])
    d = dispatcher(store, executor)
    d.tick()
    assert store.get(batch.id).status == "in_progress"
    peak = 0
    for _ in range(50):
        d.tick()
        peak = max(peak, len(store.inflight(batch.id)))
        executor.work(n=3)
        if store.get(batch.id).finished:
            break
    done = store.get(batch.id)
    assert done.status == "completed" and peak == 4
    assert (done.total, done.completed, done.failed) == (10, 10, 0)
    assert (done.input_tokens, done.output_tokens) == (10, 20)
    out = results(store, done.output_file_id)
    assert sorted(out) == sorted(f"c{i}" for i in range(10)) and done.error_file_id is None
    row = out["c3"]
    assert row["error"] is None and row["id"].startswith("batch_req_")
    assert row["response"]["status_code"] == 200 and row["response"]["body"]["choices"][0]["text"] == "P3"
    assert row["response"]["request_id"] == row["response"]["body"]["id"]
    assert sorted(executor.settled) == [(i, 10, 3) for i in range(10)]


def test_bad_lines_go_to_the_error_file(store, executor):
    batch = submit(store, [("ok", {"prompt": "x"}), ("bad", {"prompt": 5}), ("refused", {"prompt": "fail"}),
                           ("blocked", {"prompt": "x", "user": "blocked"}), ("huge", {"prompt": "x", "user": "huge"})])
    done = run(dispatcher(store, executor), executor, store, batch.id)
    assert done.status == "completed" and (done.completed, done.failed) == (1, 4)
    errors = results(store, done.error_file_id)
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"] == "prompt"
    assert errors["refused"]["response"] == {"status_code": 400, "request_id": errors["refused"]["response"]["request_id"],
                                             "body": protocol.error_body("engine refused", param="prompt")}
    assert errors["blocked"]["response"]["status_code"] == 403
    assert errors["huge"]["response"]["status_code"] == 429  # too large for the limits: not waited for
    assert list(results(store, done.output_file_id)) == ["ok"]


def test_rate_limited_lines_wait(store, executor, monkeypatch):
    import web.batch.dispatcher as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])
    executor.limited = 1
    batch = submit(store, [("a", {"prompt": "x"})])
    d = dispatcher(store, executor)
    d.tick()  # validates
    d.tick()  # refused: waits a second
    assert store.get(batch.id).next == 0 and store.inflight(batch.id) == []
    d.tick()
    assert store.get(batch.id).next == 0  # still waiting
    now[0] += 1.5
    d.tick()
    assert store.get(batch.id).next == 1
    assert run(d, executor, store, batch.id).completed == 1


def test_validation_failure(store, executor):
    batch = submit(store, [("a", {"prompt": "x"}), ("a", {"prompt": "y"})])
    dispatcher(store, executor).tick()
    failed = store.get(batch.id)
    assert failed.status == "failed" and failed.errors[0]["code"] == "duplicate_custom_id"
    assert failed.errors[0]["line"] == 2 and executor.r.llen(QUEUE) == 0


def test_cancel_stops_the_rest(store, executor):
    batch = submit(store, [(f"c{i}", {"prompt": "x"}) for i in range(10)])
    d = dispatcher(store, executor)
    d.tick()
    d.tick()
    executor.work(n=2)  # two done, two queued
    assert store.request_cancel(batch.id)
    d.tick()  # collects the two, asks the two queued to stop
    executor.work()  # they end cancelled
    d.tick()
    done = store.get(batch.id)
    assert done.status == "cancelled" and done.times["cancelled_at"]
    assert (done.total, done.completed, done.failed) == (10, 2, 8)
    errors = results(store, done.error_file_id)
    assert len(errors) == 8 and {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert all(e["response"] is None for e in errors.values())
    assert len(results(store, done.output_file_id)) == 2


def test_expiry(store, executor, monkeypatch):
    batch = submit(store, [(f"c{i}", {"prompt": "x"}) for i in range(6)], window_s=60)
    d = dispatcher(store, executor)
    d.tick()
    d.tick()
    executor.work(n=1)
    import web.batch.dispatcher as module

    later = module.time.time() + 61
    monkeypatch.setattr(module.time, "time", lambda: later)
    d.tick()  # expiry: the three queued are asked to stop
    executor.work()
    d.tick()
    done = store.get(batch.id)
    assert done.status == "expired" and done.times["expired_at"]
    assert (done.completed, done.failed) == (1, 5)
    assert {e["error"]["code"] for e in results(store, done.error_file_id).values()} == {"batch_expired"}


def test_a_dispatcher_that_died_is_taken_over(store, executor, r):
    """One process claims lines and dies: before enqueueing one of them, and after its jobs ended
    but before it recorded them. Another takes over once the lease lapses: every line once."""
    batch = submit(store, [(f"c{i}", {"prompt": f"p{i}"}) for i in range(6)])
    first = dispatcher(store, executor, lease_s=0.2)
    first.tick()
    first.tick()  # four lines claimed and queued
    inflight = store.inflight(batch.id)
    assert len(inflight) == 4
    # its last enqueue never happened: the job is not on the queue and not marked queued
    r.lpop(QUEUE)
    lost = inflight[0]
    r.delete(f"test:job:{lost.job_id}")
    r.hset(f"nanoserve:batch:{batch.id}:inflight", lost.index, json.dumps(
        {"job": lost.job_id, "reserved": 10, "user": None, "queued": False}))
    executor.work()  # three jobs end; nobody records them yet

    second = dispatcher(store, executor, lease_s=0.2)
    second.tick()
    assert store.get(batch.id).completed == 0  # the first one's lease still holds
    import time

    time.sleep(0.25)
    done = run(second, executor, store, batch.id)
    assert done.status == "completed" and (done.completed, done.failed) == (6, 0)
    out = results(store, done.output_file_id)
    assert sorted(out) == [f"c{i}" for i in range(6)]
    assert len(store.files.read(done.output_file_id).splitlines()) == 6
    # the first one comes back and reads the same results: nothing is written twice
    assert first.store.record(batch.id, 1, {"custom_id": "again"}, ok=True) is False


def test_lost_jobs_run_again(store, executor, r):
    batch = submit(store, [("a", {"prompt": "x"})])
    d = dispatcher(store, executor)
    d.tick()
    d.tick()
    [i] = store.inflight(batch.id)
    r.delete(QUEUE, f"test:job:{i.job_id}")  # Redis lost the job and its queue entry
    d.tick()  # seen as lost: enqueued again under the same id
    assert [json.loads(x)["id"] for x in r.lrange(QUEUE, 0, -1)] == [i.job_id]
    assert run(d, executor, store, batch.id).completed == 1
