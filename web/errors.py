"""OpenAI-shaped errors: one exception type, one envelope, registered once on the app."""
from __future__ import annotations

import logging

import redis
from flask import Flask, g, jsonify
from werkzeug.exceptions import HTTPException

from worker.protocol import error_body

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# OpenAI's error types and the HTTP status each is answered with.
_STATUS_BY_TYPE = {"invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
                   "not_found_error": 404, "rate_limit_error": 429}
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "invalid_request_error", 429: "rate_limit_error"}


def error_from_body(body: dict) -> APIError:
    """An error envelope that came back from a worker (an `error` event) as an APIError."""
    err = body.get("error") or {}
    type_ = err.get("type") or "server_error"
    return APIError(_STATUS_BY_TYPE.get(type_, 500), err.get("message") or "The request failed.", type_,
                    err.get("param"), err.get("code"))


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
        return jsonify(body), 503, {"Retry-After": "1"}

    @app.errorhandler(Exception)
    def _fault(err: Exception):
        # A real fault: log it with the request id (echoed in x-request-id), never leak internals.
        log.exception("unhandled error (request id %s)", g.get("request_id"),
                      extra={"request_id": g.get("request_id")})
        return jsonify(error_body("The server had an error while processing your request.", "server_error")), 500


def _record_invalid() -> None:
    """Every 400 counts towards the caller's abuse score (web/access.py); bookkeeping never turns
    the 400 into a 500."""
    from web import access  # here, not at the top: access raises APIError, so it imports this module

    try:
        access.record_invalid(g.get("caller"), g.get("user"))
    except Exception:
        log.exception("record_invalid failed", extra={"request_id": g.get("request_id")})
