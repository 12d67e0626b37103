"""The Flask app factory: settings, logs with request ids, the error envelope, the queue, the served
models, access control, metrics, the admin CLI and one blueprint per resource."""
from __future__ import annotations

from typing import Any, Mapping

from flask import Flask, g

from web import access, cli, health, logs, metrics, playground
from web import settings as web_settings
from web.api import batches, completions, files, jobs, models, queue, tokenize
from web.api.errors import register_error_handlers
from web.settings import Settings


def create_app(config: Settings | Mapping[str, Any] | None = None) -> Flask:
    """`config`: a `Settings`, or overrides of `Settings.from_env()` by field name."""
    app = Flask(__name__, static_folder=None)  # web/static belongs to the playground blueprint
    settings = web_settings.init_app(app, config)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # keep OpenAI's field order
    logs.init_app(app, settings)  # first: every later hook and log line sees the request id
    register_error_handlers(app)
    jq = queue.init_app(app, settings)
    served = models.init_app(app, settings)
    access.init_app(app, settings)
    batches.init_app(app, settings, jq.redis, files.init_app(app, settings, jq.redis))
    metrics.init_app(app, model_ids=lambda: [spec.id for spec in served.registry.models()],
                     connection=lambda: jq.redis)
    cli.register_cli(app)

    @app.after_request
    def _rate_limit_headers(response):
        response.headers.update(access.rate_limit_headers(g.get("grant")))
        return response

    for blueprint in (completions.bp, tokenize.bp, models.bp, jobs.bp, files.bp, batches.bp, health.bp,
                      playground.bp):
        app.register_blueprint(blueprint)
    return app
