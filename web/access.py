"""The single seam between the request path and access control: API keys, the user blocklist,
rate limits and automatic abuse bans.

The completions/jobs routes call, in this order:
    caller = authenticate(request)                       # 401 missing/wrong key (when required)
    grant = admit(caller, user, reserved_tokens)         # 403 blocked, 429 over a limit
    ... run the request ...
    settle(grant, used_tokens)                           # correct the token reservation
and `rate_limit_headers(grant)` gives the `x-ratelimit-*` headers added to the response.
`record_invalid(caller, user)` is called for every 400 so repeated invalid requests can earn a ban.

This module currently lets everyone in; the access-control implementation replaces the bodies
without changing these signatures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from flask import Request


@dataclass
class Caller:
    key_name: str | None = None  # None: anonymous (auth disabled)


@dataclass
class Grant:
    caller: Caller
    user: str | None
    reserved_tokens: int
    headers: dict[str, str] = field(default_factory=dict)


def authenticate(request: Request) -> Caller:
    return Caller()


def admit(caller: Caller, user: str | None, reserved_tokens: int) -> Grant:
    return Grant(caller, user, reserved_tokens)


def settle(grant: Grant, used_tokens: int) -> None:
    return None


def rate_limit_headers(grant: Grant | None) -> dict[str, str]:
    return dict(grant.headers) if grant else {}


def record_invalid(caller: Caller | None, user: str | None) -> None:
    return None
