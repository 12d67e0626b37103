"""The Batch API end to end: the real `openai` client against gunicorn and `processor.py` on a real
Redis, with two small random-weight GPT-2 models.

Upload → create → poll → download for 200 lines over two models (one batch per model: a batch runs
one model, as on OpenAI), every output equal to the same request sent alone; validation failures;
two keys that cannot see each other's batches, files or jobs; cancel and expiry mid-way with counts
that add up; a worker killed with SIGKILL (also between taking a line and starting it) and a web
tier killed and restarted mid-batch, with every line exactly once in the output; and interactive
requests that keep their latency while a large batch is queued.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis

from tests import rq_json
from tests.conftest import make_hf_checkpoint
from tests.stack import spawn_gunicorn, spawn_processor, write_models_toml
from web.access import keys
from worker import protocol

pytestmark = pytest.mark.slow  # the whole stack as processes, restarted and killed

FINAL = ("completed", "failed", "expired", "cancelled")
WEB_ENV = {"NANOSERVE_AUTH": "required", "NANOSERVE_BATCH_TICK": "0.1", "NANOSERVE_BATCH_LEASE": "2",
           "NANOSERVE_BATCH_MAX_INFLIGHT": "6", "NANOSERVE_LOG_LEVEL": "WARNING"}
EOS = 50256


class Stack:
    """A processor (both models) and gunicorn on one Redis; either may be killed and replaced."""

    def __init__(self, redis_url, models, log_dir):
        self.redis_url, self.models, self.log_dir = redis_url, models, log_dir
        self.worker = self.web = None
        from models.registry import Registry

        self.models_served = [spec.id for spec in Registry.from_file(models).models()]
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.alice, self.bob = keys.create(r, "alice")[0], keys.create(r, "bob")[0]
        self.r = redis.Redis.from_url(redis_url)

    def start_worker(self):
        self.worker = spawn_processor(self.redis_url, self.models, concurrency=6, heartbeat=1, log_dir=self.log_dir,
                                      extra_args=["--batch-concurrency", "4"])

    def start_web(self, **env):
        return spawn_gunicorn(self.redis_url, self.models, workers=2, threads=16, env={**WEB_ENV, **env},
                              log_dir=self.log_dir)

    def client(self, key=None, web=None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(web or self.web).url + "/v1", api_key=key or self.alice, max_retries=0)

    def wait(self, client, batch_id, until=FINAL, timeout=120, check=None):
        """Poll a batch until its status is in `until` (or `check` holds); on a timeout, say why."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = client.batches.retrieve(batch_id)
            if batch.status in until or (check is not None and check(batch)):
                return batch
            time.sleep(0.2)
        raise AssertionError(f"batch {batch_id} is still {batch.status} ({batch.request_counts})\n{self.state()}")

    @contextlib.contextmanager
    def replacing_worker(self):
        """Around a kill of the worker: a new one is started after the block, even when it failed,
        so that the tests after it find a worker."""
        try:
            yield
        finally:
            self.start_worker()

    def state(self) -> str:
        """Where the jobs are (queues, intermediate lists, running registries, the maintenance lock)
        and the tail of the worker's log: what a stuck batch is waiting for."""
        lines = []
        for model in self.models_served:
            for name in (protocol.queue_name(model), protocol.batch_queue_name(model)):
                queue = rq_json.queue(name, self.r)
                started = self.r.zrange(rq_json.started(name, self.r).key, 0, -1, withscores=True)
                intermediate = self.r.lrange(queue.intermediate_queue_key, 0, -1)
                lines.append(f"{name}: {queue.count} queued, intermediate {intermediate}, "
                             f"started {[(m.decode(), round(score - time.time(), 1)) for m, score in started]}, "
                             f"maintenance lock ttl {self.r.ttl(queue.registry_cleaning_key)}")
        worker = self.worker.logs()[-3000:] if self.worker is not None else ""
        alive = self.worker is not None and self.worker.alive()
        return "\n".join(lines) + f"\nworker alive: {alive}; log tail:\n{worker}"

    def stop(self):
        for service in (self.web, self.worker):
            if service is not None:
                service.stop()


@pytest.fixture(scope="module")
def stack(redis_server, hf_checkpoint, tmp_path_factory):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    root = tmp_path_factory.mktemp("e2e-batch")
    other = make_hf_checkpoint(root / "tiny2", seed=1)
    models = write_models_toml(root / "models.toml", {"tiny": hf_checkpoint, "tiny2": other}, device="cpu",
                               max_batch=8)
    stack = Stack(redis_server.url, models, root)
    try:
        stack.start_worker()
        stack.web = stack.start_web()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def _settled(stack):
    """Each test starts and leaves with no batch running: a test that fails mid-batch leaves its
    lines cancelled, not running beside the next test's."""
    yield
    for key in (stack.alice, stack.bob):
        client = stack.client(key)
        for batch in client.batches.list(limit=100):
            if batch.status not in FINAL:
                if batch.status != "cancelling":
                    client.batches.cancel(batch.id)
                stack.wait(client, batch.id, timeout=60)


def body(i, model="tiny", max_tokens=4, **extra):
    return {"model": model, "prompt": f"Request number {i} says", "max_tokens": max_tokens, "seed": 1000 + i,
            "temperature": 1.0, "logit_bias": {str(EOS): -100}, **extra}


def jsonl(rows) -> bytes:
    return b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": b}).encode()
                    + b"\n" for cid, b in rows)


def submit(client, rows, **kwargs):
    upload = client.files.create(file=("input.jsonl", jsonl(rows)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h",
                                 **kwargs)


def wait_for(probe, what: str, timeout: float = 10.0):
    """Call `probe` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return found


def rows_of(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def one_by_one(client, bodies: dict[str, dict]) -> dict[str, str]:
    """The text of each request sent alone."""
    with ThreadPoolExecutor(6) as pool:
        texts = pool.map(lambda b: client.completions.create(**b).choices[0].text, bodies.values())
        return dict(zip(bodies, texts))


def check_exactly_once(client, batch, custom_ids):
    out, errors = rows_of(client, batch.output_file_id), rows_of(client, batch.error_file_id)
    seen = [row["custom_id"] for row in out + errors]
    assert sorted(seen) == sorted(custom_ids), "every line exactly once"
    assert batch.request_counts.total == len(custom_ids)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), len(errors))
    return out, errors


def test_round_trip_over_two_models(stack):
    client = stack.client()
    lines = {model: [(f"{model}-{i}", body(i, model)) for i in range(100)] for model in ("tiny", "tiny2")}
    created = {model: submit(client, rows, metadata={"model": model}) for model, rows in lines.items()}
    for model, batch in created.items():
        assert batch.status == "validating" and batch.metadata == {"model": model}
        assert batch.expires_at == batch.created_at + 86400 and batch.endpoint == "/v1/completions"
    done = {model: stack.wait(client, batch.id) for model, batch in created.items()}

    for model, batch in done.items():
        assert batch.status == "completed" and batch.model == model, batch
        assert batch.request_counts.model_dump() == {"total": 100, "completed": 100, "failed": 0}
        assert batch.error_file_id is None and batch.errors is None
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
        assert batch.usage.output_tokens == 400 and batch.usage.input_tokens > 0
        output = client.files.retrieve(batch.output_file_id)
        assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
        rows = rows_of(client, batch.output_file_id)
        assert sorted(row["custom_id"] for row in rows) == sorted(cid for cid, _ in lines[model])
        for row in rows:
            assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
            assert row["id"].startswith("batch_req_") and row["response"]["status_code"] == 200
            completion = row["response"]["body"]
            assert completion["object"] == "text_completion" and completion["model"] == model
            assert completion["usage"]["completion_tokens"] == 4
            assert row["response"]["request_id"] == completion["id"]
        # every output equals the same request sent alone (seeded)
        texts = {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in rows}
        assert texts == one_by_one(client, dict(lines[model]))
    # two different checkpoints really ran: the same request gives other texts on each
    texts = {model: {row["custom_id"].split("-")[-1]: row["response"]["body"]["choices"][0]["text"]
                     for row in rows_of(client, batch.output_file_id)} for model, batch in done.items()}
    assert sum(texts["tiny"][i] != texts["tiny2"][i] for i in texts["tiny"]) > 90

    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [created["tiny2"].id] and listed.has_more
    assert [b.id for b in client.batches.list(limit=5, after=created["tiny2"].id).data] == [created["tiny"].id]
    mine = {f.id for f in client.files.list(purpose="batch_output")}
    assert mine == {b.output_file_id for b in done.values()}


def test_ownership(stack):
    alice, bob = stack.client(), stack.client(stack.bob)
    batch = stack.wait(alice, submit(alice, [("only", body(0, max_tokens=2))]).id)
    assert batch.status == "completed"
    [row] = rows_of(alice, batch.output_file_id)
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.retrieve(batch.input_file_id), lambda: bob.files.content(batch.output_file_id),
                 lambda: bob.files.delete(batch.output_file_id),
                 lambda: bob.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.batches.list().data == [] and bob.files.list().data == []
    # the line's job is alice's like any job of hers (web/api/jobs.py)
    job_id = row["response"]["request_id"]
    assert alice.get(f"/jobs/{job_id}", cast_to=object)["status"] == "completed"
    with pytest.raises(openai.NotFoundError):
        bob.get(f"/jobs/{job_id}", cast_to=object)
    assert alice.files.delete(batch.input_file_id).deleted


def test_validation(stack):
    client = stack.client()
    malformed = client.files.create(file=("bad.jsonl", jsonl([("a", body(0))]) + b"{oops\n"), purpose="batch")
    duplicate = client.files.create(file=("dup.jsonl", jsonl([("a", body(0)), ("a", body(1))])), purpose="batch")
    mixed = client.files.create(file=("mixed.jsonl", jsonl([("a", body(0)), ("b", body(1, "tiny2"))])),
                                purpose="batch")
    failed = {name: client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
              for name, f in (("malformed", malformed), ("duplicate", duplicate), ("mixed", mixed))}
    expected = {"malformed": ("invalid_json_line", 2), "duplicate": ("duplicate_custom_id", 2),
                "mixed": ("model_mismatch", 2)}
    for name, batch in failed.items():
        batch = stack.wait(client, batch.id)
        assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
        assert [(e.code, e.line) for e in batch.errors.data] == [expected[name]]

    bad_bodies = [("ok", body(0, max_tokens=2)), ("hot", body(1, temperature=3)), ("long", body(2, max_tokens=500)),
                  ("streamed", body(3, stream=True)), ("tokens", {"model": "tiny", "prompt": [60000]})]
    batch = stack.wait(client, submit(client, bad_bodies).id)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {"total": 5, "completed": 1, "failed": 4}
    errors = {row["custom_id"]: row for row in rows_of(client, batch.error_file_id)}
    params = {cid: (row["response"]["status_code"], row["response"]["body"]["error"]["param"])
              for cid, row in errors.items()}
    assert params == {"hot": (400, "temperature"), "long": (400, "max_tokens"), "streamed": (400, "stream"),
                      "tokens": (400, "prompt")}
    assert [row["custom_id"] for row in rows_of(client, batch.output_file_id)] == ["ok"]

    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=malformed.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.param == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert err.value.param == "purpose"


def test_cancel_stops_the_rest_within_seconds(stack):
    client = stack.client()
    rows = [(f"c{i}", body(i, max_tokens=48)) for i in range(60)]
    batch = submit(client, rows)
    stack.wait(client, batch.id, check=lambda b: b.request_counts.completed >= 3)
    cancelling = client.batches.cancel(batch.id)
    started = time.monotonic()
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = stack.wait(client, batch.id, timeout=30)
    elapsed = time.monotonic() - started
    assert batch.status == "cancelled" and batch.cancelled_at and elapsed < 5, (batch.status, elapsed)
    out, errors = check_exactly_once(client, batch, [cid for cid, _ in rows])
    assert 3 <= len(out) < 60 and errors
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert all(row["response"] is None for row in errors)
    assert rq_json.queue(protocol.batch_queue_name("tiny"), stack.r).count == 0  # nothing left to run


def test_expiry(stack):
    web = stack.start_web(NANOSERVE_BATCH_WINDOW="3s")  # a second web tier whose "24h" lasts 3 s
    try:
        client = stack.client(web=web)
        rows = [(f"e{i}", body(i, max_tokens=64)) for i in range(200)]
        batch = submit(client, rows)
        assert batch.expires_at == batch.created_at + 3
        batch = stack.wait(client, batch.id, timeout=60)
    finally:
        web.stop()
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    out, errors = check_exactly_once(stack.client(), batch, [cid for cid, _ in rows])
    assert errors
    answered = [row for row in errors if row["error"] is None]  # lines that ran and failed
    assert not answered, answered[:3]
    assert {row["error"]["code"] for row in errors} == {"batch_expired"}
    assert all(row["response"]["status_code"] == 200 for row in out)


def test_worker_killed_mid_batch(stack):
    client = stack.client()
    rows = [(f"k{i}", body(i, max_tokens=24)) for i in range(48)]
    batch = submit(client, rows)
    stack.wait(client, batch.id, check=lambda b: b.request_counts.completed >= 6)
    registry = rq_json.started(protocol.batch_queue_name("tiny"), stack.r)
    # lines of one length end together: the next ones start a dispatcher tick later
    running = wait_for(registry.get_job_ids, "no line running")
    with stack.replacing_worker():
        stack.worker.kill()  # kill -9, the whole process group, with lines running
    batch = stack.wait(client, batch.id, timeout=120)
    assert batch.status == "completed" and batch.request_counts.failed == 0, \
        (batch.status, rows_of(client, batch.error_file_id)[:3], stack.state())
    out, _ = check_exactly_once(client, batch, [cid for cid, _ in rows])
    # the lines that were running were retried by rq on the new worker
    retried = [job for job in rq_json.fetch_many(running, stack.r) if job is not None]
    assert any(job.retries_left < 2 for job in retried)
    texts = {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in out}
    assert texts == one_by_one(client, dict(rows))  # resumed lines continue exactly where they were


def test_line_lost_between_dequeue_and_start(stack):
    """A worker killed after taking a line off the queue but before starting it leaves the line in
    the queue's intermediate list (here put there by hand, as the dead worker's dequeue would have):
    the new worker's registry maintenance retries it (after LOST_AFTER_S, worker/priority.py; the
    threshold itself is tested in tests/test_consumer.py) and it runs once."""
    client = stack.client()
    rows = [(f"l{i}", body(i, max_tokens=24)) for i in range(24)]
    batch = submit(client, rows)
    stack.wait(client, batch.id, check=lambda b: b.request_counts.completed >= 6)
    queue = rq_json.queue(protocol.batch_queue_name("tiny"), stack.r)
    with stack.replacing_worker():
        stack.worker.kill()
        # 6 lines in flight and 4 threads to run them: the dispatcher keeps 2 queued (a tick after
        # lines end), which no dead worker takes
        wait_for(lambda: stack.r.lmove(queue.key, queue.intermediate_queue_key), "no line queued")
    batch = stack.wait(client, batch.id, timeout=120)
    assert batch.status == "completed" and batch.request_counts.failed == 0, \
        (batch.status, rows_of(client, batch.error_file_id)[:3], stack.state())
    check_exactly_once(client, batch, [cid for cid, _ in rows])


def test_web_restarted_mid_batch(stack):
    client = stack.client()
    rows = [(f"w{i}", body(i, max_tokens=24)) for i in range(48)]
    batch = submit(client, rows)
    at_kill = stack.wait(client, batch.id, check=lambda b: b.request_counts.completed >= 6)
    stack.web.kill()  # kill -9: its dispatcher dies holding the batch's lease
    stack.web = stack.start_web()
    assert at_kill.request_counts.completed < 40  # most lines start after the restart
    client = stack.client()
    batch = stack.wait(client, batch.id, timeout=120)
    assert batch.status == "completed" and batch.request_counts.failed == 0, \
        (batch.status, rows_of(client, batch.error_file_id)[:3], stack.state())
    check_exactly_once(client, batch, [cid for cid, _ in rows])


def test_interactive_requests_keep_their_latency(stack):
    client = stack.client()

    def p50(n=12):
        latencies = []
        for i in range(n):
            started = time.perf_counter()
            client.completions.create(**body(10_000 + i, max_tokens=16))
            latencies.append(time.perf_counter() - started)
        return statistics.median(latencies)

    idle = p50()
    big = submit(client, [(f"b{i}", body(i, max_tokens=64)) for i in range(300)])
    stack.wait(client, big.id, check=lambda b: b.request_counts.completed >= 4)
    busy = p50()
    running = client.batches.retrieve(big.id)
    client.batches.cancel(big.id)
    print(f"\ninteractive p50: {idle * 1000:.0f} ms idle, {busy * 1000:.0f} ms with a 300-line batch running "
          f"({running.request_counts.completed} of its lines done meanwhile)")
    assert running.status == "in_progress" and running.request_counts.completed < 300  # it ran all along
    # Without priority the requests would queue behind the batch's lines (seconds each).
    assert busy < max(3 * idle, idle + 0.5), (idle, busy, stack.state())
    stack.wait(client, big.id, timeout=30)
