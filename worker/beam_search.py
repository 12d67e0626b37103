"""Beam search bookkeeping for one prompt: which beams live on, which hypotheses are finished, and
when the search is over, with transformers' length-penalised scores and stopping rules.

The model side is the caller's: each step it hands over the next-token scores of every running
beam (log-softmax of the logits, then any logits processors), and gets back which running beam
each new beam continues (`parents`), so it can fork the beams' KV-cache slots.

One step, for `width` beams (as transformers' `generate(num_beams=width)` does it):
  1. every continuation (beam b, token t) scores running_score[b] + scores[b, t]; the best
     `max(2, 1 + len(stop_ids)) * width` of them are the candidates, best first;
  2. a candidate that ends (a stop token, or whatever `ends(parent, token)` says, or the length
     limit) can only become a finished hypothesis, and only if it ranks among the first `width`,
     with the score sum_logprobs / generated_length ** length_penalty (its stop token counted);
     the finished keep the best `width` by that score;
  3. the best `width` candidates that do not end are the new running beams;
  4. the search is over when every candidate ended at the length limit, or `width` hypotheses are
     finished and either early_stopping is True or (early_stopping False, "never") the best running
     beam can no longer beat the worst of them: its score divided by the current length (False),
     or, with "never" and length_penalty > 0, by the longest length still possible, ** length_penalty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

EarlyStopping = bool | Literal["never"]


@dataclass
class Beam:
    """A running beam: its generated tokens, the sum of their (processed) log-probabilities, and one
    caller's annotation per token (e.g. the token's logprob entry)."""
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    notes: list[Any] = field(default_factory=list)


@dataclass
class Hypothesis:
    """A finished sequence: `score` is length-penalised; `finish_reason` is "stop" (ended by a stop
    token or `ends`) or "length" (reached max_new_tokens)."""
    tokens: list[int]
    score: float
    notes: list[Any]
    finish_reason: str


class BeamSearch:
    def __init__(self, width: int, max_new_tokens: int, *, length_penalty: float = 1.0,
                 early_stopping: EarlyStopping = False, stop_ids: tuple[int, ...] = ()):
        if width < 1 or max_new_tokens < 1:
            raise ValueError("beam search needs a width and max_new_tokens of at least 1")
        self.width, self.max_new_tokens = width, max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.stop_ids = frozenset(stop_ids)
        self.candidates = max(2, 1 + len(self.stop_ids)) * width
        self.running: list[Beam] = [Beam()]  # the prompt alone: the first step expands it
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.done = False

    @property
    def generated(self) -> int:
        """Tokens each running beam has (they all have as many)."""
        return len(self.running[0].tokens) if self.running else 0

    def step(self, scores: torch.Tensor, ends: Callable[[int, int], bool] | None = None,
             note: Callable[[int, int], Any] | None = None) -> list[int]:
        """Advance by one token. scores (len(running), V): each running beam's next-token scores.
        ends(parent, token): whether that continuation ends its sequence besides stop_ids (e.g. a
        stop string completes); note(parent, token): the annotation kept with the token. Returns,
        for each new running beam, the index (in the running list before this step) of the beam it
        continues."""
        if self.done:
            raise RuntimeError("the beam search is over")
        V = scores.shape[-1]
        beam_scores = torch.tensor([b.score for b in self.running], dtype=torch.float32, device=scores.device)
        total = (scores.float() + beam_scores[:, None]).flatten()
        top_scores, top_ids = total.topk(min(self.candidates, total.numel()))
        length_hit = self.generated + 1 >= self.max_new_tokens
        new_running, parents = [], []
        new_finished = []
        for rank, (value, flat) in enumerate(zip(top_scores.tolist(), top_ids.tolist())):
            parent, token = divmod(flat, V)
            stopped = token in self.stop_ids or (ends is not None and ends(parent, token))
            if stopped or length_hit:
                if rank < self.width:  # candidates past the first `width` are only a reserve of beams
                    new_finished.append(self._extend(parent, token, value, note, "stop" if stopped else "length"))
            elif len(new_running) < self.width:
                new_running.append(self._extend(parent, token, value, note))
                parents.append(parent)
        generated = self.generated + 1
        self._add_finished(new_finished, generated)
        self.running = new_running
        self.done = length_hit or not new_running or self._cannot_improve(generated)
        return parents

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (once `done`)."""
        return self.finished[:n]

    def _extend(self, parent: int, token: int, score: float, note, finish_reason: str | None = None):
        beam = self.running[parent]
        notes = beam.notes + [note(parent, token) if note is not None else None]
        if finish_reason is None:
            return Beam(beam.tokens + [token], score, notes)
        return Hypothesis(beam.tokens + [token], score, notes, finish_reason)

    def _add_finished(self, new: list[Hypothesis], length: int) -> None:
        if not new or (self.early_stopping is True and len(self.finished) == self.width):
            return
        # the same float32 arithmetic as transformers, so that equal log-probabilities rank equally
        penalized = torch.tensor([h.score for h in new], dtype=torch.float32) / (length ** self.length_penalty)
        for h, score in zip(new, penalized.tolist()):
            h.score = score
        # stable: of equal scores, the hypothesis finished earlier stays ahead
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]

    def _cannot_improve(self, length: int) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        best_possible = torch.tensor(self.running[0].score, dtype=torch.float32) / (length ** self.length_penalty)
        return best_possible.item() <= self.finished[-1].score
