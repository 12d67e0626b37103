"""The contract between web and worker: the job payload, the event schema and the Redis keys.

Torch-free and JSON-only, so the web tier can import it. Everything that crosses Redis is
defined here and nowhere else.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping
from urllib.parse import parse_qs, quote, unquote

import redis
from pydantic import BaseModel, Field
from redis.sentinel import Sentinel, SentinelConnectionPool
from rq.serializers import JSONSerializer

# The Redis of web, worker and admin CLI when REDIS_URL is not set.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"

# ---- Redis: every client of web, worker and admin CLI is made by `redis_client` ----

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class SentinelURL:
    """`redis+sentinel://[[user]:password@]host:port[,host:port…]/master[/db][?sentinel_password=…]`:
    the primary that these sentinels name `master`, reached with the password (and TLS for
    `rediss+sentinel`); the sentinels themselves with `sentinel_password`, if they ask for one."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False

    @classmethod
    def parse(cls, url: str) -> "SentinelURL":
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"not a Redis Sentinel URL (redis+sentinel://host:port,…/master/db): {url!r}")
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        auth, _, hosts = netloc.rpartition("@")
        username, _, password = auth.partition(":") if auth else ("", "", "")
        sentinels = [_host_port(item) for item in hosts.split(",") if item]
        parts = [unquote(p) for p in path.split("/") if p]
        if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"a Redis Sentinel URL names its sentinels and its master: "
                             f"redis+sentinel://host:port,host:port/master[/db], not {url!r}")
        options = {k: v[-1] for k, v in parse_qs(query).items()}
        return cls(tuple(sentinels), parts[0], int(parts[1]) if len(parts) == 2 else 0,
                   unquote(username) or None, unquote(password) or None, options.get("sentinel_password"),
                   scheme.startswith("rediss"))


def _host_port(item: str) -> tuple[str, int]:
    """`host:port`, `[v6 address]:port`, or a host alone (Sentinel's port, 26379)."""
    if item.startswith("["):
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    elif item.count(":") == 1:
        host, port = item.split(":")
    else:
        host, port = item, ""
    if port and not port.isdigit():
        raise ValueError(f"a sentinel is host:port, not {item!r}")
    return host, int(port or 26379)


def redis_url_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The Redis named by the environment: `REDIS_URL`; or, with `REDIS_SENTINELS` (host:port,…) and
    `REDIS_SENTINEL_MASTER` set, the primary they name, with REDIS_URL's user, password, database and
    TLS (its host is not used): the `redis+sentinel://` URL of both."""
    env = os.environ if environ is None else environ
    url = env.get("REDIS_URL") or DEFAULT_REDIS_URL
    sentinels, master = env.get("REDIS_SENTINELS"), env.get("REDIS_SENTINEL_MASTER")
    if not sentinels and not master:
        return url
    if not sentinels or not master:
        raise ValueError("REDIS_SENTINELS and REDIS_SENTINEL_MASTER go together: the sentinels' "
                         "host:port list and the name of the master they watch")
    if url.startswith(SENTINEL_SCHEMES):
        raise ValueError("REDIS_URL is a redis+sentinel:// URL already; REDIS_SENTINELS would name the sentinels twice")
    pool = redis.connection.parse_url(url)
    auth = ""
    if pool.get("username") or pool.get("password"):
        auth = f"{quote(pool.get('username') or '', safe='')}:{quote(pool.get('password') or '', safe='')}@"
    scheme = "rediss+sentinel" if url.startswith("rediss://") else "redis+sentinel"
    return f"{scheme}://{auth}{sentinels.replace(' ', '')}/{master}/{pool.get('db', 0)}"


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A pool of the sentinels' primary that waits for a free connection, as BlockingConnectionPool does."""


def redis_client(url: str, pool_class: type[redis.ConnectionPool] = redis.ConnectionPool,
                 **options: Any) -> redis.Redis:
    """A client of the Redis at `url`, on a pool of `pool_class` (redis-py's ConnectionPool or
    BlockingConnectionPool); `options`: the pool's and its connections' (socket_timeout, max_connections…).

    `redis://`, `rediss://` and `unix://` URLs as redis-py reads them; `redis+sentinel://` (see
    `SentinelURL`): the primary the sentinels name, asked of them again whenever a connection to it
    fails, so clients follow a failover. rq takes the result like any client. Redis Cluster is not
    supported: rq's commands span keys of several hash slots."""
    if not url.startswith(SENTINEL_SCHEMES):
        return redis.Redis(connection_pool=pool_class.from_url(url, **options))
    target = SentinelURL.parse(url)
    timeouts = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if options.get(k) is not None}
    sentinel = Sentinel(list(target.sentinels),
                        sentinel_kwargs={"password": target.sentinel_password, "socket_timeout": 2,
                                         "socket_connect_timeout": 2, **{k: min(v, 2) for k, v in timeouts.items()}})
    pool = _BlockingSentinelPool if issubclass(pool_class, redis.BlockingConnectionPool) else SentinelConnectionPool
    return sentinel.master_for(target.master, connection_pool_class=pool, db=target.db, username=target.username,
                               password=target.password, ssl=target.ssl, **options)


# rq queues per served model: interactive requests, and a batch's lines, which workers take only when
# no interactive job waits (worker/priority.py).
QUEUE_PREFIX = "completions:"
BATCH_QUEUE_PREFIX = "batch:"
# The function name every completion job carries (an rq job's hash names one): a consumer runs the
# payload of jobs that carry it on its engine and refuses any other (worker/consumer.py); nothing
# imports or calls it, so no function of that name exists.
JOB_FUNCTION = "worker.consumer.run_completion"
# The field of an rq worker's record (its hash) that is 1 while its engine compiles its decode step's
# graphs in the background, serving eagerly meanwhile, else 0 (web's /ready counts them).
WARMING_FIELD = "nanoserve_warming"
# How rq stores a job's call, meta and return value in Redis; every rq Queue, Job and Worker here is
# built with it. rq's default is pickle, which would run whatever a job written into Redis holds on
# the worker that takes it; all of ours is JSON already (payload, meta, completion object).
SERIALIZER = JSONSerializer

# How long finished streams and results stay readable (seconds).
STREAM_TTL = 600
RESULT_TTL = 600


def queue_name(model_id: str) -> str:
    return f"{QUEUE_PREFIX}{model_id}"


def batch_queue_name(model_id: str) -> str:
    return f"{BATCH_QUEUE_PREFIX}{model_id}"


def stream_key(job_id: str) -> str:
    """Redis Stream holding every event of one job, in order; entry ids double as SSE ids."""
    return f"nanoserve:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Set (to any value) to ask the engine to drop a job; checked once per engine step."""
    return f"nanoserve:cancel:{job_id}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionJob(BaseModel):
    """What web enqueues: a validated, tokenized completions request.

    `choices` are numbered prompt-major: choice `prompt_index * n + j`.
    `seed` is always set (web draws one when the client gave none) so a retried job
    reproduces the tokens its first attempt already streamed.
    """

    id: str
    model: str
    created: int = Field(default_factory=lambda: int(time.time()))
    # when the gateway took the request (unix seconds): the engine's prompt deadline counts from
    # here, so the time a job spent in the queue counts against it
    received: float = Field(default_factory=time.time)
    prompts: list[list[int]]
    max_tokens: int | None = 16  # None: generate up to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int
    n: int = 1
    best_of: int | None = None  # None: same as n
    stop: list[str] = Field(default_factory=list)
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    # beyond OpenAI's (vLLM's names and meanings; docs/decoding.md)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[list[int]] = Field(default_factory=list)  # token sequences (web tokenizes the words)
    allowed_token_ids: list[int] | None = None
    no_repeat_ngram_size: int = 0  # transformers' name; 0: off
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False  # width best_of (or n), the n best returned
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    penalty_alpha: float = 0.0  # contrastive search among top_k candidates (worker/contrastive.py); 0: off
    # structured output: an llguidance grammar every choice must follow (web/api/structured.py); None: off
    grammar: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> "CompletionJob":
        return cls.model_validate(payload)


# ---- events: one Redis Stream entry each, fields {"type": <EventType>, "data": <json>} ----

EventType = Literal["delta", "finish", "usage", "done", "error", "cancelled"]
TERMINAL_EVENTS = ("done", "error", "cancelled")
# delta:     {"index": int, "text": str, "token_ids": [int], "logprobs": Logprobs-fragment | null}
#            the logprobs fragment has OpenAI's four lists for exactly the tokens of this delta
#            and, when the choice ended in the same engine step, its finish_reason and stop_reason
#            (the finish event still follows)
# finish:    {"index": int, "finish_reason": "stop" | "length", "stop_reason": str | int | null}
#            stop_reason: the stop string or stop token id that ended the choice (vLLM's field)
# usage:     {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}
# done:      {"completion": <the final OpenAI completion object>}
# error:     {"error": {"message", "type", "param", "code"}}
# cancelled: {}


def encode_event(event_type: str, data: dict[str, Any]) -> dict[str, str]:
    return {"type": event_type, "data": json.dumps(data, separators=(",", ":"))}


def decode_event(fields: dict) -> tuple[str, dict[str, Any]]:
    """Inverse of encode_event; accepts bytes or str field names and values."""
    norm = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()}
    return norm["type"], json.loads(norm["data"])


def completion_object(job: CompletionJob, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    """The OpenAI `text_completion` object for a finished job."""
    return {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": usage,
    }


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope; all four keys are always present."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- errors: one OpenAI-shaped error type for web and worker ----

# OpenAI's error types and the HTTP status each is answered with.
STATUS_BY_TYPE = {"invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
                  "not_found_error": 404, "rate_limit_error": 429}


class APIError(Exception):
    """An error in OpenAI's shape: web answers it as `{"error": {message, type, param, code}}` with
    `status`; the worker writes it as a job's `error` event, and web reads it back with `from_body`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self):
        # pickled as it is, whatever its class's __init__ takes (an engine's process sends them)
        return _restore_error, (type(self), self.args, self.__dict__)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "APIError":
        """An envelope that came back from a worker (an `error` event) as an APIError."""
        err = body.get("error") or {}
        type_ = err.get("type") or "server_error"
        return cls(STATUS_BY_TYPE.get(type_, 500), err.get("message") or "The request failed.", type_,
                   err.get("param"), err.get("code"))


def _restore_error(cls: type, args: tuple, state: dict) -> APIError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_length_error(context_length: int, prompt_tokens: int, max_tokens: int | None) -> APIError:
    """OpenAI's refusal of a prompt (plus `max_tokens`) longer than the model's context."""
    completion = max_tokens or 0
    return bad_request(
        f"This model's maximum context length is {context_length} tokens, however you requested "
        f"{prompt_tokens + completion} tokens ({prompt_tokens} in your prompt; {completion} for the completion). "
        "Please reduce your prompt; or completion length.",
        "max_tokens" if max_tokens else "prompt", "context_length_exceeded")


# ---- a job against its model: the web tier checks a request's pieces with these before it queues
# the job, the engine the whole job again (`check_job`: a job may reach Redis another way), so
# both refuse in the same words ----

def check_job(job: CompletionJob, vocab_size: int, context_length: int) -> None:
    """What a job's model decides of it: prompts with tokens, every token id in the vocabulary,
    each prompt with max_tokens within the context (a 400 `APIError` for the first problem)."""
    check_prompts(job.prompts, vocab_size)
    for param, ids in (("logit_bias", job.logit_bias), ("stop_token_ids", job.stop_token_ids),
                       ("allowed_token_ids", job.allowed_token_ids or []),
                       ("bad_words", [t for word in job.bad_words for t in word])):
        check_token_ids(ids, vocab_size, param)
    check_context(job.prompts, job.max_tokens, context_length)


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts or not all(prompts):
        raise bad_request("The prompt is empty: give at least one token.", "prompt")
    bad = next((t for ids in prompts for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} in the prompt is out of vocabulary (vocabulary size: "
                          f"{vocab_size}).", "prompt")


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = sorted(t for t in ids if not 0 <= t < vocab_size)
    if bad:
        raise bad_request(f"{param} contains token ids that are out of vocabulary: {bad[:10]} "
                          f"(vocabulary size: {vocab_size}).", param)


def check_context(prompts: list[list[int]], max_tokens: int | None, context_length: int) -> int:
    """Refuse what cannot fit the context, in OpenAI's words; returns how many completion tokens the
    prompts may generate in all, one choice each (`max_tokens: null`: up to the end of the context)."""
    total = 0
    for ids in prompts:
        completion = max_tokens if max_tokens is not None else max(context_length - len(ids), 0)
        if len(ids) + completion > context_length:
            raise context_length_error(context_length, len(ids), max_tokens)
        total += completion
    return total
