"""The WSGI entry point: `gunicorn -k gthread --threads 32 wsgi:app` (threaded workers, for SSE)."""
from web.app import create_app

app = create_app()
