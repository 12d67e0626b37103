"""An engine in a process of its own, the worker's process keeping rq and the event writer.

A GPU engine's thread is busy launching: its forwards are short and each launch holds the GIL. In one
process with it, the consumer's rq bookkeeping and the event writer hold that GIL too, and slow its
forwards (measured: docs/notes/engine-process.md). `EngineProcess` runs the engine
(`processor.build_served_engine`) in a spawned child and stands in for it in the worker: `submit` gives a `RequestHandle` as the engine's does, the
child's events reach the worker's `StreamWriter` (which answers with cancels, sent back), a handle
ends when its job ends there, after that job's events (one pipe keeps them in order).

- The child ignores SIGINT and SIGTERM: the worker decides when it stops (after its running jobs).
  It exits when the worker's end of the pipe closes (the worker died: nothing is left to serve).
- A child that dies, or whose engine's thread dies, ends the pipe: the jobs still in it fail with
  EngineFault at once (rq retries them), `is_alive` turns false, the consumer takes no more jobs and
  processor.py exits 1, as when an engine's thread dies in the worker's own process.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
from typing import Any, Callable

from worker import protocol
from worker.engine import RequestHandle
from worker.errors import EngineError, EngineFault

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the child looks whether its engine's thread still runs
STATS_TIMEOUT_S = 5.0  # how long a stats snapshot may take to come back before the last one serves


class EngineBuildError(RuntimeError):
    """The child could not build its engine (what it raised, in words)."""


class EngineProcess:
    """The engine's side of a worker (`submit`, `stats`, `warming`, `slots`, `is_alive`, `stop`,
    `event_sink`) for an engine built and stepped in a child process. `build(sink)` builds and
    starts the engine in the child (a picklable callable: a module-level function or a partial of
    one); `setup()` runs first there (logging)."""

    def __init__(self, build: Callable[[Callable], Any], sink, setup: Callable[[], None] | None = None,
                 name: str = "nanoserve-engine"):
        self.event_sink = sink
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build, setup), name=name, daemon=True)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._numbers = itertools.count()
        self._replies: dict[int, dict] = {}
        self._replied = threading.Condition()
        self._last_stats: dict = {}
        self._open = True
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._process.join(5)
            kind, info = "failed", f"the engine's process exited with code {self._process.exitcode}"
        if kind != "ready":
            self._process.join(5)
            raise EngineBuildError(info)
        log.info("engine in a process of its own", extra={"pid": self._process.pid})
        self.slots: int = info["slots"]
        self._last_stats = info["stats"]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._write, name=f"{name}-send", daemon=True)
        self._sender.start()
        self._reader = threading.Thread(target=self._read, name=f"{name}-read", daemon=True)
        self._reader.start()

    # ---- the engine's interface ----

    def submit(self, job: protocol.CompletionJob, resume: dict[int, list[int]] | None = None) -> RequestHandle:
        number = next(self._numbers)
        handle = RequestHandle(job.id, lambda _job_id: self._send(("cancel", number)))
        self._handles[number] = handle
        if not self._send(("submit", number, job, resume)):
            self._handles.pop(number, None)
            handle.end(error=EngineFault("The engine stopped before the job started."))
        return handle

    def stats(self) -> dict:
        """A snapshot from the child (the last one it gave, if it does not answer in time)."""
        number = next(self._numbers)
        if self._send(("stats", number)):
            with self._replied:
                self._replied.wait_for(lambda: number in self._replies or not self._open, STATS_TIMEOUT_S)
                if number in self._replies:
                    self._last_stats = self._replies.pop(number)
        return dict(self._last_stats)

    @property
    def warming(self) -> bool:
        """Whether the child's engine still compiles its graphs in the background (never once stopped)."""
        return self._open and bool(self.stats().get("warming"))

    def is_alive(self) -> bool:
        return self._open and self._process.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine (its running jobs fail with EngineFault, their events and ends sent first)
        and the child; what the child sent until then is taken in."""
        if self._send(("stop",)):
            self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._reader.join(5)  # it fails the handles still open once the pipe has ended

    # ---- the pipe ----

    def _send(self, message: tuple) -> bool:
        """Queue a message for the child; False once the pipe has ended. Never blocks: the reader
        sends cancels, and were it to wait on a full pipe while the child waits on it, neither would
        go on."""
        with self._send_lock:
            if not self._open:
                return False
            self._outbox.put(message)
            return True

    def _write(self) -> None:
        """The sender's thread: the queued messages down the pipe, in order."""
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone; the reader sees the pipe end
                return

    def _read(self) -> None:
        """The worker's side: events to the writer (its cancels back to the child), ended jobs to
        their handles, stats to whoever asked."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "events":
                try:
                    cancelled = self.event_sink(message[1]) or ()
                except Exception:
                    log.exception("event sink failed; %d events lost", len(message[1]))
                    cancelled = ()
                if cancelled:
                    self._send(("cancel_jobs", list(cancelled)))
            elif kind == "end":
                _, number, result, error = message
                handle = self._handles.pop(number, None)
                if handle is not None:
                    handle.end(result, error)
            elif kind == "stats":
                with self._replied:
                    self._replies[message[1]] = message[2]
                    self._replied.notify_all()
            elif kind == "stopped":
                break
        with self._send_lock:
            self._open = False
            self._outbox.put(None)
        with self._replied:
            self._replied.notify_all()
        if self._process.is_alive():
            self._process.join(5)
        if self._process.exitcode not in (0, None):
            log.error("the engine's process died", extra={"exit_code": self._process.exitcode})
        self._fail_open_handles()  # no end can come for them now

    def _fail_open_handles(self) -> None:
        for number in list(self._handles):
            handle = self._handles.pop(number, None)
            if handle is not None and not handle.done:
                handle.end(error=EngineFault("The engine stopped before the job finished."))


def _serve(conn, build: Callable[[Callable], Any], setup: Callable[[], None] | None) -> None:
    """The child: build the engine, then take the worker's messages until it says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if setup is not None:
        setup()
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    def sink(events):  # on the engine's thread; cancels come back as messages
        send(("events", events))
        return ()

    try:
        engine = build(sink)
    except BaseException as err:  # noqa: BLE001 - said to the worker, which exits on it
        send(("failed", f"{type(err).__name__}: {err}"))
        return
    handles: dict[int, RequestHandle] = {}
    by_job: dict[str, int] = {}

    def ended(number: int, handle: RequestHandle) -> None:  # on the engine's thread, after its events
        handles.pop(number, None)
        if by_job.get(handle.job_id) == number:
            del by_job[handle.job_id]
        try:
            send(("end", number, handle.result(0), None))
        except EngineError as err:
            send(("end", number, None, err))

    send(("ready", {"slots": engine.runner.slots, "stats": {**engine.stats(), "warming": engine.warming}}))
    while True:
        try:
            if not conn.poll(WATCH_S):
                if not engine.is_alive():  # an exception ended its thread (logged by threading.excepthook)
                    _leave(1)  # the worker sees the pipe end: as a dead engine thread in its own process
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the worker is gone
            engine.stop(timeout=5)
            _leave(0)
        kind = message[0]
        if kind == "submit":
            _, number, job, resume = message
            handle = engine.submit(job, resume)
            handles[number], by_job[job.id] = handle, number
            handle.add_done_callback(lambda h, number=number: ended(number, h))
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                handle.cancel()
        elif kind == "cancel_jobs":
            for job_id in message[1]:
                handle = handles.get(by_job.get(job_id, -1))
                if handle is not None:
                    handle.cancel()
        elif kind == "stats":
            send(("stats", message[1], {**engine.stats(), "warming": engine.warming}))
        elif kind == "stop":
            engine.stop()
            send(("stopped",))
            _leave(0)


def _leave(status: int) -> None:
    """Exit without the interpreter's teardown: a background compile still running on its thread
    would abort it (std::terminate), and the worker has what it needs (processor.py leaves so too)."""
    logging.shutdown()
    os._exit(status)
