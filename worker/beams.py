"""Beam search inside the continuous batch: a prompt's beams are sequences holding KV-cache slots,
decoded in the same forward as every other sequence; this module turns their logits into the next
beams (worker/beam_search.py keeps the books) and forks the slots to match.

A beam request's prompt has `width` sequences (best_of, or n), prefilled once and its keys/values
copied to every slot, as the copies of `n` are. Sequence i holds beam i: after a step in which beam
i continues beam j, slot i takes a copy of slot j's cache (the positions written so far; a beam that
continues itself copies nothing) and of its sampling state (token counts, n-gram bans), then the new
token goes in with the next decode. The first step uses the first sequence's logits alone (every
slot holds the same prompt).
"""
from __future__ import annotations

import torch

from worker.beam_search import BeamSearch, Hypothesis


class BeamGroup:
    """The beams of one prompt of a request."""

    def __init__(self, seqs: list):
        request = seqs[0].request
        self.seqs = seqs
        self.search = BeamSearch(len(seqs), max(1, seqs[0].max_new), length_penalty=request.job.length_penalty,
                                 early_stopping=request.job.early_stopping, stop_ids=request.params.stop_ids)
        self.results: list[Hypothesis] | None = None  # the n best, once the search is over

    @property
    def rows(self) -> list:
        """The sequences whose logits the next step needs: one per running beam."""
        return self.seqs[:len(self.search.running)]


def advance(group: BeamGroup, logits: torch.Tensor, cache, sampler, tokenizer) -> None:
    """One beam step from the raw logits (R, rows) of `group.rows`: choose the next beams, fork their
    slots, and end the group's sequences when the search is over."""
    rows = group.rows
    job = rows[0].request.job
    slots = [s.slot for s in rows]
    # normalized over every row of the head, as transformers does; chosen among the tokenizer's ids
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:, :sampler.vocab_size]
    # transformers applies its processors to the log-probabilities in beam search
    scores = sampler.adjusted_logits(logprobs, slots, [b.tokens for b in group.search.running])
    k = job.logprobs or 0
    tops = _top(logprobs, k) if job.logprobs is not None else None
    ends = _stop_string_ends(group, tokenizer) if job.stop else None

    def note(parent: int, token: int):
        if tops is None:
            return None
        return logprobs[parent, token].item(), tops[parent]

    parents = group.search.step(scores, ends, note)
    running = group.search.running
    if running and not group.search.done:
        _fork(group.seqs[:len(running)], [group.seqs[p] for p in parents], cache, sampler, rows[0])
        for seq, beam in zip(group.seqs, running):
            seq.tokens = list(beam.tokens)
        for seq in group.seqs[len(running):]:  # idle while fewer beams run (their rows are not used)
            seq.tokens = list(running[0].tokens)
        new = torch.tensor([beam.tokens[-1] for beam in running], device=logits.device)
        sampler.advance([s.slot for s in group.seqs[:len(running)]], new)
    if group.search.done:
        group.results = group.search.best(job.n)
        for seq in group.seqs:
            seq.finish_reason = "beam"  # the sequences' slots are free; the choices are group.results


def _fork(seqs: list, parents: list, cache, sampler, any_row) -> None:
    """seqs[i] continues parents[i]: copy the parent's cache positions and sampling state."""
    moved = [(s.slot, p.slot) for s, p in zip(seqs, parents) if s.slot != p.slot]
    if not moved:
        return
    length = len(any_row.prompt) + len(any_row.tokens)  # positions written in every beam's slot
    dst = torch.tensor([d for d, _ in moved], device=cache.k[0].device)
    src = torch.tensor([s for _, s in moved], device=cache.k[0].device)
    for layer in cache.k + cache.v:
        layer[dst, :, :length] = layer[src, :, :length]  # the right side is gathered first: swaps are safe
    sampler.fork([d for d, _ in moved], [s for _, s in moved])


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    if k == 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _stop_string_ends(group: BeamGroup, tokenizer):
    """Whether a continuation completes one of the request's stop strings (not before min_tokens)."""
    job = group.seqs[0].request.job
    running = group.search.running

    def ends(parent: int, token: int) -> bool:
        tokens = running[parent].tokens + [token]
        if len(tokens) < job.min_tokens:
            return False
        text = tokenizer.decode(tokens)
        return any(stop in text for stop in job.stop)
    return ends
