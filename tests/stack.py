"""Start the real stack for end-to-end tests: `processor.py` workers and gunicorn, as subprocesses.

    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint})
    with start_processor(redis_url, models, concurrency=4) as worker, \
         start_gunicorn(redis_url, models) as web:
        client = openai.OpenAI(base_url=web.url + "/v1", api_key="x")
        ...

Every process runs in a process group of its own and is stopped with its whole group, so nothing
outlives a test (`stop()` is also safe to call twice, and on a process that died). Each process's
output goes to a log file whose tail is shown when it fails to start.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import redis

from web.dev.local_redis import free_port

REPO = Path(__file__).resolve().parent.parent


def write_models_toml(path: Path, models: dict[str, Path | str], **options) -> Path:
    """A registry naming each checkpoint; `options` (device, max_batch, dtype, …) apply to every
    model. Example: `write_models_toml(p, {"tiny": ckpt_dir}, device="cpu", max_batch=8)`."""
    lines = []
    for model_id, checkpoint in models.items():
        lines.append(f"[models.{model_id}]")
        lines.append(f"checkpoint = {_toml_value(str(checkpoint))}")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in options.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class Service:
    """A subprocess in its own process group, with its output in `log_path`."""

    name: str
    process: subprocess.Popen
    log_path: Path
    url: str | None = None
    info: dict = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # what "started" means for this service

    def wait_ready(self, timeout: float = 240.0) -> "Service":
        """Wait until `ready()` holds (for a service spawned with `wait=False`)."""
        _wait_until(self, self.ready, timeout, "readiness")
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        """Send a signal to the main process only (a worker's SIGTERM drain, a SIGKILL crash)."""
        if self.alive():
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """kill -9 the whole group: a crash, as far as Redis and rq can tell."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the group, wait, then SIGKILL what is left of it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # The group may hold children that outlive the leader (gunicorn workers).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        return self.process.returncode


def _spawn(name: str, args: list[str], env: dict[str, str], log_dir: Path | None,
           via: Sequence[str] = ()) -> Service:
    """`via`: what runs the command, e.g. `ip netns exec NAME` (tests/netns.py's hosts); it must
    exec the command, so the process is the command itself."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="nanoserve-stack-"))
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*via, *args], cwd=REPO, env={**os.environ, **env}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Service(name, process, log_path)


def _wait_until(service: Service, ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise RuntimeError(f"{service.name} exited with code {service.process.returncode} before "
                               f"{what}; log tail:\n{service.logs()[-4000:]}")
        try:
            if ready():
                return
        except (OSError, redis.RedisError):
            pass
        time.sleep(0.1)
    service.stop()
    raise RuntimeError(f"{service.name}: no {what} within {timeout}s; log tail:\n{service.logs()[-4000:]}")


def registered_workers(redis_url: str, model_id: str) -> set[str]:
    """Names of the live rq workers listening on a model's queue."""
    from rq.worker_registration import get_keys

    from tests import rq_json
    from worker import protocol

    client = protocol.redis_client(redis_url)
    try:
        keys = sorted(get_keys(rq_json.queue(protocol.queue_name(model_id), client)))
        alive = [key for key in keys if client.exists(key)]
        return {key.removeprefix("rq:worker:") for key in alive}
    finally:
        client.close()


def spawn_processor(redis_url: str, models_file: Path, *, models: list[str] | None = None,
                    concurrency: int | None = None, device: str | None = None, heartbeat: float | None = None,
                    compile: bool | None = False, extra_args: list[str] = (), env: dict[str, str] | None = None,
                    log_dir: Path | None = None, timeout: float = 240.0, wait: bool = True,
                    via: Sequence[str] = (), warmed: bool = False) -> Service:
    """Start `processor.py` and wait until its engines' rq workers are registered on every model's queue
    (with `wait=False`, return at once; `service.wait_ready()` waits later), and with `warmed`
    until every engine's background compile has ended too (a benchmark's steady state). `compile`:
    the worker's --compile / --no-compile, None for its default (uncompiled unless asked: most
    tests start workers on tiny models, where compiling would only cost time)."""
    args = [sys.executable, "processor.py", "--redis-url", redis_url]
    for model in models or []:
        args += ["--model", model]
    if concurrency is not None:
        args += ["--concurrency", str(concurrency)]
    if device is not None:
        args += ["--device", device]
    if heartbeat is not None:
        args += ["--heartbeat", str(heartbeat)]
    if compile is not None:
        args.append("--compile" if compile else "--no-compile")
    args += list(extra_args)
    service = _spawn("processor", args, {"REDIS_URL": redis_url, "NANOSERVE_MODELS": str(models_file),
                                         **(env or {})}, log_dir, via)
    service.info["redis_url"] = redis_url
    if models is None:
        from models.registry import Registry

        models = [spec.id for spec in Registry.from_file(models_file).models()]
    prefix = f"{socket.gethostname()}:{service.pid}:"  # how processor.py names its rq workers
    # one engine per listed device, each one rq worker
    engines = len(device.split(",")) if device and device not in ("all", "auto") else 1

    def ready() -> bool:
        mine = {model: {name for name in registered_workers(redis_url, model) if name.startswith(prefix)}
                for model in models}
        service.info["workers"] = mine
        registered = all(len(names) >= engines for names in mine.values())
        return registered and (not warmed or not compiling(service.logs()))

    service.ready = ready
    return service.wait_ready(timeout) if wait else service


def spawn_gunicorn(redis_url: str, models_file: Path, *, port: int | None = None, workers: int = 2,
                   threads: int = 16, env: dict[str, str] | None = None, log_dir: Path | None = None,
                   timeout: float = 60.0, worker_class: str = "gthread", host: str = "127.0.0.1",
                   via: Sequence[str] = ()) -> Service:
    """Start `gunicorn wsgi:app` on `host` and wait until /health answers. `worker_class`: gthread
    (`threads` each) or gevent (a greenlet per connection, up to 10000)."""
    port = port or free_port()
    concurrency = ["--threads", str(threads)] if worker_class == "gthread" else ["--worker-connections", "10000"]
    args = [sys.executable, "-m", "gunicorn", "-k", worker_class, *concurrency, "-w", str(workers),
            "-b", f"{host}:{port}", "--graceful-timeout", "5", "--no-control-socket", "wsgi:app"]
    service = _spawn("gunicorn", args, {"REDIS_URL": redis_url, "NANOSERVE_MODELS": str(models_file),
                                        **(env or {})}, log_dir, via)
    service.url = f"http://{host}:{port}"

    def ready() -> bool:
        with urllib.request.urlopen(service.url + "/health", timeout=1) as response:
            return response.status == 200

    service.ready = ready
    return service.wait_ready(timeout)


def compiling(logs: str) -> bool:
    """Whether a worker's log says an engine's graphs still compile in the background."""
    said = [line for line in logs.splitlines() if line.startswith("{")]
    started = sum('"engine ready"' in line and '"warming_up": true' in line for line in said)
    ended = sum('"decode step compiled"' in line or '"compiling the decode step failed' in line for line in said)
    return ended < started


@contextlib.contextmanager
def start_processor(redis_url: str, models_file: Path, **kwargs) -> Iterator[Service]:
    """`spawn_processor` as a context manager that always stops it."""
    service = spawn_processor(redis_url, models_file, **kwargs)
    try:
        yield service
    finally:
        service.stop()


@contextlib.contextmanager
def start_gunicorn(redis_url: str, models_file: Path, **kwargs) -> Iterator[Service]:
    """`spawn_gunicorn` as a context manager that always stops it."""
    service = spawn_gunicorn(redis_url, models_file, **kwargs)
    try:
        yield service
    finally:
        service.stop()
