"""The HTTP face through Flask's test client against a real redis-server: validation and its OpenAI
errors, models, the queue (503 without a worker, 429 when full), the synchronous and SSE answers,
jobs, cancellation.

No model runs here: a `ScriptedWorker` stands in for processor.py. It registers as a real rq worker
on the model's queue, takes each job from the real queue and writes scripted events to the job's
real Redis Stream, so everything the web tier does is exercised for real. The real worker, gunicorn
and the `openai` client are in test_e2e_openai.py.
"""
from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from typing import Callable, Iterable

import pytest
import redis
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.job import JobStatus
from rq.serializers import PickleSerializer

from models import tokenizer as tokenizer_module
from models.tokenizer import load_tokenizer
from tests import rq_json
from tests.conftest import redis_commands, write_gpt2_tokenizer
from web.access import keys
from web.api.queue import job_queue
from web.app import create_app
from web.dev.local_redis import free_port
from worker import protocol
from worker.events import append_event

CONTEXT = 64


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """What the web tier reads of a GPT-2 checkpoint: its config and the real GPT-2 vocabulary
    (the web tier never loads weights)."""
    directory = write_gpt2_tokenizer(tmp_path_factory.mktemp("tiny-web"))
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_positions": CONTEXT, "vocab_size": 50257, "eos_token_id": 50256}))
    return directory


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return load_tokenizer(checkpoint_dir)


@pytest.fixture(scope="module")
def models_file(checkpoint_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("registry") / "models.toml"
    path.write_text(f'[models.tiny]\ncheckpoint = "{checkpoint_dir}"\naliases = ["tiny-alias"]\n\n'
                    f'[models."org/idle"]\ncheckpoint = "{checkpoint_dir}"\n')
    return path


SETTINGS = {"keepalive_s": 0.2, "sync_timeout_s": 5, "max_queue_depth": 3, "max_body_bytes": 8192}


@pytest.fixture()
def app(redis_url, models_file):
    return create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS})


@pytest.fixture()
def client(app):
    return app.test_client()


@pytest.fixture()
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


# ---- a stand-in for processor.py ----

Script = Callable[[protocol.CompletionJob], Iterable[tuple[str, dict] | float]]


def hello_script(job: protocol.CompletionJob) -> Iterable[tuple[str, dict] | float]:
    """Every choice says "Hello world" in two deltas, then finishes with `length`."""
    choices = []
    for index in range(len(job.prompts) * job.n):
        for text in ("Hello", " world"):
            yield "delta", {"index": index, "text": text, "token_ids": [1], "logprobs": None}
        yield "finish", {"index": index, "finish_reason": "length"}
        choices.append({"index": index, "text": "Hello world", "logprobs": None, "finish_reason": "length"})
    prompt_tokens = sum(map(len, job.prompts))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2 * len(choices),
             "total_tokens": prompt_tokens + 2 * len(choices)}
    yield "usage", usage
    yield "done", {"completion": protocol.completion_object(job, choices, usage)}


class ScriptedWorker:
    """A real rq worker registration whose jobs are answered by a script (floats in the script are
    pauses, in seconds)."""

    def __init__(self, redis_url: str, model_id: str, script: Script = hello_script):
        self.redis = redis.Redis.from_url(redis_url)
        self.queue = rq_json.queue(protocol.queue_name(model_id), self.redis)
        self.worker = rq_json.worker([self.queue], self.redis)
        self.worker.register_birth()
        self.script = script
        self.jobs: list[protocol.CompletionJob] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self.redis.close()

    def _run(self):
        while not self._stop.is_set():
            try:
                got = Queue.dequeue_any([self.queue], timeout=1, connection=self.redis, serializer=rq_json.SERIALIZER)
            except DequeueTimeout:
                continue
            if got is None:
                continue
            job = protocol.CompletionJob.from_payload(got[0].args[0])
            self.jobs.append(job)
            for item in self.script(job):
                if isinstance(item, float):
                    time.sleep(item)
                else:
                    self.redis.xadd(protocol.stream_key(job.id), protocol.encode_event(*item))


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", **body})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_events(response) -> list[str]:
    """The raw frames of a streamed response, in order; a comment line (`: keepalive`, sent without
    a blank line after it) counts as a frame of its own."""
    text = b"".join(response.response).decode()
    frames = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        frames += [line for line in lines if line.startswith(":")]
        frames.append("\n".join(line for line in lines if not line.startswith(":")))
    return [frame for frame in frames if frame]


def frame_data(frames: list[str]) -> list:
    out = []
    for frame in frames:
        for line in frame.split("\n"):
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---- models ----

def test_models_list_and_retrieve(client):
    listing = client.get("/v1/models").get_json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["tiny", "org/idle"]
    assert all(m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"] for m in listing["data"])
    assert client.get("/v1/models/tiny").get_json()["id"] == "tiny"
    assert client.get("/v1/models/org/idle").get_json()["id"] == "org/idle"  # ids may contain '/'
    assert client.get("/v1/models/tiny-alias").get_json()["context_length"] == CONTEXT


def test_a_gunicorn_process_loads_every_models_tokenizer_as_it_starts(redis_url, models_file, monkeypatch,
                                                                     tmp_path, caplog):
    """A GPT-2 vocabulary takes about half a second to load: `wsgi.py` has a process that gunicorn
    serves from (it says so in SERVER_SOFTWARE) load each served model's as it starts, so that its
    first request does not wait for it; one it cannot load is said in a line, and its requests are
    refused as before. The admin CLI (`flask --app wsgi`) loads none."""
    registry = tmp_path / "models.toml"
    registry.write_text(models_file.read_text() + f'\n[models.gone]\ncheckpoint = "{tmp_path / "missing"}"\n')
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("NANOSERVE_MODELS", str(registry))
    for server, loads in (("gunicorn/25.0.0", True), (None, False)):
        if server is None:
            monkeypatch.delenv("SERVER_SOFTWARE", raising=False)
        else:
            monkeypatch.setenv("SERVER_SOFTWARE", server)
        tokenizer_module._load.cache_clear()  # loaded afresh, not shared from another test's app
        sys.modules.pop("wsgi", None)
        served = importlib.import_module("wsgi").app.extensions["nanoserve.models"]
        if not loads:
            assert served.loading is None and served._tokenizers == {}
            continue
        served.loading.join(30)  # no request sent
        assert set(served._tokenizers) == {"tiny", "org/idle"}
        said = [r for r in caplog.records if r.name == "web.api.models"]
        assert [r.getMessage() for r in said] == ["model gone has no usable tokenizer; its requests are refused"]
        assert said[0].exc_info is None and "missing" in said[0].error
        client = importlib.import_module("wsgi").app.test_client()
        assert error_of(complete(client, model="gone"), 503)["code"] == "model_unavailable"
    sys.modules.pop("wsgi", None)


def test_models_need_a_key_when_auth_is_required(redis_url, models_file, monkeypatch):
    monkeypatch.setenv("NANOSERVE_AUTH", "required")
    client = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS}).test_client()
    for path in ("/v1/models", "/v1/models/tiny"):
        assert error_of(client.get(path), 401)["message"].startswith("You didn't provide an API key.")

def test_unknown_model_is_404_model_not_found(client):
    error = error_of(client.get("/v1/models/nope/x"), 404)
    assert error["code"] == "model_not_found" and "`nope/x` does not exist" in error["message"]
    error = error_of(complete(client, model="gpt-9"), 404)
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")


# ---- bad requests ----

@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"logprobs": 6}, "logprobs"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 9}, "frequency_penalty"), ({"stop": ["s"] * 17}, "stop"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"logit_bias": {"50257": 1}}, "logit_bias"),
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": [50257]}, "prompt"),
    ({"prompt": [[1, 2], [99999]]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": []}, "prompt"), ({"model": None}, "model"), ({"max_tokens": -1}, "max_tokens"),
    ({"seed": 2**63}, "seed"), ({"top_k": -2}, "top_k"), ({"user": "u" * 257}, "user"),
])
def test_invalid_values_are_400_with_param(client, body, param):
    error = error_of(complete(client, **body), 400)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


def test_context_length_in_openais_words(client):
    error = error_of(complete(client, prompt=[1] * 60, max_tokens=10), 400)
    assert error["message"] == ("This model's maximum context length is 64 tokens, however you requested 70 tokens "
                                "(60 in your prompt; 10 for the completion). Please reduce your prompt; or "
                                "completion length.")
    assert error["code"] == "context_length_exceeded"
    error = error_of(complete(client, prompt=[1] * 65, max_tokens=None), 400)
    assert "you requested 65 tokens (65 in your prompt; 0 for the completion)" in error["message"]


def test_malformed_json_and_non_objects(client):
    error = error_of(client.post("/v1/completions", data='{"model": "tiny",', content_type="application/json"), 400)
    assert "could not parse the JSON body" in error["message"]
    error_of(client.post("/v1/completions", data=b"\xff\xfe", content_type="application/json"), 400)
    error = error_of(client.post("/v1/completions", json=["tiny"]), 400)
    assert "JSON object" in error["message"]
    error_of(client.post("/v1/completions", data="[" * 5000, content_type="application/json"), 400)


def test_too_many_sequences(redis_url, models_file):
    app = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS, "max_choices": 8})
    assert error_of(complete(app.test_client(), prompt=["a", "b", "c"], n=3), 400)["param"] == "n"
    assert error_of(complete(app.test_client(), prompt=["a"] * 9), 400)["param"] == "prompt"


def test_body_too_large_is_413(client):
    error = error_of(complete(client, prompt="x" * 10_000), 413)
    assert error["type"] == "invalid_request_error"


def test_unknown_route_and_method_use_the_envelope(client):
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    error_of(client.get("/v1/completions"), 405)


# ---- the queue ----

@pytest.fixture()
def slow_retry(redis_url, models_file):
    """The app with NANOSERVE_RETRY_AFTER=7, as a deployment would set it."""
    return create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS,
                       "retry_after_s": "7"}).test_client()


def test_no_live_worker_is_503_with_retry_after(client, slow_retry):
    response = complete(client, model="org/idle")
    error = error_of(response, 503)
    assert error["code"] == "no_worker" and response.headers["Retry-After"] == "1"
    assert complete(slow_retry, model="org/idle").headers["Retry-After"] == "7"


def test_full_queue_is_429_with_retry_after(client, slow_retry, redis_url, r):
    rq_json.worker(["completions:tiny"], r).register_birth()  # registered, never works
    for _ in range(3):
        assert client.post("/v1/jobs", json={"model": "tiny", "prompt": "x"}).status_code == 202
    response = client.post("/v1/jobs", json={"model": "tiny", "prompt": "x"})
    error = error_of(response, 429)
    assert error["code"] == "queue_full" and response.headers["Retry-After"] == "1"
    response = slow_retry.post("/v1/jobs", json={"model": "tiny", "prompt": "x"})
    assert error_of(response, 429)["code"] == "queue_full" and response.headers["Retry-After"] == "7"


def test_admission_is_one_round_trip_and_a_refusal_takes_nothing_after_it(redis_url, models_file, r):
    """A job's admission (web/api/admission.py): the model's queue, the caller's open hold, rate
    limit and jobs quota checked in one script call; refused at one step, the steps after it take
    nothing and those before it are given back (a request without a worker spends no rate limit)."""
    app = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS, "key_max_jobs": 1,
                      "key_rpm": 5, "key_tpm": 600})
    client = app.test_client()
    bucket, jobs, opened = ("nanoserve:ratelimit:addr:127.0.0.1", "nanoserve:quota:jobs:addr:127.0.0.1",
                            "nanoserve:quota:open:addr:127.0.0.1")
    assert error_of(complete(client, model="org/idle"), 503)["code"] == "no_worker"
    assert not r.exists(bucket) and not r.exists(jobs) and not r.zcard(opened)
    rq_json.worker(["completions:tiny"], r).register_birth()  # registered, never works
    with redis_commands(redis_url) as commands:
        posted = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"})
    assert posted.status_code == 202
    writes = [c for c in commands if c.startswith(("EVAL", "EVALSHA", "MULTI"))]
    assert len(writes) == 1 and writes[0].startswith("EVAL"), writes  # admission and enqueue, one call
    queue = Queue(protocol.queue_name("tiny"), connection=r, serializer=protocol.SERIALIZER)
    assert queue.job_ids == [posted.get_json()["id"]]
    tokens = float(r.hget(bucket, "tok"))
    assert r.zcard(jobs) == 1 and float(r.hget(bucket, "req")) == pytest.approx(4, abs=0.01)
    # the jobs quota refuses a synchronous request: its open hold and its tokens are given back, and
    # nothing of it is queued
    rq_keys = set(r.scan_iter("rq:job:*"))
    assert error_of(complete(client), 429)["code"] == "quota_exceeded"
    assert r.zcard(opened) == 0 and float(r.hget(bucket, "tok")) == pytest.approx(tokens, abs=2)
    assert r.zcard(jobs) == 1 and queue.job_ids == [posted.get_json()["id"]] and set(r.scan_iter("rq:job:*")) == rq_keys


@pytest.mark.parametrize("stream", [False, True])
def test_a_held_completion_settles_its_tokens_in_its_release(redis_url, models_file, r, monkeypatch, stream):
    """A synchronous or streamed completion's token reservation is corrected by its usage in the
    round trip that gives its hold back, not in one of its own."""
    from web.access import ratelimit

    app = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS, "key_tpm": 60})
    own_trips = []
    monkeypatch.setattr(ratelimit, "settle", lambda *args: own_trips.append(args))
    with ScriptedWorker(redis_url, "tiny"):
        response = complete(app.test_client(), prompt="Hello", max_tokens=40, stream=stream)
        body = b"".join(response.response)  # a stream's generator runs, and ends, here
    assert response.status_code == 200 and b"Hello" in body
    # 40 completion tokens were reserved and 2 used: the deficit left is the 1-token prompt's and
    # those 2; unsettled, it would be 41 (less the token a second the bucket refills meanwhile)
    deficit = 60 - float(r.hget("nanoserve:ratelimit:addr:127.0.0.1", "tok"))
    assert deficit < 10 and own_trips == []


def test_a_job_enqueued_by_the_admission_script_is_rqs_enqueue(app, r):
    """The admission script runs rq's own enqueue commands (`JobQueue.prepare`): what it leaves in
    Redis is what running them as rq's transaction leaves, and rq reads the job back whole."""
    from web.api.admission import _ADMIT
    from web.api.queue import commands

    def enqueued(job_id: str, by_script: bool) -> dict:
        job = protocol.CompletionJob(id=job_id, model="tiny", prompts=[[1, 2, 3]], max_tokens=4, seed=0)
        with app.app_context():
            jq = job_queue()
            _, pipe = jq.prepare(job, "tiny", owner="key:k1", also=lambda p: jq.hub.queue_wake(p, "a-stream"))
            if by_script:  # a queue with a live worker and room; no step to take
                rq_json.worker(["completions:tiny"], r).register_birth()
                assert r.eval(_ADMIT, 2, *jq.load_keys("tiny"), 100, 0, 0, 0, 0, 0, 0, *commands(pipe))[0] == 0
            else:
                with pipe:
                    pipe.execute()
        fetched = Queue(protocol.queue_name("tiny"), connection=r, serializer=protocol.SERIALIZER).fetch_job(job_id)
        assert fetched.args[0]["prompts"] == [[1, 2, 3]] and fetched.meta == {"owner": "key:k1"}
        assert fetched.get_status() == JobStatus.QUEUED and fetched.retries_left == jq.settings.job_retries
        fields = {k: v for k, v in r.hgetall(fetched.key).items() if k not in (b"created_at", b"enqueued_at", b"data",
                                                                                b"description")}
        return {"fields": fields, "ttl": r.ttl(fetched.key) // 10, "queued": job_id.encode() in r.lrange(
            f"rq:queue:{protocol.queue_name('tiny')}", 0, -1), "queues": r.smembers("rq:queues")}

    by_script, by_transaction = enqueued("cmpl-a", True), enqueued("cmpl-b", False)
    assert by_script == by_transaction and by_script["queued"] and by_script["fields"][b"status"] == b"queued"


@pytest.mark.parametrize("retry_after", [None, "7"])
def test_redis_down_is_503_with_retry_after(models_file, monkeypatch, retry_after):
    if retry_after:
        monkeypatch.setenv("NANOSERVE_RETRY_AFTER", retry_after)
    app = create_app({"redis_url": f"redis://127.0.0.1:{free_port()}/0", "models_path": str(models_file)})
    client = app.test_client()
    for response in (complete(client), client.get("/v1/jobs/cmpl-x"), client.post("/v1/jobs", json={"model": "tiny"})):
        assert error_of(response, 503)["type"] == "server_error"
        assert response.headers["Retry-After"] == (retry_after or "1")
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503


def test_ready_needs_a_worker_for_every_model(client, redis_url):
    body = client.get("/ready")
    assert body.status_code == 503 and body.get_json()["models"]["tiny"]["workers"] == 0
    with ScriptedWorker(redis_url, "tiny"), ScriptedWorker(redis_url, "org/idle"):
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.get_json()["models"]["tiny"]["workers"] == 1



def test_ready_counts_the_workers_whose_engine_still_compiles(client, redis_url):
    """A worker serves while its graphs compile in the background, and its record in Redis says so
    at every beat: /ready stays 200 and counts it under `warming_up` until it has compiled."""
    from worker.consumer import EngineWorker

    compiling = threading.Event()
    compiling.set()
    r = redis.Redis.from_url(redis_url)
    worker = EngineWorker([protocol.queue_name("tiny")], connection=r,
                          serializer=protocol.SERIALIZER, heartbeat_ttl=10, warming=compiling.is_set)
    worker.register_birth()
    worker.heartbeat()
    try:
        with ScriptedWorker(redis_url, "org/idle"):
            ready = client.get("/ready")
            assert ready.status_code == 200
            assert ready.get_json()["models"]["tiny"] == {"workers": 1, "queued": 0, "warming_up": 1}
            assert ready.get_json()["models"]["org/idle"]["warming_up"] == 0
            compiling.clear()
            worker.heartbeat()
            assert client.get("/ready").get_json()["models"]["tiny"] == {"workers": 1, "queued": 0, "warming_up": 0}
    finally:
        worker.register_death()

# ---- synchronous answers ----

def test_sync_completion_and_the_job_it_enqueued(client, redis_url, tokenizer):
    with ScriptedWorker(redis_url, "tiny") as worker:
        response = complete(client, model="tiny-alias", prompt=["Hello there", "Bye"], n=2, max_tokens=5,
                            temperature=0.5, top_p=0.9, top_k=7, stop="\n", logit_bias={"50256": -100},
                            presence_penalty=0.5, frequency_penalty=-0.5, logprobs=2, echo=True, user="u1")
    assert response.status_code == 200
    body = response.get_json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert response.headers["x-request-id"]

    (job,) = worker.jobs
    assert job.id == body["id"] and job.model == "tiny"
    assert job.prompts == [tokenizer.encode("Hello there"), tokenizer.encode("Bye")]
    assert (job.n, job.max_tokens, job.temperature, job.top_p, job.top_k) == (2, 5, 0.5, 0.9, 7)
    assert (job.stop, job.logit_bias, job.logprobs, job.echo, job.user) == (["\n"], {50256: -100.0}, 2, True, "u1")
    assert (job.presence_penalty, job.frequency_penalty, job.stream) == (0.5, -0.5, False)
    assert isinstance(job.seed, int)  # drawn when not given: a retried job replays it


def test_defaults_reach_the_job(client, redis_url, tokenizer):
    with ScriptedWorker(redis_url, "tiny") as worker:
        assert complete(client, prompt=None, seed=42, max_tokens=None).status_code == 200
        assert complete(client, prompt=[[5, 6], [7]], best_of=3, n=2, top_p=0).status_code == 200
    first, second = worker.jobs
    assert first.prompts == [[tokenizer.eos_token_id]] and first.seed == 42 and first.max_tokens is None
    assert (first.temperature, first.n, first.best_of, first.stop, first.logprobs) == (1.0, 1, None, [], None)
    assert second.prompts == [[5, 6], [7]] and (second.n, second.best_of, second.max_tokens) == (2, 3, 16)
    assert second.top_p == 0.0  # accepted, as OpenAI does: the worker samples the most likely token


def test_worker_error_event_becomes_the_http_error(client, redis_url):
    def failing(job):
        yield "error", protocol.error_body("logprobs is too large for this model", "invalid_request_error", "logprobs")

    with ScriptedWorker(redis_url, "tiny", failing):
        error = error_of(complete(client), 400)
    assert (error["param"], error["message"]) == ("logprobs", "logprobs is too large for this model")

    def crashing(job):
        yield "error", protocol.error_body("The server had an error while processing your request.", "server_error")

    with ScriptedWorker(redis_url, "tiny", crashing):
        assert error_of(complete(client), 500)["type"] == "server_error"


@pytest.mark.parametrize("busy", [False, True], ids=["silent", "still-generating"])
def test_sync_timeout_is_504_and_cancels(redis_url, models_file, r, busy):
    app = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS, "sync_timeout_s": 0.5})

    def slow(job):  # nothing at all, or tokens that never end (until cancelled)
        while busy and not r.exists(protocol.cancel_key(job.id)):
            yield "delta", {"index": 0, "text": "x", "token_ids": [1], "logprobs": None}
            yield 0.05

    with ScriptedWorker(redis_url, "tiny", slow) as worker:
        response = complete(app.test_client())
    error = error_of(response, 504)
    assert error["code"] == "timeout" and response.headers["x-should-retry"] == "false"
    assert r.exists(protocol.cancel_key(worker.jobs[0].id))


def test_a_job_rq_forgot_does_not_hang_its_reader(client, redis_url, r):
    """A job that expires (or is deleted) without a terminal event ends its waiters with an error."""
    def vanish(job):
        rq_json.fetch(job.id, r).delete()
        return []

    with ScriptedWorker(redis_url, "tiny", vanish):
        error = error_of(complete(client), 500)
    assert error["code"] == "job_failed" and "expired" in error["message"]


# ---- streaming ----

def test_stream_frames(client, redis_url):
    with ScriptedWorker(redis_url, "tiny"):
        response = complete(client, stream=True, n=2, stream_options={"include_usage": True})
        assert response.mimetype == "text/event-stream"
        frames = sse_events(response)
    data = frame_data(frames)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") and c["model"] == "tiny"
               for c in chunks)
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]  # one choice per chunk
        assert chunk["usage"] is None
        text[choice["index"]] += choice["text"]
        assert choice["finish_reason"] in (None, "length")
        assert choice["finish_reason"] is None or choice["text"] == ""
    assert text == {0: "Hello world", 1: "Hello world"}
    assert sum(1 for c in chunks[:-1] if c["choices"][0]["finish_reason"]) == 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # every event frame carries its stream entry id
    assert all(f.startswith("id: ") for f in frames[:-1])


def test_stream_without_usage_has_no_usage_key(client, redis_url):
    with ScriptedWorker(redis_url, "tiny"):
        chunks = frame_data(sse_events(complete(client, stream=True)))[:-1]
    assert chunks and all("usage" not in c and c["choices"] for c in chunks)


def test_stream_keepalive_while_waiting(client, redis_url):
    def slow(job):
        yield 0.7
        yield from hello_script(job)

    with ScriptedWorker(redis_url, "tiny", slow):
        frames = sse_events(complete(client, stream=True))
    assert ": keepalive" in frames
    assert frame_data(frames)[-1] == "[DONE]"


def test_stream_error_mid_stream(client, redis_url):
    def failing(job):
        yield "delta", {"index": 0, "text": "Hi", "token_ids": [1], "logprobs": None}
        yield "error", protocol.error_body("boom", "server_error")

    with ScriptedWorker(redis_url, "tiny", failing):
        data = frame_data(sse_events(complete(client, stream=True)))
    assert data[0]["choices"][0]["text"] == "Hi"
    assert data[1] == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert data[2] == "[DONE]"


def test_client_disconnect_cancels_the_job(client, redis_url, r):
    def endless(job):  # stops when cancelled, as the engine does
        while not r.exists(protocol.cancel_key(job.id)):
            yield "delta", {"index": 0, "text": "x", "token_ids": [1], "logprobs": None}
            yield 0.05

    with ScriptedWorker(redis_url, "tiny", endless) as worker:
        response = complete(client, stream=True, max_tokens=None)
        frames = iter(response.response)
        assert b"data: " in next(frames)
        response.close()  # the WSGI server closes the body when the client goes away
        assert r.exists(protocol.cancel_key(worker.jobs[0].id))


# ---- jobs ----

def test_job_submit_poll_result(client, redis_url, r):
    rq_json.worker(["completions:tiny"], r).register_birth()  # busy elsewhere
    submitted = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert submitted.status_code == 202
    job = submitted.get_json()
    assert job["id"].startswith("cmpl-") and (job["object"], job["status"], job["model"]) == ("job", "queued", "tiny")
    assert submitted.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert client.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "queued"
    for odd in ("cmpl-%00", "cmpl-%FF", "cmpl-x.y"):  # not even an rq job id: as unknown as any other
        assert client.get(f"/v1/jobs/{odd}").status_code == 404

    with ScriptedWorker(redis_url, "tiny"):
        deadline = time.monotonic() + 10
        while (state := client.get(f"/jobs/{job['id']}").get_json())["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert state["result"]["id"] == job["id"] and state["result"]["choices"][0]["text"] == "Hello world"


def test_a_job_rq_has_finished_is_in_progress_until_its_stream_has_its_result(client, r):
    """The worker's last events can land after rq marks the job finished (its writer retries them
    through an outage): until the `done` event is there, a poll says in_progress, never completed
    without a result."""
    from rq.job import Job

    rq_json.worker(["completions:tiny"], r).register_birth()
    job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}).get_json()["id"]
    done = list(hello_script(protocol.CompletionJob.from_payload(
        Job.fetch(job_id, connection=r, serializer=rq_json.SERIALIZER).args[0])))[-1]
    r.xadd(protocol.stream_key(job_id), protocol.encode_event("delta", {"index": 0, "text": "Hello", "token_ids": [1],
                                                                        "logprobs": None}))
    Job.fetch(job_id, connection=r, serializer=rq_json.SERIALIZER).set_status(JobStatus.FINISHED)
    state = client.get(f"/v1/jobs/{job_id}").get_json()
    assert state["status"] == "in_progress" and "result" not in state
    r.xadd(protocol.stream_key(job_id), protocol.encode_event(*done))
    state = client.get(f"/v1/jobs/{job_id}").get_json()
    assert state["status"] == "completed" and state["result"]["id"] == job_id


def test_job_failed(client, redis_url):
    def failing(job):
        yield "error", protocol.error_body("bad", "server_error")

    with ScriptedWorker(redis_url, "tiny", failing):
        job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).get_json()["id"]
        deadline = time.monotonic() + 10
        while (state := client.get(f"/v1/jobs/{job_id}").get_json())["status"] != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert state["error"]["message"] == "bad"


def test_job_cancel_while_queued(client, r):
    rq_json.worker(["completions:tiny"], r).register_birth()
    job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).get_json()["id"]
    cancelled = client.delete(f"/v1/jobs/{job_id}")
    assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}").get_json()["status"] == "cancelled"
    assert r.exists(protocol.cancel_key(job_id))
    assert rq_json.fetch(job_id, r).get_status() == JobStatus.CANCELED
    assert rq_json.queue("completions:tiny", r).count == 0


def cancel_after(app, client, r, monkeypatch, meanwhile) -> tuple[str, bool]:
    """A queued job cancelled with `meanwhile(job_id)` run between the cancel's read of the job (which
    still says queued) and rq's cancel: its id, and what `JobQueue.cancel` answered."""
    rq_json.worker(["completions:tiny"], r).register_birth()
    job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).get_json()["id"]
    with app.app_context():
        jq = job_queue()
        fetch = jq.fetch

        def stale_fetch(job_id):
            stale = fetch(job_id)
            meanwhile(job_id)
            return stale

        monkeypatch.setattr(jq, "fetch", stale_fetch)
        return job_id, jq.cancel(job_id)


def test_a_cancel_that_loses_the_race_to_another_is_no_error(app, client, r, monkeypatch):
    """A batch's cancel and its dispatcher (or two web processes) may cancel one queued job at once:
    the one that comes second finds it cancelled under it and must not turn that into a 500."""
    job_id, queued = cancel_after(app, client, r, monkeypatch, lambda job_id: rq_json.fetch(job_id, r).cancel())
    assert queued is True
    assert rq_json.fetch(job_id, r).get_status() == JobStatus.CANCELED and r.exists(protocol.cancel_key(job_id))


def test_a_cancel_that_meets_a_worker_starting_the_job_is_no_error(app, client, r, monkeypatch):
    """A worker may start a queued job between the cancel's read of it and rq's cancel, which then
    reads an execution the worker has registered but not yet written (rq raises ValueError): the job
    runs, its cancel flag stops it, and the answer is no 500."""
    def start(job_id):  # started, its execution listed but not (or no longer) written
        r.hset(f"rq:job:{job_id}", "status", JobStatus.STARTED.value)
        r.zadd(f"rq:executions:{job_id}", {"half-written": time.time() + 60})

    job_id, queued = cancel_after(app, client, r, monkeypatch, start)
    assert queued is False  # it was no longer only queued
    assert r.exists(protocol.cancel_key(job_id))
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200


def test_a_job_whose_stream_ended_gives_its_place_in_the_keys_quota_back(redis_url, models_file, r):
    """A key's quota of jobs counts what its jobs hold of an engine. The worker writes a job's terminal
    event before rq records the job finished, which lags under load: a job whose stream ended frees
    its place even while rq still calls it started; one whose stream goes on does not."""
    app = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS, "key_max_jobs": 2})
    client = app.test_client()
    rq_json.worker(["completions:tiny"], r).register_birth()
    first, second = (client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).get_json()["id"] for _ in range(2))
    assert error_of(client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}), 429)["code"] == "quota_exceeded"
    for job_id in (first, second):  # both taken by a worker, as rq records it
        r.hset(f"rq:job:{job_id}", "status", JobStatus.STARTED.value)
        append_event(r, job_id, "delta", {"index": 0, "text": "a", "token_ids": [64], "logprobs": None})
    assert error_of(client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}), 429)["code"] == "quota_exceeded"
    append_event(r, first, "done", {"completion": {}})
    assert client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).status_code == 202


def test_unknown_job_is_404(client):
    for path in ("/v1/jobs/cmpl-nope", "/jobs/cmpl-nope", "/v1/jobs/other"):
        assert error_of(client.get(path), 404)["code"] == "job_not_found"
    assert error_of(client.delete("/v1/jobs/cmpl-nope"), 404)["type"] == "invalid_request_error"


def test_a_job_belongs_to_the_key_that_made_it(redis_url, models_file):
    keyed = create_app({"redis_url": redis_url, "models_path": str(models_file), **SETTINGS,
                        "auth_required": "required"})
    admin = redis.Redis.from_url(redis_url, decode_responses=True)
    (alice, _), (bob, _) = keys.create(admin, "alice"), keys.create(admin, "bob")
    client = keyed.test_client()

    def as_(token):
        return {"Authorization": f"Bearer {token}"}

    with ScriptedWorker(redis_url, "tiny"):
        job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}, headers=as_(alice)).get_json()["id"]
        unknown = "cmpl-" + "0" * 32
        for path in (f"/v1/jobs/{job_id}", f"/jobs/{job_id}", f"/v1/jobs/{job_id}/stream"):
            refused = client.get(path, headers=as_(bob))
            # exactly the answer for an id that does not exist: existence does not leak
            assert error_of(refused, 404)["code"] == "job_not_found"
            assert refused.get_json() == json.loads(
                client.get(path.replace(job_id, unknown), headers=as_(bob)).get_data(as_text=True).replace(unknown, job_id))
        assert error_of(client.delete(f"/v1/jobs/{job_id}", headers=as_(bob)), 404)["code"] == "job_not_found"
        deadline = time.monotonic() + 10
        while (state := client.get(f"/v1/jobs/{job_id}", headers=as_(alice)).get_json())["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert state["result"]["choices"][0]["text"] == "Hello world"  # the owner still can, after bob's tries
    assert frame_data(sse_events(client.get(f"/v1/jobs/{job_id}/stream", headers=as_(alice))))[-1] == "[DONE]"
    assert client.delete(f"/v1/jobs/{job_id}", headers=as_(alice)).get_json()["status"] == "completed"
    assert error_of(client.get(f"/v1/jobs/{job_id}"), 401)  # no key at all: 401 before any lookup

    # A key revoked and created again under the same name is a new key: the old jobs are not its own.
    keys.revoke(admin, "alice")
    alice_again, _ = keys.create(admin, "alice")
    assert error_of(client.get(f"/v1/jobs/{job_id}", headers=as_(alice_again)), 404)["code"] == "job_not_found"
    admin.close()


def test_with_keys_off_anonymous_callers_share_one_scope(client, r):
    rq_json.worker(["completions:tiny"], r).register_birth()
    job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"},
                         environ_base={"REMOTE_ADDR": "10.0.0.1"}).get_json()["id"]
    other = client.get(f"/v1/jobs/{job_id}", environ_base={"REMOTE_ADDR": "10.0.0.2"})
    assert other.status_code == 200 and other.get_json()["status"] == "queued"
    assert rq_json.fetch(job_id, r).meta["owner"] == "anonymous"


def test_a_job_stored_pickled_is_no_job_of_ours_and_is_never_unpickled(app, client, r, tmp_path):
    """A job pickled into a model's queue (rq's default serializer), as anyone who can write to Redis
    could: the API answers as for an unknown id, the admin's job list leaves it out, and nothing
    unpickles it."""
    touched = tmp_path / "touched"
    job_id = protocol.new_completion_id()
    Queue("completions:tiny", connection=r, serializer=PickleSerializer).enqueue_call(
        protocol.JOB_FUNCTION, args=(rq_json.Touch(touched),), meta={"owner": "anonymous"}, job_id=job_id)
    for response in (client.get(f"/v1/jobs/{job_id}"), client.delete(f"/v1/jobs/{job_id}")):
        assert error_of(response, 404)["code"] == "job_not_found"
    with app.app_context():
        assert job_id.encode() in r.lrange(rq_json.queue("completions:tiny", r).key, 0, -1)  # queued, as such
        assert job_id not in [job.id for job in job_queue().jobs()]
    assert not touched.exists()


def test_jobs_refuse_stream(client):
    assert error_of(client.post("/v1/jobs", json={"model": "tiny", "prompt": "x", "stream": True}), 400)["param"] == "stream"


def test_job_stream_resumes_from_last_event_id(client, redis_url):
    with ScriptedWorker(redis_url, "tiny"):
        job_id = client.post("/v1/jobs", json={"model": "tiny", "prompt": "Hi"}).get_json()["id"]
        frames = sse_events(client.get(f"/v1/jobs/{job_id}/stream"))
    ids = [f.split("\n")[0][len("id: "):] for f in frames if f.startswith("id: ")]
    assert len(ids) == 4  # 2 deltas, finish, usage; then `data: [DONE]`
    resumed = sse_events(client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": ids[1]}))
    assert resumed == frames[2:]
    assert error_of(client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "x"}), 400)


def test_request_id_is_echoed_or_made(client):
    assert client.get("/health", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
    made = client.get("/v1/models").headers["x-request-id"]
    assert made and made != "abc-123"


def test_a_character_the_vocabulary_lacks_is_a_400(redis_url, tmp_path):
    """A character-level model's prompt (and bad word) with a character outside its vocabulary."""
    import pickle

    from test_registry import save_nanogpt_ckpt

    save_nanogpt_ckpt(tmp_path / "chars" / "ckpt.pt")
    (tmp_path / "chars" / "meta.pkl").write_bytes(pickle.dumps(
        {"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}}))
    (tmp_path / "models.toml").write_text(f'[models.chars]\ncheckpoint = "{tmp_path / "chars" / "ckpt.pt"}"\n')
    client = create_app({"redis_url": redis_url, "models_path": str(tmp_path / "models.toml"), **SETTINGS}).test_client()
    for body, param in (({"prompt": "abz"}, "prompt"), ({"prompt": ["ab", "é"]}, "prompt"),
                        ({"prompt": "ab", "bad_words": ["z"]}, "bad_words")):
        err = error_of(client.post("/v1/completions", json={"model": "chars", "max_tokens": 2, **body}), 400)
        assert err["param"] == param and "not in this model's vocabulary" in err["message"]


def test_a_stream_gives_its_places_back_before_the_client_sees_its_end(r):
    """A client that has read `data: [DONE]` and at once sends its next request finds its key's open
    place and its ended job's place given back, not still held by the stream that just ended."""
    from web.access.quotas import Hold, Quota
    from web.api.streaming import DONE, guarded

    open_quota, jobs = Quota("open", 4, "open streams"), Quota("jobs", 4, "completions")
    jobs.take(r, "owner", "job-1", time.time() + 60)
    hold = Hold(r, open_quota, "owner", stale_s=30)
    hold.follow(jobs, "job-1")
    hold.job_ended()
    frames = guarded(iter(['data: {"x": 1}\n\n', DONE]), None, "job-1", cancel_on_disconnect=False, hold=hold)
    assert next(frames) == 'data: {"x": 1}\n\n'
    assert r.zcard(open_quota.key("owner")) == 1 and r.zcard(jobs.key("owner")) == 1  # held while it streams
    assert next(frames) == DONE  # the stream's generator waits here until the server asks for more
    assert r.zcard(open_quota.key("owner")) == 0 and r.zcard(jobs.key("owner")) == 0
    assert list(frames) == []
