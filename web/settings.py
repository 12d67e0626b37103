"""The web tier's settings: one object, read from the environment in one place (`Settings.from_env`).

Every knob has a default that works for a local run. `create_app(config)` overrides any field by
name, which is how tests shrink limits and timeouts; a string value is parsed and checked as the
environment's would be, with an error naming the variable. The table of variables is in docs/configuration.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from flask import Flask, current_app

from web.durations import parse_duration
from worker import protocol

EXTENSION = "nanoserve.settings"

Parser = Callable[[str, str], Any]  # (variable name, text) -> value; ValueError naming the variable


def _text(var: str, text: str) -> str:
    return text


def _whole(minimum: int, hint: str) -> Parser:
    def parse(var: str, text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise ValueError(f"{var} must be a whole number{hint}, not {text!r}")
        return int(text)
    return parse


def _seconds(var: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"{var} must be a number of seconds, not {text!r}")
    return value


def _duration(var: str, text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None


def _switch(on: tuple[str, ...], off: tuple[str, ...]) -> Parser:
    def parse(var: str, text: str) -> bool:
        value = text.strip().lower()
        if value not in on + off:
            raise ValueError(f"{var} must be {on[0]!r} or {off[0]!r}, not {text!r}")
        return value in on
    return parse


def _choice(*choices: str) -> Parser:
    def parse(var: str, text: str) -> str:
        if text.strip().lower() not in choices:
            raise ValueError(f"{var} must be one of {', '.join(choices)}, not {text!r}")
        return text.strip().lower()
    return parse


def _log_level(var: str, text: str) -> str:
    if not isinstance(logging.getLevelName(text.strip().upper()), int):
        raise ValueError(f"{var} must be a logging level such as DEBUG, INFO or WARNING, not {text!r}")
    return text.strip().upper()


def _setting(default: Any, var: str | None, parse: Parser = _text) -> Any:
    """A field read from the environment variable `var` (None: settable only in code)."""
    return field(default=default, metadata={"env": var, "parse": parse})


_COUNT = _whole(0, "")
_LIMIT = _whole(0, " (0: no limit)")
_THRESHOLD = _whole(1, " of at least 1")
_REQUIRED = _switch(("required",), ("disabled",))
_ON_OFF = _switch(("on", "1", "true"), ("off", "0", "false"))


@dataclass(frozen=True)
class Settings:
    # the queue and the models
    redis_url: str = _setting(protocol.DEFAULT_REDIS_URL, "REDIS_URL")
    models_path: str | None = _setting(None, "NANOSERVE_MODELS")  # None: the registry's default
    max_body_bytes: int = _setting(1 << 20, "NANOSERVE_MAX_BODY_BYTES", _COUNT)  # larger bodies → 413
    max_queue_depth: int = _setting(1000, "NANOSERVE_MAX_QUEUE_DEPTH", _COUNT)  # waiting jobs per model before 429
    max_choices: int = _setting(256, "NANOSERVE_MAX_CHOICES", _COUNT)  # prompts × max(n, best_of) per request
    retry_after_s: int = _setting(1, "NANOSERVE_RETRY_AFTER", _COUNT)  # on 429 (queue full) and 503 (Redis, no worker)
    sync_timeout_s: float = _setting(600.0, "NANOSERVE_SYNC_TIMEOUT", _seconds)  # a `stream: false` request's wait
    keepalive_s: float = _setting(15.0, "NANOSERVE_KEEPALIVE", _seconds)  # SSE keepalive, and job checks while waiting
    job_retries: int = _setting(2, "NANOSERVE_JOB_RETRIES", _COUNT)  # rq Retry(max=…): re-runs after a worker crash
    job_timeout_s: int = _setting(900, "NANOSERVE_JOB_TIMEOUT", _COUNT)  # rq job_timeout: the longest one job runs
    queue_ttl_s: int = _setting(900, "NANOSERVE_QUEUE_TTL", _COUNT)  # rq ttl: the longest a job waits in the queue
    result_ttl_s: int = _setting(protocol.RESULT_TTL, "NANOSERVE_RESULT_TTL", _COUNT)  # rq result_ttl / failure_ttl
    cancel_ttl_s: int = _setting(protocol.STREAM_TTL, None)  # how long a cancel flag stays set

    # the request schema (web/api/schemas.py)
    unknown_fields: str = _setting("reject", "NANOSERVE_UNKNOWN_FIELDS", _choice("reject", "ignore"))  # 400 or drop
    max_stop: int = _setting(16, "NANOSERVE_MAX_STOP", _THRESHOLD)  # stop strings per request
    max_logit_bias: int = _setting(300, "NANOSERVE_MAX_LOGIT_BIAS", _THRESHOLD)  # logit_bias entries per request

    # files and batches (web/batch/, web/api/files.py, web/api/batches.py)
    max_file_bytes: int = _setting(100 << 20, "NANOSERVE_MAX_FILE_BYTES", _COUNT)  # larger uploads → 413
    file_ttl_s: float = _setting(30 * 86400.0, "NANOSERVE_FILE_TTL", _duration)  # files live this long by default, and at most
    batch_window_s: float = _setting(86400.0, "NANOSERVE_BATCH_WINDOW", _duration)  # what `completion_window: 24h` lasts
    batch_max_lines: int = _setting(50_000, "NANOSERVE_BATCH_MAX_LINES", _THRESHOLD)  # requests in one batch
    batch_max_inflight: int = _setting(32, "NANOSERVE_BATCH_MAX_INFLIGHT", _THRESHOLD)  # one batch's lines queued or running
    batch_dispatch: bool = _setting(True, "NANOSERVE_BATCH_DISPATCH", _ON_OFF)  # drive batches from this process
    batch_tick_s: float = _setting(0.25, "NANOSERVE_BATCH_TICK", _seconds)  # how often the dispatcher steps each batch
    batch_lease_s: float = _setting(10.0, "NANOSERVE_BATCH_LEASE", _seconds)  # a dead dispatcher's batches wait this long

    # access control (web/access/)
    auth_required: bool = _setting(False, "NANOSERVE_AUTH", _REQUIRED)  # `Authorization: Bearer <key>` on /v1
    # the same on /metrics; None: as on /v1
    metrics_auth_required: bool | None = _setting(None, "NANOSERVE_METRICS_AUTH", _REQUIRED)
    key_rpm: int = _setting(10_000, "NANOSERVE_KEY_RPM", _LIMIT)  # keys without their own limits, and
    key_tpm: int = _setting(10_000_000, "NANOSERVE_KEY_TPM", _LIMIT)  # anonymous callers per address
    user_rpm: int = _setting(1_000, "NANOSERVE_USER_RPM", _LIMIT)  # per end user (the `user` field)
    user_tpm: int = _setting(1_000_000, "NANOSERVE_USER_TPM", _LIMIT)

    # what one key may hold at once (web/access/quotas.py); 0: no limit
    key_max_jobs: int = _setting(256, "NANOSERVE_KEY_MAX_JOBS", _LIMIT)  # completions queued or running
    key_max_open: int = _setting(96, "NANOSERVE_KEY_MAX_OPEN", _LIMIT)  # streams and synchronous waits
    key_max_batches: int = _setting(8, "NANOSERVE_KEY_MAX_BATCHES", _LIMIT)  # batches not yet ended
    key_max_files: int = _setting(100, "NANOSERVE_KEY_MAX_FILES", _LIMIT)  # files stored
    key_max_stored_bytes: int = _setting(512 << 20, "NANOSERVE_KEY_MAX_STORED_BYTES", _LIMIT)  # their bytes

    # automatic bans (web/access/abuse.py)
    abuse_enabled: bool = _setting(True, "NANOSERVE_ABUSE", _ON_OFF)
    abuse_window_s: float = _setting(600.0, "NANOSERVE_ABUSE_WINDOW", _duration)  # strikes count within it
    abuse_max_rate_limited: int = _setting(300, "NANOSERVE_ABUSE_MAX_429", _THRESHOLD)  # 429s per window
    abuse_max_invalid: int = _setting(100, "NANOSERVE_ABUSE_MAX_INVALID", _THRESHOLD)  # 400s per window
    abuse_ban_s: float = _setting(3600.0, "NANOSERVE_ABUSE_BAN", _duration)  # how long a ban lasts

    # logs (web/logs.py)
    log_format: str = _setting("json", "NANOSERVE_LOG_FORMAT", _choice("json", "text"))
    log_level: str = _setting("INFO", "NANOSERVE_LOG_LEVEL", _log_level)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The defaults, overridden by every variable that is set (and not empty)."""
        env = os.environ if environ is None else environ
        values = {f.name: env[f.metadata["env"]] for f in dataclasses.fields(cls)
                  if f.metadata["env"] and env.get(f.metadata["env"])}
        if env.get("REDIS_SENTINELS") or env.get("REDIS_SENTINEL_MASTER"):
            values["redis_url"] = protocol.redis_url_from_env(env)  # REDIS_URL's password and db, their primary
        return cls().replace(**values)

    def replace(self, **overrides: Any) -> "Settings":
        """A copy with some fields changed. Strings (as from the environment) are parsed and checked
        like the field's variable; other values are taken as given."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        converted = {}
        for name, value in overrides.items():
            if name not in fields:
                raise ValueError(f"unknown setting {name!r}")
            meta = fields[name].metadata
            if isinstance(value, str):
                value = meta["parse"](meta["env"] or name, value)
            converted[name] = value
        return dataclasses.replace(self, **converted)


def init_app(app: Flask, config: Settings | Mapping[str, Any] | None = None) -> Settings:
    """Attach the settings to the app: `config` is a `Settings`, or overrides of `Settings.from_env()`
    by field name."""
    settings = config if isinstance(config, Settings) else Settings.from_env().replace(**(config or {}))
    app.extensions[EXTENSION] = settings
    return settings


def settings() -> Settings:
    """The current app's settings."""
    return current_app.extensions[EXTENSION]
