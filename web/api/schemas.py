"""The protocol of `/v1/completions`: the request model with OpenAI's names, ranges and defaults,
vLLM's extras (its names and meanings) and a few of transformers' `generate` options, the conversion
of validation errors into OpenAI's 400s, and the one conversion of a valid request into the job the
worker runs (`CompletionRequest.to_job`). docs/api.md lists them all.

This is the only place the ranges and defaults are written: the worker trusts a job built here and
checks only what only it knows. `null` is accepted wherever OpenAI (or vLLM) accepts it and means the
default, except `max_tokens: null`, which means "up to the end of the context". A field that is not
in the model is a 400 naming it, as OpenAI answers, unless the caller asks to drop unknown fields
(the operator's `NANOSERVE_UNKNOWN_FIELDS=ignore`). Types are strict (no `"5"` for 5), as OpenAI's
schema is. What needs the model (vocabulary, context length, tokenizing bad words) is checked in
`web.api.completions`, with the model's tokenizer at hand.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from models.registry import ModelSpec
from web.api import structured
from worker import protocol

log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 16  # default cap on stop strings (OpenAI's is 4; vLLM and llama.cpp have none)
MAX_LOGIT_BIAS = 300  # default cap on logit_bias entries: each is applied to every step of the batch
MAX_BAD_WORDS = 128
MAX_USER = 256  # the `user` field names Redis keys
MAX_WORD_CHARS = 1000  # one stop string or bad word: matched against the text at every step
MAX_TOKEN_IDS = 1 << 17  # stop_token_ids, allowed_token_ids: above any GPT-2-era vocabulary

# Prompt after normalisation: either texts or token ids, always a list of prompts.
Prompt = str | list[str] | list[int] | list[list[int]]


class RequestError(ValueError):
    """A request value OpenAI would reject, naming the parameter (raised inside the validators, which
    pydantic lets raise only ValueError; `parse_completion_request` answers it as a 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's: accepted; chunks are not padded here
    continuous_usage_stats: bool | None = None  # vLLM: every chunk carries its choice's usage so far


class CompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str
    prompt: Prompt | None = None  # null: OpenAI's default, the end-of-text token
    best_of: int | None = Field(None, ge=1, le=20)
    echo: bool = False
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: int | None = Field(None, ge=0, le=5)
    max_tokens: int | None = Field(16, ge=0)  # null: up to the end of the context
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=0, le=1)  # 0, as at OpenAI: the most likely token only
    user: str | None = Field(None, max_length=MAX_USER)
    # vLLM's extras (its SamplingParams and OpenAI protocol models: names, meanings, ranges)
    top_k: int = Field(0, ge=-1, le=1 << 20)  # 0 or -1 (vLLM's): off; above any vocabulary means all
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, le=1 << 20)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_IDS)
    prompt_logprobs: int | None = Field(None, ge=0, le=5)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: the model's context
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10, le=10)  # length ** penalty must stay a float
    early_stopping: bool | Literal["never"] = False
    # transformers' generate options
    no_repeat_ngram_size: int = Field(0, ge=0, le=1 << 20)
    penalty_alpha: float | None = Field(None, ge=0, le=1)  # contrastive search among top_k candidates
    # structured output (web/api/structured.py): vLLM's fields, and OpenAI's response_format
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    _grammar: str | None = PrivateAttr(None)  # what they ask for, as one llguidance grammar

    @field_validator("echo", "frequency_penalty", "n", "presence_penalty", "stream", "temperature",
                     "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                     "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "bad_words",
                     "return_tokens_as_token_ids", "use_beam_search", "length_penalty", "early_stopping",
                     "no_repeat_ngram_size", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) if value is None else value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _check_token_ids(cls, value: list[int] | None, info) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise RequestError(f"{info.field_name} must hold token ids (integers >= 0).", info.field_name)
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str]) -> list[str]:
        if any(not w.strip() for w in value):
            raise RequestError("bad_words must be non-empty strings.", "bad_words")
        if any(len(w) > MAX_WORD_CHARS for w in value):
            raise RequestError(f"bad_words must be at most {MAX_WORD_CHARS} characters each.", "bad_words")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise RequestError("prompt must be a non-empty string, list of strings, list of token ids "
                               "or list of lists of token ids.", "prompt")
        if all(isinstance(p, str) for p in value) or all(_is_token_id(t) for t in value):
            return value
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return value
        raise RequestError("prompt must be a string, a list of strings, a list of token ids (integers "
                           ">= 0) or a list of non-empty lists of token ids.", "prompt")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any, info) -> Any:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RequestError(f"{_shown(value)} is not valid under any of the given schemas - 'stop'", "stop")
        limit = (info.context or {}).get("max_stop", MAX_STOP)
        if len(stops) > limit:
            raise RequestError(f"{_shown(value)} is too long - 'stop' (at most {limit} stop sequences)", "stop")
        if any(s == "" for s in stops):
            raise RequestError("stop sequences must be non-empty strings.", "stop")
        if any(len(s) > MAX_WORD_CHARS for s in stops):
            raise RequestError(f"stop sequences must be at most {MAX_WORD_CHARS} characters each.", "stop")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any, info) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise RequestError(f"{_shown(value)} is not of type 'object' - 'logit_bias'", "logit_bias")
        limit = (info.context or {}).get("max_logit_bias", MAX_LOGIT_BIAS)
        if len(value) > limit:
            raise RequestError(f"Invalid 'logit_bias': {len(value)} entries; at most {limit} are allowed.",
                               "logit_bias")
        bias = {}
        for key, weight in value.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"Invalid key in 'logit_bias': {_shown(key)}. Keys must be token ids.",
                                   "logit_bias") from None
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not -100 <= weight <= 100:
                raise RequestError(f"Invalid value for 'logit_bias' at token {key}: {json.dumps(weight)}. "
                                   "Values must be numbers from -100 to 100.", "logit_bias")
            bias[token] = float(weight)
        return bias

    @model_validator(mode="after")
    def _check_combinations(self) -> "CompletionRequest":
        if self.suffix:
            raise RequestError("suffix is not supported by this server.", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of must be greater than or equal to n (got best_of={self.best_of}, "
                               f"n={self.n}).", "best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise RequestError("best_of cannot be used with stream: the best choices are known only "
                               "when all are finished.", "best_of")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true.", "stream_options")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be less than or equal to max_tokens (got min_tokens="
                               f"{self.min_tokens}, max_tokens={self.max_tokens}).", "min_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs are not available when stream is true.", "prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens must be at least 1 (or -1: the model's context).",
                               "truncate_prompt_tokens")
        if self.penalty_alpha is not None:
            self._check_contrastive_search()
        if self.use_beam_search:
            self._check_beam_search()
        self._check_structured_output()
        return self

    def _check_structured_output(self) -> None:
        try:
            asked = structured.requested(self.structured_outputs, self.response_format,
                                         {name: getattr(self, name) for name in structured.GUIDED})
            if asked is None:
                return
            if self.use_beam_search or self.penalty_alpha is not None:
                raise structured.StructuredError("Structured output does not combine with use_beam_search or "
                                                 "penalty_alpha.", asked[0])
            self._grammar = structured.compile_grammar(*asked)
        except structured.StructuredError as err:
            raise RequestError(str(err), err.param) from None

    def _check_beam_search(self) -> None:
        """Beam search is deterministic: truncations of a sampled distribution have no meaning in it."""
        if self.stream:
            raise RequestError("Streaming is not supported with beam search.", "stream")
        self._refuse_truncations("use_beam_search")
        if self.top_k > 0:
            raise RequestError("top_k cannot be used with use_beam_search.", "top_k")

    def _check_contrastive_search(self) -> None:
        """Contrastive search (penalty_alpha) compares top_k candidates and keeps one deterministic
        sequence per prompt: it needs at least two candidates, and takes neither another search (beam
        search), copies of itself (n, best_of) nor truncations of a sampled distribution."""
        if self.use_beam_search:
            raise RequestError("penalty_alpha (contrastive search) cannot be used with use_beam_search.",
                               "penalty_alpha")
        if self.top_k <= 1:
            raise RequestError(f"penalty_alpha (contrastive search) needs top_k > 1, the number of candidate "
                               f"tokens compared each step (got top_k={self.top_k}).", "top_k")
        for name, value in (("n", self.n), ("best_of", self.best_of or 1)):
            if value > 1:
                raise RequestError(f"{name} must be 1 with penalty_alpha: contrastive search is deterministic, "
                                   f"so its choices would all be the same.", name)
        self._refuse_truncations("penalty_alpha")

    def _refuse_truncations(self, mode: str) -> None:
        for name, neutral in (("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != neutral:
                raise RequestError(f"{name} cannot be used with {mode}.", name)

    @property
    def include_usage(self) -> bool:
        """The usage chunk at the end of a stream: asked for, or implied by continuous usage (as vLLM's
        stream options default include_usage to true) unless refused."""
        options = self.stream_options
        if not (self.stream and options):
            return False
        return bool(options.include_usage or (options.continuous_usage_stats and options.include_usage is None))

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_job(self, spec: ModelSpec, prompts: list[list[int]], seed: int,
               bad_words: list[list[int]] = ()) -> protocol.CompletionJob:
        """The job for this request: `prompts` tokenized with the model's tokenizer, and so are the
        `bad_words` (their spellings), and always a `seed` (the caller draws one when the request has
        none), so a job retried after a worker crash replays the tokens it already streamed."""
        return protocol.CompletionJob(
            id=protocol.new_completion_id(), model=spec.id, prompts=prompts, max_tokens=self.max_tokens,
            # contrastive search is deterministic; with penalty_alpha 0 it is greedy search (transformers)
            temperature=self.temperature if self.penalty_alpha is None else 0.0, top_p=self.top_p,
            top_k=max(self.top_k, 0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, seed=seed, n=self.n, best_of=self.best_of, stop=self.stop,
            logprobs=self.logprobs, echo=self.echo, stream=self.stream, include_usage=self.include_usage,
            user=self.user, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, bad_words=list(bad_words),
            allowed_token_ids=self.allowed_token_ids, no_repeat_ngram_size=self.no_repeat_ngram_size,
            prompt_logprobs=self.prompt_logprobs, return_tokens_as_token_ids=self.return_tokens_as_token_ids,
            use_beam_search=self.use_beam_search, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping, penalty_alpha=self.penalty_alpha or 0.0, grammar=self._grammar)


def _shown(value: Any, limit: int = 200) -> str:
    """A value as JSON for an error message, cut short: a 400 never echoes a megabyte back."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


_TYPE_NAMES = {"int_type": "integer", "float_type": "number", "bool_type": "boolean",
               "string_type": "string", "dict_type": "object", "list_type": "array",
               "model_type": "object", "int_from_float": "integer"}


def parse_completion_request(body: Any, *, max_stop: int = MAX_STOP, max_logit_bias: int = MAX_LOGIT_BIAS,
                             unknown_fields: str = "reject") -> CompletionRequest:
    """Validate a decoded JSON body; the first problem is a 400 `APIError` naming its param.
    `unknown_fields`: "reject" (a 400 naming the first one, as OpenAI) or "ignore" (dropped, logged)."""
    if not isinstance(body, dict):
        raise protocol.bad_request(f"The request body must be a JSON object, not {type(body).__name__}.")
    if unknown_fields == "ignore":
        body = _known_fields(body)
    try:
        return CompletionRequest.model_validate(body, context={"max_stop": max_stop, "max_logit_bias": max_logit_bias})
    except ValidationError as err:
        problem = request_error(err)
        raise protocol.bad_request(str(problem), problem.param) from None


def _known_fields(body: dict) -> dict:
    """The body without the fields the request model does not know (at the top and in stream_options)."""
    unknown = [k for k in body if k not in CompletionRequest.model_fields]
    kept = {k: v for k, v in body.items() if k in CompletionRequest.model_fields}
    options = kept.get("stream_options")
    if isinstance(options, dict):
        unknown += [f"stream_options.{k}" for k in options if k not in StreamOptions.model_fields]
        kept["stream_options"] = {k: v for k, v in options.items() if k in StreamOptions.model_fields}
    if unknown:
        log.info("request fields ignored: %s", ", ".join(unknown))
    return kept


def request_error(err: ValidationError) -> RequestError:
    """The first pydantic error in OpenAI's words, e.g. "3 is greater than the maximum of 2 - 'temperature'"."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    param = loc[0] if loc else None
    ctx = first.get("ctx") or {}
    if isinstance(ctx.get("error"), RequestError):
        return ctx["error"]
    where = ".".join(loc)
    value = _shown(first.get("input"))
    kind = first["type"]
    if kind == "extra_forbidden":
        return RequestError(f"Unrecognized request argument supplied: {where}", where)
    if kind == "missing":
        message = f"Missing required parameter: '{where}'."
        if where == "model":
            message = "you must provide a model parameter"
    elif kind in ("greater_than_equal", "greater_than"):
        message = f"{value} is less than the minimum of {ctx.get('ge', ctx.get('gt'))} - '{where}'"
    elif kind in ("less_than_equal", "less_than"):
        message = f"{value} is greater than the maximum of {ctx.get('le', ctx.get('lt'))} - '{where}'"
    elif kind == "finite_number":
        message = f"{value} is not a finite number - '{where}'"
    elif kind in _TYPE_NAMES:
        message = f"{value} is not of type '{_TYPE_NAMES[kind]}' - '{where}'"
    else:
        message = f"Invalid value for '{where}': {first['msg']}."
    return RequestError(message, param)
