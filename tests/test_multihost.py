"""nanoserve on several hosts, under real network faults: Redis, two web hosts and two worker hosts,
each a network namespace of its own (tests/netns.py), and this process as the client host. Every
connection is real TCP across a bridge.

Each fault is injected under a steady load of streamed completions, synchronous completions, polled
jobs and followed job streams, all seeded, so each answer has one right text (the engine's
uninterrupted run of the same request). The clients are careful ones: they retry a request that got
no answer through the other web host, resume a broken stream by its job id with `Last-Event-ID`, and
wait out 503s. Then every request must have exactly the right answer or a clean API error: nothing
lost, nothing answered twice, and no job's stream with a gap, a repeated piece or an event past its
end. Each test prints its row of the fault table (docs/deployment.md, "Several hosts").

Needs root and iproute2 (skipped with the reason where there is neither).
"""
from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
import redis

from tests import netns, rq_json
from tests.fault_load import (MODEL, Client, Load, body, reference_texts, report_table, running_on, tally,
                              wait_for)
from tests.stack import Service, registered_workers, spawn_gunicorn, spawn_processor, write_models_toml
from web.access import blocklist, keys
from web.dev.local_redis import LocalRedis, start_redis
from worker import protocol

pytestmark = pytest.mark.slow

_why_not = netns.unavailable()
if _why_not:
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"multi-host tests: {_why_not}")]

PASSWORD = "multihost-redis-password"
WEB_PORT = 8000
REDIS_PORT = 6379
WEB_ENV = {"NANOSERVE_AUTH": "required", "NANOSERVE_KEEPALIVE": "1", "NANOSERVE_LOG_LEVEL": "WARNING",
           "NANOSERVE_BATCH_TICK": "0.2", "NANOSERVE_BATCH_LEASE": "3"}
HEARTBEAT = 1  # the workers' --heartbeat: a job is re-queued 3 s after its worker was last heard from
TABLE: list[dict] = []  # the fault table, a row per test


# ---- the test bed -----------------------------------------------------------------------------

class Bed:
    """Redis, two web hosts and two worker hosts; any of them may be killed and started again."""

    def __init__(self, net: netns.Network, models: Path, log_dir: Path):
        self.net, self.models, self.log_dir = net, models, log_dir
        self.redis_host = net.host("redis")
        self.web_hosts = [net.host("web1"), net.host("web2")]
        self.worker_hosts = [net.host("work1"), net.host("work2")]
        self.redis_dir = log_dir / "redis"
        self.redis_dir.mkdir(exist_ok=True)
        self.server: LocalRedis | None = None
        self.webs: dict[str, Service] = {}
        self.workers: dict[str, Service] = {}

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@{self.redis_host.address}:{REDIS_PORT}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def start_redis(self) -> None:
        # an append-only file, fsynced every second, as docker-compose.yml runs it
        self.server = start_redis(port=REDIS_PORT, persist_dir=str(self.redis_dir), password=PASSWORD,
                                  host=self.redis_host.address, via=self.redis_host.via)

    def start_worker(self, host: netns.Host, wait: bool = True) -> Service:
        host.kill()  # what is left of an earlier process there
        self.workers[host.name] = spawn_processor(
            self.url, self.models, concurrency=4, heartbeat=HEARTBEAT, log_dir=self.log_dir, via=host.via,
            extra_args=["--batch-concurrency", "2"], wait=wait)
        return self.workers[host.name]

    def start_web(self, host: netns.Host) -> Service:
        host.kill()
        self.webs[host.name] = spawn_gunicorn(self.url, self.models, port=WEB_PORT, workers=1, threads=24,
                                              env=WEB_ENV, log_dir=self.log_dir, host=host.address, via=host.via)
        return self.webs[host.name]

    def web_urls(self) -> list[tuple[str, int]]:
        return [(host.address, WEB_PORT) for host in self.web_hosts]

    def heal(self) -> None:
        """Every host back on the network and every process running (after a test that failed halfway)."""
        for host in self.net.hosts.values():
            host.heal()
        if self.server is None or self.server.process.poll() is not None:
            self.start_redis()
        for host in self.worker_hosts:
            worker = self.workers.get(host.name)
            if worker is None or not worker.alive():
                self.start_worker(host, wait=False)
        for host in self.web_hosts:
            web = self.webs.get(host.name)
            if web is None or not web.alive():
                self.start_web(host)
        for worker in self.workers.values():
            worker.wait_ready()

    def worker_of(self, host: netns.Host) -> Service:
        return self.workers[host.name]

    def stop(self) -> None:
        for service in [*self.webs.values(), *self.workers.values()]:
            service.stop(timeout=10)
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def models_file(hf_checkpoint, tmp_path_factory) -> Path:
    return write_models_toml(tmp_path_factory.mktemp("multihost") / "models.toml", {MODEL: hf_checkpoint},
                             device="cpu", max_batch=8)


@pytest.fixture(scope="module")
def bed(models_file, tmp_path_factory, request):
    log_dir = tmp_path_factory.mktemp("multihost-logs")
    with netns.Network() as net:
        bed = Bed(net, models_file, log_dir)
        try:
            bed.start_redis()
            for host in bed.worker_hosts:
                bed.start_worker(host, wait=False)
            for host in bed.web_hosts:
                bed.start_web(host)
            bed.reference = reference_texts(models_file)  # while the workers load
            bed.key = keys.create(redis.Redis.from_url(bed.url, decode_responses=True), "client")[0]
            for worker in bed.workers.values():
                worker.wait_ready()
            yield bed
        finally:
            bed.stop()
    report_table(request.config, TABLE)


@pytest.fixture()
def healthy(bed) -> Bed:
    """The bed with every host up, whatever the test before it left."""
    bed.heal()
    return bed


# ---- the faults -------------------------------------------------------------------------------

def log_records(service) -> list[dict]:
    """A service's JSON log lines."""
    records = []
    for line in service.logs().splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut as it was written
                pass
    return records


def fault_a_streaming_worker(bed, r, victim_host, other_host, fault) -> tuple:
    """Once the victim host's worker streams two jobs or more, `fault()` it, and wait until each of
    those jobs has ended or runs on the other host's worker. Returns (the victim's service, its jobs,
    when the fault came)."""
    victim = bed.worker_of(victim_host)
    taken = wait_for("the victim to stream jobs", lambda: (ids := running_on(r, victim)) and len(ids) >= 2 and ids, 60)
    fault_at = time.monotonic()
    fault()
    wait_for("the victim's jobs to resume elsewhere",
             lambda: all(rq_json.fetch(job_id, r).get_status().value == "finished" or
                         job_id in running_on(r, bed.worker_of(other_host)) for job_id in taken), 60, 0.2)
    return victim, taken, fault_at


def test_a_worker_host_partitioned_from_redis(healthy):
    """A worker host's link goes down while it streams: its jobs are re-queued once their
    heartbeats expire and resumed by the other worker, every stream without a gap or a repeat. The
    link comes back: what the cut-off worker generated meanwhile and tries to write is refused (each
    stream belongs to its newer attempt), and nothing is written twice."""
    bed = healthy
    victim_host, other_host = bed.worker_hosts
    r = bed.client()
    with Load(bed.web_urls(), bed.key) as load:
        load.wait_pieces(50)
        victim, taken, fault_at = fault_a_streaming_worker(bed, r, victim_host, other_host, victim_host.partition)
        load.wait_pieces(100)
        healed_at = time.time()
        victim_host.heal()
        # it reaches Redis again: its kept events land (or are refused, the jobs being another's now),
        # or it finishes a job. A partition shorter than its socket timeout shows no failed write at all.
        wait_for("the healed worker to reach Redis again", lambda: any(
            r.get("ts", 0) >= healed_at and r.get("msg") in ("event stream writes recovered", "stream entries refused",
                                                             "job finished") for r in log_records(victim)), 60, 0.5)
        # and to count as live again: web refuses a model with no live worker (503)
        wait_for("the healed worker's rq worker to be registered again",
                 lambda: any(f":{victim.pid}:" in name for name in registered_workers(bed.url, MODEL)),
                 30, 0.5)
        load.wait_pieces(300)
    row = tally(bed.client(), load, bed.reference, "worker host partitioned from Redis", fault_at, TABLE)
    assert set(taken) <= {job_id for o in load.outcomes for job_id in o.ids}
    assert victim.alive()
    print(f"the healed worker's refused writes: {victim.logs().count('stream entries refused')} transactions")
    assert row["completed"] > 0


def test_a_worker_host_killed(healthy):
    """Every process of a worker host killed at once: its jobs resume on the other worker."""
    bed = healthy
    victim_host, other_host = bed.worker_hosts
    r = bed.client()
    with Load(bed.web_urls(), bed.key) as load:
        load.wait_pieces(50)
        _, _, fault_at = fault_a_streaming_worker(bed, r, victim_host, other_host, victim_host.kill)
        load.wait_pieces(300)
    tally(bed.client(), load, bed.reference, "worker host killed", fault_at, TABLE)


def test_a_web_host_killed(healthy):
    """Every process of a web host killed at once: its clients' requests go through the other web
    host; a broken stream resumes by its job id, a polled job is read by id."""
    bed = healthy
    victim_host = bed.web_hosts[0]
    with Load(bed.web_urls(), bed.key) as load:
        load.wait_pieces(100)
        fault_at = time.monotonic()
        victim_host.kill()
        load.wait_pieces(400)
    row = tally(bed.client(), load, bed.reference, "web host killed", fault_at, TABLE)
    assert row["resumed"] > 0  # streams broken by the kill were resumed through the other host


def test_the_clients_connection_cut_mid_stream(healthy):
    """Followed job streams (and polled jobs, followed too) cut by the client after a few pieces and
    resumed with Last-Event-ID through the other web host: each text whole, nothing repeated."""
    bed = healthy
    with Load(bed.web_urls(), bed.key, cut_after=True) as load:
        fault_at = time.monotonic()
        load.wait_pieces(600)
        wait_for("three streams cut by the client", lambda: sum(o.cuts for o in list(load.outcomes)) >= 3, 120, 0.2)
    row = tally(bed.client(), load, bed.reference, "client connection cut mid-stream", fault_at, TABLE)
    cut = [o for o in load.outcomes if o.cuts]
    assert all(o.resumes >= o.cuts for o in cut), [(o.kind, o.cuts, o.resumes, o.error) for o in cut]


def test_redis_host_killed_and_restarted_from_its_append_only_file(healthy):
    """The Redis host killed at once and Redis started again from its append-only file: queued jobs,
    keys, the blocklist, files and batches are all there, and the load rides it out."""
    bed = healthy
    r = bed.client()
    admin = redis.Redis.from_url(bed.url, decode_responses=True)
    blocked = keys.create(admin, "mallory")[0]
    blocklist.add(admin, "key", "mallory", reason="test")
    client = Client(bed.web_urls(), bed.key, seed=0)
    lines = b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body(i)}).encode() + b"\n" for i in range(12))
    file_id = _upload(bed, lines)
    status, batch = client._json("POST", "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/completions",
                                                         "completion_window": "24h"})
    assert status == 200, batch
    with Load(bed.web_urls(), bed.key) as load:
        load.wait_pieces(50)
        queued = [job_id for job_id in rq_json.queue(protocol.queue_name(MODEL), r).get_job_ids()]
        fault_at = time.monotonic()
        bed.redis_host.kill()
        bed.server.process.wait()
        time.sleep(2)
        bed.start_redis()
        load.wait_pieces(300, timeout=120)
    row = tally(bed.client(), load, bed.reference, "Redis host killed, restarted from its AOF", fault_at, TABLE)
    r = bed.client()
    # what Redis held survived: the key (the load used it after), the blocklist, the file, the batch
    status, refused = Client(bed.web_urls(), blocked, seed=0)._json("POST", "/v1/completions", body(0))
    assert status == 403 and refused["error"]["code"] == "blocked"
    status, _ = client._json("GET", f"/v1/files/{file_id}")
    assert status == 200
    status, done = _wait_batch(client, batch["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 12, done
    # jobs queued at the kill were run (every request above had its answer, theirs included)
    assert all(job_id in {i for o in load.outcomes for i in o.ids} for job_id in queued)
    assert row["completed"] > 0


def _upload(bed: Bed, content: bytes) -> str:
    boundary = "multihostboundary"
    payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
               "Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    host, port = bed.web_urls()[0]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/files", body=payload,
                 headers={"Authorization": f"Bearer {bed.key}", "Content-Type": f"multipart/form-data; boundary={boundary}"})
    response = conn.getresponse()
    data = json.loads(response.read())
    assert response.status == 200, data
    return data["id"]


def _wait_batch(client: Client, batch_id: str, timeout: float = 120) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        status, batch = client._json("GET", f"/v1/batches/{batch_id}")
        if batch.get("status") in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return status, batch
        time.sleep(0.5)
