"""The Redis Stream side of a job: the engine's event sink, and reading a job's stream back.

Every event of a job is one entry of `protocol.stream_key(job_id)`; web follows that stream for
SSE, for the synchronous answer and for polling. The engine calls the sink once per step with the
whole batch's events, so one step costs at most one round trip to Redis however many jobs are
running, and a step whose only events are tokens of jobs nobody reads token by token costs none.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis
from rq.job import Job

from worker import protocol

log = logging.getLogger(__name__)

Event = tuple[str, str, dict[str, Any]]  # (job_id, event_type, data)


def append_event(client: redis.Redis, job_id: str, event_type: str, data: dict[str, Any],
                 entry_id: str = "*") -> None:
    """Write one event outside the engine (a job the engine never saw, or one rq gave up on)."""
    key = protocol.stream_key(job_id)
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(key, protocol.encode_event(event_type, data), id=entry_id)
        pipe.expire(key, protocol.STREAM_TTL)
        pipe.execute()


class StreamWriter:
    """The engine's `event_sink`: XADD the events of a step that are due, refresh their streams' TTL
    and read the cancel flags of every job this process is running, all in one MULTI/EXEC.

    - The engine's thread only hands its events over; a thread of the writer's own writes them. The
      engine goes on with its next step meanwhile: a write's round trip (Redis waking every reader
      of the streams it touches before it answers) is not part of any step. Whatever was handed
      over while a write was under way goes with the next one, in one transaction.
    - One transaction per write: a worker killed mid-write leaves each stream with a whole number
      of steps (a step's last deltas, finishes, usage and `done` land together or not at all), which
      is what a retried attempt resumes from. A job's events are written in the order they came.
    - If Redis is unreachable the events are kept, and the writer's thread tries again every
      `RETRY_S`, with whatever came meanwhile, until Redis answers: the engine neither waits out the
      outage's timeouts nor has to step again for its last events to land.
    - A streamed job's events are written the step they are made. A job that is not streamed (the
      synchronous answer, a polled or batch job) is read whole at its end, so its tokens are written
      at most every `DEFER_S` after its own last write, and at once for its first token and its
      end; another job's write does not take them along. One who follows a polled job's stream
      (`GET /v1/jobs/<id>/stream`) gets its tokens in bunches of up to `DEFER_S`. Each write wakes
      Redis and the web thread reading each stream it touches, and in a burst of jobs starting and
      ending a few steps apart some job is due nearly every step: were the others taken along,
      each job's tokens would be written that often (docs/notes/event-writes.md). The token deltas
      of one of its choices that wait together are written as one delta (their text, token ids
      and logprobs joined in order): one XADD a choice a write instead of one a step. A worker
      killed meanwhile has its retry compute those tokens again (the resumed attempt starts from
      what the stream holds, as always).
    - The cancel flags of the running jobs are read (one MGET) with every write, and between writes
      at least every `CHECK_S` (one round trip that wakes no reader); the engine gets the jobs
      whose flag was set from its next call: a cancel is seen within `CHECK_S` and a write.
    - Writes are idempotent: each event gets its entry id here (`<ms>-<n>`: the attempt's fence,
      see `open_attempt`, n counting the attempt's events), so a transaction sent again after its
      reply was lost (Redis restarting, redis-py retrying) is refused entry by entry instead of
      duplicated, and so is every write of an older attempt once a newer one opened.
    - `wait_written` waits for what was handed over to be written: the consumer records a job
      finished in rq only once its terminal event is in its stream (web takes a job rq calls
      finished that left no terminal event for a failed one).
    - A stream's TTL (protocol.STREAM_TTL) is set with an attempt's first write and its terminal
      one, and between them at most every `TTL_REFRESH_S`: a streamed job's every step would
      otherwise cost an EXPIRE beside its XADD. While the job runs its stream has at least
      STREAM_TTL - TTL_REFRESH_S left; from its end, STREAM_TTL.
    """

    DEFER_S = 1.0  # how long the tokens of a job nobody reads token by token may wait
    CHECK_S = 0.1  # how long a cancel may wait to be seen between writes
    RETRY_S = 0.5  # how often writes are tried while Redis does not answer
    TTL_REFRESH_S = protocol.STREAM_TTL / 10  # how often a running job's stream has its TTL set again

    def __init__(self, client: redis.Redis, max_pending: int = 100_000):
        self.client = client
        self.max_pending = max_pending
        self._streamed: set[str] = set()  # jobs whose every step is written at once
        self._written_at: dict[str, float] = {}  # job id -> time.monotonic() of its last write
        self._ttl_set_at: dict[str, float] = {}  # job id -> time.monotonic() of its stream's last EXPIRE
        self._checked_at = 0.0  # time.monotonic() of the last read of the cancel flags
        # job id -> its events waiting to be written, in order, with their entry ids
        self._pending: dict[str, list[tuple[str, dict[str, Any], str]]] = {}
        self._open: dict[str, dict[int, int]] = {}  # job id -> choice -> its waiting delta's place in _pending[job]
        self._next_id: dict[str, list[int]] = {}  # job id -> [ms, n] of its next entry
        self._active: set[str] = set()  # jobs whose cancel flag is read with every write
        self._silenced: dict[str, threading.Event] = {}  # see `silence`
        self._failing_since: float | None = None  # when writes started failing (logged once)
        self._cancelled: set[str] = set()  # jobs whose flag a write found set, for the engine's next call
        # the engine's thread hands events over and consumer threads track jobs while the writer's writes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # work for the writer's thread, or a write done
        self._due: set[str] = set()  # jobs whose kept events the writer's thread is to write
        self._check_due = False  # a read of the cancel flags is due
        self._writing: set[str] = set()  # jobs whose events the write under way holds
        self._asked = self._done = 0  # writes asked for, and of those the last one done (wait_written)
        self._thread: threading.Thread | None = None

    def track(self, job_id: str, attempt_ms: int | None = None, streamed: bool = True) -> None:
        """Number this job's events from now on (`attempt_ms`: the attempt `open_attempt` opened,
        whose entries are <ms>-1, <ms>-2...) and check its cancel flag with every write;
        `streamed`: write its every step at once."""
        with self._lock:
            self._next_id[job_id] = [attempt_ms if attempt_ms is not None else int(time.time() * 1000), 1]
            self._open.pop(job_id, None)  # a new attempt's deltas never join an earlier attempt's
            self._ttl_set_at.pop(job_id, None)
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
        """Take a step's events (the engine's thread) and hand what is due to the writer's thread;
        returns the jobs whose cancel flag was found set since the last call."""
        with self._lock:
            urgent: set[str] = set()
            for job_id, event_type, data in events:
                terminal = event_type in protocol.TERMINAL_EVENTS
                ended = self._silenced.get(job_id)
                if ended is None:
                    if self._urgent(job_id, event_type):
                        urgent.add(job_id)
                    if not self._joined(job_id, event_type, data):
                        self._pending.setdefault(job_id, []).append((event_type, data, self._entry_id(job_id)))
                elif terminal:
                    del self._silenced[job_id]
                    self._written_at.pop(job_id, None)
                    self._ttl_set_at.pop(job_id, None)
                    ended.set()
                if terminal:
                    self._next_id.pop(job_id, None)
            now = time.monotonic()
            due = {job_id for job_id in self._pending
                   if job_id in urgent or now - self._written_at.get(job_id, -math.inf) >= self.DEFER_S}
            check = bool(self._active) and now - self._checked_at >= self.CHECK_S and not self._check_due
            if due or check:
                self._due |= due
                self._check_due = self._check_due or check
                self._asked += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
                    self._thread.start()
                self._changed.notify_all()
            return self._take_cancelled()

    def cancelled(self) -> set[str]:
        """The jobs whose cancel flag a write found set since the engine last asked (what its next
        call would return)."""
        with self._lock:
            return self._take_cancelled()

    def _take_cancelled(self) -> set[str]:
        cancelled, self._cancelled = self._cancelled, set()
        return cancelled

    @property
    def failing(self) -> bool:
        """Whether the last write failed (Redis away): what is due is kept and tried again."""
        return self._failing_since is not None

    def _run(self) -> None:
        """The writer's thread: write what is due, as it comes; through an outage, try again every
        RETRY_S with everything kept."""
        while True:
            with self._lock:
                while not (self._due or self._check_due):
                    self._changed.wait()
                due, check = [job_id for job_id in self._due if job_id in self._pending], self._check_due
                self._due, self._check_due = set(), False
                active, asked = sorted(self._active), self._asked
            try:
                cancelled = self._flush(active, due) if due else self._check(active)
            except redis.RedisError as exc:
                with self._lock:
                    if self._failing_since is None:
                        self._failing_since = time.monotonic()
                        log.warning("event stream writes failing; keeping events until Redis answers",
                                    extra={"error": str(exc)})
                    self._due |= set(self._pending)
                    self._check_due = self._check_due or check
                time.sleep(self.RETRY_S)
                continue
            except Exception:
                log.exception("event stream write failed; its events are lost", extra={"jobs": len(due)})
                cancelled = set()
            with self._lock:
                self._cancelled |= cancelled
                self._done = asked
                if self._failing_since is not None:
                    log.info("event stream writes recovered",
                             extra={"outage_seconds": round(time.monotonic() - self._failing_since, 1)})
                    self._failing_since = None
                self._changed.notify_all()

    def holds(self, job_id: str) -> bool:
        """Whether events of this job wait to be written, or are being written."""
        with self._lock:
            return bool(self._pending.get(job_id)) or job_id in self._writing

    def wait_written(self, timeout: float, job_ids: Iterable[str] | None = None) -> bool:
        """Wait until what was due when called is written (with `job_ids`: every event those jobs
        have handed over); False if Redis did not take it within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if job_ids is None:
                asked = self._asked
                written = lambda: self._done >= asked  # noqa: E731
            else:
                jobs = set(job_ids)
                written = lambda: not any(self._pending.get(j) or j in self._writing for j in jobs)  # noqa: E731
            while not written():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def _urgent(self, job_id: str, event_type: str) -> bool:
        """Whether this event goes out with this step: anything but a token of a job that is not
        streamed, and the first event of every attempt (the answer's first token, as web times it)."""
        next_id = self._next_id.get(job_id)
        return event_type != "delta" or job_id in self._streamed or next_id is None or next_id[1] == 1

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
            waiting[data["index"]] = len(self._pending.get(job_id, ()))  # the place it is about to take
            return False
        kept = self._pending[job_id]
        _, earlier, entry_id = kept[at]
        kept[at] = ("delta", _join(earlier, data), entry_id)
        return True

    def _entry_id(self, job_id: str) -> str:
        next_id = self._next_id.get(job_id)
        if next_id is None:  # a job nobody tracked: let Redis number it
            return "*"
        entry_id = f"{next_id[0]}-{next_id[1]}"
        next_id[1] += 1
        return entry_id

    def _check(self, active: list[str]) -> set[str]:
        """The jobs of `active` whose cancel flag is set (the writer's thread; a RedisError is its
        outage, as a write's is)."""
        flags = self.client.mget([protocol.cancel_key(job_id) for job_id in active]) if active else []
        with self._lock:
            self._checked_at = time.monotonic()
        return {job_id for job_id, flag in zip(active, flags) if flag is not None}

    def _flush(self, active: list[str], due: list[str]) -> set[str]:
        """Write every kept event of the jobs `due` (the writer's thread); on failure they are kept,
        in order, ahead of those added meanwhile."""
        with self._lock:
            taken = {job_id: self._pending.pop(job_id) for job_id in due if job_id in self._pending}
            for job_id in taken:
                self._open.pop(job_id, None)
            self._writing = set(taken)
            started = time.monotonic()  # no later than the EXPIREs below
            expiring = {job_id for job_id, events in taken.items() if events[-1][0] in protocol.TERMINAL_EVENTS
                        or started - self._ttl_set_at.get(job_id, -math.inf) >= self.TTL_REFRESH_S}
        try:
            with self.client.pipeline(transaction=True) as pipe:
                for job_id, events in taken.items():
                    key = protocol.stream_key(job_id)
                    for event_type, data, entry_id in events:
                        pipe.xadd(key, protocol.encode_event(event_type, data), id=entry_id)
                    if job_id in expiring:
                        pipe.expire(key, protocol.STREAM_TTL)
                if active:
                    pipe.mget([protocol.cancel_key(job_id) for job_id in active])
                replies = pipe.execute(raise_on_error=False)
        except redis.RedisError:
            with self._lock:
                # the events kept may be cut below: nothing joins them any more
                for job_id, events in taken.items():
                    self._pending[job_id] = events + self._pending.get(job_id, [])
                    self._open.pop(job_id, None)
                self._bound()
                self._writing = set()
            raise
        except Exception:  # not Redis's: these events could not be written and never will be
            with self._lock:
                self._writing = set()
            raise
        with self._lock:
            now = self._checked_at = time.monotonic()
            for job_id, events in taken.items():
                if events[-1][0] in protocol.TERMINAL_EVENTS:
                    self._written_at.pop(job_id, None)
                    self._ttl_set_at.pop(job_id, None)
                else:
                    self._written_at[job_id] = now
                    if job_id in expiring:
                        self._ttl_set_at[job_id] = started
            self._writing = set()
        written = [(job_id, event) for job_id, events in taken.items()
                   for event in [*events, *([None] if job_id in expiring else [])]]  # None: EXPIRE
        refused = [(job_id, reply) for (job_id, event), reply in zip(written, replies)
                   if event is not None and isinstance(reply, Exception)]
        if refused:  # already written (a resent step), or a newer attempt owns the stream
            log.info("stream entries refused", extra={"count": len(refused), "job_id": refused[0][0],
                                                      "error": str(refused[0][1])})
        flags = replies[-1] if active and not isinstance(replies[-1], Exception) else []
        return {job_id for job_id, flag in zip(active, flags) if flag is not None}

    def _bound(self) -> None:
        """Redis has been gone a long time: bound memory, the oldest jobs' oldest events are lost."""
        over = sum(map(len, self._pending.values())) - self.max_pending
        for job_id in list(self._pending):
            if over <= 0:
                return
            cut = min(over, len(self._pending[job_id]))
            del self._pending[job_id][:cut]
            self._open.pop(job_id, None)  # its waiting deltas' places moved
            over -= cut
            if not self._pending[job_id]:
                del self._pending[job_id]


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
    attempt_ms: int | None = None  # the attempt `open_attempt` opened: its entries are <ms>-1, <ms>-2, ...
    cancelled: bool = False  # the job's cancel flag was set when the attempt opened


def read_history(client: redis.Redis, job_id: str) -> History:
    """Replay a job's stream (empty for a first attempt)."""
    return _replay(client.xrange(protocol.stream_key(job_id)))


def _replay(entries) -> History:
    history = History()
    for _, fields in entries:
        event_type, data = protocol.decode_event(fields)
        if event_type == "delta":
            history.tokens.setdefault(data["index"], []).extend(data.get("token_ids") or [])
        elif event_type in protocol.TERMINAL_EVENTS and history.terminal is None:
            history.terminal = (event_type, data)
    return history


# Opens an attempt of a job: its stream so far and, unless the job has ended, a fence. The stream's
# last id becomes <ms>-0 (XSETID: no entry is added), ms past both Redis's clock and every id the
# stream has given, so the attempt's own entries <ms>-1, <ms>-2... are accepted and those of any
# earlier attempt still running (a worker wrongly thought dead) are refused from now on. Redis's
# clock, not the workers': hosts' clocks may disagree. Each attempt's ms is kept in the job's rq hash
# (KEYS[3]), and a later attempt's ms is past it: the job's first attempt, with no stream yet and no
# earlier attempt to fence out, leaves the stream to its first write, since creating it would wake
# every reader blocked on it (the web tier's stream hub) for an empty reply.
_OPEN_ATTEMPT = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'type' then
      for j = 2, #ARGV do
        if fields[i + 1] == ARGV[j] then return {0, entries, 0} end
      end
    end
  end
end
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local job = redis.call('EXISTS', KEYS[3]) == 1
local earlier = job and redis.call('HGET', KEYS[3], 'nanoserve_attempt_ms')
if earlier and tonumber(earlier) >= ms then ms = tonumber(earlier) + 1 end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      local last_ms = tonumber(string.match(info[i + 1], '^(%d+)'))
      if last_ms >= ms then ms = last_ms + 1 end
    end
  end
  redis.call('XSETID', KEYS[1], string.format('%d-0', ms))
  redis.call('EXPIRE', KEYS[1], ARGV[1])
elseif earlier or not job then  -- an empty stream, with no entry (a reader already blocked on it gets one empty reply)
  redis.call('XGROUP', 'CREATE', KEYS[1], 'fence', '$', 'MKSTREAM')
  redis.call('XGROUP', 'DESTROY', KEYS[1], 'fence')
  redis.call('XSETID', KEYS[1], string.format('%d-0', ms))
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
if job then redis.call('HSET', KEYS[3], 'nanoserve_attempt_ms', ms) end
return {ms, entries, redis.call('EXISTS', KEYS[2])}
"""


def open_attempt(client: redis.Redis, job_id: str) -> History:
    """Replay the job's stream and, unless it has ended, fence earlier attempts out of it (see
    `_OPEN_ATTEMPT`); one round trip, which also reads the job's cancel flag."""
    return attempt_opened(queue_attempt(client, job_id))


def queue_attempt(client, job_id: str):
    """`open_attempt`'s script call: on a pipeline, queued with the pipeline's other commands (its
    reply, among the pipeline's, goes to `attempt_opened`); on a client, its reply. EVAL rather
    than a registered script's EVALSHA, which costs a pipeline a round trip of its own (SCRIPT EXISTS)."""
    return client.eval(_OPEN_ATTEMPT, 3, protocol.stream_key(job_id), protocol.cancel_key(job_id),
                       Job.key_for(job_id), protocol.STREAM_TTL, *protocol.TERMINAL_EVENTS)


def attempt_opened(reply) -> History:
    """The History of the attempt a `queue_attempt` reply opened."""
    ms, entries, cancelled = reply
    history = _replay((entry_id, dict(zip(fields[::2], fields[1::2]))) for entry_id, fields in entries)
    if history.terminal is None:
        history.attempt_ms, history.cancelled = int(ms), bool(cancelled)
    return history
