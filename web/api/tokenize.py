"""vLLM's `POST /tokenize` and `POST /detokenize` (also under `/v1`), with its request and response
shapes: clients count and cut prompts against the context with them, using exactly the ids a
completion of the same model would see.

    POST /tokenize   {"model", "prompt": str | [ids], "add_special_tokens": true, "return_token_strs": false}
                  -> {"count", "max_model_len", "tokens", "token_strs"?}
    POST /detokenize {"model", "tokens": [ids]} -> {"prompt"}

Both take the caller's key and one request of its rpm, like any route that costs work.
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, g, jsonify, request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from web import access
from web.api.completions import encode_text, read_json_body
from web.api.models import served_models
from web.api.schemas import MAX_TOKEN_IDS, request_error
from worker.protocol import bad_request, check_token_ids

bp = Blueprint("tokenize", __name__)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: str | list[int]  # ids: echoed back checked, as a completion's token prompt is
    add_special_tokens: bool = True  # the family's BOS first (OPT's), as a completion's prompt has it
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    tokens: list[int] = Field(max_length=MAX_TOKEN_IDS)


@bp.post("/tokenize")
@bp.post("/v1/tokenize")
def tokenize():
    req = _parse(TokenizeRequest)
    spec = served_models().get(req.model)
    tokenizer = served_models().tokenizer(spec)
    if isinstance(req.prompt, str):
        ids = encode_text(req.prompt, tokenizer.encode, "prompt")
        if not req.add_special_tokens and tokenizer.prompt_bos is not None:
            ids = ids[1:]  # only the added BOS goes: special tokens' text still stands for them
    else:
        check_token_ids(ids := req.prompt, tokenizer.vocab_size, "prompt")
    body: dict[str, Any] = {"count": len(ids), "max_model_len": spec.context_length, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.token_string(t) for t in ids]
    return jsonify(body)


@bp.post("/detokenize")
@bp.post("/v1/detokenize")
def detokenize():
    req = _parse(DetokenizeRequest)
    tokenizer = served_models().tokenizer(served_models().get(req.model))
    check_token_ids(req.tokens, tokenizer.vocab_size, "tokens")
    return jsonify({"prompt": tokenizer.decode(req.tokens)})


def _parse(model: type[BaseModel]) -> Any:
    g.grant = access.admit_request(access.authenticate(request))
    body = read_json_body()
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {type(body).__name__}.")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        problem = request_error(err)
        raise bad_request(str(problem), problem.param) from None

