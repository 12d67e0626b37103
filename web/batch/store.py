"""Batches in Redis: the record OpenAI's batch object is read from, its lines, and the bookkeeping
that makes every line land in the output (or error) file exactly once.

Keys of one batch (`nanoserve:batch:<id>`…):
    (hash)       the record: status and its timestamps, counts, files, owner, caller, cursor `next`
    :lines       (list) the validated requests, `{"custom_id", "body"}` each, in file order
    :inflight    (hash) line index → its job (`{"job", "reserved", "user", "queued"}`) while it runs
    :done        (set) indices already written to the output or error file: the idempotency key
    :output, :errors  (strings) the two result files as they grow
    :lease       (string) which dispatcher drives the batch (web/batch/dispatcher.py)
plus `nanoserve:batches:active` (ids not yet finished) and the listings (sorted sets, creation order):
`nanoserve:batches:<owner>` and `nanoserve:batches:all` (the admin CLI's).

Statuses: validating → in_progress → finalizing → completed; validating → failed; in_progress →
expired (once the window has passed: `ending` is set while its running lines are stopped);
validating | in_progress → cancelling → cancelled. Every transition and every line result is one Lua
script or one MULTI, so a dispatcher killed at any point leaves a state the next one continues from:

- `claim` moves the cursor and records the line's job in one step; a line is claimed once.
- `record` writes a line's result, counts it and forgets its job in one step, only if its index was
  not yet in `:done`; a result seen twice (a dispatcher that died after writing it, two dispatchers
  racing on a lease that expired) is written once.
- `finish` turns the result strings into files and the batch into its final status in one MULTI,
  which WATCH aborts if a result is written meanwhile.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from web.access.quotas import Quota
from web.batch import files as file_store
from web.batch import listing
from web.batch.input import BatchError

ACTIVE = "nanoserve:batches:active"
ALL = "nanoserve:batches:all"
_SEQ = "nanoserve:batches:seq"

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
FINAL = ("failed", "completed", "expired", "cancelled")
_TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")


def batch_key(batch_id: str, part: str = "") -> str:
    return f"nanoserve:batch:{batch_id}" + (f":{part}" if part else "")


def listing_key(owner: str) -> str:
    return f"nanoserve:batches:{owner}"


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


@dataclass
class Batch:
    id: str
    owner: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    caller: dict[str, Any] = field(default_factory=dict)  # who runs the lines (web/access Caller fields)
    metadata: dict[str, str] | None = None
    output_expires_after: int | None = None  # seconds the result files live (None: the files' default)
    model: str | None = None
    errors: list[dict] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    next: int = 0  # index of the first line not yet claimed
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, those the worker's prefix cache held
    ending: str = ""  # "expired" while an expired batch's running lines are being stopped
    times: dict[str, int | None] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def stopping(self) -> bool:
        """No more lines start: cancelled, or past its window."""
        return self.status == "cancelling" or self.ending == "expired"

    def to_object(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        times = {name: self.times.get(name) for name in _TIMESTAMPS}
        times.update(created_at=self.created_at, expires_at=self.expires_at)
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            **times,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
            "metadata": self.metadata,
        }

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> "Batch":
        f = {k.decode(): v.decode() for k, v in raw.items()}

        def number(name: str) -> int | None:
            return int(f[name]) if f.get(name) else None

        def loaded(name: str) -> Any:
            return json.loads(f[name]) if f.get(name) else None

        return cls(
            id=f["id"], owner=f["owner"], status=f["status"], endpoint=f["endpoint"],
            input_file_id=f["input_file_id"], completion_window=f["completion_window"],
            created_at=int(f["created_at"]), expires_at=int(f["expires_at"]), caller=loaded("caller") or {},
            metadata=loaded("metadata"), output_expires_after=number("output_expires_after"),
            model=f.get("model") or None, errors=loaded("errors"), output_file_id=f.get("output_file_id") or None,
            error_file_id=f.get("error_file_id") or None, total=number("total") or 0,
            completed=number("completed") or 0, failed=number("failed") or 0, next=number("next") or 0,
            input_tokens=number("input_tokens") or 0, output_tokens=number("output_tokens") or 0,
            cached_tokens=number("cached_tokens") or 0,
            ending=f.get("ending", ""), times={name: number(name) for name in _TIMESTAMPS})


# KEYS: record. ARGV: allowed statuses (comma-separated), new status, its timestamp field, now, then
# field/value pairs to set as well. Refused (0) unless the status is one of the allowed ones and no
# expiry is under way.
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == status then allowed = true end end
if not allowed or (redis.call('HGET', KEYS[1], 'ending') or '') ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: record, inflight. ARGV: index, max in flight, job info. The line at the cursor starts (1) if
# the batch runs, the cursor is at `index`, and fewer than `max` lines are in flight.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
if (redis.call('HGET', KEYS[1], 'ending') or '') ~= '' then return 0 end
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next'))
if nxt ~= tonumber(ARGV[1]) or nxt >= tonumber(redis.call('HGET', KEYS[1], 'total')) then return 0 end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'next', 1)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# KEYS: record, inflight, done, result string. ARGV: index, line, counter, input tokens, output
# tokens, input tokens from the prefix cache. Writes the line once (1), or nothing (0) when it was written before or the batch is over.
_RECORD = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'failed' or status == 'completed' or status == 'expired' or status == 'cancelled' then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('APPEND', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[6])
return 1
"""

# KEYS: lease. ARGV: token, ttl ms. Take the lease if free, or extend it if it is ours.
_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Inflight:
    """A claimed line's job."""
    index: int
    job_id: str
    reserved: int  # tokens taken from the caller's rate limits when it started
    user: str | None
    queued: bool  # False until the job is on the queue (a dispatcher may die in between)

    def to_json(self) -> str:
        return json.dumps({"job": self.job_id, "reserved": self.reserved, "user": self.user, "queued": self.queued})

    @classmethod
    def from_json(cls, index: int, raw: bytes | str) -> "Inflight":
        d = json.loads(raw)
        return cls(index, d["job"], d["reserved"], d["user"], d["queued"])


class BatchStore:
    def __init__(self, client: redis.Redis, files: file_store.FileStore, record_ttl_s: int = file_store.MAX_EXPIRES_AFTER,
                 quota: Quota | None = None):
        self.redis = client  # bytes
        self.files = files
        self.quota = quota or Quota("batches", 0, "batches in progress")  # an owner's batches not yet ended
        self.record_ttl_s = record_ttl_s  # how long a finished batch stays listed
        self._transition = client.register_script(_TRANSITION)
        self._claim = client.register_script(_CLAIM)
        self._record = client.register_script(_RECORD)
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)

    # ---- the record ----

    def create(self, *, owner: str, caller: dict[str, Any], input_file_id: str, endpoint: str,
               completion_window: str, window_s: int, metadata: dict[str, str] | None,
               output_expires_after: int | None) -> Batch:
        now = int(time.time())
        batch = Batch(id=new_batch_id(), owner=owner, status="validating", endpoint=endpoint,
                      input_file_id=input_file_id, completion_window=completion_window, created_at=now,
                      expires_at=now + window_s, caller=caller, metadata=metadata,
                      output_expires_after=output_expires_after)
        fields = {"id": batch.id, "owner": owner, "status": batch.status, "endpoint": endpoint,
                  "input_file_id": input_file_id, "completion_window": completion_window, "created_at": now,
                  "expires_at": batch.expires_at, "caller": json.dumps(caller),
                  "metadata": json.dumps(metadata) if metadata is not None else "",
                  "output_expires_after": output_expires_after or "", "total": 0, "completed": 0, "failed": 0,
                  "next": 0, "input_tokens": 0, "output_tokens": 0, "ending": ""}
        # a batch holds its owner's place until it ends, or at the latest a day past its window
        self.quota.take(self.redis, owner, batch.id, batch.expires_at + 86400, ended=self._ended)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(batch.id), mapping=fields)
            pipe.sadd(ACTIVE, batch.id)
            listing.add(pipe, _SEQ, [listing_key(owner), ALL], batch.id)
            pipe.execute()
        return batch

    def _ended(self, batch_ids: list) -> list:
        """Those of these batches that ended (or whose record is gone), in one round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hget(batch_key(batch_id.decode() if isinstance(batch_id, bytes) else batch_id), "status")
            statuses = pipe.execute()
        return [b for b, status in zip(batch_ids, statuses) if status is None or status.decode() in FINAL]

    def get(self, batch_id: str) -> Batch | None:
        raw = self.redis.hgetall(batch_key(batch_id))
        return Batch.from_hash(raw) if raw else None

    def list(self, owner: str | None, *, after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
        """Batches newest first (the owner's, or everyone's for None), those after `after`, up to
        `limit`; and whether there are more."""
        return listing.page(self.redis, listing_key(owner) if owner is not None else ALL, batch_key,
                            Batch.from_hash, after=after, limit=limit)

    def active(self) -> list[str]:
        return sorted(m.decode() for m in self.redis.smembers(ACTIVE))

    def forget(self, batch_id: str) -> None:
        """Drop an id from the active set (its record is gone or already final)."""
        self.redis.srem(ACTIVE, batch_id)

    # ---- transitions ----

    def _move(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields: Any) -> bool:
        stamp = f"{status}_at" if f"{status}_at" in _TIMESTAMPS else ""
        args = [",".join(allowed), status, stamp, int(time.time())]
        for name, value in fields.items():
            args += [name, value]
        return bool(self._transition(keys=[batch_key(batch_id)], args=args))

    def start(self, batch_id: str, lines: list[str], model: str) -> bool:
        """A validated batch starts running its lines (False: it was cancelled meanwhile)."""
        key = batch_key(batch_id, "lines")
        self.redis.delete(key)
        for start in range(0, len(lines), 1000):
            self.redis.rpush(key, *lines[start:start + 1000])
        return self._move(batch_id, ("validating",), "in_progress", total=len(lines), model=model)

    def fail(self, batch_id: str, errors: list[BatchError]) -> bool:
        """The input was not usable: the batch fails with the reasons, nothing runs."""
        if not self._move(batch_id, ("validating",), "failed",
                          errors=json.dumps([e.to_object() for e in errors])):
            return False
        self._retire(batch_id)
        return True

    def request_cancel(self, batch_id: str) -> bool:
        """validating | in_progress → cancelling (False: it was past that point already)."""
        return self._move(batch_id, ("validating", "in_progress"), "cancelling")

    def begin_expiry(self, batch_id: str) -> bool:
        """The window has passed: no more lines start, the running ones are stopped."""
        return bool(self.redis.eval(
            "if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end "
            "redis.call('HSET', KEYS[1], 'ending', 'expired') return 1", 1, batch_key(batch_id)))

    def finish(self, batch_id: str) -> Batch | None:
        """Every line has its result: create the output and error files and take the final status
        (completed, cancelled or expired) in one transaction. None if another dispatcher finished it."""
        record = batch_key(batch_id)
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(record)
                    raw = pipe.hgetall(record)
                    if not raw:
                        return None
                    batch = Batch.from_hash(raw)
                    if batch.finished:
                        return None
                    sizes = {part: pipe.strlen(batch_key(batch_id, part)) for part in ("output", "errors")}
                    final = ("expired" if batch.ending == "expired" else
                             "cancelled" if batch.status == "cancelling" else "completed")
                    now = int(time.time())
                    pipe.multi()
                    fields: dict[str, Any] = {"status": final, f"{final}_at": now, "ending": ""}
                    if final == "completed" and batch.status != "finalizing":
                        fields["finalizing_at"] = now
                    for part, name in (("output", "output_file_id"), ("errors", "error_file_id")):
                        if sizes[part]:
                            suffix = "output" if part == "output" else "error"
                            stored = self.files.adopt(pipe, batch_key(batch_id, part), sizes[part], batch.owner,
                                                      f"{batch_id}_{suffix}.jsonl", batch.output_expires_after)
                            fields[name] = stored.id
                    pipe.hset(record, mapping=fields)
                    pipe.execute()
                except redis.WatchError:
                    continue  # a result landed meanwhile: count it too
            break
        self._retire(batch_id)
        return self.get(batch_id)

    def _retire(self, batch_id: str) -> None:
        """A finished batch keeps its record (for `record_ttl_s`) and nothing else."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*(batch_key(batch_id, part) for part in ("lines", "inflight", "done", "lease")))
            pipe.srem(ACTIVE, batch_id)
            pipe.expire(batch_key(batch_id), self.record_ttl_s)
            pipe.execute()

    def mark_finalizing(self, batch_id: str) -> bool:
        return self._move(batch_id, ("in_progress",), "finalizing")

    # ---- lines ----

    def line(self, batch_id: str, index: int) -> dict[str, Any] | None:
        raw = self.redis.lindex(batch_key(batch_id, "lines"), index)
        return json.loads(raw) if raw is not None else None

    def lines(self, batch_id: str, start: int, stop: int) -> list[dict[str, Any]]:
        """Lines start..stop-1."""
        if stop <= start:
            return []
        return [json.loads(raw) for raw in self.redis.lrange(batch_key(batch_id, "lines"), start, stop - 1)]

    def claim(self, batch_id: str, inflight: Inflight, max_inflight: int) -> bool:
        return bool(self._claim(keys=[batch_key(batch_id), batch_key(batch_id, "inflight")],
                                args=[inflight.index, max_inflight, inflight.to_json()]))

    def mark_queued(self, batch_id: str, inflight: Inflight) -> None:
        queued = Inflight(inflight.index, inflight.job_id, inflight.reserved, inflight.user, True)
        # HSETXX: only while the line is still in flight (its result may already be in)
        self.redis.eval("if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then "
                        "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end", 1,
                        batch_key(batch_id, "inflight"), inflight.index, queued.to_json())

    def inflight(self, batch_id: str) -> list[Inflight]:
        raw = self.redis.hgetall(batch_key(batch_id, "inflight"))
        return sorted((Inflight.from_json(int(k), v) for k, v in raw.items()), key=lambda i: i.index)

    def record(self, batch_id: str, index: int, line: dict[str, Any], ok: bool, input_tokens: int = 0,
               output_tokens: int = 0, client: redis.client.Pipeline | None = None, cached_tokens: int = 0) -> bool:
        """Write one line's result to the output (`ok`) or error file, once (on `client`, a
        pipeline, the answer comes with its `execute()`)."""
        part = "output" if ok else "errors"
        keys = [batch_key(batch_id), batch_key(batch_id, "inflight"), batch_key(batch_id, "done"),
                batch_key(batch_id, part)]
        text = json.dumps(line, separators=(",", ":")) + "\n"
        args = [index, text, "completed" if ok else "failed", input_tokens, output_tokens, cached_tokens]
        written = self._record(keys=keys, args=args, client=client)
        return client is None and bool(written)

    # ---- leases ----

    def take_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self._lease(keys=[batch_key(batch_id, "lease")], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, batch_id: str, token: str) -> None:
        self._release(keys=[batch_key(batch_id, "lease")], args=[token])
