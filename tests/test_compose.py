"""docker-compose.yml, its CPU override and the Dockerfile (Docker itself does not run here): they parse,
name the services, and every command they run is one our programs accept."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from models.registry import Registry

REPO = Path(__file__).resolve().parent.parent


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!reset`, `!override`), kept as ("!reset", value)."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return node.tag, loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return node.tag, loader.construct_sequence(node, deep=True)
    return node.tag, loader.construct_scalar(node)


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _tagged)


def load(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def cpu() -> dict:
    return load("docker-compose.cpu.yml")


def env(service: dict) -> dict:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def test_services(compose):
    assert {"redis", "web", "worker", "rq-dashboard"} <= set(compose["services"])


def test_redis_persists_with_aof_and_has_a_healthcheck(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_redis_takes_a_password_and_never_evicts(compose):
    """Whoever reaches Redis controls the queue (rq runs what a job names): it needs the password, and
    past its memory cap it refuses writes instead of dropping queued jobs, keys or the blocklist."""
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction" and "--maxmemory" in command
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")  # for the healthcheck
    for service in ("web", "worker"):
        assert "${REDIS_PASSWORD:?" in env(compose["services"][service])["REDIS_URL"]


def test_the_image_requires_keys_and_compose_puts_metrics_behind_them(compose):
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ENV NANOSERVE_AUTH=required", dockerfile, re.M)  # its command listens on 0.0.0.0
    web = env(compose["services"]["web"])
    assert web["NANOSERVE_AUTH"] == "required" and web.get("NANOSERVE_METRICS_AUTH") in (None, "required")


def test_web_is_threaded_gunicorn_with_auth_and_multiprocess_metrics(compose):
    web = compose["services"]["web"]
    command = web["command"]
    assert command[:2] == ["gunicorn", "wsgi:app"]
    assert command[command.index("--worker-class") + 1] == "gthread"
    assert env(web)["NANOSERVE_AUTH"] == "required"
    assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:\?[^}]*\}@redis:6379/0", env(web)["REDIS_URL"])
    assert env(web)["PROMETHEUS_MULTIPROC_DIR"] in web["tmpfs"]  # empty at every start
    assert web["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "8000:8000" in web["ports"]


def test_gunicorn_accepts_the_web_command(compose):
    from gunicorn.config import Config

    command = compose["services"]["web"]["command"]
    parsed = Config().parser().parse_args(command[1:])
    assert parsed.worker_class == "gthread" and parsed.threads >= 2 and parsed.args == ["wsgi:app"]


def test_worker_reserves_gpus_and_shares_the_caches(compose):
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    mounts = {volume.split(":")[1] for volume in worker["volumes"]}
    assert {"/app/checkpoints", env(worker)["HF_HOME"]} <= mounts
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["stop_grace_period"]  # time to finish running jobs on SIGTERM


def test_named_volumes_are_declared(compose, cpu):
    used = {volume.split(":")[0] for file in (compose, cpu) for service in file["services"].values()
            for volume in service.get("volumes", []) if not volume.startswith((".", "/"))}
    assert used <= set(compose["volumes"])


def test_dashboard_is_optional(compose):
    assert compose["services"]["rq-dashboard"]["profiles"] == ["dashboard"]


def test_cpu_override_drops_the_gpu_and_prepares_the_default_model(cpu):
    worker = cpu["services"]["worker"]
    assert worker["deploy"][0] == "!reset"
    command = worker["command"]
    assert command[command.index("--device") + 1] == "cpu"
    assert worker["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert "ensure_default_model" in " ".join(cpu["services"]["prepare"]["command"])


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_worker_command_is_one_processor_accepts(file):
    import processor

    command = load(file)["services"]["worker"]["command"]
    assert command[:2] == ["python", "processor.py"]
    args = processor.parse_args(command[2:])  # exits on an unknown flag
    registry = Registry.from_file(REPO / "models" / "models.toml")
    for name in args.models:
        registry.get(name)  # served models exist in the image's registry


def test_the_worker_image_has_a_compiler_and_keeps_what_it_builds():
    # torch.compile's decode step and the project's own kernels need a C++ compiler, and their
    # builds a directory that outlives the container (nanogpt/runtime/compile_cache.py, nanogpt/kernels/extension.py)
    from nanogpt.kernels import extension
    from nanogpt.runtime import compile_cache

    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    assert any(line.startswith("RUN apt-get") and " g++ " in line for line in lines)
    assert "useradd --create-home --uid 1000 nanoserve" in " ".join(lines) and "USER nanoserve" in lines
    worker = load("docker-compose.yml")["services"]["worker"]
    cache = next(v for v in worker["volumes"] if v.endswith(":/home/nanoserve/.cache/nanoserve"))
    assert cache.split(":")[0] in load("docker-compose.yml")["volumes"]
    home = Path("/home/nanoserve")
    for directory in (extension.directory, compile_cache.default_directory):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HOME", str(home))
            mp.delenv(extension.ENV, raising=False)
            mp.delenv(compile_cache.ENV, raising=False)
            assert directory().is_relative_to(home / ".cache" / "nanoserve")


def test_dockerfile_builds_from_python_slim_with_a_torch_choice():
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    arg = next(line for line in lines if line.startswith("ARG TORCH_INSTALL="))
    assert "/whl/cpu" in arg  # CPU by default
    assert any(line.startswith("RUN pip install ${TORCH_INSTALL}") for line in lines)
    cmd = next(line for line in lines if line.startswith("CMD "))
    assert "gthread" in shlex.split(cmd.removeprefix("CMD ").replace(",", " ").replace("[", "").replace("]", ""))
