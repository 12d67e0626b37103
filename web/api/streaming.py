"""Reading a job's Redis Stream: following its events, turning them into SSE frames or into the
final completion object.

The worker appends every event of a job to `protocol.stream_key(job_id)` (see `worker/protocol.py`
for the schema); each reader follows it with XREAD BLOCK from an entry id, so a late reader, a
resumed SSE connection (`Last-Event-ID`) and a poller all see the same events. Entry ids are the SSE
`id:` of each frame.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import redis
from rq.job import Job, JobStatus

from web.access.quotas import Hold
from web.api.queue import JobQueue
from web.api.stream_hub import Follower
from web.batch.dispatcher import Outcome
from worker import protocol
from worker.protocol import APIError

_WAITING = (JobStatus.CREATED, JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED, JobStatus.STARTED)


@dataclass
class Event:
    id: str | None  # the stream entry id; None for an event web concluded itself (see `follow`)
    type: str
    data: dict[str, Any]


def follow(jq: JobQueue, job_id: str, after: str = "0-0", tick_s: float = 15.0,
           deadline: float | None = None, follower: Follower | None = None) -> Iterator[Event | None]:
    """The job's events after entry `after`, up to and including its terminal event, read through
    the process's stream hub (web/api/stream_hub.py), or on this thread's own connection where the
    hub already follows the job for another reader.

    Yields None whenever `tick_s` passes without an event (the caller's chance to send a keepalive
    or give up at `deadline`, a `time.monotonic()` value). At each such pause the rq job is checked:
    a job rq will never run again (failed after its retries, cancelled while queued, expired in the
    queue) that left no terminal event gets one concluded here, so no reader waits forever.

    `follower`: the hub's place for the stream, registered already and the hub woken for it (by the
    request's own enqueue: `admit_completion`).
    """
    key = protocol.stream_key(job_id)
    last = after
    if follower is None:
        follower = jq.hub.follow(key, after, jq.redis)
    try:
        while True:
            block_s = tick_s if deadline is None else min(tick_s, deadline - time.monotonic())
            if follower is not None:
                entries = follower.read(block_s)
            else:
                reply = jq.blocking_redis.xread({key: last}, block=max(1, int(block_s * 1000)))  # BLOCK 0: forever
                entries = reply[0][1] if reply else []
            if not entries:
                if jq.status(job_id) in _WAITING:
                    yield None
                    continue
                # The job is over for rq; take what it wrote meanwhile, else conclude it here.
                reply = jq.redis.xread({key: last})
                if not reply:
                    yield _concluded(jq, job_id)
                    return
                entries = reply[0][1]
            for entry_id, fields in entries:
                if not _newer(entry_id, last):  # the hub's copy of what the direct read above took
                    continue
                event = _decode(entry_id, fields)
                last = event.id
                yield event
                if event.type in protocol.TERMINAL_EVENTS:
                    return
    finally:
        if follower is not None:
            jq.hub.leave(follower)


def _newer(entry_id: bytes, last: str) -> bool:
    ms, _, n = entry_id.partition(b"-")
    last_ms, _, last_n = last.partition("-")
    return (int(ms), int(n)) > (int(last_ms), int(last_n))


def _decode(entry_id: bytes, fields: dict) -> Event:
    event_type, data = protocol.decode_event(fields)
    return Event(entry_id.decode(), event_type, data)


def _concluded(jq: JobQueue, job_id: str) -> Event:
    status = jq.status(job_id)
    if status in (JobStatus.CANCELED, JobStatus.STOPPED):
        return Event(None, "cancelled", {})
    if status is None:
        message = "The request expired before a worker could run it."
    else:
        message = "The worker failed while running this request."
    return Event(None, "error", protocol.error_body(message, "server_error", None, "job_failed"))


def last_terminal_events(r: redis.Redis, job_ids: list[str]) -> dict[str, Event]:
    """The terminal event of each of these jobs that has one, in one round trip."""
    with r.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.xrevrange(protocol.stream_key(job_id), count=1)
        replies = pipe.execute()
    ended = {}
    for job_id, entries in zip(job_ids, replies):
        if entries:
            event = _decode(*entries[0])
            if event.type in protocol.TERMINAL_EVENTS:
                ended[job_id] = event
    return ended


def outcomes(jq: JobQueue, job_ids: list[str]) -> dict[str, Outcome]:
    """How each of these jobs ended, read in this one place for every reader (a polled job, a batch's
    line): its terminal event; when its stream is gone (it expired while nobody read it), rq's record
    of the job. Jobs still queued or running are left out. Three round trips at most."""
    ended = {job_id: _outcome_of(event) for job_id, event in last_terminal_events(jq.redis, job_ids).items()}
    rest = [job_id for job_id in job_ids if job_id not in ended]
    with jq.redis.pipeline(transaction=False) as pipe:
        for job_id in rest:
            pipe.exists(protocol.stream_key(job_id))
            pipe.hget(Job.key_for(job_id), "status")
        replies = pipe.execute()
    for job_id, streaming, status in zip(rest, replies[::2], replies[1::2]):
        if streaming or (status is not None and JobStatus(status.decode()) in _WAITING):
            continue
        outcome = _outcome_from_rq(jq.fetch(job_id))
        if outcome is not None:
            ended[job_id] = outcome
    return ended


def _outcome_of(event: Event) -> Outcome:
    if event.type == "done":
        return Outcome("done", completion=event.data["completion"])
    if event.type == "error":
        err = APIError.from_body(event.data)
        return Outcome("error", error=err.body(), status=err.status)
    return Outcome("cancelled")


def _outcome_from_rq(rq_job) -> Outcome | None:
    """How a job without a stream ended, from rq (None: it has not ended)."""
    if rq_job is None:
        return Outcome("lost")
    status = rq_job.get_status(refresh=False)
    if status in _WAITING:
        return None
    if status in (JobStatus.CANCELED, JobStatus.STOPPED):
        return Outcome("cancelled")
    if status == JobStatus.FAILED:
        return Outcome("error", error=protocol.error_body("The worker failed while running this request.",
                                                          "server_error", None, "job_failed"), status=500)
    completion = rq_job.return_value()
    return Outcome("done", completion=completion) if completion else Outcome("lost")


def cancelled_error() -> APIError:
    return APIError(400, "The request was cancelled.", "invalid_request_error", None, "cancelled")


def wait_for_completion(events: Iterator[Event | None], deadline: float, jq: JobQueue, job_id: str,
                        timeout_s: float) -> dict[str, Any]:
    """Read the job's events (`follow` with this `deadline`) to its `done` and return the completion
    object; its error as an APIError. Past the deadline the job is cancelled and a 504 raised."""
    for event in events:
        if time.monotonic() >= deadline:
            break
        if event is None:
            continue
        if event.type == "done":
            return event.data["completion"]
        if event.type == "error":
            raise APIError.from_body(event.data)
        if event.type == "cancelled":
            raise cancelled_error()
    jq.cancel(job_id)
    raise APIError(504, f"The completion did not finish within {timeout_s:g} seconds and was cancelled. "
                   "Use stream: true or POST /v1/jobs for long requests.", "server_error", None, "timeout",
                   {"x-should-retry": "false"})


@dataclass
class ChunkFormat:
    """What every SSE chunk of one completion shares. With `continuous_usage` (vLLM's
    `stream_options.continuous_usage_stats`) each choice's chunk carries the usage of that choice so
    far: its prompt's tokens (`prompt_tokens[index]`) and the tokens it generated."""

    id: str
    created: int
    model: str
    include_usage: bool
    logprobs: bool  # requested: a finish chunk then carries empty logprobs lists, not null
    continuous_usage: bool = False
    prompt_tokens: list[int] = field(default_factory=list)  # per choice index
    echo: bool = False  # a choice's first delta then carries its prompt's ids too

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage or self.continuous_usage:
            body["usage"] = usage
        return body


DONE = "data: [DONE]\n\n"  # the last frame of every stream
EMPTY_LOGPROBS = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def sse_frames(events: Iterator[Event | None], fmt: ChunkFormat) -> Iterator[str]:
    """Server-sent events for a completion: one choice per chunk; a choice's `finish_reason` on the
    chunk with its last text when both came in the same engine step (as vLLM sends it), else on a
    chunk of its own; the usage chunk (`choices: []`) when asked for; `data: [DONE]` at the end;
    errors as `data: {"error": …}`; and `: keepalive` comments while waiting."""
    generated: dict[int, int] = {}  # choice index -> completion tokens so far
    finished: set[int] = set()  # choices whose finish_reason went out
    for event in events:
        if event is None:
            # A comment line without the blank line that would end an event: once a frame carried
            # an `id:`, openai-python's decoder turns a blank line into an empty event and fails to
            # parse it as JSON (openai/openai-python#2722).
            yield ": keepalive\n"
            continue
        body = None
        data = event.data
        if event.type == "delta":
            index = data["index"]
            first = index not in generated
            generated[index] = generated.get(index, 0) + len(data.get("token_ids", ()))
            if first and fmt.echo:
                generated[index] -= _prompt_tokens(fmt, index)
            reason = data.get("finish_reason")
            if data.get("text") or data.get("logprobs") or reason:
                choice = {"index": index, "text": data.get("text", ""), "logprobs": data.get("logprobs"),
                          "finish_reason": reason}
                if reason:
                    choice["stop_reason"] = data.get("stop_reason")
                    finished.add(index)
                body = fmt.chunk([choice], _usage_so_far(fmt, index, generated))
        elif event.type == "finish":
            index = data["index"]
            if index not in finished:
                finished.add(index)
                body = fmt.chunk([{"index": index, "text": "",
                                   "logprobs": dict(EMPTY_LOGPROBS) if fmt.logprobs else None,
                                   "finish_reason": data["finish_reason"], "stop_reason": data.get("stop_reason")}],
                                 _usage_so_far(fmt, index, generated))
        elif event.type == "usage":
            if fmt.include_usage:
                body = fmt.chunk([], usage=data)
        elif event.type == "error":
            body = data
        elif event.type == "cancelled":
            body = cancelled_error().body()
        if body is not None:
            yield sse_frame(body, event.id)
        if event.type in protocol.TERMINAL_EVENTS:
            yield DONE
            return


def _prompt_tokens(fmt: ChunkFormat, index: int) -> int:
    return fmt.prompt_tokens[index] if index < len(fmt.prompt_tokens) else 0


def _usage_so_far(fmt: ChunkFormat, index: int, generated: dict[int, int]) -> dict | None:
    if not fmt.continuous_usage:
        return None
    prompt, completion = _prompt_tokens(fmt, index), generated.get(index, 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_frame(body: dict[str, Any], entry_id: str | None = None) -> str:
    data = json.dumps(body, separators=(",", ":"))
    return f"id: {entry_id}\ndata: {data}\n\n" if entry_id else f"data: {data}\n\n"


def guarded(frames: Iterator[str], jq: JobQueue, job_id: str, cancel_on_disconnect: bool,
            hold: Hold | None = None) -> Iterator[str]:
    """Pass frames through; a client that goes away (the WSGI server closes the generator) cancels
    the job, and a Redis failure mid-stream ends the stream with an error frame. However it ends, the
    stream's `hold` on its caller's quota of open streams is given back."""
    finished = False
    try:
        for frame in frames:
            if frame == DONE and hold is not None:
                # before the client sees the end: a next request of its key finds its places free
                hold.release()
                hold = None
            yield frame
        finished = True
    except redis.RedisError:
        finished = True
        yield sse_frame(protocol.error_body("The queue became unreachable during the stream.", "server_error",
                                            None, "redis_unavailable"))
        yield DONE
    finally:
        if hold is not None:
            hold.release()
        if not finished and cancel_on_disconnect:
            try:
                jq.cancel(job_id)
            except redis.RedisError:
                pass
