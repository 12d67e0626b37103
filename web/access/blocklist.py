"""The blocklist: end users and API keys refused with 403, and the audit trail of every change.

State lives only in Redis, so an entry takes effect at once in every web process. Each entry is one
hash (`nanoserve:blocked:<kind>:<name>`); a timed entry carries a Redis expiry and vanishes by itself,
so checking an entry is a single EXISTS (done inside the rate-limit script, see `web/access/__init__.py`).
A set indexes the entries for `list`; the audit log is a capped Redis Stream.

Functions take a Redis client created with `decode_responses=True`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis

KINDS = ("user", "key")  # `user`: the request's `user` field; `key`: an API key by name
INDEX = "nanoserve:blocklist"
LOG = "nanoserve:blocklist:log"
LOG_MAXLEN = 10_000  # the audit log keeps about this many changes


def entry_key(kind: str, name: str) -> str:
    return f"nanoserve:blocked:{kind}:{name}"


@dataclass
class Entry:
    kind: str
    name: str
    reason: str
    added_by: str
    added_at: float  # unix seconds
    expires_at: float | None  # None: until removed


def add(r: redis.Redis, kind: str, name: str, *, reason: str = "", by: str = "admin",
        duration: float | None = None) -> Entry:
    """Block `name` (replacing any entry it already has), for `duration` seconds or until removed."""
    _check_kind(kind)
    now = time.time()
    entry = Entry(kind, name, reason, by, now, now + duration if duration else None)
    key = entry_key(kind, name)
    pipe = r.pipeline()  # MULTI: the entry, its index and the log line land together
    pipe.delete(key)
    pipe.hset(key, mapping={"reason": reason, "added_by": by, "added_at": repr(now),
                            "expires_at": repr(entry.expires_at) if duration else ""})
    if duration:
        pipe.pexpire(key, max(1, round(duration * 1000)))  # relative: immune to clock skew with Redis
    pipe.sadd(INDEX, f"{kind}:{name}")
    _log(pipe, "add", entry)
    pipe.execute()
    return entry


def remove(r: redis.Redis, kind: str, name: str, *, by: str = "admin") -> bool:
    """Unblock `name`; False when it was not blocked (never added, removed, or expired)."""
    _check_kind(kind)
    pipe = r.pipeline()
    pipe.delete(entry_key(kind, name))
    pipe.srem(INDEX, f"{kind}:{name}")
    deleted, _ = pipe.execute()
    if deleted:
        _log(r, "remove", Entry(kind, name, "", by, time.time(), None))
    return bool(deleted)


def entries(r: redis.Redis) -> list[Entry]:
    """Every current entry, oldest first. Expired entries are dropped from the index on the way."""
    subjects = sorted(r.smembers(INDEX))
    pipe = r.pipeline(transaction=False)
    for subject in subjects:
        pipe.hgetall(entry_key(*subject.split(":", 1)))
    found, expired = [], []
    for subject, fields in zip(subjects, pipe.execute()):
        kind, name = subject.split(":", 1)
        if not fields:
            expired.append(subject)
            continue
        found.append(Entry(kind, name, fields.get("reason", ""), fields.get("added_by", ""),
                           float(fields.get("added_at") or 0), _float_or_none(fields.get("expires_at"))))
    if expired:
        r.srem(INDEX, *expired)
    return sorted(found, key=lambda e: e.added_at)


def log(r: redis.Redis, count: int = 50) -> list[dict[str, str]]:
    """The last `count` changes, oldest first: {time, action, kind, name, reason, by, expires_at}."""
    rows = []
    for entry_id, fields in reversed(r.xrevrange(LOG, count=count)):
        rows.append({"time": str(int(entry_id.split("-")[0]) / 1000), **fields})
    return rows


def _log(client, action: str, entry: Entry) -> None:
    client.xadd(LOG, {"action": action, "kind": entry.kind, "name": entry.name, "reason": entry.reason,
                      "by": entry.added_by, "expires_at": repr(entry.expires_at) if entry.expires_at else ""},
                maxlen=LOG_MAXLEN, approximate=True)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"blocklist kind must be one of {KINDS}, not {kind!r}")


def _float_or_none(value: str | None) -> float | None:
    return float(value) if value else None
