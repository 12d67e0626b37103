"""A batch's input file, checked as OpenAI checks it before a batch runs.

Each line of the JSONL file is one request: `{"custom_id": …, "method": "POST", "url": <the batch's
endpoint>, "body": {…}}`. What makes the whole file unusable fails the batch, with one error per
offending line in the batch's `errors` (OpenAI's codes where it documents them): the file is empty
(`empty_file`), has too many lines (`too_many_tasks`), a line is not a JSON object
(`invalid_json_line`), lacks a field (`missing_required_parameter`), uses another method
(`invalid_method`) or endpoint (`url_mismatch`), is larger than a request may be (`line_too_large`), has
a `custom_id` that is too long or repeated (`invalid_value`, `duplicate_custom_id`), names
a model that is not served (`model_not_found`) or another model than the other lines
(`model_mismatch`: one batch, one model, as on OpenAI).

What is wrong *inside* a body (a temperature out of range, a prompt too long) is found when that line
runs, exactly as for the same request sent alone, and goes to the batch's error file: one bad line
does not sink the others.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

MAX_ERRORS = 100  # errors reported for one file; past that, checking stops
MAX_CUSTOM_ID = 512  # characters


@dataclass(frozen=True)
class BatchError:
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based, as OpenAI counts

    def to_object(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class BatchInput:
    lines: list[str] = field(default_factory=list)  # `{"custom_id", "body"}` per request, compact JSON
    model: str | None = None  # the served model id every line resolved to
    errors: list[BatchError] = field(default_factory=list)


def read_input(content: bytes, endpoint: str, resolve_model: Callable[[str], str | None],
               max_lines: int, max_line_bytes: int = 0) -> BatchInput:
    """Check every line; `resolve_model(name)` gives the served model id of a name or alias (None:
    not served); a line may be at most `max_line_bytes` long (0: any), as the body of the same request
    sent alone. On success `errors` is empty and `lines` holds what each request needs to run."""
    result = BatchInput()
    rows = content.split(b"\n")
    if rows[-1].strip() == b"":
        rows.pop()  # the newline that ends the last line
    if not content.strip():
        result.errors.append(BatchError("empty_file", "The input file is empty: it must hold one request per line."))
        return result
    if len(rows) > max_lines:
        result.errors.append(BatchError("too_many_tasks", f"The input file has {len(rows)} requests; a batch may "
                                                          f"hold at most {max_lines}."))
        return result

    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(rows, start=1):
        if len(result.errors) >= MAX_ERRORS:
            break
        if max_line_bytes and len(raw) > max_line_bytes:
            result.errors.append(BatchError("line_too_large", f"This line is {len(raw)} bytes; a request may be "
                                                              f"at most {max_line_bytes}.", None, number))
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError):  # also bytes that are not UTF-8
            row = None
        if not isinstance(row, dict):
            result.errors.append(BatchError("invalid_json_line", "This line is not parseable as a JSON object.",
                                            None, number))
            continue
        error = _check_row(row, number, endpoint, first_line_of)
        model = None
        if error is None:
            model, error = _check_model(row["body"]["model"], number, resolve_model, result.model)
        if error is not None:
            result.errors.append(error)
            continue
        result.model = model
        first_line_of[row["custom_id"]] = number
        result.lines.append(json.dumps({"custom_id": row["custom_id"], "body": row["body"]},
                                       separators=(",", ":")))
    if result.errors:
        result.lines = []
    return result


def _check_row(row: dict, number: int, endpoint: str, first_line_of: dict[str, int]) -> BatchError | None:
    for name in ("custom_id", "method", "url", "body"):
        if name not in row:
            return BatchError("missing_required_parameter", f"Missing required parameter: '{name}'.", name, number)
    custom_id = row["custom_id"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return BatchError("invalid_value", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                                           "characters.", "custom_id", number)
    if custom_id in first_line_of:
        return BatchError("duplicate_custom_id", f"The custom_id {custom_id!r} is also used on line "
                                                 f"{first_line_of[custom_id]}; each request of a batch needs "
                                                 "its own custom_id.", "custom_id", number)
    if row["method"] != "POST":
        return BatchError("invalid_method", f"The method must be POST, not {_shown(row['method'])}.",
                          "method", number)
    if row["url"] != endpoint:
        return BatchError("url_mismatch", f"The url {_shown(row['url'])} does not match the batch's "
                                          f"endpoint {endpoint}.", "url", number)
    body = row["body"]
    if not isinstance(body, dict):
        return BatchError("invalid_value", "body must be a JSON object: the request as sent to "
                                           f"{endpoint}.", "body", number)
    if not isinstance(body.get("model"), str):
        return BatchError("missing_required_parameter", "Missing required parameter: 'body.model'.",
                          "body.model", number)
    return None


def _shown(value, limit: int = 100) -> str:
    """A value as JSON in an error, cut short: errors are stored and shown back."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _check_model(name: str, number: int, resolve_model: Callable[[str], str | None],
                 batch_model: str | None) -> tuple[str | None, BatchError | None]:
    model = resolve_model(name)
    if model is None:
        return None, BatchError("model_not_found", f"The model `{name[:100]}` does not exist or you do not have "
                                                   "access to it.", "body.model", number)
    if batch_model is not None and model != batch_model:
        return None, BatchError("model_mismatch", f"This line uses the model `{model}` while the lines before "
                                                  f"it use `{batch_model}`: a batch runs one model.",
                                "body.model", number)
    return model, None
