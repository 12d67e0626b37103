"""The batch dispatcher: it turns a batch's lines into ordinary completions jobs, a bounded number at
a time, on the model's low-priority queue, and writes each job's result into the batch's output or
error file.

Where it runs: a thread in every web process (`start`). Each active batch is driven by one of them at
a time, the holder of the batch's lease in Redis (a few seconds, renewed at every step). Nothing it
knows lives only in its memory: the cursor, the lines in flight and their jobs, the results written
so far are all in Redis (web/batch/store.py), so when a web process dies (kill -9, a restart) its
leases lapse and another process, or the restarted one, continues where it stopped. A worker that
dies mid-line is rq's business: the job carries `Retry` and resumes elsewhere (worker/consumer.py);
the dispatcher only waits for the job's terminal event. Web processes are where the request path
lives (parsing, tokenizing, the rate limits and the blocklist), which the lines go through exactly as
the same requests sent one by one would.

One step of a batch (`step`):
  validating   read and check the input file (web/batch/input.py) → in_progress, or failed
  in_progress  collect the results of lines in flight; past the window → expiry; start new lines
               up to `max_inflight` (each: prepare → admit → claim → enqueue); when every line has
               its result → finalizing → completed
  cancelling / expiring   stop the running lines (cancel flags; the engine drops them within a
               step), write `batch_cancelled` / `batch_expired` for every line that has no result,
               then → cancelled / expired
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import redis

from web.batch.input import BatchError, read_input
from web.batch.store import Batch, BatchStore, Inflight
from worker.protocol import APIError

log = logging.getLogger(__name__)

STEP_LINES = 256  # lines started (or refused) per batch per step, so a step stays short


@dataclass
class Prepared:
    """A line ready to run: its job (whatever the executor's `enqueue` takes), and what it costs."""
    job_id: str
    job: Any
    reserved: int  # tokens reserved from the caller's limits
    user: str | None  # the body's `user`, whom the limits and the blocklist also apply to


@dataclass
class Outcome:
    """How a line's job ended: `done` (with the completion), `error` (with OpenAI's error body and
    status), `cancelled`, or `lost` (no trace of it left: it must run again)."""
    kind: str
    completion: dict | None = None
    error: dict | None = None
    status: int = 200


class Executor(Protocol):
    """What the dispatcher needs from the request path and the queue (web/batch/execution.py)."""

    def resolve_model(self, name: str) -> str | None: ...
    def prepare(self, batch: Batch, body: dict, job_id: str) -> Prepared: ...  # APIError: the line's error
    def admit(self, batch: Batch, prepared: Prepared) -> None: ...  # APIError: 401/403 the line's, 429 wait
    def settle(self, batch: Batch, inflight: Inflight, used_tokens: int) -> None: ...
    def enqueue(self, batch: Batch, prepared: Prepared) -> None: ...
    def exists(self, job_id: str) -> bool: ...
    def outcomes(self, job_ids: list[str]) -> dict[str, Outcome]: ...  # the ended ones only
    def cancel(self, job_ids: list[str]) -> None: ...


def new_job_id() -> str:
    return f"cmpl-{secrets.token_hex(16)}"


class Dispatcher:
    def __init__(self, store: BatchStore, executor: Executor, *, max_inflight: int = 32, lease_s: float = 10.0,
                 max_lines: int = 50_000, max_line_bytes: int = 0):
        self.store = store
        self.executor = executor
        self.max_inflight = max_inflight
        self.lease_s = lease_s
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes  # a line is a request's body: the same cap
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._retry_at: dict[str, float] = {}  # batch id → when its caller's rate limit lets lines start again
        self._cancelled: set[str] = set()  # jobs this process already asked to stop

    # ---- the loop ----

    def run(self, stopping: threading.Event, tick_s: float,
            scope: Callable[[], ContextManager | None] = contextlib.nullcontext) -> None:
        """Tick every `tick_s` until `stopping` is set, or until `scope()`, the context each tick
        runs in, is None (the app this dispatcher serves is gone)."""
        failing = False
        while not stopping.is_set():
            context = scope()
            if context is None:
                return
            try:
                with context:
                    self.tick()
                failing = False
            except redis.RedisError as exc:  # Redis away: try again at the next tick (said once per outage)
                if not failing:
                    log.warning("batch dispatch failed", extra={"error": repr(exc)})
                failing = True
            except Exception:  # a bug: logged, and the thread lives on
                log.exception("batch dispatch failed")
            del context
            stopping.wait(tick_s)
        with contextlib.suppress(redis.RedisError):
            for batch_id in self.store.active():
                self.store.release_lease(batch_id, self.token)

    def tick(self) -> None:
        """One step of every active batch whose lease this process holds or can take."""
        for batch_id in self.store.active():
            if not self.store.take_lease(batch_id, self.token, self.lease_s):
                continue
            try:
                self.step(batch_id)
            except redis.RedisError:
                raise
            except Exception:  # a bug must not stop the other batches; this one is retried next tick
                log.exception("batch step failed", extra={"batch_id": batch_id})

    def step(self, batch_id: str) -> None:
        batch = self.store.get(batch_id)
        if batch is None or batch.finished:
            self.store.forget(batch_id)
            return
        if batch.status == "validating":
            self._validate(batch)
            return
        self._collect(batch)
        batch = self.store.get(batch_id)
        if batch.status == "in_progress" and not batch.ending and time.time() >= batch.expires_at:
            self.store.begin_expiry(batch_id)
            log.info("batch expired", extra={"batch_id": batch_id, "done": batch.completed + batch.failed,
                                             "total": batch.total})
            batch = self.store.get(batch_id)
        if batch.stopping:
            self._wind_down(batch)
            return
        if batch.status == "in_progress":
            self._start_lines(batch)
            batch = self.store.get(batch_id)
        if batch.next >= batch.total and not self.store.inflight(batch_id) and batch.status in ("in_progress",
                                                                                                "finalizing"):
            self.store.mark_finalizing(batch_id)
            self._finish(batch_id)

    # ---- the phases ----

    def _validate(self, batch: Batch) -> None:
        stored = self.store.files.get(batch.input_file_id)
        content = self.store.files.read(batch.input_file_id) if stored else None
        if content is None:
            self.store.fail(batch.id, [BatchError("file_not_found", f"The input file {batch.input_file_id} "
                                                                    "no longer exists.", "input_file_id")])
            return
        checked = read_input(content, batch.endpoint, self.executor.resolve_model, self.max_lines,
                             self.max_line_bytes)
        if checked.errors:
            self.store.fail(batch.id, checked.errors)
            log.info("batch failed validation", extra={"batch_id": batch.id, "errors": len(checked.errors)})
        elif self.store.start(batch.id, checked.lines, checked.model):
            log.info("batch started", extra={"batch_id": batch.id, "lines": len(checked.lines),
                                             "model": checked.model})

    def _collect(self, batch: Batch) -> None:
        """Write the results of the lines in flight that ended; put back on the queue the ones a dead
        dispatcher claimed but never enqueued, or whose job vanished."""
        inflight = self.store.inflight(batch.id)
        queued = {i.job_id: i for i in inflight if i.queued}
        for i in inflight:
            if not i.queued:
                if self.executor.exists(i.job_id):
                    self.store.mark_queued(batch.id, i)
                elif batch.stopping:
                    self._record_skipped(batch, [i.index])
                else:
                    self._requeue(batch, i)
        for job_id, outcome in self.executor.outcomes(list(queued)).items():
            i = queued[job_id]
            if outcome.kind == "lost" and not batch.stopping:
                self._requeue(batch, i)
                continue
            line = self.store.line(batch.id, i.index)
            self._record_outcome(batch, i, line["custom_id"], outcome)

    def _start_lines(self, batch: Batch) -> None:
        if time.monotonic() < self._retry_at.get(batch.id, 0.0):
            return
        room = self.max_inflight - len(self.store.inflight(batch.id))
        index, stop = batch.next, min(batch.total, batch.next + STEP_LINES)
        while room > 0 and index < stop:
            line = self.store.line(batch.id, index)
            job_id = new_job_id()
            try:
                prepared = self.executor.prepare(batch, line["body"], job_id)
                self.executor.admit(batch, prepared)
            except APIError as err:
                if err.status == 429 and err.headers.get("x-should-retry") != "false":
                    # the caller's limits are spent for now: this line waits, as a client would
                    self._retry_at[batch.id] = time.monotonic() + _retry_after(err)
                    return
                if not self.store.claim(batch.id, Inflight(index, job_id, 0, None, False), self.max_inflight):
                    return
                self.store.record(batch.id, index, _response_line(line["custom_id"], job_id, err.status,
                                                                  err.body()), ok=False)
                index += 1
                continue
            inflight = Inflight(index, job_id, prepared.reserved, prepared.user, False)
            if not self.store.claim(batch.id, inflight, self.max_inflight):
                self.executor.settle(batch, inflight, 0)
                return
            self.executor.enqueue(batch, prepared)
            self.store.mark_queued(batch.id, inflight)
            index += 1
            room -= 1

    def _wind_down(self, batch: Batch) -> None:
        """A cancelled or expired batch: stop its running jobs; once none is left, every line without
        a result gets `batch_cancelled` / `batch_expired`, and the batch takes its final status."""
        inflight = self.store.inflight(batch.id)
        to_cancel = [i.job_id for i in inflight if i.queued and i.job_id not in self._cancelled]
        if to_cancel:
            self.executor.cancel(to_cancel)
            self._cancelled.update(to_cancel)
        if inflight:
            return
        for start in range(batch.next, batch.total, 1000):
            self._record_skipped(batch, list(range(start, min(start + 1000, batch.total))))
        self._finish(batch.id)

    def _finish(self, batch_id: str) -> None:
        batch = self.store.finish(batch_id)
        if batch is not None:
            self._retry_at.pop(batch_id, None)
            log.info("batch finished", extra={"batch_id": batch_id, "status": batch.status,
                                              "completed": batch.completed, "failed": batch.failed,
                                              "total": batch.total})

    # ---- lines ----

    def _requeue(self, batch: Batch, i: Inflight) -> None:
        """Enqueue a claimed line's job again (its first enqueue never happened, or its job left no
        trace); its tokens were already reserved when it was claimed."""
        line = self.store.line(batch.id, i.index)
        try:
            prepared = self.executor.prepare(batch, line["body"], i.job_id)
        except APIError as err:
            self.store.record(batch.id, i.index, _response_line(line["custom_id"], i.job_id, err.status,
                                                                err.body()), ok=False)
            self.executor.settle(batch, i, 0)
            return
        self.executor.enqueue(batch, prepared)
        self.store.mark_queued(batch.id, i)

    def _record_outcome(self, batch: Batch, i: Inflight, custom_id: str, outcome: Outcome) -> None:
        usage = (outcome.completion or {}).get("usage") or {}
        if outcome.kind == "done":
            line = _response_line(custom_id, i.job_id, 200, outcome.completion)
        elif outcome.kind == "error":
            line = _response_line(custom_id, i.job_id, outcome.status, outcome.error)
        else:  # cancelled (by the batch's cancel or expiry, or through /v1/jobs), or lost while stopping
            line = _skipped_line(custom_id, batch)
        ok = outcome.kind == "done"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if self.store.record(batch.id, i.index, line, ok, usage.get("prompt_tokens", 0),
                             usage.get("completion_tokens", 0), cached_tokens=cached):
            self.executor.settle(batch, i, usage.get("total_tokens", 0))

    def _record_skipped(self, batch: Batch, indices: list[int]) -> None:
        if not indices:
            return
        lines = self.store.lines(batch.id, indices[0], indices[-1] + 1)
        by_index = dict(zip(range(indices[0], indices[-1] + 1), lines))
        with self.store.redis.pipeline(transaction=False) as pipe:
            for index in indices:
                self.store.record(batch.id, index, _skipped_line(by_index[index]["custom_id"], batch), ok=False,
                                  client=pipe)
            pipe.execute()


def _response_line(custom_id: str, job_id: str, status: int, body: dict) -> dict:
    """A line of the output or error file for a request that got an HTTP answer."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": job_id, "body": body}, "error": None}


def _skipped_line(custom_id: str, batch: Batch) -> dict:
    """A line of the error file for a request the batch's cancel or expiry kept from running."""
    if batch.ending == "expired":
        error = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}
    else:
        error = {"code": "batch_cancelled", "message": "This request was not executed: the batch was cancelled."}
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": None, "error": error}


def _retry_after(err: APIError) -> float:
    try:
        return max(1.0, float(err.headers.get("Retry-After", 1)))
    except (TypeError, ValueError):
        return 1.0
