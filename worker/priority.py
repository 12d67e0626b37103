"""Taking jobs off a model's queues in priority order (`take`): a consumer listening on
`[interactive, batch]` takes a batch job only when no interactive job waits, and as many jobs as its
engine has room for in one round trip a queue.

Every job taken is moved into its queue's intermediate list (LMOVE, as rq's own dequeue does for
one queue; its multi-queue dequeue pops with BLPOP, which leaves nothing in Redis to say so): rq's
registry maintenance finds and retries a job whose worker died between taking and starting it,
whichever queue it came from.

Waiting: with every queue empty, the consumer blocks on the first (interactive) queue only, in
slices of `SLICE_S`, and looks at the others between slices; an interactive job is taken the moment
it arrives, a batch job within a slice.
"""
from __future__ import annotations

import time

from rq import Queue
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.utils import now

# Short, so that a batch line enqueued while the queues were empty starts at once (the batch's lines
# are fed a few at a time, each as another ends); cheap, since one thread of an engine listens.
SLICE_S = 0.1
# Redis reads a blocking command's timeout in whole milliseconds, and 0 as "block forever": the last
# slice before the deadline blocks at least this long.
MIN_SLICE_S = 0.01
# rq keeps a queue's maintenance lock 15 minutes: a worker killed while cleaning would stop every
# other worker from re-queueing dead workers' jobs that long. Cleaning takes milliseconds.
MAINTENANCE_LOCK_S = 30
# A job sits in a queue's intermediate list from its taking to its start, a round trip or two; one still there at two maintenance passes this far apart was lost with its worker. rq waits
# a minute: a request whose worker died at that moment would wait that long to run again.
LOST_AFTER_S = 15


# Moves up to ARGV[1] jobs from a queue (KEYS[1]) into its intermediate list (KEYS[2]), as rq's
# dequeue moves one (LMOVE, left to right), and returns each one's id and hash (ARGV[2] is rq's
# prefix of job keys).
_TAKE = """
local taken = {}
for i = 1, tonumber(ARGV[1]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  taken[#taken + 1] = id
  taken[#taken + 1] = redis.call('HGETALL', ARGV[2] .. id)
end
return taken
"""


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


def take(queues: list[Queue], room: list[int], timeout: float, connection, job_class,
         serializer=None) -> list[tuple[Job, Queue]]:
    """Up to room[i] jobs of queues[i], each moved into its queue's intermediate list: a later
    queue's only once every earlier one is empty (a batch line only when no interactive job waits).
    With every queue it may take from empty, block on the first for up to `timeout`, in slices of
    SLICE_S (looking at the others between slices), and return what one wake brings (an empty list
    at the deadline). A job whose hash expired while it was queued is left in the intermediate list
    for rq's maintenance (as rq's dequeue leaves it)."""
    script = connection.register_script(_TAKE)
    deadline = time.monotonic() + timeout
    while True:
        taken: list[tuple[bytes, list, Queue]] = []
        for queue, n in zip(queues, room):
            n = min(n, room[0] - len(taken))  # the first queue's room is the engine's
            if n <= 0:
                break
            reply = script(keys=[queue.key, queue.intermediate_queue_key], args=[n, job_class.redis_job_namespace_prefix])
            taken += [(job_id, fields, queue) for job_id, fields in zip(reply[::2], reply[1::2])]
            if len(reply) // 2 == n:  # this queue may hold more: the later ones wait
                break
        if not taken:
            left = deadline - time.monotonic()
            if left <= 0 or room[0] <= 0:
                return []
            first = queues[0]
            job_id = connection.blmove(first.key, first.intermediate_queue_key, max(min(SLICE_S, left), MIN_SLICE_S))
            if job_id is None:
                continue
            taken = [(job_id, connection.hgetall(job_class.key_for(_text(job_id))), first)]
        found = []
        for job_id, fields, queue in taken:
            if fields:  # else it expired while queued
                job = job_class(_text(job_id), connection=connection, serializer=serializer)
                job.restore(fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2])))
                found.append((job, queue))
        if found:
            return found



def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
