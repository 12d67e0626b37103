"""API keys: created by an admin, shown once, stored only as a SHA-256 hash.

A key reads `sk-<id><secret>`: its first 8 characters after `sk-` are a lookup id, so checking a key
is one HGET of its record (name, hash of the whole key, limits) followed by a constant-time compare
of the hashes. Revoking deletes the record, which every web process sees on its next request.

Functions take a Redis client created with `decode_responses=True`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass

import redis

PREFIX = "sk-"
ID_LENGTH = 8
RECORDS = "nanoserve:apikeys"  # lookup id -> JSON record
NAMES = "nanoserve:apikeys:names"  # name -> lookup id
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ApiKeyError(ValueError):
    """A key cannot be created or revoked as asked (the message says why)."""


@dataclass
class ApiKey:
    name: str
    id: str
    digest: str  # sha256 hex of the whole key
    rpm: int | None  # None: the server's default for keys
    tpm: int | None
    created_at: float

    @property
    def redacted(self) -> str:
        return f"{PREFIX}{self.id}…"


def create(r: redis.Redis, name: str, *, rpm: int | None = None, tpm: int | None = None) -> tuple[str, ApiKey]:
    """A new key named `name`: returns the key itself (never stored) and its record."""
    if not NAME_PATTERN.fullmatch(name):
        raise ApiKeyError(f"Invalid key name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit.")
    while True:
        token = PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(name, token[len(PREFIX):len(PREFIX) + ID_LENGTH], _digest(token), rpm, tpm, time.time())
        if not r.hsetnx(NAMES, name, record.id):
            raise ApiKeyError(f"An API key named {name!r} already exists; revoke it first or pick another name.")
        if r.hsetnx(RECORDS, record.id, json.dumps(asdict(record))):
            return token, record
        r.hdel(NAMES, name)  # lookup id taken by another key (1 in 2^48): draw again


def verify(r: redis.Redis, token: str) -> ApiKey | None:
    """The record of a valid key, or None for an unknown, malformed or revoked one."""
    if not token.startswith(PREFIX) or len(token) <= len(PREFIX) + ID_LENGTH:
        return None
    record = by_id(r, token[len(PREFIX):len(PREFIX) + ID_LENGTH])
    return record if record is not None and hmac.compare_digest(record.digest, _digest(token)) else None


def by_id(r: redis.Redis, key_id: str) -> ApiKey | None:
    """The record of the key with this lookup id, None once it is revoked (for work a key ordered
    earlier, such as a batch's lines)."""
    raw = r.hget(RECORDS, key_id)
    return ApiKey(**json.loads(raw)) if raw is not None else None


def revoke(r: redis.Redis, name: str) -> bool:
    """Delete the key named `name`; False when there is none."""
    key_id = r.hget(NAMES, name)
    if key_id is None:
        return False
    pipe = r.pipeline()
    pipe.hdel(RECORDS, key_id)
    pipe.hdel(NAMES, name)
    pipe.execute()
    return True


def list_keys(r: redis.Redis) -> list[ApiKey]:
    """Every key's record, oldest first."""
    return sorted((ApiKey(**json.loads(raw)) for raw in r.hvals(RECORDS)), key=lambda k: k.created_at)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
