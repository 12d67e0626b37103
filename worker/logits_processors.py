"""Logits processors: the adjustments of next-token scores that come before a token is chosen,
beyond OpenAI's (logit_bias, presence/frequency penalties: sampling.py).

Each is a pure function over a batch: scores (B, V) float, and each row's setting as a tensor
(B,) or a mask (B, V), so a batch that mixes requests with and without a processor takes one
tensor op for all its rows, and a row with the neutral setting comes out unchanged. What needs the
tokens a sequence has seen (multi-token bad words, n-gram bans) is worked out on the host from
those tokens (`bad_word_bans`, `NGramBans`) and applied as a list of (row, token) bans.

Semantics follow vLLM's SamplingParams (names and ranges) and transformers' logits processors
(arithmetic), which the tests compare against:
- repetition_penalty: a seen token's score is divided by the penalty when positive, multiplied
  when not (CTRL; transformers' RepetitionPenaltyLogitsProcessor). "Seen" = in the prompt or the
  output, as in both.
- min_p: tokens less probable than min_p × the most probable one are dropped (MinPLogitsWarper).
- min_tokens: the stop tokens (end-of-text, stop_token_ids) cannot be drawn before min_tokens
  tokens were generated (MinNewTokensLengthLogitsProcessor).
- allowed_token_ids / one-token bad words: a static ban mask per sequence.
- bad_words: the last token of a bad word is banned when the tokens before it end the output
  (NoBadWordsLogitsProcessor; the spellings of a word: models.tokenizer.bad_words_token_ids).
- no_repeat_ngram_size: a token that would repeat an n-gram of the sequence is banned
  (NoRepeatNGramLogitsProcessor).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from nanogpt.runtime.transfer import to_device

NEG_INF = float("-inf")


# ---- tensor side: (B, V) scores in, (B, V) scores out ----

def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """scores (B, V); seen (B, V) bool, the tokens of each row's prompt and output; penalty (B,) > 0,
    1 = off. Dividing a positive score and multiplying a negative one both lower it for penalty > 1."""
    p = penalty[:, None].to(scores.dtype)
    penalized = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalized, scores)


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (-inf) each row's tokens whose probability under softmax(scores) is below
    min_p[b] × its most probable token's; min_p (B,) in [0, 1], 0 = off. The most probable token
    always stays."""
    probs = torch.softmax(scores, dim=-1)
    threshold = min_p[:, None].to(probs.dtype) * probs.max(dim=-1, keepdim=True).values
    return scores.masked_fill(probs < threshold, NEG_INF)


def apply_token_mask(scores: torch.Tensor, banned: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """Ban (-inf) the tokens of banned (B, V) bool; with `active` (B,) bool, only in those rows (the
    stop tokens of rows that have not reached min_tokens)."""
    if active is not None:
        banned = banned & active[:, None]
    return scores.masked_fill(banned, NEG_INF)


def apply_bans(scores: torch.Tensor, bans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Ban (-inf) individual (row, token) pairs, as `bad_word_bans` and `NGramBans` find them."""
    if not bans:
        return scores
    rows, tokens = to_device(list(bans), scores.device).T
    return scores.index_put((rows, tokens), torch.full((), NEG_INF, dtype=scores.dtype, device=scores.device))


def token_mask(token_ids: Iterable[int], vocab_size: int, device=None) -> torch.Tensor:
    """(V,) bool, True at token_ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = list(token_ids)
    if ids:
        mask[to_device(ids, mask.device)] = True
    return mask


# ---- host side: bans that depend on the tokens a sequence has seen ----

def bad_word_bans(past: Sequence[int], bad_words: Sequence[Sequence[int]]) -> list[int]:
    """Tokens that would complete a bad word after the tokens `past`: the last token of each bad word
    whose other tokens end `past` (a one-token bad word is always banned)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(past) and list(past[len(past) - prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


class NGramBans:
    """Tokens that would repeat an n-gram (n = size) of one sequence, kept up to date as tokens
    arrive: a map from each (n-1)-gram seen to the tokens that followed it."""

    def __init__(self, size: int, tokens: Iterable[int] = ()):
        if size < 1:
            raise ValueError("n-gram size must be at least 1")
        self.size = size
        self.tokens: list[int] = []
        self.followers: dict[tuple[int, ...], set[int]] = {}
        for token in tokens:
            self.push(token)

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self.size:
            gram = self.tokens[len(self.tokens) - self.size:]
            self.followers.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def copy(self) -> "NGramBans":
        other = NGramBans(self.size)
        other.tokens = list(self.tokens)
        other.followers = {gram: set(nexts) for gram, nexts in self.followers.items()}
        return other

    def banned(self) -> set[int]:
        """The tokens that may not come next."""
        if len(self.tokens) < self.size - 1:
            return set()
        context = tuple(self.tokens[len(self.tokens) - self.size + 1:]) if self.size > 1 else ()
        return self.followers.get(context, set())
