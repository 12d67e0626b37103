"""`python -m web.dev.devserver` (what `make serve` runs): it starts Redis, a worker and gunicorn, serves a
completion to the real openai client, and leaves nothing running after Ctrl-C or after a child dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest

from tests.stack import write_models_toml
from web.dev.local_redis import free_port

REPO = Path(__file__).resolve().parent.parent


class DevServer:
    def __init__(self, tmp_path: Path, models_file: Path):
        self.port = free_port()
        self.log_path = tmp_path / "devserver.log"
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")}
        env.update(NANOSERVE_MODELS=str(models_file), NANOSERVE_PORT=str(self.port), HF_HUB_OFFLINE="1",
                   NANOSERVE_WEB_WORKERS="1", NANOSERVE_WEB_THREADS="4")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "web.dev.devserver", "--model", "tiny",
                                             "--concurrency", "2"],
                                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"devserver exited early:\n{self.output()[-4000:]}"
            if "nanoserve is up" in self.output():
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    assert response.status == 200
                return
            time.sleep(0.2)
        raise AssertionError(f"devserver not ready in {timeout}s:\n{self.output()[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def kill(self) -> None:
        """Test cleanup only: whatever is left, gone."""
        procs = [psutil.Process(self.process.pid)] + self.descendants() if self.process.poll() is None else []
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()


def command_line(proc: psutil.Process) -> str:
    """A process's command line; "" for one that has exited (the worker's compile leaves short-lived
    compiler processes, some of them zombies for a moment)."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def still_running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.cmdline()))
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture()
def devserver(tmp_path, hf_checkpoint):
    # Two models, one served (as `make serve` serves one of models/models.toml): /ready stays 503
    # for the other, and the devserver must still see that its own model is up.
    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint, "unserved": hf_checkpoint})
    server = DevServer(tmp_path, models)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.mark.slow
def test_serves_and_ctrl_c_stops_everything(devserver):
    assert "curl " in devserver.output() and "OpenAI(base_url=" in devserver.output()  # how to call it
    assert "models: tiny\n" in devserver.output()
    client = openai.OpenAI(base_url=devserver.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5,
                                           temperature=0)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"

    children = devserver.descendants()
    names = " ".join(command_line(p) for p in children)
    assert "redis-server" in names and "processor.py" in names and "gunicorn" in names
    redis_port = next(c.laddr.port for p in children if "redis-server" in command_line(p)
                      for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN)

    devserver.process.send_signal(signal.SIGINT)
    assert devserver.process.wait(timeout=90) == 0, devserver.output()[-3000:]
    assert still_running(children) == []
    assert "devserver: stopped" in devserver.output()
    with pytest.raises(OSError):  # Redis is gone too
        import socket
        socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()


@pytest.mark.slow
def test_a_dying_child_stops_everything(devserver):
    children = devserver.descendants()
    worker = next(p for p in children if "processor.py" in command_line(p))
    worker.kill()  # kill -9: the worker crashes
    assert devserver.process.wait(timeout=90) == 1
    assert "worker (processor.py) exited with code -9; stopping everything" in devserver.output()
    assert still_running(children) == []


def test_the_web_tier_never_imports_torch():
    code = ("import importlib, pkgutil, sys, web, wsgi\n"
            "for module in pkgutil.walk_packages(web.__path__, 'web.'):\n"
            "    importlib.import_module(module.name)\n"
            "assert 'web.dev.devserver' in sys.modules and 'web.api.completions' in sys.modules\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, NANOSERVE_MODELS=str(REPO / "models" / "models.toml"))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("host, configured, expected, warned", [
    ("127.0.0.1", None, "disabled", False), ("localhost", "", "disabled", False), ("::1", None, "disabled", False),
    ("0.0.0.0", None, "required", False), ("192.168.1.5", None, "required", False), ("::", None, "required", False),
    ("0.0.0.0", "disabled", "disabled", True), ("0.0.0.0", "required", "required", False),
    ("127.0.0.1", "required", "required", False),
])
def test_keys_are_required_beyond_loopback_unless_disabled_with_a_warning(capsys, host, configured, expected, warned):
    from web.dev.devserver import default_auth

    assert default_auth(host, configured) == expected
    assert ("WARNING" in capsys.readouterr().err) == warned


def test_the_default_model_is_trained_only_when_it_is_served():
    """`make serve MODEL=gpt2` serves the Hub's GPT-2 without training shakespeare-char first."""
    from web.dev.devserver import trains_default_model

    env = {k: v for k, v in os.environ.items() if k != "NANOSERVE_MODELS"}  # the default registry
    assert trains_default_model(["shakespeare-char"], env)
    assert not trains_default_model(["gpt2"], env) and not trains_default_model(["gpt-2"], env)  # an alias
    assert trains_default_model(["gpt2", "shakespeare-char"], env)
    assert not trains_default_model(["no-such-model"], env)
