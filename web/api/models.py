"""The served models: `GET /v1/models`, `GET /v1/models/<id>`, and the lookups the request path
needs (a model by name or alias, its tokenizer). The registry is read once per process."""
from __future__ import annotations

import logging
import threading

from flask import Blueprint, Flask, current_app, jsonify, request

from models.registry import ModelNotFoundError, ModelSpec, Registry, RegistryError
from models.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from web import access
from web.settings import Settings
from worker.protocol import APIError

log = logging.getLogger(__name__)
bp = Blueprint("models", __name__)


class ServedModels:
    def __init__(self, settings: Settings):
        self.registry = Registry.from_file(settings.models_path)
        self._tokenizers: dict[str, Tokenizer] = {}
        self._lock = threading.Lock()
        self.loading: threading.Thread | None = None  # `start_loading`'s

    def get(self, name: str) -> ModelSpec:
        """The model by id or alias; 404 `model_not_found` in OpenAI's words otherwise."""
        try:
            return self.registry.get(name)
        except ModelNotFoundError:
            raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                           "invalid_request_error", "model", "model_not_found") from None

    def tokenizer(self, spec: ModelSpec) -> Tokenizer:
        """The model's tokenizer, loaded once; 503 when its files are unusable (a configuration
        problem, logged with the details, which the client does not need)."""
        with self._lock:
            if spec.id not in self._tokenizers:
                try:
                    self._tokenizers[spec.id] = load_tokenizer(spec)
                except (RegistryError, TokenizerError):
                    log.exception("model %s cannot be served", spec.id)
                    raise APIError(503, f"The model `{spec.id}` is not available right now.", "server_error",
                                   None, "model_unavailable") from None
            return self._tokenizers[spec.id]

    def start_loading(self) -> threading.Thread:
        """Load every served model's tokenizer on a thread of its own, so that a serving process's
        first request does not wait for it (a request that comes sooner waits for its model's). One
        that cannot be loaded is said in a line here, and refused at its requests (which log why)."""

        def load() -> None:
            for spec in self.registry.models():
                with self._lock:
                    if spec.id in self._tokenizers:
                        continue
                    try:
                        self._tokenizers[spec.id] = load_tokenizer(spec)
                    except (RegistryError, TokenizerError) as err:
                        log.warning("model %s has no usable tokenizer; its requests are refused", spec.id,
                                    extra={"error": str(err)})

        self.loading = threading.Thread(target=load, name="tokenizers", daemon=True)
        self.loading.start()
        return self.loading

    def model_object(self, spec: ModelSpec) -> dict:
        try:
            context_length = spec.context_length
        except RegistryError:  # its checkpoint is missing: still listed, as configured
            context_length = None
        return {"id": spec.id, "object": "model", "created": spec.created, "owned_by": spec.owned_by,
                "context_length": context_length}


def init_app(app: Flask, settings: Settings) -> ServedModels:
    app.extensions["nanoserve.models"] = served = ServedModels(settings)
    return served


def served_models() -> ServedModels:
    return current_app.extensions["nanoserve.models"]


@bp.get("/v1/models")
def list_models():
    access.authenticate(request)
    models = served_models()
    return jsonify({"object": "list", "data": [models.model_object(spec) for spec in models.registry.models()]})


@bp.get("/v1/models/<path:model_id>")
def retrieve_model(model_id: str):
    access.authenticate(request)
    models = served_models()
    spec = models.get(model_id)
    return jsonify(models.model_object(spec))
