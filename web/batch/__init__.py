"""Batches: OpenAI's files and batches kept in Redis, the input checks, and the dispatcher that runs a
batch's lines. Nothing here knows Flask or the request path: web/api/batch_lines.py gives the
dispatcher those."""
