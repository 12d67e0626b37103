"""Automatic prefix caching: what the free KV-cache slots still hold, found again by content.

A sequence that ends leaves its slot's keys and values in place. The slot's record says which
tokens they are the keys and values of (positions 0..L-1) and, where a prefill scored its context
(echo with logprobs, prompt_logprobs), each of those tokens' scores. A new prompt takes the free slot
whose tokens share the longest prefix with its context, and its prefill starts after that prefix:
its first forward feeds at least the context's last token (whose logits choose the first new token),
and a scored context reuses a prefix only as far as the record has its tokens' scores (with the
ranks if it asks for them), up to its last token in common with the record. Without a match a prompt takes the free slot released longest ago (slots
never used first): least-recently-used eviction, at the granularity of a slot.

Keys and values at position p depend on tokens 0..p alone, so a reused prefix gives the answer a
fresh prefill gives, to the rounding of a different chunking. A slot is recorded only by a sequence
that ended in order (finished or cancelled, never by a faulted step, which may have written part of
its layers), and never by beam search or contrastive search, which move keys and values between slots.
The request's usage reports the reused tokens as `prompt_tokens_details.cached_tokens`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

MAX_TOP = 5  # a scored context keeps this many alternatives a token, the most a request asks for


@dataclass
class Score:
    """A context token's score: its logprob, the top alternatives [(token, logprob)] and its rank
    (None where the prefill did not compute it)."""
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class Record:
    tokens: np.ndarray  # the slot's keys and values are those of these tokens, positions 0..len-1
    scores: dict[int, Score] = field(default_factory=dict)  # position -> that token's score
    released: int = 0  # the release order: the lowest is evicted first


@dataclass
class Match:
    slot: int
    reused: int  # positions whose keys and values are reused: the prefill starts here
    scores: list[Score]  # the scores of the context tokens score_from..reused, in order


class PrefixCache:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.records: dict[int, Record] = {}  # free slot -> what it holds
        # first token -> the slots whose record starts with it: a prompt compares only those (a GPU
        # engine has hundreds of free slots, and every admission looks)
        self._by_first: dict[int, set[int]] = {}
        self._clock = itertools.count(1)
        self.queried_tokens = 0  # prompt tokens of the prefills that looked for a prefix
        self.hit_tokens = 0  # ... and those found

    def release(self, slot: int, tokens: list[int], scores: dict[int, Score] | None = None) -> None:
        """A sequence left `slot` holding the keys and values of `tokens` (nothing: `tokens` empty)."""
        self.take(slot)
        if self.enabled and tokens:
            self.records[slot] = Record(np.asarray(tokens, dtype=np.int64), dict(scores or {}), next(self._clock))
            self._by_first.setdefault(tokens[0], set()).add(slot)

    def take(self, slot: int) -> None:
        """`slot` goes to a new sequence: what it held is no longer the cache's."""
        record = self.records.pop(slot, None)
        if record is not None:
            first = int(record.tokens[0])
            self._by_first[first].discard(slot)
            if not self._by_first[first]:
                del self._by_first[first]

    def evictable(self, free: list[int]) -> int:
        """The free slot to give a prompt that reuses nothing: one never used, else the one
        released longest ago."""
        return min(free, key=lambda s: (s in self.records, self.records[s].released if s in self.records else s))

    def find(self, context: list[int], score_from: int | None, ranks: bool) -> Match | None:
        """The free slot holding the longest prefix of `context` this prefill can reuse, or None
        (every slot with a record is free: `take` drops a slot's record)."""
        if not self.enabled:
            return None
        self.queried_tokens += len(context)
        best, wanted = None, np.asarray(context, dtype=np.int64)
        for slot in sorted(self._by_first.get(context[0], ())):
            record = self.records[slot]
            common = _common(record.tokens, wanted)
            reused = min(common, len(context) - 1)
            if score_from is not None:
                # the tokens score_from..reused are scored by the record, so token `reused` is one
                # the record holds too (its score comes from the logits of the position before)
                reused = min(reused, common - 1)
                position = score_from
                while position <= reused and _usable(record.scores.get(position), ranks):
                    position += 1
                reused = min(reused, position - 1)
            if reused > 0 and (best is None or reused > best.reused):
                best = Match(slot, reused, [])
        if best is None:
            return None
        if score_from is not None:
            record = self.records[best.slot]
            best.scores = [record.scores[p] for p in range(score_from, best.reused + 1)]
        self.hit_tokens += best.reused
        return best


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix (one vector compare: this runs per free slot at every
    admission)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _usable(score: Score | None, ranks: bool) -> bool:
    return score is not None and (score.rank is not None or not ranks)
