"""`/tokenize` and `/detokenize` with vLLM's shapes, through gunicorn and the real `openai` client,
against transformers' tokenizers of the same files: the ids a completion of that model would see."""
from __future__ import annotations

import httpx2
import openai
import pytest
import transformers

from stack import start_gunicorn, write_models_toml
from tests.conftest import make_family_checkpoint
from web.app import create_app

TEXT = "Hello, world! Ünïcödé and 12345 tokens."


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint, tmp_path_factory) -> dict:
    return {"tiny": hf_checkpoint, "opt": make_family_checkpoint(tmp_path_factory.mktemp("opt-tok"), "opt")}


@pytest.fixture(scope="module")
def web(redis_server, checkpoints, tmp_path_factory):
    models = write_models_toml(tmp_path_factory.mktemp("tokenize") / "models.toml", checkpoints, device="cpu")
    with start_gunicorn(redis_server.url, models, workers=1, threads=4, env={"NANOSERVE_AUTH": "required"}) as service:
        yield service


@pytest.fixture(scope="module")
def client(web, redis_server) -> openai.OpenAI:
    runner = create_app({"redis_url": redis_server.url, "batch_dispatch": False}).test_cli_runner()
    token = runner.invoke(args=["keys", "create", "tokenizer-user"]).stdout.strip()
    return openai.OpenAI(base_url=web.url + "/v1", api_key=token, max_retries=0)


def post(client: openai.OpenAI, path: str, **body) -> dict:
    return client.post(path, body=body, cast_to=httpx2.Response).json()


@pytest.mark.parametrize("model", ["tiny", "opt"])
def test_tokenize_gives_the_ids_transformers_gives(client, checkpoints, model):
    reference = transformers.AutoTokenizer.from_pretrained(checkpoints[model])
    answer = post(client, "/tokenize", model=model, prompt=TEXT, return_token_strs=True)
    expected = reference(TEXT)["input_ids"]  # OPT's starts with its BOS, GPT-2's with nothing
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["max_model_len"] == 128
    assert "".join(answer["token_strs"]).replace("</s>", "") == TEXT
    plain = post(client, "/tokenize", model=model, prompt=TEXT, add_special_tokens=False)["tokens"]
    assert plain == reference(TEXT, add_special_tokens=False)["input_ids"]
    assert post(client, "/detokenize", model=model, tokens=plain)["prompt"] == TEXT


def test_special_tokens_text_stands_for_them_as_in_a_prompt(client, checkpoints):
    reference = transformers.AutoTokenizer.from_pretrained(checkpoints["tiny"])
    text = "a<|endoftext|>b"
    for add in (True, False):
        answer = post(client, "/tokenize", model="tiny", prompt=text, add_special_tokens=add)
        assert answer["tokens"] == reference(text)["input_ids"] and 50256 in answer["tokens"]


def test_token_prompts_and_the_v1_paths(client):
    ids = post(client, "/tokenize", model="tiny", prompt="abc")["tokens"]
    assert post(client, "/tokenize", model="tiny", prompt=ids) == {"count": len(ids), "max_model_len": 128,
                                                                   "tokens": ids}
    root = openai.OpenAI(base_url=str(client.base_url).removesuffix("/v1/"), api_key=client.api_key, max_retries=0)
    assert post(root, "/tokenize", model="tiny", prompt="abc")["tokens"] == ids  # vLLM's own path
    assert post(root, "/detokenize", model="tiny", tokens=ids) == {"prompt": "abc"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "tiny", "prompt": "x", "bogus": 1}, "bogus"),
    ("/tokenize", {"model": "tiny", "prompt": [50257]}, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": 7}, "prompt"),
    ("/detokenize", {"model": "tiny", "tokens": [-1]}, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [99999999]}, "tokens"),
    ("/detokenize", {"model": "tiny"}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(path, body=body, cast_to=httpx2.Response)
    assert refused.value.param == param


def test_an_unknown_model_is_a_404_and_a_key_is_required(client):
    with pytest.raises(openai.NotFoundError):
        post(client, "/tokenize", model="nope", prompt="x")
    stranger = openai.OpenAI(base_url=str(client.base_url), api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        post(stranger, "/detokenize", model="tiny", tokens=[1])
