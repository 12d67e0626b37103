"""The HTTP face of nanoserve (never torch): `create_app` in web/app.py; the OpenAI API in web/api/,
access control in web/access/, development tools in web/dev/ (docs/architecture.md lists every module)."""
