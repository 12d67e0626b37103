"""Access control end to end: the real `openai` client against gunicorn (two web processes) and
processor.py, with the admin CLI changing keys and the blocklist underneath them."""
from __future__ import annotations

import time
import urllib.request

import httpx2
import openai
import pytest
import redis

from stack import start_gunicorn, start_processor, write_models_toml
from web.app import create_app
from worker import protocol

EOS = 50256
# Automatic bans after 3 rate-limited or 3 invalid requests within the window.
WEB_ENV = {"NANOSERVE_AUTH": "required", "NANOSERVE_ABUSE_MAX_429": "3", "NANOSERVE_ABUSE_MAX_INVALID": "3",
           "NANOSERVE_ABUSE_WINDOW": "10m", "NANOSERVE_ABUSE_BAN": "1h"}


@pytest.fixture(scope="module")
def stack(redis_server, hf_checkpoint, tmp_path_factory):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    models = write_models_toml(tmp_path_factory.mktemp("e2e-access") / "models.toml", {"tiny": hf_checkpoint},
                               device="cpu", max_batch=8)
    with start_processor(redis_server.url, models, concurrency=2), \
         start_gunicorn(redis_server.url, models, workers=2, threads=4, env=WEB_ENV) as web:
        yield web


@pytest.fixture(scope="module")
def admin(stack, redis_server):
    """Run an admin command (`flask --app wsgi …`) against the stack's Redis; returns its output."""
    runner = create_app({"redis_url": redis_server.url}).test_cli_runner()

    def run(*args: str, expect: int = 0) -> str:
        result = runner.invoke(args=list(args))
        assert result.exit_code == expect, result.output
        return result.stdout

    return run


def client_for(stack, api_key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=api_key, **kwargs)


def complete(client: openai.OpenAI, **kwargs):
    """A short completion that cannot end early (EOS is banned), so usage is exactly what was reserved."""
    args = {"model": "tiny", "prompt": "Hello", "max_tokens": 1, "temperature": 0, "logit_bias": {str(EOS): -100}}
    return client.completions.create(**{**args, **kwargs})


def test_key_required_wrong_and_revoked(stack, admin):
    with urllib.request.urlopen(stack.url + "/health", timeout=5) as response:  # no key needed
        assert response.status == 200
    token = admin("keys", "create", "e2e-auth").strip()
    client = client_for(stack, token, max_retries=0)
    assert complete(client).choices[0].text

    with pytest.raises(openai.AuthenticationError) as missing:
        complete(client, extra_headers={"Authorization": openai.Omit()})
    assert "You didn't provide an API key" in missing.value.message
    with pytest.raises(openai.AuthenticationError) as wrong:
        complete(client_for(stack, token[:-4] + "abcd", max_retries=0))
    assert wrong.value.code == "invalid_api_key" and "Incorrect API key provided" in wrong.value.message

    admin("keys", "revoke", "e2e-auth")
    for _ in range(4):  # every web process sees the revocation at once
        with pytest.raises(openai.AuthenticationError):
            complete(client)


def test_blocked_user_others_unaffected_and_unblock(stack, admin):
    client = client_for(stack, admin("keys", "create", "e2e-block").strip(), max_retries=0)
    assert complete(client, user="mallory").choices
    admin("blocklist", "add", "mallory", "--of-key", "e2e-block", "--reason", "scraping the model")
    for stream in (False, True, False, True):
        with pytest.raises(openai.PermissionDeniedError) as denied:
            complete(client, user="mallory", stream=stream)
        assert denied.value.status_code == 403
        assert "blocked" in denied.value.message and "scraping" not in denied.value.message
    assert complete(client, user="alice").choices  # other users are unaffected
    assert complete(client).choices  # and so are requests without a user

    admin("blocklist", "remove", "mallory", "--of-key", "e2e-block")
    assert complete(client, user="mallory").choices
    log = admin("blocklist", "log")
    assert "add" in log and "remove" in log and "scraping the model" in log


def test_timed_block_expires(stack, admin):
    client = client_for(stack, admin("keys", "create", "e2e-timed").strip(), max_retries=0)
    admin("blocklist", "add", "brief", "--of-key", "e2e-timed", "--for", "2s")
    with pytest.raises(openai.PermissionDeniedError):
        complete(client, user="brief")
    deadline = time.monotonic() + 20
    while True:
        try:
            assert complete(client, user="brief").choices
            break
        except openai.PermissionDeniedError:
            assert time.monotonic() < deadline, "the 2s block never expired"
            time.sleep(0.25)
    assert "brief" not in admin("blocklist", "list")


def test_rate_limit_error_carries_headers(stack, admin):
    client = client_for(stack, admin("keys", "create", "e2e-rpm", "--rpm", "2").strip(), max_retries=0)
    first = client.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=1)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"} <= set(first.headers)
    assert complete(client).choices
    with pytest.raises(openai.RateLimitError) as limited:
        complete(client)
    headers = limited.value.response.headers
    assert limited.value.status_code == 429 and limited.value.code == "rate_limit_exceeded"
    assert 1 <= int(headers["retry-after"]) <= 30  # one request comes back every 30 s
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_client_retry_honours_retry_after(stack, admin):
    # 190 tokens per minute (about 3 a second); each request reserves and uses 100 prompt + 1 completion
    # tokens. After one request 89 are left, so the next must wait about 4 s for 12 more.
    token = admin("keys", "create", "e2e-tpm", "--tpm", "190").strip()
    prompt = [464] * 100
    assert complete(client_for(stack, token, max_retries=0), prompt=prompt).usage.total_tokens == 101
    with pytest.raises(openai.RateLimitError) as limited:
        complete(client_for(stack, token, max_retries=0), prompt=prompt)
    retry_after = int(limited.value.response.headers["retry-after"])
    assert limited.value.response.headers["x-ratelimit-limit-tokens"] == "190"
    assert int(limited.value.response.headers["x-ratelimit-remaining-tokens"]) < 101
    assert 2 <= retry_after <= 5
    # One retry is enough only if the client waits as long as Retry-After says (its own backoff
    # before a first retry is under a second).
    started = time.monotonic()
    raw = client_for(stack, token, max_retries=1).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(EOS): -100})
    assert raw.retries_taken == 1 and raw.parse().usage.total_tokens == 101
    assert time.monotonic() - started >= retry_after - 1.5


def test_automatic_ban_for_invalid_requests_and_its_lifting(stack, admin):
    client = client_for(stack, admin("keys", "create", "e2e-fuzz").strip(), max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            complete(client, user="fuzzer", temperature=5)
    with pytest.raises(openai.PermissionDeniedError):
        complete(client, user="fuzzer")
    # the key that sent them is struck too (a key sending a new `user` each time gets no free pass)
    with pytest.raises(openai.PermissionDeniedError) as key_banned:
        complete(client, user="alice")
    assert "API key" in key_banned.value.message
    listing = admin("blocklist", "list")
    assert "e2e-fuzz:fuzzer" in listing and "key:e2e-fuzz" in listing and "auto: 3 invalid requests" in listing
    assert "auto" in admin("blocklist", "log")

    admin("blocklist", "remove", "--key", "e2e-fuzz")
    assert complete(client, user="alice").choices
    with pytest.raises(openai.PermissionDeniedError):
        complete(client, user="fuzzer")  # its end user stays banned until lifted on its own
    admin("blocklist", "remove", "fuzzer", "--of-key", "e2e-fuzz")
    assert complete(client, user="fuzzer").choices
    with pytest.raises(openai.BadRequestError):  # its strikes were cleared with the ban
        complete(client, user="fuzzer", temperature=5)
    assert complete(client, user="fuzzer").choices


def test_automatic_ban_for_hammering_a_rate_limit(stack, admin):
    client = client_for(stack, admin("keys", "create", "e2e-hammer", "--rpm", "1").strip(), max_retries=0)
    assert complete(client).choices
    for _ in range(3):
        with pytest.raises(openai.RateLimitError):
            complete(client)
    with pytest.raises(openai.PermissionDeniedError) as banned:
        complete(client)
    assert "API key" in banned.value.message
    assert "key:e2e-hammer" in admin("blocklist", "list")
    admin("blocklist", "remove", "e2e-hammer", expect=1)  # a key is named with --key
    admin("blocklist", "remove", "--key", "e2e-hammer")
    with pytest.raises(openai.RateLimitError):  # past the blocklist again, still inside its 1 rpm
        complete(client)


def test_a_job_belongs_to_the_key_that_made_it(stack, admin, redis_server):
    alice = client_for(stack, admin("keys", "create", "e2e-owner-a").strip(), max_retries=0)
    bob = client_for(stack, admin("keys", "create", "e2e-owner-b").strip(), max_retries=0)
    bob_unversioned = openai.OpenAI(base_url=stack.url, api_key=bob.api_key, max_retries=0)  # GET /jobs/{id}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "temperature": 0, "logit_bias": {str(EOS): -100}}
    created = alice.post("/jobs", body=body, cast_to=httpx2.Response)
    assert created.status_code == 202
    job_id = created.json()["id"]

    def refusal(call, path: str) -> dict:
        with pytest.raises(openai.NotFoundError) as refused:
            call(path, cast_to=httpx2.Response)
        assert refused.value.code == "job_not_found"
        return refused.value.body

    unknown = "cmpl-" + "0" * 32
    for call, path in ((bob.get, "/jobs/{}"), (bob_unversioned.get, "/jobs/{}"), (bob.get, "/jobs/{}/stream"),
                       (bob.delete, "/jobs/{}")):
        # exactly what an id that does not exist gets: bob cannot tell that alice's job exists
        mine, nobodys = refusal(call, path.format(job_id)), refusal(call, path.format(unknown))
        assert mine == {**nobodys, "message": nobodys["message"].replace(unknown, job_id)}
    client = redis.Redis.from_url(redis_server.url)
    assert not client.exists(protocol.cancel_key(job_id))  # bob's DELETE did not cancel it
    client.close()

    # alice follows her job to its end, reads it, and can cancel another of hers
    stream = alice.get(f"/jobs/{job_id}/stream", cast_to=httpx2.Response)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    state = alice.get(f"/jobs/{job_id}", cast_to=httpx2.Response).json()
    assert state["status"] == "completed" and state["result"]["usage"]["completion_tokens"] == 100
    assert state["result"]["choices"][0]["finish_reason"] == "length"
    assert alice.delete(f"/jobs/{job_id}", cast_to=httpx2.Response).json()["status"] == "completed"
    second = alice.post("/jobs", body={**body, "max_tokens": None}, cast_to=httpx2.Response).json()["id"]
    assert alice.delete(f"/jobs/{second}", cast_to=httpx2.Response).json()["status"] == "cancelled"

    # the admin sees both, with their owner
    listing = admin("jobs", "list", "--key", "e2e-owner-a")
    assert job_id in listing and second in listing and "e2e-owner-b" not in listing
