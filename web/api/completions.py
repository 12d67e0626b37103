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
from web.access.ownership import owner_of
from web.api.models import served_models
from web.api.queue import job_queue
from web.api.schemas import CompletionRequest, parse_completion_request
from web.api.streaming import ChunkFormat, Event, follow, guarded, sse_frames, wait_for_completion
from web.settings import settings
from worker import protocol
from worker.protocol import bad_request

bp = Blueprint("completions", __name__)


@dataclass
class Admitted:
    request: CompletionRequest
    job: protocol.CompletionJob
    grant: access.Grant


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
    jq, job, s = job_queue(), admitted.job, settings()
    deadline = None if job.stream else time.monotonic() + s.sync_timeout_s
    events = follow(jq, job.id, tick_s=s.keepalive_s, deadline=deadline)
    events = _accounted(events, admitted.grant, job.model, started)
    if not job.stream:
        return jsonify(wait_for_completion(events, deadline, jq, job.id, s.sync_timeout_s))
    fmt = ChunkFormat(job.id, job.created, job.model, job.include_usage, job.logprobs is not None,
                      continuous_usage=admitted.request.continuous_usage, echo=job.echo,
                      prompt_tokens=[len(p) for p in job.prompts for _ in range(job.n)])
    frames = guarded(sse_frames(events, fmt), jq, job.id, cancel_on_disconnect=True)
    return sse_response(frames)


def sse_response(frames: Iterator[str]) -> Response:
    # stream_with_context: the generator runs after this view returns and still needs the app.
    return Response(stream_with_context(frames), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _accounted(events: Iterator[Event | None], grant: access.Grant, model: str,
               started: float) -> Iterator[Event | None]:
    """Pass events through, recording the time to the first token and settling the token
    reservation with the real usage (none for a request that failed or was cancelled)."""
    first_token = True
    for event in events:
        kind = event.type if event is not None else None
        if kind == "delta" and first_token:
            first_token = False
            metrics.observe_ttft(model, time.perf_counter() - started)
        elif kind == "usage":
            access.settle(grant, event.data["total_tokens"])
        elif kind in ("error", "cancelled"):
            access.settle(grant, 0)
        yield event


def admit_completion(for_job: bool = False) -> Admitted:
    """The request path up to the queue (DESIGN.md): authenticate, parse and validate, resolve the
    model, tokenize, check the context, admit (access limits), enqueue as the caller's job."""
    g.caller = access.authenticate(request)
    body = read_json_body()
    if isinstance(body, dict) and isinstance(body.get("user"), str):
        g.user = body["user"]
    if for_job and isinstance(body, dict) and body.get("stream"):
        raise bad_request("stream is not supported on /v1/jobs; follow GET /v1/jobs/{id}/stream instead.", "stream")
    checked = check_completion(body)

    jq = job_queue()
    jq.check_capacity(checked.spec.id)
    g.grant = grant = access.admit(g.caller, checked.request.user, checked.reserved_tokens)
    job = checked.to_job()
    jq.enqueue(job, checked.spec.id, owner=owner_of(g.caller))
    return Admitted(checked.request, job, grant)


def check_completion(body: Any) -> Checked:
    """Everything about a completions request that needs no caller: parse and validate, resolve the
    model, tokenize, check the vocabulary, the context and the number of sequences (a 400 or 404
    `APIError` for the first problem). Also how a batch's line is checked before it runs."""
    s = settings()
    req = parse_completion_request(body, max_stop=s.max_stop, unknown_fields=s.unknown_fields)
    models = served_models()
    spec = models.get(req.model)
    tokenizer = models.tokenizer(spec)
    prompts = truncate_prompts(tokenize_prompts(req.prompt, tokenizer), req.truncate_prompt_tokens,
                               spec.context_length)
    check_logit_bias(req.logit_bias, tokenizer.vocab_size)
    for name in ("stop_token_ids", "allowed_token_ids"):
        check_token_ids(getattr(req, name) or [], tokenizer.vocab_size, name)
    bad_words = bad_words_token_ids(req.bad_words, lambda word: encode_text(word, tokenizer.encode_ordinary, "bad_words"))
    completion_tokens = check_context(prompts, req.max_tokens, spec.context_length)
    per_prompt = req.best_of or req.n  # sequences generated for each prompt
    if len(prompts) * per_prompt > s.max_choices:
        raise bad_request(f"This request asks for {len(prompts) * per_prompt} sequences ({len(prompts)} "
                          f"prompts × {per_prompt}); the limit is {s.max_choices}.",
                          "n" if per_prompt > 1 else "prompt")
    return Checked(req, spec, prompts, sum(map(len, prompts)) + completion_tokens * per_prompt, bad_words)


def read_json_body() -> Any:
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
    for ids in prompts:
        if not ids:
            raise bad_request("The prompt is empty: give at least one token.", "prompt")
        bad = [t for t in ids if t >= tokenizer.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} in the prompt is out of vocabulary (vocabulary size: "
                              f"{tokenizer.vocab_size}).", "prompt")
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


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = sorted(t for t in ids if t >= vocab_size)
    if bad:
        raise bad_request(f"{param} contains token ids that are out of vocabulary: {bad[:10]} "
                          f"(vocabulary size: {vocab_size}).", param)


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    bad = sorted(t for t in bias if not 0 <= t < vocab_size)
    if bad:
        raise bad_request(f"logit_bias contains token ids that are out of vocabulary: {bad[:10]} "
                          f"(vocabulary size: {vocab_size}).", "logit_bias")


def check_context(prompts: list[list[int]], max_tokens: int | None, context_length: int) -> int:
    """Reject what cannot fit the context, in OpenAI's words; returns how many completion tokens the
    prompts may generate in all, one choice each (`max_tokens: null`: up to the end of the context)."""
    total = 0
    for ids in prompts:
        completion = max_tokens if max_tokens is not None else max(context_length - len(ids), 0)
        if len(ids) + completion > context_length:
            raise protocol.context_length_error(context_length, len(ids), max_tokens)
        total += completion
    return total
