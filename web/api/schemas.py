"""The OpenAI protocol of `/v1/completions`: the request model with OpenAI's names, ranges and
defaults, the conversion of its validation errors into OpenAI's 400s, and the one conversion of a
valid request into the job the worker runs (`CompletionRequest.to_job`).

This is the only place OpenAI's ranges and defaults are written: the worker trusts a job built here
and checks only what only it knows. `null` is accepted wherever OpenAI accepts it and means the
default, except `max_tokens: null`, which means "up to the end of the context". Unknown fields are
ignored. Types are strict (no `"5"` for 5), as OpenAI's schema is. What needs the model (vocabulary,
context length) is checked in `web.api.completions`, with the model's tokenizer at hand.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from models.registry import ModelSpec
from worker import protocol

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 4

# Prompt after normalisation: either texts or token ids, always a list of prompts.
Prompt = str | list[str] | list[int] | list[list[int]]


class RequestError(ValueError):
    """A request value OpenAI would reject, naming the parameter (raised inside the validators, which
    pydantic lets raise only ValueError; `parse_completion_request` answers it as a 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

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
    top_k: int = Field(0, ge=0)  # extension (vLLM's name); 0: off
    user: str | None = Field(None, max_length=256)  # it names Redis keys: keep it bounded

    @field_validator("echo", "frequency_penalty", "n", "presence_penalty", "stream", "temperature",
                     "top_p", "top_k", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

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
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RequestError(f"{json.dumps(value)} is not valid under any of the given schemas - 'stop'", "stop")
        if len(stops) > MAX_STOP:
            raise RequestError(f"{json.dumps(value)} is too long - 'stop' (at most {MAX_STOP} stop sequences)", "stop")
        if any(s == "" for s in stops):
            raise RequestError("stop sequences must be non-empty strings.", "stop")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise RequestError(f"{json.dumps(value)} is not of type 'object' - 'logit_bias'", "logit_bias")
        bias = {}
        for key, weight in value.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"Invalid key in 'logit_bias': {key}. Keys must be token ids.", "logit_bias") from None
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
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_job(self, spec: ModelSpec, prompts: list[list[int]], seed: int) -> protocol.CompletionJob:
        """The job for this request: `prompts` tokenized with the model's tokenizer, and always a `seed`
        (the caller draws one when the request has none), so a job retried after a worker crash
        replays the tokens it already streamed."""
        return protocol.CompletionJob(
            id=protocol.new_completion_id(), model=spec.id, prompts=prompts, max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, seed=seed, n=self.n, best_of=self.best_of, stop=self.stop,
            logprobs=self.logprobs, echo=self.echo, stream=self.stream, include_usage=self.include_usage,
            user=self.user)


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


_TYPE_NAMES = {"int_type": "integer", "float_type": "number", "bool_type": "boolean",
               "string_type": "string", "dict_type": "object", "list_type": "array",
               "model_type": "object", "int_from_float": "integer"}


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body; the first problem is a 400 `APIError` naming its param."""
    if not isinstance(body, dict):
        raise protocol.bad_request(f"The request body must be a JSON object, not {type(body).__name__}.")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as err:
        problem = request_error(err)
        raise protocol.bad_request(str(problem), problem.param) from None


def request_error(err: ValidationError) -> RequestError:
    """The first pydantic error in OpenAI's words, e.g. "3 is greater than the maximum of 2 - 'temperature'"."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    param = loc[0] if loc else None
    ctx = first.get("ctx") or {}
    if isinstance(ctx.get("error"), RequestError):
        return ctx["error"]
    where = ".".join(loc)
    value = json.dumps(first.get("input"), default=str)
    kind = first["type"]
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
