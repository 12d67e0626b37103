"""lm-evaluation-harness, tried as a user would: its `local-completions` backend (text prompts, as the
harness sends them, with `<|endoftext|>` as the document separator) against nanoserve scores the same
as its own transformers backend (`hf`) on the same checkpoint, and its generation mode (stop strings
plus the end-of-text string: five of them) gets the same greedy text.
"""
from __future__ import annotations

import pytest

from lm_eval.api.instance import Instance

from tests.stack import start_gunicorn, start_processor, write_models_toml
from web.dev.local_redis import start_redis

pytestmark = pytest.mark.slow  # the whole stack as processes under the harness

EOT = "<|endoftext|>"
PAIRS = [  # (context, continuation) as a task hands them to the harness
    (EOT, "Hello world"),  # an empty context: the harness puts the end-of-text token before it
    ("The quick brown fox", " jumps over the lazy dog"),
    (f"First document.{EOT}Second", " document, continued"),
    ("Question: what is 2 + 2?\nAnswer:", " 4"),
]
GENERATE = [("Once upon a time", ["\n\n", ".", "Question:", "!!"]),  # four of the task's, and the harness adds EOT
            ("The weather today is", ["\n", " and", ",", ";"])]


@pytest.fixture(scope="module")
def harness_models(hf_checkpoint, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tmp = tmp_path_factory.mktemp("lm-eval")
    models = write_models_toml(tmp / "models.toml", {"tiny": hf_checkpoint}, device="cpu", max_batch=8)
    server = start_redis()
    try:
        with start_processor(server.url, models, models=["tiny"], concurrency=2, log_dir=tmp), \
                start_gunicorn(server.url, models, env={"NANOSERVE_AUTH": "disabled"}, log_dir=tmp) as web:
            api = LocalCompletionsAPI(base_url=f"{web.url}/v1/completions", model="tiny", tokenizer=str(hf_checkpoint),
                                      tokenizer_backend="huggingface", tokenized_requests=False, max_length=128,
                                      max_gen_toks=12)
            hf = HFLM(pretrained=str(hf_checkpoint), device="cpu", batch_size=1, max_length=128)
            yield api, hf
    finally:
        server.stop()


def _instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_of_text_prompts_equals_the_transformers_backend(harness_models):
    api, hf = harness_models
    got = api.loglikelihood(_instances("loglikelihood", PAIRS))
    want = hf.loglikelihood(_instances("loglikelihood", PAIRS))
    for (lp, greedy), (want_lp, want_greedy), pair in zip(got, want, PAIRS):
        assert lp == pytest.approx(want_lp, abs=1e-4), pair
        assert greedy == want_greedy, pair


def test_generation_with_five_stop_strings_equals_the_transformers_backend(harness_models):
    api, hf = harness_models
    args = [(context, {"until": until, "max_gen_toks": 12, "do_sample": False}) for context, until in GENERATE]
    got = api.generate_until(_instances("generate_until", args))
    want = hf.generate_until(_instances("generate_until", [(c, dict(kw)) for c, kw in args]))
    assert got == want
    assert all(isinstance(text, str) for text in got) and any(got)  # some text was generated
