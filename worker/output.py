"""Tokens to text and text to events: each sequence's incremental decoder and stop matcher, the
finishing of sequences, each step's events, and the completion object.

Events (worker/protocol.py) per job: `delta` {index, text, token_ids, logprobs} whenever a choice
has new tokens or text (with `echo`, a choice's first delta also carries the prompt: its text, ids
and logprobs), `finish` {index, finish_reason} once per choice, then `usage` and `done`
{completion}. With best_of > n nothing is streamed: the chosen choices come as one delta each when
the request ends. (`error` and `cancelled` end requests dropped early: see scheduler.py.)

Resuming (a job retried after a crash): `resume[index]` is the concatenation of the `token_ids` of
the deltas already emitted for that choice. Once the choice's prompt and those tokens are in its
cache, they are replayed through the same decoder, stop matcher and finish checks (the sampler
has counted them too), so it continues as if never interrupted; only what is new is emitted
(choices that had finished emit nothing more), while `done` holds the full completion.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from worker import protocol
from worker.logprobs import TokenLogprob, fragment
from worker.scheduler import Event, Prefill, Request, Sequence

if TYPE_CHECKING:
    from worker.runner import Draw


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_id: int | None):
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id

    def start(self, unit: Prefill) -> list[Sequence]:
        """Sequences whose context is in their cache (or that need none): queue their echo, replay
        a resumed history. Returns those that go on to draw a token."""
        for seq in unit.seqs:
            self._start(seq, unit)
        return [s for s in unit.seqs if s.finish_reason is None]

    def accept(self, rows: list[Sequence], draws: list[Draw]) -> None:
        for seq, draw in zip(rows, draws):
            self._accept(seq, draw.token, draw.logprob, draw.top)

    def collect(self, requests: Iterable[Request], events: list[Event]) -> list[tuple[Request, dict]]:
        """This step's deltas and finishes, and the usage and completion of each request whose
        sequences all finished: returns those requests with their completion objects."""
        completed = []
        for req in requests:
            if req.streams:
                for s in req.seqs:
                    self._stream_events(s, events)
            if all(s.finish_reason is not None for s in req.seqs):
                completed.append((req, self._complete(req, events)))
        return completed

    # ---- tokens to text ----

    def _start(self, seq: Sequence, unit: Prefill) -> None:
        req, scores = seq.request, unit.scores
        if req.job.prompt_logprobs is not None and seq.prompt_index not in req.prompt_logprobs:
            req.prompt_logprobs[seq.prompt_index] = self._prompt_logprobs(req, unit)
        echo = self._echo_entries(req, seq.prompt_index, scores) if req.job.echo and req.wants_logprobs else []
        if seq.echo_pending:
            seq.out_text, seq.out_ids, seq.out_entries = req.prompt_texts[seq.prompt_index], list(seq.prompt), list(echo)
        if seq.history:
            replay = scores[len(scores) - len(seq.history):] if req.wants_logprobs else [(None, [])] * len(seq.history)
            for token, (lp, top) in zip(seq.history, replay):
                self._accept(seq, token, lp, top[:req.job.logprobs or 0])
                if seq.finish_reason is not None:
                    break
            seq.out_text, seq.out_ids, seq.out_entries = "", [], []  # emitted before the crash
            seq.finish_sent = seq.finish_reason is not None
        elif seq.max_new == 0:
            self._finish(seq, "length")

    def _prompt_logprobs(self, req: Request, unit: Prefill) -> list:
        """vLLM's prompt_logprobs of the prompt: None for its first token, then for each token a dict
        {token id: {logprob, rank, decoded_token}} of the token itself and the top-N."""
        prompt, k = req.job.prompts[unit.seqs[0].prompt_index], req.job.prompt_logprobs
        out: list = [None]
        for i, token in enumerate(prompt[1:]):
            lp, top = unit.scores[i]
            entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tokenizer.decode([t])}
                     for r, (t, v) in enumerate(top[:k])}
            entry.setdefault(str(token), {"logprob": lp, "rank": unit.ranks[i], "decoded_token": self.tokenizer.decode([token])})
            out.append(entry)
        return out

    def _echo_entries(self, req: Request, p: int, scores) -> list[TokenLogprob]:
        """The prompt's logprob entries (first token: None), computed once per prompt."""
        if p not in req.echo_entries:
            prompt, decoder, chars = req.job.prompts[p], self.tokenizer.incremental_decoder(), 0
            k = req.job.logprobs or 0
            entries = []
            for i, token in enumerate(prompt):
                lp, top = scores[i - 1] if i else (None, None)
                entries.append(TokenLogprob(token, lp, top[:k] if top is not None else None, chars))
                chars += len(decoder.push(token))
            req.echo_entries[p] = entries
        return req.echo_entries[p]

    def _accept(self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """Append a drawn token: logprobs, text through the stop matcher, finish checks."""
        seq.tokens.append(token)
        seq.out_ids.append(token)
        if logprob is not None:
            seq.logprob_sum += logprob
        if seq.request.wants_logprobs:
            entry = TokenLogprob(token, logprob, top, seq.text_base + seq.chars)
            seq.entries.append(entry)
            seq.out_entries.append(entry)
        job = seq.request.job
        stop_token = token in seq.request.params.stop_ids
        if stop_token and token != self.eos_token_id:
            seq.stop_reason = token
        if stop_token and not job.include_stop_str_in_output:
            self._finish(seq, "stop")
            return
        skipped = job.skip_special_tokens and token in self.tokenizer.special_ids
        piece = "" if skipped else seq.decoder.push(token)
        seq.chars += len(piece)
        if len(seq.tokens) < job.min_tokens:  # stop strings count from min_tokens on (vLLM)
            _release_text(seq, piece)
        else:
            _release_text(seq, seq.stops.push(piece))
        if stop_token or seq.stops.stopped:
            seq.stop_reason = seq.stop_reason if stop_token else seq.stops.matched
            self._finish(seq, "stop")
        elif seq.matcher is not None and seq.matcher.is_stopped():  # its grammar is complete
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.max_new:
            self._finish(seq, "length")

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        """The sequence ends (its slot is freed after the step's run)."""
        if not seq.stops.stopped:  # EOS or length: what the decoder and the matcher hold is text
            _release_text(seq, seq.stops.push(seq.decoder.flush()))
            if seq.stops.stopped:
                reason = "stop"
            else:
                _release_text(seq, seq.stops.flush())
        seq.finish_reason = reason

    def _hypotheses(self, req: Request, p: int, hypotheses) -> list[Sequence]:
        """Beam search's hypotheses as sequences: their tokens replayed through a choice's decoder,
        stop matcher and finish checks, with the logprobs noted along the search."""
        seqs = []
        for j, h in enumerate(hypotheses):
            seq = Sequence(req, p, p * req.n + j, req.seqs[p * req.best_of].max_new, self.tokenizer, None)
            for token, note in zip(h.tokens, h.notes):
                lp, top = note if note is not None else (None, [])
                self._accept(seq, token, lp, top)
                if seq.finish_reason is not None:
                    break
            if seq.finish_reason is None:
                self._finish(seq, h.finish_reason)
            seqs.append(seq)
        return seqs

    # ---- text to events ----

    def _token_string(self, req: Request):
        if req.job.return_tokens_as_token_ids:
            return lambda token: f"token_id:{token}"
        return self.tokenizer.token_string

    def _stream_events(self, seq: Sequence, events: list[Event]) -> None:
        """A delta with what the step added (and, when the choice ended in the same step, its
        finish_reason: it rides on the last text), then the finish event once."""
        job_id = seq.request.job.id
        finish = {"index": seq.candidate, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        ending = seq.finish_reason is not None and not seq.finish_sent
        if seq.out_ids or seq.out_text:
            frag = fragment(seq.out_entries, self._token_string(seq.request)) if seq.request.wants_logprobs else None
            delta = {"index": seq.candidate, "text": seq.out_text, "token_ids": seq.out_ids, "logprobs": frag}
            events.append((job_id, "delta", {**delta, **finish} if ending else delta))
            seq.out_text, seq.out_ids, seq.out_entries = "", [], []
        if ending:
            events.append((job_id, "finish", finish))
            seq.finish_sent = True

    def _complete(self, req: Request, events: list[Event]) -> dict:
        """The request's choices (with best_of, the n best candidates of each prompt, sent now),
        its usage and `done` events; returns the completion object."""
        job = req.job
        choices, returned = [], []
        for p in range(len(job.prompts)):
            candidates = req.seqs[p * req.best_of:(p + 1) * req.best_of]
            if req.beam:  # the n best hypotheses, best first, their text made as a sampled choice's
                group = req.beams.get(p)
                candidates = self._hypotheses(req, p, group.results) if group else candidates[:req.n]
            elif not req.streams:  # best_of: the n with the highest mean token logprob
                candidates = sorted(candidates, key=lambda s: -s.mean_logprob())[:req.n]
            for j, s in enumerate(candidates):
                echo = req.echo_entries.get(p, []) if job.echo else []
                choice = {"index": p * req.n + j,
                          "text": (req.prompt_texts[p] if job.echo else "") + s.text,
                          "logprobs": fragment(echo + s.entries, self._token_string(req))
                          if req.wants_logprobs else None,
                          "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                if job.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = req.prompt_logprobs.get(p)
                choices.append(choice)
                returned.append(s)
                if not req.streams:
                    ids = (list(s.prompt) if job.echo else []) + s.tokens
                    events.append((job.id, "delta", {**choice, "token_ids": ids}))
                    events.append((job.id, "finish", {"index": choice["index"], "finish_reason": s.finish_reason,
                                                      "stop_reason": s.stop_reason}))
        prompt_tokens = sum(len(p) for p in job.prompts)
        # beam search counts the tokens of the hypotheses returned (vLLM), sampling every candidate's
        completion_tokens = sum(len(s.tokens) for s in (returned if req.beam else req.seqs))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}
        completion = protocol.completion_object(job, choices, usage)
        events.append((job.id, "usage", usage))
        events.append((job.id, "done", {"completion": completion}))
        return completion


def _release_text(seq: Sequence, text: str) -> None:
    seq.text += text
    seq.out_text += text
