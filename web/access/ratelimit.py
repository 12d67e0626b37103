"""Rate limits as token buckets in Redis: requests per minute (rpm) and tokens per minute (tpm).

A bucket holds at most one minute's allowance and refills continuously (60 rpm gives back one
request a second), so `x-ratelimit-reset-*` is the time until it is full again. A request takes one
request and `cost` tokens (prompt + max_tokens) from every bucket that applies to it, all or nothing;
`settle` later gives back what the completion did not use. Both run as Lua scripts, so they are
atomic across every web process and use Redis's clock.

The reservation script also takes *gate* keys (blocklist entries): if any of them exists the request
is refused before anything is reserved. That makes the blocklist check and the reservation a single
round trip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import redis

# KEYS: gate keys (ARGV[1] of them), then bucket keys.
# ARGV: ngate, cost, then rpm and tpm for each bucket (0: no limit in that dimension).
# Returns {-1, gate index} when a gate key exists, else {allowed (0/1), retry_ms, then for each
# bucket: remaining requests, remaining tokens, reset_requests_ms, reset_tokens_ms, refusal}
# with refusal 0: fine, 1: out of requests, 2: out of tokens, 3: cost larger than the whole tpm.
RESERVE = """
local ngate = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
for i = 1, ngate do
  if redis.call('EXISTS', KEYS[i]) == 1 then return {-1, i} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local buckets = {}
local allowed, retry_ms = 1, 0
for j = ngate + 1, #KEYS do
  local n = j - ngate
  local rpm, tpm = tonumber(ARGV[1 + 2 * n]), tonumber(ARGV[2 + 2 * n])
  local saved = redis.call('HMGET', KEYS[j], 'req', 'tok', 'ts')
  local elapsed = math.max(0, now - (tonumber(saved[3]) or now))
  local req = math.min(rpm, (tonumber(saved[1]) or rpm) + elapsed * rpm / 60000)
  local tok = math.min(tpm, (tonumber(saved[2]) or tpm) + elapsed * tpm / 60000)
  local refusal = 0
  if tpm > 0 and cost > tpm then
    refusal = 3
  elseif rpm > 0 and req < 1 then
    refusal = 1
    retry_ms = math.max(retry_ms, (1 - req) * 60000 / rpm)
  elseif tpm > 0 and tok < cost then
    refusal = 2
    retry_ms = math.max(retry_ms, (cost - tok) * 60000 / tpm)
  end
  if refusal > 0 then allowed = 0 end
  buckets[n] = {rpm, tpm, req, tok, refusal}
end
local out = {allowed, math.ceil(retry_ms)}
for n, b in ipairs(buckets) do
  local rpm, tpm, req, tok, refusal = b[1], b[2], b[3], b[4], b[5]
  if allowed == 1 then
    if rpm > 0 then req = req - 1 end
    if tpm > 0 then tok = tok - cost end
    redis.call('HSET', KEYS[ngate + n], 'req', tostring(req), 'tok', tostring(tok), 'ts', now)
    -- from empty to full takes one minute: an idle bucket is simply a missing key
    redis.call('PEXPIRE', KEYS[ngate + n], 61000)
  end
  local reset_req, reset_tok = 0, 0
  if rpm > 0 then reset_req = (rpm - req) * 60000 / rpm end
  if tpm > 0 then reset_tok = (tpm - tok) * 60000 / tpm end
  table.insert(out, math.floor(math.max(req, 0)))
  table.insert(out, math.floor(math.max(tok, 0)))
  table.insert(out, math.ceil(reset_req))
  table.insert(out, math.ceil(reset_tok))
  table.insert(out, refusal)
end
return out
"""

# KEYS: bucket keys; ARGV[1]: tokens to give back (negative: take more). A missing bucket is full.
_SETTLE = """
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('HINCRBYFLOAT', key, 'tok', ARGV[1]) end
end
return 0
"""

REFUSALS = {1: "requests", 2: "tokens", 3: "too_large"}


@dataclass(frozen=True)
class Bucket:
    key: str  # Redis key of its state
    rpm: int  # 0: no request limit
    tpm: int  # 0: no token limit


@dataclass
class BucketState:
    bucket: Bucket
    remaining_requests: int
    remaining_tokens: int
    reset_requests_ms: int
    reset_tokens_ms: int
    refused: str | None  # None, "requests", "tokens" or "too_large"


@dataclass
class Reservation:
    allowed: bool
    blocked_by: int | None = None  # index into the gate keys of the entry that refused the request
    retry_after_ms: int = 0
    states: list[BucketState] = field(default_factory=list)

    @property
    def refused(self) -> list[BucketState]:
        return [s for s in self.states if s.refused]

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers, from the tightest bucket in each dimension."""
        return {**_dimension_headers("requests", [(s.bucket.rpm, s.remaining_requests, s.reset_requests_ms)
                                                  for s in self.states]),
                **_dimension_headers("tokens", [(s.bucket.tpm, s.remaining_tokens, s.reset_tokens_ms)
                                                for s in self.states])}


def _dimension_headers(dimension: str, buckets: list[tuple[int, int, int]]) -> dict[str, str]:
    """The headers of one dimension from each bucket's (limit, remaining, reset ms): the bucket with
    the least left among those limited in it; none when no bucket is."""
    limited = [bucket for bucket in buckets if bucket[0] > 0]
    if not limited:
        return {}
    limit, remaining, reset_ms = min(limited, key=lambda bucket: bucket[1])
    return {f"x-ratelimit-limit-{dimension}": str(limit), f"x-ratelimit-remaining-{dimension}": str(remaining),
            f"x-ratelimit-reset-{dimension}": reset_header(reset_ms)}


def reserve(r: redis.Redis, buckets: list[Bucket], cost: int, gates: list[str] = ()) -> Reservation:
    """Take one request and `cost` tokens from every bucket, unless a gate key exists or a bucket is short."""
    keys, args = reserve_call(buckets, cost, gates)
    return reservation(r.register_script(RESERVE)(keys=keys, args=args), buckets)


def reserve_call(buckets: list[Bucket], cost: int, gates: list[str] = ()) -> tuple[list, list]:
    """`reserve`'s script keys and arguments (web/api/admission.py runs `RESERVE` among other scripts)."""
    return [*gates, *(b.key for b in buckets)], [len(gates), cost] + [n for b in buckets for n in (b.rpm, b.tpm)]


def reservation(out: list, buckets: list[Bucket]) -> Reservation:
    """The Reservation a `reserve_call`'s reply says."""
    if out[0] == -1:
        return Reservation(False, blocked_by=out[1] - 1)
    states = []
    for n, bucket in enumerate(buckets):
        req, tok, reset_req, reset_tok, refusal = out[2 + 5 * n: 7 + 5 * n]
        states.append(BucketState(bucket, req, tok, reset_req, reset_tok, REFUSALS.get(refusal)))
    return Reservation(bool(out[0]), None, out[1], states)


def settle(r: redis.Redis, buckets: list[Bucket], refund: int) -> None:
    """Give `refund` tokens back to the token-limited buckets (negative: charge the excess)."""
    keys = _token_keys(buckets)
    if keys and refund:
        r.register_script(_SETTLE)(keys=keys, args=[refund])


def queue_settle(pipe: redis.client.Pipeline, buckets: list[Bucket], refund: int) -> None:
    """`settle`, queued on a pipeline (EVAL: a script object in a pipeline costs a round trip of its
    own to check that Redis has it)."""
    keys = _token_keys(buckets)
    if keys and refund:
        pipe.eval(_SETTLE, len(keys), *keys, refund)


def _token_keys(buckets: list[Bucket]) -> list[str]:
    return [b.key for b in buckets if b.tpm > 0]


def reset_header(ms: int) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6.5s`, `1m30s`."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m" + (f"{rest:.3f}".rstrip("0").rstrip(".") or "0") + "s"


def retry_after_seconds(ms: int) -> int:
    """`Retry-After` in whole seconds, at least 1; a bucket refills within a minute, so at most 60."""
    return max(1, math.ceil(ms / 1000))
