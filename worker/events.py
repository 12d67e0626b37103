"""The Redis Stream side of a job: the engine's event sink, and reading a job's stream back.

Every event of a job is one entry of `protocol.stream_key(job_id)`; web follows that stream for
SSE, for the synchronous answer and for polling. The engine calls the sink once per step with the
whole batch's events, so one step costs at most one round trip to Redis however many jobs are
running, and a step whose only events are tokens of jobs nobody reads token by token costs none.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis

from worker import protocol

log = logging.getLogger(__name__)

Event = tuple[str, str, dict[str, Any]]  # (job_id, event_type, data)


def append_event(client: redis.Redis, job_id: str, event_type: str, data: dict[str, Any]) -> None:
    """Write one event outside the engine (a job the engine never saw, or one rq gave up on)."""
    key = protocol.stream_key(job_id)
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(key, protocol.encode_event(event_type, data))
        pipe.expire(key, protocol.STREAM_TTL)
        pipe.execute()


class StreamWriter:
    """The engine's `event_sink`: XADD every event of a step, refresh the streams' TTL and check the
    cancel flags of every job this process is running, all in one MULTI/EXEC.

    - One transaction per step: a worker killed mid-write leaves each stream with a whole number of
      steps (a step's last deltas, finishes, usage and `done` land together or not at all), which
      is what a retried attempt resumes from.
    - If Redis is unreachable the events are kept and written, in order, with the next step's; the
      engine never sees the error.
    - A job that is not streamed (the synchronous answer, a polled or batch job) is read whole at
      its end, so its tokens are written at most every `DEFER_S` (with any other job's events, and
      at once for its first token and its end); one who follows a polled job's stream
      (`GET /v1/jobs/<id>/stream`) gets its tokens in bunches of up to `DEFER_S`. Each write wakes
      Redis and the web thread reading each stream it touches, on the cores the decode step runs
      on: with 32 such jobs, writing every 0.1 s (every step, at 100-ms steps) slowed the stack
      by a tenth against once a second (docs/notes/event-writes.md). The token deltas of one of its
      choices that wait together are written as one delta (their text, token ids and logprobs
      joined in order): one XADD a choice a write instead of one a step. A worker killed meanwhile
      has its retry compute those tokens again (the resumed attempt starts from what the stream
      holds, as always).
    - The cancel flags of the running jobs are read with every write, and between writes at least
      every `CHECK_S` (one round trip that wakes no reader): a cancel is seen within `CHECK_S` and
      a step, however long a job's tokens wait.
    - Writes are idempotent: each event gets its entry id here (`<ms>-<n>`: one millisecond per
      attempt, n counting the attempt's events), so a transaction sent again after its reply was
      lost (Redis restarting, redis-py retrying) is refused entry by entry instead of duplicated.
      The ms part of a resumed attempt is past its stream's last entry, and an older attempt still
      writing (a worker wrongly thought dead) is refused the same way.
    """

    DEFER_S = 1.0  # how long the tokens of a job nobody reads token by token may wait
    CHECK_S = 0.1  # how long a cancel may wait to be seen between writes

    def __init__(self, client: redis.Redis, max_pending: int = 100_000):
        self.client = client
        self.max_pending = max_pending
        self._streamed: set[str] = set()  # jobs whose every step is written at once
        self._written_at = 0.0  # time.monotonic() of the last write
        self._checked_at = 0.0  # ... and of the last read of the cancel flags
        self._pending: list[tuple[str, str, dict[str, Any], str]] = []  # events with their entry ids
        self._open: dict[str, dict[int, int]] = {}  # job id -> choice -> its waiting delta's place in _pending
        self._next_id: dict[str, list[int]] = {}  # job id -> [ms, n] of its next entry
        self._active: set[str] = set()  # jobs whose cancel flag is read with every write
        self._silenced: dict[str, threading.Event] = {}  # see `silence`
        self._failing_since: float | None = None  # when writes started failing (logged once)
        self._lock = threading.Lock()  # consumer threads call track/silence while the engine writes

    def track(self, job_id: str, last_entry_id: str | None = None, streamed: bool = True) -> None:
        """Number this job's events from now on (`last_entry_id`: its stream's newest entry, if
        any) and check its cancel flag with every write; `streamed`: write its every step at once."""
        last_ms = int(last_entry_id.split("-")[0]) if last_entry_id else 0
        with self._lock:
            self._next_id[job_id] = [max(int(time.time() * 1000), last_ms + 1), 0]
            self._open.pop(job_id, None)  # a new attempt's deltas never join an earlier attempt's
            self._active.add(job_id)
            if streamed:
                self._streamed.add(job_id)

    def untrack(self, job_id: str) -> None:
        """Stop checking the cancel flag (the numbering ends with the job's terminal event)."""
        with self._lock:
            self._active.discard(job_id)
            self._streamed.discard(job_id)

    def silence(self, job_id: str) -> threading.Event:
        """Drop the job's events from now on, up to and including its next terminal event (the
        returned Event is set then). For an attempt taken out of the engine that must leave the
        stream open for the job's retry to resume."""
        ended = threading.Event()
        with self._lock:
            self._silenced[job_id] = ended
        return ended

    def unsilence(self, job_id: str) -> None:
        with self._lock:
            self._silenced.pop(job_id, None)

    def __call__(self, events: Iterable[Event]) -> set[str]:
        with self._lock:
            urgent = False
            for job_id, event_type, data in events:
                terminal = event_type in protocol.TERMINAL_EVENTS
                ended = self._silenced.get(job_id)
                if ended is None:
                    urgent = urgent or self._urgent(job_id, event_type)
                    if not self._joined(job_id, event_type, data):
                        self._pending.append((job_id, event_type, data, self._entry_id(job_id)))
                elif terminal:
                    del self._silenced[job_id]
                    ended.set()
                if terminal:
                    self._next_id.pop(job_id, None)
            now = time.monotonic()
            deferred = not urgent and now - self._written_at < self.DEFER_S
            if deferred and (now - self._checked_at < self.CHECK_S or not self._active):
                return set()
            active = sorted(self._active)
        if deferred:
            return self._check(active)
        try:
            cancelled = self._flush(active)
        except redis.RedisError as exc:
            self._open = {}  # the events kept may be cut below: nothing joins them any more
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("event stream writes failing; keeping events until Redis answers",
                            extra={"error": str(exc)})
            if len(self._pending) > self.max_pending:
                # Redis has been gone for a long time: bound memory, the oldest events are lost.
                del self._pending[: len(self._pending) - self.max_pending]
            return set()
        if self._failing_since is not None:
            log.info("event stream writes recovered",
                     extra={"outage_seconds": round(time.monotonic() - self._failing_since, 1)})
            self._failing_since = None
        return cancelled

    def _urgent(self, job_id: str, event_type: str) -> bool:
        """Whether this event goes out with this step: anything but a token of a job that is not
        streamed, and the first event of every attempt (the answer's first token, as web times it)."""
        next_id = self._next_id.get(job_id)
        return event_type != "delta" or job_id in self._streamed or next_id is None or next_id[1] == 0

    def _joined(self, job_id: str, event_type: str, data: dict[str, Any]) -> bool:
        """Whether this event, a token delta of a job read at its end, joined its choice's delta
        still waiting to be written. Any other event of the job closes its waiting deltas: what
        follows it is written after it."""
        if event_type != "delta" or job_id in self._streamed or "finish_reason" in data:
            self._open.pop(job_id, None)
            return False
        waiting = self._open.setdefault(job_id, {})
        at = waiting.get(data["index"])
        if at is None:
            waiting[data["index"]] = len(self._pending)  # the place it is about to take
            return False
        joined_id, _, earlier, entry_id = self._pending[at]
        self._pending[at] = (joined_id, "delta", _join(earlier, data), entry_id)
        return True

    def _entry_id(self, job_id: str) -> str:
        next_id = self._next_id.get(job_id)
        if next_id is None:  # a job nobody tracked: let Redis number it
            return "*"
        entry_id = f"{next_id[0]}-{next_id[1]}"
        next_id[1] += 1
        return entry_id

    def _check(self, active: list[str]) -> set[str]:
        """The jobs of `active` whose cancel flag is set (none while Redis is unreachable: the next
        write says so)."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for job_id in active:
                    pipe.exists(protocol.cancel_key(job_id))
                flags = pipe.execute()
        except redis.RedisError:
            return set()
        self._checked_at = time.monotonic()
        return {job_id for job_id, flag in zip(active, flags) if flag}

    def _flush(self, active: list[str]) -> set[str]:
        events = self._pending
        with self.client.pipeline(transaction=True) as pipe:
            for job_id, event_type, data, entry_id in events:
                pipe.xadd(protocol.stream_key(job_id), protocol.encode_event(event_type, data), id=entry_id)
            for job_id in {event[0] for event in events}:
                pipe.expire(protocol.stream_key(job_id), protocol.STREAM_TTL)
            for job_id in active:
                pipe.exists(protocol.cancel_key(job_id))
            replies = pipe.execute(raise_on_error=False)
        self._written_at = self._checked_at = time.monotonic()
        self._pending, self._open = [], {}
        refused = [(event[0], reply) for event, reply in zip(events, replies) if isinstance(reply, Exception)]
        if refused:  # already written (a resent step), or a newer attempt owns the stream
            log.info("stream entries refused", extra={"count": len(refused), "job_id": refused[0][0],
                                                      "error": str(refused[0][1])})
        flags = replies[len(replies) - len(active):] if active else []
        return {job_id for job_id, flag in zip(active, flags) if flag}


def _join(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """Two token deltas of one choice as one: the later one's text, token ids and logprobs after
    the earlier one's."""
    joined = {**earlier, "text": earlier["text"] + later["text"],
              "token_ids": earlier["token_ids"] + later["token_ids"]}
    if earlier.get("logprobs") is not None:
        joined["logprobs"] = {key: values + later["logprobs"][key] for key, values in earlier["logprobs"].items()}
    return joined


@dataclass
class History:
    """What earlier attempts of a job wrote to its stream."""

    # choice index -> the concatenated `token_ids` of its deltas: the engine's `resume`
    tokens: dict[int, list[int]] = field(default_factory=dict)
    terminal: tuple[str, dict[str, Any]] | None = None  # (done | error | cancelled, data)
    last_entry_id: str | None = None


def read_history(client: redis.Redis, job_id: str) -> History:
    """Replay a job's stream (empty for a first attempt)."""
    history = History()
    for entry_id, fields in client.xrange(protocol.stream_key(job_id)):
        history.last_entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        event_type, data = protocol.decode_event(fields)
        if event_type == "delta":
            history.tokens.setdefault(data["index"], []).extend(data.get("token_ids") or [])
        elif event_type in protocol.TERMINAL_EVENTS and history.terminal is None:
            history.terminal = (event_type, data)
    return history
