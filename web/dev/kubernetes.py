"""Kubernetes manifests for nanoserve, rendered from one set of values (docs/kubernetes/values.toml)
and the models a registry names:

    python -m web.dev.kubernetes --values docs/kubernetes/values.toml --models models/models.toml > nanoserve.yaml
    kubectl apply -f nanoserve.yaml        # after: kubectl create secret generic nanoserve-redis --from-literal=password=…

- Redis: a StatefulSet with its append-only file on a persistent volume, a password from the Secret,
  a memory cap without eviction, and a Service.
- The web tier: a Deployment of gunicorn (threaded, for streams) behind a Service, the registry from
  a ConfigMap; liveness and readiness on `/health` (a web pod serves as long as it runs: `/ready`, which
  also wants a live worker for every model, is the whole deployment's check, for monitoring).
- A worker Deployment per model, one GPU each where the model runs on a GPU, liveness on its metrics
  port, and a termination grace long enough to finish running jobs (SIGTERM: it takes no new job).
- KEDA: a ScaledObject per model on the length of its rq queues (`rq:queue:completions:<model>` and
  `rq:queue:batch:<model>`, the Redis lists rq keeps), with the Redis password through a
  TriggerAuthentication. At least one worker always runs: web answers 503 for a model with none.

Every document is JSON, which is YAML: no YAML library needed to write it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from models.registry import DEFAULT_PATH, Registry
from worker import protocol

DEFAULTS: dict[str, Any] = {
    "name": "nanoserve",
    "image": "nanoserve:cuda",  # the worker's (docker-compose.yml builds both)
    "web_image": "nanoserve:cpu",
    "hf_cache_claim": "",  # a PersistentVolumeClaim holding the Hugging Face cache (hf: models); "": none
    "redis": {"image": "redis:7.4-alpine", "storage": "20Gi", "maxmemory": "4gb", "secret": "nanoserve-redis"},
    "web": {"replicas": 2, "workers": 4, "threads": 1024, "port": 8000, "cpu": "2", "memory": "4Gi"},
    "worker": {"gpus": 1, "cpu": "4", "memory": "16Gi", "metrics_port": 9100, "grace_seconds": 120,
               "min_replicas": 1, "max_replicas": 4, "queue_length": 16, "startup_seconds": 600},
}
# beside the image's /app/checkpoints, so the registry's relative paths ("../checkpoints/…") hold
MODELS_DIR = "/app/config"
HF_HOME = "/data/hf"


def values_from(path: Path | None) -> dict[str, Any]:
    """The defaults, overridden by what the TOML file at `path` sets (section by section)."""
    values = copy.deepcopy(DEFAULTS)
    if path is not None:
        with open(path, "rb") as f:
            given = tomllib.load(f)
        unknown = [key for key in given if key not in DEFAULTS] + [
            f"{section}.{key}" for section in given if isinstance(DEFAULTS.get(section), dict)
            for key in given[section] if key not in DEFAULTS[section]]
        if unknown:
            raise ValueError(f"{path}: unknown values: {', '.join(unknown)}")
        for key, value in given.items():
            if isinstance(value, dict):
                values[key].update(value)
            else:
                values[key] = value
    return values


def render(values: dict[str, Any], registry: Registry, models_toml: str) -> list[dict[str, Any]]:
    """The manifests, in the order `kubectl apply` takes them."""
    name, redis, web, worker = values["name"], values["redis"], values["web"], values["worker"]
    redis_host = f"{name}-redis"
    password = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": redis["secret"], "key": "password"}}}
    env = [password, {"name": "REDIS_URL", "value": f"redis://:$(REDIS_PASSWORD)@{redis_host}:6379/0"},
           {"name": "NANOSERVE_MODELS", "value": f"{MODELS_DIR}/models.toml"}, {"name": "HF_HOME", "value": HF_HOME}]
    # the registry, and the Hugging Face cache where hf: models' files are (web reads their tokenizers)
    claim = values["hf_cache_claim"]
    shared = [{"name": "models", "configMap": {"name": f"{name}-models"}},
              {"name": "hf-cache", **({"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}})}]
    mounts = [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}, {"name": "hf-cache", "mountPath": HF_HOME}]
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{name}-models", name),
         "data": {"models.toml": models_toml}},
        _service(redis_host, name, "redis", 6379),
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(redis_host, name, "redis"),
         "spec": {"serviceName": redis_host, "replicas": 1, "selector": _selector(name, "redis"),
                  "template": {"metadata": {"labels": _labels(name, "redis")}, "spec": {"containers": [{
                      "name": "redis", "image": redis["image"],
                      # AOF fsynced every second; a memory cap without eviction (a 503, never a lost job)
                      "args": ["--appendonly", "yes", "--appendfsync", "everysec", "--requirepass", "$(REDIS_PASSWORD)",
                               "--maxmemory", redis["maxmemory"], "--maxmemory-policy", "noeviction"],
                      "env": [password, {"name": "REDISCLI_AUTH", "value": "$(REDIS_PASSWORD)"}],
                      "ports": [{"containerPort": 6379, "name": "redis"}],
                      "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
                      "livenessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 10},
                      "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]}},
                  "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                      "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": redis["storage"]}}}}]}},
        _service(f"{name}-web", name, "web", web["port"]),
        _deployment(f"{name}-web", name, "web", web["replicas"], {
            "name": "web", "image": values["web_image"],
            "command": ["gunicorn", "wsgi:app", "--bind", f"0.0.0.0:{web['port']}", "--worker-class", "gthread",
                       "--workers", str(web["workers"]), "--threads", str(web["threads"]), "--graceful-timeout", "30"],
            "env": env + [{"name": "NANOSERVE_AUTH", "value": "required"},
                          {"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/run/nanoserve-metrics"}],
            "ports": [{"containerPort": web["port"], "name": "http"}],
            "readinessProbe": _http("/health", web["port"], 5),
            "livenessProbe": _http("/health", web["port"], 10),
            "resources": _resources(web["cpu"], web["memory"]),
            "volumeMounts": mounts + [{"name": "metrics", "mountPath": "/run/nanoserve-metrics"}]},
            shared + [{"name": "metrics", "emptyDir": {"medium": "Memory"}}], 40),
        {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication", "metadata": _meta(f"{name}-redis", name),
         "spec": {"secretTargetRef": [{"parameter": "password", "name": redis["secret"], "key": "password"}]}},
    ]
    for spec in registry.models():
        on_gpu = spec.device != "cpu" and worker["gpus"] > 0
        deployment = f"{name}-worker-{_dns(spec.id)}"
        container = {
            "name": "worker", "image": values["image"],
            "command": ["python", "processor.py", "--model", spec.id, "--device", "all" if on_gpu else "cpu",
                        "--metrics-port", str(worker["metrics_port"])],
            "env": env, "ports": [{"containerPort": worker["metrics_port"], "name": "metrics"}],
            # the first start loads (and may compile) the model: the liveness probe waits for it
            "startupProbe": {**_http("/metrics", worker["metrics_port"], 10),
                             "failureThreshold": max(1, worker["startup_seconds"] // 10)},
            "livenessProbe": _http("/metrics", worker["metrics_port"], 15),
            "resources": _resources(worker["cpu"], worker["memory"], worker["gpus"] if on_gpu else 0),
            "volumeMounts": mounts + [{"name": "cache", "mountPath": "/home/nanoserve/.cache/nanoserve"}]}
        docs.append(_deployment(deployment, name, f"worker-{_dns(spec.id)}", worker["min_replicas"], container,
                                shared + [{"name": "cache", "emptyDir": {}}], worker["grace_seconds"]))
        docs.append({
            "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(deployment, name),
            "spec": {"scaleTargetRef": {"name": deployment}, "minReplicaCount": max(1, worker["min_replicas"]),
                     "maxReplicaCount": worker["max_replicas"],
                     "triggers": [{"type": "redis", "authenticationRef": {"name": f"{name}-redis"},
                                   "metadata": {"address": f"{redis_host}:6379", "listName": f"rq:queue:{queue}",
                                                "listLength": str(worker["queue_length"]), "databaseIndex": "0"}}
                                  for queue in (protocol.queue_name(spec.id), protocol.batch_queue_name(spec.id))]}})
    return docs


def _labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component}


def _meta(object_name: str, name: str, component: str | None = None) -> dict[str, Any]:
    return {"name": object_name, "labels": _labels(name, component or "config")}


def _selector(name: str, component: str) -> dict[str, Any]:
    return {"matchLabels": _labels(name, component)}


def _service(object_name: str, name: str, component: str, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(object_name, name, component),
            "spec": {"selector": _labels(name, component), "ports": [{"port": port, "targetPort": port, "name": component}]}}


def _deployment(object_name: str, name: str, component: str, replicas: int, container: dict, volumes: list,
                grace_seconds: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(object_name, name, component),
            "spec": {"replicas": replicas, "selector": _selector(name, component),
                     "template": {"metadata": {"labels": _labels(name, component)},
                                  "spec": {"terminationGracePeriodSeconds": grace_seconds, "containers": [container],
                                           "volumes": volumes}}}}


def _http(path: str, port: int, period: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 3}


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    limits = {"memory": memory, **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}


def _dns(model_id: str) -> str:
    """A model id as a DNS label (Kubernetes names): lower case, [a-z0-9-]."""
    label = "".join(c if c.isalnum() else "-" for c in model_id.lower()).strip("-")
    return label[:40] or "model"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=Path, help="a TOML file of values (default: the built-in ones)")
    parser.add_argument("--models", type=Path, default=None, help="models.toml (default: $NANOSERVE_MODELS or the packaged one)")
    args = parser.parse_args(argv)
    path = Path(args.models or os.environ.get("NANOSERVE_MODELS") or DEFAULT_PATH)
    registry = Registry.from_file(path)
    for doc in render(values_from(args.values), registry, path.read_text()):
        sys.stdout.write("---\n" + json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
