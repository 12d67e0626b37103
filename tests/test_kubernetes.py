"""The Kubernetes manifests (web/dev/kubernetes.py) as `kubectl apply` would take them: every core
object valid against Kubernetes' own schemas (kubernetes-validate, offline), the worker's command one
processor.py accepts, and KEDA scaling each model's deployment on the Redis lists rq keeps its queues
in. kubernetes-validate carries no schema for KEDA's resources: those are checked field by field."""
from __future__ import annotations

import json
import subprocess
import sys

import kubernetes_validate
import pytest
import redis
from rq import Queue

import processor
from models.registry import Registry
from web.dev import kubernetes
from worker import protocol

KEDA = "keda.sh/v1alpha1"


@pytest.fixture()
def registry(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[models."org/Big.Model_v2"]\ncheckpoint = "hf:org/big"\ndevice = "cuda"\n\n'
                    '[models.small]\ncheckpoint = "../checkpoints/small/ckpt.pt"\ndevice = "cpu"\n')
    return path


def documents(values_path, models_path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "web.dev.kubernetes", "--values", str(values_path), "--models",
                          str(models_path)], capture_output=True, text=True, check=True).stdout
    return [json.loads(part) for part in out.split("---\n") if part.strip()]


def test_every_core_object_validates_against_kubernetes_schemas(registry):
    docs = documents("docs/kubernetes/values.toml", registry)
    core = [d for d in docs if d["apiVersion"] != KEDA]
    assert {d["kind"] for d in core} == {"ConfigMap", "Service", "StatefulSet", "Deployment"}
    for doc in core:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))


def test_workers_run_processor_and_keda_scales_them_on_rqs_queue_lists(registry):
    docs = documents("docs/kubernetes/values.toml", registry)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    specs = Registry.from_file(registry).models()
    assert len(scaled) == len(specs) == 2
    r = redis.Redis()  # never connected: rq names a queue's key without Redis
    for spec, obj in zip(specs, scaled):
        target = deployments[obj["spec"]["scaleTargetRef"]["name"]]
        container = target["spec"]["template"]["spec"]["containers"][0]
        args = processor.parse_args(container["command"][2:])
        assert container["command"][:2] == ["python", "processor.py"] and args.models == [spec.id]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert (args.device, gpus) == (("all", 1) if spec.device == "cuda" else ("cpu", 0))
        lists = [t["metadata"]["listName"] for t in obj["spec"]["triggers"]]
        assert lists == [Queue(name, connection=r).key for name in (protocol.queue_name(spec.id),
                                                                     protocol.batch_queue_name(spec.id))]
        assert all(t["type"] == "redis" and t["authenticationRef"]["name"] == "nanoserve-redis" for t in obj["spec"]["triggers"])
        assert 1 <= obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        assert target["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
    auth = [d for d in docs if d["kind"] == "TriggerAuthentication"]
    assert auth[0]["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "nanoserve-redis", "key": "password"}]


def test_the_registry_goes_in_a_config_map_beside_the_checkpoints(registry):
    docs = documents("docs/kubernetes/values.toml", registry)
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["models.toml"] == registry.read_text()
    web = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nanoserve-web")
    env = {e["name"]: e.get("value") for e in web["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NANOSERVE_MODELS"] == "/app/config/models.toml" and env["NANOSERVE_AUTH"] == "required"
    assert env["REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@nanoserve-redis:6379/0"


def test_values_override_the_defaults_and_unknown_ones_are_refused(tmp_path, registry):
    values = tmp_path / "values.toml"
    values.write_text('name = "llm"\n[worker]\ngpus = 0\nmax_replicas = 9\n')
    docs = documents(values, registry)
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert all(d["spec"]["maxReplicaCount"] == 9 and d["metadata"]["name"].startswith("llm-worker-") for d in scaled)
    workers = [d for d in docs if d["kind"] == "Deployment" and "worker" in d["metadata"]["name"]]
    assert all("nvidia.com/gpu" not in d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
               for d in workers)
    values.write_text('[worker]\ngpu = 2\n')
    with pytest.raises(ValueError, match="unknown values: worker.gpu"):
        kubernetes.values_from(values)
