"""JSON logs with a request id echoed in `x-request-id`."""
from __future__ import annotations

import json

import pytest

from tests.stack import write_models_toml


@pytest.fixture()
def app(tmp_path, hf_checkpoint, redis_url):
    from web.app import create_app

    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint})
    app = create_app({"redis_url": redis_url, "models_path": str(models)})

    @app.get("/test-fault")
    def fault():
        raise RuntimeError("a real fault")

    return app


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_request_id_is_echoed_or_made(app):
    client = app.test_client()
    assert client.get("/health", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
    made = client.get("/health", headers={"X-Request-ID": "not a sane id"}).headers["x-request-id"]
    assert made.startswith("req-") and made != "not a sane id"
    first, second = (client.get("/health").headers["x-request-id"] for _ in range(2))
    assert first != second


def test_logs_are_json_lines_carrying_the_request_id(app, capsys):
    client = app.test_client()
    response = client.get("/test-fault", headers={"X-Request-ID": "fault-1"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "fault-1"
    assert "a real fault" not in response.get_data(as_text=True)  # never leaked to the client
    client.get("/v1/models", headers={"X-Request-ID": "list-1"})

    lines = json_lines(capsys.readouterr().err)
    fault = [line for line in lines if line["request_id"] == "fault-1"]
    error = next(line for line in fault if line["level"] == "error")
    assert "RuntimeError: a real fault" in error["exc"]
    access = next(line for line in fault if line["logger"] == "nanoserve.access")
    assert (access["method"], access["path"], access["status"]) == ("GET", "/test-fault", 500)
    assert access["duration_ms"] >= 0
    listed = next(line for line in lines if line["request_id"] == "list-1" and line["logger"] == "nanoserve.access")
    assert listed["status"] == 200 and isinstance(listed["ts"], float)
