"""End to end: the official `openai` client against gunicorn and one `processor.py` serving a model
of each family at once (GPT-Neo, GPT-J, OPT, GPT-NeoX), over a private redis-server. Greedy
completions equal transformers' generate; OPT's BOS is counted in usage; streaming and logprobs
come through each family's tokenizer."""
from __future__ import annotations

import openai
import pytest
import torch

from conftest import FAMILY_CONFIGS
from models.tokenizer import load_tokenizer
from tests.stack import start_gunicorn, start_processor, write_models_toml
from web.dev.local_redis import start_redis

pytestmark = pytest.mark.slow  # the whole stack as processes, one per family

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def stack(family_checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e-families")
    models = write_models_toml(tmp / "models.toml", family_checkpoints, device="cpu", max_batch=4)
    server = start_redis()
    try:
        with start_processor(server.url, models, concurrency=2, log_dir=tmp), \
                start_gunicorn(server.url, models, env={"NANOSERVE_AUTH": "disabled"}, workers=1, threads=8,
                               log_dir=tmp) as web:
            yield openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_greedy_completion_equals_transformers(stack, family_checkpoints, family):
    import transformers

    directory = family_checkpoints[family]
    tok = load_tokenizer(directory)
    hf = getattr(transformers, FAMILY_CONFIGS[family][1]).from_pretrained(directory).eval()
    ids = tok.encode(PROMPT)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=6,
                      min_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id,
                      suppress_tokens=list(range(tok.vocab_size, hf.config.vocab_size)) or None)
    want = out[0, len(ids):].tolist()

    result = stack.completions.create(model=family, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    choice = result.choices[0]
    assert choice.text == tok.decode(want)
    assert choice.logprobs.tokens == [tok.token_string(t) for t in want]
    assert result.usage.prompt_tokens == len(ids) == len(tok.encode(PROMPT))
    assert result.model == family

    streamed = "".join(c.choices[0].text for c in stack.completions.create(
        model=family, prompt=PROMPT, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == choice.text


def test_opt_counts_its_bos_and_echoes_the_prompt_as_sent(stack, family_checkpoints):
    plain = load_tokenizer(family_checkpoints["gpt_neo"]).encode(PROMPT)  # GPT-2's BPE of the same text
    result = stack.completions.create(model="opt", prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=0)
    assert result.usage.prompt_tokens == len(plain) + 1
    assert result.choices[0].text.startswith(PROMPT)
    assert result.choices[0].logprobs.tokens[0] == "</s>"
    assert stack.models.retrieve("opt").id == "opt"
