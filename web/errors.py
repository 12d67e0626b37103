"""OpenAI-shaped errors: one exception type, one envelope, registered once on the app."""
from __future__ import annotations

import logging

from flask import Flask, jsonify
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


# Werkzeug's own HTTP errors (405, 413, …) mapped to OpenAI's types.
_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return jsonify(err.body()), err.status, err.headers

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        status = err.code or 500
        message = err.description or err.name
        if status == 413:
            message = "Request body too large."
        body = error_body(message, _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"))
        return jsonify(body), status

    @app.errorhandler(Exception)
    def _fault(err: Exception):
        # A real fault: log it with the request id (echoed in x-request-id), never leak internals.
        log.exception("unhandled error")
        return jsonify(error_body("The server had an error while processing your request.", "server_error")), 500
