"""End to end: the official `openai` client against gunicorn (threaded workers) and a real
`processor.py`, over a private redis-server, serving a tiny random-weight GPT-2 checkpoint with the
real GPT-2 vocabulary.

The registry also names a second model, `parked`, that no processor serves: it answers 503, and
with a registered but idle worker it fills its queue for the 429.
"""
from __future__ import annotations

import json
import signal
import time

import openai
import pytest
import redis
import requests

from models.tokenizer import load_tokenizer
from tests import rq_json
from tests.stack import compiling, start_gunicorn, start_processor, write_models_toml
from web.dev.local_redis import start_redis
from worker import protocol

pytestmark = pytest.mark.slow  # the whole stack as processes, its worker compiling the decode step

PROMPT = "Hello, my name is"
CONTEXT = 128  # the hf_checkpoint fixture's n_positions
MAX_BODY = 65536
QUEUE_DEPTH = 6


@pytest.fixture(scope="module")
def stack(hf_checkpoint, tmp_path_factory):
    """redis-server + processor.py (model `tiny`, 4 jobs at once, its decode step compiled or not
    as the worker decides by default) + gunicorn."""
    tmp = tmp_path_factory.mktemp("e2e-openai")
    models = tmp / "models.toml"
    write_models_toml(models, {"tiny": hf_checkpoint}, device="cpu", max_batch=8)
    with open(models, "a") as f:
        f.write(f'\n[models.parked]\ncheckpoint = "{hf_checkpoint}"\n')
    server = start_redis()
    env = {"NANOSERVE_MAX_BODY_BYTES": str(MAX_BODY), "NANOSERVE_MAX_QUEUE_DEPTH": str(QUEUE_DEPTH),
           "NANOSERVE_KEEPALIVE": "1", "NANOSERVE_AUTH": "disabled"}
    try:
        with start_processor(server.url, models, models=["tiny"], concurrency=4, compile=None, log_dir=tmp,
                             timeout=300.0) as worker, \
                start_gunicorn(server.url, models, env=env, workers=2, threads=8, log_dir=tmp) as web:
            yield {"url": web.url, "redis_url": server.url, "worker": worker, "web": web}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(hf_checkpoint):
    return load_tokenizer(hf_checkpoint)


def test_the_worker_compiles_its_float32_cpu_decode_step_by_default(stack):
    """Where it was measured to pay (nanogpt.runtime.compile.compiles_by_default), the worker every other
    test here talks to runs the compiled decode step unless told otherwise, compiled in the background
    while it serves (the module's last test sees it end)."""
    from nanogpt.runtime.compile import compiles_by_default

    ready = next(line for line in stack["worker"].logs().splitlines() if "engine ready" in line)
    assert compiles_by_default("cpu", "float32")  # this machine has the C++ compiler inductor needs
    assert '"compiled": true' in ready and '"warming_up": true' in ready, ready
    assert '"cuda_graphs": 0' in ready, ready  # CUDA graphs: a GPU's only


def test_the_worker_freezes_what_loading_built(stack):
    """The loaded engine's objects are out of the collector's full passes (processor.freeze_heap):
    a collection would otherwise walk them all, every thread of the worker stopped."""
    logs = stack["worker"].logs().splitlines()
    ready = next(i for i, line in enumerate(logs) if "engine ready" in line)
    frozen = next(line for line in logs[ready:] if "loaded objects frozen" in line)
    assert int(json.loads(frozen)["objects"]) > 10_000, frozen


def greedy(client, prompt=PROMPT, **kw):
    return client.completions.create(model="tiny", prompt=prompt, temperature=0, **kw)


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Texts and finish reasons by choice index, and every chunk."""
    texts, finish, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            assert len(chunk.choices) == 1  # one choice per chunk
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finish  # one finish per choice
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def wait_for_status(base: str, job_id: str, statuses: tuple[str, ...], timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = requests.get(f"{base}/v1/jobs/{job_id}", timeout=10).json()
        if state["status"] in statuses:
            return state
        assert time.monotonic() < deadline, (state["status"], state)
        time.sleep(0.05)


# ---- models ----

def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "parked"]
    assert all(m.object == "model" and m.owned_by == "nanoserve" and m.created > 0 for m in models.data)
    tiny = client.models.retrieve("tiny")
    assert tiny.id == "tiny" and tiny.context_length == CONTEXT
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/missing")
    assert info.value.code == "model_not_found" and info.value.request_id


# ---- completions ----

def test_greedy_completion_matches_transformers(client, hf_checkpoint, tokenizer):
    import torch
    from transformers import GPT2LMHeadModel

    result = greedy(client, max_tokens=8)
    ids = tokenizer.encode(PROMPT)
    model = GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=50256)
    expected = out[0, len(ids):].tolist()
    assert result.id.startswith("cmpl-") and result.object == "text_completion" and result.model == "tiny"
    (choice,) = result.choices
    if tokenizer.eos_token_id in expected:  # EOS ends the completion early
        expected = expected[:expected.index(tokenizer.eos_token_id)]
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == ("length" if len(expected) == 8 else "stop")
    assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == len(expected)
    assert result.usage.total_tokens == len(ids) + len(expected)


def test_stream_equals_non_stream_at_temperature_0(client):
    kwargs = dict(max_tokens=12, logprobs=2, n=2, prompt=[PROMPT, "The sky"])
    whole = greedy(client, **kwargs)
    texts, finish, chunks = collect_stream(greedy(client, stream=True, **kwargs))
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    # logprobs streamed piecewise concatenate to the non-streamed ones
    for choice in whole.choices:
        streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].index == choice.index]
        assert sum((lp.tokens for lp in streamed), []) == choice.logprobs.tokens
        assert sum((lp.text_offset for lp in streamed), []) == choice.logprobs.text_offset
        assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(choice.logprobs.token_logprobs)
    assert all(c.usage is None for c in chunks) and all(c.id == chunks[0].id for c in chunks)


def test_stream_with_usage(client):
    whole = greedy(client, max_tokens=6)
    texts, finish, chunks = collect_stream(
        greedy(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == whole.choices[0].text and finish[0] == whole.choices[0].finish_reason
    *body, last = chunks
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason is not None
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()


def test_list_and_token_prompts_agree(client, tokenizer):
    prompts = [PROMPT, "Once upon a time", "x"]
    by_text = greedy(client, prompt=prompts, max_tokens=5)
    by_ids = greedy(client, prompt=[tokenizer.encode(p) for p in prompts], max_tokens=5)
    one_id_list = greedy(client, prompt=tokenizer.encode(prompts[1]), max_tokens=5)
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert one_id_list.choices[0].text == by_text.choices[1].text
    assert by_text.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_n_times_prompts_indexing(client):
    prompts = ["A", "B", "C"]
    singles = [greedy(client, prompt=p, max_tokens=4).choices[0].text for p in prompts]
    result = greedy(client, prompt=prompts, n=2, max_tokens=4)
    assert [c.index for c in result.choices] == list(range(6))
    assert [c.text for c in result.choices] == [s for s in singles for _ in range(2)]  # prompt_index * n + j
    texts, finish, _ = collect_stream(greedy(client, prompt=prompts, n=2, max_tokens=4, stream=True))
    assert texts == {i: singles[i // 2] for i in range(6)} and set(finish) == set(range(6))


def test_every_sampling_parameter(client, tokenizer):
    base = greedy(client, max_tokens=8).choices[0]

    # seed: the same seed gives the same sample; top_k=1 and a tiny top_p are greedy
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=7, temperature=1.0,
                                         user="alice").choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1}).choices[0].text == base.text
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                     top_p=0.001).choices[0].text == base.text

    # logit_bias +100 forces a token; -100 bans it
    forced = greedy(client, max_tokens=4, logit_bias={"1000": 100}).choices[0]
    assert forced.text == tokenizer.decode([1000] * 4)
    first = tokenizer.encode(base.text)[0]
    assert tokenizer.encode(greedy(client, max_tokens=1, logit_bias={str(first): -100}).choices[0].text)[0] != first

    # the frequency penalty grows with each repeat, so it ends a greedy completion's repetition
    # (the presence penalty's arithmetic is the engine's tests' business; here it must be accepted)
    if len(set(tokenizer.encode(base.text))) < len(tokenizer.encode(base.text)):
        assert greedy(client, max_tokens=8, frequency_penalty=2.0).choices[0].text != base.text
    assert greedy(client, max_tokens=8, presence_penalty=-2.0).choices[0].finish_reason == "length"

    # stop: cut before the stop string, finish_reason "stop"
    stop = base.text[len(base.text) // 2:][:3]
    stopped = greedy(client, max_tokens=8, stop=[stop, "\u2603"]).choices[0]
    assert stopped.text == base.text[:base.text.index(stop)] and stopped.finish_reason == "stop"

    # echo + logprobs: the prompt leads, its first token has no logprob
    echoed = greedy(client, max_tokens=3, echo=True, logprobs=3).choices[0]
    assert echoed.text.startswith(PROMPT)
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    assert all(3 <= len(top) <= 4 for top in echoed.logprobs.top_logprobs[1:])
    assert echoed.logprobs.text_offset[0] == 0 and echoed.logprobs.tokens[0] == tokenizer.decode(tokenizer.encode(PROMPT)[:1])
    scored = greedy(client, max_tokens=0, echo=True, logprobs=0).choices[0]  # scoring a prompt
    assert scored.text == PROMPT and len(scored.logprobs.tokens) == len(tokenizer.encode(PROMPT))

    # best_of: n best of more candidates; max_tokens null runs to the end of the context
    assert len(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, best_of=3, seed=1).choices) == 2
    long = greedy(client, prompt=[1] * 100, max_tokens=None, logit_bias={"50256": -100})
    assert long.usage.completion_tokens == CONTEXT - 100 and long.choices[0].finish_reason == "length"


def test_null_parameters_are_defaults(client):
    nulls = dict(best_of=None, echo=None, frequency_penalty=None, logit_bias=None, logprobs=None, n=None,
                 presence_penalty=None, seed=None, stop=None, stream=None, suffix=None, top_p=None, user=None)
    result = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=5, **nulls)
    assert result.choices[0].text == greedy(client, max_tokens=5).choices[0].text
    default_prompt = client.completions.create(model="tiny", prompt=None, max_tokens=2, temperature=0)
    assert default_prompt.usage.prompt_tokens == 1  # <|endoftext|>


# ---- jobs ----

def test_job_submit_poll_result(stack, client):
    base = stack["url"]
    submitted = requests.post(f"{base}/v1/jobs", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0}, timeout=10)
    assert submitted.status_code == 202
    job = submitted.json()
    assert job["status"] == "queued" and job["id"].startswith("cmpl-")
    state = wait_for_status(base, job["id"], ("completed",))
    assert state["result"]["choices"][0]["text"] == greedy(client, max_tokens=6).choices[0].text
    assert requests.get(f"{base}/jobs/{job['id']}", timeout=10).json()["status"] == "completed"
    missing = requests.get(f"{base}/v1/jobs/cmpl-missing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_job_cancel(stack):
    base = stack["url"]
    r = redis.Redis.from_url(stack["redis_url"])
    job_id = requests.post(f"{base}/v1/jobs", json={"model": "tiny", "prompt": "x", "max_tokens": None,
                                                    "logit_bias": {"50256": -100}}, timeout=10).json()["id"]
    # the job is running once its first token is written: the worker is paused there (a 127-token
    # job on this model takes about a tenth of a second), cancelled, and let go
    assert r.xread({protocol.stream_key(job_id): "0-0"}, block=30_000)
    stack["worker"].signal(signal.SIGSTOP)
    try:
        assert wait_for_status(base, job_id, ("in_progress", "completed"))["status"] == "in_progress"
        assert requests.delete(f"{base}/v1/jobs/{job_id}", timeout=10).json()["status"] == "cancelled"
    finally:
        stack["worker"].signal(signal.SIGCONT)
    wait_for_status(base, job_id, ("cancelled",))
    events = redis.Redis.from_url(stack["redis_url"]).xrange(protocol.stream_key(job_id))
    types = [protocol.decode_event(fields)[0] for _, fields in events]
    assert types[-1] == "cancelled" and types.count("delta") < CONTEXT - 1  # dropped early by the engine


def test_stream_disconnect_cancels(stack, client):
    stream = client.completions.create(model="tiny", prompt="x", max_tokens=None, stream=True,
                                       logit_bias={"50256": -100})
    first = next(iter(stream))
    stream.close()
    state = wait_for_status(stack["url"], first.id, ("cancelled", "completed"))
    assert state["status"] == "cancelled"
    deltas = [e for e in redis.Redis.from_url(stack["redis_url"]).xrange(protocol.stream_key(first.id))
              if protocol.decode_event(e[1])[0] == "delta"]
    assert len(deltas) < CONTEXT - 1  # stopped well before the end of the context


def test_job_stream_resumes(stack):
    base = stack["url"]
    job_id = requests.post(f"{base}/v1/jobs", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4},
                           timeout=10).json()["id"]
    wait_for_status(base, job_id, ("completed",))
    frames = requests.get(f"{base}/v1/jobs/{job_id}/stream", timeout=10).text.strip().split("\n\n")
    ids = [f.split("\n")[0][4:] for f in frames if f.startswith("id: ")]
    resumed = requests.get(f"{base}/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": ids[1]}, timeout=10)
    assert resumed.text.strip().split("\n\n") == frames[2:] and frames[-1] == "data: [DONE]"


# ---- errors ----

@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": 6}, "logprobs"), ({"n": 0}, "n"), ({"n": 129}, "n"), ({"temperature": 2.1}, "temperature"),
    ({"top_p": 1.2}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"stop": ["s"] * 17}, "stop"),
    ({"logit_bias": {"50257": 1}}, "logit_bias"), ({"logit_bias": {"1": 150}}, "logit_bias"),
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": [50257]}, "prompt"),
    ({"prompt": ""}, "prompt"), ({"max_tokens": CONTEXT}, "max_tokens"), ({"extra_body": {"top_k": -2}}, "top_k"),
    # vLLM's extras and transformers' options
    ({"extra_body": {"min_p": 2}}, "min_p"), ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 20}, "max_tokens": 5}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [50257]}}, "stop_token_ids"),
    ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"allowed_token_ids": [99999]}}, "allowed_token_ids"),
    ({"extra_body": {"bad_words": [""]}}, "bad_words"), ({"extra_body": {"ignore_eos": "no"}}, "ignore_eos"),
    ({"extra_body": {"include_stop_str_in_output": 1}}, "include_stop_str_in_output"),
    ({"extra_body": {"skip_special_tokens": "yes"}}, "skip_special_tokens"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
    ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ({"extra_body": {"truncate_prompt_tokens": CONTEXT + 1}}, "truncate_prompt_tokens"),
    ({"extra_body": {"return_tokens_as_token_ids": "y"}}, "return_tokens_as_token_ids"),
    ({"extra_body": {"use_beam_search": True, "top_p": 0.5}}, "top_p"),
    ({"extra_body": {"use_beam_search": True}, "stream": True}, "stream"),
    ({"extra_body": {"use_beam_search": True, "n": 9}}, "n"),  # wider than the worker's 8 slots
    ({"extra_body": {"length_penalty": "long"}}, "length_penalty"),
    ({"extra_body": {"early_stopping": "soon"}}, "early_stopping"),
    ({"extra_body": {"no_repeat_ngram_size": -1}}, "no_repeat_ngram_size"),
    ({"extra_body": {"penalty_alpha": 0.6, "top_k": 1}}, "top_k"),
    ({"extra_body": {"penalty_alpha": 0.6, "top_k": 9}}, "top_k"),  # more candidates than the worker's 8 slots
    ({"extra_body": {"penalty_alpha": 0.6, "top_k": 4}, "n": 2}, "n"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "nonsense"}}}}, "structured_outputs"),
    ({"extra_body": {"guided_regex": "[^\\s\\S]"}}, "structured_outputs"),  # no text matches: the worker refuses it
])
def test_bad_request_errors_name_the_param(client, kwargs, param):
    kwargs = {"model": "tiny", "prompt": PROMPT, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert info.value.param == param and info.value.type == "invalid_request_error"


def test_structured_output_through_the_client(client):
    """vLLM's structured_outputs and OpenAI's response_format through `extra_body`, synchronous and
    streamed: every choice follows its constraint and ends with `stop`."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rainy"],
              "properties": {"city": {"type": "string", "maxLength": 10}, "rainy": {"type": "boolean"}}}
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, n=2, seed=1, logprobs=1,
                                       extra_body={"structured_outputs": {"json": schema}})
    for choice in answer.choices:
        value = json.loads(choice.text)
        assert set(value) == {"city", "rainy"} and isinstance(value["rainy"], bool) and len(value["city"]) <= 10
        assert choice.finish_reason == "stop" and "".join(choice.logprobs.tokens) == choice.text
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}})
    assert set(json.loads(answer.choices[0].text)) == {"city", "rainy"}
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, stream=True, seed=2,
                                            extra_body={"guided_choice": ["sunny", "partly cloudy", "rain"]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("sunny", "partly cloudy", "rain")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_repeated_prefix_comes_from_the_prefix_cache(client, tokenizer):
    context = PROMPT + " Ishmael, and I have lived by the sea all my life, where the whales"
    first = client.completions.create(model="tiny", prompt=context + " sing", max_tokens=3, temperature=0)
    second = client.completions.create(model="tiny", prompt=context + " swim", max_tokens=3, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in second if chunk.usage][0]
    assert first.usage.prompt_tokens_details.cached_tokens < len(tokenizer.encode(context)) - 1
    assert usage.prompt_tokens_details.cached_tokens >= len(tokenizer.encode(context)) - 1


def test_context_length_error_in_openais_words(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[1] * 120, max_tokens=10)
    assert info.value.body["message"].startswith("This model's maximum context length is 128 tokens, however you "
                                                 "requested 130 tokens (120 in your prompt; 10 for the completion).")


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt=PROMPT)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_no_worker_is_503(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="parked", prompt=PROMPT)
    assert info.value.status_code == 503 and info.value.code == "no_worker"
    assert info.value.response.headers["Retry-After"] == "1"


def test_full_queue_is_rate_limited(stack, client):
    r = redis.Redis.from_url(stack["redis_url"])
    idle = rq_json.worker([protocol.queue_name("parked")], r, name="idle-parked")
    idle.register_birth()  # a live worker that never takes a job: the queue only fills
    try:
        for _ in range(QUEUE_DEPTH):
            assert requests.post(f"{stack['url']}/v1/jobs", json={"model": "parked", "prompt": "x"},
                                 timeout=10).status_code == 202
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="parked", prompt=PROMPT)
        assert info.value.code == "queue_full" and info.value.response.headers["Retry-After"] == "1"
    finally:
        idle.register_death()
        rq_json.queue(protocol.queue_name("parked"), r).empty()


def test_body_too_large_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="x" * (MAX_BODY + 1000))
    assert info.value.status_code == 413 and info.value.type == "invalid_request_error"


def test_malformed_json_is_400(stack):
    response = requests.post(f"{stack['url']}/v1/completions", data='{"model": "tiny", "prompt":',
                             headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "could not parse the JSON body" in response.json()["error"]["message"]
    assert response.headers["x-request-id"]


def test_health_and_ready(stack):
    assert requests.get(f"{stack['url']}/health", timeout=10).json() == {"status": "ok"}
    ready = requests.get(f"{stack['url']}/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["models"]["tiny"]["workers"] == 1  # `parked` has none
    assert ready.json()["models"]["parked"]["workers"] == 0


# ---- beyond OpenAI's parameters (vLLM's extras through extra_body) ----

@pytest.mark.parametrize("extra", [{"frobnicate": 1}, {"num_beams": 2}, {"prompt_embeds": "AAAA"}])
def test_unknown_fields_are_a_400_naming_them(client, extra):
    with pytest.raises(openai.BadRequestError) as info:
        greedy(client, max_tokens=2, extra_body=extra)
    (name,) = extra
    assert info.value.param == name and info.value.type == "invalid_request_error"
    assert info.value.body["message"] == f"Unrecognized request argument supplied: {name}"


def test_beam_search_returns_transformers_hypotheses_prompt_major(client, hf_checkpoint, tokenizer):
    """vLLM's test_batch_completions with beam search: n=2 beams of two prompts, distinct, in order,
    and equal to transformers' beam search."""
    import torch
    from transformers import GPT2LMHeadModel

    prompts = [PROMPT, "The sky"]
    result = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2,
                                       extra_body={"use_beam_search": True, "length_penalty": 0.5})
    texts = [c.text for c in result.choices]
    assert texts[0] != texts[1] and texts[2] != texts[3]
    model = GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()
    for p, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=5, num_beams=2, num_return_sequences=2, length_penalty=0.5,
                             do_sample=False, pad_token_id=50256)
        assert texts[2 * p:2 * p + 2] == [tokenizer.decode(row[len(ids):]) for row in out.tolist()]
    assert result.usage.completion_tokens == 4 * 5


def test_contrastive_search_through_extra_body_is_the_papers_formula(client, hf_checkpoint, tokenizer):
    """penalty_alpha with top_k (transformers' GPT-API extension) through the openai client: the
    tokens of a direct implementation of the formula over transformers, streamed and not."""
    from transformers import GPT2LMHeadModel

    from test_contrastive import reference

    extra = {"penalty_alpha": 0.6, "top_k": 4}
    prompts = [PROMPT, "The sky"]
    result = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, logprobs=1, extra_body=extra)
    model = GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()
    want = [reference(model, tokenizer.encode(p), 0.6, 4, 8, tokenizer.vocab_size)[0] for p in prompts]
    assert [c.text for c in result.choices] == [tokenizer.decode(w) for w in want]
    assert [c.logprobs.tokens for c in result.choices] == [[tokenizer.token_string(t) for t in w] for w in want]
    assert tokenizer.decode(want[0]) != greedy(client, max_tokens=8).choices[0].text  # not greedy search
    texts, finishes, _ = collect_stream(client.completions.create(model="tiny", prompt=prompts, max_tokens=8,
                                                                  stream=True, extra_body=extra))
    assert [texts[i] for i in range(2)] == [c.text for c in result.choices]
    assert [finishes[i] for i in range(2)] == ["length", "length"]


def test_prompt_logprobs_a_list_per_prompt_token_first_null(client, tokenizer):
    result = greedy(client, prompt=[PROMPT, "The sky"], max_tokens=1, extra_body={"prompt_logprobs": 1})
    for choice, prompt in zip(result.choices, [PROMPT, "The sky"]):
        ids = tokenizer.encode(prompt)
        plp = choice.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        assert all(str(t) in entry and 1 <= len(entry) <= 2 for t, entry in zip(ids[1:], plp[1:]))
    assert greedy(client, max_tokens=1).choices[0].model_extra.get("prompt_logprobs") is None


def test_usage_on_every_chunk_with_continuous_usage_stats(client, tokenizer):
    prompt_tokens = len(tokenizer.encode(PROMPT))
    stream = greedy(client, max_tokens=5, stream=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    texts, finish, chunks = collect_stream(stream)
    *body, last = chunks
    assert body and all(c.usage is not None for c in body)
    for c in body:
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert [c.usage.completion_tokens for c in body] == sorted(c.usage.completion_tokens for c in body)
    assert body[-1].usage.completion_tokens == 5 and last.choices == [] and last.usage.completion_tokens == 5


def test_finish_reason_rides_on_the_last_text_chunk(client):
    texts, finish, chunks = collect_stream(greedy(client, max_tokens=5, stream=True))
    (last,) = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert last is chunks[-1] and last.choices[0].text != "" and finish == {0: "length"}


def test_more_than_four_stop_strings_and_vllms_stop_options(client, tokenizer):
    whole = greedy(client, max_tokens=12).choices[0].text
    stop = whole[4:7]
    stops = ["zzz1", "zzz2", "zzz3", "zzz4", stop]  # lm-evaluation-harness sends five
    cut = greedy(client, max_tokens=12, stop=stops).choices[0]
    kept = greedy(client, max_tokens=12, stop=stops, extra_body={"include_stop_str_in_output": True}).choices[0]
    start = whole.index(stop)
    assert cut.text == whole[:start] and kept.text == whole[:start + len(stop)]
    assert cut.model_extra["stop_reason"] == stop


def test_extras_through_extra_body_change_the_output_as_transformers(client, hf_checkpoint, tokenizer):
    import torch
    from transformers import GPT2LMHeadModel

    ids = tokenizer.encode(PROMPT)
    model = GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=8, do_sample=False, pad_token_id=50256, repetition_penalty=1.5,
                         no_repeat_ngram_size=2)
    result = greedy(client, max_tokens=8, logprobs=1,
                    extra_body={"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "return_tokens_as_token_ids": True})
    assert result.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out[0, len(ids):].tolist()]


def test_special_token_text_in_a_prompt_is_the_token(client, tokenizer):
    result = greedy(client, prompt="<|endoftext|>Hello", max_tokens=1, echo=True, logprobs=0)
    assert result.usage.prompt_tokens == 2
    assert result.choices[0].logprobs.tokens[:2] == ["<|endoftext|>", "Hello"]
    truncated = greedy(client, prompt=[1, 2, 3, 4, 5], max_tokens=1, extra_body={"truncate_prompt_tokens": 2})
    assert truncated.usage.prompt_tokens == 2


def test_the_worker_logs_each_start_phase_and_took_jobs_before_its_graphs_compiled(stack):
    """Each start phase in the log with its duration. The worker registered on its queue (`serving`)
    before its background compile ended, each graph went live with its cost in the log, and /ready
    counts no worker warming up once its record has beaten again. Last in the module: every other
    test here ran while it compiled, or after."""
    deadline = time.monotonic() + 300
    while compiling(stack["worker"].logs()):
        assert time.monotonic() < deadline, "the background compile did not end"
        time.sleep(0.5)
    records = [json.loads(line) for line in stack["worker"].logs().splitlines() if line.startswith("{")]
    phases = [r["msg"] for r in records]
    order = ["loading weights", "weights loaded", "matmul kernels chosen", "engine ready", "serving",
             "decode step compiled"]
    assert [phases.index(p) for p in order] == sorted(phases.index(p) for p in order), phases
    timed = [r for r in records if r["msg"] in ("weights loaded", "matmul kernels chosen", "decode step compiled")]
    assert len(timed) == 3 and all(r["seconds"] >= 0 for r in timed)
    planned = next(r["graphs"] for r in records if r["msg"] == "compiling the decode step")
    live = [r for r in records if r["msg"] == "decode graph live"]
    assert len(live) == planned >= 1 and all(r["seconds"] > 0 for r in live)
    while (state := requests.get(f"{stack['url']}/ready", timeout=10).json()["models"]["tiny"])["warming_up"]:
        assert time.monotonic() < deadline + 30, state
        time.sleep(0.5)
    assert state["workers"] == 1
