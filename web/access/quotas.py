"""Per-key quotas on what one tenant holds at once: jobs queued or running, requests held open
(streams and synchronous waits), active batches, and stored files (count and bytes).

Each quota is a sorted set per owner (`web/access/ownership.py`'s scope) in Redis, so every web
process counts into the same place: a member per held thing, scored by the time it lapses on its own.
Taking a place is one Lua script (drop what lapsed, refuse at the cap, add), so concurrent requests
never overshoot. A member is given back when its holder knows it ended (a stream closes, a file is
deleted, a request that followed its job saw the job end); what ends unseen (a polled job on a
worker, a batch in the dispatcher) lapses at its deadline or is dropped when the owner reaches the
cap and `ended` says it is over. A crashed web process's holds lapse after a few keepalive periods:
an open hold is refreshed as it runs.
"""
from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from web.settings import Settings
from worker.protocol import APIError

# KEYS[1]: the set; KEYS[2]: its sizes hash (or a dummy). ARGV: now, cap (0: none), member, lapses at,
# size, byte cap (0: none). Returns {1, 0} when taken, else {0, seconds until the earliest lapse}.
TAKE = """
local now, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #lapsed > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(lapsed))
end
local size, byte_cap = tonumber(ARGV[5]), tonumber(ARGV[6])
local held = redis.call('ZCARD', KEYS[1])
local used = 0
if byte_cap > 0 then
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(v) end
end
if (cap > 0 and held >= cap) or (byte_cap > 0 and used + size > byte_cap) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = 1
  if first[2] then wait = math.max(1, math.ceil(tonumber(first[2]) - now)) end
  return {0, wait}
end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
if size > 0 then redis.call('HSET', KEYS[2], ARGV[3], size) end
local longest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(longest[2])) + 1)
redis.call('EXPIREAT', KEYS[2], math.ceil(tonumber(longest[2])) + 1)
return {1, 0}
"""


def take_reply(out: list) -> tuple[bool, int]:
    """What a take script's reply says: taken, else the seconds until the earliest place lapses."""
    return bool(out[0]), int(out[1])


@dataclass(frozen=True)
class Quota:
    """One kind of thing a key holds, e.g. `jobs`: at most `cap` at once (0: no limit), and for files
    at most `byte_cap` bytes in all."""
    kind: str
    cap: int
    what: str  # how a 429 names it, e.g. "jobs queued or running"
    byte_cap: int = 0

    def key(self, owner: str) -> str:
        return f"nanoserve:quota:{self.kind}:{owner}"

    def sizes_key(self, owner: str) -> str:
        return f"nanoserve:quota:{self.kind}:{owner}:bytes"

    def take(self, r: redis.Redis, owner: str, member: str, lapses_at: float, size: int = 0,
             ended: Callable[[list[str]], Iterable[str]] | None = None) -> None:
        """Hold one place for `member` until `lapses_at` (unix seconds), or raise the 429. At the cap,
        `ended` (given the members) names those that are over, and the take is tried once more."""
        if not self.cap and not self.byte_cap:
            return
        taken, wait = self._take(r, owner, member, lapses_at, size)
        if not taken:
            self.take_at_cap(r, owner, member, lapses_at, wait, size, ended)

    def take_at_cap(self, r: redis.Redis, owner: str, member: str, lapses_at: float, wait: int, size: int = 0,
                    ended: Callable[[list[str]], Iterable[str]] | None = None) -> None:
        """`take` once its first try found the cap reached (`wait`: what that try said)."""
        taken = False
        if ended is not None:
            over = list(ended(r.zrange(self.key(owner), 0, -1)))
            if over:
                self.give_back(r, owner, *over)
            # taken again even when nothing read here was over: another request of this owner at the
            # cap may have given back what ended between the first take and the read
            taken, wait = self._take(r, owner, member, lapses_at, size)
        if not taken:
            raise self.exceeded(wait, size)

    def force(self, r: redis.Redis, owner: str, member: str, lapses_at: float, size: int = 0) -> None:
        """Count `member` whatever the cap (what the server writes for the owner, e.g. a batch's
        output file): it counts against the owner's next request instead."""
        if self.cap or self.byte_cap:
            self._take(r, owner, member, lapses_at, size, force=True)

    def refresh(self, r: redis.Redis, owner: str, member: str, lapses_at: float) -> None:
        if self.cap:
            r.zadd(self.key(owner), {member: lapses_at}, xx=True)

    def give_back(self, r: redis.Redis, owner: str, *members: str) -> None:
        with r.pipeline(transaction=True) as pipe:
            self.queue_give_back(pipe, owner, *members)
            if len(pipe):
                pipe.execute()

    def queue_give_back(self, pipe: redis.client.Pipeline, owner: str, *members: str, sized: bool = True) -> None:
        """`give_back`'s commands, queued on `pipe` (to go with other commands in one round trip);
        `sized=False`: the members were taken without a size."""
        if members and (self.cap or self.byte_cap):
            pipe.zrem(self.key(owner), *members)
            if sized:
                pipe.hdel(self.sizes_key(owner), *members)

    def _take(self, r: redis.Redis, owner: str, member: str, lapses_at: float, size: int,
              force: bool = False) -> tuple[bool, int]:
        keys, args = self.take_call(owner, member, lapses_at, size, force)
        return take_reply(r.register_script(TAKE)(keys=keys, args=args))

    def take_call(self, owner: str, member: str, lapses_at: float, size: int = 0,
                  force: bool = False) -> tuple[list, list]:
        """`TAKE`'s keys and arguments (web/api/admission.py runs it among other scripts)."""
        cap, byte_cap = (0, 0) if force else (self.cap, self.byte_cap)
        return [self.key(owner), self.sizes_key(owner)], [time.time(), cap, member, lapses_at, size, byte_cap]

    def exceeded(self, wait_s: int, size: int = 0) -> APIError:
        if self.byte_cap and size:
            limit = f"at most {self.cap} files and {self.byte_cap} bytes stored"
        else:
            limit = f"at most {self.cap} {self.what} at once"
        # Waiting longer than a minute is the client's decision: say how long, but keep the hint short.
        retry = max(1, min(wait_s, 60))
        return APIError(429, f"This API key holds too many {self.what} ({limit}); wait for some to end or "
                        f"remove some, then try again.", "rate_limit_error", None, "quota_exceeded",
                        {"Retry-After": str(retry)})


def quota(settings: Settings, kind: str) -> Quota:
    """The quota `kind` (jobs, open, batches, files) with these settings' limits."""
    s = settings
    return {"jobs": Quota("jobs", s.key_max_jobs, "completions queued or running"),
            "open": Quota("open", s.key_max_open, "open streams and waiting requests"),
            "batches": Quota("batches", s.key_max_batches, "batches in progress"),
            "files": Quota("files", s.key_max_files, "stored files", s.key_max_stored_bytes)}[kind]


class Hold:
    """A request held open (a stream or a synchronous wait) in its key's `open` quota: taken when it
    starts, refreshed while it runs, given back when it ends.

    The job it follows (`follow`) has a place of the same owner's in another quota (`jobs`): once the
    request has seen the job end (`job_ended`), the release gives that place back too, in the same
    round trip, rather than leaving it to lapse or to be found over at the owner's cap; so does
    what `with_release` queued (the settle of the request's tokens)."""

    def __init__(self, r: redis.Redis, quota: Quota, owner: str, stale_s: float, take: bool = True):
        """`take=False`: the place is taken by `take_call`'s script (web/api/admission.py)."""
        self.r, self.quota, self.owner, self.stale_s = r, quota, owner, stale_s
        self.member = secrets.token_hex(8)
        self._refreshed = time.monotonic()
        self._job: tuple[Quota, str] | None = None
        self._job_ended = False
        self._also: list[Callable[[redis.client.Pipeline], None]] = []
        if take:
            quota.take(r, owner, self.member, time.time() + stale_s)

    def take_call(self) -> tuple[list, list] | None:
        """The take's script keys and arguments; None where the quota has no cap (nothing to take)."""
        if not self.quota.cap:
            return None
        return self.quota.take_call(self.owner, self.member, time.time() + self.stale_s)

    def follow(self, quota: Quota, member: str) -> None:
        self._job = (quota, member)

    def job_ended(self) -> None:
        self._job_ended = True

    def with_release(self, queue: Callable[[redis.client.Pipeline], None]) -> None:
        """`queue(pipe)` queues its commands on the release's pipeline, to go in its round trip."""
        self._also.append(queue)

    def refresh(self) -> None:
        """Push the lapse back; cheap to call often (a round trip at most every third of stale_s)."""
        if time.monotonic() - self._refreshed >= self.stale_s / 3:
            self._refreshed = time.monotonic()
            try:
                self.quota.refresh(self.r, self.owner, self.member, time.time() + self.stale_s)
            except redis.RedisError:
                pass  # the stream itself reports Redis trouble; the hold lapses on its own

    def release(self) -> None:
        try:
            with self.r.pipeline(transaction=False) as pipe:  # each place given back is whole on its own
                self.quota.queue_give_back(pipe, self.owner, self.member, sized=False)
                if self._job is not None and self._job_ended:  # a job's place is taken without a size too
                    quota, member = self._job
                    quota.queue_give_back(pipe, self.owner, member, sized=False)
                also, self._also = self._also, []  # queued once, however often it is released
                for queue in also:
                    queue(pipe)
                if len(pipe):
                    pipe.execute()
        except redis.RedisError:
            pass


def deadline(seconds: float) -> float:
    """Unix time `seconds` from now (inf-safe)."""
    return time.time() + (seconds if math.isfinite(seconds) else 10 * 365 * 86400)
