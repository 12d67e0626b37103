"""The WSGI entry point: `gunicorn -k gthread --threads 32 wsgi:app` (threaded workers, for SSE)."""
import os

from web.app import create_app

app = create_app()
if os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn/"):  # served, not `flask --app wsgi` (the admin CLI)
    app.extensions["nanoserve.models"].start_loading()
