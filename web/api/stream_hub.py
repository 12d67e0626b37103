"""One reader for every job stream a web process follows: a single XREAD BLOCK over all of them,
its entries handed to the request threads that wait on each.

A request thread reading its own job's stream pays a Redis round trip for every step of the
engine (its XREAD BLOCK, parsed by redis-py, and Redis waking it): with many streams open, the
same step's events cost as many round trips, all on the cores the decode step runs on. The worker
writes a step's events of every job in one transaction, so one XREAD over every followed stream
takes them all at once (docs/notes/stream-hub.md measures both).

A stream has one follower through the hub; a second reader of the same job (a resumed
`GET /v1/jobs/<id>/stream` beside the first) reads on its own (`follow` returns None). The hub's
thread starts with its first follower and ends when it has had none for a whole blocking read.
"""
from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
import time

import redis

from worker import protocol

Entries = list  # [(entry_id: bytes, fields: dict)], as redis-py's XREAD returns them
_TERMINAL = {kind.encode() for kind in protocol.TERMINAL_EVENTS}


class Follower:
    """One stream's place in the hub: the entries read for it, in order, or the error that ended
    the hub's read."""

    def __init__(self, key: str, after: str):
        self.key = key
        self.last = after  # the id of the last entry handed over (the hub's read position)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def read(self, timeout_s: float) -> Entries:
        """The entries that arrived, waiting up to `timeout_s` for the first ([] if none came);
        a Redis error of the hub's read is raised here."""
        try:
            got = [self._queue.get(timeout=max(0.0, timeout_s))]
        except queue.Empty:
            return []
        while not self._queue.empty():
            got.append(self._queue.get_nowait())
        entries = []
        for item in got:
            if isinstance(item, Exception):
                raise item
            entries += item
        return entries

    def _put(self, item: Entries | Exception) -> None:
        self._queue.put(item)


class StreamHub:
    RETRY_S = 0.5  # after a failed read, before the next (its followers got the error)
    WAKE_TTL_S = 3600  # the wake stream outlives a process that died without cleaning up

    def __init__(self, redis_url: str, block_s: float = 10.0):
        self.block_s = block_s
        # its own connection: a read blocks for up to block_s, and the socket must outlast that
        self._redis = protocol.redis_client(redis_url, socket_connect_timeout=2, socket_timeout=block_s + 10)
        # a stream of this hub's own that a new follower writes to, so a blocked read returns and
        # the next one includes the new stream (written after the follower is added: never missed)
        self._wake_key = f"nanoserve:web-hub:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._wake_last = "0-0"
        self._lock = threading.Lock()
        self._followers: dict[str, Follower] = {}
        self._thread: threading.Thread | None = None

    def follow(self, key: str, after: str, client: redis.Redis) -> Follower | None:
        """Follow stream `key` from entry `after` (None when the hub already follows it). `client`
        (an ordinary connection) wakes the hub's read."""
        follower = self.register(key, after)
        if follower is None:
            return None
        try:
            with client.pipeline(transaction=False) as pipe:
                self.queue_wake(pipe, key)
                pipe.execute()
        except redis.RedisError:
            self.leave(follower)
            raise
        return follower

    def register(self, key: str, after: str) -> Follower | None:
        """`follow`'s first half: the follower, whose stream the hub reads from its next read on (after
        `queue_wake`'s commands ran; None when the hub already follows the stream)."""
        with self._lock:
            if key in self._followers:
                return None
            follower = self._followers[key] = Follower(key, after)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-hub", daemon=True)
                self._thread.start()
        return follower

    def queue_wake(self, pipe: redis.client.Pipeline, key: str) -> None:
        """Queue the write that wakes the hub's read (so that its next read takes in `key`), to go
        with the pipeline's other commands (a job's enqueue)."""
        pipe.xadd(self._wake_key, {"key": key}, maxlen=1)
        pipe.expire(self._wake_key, self.WAKE_TTL_S)

    def leave(self, follower: Follower) -> None:
        with self._lock:
            if self._followers.get(follower.key) is follower:
                del self._followers[follower.key]

    def _run(self) -> None:
        while True:
            with self._lock:
                streams = {key: f.last for key, f in self._followers.items()}
            streams[self._wake_key] = self._wake_last
            try:
                reply = self._redis.xread(streams, block=int(self.block_s * 1000))
            except redis.ResponseError as exc:
                # Redis refused the command, not the connection: fail only the streams it refuses.
                self._fail(self._refused(streams) or list(streams), exc)
                continue
            except redis.RedisError as exc:
                self._fail(list(streams), exc)
                time.sleep(self.RETRY_S)
                continue
            if not reply:
                with self._lock:
                    if not self._followers:  # none for a whole read: end (the next follower starts anew)
                        self._thread = None
                        return
                continue
            self._hand_over(reply)

    def _refused(self, streams: dict[str, str]) -> list[str]:
        """The followed streams whose read Redis refuses on its own (a non-blocking read each)."""
        refused = []
        for key, last in streams.items():
            if key == self._wake_key:
                continue
            try:
                self._redis.xread({key: last}, count=1)
            except redis.ResponseError:
                refused.append(key)
            except redis.RedisError:
                return []
        return refused

    def _fail(self, keys: list[str], exc: Exception) -> None:
        with self._lock:
            failed = [self._followers.pop(key) for key in keys if key in self._followers]
        for follower in failed:
            follower._put(exc)

    def _hand_over(self, reply) -> None:
        with self._lock:
            for key, entries in reply:
                key = key.decode() if isinstance(key, bytes) else key
                if not entries:  # a stream whose last id moved without an entry (a worker's fence)
                    continue
                last = entries[-1][0].decode()
                if key == self._wake_key:
                    self._wake_last = last
                    continue
                follower = self._followers.get(key)
                if follower is not None:  # else it left while the read was out
                    follower.last = last
                    follower._put(entries)
                    if any(fields.get(b"type") in _TERMINAL for _, fields in entries):
                        # its reader has all it will read: the hub stops reading the stream even if
                        # that reader never comes to leave (a request that failed before reading)
                        del self._followers[key]
