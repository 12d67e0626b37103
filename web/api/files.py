"""OpenAI's Files API, for batches: `POST /v1/files` (multipart: `file`, `purpose: "batch"`, optional
`expires_after`), `GET /v1/files` (`purpose`, `limit`, `order`, `after`), `GET /v1/files/<id>`,
`GET /v1/files/<id>/content`, `DELETE /v1/files/<id>`.

Files live in Redis (web/batch/files.py), so every web process and the dispatcher reach them; an
upload larger than `max_file_bytes` (NANOSERVE_MAX_FILE_BYTES) is a 413. A file belongs to the caller
that uploaded it, a batch's output and error files to the batch's owner (web/access/ownership.py):
any other caller gets the 404 of an unknown id.
"""
from __future__ import annotations

import os
import re
from urllib.parse import quote

import redis
from flask import Blueprint, Flask, Response, current_app, g, jsonify, request

from web import access
from web.access import quotas
from web.access.ownership import check_owner, owner_of
from web.batch.files import MAX_EXPIRES_AFTER, MIN_EXPIRES_AFTER, UPLOAD_PURPOSES, FileStore, StoredFile
from web.settings import Settings, settings
from worker.protocol import APIError, bad_request

bp = Blueprint("files", __name__)
EXTENSION = "nanoserve.files"
_MULTIPART_SLACK = 64 << 10  # the form's own bytes around the file
_FORM_FIELDS = {"purpose", "expires_after[anchor]", "expires_after[seconds]"}


def init_app(app: Flask, settings: Settings, client: redis.Redis) -> FileStore:
    app.extensions[EXTENSION] = store = FileStore(client, default_ttl_s=int(settings.file_ttl_s),
                                                  quota=quotas.quota(settings, "files"))
    return store


def file_store() -> FileStore:
    return current_app.extensions[EXTENSION]


@bp.post("/v1/files")
def upload():
    caller = access.authenticate(request)
    g.grant = access.admit_request(caller)
    cap = settings().max_file_bytes
    request.max_content_length = cap + _MULTIPART_SLACK  # werkzeug answers 413 past it
    form, uploads = request.form, request.files
    unknown = sorted(set(form) - _FORM_FIELDS) or sorted(set(uploads) - {"file"})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    purpose = form.get("purpose")
    if not purpose:
        raise bad_request("Missing required parameter: 'purpose'.", "purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"Invalid value for 'purpose': {purpose!r}. This server accepts files for batches "
                          "only: 'batch'.", "purpose")
    upload = uploads.get("file")
    if upload is None:
        raise bad_request("Missing required parameter: 'file' (a multipart file part).", "file")
    content = upload.read(cap + 1)
    if len(content) > cap:
        raise APIError(413, f"The file is larger than the {cap} bytes this server accepts.",
                       "invalid_request_error", "file", "file_too_large")
    # a name is shown back in listings and a download header: no control characters in it
    filename = re.sub(r"[\x00-\x1f\x7f]", "", os.path.basename(upload.filename or "")) or "upload.jsonl"
    stored = file_store().create(owner_of(caller), filename, purpose, content, _expires_after(form))
    return jsonify(stored.to_object())


@bp.get("/v1/files")
def list_files():
    caller = access.authenticate(request)
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"Invalid value for 'order': {order!r}; use 'asc' or 'desc'.", "order")
    limit = int_arg("limit", 10_000, 1, 10_000)
    found, more = file_store().list(owner_of(caller), purpose=args.get("purpose"), after=args.get("after"),
                                    limit=limit, order=order)
    return jsonify(list_object([f.to_object() for f in found], more))


@bp.get("/v1/files/<file_id>")
def retrieve(file_id: str):
    return jsonify(find_file(file_id, access.authenticate(request)).to_object())


@bp.get("/v1/files/<file_id>/content")
def content(file_id: str):
    stored = find_file(file_id, access.authenticate(request))
    return Response(file_store().chunks(stored.id, stored.bytes), mimetype="application/octet-stream",
                    headers={"Content-Length": str(stored.bytes),
                             "Content-Disposition": f"attachment; filename*=UTF-8''{quote(stored.filename)}"})


@bp.delete("/v1/files/<file_id>")
def delete(file_id: str):
    stored = find_file(file_id, access.authenticate(request))
    file_store().delete(stored)
    return jsonify({"id": stored.id, "object": "file", "deleted": True})


def find_file(file_id: str, caller: access.Caller) -> StoredFile:
    """The file if it belongs to `caller`; else the 404 of an id that does not exist."""
    not_found = APIError(404, f"No such File object: {file_id}", "invalid_request_error", "file_id",
                         "file_not_found")
    stored = file_store().get(file_id) if file_id.startswith("file-") else None
    check_owner(stored.owner if stored else None, caller, not_found)
    return stored


def list_object(data: list[dict], has_more: bool) -> dict:
    """OpenAI's cursor page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def int_arg(name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter within [low, high] (400 naming it otherwise)."""
    raw = request.args.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"\s*-?[0-9]+\s*", raw) or not low <= int(raw) <= high:
        raise bad_request(f"Invalid value for '{name}': {raw!r}; it must be a whole number from {low} to {high}.",
                          name)
    return int(raw)


def expiry_seconds(value, param: str) -> int:
    """`{"anchor": "created_at", "seconds": N}` with N within OpenAI's bounds, as seconds."""
    if not isinstance(value, dict) or set(value) != {"anchor", "seconds"}:
        raise bad_request(f"'{param}' must be an object with 'anchor' and 'seconds'.", param)
    if value["anchor"] != "created_at":
        raise bad_request(f"Invalid value for '{param}.anchor': only 'created_at' is supported.", f"{param}.anchor")
    seconds = value["seconds"]
    if isinstance(seconds, str) and re.fullmatch(r"\s*[0-9]+\s*", seconds):
        seconds = int(seconds)  # multipart fields are text
    ttl = int(settings().file_ttl_s)  # the server's cap on a file's lifetime (0: OpenAI's)
    longest = min(MAX_EXPIRES_AFTER, max(MIN_EXPIRES_AFTER, ttl)) if ttl else MAX_EXPIRES_AFTER
    if type(seconds) is not int or not MIN_EXPIRES_AFTER <= seconds <= longest:
        raise bad_request(f"Invalid value for '{param}.seconds': it must be a whole number from "
                          f"{MIN_EXPIRES_AFTER} to {longest}.", f"{param}.seconds")
    return seconds


def _expires_after(form) -> int | None:
    fields = {name[len("expires_after["):-1]: form[name] for name in form if name.startswith("expires_after[")}
    return expiry_seconds(fields, "expires_after") if fields else None
