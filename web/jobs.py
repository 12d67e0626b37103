"""Polled completions: `POST /v1/jobs` queues a completions request and answers 202 at once;
`GET /v1/jobs/<id>` (also `/jobs/<id>`) reports it, `DELETE /v1/jobs/<id>` cancels it, and
`GET /v1/jobs/<id>/stream` follows its events as SSE (resumable with `Last-Event-ID`; leaving does
not cancel the job). The job id is the completion id (`cmpl-…`)."""
from __future__ import annotations

import re
from typing import Any

from flask import Blueprint, jsonify, request
from rq.job import Job, JobStatus

from web import access
from web.completions import admit_completion, sse_response
from web.config import settings
from web.errors import APIError, bad_request
from web.queue import job_queue
from web.streaming import ChunkFormat, follow, guarded, last_terminal_event, sse_frames
from worker import protocol

bp = Blueprint("jobs", __name__)

_STATUS = {JobStatus.CREATED: "queued", JobStatus.QUEUED: "queued", JobStatus.DEFERRED: "queued",
           JobStatus.SCHEDULED: "queued", JobStatus.STARTED: "in_progress", JobStatus.FINISHED: "completed",
           JobStatus.FAILED: "failed", JobStatus.CANCELED: "cancelled", JobStatus.STOPPED: "cancelled"}
_ENTRY_ID = re.compile(r"^\d+-\d+$")


@bp.post("/v1/jobs")
def submit_job():
    job = admit_completion(for_job=True).job
    body = {"id": job.id, "object": "job", "status": "queued", "model": job.model, "created": job.created}
    return jsonify(body), 202, {"Location": f"/v1/jobs/{job.id}"}


@bp.get("/v1/jobs/<job_id>")
@bp.get("/jobs/<job_id>")
def get_job(job_id: str):
    access.authenticate(request)
    return jsonify(job_state(job_id))


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str):
    access.authenticate(request)
    state = job_state(job_id)
    if state["status"] in ("queued", "in_progress"):
        job_queue().cancel(job_id)
        state = {**state, "status": "cancelled"}
    return jsonify(state)


@bp.get("/v1/jobs/<job_id>/stream")
def stream_job(job_id: str):
    access.authenticate(request)
    state = job_state(job_id)
    after = request.headers.get("Last-Event-ID") or "0-0"
    if not _ENTRY_ID.match(after):
        raise bad_request(f"Last-Event-ID must be a stream entry id like 1700000000000-0, not {after!r}.")
    jq = job_queue()
    payload = _payload(jq.fetch(job_id)) or {}
    fmt = ChunkFormat(job_id, state.get("created", 0), state.get("model", ""), include_usage=True,
                      logprobs=payload.get("logprobs") is not None)
    events = follow(jq, job_id, after=after, tick_s=settings().keepalive_s)
    return sse_response(guarded(sse_frames(events, fmt), jq, job_id, cancel_on_disconnect=False))


def job_state(job_id: str) -> dict[str, Any]:
    """`{id, object: "job", status, model, created, result | error}` from the job's terminal event
    (its stream says how it ended) or else from rq (queued or running); 404 when neither knows it."""
    jq = job_queue()
    rq_job = jq.fetch(job_id) if job_id.startswith("cmpl-") else None
    terminal = last_terminal_event(jq.redis, job_id) if job_id.startswith("cmpl-") else None
    if rq_job is None and terminal is None:
        raise APIError(404, f"No job with id `{job_id}`.", "invalid_request_error", None, "job_not_found")
    state: dict[str, Any] = {"id": job_id, "object": "job"}
    payload = _payload(rq_job)
    if payload:
        state.update(model=payload["model"], created=payload["created"])
    if terminal is not None and terminal.type == "done":
        state.update(status="completed", result=terminal.data["completion"])
    elif terminal is not None and terminal.type == "error":
        state.update(status="failed", error=terminal.data["error"])
    elif terminal is not None:
        state.update(status="cancelled")
    else:
        state["status"] = _STATUS.get(rq_job.get_status(refresh=False), "queued")
        if state["status"] == "completed":
            state["result"] = rq_job.return_value()
        elif state["status"] == "failed":
            state["error"] = protocol.error_body("The worker failed while running this request.",
                                                 "server_error", None, "job_failed")["error"]
    return state


def _payload(rq_job: Job | None) -> dict[str, Any] | None:
    """The job's `CompletionJob` payload as enqueued (None once rq has forgotten the job)."""
    return rq_job.args[0] if rq_job is not None and rq_job.args else None
