"""The admin CLI (`flask --app wsgi keys|blocklist|jobs …`) through Flask's CLI runner, against a real Redis."""
from __future__ import annotations

import json
import time

import pytest
import redis

from web.access import Caller, abuse, blocklist, keys
from web.access.ownership import owner_of
from web.api.queue import job_queue
from web.app import create_app
from web.dev.local_redis import free_port
from web.settings import Settings
from worker import protocol


@pytest.fixture()
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def cli(redis_url):
    runner = create_app({"redis_url": redis_url}).test_cli_runner()
    return lambda *args: runner.invoke(args=list(args))


def ok(result):
    assert result.exit_code == 0, result.output
    return result


def fails(result, message):
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    return result


# ---- keys ----

def test_keys_create_shows_the_key_once(cli, r):
    result = ok(cli("keys", "create", "ci", "--rpm", "30", "--tpm", "5000"))
    token = result.stdout.strip()
    assert token.startswith("sk-") and "\n" not in token
    assert "cannot be shown again" in result.stderr
    assert keys.verify(r, token).name == "ci"
    listing = ok(cli("keys", "list")).output
    assert "ci" in listing and "30" in listing and "5000" in listing
    assert token not in listing and token[:11] + "…" in listing


def test_keys_list_and_revoke(cli, r):
    assert "No API keys." in ok(cli("keys", "list")).output
    token = ok(cli("keys", "create", "batch")).stdout.strip()
    assert "default" in ok(cli("keys", "list")).output
    fails(cli("keys", "create", "batch"), "already exists")
    fails(cli("keys", "create", "no spaces"), "Invalid key name")
    assert "Revoked API key 'batch'" in ok(cli("keys", "revoke", "batch")).output
    assert keys.verify(r, token) is None
    fails(cli("keys", "revoke", "batch"), "No API key named 'batch'")


def test_negative_limits_are_a_usage_error(cli):
    result = cli("keys", "create", "ci", "--rpm", "-1")
    assert result.exit_code == 2 and "Traceback" not in result.output


# ---- blocklist ----

def test_blocklist_add_list_remove_log(cli, r):
    assert "The blocklist is empty." in ok(cli("blocklist", "list")).output
    added = ok(cli("blocklist", "add", "mallory", "--reason", "prompt spam", "--for", "24h")).output
    assert "Blocked user 'mallory' until" in added
    ok(cli("blocklist", "add", "ci", "--key"))
    assert r.exists(blocklist.entry_key("user", "mallory")) and r.exists(blocklist.entry_key("key", "ci"))

    lines = ok(cli("blocklist", "list")).output.splitlines()
    assert lines[0].split() == ["USER", "REASON", "ADDED", "BY", "ADDED", "AT", "EXPIRES"]
    mallory = next(line for line in lines if line.startswith("mallory"))
    assert "prompt spam" in mallory and ("(in 23h59m)" in mallory or "(in 1d)" in mallory)
    key_line = next(line for line in lines if line.startswith("key:ci"))
    assert key_line.rstrip().endswith("never")

    assert "Unblocked user 'mallory'" in ok(cli("blocklist", "remove", "mallory")).output
    assert not r.exists(blocklist.entry_key("user", "mallory"))
    fails(cli("blocklist", "remove", "mallory"), "User 'mallory' is not on the blocklist")
    fails(cli("blocklist", "remove", "ci"), "not on the blocklist")  # ci is a key, not a user
    ok(cli("blocklist", "remove", "ci", "--key"))

    log = ok(cli("blocklist", "log")).output.splitlines()
    assert log[0].split()[:3] == ["TIME", "ACTION", "USER"]
    actions = [line.split()[2:4] for line in log[1:]]  # after the date and time
    assert actions == [["add", "mallory"], ["add", "key:ci"], ["remove", "mallory"], ["remove", "key:ci"]]
    assert "prompt spam" in log[1]
    assert len(ok(cli("blocklist", "log", "-n", "2")).output.splitlines()) == 3


@pytest.mark.parametrize("duration", ["soon", "h", "-5m", "0s", "1x", "1h-", ""])
def test_malformed_durations(cli, r, duration):
    fails(cli("blocklist", "add", "mallory", "--for", duration), "Invalid duration")
    assert not r.exists(blocklist.entry_key("user", "mallory"))


def test_empty_name_is_refused(cli, r):
    fails(cli("blocklist", "add", " "), "must not be empty")
    assert blocklist.entries(r) == []


def test_timed_block_expires(cli, r):
    ok(cli("blocklist", "add", "brief", "--for", "1s"))
    assert "brief" in ok(cli("blocklist", "list")).output
    deadline = time.monotonic() + 10
    while r.exists(blocklist.entry_key("user", "brief")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "The blocklist is empty." in ok(cli("blocklist", "list")).output
    fails(cli("blocklist", "remove", "brief"), "not on the blocklist")


def test_remove_lifts_an_automatic_ban_and_its_strikes(cli, r):
    policy = Settings(abuse_window_s=60, abuse_max_invalid=2, abuse_ban_s=3600)
    abuse.strike(r, policy, "invalid", [("user", "eve")])
    abuse.strike(r, policy, "invalid", [("user", "eve")])
    listing = ok(cli("blocklist", "list")).output
    assert "auto: 2 invalid requests" in listing and " auto " in listing
    abuse.strike(r, policy, "invalid", [("user", "eve")])  # a strike after the ban
    ok(cli("blocklist", "remove", "eve"))
    assert not r.exists(abuse.strike_key("invalid", "user", "eve"))


# ---- jobs ----

@pytest.fixture()
def enqueue(redis_url):
    """Queue a job as the API does (the real rq queue), owned by `owner`."""
    app = create_app({"redis_url": redis_url})

    def put(model: str, owner: str) -> str:
        job = protocol.CompletionJob(id=protocol.new_completion_id(), model=model, prompts=[[1, 2]], seed=1)
        with app.app_context():
            job_queue().enqueue(job, model, owner=owner)
        return job.id

    return put


def test_jobs_list_show_and_cancel_see_every_owner(cli, r, enqueue):
    assert "No jobs." in ok(cli("jobs", "list")).output
    _, alice = keys.create(r, "alice")
    _, bob = keys.create(r, "bob")
    first = enqueue("tiny", owner_of(Caller("alice", alice.id)))
    second = enqueue("org/other", owner_of(Caller("bob", bob.id)))
    third = enqueue("tiny", owner_of(Caller()))
    done = {"completion": {"id": first, "choices": []}}
    r.xadd(protocol.stream_key(first), protocol.encode_event("done", done))

    lines = ok(cli("jobs", "list")).output.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "MODEL", "OWNER", "CREATED"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines[1:]}
    assert rows == {first: ["completed", "tiny", "alice"], second: ["queued", "org/other", "bob"],
                    third: ["queued", "tiny", "anonymous"]}
    assert [line.split()[0] for line in ok(cli("jobs", "list", "--key", "bob")).output.splitlines()[1:]] == [second]
    assert {line.split()[0] for line in ok(cli("jobs", "list", "--model", "tiny")).output.splitlines()[1:]} == {first, third}
    assert [line.split()[0] for line in ok(cli("jobs", "list", "--status", "completed")).output.splitlines()[1:]] == [first]
    assert len(ok(cli("jobs", "list", "-n", "2")).output.splitlines()) == 3
    assert "No jobs." in ok(cli("jobs", "list", "--key", "carol")).output

    shown = json.loads(ok(cli("jobs", "show", second)).output)
    assert (shown["id"], shown["status"], shown["model"], shown["owner"]) == (second, "queued", "org/other", "bob")
    assert json.loads(ok(cli("jobs", "show", first)).output)["result"] == done["completion"]

    assert f"Cancelled job {second} (it was queued)" in ok(cli("jobs", "cancel", second)).output
    assert json.loads(ok(cli("jobs", "show", second)).output)["status"] == "cancelled"
    assert r.exists(protocol.cancel_key(second))
    assert "had already ended: completed" in ok(cli("jobs", "cancel", first)).output
    fails(cli("jobs", "show", "cmpl-nope"), "No job with id `cmpl-nope`")
    fails(cli("jobs", "cancel", "nope"), "No job with id `nope`")

    keys.revoke(r, "bob")  # a revoked key's jobs still say whose they were
    assert json.loads(ok(cli("jobs", "show", second)).output)["owner"] == f"sk-{bob.id}… (revoked)"


def test_redis_unreachable(redis_url):
    runner = create_app({"redis_url": f"redis://127.0.0.1:{free_port()}/0"}).test_cli_runner()
    for args in (["keys", "create", "ci"], ["keys", "list"], ["keys", "revoke", "ci"],
                 ["blocklist", "add", "u"], ["blocklist", "remove", "u"], ["blocklist", "list"],
                 ["blocklist", "log"], ["jobs", "list"], ["jobs", "show", "cmpl-x"], ["jobs", "cancel", "cmpl-x"]):
        fails(runner.invoke(args=args), "Cannot use Redis at 127.0.0.1:")


def test_bad_abuse_setting_is_a_clear_error(redis_url, monkeypatch):
    monkeypatch.setenv("NANOSERVE_ABUSE_BAN", "forever")
    with pytest.raises(ValueError, match="NANOSERVE_ABUSE_BAN"):
        create_app({"redis_url": redis_url})
