"""The playground at `/`: served by the web tier as a public page with the right content types, and
used in a real browser — Debian's headless chromium driven by selenium through its chromedriver —
against the real stack (redis-server, processor.py, gunicorn): a prompt streams into tokens coloured
by their logprobs with the alternatives on hover, Stop aborts, errors show OpenAI's message, and with
keys required the page shows the 401 until a key is typed.

Screenshots go to `test-artifacts/` (ignored by git); each test prints the path of its own.
`make browser` installs chromium and chromedriver from Debian's packages when they are missing.
"""
from __future__ import annotations

import colorsys
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import openai
import pytest
import redis

import rq_json
from conftest import REPO, make_hf_checkpoint
from stack import start_gunicorn, start_processor, write_models_toml
from web.app import create_app
from worker import protocol

ARTIFACTS = REPO / "test-artifacts"
STATIC = REPO / "web" / "static"
WAIT_S = 60


# ---- the page as the web tier serves it (no browser) ----

def test_page_is_public_with_correct_types(redis_url, hf_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_AUTH", "required")
    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint})
    app = create_app({"redis_url": redis_url, "models_path": str(models)})
    client = app.test_client()

    assert [rule.endpoint for rule in app.url_map.iter_rules() if rule.rule == "/"] == ["playground.page"]
    page = client.get("/")
    assert page.status_code == 200 and page.content_type == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    for path in re.findall(r'(?:src|href)="(/[^"]+)"', page.get_data(as_text=True)):
        asset = client.get(path)
        assert asset.status_code == 200, path
        expected = "javascript" if path.endswith(".js") else "css"
        assert expected in asset.content_type, (path, asset.content_type)
    assert client.head("/").status_code == 200
    assert client.get("/static/playground.js").status_code == 404  # one URL per file
    # the page is public, the API behind it is not
    assert client.get("/v1/models").status_code == 401


def test_page_fetches_nothing_from_elsewhere():
    for name in ("playground.html", "playground.js", "playground.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/|@import", text), name


# ---- in a browser, against the real stack ----

@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    """One worker and two web tiers over it: one open, one requiring API keys."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    directory = tmp_path_factory.mktemp("playground")
    # a 1024-token context, so a long completion streams for a while (the Stop test)
    checkpoint = make_hf_checkpoint(directory / "tiny", n_positions=1024)
    models = write_models_toml(directory / "models.toml", {"tiny": checkpoint}, device="cpu", max_batch=8)
    with start_processor(redis_server.url, models, concurrency=2), \
         start_gunicorn(redis_server.url, models, workers=1, threads=8) as open_web, \
         start_gunicorn(redis_server.url, models, workers=1, threads=8, env={"NANOSERVE_AUTH": "required"}) as auth_web:
        yield {"open": open_web.url, "auth": auth_web.url, "redis_url": redis_server.url}


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = os.environ.get("CHROMIUM") or shutil.which("chromium")
    driver_path = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not (binary and driver_path):
        pytest.fail("chromium and chromedriver are needed: `make browser` installs Debian's packages")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


class Page:
    """The playground in the browser: its fields, buttons and what it shows."""

    def __init__(self, driver, url: str):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.url, self.by = driver, url, By
        self.wait_for = lambda condition, timeout=WAIT_S: WebDriverWait(driver, timeout, 0.02).until(
            lambda _: condition())
        driver.get(url + "/")
        driver.execute_script("localStorage.clear()")
        self.reload()

    def reload(self) -> None:
        self.driver.get(self.url + "/")
        self.wait_for(lambda: self.models() or self.error())

    def el(self, css: str):
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def els(self, css: str):
        return self.driver.find_elements(self.by.CSS_SELECTOR, css)

    def models(self) -> list[str]:
        return [option.get_attribute("value") for option in self.els("#model option")]

    def error(self) -> str:
        error = self.el("#error")
        return error.text if error.is_displayed() else ""

    def fill(self, **fields) -> None:
        """Type into fields by id (`max_tokens=…` fills `#max-tokens`); a field's change event fires."""
        from selenium.webdriver.common.keys import Keys

        for name, value in fields.items():
            field = self.el("#" + name.replace("_", "-"))
            field.clear()
            field.send_keys(str(value), Keys.TAB)

    def run(self) -> None:
        self.el("#run").click()

    def state(self) -> str | None:
        return self.el("#output").get_attribute("data-state")

    def wait_finished(self) -> str:
        self.wait_for(lambda: self.state() in ("done", "stopped", "error"))
        return self.state()

    def completion(self) -> str:
        return self.driver.execute_script("return document.querySelector('#output .completion').textContent")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def drawn_tokens(choice) -> list[int]:
    """The indices of the tokens that have text of their own (a token holding only part of a UTF-8
    character has none: the character shows with its last token)."""
    offsets = choice.logprobs.text_offset
    ends = offsets[1:] + [offsets[0] + len(choice.text)]
    return [i for i, (start, end) in enumerate(zip(offsets, ends)) if start < end]


def hue(css_colour: str) -> float:
    r, g, b = (int(x) / 255 for x in re.findall(r"\d+", css_colour)[:3])
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


def tip_alternatives(tip: str) -> dict[str, float]:
    lines = tip.split("\n")
    assert lines[1] == "top alternatives:", tip
    pairs = [re.fullmatch(r'\s+(".*")\s+[\d.]+%\s+\((-?[\d.]+)\)', line) for line in lines[2:]]
    assert all(pairs), tip
    return {json.loads(m.group(1)): float(m.group(2)) for m in pairs}


def test_streams_tokens_coloured_by_logprob_with_alternatives(stack, browser):
    from selenium.webdriver.common.action_chains import ActionChains

    page = Page(browser, stack["open"])
    assert page.models() == ["tiny"] and not page.error()
    params = {"max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "logprobs": 5}
    prompt = "The quick brown fox"
    page.fill(prompt=prompt, **params)
    page.run()
    page.wait_for(lambda: page.els("#output .completion .token"))  # streamed text appears
    assert page.wait_finished() == "done", page.error()
    assert int(page.el("#output .completion").get_attribute("data-chunks")) > 2  # arrived in pieces

    client = openai.OpenAI(base_url=stack["open"] + "/v1", api_key="unused")
    response = client.completions.create(model="tiny", prompt=prompt, **params)
    reference, usage = response.choices[0], response.usage
    assert page.completion() == reference.text
    assert f"{usage.completion_tokens} completion" in page.el("#status").text
    assert "finish: length" in page.el("#status").text

    spans = page.els("#output .completion .token")
    drawn = drawn_tokens(reference)
    assert len(spans) == len(drawn)
    for span, i in zip(spans, drawn):
        logprob = float(span.get_attribute("data-logprob"))
        assert logprob == pytest.approx(reference.logprobs.token_logprobs[i], abs=1e-4)
        # the colour is the token's probability on a red (0) → green (1) scale
        colour = span.value_of_css_property("background-color")
        assert hue(colour) == pytest.approx(120 * math.exp(logprob), abs=3), colour

    # hover the least likely token: its top-5 alternatives, as the API gives them, in the tooltip
    i_least = min(range(len(drawn)), key=lambda k: reference.logprobs.token_logprobs[drawn[k]])
    ActionChains(browser).move_to_element(spans[i_least]).perform()
    page.wait_for(lambda: page.el("#tooltip").is_displayed())
    tip = page.el("#tooltip").get_attribute("textContent")
    expected = reference.logprobs.top_logprobs[drawn[i_least]]
    shown = tip_alternatives(tip)
    assert shown.keys() == expected.keys() and len(shown) >= 5
    assert all(shown[t] == pytest.approx(lp, abs=1e-3) for t, lp in expected.items())
    page.screenshot("playground")


def test_stop_aborts_the_stream(stack, browser):
    page = Page(browser, stack["open"])
    page.fill(prompt="Once upon a time", max_tokens=1000, temperature=1, logprobs="")  # plain text
    page.run()
    page.wait_for(lambda: page.completion())
    page.el("#stop-run").click()
    assert page.wait_finished() == "stopped"
    shown = page.completion()
    time.sleep(0.5)
    assert page.completion() == shown  # nothing arrives after Stop
    assert not page.els("#output .token") and page.el("#status").text == "stopped"
    assert page.el("#run").is_enabled() and not page.el("#stop-run").is_enabled()

    # the closed stream cancelled the job: the worker drops it long before its 1000 tokens
    r = redis.Redis.from_url(stack["redis_url"])
    started = rq_json.started(protocol.queue_name("tiny"), r)
    page.wait_for(lambda: started.count == 0, timeout=5)
    assert r.keys(protocol.cancel_key("*"))


def test_structured_output_constrains_the_completion(stack, browser):
    from selenium.webdriver.support.ui import Select

    page = Page(browser, stack["open"])
    page.fill(prompt="Pick one:", max_tokens=20, temperature=1, seed=5, logprobs="")
    Select(page.el("#structured")).select_by_value("choice")
    page.el("#constraint").send_keys("red apple\ngreen pear\nblue plum")
    page.run()
    assert page.wait_finished() == "done", page.error()
    assert page.completion() in ("red apple", "green pear", "blue plum")
    assert "finish: stop" in page.el("#status").text
    Select(page.el("#structured")).select_by_value("regex")
    page.el("#constraint").clear()
    page.el("#constraint").send_keys("a(b")
    page.run()
    assert page.wait_finished() == "error" and "regex" in page.error()


def chunk(text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def stub_completions(browser, frames: list[dict]) -> None:
    """Make the page's POST /v1/completions answer these SSE frames (with a keepalive comment and
    entry ids, as the server writes them), for stream shapes the tiny model cannot be made to give."""
    body = ": keepalive\n" + "".join(f"id: 1-{i}\ndata: {json.dumps(f)}\n\n" for i, f in enumerate(frames))
    browser.execute_script("""
        const [body, real] = [arguments[0], window.fetch];
        window.fetch = (url, init) => url === "/v1/completions"
          ? Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}))
          : real(url, init);""", body + "data: [DONE]\n\n")


def test_errors_show_openai_message(stack, browser):
    page = Page(browser, stack["open"])
    page.fill(prompt="Hello", max_tokens=8, stop="\n".join("abcdefghijklmnopq"))  # past the cap of 16
    page.run()
    assert page.wait_finished() == "error"
    assert page.error().startswith("Error 400: ") and "'stop'" in page.error()

    # An error after the stream started arrives as a `data: {"error": …}` chunk: the text so far stays.
    stub_completions(browser, [chunk(" partial"),
                               {"error": {"message": "The worker failed while running this request.",
                                          "type": "server_error", "param": None, "code": "job_failed"}}])
    page.fill(stop="", logprobs="")
    page.run()
    assert page.wait_finished() == "error"
    assert page.error() == "Error: The worker failed while running this request."
    assert page.completion() == " partial"


def test_tokens_are_drawn_with_their_text(stack, browser):
    """Logprobs arrive with each token, text can come later: a character split over two tokens shows
    with the second, and tokens of a stop sequence (text held back, then cut) are not drawn."""
    def lp(tokens, offsets):
        return {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens),
                "top_logprobs": [{t: -0.1} for t in tokens], "text_offset": offsets}

    page = Page(browser, stack["open"])
    stub_completions(browser, [chunk(" caf", lp([" caf", "bytes:\\xc3"], [5, 9])),
                               chunk("é", lp(["bytes:\\xa9"], [9])),
                               chunk("", lp([" EN"], [10])),  # held back: could start " END"
                               chunk(" ENX", lp(["X"], [13])),  # released: it did not
                               chunk("", lp([" EN"], [14])),
                               chunk("", lp(["D"], [17])),  # " END": cut
                               chunk("", lp([], []), "stop")])
    page.fill(prompt="Hello", stop=" END")
    page.run()
    assert page.wait_finished() == "done", page.error()
    spans = page.els("#output .completion .token")
    assert [span.get_attribute("textContent") for span in spans] == [" caf", "é", " EN", "X"]
    assert page.completion() == " café ENX"
    assert spans[1].get_attribute("data-tip").startswith('"bytes:\\\\xa9"')
    assert "finish: stop" in page.el("#status").text


@pytest.fixture(scope="module")
def admin(stack):
    runner = create_app({"redis_url": stack["redis_url"]}).test_cli_runner()

    def run(*args: str) -> str:
        result = runner.invoke(args=list(args))
        assert result.exit_code == 0, result.output
        return result.stdout.strip()

    return run


def test_with_keys_required_401_until_a_key_is_given(stack, browser, admin):
    from selenium.webdriver.common.keys import Keys

    page = Page(browser, stack["auth"])
    assert page.models() == []
    assert page.error().startswith("Error 401: You didn't provide an API key")
    page.fill(prompt="Hello", max_tokens=8)
    page.run()  # no model to pick: the server still answers first that a key is missing
    assert page.wait_finished() == "error" and "Error 401: You didn't provide an API key" in page.error()
    page.screenshot("playground-401")

    page.fill(api_key="sk-not-a-real-key-1234")
    page.wait_for(lambda: "Incorrect API key provided" in page.error())

    key = admin("keys", "create", "playground")
    page.fill(api_key=key)
    page.wait_for(lambda: page.models() == ["tiny"])
    assert not page.error()
    page.fill(max_tokens=8, seed=3)
    page.el("#prompt").send_keys(Keys.CONTROL, Keys.ENTER)  # the keyboard way to run
    assert page.wait_finished() == "done", page.error()
    assert page.els("#output .completion .token") and page.completion()

    page.reload()  # the key is remembered in this browser
    assert page.el("#api-key").get_attribute("value") == key and page.models() == ["tiny"]
