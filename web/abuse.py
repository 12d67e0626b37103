"""Automatic temporary bans: a user or API key that keeps getting rate limited, or keeps sending
invalid requests, within a window is put on the blocklist for a while with reason `auto: …` (and so
in the audit log); `flask blocklist remove` lifts it early.

Strikes are counted in Redis (one counter per offence and subject, living for one window), so every
web process adds to the same count. Only refused requests cost a strike, and so a round trip: a normal
request does no abuse bookkeeping at all.

Settings (environment), on by default with generous thresholds:
    NANOSERVE_ABUSE               on | off                                  (default on)
    NANOSERVE_ABUSE_WINDOW        window for counting strikes               (default 10m)
    NANOSERVE_ABUSE_MAX_429       rate-limited requests per window before a ban  (default 300)
    NANOSERVE_ABUSE_MAX_INVALID   invalid (400) requests per window before a ban (default 100)
    NANOSERVE_ABUSE_BAN           how long an automatic ban lasts           (default 1h)
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from web import blocklist

OFFENCES = {"rate_limited": "rate-limited requests", "invalid": "invalid requests"}


@dataclass(frozen=True)
class AbusePolicy:
    enabled: bool = True
    window: float = 600.0  # seconds
    max_rate_limited: int = 300
    max_invalid: int = 100
    ban: float = 3600.0  # seconds

    @classmethod
    def from_env(cls, get: Callable[[str], str | None] = os.environ.get) -> "AbusePolicy":
        """Read the settings above; `get(name)` looks a name up (default: the environment)."""
        def duration(name: str, default: float) -> float:
            value = get(name)
            try:
                return blocklist.parse_duration(value) if value not in (None, "") else default
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None

        def count(name: str, default: int) -> int:
            value = get(name)
            if value in (None, ""):
                return default
            if not str(value).isdigit() or int(value) < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
            return int(value)

        switch = str(get("NANOSERVE_ABUSE") or "on").lower()
        if switch not in ("on", "off", "1", "0", "true", "false"):
            raise ValueError(f"NANOSERVE_ABUSE must be 'on' or 'off', not {switch!r}")
        return cls(enabled=switch in ("on", "1", "true"),
                   window=duration("NANOSERVE_ABUSE_WINDOW", cls.window),
                   max_rate_limited=count("NANOSERVE_ABUSE_MAX_429", cls.max_rate_limited),
                   max_invalid=count("NANOSERVE_ABUSE_MAX_INVALID", cls.max_invalid),
                   ban=duration("NANOSERVE_ABUSE_BAN", cls.ban))

    def threshold(self, offence: str) -> int:
        return self.max_rate_limited if offence == "rate_limited" else self.max_invalid


def strike_key(offence: str, kind: str, name: str) -> str:
    return f"nanoserve:strikes:{offence}:{kind}:{name}"


def strike(r: redis.Redis, policy: AbusePolicy, offence: str, subjects: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Count one `offence` against each (kind, name) subject; ban those that reach the threshold.
    Returns the subjects banned by this call."""
    subjects = list(subjects)
    if not policy.enabled or not subjects:
        return []
    pipe = r.pipeline()
    for kind, name in subjects:
        key = strike_key(offence, kind, name)
        pipe.set(key, 0, ex=max(1, round(policy.window)), nx=True)  # the window starts at the first strike
        pipe.incr(key)  # keeps the expiry
    counts = pipe.execute()[1::2]
    limit = policy.threshold(offence)
    banned = []
    for (kind, name), n in zip(subjects, counts):
        # Exactly at the threshold: of many processes striking at once, only one bans.
        if n == limit:
            reason = f"auto: {n} {OFFENCES[offence]} within {blocklist.format_duration(policy.window)}"
            blocklist.add(r, kind, name, reason=reason, by="auto", duration=policy.ban)
            forgive(r, kind, name)
            banned.append((kind, name))
    return banned


def forgive(r: redis.Redis, kind: str, name: str) -> None:
    """Clear a subject's strikes (after a ban, or when an admin lifts one)."""
    r.delete(*(strike_key(offence, kind, name) for offence in OFFENCES))
