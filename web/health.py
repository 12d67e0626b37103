"""`GET /health`: the process answers. `GET /ready`: Redis answers and every served model has at
least one live worker on its queue (503 with the details otherwise). Each model's `warming_up`
counts those of its workers whose engine still compiles its decode step: they serve, more slowly."""
from __future__ import annotations

import logging

import redis
from flask import Blueprint, jsonify

from web.api.models import served_models
from web.api.queue import job_queue
from worker import protocol

bp = Blueprint("health", __name__)
log = logging.getLogger(__name__)


@bp.get("/health")
def health():
    return jsonify({"status": "ok"})


@bp.get("/ready")
def ready():
    jq = job_queue()
    try:
        jq.redis.ping()
        models = {spec.id: {**dict(zip(("workers", "queued"), jq.load(spec.id))), "warming_up": jq.warming(spec.id)}
                  for spec in served_models().registry.models()}
    except redis.RedisError as err:
        # the details (host, port, the client's words) go to the log, not to whoever asks
        log.warning("ready: redis unreachable: %r", err)
        body = protocol.error_body("The queue (Redis) is unreachable.", "server_error", None, "redis_unavailable")
        return jsonify({**body, "status": "unavailable", "redis": False}), 503
    missing = [model_id for model_id, state in models.items() if not state["workers"]]
    if missing:
        body = protocol.error_body(f"No live worker for: {', '.join(missing)}.", "server_error", None, "no_worker")
        return jsonify({**body, "status": "unavailable", "redis": True, "models": models}), 503
    return jsonify({"status": "ready", "redis": True, "models": models})
