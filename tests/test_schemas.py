"""The OpenAI request schema of /v1/completions: names, defaults, nulls, ranges, the wording of each
rejection (a 400 naming its param), and the job a valid request becomes (pure: no model, no Redis).
The schema is the only place these ranges are checked: the worker runs the job it is given."""
from __future__ import annotations

import pytest

from models.registry import ModelSpec
from web.api.schemas import INT64_MAX, parse_completion_request
from worker import protocol
from worker.protocol import APIError


def parse(**fields):
    return parse_completion_request({"model": "m", **fields})


def rejected(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert (info.value.status, info.value.type) == (400, "invalid_request_error")
    return info.value


def test_defaults_are_openais():
    req = parse(prompt="hi")
    assert (req.max_tokens, req.n, req.best_of, req.temperature, req.top_p, req.top_k) == (16, 1, None, 1.0, 1.0, 0)
    assert (req.presence_penalty, req.frequency_penalty, req.logprobs, req.echo) == (0.0, 0.0, None, False)
    assert (req.stop, req.logit_bias, req.seed, req.stream, req.include_usage) == ([], {}, None, False, False)


def test_null_means_default_everywhere_openai_allows_it():
    nulls = {name: None for name in ("prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                                     "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                                     "suffix", "temperature", "top_p", "top_k", "user")}
    req = parse(**nulls)
    assert req.prompt is None  # the end-of-text token, resolved with the model's tokenizer
    assert (req.n, req.temperature, req.top_p, req.stop, req.logit_bias, req.stream) == (1, 1.0, 1.0, [], {}, False)
    assert parse(max_tokens=None).max_tokens is None  # null max_tokens: up to the end of the context


def test_unknown_fields_are_ignored():
    req = parse(prompt="x", frobnicate=3, stream=True, stream_options={"include_usage": True, "include_obfuscation": 1})
    assert req.include_usage and not hasattr(req, "frobnicate")


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]], ""])
def test_prompt_forms(prompt):
    assert parse(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [[1], "a"], [-1], [1.5], [True], {"a": 1}, 5])
def test_malformed_prompts(prompt):
    assert rejected(prompt=prompt).param == "prompt"


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "0 is less than the minimum of 1 - 'n'"),
    ("n", 129, "129 is greater than the maximum of 128 - 'n'"),
    ("logprobs", 6, "6 is greater than the maximum of 5 - 'logprobs'"),
    ("logprobs", -1, "-1 is less than the minimum of 0 - 'logprobs'"),
    ("temperature", 2.5, "2.5 is greater than the maximum of 2"),
    ("temperature", -0.1, "-0.1 is less than the minimum of 0"),
    ("top_p", 1.01, "1.01 is greater than the maximum of 1"),
    ("top_p", -0.5, "-0.5 is less than the minimum of 0"),
    ("presence_penalty", 2.01, "2.01 is greater than the maximum of 2"),
    ("frequency_penalty", -3, "-3 is less than the minimum of -2"),
    ("max_tokens", -1, "-1 is less than the minimum of 0 - 'max_tokens'"),
    ("best_of", 21, "21 is greater than the maximum of 20 - 'best_of'"),
    ("top_k", -1, "-1 is less than the minimum of 0 - 'top_k'"),
    ("seed", INT64_MAX + 1, "is greater than the maximum of"),
    ("n", "2", "\"2\" is not of type 'integer' - 'n'"),
    ("n", 2.0, "2.0 is not of type 'integer' - 'n'"),
    ("echo", 1, "1 is not of type 'boolean' - 'echo'"),
    ("temperature", "hot", "\"hot\" is not of type 'number' - 'temperature'"),
    ("user", 5, "5 is not of type 'string' - 'user'"),
])
def test_out_of_range_values_name_their_param(field, value, message):
    err = rejected(prompt="x", **{field: value})
    assert err.param == field
    assert message in err.message


def test_boundaries_are_accepted():
    req = parse(n=20, logprobs=5, temperature=2, top_p=0, presence_penalty=-2, frequency_penalty=2,
                max_tokens=0, best_of=20, seed=-(2**63), logit_bias={"0": -100, "50256": 100})
    assert (req.n, req.logprobs, req.top_p, req.best_of, req.max_tokens) == (20, 5, 0.0, 20, 0)
    assert req.logit_bias == {0: -100.0, 50256: 100.0}
    assert parse(n=128, logprobs=0, seed=INT64_MAX).n == 128


def test_missing_model():
    with pytest.raises(APIError) as info:
        parse_completion_request({"prompt": "x"})
    assert (info.value.status, info.value.param) == (400, "model") and "must provide a model" in info.value.message


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="JSON object") as info:
        parse_completion_request(["model", "m"])
    assert (info.value.status, info.value.param) == (400, None)


@pytest.mark.parametrize("stop", ["\n", ["a", "b", "c", "d"], [], None])
def test_stop_forms(stop):
    expected = [stop] if isinstance(stop, str) else (stop or [])
    assert parse(stop=stop).stop == expected


@pytest.mark.parametrize("stop", [["a"] * 5, "", ["a", ""], [1], {"a": 1}])
def test_bad_stops(stop):
    assert rejected(stop=stop).param == "stop"


@pytest.mark.parametrize("bias", [{"x": 1}, {"1": 101}, {"1": -100.5}, {"1": "a"}, {"1": True}, [1, 2], "1"])
def test_bad_logit_bias(bias):
    assert rejected(logit_bias=bias).param == "logit_bias"


def test_best_of_rules():
    assert rejected(n=3, best_of=2).param == "best_of"
    assert rejected(n=1, best_of=2, stream=True).param == "best_of"
    # best_of == n changes nothing and may be streamed (LangChain sends best_of=1 by default)
    assert parse(n=2, best_of=2, stream=True).best_of == 2


def test_suffix_is_unsupported():
    assert rejected(suffix="tail").param == "suffix"
    assert parse(suffix="").suffix == ""  # an empty suffix changes nothing


def test_stream_options_need_stream():
    assert rejected(stream_options={"include_usage": True}).param == "stream_options"
    assert rejected(stream=False, stream_options={}).param == "stream_options"
    assert parse(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert rejected(stream=True, stream_options={"include_usage": "yes"}).param == "stream_options"


def test_non_finite_numbers_are_rejected():
    assert rejected(temperature=float("nan")).param == "temperature"
    assert rejected(top_p=float("inf")).param == "top_p"


def test_top_p_zero_is_accepted_as_at_openai():
    assert parse(top_p=0).top_p == 0.0  # the worker reads it as "the most likely token only"


def test_a_valid_request_becomes_its_job():
    spec = ModelSpec(id="tiny", checkpoint="unused")
    req = parse(model="tiny-alias", prompt=["a", "b"], max_tokens=None, temperature=0.5, top_p=0, top_k=7,
                presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"3": -100}, n=2, best_of=3,
                stop="\n", logprobs=2, echo=True, user="u1")
    job = req.to_job(spec, [[1, 2], [3]], seed=42)
    assert job.id.startswith("cmpl-") and job.model == "tiny" and job.prompts == [[1, 2], [3]] and job.seed == 42
    assert (job.max_tokens, job.temperature, job.top_p, job.top_k) == (None, 0.5, 0.0, 7)
    assert (job.presence_penalty, job.frequency_penalty, job.logit_bias) == (0.5, -0.5, {3: -100.0})
    assert (job.n, job.best_of, job.stop, job.logprobs, job.echo, job.user) == (2, 3, ["\n"], 2, True, "u1")
    assert (job.stream, job.include_usage) == (False, False)
    streamed = parse(prompt="x", stream=True, stream_options={"include_usage": True}).to_job(spec, [[1]], seed=1)
    assert (streamed.stream, streamed.include_usage, streamed.max_tokens, streamed.n) == (True, True, 16, 1)
    # every job field is set from the request (none left at the job's own default by omission)
    assert set(protocol.CompletionJob.model_fields) - {"created"} <= set(job.model_dump(exclude_unset=True))
