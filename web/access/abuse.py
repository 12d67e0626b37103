"""Automatic temporary bans: a user or API key that keeps getting rate limited, or keeps sending
invalid requests, within a window is put on the blocklist for a while with reason `auto: …` (and so
in the audit log); `flask blocklist remove` lifts it early.

Strikes are counted in Redis (one counter per offence and subject, living for one window), so every
web process adds to the same count. Only refused requests cost a strike, and so a round trip: a normal
request does no abuse bookkeeping at all.

The thresholds are settings (`abuse_*` in web/settings.py: NANOSERVE_ABUSE, NANOSERVE_ABUSE_WINDOW,
NANOSERVE_ABUSE_MAX_429, NANOSERVE_ABUSE_MAX_INVALID, NANOSERVE_ABUSE_BAN), on by default with
generous values.
"""
from __future__ import annotations

from collections.abc import Iterable

import redis

from web.access import blocklist
from web.durations import format_duration
from web.settings import Settings

OFFENCES = {"rate_limited": "rate-limited requests", "invalid": "invalid requests"}


def threshold(settings: Settings, offence: str) -> int:
    """Strikes within one window that earn a ban."""
    return settings.abuse_max_rate_limited if offence == "rate_limited" else settings.abuse_max_invalid


def strike_key(offence: str, kind: str, name: str) -> str:
    return f"nanoserve:strikes:{offence}:{kind}:{name}"


def strike(r: redis.Redis, settings: Settings, offence: str, subjects: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Count one `offence` against each (kind, name) subject; ban those that reach the threshold.
    Returns the subjects banned by this call."""
    subjects = list(subjects)
    if not settings.abuse_enabled or not subjects:
        return []
    pipe = r.pipeline()
    for kind, name in subjects:
        key = strike_key(offence, kind, name)
        pipe.set(key, 0, ex=max(1, round(settings.abuse_window_s)), nx=True)  # the window starts at the first strike
        pipe.incr(key)  # keeps the expiry
    counts = pipe.execute()[1::2]
    limit = threshold(settings, offence)
    banned = []
    for (kind, name), n in zip(subjects, counts):
        # Exactly at the threshold: of many processes striking at once, only one bans.
        if n == limit:
            reason = f"auto: {n} {OFFENCES[offence]} within {format_duration(settings.abuse_window_s)}"
            blocklist.add(r, kind, name, reason=reason, by="auto", duration=settings.abuse_ban_s)
            forgive(r, kind, name)
            banned.append((kind, name))
    return banned


def forgive(r: redis.Redis, kind: str, name: str) -> None:
    """Clear a subject's strikes (after a ban, or when an admin lifts one)."""
    r.delete(*(strike_key(offence, kind, name) for offence in OFFENCES))
