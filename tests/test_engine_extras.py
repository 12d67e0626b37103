"""The engine's decoding beyond OpenAI's parameters, against transformers on a random-weight GPT-2
checkpoint in float32: beam search (the hypotheses and their order, also while ordinary requests
share the batch), the logits processors through whole generations, and vLLM's output semantics
(stop tokens, ignore_eos, min_tokens, include_stop_str_in_output, prompt_logprobs, token ids as
logprob tokens)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from test_engine import Sink, hf, job, model, run_all, tok  # noqa: F401 (fixtures)
from tests.compare import assert_same_choices
from worker.engine import Engine

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def stop_token(hf, tok):
    """A token this random model often generates, to stand for end-of-text: with the real one (never
    likely here) no beam would ever finish early."""
    counts = Counter()
    for text in PROMPTS:
        prompt = tok.encode(text)
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=10, num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=0)
        counts.update(t for row in out[:, len(prompt) + 1:].tolist() for t in row)
    return counts.most_common(1)[0][0]


def token_ids(sink, job_id) -> dict[int, list[int]]:
    """Each choice's tokens: its deltas' token_ids joined."""
    ids: dict[int, list[int]] = {}
    for _, d in sink.of(job_id, "delta"):
        ids.setdefault(d["index"], []).extend(d["token_ids"])
    return ids


def hf_beams(hf, prompt, *, width, n, max_new, length_penalty, early_stopping, eos, **kw):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=width, num_return_sequences=n, max_new_tokens=max_new, do_sample=False,
                      length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                      pad_token_id=eos, **kw)
    rows = []
    for row in out[:, len(prompt):].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


BEAMS = [  # width, n, max_new, length_penalty, early_stopping
    (4, 2, 10, 1.0, False),
    (3, 3, 8, 2.0, True),
    (3, 1, 9, -0.5, "never"),
]


def test_beam_search_equals_transformers_beside_ordinary_requests(model, tok, hf, stop_token):
    engine = Engine(model, tok, max_batch=16, event_sink=(sink := Sink()), eos_token_id=stop_token, prefill_chunk=6)
    beam_jobs, expected = [], []
    for width, n, max_new, lp, es in BEAMS:
        beam_jobs.append(job(tok, PROMPTS, use_beam_search=True, n=n, best_of=width, max_tokens=max_new,
                             length_penalty=lp, early_stopping=es))
        expected.append([hf_beams(hf, tok.encode(p), width=width, n=n, max_new=max_new, length_penalty=lp,
                                  early_stopping=es, eos=stop_token) for p in PROMPTS])
    others = [job(tok, [PROMPTS[1]], temperature=0.9, seed=7, n=2, max_tokens=12),
              job(tok, [PROMPTS[0]], max_tokens=10, logprobs=2)]
    alone = [Engine(model, tok, max_batch=4, eos_token_id=stop_token).generate(j) for j in others]
    results = run_all(engine, beam_jobs[:1] + others[:1] + beam_jobs[1:] + others[1:])
    beam_results = [results[0], results[2], results[3]]
    finished_early = set()
    for j, result, want, (width, n, max_new, lp, es) in zip(beam_jobs, beam_results, expected, BEAMS):
        got = token_ids(sink, j.id)
        for p, hyps in enumerate(want):
            assert [got[p * n + i] for i in range(n)] == hyps, (j.id, p)
            for i, hyp in enumerate(hyps):
                choice = result["choices"][p * n + i]
                assert choice["text"] == tok.decode([t for t in hyp if t != stop_token])
                assert choice["finish_reason"] == ("stop" if hyp[-1] == stop_token else "length")
                finished_early |= {len(hyp) < max_new}
        assert result["usage"]["completion_tokens"] == sum(len(h) for hyps in want for h in hyps)
    assert finished_early == {True, False}  # some hypotheses ended at the stop token
    # the ordinary requests beside them are what they are alone
    for result, by_itself in zip((results[1], results[4]), alone):
        assert_same_choices(result["choices"], by_itself["choices"])
    assert engine.stats()["kv_slots_used"] == 0


def test_beam_search_with_repetition_penalty_and_ngram_bans_equals_transformers(model, tok, hf, stop_token):
    engine = Engine(model, tok, max_batch=8, event_sink=(sink := Sink()), eos_token_id=stop_token)
    j = job(tok, PROMPTS[:2], use_beam_search=True, n=2, best_of=3, max_tokens=10,
            repetition_penalty=1.6, no_repeat_ngram_size=2)
    engine.generate(j)
    got = token_ids(sink, j.id)
    for p, prompt in enumerate(PROMPTS[:2]):
        want = hf_beams(hf, tok.encode(prompt), width=3, n=2, max_new=10, length_penalty=1.0, early_stopping=False,
                        eos=stop_token, repetition_penalty=1.6, no_repeat_ngram_size=2)
        assert [got[p * 2], got[p * 2 + 1]] == want


def test_beam_search_wider_than_the_cache_is_refused(model, tok):
    engine = Engine(model, tok, max_batch=2)
    with pytest.raises(Exception) as info:
        engine.generate(job(tok, PROMPTS[:1], use_beam_search=True, n=3))
    assert info.value.param == "n" and info.value.status == 400


def hf_greedy(hf, prompt, max_new, **kw):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, pad_token_id=50256, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw,hf_kw", [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"repetition_penalty": 0.6}, {"repetition_penalty": 0.6}),
    ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 1}),
])
def test_greedy_with_processors_equals_transformers(model, tok, hf, kw, hf_kw):
    engine = Engine(model, tok, max_batch=4, event_sink=(sink := Sink()))
    jobs = [job(tok, [p], max_tokens=12, **kw) for p in PROMPTS]
    run_all(engine, jobs)
    for j, p in zip(jobs, PROMPTS):
        assert token_ids(sink, j.id)[0] == hf_greedy(hf, tok.encode(p), 12, **hf_kw)


def test_bad_words_and_allowed_tokens_through_a_generation(model, tok):
    engine = Engine(model, tok, max_batch=4, event_sink=(sink := Sink()))
    sampled = dict(temperature=1.0, seed=3)  # the same draws whatever is banned, up to the first ban
    plain = job(tok, [PROMPTS[0]], max_tokens=10, **sampled)
    run_all(engine, [plain])
    tokens = token_ids(sink, plain.id)[0]
    first_new = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    pair = tokens[:2]  # a two-token bad word: its second token may not follow its first
    banned = job(tok, [PROMPTS[0]], max_tokens=10, bad_words=[[tokens[first_new]]], **sampled)
    banned_pair = job(tok, [PROMPTS[0]], max_tokens=10, bad_words=[pair], **sampled)
    allowed = job(tok, [PROMPTS[0]], max_tokens=6, allowed_token_ids=[11, 13, 262])
    run_all(engine, [banned, banned_pair, allowed])
    got = token_ids(sink, banned.id)[0]
    assert got[:first_new] == tokens[:first_new] and tokens[first_new] not in got
    got = token_ids(sink, banned_pair.id)[0]
    assert got[0] == pair[0] and all(got[i:i + 2] != pair for i in range(len(got) - 1))
    assert set(token_ids(sink, allowed.id)[0]) <= {11, 13, 262}


def test_stop_token_ids_ignore_eos_min_tokens(model, tok):
    engine = Engine(model, tok, max_batch=4, event_sink=(sink := Sink()))
    plain = job(tok, [PROMPTS[1]], max_tokens=10)
    run_all(engine, [plain])
    tokens = token_ids(sink, plain.id)[0]
    stop = tokens[3]
    stopped, late, kept = (job(tok, [PROMPTS[1]], max_tokens=10, stop_token_ids=[stop]),
                           job(tok, [PROMPTS[1]], max_tokens=10, stop_token_ids=[stop], min_tokens=6),
                           job(tok, [PROMPTS[1]], max_tokens=10, stop_token_ids=[stop], include_stop_str_in_output=True))
    r_stopped, r_late, r_kept = run_all(engine, [stopped, late, kept])
    first = tokens.index(stop)
    assert token_ids(sink, stopped.id)[0] == tokens[:first + 1]  # the stop token is generated, its text not shown
    assert r_stopped["choices"][0]["text"] == tok.decode(tokens[:first])
    assert (r_stopped["choices"][0]["finish_reason"], r_stopped["choices"][0]["stop_reason"]) == ("stop", stop)
    assert r_kept["choices"][0]["text"] == tok.decode(tokens[:first + 1])
    assert stop not in token_ids(sink, late.id)[0][:6]  # banned before min_tokens
    # ignore_eos: with the end-of-text token forced first, the choice goes on, its text skipped by default
    eos = tok.eos_token_id
    forced = dict(max_tokens=4, logit_bias={eos: 100}, ignore_eos=True)
    skip, shown = run_all(engine, [job(tok, [PROMPTS[0]], **forced),
                                   job(tok, [PROMPTS[0]], skip_special_tokens=False, **forced)])
    assert skip["choices"][0]["text"] == "" and skip["usage"]["completion_tokens"] == 4
    assert shown["choices"][0]["text"] == "<|endoftext|>" * 4


def test_stop_string_kept_with_include_stop_str_in_output(model, tok):
    engine = Engine(model, tok, max_batch=4)
    text = engine.generate(job(tok, [PROMPTS[2]], max_tokens=12))["choices"][0]["text"]
    stop = text[5:8]
    cut = engine.generate(job(tok, [PROMPTS[2]], max_tokens=12, stop=[stop]))["choices"][0]
    kept = engine.generate(job(tok, [PROMPTS[2]], max_tokens=12, stop=[stop], include_stop_str_in_output=True))["choices"][0]
    start = text.index(stop)
    assert cut["text"] == text[:start] and kept["text"] == text[:start + len(stop)]
    assert cut["stop_reason"] == kept["stop_reason"] == stop


def test_prompt_logprobs_and_token_ids_as_logprob_tokens(model, tok, hf):
    engine = Engine(model, tok, max_batch=4)
    prompt = tok.encode(PROMPTS[1])
    result = engine.generate(job(tok, [prompt], max_tokens=2, prompt_logprobs=2, logprobs=1,
                                 return_tokens_as_token_ids=True))
    choice = result["choices"][0]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        row = lp[i - 1]
        top = row.topk(2)
        want_ids = {str(t) for t in top.indices.tolist()} | {str(prompt[i])}
        assert set(entry) == want_ids
        actual = entry[str(prompt[i])]
        assert actual["logprob"] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert actual["rank"] == int((row > row[prompt[i]]).sum()) + 1
        assert actual["decoded_token"] == tok.decode([prompt[i]])
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)


def test_a_finish_rides_on_the_last_delta(model, tok):
    engine = Engine(model, tok, max_batch=4, event_sink=(sink := Sink()))
    j = job(tok, [PROMPTS[0]], max_tokens=3)
    engine.generate(j)
    deltas = [d for _, d in sink.of(j.id, "delta")]
    assert deltas[-1]["finish_reason"] == "length" and "finish_reason" not in deltas[0]
    assert len(sink.of(j.id, "finish")) == 1
