"""Tenants cannot hurt each other: each attack one key can make, end to end through gunicorn, Redis
(with a password, as every deployment should have) and processor.py, with the real `openai` client.
Each test asserts the attacker gets a clean 4xx and the other tenant is unaffected."""
from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from contextlib import contextmanager

import httpx2
import openai
import pytest
import redis
import requests

from stack import start_gunicorn, start_processor, write_models_toml
from web.access.quotas import Quota
from web.api.stream_hub import StreamHub
from web.app import create_app
from web.dev.local_redis import start_redis
from worker.protocol import APIError

EOS = 50256
LIMITS = {"NANOSERVE_AUTH": "required", "NANOSERVE_KEEPALIVE": "1",
          "NANOSERVE_KEY_MAX_JOBS": "3", "NANOSERVE_KEY_MAX_OPEN": "2", "NANOSERVE_KEY_MAX_BATCHES": "1",
          "NANOSERVE_KEY_MAX_FILES": "3", "NANOSERVE_KEY_MAX_STORED_BYTES": "150000",
          "NANOSERVE_MAX_FILE_BYTES": "100000", "NANOSERVE_MAX_BODY_BYTES": "65536",
          "NANOSERVE_ABUSE_MAX_INVALID": "4", "NANOSERVE_ABUSE_WINDOW": "10m", "NANOSERVE_BATCH_TICK": "0.1"}


@pytest.fixture(scope="module")
def stack(hf_checkpoint, tmp_path_factory):
    """One web process (so every stream shares its stream hub), one worker, a Redis with a password."""
    server = start_redis(password=secrets.token_hex(16))
    models = write_models_toml(tmp_path_factory.mktemp("e2e-tenants") / "models.toml", {"tiny": hf_checkpoint},
                               device="cpu", max_batch=8)
    try:
        with start_processor(server.url, models, concurrency=2) as worker, \
             start_gunicorn(server.url, models, workers=1, threads=16, env=LIMITS) as web:
            web.info.update(worker=worker, redis_url=server.url)
            yield web
    finally:
        server.stop()


@pytest.fixture(scope="module")
def r(stack):
    client = redis.Redis.from_url(stack.info["redis_url"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def admin(stack):
    runner = create_app({"redis_url": stack.info["redis_url"]}).test_cli_runner()

    def run(*args: str) -> str:
        result = runner.invoke(args=list(args))
        assert result.exit_code == 0, result.output
        return result.stdout

    return run


class Tenant(openai.OpenAI):
    """An openai client that never retries, and the name of its key."""

    def __init__(self, url: str, name: str, token: str):
        super().__init__(base_url=url + "/v1", api_key=token, max_retries=0)
        self.name = name


@pytest.fixture()
def tenants(stack, admin) -> tuple[Tenant, Tenant]:
    """Two fresh keys: (attacker, victim)."""
    suffix = secrets.token_hex(3)
    return tuple(Tenant(stack.url, f"{name}-{suffix}", admin("keys", "create", f"{name}-{suffix}").strip())
                 for name in ("mallory", "alice"))


def complete(client: openai.OpenAI, **kwargs):
    args = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0, "logit_bias": {str(EOS): -100}}
    return client.completions.create(**{**args, **kwargs})


def submit_job(client: openai.OpenAI, **body) -> httpx2.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "logit_bias": {str(EOS): -100}, **body}
    return client.post("/jobs", body=body, cast_to=httpx2.Response)


@contextmanager
def worker_paused(stack):
    """The worker frozen (SIGSTOP to its process group): jobs stay queued and streams stay open."""
    pgid = stack.info["worker"].pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)


def stream_text(client: openai.OpenAI, results: list, **kwargs) -> None:
    try:
        chunks = complete(client, stream=True, **kwargs)
        results.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
    except Exception as exc:  # the test reads it
        results.append(exc)


def test_a_bad_last_event_id_is_that_requests_400_and_no_other_stream_notices(stack, tenants, r):
    mallory, alice = tenants
    reference = complete(alice, max_tokens=24).choices[0].text
    results: list = []
    with worker_paused(stack):
        # alice's streams wait in the web process's stream hub for a worker that is stopped
        threads = [threading.Thread(target=stream_text, args=(alice, results), kwargs={"max_tokens": 24})
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        job_id = submit_job(mallory).json()["id"]
        for bad in ("99999999999999999999999-0", str(1 << 64) + "-0", "0-" + str(1 << 64), "1-2-3", "-1-0"):
            answer = requests.get(f"{stack.url}/v1/jobs/{job_id}/stream", timeout=10,
                                  headers={"Authorization": f"Bearer {mallory.api_key}", "Last-Event-ID": bad})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "Last-Event-ID"
        time.sleep(1.0)  # a failed hub read would have reached alice's streams by now
    for thread in threads:
        thread.join(timeout=60)
    assert results == [reference, reference]  # whole, and no error frame
    with pytest.raises(openai.PermissionDeniedError):  # five 400s in a row: the key is banned (threshold 4)
        complete(mallory)
    # the largest id Redis takes is still taken
    job_id = submit_job(alice).json()["id"]
    top = requests.get(f"{stack.url}/v1/jobs/{job_id}/stream", timeout=10, stream=True,
                       headers={"Authorization": f"Bearer {alice.api_key}",
                                "Last-Event-ID": f"{(1 << 64) - 1}-{(1 << 64) - 1}"})
    assert top.status_code == 200
    top.close()


def test_the_hub_fails_only_the_stream_redis_refuses(stack):
    """Past the route's check, the hub itself isolates a stream whose read Redis refuses."""
    hub = StreamHub(stack.info["redis_url"], block_s=0.5)
    client = redis.Redis.from_url(stack.info["redis_url"])
    good, bad = f"test:hub:{secrets.token_hex(4)}:good", f"test:hub:{secrets.token_hex(4)}:bad"
    try:
        follower = hub.follow(good, "0-0", client)
        refused = hub.follow(bad, "99999999999999999999999-0", client)
        with pytest.raises(redis.ResponseError):
            refused.read(5)
        client.xadd(good, {"n": "1"})
        entries = follower.read(5)
        assert [fields for _, fields in entries] == [{b"n": b"1"}]
    finally:
        client.delete(good)
        client.close()


def test_a_huge_user_in_bad_requests_stores_nothing_and_strikes_the_key(stack, tenants, r, admin):
    mallory, alice = tenants
    before = key_sizes(r)
    huge = "u" * 60_000
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(mallory, user=huge, temperature=5)
        assert len(refused.value.message) < 1000  # the 400 does not echo it either
    assert not [key for key in r.scan_iter(count=1000) if len(key) > 600]
    # Per key, not Redis's whole used_memory, which other clients' buffers move by as much as a copy.
    grown = {key: size - before.get(key, 0) for key, size in key_sizes(r).items()}
    assert not {key: growth for key, growth in grown.items() if growth > 50_000}
    assert int(r.get(f"nanoserve:strikes:invalid:key:{mallory.name}")) == 3
    assert complete(alice, user="u" * 256).choices


def key_sizes(r: redis.Redis) -> dict[bytes, int]:
    """Every key's bytes in Redis, its values' elements all counted (MEMORY USAGE ... SAMPLES 0)."""
    return {key: r.memory_usage(key, samples=0) or 0 for key in r.scan_iter(count=1000)}


def test_the_user_field_belongs_to_its_key(stack, tenants, admin):
    mallory, alice = tenants
    assert complete(alice, user="shared").choices
    for _ in range(4):  # mallory gets "shared" banned, and herself with it
        with pytest.raises(openai.BadRequestError):
            complete(mallory, user="shared", temperature=5)
    with pytest.raises(openai.PermissionDeniedError):
        complete(mallory, user="shared")
    with pytest.raises(openai.PermissionDeniedError):
        complete(mallory, user=secrets.token_hex(4))  # a fresh user each time does not escape it
    assert complete(alice, user="shared").choices  # alice's "shared" is another user
    listing = admin("blocklist", "list")
    assert f"{mallory.name}:shared" in listing and alice.name not in listing


def test_a_key_that_sends_a_new_user_every_time_is_still_struck(stack, tenants):
    mallory, alice = tenants
    for _ in range(4):
        with pytest.raises(openai.BadRequestError):
            complete(mallory, user=secrets.token_hex(8), temperature=5)
    with pytest.raises(openai.PermissionDeniedError) as banned:
        complete(mallory)
    assert "API key" in banned.value.message
    assert complete(alice).choices


def test_one_key_cannot_take_the_queue(stack, tenants):
    mallory, alice = tenants
    with worker_paused(stack):
        jobs = [submit_job(mallory) for _ in range(3)]
        assert [job.status_code for job in jobs] == [202, 202, 202]
        with pytest.raises(openai.RateLimitError) as refused:
            submit_job(mallory)
        assert refused.value.code == "quota_exceeded" and int(refused.value.response.headers["retry-after"]) >= 1
        theirs = submit_job(alice)
        assert theirs.status_code == 202
    for job in jobs:  # cancelled jobs give their places back
        mallory.delete(f"/jobs/{job.json()['id']}", cast_to=httpx2.Response)
    assert submit_job(mallory).status_code == 202
    assert alice.get(f"/jobs/{theirs.json()['id']}/stream", cast_to=httpx2.Response).text.rstrip().endswith("[DONE]")


def places_in_jobs_quotas(r: redis.Redis, job_id: str) -> int:
    return sum(r.zscore(key, job_id) is not None for key in r.scan_iter("nanoserve:quota:jobs:*", count=1000)
               if not key.endswith(b":bytes"))


def test_a_request_that_saw_its_job_end_gives_the_jobs_place_back(stack, tenants, r):
    """Sync and streamed completions, and a polled job's stream followed to its end, free their key's
    place in its jobs quota as they end; a polled job nobody followed keeps it until it lapses or the
    key reaches its cap (the cap's own test above)."""
    _, alice = tenants
    done = complete(alice)
    chunks = list(complete(alice, stream=True))
    assert places_in_jobs_quotas(r, done.id) == 0 and places_in_jobs_quotas(r, chunks[0].id) == 0
    polled = submit_job(alice).json()["id"]
    deadline = time.monotonic() + 60
    while alice.get(f"/jobs/{polled}", cast_to=httpx2.Response).json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert places_in_jobs_quotas(r, polled) == 1
    assert alice.get(f"/jobs/{polled}/stream", cast_to=httpx2.Response).text.rstrip().endswith("[DONE]")
    assert places_in_jobs_quotas(r, polled) == 0


def test_one_key_cannot_hold_every_stream(stack, tenants):
    mallory, alice = tenants
    results: list = []
    with worker_paused(stack):
        threads = [threading.Thread(target=stream_text, args=(mallory, results)) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        with pytest.raises(openai.RateLimitError) as refused:
            complete(mallory)  # a synchronous wait holds a thread too
        assert refused.value.code == "quota_exceeded"
        mine: list = []
        theirs = threading.Thread(target=stream_text, args=(alice, mine))
        theirs.start()
        time.sleep(0.5)
    for thread in [*threads, theirs]:
        thread.join(timeout=60)
    assert all(isinstance(text, str) for text in results + mine) and len(mine) == 1
    assert complete(mallory).choices  # the closed streams gave their places back


def upload(client: openai.OpenAI, content: bytes) -> openai.types.FileObject:
    return client.files.create(file=("in.jsonl", content), purpose="batch")


def test_uploads_have_a_quota_per_key(stack, tenants, admin):
    mallory, alice = tenants
    big = upload(mallory, b"x" * 100_000)
    with pytest.raises(openai.RateLimitError) as over_bytes:
        upload(mallory, b"x" * 60_000)
    assert over_bytes.value.code == "quota_exceeded"
    upload(mallory, b"{}\n")
    upload(mallory, b"{}\n")
    with pytest.raises(openai.RateLimitError) as over_count:
        upload(mallory, b"{}\n")
    assert over_count.value.code == "quota_exceeded"
    assert upload(alice, b"x" * 100_000).bytes == 100_000  # alice's quota is her own
    mallory.files.delete(big.id)
    assert upload(mallory, b"{}\n").bytes == 3  # a deleted file gives its place back
    too_long = requests.post(f"{stack.url}/v1/files", headers={"Authorization": f"Bearer {mallory.api_key}"},
                             files={"file": ("in.jsonl", b"{}\n")}, timeout=10,
                             data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                   "expires_after[seconds]": str(31 * 86400)})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "expires_after.seconds"

    admin("blocklist", "add", "--key", mallory.name)
    with pytest.raises(openai.PermissionDeniedError):  # a blocked key stores nothing more
        upload(mallory, b"{}\n")


def batch_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2, **body}}


def test_batches_active_per_key_and_a_line_larger_than_a_request_fails_the_batch(stack, tenants):
    mallory, alice = tenants
    lines = b"".join(json.dumps(batch_line(f"r{i}")).encode() + b"\n" for i in range(2))
    inputs = upload(mallory, lines)
    with worker_paused(stack):
        first = create_batch(mallory, inputs.id)
        with pytest.raises(openai.RateLimitError) as refused:
            create_batch(mallory, inputs.id)
        assert refused.value.code == "quota_exceeded"
        assert create_batch(alice, upload(alice, lines).id).status == "validating"
        mallory.batches.cancel(first.id)
    mallory.files.delete(inputs.id)

    huge = upload(mallory, json.dumps(batch_line("big", prompt="x " * 40_000)).encode() + b"\n")  # > 64 KiB
    deadline = time.monotonic() + 60
    while True:  # the cancelled batch gives its place back once it has ended
        try:
            oversized = create_batch(mallory, huge.id)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the cancelled batch never gave its place back"
            time.sleep(0.2)
    while (batch := mallory.batches.retrieve(oversized.id)).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["line_too_large"]


def create_batch(client: openai.OpenAI, file_id: str):
    return client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")


def test_unbounded_lists_are_400s_naming_the_field(stack, tenants):
    mallory, alice = tenants
    cases = [({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
             ({"stop": ["x" * 1001]}, "stop"),
             ({"extra_body": {"bad_words": ["y" * 1001]}}, "bad_words"),
             ({"prompt": ["a"] * 200, "n": 2}, "n")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            complete(mallory, **kwargs)
        assert refused.value.param == param, refused.value.message
    assert complete(alice, logit_bias={str(t): 1 for t in range(300)}).choices


def test_only_json_is_read(stack, tenants):
    """A web page can post text/plain to a server on the user's machine without a preflight."""
    mallory, alice = tenants
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Authorization": f"Bearer {alice.api_key}"}
        if content_type:
            headers["Content-Type"] = content_type
        answer = requests.post(f"{stack.url}/v1/completions", data=body, headers=headers, timeout=10)
        assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type"
    assert complete(alice).choices


def test_metrics_and_readiness_tell_strangers_nothing(stack):
    assert requests.get(f"{stack.url}/metrics", timeout=10).status_code == 401  # keys required: so is /metrics
    dead = create_app({"redis_url": "redis://:secret@127.0.0.1:1/0", "batch_dispatch": False}).test_client()
    answer = dead.get("/ready")
    assert answer.status_code == 503 and answer.json["error"]["code"] == "redis_unavailable"
    assert "127.0.0.1" not in answer.text and ":1" not in answer.text and "secret" not in answer.text


def test_a_quota_never_overshoots_under_concurrent_takes(stack):
    client = redis.Redis.from_url(stack.info["redis_url"], decode_responses=True)
    quota, owner = Quota("test", 5, "things"), f"test:{secrets.token_hex(4)}"
    taken: list = []

    def take(i: int) -> None:
        try:
            quota.take(client, owner, f"m{i}", time.time() + 60)
            taken.append(i)
        except Exception:
            pass

    threads = [threading.Thread(target=take, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(taken) == 5 and client.zcard(quota.key(owner)) == 5
    quota.take(client, f"{owner}:lapsed", "old", time.time() - 1)  # a lapsed place frees itself
    assert client.zcard(quota.key(f"{owner}:lapsed")) == 1
    for i in range(5):
        quota.take(client, f"{owner}:lapsed", f"n{i}", time.time() + 60)
    assert client.zcard(quota.key(f"{owner}:lapsed")) == 5
    client.close()


def test_a_take_at_the_cap_sees_what_another_request_gave_back(stack):
    """Two requests of one key at its cap: the other one drops the places of the jobs that ended
    between this one's refused take and its look at what ended. This one then finds nothing ended,
    and is still taken, as there is room (the GPU check's 64 clients of one key were refused at 256)."""
    client = redis.Redis.from_url(stack.info["redis_url"], decode_responses=True)
    quota, owner = Quota("test", 2, "things"), f"test:{secrets.token_hex(4)}"
    for member in ("ended", "running"):
        quota.take(client, owner, member, time.time() + 60)

    def another_request_drops_what_ended(members):
        quota.give_back(client, owner, "ended")
        return []

    quota.take(client, owner, "new", time.time() + 60, ended=another_request_drops_what_ended)
    assert set(client.zrange(quota.key(owner), 0, -1)) == {"running", "new"}
    with pytest.raises(APIError) as refused:  # at the cap with nothing ended: refused
        quota.take(client, owner, "more", time.time() + 60, ended=lambda members: [])
    assert refused.value.status == 429
    client.close()


def test_redis_at_its_memory_cap_is_a_503_not_a_500(stack, tenants, r):
    mallory, alice = tenants
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")  # below what it holds: every write is refused
    try:
        for call in (lambda: upload(mallory, b"{}\n"), lambda: complete(mallory)):
            with pytest.raises(openai.InternalServerError) as refused:
                call()
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"]
    finally:
        r.config_set("maxmemory", "0")
    assert complete(alice).choices
