"""OpenAI-shaped errors answered by the app: the handlers, registered once. The error type itself,
`APIError` (with `bad_request` and `context_length_error`), is worker/protocol.py's, shared with the
worker; every web module raises it from there."""
from __future__ import annotations

import logging

import redis
from flask import Flask, g, jsonify
from werkzeug.exceptions import HTTPException

from web import access
from web.settings import settings
from worker.protocol import APIError, error_body

log = logging.getLogger(__name__)


# The OpenAI error type of each status werkzeug raises on its own.
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "invalid_request_error", 429: "rate_limit_error"}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        if err.status == 400:
            _record_invalid()
        return jsonify(err.body()), err.status, err.headers

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        status = err.code or 500
        message = err.description or err.name
        if status == 413:
            message = "Request body too large."
        if status == 400:
            _record_invalid()
        type_ = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
        return jsonify(error_body(message, type_)), status

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    def _redis_down(err: redis.RedisError):
        # The queue is down: the client may retry (the openai client does, honouring Retry-After).
        log.warning("redis unavailable: %r", err, extra={"request_id": g.get("request_id")})
        body = error_body("The service is temporarily unavailable (the queue cannot be reached).",
                          "server_error", None, "service_unavailable")
        return jsonify(body), 503, {"Retry-After": str(settings().retry_after_s)}

    @app.errorhandler(redis.ResponseError)
    def _redis_refused(err: redis.ResponseError):
        if not isinstance(err, redis.OutOfMemoryError) and "OOM command not allowed" not in str(err):
            return _fault(err)  # a script's OOM arrives as a plain ResponseError
        # Redis at its memory cap refuses writes (noeviction): a retry may find room again.
        log.error("redis out of memory: %r", err, extra={"request_id": g.get("request_id")})
        body = error_body("The service is temporarily out of storage; try again later.", "server_error", None,
                          "service_unavailable")
        return jsonify(body), 503, {"Retry-After": str(settings().retry_after_s)}

    @app.errorhandler(Exception)
    def _fault(err: Exception):
        # A real fault: log it with the request id (echoed in x-request-id), never leak internals.
        log.exception("unhandled error (request id %s)", g.get("request_id"),
                      extra={"request_id": g.get("request_id")})
        return jsonify(error_body("The server had an error while processing your request.", "server_error")), 500


def _record_invalid() -> None:
    """Every 400 counts towards the caller's abuse score (web/access/abuse.py); bookkeeping never
    turns the 400 into a 500."""
    try:
        access.record_invalid(g.get("caller"), g.get("user"))
    except Exception:
        log.exception("record_invalid failed", extra={"request_id": g.get("request_id")})
