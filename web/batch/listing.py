"""Listings in creation order, for OpenAI's cursor pages (`after`, `limit`, `has_more`).

A listing is a sorted set of ids scored by a counter taken when the object is created, so the order
is the order of creation even within one second. Records expire on their own (files, finished
batches); an id whose record is gone is dropped from the listing when a page meets it.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import redis

T = TypeVar("T")

# KEYS: the counter, then every listing the id joins. ARGV: the id.
_ADD = """
local n = redis.call('INCR', KEYS[1])
for i = 2, #KEYS do redis.call('ZADD', KEYS[i], n, ARGV[1]) end
"""


def add(pipe: redis.client.Pipeline, counter: str, listings: list[str], object_id: str) -> None:
    """Queue on `pipe` (a MULTI, with the record's own commands) the id's entry in each listing."""
    pipe.eval(_ADD, 1 + len(listings), counter, *listings, object_id)


def page(r: redis.Redis, listing: str, record_key: Callable[[str], str], parse: Callable[[dict], T], *,
         after: str | None, limit: int, newest_first: bool = True,
         keep: Callable[[T], bool] = lambda _: True) -> tuple[list[T], bool]:
    """Up to `limit` records (`parse`d from their hashes, those `keep` accepts) after the id `after`
    (one not in this listing gives an empty page: a cursor reveals nothing of other listings), and
    whether there are more."""
    bound = "+inf" if newest_first else "-inf"
    if after is not None:
        score = r.zscore(listing, after)
        if score is None:
            return [], False
        bound = f"({score}"
    found: list[T] = []
    while len(found) <= limit:
        ids = (r.zrevrangebyscore(listing, bound, "-inf", start=0, num=limit + 1, withscores=True) if newest_first
               else r.zrangebyscore(listing, bound, "+inf", start=0, num=limit + 1, withscores=True))
        if not ids:
            break
        with r.pipeline(transaction=False) as pipe:
            for object_id, _ in ids:
                pipe.hgetall(record_key(object_id.decode()))
            records = pipe.execute()
        gone = [object_id for (object_id, _), raw in zip(ids, records) if not raw]
        if gone:
            r.zrem(listing, *gone)
        found += [item for item in map(parse, filter(None, records)) if keep(item)]
        bound = f"({ids[-1][1]}"
    return found[:limit], len(found) > limit
