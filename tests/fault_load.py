"""Careful clients under a fault, and the tally of what became of their requests.

A `Load` runs client threads that send seeded completions back to back through a set of web hosts:
streamed completions, synchronous ones, polled jobs and followed job streams. Each client is a
careful one: a request that got no answer is sent again through the next web host, a broken stream
is resumed by its job id with `Last-Event-ID`, 503s are waited out. `tally` then holds every request
against the text an uninterrupted run gives (`reference_texts`) and every job's stream against its
one right shape, and makes the fault's row: sent, completed, failed with a clean error, lost,
duplicated, and the time to recover.
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from models.registry import Registry
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from tests import rq_json
from tests.stack import Service
from worker import protocol
from worker.engine import Engine

MODEL = "tiny"
EOS = 50256
MAX_TOKENS = 48
DISTINCT = 40  # request bodies (each has its reference text); the load cycles through them
READ_TIMEOUT = 5.0  # a client's socket timeout: a live stream sends at least a keepalive every second
SYNC_TIMEOUT = 120.0  # ... and a synchronous completion's, which sends nothing until its answer


def body(i: int) -> dict:
    """The i-th distinct request: seeded sampling (every fourth greedy), no end-of-text, so it runs
    to MAX_TOKENS."""
    return {"model": MODEL, "prompt": [464, 318 + i], "max_tokens": MAX_TOKENS, "seed": 1000 + i,
            "temperature": 0.0 if i % 4 == 0 else 1.0, "logit_bias": {str(EOS): -100}}


def reference_texts(models_file: Path) -> list[str]:
    """What each body gives uninterrupted: the engine alone, in this process."""
    spec = Registry.from_file(models_file).get(MODEL)
    engine = Engine(load_model(spec.checkpoint), load_tokenizer(spec), max_batch=DISTINCT, max_len=spec.context_length)
    jobs = [protocol.CompletionJob(id=protocol.new_completion_id(), model=MODEL, prompts=[b["prompt"]],
                                   max_tokens=MAX_TOKENS, seed=b["seed"], temperature=b["temperature"],
                                   logit_bias={EOS: -100.0}) for b in map(body, range(DISTINCT))]
    handles = [engine.submit(job) for job in jobs]
    while not all(h.done for h in handles):
        engine.step()
    return [h.result()["choices"][0]["text"] for h in handles]


# ---- careful clients ---------------------------------------------------------------------------

class NoAnswer(Exception):
    """The web host could not be reached, or the connection broke before an answer."""


@dataclass
class Outcome:
    """One logical request, however many times the client had to send or resume it."""

    kind: str  # stream | sync | job | follow
    index: int  # its body
    sent_at: float
    ids: list[str] = field(default_factory=list)  # the jobs it made (more than one: it was re-sent)
    text: str | None = None
    error: dict | None = None  # a clean API error that ended it
    problem: str | None = None  # anything else that ended it: the request is lost
    pieces_at: list[float] = field(default_factory=list)  # arrival of each streamed piece
    resends: int = 0
    resumes: int = 0
    cuts: int = 0  # connections the client cut itself (`cut_after`)
    ended_at: float | None = None


class Client:
    """A client host's careful client: web hosts tried in turn, a request with no answer sent again
    through the next one, a broken stream resumed by job id with Last-Event-ID, 503s waited out."""

    RETRIES = 40  # sends and resumes of one request before it is given up

    def __init__(self, webs: list[tuple[str, int]], key: str, seed: int):
        self.webs = webs
        self.key = key
        self.turn = seed % len(webs)

    def _web(self, switch: bool = False) -> tuple[str, int]:
        if switch:
            self.turn = (self.turn + 1) % len(self.webs)
        return self.webs[self.turn]

    def _open(self, method: str, path: str, payload: dict | None = None, headers: dict | None = None,
              switch: bool = False, timeout: float = READ_TIMEOUT) -> http.client.HTTPResponse:
        host, port = self._web(switch)
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(payload) if payload is not None else None,
                         headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json",
                                  **(headers or {})})
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise NoAnswer(f"{host}: {exc!r}") from None

    def _json(self, method: str, path: str, payload: dict | None = None, timeout: float = READ_TIMEOUT,
              outcome: Outcome | None = None) -> tuple[int, dict]:
        """A whole JSON answer, sent again through the other web host until one comes (503s waited out);
        a POST sent again counts in `outcome.resends`."""
        switch = False
        for _ in range(self.RETRIES):
            try:
                response = self._open(method, path, payload, switch=switch, timeout=timeout)
                data = response.read()
                response.close()
            except (NoAnswer, OSError, http.client.HTTPException):
                switch = True
                if outcome is not None and method == "POST":
                    outcome.resends += 1
                time.sleep(0.2)
                continue
            if response.status == 503:
                time.sleep(float(response.getheader("Retry-After") or 1))
                switch = True
                continue
            return response.status, json.loads(data)
        raise NoAnswer(f"{method} {path}: no answer after {self.RETRIES} tries")

    def sync(self, outcome: Outcome) -> None:
        """POST /v1/completions, stream false. With no answer it is sent again (the client cannot know
        the id of a job whose answer never came: that job runs on, unread)."""
        status, data = self._json("POST", "/v1/completions", body(outcome.index), timeout=SYNC_TIMEOUT, outcome=outcome)
        if status == 200:
            outcome.ids.append(data["id"])
            outcome.text = data["choices"][0]["text"]
        else:
            outcome.error = data.get("error")

    def job(self, outcome: Outcome) -> None:
        """POST /v1/jobs, then GET /v1/jobs/<id> until it has ended."""
        status, data = self._json("POST", "/v1/jobs", body(outcome.index), outcome=outcome)
        if status != 202:
            outcome.error = data.get("error")
            return
        outcome.ids.append(data["id"])
        while True:
            time.sleep(0.3)
            status, data = self._json("GET", f"/v1/jobs/{data['id']}")
            if status != 200 or data["status"] in ("failed", "cancelled"):
                outcome.error = data.get("error") or {"code": data.get("status")}
                return
            if data["status"] == "completed":
                outcome.text = data["result"]["choices"][0]["text"]
                return

    def stream(self, outcome: Outcome, cut_after: int | None = None) -> None:
        """POST /v1/completions, stream true; once its job id is known, a broken stream is resumed
        through GET /v1/jobs/<id>/stream from the last event read (`cut_after`: the client itself cuts
        its connection after that many pieces, once)."""
        self._follow(outcome, "/v1/completions", {**body(outcome.index), "stream": True}, cut_after)

    def follow(self, outcome: Outcome, cut_after: int | None = None) -> None:
        """POST /v1/jobs, then its events through GET /v1/jobs/<id>/stream."""
        status, data = self._json("POST", "/v1/jobs", body(outcome.index), outcome=outcome)
        if status != 202:
            outcome.error = data.get("error")
            return
        outcome.ids.append(data["id"])
        self._follow(outcome, None, None, cut_after)

    def _follow(self, outcome: Outcome, path: str | None, payload: dict | None, cut_after: int | None) -> None:
        pieces: list[str] = []
        last_id = None
        switch = False
        for _ in range(self.RETRIES):
            try:
                if outcome.ids:  # resume the job's stream (also a job made by POST /v1/jobs)
                    headers = {"Last-Event-ID": last_id} if last_id else {}
                    if last_id:
                        outcome.resumes += 1
                    response = self._open("GET", f"/v1/jobs/{outcome.ids[-1]}/stream", headers=headers, switch=switch)
                else:
                    response = self._open("POST", path, payload, switch=switch)
                switch = False
                if response.status == 503:
                    response.read()
                    time.sleep(float(response.getheader("Retry-After") or 1))
                    switch = True
                    continue
                if response.status != 200:
                    outcome.error = json.loads(response.read()).get("error")
                    return
                for entry_id, data in _events(response):
                    if data is None:  # [DONE]
                        outcome.text = "".join(pieces)
                        return
                    if "error" in data:
                        if data["error"].get("code") == "redis_unavailable" and outcome.ids:
                            raise NoAnswer("the web host lost Redis mid-stream")  # resumable
                        outcome.error = data["error"]
                        return
                    if not outcome.ids:
                        outcome.ids.append(data["id"])
                    last_id = entry_id or last_id
                    for choice in data["choices"]:
                        if choice["text"]:
                            pieces.append(choice["text"])
                            outcome.pieces_at.append(time.monotonic())
                    if cut_after is not None and len(outcome.pieces_at) >= cut_after:
                        cut_after = None
                        outcome.cuts += 1
                        response.fp.raw._sock.shutdown(socket.SHUT_RDWR)
                        response.close()
                        raise NoAnswer("cut by the client")
                raise NoAnswer("the stream ended without [DONE]")
            except (NoAnswer, OSError, http.client.HTTPException, ValueError):
                switch = True
                if not outcome.ids:
                    outcome.resends += 1
                time.sleep(0.2)
        raise NoAnswer(f"stream: no end after {self.RETRIES} tries")


def _events(response: http.client.HTTPResponse):
    """(entry id, data) of each SSE event; data None for `[DONE]`."""
    entry_id = None
    while True:
        line = response.readline()
        if not line:
            return
        line = line.decode().rstrip("\r\n")
        if line.startswith("id: "):
            entry_id = line[4:]
        elif line.startswith("data: "):
            payload = line[6:]
            yield entry_id, (None if payload == "[DONE]" else json.loads(payload))
            entry_id = None


class Load:
    """Client threads sending requests back to back, each kind in its share, until `stop`."""

    MIX = ("stream", "stream", "stream", "sync", "sync", "job", "job", "follow")

    def __init__(self, webs: list[tuple[str, int]], key: str, mix=MIX, cut_after: bool = False):
        self.webs, self.key, self.mix, self.cut_after = webs, key, mix, cut_after
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.counter = 0
        self.threads = [threading.Thread(target=self._run, args=(n, kind), daemon=True)
                        for n, kind in enumerate(mix)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, n: int, kind: str) -> None:
        client = Client(self.webs, self.key, seed=n)
        rng = random.Random(n)
        while not self.stopping.is_set():
            with self.lock:
                index = self.counter % DISTINCT
                self.counter += 1
                outcome = Outcome(kind, index, time.monotonic())
                self.outcomes.append(outcome)
            try:
                cut = rng.randint(3, MAX_TOKENS // 2) if self.cut_after and kind in ("follow", "job") else None
                if kind == "job" and cut:  # under the cut, polled jobs are followed too
                    client.follow(outcome, cut_after=cut)
                elif kind in ("stream", "follow"):
                    getattr(client, kind)(outcome, cut_after=cut)
                else:
                    getattr(client, kind)(outcome)
            except Exception as exc:  # whatever it was, the request is lost
                outcome.problem = repr(exc)
            outcome.ended_at = time.monotonic()

    def stop(self, timeout: float = 180) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.1, deadline - time.monotonic()))
        for outcome in self.outcomes:
            if outcome.ended_at is None:
                outcome.problem = outcome.problem or "no answer when the load stopped"

    def running_pieces(self) -> int:
        return sum(len(o.pieces_at) for o in self.outcomes)

    def wait_pieces(self, more: int, timeout: float = 60) -> None:
        """Until the streams have received `more` pieces."""
        target = self.running_pieces() + more
        deadline = time.monotonic() + timeout
        while self.running_pieces() < target:
            assert time.monotonic() < deadline, "the load made no progress"
            time.sleep(0.05)


def stream_of(r: redis.Redis, job_id: str) -> list[tuple[str, dict]]:
    return [protocol.decode_event(fields) for _, fields in r.xrange(protocol.stream_key(job_id))]


def tally(r: redis.Redis, load: Load, reference: list[str], fault: str, fault_at: float, table: list[dict],
          check: bool = True) -> dict:
    """Every request's fate, checked against the reference texts and the jobs' streams: the fault's
    row, added to `table`. With `check`, a request lost or answered twice fails the test."""
    completed, failed, lost, duplicated = [], [], [], []
    for o in load.outcomes:
        expected = reference[o.index]
        if o.problem is not None or (o.text is None and o.error is None):
            lost.append(o)
        elif o.error is not None:
            failed.append(o)
        elif o.text == expected:
            completed.append(o)
        elif len(o.text) > len(expected) or o.text in expected + expected:
            duplicated.append(o)
        else:
            lost.append(o)
    # Each job written once: one terminal event, last, after exactly its tokens (or a clean error).
    bad_streams = []
    for o in load.outcomes:
        for job_id in o.ids:
            events = stream_of(r, job_id)
            kinds = [kind for kind, _ in events]
            terminal = [i for i, kind in enumerate(kinds) if kind in protocol.TERMINAL_EVENTS]
            tokens = sum(len(data["token_ids"]) for kind, data in events if kind == "delta")
            text = "".join(data["text"] for kind, data in events if kind == "delta")
            if terminal and (len(terminal) > 1 or terminal[0] != len(kinds) - 1):
                bad_streams.append((job_id, "events past the end", kinds[-6:]))
            elif terminal and kinds[-1] == "done" and (tokens != MAX_TOKENS or text != reference[o.index]):
                bad_streams.append((job_id, f"{tokens} tokens", text))
    if bad_streams:
        duplicated += [o for o in load.outcomes if set(o.ids) & {job_id for job_id, *_ in bad_streams}
                       and o not in duplicated]
    # Recovery: the longest a stream open at the fault waited for its next piece.
    waits = []
    for o in load.outcomes:
        if o.sent_at <= fault_at and (o.ended_at or 0) > fault_at:
            after = [t for t in o.pieces_at if t > fault_at]
            before = [t for t in o.pieces_at if t <= fault_at]
            if after and before:
                waits.append(after[0] - fault_at)
    row = {"fault": fault, "sent": len(load.outcomes), "completed": len(completed), "failed": len(failed),
           "lost": len(lost), "duplicated": len(duplicated), "recovery": max(waits, default=0.0),
           "resent": sum(o.resends for o in load.outcomes), "resumed": sum(o.resumes for o in load.outcomes)}
    table.append(row)
    print(f"\n{fault}: {row}")
    row["detail"] = [(o.kind, o.ids, o.problem or o.error, (o.text or "")[:60], reference[o.index][:60])
                     for o in lost + duplicated][:10] + bad_streams[:5]
    row["errors"] = [(o.kind, o.ids, o.error) for o in failed][:10]
    if check:
        assert not lost and not duplicated and not bad_streams, row
    return row


def running_on(r: redis.Redis, worker: Service) -> list[str]:
    """Jobs a processor runs now whose streams have begun (its rq workers are named host:pid:…)."""
    ids = rq_json.started(protocol.queue_name(MODEL), r).get_job_ids(cleanup=False)
    pid = f":{worker.pid}:"
    return [job.id for job in rq_json.fetch_many(ids, r)
            if job is not None and pid in (job.worker_name or "") and r.xlen(protocol.stream_key(job.id))]


def wait_for(what: str, check, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
    return value


def report_table(config, table: list[dict]) -> None:
    """The rows, as a Markdown table on the terminal (also without `-s`)."""
    if not table:
        return
    lines = ["", "fault | sent | completed | failed (clean error) | lost | duplicated | recovery (s)",
             "--- | --- | --- | --- | --- | --- | ---"]
    lines += [f"{r['fault']} | {r['sent']} | {r['completed']} | {r['failed']} | {r['lost']} | {r['duplicated']} | "
              f"{r['recovery']:.1f}" for r in table]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        reporter.write_line(line) if reporter else print(line)


