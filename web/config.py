"""The web tier's settings, read once from the environment (`Settings.from_env`).

Every knob has a default that works for a local run; `create_app(config)` can override any field by
name, which is how tests shrink limits and timeouts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from flask import current_app

from worker import protocol


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://localhost:6379/0"
    models_path: str | None = None  # None: the registry's default ($NANOSERVE_MODELS or models/models.toml)
    max_body_bytes: int = 1 << 20  # larger request bodies → 413
    max_queue_depth: int = 1000  # jobs waiting on one model's queue before new ones get 429
    max_choices: int = 1024  # prompts × max(n, best_of) sequences in one request
    retry_after_s: int = 1  # Retry-After on 429 (queue full) and 503 (Redis down, no worker)
    sync_timeout_s: float = 600.0  # how long a `stream: false` request waits for its result
    keepalive_s: float = 15.0  # SSE `: keepalive` period, and how often a waiting reader checks on its job
    job_retries: int = 2  # rq Retry(max=…): re-runs after a worker crash
    job_timeout_s: int = 900  # rq job_timeout: the longest one job may run on a worker
    queue_ttl_s: int = 900  # rq ttl: the longest a job may wait in the queue
    result_ttl_s: int = protocol.RESULT_TTL  # rq result_ttl / failure_ttl
    cancel_ttl_s: int = protocol.STREAM_TTL  # how long a cancel flag stays set

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        names = {
            "redis_url": "REDIS_URL",
            "models_path": "NANOSERVE_MODELS",
            "max_body_bytes": "NANOSERVE_MAX_BODY_BYTES",
            "max_queue_depth": "NANOSERVE_MAX_QUEUE_DEPTH",
            "max_choices": "NANOSERVE_MAX_CHOICES",
            "retry_after_s": "NANOSERVE_RETRY_AFTER",
            "sync_timeout_s": "NANOSERVE_SYNC_TIMEOUT",
            "keepalive_s": "NANOSERVE_KEEPALIVE",
            "job_retries": "NANOSERVE_JOB_RETRIES",
            "job_timeout_s": "NANOSERVE_JOB_TIMEOUT",
            "queue_ttl_s": "NANOSERVE_QUEUE_TTL",
            "result_ttl_s": "NANOSERVE_RESULT_TTL",
        }
        values = {field: env[var] for field, var in names.items() if env.get(var)}
        return cls().replace(**values)

    def replace(self, **overrides: Any) -> "Settings":
        """A copy with some fields changed; string values (from the environment) are converted to
        the field's type, with an error naming the field when they do not parse."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        converted = {}
        for name, value in overrides.items():
            if name not in fields:
                raise ValueError(f"unknown setting {name!r}")
            default = getattr(self, name)
            if isinstance(value, str) and isinstance(default, (int, float)):
                try:
                    value = type(default)(value)
                except ValueError:
                    raise ValueError(f"setting {name}: expected a {type(default).__name__}, got {value!r}") from None
            converted[name] = value
        return dataclasses.replace(self, **converted)


def settings() -> Settings:
    """The current app's settings."""
    return current_app.extensions["nanoserve.settings"]
