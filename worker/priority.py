"""Queues in priority order: a worker listening on `[interactive, batch]` takes a batch job only
when no interactive job waits.

rq's own multi-queue dequeue blocks with BLPOP, which takes a job off its queue with nothing left in
Redis to say so: a worker killed between that pop and the job's start loses the job. Here every
dequeue is an LMOVE into the queue's intermediate list (as rq does for one queue), so rq's registry
maintenance finds and retries a job whose worker died at that moment, whichever queue it came from.

Waiting: with every queue empty, the worker blocks on the first (interactive) queue only, in slices
of `SLICE_S`, and looks at the others between slices; an interactive job is taken the moment it
arrives, a batch job within a slice.
"""
from __future__ import annotations

import time

from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.utils import now

# Short, so that a batch line enqueued while the queues were empty starts at once (the batch's lines
# are fed a few at a time, each as another ends); cheap, since only a few threads of an engine listen
# at a time (worker/consumer.py LISTENERS: 32 idle threads took 0.014 cores).
SLICE_S = 0.1
# Redis reads a blocking command's timeout in whole milliseconds, and 0 as "block forever": the last
# slice before the deadline blocks at least this long.
MIN_SLICE_S = 0.01
# rq keeps a queue's maintenance lock 15 minutes: a worker killed while cleaning would stop every
# other worker from re-queueing dead workers' jobs that long. Cleaning takes milliseconds.
MAINTENANCE_LOCK_S = 30
# A job sits in a queue's intermediate list from its dequeue to its start, a few Redis calls on one
# thread; one still there at two maintenance passes this far apart was lost with its worker. rq waits
# a minute: a request whose worker died at that moment would wait that long to run again.
LOST_AFTER_S = 15


class _Intermediate(IntermediateQueue):
    """A queue's intermediate list, whose jobs count as lost after LOST_AFTER_S."""

    def should_be_cleaned_up(self, job_id: str) -> bool:
        first_seen = self.get_first_seen(job_id)
        return first_seen is not None and (now() - first_seen).total_seconds() > LOST_AFTER_S


class PriorityQueue(Queue):
    def enqueue_dependents(self, job, pipeline=None, exclude_job_id=None) -> None:
        # No job of ours depends on another (web enqueues none with depends_on): rq would read each
        # finished job's dependents set, a round trip of the worker's per-job bookkeeping for nothing.
        pass

    def acquire_maintenance_lock(self) -> bool:
        return bool(self.connection.set(self.registry_cleaning_key, 1, nx=True, ex=MAINTENANCE_LOCK_S))

    @property
    def intermediate_queue(self) -> IntermediateQueue:
        return _Intermediate(self.key, connection=self.connection)

    @classmethod
    def dequeue_any(cls, queues, timeout, connection, job_class=None, serializer=None,
                    death_penalty_class=None) -> tuple[Job, Queue] | None:
        queues = list(queues)
        if len(queues) == 1:
            return super().dequeue_any(queues, timeout, connection, job_class, serializer, death_penalty_class)
        job_class = job_class or Job
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for queue in queues:
                while (job_id := connection.lmove(queue.key, queue.intermediate_queue_key)) is not None:
                    found = _fetch(job_id, queue, job_class, connection, serializer)
                    if found:
                        return found
            if deadline is None:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise DequeueTimeout(timeout, [q.key for q in queues])
            first = queues[0]
            job_id = connection.blmove(first.key, first.intermediate_queue_key, max(min(SLICE_S, left), MIN_SLICE_S))
            found = _fetch(job_id, first, job_class, connection, serializer)
            if found:
                return found


def _fetch(job_id, queue: Queue, job_class, connection, serializer) -> tuple[Job, Queue] | None:
    if job_id is None:
        return None
    try:
        return job_class.fetch(job_id.decode() if isinstance(job_id, bytes) else job_id, connection=connection,
                               serializer=serializer), queue
    except NoSuchJobError:  # expired while queued; rq's maintenance clears the intermediate list
        return None
