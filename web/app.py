"""The Flask app factory: settings, logs with request ids, the error envelope, the queue, the served
models, access control, metrics, the admin CLI and one blueprint per resource."""
from __future__ import annotations

from typing import Any, Mapping

from flask import Flask, g

from web import access, cli, completions, health, jobs, logs, metrics, models_api, playground, queue
from web.config import Settings
from web.errors import register_error_handlers


def create_app(config: Settings | Mapping[str, Any] | None = None) -> Flask:
    """`config`: a `Settings`, or overrides of `Settings.from_env()` by field name."""
    settings = config if isinstance(config, Settings) else Settings.from_env().replace(**(config or {}))

    app = Flask(__name__, static_folder=None)  # web/static belongs to the playground blueprint
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # keep OpenAI's field order
    app.extensions["nanoserve.settings"] = settings
    logs.init_app(app)  # first: every later hook and log line sees the request id
    register_error_handlers(app)
    jq = queue.init_app(app, settings)
    served = models_api.init_app(app, settings)
    access.init_app(app)
    metrics.init_app(app, model_ids=lambda: [spec.id for spec in served.registry.models()],
                     connection=lambda: jq.redis)
    cli.register_cli(app)

    @app.after_request
    def _rate_limit_headers(response):
        response.headers.update(access.rate_limit_headers(g.get("grant")))
        return response

    for blueprint in (completions.bp, models_api.bp, jobs.bp, health.bp, playground.bp):
        app.register_blueprint(blueprint)
    return app
