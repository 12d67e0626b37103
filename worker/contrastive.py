"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation";
transformers' `penalty_alpha` with `top_k`) inside the continuous batch.

Each step, a searching sequence takes the k tokens most likely next (softmax of its logits after the
logits processors), feeds each as one row of the step's decode forward, and keeps the candidate v
with the best

    (1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)

where h_v is the candidate's last hidden state (after the final norm) and h_j those of every token
before it, prompt and output: a likely token that does not repeat what the text already said.

KV-cache slots: a searching sequence holds k slots, its own first (its sampling state lives there)
and k - 1 scratch slots, all with the same keys/values at every position before the next one, P.
Candidate i writes position P of slot i; once v is chosen, position P of v's slot is copied to the
other slots, so they agree again up to P + 1: one position per step is copied, never the sequence.
Between steps a search keeps the chosen candidate's logits (the next token's distribution) and the
unit-length hidden states of every position in its cache, on the model's device.

A search starts from its prefill: the hidden states of the context (the prompt, and the tokens a
resumed job already emitted) and the logits of its last position. Its first candidates go out with
the next step's decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Search:
    """The contrastive search of one sequence."""

    def __init__(self, alpha: float, slots: list[int], capacity: int):
        self.alpha = alpha
        self.slots = slots  # the sequence's own slot first, then its scratch slots: k in all
        self.capacity = capacity  # positions it may reach: prompt + max_tokens
        self.hidden: torch.Tensor | None = None  # (capacity, width) unit vectors, one per cached position
        self.length = 0  # positions in the cache = the position the next candidates take
        self.logits: torch.Tensor | None = None  # (rows,) raw, every row of the head: the next token's distribution
        # this step's candidates: ids and probabilities (k,), then their forward's logits and hidden states
        self.ids = self.probs = self.next_logits = self.next_hidden = None

    @property
    def k(self) -> int:
        return len(self.slots)

    def remember(self, hidden: torch.Tensor) -> None:
        """Append the last hidden states (n, width) of the next n positions."""
        n = hidden.shape[0]
        if self.hidden is None:
            self.hidden = hidden.new_empty(self.capacity, hidden.shape[-1], dtype=torch.float32)
        self.hidden[self.length:self.length + n] = F.normalize(hidden.float(), dim=-1)
        self.length += n


def propose(searches: list[Search], seqs: list, sampler) -> torch.Tensor:
    """Each search's k candidates from its logits after the logits processors of its sequence's
    slot (seqs[i] holds searches[i]). Returns the candidate tokens of all searches, search-major, on
    the device; each search keeps its own ids and probabilities."""
    logits = sampler.adjusted_logits(torch.stack([s.logits[:sampler.vocab_size] for s in searches]), [q.slot for q in seqs],
                                     [q.tokens for q in seqs])
    probs = torch.softmax(logits, dim=-1)
    top_probs, top_ids = probs.topk(min(max(s.k for s in searches), probs.shape[-1]), dim=-1)
    for i, search in enumerate(searches):
        search.ids, search.probs = top_ids[i, :search.k], top_probs[i, :search.k]
    return torch.cat([s.ids for s in searches])


def rows(searches: list[Search]) -> tuple[list[int], list[int]]:
    """The slots and positions of the candidate rows `propose` returned, in its order."""
    slots = [slot for s in searches for slot in s.slots]
    positions = [s.length for s in searches for _ in s.slots]
    return slots, positions


def take(searches: list[Search], logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """The candidates' forward: logits (R, rows) and last hidden states (R, width) of the rows of `rows`."""
    start = 0
    for search in searches:
        search.next_logits, search.next_hidden = logits[start:start + search.k], hidden[start:start + search.k]
        start += search.k


def choose(searches: list[Search], cache) -> torch.Tensor:
    """Each search's best candidate by the contrastive score: keep its hidden state and logits, and
    copy its keys/values at the new position to the search's other slots. Returns the chosen tokens
    (len(searches),) on the device; nothing here waits for the device."""
    chosen = []
    for search in searches:
        h = F.normalize(search.next_hidden.float(), dim=-1)  # (k, width)
        similarity = (h @ search.hidden[:search.length].T).max(dim=-1).values  # (k,): the closest earlier token
        best = ((1 - search.alpha) * search.probs - search.alpha * similarity).argmax()
        search.hidden[search.length] = h[best]
        search.logits = search.next_logits[best]
        chosen.append(best)
    best = torch.stack(chosen)
    _share_position(searches, best, cache)
    for search in searches:
        search.length += 1
    return torch.stack([s.ids[b] for s, b in zip(searches, best)])


def _share_position(searches: list[Search], best: torch.Tensor, cache) -> None:
    """Position P of each search's chosen slot to all of its slots (the chosen one copies onto itself)."""
    device = cache.k[0].device
    dst = torch.tensor([slot for s in searches for slot in s.slots], device=device)
    pos = torch.tensor([s.length for s in searches for _ in s.slots], device=device)
    ks = torch.tensor([s.k for s in searches], device=device)
    first = torch.cumsum(ks, 0) - ks  # where each search's slots start in dst
    src = torch.repeat_interleave(dst[first + best.to(device)], ks)
    for layer in cache.k + cache.v:
        layer[dst, :, pos] = layer[src, :, pos]  # the right side is gathered first
