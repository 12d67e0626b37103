"""worker/beam_search.py against transformers' `generate(num_beams=…)`: the same hypotheses in the
same order, with the same length-penalised scores, for every early_stopping mode and several length
penalties. The model is a random-weight GPT-2 with a small vocabulary and a likely end-of-text token,
so that beams do finish early and the stopping rules are exercised."""
from __future__ import annotations

import pytest
import torch

from worker.beam_search import BeamSearch
from worker.logits_processors import apply_repetition_penalty, token_mask

V = 48
EOS = 35  # among this model's 4 likeliest tokens at 16% of positions (seed 0): beams often end


@pytest.fixture(scope="module")
def hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=V,
                        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(6.0)  # peaked distributions: beams differ in earnest
    return model


def hf_beams(model, prompt, *, width, n, max_new, length_penalty, early_stopping, **kw):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=width, num_return_sequences=n, max_new_tokens=max_new, do_sample=False,
                         length_penalty=length_penalty, early_stopping=early_stopping, pad_token_id=EOS,
                         eos_token_id=EOS, output_scores=True, return_dict_in_generate=True, **kw)
    sequences = []
    for row in out.sequences[:, len(prompt):].tolist():
        sequences.append(row[:row.index(EOS) + 1] if EOS in row else row)
    scores = getattr(out, "sequences_scores", None)  # None for one beam: transformers runs greedy search
    return sequences, None if scores is None else scores.tolist()


_runs: dict = {}  # (prompt, config) -> our search and its step count, shared by the tests below


def our_beams(model, prompt, *, width, n, max_new, length_penalty, early_stopping, repetition_penalty=1.0):
    key = (tuple(prompt), width, max_new, length_penalty, early_stopping, repetition_penalty)
    if key not in _runs:
        _runs[key] = run_search(model, prompt, width, max_new, length_penalty, early_stopping, repetition_penalty)
    search, _ = _runs[key]
    best = search.best(n)
    return [h.tokens for h in best], [h.score for h in best], best


def run_search(model, prompt, width, max_new, length_penalty, early_stopping, repetition_penalty):
    """Our bookkeeping over transformers' forward of every running beam (no cache: tiny model)."""
    search = BeamSearch(width, max_new, length_penalty=length_penalty, early_stopping=early_stopping,
                        stop_ids=(EOS,))
    steps = 0
    while not search.done:
        contexts = torch.tensor([prompt + beam.tokens for beam in search.running])
        with torch.no_grad():
            logits = model(contexts).logits[:, -1].float()
        scores = torch.log_softmax(logits, -1)
        if repetition_penalty != 1.0:
            seen = torch.stack([token_mask(row.tolist(), V) for row in contexts])
            scores = apply_repetition_penalty(scores, seen, torch.full((len(contexts),), repetition_penalty))
        search.step(scores)
        steps += 1
    assert steps <= max_new
    return search, steps


PROMPTS = [[5, 9, 12], [40, 2], [11, 30, 30, 8, 1]]
CONFIGS = [  # width, n, max_new, length_penalty, early_stopping
    (4, 4, 10, 1.0, False),
    (3, 2, 12, 2.0, True),
    (4, 3, 9, -1.0, "never"),
    (2, 1, 8, 0.0, "never"),
    (5, 2, 7, 0.5, False),
    (3, 3, 11, 1.5, "never"),
    (1, 1, 6, 1.0, False),  # one beam: greedy with a stop token
]


@pytest.mark.parametrize("width,n,max_new,length_penalty,early_stopping", CONFIGS)
def test_hypotheses_and_order_equal_transformers(hf_model, width, n, max_new, length_penalty, early_stopping):
    kw = dict(width=width, n=n, max_new=max_new, length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt in PROMPTS:
        want, want_scores = hf_beams(hf_model, prompt, **kw)
        got, got_scores, _ = our_beams(hf_model, prompt, **kw)
        assert got == want, prompt
        if want_scores is not None:
            assert got_scores == pytest.approx(want_scores, rel=1e-6, abs=1e-5)


def test_beams_do_finish_early_in_these_cases(hf_model):
    """The comparison above means something only if hypotheses end at the stop token, at different
    lengths, and the search stops before max_new_tokens in some of them."""
    reasons, lengths, early = set(), set(), False
    for width, n, max_new, lp, es in CONFIGS:
        for prompt in PROMPTS:
            _, _, best = our_beams(hf_model, prompt, width=width, n=n, max_new=max_new, length_penalty=lp,
                                   early_stopping=es)
            early |= _runs[(tuple(prompt), width, max_new, lp, es, 1.0)][1] < max_new
            reasons |= {h.finish_reason for h in best}
            lengths |= {len(h.tokens) for h in best}
    assert reasons == {"stop", "length"} and len(lengths) > 3 and early


def test_processed_scores_rank_beams_as_in_transformers(hf_model):
    kw = dict(width=3, n=3, max_new=8, length_penalty=1.0, early_stopping=False)
    for prompt in PROMPTS[:2]:
        want, want_scores = hf_beams(hf_model, prompt, repetition_penalty=1.8, **kw)
        got, got_scores, _ = our_beams(hf_model, prompt, repetition_penalty=1.8, **kw)
        assert got == want
        assert got_scores == pytest.approx(want_scores, rel=1e-6, abs=1e-5)


def test_ends_callback_and_notes():
    """A continuation `ends` declares finished is a hypothesis, never a running beam; notes follow
    their beams through forks."""
    search = BeamSearch(2, 5, stop_ids=())
    scores = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0]]), -1)
    parents = search.step(scores, ends=lambda parent, token: token == 1, note=lambda parent, token: f"t{token}")
    assert [h.tokens for h in search.finished] == [[1]] and search.finished[0].finish_reason == "stop"
    assert [b.tokens for b in search.running] == [[2], [3]] and parents == [0, 0]
    assert [b.notes for b in search.running] == [["t2"], ["t3"]]
    two = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0, 5.0], [4.0, 0.0, 0.0, 0.0]]), -1)
    parents = search.step(two, note=lambda parent, token: (parent, token))
    assert parents == [0, 1]
    assert [b.tokens for b in search.running] == [[2, 3], [3, 0]]
    assert search.running[1].notes == ["t3", (1, 0)]


def test_length_limit_finishes_the_best_beams():
    search = BeamSearch(2, 1, stop_ids=(0,))
    search.step(torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.5]]), -1))
    assert search.done and [h.tokens for h in search.best(2)] == [[1], [2]]
    assert [h.finish_reason for h in search.best(2)] == ["length", "length"]
    with pytest.raises(RuntimeError):
        search.step(torch.zeros(1, 4))
