"""The engine's errors, all `worker.protocol.APIError`s: a request it refuses (`EngineError`, written
as the job's `error` event), a cancelled one (`RequestCancelled`, a `cancelled` event) and a fault
of the engine itself (`EngineFault`: no event, so the job can be retried and resume elsewhere)."""
from __future__ import annotations

from worker import protocol


class EngineError(protocol.APIError):
    """A request the engine cannot run (OpenAI's error fields; answered as a 400 unless its type says
    otherwise)."""

    def __init__(self, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(protocol.STATUS_BY_TYPE.get(type_, 500), message, type_, param, code)


class EngineFault(EngineError):
    """The engine failed, not the request (a fault in a step, or the engine stopping)."""

    def __init__(self, message: str = "The server had an error while processing your request."):
        super().__init__(message, "server_error")


class RequestCancelled(EngineError):
    def __init__(self, job_id: str):
        super().__init__(f"Job {job_id} was cancelled.", "cancelled")
