"""The Files and Batch APIs through Flask's test client against a real redis-server: uploads and
their limits, the batch object, validation, ownership between two keys, the line path (checks, the
blocklist, rate limits, the batch queue), cancel, and the admin CLI. The dispatcher is stepped by hand
here (no worker runs); tests/test_e2e_batch.py runs batches on the real stack with the openai client."""
from __future__ import annotations

import io
import json
import time

import pytest
import redis
from rq.job import Job, JobStatus

from tests import rq_json
from tests.conftest import write_gpt2_tokenizer
from web.access import blocklist, keys
from web.api import batches
from web.api.batch_lines import BatchLines
from web.app import create_app
from web.batch.dispatcher import Dispatcher
from worker import protocol

CONTEXT = 64


@pytest.fixture(scope="module")
def models_file(tmp_path_factory):
    directory = write_gpt2_tokenizer(tmp_path_factory.mktemp("tiny-web"))
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_positions": CONTEXT, "vocab_size": 50257, "eos_token_id": 50256}))
    path = tmp_path_factory.mktemp("registry") / "models.toml"
    path.write_text(f'[models.tiny]\ncheckpoint = "{directory}"\naliases = ["tiny-alias"]\n\n'
                    f'[models.other]\ncheckpoint = "{directory}"\n')
    return path


@pytest.fixture()
def app(batch_redis_url, models_file):
    return create_app({"redis_url": batch_redis_url, "models_path": str(models_file), "auth_required": True,
                       "batch_dispatch": False, "max_file_bytes": 4096, "batch_max_inflight": 2})


@pytest.fixture()
def r(batch_redis_url):
    client = redis.Redis.from_url(batch_redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def alice(app, r):
    return Client(app, keys.create(r, "alice")[0])


@pytest.fixture()
def bob(app, r):
    return Client(app, keys.create(r, "bob")[0])


class Client:
    def __init__(self, app, key):
        self.app, self.http = app, app.test_client()
        self.headers = {"Authorization": f"Bearer {key}"}

    def upload(self, content: bytes, purpose="batch", filename="in.jsonl", **fields):
        data = {"purpose": purpose, "file": (io.BytesIO(content), filename), **fields}
        return self.http.post("/v1/files", data=data, headers=self.headers, content_type="multipart/form-data")

    def get(self, path, **kwargs):
        return self.http.get(path, headers=self.headers, **kwargs)

    def post(self, path, body=None):
        return self.http.post(path, json=body, headers=self.headers)

    def delete(self, path):
        return self.http.delete(path, headers=self.headers)

    def batch(self, content: bytes, **fields):
        upload = self.upload(content)
        assert upload.status_code == 200, upload.json
        response = self.post("/v1/batches", {"input_file_id": upload.json["id"], "endpoint": "/v1/completions",
                                             "completion_window": "24h", **fields})
        assert response.status_code == 200, response.json
        return response.json


def jsonl(*bodies, url="/v1/completions") -> bytes:
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": url, "body": {"model": "tiny", **body}}
            for i, body in enumerate(bodies)]
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def error(response, status, param=None):
    assert response.status_code == status, (response.status_code, response.json)
    body = response.json["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["param"] == param, body
    return body


def step(app, times=1):
    """Step the dispatcher as a web process's thread would (one dispatcher per app: the leases are its)."""
    with app.app_context():
        dispatcher = app.extensions.setdefault("test.dispatcher", Dispatcher(
            batches.batch_store(), BatchLines(), max_inflight=2, lease_s=5))
        for _ in range(times):
            dispatcher.tick()


# ---- files ----

def test_upload_list_retrieve_download_delete(alice):
    content = jsonl({"prompt": "a"})
    up = alice.upload(content, filename="../../etc/prompts.jsonl")
    assert up.status_code == 200
    obj = up.json
    assert obj["object"] == "file" and obj["bytes"] == len(content) and obj["purpose"] == "batch"
    assert obj["filename"] == "prompts.jsonl" and obj["status"] == "processed"
    assert obj["expires_at"] == obj["created_at"] + 30 * 86400
    assert alice.get(f"/v1/files/{obj['id']}").json == obj
    download = alice.get(f"/v1/files/{obj['id']}/content")
    assert download.status_code == 200 and download.data == content
    listed = alice.get("/v1/files").json
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [obj["id"]]
    assert listed["first_id"] == listed["last_id"] == obj["id"] and listed["has_more"] is False
    assert alice.get("/v1/files?purpose=batch_output").json["data"] == []
    assert download.headers["Content-Disposition"] == "attachment; filename*=UTF-8''prompts.jsonl"
    odd = alice.upload(content, filename="数据\tx.jsonl").json  # control characters dropped, the rest encoded
    assert odd["filename"] == "数据x.jsonl"
    header = alice.get(f"/v1/files/{odd['id']}/content").headers["Content-Disposition"]
    assert header == "attachment; filename*=UTF-8''%E6%95%B0%E6%8D%AEx.jsonl"
    alice.delete(f"/v1/files/{odd['id']}")
    gone = alice.delete(f"/v1/files/{obj['id']}")
    assert gone.json == {"id": obj["id"], "object": "file", "deleted": True}
    error(alice.get(f"/v1/files/{obj['id']}"), 404, "file_id")


def test_expires_after(alice):
    obj = alice.upload(b"x", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}).json
    assert obj["expires_at"] == obj["created_at"] + 3600
    error(alice.upload(b"x", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}), 400,
          "expires_after.seconds")
    error(alice.upload(b"x", **{"expires_after[anchor]": "now", "expires_after[seconds]": "3600"}), 400,
          "expires_after.anchor")


def test_upload_errors(alice):
    error(alice.upload(b"x", purpose="fine-tune"), 400, "purpose")
    error(alice.http.post("/v1/files", data={"file": (io.BytesIO(b"x"), "a.jsonl")}, headers=alice.headers,
                          content_type="multipart/form-data"), 400, "purpose")
    error(alice.http.post("/v1/files", data={"purpose": "batch"}, headers=alice.headers,
                          content_type="multipart/form-data"), 400, "file")
    error(alice.upload(b"x", colour="red"), 400, "colour")
    too_big = error(alice.upload(b"x" * 4097), 413, "file")
    assert too_big["code"] == "file_too_large" and "4096" in too_big["message"]
    assert alice.upload(b"x" * 4096).status_code == 200  # the cap itself is fine
    assert alice.upload(b"x" * (200 << 10)).status_code == 413  # far past it: refused while reading
    error(alice.get("/v1/files?order=sideways"), 400, "order")
    error(alice.get("/v1/files?limit=0"), 400, "limit")
    for odd in ("--5", "%C2%B2", "1e3"):  # not whole numbers, however int() would read them
        error(alice.get(f"/v1/files?limit={odd}"), 400, "limit")
        error(alice.get(f"/v1/batches?limit={odd}"), 400, "limit")
    error(alice.upload(b"x", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "\u00b2"}),
          400, "expires_after.seconds")
    assert alice.http.post("/v1/files", data={"purpose": "batch"}).status_code == 401


# ---- batches ----

def test_create_validate_and_run_lines(app, alice, r):
    content = jsonl({"prompt": "hello", "max_tokens": 3, "seed": 1}, {"prompt": "x", "temperature": 5},
                    {"prompt": "y", "stream": True}, {"prompt": "z " * 70, "max_tokens": 10},
                    {"prompt": "ok", "user": "mallory"})
    created = alice.batch(content, metadata={"run": "7"})
    assert created["object"] == "batch" and created["status"] == "validating"
    assert created["endpoint"] == "/v1/completions" and created["completion_window"] == "24h"
    assert created["metadata"] == {"run": "7"} and created["expires_at"] == created["created_at"] + 86400
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    blocklist.add(r, "user", "alice:mallory", reason="test", by="test")  # alice's end user mallory

    step(app)  # validates
    running = alice.get(f"/v1/batches/{created['id']}").json
    assert running["status"] == "in_progress" and running["model"] == "tiny" and running["in_progress_at"]
    assert running["request_counts"]["total"] == 5
    step(app)  # starts lines: bad ones are answered at once, good ones queued (two at most)
    now = alice.get(f"/v1/batches/{created['id']}").json
    assert now["request_counts"] == {"total": 5, "completed": 0, "failed": 4}
    errors = {row["custom_id"]: row["response"] for row in map(json.loads, r.get(
        f"nanoserve:batch:{created['id']}:errors").splitlines())}  # the error file as it grows
    assert {cid: (resp["status_code"], resp["body"]["error"]["param"]) for cid, resp in errors.items()} == {
        "r1": (400, "temperature"), "r2": (400, "stream"), "r3": (400, "max_tokens"), "r4": (403, None)}
    assert errors["r3"]["body"]["error"]["code"] == "context_length_exceeded"
    queued = rq_json.queue(protocol.batch_queue_name("tiny"), redis.Redis.from_url(app.extensions[
        "nanoserve.settings"].redis_url))
    [job] = queued.get_jobs()
    assert job.args[0]["prompts"][0] and job.args[0]["max_tokens"] == 3 and job.args[0]["seed"] == 1
    assert job.meta["owner"].startswith("key:") and job.ttl > 86000  # it may wait for the whole window
    assert rq_json.queue(protocol.queue_name("tiny"), queued.connection).count == 0
    # the line's job is the batch owner's, like any job of theirs
    assert alice.get(f"/v1/jobs/{job.id}").json["status"] == "queued"


def test_a_line_waits_for_its_dispatcher_to_end_it_and_is_queued_once(app, alice, r):
    """A line's job may wait in the batch queue until its window ends, when the dispatcher cancels it.
    It must not expire under the dispatcher before that: the dispatcher would take it for lost and
    queue it again, and two workers would run the same id at once. A line lost for real (Redis lost
    its job) is queued again without its stale entry."""
    created = alice.batch(jsonl(*({"prompt": f"p{i}"} for i in range(3))))
    step(app, 2)  # validated, two lines queued
    queue = rq_json.queue(protocol.batch_queue_name("tiny"), r)
    first, second = queue.get_job_ids()
    window_left = created["expires_at"] - time.time()
    assert r.ttl(Job.key_for(first)) > window_left + 60  # it outlives the window: the dispatcher ends it

    r.delete(Job.key_for(first))  # lost: no job, no stream
    step(app)
    assert sorted(queue.get_job_ids()) == sorted([first, second])  # queued again, and once
    assert r.hget(Job.key_for(first), "status") == JobStatus.QUEUED.value


def test_invalid_files_fail_validation(app, alice):
    created = alice.batch(b'{"custom_id": "a"\n' + jsonl({"prompt": "x"}, url="/v1/chat/completions"))
    step(app)
    failed = alice.get(f"/v1/batches/{created['id']}").json
    assert failed["status"] == "failed" and failed["failed_at"]
    codes = [(e["code"], e["line"]) for e in failed["errors"]["data"]]
    assert codes == [("invalid_json_line", 1), ("url_mismatch", 2)]
    assert failed["errors"]["object"] == "list"


def test_create_errors(alice, bob):
    file_id = alice.upload(jsonl({"prompt": "x"})).json["id"]
    good = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    error(alice.post("/v1/batches", {**good, "endpoint": "/v1/chat/completions"}), 400, "endpoint")
    error(alice.post("/v1/batches", {**good, "completion_window": "1h"}), 400, "completion_window")
    error(alice.post("/v1/batches", {**good, "colour": "red"}), 400, "colour")
    error(alice.post("/v1/batches", {k: v for k, v in good.items() if k != "endpoint"}), 400, "endpoint")
    error(alice.post("/v1/batches", {**good, "metadata": {str(i): "v" for i in range(17)}}), 400, "metadata")
    error(alice.post("/v1/batches", {**good, "metadata": {"k": 1}}), 400, "metadata")
    error(alice.post("/v1/batches", {**good, "output_expires_after": {"anchor": "created_at", "seconds": 5}}),
          400, "output_expires_after.seconds")
    error(alice.post("/v1/batches", {**good, "input_file_id": "file-nope"}), 404, "file_id")
    error(bob.post("/v1/batches", good), 404, "file_id")  # alice's file
    error(alice.post("/v1/batches", [1]), 400)


def test_another_key_sees_nothing(app, alice, bob):
    created = alice.batch(jsonl({"prompt": "x"}))
    file_id = created["input_file_id"]
    for response in (bob.get(f"/v1/batches/{created['id']}"), bob.post(f"/v1/batches/{created['id']}/cancel")):
        assert error(response, 404, "batch_id")["code"] == "batch_not_found"
    for response in (bob.get(f"/v1/files/{file_id}"), bob.get(f"/v1/files/{file_id}/content"),
                     bob.delete(f"/v1/files/{file_id}")):
        error(response, 404, "file_id")
    assert bob.get("/v1/batches").json["data"] == [] and bob.get("/v1/files").json["data"] == []
    assert bob.get(f"/v1/batches?after={created['id']}").json["data"] == []
    assert alice.get(f"/v1/files/{file_id}").status_code == 200  # still there
    error(alice.get("/v1/batches/batch_nope"), 404, "batch_id")


def test_list_pages(alice):
    ids = [alice.batch(jsonl({"prompt": "x"}))["id"] for _ in range(3)]
    first = alice.get("/v1/batches?limit=2").json
    assert [b["id"] for b in first["data"]] == ids[:0:-1] and first["has_more"] is True
    rest = alice.get(f"/v1/batches?limit=2&after={first['last_id']}").json
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    error(alice.get("/v1/batches?limit=101"), 400, "limit")


def test_cancel(app, alice):
    created = alice.batch(jsonl(*({"prompt": f"p{i}"} for i in range(5))))
    step(app, 2)  # validated, two lines queued
    cancelling = alice.post(f"/v1/batches/{created['id']}/cancel").json
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    step(app, 2)  # the queued jobs were cancelled (nothing ran them): every line gets batch_cancelled
    cancelled = alice.get(f"/v1/batches/{created['id']}").json
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"]
    assert cancelled["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    assert cancelled["output_file_id"] is None
    lines = [json.loads(x) for x in alice.get(f"/v1/files/{cancelled['error_file_id']}/content").data.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"r{i}" for i in range(5)]
    assert {x["error"]["code"] for x in lines} == {"batch_cancelled"} and all(x["response"] is None for x in lines)
    output = alice.get(f"/v1/files/{cancelled['error_file_id']}").json
    assert output["purpose"] == "batch_output"
    assert alice.post(f"/v1/batches/{created['id']}/cancel").json["status"] == "cancelled"  # again: no change


def test_admin_cli(app, alice):
    created = alice.batch(jsonl({"prompt": "x"}))
    run = app.test_cli_runner().invoke
    listed = run(args=["batches", "list"])
    assert listed.exit_code == 0 and created["id"] in listed.output and "alice" in listed.output
    assert "validating" in listed.output
    assert created["id"] not in run(args=["batches", "list", "--status", "completed"]).output
    cancelled = run(args=["batches", "cancel", created["id"]])
    assert cancelled.exit_code == 0 and "cancelling" in cancelled.output, cancelled.output
    missing = run(args=["batches", "cancel", "batch_nope"])
    assert missing.exit_code == 1 and "No batch found" in missing.output and "Traceback" not in missing.output


def test_lines_take_the_creators_limits_without_strikes(app, r):
    # rpm 3: uploading the file and creating the batch are requests of the key's, its first line the third
    carol = Client(app, keys.create(r, "carol", rpm=3, tpm=100_000)[0])
    created = carol.batch(jsonl({"prompt": "a", "max_tokens": 5}, {"prompt": "b", "max_tokens": 5}))
    step(app, 3)  # validated; the first line starts, the second waits for the key's next request
    batch = carol.get(f"/v1/batches/{created['id']}").json
    assert batch["status"] == "in_progress" and batch["request_counts"]["failed"] == 0
    with app.app_context():
        [line] = batches.batch_store().inflight(created["id"])
    assert line.reserved > 5 and not r.keys("nanoserve:strikes:*")  # waiting earns no abuse strike
    bucket = "nanoserve:ratelimit:key:carol"
    assert float(r.hget(bucket, "tok")) == pytest.approx(100_000 - line.reserved, abs=50)
    # the line ends (as a worker would end it): its tokens are settled with the real usage
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    completion = {"id": line.job_id, "object": "text_completion", "choices": [], "usage": usage}
    r.xadd(protocol.stream_key(line.job_id), protocol.encode_event("done", {"completion": completion}))
    step(app)
    assert carol.get(f"/v1/batches/{created['id']}").json["request_counts"]["completed"] == 1
    assert float(r.hget(bucket, "tok")) == pytest.approx(100_000 - 3, abs=50)
