"""What a caller creates belongs to it: a job, a file or a batch records its owner when it is made,
and only that owner may read, follow or cancel it (a batch's output files and its lines' jobs
belong to the batch's owner).

    record.owner = owner_of(caller)                          # when the object is made
    check_owner(record.owner, caller, not_found)             # on every later access

The owner is the API key's lookup id, not its name: a key revoked and created again under the same
name is a new key and does not inherit the old one's objects. With keys off (NANOSERVE_AUTH=disabled)
every caller is anonymous and they all share one scope. Another caller gets exactly the answer for
an id that does not exist (`not_found`), so an id reveals nothing about whether its object exists.
The admin CLI does not go through this check: it sees every object.
"""
from __future__ import annotations

import hmac

from web.access import Caller
from worker.protocol import APIError

ANONYMOUS = "anonymous"


def owner_of(caller: Caller) -> str:
    """The scope the caller's objects belong to: `key:<lookup id>`, or `anonymous` with keys off."""
    return f"key:{caller.key_id}" if caller.key_id else ANONYMOUS


def check_owner(owner: str | None, caller: Caller, not_found: APIError) -> None:
    """Raise `not_found` unless the object owned by `owner` belongs to `caller`. An object whose owner
    is unknown (None) belongs to nobody."""
    if owner is None or not hmac.compare_digest(owner, owner_of(caller)):
        raise not_found
