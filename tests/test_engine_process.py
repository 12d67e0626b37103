"""An engine in a process of its own (worker/engine_process.py), as processor.py builds it
(`build_served_engine`), held against the same engine in this process: the same completions and the
same events in the same order, each job's events ahead of its end, the writer's cancels reaching
the child, the engine's refusals and faults reaching the caller as the engine raised them."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from models.registry import Registry
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from processor import build_served_engine
from tests.compare import assert_same_completion
from worker import protocol
from worker.engine import Engine
from worker.engine_process import EngineBuildError, EngineProcess
from worker.errors import EngineError, EngineFault, RequestCancelled

MODEL = "tiny"
EOS = 50256


@pytest.fixture(scope="module")
def spec(hf_checkpoint, tmp_path_factory):
    from tests.stack import write_models_toml

    path = write_models_toml(tmp_path_factory.mktemp("engine-process") / "models.toml", {MODEL: hf_checkpoint},
                             device="cpu", max_batch=8)
    return Registry.from_file(path).get(MODEL)


class Sink:
    """What the worker's StreamWriter is to the engine: takes a step's events, answers with the jobs
    to cancel (those in `cancel`, once each)."""

    def __init__(self, cancel=()):
        self.events: list[tuple] = []
        self.cancel = set(cancel)

    def __call__(self, events):
        self.events.extend(events)
        hits = {job_id for job_id, _, _ in events} & self.cancel
        self.cancel -= hits
        return hits

    def of(self, job_id: str) -> list[tuple[str, dict]]:
        return [(kind, data) for j, kind, data in self.events if j == job_id]


@pytest.fixture(scope="module")
def apart(spec):
    """The engine in a process of its own, with a sink whose cancels a test may set."""
    sink = Sink()
    engine = EngineProcess(functools.partial(build_served_engine, spec, "cpu", {"compile": False}), sink)
    engine.sink = sink
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def here(spec):
    sink = Sink()
    engine = Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=8, max_len=spec.context_length,
                    event_sink=sink)
    engine.start()
    engine.sink = sink
    yield engine
    engine.stop()


def jobs() -> list[protocol.CompletionJob]:
    """Greedy with logprobs and echo, seeded sampling of two choices with a stop, a streamed one."""
    return [
        protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464, 318, 257]], max_tokens=12,
                               temperature=0.0, seed=1, logprobs=3, echo=True, logit_bias={EOS: -100.0}),
        protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464, 330]], max_tokens=16,
                               temperature=1.0, seed=7, n=2, stop=["e"], logit_bias={EOS: -100.0}),
        protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[100, 200, 300]], max_tokens=9,
                               temperature=0.7, seed=3, stream=True, logprobs=1),
    ]


def tokens_by_event(events: list[tuple[str, dict]]) -> list[tuple[str, int | None, list[int] | None]]:
    return [(kind, data.get("index"), data.get("token_ids")) for kind, data in events]


def without_ids(value):
    """A completion without what names its job (its id and creation time)."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def test_the_engine_process_answers_and_streams_as_the_engine_in_this_process(apart, here):
    results = {}
    for name, engine in (("apart", apart), ("here", here)):
        submitted = jobs()
        handles = [engine.submit(job) for job in submitted]
        results[name] = [(job.id, handle.result(timeout=60)) for job, handle in zip(submitted, handles)]
    for (apart_id, apart_result), (here_id, here_result) in zip(results["apart"], results["here"]):
        # the same tokens and texts; logprobs within float noise (the child's engine takes the machine's
        # planned matmul kernels, and its batches may form a step apart)
        assert_same_completion(without_ids(apart_result), without_ids(here_result))
        # the same events, in the same order, the terminal one last
        assert tokens_by_event(apart.sink.of(apart_id)) == tokens_by_event(here.sink.of(here_id))
        assert apart.sink.of(apart_id)[-1][0] in protocol.TERMINAL_EVENTS
    assert apart.slots == here.slots == 8
    stats = apart.stats()
    assert stats["steps"] > 0 and stats["busy_seconds"] > 0 and not apart.warming and apart.is_alive()


def test_a_jobs_end_reaches_its_handle_after_its_events(apart):
    """The consumer records a job's end once its events are written: the pipe must not hand over an
    end before the events of that job's last step."""
    job = jobs()[0]
    seen_at_end = []
    handle = apart.submit(job)
    handle.add_done_callback(lambda h: seen_at_end.append([kind for kind, _ in apart.sink.of(job.id)]))
    handle.result(timeout=60)
    [kinds] = seen_at_end
    assert kinds[-1] in protocol.TERMINAL_EVENTS and kinds.count("delta") >= 1


def test_a_cancel_the_writer_finds_reaches_the_engine_process(apart):
    """The writer answers a step's events with the jobs whose cancel flag it found set: the worker
    sends them to the child, whose engine ends the job as cancelled."""
    job = protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464]], max_tokens=100,
                                 temperature=0.0, seed=1, logit_bias={EOS: -100.0})
    apart.sink.cancel.add(job.id)
    with pytest.raises(RequestCancelled):
        apart.submit(job).result(timeout=60)
    kinds = [kind for kind, _ in apart.sink.of(job.id)]
    assert kinds[-1] == "cancelled" and kinds.count("delta") < 100


def test_the_engines_refusal_reaches_the_caller_as_the_engine_raised_it(apart, here):
    """A job the engine refuses (a resumed choice whose tokens do not fit it) fails its handle with
    the engine's own error: its class, message, type and param survive the pipe."""
    errors = []
    for engine in (apart, here):
        job = jobs()[0]
        with pytest.raises(EngineError) as raised:
            engine.submit(job, resume={0: [10 ** 6]}).result(timeout=60)
        errors.append(raised.value)
    assert type(errors[0]) is type(errors[1]) and not isinstance(errors[0], EngineFault)
    assert [(e.message, e.type, e.param, e.code, e.status) for e in errors][0] == \
        [(e.message, e.type, e.param, e.code, e.status) for e in errors][1]


def test_stopping_fails_the_running_jobs_with_a_fault_and_ends_the_child(spec, tmp_path):
    """`stop` stops the child's engine, whose running jobs fail with EngineFault (rq retries those),
    and then the child; a build that fails says why."""
    sink = Sink()
    engine = EngineProcess(functools.partial(build_served_engine, spec, "cpu", {"compile": False}), sink)
    job = protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464]],
                                 max_tokens=spec.context_length - 1, temperature=0.0, seed=1, logit_bias={EOS: -100.0})
    handle = engine.submit(job)
    engine.stop()
    with pytest.raises(EngineFault):
        handle.result(timeout=10)
    assert not engine.is_alive() and not engine.warming
    with pytest.raises(EngineFault):  # a job submitted after the stop fails at once
        engine.submit(jobs()[0]).result(timeout=5)

    broken = dataclasses.replace(spec, checkpoint=str(tmp_path / "no-checkpoint"))
    with pytest.raises(EngineBuildError, match="no-checkpoint"):
        EngineProcess(functools.partial(build_served_engine, broken, "cpu", {"compile": False}), Sink())


def test_a_killed_engine_process_fails_its_jobs_at_once(spec):
    """The child killed (SIGKILL, the OOM killer) while a job runs in it: the job's handle fails with
    EngineFault as soon as the pipe ends (rq retries such a job), and the engine reads as dead."""
    import os
    import signal

    engine = EngineProcess(functools.partial(build_served_engine, spec, "cpu", {"compile": False}), Sink())
    try:
        os.kill(engine._process.pid, signal.SIGSTOP)  # held, so the job is in it when it dies
        job = protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464]], seed=1,
                                     max_tokens=8, temperature=0.0, logit_bias={EOS: -100.0})
        handle = engine.submit(job)
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineFault):
            handle.result(timeout=10)
        assert not engine.is_alive()
    finally:
        engine.stop()


def test_ctrl_c_to_the_workers_group_drains_it_and_leaves_no_engine_process(redis_server, spec, tmp_path):
    """Ctrl-C reaches every process of the worker's group: the engine's process ignores it, the
    worker takes no new jobs, finishes its running ones through the child, stops it and exits 0."""
    import os
    import signal
    import time

    import redis
    from rq.job import JobStatus

    from tests import rq_json
    from tests.stack import start_processor, write_models_toml

    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    models_file = write_models_toml(tmp_path / "models.toml", {MODEL: spec.checkpoint}, device="cpu", max_batch=8)
    queue = rq_json.queue(protocol.queue_name(MODEL), r)

    def enqueue(max_tokens: int):
        job = protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[[464]], seed=1,
                                     max_tokens=max_tokens, temperature=0.0, logit_bias={EOS: -100.0})
        return queue.enqueue_call(protocol.JOB_FUNCTION, args=(job.to_payload(),), job_id=job.id,
                                  result_ttl=protocol.RESULT_TTL)

    with start_processor(url, models_file, concurrency=4, log_dir=tmp_path, extra_args=["--engine-process"]) as worker:
        [child] = [line for line in worker.logs().splitlines() if "engine in a process of its own" in line]
        child = int(child.split('"pid": ')[1].split("}")[0].split(",")[0])
        running = [enqueue(100) for _ in range(2)]
        deadline = time.monotonic() + 30
        while not all(r.exists(protocol.stream_key(job.id)) for job in running):
            assert time.monotonic() < deadline, "the jobs never started"
            time.sleep(0.01)
        os.killpg(worker.process.pid, signal.SIGINT)
        time.sleep(0.3)
        assert alive(child)  # the engine's process did not take the signal as its own stop
        while "taking no new jobs" not in worker.logs():
            assert time.monotonic() < deadline and worker.alive()
            time.sleep(0.05)
        late = enqueue(8)
        assert worker.wait(timeout=60) == 0
    for job in running:
        assert job.get_status() == JobStatus.FINISHED
        assert job.return_value()["usage"]["completion_tokens"] == 100
    assert late.get_status() == JobStatus.QUEUED
    assert '"msg": "stopped"' in worker.logs()
    assert not alive(child)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read().lower()
    except FileNotFoundError:
        return False
