"""OpenAI's Batch API: `POST /v1/batches` (`input_file_id`, `endpoint: "/v1/completions"`,
`completion_window: "24h"`, `metadata`, `output_expires_after`), `GET /v1/batches/<id>`,
`GET /v1/batches` (`after`, `limit`), `POST /v1/batches/<id>/cancel`.

A batch belongs to the caller that created it (web/access/ownership.py); any other caller gets the
404 of an unknown id. Creating one checks the request and that the input file is the caller's batch
file; the file's lines are checked by the dispatcher (status `validating`), which then runs them
(web/batch/dispatcher.py). The dispatcher is a thread of each web process, started by the process's
first request (`init_app`); Redis leases make sure each batch is driven by one process at a time and
taken over when that process dies.
"""
from __future__ import annotations

import logging
import threading
import weakref

import redis
from flask import Blueprint, Flask, current_app, g, jsonify, request

from web import access
from web.access import quotas
from web.access.ownership import check_owner, owner_of
from web.api.batch_lines import BatchLines
from web.api.completions import read_json_body
from web.api.files import expiry_seconds, find_file, int_arg, list_object
from web.api.queue import job_queue
from web.batch.dispatcher import Dispatcher
from web.batch.files import FileStore
from web.batch.store import Batch, BatchStore
from web.settings import Settings, settings
from worker.protocol import APIError, bad_request

log = logging.getLogger(__name__)
bp = Blueprint("batches", __name__)
EXTENSION = "nanoserve.batches"

ENDPOINTS = ("/v1/completions",)
WINDOWS = ("24h",)
_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def init_app(app: Flask, settings: Settings, client: redis.Redis, files: FileStore) -> BatchStore:
    store = BatchStore(client, files, record_ttl_s=int(settings.file_ttl_s), quota=quotas.quota(settings, "batches"))
    app.extensions[EXTENSION] = store
    if settings.batch_dispatch:
        app.before_request(DispatchThread(app, store, settings).ensure_started)
    return store


def batch_store() -> BatchStore:
    return current_app.extensions[EXTENSION]


@bp.post("/v1/batches")
def create():
    caller = access.authenticate(request)
    g.grant = access.admit_request(caller)
    body = read_json_body()
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {type(body).__name__}.")
    unknown = [name for name in body if name not in _FIELDS]
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise bad_request(f"Missing required parameter: '{name}'." if body.get(name) is None else
                              f"'{name}' must be a string.", name)
    if body["endpoint"] not in ENDPOINTS:
        raise bad_request(f"Invalid value for 'endpoint': {body['endpoint']!r}. This server runs batches of "
                          f"{', '.join(ENDPOINTS)}.", "endpoint")
    if body["completion_window"] not in WINDOWS:
        raise bad_request(f"Invalid value for 'completion_window': {body['completion_window']!r}. Supported "
                          f"values are: {', '.join(WINDOWS)}.", "completion_window")
    metadata = _metadata(body.get("metadata"))
    output_expires_after = (expiry_seconds(body["output_expires_after"], "output_expires_after")
                            if body.get("output_expires_after") is not None else None)
    stored = find_file(body["input_file_id"], caller)
    if stored.purpose != "batch":
        raise bad_request(f"The file {stored.id} has purpose {stored.purpose!r}; a batch's input file must be "
                          "uploaded with purpose 'batch'.", "input_file_id")
    batch = batch_store().create(
        owner=owner_of(caller), caller={"key_id": caller.key_id, "address": caller.address},
        input_file_id=stored.id, endpoint=body["endpoint"], completion_window=body["completion_window"],
        window_s=int(settings().batch_window_s), metadata=metadata, output_expires_after=output_expires_after)
    log.info("batch created", extra={"batch_id": batch.id, "input_file_id": stored.id, "bytes": stored.bytes})
    return jsonify(batch.to_object())


@bp.get("/v1/batches/<batch_id>")
def retrieve(batch_id: str):
    return jsonify(find_batch(batch_id, access.authenticate(request)).to_object())


@bp.get("/v1/batches")
def list_batches():
    caller = access.authenticate(request)
    limit = int_arg("limit", 20, 1, 100)
    found, more = batch_store().list(owner_of(caller), after=request.args.get("after"), limit=limit)
    return jsonify(list_object([b.to_object() for b in found], more))


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_route(batch_id: str):
    return jsonify(cancel(find_batch(batch_id, access.authenticate(request))).to_object())


def find_batch(batch_id: str, caller: access.Caller | None) -> Batch:
    """The batch if it belongs to `caller` (None: the admin CLI, which sees every batch); else the 404
    of an id that does not exist."""
    not_found = APIError(404, f"No batch found with id '{batch_id}'.", "invalid_request_error", "batch_id",
                         "batch_not_found")
    batch = batch_store().get(batch_id) if batch_id.startswith("batch_") else None
    if batch is None:
        raise not_found
    if caller is not None:
        check_owner(batch.owner, caller, not_found)
    return batch


def cancel(batch: Batch) -> Batch:
    """validating | in_progress → cancelling, and stop its running lines now (the dispatcher writes
    their `batch_cancelled` lines and finishes the batch within a few ticks). Cancelling a batch that
    is cancelling or cancelled again changes nothing; one that ended otherwise cannot be cancelled."""
    store = batch_store()
    if store.request_cancel(batch.id):
        jq = job_queue()
        for line in store.inflight(batch.id):
            jq.cancel(line.job_id)
        log.info("batch cancelling", extra={"batch_id": batch.id})
    batch = store.get(batch.id)
    if batch.status not in ("cancelling", "cancelled"):
        raise bad_request(f"Cannot cancel a batch that is {batch.status}.", None, "batch_not_cancellable")
    return batch


def _metadata(value) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in value.items()):
        raise bad_request(f"Invalid 'metadata': at most {MAX_METADATA} pairs of strings, keys up to "
                          f"{MAX_METADATA_KEY} characters and values up to {MAX_METADATA_VALUE}.", "metadata")
    return value


class DispatchThread:
    """This process's dispatcher thread, started by its first request: a web process serves requests
    before it drives batches, and the admin CLI (which builds the app too) never starts one. It holds
    its app weakly and ends with it (tests build many apps in one process)."""

    def __init__(self, app: Flask, store: BatchStore, settings: Settings):
        self.app, self.store, self.settings = weakref.ref(app), store, settings
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batch-dispatcher", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        s = self.settings
        dispatcher = Dispatcher(self.store, BatchLines(), max_inflight=s.batch_max_inflight,
                                lease_s=s.batch_lease_s, max_lines=s.batch_max_lines,
                                max_line_bytes=s.max_body_bytes)
        dispatcher.run(self.stopping, s.batch_tick_s, scope=self._app_context)

    def _app_context(self):
        app = self.app()
        return app.app_context() if app is not None else None
