"""worker/logits_processors.py against transformers' own logits processors, row by row, on batches
that mix settings (including the neutral ones, which must leave a row unchanged)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

from models.tokenizer import bad_words_token_ids
from worker.logits_processors import (NGramBans, apply_bans, apply_min_p, apply_repetition_penalty,
                                      apply_token_mask, bad_word_bans, token_mask)

V = 40


def random_rows(seed: int, B: int, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, V, generator=gen) * 3
    ids = torch.randint(0, V, (B, length), generator=gen)
    return scores, ids


def seen_mask(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([token_mask(row.tolist(), V) for row in ids])


def test_repetition_penalty_matches_transformers_per_row():
    scores, ids = random_rows(0, 4)
    penalties = [1.0, 1.3, 0.7, 2.5]  # 1.0: off; < 1 encourages repeats
    got = apply_repetition_penalty(scores, seen_mask(ids), torch.tensor(penalties))
    for b, penalty in enumerate(penalties):
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids[b:b + 1], scores[b:b + 1].clone())
        assert torch.equal(got[b], want[0])
    assert torch.equal(got[0], scores[0])
    assert not torch.equal(got[1], scores[1])


def test_repetition_penalty_on_log_probabilities_as_beam_search_uses_it():
    scores, ids = random_rows(1, 3)
    logprobs = torch.log_softmax(scores, -1)  # all negative: every seen token is multiplied
    got = apply_repetition_penalty(logprobs, seen_mask(ids), torch.full((3,), 1.5))
    want = RepetitionPenaltyLogitsProcessor(1.5)(ids, logprobs.clone())
    assert torch.equal(got, want)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_matches_transformers_per_row(temperature):
    scores, ids = random_rows(2, 4)
    scores = scores / temperature  # min_p applies to the tempered distribution
    values = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(scores, torch.tensor(values))
    for b, value in enumerate(values):
        want = MinPLogitsWarper(value)(ids[b:b + 1], scores[b:b + 1].clone())
        assert torch.equal(got[b], want[0])
    assert torch.equal(got[0], scores[0])  # 0: off
    assert torch.isfinite(got[3]).sum() == 1  # 1: only the most probable token


def test_min_tokens_mask_matches_transformers_while_active():
    scores, ids = random_rows(3, 3, length=6)
    stop_ids = [7, 11]  # the end-of-text token and a stop_token_id
    prompt_len, min_new = [2, 5, 4], 3  # rows have generated 4, 1 and 2 tokens
    generated = torch.tensor([6 - p for p in prompt_len])
    stops = token_mask(stop_ids, V).expand(3, V)
    got = apply_token_mask(scores, stops, active=generated < min_new)
    for b in range(3):
        proc = MinNewTokensLengthLogitsProcessor(prompt_len[b], min_new, stop_ids)
        assert torch.equal(got[b], proc(ids[b:b + 1], scores[b:b + 1].clone())[0])
    assert torch.equal(got[0], scores[0])  # row 0 already has its 3 tokens
    assert torch.isinf(got[1, stop_ids]).all()


def test_allowed_token_ids_ban_everything_else():
    scores, _ = random_rows(4, 2)
    banned = torch.stack([~token_mask([3, 5, 9], V), torch.zeros(V, dtype=torch.bool)])
    got = apply_token_mask(scores, banned)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [3, 5, 9]
    assert torch.equal(got[1], scores[1])


def test_bad_words_match_transformers_on_random_histories():
    rng = random.Random(5)
    bad = [[4], [1, 2], [3, 3, 6], [9, 1, 2, 8]]  # one-token, and words whose prefixes overlap
    for trial in range(200):
        past = [rng.choice([1, 2, 3, 4, 6, 9]) for _ in range(rng.randrange(0, 8))]
        ids = torch.tensor([[0] + past])  # transformers needs one token at least; 0 is in no bad word
        scores = torch.randn(1, V, generator=torch.Generator().manual_seed(trial))
        want = NoBadWordsLogitsProcessor(bad, eos_token_id=39)(ids, scores.clone())
        got = apply_bans(scores, [(0, t) for t in bad_word_bans(past, bad)])
        assert torch.equal(got, want), past


def test_bad_words_spellings_follow_vllm():
    vocab = {"hello": [5], " hello": [6], "two words": [7, 8], " two words": [9, 8], "x": [1], " x": [1, 2]}
    spellings = bad_words_token_ids(["hello", "  two words", "x"], lambda text: vocab[text])
    # " x" is two tokens where "x" is one: not another spelling of the same word
    assert spellings == [[5], [6], [7, 8], [9, 8], [1]]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_repeat_ngram_bans_match_transformers(size):
    rng = random.Random(size)
    for trial in range(100):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 15))]
        scores = torch.randn(1, V, generator=torch.Generator().manual_seed(trial))
        want = NoRepeatNGramLogitsProcessor(size)(torch.tensor([seq]), scores.clone())
        bans = NGramBans(size, seq)
        got = apply_bans(scores, [(0, t) for t in bans.banned()])
        assert torch.equal(got, want), seq


def test_ngram_bans_grow_token_by_token_like_a_rebuild():
    rng = random.Random(7)
    seq = [rng.randrange(4) for _ in range(30)]
    bans = NGramBans(3, seq[:5])
    for i in range(5, 30):
        assert bans.banned() == NGramBans(3, seq[:i]).banned()
        bans.push(seq[i])


def test_apply_bans_takes_rows_and_tokens_together():
    scores = torch.zeros(3, V)
    got = apply_bans(scores, [(0, 1), (2, 1), (2, 5)])
    assert torch.isinf(got).nonzero().tolist() == [[0, 1], [2, 1], [2, 5]]
    assert apply_bans(scores, []) is scores
