"""rq's objects as web and worker build them: with the project's serializer (`protocol.SERIALIZER`,
JSON). A test that makes its own rq queue, job, worker or registry makes it here, so it reads and
writes Redis as the code under test does (rq's default, pickle, could not read the jobs at all)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import redis
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FinishedJobRegistry, StartedJobRegistry

from worker import protocol

SERIALIZER = protocol.SERIALIZER


def queue(name: str, r: redis.Redis) -> Queue:
    return Queue(name, connection=r, serializer=SERIALIZER)


def fetch(job_id: str, r: redis.Redis) -> Job:
    return Job.fetch(job_id, connection=r, serializer=SERIALIZER)


def fetch_many(job_ids: Iterable[str], r: redis.Redis) -> list[Job | None]:
    return Job.fetch_many(list(job_ids), connection=r, serializer=SERIALIZER)


def worker(queues: list[str | Queue], r: redis.Redis, **kwargs) -> Worker:
    return Worker(queues, connection=r, serializer=SERIALIZER, **kwargs)


def started(name: str, r: redis.Redis) -> StartedJobRegistry:
    return StartedJobRegistry(name, connection=r, serializer=SERIALIZER)


def finished(name: str, r: redis.Redis) -> FinishedJobRegistry:
    return FinishedJobRegistry(name, connection=r, serializer=SERIALIZER)


class Touch:
    """Unpickled, creates the file at `path`: what a job pickled into Redis by someone else might hold."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)
