"""JSON-lines logs with a request id.

Every request gets an id: the caller's `X-Request-ID` when it is a sane token, else a new one. It is
kept in `flask.g.request_id`, echoed in the `x-request-id` response header, and added to every log
record written while the request runs, so one grep finds everything a request did. Each request
also writes one access line (method, path, status, duration) when its response is finished; for a
stream, that is when the stream ends (probes and scrapes: `/health`, `/ready`, `/metrics` only at
DEBUG). `init_app` should run first in the app factory, so every later hook sees the id.

Format and level are settings (`log_format`: json or text, `log_level`; NANOSERVE_LOG_FORMAT and
NANOSERVE_LOG_LEVEL).
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid

from flask import Flask, g, has_request_context, request

from web.settings import Settings

access_log = logging.getLogger("nanoserve.access")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged too.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def current_request_id() -> str | None:
    """The id of the request being served, or None outside a request."""
    return g.get("request_id") if has_request_context() else None


class RequestIdFilter(logging.Filter):
    """Stamps `record.request_id` from the request being served (None elsewhere)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, the same fields as the worker's logs (processor.py): ts (unix
    seconds), level, logger, msg, request_id, any `extra=` fields, and `exc` for a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "msg": record.getMessage(), "request_id": getattr(record, "request_id", None)}
        line.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and k not in line})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted (test captures, redirections)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging(fmt: str = "json", level: str = "INFO") -> None:
    """Send the root logger to stderr as JSON lines (`fmt` json) or plain text. Idempotent."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_nanoserve", False)]:
        root.removeHandler(handler)
    handler = StderrHandler()
    handler._nanoserve = True
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def init_app(app: Flask, settings: Settings) -> None:
    """Request ids, `x-request-id` on every response, JSON logs and one access line per request."""
    configure_logging(settings.log_format, settings.log_level)

    @app.before_request
    def _assign_request_id():
        given = request.headers.get("x-request-id", "")
        g.request_id = given if _SANE_ID.match(given) else f"req-{uuid.uuid4().hex}"
        g.log_started = time.perf_counter()

    @app.after_request
    def _echo_and_log(response):
        if "request_id" not in g:  # a request that failed before the hooks ran
            g.request_id = f"req-{uuid.uuid4().hex}"
        response.headers["x-request-id"] = g.request_id
        started = g.get("log_started", time.perf_counter())
        fields = {"request_id": g.request_id, "method": request.method, "path": request.path,
                  "status": response.status_code}

        # Probes and scrapes come every few seconds: their lines only at DEBUG.
        level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO

        def log_access():
            fields["duration_ms"] = round((time.perf_counter() - started) * 1000, 1)
            access_log.log(level, "%s %s %s", fields["method"], fields["path"], fields["status"], extra=fields)

        # A streamed body is still being produced: log when the server closes it.
        if response.is_streamed:
            response.call_on_close(log_access)
        else:
            log_access()
        return response
