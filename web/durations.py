"""Durations as people write them (`90s`, `30m`, `24h`, `7d`, `1h30m`): the blocklist's `--for`, the
abuse settings, and how the CLI shows a time left."""
from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> float:
    """Seconds in a duration like `24h`, `1h30m`, `90s`, `2d`, `1.5h`; a bare number is seconds.
    Raises ValueError for anything else, or for zero."""
    compact = text.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(?:\.\d+)?", compact):
        seconds = float(compact)
    elif compact and _PART.sub("", compact) == "":
        seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(compact))
    else:
        raise ValueError(f"Invalid duration {text!r}: use a number with a unit, e.g. 90s, 30m, 24h, 7d or 1h30m.")
    if seconds <= 0:
        raise ValueError(f"Invalid duration {text!r}: it must be longer than zero.")
    return seconds


def format_duration(seconds: float) -> str:
    """`1d2h`, `3h5m`, `42s`: the two largest units, for people reading the CLI."""
    seconds = max(0, round(seconds))
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts[:2])
