"""Polled completions: `POST /v1/jobs` queues a completions request and answers 202 at once;
`GET /v1/jobs/<id>` (also `/jobs/<id>`) reports it, `DELETE /v1/jobs/<id>` cancels it, and
`GET /v1/jobs/<id>/stream` follows its events as SSE (resumable with `Last-Event-ID`; leaving does
not cancel the job). The job id is the completion id (`cmpl-…`).

A job belongs to the caller that made it (web/access/ownership.py): any other caller is told that no
such job exists. The admin CLI (`flask --app wsgi jobs …`) uses the same functions with no caller and
sees every job.
"""
from __future__ import annotations

import re
from typing import Any

from flask import Blueprint, g, jsonify, request
from rq.job import Job, JobStatus

from web import access
from web.access.ownership import check_owner
from web.api.completions import admit_completion, held, sse_response
from web.api.queue import job_queue, owner
from web.api.streaming import ChunkFormat, follow, guarded, outcomes, sse_frames
from web.settings import settings
from worker import protocol
from worker.protocol import APIError, bad_request

bp = Blueprint("jobs", __name__)

# A job's status before its stream has a terminal event (`outcomes`). rq's FINISHED is then still
# in progress: the worker's last events can land after rq's record (a writer retrying through an outage).
_STATUS = {JobStatus.CREATED: "queued", JobStatus.QUEUED: "queued", JobStatus.DEFERRED: "queued",
           JobStatus.SCHEDULED: "queued", JobStatus.STARTED: "in_progress", JobStatus.FINISHED: "in_progress",
           JobStatus.FAILED: "failed", JobStatus.CANCELED: "cancelled", JobStatus.STOPPED: "cancelled"}
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
ACTIVE = ("queued", "in_progress")
_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")


@bp.post("/v1/jobs")
def submit_job():
    job = admit_completion(for_job=True).job
    body = {"id": job.id, "object": "job", "status": "queued", "model": job.model, "created": job.created}
    return jsonify(body), 202, {"Location": f"/v1/jobs/{job.id}"}


@bp.get("/v1/jobs/<job_id>")
@bp.get("/jobs/<job_id>")
def get_job(job_id: str):
    return jsonify(job_state(find_job(job_id, access.authenticate(request))))


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str):
    return jsonify(cancel(find_job(job_id, access.authenticate(request))))


@bp.get("/v1/jobs/<job_id>/stream")
def stream_job(job_id: str):
    caller = access.authenticate(request)
    rq_job = find_job(job_id, caller)
    after = entry_id(request.headers.get("Last-Event-ID") or "0-0")
    payload = _payload(rq_job)
    fmt = ChunkFormat(job_id, payload["created"], payload["model"], include_usage=True,
                      logprobs=payload.get("logprobs") is not None)
    g.grant = access.admit_request(caller)
    hold = access.hold_open(caller)
    hold.follow(access.quota("jobs"), job_id)  # its place, when the caller's scope is the submitter's
    jq = job_queue()
    events = held(follow(jq, job_id, after=after, tick_s=settings().keepalive_s), hold)
    return sse_response(guarded(sse_frames(events, fmt), jq, job_id, cancel_on_disconnect=False, hold=hold))


def entry_id(text: str) -> str:
    """`Last-Event-ID` as a Redis stream entry id: two whole numbers of at most 64 bits (Redis refuses
    any other, and that refusal must stay this request's 400)."""
    match = _ENTRY_ID.fullmatch(text)
    if not match or max(int(match[1]), int(match[2])) >= 1 << 64:
        shown = text if len(text) <= 60 else text[:60] + "…"
        raise bad_request(f"Last-Event-ID must be a stream entry id like 1700000000000-0, not {shown!r}.",
                          "Last-Event-ID")
    return f"{int(match[1])}-{int(match[2])}"


def find_job(job_id: str, caller: access.Caller | None) -> Job:
    """The job `job_id` if it belongs to `caller` (None: the admin, who sees every job); else the
    same 404 as for an id rq does not know (never enqueued, or expired with its result)."""
    not_found = APIError(404, f"No job with id `{job_id}`.", "invalid_request_error", None, "job_not_found")
    rq_job = job_queue().fetch(job_id) if job_id.startswith("cmpl-") else None
    if rq_job is None or not rq_job.args:
        raise not_found
    if caller is not None:
        check_owner(owner(rq_job), caller, not_found)
    return rq_job


def job_state(rq_job: Job) -> dict[str, Any]:
    """`{id, object: "job", status, model, created, result | error}` from how the job ended
    (`streaming.outcomes`, the one reader of results), else from rq (queued or running)."""
    payload = _payload(rq_job)
    state: dict[str, Any] = {"id": rq_job.id, "object": "job", "model": payload["model"],
                             "created": payload["created"]}
    outcome = outcomes(job_queue(), [rq_job.id]).get(rq_job.id)
    if outcome is None:
        state["status"] = _STATUS.get(rq_job.get_status(refresh=False), "queued")
    elif outcome.kind == "done":
        state.update(status="completed", result=outcome.completion)
    elif outcome.kind == "error":
        state.update(status="failed", error=outcome.error["error"])
    elif outcome.kind == "cancelled":
        state["status"] = "cancelled"
    else:  # finished, but its result expired before it was read
        state.update(status="failed", error=protocol.error_body(
            "The result of this request is no longer available.", "server_error", None, "result_expired")["error"])
    return state


def cancel(rq_job: Job) -> dict[str, Any]:
    """Cancel a job that is still queued or running; its state after that."""
    state = job_state(rq_job)
    if state["status"] in ACTIVE:
        job_queue().cancel(rq_job.id)
        state = {**state, "status": "cancelled"}
    return state


def _payload(rq_job: Job) -> dict[str, Any]:
    """The job's `CompletionJob` payload as enqueued."""
    return rq_job.args[0]
