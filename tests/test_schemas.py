"""The OpenAI request schema of /v1/completions: names, defaults, nulls, ranges, the wording of each
rejection (a 400 naming its param), and the job a valid request becomes (pure: no model, no Redis).
The schema is the only place these ranges are checked: the worker runs the job it is given."""
from __future__ import annotations

import time

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


@pytest.mark.parametrize("fields,name", [({"frobnicate": 3}, "frobnicate"), ({"num_beams": 2}, "num_beams"),
                                         ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
                                         ({"stream": True, "stream_options": {"include_usage": True, "x": 1}},
                                          "stream_options.x")])
def test_unknown_fields_are_a_400_naming_them(fields, name):
    err = rejected(prompt="x", **fields)
    assert err.message == f"Unrecognized request argument supplied: {name}" and err.param == name


def test_unknown_fields_are_dropped_in_the_lenient_mode():
    req = parse_completion_request({"model": "m", "prompt": "x", "frobnicate": 3, "stream": True,
                                    "stream_options": {"include_usage": True, "x": 1}}, unknown_fields="ignore")
    assert req.include_usage and not hasattr(req, "frobnicate")
    assert parse(stream=True, stream_options={"include_usage": True, "include_obfuscation": True}).include_usage


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
    ("top_k", -2, "-2 is less than the minimum of -1 - 'top_k'"),  # -1: vLLM's "off"
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


@pytest.mark.parametrize("stop", [["a"] * 17, "", ["a", ""], [1], {"a": 1}])
def test_bad_stops(stop):
    assert rejected(stop=stop).param == "stop"


def test_more_than_four_stop_strings_up_to_the_cap():
    assert len(parse(stop=[str(i) for i in range(16)]).stop) == 16
    with pytest.raises(APIError) as info:
        parse_completion_request({"model": "m", "stop": ["a", "b", "c"]}, max_stop=2)
    assert info.value.param == "stop" and "at most 2" in info.value.message


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
    # every job field is set from the request (none left at the job's own default by omission),
    # but its timestamps, which the job takes when the gateway makes it
    assert set(protocol.CompletionJob.model_fields) - {"created", "received"} <= set(job.model_dump(exclude_unset=True))
    assert time.time() - 60 < job.received <= time.time() and int(job.received) in (job.created, job.created + 1)


# ---- vLLM's extras and transformers' options ----

def test_extras_defaults_are_vllms_and_nulls_mean_them():
    req = parse(prompt="x")
    assert (req.min_p, req.repetition_penalty, req.min_tokens, req.stop_token_ids, req.ignore_eos) == (0.0, 1.0, 0, [], False)
    assert (req.include_stop_str_in_output, req.skip_special_tokens, req.bad_words, req.allowed_token_ids) == (False, True, [], None)
    assert (req.prompt_logprobs, req.truncate_prompt_tokens, req.return_tokens_as_token_ids) == (None, None, False)
    assert (req.use_beam_search, req.length_penalty, req.early_stopping, req.no_repeat_ngram_size) == (False, 1.0, False, 0)
    nulls = parse(**{name: None for name in ("min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                                             "skip_special_tokens", "bad_words", "allowed_token_ids", "use_beam_search",
                                             "length_penalty", "early_stopping", "no_repeat_ngram_size")})
    assert (nulls.skip_special_tokens, nulls.stop_token_ids, nulls.repetition_penalty) == (True, [], 1.0)


@pytest.mark.parametrize("fields,param", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "3"}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"bad_words": ["ok", ""]}, "bad_words"), ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["w"] * 129}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"), ({"top_k": -2}, "top_k"),
    ({"length_penalty": float("inf")}, "length_penalty"), ({"length_penalty": 1e308}, "length_penalty"),
    ({"top_k": 2 ** 70}, "top_k"), ({"min_tokens": 2 ** 70}, "min_tokens"),
    ({"no_repeat_ngram_size": 2 ** 70}, "no_repeat_ngram_size"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"), ({"penalty_alpha": 2, "top_k": 4}, "penalty_alpha"),
    ({"penalty_alpha": -0.1, "top_k": 4}, "penalty_alpha"), ({"penalty_alpha": "0.5", "top_k": 4}, "penalty_alpha"),
    ({"penalty_alpha": 0.6}, "top_k"), ({"penalty_alpha": 0.6, "top_k": 1}, "top_k"), ({"penalty_alpha": 0, "top_k": -1}, "top_k"),
    ({"penalty_alpha": 0.6, "top_k": 4, "use_beam_search": True}, "penalty_alpha"),
    ({"penalty_alpha": 0.6, "top_k": 4, "n": 2}, "n"), ({"penalty_alpha": 0.6, "top_k": 4, "best_of": 3}, "best_of"),
    ({"penalty_alpha": 0.6, "top_k": 4, "top_p": 0.9}, "top_p"), ({"penalty_alpha": 0.6, "top_k": 4, "min_p": 0.1}, "min_p"),
    ({"include_stop_str_in_output": None, "skip_special_tokens": 0}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
    ({"use_beam_search": True, "stream": True}, "stream"), ({"use_beam_search": True, "top_p": 0.9}, "top_p"),
    ({"use_beam_search": True, "top_k": 5}, "top_k"), ({"use_beam_search": True, "min_p": 0.1}, "min_p"),
    ({"use_beam_search": "true"}, "use_beam_search"),
])
def test_bad_extras_are_a_400_naming_their_param(fields, param):
    assert rejected(prompt="x", **fields).param == param


def test_continuous_usage_implies_the_usage_chunk_unless_refused():
    on = parse(stream=True, stream_options={"continuous_usage_stats": True})
    assert on.include_usage and on.continuous_usage
    refused = parse(stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert not refused.include_usage and not refused.continuous_usage
    assert not parse(stream=True, stream_options={"include_usage": True}).continuous_usage


def test_extras_go_into_the_job():
    spec = ModelSpec(id="m", checkpoint="unused")
    req = parse(prompt="x", top_k=-1, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7],
                ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, allowed_token_ids=[1, 2],
                prompt_logprobs=2, return_tokens_as_token_ids=True, no_repeat_ngram_size=3, use_beam_search=True,
                n=2, best_of=3, length_penalty=0.5, early_stopping="never", temperature=0)
    job = req.to_job(spec, [[1, 2]], seed=5, bad_words=[[9], [4, 5]])
    assert job.top_k == 0 and job.bad_words == [[9], [4, 5]]
    assert (job.repetition_penalty, job.min_tokens, job.stop_token_ids, job.ignore_eos) == (1.2, 2, [7], True)
    assert parse(prompt="x", min_p=0.05).to_job(spec, [[1]], seed=0).min_p == 0.05
    assert (job.include_stop_str_in_output, job.skip_special_tokens, job.allowed_token_ids) == (True, False, [1, 2])
    assert (job.prompt_logprobs, job.return_tokens_as_token_ids, job.no_repeat_ngram_size) == (2, True, 3)
    assert (job.use_beam_search, job.best_of, job.n, job.length_penalty, job.early_stopping) == (True, 3, 2, 0.5, "never")
    assert protocol.CompletionJob.from_payload(job.to_payload()) == job


def test_contrastive_search_goes_into_the_job_deterministic():
    """penalty_alpha with top_k candidates; temperature has no part in it, and penalty_alpha 0 is greedy
    search (as in transformers), so the job is greedy in both cases."""
    spec = ModelSpec(id="m", checkpoint="unused")
    job = parse(prompt="x", penalty_alpha=0.6, top_k=4, temperature=0.8, stream=True).to_job(spec, [[1]], seed=0)
    assert (job.penalty_alpha, job.top_k, job.temperature, job.stream) == (0.6, 4, 0.0, True)
    greedy = parse(prompt="x", penalty_alpha=0, top_k=4).to_job(spec, [[1]], seed=0)
    assert (greedy.penalty_alpha, greedy.temperature) == (0.0, 0.0)
    sampled = parse(prompt="x", temperature=0.8).to_job(spec, [[1]], seed=0)
    assert (sampled.penalty_alpha, sampled.temperature) == (0.0, 0.8)
    assert parse(prompt="x", penalty_alpha=None).penalty_alpha is None
