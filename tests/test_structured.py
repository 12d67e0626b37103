"""Structured output (vLLM's structured_outputs and guided_* fields, OpenAI's response_format) on a
random-weight GPT-2 checkpoint, where the grammar's mask does all the work: every finished completion
parses or matches, sampled or greedy, with n, logprobs, stop strings, seeds and a resumed job; a
completion cut by max_tokens says `length`; bad constraints are 400s naming their field."""
from __future__ import annotations

import json
import re

import pytest
import torch

from models.tokenizer import CharTokenizer
from test_engine import job, make_engine, model, tok  # noqa: F401 (fixtures)
from web.api.schemas import parse_completion_request
from worker import protocol
from worker.errors import EngineError
from worker.grammar import Grammars

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b c", 'd"e']}}}


def _fits_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "ok", "n", "tag"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and isinstance(value["ok"], bool) and type(value["n"]) is int and 0 <= value["n"] <= 99
            and value["tag"] in ("a", "b c", 'd"e'))


# (request fields, what every finished completion must satisfy)
CONSTRAINTS = {
    "json schema": ({"structured_outputs": {"json": SCHEMA}}, _fits_schema),
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
                                    _fits_schema),
    "regex": ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    "choice": ({"structured_outputs": {"choice": ["yes", "no", "maybe so", "n/a"]}},
               lambda t: t in ("yes", "no", "maybe so", "n/a")),
    "lark": ({"guided_grammar": 'start: "(" NUM "," NUM ")"\nNUM: /[0-9]{1,2}/'},
             lambda t: re.fullmatch(r"\([0-9]{1,2},[0-9]{1,2}\)", t)),
    "gbnf": ({"structured_outputs": {"grammar": 'root ::= ("on" | "off") " " [0-9]'}},
             lambda t: re.fullmatch(r"(on|off) [0-9]", t)),
}


def grammar_of(**fields) -> str:
    return parse_completion_request({"model": "tiny", "prompt": "x", **fields}).to_job(
        _Spec(), [[1]], seed=0).grammar


class _Spec:
    id = "tiny"


@pytest.mark.parametrize("name", CONSTRAINTS)
def test_every_finished_completion_follows_its_constraint(model, tok, name):
    fields, valid = CONSTRAINTS[name]
    grammar = grammar_of(**fields)
    engine, _ = make_engine(model, tok)
    jobs = [job(tok, max_tokens=80, grammar=grammar),  # greedy
            job(tok, ["The quick brown fox", "Once upon a time"], max_tokens=80, grammar=grammar, temperature=1.0,
                seed=3, n=3, logprobs=2)]
    for completion in [engine.generate(j) for j in jobs]:
        for choice in completion["choices"]:
            assert choice["finish_reason"] == "stop", choice
            assert valid(choice["text"]), choice["text"]
            if choice["logprobs"] is not None:  # the sampled job's: the model's own, of exactly the text's tokens
                lp = choice["logprobs"]
                assert "".join(lp["tokens"]) == choice["text"] and all(v <= 0 for v in lp["token_logprobs"])
    assert len(completion["choices"]) == 6 and completion["choices"][0]["logprobs"] is not None  # the last, sampled job


def test_an_unconstrained_request_in_the_same_batch_is_unchanged(model, tok):
    engine, _ = make_engine(model, tok)
    plain = dict(prompts=["Hello world"], temperature=1.0, seed=11, max_tokens=12)
    alone = engine.generate(job(tok, **plain))
    together = [engine.submit(j) for j in (job(tok, **plain), job(tok, max_tokens=12, grammar=grammar_of(
        guided_regex="[a-z]+"), temperature=1.0, seed=2))]
    while not all(h.done for h in together):
        engine.step()
    assert together[0].result()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert re.fullmatch("[a-z]+", together[1].result()["choices"][0]["text"])


def test_a_completion_cut_by_max_tokens_says_length_and_is_a_prefix(model, tok):
    grammar = grammar_of(structured_outputs={"json": SCHEMA})
    engine, _ = make_engine(model, tok)
    whole = engine.generate(job(tok, max_tokens=80, grammar=grammar, temperature=1.0, seed=4))["choices"][0]
    cut = engine.generate(job(tok, max_tokens=3, grammar=grammar, temperature=1.0, seed=4))["choices"][0]
    assert cut["finish_reason"] == "length" and whole["text"].startswith(cut["text"]) and cut["text"] != whole["text"]


def test_stop_strings_and_seeds_apply_to_a_constrained_completion(model, tok):
    engine, _ = make_engine(model, tok)
    choice = grammar_of(guided_choice=["maybe so"])
    stopped = engine.generate(job(tok, max_tokens=20, grammar=choice, stop=["be"]))["choices"][0]
    assert (stopped["text"], stopped["finish_reason"], stopped["stop_reason"]) == ("may", "stop", "be")
    regex = grammar_of(guided_regex=r"[a-z]{4,12}")
    runs = [engine.generate(job(tok, max_tokens=20, grammar=regex, temperature=1.0, seed=seed, n=2))
            for seed in (7, 7, 8)]
    texts = [[c["text"] for c in run["choices"]] for run in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_a_resumed_constrained_job_continues_where_its_stream_stopped(model, tok):
    grammar = grammar_of(structured_outputs={"json": SCHEMA})
    engine, sink = make_engine(model, tok)
    first = job(tok, max_tokens=80, grammar=grammar, temperature=1.0, seed=9, n=2)
    full = engine.generate(first)
    emitted = {}
    for _, d in sink.of(first.id, "delta")[:6]:  # as if the worker died three steps in
        emitted.setdefault(d["index"], []).extend(d["token_ids"])
    again = protocol.CompletionJob(**{**first.model_dump(), "id": "resumed"})
    resumed = make_engine(model, tok)[0].generate(again, resume=emitted)
    assert [c["text"] for c in resumed["choices"]] == [c["text"] for c in full["choices"]]
    assert all(_fits_schema(c["text"]) for c in resumed["choices"])


def test_a_constraint_no_text_can_follow_is_refused_by_the_engine(model, tok):
    engine, _ = make_engine(model, tok)
    with pytest.raises(EngineError) as refused:
        engine.generate(job(tok, grammar=grammar_of(guided_regex=r"[^\s\S]")))
    assert refused.value.status == 400 and refused.value.param == "structured_outputs"


def test_a_character_vocabulary_without_end_of_text(tmp_path):
    """nanoGPT's character vocabulary has no end-of-text token: the mask allows exactly the
    characters the grammar does, and a complete grammar stops the sequence (not an end token)."""
    chars = "\n -0123456789abcdefghij"
    vocab = CharTokenizer({i: c for i, c in enumerate(chars)})
    grammars = Grammars(vocab, vocab.vocab_size)
    matcher = grammars.matcher(grammar_of(guided_regex="a[0-9]b"))
    allowed = lambda: [chars[i] for i in torch.isfinite(grammars.mask(torch.zeros(1, len(chars)), [matcher]))[0].nonzero()[:, 0]]
    assert allowed() == ["a"]
    matcher.consume_token(chars.index("a"))
    assert allowed() == list("0123456789")
    for c in "7b":
        matcher.consume_token(chars.index(c))
    assert matcher.is_stopped()


def test_the_bitmask_unpacks_alike_on_the_host_and_by_device_ops():
    """A GPU unpacks the mask's words with tensor ops, a CPU with numpy: the same banned tokens."""
    from worker.grammar import _banned_by_numpy, _banned_on

    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 1571), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    by_numpy, by_ops = _banned_by_numpy(bitmask, 50257), _banned_on(bitmask, 50257, torch.device("cpu"))
    assert by_numpy.shape == (5, 50257) and torch.equal(by_numpy, by_ops)
    word, bit = divmod(12345, 32)
    assert bool(by_numpy[2, 12345]) == (not (int(bitmask[2, word]) >> bit) & 1)


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: "a" "b'}}, "structured_outputs"),
    ({"guided_grammar": "root ::= undefined-rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "b"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex"),
    ({"guided_regex": "a", "penalty_alpha": 0.5, "top_k": 4}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_their_field(fields, param):
    with pytest.raises(protocol.APIError) as refused:
        parse_completion_request({"model": "tiny", "prompt": "x", **fields})
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message
