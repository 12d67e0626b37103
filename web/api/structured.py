"""Structured output's request fields, in vLLM's spellings, as one llguidance grammar for the worker
(worker/grammar.py), or a 400 naming the field:

- `structured_outputs`: {"json": schema, "regex": str, "choice": [str], "grammar": str (Lark or
  GBNF), "json_object": true}, exactly one of them;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"schema": ...}} ({"type": "text"}: no constraint).

JSON is generated compact and on one line (", " and ": " between items, no other whitespace): a
small model given a choice of whitespace may spend every token on it. llguidance is imported on the
first request that asks for a grammar, not when web starts.
"""
from __future__ import annotations

import json
from typing import Any

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex, choice list or grammar as sent
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def requested(structured_outputs: Any, response_format: Any, guided: dict[str, Any]) -> tuple[str, str, Any] | None:
    """The one constraint a request asks for, as (param, form, value), or None."""
    asked = []
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise StructuredError("structured_outputs must be an object with one of: " + ", ".join(FORMS) + ".",
                                  "structured_outputs")
        unknown = [k for k in structured_outputs if k not in FORMS]
        if unknown:
            raise StructuredError(f"Unrecognized field of structured_outputs: {unknown[0][:100]!r} (known: "
                                  + ", ".join(FORMS) + ").", "structured_outputs")
        given = [(k, v) for k, v in structured_outputs.items() if v is not None and v is not False]
        if len(given) != 1:
            raise StructuredError("structured_outputs must set exactly one of: " + ", ".join(FORMS) + ".",
                                  "structured_outputs")
        asked.append(("structured_outputs", *given[0]))
    asked += [(param, GUIDED[param], value) for param, value in guided.items() if value is not None]
    if response_format is not None:
        form = _response_format(response_format)
        if form is not None:
            asked.append(("response_format", *form))
    if len(asked) > 1:
        raise StructuredError(f"Only one structured output constraint may be given; got {asked[0][0]} and "
                              f"{asked[1][0]}.", asked[1][0])
    return asked[0] if asked else None


def _response_format(value: Any) -> tuple[str, Any] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise StructuredError("response_format.json_schema must be an object whose `schema` is a JSON schema.",
                                  "response_format")
        return "json", spec.get("schema", {})
    raise StructuredError("response_format.type must be one of 'text', 'json_object' or 'json_schema'.",
                          "response_format")


def compile_grammar(param: str, form: str, value: Any) -> str:
    """The llguidance grammar of one constraint; a 400 naming `param` if it is malformed or too large."""
    from llguidance import LLMatcher

    if form == "json_object":
        form, value = "json", {"type": "object"}
    if form == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise StructuredError(f"{param}: the JSON schema is not valid JSON ({exc}).", param) from None
        if not isinstance(value, (dict, bool)):
            raise StructuredError(f"{param}: a JSON schema must be an object.", param)
        _check_size(json.dumps(value), param)
        grammar = LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    elif form == "regex":
        _check_text(value, param, "a regular expression")
        grammar = LLMatcher.grammar_from_regex(value)
    elif form == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredError(f"{param}: choices must be a non-empty list of non-empty strings.", param)
        if len(value) > MAX_CHOICES:
            raise StructuredError(f"{param}: at most {MAX_CHOICES} choices.", param)
        _check_size(json.dumps(value), param)
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:  # grammar: Lark, as llguidance reads it, or GBNF (llama.cpp's), told apart by its `::=`
        _check_text(value, param, "a grammar")
        lark = value
        if "::=" in value:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(value)
            except Exception as exc:  # the converter's own parse errors: the caller's grammar is malformed
                raise StructuredError(f"{param}: the GBNF grammar is not valid ({str(exc)[:300]}).", param) from None
        grammar = LLMatcher.grammar_from_lark(lark)
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise StructuredError(f"{param}: {problem.strip()[:500]}", param)
    return grammar


def _check_text(value: Any, param: str, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise StructuredError(f"{param} must be {what}, a non-empty string.", param)
    _check_size(value, param)


def _check_size(text: str, param: str) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise StructuredError(f"{param} is larger than {MAX_GRAMMAR_BYTES} bytes.", param)
