"""Access control against a real redis-server: API keys, the blocklist, rate limits (atomic across
concurrent callers), automatic abuse bans, and the seam `web/access/__init__.py` behind a Flask route."""
from __future__ import annotations

import threading
import time

import pytest
import redis
from flask import Flask, jsonify, request

from web import access
from web import settings as web_settings
from web.access import abuse, blocklist, keys, ratelimit
from web.api.errors import register_error_handlers
from web.durations import parse_duration
from web.settings import Settings


@pytest.fixture()
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# ---- API keys ----

def test_key_is_shown_once_and_only_its_hash_is_stored(r):
    token, record = keys.create(r, "ci", rpm=5)
    assert token.startswith("sk-") and len(token) > 40
    assert record.name == "ci" and record.rpm == 5 and record.tpm is None
    stored = " ".join(str(v) for key in r.keys("*") for v in (r.hgetall(key) or {}).values())
    assert token not in stored and token[12:] not in stored
    assert keys.verify(r, token).name == "ci"


def test_wrong_unknown_and_malformed_keys_are_refused(r):
    token, _ = keys.create(r, "ci")
    wrong_secret = token[:11] + ("A" if token[11] != "A" else "B") + token[12:]
    for bad in (wrong_secret, token + "x", token[:11], "sk-", "", "Bearer " + token, "sk-" + "x" * 40):
        assert keys.verify(r, bad) is None, bad


def test_duplicate_and_invalid_names_are_rejected(r):
    keys.create(r, "ci")
    with pytest.raises(keys.ApiKeyError, match="already exists"):
        keys.create(r, "ci")
    with pytest.raises(keys.ApiKeyError, match="Invalid key name"):
        keys.create(r, "has space")
    assert [k.name for k in keys.list_keys(r)] == ["ci"]


def test_revoke_takes_effect_at_once(r):
    token, _ = keys.create(r, "ci")
    other, _ = keys.create(r, "batch", tpm=100)
    assert keys.revoke(r, "ci")
    assert keys.verify(r, token) is None
    assert keys.verify(r, other).name == "batch"
    assert not keys.revoke(r, "ci")
    assert [k.name for k in keys.list_keys(r)] == ["batch"]
    token2, _ = keys.create(r, "ci")  # the name is free again, with a new key
    assert keys.verify(r, token2).name == "ci" and keys.verify(r, token) is None


# ---- blocklist ----

def test_blocklist_add_list_remove_and_log(r):
    blocklist.add(r, "user", "mallory", reason="spam", by="alice")
    blocklist.add(r, "key", "ci", by="bob", duration=3600)
    entries = blocklist.entries(r)
    assert [(e.kind, e.name, e.reason, e.added_by) for e in entries] == [
        ("user", "mallory", "spam", "alice"), ("key", "ci", "", "bob")]
    assert entries[0].expires_at is None
    assert entries[1].expires_at == pytest.approx(time.time() + 3600, abs=5)
    assert r.exists(blocklist.entry_key("user", "mallory"))

    assert blocklist.remove(r, "user", "mallory", by="carol")
    assert not blocklist.remove(r, "user", "mallory")
    assert not blocklist.remove(r, "user", "nobody")
    assert [e.name for e in blocklist.entries(r)] == ["ci"]
    log = blocklist.log(r)
    assert [(row["action"], row["kind"], row["name"], row["by"]) for row in log] == [
        ("add", "user", "mallory", "alice"), ("add", "key", "ci", "bob"), ("remove", "user", "mallory", "carol")]
    assert log[0]["reason"] == "spam" and float(log[1]["expires_at"]) > time.time()


def test_timed_entry_expires_by_itself(r):
    blocklist.add(r, "user", "brief", duration=0.3)
    assert [e.name for e in blocklist.entries(r)] == ["brief"]
    assert wait_for(lambda: not r.exists(blocklist.entry_key("user", "brief")))
    assert blocklist.entries(r) == []
    assert r.smembers(blocklist.INDEX) == set()  # the index forgets it too
    assert not blocklist.remove(r, "user", "brief")


@pytest.mark.parametrize("text, seconds", [("24h", 86400), ("30m", 1800), ("2s", 2), ("90", 90), ("1h30m", 5400),
                                           ("7d", 604800), ("1.5h", 5400), ("250ms", 0.25), (" 2 H ", 7200)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "-1h", "0s", "1x", "1h-", "tomorrow", "1.h", "h1"])
def test_parse_duration_rejects_malformed(text):
    with pytest.raises(ValueError, match="Invalid duration"):
        parse_duration(text)


# ---- rate limits ----

def test_requests_per_minute(r):
    bucket = ratelimit.Bucket("nanoserve:ratelimit:test", rpm=3, tpm=0)
    results = [ratelimit.reserve(r, [bucket], 10) for _ in range(4)]
    assert [res.allowed for res in results] == [True, True, True, False]
    assert [res.states[0].remaining_requests for res in results[:3]] == [2, 1, 0]
    refused = results[3]
    assert refused.refused[0].refused == "requests"
    # One request comes back every 20 s.
    assert 0 < refused.retry_after_ms <= 20_000
    assert 1 <= ratelimit.retry_after_seconds(refused.retry_after_ms) <= 20
    headers = results[0].headers()
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in headers  # tpm 0: no token limit


def test_tokens_per_minute_reserve_and_settle(r):
    bucket = ratelimit.Bucket("nanoserve:ratelimit:test", rpm=0, tpm=100)
    first = ratelimit.reserve(r, [bucket], 60)
    assert first.allowed and first.states[0].remaining_tokens == 40
    second = ratelimit.reserve(r, [bucket], 60)
    assert not second.allowed and second.refused[0].refused == "tokens"
    assert second.states[0].remaining_tokens == 40  # a refusal takes nothing
    ratelimit.settle(r, [bucket], 60 - 10)  # the first request used 10 of its 60
    third = ratelimit.reserve(r, [bucket], 60)
    assert third.allowed and 30 <= third.states[0].remaining_tokens <= 32
    headers = third.headers()
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert int(headers["x-ratelimit-remaining-tokens"]) == third.states[0].remaining_tokens


def test_cost_above_the_whole_limit_is_too_large(r):
    bucket = ratelimit.Bucket("nanoserve:ratelimit:test", rpm=10, tpm=100)
    res = ratelimit.reserve(r, [bucket], 101)
    assert not res.allowed and res.refused[0].refused == "too_large"
    assert ratelimit.reserve(r, [bucket], 100).allowed


def test_all_buckets_or_none(r):
    roomy = ratelimit.Bucket("nanoserve:ratelimit:roomy", rpm=100, tpm=0)
    tight = ratelimit.Bucket("nanoserve:ratelimit:tight", rpm=1, tpm=0)
    assert ratelimit.reserve(r, [roomy, tight], 1).allowed
    res = ratelimit.reserve(r, [roomy, tight], 1)
    assert not res.allowed and [s.bucket for s in res.refused] == [tight]
    assert res.states[0].remaining_requests == 99  # the roomy bucket kept its request
    # The tightest bucket names the headers.
    assert res.headers()["x-ratelimit-limit-requests"] == "1"


def test_gate_key_blocks_before_anything_is_reserved(r):
    bucket = ratelimit.Bucket("nanoserve:ratelimit:test", rpm=5, tpm=0)
    blocklist.add(r, "user", "mallory")
    gates = [blocklist.entry_key("key", "ci"), blocklist.entry_key("user", "mallory")]
    res = ratelimit.reserve(r, [bucket], 1, gates)
    assert not res.allowed and res.blocked_by == 1
    assert not r.exists(bucket.key)
    assert ratelimit.reserve(r, [bucket], 1, gates[:1]).allowed


def test_reservations_are_atomic_under_concurrency(r, redis_url):
    # 8 threads, each with its own connection, race for a 600-token bucket at 100 tokens a request.
    bucket = ratelimit.Bucket("nanoserve:ratelimit:race", rpm=0, tpm=600)
    allowed = []
    start = threading.Barrier(8)

    def hammer():
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        start.wait()
        for _ in range(10):
            allowed.append(ratelimit.reserve(client, [bucket], 100).allowed)
        client.close()

    began = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The bucket refills 10 tokens a second: allow for what came back while the threads ran.
    refill = int((time.monotonic() - began) * 600 / 60 / 100) + 1
    assert len(allowed) == 80
    assert 6 <= sum(allowed) <= 6 + refill


@pytest.mark.parametrize("ms, text", [(0, "0ms"), (20, "20ms"), (1000, "1s"), (6500, "6.5s"), (60000, "1m0s"),
                                      (90250, "1m30.25s")])
def test_reset_header_format(ms, text):
    assert ratelimit.reset_header(ms) == text


# ---- abuse ----

def test_strikes_reach_a_temporary_ban_once(r):
    policy = Settings(abuse_window_s=60, abuse_max_rate_limited=3, abuse_max_invalid=2, abuse_ban_s=120)
    subject = [("user", "mallory")]
    assert abuse.strike(r, policy, "rate_limited", subject) == []
    assert abuse.strike(r, policy, "rate_limited", subject) == []
    assert abuse.strike(r, policy, "rate_limited", subject) == subject
    [entry] = blocklist.entries(r)
    assert entry.reason.startswith("auto: 3 rate-limited requests within 1m") and entry.added_by == "auto"
    assert entry.expires_at == pytest.approx(time.time() + 120, abs=5)
    assert 0 < r.pttl(blocklist.entry_key("user", "mallory")) <= 120_000
    assert blocklist.log(r)[-1]["by"] == "auto"
    # The counter restarts after a ban.
    assert abuse.strike(r, policy, "rate_limited", subject) == []


def test_offences_are_counted_separately_per_subject(r):
    policy = Settings(abuse_window_s=60, abuse_max_rate_limited=2, abuse_max_invalid=2, abuse_ban_s=60)
    abuse.strike(r, policy, "invalid", [("user", "a")])
    abuse.strike(r, policy, "rate_limited", [("user", "a")])
    abuse.strike(r, policy, "invalid", [("key", "a")])
    assert blocklist.entries(r) == []
    assert abuse.strike(r, policy, "invalid", [("user", "a"), ("user", "b")]) == [("user", "a")]


def test_forgive_and_disabled_policy(r):
    policy = Settings(abuse_window_s=60, abuse_max_invalid=2, abuse_ban_s=60)
    abuse.strike(r, policy, "invalid", [("user", "a")])
    abuse.forgive(r, "user", "a")
    assert abuse.strike(r, policy, "invalid", [("user", "a")]) == []
    off = Settings(abuse_enabled=False, abuse_max_invalid=1)
    assert abuse.strike(r, off, "invalid", [("user", "b")]) == []
    assert blocklist.entries(r) == []


# ---- the seam behind a route ----

def seam_app(redis_url: str, **config) -> Flask:
    """The seam as the completions route uses it, without a model: {"user", "tokens"} in, headers out.
    `config`: settings by field name (strings are parsed as from the environment)."""
    app = Flask(__name__)
    settings = web_settings.init_app(app, {"redis_url": redis_url, **config})
    access.init_app(app, settings)
    register_error_handlers(app)

    @app.post("/v1/echo")
    def echo():
        caller = access.authenticate(request)
        body = request.get_json()
        if body.get("invalid"):
            access.record_invalid(caller, body.get("user"))
            return jsonify({"error": "invalid"}), 400
        grant = access.admit(caller, body.get("user"), body.get("tokens", 10))
        access.settle(grant, body.get("used", 5))
        return jsonify({"key": caller.key_name}), 200, access.rate_limit_headers(grant)

    @app.get("/metrics")
    def metrics():
        access.authorize_metrics(request)
        return "ok"

    return app


def post(client, token=None, **body):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.post("/v1/echo", json=body, headers=headers)


def test_auth_required(redis_url, r):
    client = seam_app(redis_url, auth_required="required").test_client()
    missing = post(client)
    assert missing.status_code == 401
    assert missing.json["error"]["message"].startswith("You didn't provide an API key.")
    assert set(missing.json["error"]) == {"message", "type", "param", "code"}
    wrong = post(client, "sk-wrongwrongwrongwrong")
    assert wrong.status_code == 401 and wrong.json["error"]["code"] == "invalid_api_key"
    assert wrong.json["error"]["message"].startswith("Incorrect API key provided: sk-***rong.")
    token, _ = keys.create(r, "ci")
    ok = post(client, token)
    assert ok.status_code == 200 and ok.json["key"] == "ci"
    keys.revoke(r, "ci")
    assert post(client, token).status_code == 401


@pytest.mark.parametrize("auth", ["required", "disabled"])
def test_metrics_auth(redis_url, r, auth):
    client = seam_app(redis_url, auth_required=auth, metrics_auth_required="required").test_client()
    token, _ = keys.create(r, "prometheus")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer sk-nope-nope-nope"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200


@pytest.mark.parametrize("auth", ["required", "disabled"])
def test_metrics_follow_the_api_unless_set(redis_url, auth):
    """Unset, /metrics is as open as /v1: behind a key whenever keys are required."""
    expected = 401 if auth == "required" else 200
    assert seam_app(redis_url, auth_required=auth).test_client().get("/metrics").status_code == expected
    opened = seam_app(redis_url, auth_required=auth, metrics_auth_required="disabled").test_client()
    assert opened.get("/metrics").status_code == 200


def test_auth_disabled_lets_anyone_in_with_limits_per_address(redis_url):
    client = seam_app(redis_url, auth_required="disabled", key_rpm=2).test_client()
    assert post(client).status_code == 200
    assert post(client, "anything").status_code == 200
    limited = post(client)
    assert limited.status_code == 429 and "client 127.0.0.1" in limited.json["error"]["message"]


def test_success_carries_rate_limit_headers(redis_url, r):
    token, _ = keys.create(r, "ci", rpm=50, tpm=1000)
    client = seam_app(redis_url, auth_required="required", user_rpm=20).test_client()
    response = post(client, token, user="alice", tokens=100, used=40)
    assert response.status_code == 200
    # requests: the user's 20 rpm is tighter than the key's 50; tokens: only the key has a tpm below the default
    assert response.headers["x-ratelimit-limit-requests"] == "20"
    assert response.headers["x-ratelimit-remaining-requests"] == "19"
    assert response.headers["x-ratelimit-limit-tokens"] == "1000"
    assert response.headers["x-ratelimit-remaining-tokens"] == "900"
    assert response.headers["x-ratelimit-reset-tokens"].endswith("s")
    # settle gave back the unused 60
    again = post(client, token, user="alice", tokens=100, used=100)
    assert 860 <= int(again.headers["x-ratelimit-remaining-tokens"]) <= 862  # 1000 - 100 + 60 - 100


def test_blocked_user_and_key_get_403_without_the_reason(redis_url, r):
    token, _ = keys.create(r, "ci")
    other, _ = keys.create(r, "other")
    client = seam_app(redis_url, auth_required="required").test_client()
    blocklist.add(r, "user", "ci:mallory", reason="secret reason")  # the end user mallory of the key ci
    blocked = post(client, token, user="mallory")
    assert blocked.status_code == 403
    assert blocked.json["error"]["type"] == "permission_error"
    assert "blocked" in blocked.json["error"]["message"] and "secret" not in blocked.json["error"]["message"]
    assert post(client, token, user="alice").status_code == 200
    assert post(client, other, user="mallory").status_code == 200  # another key's mallory is another user
    blocklist.remove(r, "user", "ci:mallory")
    assert post(client, token, user="mallory").status_code == 200
    blocklist.add(r, "key", "ci")
    refused = post(client, token, user="alice")
    assert refused.status_code == 403 and "API key" in refused.json["error"]["message"]


def test_rate_limited_429_then_automatic_ban(redis_url, r):
    client = seam_app(redis_url, user_rpm=1, abuse_max_rate_limited=3,
                      abuse_ban_s="1h").test_client()
    assert post(client, user="eve").status_code == 200
    for _ in range(2):
        limited = post(client, user="eve")
        assert limited.status_code == 429
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert limited.json["error"]["code"] == "rate_limit_exceeded"
        assert "user `eve`" in limited.json["error"]["message"]
    assert post(client, user="eve").status_code == 429  # the third strike bans
    assert post(client, user="eve").status_code == 403
    [entry] = blocklist.entries(r)
    assert (entry.kind, entry.name, entry.added_by) == ("user", "eve", "auto")
    assert entry.reason.startswith("auto: 3 rate-limited requests")
    assert post(client, user="bob").status_code == 200  # others are unaffected


def test_too_large_is_not_retried(redis_url):
    client = seam_app(redis_url, key_tpm=50).test_client()
    response = post(client, tokens=51)
    assert response.status_code == 429 and response.headers["x-should-retry"] == "false"
    assert "Request too large" in response.json["error"]["message"]


def test_invalid_requests_earn_a_ban(redis_url, r):
    client = seam_app(redis_url, abuse_max_invalid=2).test_client()
    assert post(client, user="fuzz", invalid=True).status_code == 400
    assert post(client, user="fuzz", invalid=True).status_code == 400
    assert post(client, user="fuzz").status_code == 403
    assert blocklist.entries(r)[0].reason.startswith("auto: 2 invalid requests")


def test_a_normal_request_costs_one_round_trip_per_step(redis_url, r, monkeypatch):
    token, _ = keys.create(r, "ci")
    app = seam_app(redis_url, auth_required="required")
    client = app.test_client()
    assert post(client, token, user="alice").status_code == 200  # loads the scripts
    commands = []
    with app.app_context():
        connection = access.redis_client()
    original = connection.execute_command
    monkeypatch.setattr(connection, "execute_command", lambda *a, **kw: commands.append(a[0]) or original(*a, **kw))
    assert post(client, token, user="alice", tokens=10, used=5).status_code == 200
    # authenticate: the key record; admit: blocklist + reservation in one script; settle: one script
    assert commands == ["HGET", "EVALSHA", "EVALSHA"]


def test_bad_setting_is_a_clear_error(redis_url):
    with pytest.raises(ValueError, match="NANOSERVE_AUTH must be 'required' or 'disabled'"):
        seam_app(redis_url, auth_required="maybe")


def test_redis_down_is_503_with_the_configured_retry_after(redis_url):
    from web.dev.local_redis import free_port

    client = seam_app(f"redis://127.0.0.1:{free_port()}/0", retry_after_s=7).test_client()
    response = post(client, user="alice")
    assert response.status_code == 503 and response.headers["Retry-After"] == "7"
    assert set(response.json["error"]) == {"message", "type", "param", "code"}
