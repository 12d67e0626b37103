"""The web tier's Redis clients, made in one place: each on a pool that waits for a free connection
instead of failing when every one is in use. A gevent worker runs as many requests at once as it has
connections open, far more than a pool's size; with threads the wait never comes."""
from __future__ import annotations

import redis

from worker import protocol

POOL_SIZE = 256  # connections per client and process; Redis takes 10000 clients by default
WAIT_S = 10.0  # past it a request gets the 503 of an unreachable queue


def client(url: str, *, socket_timeout: float | None = 5.0, decode_responses: bool = False) -> redis.Redis:
    return protocol.redis_client(url, redis.BlockingConnectionPool, max_connections=POOL_SIZE, timeout=WAIT_S,
                                 socket_connect_timeout=2, socket_timeout=socket_timeout,
                                 decode_responses=decode_responses)
