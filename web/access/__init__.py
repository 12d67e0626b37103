"""The single seam between the request path and access control: API keys, the user blocklist,
rate limits and automatic abuse bans.

The completions/jobs routes call, in this order:
    caller = authenticate(request)                       # 401 missing/wrong key (when required)
    grant = admit(caller, user, reserved_tokens)         # 403 blocked, 429 over a limit
    ... run the request ...
    settle(grant, used_tokens)                           # correct the token reservation
and `rate_limit_headers(grant)` gives the `x-ratelimit-*` headers added to the response.
`record_invalid(caller, user)` is called for every 400 so repeated invalid requests can earn a ban.
`/metrics` calls `authorize_metrics(request)`. What a caller creates (jobs, files, batches) belongs
to it: see `web/access/ownership.py`.

A batch's lines (web/batch/dispatcher.py) run later, in the name of the batch's creator: each line
is admitted with `admit(caller_for(key_id, address), user, reserved, strike=False)` as it starts and
settled with `settle(grant_for(caller, user, reserved), used)` when it ends, whichever web process
that happens in.

Cost on the request path: `authenticate` is one Redis round trip when keys are required (none when
not); `admit` is one (blocklist entries of the key and the user, and the rate-limit reservation, in
one Lua script), and none of its own for a completion, whose admission runs its script with the
queue's and the quotas' (`admission_call`, `granted`: web/api/admission.py); `settle` is one.
Nothing is cached in the process, so a revoked key or a new blocklist entry takes effect on the very
next request in every web process. Redis being down raises redis.ConnectionError, which the app
answers with 503.

Settings: `auth_required`, `metrics_auth_required`, `key_rpm`/`key_tpm` (keys created without their
own limits, and anonymous callers per client address), `user_rpm`/`user_tpm` (per end user), and the
abuse thresholds, all in web/settings.py (NANOSERVE_AUTH, NANOSERVE_KEY_RPM, …). 0 means no limit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from flask import Flask, Request, current_app, g

from web import redis_pool
from web.access import abuse, blocklist, keys, quotas, ratelimit
from web.settings import Settings
from worker.protocol import APIError

log = logging.getLogger(__name__)

EXTENSION = "nanoserve.access"

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY). An administrator can create one "
               "with `flask --app wsgi keys create NAME`.")


@dataclass
class Caller:
    key_name: str | None = None  # None: anonymous (auth disabled)
    key_id: str | None = None  # the key's lookup id: what the caller's jobs belong to
    rpm: int = 0  # this caller's limits (0: none)
    tpm: int = 0
    address: str | None = None  # anonymous callers are rate-limited per client address


@dataclass
class Grant:
    caller: Caller
    user: str | None
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    buckets: list[ratelimit.Bucket] = field(default_factory=list)
    settled: bool = False


@dataclass
class _State:
    settings: Settings
    redis: redis.Redis


def init_app(app: Flask, settings: Settings) -> None:
    """Open the Redis client of access control (strings, not bytes)."""
    app.extensions[EXTENSION] = _State(settings, redis_pool.client(settings.redis_url, decode_responses=True))


def _state() -> _State:
    return current_app.extensions[EXTENSION]


def redis_client() -> redis.Redis:
    """This app's Redis client for access control (strings, not bytes)."""
    return _state().redis


# ---- the seam ----

def authenticate(request: Request) -> Caller:
    """The request's caller, also kept as `g.caller`: what its 400s are struck against."""
    state = _state()
    if not state.settings.auth_required:
        caller = Caller(rpm=state.settings.key_rpm, tpm=state.settings.key_tpm, address=request.remote_addr)
    else:
        caller = _key_caller(_verified_key(request, state), state.settings)
    g.caller = caller
    return caller


def caller_for(key_id: str | None, address: str | None) -> Caller | None:
    """The caller that work ordered earlier runs as, as it is now (a batch's lines run long after the
    request that created the batch): its key with the key's current limits, None once the key is
    revoked; without a key, the anonymous caller of `address`."""
    state = _state()
    if key_id is None:
        return Caller(rpm=state.settings.key_rpm, tpm=state.settings.key_tpm, address=address)
    record = keys.by_id(state.redis, key_id)
    return _key_caller(record, state.settings) if record is not None else None


def _key_caller(record: keys.ApiKey, s: Settings) -> Caller:
    return Caller(record.name, record.id, _or_default(record.rpm, s.key_rpm), _or_default(record.tpm, s.key_tpm))


def authorize_metrics(request: Request) -> None:
    """401 unless /metrics is open (by default: when /v1 is) or the request carries a valid key."""
    state = _state()
    required = state.settings.metrics_auth_required
    if state.settings.auth_required if required is None else required:
        _verified_key(request, state)


# ---- quotas: what one caller holds at once ----

def quota(kind: str) -> quotas.Quota:
    """The caller quota `kind` (jobs, open, batches, files) with this app's limits."""
    return quotas.quota(_state().settings, kind)


def quota_scope(caller: Caller) -> str:
    """Whose quota a caller draws on: its key's, or (keys off) its client address's."""
    return f"key:{caller.key_id}" if caller.key_id else f"addr:{caller.address}"


def hold_open(caller: Caller, take: bool = True) -> quotas.Hold:
    """Count a stream or a synchronous wait against the caller's `open` quota (429 past it);
    `take=False`: its place is taken by its `take_call` (web/api/admission.py)."""
    s = _state().settings
    return quotas.Hold(_state().redis, quota("open"), quota_scope(caller), stale_s=max(30.0, 3 * s.keepalive_s),
                       take=take)


def admit(caller: Caller, user: str | None, reserved_tokens: int, strike: bool = True) -> Grant:
    """`strike=False`: a refusal earns no abuse strike (a batch's dispatcher waiting on its caller's
    limits is no abuse)."""
    reservation = ratelimit.reserve(_state().redis, admission_buckets(caller, user), reserved_tokens,
                                    _gates(caller, user))
    return granted(reservation, caller, user, reserved_tokens, strike)


def admission_call(caller: Caller, user: str | None, reserved_tokens: int) -> tuple[list, list]:
    """`admit`'s reservation script's keys and arguments (web/api/admission.py runs it among others);
    `granted` reads its reply (ratelimit.reservation, with `admission_buckets`)."""
    return ratelimit.reserve_call(admission_buckets(caller, user), reserved_tokens, _gates(caller, user))


def admission_buckets(caller: Caller, user: str | None) -> list[ratelimit.Bucket]:
    """The rate-limit buckets a request of `caller` and `user` draws from."""
    return [bucket for bucket, _, _ in _limits(caller, user, _state().settings)]


def granted(reservation: ratelimit.Reservation, caller: Caller, user: str | None, reserved_tokens: int,
            strike: bool = True) -> Grant:
    """The Grant of an `admission_call`'s reservation, or its 403 or 429 (a strike, with `strike`)."""
    state = _state()
    _check_gate(reservation, _subjects(caller, user))
    limits = _limits(caller, user, state.settings)
    if not reservation.allowed:
        culprits = {bucket.key: subject for bucket, _, subject in limits}
        struck = [culprits[s.bucket.key] for s in reservation.refused if culprits[s.bucket.key]]
        if strike:
            abuse.strike(state.redis, state.settings, "rate_limited", struck)
        raise _rate_limited(reservation, {bucket.key: label for bucket, label, _ in limits}, reserved_tokens)
    return Grant(caller, user, reserved_tokens, reservation.headers(), [bucket for bucket, _, _ in limits])


def _gates(caller: Caller, user: str | None) -> list[str]:
    return [blocklist.entry_key(kind, name) for kind, name in _subjects(caller, user)]


def check_blocked(caller: Caller, user: str | None) -> None:
    """The 403 of `admit` for a blocked key or user, alone: a cheap refusal before costly work."""
    subjects = _subjects(caller, user)
    if subjects:
        _check_gate(ratelimit.reserve(_state().redis, [], 0, _gates(caller, user)), subjects)


def _check_gate(reservation: ratelimit.Reservation, subjects: list[tuple[str, str]]) -> None:
    if reservation.blocked_by is not None:
        kind = subjects[reservation.blocked_by][0]
        what = "This user is" if kind == "user" else "This API key is"
        raise APIError(403, f"{what} blocked from using this service.", "permission_error", code="blocked")


def grant_for(caller: Caller, user: str | None, reserved_tokens: int) -> Grant:
    """The grant of an admission made earlier, maybe by another process (a batch line's), to settle."""
    return Grant(caller, user, reserved_tokens, buckets=[b for b, _, _ in _limits(caller, user, _state().settings)])


def settle(grant: Grant, used_tokens: int, hold: quotas.Hold | None = None) -> None:
    """Correct the grant's token reservation by what the request used; with `hold`, in the round
    trip of its release."""
    if grant is None or grant.settled:
        return
    grant.settled = True
    if hold is not None:
        hold.with_release(lambda pipe: ratelimit.queue_settle(pipe, grant.buckets, grant.reserved_tokens - used_tokens))
        return
    try:
        ratelimit.settle(_state().redis, grant.buckets, grant.reserved_tokens - used_tokens)
    except redis.RedisError:
        # The response is already computed; an unsettled reservation only delays this caller a little.
        log.warning("could not settle the token reservation of %s", grant.caller.key_name, exc_info=True)


def rate_limit_headers(grant: Grant | None) -> dict[str, str]:
    return dict(grant.headers) if grant else {}


def admit_request(caller: Caller) -> Grant:
    """Admission of a request that stores or holds something but spends no tokens (an upload, a
    batch, a stream followed): the blocklist and one request of the caller's rpm."""
    return admit(caller, None, 0)


def record_invalid(caller: Caller | None, user: str | None) -> None:
    """Strike the key and its end user alike: a key sending a fresh `user` each time is still struck."""
    state = _state()
    subjects = _subjects(caller or Caller(), user)
    try:
        abuse.strike(state.redis, state.settings, "invalid", subjects)
    except redis.RedisError:
        log.warning("could not record an invalid request", exc_info=True)


def end_user(key_name: str | None, user: str) -> str:
    """The name an end user is accounted, limited and blocked under: scoped to the key that sends it
    (`<key>:<user>`; key names hold no colon), so one tenant's `user` is never another's."""
    return f"{key_name}:{user}" if key_name else user


# ---- helpers ----

def _verified_key(request: Request, state: _State) -> keys.ApiKey:
    """The record of the request's bearer key, or a 401 worded like OpenAI's."""
    token = _bearer_token(request)
    if not token:
        raise APIError(401, MISSING_KEY, "invalid_request_error")
    record = keys.verify(state.redis, token)
    if record is None:
        raise APIError(401, f"Incorrect API key provided: {_mask(token)}. Ask an administrator for a valid key.",
                       "invalid_request_error", code="invalid_api_key")
    return record


def _rate_limited(reservation: ratelimit.Reservation, labels: dict[str, str], cost: int) -> APIError:
    """The 429 for a refused reservation, worded like OpenAI's, with Retry-After and x-ratelimit-*."""
    headers = reservation.headers()
    s = next((s for s in reservation.refused if s.refused == "too_large"), reservation.refused[0])
    label = labels[s.bucket.key]
    if s.refused == "too_large":
        # It can never fit, so the client must not retry.
        message = (f"Request too large for {label} on tokens per min (TPM): Limit {s.bucket.tpm}, "
                   f"Requested {cost}. Reduce the prompt or max_tokens in order to run successfully.")
        return APIError(429, message, "tokens", code="rate_limit_exceeded",
                        headers={**headers, "x-should-retry": "false"})
    retry_after = ratelimit.retry_after_seconds(reservation.retry_after_ms)
    if s.refused == "requests":
        message = (f"Rate limit reached for {label} on requests per min (RPM): Limit {s.bucket.rpm}, "
                   f"Used {s.bucket.rpm - s.remaining_requests}, Requested 1.")
    else:
        message = (f"Rate limit reached for {label} on tokens per min (TPM): Limit {s.bucket.tpm}, "
                   f"Used {s.bucket.tpm - s.remaining_tokens}, Requested {cost}.")
    return APIError(429, f"{message} Please try again in {retry_after}s.", s.refused, code="rate_limit_exceeded",
                    headers={**headers, "Retry-After": str(retry_after)})


def _subjects(caller: Caller, user: str | None) -> list[tuple[str, str]]:
    """Who a request is accountable to, as blocklist (kind, name): its API key, then its end user."""
    subjects = []
    if caller.key_name:
        subjects.append(("key", caller.key_name))
    if user:
        subjects.append(("user", end_user(caller.key_name, user)))
    return subjects


def _limits(caller: Caller, user: str | None, s: Settings) -> list[tuple[ratelimit.Bucket, str, tuple | None]]:
    """The buckets a request draws from, each with the words naming it in a 429 and the subject that
    earns a strike when it refuses (none for an anonymous client address)."""
    limits = []
    if caller.key_name:
        limits.append((ratelimit.Bucket(f"nanoserve:ratelimit:key:{caller.key_name}", caller.rpm, caller.tpm),
                       f"API key `{caller.key_name}`", ("key", caller.key_name)))
    elif caller.address:
        limits.append((ratelimit.Bucket(f"nanoserve:ratelimit:addr:{caller.address}", caller.rpm, caller.tpm),
                       f"client {caller.address}", None))
    if user:
        name = end_user(caller.key_name, user)
        limits.append((ratelimit.Bucket(f"nanoserve:ratelimit:user:{name}", s.user_rpm, s.user_tpm),
                       f"user `{user}`", ("user", name)))
    return limits


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _mask(token: str) -> str:
    return f"{token[:3]}***{token[-4:]}" if len(token) > 10 else "***"


def _or_default(value: int | None, default: int) -> int:
    return default if value is None else value

