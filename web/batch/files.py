"""Files: OpenAI's file objects, kept in Redis so that every web process reaches them.

A file is two keys, its record (a hash: owner, filename, purpose, size, times) and its content (a
string), plus its id in its owner's listing (a sorted set in creation order). Files expire as
OpenAI's do: `expires_after` seconds after creation when asked, and batch files after
`default_ttl_s` (30 days) otherwise; both keys carry the expiry, so Redis forgets them on its own and
a listing drops ids whose record is gone.

The store does not check ownership: the routes do (web/access/ownership.py), with the record's
`owner`. Sizes are checked by the routes too (413 above the configured cap). What an owner stores in
all is bounded by its `files` quota (web/access/quotas.py): an upload past it is refused; a batch's
output files are counted whatever the quota, against the owner's next upload.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Iterator

import redis

from web.access.quotas import Quota
from web.batch import listing

# What an upload may be for: batches are the only consumer of files here.
UPLOAD_PURPOSES = ("batch",)
# The purposes of files this server writes itself.
OUTPUT_PURPOSE = "batch_output"
# OpenAI's bounds on `expires_after.seconds`.
MIN_EXPIRES_AFTER, MAX_EXPIRES_AFTER = 3600, 2_592_000

_SEQ = "nanoserve:files:seq"  # creation order, for listings and `after` cursors
_READ_CHUNK = 1 << 20


def record_key(file_id: str) -> str:
    return f"nanoserve:file:{file_id}"


def content_key(file_id: str) -> str:
    return f"nanoserve:file:{file_id}:content"


def listing_key(owner: str) -> str:
    return f"nanoserve:files:{owner}"


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None

    def to_object(self) -> dict:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": self.expires_at}

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> "StoredFile":
        f = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(f["id"], f["owner"], f["filename"], f["purpose"], int(f["bytes"]), int(f["created_at"]),
                   int(f["expires_at"]) if f.get("expires_at") else None)


class FileStore:
    def __init__(self, client: redis.Redis, default_ttl_s: int = MAX_EXPIRES_AFTER, quota: Quota | None = None):
        self.redis = client  # bytes in, bytes out
        self.default_ttl_s = default_ttl_s
        self.quota = quota or Quota("files", 0, "stored files")

    def create(self, owner: str, filename: str, purpose: str, content: bytes,
               expires_after_s: int | None = None) -> StoredFile:
        """Store an uploaded file (the 429 `APIError` of the owner's `files` quota when it is full)."""
        file_id = new_file_id()
        self.quota.take(self.redis, owner, file_id, self._lapses(expires_after_s), size=len(content))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(content_key(file_id), content)
            stored = self._add_record(pipe, file_id, owner, filename, purpose, len(content), expires_after_s)
            pipe.execute()
        return stored

    def adopt(self, pipe: redis.client.Pipeline, staging_key: str, size: int, owner: str, filename: str,
              expires_after_s: int | None) -> StoredFile:
        """Queue, on a MULTI pipeline, the commands that turn the string at `staging_key` (`size`
        bytes, written by the server) into a `batch_output` file; the caller executes them together
        with its own, so the file appears exactly when the batch says it exists."""
        file_id = new_file_id()
        pipe.rename(staging_key, content_key(file_id))
        self.quota.force(self.redis, owner, file_id, self._lapses(expires_after_s), size)
        return self._add_record(pipe, file_id, owner, filename, OUTPUT_PURPOSE, size, expires_after_s)

    def _lapses(self, expires_after_s: int | None) -> float:
        ttl = expires_after_s if expires_after_s is not None else self.default_ttl_s
        return time.time() + (ttl or 10 * 365 * 86400)

    def _add_record(self, pipe, file_id: str, owner: str, filename: str, purpose: str, size: int,
                    expires_after_s: int | None) -> StoredFile:
        now = int(time.time())
        ttl = expires_after_s if expires_after_s is not None else self.default_ttl_s
        stored = StoredFile(file_id, owner, filename, purpose, size, now, now + ttl if ttl else None)
        pipe.hset(record_key(file_id), mapping={
            "id": file_id, "owner": owner, "filename": filename, "purpose": purpose, "bytes": size,
            "created_at": now, "expires_at": stored.expires_at or ""})
        if stored.expires_at:
            pipe.expireat(record_key(file_id), stored.expires_at)
            pipe.expireat(content_key(file_id), stored.expires_at)
        listing.add(pipe, _SEQ, [listing_key(owner)], file_id)
        return stored

    def get(self, file_id: str) -> StoredFile | None:
        fields = self.redis.hgetall(record_key(file_id))
        return StoredFile.from_hash(fields) if fields else None

    def read(self, file_id: str) -> bytes | None:
        return self.redis.get(content_key(file_id))

    def chunks(self, file_id: str, size: int) -> Iterator[bytes]:
        """The content in pieces of at most 1 MiB, for streaming a download without holding it all."""
        for start in range(0, size, _READ_CHUNK):
            yield self.redis.getrange(content_key(file_id), start, min(start + _READ_CHUNK, size) - 1)

    def delete(self, stored: StoredFile) -> bool:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(record_key(stored.id), content_key(stored.id))
            pipe.zrem(listing_key(stored.owner), stored.id)
            deleted, _ = pipe.execute()
        self.quota.give_back(self.redis, stored.owner, stored.id)
        return bool(deleted)

    def list(self, owner: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> tuple[list[StoredFile], bool]:
        """The owner's files in creation order (`desc`: newest first), those after the file `after`,
        up to `limit`; and whether there are more."""
        return listing.page(self.redis, listing_key(owner), record_key, StoredFile.from_hash, after=after,
                            limit=limit, newest_first=order == "desc",
                            keep=lambda f: purpose is None or f.purpose == purpose)
