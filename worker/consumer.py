"""The rq side of a worker process: each engine's consumer, which takes its jobs from rq, runs them
in the engine's batch and records their ends in rq's bookkeeping (registries, results, `Retry`).

A process serves one engine per (model, device); each engine has one `Consumer`, registered with
rq as one worker, running up to `concurrency` of its queues' jobs at once:

- its taking thread moves as many jobs as the engine has room for off the queues (worker/priority.py:
  interactive jobs first; the batch queue's only when no interactive job waits, and at most
  `batch_concurrency` at once, so a running batch never holds the whole engine) and starts them all
  in one transaction: rq's execution and StartedJobRegistry entries, the job's status, and the new
  attempt on each job's stream (worker/events.py `queue_attempt`, which fences out earlier
  attempts and replays what they wrote: a retried job resumes from its tokens). Then it submits them
  to the engine;
- its recording thread takes the jobs the engine ended (their handles call back) and records every
  finished one of a batch in one transaction; a fault (EngineFault, rq's job timeout) goes through
  rq's failure path: retried while the job has retries, and once they run out `report_given_up`
  ends its stream with an `error` event;
- the pool's heartbeat thread beats every running job's registry entry and execution with a short
  TTL, so the jobs of a worker that died (kill -9, OOM, lost machine) expire within seconds and are
  re-queued by any surviving worker's registry maintenance, which that thread also runs;
- a job delivered again while it runs on this engine (its id back in a queue) ends as the running
  attempt does, rather than failing as a second copy of it.

Every Redis round trip and every line of rq's per-job Python holds the GIL that the engine's thread
steps with; batches keep them to a few per burst of jobs instead of a dozen per job
(docs/notes/consumer.md).
"""
from __future__ import annotations

import logging
import math
import os
import queue as queues
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError
from rq import Queue, SimpleWorker, worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.results import Result
from rq.suspension import is_suspended
from rq.timeouts import JobTimeoutException
from rq.utils import now, utcformat
from rq.worker import WorkerStatus

from worker import protocol
from worker.errors import EngineError, EngineFault
from worker.events import History, StreamWriter, append_event, attempt_opened, queue_attempt, read_history
from worker.priority import PriorityQueue, take

log = logging.getLogger(__name__)

# How often a worker's beats write its whole record and queue memberships again, at most (seconds).
REREGISTER_S = 1.0
# How often a consumer asks whether `rq suspend` holds its worker, at most (seconds): rq's own worker
# asks before every job.
SUSPENSION_CHECK_S = 1.0
# How long recording ended jobs waits for their last events to be written (seconds); past it, as
# when Redis is away, the records are tried again on the next turn of the loop.
RECORD_WAIT_S = 2.0


@dataclass
class Binding:
    """The engine a consumer feeds, and the writer of its events."""

    model_id: str
    engine: Any  # worker.engine.Engine
    writer: StreamWriter
    running: dict[str, Running] = field(default_factory=dict)  # job id -> its attempt, while in the engine
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Running:
    """A job a consumer started: its rq job, queue and execution; the engine's `handle` and the
    `history` its attempt resumed from, or, for a job that ended as it started, its `value` (the
    completion or None) or `failure` (exc_info); `deadline`, rq's job timeout (monotonic seconds);
    `silenced`, set once a timed-out job's events are dropped (StreamWriter.silence); `followers`,
    deliveries of the same job that end as this one does."""

    job: Job
    queue: Queue
    deadline: float
    execution: Execution | None = None
    handle: Any = None
    history: History | None = None
    value: Any = None
    failure: tuple | None = None
    outcome: Any = None  # once it ended: its result, or the exc_info of its failure (`_outcome`)
    silenced: threading.Event | None = None
    followers: list[Running] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


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


# ---- the rq side ---------------------------------------------------------------------------

class ForeignJob(Exception):
    """A job in a model's queue that does not name `protocol.JOB_FUNCTION`."""


class CompletionRqJob(Job):
    """An rq job as a consumer reads it. rq imports and calls whatever function, callbacks and
    webhooks a job's hash in Redis names; a consumer runs the payload of jobs that name the job
    function on its engine, and imports, calls or sends nothing a job names."""

    def check(self) -> None:
        """Raise ForeignJob unless the job names the job function (and no instance to call it on)."""
        if self.func_name != protocol.JOB_FUNCTION or self.instance is not None:
            raise ForeignJob(f"The job calls {self.func_name!r}, not {protocol.JOB_FUNCTION}.")

    @property
    def func(self):
        self.check()
        raise TypeError("A completion job runs on a consumer's engine: nothing imports or calls the function it names.")

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
    """A consumer's identity in rq: its worker record (which web's /ready and `rq info` read), its
    beats, and rq's handling of a failed job. It never runs rq's work loop (the consumer takes and
    records jobs itself), so it has no signals, no pubsub and no maintenance of its own.

    - Its record's key lives `heartbeat_ttl` seconds past each beat, and says whether its engine
      still compiles its graphs (`warming`: web's /ready).
    - Registries are cleaned only as `grace` allows (see OutageGrace).
    """

    queue_class = PriorityQueue
    job_class = CompletionRqJob

    def __init__(self, *args, heartbeat_ttl: int, grace: OutageGrace | None = None, warming=lambda: False, **kwargs):
        self.heartbeat_ttl = heartbeat_ttl
        self.warming = warming
        self.grace = grace
        self._registered = -math.inf  # when a beat last wrote the worker's record and memberships
        self._beaten = (-math.inf, None)  # when a beat was last sent, and its warming flag
        super().__init__(*args, **kwargs)

    def subscribe(self) -> None:
        # rq's pubsub commands (stop-job, shutdown) act through signals and forked horses, which a
        # consumer has not; skipping them saves a connection and a thread.
        pass

    def clean_registries(self) -> None:
        if self.grace is None or self.grace.allows_cleaning():
            super().clean_registries()

    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.heartbeat_ttl

    def serialize(self) -> dict:
        return {**super().serialize(), protocol.WARMING_FIELD: int(self.warming())}

    def set_state(self, state: str, pipeline=None) -> None:
        if state != self._state:  # a round trip for a state Redis already holds, otherwise
            super().set_state(state, pipeline)

    def heartbeat(self, timeout=None, pipeline=None) -> None:
        # rq keeps a worker's key `worker_ttl + 60` s past each beat; ours beat every few seconds,
        # so a short TTL lets a dead process drop out of the queue's live workers (web's /ready).
        # Outside a transaction, a beat within a quarter TTL of the last is skipped unless the
        # record changes (rq's failure path beats on its own).
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
            # REREGISTER_S.
            self._registered = time.monotonic()
            connection.hset(self.key, mapping=self.serialize())
            worker_registration.register(self, connection)
        if pipeline is None:
            connection.execute()


class Consumer:
    """One engine's side of its queues (see the module docstring): a taking thread and a recording
    thread, and the jobs running in the engine."""

    def __init__(self, pool: WorkerPool, binding: Binding, name: str, queue_names: list[str], concurrency: int,
                 batch_concurrency: int):
        self.pool, self.binding, self.name = pool, binding, name
        self.queue_names, self.concurrency, self.batch_concurrency = queue_names, concurrency, batch_concurrency
        self.worker: EngineWorker | None = None
        self.running: set[Running] = set()
        self._room = threading.Condition()  # guards `running`; notified as jobs end
        self._ended: queues.SimpleQueue[Running] = queues.SimpleQueue()
        thread_name = f"rq-{name.split(':', 2)[-1]}"
        self._taking = threading.Thread(target=self._take_loop, name=f"{thread_name}-take", daemon=True)
        self._recording = threading.Thread(target=self._record_loop, name=f"{thread_name}-record", daemon=True)

    def start(self) -> None:
        self._taking.start()
        self._recording.start()

    # ---- taking ----

    def _take_loop(self) -> None:
        failing, checked = False, -math.inf
        while not self.pool.stopping.is_set():
            try:
                if self.worker is None:
                    self.worker = self._register()
                    failing = False
                worker = self.worker
                if time.monotonic() - checked >= SUSPENSION_CHECK_S:
                    checked = time.monotonic()
                    if is_suspended(worker.connection, worker):  # `rq suspend`
                        worker.set_state(WorkerStatus.SUSPENDED)
                        checked = -math.inf
                        self.pool.stopping.wait(SUSPENSION_CHECK_S)
                        continue
                engine = self.binding.engine
                if engine is not None and not engine.is_alive():  # its process exits: the queues' jobs are others'
                    self.pool.stopping.wait(self.pool.poll_interval)
                    continue
                with self._room:
                    free = self.concurrency - len(self.running)
                    batch_free = self.batch_concurrency - sum(r.queue.name != self.queue_names[0] for r in self.running)
                    if free <= 0:
                        self._room.wait(self.pool.poll_interval)
                        continue
                taken = take(self._queues, [free, batch_free], self.pool.poll_interval, worker.connection,
                             CompletionRqJob, protocol.SERIALIZER)
                if taken and self.pool.stopping.is_set():  # the stop came while we waited on the queues
                    self._put_back(taken)
                elif taken:
                    self._start(taken)
                elif not self.running:
                    worker.set_state(WorkerStatus.IDLE)
                failing = False
            except Exception as exc:  # Redis unreachable: try again shortly (said once per outage)
                self.pool.grace.lost()
                log.log(logging.DEBUG if failing else logging.WARNING, "taking jobs failed",
                        extra={"worker": self.name, "error": str(exc)}, exc_info=not isinstance(exc, redis.RedisError))
                failing = True
                self.pool.stopping.wait(2.0)

    def _put_back(self, taken: list[tuple[Job, Queue]]) -> None:
        """Return jobs just taken to the front of their queues, in their order, for another worker."""
        with self.worker.connection.pipeline() as pipe:
            for job, queue in reversed(taken):
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                queue.push_job_id(job.id, pipeline=pipe, at_front=True)
            pipe.execute()

    def _register(self) -> EngineWorker:
        worker = self.pool._new_worker(self.name, self.queue_names,
                                       lambda: bool(getattr(self.binding.engine, "warming", False)))
        worker.register_birth()
        self._queues = [PriorityQueue(name, connection=worker.connection, serializer=protocol.SERIALIZER)
                        for name in self.queue_names]
        return worker

    def _start(self, taken: list[tuple[Job, Queue]]) -> None:
        """Start the jobs taken, in one transaction, and submit them to the engine."""
        worker, binding = self.worker, self.binding
        ttl, started = self.pool.heartbeat_ttl, time.monotonic()
        runs, payloads, refused = [], {}, []
        for job, queue in taken:
            run = Running(job, queue, started + (job.timeout or Queue.DEFAULT_TIMEOUT))
            runs.append(run)
            try:
                job.check()  # also reads the job's data: one another serializer wrote raises here
            except Exception:
                run.failure = sys.exc_info()
                continue
            try:
                payload = protocol.CompletionJob.from_payload(job.args[0])
            except (ValidationError, IndexError, TypeError) as exc:
                first = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
                refused.append((run, f"Invalid job payload: {first['msg']} ({'.'.join(map(str, first['loc']))}).", None))
            else:
                if payload.model != binding.model_id:
                    refused.append((run, f"This worker serves `{binding.model_id}`, not `{payload.model}`.", "model"))
                else:
                    payloads[run] = payload
        # A copy delivered while this engine runs the job must not open an attempt of its own: that
        # would fence the running one out of the job's stream. It ends as the running one does.
        opening = []
        with binding.lock:
            for run in payloads:
                if (leader := binding.running.get(run.job.id)) is not None:
                    log.warning("job delivered again while it runs; it ends as the running attempt does",
                                extra={"job_id": run.job.id})
                    leader.followers.append(run)
                else:  # held from now on, so that later deliveries follow it
                    binding.running[run.job.id] = run
                    opening.append(run)
        for run in opening:
            if binding.writer.holds(run.job.id):  # an attempt of ours whose events an outage kept back
                binding.writer.wait_written(timeout=10.0)
        try:
            with worker.connection.pipeline() as pipe:
                for run in runs:
                    run.execution = Execution.create(run.job, ttl, pipeline=pipe, worker_name=worker.name)
                    run.job.prepare_for_execution(worker.name, pipeline=pipe)
                    pipe.lrem(run.queue.intermediate_queue_key, 1, run.job.id)
                    pipe.persist(run.job.key)
                first_attempt = len(pipe)
                for run in opening:
                    queue_attempt(pipe, run.job.id)
                worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
                replies = pipe.execute()[first_attempt:first_attempt + len(opening)]
        except BaseException:  # none started: they wait in the intermediate lists for rq's maintenance
            with binding.lock:
                for run in opening:
                    binding.running.pop(run.job.id, None)
            raise
        with self._room:
            self.running.update(runs)
        for run, message, param in refused:
            try:
                append_event(worker.connection, run.job.id, "error", protocol.error_body(message, param=param))
            except redis.RedisError:
                run.failure = sys.exc_info()  # retried: its stream must end
        for run in runs:
            if run not in payloads:
                self._ended.put(run)
        for run, reply in zip(opening, replies):
            self._submit(run, payloads[run], attempt_opened(reply))

    def _submit(self, run: Running, job: protocol.CompletionJob, history: History) -> None:
        """Submit a started job to the engine, unless an earlier attempt ended it (it died before rq
        recorded that) or it was cancelled before it started."""
        binding = self.binding
        if history.terminal is None and not history.cancelled:
            binding.writer.track(run.job.id, history.attempt_ms, streamed=job.stream)
            run.history = history
            run.handle = binding.engine.submit(job, resume=history.tokens or None)
            run.handle.add_done_callback(lambda _handle: self._ended.put(run))
            return
        if history.terminal is not None:
            kind, data = history.terminal
            run.value = data.get("completion") if kind == "done" else None
        else:
            try:
                append_event(self.worker.connection, run.job.id, "cancelled", {}, entry_id=f"{history.attempt_ms}-1")
            except redis.RedisError:
                run.failure = sys.exc_info()  # retried: its stream must end
        self._ended.put(run)

    # ---- recording ----

    def _record_loop(self) -> None:
        unrecorded: list[Running] = []  # ended, their records not written yet (Redis away)
        failing = False
        while not (self.pool.stopping.is_set() and not self._taking.is_alive() and not self.running):
            try:
                ended = [self._ended.get(timeout=0.5)]
            except queues.Empty:
                ended = []
            while not self._ended.empty():
                ended.append(self._ended.get())
            try:
                self._watch()
            except Exception:
                log.exception("watching running jobs failed", extra={"worker": self.name})
            for run in ended:
                try:
                    run.outcome = self._outcome(run)
                except Exception:
                    log.exception("reading a job's end failed", extra={"job_id": run.job.id})
                    run.outcome = sys.exc_info()
            unrecorded = self._record(unrecorded + ended) if unrecorded or ended else []
            if unrecorded and not failing:
                self.pool.grace.lost()
                log.warning("recording ended jobs failed; retrying", extra={"worker": self.name, "jobs": len(unrecorded)})
            failing = bool(unrecorded)
            if failing:
                self.pool.stopping.wait(0.5)

    def _watch(self) -> None:
        """Time out jobs past rq's job timeout (taken out of the engine without a `cancelled` event,
        then failed, so rq retries them) and fail the jobs of an engine whose thread died."""
        engine = self.binding.engine
        dead = engine is not None and not engine.is_alive()
        with self._room:
            running = [r for r in self.running if r.handle is not None and not r.handle.done]
        for run in running:
            if dead:
                run.handle.end(error=EngineFault("The engine stopped before the job finished."))
            elif run.silenced is None and time.monotonic() > run.deadline:
                run.silenced = self.binding.writer.silence(run.job.id)
                run.handle.cancel()

    def _record(self, ended: list[Running]) -> list[Running]:
        """Record the ends of these jobs (and of the deliveries that follow them): the finished ones
        in one transaction, the failed ones through rq's failure path. Returns those whose records
        Redis did not take, to be tried again."""
        finished = [run for run in ended if not isinstance(run.outcome, tuple)]
        recorded, unrecorded = [], []
        # rq hears of a job's end after its stream does: web takes a job rq calls finished that left
        # no terminal event for a failed one
        if not self.binding.writer.wait_written(RECORD_WAIT_S, [run.job.id for run in finished]):
            unrecorded += finished
        else:
            try:
                self._write_finished([(delivery, run.outcome) for run in finished
                                      for delivery in [run, *run.followers]])
                recorded += finished
            except redis.RedisError:
                unrecorded += finished
        for run in ended:
            if isinstance(run.outcome, tuple):
                try:
                    for delivery in [run, *run.followers]:
                        if delivery.execution is not None:  # not recorded yet
                            self._fail(delivery, run.outcome)
                            delivery.execution = None
                    recorded.append(run)
                except redis.RedisError:
                    unrecorded.append(run)
        with self._room:
            self.running.difference_update(delivery for run in recorded for delivery in [run, *run.followers])
            self._room.notify()
        return unrecorded

    def _write_finished(self, finished: list[tuple[Running, Any]]) -> None:
        if not finished:
            return
        worker = self.worker
        with worker.connection.pipeline() as pipe:
            for run, value in finished:
                job = run.job
                job.ended_at, job._result, job._status = now(), value, JobStatus.FINISHED
                result_ttl = job.get_result_ttl(worker.default_result_ttl)
                if result_ttl != 0:
                    # rq's Job._handle_success, but for its save: that rewrites every field of the job
                    # (its payload compressed again) where a finish changes two
                    pipe.hset(job.key, mapping={"status": JobStatus.FINISHED, "ended_at": utcformat(job.ended_at)})
                    Result.create(job, Result.Type.SUCCESSFUL, return_value=value, ttl=result_ttl,
                                  worker_name=worker.name, pipeline=pipe, execution_id=run.execution.id,
                                  execution_started_at=run.execution.created_at, execution_ended_at=job.ended_at)
                    job.finished_job_registry.add(job, result_ttl, pipe)
                if result_ttl and result_ttl > 0:  # rq's Job.cleanup, less its EXPIREs of the dependency keys no job of ours has
                    pipe.expire(job.key, result_ttl)
                else:
                    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
                run.execution.delete(job=job, pipeline=pipe)
            pipe.hincrby(worker.key, "successful_job_count", len(finished))
            pipe.execute()

    def _outcome(self, run: Running):
        """A job's result (the completion object, or None when it was refused, cancelled or ended
        before it started), or the exc_info of its failure."""
        binding = self.binding
        with binding.lock:  # from here on, a new delivery of the job opens an attempt of its own
            if binding.running.get(run.job.id) is run:
                del binding.running[run.job.id]
        if run.handle is None:
            return run.failure or run.value
        binding.writer.untrack(run.job.id)
        if run.silenced is not None:  # timed out: its terminal event was dropped as the engine let go
            binding.writer.unsilence(run.job.id)
            return _exc_info(JobTimeoutException(f"Task exceeded maximum timeout value ({run.job.timeout} seconds)"))
        try:
            completion = run.handle.result(0)
        except EngineFault as exc:
            return _exc_info(exc)  # no event was written: rq's retry resumes the job
        except EngineError as err:  # refused or cancelled: the engine wrote its event
            log.info("job ended", extra={"job_id": run.job.id, "outcome": err.type, "reason": err.message})
            return None
        log.info("job finished", extra={
            "job_id": run.job.id, "model": binding.model_id, "seconds": round(time.monotonic() - run.started, 3),
            "completion_tokens": completion["usage"]["completion_tokens"],
            "resumed_tokens": sum(len(t) for t in run.history.tokens.values())})
        return completion

    def _fail(self, run: Running, exc_info) -> None:
        """rq's failure path for one job: its exception handlers (report_given_up), then a retry
        while it has retries, else the FailedJobRegistry."""
        worker, job = self.worker, run.job
        job.ended_at, job._status = now(), JobStatus.FAILED
        worker.execution = run.execution
        worker.handle_exception(job, *exc_info)
        worker.handle_job_failure(job=job, queue=run.queue, started_job_registry=run.queue.started_job_registry,
                                  exc_string="".join(traceback.format_exception(*exc_info)))

    # ---- beats and stopping ----

    def beat(self) -> None:
        """Refresh the running jobs' registry entries and executions, and this worker's key."""
        worker = self.worker
        if worker is None:
            return
        with self._room:
            running = [r for r in self.running if r.execution is not None]
        ttl = self.pool.heartbeat_ttl
        with worker.connection.pipeline() as pipe:
            worker.heartbeat(pipeline=pipe)
            for run in running:
                run.execution.heartbeat(run.job.started_job_registry, ttl, pipeline=pipe)
                run.job.heartbeat(now(), ttl, pipeline=pipe)
            pipe.execute()

    def join(self, idle_grace: float) -> None:
        """Wait for the running jobs to end and be recorded while Redis answers (their results have
        somewhere to go; with Redis gone they are re-queued from their registry once it is back)."""
        self._taking.join(idle_grace)
        while self.running and self._recording.is_alive() and self.pool._redis_answers():
            self._recording.join(0.5)
        self._recording.join(idle_grace)
        if self.worker is not None and not self.running:
            try:
                self.worker.register_death()
            except redis.RedisError:
                pass


def _exc_info(exc: BaseException):
    try:
        raise exc
    except BaseException:
        return sys.exc_info()


class WorkerPool:
    """The consumers of every engine of the process, and the heartbeat thread."""

    def __init__(self, redis_url: str, *, heartbeat_interval: float = 5.0, maintenance_interval: int = 5,
                 poll_interval: int = 1, worker_ttl: int = 20):
        self.redis_url = redis_url
        self.heartbeat_interval = heartbeat_interval
        self.maintenance_interval = maintenance_interval
        self.poll_interval = poll_interval
        self.worker_ttl = worker_ttl
        self.consumers: list[Consumer] = []
        self.stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="rq-heartbeat", daemon=True)
        self.queue_names: list[str] = []  # every queue a consumer here takes from
        self._maintainer: EngineWorker | None = None
        self.grace = OutageGrace(self.heartbeat_ttl + heartbeat_interval)

    def add(self, binding: Binding, device: str, concurrency: int, batch_concurrency: int | None = None) -> None:
        """Start a consumer feeding this engine at most `concurrency` jobs at once, at most
        `batch_concurrency` of them (default: all) the model's batch jobs, taken when no interactive
        job waits."""
        queue_names = [protocol.queue_name(binding.model_id)]
        batch = concurrency if batch_concurrency is None else batch_concurrency
        if batch > 0:
            queue_names.append(protocol.batch_queue_name(binding.model_id))
        self.queue_names += [name for name in queue_names if name not in self.queue_names]
        name = f"{socket.gethostname()}:{os.getpid()}:{binding.model_id}:{device}:{len(self.consumers)}"
        consumer = Consumer(self, binding, name, queue_names, concurrency, batch)
        self.consumers.append(consumer)
        consumer.start()
        if not self._heartbeat.is_alive():
            self._heartbeat.start()

    @property
    def workers(self) -> list[EngineWorker | None]:
        """Each consumer's rq worker (None until it has registered)."""
        return [consumer.worker for consumer in self.consumers]

    def _new_worker(self, name: str, queues: list[str], warming=lambda: False) -> EngineWorker:
        connection = protocol.redis_client(self.redis_url)
        return EngineWorker(queues, name=name, connection=connection, serializer=protocol.SERIALIZER,
                            worker_ttl=self.worker_ttl, maintenance_interval=self.maintenance_interval,
                            exception_handlers=[report_given_up], heartbeat_ttl=self.heartbeat_ttl, grace=self.grace,
                            warming=warming)

    @property
    def heartbeat_ttl(self) -> int:
        # Three missed beats before a job counts as abandoned.
        return max(3, int(3 * self.heartbeat_interval))

    def _heartbeat_loop(self) -> None:
        last_maintenance = time.monotonic()
        failing = False
        while not self.stopping.wait(self.heartbeat_interval) or self.busy():
            errors = []
            for consumer in list(self.consumers):
                try:
                    consumer.beat()
                except redis.RedisError as exc:
                    errors.append(str(exc))
                except Exception:  # a bug: said, but the other consumers' jobs must keep their beats
                    log.exception("job heartbeat failed", extra={"worker": consumer.name})
            if errors:
                self.grace.lost()
            if errors and not failing:
                log.warning("job heartbeats failing", extra={"error": errors[0]})
            failing = bool(errors)
            if time.monotonic() - last_maintenance >= self.maintenance_interval:
                last_maintenance = time.monotonic()
                self._maintain()

    def _maintain(self) -> None:
        """Re-queue dead workers' jobs even when every consumer here is busy with long jobs. On a
        worker of its own that never runs a job: rq retries a job lost from a queue's intermediate
        list through the cleaning worker's `handle_job_failure`, which also deletes that worker's
        current execution."""
        try:
            if self._maintainer is None or self._maintainer.queue_names() != self.queue_names:
                name = f"{socket.gethostname()}:{os.getpid()}:maintenance"
                self._maintainer = self._new_worker(name, list(self.queue_names))
            self._maintainer.clean_registries()
        except redis.RedisError as exc:
            self.grace.lost()
            log.warning("registry maintenance failed", extra={"error": repr(exc)})

    def running(self) -> int:
        """Jobs running on this pool's engines."""
        return sum(len(consumer.running) for consumer in self.consumers)

    def busy(self) -> bool:
        return self.running() > 0

    def stop(self) -> None:
        """Take no new jobs; running ones finish (call `join` to wait for them)."""
        self.stopping.set()
        for consumer in self.consumers:
            with consumer._room:
                consumer._room.notify_all()

    def join(self, idle_grace: float = 2.0) -> None:
        """Wait for the running jobs to end, while Redis answers (see Consumer.join)."""
        for consumer in self.consumers:
            consumer.join(idle_grace)
        self._heartbeat.join(timeout=(self.heartbeat_interval + 1) if self._redis_answers() else 0.5)

    def _redis_answers(self) -> bool:
        client = protocol.redis_client(self.redis_url, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()
