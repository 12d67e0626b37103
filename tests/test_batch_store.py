"""Files, batch input checks and the batch store against a real redis-server."""
from __future__ import annotations

import json
import time

import pytest

from web.batch.files import FileStore, content_key, record_key
from web.batch.input import MAX_ERRORS, read_input
from web.batch.store import ACTIVE, BatchStore, Inflight, batch_key

MODELS = {"tiny": "tiny", "tiny-alias": "tiny", "other": "other"}


@pytest.fixture()
def r(batch_redis):
    return batch_redis


@pytest.fixture()
def files(r):
    return FileStore(r)


@pytest.fixture()
def store(r, files):
    return BatchStore(r, files)


def jsonl(*rows) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def request(custom_id, model="tiny", **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "hi", **body}}


# ---- files ----

def test_file_round_trip(files, r):
    stored = files.create("key:a", "in.jsonl", "batch", b"line\n" * 3)
    obj = stored.to_object()
    assert obj["object"] == "file" and obj["bytes"] == 15 and obj["filename"] == "in.jsonl"
    assert obj["purpose"] == "batch" and obj["status"] == "processed" and obj["id"].startswith("file-")
    # batch files expire after 30 days by default, as on OpenAI; Redis forgets both keys then
    assert obj["expires_at"] == obj["created_at"] + 30 * 86400
    assert 0 < r.ttl(record_key(stored.id)) <= 30 * 86400 and 0 < r.ttl(content_key(stored.id)) <= 30 * 86400
    assert files.get(stored.id) == stored and files.get(stored.id).owner == "key:a"
    assert files.read(stored.id) == b"line\n" * 3
    assert files.delete(stored) is True
    assert files.get(stored.id) is None and files.read(stored.id) is None
    assert files.list("key:a") == ([], False)


def test_chunks_cover_the_content(files, monkeypatch):
    import web.batch.files as module

    monkeypatch.setattr(module, "_READ_CHUNK", 7)
    content = bytes(range(256)) * 3
    stored = files.create("key:a", "x.bin", "batch", content)
    pieces = list(files.chunks(stored.id, stored.bytes))
    assert b"".join(pieces) == content and max(map(len, pieces)) == 7


def test_expires_after(files):
    stored = files.create("key:a", "in.jsonl", "batch", b"x", expires_after_s=3600)
    assert stored.expires_at == stored.created_at + 3600


def test_listing_order_pages_and_purpose(files, r):
    ids = [files.create("key:a", f"{i}.jsonl", "batch", b"x").id for i in range(5)]
    files.create("key:b", "other.jsonl", "batch", b"x")
    newest, more = files.list("key:a", limit=2)
    assert [f.id for f in newest] == ids[:-3:-1] and more
    page2, more = files.list("key:a", after=newest[-1].id, limit=2)
    assert [f.id for f in page2] == [ids[2], ids[1]] and more
    page3, more = files.list("key:a", after=page2[-1].id, limit=2)
    assert [f.id for f in page3] == [ids[0]] and not more
    oldest, _ = files.list("key:a", order="asc", limit=3)
    assert [f.id for f in oldest] == ids[:3]
    # another owner's id as a cursor reveals nothing
    assert files.list("key:b", after=ids[0]) == ([], False)
    assert files.list("key:a", purpose="batch_output") == ([], False)
    # a file Redis dropped (expired) leaves the listing too
    r.delete(record_key(ids[4]))
    remaining, _ = files.list("key:a")
    assert [f.id for f in remaining] == ids[3::-1]


# ---- input ----

def check(content, max_lines=100):
    return read_input(content, "/v1/completions", MODELS.get, max_lines)


def test_valid_input_keeps_each_request():
    checked = check(jsonl(request("a"), request("b", model="tiny-alias", max_tokens=2)).replace(b"\n", b"\r\n"))
    assert checked.errors == [] and checked.model == "tiny"
    assert [json.loads(line) for line in checked.lines] == [
        {"custom_id": "a", "body": {"model": "tiny", "prompt": "hi"}},
        {"custom_id": "b", "body": {"model": "tiny-alias", "prompt": "hi", "max_tokens": 2}}]


@pytest.mark.parametrize("content, code, line, param", [
    (b"", "empty_file", None, None),
    (b"\n", "empty_file", None, None),
    (jsonl(request("a")) + b"{not json\n", "invalid_json_line", 2, None),
    (jsonl(request("a")) + b"\n" + jsonl(request("b")), "invalid_json_line", 2, None),
    (jsonl([1, 2]), "invalid_json_line", 1, None),
    (b"\xff\xfe{}\n", "invalid_json_line", 1, None),
    (jsonl({"method": "POST", "url": "/v1/completions", "body": {}}), "missing_required_parameter", 1, "custom_id"),
    (jsonl({**request("a"), "custom_id": 7}), "invalid_value", 1, "custom_id"),
    (jsonl(request("a"), request("b"), request("a")), "duplicate_custom_id", 3, "custom_id"),
    (jsonl({**request("a"), "method": "GET"}), "invalid_method", 1, "method"),
    (jsonl({**request("a"), "url": "/v1/chat/completions"}), "url_mismatch", 1, "url"),
    (jsonl({**request("a"), "body": "prompt"}), "invalid_value", 1, "body"),
    (jsonl({**request("a"), "body": {"prompt": "x"}}), "missing_required_parameter", 1, "body.model"),
    (jsonl(request("a", model="gpt-4")), "model_not_found", 1, "body.model"),
    (jsonl(request("a"), request("b", model="other")), "model_mismatch", 2, "body.model"),
])
def test_unusable_input_fails_with_the_line(content, code, line, param):
    checked = check(content)
    assert checked.lines == []
    first = checked.errors[0]
    assert (first.code, first.line, first.param) == (code, line, param), first
    assert first.message


def test_too_many_lines():
    checked = check(jsonl(*(request(str(i)) for i in range(4))), max_lines=3)
    assert [e.code for e in checked.errors] == ["too_many_tasks"] and "at most 3" in checked.errors[0].message


def test_errors_are_listed_per_line_up_to_a_cap():
    checked = check(b"nope\n" * (MAX_ERRORS + 20), max_lines=1000)
    assert len(checked.errors) == MAX_ERRORS
    assert [e.line for e in checked.errors[:3]] == [1, 2, 3]


# ---- batches ----

def new_batch(store, owner="key:a", window_s=3600):
    return store.create(owner=owner, caller={"key_name": "a"}, input_file_id="file-x", endpoint="/v1/completions",
                        completion_window="24h", window_s=window_s, metadata={"run": "1"}, output_expires_after=None)


def started(store, n=3, **kwargs):
    batch = new_batch(store, **kwargs)
    lines = [json.dumps({"custom_id": f"c{i}", "body": {"model": "tiny", "prompt": str(i)}}) for i in range(n)]
    assert store.start(batch.id, lines, "tiny")
    return store.get(batch.id)


def test_batch_object(store):
    batch = new_batch(store)
    obj = store.get(batch.id).to_object()
    assert obj["object"] == "batch" and obj["id"].startswith("batch_") and obj["status"] == "validating"
    assert obj["expires_at"] == obj["created_at"] + 3600 and obj["metadata"] == {"run": "1"}
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert obj["errors"] is None and obj["output_file_id"] is None and obj["in_progress_at"] is None
    assert batch.id in store.active()


def test_start_and_fail(store):
    batch = started(store, 3)
    assert batch.status == "in_progress" and batch.total == 3 and batch.model == "tiny"
    assert batch.times["in_progress_at"] is not None
    assert store.line(batch.id, 1) == {"custom_id": "c1", "body": {"model": "tiny", "prompt": "1"}}
    assert not store.fail(batch.id, [])  # only a validating batch can fail validation

    other = new_batch(store)
    from web.batch.input import BatchError
    assert store.fail(other.id, [BatchError("empty_file", "empty")])
    failed = store.get(other.id)
    assert failed.status == "failed" and failed.times["failed_at"] is not None
    assert failed.to_object()["errors"] == {"object": "list", "data": [
        {"code": "empty_file", "message": "empty", "param": None, "line": None}]}
    assert other.id not in store.active()


def test_claim_moves_the_cursor_once_and_bounds_the_lines_in_flight(store):
    batch = started(store, 3)
    line = lambda i: Inflight(i, f"job{i}", 5, None, False)  # noqa: E731
    assert store.claim(batch.id, line(0), max_inflight=2)
    assert not store.claim(batch.id, line(0), max_inflight=2)  # the cursor moved on
    assert not store.claim(batch.id, line(2), max_inflight=2)  # not at the cursor
    assert store.claim(batch.id, line(1), max_inflight=2)
    assert not store.claim(batch.id, line(2), max_inflight=2)  # two in flight already
    assert [i.job_id for i in store.inflight(batch.id)] == ["job0", "job1"]
    store.mark_queued(batch.id, line(1))
    assert [i.queued for i in store.inflight(batch.id)] == [False, True]
    assert store.record(batch.id, 0, {"custom_id": "c0"}, ok=True, input_tokens=2, output_tokens=3)
    assert store.claim(batch.id, line(2), max_inflight=2)
    assert not store.claim(batch.id, Inflight(3, "x", 0, None, False), max_inflight=9)  # past the end
    assert store.get(batch.id).next == 3


def test_record_writes_each_line_once(store, r):
    batch = started(store, 2)
    assert store.claim(batch.id, Inflight(0, "j0", 5, None, True), 9)
    assert store.record(batch.id, 0, {"custom_id": "c0", "n": 1}, ok=True, input_tokens=2, output_tokens=3,
                        cached_tokens=1)
    assert not store.record(batch.id, 0, {"custom_id": "c0", "n": 2}, ok=True, input_tokens=2, output_tokens=3,
                            cached_tokens=1)
    assert not store.record(batch.id, 0, {"custom_id": "c0", "n": 3}, ok=False)
    assert store.record(batch.id, 1, {"custom_id": "c1"}, ok=False)
    got = store.get(batch.id)
    assert (got.completed, got.failed, got.input_tokens, got.output_tokens) == (1, 1, 2, 3)
    assert got.to_object()["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    assert r.get(batch_key(batch.id, "output")) == b'{"custom_id":"c0","n":1}\n'
    assert r.get(batch_key(batch.id, "errors")) == b'{"custom_id":"c1"}\n'
    assert store.inflight(batch.id) == []


def test_finish_makes_the_files_and_keeps_only_the_record(store, files, r):
    batch = started(store, 2, owner="key:b")
    store.record(batch.id, 0, {"custom_id": "c0"}, ok=True)
    store.record(batch.id, 1, {"custom_id": "c1"}, ok=True)
    assert store.mark_finalizing(batch.id)
    done = store.finish(batch.id)
    assert done.status == "completed" and done.times["finalizing_at"] and done.times["completed_at"]
    assert done.error_file_id is None  # no errors, no error file
    output = files.get(done.output_file_id)
    assert output.purpose == "batch_output" and output.owner == "key:b"
    assert output.filename == f"{batch.id}_output.jsonl" and output.bytes == 2 * len('{"custom_id":"c0"}\n')
    assert files.read(output.id).splitlines() == [b'{"custom_id":"c0"}', b'{"custom_id":"c1"}']
    assert [f.id for f in files.list("key:b")[0]] == [output.id]
    assert store.finish(batch.id) is None  # once
    assert not store.record(batch.id, 1, {"custom_id": "late"}, ok=True)  # nothing after the end
    assert batch.id not in store.active()
    assert not any(r.exists(batch_key(batch.id, p)) for p in ("lines", "inflight", "done", "output", "errors"))
    assert 0 < r.ttl(batch_key(batch.id)) <= store.record_ttl_s


def test_cancel_and_expiry_transitions(store):
    batch = started(store, 2)
    assert store.request_cancel(batch.id)
    cancelling = store.get(batch.id)
    assert cancelling.status == "cancelling" and cancelling.times["cancelling_at"] and cancelling.stopping
    assert not store.request_cancel(batch.id)
    store.record(batch.id, 0, {"custom_id": "c0"}, ok=True)
    store.record(batch.id, 1, {"custom_id": "c1", "error": "batch_cancelled"}, ok=False)
    cancelled = store.finish(batch.id)
    assert cancelled.status == "cancelled" and cancelled.times["cancelled_at"]
    assert cancelled.output_file_id and cancelled.error_file_id
    assert (cancelled.completed, cancelled.failed, cancelled.total) == (1, 1, 2)

    expiring = started(store, 1)
    assert store.begin_expiry(expiring.id)
    assert store.get(expiring.id).stopping and store.get(expiring.id).status == "in_progress"
    assert not store.request_cancel(expiring.id)  # too late to cancel: it is expiring
    assert not store.claim(expiring.id, Inflight(0, "j", 0, None, False), 9)
    expired = store.finish(expiring.id)
    assert expired.status == "expired" and expired.times["expired_at"] and expired.output_file_id is None


def test_listing(store):
    ids = [new_batch(store).id for _ in range(3)]
    new_batch(store, owner="key:b")
    page, more = store.list("key:a", limit=2)
    assert [b.id for b in page] == ids[:0:-1] and more
    page, more = store.list("key:a", after=page[-1].id, limit=2)
    assert [b.id for b in page] == [ids[0]] and not more
    everyone, _ = store.list(None)
    assert len(everyone) == 4
    assert store.list("key:b", after=ids[0]) == ([], False)


def test_leases(store, r):
    batch = new_batch(store)
    assert store.take_lease(batch.id, "one", 0.3)
    assert not store.take_lease(batch.id, "two", 0.3)
    assert store.take_lease(batch.id, "one", 0.3)  # renewed
    store.release_lease(batch.id, "two")  # not its lease: nothing happens
    assert not store.take_lease(batch.id, "two", 0.3)
    time.sleep(0.4)
    assert store.take_lease(batch.id, "two", 0.3)  # lapsed: anyone may take it
    store.release_lease(batch.id, "two")
    assert store.take_lease(batch.id, "one", 0.3)
    assert r.sismember(ACTIVE, batch.id)
