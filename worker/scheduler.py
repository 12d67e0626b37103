"""Request state and each step's schedule: which sequences hold which KV-cache slots, which wait for
one, which context tokens are fed this step; new requests, cancellations, and the ends of requests
dropped early.

A job is a `Request`; each of its choices (or best_of candidates) a `Sequence`. The fresh copies of
one prompt share one `Prefill`: its context is fed into the first copy's slot, then copied to the
others' slots. A sequence goes waiting (no slot) -> prefilling (a slot; its context fed a chunk per
step) -> decoding (one token per step) -> finished (its slot freed for the next waiting prefill).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from worker import protocol
from worker.errors import EngineError, EngineFault, RequestCancelled
from worker.logprobs import TokenLogprob
from worker.prefix_cache import PrefixCache, Score
from worker.sampling import SamplingParams
from worker.stops import StopMatcher

SCORE_CHUNK = 128  # context tokens a scoring prefill (echo + logprobs) feeds per step: their (T, V) logits are kept
SCORE_BUDGET = 256  # ... and all scoring prefills together (float32 logits: 51 MB of GPT-2's vocabulary)
# Beside decoding sequences, a step's prompt tokens are held to what keeps its weight matmuls within
# STEP_RATIO times those of their decode alone (they share one forward), and at least MIN_CHUNK
# tokens so that prompts still move; without measured costs, BESIDE_CHUNK tokens. The ratio doubles,
# as far as prefill_chunk, while at the pace of the steps so far the prompts holding slots would not
# all see their first token within PROMPT_DEADLINE seconds of reaching the gateway; prompts still
# waiting for a slot do not count, as larger chunks would only delay the sequences whose slots they
# wait for. Why these values: docs/notes/prefill-schedule.md.
STEP_RATIO = 1.6
MIN_CHUNK = 4
BESIDE_CHUNK = 128
# The most prompt tokens a step feeds: on a CPU, whose forwards cost in proportion to their rows; on
# a GPU, where an eager forward's time is its kernel launches up to thousands of rows, a burst's
# prompts go in one step and no cost holds back what rides beside decoding rows (`launch_bound`).
PREFILL_CHUNK = {"cpu": 256, "cuda": 2048}
PROMPT_DEADLINE = 0.75
PACE_STEPS = 64  # the steps whose pace (seconds per unit of row cost) estimates the next ones'

Event = tuple[str, str, dict]  # (job id, event type, data): see worker/protocol.py


class Request:
    """One job inside the engine: its parameters and its sequences, prompt-major
    (candidate prompt_index * best_of + k)."""

    def __init__(self, job: protocol.CompletionJob, handle, params: SamplingParams, resume: dict[int, list[int]],
                 tokenizer, max_len: int):
        self.job, self.handle, self.params = job, handle, params
        self.n = job.n
        self.best_of = job.best_of or job.n  # with beam search: the beam width
        self.beam = job.use_beam_search
        self.beams: dict[int, object] = {}  # prompt index -> its beams (worker/beams.BeamGroup)
        # contrastive search: each sequence holds top_k KV-cache slots, one per candidate (worker/contrastive.py)
        self.contrastive = job.penalty_alpha > 0
        self.slots_per_sequence = job.top_k if self.contrastive else 1
        # best_of > n and beam search: the choices are decided at the end
        self.streams = self.best_of == self.n and not self.beam
        self.wants_logprobs = job.logprobs is not None
        self.needs_scores = self.wants_logprobs or not self.streams  # best_of ranks by mean logprob
        # whether its sequences decode a step ahead of the host taking their tokens in (engine.py):
        # sampled, without bans that read the tokens so far or a grammar that must consume each
        self.overlaps = not self.beam and not self.contrastive and not params.sequence_bans and params.grammar is None
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> vLLM's prompt_logprobs list
        # the prompts' text: what echo repeats and where logprobs' text_offset counts from (decoding
        # each prompt costs the consumer's thread, which holds the GIL the engine steps with)
        self.prompt_texts = ([tokenizer.decode(p) for p in job.prompts] if job.echo or self.wants_logprobs
                             else [""] * len(job.prompts))
        self.cached_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        self.echo_entries: dict[int, list[TokenLogprob]] = {}  # prompt index -> prompt's logprobs
        self.seqs = []
        for p, prompt in enumerate(job.prompts):
            max_new = max_len - len(prompt) if job.max_tokens is None else job.max_tokens
            for k in range(self.best_of):
                c = p * self.best_of + k
                self.seqs.append(Sequence(self, p, c, max_new, tokenizer, resume.get(c)))


class Sequence:
    """One choice being generated (or one best_of candidate)."""

    def __init__(self, request: Request, prompt_index: int, candidate: int, max_new: int, tokenizer,
                 emitted: list[int] | None):
        job = request.job
        self.request, self.prompt_index, self.candidate, self.max_new = request, prompt_index, candidate, max_new
        self.prompt = job.prompts[prompt_index]
        # a resumed choice: its echo went out with its first delta, the rest are generated tokens
        self.history = (emitted[len(self.prompt):] if job.echo else emitted) if emitted is not None else []
        self.echo_pending = job.echo and emitted is None
        self.slot: int | None = None
        self.scratch: list[int] = []  # more slots it holds (contrastive search's candidates)
        self.search = None  # its contrastive search (worker/contrastive.Search), from admission
        self.matcher = None  # its structured-output matcher (worker/grammar.py), from admission
        self.context_scores: dict[int, Score] = {}  # its prefill's scores by position, for the prefix cache
        self.tokens: list[int] = []  # generated so far (history included)
        self.pending = 0  # drawn on the device, not yet taken in (the engine runs a step ahead)
        self.entries: list[TokenLogprob] = []  # logprobs of the generated tokens
        self.logprob_sum = 0.0
        self.text = ""  # completion text released so far (stops applied)
        self.chars = 0  # characters decoded so far, where the next token's text starts
        self.text_base = len(request.prompt_texts[prompt_index])  # text_offset counts from the prompt's end
        self.decoder = tokenizer.incremental_decoder()
        self.stops = StopMatcher(job.stop, job.include_stop_str_in_output)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.finish_sent = False
        # what the next delta carries
        self.out_text, self.out_ids, self.out_entries = "", [], []

    @property
    def position(self) -> int:
        """Tokens in this sequence's cache slot = position of the next token fed (its draws still
        on their way to the host count)."""
        return len(self.prompt) + len(self.tokens) + self.pending - 1

    def mean_logprob(self) -> float:
        return self.logprob_sum / len(self.tokens) if self.tokens else 0.0


class Prefill:
    """Context to feed into the leader's slot (seqs[0]); the other seqs get a copy of its cache.
    `scores[i]` is (logprob, top) of context[score_from + i] when logprobs of the context are needed,
    `ranks[i]` that token's rank in its distribution (1: the most likely)."""

    def __init__(self, seqs: list[Sequence], context: list[int], score_from: int | None, queued: float):
        self.seqs, self.context, self.score_from = seqs, context, score_from
        self.fed = 0
        self.queued = queued  # time.monotonic() when its request reached the gateway (`arrival`)
        self.scores: list[tuple[float, list[tuple[int, float]]]] = []
        self.ranks: list[int] = []


@dataclass
class Batch:
    """What one step runs."""
    ready: list[Prefill]  # nothing to feed (max_tokens 0, the prompt not scored): they start at once, slotless
    admitted: list[Sequence]  # given a slot this step: their sampling state is still to be set
    decoding: list[Sequence]  # one token each, in slot order (not those whose last token is drawn)
    chunks: list[tuple[Prefill, int]]  # context tokens fed this step, per prefill, in arrival order
    requests: set[Request]  # every request with a sequence in the step: they fail together on a fault


class Scheduler:
    """The state of every request in the engine, and of every KV-cache slot. `inbox` and `cancels`
    are filled by other threads and drained by `schedule`; everything else belongs to the engine
    thread (other threads only read `stats`)."""

    def __init__(self, slots: int, prefill_chunk: int, row_costs: dict[int, float] | None = None,
                 prefix_caching: bool = True, launch_bound: bool = False):
        """prefill_chunk: the most prompt tokens a step feeds; row_costs: {rows: seconds} of a forward's
        weight matmuls (nanogpt.kernels.row_costs), which size the chunks fed beside decoding sequences;
        launch_bound: a step costs its launches whatever its rows (a GPU): the whole prefill_chunk
        rides beside decoding sequences; prefix_caching: reuse what free slots hold (worker/prefix_cache.py)."""
        self.slots = slots
        self.prefill_chunk = max(1, prefill_chunk)
        self.row_costs = row_costs
        self.launch_bound = launch_bound
        self.pace: deque[float] = deque(maxlen=PACE_STEPS)  # seconds per unit of step_cost, last steps
        self.free_slots = list(range(slots))
        self.prefix = PrefixCache(prefix_caching)
        self.requests: dict[str, Request] = {}  # active jobs, in arrival order
        self.ready: list[Prefill] = []  # nothing to feed
        self.waiting: deque[Prefill] = deque()  # no slots yet
        self.prefilling: list[Prefill] = []  # slots held, context being fed
        self.decoding: list[Sequence] = []  # running: one token per step
        self.inbox: deque[tuple[Request | None, object, EngineError | None]] = deque()  # (request, handle, refusal)
        self.cancels: deque[str] = deque()  # job ids
        self.ended: list[tuple[object, dict | None, EngineError | None]] = []  # (handle, result, error), see `settle`

    def has_work(self) -> bool:
        return bool(self.requests or self.inbox or self.cancels)

    def stats(self) -> dict:
        """Sequences, requests and slots (read from any thread)."""
        return {"running": len(self.decoding) + sum(len(u.seqs) for u in self.prefilling),
                "waiting": len(self.inbox) + len({id(u.seqs[0].request) for u in list(self.waiting)}),
                "requests": len(self.requests), "kv_slots_used": self.slots - len(self.free_slots),
                "kv_slots_total": self.slots, "prefix_cache_queried_tokens": self.prefix.queried_tokens,
                "prefix_cache_hit_tokens": self.prefix.hit_tokens}

    def schedule(self, events: list[Event]) -> Batch:
        """Take new requests and cancellations, admit waiting prefills into free slots, and choose
        this step's prefill chunk."""
        self._take_new(events)
        self._take_cancels(events)
        admitted = self._admit()
        ready, self.ready = self.ready, []
        # rows in ascending slots read the KV cache in place (nanogpt's CacheWindow); in any other
        # order every layer copies their keys and values first (measured: 18% of the throughput at 32)
        self.decoding.sort(key=lambda s: s.slot)
        requests = {s.request for s in self.decoding} | {u.seqs[0].request for u in self.prefilling + ready}
        # a sequence whose last token is drawn but not taken in yet ends by its length when it is
        decoding = [s for s in self.decoding if not s.pending or len(s.tokens) + s.pending < s.max_new]
        return Batch(ready, admitted, decoding, self._chunks(), requests)

    def update(self, batch: Batch, prefilled: list[Prefill]) -> None:
        """After the step ran `batch`: the completed prefills stop prefilling, their sequences
        decode from the next step, and the sequences that finished give their slots back."""
        for unit in prefilled:
            self.prefilling.remove(unit)
            if unit.score_from is not None and self.prefix.enabled:
                scores = {unit.score_from + i: Score(lp, top, unit.ranks[i] if i < len(unit.ranks) else None)
                          for i, (lp, top) in enumerate(unit.scores)}
                for s in unit.seqs:
                    s.context_scores = scores
        self.retire(self.decoding + [s for unit in prefilled for s in unit.seqs])

    def retire(self, seqs: list[Sequence]) -> None:
        """`seqs` (every decoding sequence) go on decoding unless finished; the finished give their slots back."""
        self.decoding = [s for s in seqs if s.finish_reason is None]
        for s in seqs:
            if s.finish_reason is not None:
                self._release(s, _kv_tokens(s))

    def timed(self, batch: Batch, seconds: float) -> None:
        """A step ran `batch` in `seconds`: the pace that `_in_time` expects of the next steps."""
        rows = len(batch.decoding) + sum(n for _, n in batch.chunks)
        if rows:
            self.pace.append(seconds / step_cost(rows, self.row_costs))

    def complete(self, req: Request, completion: dict) -> None:
        """A request that ended: its completion goes to the caller at `settle`."""
        del self.requests[req.job.id]
        self.ended.append((req.handle, completion, None))

    def drop(self, req: Request, err: EngineError, events: list[Event]) -> None:
        """End a request early (cancelled or failed): free its slots, tell the caller (at `settle`)."""
        del self.requests[req.job.id]
        # what its slots hold, where it is whole: a faulted step may have written part of its layers
        kept = {}
        if not isinstance(err, EngineFault):
            kept = {id(s): _kv_tokens(s) for s in self.decoding if s.request is req}
            kept.update({id(u.seqs[0]): u.context[:u.fed] for u in self.prefilling if u.seqs[0].request is req})
        self.ready = [u for u in self.ready if u.seqs[0].request is not req]
        self.waiting = deque(u for u in self.waiting if u.seqs[0].request is not req)
        self.prefilling = [u for u in self.prefilling if u.seqs[0].request is not req]
        self.decoding = [s for s in self.decoding if s.request is not req]
        for s in req.seqs:
            self._release(s, kept.get(id(s), []))
        if isinstance(err, RequestCancelled):
            events.append((req.job.id, "cancelled", {}))
        elif not isinstance(err, EngineFault):  # a fault writes nothing: the job may resume elsewhere
            events.append((req.job.id, "error", err.body()))
        self.ended.append((req.handle, None, err))

    def settle(self) -> None:
        """Hand the requests that ended to their callers, once their events went to the event sink
        (a caller that needs them in the job's stream waits for the sink's writer:
        worker/consumer.py records a job's end in rq only then)."""
        ended, self.ended = self.ended, []
        for handle, result, error in ended:
            handle.end(result, error)

    def stop(self, err: EngineFault, events: list[Event]) -> None:
        """The engine stops: every request in it, submitted or running, fails with `err`."""
        self._take_new(events)
        for req in list(self.requests.values()):
            self.drop(req, err, events)

    def _take_new(self, events: list[Event]) -> None:
        """Register the submitted requests (or end the refused ones) and queue their prefills."""
        while self.inbox:
            req, handle, err = self.inbox.popleft()
            if err is not None:
                events.append((handle.job_id, "error", err.body()))
                self.ended.append((handle, None, err))
            elif handle.job_id in self.requests:
                self.ended.append((handle, None, EngineFault(f"Job {handle.job_id} is already running.")))
            else:
                self.requests[handle.job_id] = req
                self._queue(req)

    def _queue(self, req: Request) -> None:
        """Group the request's sequences into prefills: the fresh copies of a prompt share one,
        a resumed sequence feeds its own prompt + emitted tokens."""
        echo_scores = (req.wants_logprobs and req.job.echo) or req.job.prompt_logprobs is not None
        score_from = 1 if echo_scores else None  # logprobs of the prompt's tokens, from the second
        queued = arrival(req.job)
        for p, prompt in enumerate(req.job.prompts):
            seqs = req.seqs[p * req.best_of:(p + 1) * req.best_of]
            fresh = [s for s in seqs if not s.history]
            if fresh and all(s.max_new == 0 for s in fresh) and score_from is None:
                self.ready.append(Prefill(fresh, prompt, None, queued))  # nothing to compute: the (echoed) prompt alone
            elif fresh:
                self.waiting.append(Prefill(fresh, prompt, score_from, queued))
            for s in seqs:
                if s.history:  # its emitted tokens need their logprobs again for `done`
                    from_ = 1 if echo_scores else len(prompt) if req.wants_logprobs else None
                    self.waiting.append(Prefill([s], prompt + s.history, from_, queued))

    def _take_cancels(self, events: list[Event]) -> None:
        while self.cancels:
            job_id = self.cancels.popleft()
            if job_id in self.requests:
                self.drop(self.requests[job_id], RequestCancelled(job_id), events)

    def _admit(self) -> list[Sequence]:
        """Waiting prefills take free slots in arrival order; one too big for what is free is split
        (its remaining copies wait for slots and a prefill of their own), except a prompt's beams,
        which start together or wait, and a contrastive search, which waits for all its slots.
        Returns the sequences admitted."""
        admitted = []
        while self.waiting and self.free_slots:
            head = self.waiting[0]
            req = head.seqs[0].request
            if len(head.seqs) * req.slots_per_sequence > len(self.free_slots) and (req.beam or req.contrastive):
                break
            if len(head.seqs) > len(self.free_slots):
                take = len(self.free_slots)
                unit = Prefill(head.seqs[:take], head.context, head.score_from, head.queued)
                head.seqs = head.seqs[take:]
            else:
                unit = self.waiting.popleft()
            self._reuse_prefix(unit)
            for s in unit.seqs:
                if s.slot is None:
                    s.slot = self._take_slot()
                s.scratch = [self._take_slot() for _ in range(req.slots_per_sequence - 1)]
            admitted += unit.seqs
            self.prefilling.append(unit)
        return admitted

    def _chunks(self) -> list[tuple[Prefill, int]]:
        """Context tokens of the prefilling sequences, in arrival order: up to `prefill_chunk`, and,
        unless `launch_bound`, beside decoding sequences up to what keeps the step within STEP_RATIO
        times their decode (`chunk_beside`; more where the prompts holding slots would miss
        PROMPT_DEADLINE), so a long prompt slows the running sequences by a bounded factor, never
        stalls them for its whole length."""
        budget, chunks = self.prefill_chunk, []
        if self.decoding and self.prefilling and not self.launch_bound:
            ratio, pace = STEP_RATIO, float(np.median(self.pace)) if self.pace else None
            while chunk_beside(len(self.decoding), self.row_costs, ratio) < budget and not self._in_time(ratio, pace):
                ratio *= 2
            budget = min(budget, chunk_beside(len(self.decoding), self.row_costs, ratio))
        scoring = SCORE_BUDGET
        for unit in self.prefilling:
            if budget <= 0:
                break
            cap = min(SCORE_CHUNK, scoring) if unit.score_from is not None else budget
            n = min(len(unit.context) - unit.fed, budget, cap)
            if n <= 0:
                continue
            chunks.append((unit, n))
            budget -= n
            if unit.score_from is not None:
                scoring -= n
        return chunks

    def _in_time(self, ratio: float, pace: float | None) -> bool:
        """Whether, in chunks of `chunk_beside` at `ratio` and steps at `pace` (the median measured),
        every prompt holding a slot (in arrival order, each behind the ones before it) is fed within
        PROMPT_DEADLINE seconds of its arrival (`arrival`). Nothing measured yet: in time. Prompts
        still waiting for a slot are not counted: admission runs before this, so they wait because
        every slot is taken, and larger chunks would only slow the sequences whose ends free them."""
        if pace is None:
            return True
        decoding = len(self.decoding)
        chunk = min(self.prefill_chunk, chunk_beside(decoding, self.row_costs, ratio))
        step = pace * step_cost(decoding + chunk, self.row_costs)
        now, behind = time.monotonic(), 0
        for unit in self.prefilling:
            behind += len(unit.context) - unit.fed
            if now - unit.queued + -(-behind // chunk) * step > PROMPT_DEADLINE:
                return False
        return True

    def _reuse_prefix(self, unit: Prefill) -> None:
        """Give the prefill's leader the free slot holding the longest prefix of its context, and
        start its prefill after that prefix (worker/prefix_cache.py). A contrastive search needs its
        context's hidden states, which a reused prefix does not give."""
        req = unit.seqs[0].request
        if req.contrastive or unit.fed:
            return
        match = self.prefix.find(unit.context, unit.score_from, req.job.prompt_logprobs is not None)
        if match is None:
            return
        self.free_slots.remove(match.slot)
        self.prefix.take(match.slot)
        unit.seqs[0].slot = match.slot
        unit.fed = match.reused
        unit.scores = [(score.logprob, score.top) for score in match.scores]
        if req.job.prompt_logprobs is not None:
            unit.ranks = [score.rank for score in match.scores]
        req.cached_tokens += min(match.reused, len(unit.seqs[0].prompt))

    def _take_slot(self) -> int:
        slot = self.prefix.evictable(self.free_slots)
        self.free_slots.remove(slot)
        self.prefix.take(slot)
        return slot

    def _release(self, seq: Sequence, kv_tokens: list[int]) -> None:
        """Free the sequence's slots; its own keeps what it holds for the prefix cache (`kv_tokens`:
        the tokens whose keys and values it holds) unless the request's search moved them around."""
        if seq.slot is not None:
            req = seq.request
            self.free_slots += [seq.slot, *seq.scratch]
            searched = req.beam or req.contrastive
            self.prefix.release(seq.slot, [] if searched else kv_tokens, seq.context_scores)
            for slot in seq.scratch:
                self.prefix.release(slot, [])
            seq.slot, seq.scratch, seq.search = None, [], None


def _kv_tokens(seq: Sequence) -> list[int]:
    """The tokens whose keys and values a sequence past its prefill holds: its context, and the
    tokens it generated that a forward has fed (all but the last, or all where a later draw is still
    on its way to the host: the step that drew it fed the last)."""
    return (seq.prompt + seq.tokens)[:seq.position] if seq.tokens else list(seq.prompt)


def arrival(job: protocol.CompletionJob) -> float:
    """When `job` reached the gateway, on this process's time.monotonic() clock: its age by the
    wall clock, never negative (the gateway's clock may run ahead of this machine's)."""
    return time.monotonic() - max(0.0, time.time() - job.received)


def step_cost(rows: int, row_costs: dict[int, float] | None) -> float:
    """The cost of a forward of `rows` rows by `row_costs` (linear between the measured row counts,
    proportional to the rows past the last; more rows never cost less, timings being noisy); 1.0
    at any rows without measured costs (a GPU, whose small steps wait on their launches)."""
    if not row_costs:
        return 1.0
    rows_at, costs = _costs(row_costs)
    if rows > rows_at[-1]:
        return costs[-1] * rows / rows_at[-1]
    return float(np.interp(rows, rows_at, costs))


def chunk_beside(decoding: int, row_costs: dict[int, float] | None, ratio: float = STEP_RATIO) -> int:
    """The prompt tokens to feed in one forward with `decoding` rows: the most whose rows cost, by
    `step_cost`, at most `ratio` times the decoding rows alone; at least MIN_CHUNK. Without
    measured costs, BESIDE_CHUNK tokens at STEP_RATIO, in proportion at another ratio."""
    if not row_costs:
        return int(BESIDE_CHUNK * ratio / STEP_RATIO)
    rows_at, costs = _costs(row_costs)
    limit = ratio * step_cost(decoding, row_costs)
    most = rows_at[-1] * limit / costs[-1] if limit > costs[-1] else np.interp(limit, costs, rows_at)
    return max(MIN_CHUNK, int(most) - decoding)


def _costs(row_costs: dict[int, float]) -> tuple[tuple[int, ...], np.ndarray]:
    rows, costs = zip(*sorted(row_costs.items()))
    return rows, np.maximum.accumulate(costs)
