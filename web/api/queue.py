"""The web side of the job queue: Redis connections, admission (live worker, queue depth) and
enqueueing with rq.

One rq queue per served model (`protocol.queue_name`), and one for batches' lines
(`protocol.batch_queue_name`). The job function is named by its dotted
path (`protocol.JOB_FUNCTION`), so web never imports worker code. The rq job id is the completion
id (`cmpl-…`), so one id works for the completion, its event stream and `/v1/jobs/<id>`.
"""
from __future__ import annotations

import redis
from flask import Flask, current_app
from rq import Queue, Retry
from rq.exceptions import DeserializationError, InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from web import redis_pool
from web.api.stream_hub import StreamHub
from web.settings import Settings
from worker import protocol
from worker.protocol import APIError


# A queue's live workers (its registered workers whose keys exist) and its length.
LOAD = """
local live = 0
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  live = live + redis.call('EXISTS', key)
end
return {live, redis.call('LLEN', KEYS[2])}
"""

OWNER = "owner"  # the rq job's meta field holding who the job belongs to

# Runs the commands that `commands` laid out as ARGV, in order (web/api/admission.py runs it once a
# job is admitted). The keys they touch are not declared: rq's, on the one Redis rq runs on.
RUN = """
local at = 1
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[at + 1])
  redis.call(unpack(ARGV, at + 2, at + 1 + n))
  at = at + 1 + n
end
"""


def commands(pipe: redis.client.Pipeline) -> list:
    """A pipeline's queued commands as `RUN`'s arguments: their number, then each one's length and
    words."""
    out = [len(pipe.command_stack)]
    for args, _options in pipe.command_stack:
        out += [len(args), *args]
    return out


def owner(job: Job) -> str | None:
    """Who the job belongs to (None for a job queued without one)."""
    return job.meta.get(OWNER)


class JobQueue:
    def __init__(self, settings: Settings):
        self.settings = settings
        # Short timeouts on ordinary commands so a dead Redis is a quick 503, not a hung request.
        self.redis = redis_pool.client(settings.redis_url, socket_timeout=5)
        # XREAD BLOCK waits up to one keepalive period; its socket must outlast that.
        self.blocking_redis = redis_pool.client(settings.redis_url, socket_timeout=settings.keepalive_s + 10)
        self.hub = StreamHub(settings.redis_url)
        self._load = self.redis.register_script(LOAD)

    def queue(self, model_id: str) -> Queue:
        return Queue(protocol.queue_name(model_id), connection=self.redis, serializer=protocol.SERIALIZER)

    def load(self, model_id: str) -> tuple[int, int]:
        """(live workers, queued jobs) of a model's queue, in one round trip. Live: an rq worker
        registered on the queue whose key has not expired (it lives `worker_ttl` past the worker's
        last heartbeat, so a crashed worker drops out on its own)."""
        live, queued = self._load(keys=self.load_keys(model_id))
        return int(live), int(queued)

    def load_keys(self, model_id: str) -> list[str]:
        """`LOAD`'s keys for a model's queue (web/api/admission.py runs it among other scripts)."""
        queue = self.queue(model_id)
        return [WORKERS_BY_QUEUE_KEY % queue.name, queue.key]

    def warming(self, model_id: str) -> int:
        """Of a model's live workers, how many belong to an engine that still compiles its graphs
        (serving meanwhile, more slowly: worker/decode_routes.py)."""
        registered = self.redis.smembers(WORKERS_BY_QUEUE_KEY % self.queue(model_id).name)
        with self.redis.pipeline(transaction=False) as pipe:
            for key in registered:
                pipe.hget(key, protocol.WARMING_FIELD)
            return sum(flag == b"1" for flag in pipe.execute())

    def capacity_error(self, model_id: str, workers: int, queued: int) -> APIError | None:
        """What a model's `load` refuses a new job with: 503 when no worker serves it, 429 when its
        queue is full (both with Retry-After); None when it takes one."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if not workers:
            return APIError(503, f"No worker is serving the model `{model_id}` right now; try again later.",
                            "server_error", None, "no_worker", retry)
        if queued >= self.settings.max_queue_depth:
            return APIError(429, f"The queue for model `{model_id}` is full; try again later.",
                            "rate_limit_error", None, "queue_full", retry)
        return None

    def enqueue(self, job: protocol.CompletionJob, model_id: str, owner: str,
                batch_window_left_s: float | None = None, also=None) -> Job:
        """Queue the job as `owner`'s: `prepare`'s commands, run as one transaction."""
        queued, pipe = self.prepare(job, model_id, owner, batch_window_left_s, also)
        with pipe:
            pipe.execute()
        return queued

    def prepare(self, job: protocol.CompletionJob, model_id: str, owner: str,
                batch_window_left_s: float | None = None, also=None) -> tuple[Job, redis.client.Pipeline]:
        """rq's enqueue of the job, its commands queued on a transaction that is not run yet: run it
        (`enqueue`), or hand its commands to a script (`commands`: web/api/admission.py runs them once
        the job is admitted). The rq job is returned as rq made it.

        The job is `owner`'s (web/access/ownership.py), kept in the rq job's meta: it lives and
        expires with the job, and the worker never reads it. A batch's line (its batch's window ends
        in `batch_window_left_s`) goes to the model's batch queue, which workers take from only when
        this one is empty, and may wait there until the window ends.

        A line's job outlives its window by the queue's ttl: its batch's dispatcher is what ends it
        (it cancels the lines still queued when the window closes). Were the job to expire first, the
        dispatcher would take the line for lost and queue it again. A line queued again leaves no
        stale entry behind: the same id twice in the queue would run twice at once. `also(pipe)`
        queues more commands of the caller's after rq's."""
        s = self.settings
        queue, ttl = self.queue(model_id), s.queue_ttl_s
        if batch_window_left_s is not None:
            queue = Queue(protocol.batch_queue_name(model_id), connection=self.redis, serializer=protocol.SERIALIZER)
            ttl = max(0, int(batch_window_left_s)) + s.queue_ttl_s
            queue.remove(job.id)
        pipe = self.redis.pipeline()  # rq's registration of the queue and the job's
        queued = queue.enqueue_call(
            protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id, meta={OWNER: owner},
            timeout=s.job_timeout_s, ttl=ttl, result_ttl=s.result_ttl_s, failure_ttl=s.result_ttl_s,
            # a retried job (its worker crashed) goes to the front: its client may be mid-stream
            retry=Retry(max=s.job_retries, enqueue_at_front=True) if s.job_retries > 0 else None,
            description=f"completion {job.id} ({job.model})", pipeline=pipe)
        if also is not None:
            also(pipe)
        return queued, pipe

    def jobs(self) -> list[Job]:
        """Every completion job rq still knows, on every model's queue: waiting, running and ended
        ones (for the admin CLI; a request never needs them all)."""
        job_ids: set[str] = set()
        for queue in Queue.all(connection=self.redis, serializer=protocol.SERIALIZER):
            if queue.name.startswith((protocol.QUEUE_PREFIX, protocol.BATCH_QUEUE_PREFIX)):
                job_ids.update(queue.get_job_ids())
                for registry in (queue.started_job_registry, queue.finished_job_registry,
                                 queue.failed_job_registry, queue.canceled_job_registry,
                                 queue.deferred_job_registry, queue.scheduled_job_registry):
                    job_ids.update(registry.get_job_ids())
        jobs = Job.fetch_many(sorted(job_ids), connection=self.redis, serializer=protocol.SERIALIZER)
        return [job for job in jobs if job is not None and _readable(job)]

    def ended(self, job_ids: list[str]) -> list[str]:
        """Those of these jobs that hold nothing of an engine's any more, in one round trip: those
        rq will not run again (ended, or forgotten), and those whose stream holds their terminal
        event: the worker writes that event before its consumer records the job finished in rq,
        which lags under load, and a key's quota of jobs would count the lag."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "status")
                pipe.xrevrange(protocol.stream_key(job_id), count=1)
            replies = pipe.execute()
        over = {s.value.encode() for s in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED)}
        return [job_id for job_id, status, last in zip(job_ids, replies[::2], replies[1::2])
                if status is None or status in over or (last and _terminal(last[0][1]))]

    def fetch(self, job_id: str) -> Job | None:
        try:
            job = Job.fetch(job_id, connection=self.redis, serializer=protocol.SERIALIZER)
        except (NoSuchJobError, ValueError):  # ValueError: not even a valid rq job id
            return None
        return job if _readable(job) else None

    def status(self, job_id: str) -> JobStatus | None:
        """The rq status, or None when rq no longer knows the job (never enqueued, or expired)."""
        job = self.fetch(job_id)
        return job.get_status(refresh=False) if job else None

    def cancel(self, job_id: str) -> bool:
        """Ask for a job to stop: the engine drops it within a few steps once the flag is set (the
        worker's next event write reads it), and a job still waiting in the queue is taken out of
        it. Returns whether it was still queued."""
        self.redis.set(protocol.cancel_key(job_id), 1, ex=self.settings.cancel_ttl_s)
        job = self.fetch(job_id)
        if job is None or job.get_status(refresh=False) != JobStatus.QUEUED:
            return False
        try:
            job.cancel()
        except InvalidJobOperation:  # cancelled since the fetch, by another thread or process: done
            pass
        except ValueError:  # rq read an execution a worker was starting or ending: it runs, and the flag stops it
            return False
        return True


def _terminal(fields: dict) -> bool:
    """Whether a stream entry (as redis-py gives it, bytes) is a job's terminal event."""
    return fields.get(b"type", b"").decode() in protocol.TERMINAL_EVENTS


def _readable(job: Job) -> bool:
    """Whether the job's call decodes with `protocol.SERIALIZER`: one stored another way (pickled,
    by an older version or by whoever else writes to Redis) is no job of ours."""
    try:
        job.args
    except DeserializationError:
        return False
    return True


def init_app(app: Flask, settings: Settings) -> JobQueue:
    app.extensions["nanoserve.queue"] = jq = JobQueue(settings)
    return jq


def job_queue() -> JobQueue:
    return current_app.extensions["nanoserve.queue"]
