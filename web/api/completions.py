"""`POST /v1/completions`: a request becomes one queued job (`admit_completion`, shared with
`/v1/jobs`), then the answer is read back from the job's event stream — the completion object
(`stream: false`) or server-sent events (`stream: true`)."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator

from flask import Blueprint, Response, g, jsonify, request, stream_with_context

from models.registry import ModelSpec
from models.tokenizer import Tokenizer, bad_words_token_ids
from web import access, metrics
from web.api import admission
from web.access.ownership import owner_of
from web.access.quotas import Hold
from web.api.models import served_models
from web.api.queue import job_queue
from web.api.schemas import MAX_USER, CompletionRequest, parse_completion_request
from web.api.stream_hub import Follower
from web.api.streaming import ChunkFormat, Event, follow, guarded, sse_frames, wait_for_completion
from web.settings import settings
from worker import protocol
from worker.protocol import APIError, bad_request

bp = Blueprint("completions", __name__)


@dataclass
class Admitted:
    request: CompletionRequest
    job: protocol.CompletionJob
    grant: access.Grant
    hold: Hold | None  # the request's place in its caller's `open` quota (None for a polled job)
    follower: Follower | None  # the stream hub's place for the job's stream (None for a polled job)


@dataclass
class Checked:
    """A completions request that the model can run: parsed, its model resolved, its prompts
    tokenized, and the most tokens it may use (what its admission reserves)."""
    request: CompletionRequest
    spec: ModelSpec
    prompts: list[list[int]]
    reserved_tokens: int
    bad_words: list[list[int]]

    def to_job(self) -> protocol.CompletionJob:
        req = self.request
        return req.to_job(self.spec, self.prompts, seed=req.seed if req.seed is not None else random.getrandbits(63),
                          bad_words=self.bad_words)


@bp.post("/v1/completions")
def create_completion():
    started = time.perf_counter()
    admitted = admit_completion()
    jq, job, s, hold = job_queue(), admitted.job, settings(), admitted.hold
    deadline = None if job.stream else time.monotonic() + s.sync_timeout_s
    events = follow(jq, job.id, tick_s=s.keepalive_s, deadline=deadline, follower=admitted.follower)
    events = _accounted(events, admitted.grant, job.model, started, hold)
    hold.follow(access.quota("jobs"), job.id)
    if not job.stream:
        try:
            return jsonify(wait_for_completion(held(events, hold), deadline, jq, job.id, s.sync_timeout_s))
        finally:
            hold.release()
    fmt = ChunkFormat(job.id, job.created, job.model, job.include_usage, job.logprobs is not None,
                      continuous_usage=admitted.request.continuous_usage, echo=job.echo,
                      prompt_tokens=[len(p) for p in job.prompts for _ in range(job.n)])
    frames = guarded(sse_frames(held(events, hold), fmt), jq, job.id, cancel_on_disconnect=True, hold=hold)
    return sse_response(frames)


def sse_response(frames: Iterator[str]) -> Response:
    # stream_with_context: the generator runs after this view returns and still needs the app.
    return Response(stream_with_context(frames), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _accounted(events: Iterator[Event | None], grant: access.Grant, model: str,
               started: float, hold: Hold | None) -> Iterator[Event | None]:
    """Pass events through, recording the time to the first token and settling the token
    reservation with the real usage (none for a request that failed or was cancelled), in the
    round trip of `hold`'s release where there is one."""
    first_token = True
    for event in events:
        kind = event.type if event is not None else None
        if kind == "delta" and first_token:
            first_token = False
            metrics.observe_ttft(model, time.perf_counter() - started)
        elif kind == "usage":
            access.settle(grant, event.data["total_tokens"], hold)
        elif kind in ("error", "cancelled"):
            access.settle(grant, 0, hold)
        yield event


def admit_completion(for_job: bool = False) -> Admitted:
    """The request path up to the queue (docs/architecture.md): authenticate, parse and validate,
    resolve the model, count its sequences, refuse a blocked caller (all before tokenizing), tokenize,
    check the context, admit and enqueue as the caller's job (the model's queue, access limits and
    quotas, then rq's enqueue, in one round trip: web/api/admission.py)."""
    g.caller = caller = access.authenticate(request)
    body = read_json_body()
    if isinstance(body, dict) and isinstance(body.get("user"), str) and len(body["user"]) <= MAX_USER:
        g.user = body["user"]  # abuse accounting names it only within the schema's cap
    if for_job and isinstance(body, dict) and body.get("stream"):
        raise bad_request("stream is not supported on /v1/jobs; follow GET /v1/jobs/{id}/stream instead.", "stream")
    req, spec = parse_completion(body)
    access.check_blocked(caller, req.user)
    checked = check_prompts(req, spec)
    jq, job, s = job_queue(), checked.to_job(), settings()
    hold = None if for_job else access.hold_open(caller, take=False)
    lapses = time.time() + s.queue_ttl_s + s.job_timeout_s * (s.job_retries + 1)
    # the hub follows the stream from the job's enqueue on, woken by a write that goes with it
    key = protocol.stream_key(job.id)
    follower = None if for_job else jq.hub.register(key, "0-0")
    try:
        _, enqueue = jq.prepare(job, spec.id, owner=owner_of(caller),
                                also=None if follower is None else lambda pipe: jq.hub.queue_wake(pipe, key))
        g.grant = grant = admission.admit(jq, caller, req.user, spec.id, checked.reserved_tokens, job.id, lapses,
                                          hold, enqueue)
    except Exception:
        if follower is not None:
            jq.hub.leave(follower)
        raise
    return Admitted(req, job, grant, hold, follower)


def held(events: Iterator[Event | None], hold: Hold | None) -> Iterator[Event | None]:
    """Pass events through, keeping the request's hold on its `open` quota fresh, and telling it when
    the job ended (its release then gives back the job's place too)."""
    for event in events:
        if hold is not None:
            hold.refresh()
            if event is not None and event.type in protocol.TERMINAL_EVENTS:
                hold.job_ended()
        yield event


def check_completion(body: Any) -> Checked:
    """Everything about a completions request that needs no caller: parse and validate, resolve the
    model, tokenize, check the vocabulary, the context and the number of sequences (a 400 or 404
    `APIError` for the first problem). Also how a batch's line is checked before it runs."""
    return check_prompts(*parse_completion(body))


def parse_completion(body: Any) -> tuple[CompletionRequest, ModelSpec]:
    """The request validated and its model resolved, with its size checked before any tokenizing:
    the number of sequences it asks for (prompts × max(n, best_of))."""
    s = settings()
    req = parse_completion_request(body, max_stop=s.max_stop, max_logit_bias=s.max_logit_bias,
                                   unknown_fields=s.unknown_fields)
    spec = served_models().get(req.model)
    prompts = _prompt_count(req.prompt)
    per_prompt = req.best_of or req.n  # sequences generated for each prompt
    if prompts * per_prompt > s.max_choices:
        raise bad_request(f"This request asks for {prompts * per_prompt} sequences ({prompts} "
                          f"prompts × {per_prompt}); the limit is {s.max_choices}.",
                          "n" if per_prompt > 1 else "prompt")
    return req, spec


def _prompt_count(prompt: Any) -> int:
    if prompt is None or isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def check_prompts(req: CompletionRequest, spec: ModelSpec) -> Checked:
    """Tokenize a parsed request's prompts with its model's tokenizer and check them against the
    vocabulary and the context."""
    tokenizer = served_models().tokenizer(spec)
    prompts = truncate_prompts(tokenize_prompts(req.prompt, tokenizer), req.truncate_prompt_tokens,
                               spec.context_length)
    for name in ("logit_bias", "stop_token_ids", "allowed_token_ids"):  # as the engine checks the job
        protocol.check_token_ids(getattr(req, name) or [], tokenizer.vocab_size, name)
    bad_words = bad_words_token_ids(req.bad_words, lambda word: encode_text(word, tokenizer.encode_ordinary, "bad_words"))
    completion_tokens = protocol.check_context(prompts, req.max_tokens, spec.context_length)
    per_prompt = req.best_of or req.n
    return Checked(req, spec, prompts, sum(map(len, prompts)) + completion_tokens * per_prompt, bad_words)


def read_json_body() -> Any:
    """The request's JSON body. Only a JSON content type is read: a web page may post `text/plain`
    to a server on the user's machine without asking, but not `application/json`."""
    if not request.is_json:
        raise APIError(415, "The request body must be JSON, sent with `Content-Type: application/json` "
                       f"(got {request.mimetype[:60] or 'none'!r}).", "invalid_request_error", None,
                       "unsupported_media_type")
    data = request.get_data(cache=False)  # werkzeug answers 413 past MAX_CONTENT_LENGTH
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise bad_request("We could not parse the JSON body of your request. The API expects a JSON "
                          "payload, but what was sent was not valid JSON.") from None


def encode_text(text: str, encode, param: str) -> list[int]:
    """A text's ids; a character the model's vocabulary lacks (a character-level model's) is a 400."""
    try:
        return encode(text)
    except ValueError as err:
        raise bad_request(f"{err}.", param) from None


def tokenize_prompts(prompt: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """Every prompt form as a list of token-id lists (prompt-major: choice = prompt_index * n + j)."""
    if prompt is None:  # OpenAI's default prompt is the end-of-text token
        if tokenizer.eos_token_id is None:
            raise bad_request("This model has no end-of-text token; a prompt is required.", "prompt")
        return [[tokenizer.eos_token_id]]
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        prompts = [encode_text(text, tokenizer.encode, "prompt") for text in ([prompt] if isinstance(prompt, str) else prompt)]
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(ids) for ids in prompt]
    protocol.check_prompts(prompts, tokenizer.vocab_size)
    return prompts


def truncate_prompts(prompts: list[list[int]], keep: int | None, context_length: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return prompts
    if keep > context_length:
        raise bad_request(f"truncate_prompt_tokens ({keep}) is greater than the model's context length "
                          f"({context_length}).", "truncate_prompt_tokens")
    keep = context_length if keep == -1 else keep
    return [ids[-keep:] for ids in prompts]
