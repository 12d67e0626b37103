"""The playground: a page at `/` to try the served models from a browser — pick a model, write a
prompt, set the sampling parameters, stream a completion and see each token coloured by its logprob.

The page is static (plain HTML, CSS and one small script in `web/static/`, no build step) and speaks
only the public `/v1` API, like any other client. So the page itself is public and the API calls
carry the key typed into it. Its Content-Security-Policy lets it load and call nothing but this
origin: the playground works on a machine without internet access, and a script injected into it
could not send a key elsewhere.
"""
from __future__ import annotations

from flask import Blueprint, Response

bp = Blueprint("playground", __name__, static_folder="static", static_url_path="/playground")

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@bp.get("/")
def page() -> Response:
    return bp.send_static_file("playground.html")


@bp.after_request
def _same_origin_only(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = _CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
