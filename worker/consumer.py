"""The rq side of a worker process: `run_completion` (the job function) and the threads that feed
jobs from rq to the engines.

A process serves one engine per (model, device). Each engine gets `concurrency` rq `SimpleWorker`s,
each on a thread of its own, all pulling from the model's queue: a job holds its thread while the
engine runs it in the shared batch, so `concurrency` bounds how many of the queue's jobs one engine
runs at once. rq's own bookkeeping (registries, results, `Retry`) is kept as is; added on top:

- a heartbeat thread refreshing running jobs' StartedJobRegistry entries with a short TTL, so the
  jobs of a worker that died (kill -9, OOM, lost machine) expire within seconds and are re-queued
  (the jobs carry `Retry`) by any surviving worker's registry maintenance;
- a retried job resumes from the tokens its earlier attempt already wrote to the job's stream;
- most threads also take jobs of the model's batch queue, but only when no interactive job waits
  (worker/priority.py); the others take interactive jobs only, so a running batch never holds every
  thread of an engine;
- when rq gives up on a job (no retries left), its stream gets an `error` event so readers stop;
- a job delivered again while it runs on this engine (its id back in a queue) waits for the
  running attempt and ends as it does, rather than failing as a second copy of it;
- of an engine's idle threads, only `LISTENERS` of each kind (those that take batch jobs, those
  that do not) wait on Redis at a time; the others wait their turn on a semaphore, their rq keys
  kept alive by the heartbeat thread. Every wake of a thread polling Redis holds the GIL the
  engine's thread needs for its step.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError
from rq import Queue, SimpleWorker, get_current_job, worker_registration
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import WorkerStatus

from worker import protocol
from worker.errors import EngineError, EngineFault
from worker.priority import PriorityQueue
from worker.events import StreamWriter, append_event, open_attempt, read_history

log = logging.getLogger(__name__)

# Idle threads of each kind listening on an engine's queues at once. A job wakes a listener at once;
# the thread that takes the next turn starts listening a rq poll cycle (a few Redis calls) later.
# With every idle thread listening, 32 threads per engine served 8 concurrent requests 11% (float32)
# and 20% (bfloat16) slower than 8 threads did, medians of three runs (docs/notes/idle-listeners.md).
LISTENERS = 2
# How often a worker's beats write its whole record and queue memberships again, at most (seconds).
REREGISTER_S = 1.0


@dataclass
class Binding:
    """The engine a worker thread feeds; `run_completion` finds it through the thread it runs on."""

    model_id: str
    engine: Any  # worker.engine.Engine
    writer: StreamWriter
    running: dict[str, Any] = field(default_factory=dict)  # job id -> its engine handle, while it runs
    lock: threading.Lock = field(default_factory=threading.Lock)


_local = threading.local()


def bind(binding: Binding) -> None:
    _local.binding = binding


# ---- the job function ----------------------------------------------------------------------

def run_completion(payload: dict[str, Any]) -> dict[str, Any] | None:
    """Run one completions job on this thread's engine; return the OpenAI completion object.

    A request the engine refuses, or a cancelled one, ends with its `error`/`cancelled` event and a
    normal return (a retry could not change it). A fault raises with the job's stream left open:
    rq's retry resumes it, and once retries run out `report_given_up` ends the stream with an error.
    rq's job timeout (raised into this thread) counts as a fault: it takes the job out of the engine
    without a `cancelled` event.
    """
    binding: Binding = _local.binding
    rq_job = get_current_job()
    client = rq_job.connection
    try:
        job = protocol.CompletionJob.from_payload(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = f"Invalid job payload: {first['msg']} ({'.'.join(map(str, first['loc']))})."
        append_event(client, rq_job.id, "error", protocol.error_body(message))
        return None
    if job.model != binding.model_id:
        message = f"This worker serves `{binding.model_id}`, not `{job.model}`."
        append_event(client, job.id, "error", protocol.error_body(message, param="model"))
        return None

    # A copy delivered while this engine runs the job must not open an attempt of its own: that
    # would fence the running one out of the job's stream.
    with binding.lock:
        if (earlier := binding.running.get(job.id)) is None:
            if binding.writer.holds(job.id):  # an attempt of ours whose events an outage kept back
                binding.writer.wait_written(timeout=10.0)
            history = open_attempt(client, job.id)
            if history.terminal is None and not history.cancelled:
                binding.writer.track(job.id, history.attempt_ms, streamed=job.stream)
                handle = binding.running[job.id] = binding.engine.submit(job, resume=history.tokens or None)
    if earlier is not None:
        log.warning("job delivered again while it runs; waiting for the running attempt", extra={"job_id": job.id})
        return _outcome(earlier, binding.engine)
    if history.terminal is not None:
        # An earlier attempt ended the job but died before rq recorded it.
        kind, data = history.terminal
        return data.get("completion") if kind == "done" else None
    if history.cancelled:
        append_event(client, job.id, "cancelled", {}, entry_id=f"{history.attempt_ms}-1")
        return None

    started = time.monotonic()
    try:
        try:
            completion = _outcome(handle, binding.engine)
        except EngineFault:
            raise  # no event was written: rq's retry resumes the job
        except BaseException:  # e.g. rq's job timeout: take the job out of the engine
            _abandon(binding.writer, handle)
            raise
    finally:
        with binding.lock:
            del binding.running[job.id]
            binding.writer.untrack(job.id)
    if completion is None:
        return None
    log.info("job finished", extra={
        "job_id": job.id, "model": job.model, "seconds": round(time.monotonic() - started, 3),
        "completion_tokens": completion["usage"]["completion_tokens"],
        "resumed_tokens": sum(len(t) for t in history.tokens.values())})
    return completion


def _outcome(handle, engine) -> dict[str, Any] | None:
    """The completion of a job running in the engine; None when it was refused or cancelled (the
    engine wrote its event). A fault raises with no event written: rq's retry resumes the job."""
    try:
        return _wait(handle, engine)
    except EngineFault:
        raise
    except EngineError as err:  # refused or cancelled
        log.info("job ended", extra={"job_id": handle.job_id, "outcome": err.type, "reason": err.message})
        return None


def _wait(handle, engine) -> dict[str, Any]:
    # Wait in short slices: rq's TimerDeathPenalty raises its timeout into this thread, and Python
    # delivers that only between bytecodes, never inside one long blocking wait. A job whose engine
    # thread is gone (it died, or was stopped) will never end: it fails now, and rq retries it.
    while True:
        try:
            return handle.result(timeout=1.0)
        except TimeoutError:
            if not engine.is_alive() and not handle.done:
                raise EngineFault("The engine stopped before the job finished.") from None


def _abandon(writer: StreamWriter, handle) -> None:
    """Take a job out of the engine without ending its stream (no `cancelled` event)."""
    if handle.done:  # it ended on its own meanwhile; its events stand
        return
    ended = writer.silence(handle.job_id)
    handle.cancel()
    if not ended.wait(timeout=30):
        log.warning("engine did not let go of job", extra={"job_id": handle.job_id})
    writer.unsilence(handle.job_id)


def report_given_up(job: Job, exc_type, exc_value, traceback) -> bool:
    """rq exception handler: when a job fails for good (no retries left), end its stream with an
    `error` event so readers stop waiting. Also called for jobs of dead workers (AbandonedJobError)."""
    if job.should_retry:
        return True
    try:
        if read_history(job.connection, job.id).terminal is None:
            body = protocol.error_body("The server had an error while processing your request.",
                                       "server_error")
            append_event(job.connection, job.id, "error", body)
    except redis.RedisError:
        log.exception("could not record failure of job %s", job.id)
    log.error("job failed", extra={"job_id": job.id, "error": f"{exc_type.__name__}: {exc_value}"})
    return True


# ---- the rq workers ------------------------------------------------------------------------

class ForeignJob(Exception):
    """A job in a model's queue that does not call `protocol.JOB_FUNCTION`."""


class CompletionRqJob(Job):
    """An rq job that runs `run_completion` and nothing else. rq imports and calls whatever function,
    callbacks and webhooks a job's hash in Redis names; ours name only the function, so a job written
    into Redis some other way cannot make a worker import or call code, or send a request, of its choosing."""

    @property
    def func(self):
        if self.func_name != protocol.JOB_FUNCTION or self.instance is not None:
            raise ForeignJob(f"The job calls {self.func_name!r}, not {protocol.JOB_FUNCTION}.")
        return run_completion

    success_callback = failure_callback = stopped_callback = property(lambda self: None)

    def send_webhooks(self, status, *, exc_string=None) -> None:
        pass


class OutageGrace:
    """Redis away for a while: the registry entries of jobs running on live workers may have lapsed
    meanwhile (their beats could not land). Cleaning the registries then would re-queue those jobs
    and run each twice, so it waits until every live worker has had `ttl` to beat again."""

    def __init__(self, ttl: float):
        self.ttl = ttl
        self._lost_at: float | None = None

    def lost(self) -> None:
        self._lost_at = time.monotonic()

    def allows_cleaning(self) -> bool:
        return self._lost_at is None or time.monotonic() - self._lost_at > self.ttl


class EngineWorker(SimpleWorker):
    """An rq SimpleWorker that lives on a thread of its own (so many can share one engine).

    - Job timeouts use a timer thread (SIGALRM only reaches the main thread).
    - Signals belong to the main thread; it stops the workers through `request_stop`.
    - Dequeue blocks at most `poll_interval` at a time, so a stop request is seen promptly, and
      only while the worker holds a turn of `listeners` (a semaphore its kind of thread shares).
    - Running jobs' registry entries live `heartbeat_ttl` seconds; `beat()` refreshes them.
    - Registries are cleaned only as `grace` allows (see OutageGrace).
    - Its record in Redis says whether its engine still compiles its graphs (`warming`: web's /ready).
    """

    death_penalty_class = TimerDeathPenalty
    queue_class = PriorityQueue
    job_class = CompletionRqJob
    max_connection_wait_time = 5.0  # rq backs off up to this while Redis is away (its default: 60 s)

    def __init__(self, *args, heartbeat_ttl: int, poll_interval: int,
                 listeners: threading.Semaphore | None = None, grace: OutageGrace | None = None,
                 warming=lambda: False, **kwargs):
        self.heartbeat_ttl = heartbeat_ttl
        self.warming = warming
        self.grace = grace
        self.poll_interval = poll_interval
        self.listeners = listeners
        self._waiting = False  # for a turn to listen: rq's dequeue loop is not beating our key
        self._running: Job | None = None
        self._running_lock = threading.Lock()
        self._registered = -math.inf  # when a beat last wrote the worker's record and memberships
        self._beaten = (-math.inf, None)  # when a beat was last sent, and its warming flag
        super().__init__(*args, **kwargs)

    def _install_signal_handlers(self) -> None:
        pass

    def subscribe(self) -> None:
        # rq's pubsub commands (stop-job, shutdown) act through signals and forked horses, neither of
        # which a worker thread has; skipping them saves a connection and a thread per worker.
        pass

    def clean_registries(self) -> None:
        if self.grace is None or self.grace.allows_cleaning():
            super().clean_registries()

    @property
    def should_run_maintenance_tasks(self) -> bool:
        # The pool's heartbeat thread cleans the registries for every thread (WorkerPool._maintain):
        # rq's own, every thread every maintenance interval, would lie on the path that takes the next job.
        return False

    def request_stop(self, signum=None, frame=None) -> None:
        """Take no new job; the running one finishes."""
        self._stop_requested = True

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.heartbeat_ttl

    def serialize(self) -> dict:
        return {**super().serialize(), protocol.WARMING_FIELD: int(self.warming())}

    def set_state(self, state: str, pipeline=None) -> None:
        # rq sets IDLE after every job and again before every dequeue: a round trip on the path
        # that takes the next job, for a state Redis already holds
        if pipeline is not None or state != self._state:
            super().set_state(state, pipeline)

    def heartbeat(self, timeout=None, pipeline=None) -> None:
        # rq keeps a worker's key `worker_ttl + 60` s past each beat; ours beat every few seconds,
        # so a short TTL lets a dead process drop out of the queue's live workers (web's /ready).
        # rq also beats on its own several times per job (after it, before each dequeue): a round
        # trip each on the path that takes the next job, skipped within a quarter TTL of the last
        # unless the record changes.
        warming = int(self.warming())
        recent = time.monotonic() - self._beaten[0] < self.heartbeat_ttl / 4
        if pipeline is None and recent and warming == self._beaten[1]:
            return
        self._beaten = (time.monotonic(), warming)
        connection = pipeline if pipeline is not None else self.connection.pipeline()
        super().heartbeat(self.heartbeat_ttl, pipeline=connection)
        connection.hset(self.key, protocol.WARMING_FIELD, warming)  # web's /ready reads it at every beat
        if self.birth_date is not None and time.monotonic() - self._registered >= REREGISTER_S:
            # A worker cut off from Redis past that TTL was dropped from the queues' worker sets by
            # other workers' maintenance, and rq's beat alone would leave it there, unseen (web would
            # answer 503 "no worker"): beats write its record and memberships again, at most every
            # REREGISTER_S (rq beats several times per job, each record a dozen fields built in Python).
            self._registered = time.monotonic()
            connection.hset(self.key, mapping=self.serialize())
            worker_registration.register(self, connection)
        if pipeline is None:
            connection.execute()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        while not self._stop_requested:
            if not self._take_turn():
                continue
            try:  # a turn taken as the stop came: the thread leaves without listening
                result = None if self._stop_requested else \
                    super().dequeue_job_and_maintain_ttl(self.poll_interval, max_idle_time=self.poll_interval)
            finally:
                if self.listeners is not None:
                    self.listeners.release()
            if result is None:
                continue
            if self._stop_requested:  # the stop came while we were blocked on the queue
                self._put_back(*result)
                return None
            return result
        return None

    def _take_turn(self) -> bool:
        """Wait up to `poll_interval` for a turn to listen on the queues (always one without `listeners`)."""
        if self.listeners is None:
            return True
        self._waiting = True
        try:
            return self.listeners.acquire(timeout=self.poll_interval)
        finally:
            self._waiting = False

    def _put_back(self, job: Job, queue: Queue) -> None:
        """Return a just-dequeued job to the front of its queue for another worker."""
        with self.connection.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            queue.push_job_id(job.id, pipeline=pipe, at_front=True)
            pipe.execute()

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        # Every dequeue here goes through the queue's intermediate list (PriorityQueue), also from
        # two queues, where rq's own dequeue would not: take the job out of it as it starts.
        super().prepare_job_execution(job, remove_from_intermediate_queue=True)

    def execute_job(self, job: Job, queue: Queue) -> None:
        self.prepare_execution(job)
        with self._running_lock:
            self._running = job
        try:
            self.perform_job(job, queue)
        finally:
            self._stop_beating()
        self.set_state(WorkerStatus.IDLE)

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        # Stop heartbeats before rq removes the job from the registries, so none re-creates them.
        self._stop_beating()
        super().handle_execution_ended(job, queue, heartbeat_ttl)

    def _stop_beating(self) -> None:
        with self._running_lock:
            self._running = None

    @property
    def busy(self) -> bool:
        return self._running is not None

    def beat(self) -> None:
        """Refresh the running job's registry entry, execution and this worker's key; or, waiting
        for a turn to listen, the key alone."""
        with self._running_lock:
            if self._running is not None:
                self.maintain_heartbeats(self._running)
            elif self._waiting:
                self.heartbeat()


class WorkerPool:
    """Starts and stops the rq worker threads of every engine, plus the heartbeat thread."""

    def __init__(self, redis_url: str, *, heartbeat_interval: float = 5.0, maintenance_interval: int = 5,
                 poll_interval: int = 1, worker_ttl: int = 20):
        self.redis_url = redis_url
        self.heartbeat_interval = heartbeat_interval
        self.maintenance_interval = maintenance_interval
        self.poll_interval = poll_interval
        self.worker_ttl = worker_ttl
        self.workers: list[EngineWorker | None] = []
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="rq-heartbeat", daemon=True)
        self.queue_names: list[str] = []  # every queue a thread here listens on
        self._maintainer: EngineWorker | None = None
        self.grace = OutageGrace(self.heartbeat_ttl + heartbeat_interval)

    def add(self, binding: Binding, device: str, concurrency: int, batch_concurrency: int | None = None) -> None:
        """Start `concurrency` worker threads feeding this engine; `batch_concurrency` of them (default:
        all) also take the model's batch jobs when no interactive job waits."""
        interactive = protocol.queue_name(binding.model_id)
        batch_threads = concurrency if batch_concurrency is None else batch_concurrency
        turns = {kind: threading.Semaphore(LISTENERS) for kind in ("batch", "interactive")}
        for i in range(concurrency):
            slot = len(self.workers)
            self.workers.append(None)
            name = f"{socket.gethostname()}:{os.getpid()}:{binding.model_id}:{device}:{slot}"
            queues = [interactive, protocol.batch_queue_name(binding.model_id)] if i < batch_threads else [interactive]
            self.queue_names += [name for name in queues if name not in self.queue_names]
            listeners = turns["batch" if i < batch_threads else "interactive"]
            thread = threading.Thread(target=self._serve, args=(slot, name, queues, binding, listeners),
                                      name=f"rq-{binding.model_id}-{device}-{i}", daemon=True)
            self.threads.append(thread)
            thread.start()
        if not self._heartbeat.is_alive():
            self._heartbeat.start()

    def _new_worker(self, name: str, queues: list[str], listeners: threading.Semaphore | None = None,
                    warming=lambda: False) -> EngineWorker:
        connection = protocol.redis_client(self.redis_url)
        return EngineWorker(queues, name=name, connection=connection, serializer=protocol.SERIALIZER,
                            worker_ttl=self.worker_ttl, job_monitoring_interval=int(self.heartbeat_interval) or 1,
                            maintenance_interval=self.maintenance_interval,
                            exception_handlers=[report_given_up], heartbeat_ttl=self.heartbeat_ttl,
                            poll_interval=self.poll_interval, listeners=listeners, grace=self.grace,
                            warming=warming)

    @property
    def heartbeat_ttl(self) -> int:
        # Three missed beats before a job counts as abandoned.
        return max(3, int(3 * self.heartbeat_interval))

    def _serve(self, slot: int, name: str, queues: list[str], binding: Binding,
               listeners: threading.Semaphore) -> None:
        """One worker thread: rq's work loop, restarted if it ends before we stop (rq leaves its
        loop on some Redis errors, e.g. when Redis restarts in the middle of a job)."""
        bind(binding)
        generation, failing = 0, False
        while not self.stopping.is_set():
            try:
                worker = self._new_worker(f"{name}.{generation}", queues, listeners,
                                          lambda: bool(getattr(binding.engine, "warming", False)))
                failing = False
                self.workers[slot] = worker
                if self.stopping.is_set():
                    break
                worker.work(logging_level=None)
            except Exception as exc:  # Redis unreachable: try again shortly (said once per outage)
                self.grace.lost()
                log.log(logging.DEBUG if failing else logging.WARNING, "rq worker loop failed",
                        extra={"worker": name, "error": str(exc)})
                failing = True
            generation += 1
            if not self.stopping.wait(2.0) and not failing:
                log.info("restarting rq worker", extra={"worker": name})

    def _heartbeat_loop(self) -> None:
        last_maintenance = time.monotonic()
        failing = False
        while not self.stopping.wait(self.heartbeat_interval) or self.busy():
            errors = []
            for worker in list(self.workers):
                try:
                    if worker is not None:
                        worker.beat()
                except redis.RedisError as exc:
                    errors.append(str(exc))
                except Exception:  # a bug: said, but the other workers' jobs must keep their beats
                    log.exception("job heartbeat failed", extra={"worker": worker.name})
            if errors:
                self.grace.lost()
            if errors and not failing:
                log.warning("job heartbeats failing", extra={"error": errors[0]})
            failing = bool(errors)
            if time.monotonic() - last_maintenance >= self.maintenance_interval:
                last_maintenance = time.monotonic()
                self._maintain()

    def _maintain(self) -> None:
        """Re-queue dead workers' jobs even when every thread here is busy with a long job. On a
        worker of its own that never runs a job: rq retries a job lost from a queue's intermediate
        list through the cleaning worker's `handle_job_failure`, which also deletes that worker's
        current execution, i.e. a busy worker's running job and its heartbeats."""
        try:
            if self._maintainer is None or self._maintainer.queue_names() != self.queue_names:
                name = f"{socket.gethostname()}:{os.getpid()}:maintenance"
                self._maintainer = self._new_worker(name, list(self.queue_names))
            self._maintainer.clean_registries()
        except redis.RedisError as exc:
            self.grace.lost()
            log.warning("registry maintenance failed", extra={"error": repr(exc)})

    def running(self) -> int:
        """Jobs running on this pool's workers."""
        return sum(1 for w in self.workers if w is not None and w.busy)

    def busy(self) -> bool:
        return self.running() > 0

    def stop(self) -> None:
        """Stop taking jobs; running ones finish (call `join` to wait for them)."""
        self.stopping.set()
        for worker in self.workers:
            if worker is not None:
                worker.request_stop()

    def join(self, idle_grace: float = 2.0) -> None:
        """Wait for the threads running a job to finish it, while Redis answers (its result has
        somewhere to go; with Redis gone the job is re-queued from its registry once Redis is back).
        An idle thread gets `idle_grace` to leave: one stuck in rq's reconnect loop is left behind
        (the threads are daemons)."""
        deadline = time.monotonic() + idle_grace
        for slot, thread in enumerate(self.threads):
            while thread.is_alive():
                thread.join(timeout=0.5)
                worker = self.workers[slot]
                if time.monotonic() > deadline and not (worker is not None and worker.busy and self._redis_answers()):
                    break
        self._heartbeat.join(timeout=(self.heartbeat_interval + 1) if self._redis_answers() else 0.5)

    def _redis_answers(self) -> bool:
        client = protocol.redis_client(self.redis_url, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

