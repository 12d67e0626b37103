"""The continuous-batching engine: one per device, owning the model, a KV cache of sequence slots
and the thread that steps them.

Each step reads like vLLM's, one module per stage:
  1. schedule (scheduler.py): take new requests and cancellations, admit waiting sequences into
     free KV-cache slots, choose the prefill chunk (at most `prefill_chunk` prompt tokens, and
     on a CPU beside running sequences as many as keep the step's matmuls within STEP_RATIO times
     their decode's measured cost, so a long prompt slows them for a few steps, never stalls them
     for its whole length; a GPU's step costs its launches, so there the whole chunk rides along);
  2. execute (runner.py): one forward for every running sequence (T = 1), the prefill chunk
     riding along where the step's route takes it (decode_routes.py); the sequences whose prefill
     completed start (output.py: echo, a resumed history);
  3. sample (strategies.py): each decoding strategy (sampling, beam search, contrastive search)
     chooses its rows' tokens on the device, all brought to the host in one copy; output.py takes
     them in (text, stops, finishes);
  4. update: the scheduler takes the finished sequences' slots back; the step's events
     (output.py) go to `event_sink` at once, which answers with the job ids to cancel; then the
     requests that ended are handed to their callers (Scheduler.settle).

Running a step ahead (`overlap`, by default on a GPU): a step's sampled tokens are taken in during
the next step, after its forward and draws are launched, so that the host's work (text, stops,
events, scheduling) runs while the GPU computes (a worker's event sink writes to Redis on a thread
of its own: worker/events.py). The next step feeds each sequence the token its slot last drew, from
the device (runner.py `last`), and counts it in the sequence's position (`Sequence.pending`). A
sequence that turns out to have ended in the step before draws one token more, which is dropped:
never a wrong output, a row's work at most. Requests whose next token depends on the previous one on
the host (beam and contrastive search, a grammar, multi-token bans) take their tokens in at once,
and while one is in the engine every step does.

Several decode forwards a step (`decode_steps`, running ahead only): while nothing waits to be
admitted or prefilled, a step launches up to `decode_steps` decode forwards and draws back to back,
each fed the draws of the one before from the device, then takes the step before's tokens in: the
scheduling, the take-in and the event write are paid once for all of them. A sequence that ends
inside them has its later draws dropped; none runs past its max_tokens. Its cost: a stop, a
cancellation or a new request is seen up to that many forwards later (docs/notes/decode-steps.md).

A fault of the engine itself (EngineFault) writes no event: the job's handle raises it, and a
retry can resume the job (output.py).

Seeded draws depend on (seed, choice index, step) only (sampling.draw_key), so a request gives
the same tokens whatever shares its batch: Gumbel-max draws make the ~1e-6 differences that batch
shapes cause in the model's logits matter only at a near-exact tie, as for greedy choices.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from nanogpt.kernels.planner import row_costs
from worker import protocol
from worker.errors import EngineError, EngineFault
from worker.grammar import Grammars
from worker.output import OutputProcessor
from worker.runner import Drawn, Runner
from worker.sampling import SamplingParams
from worker.scheduler import PREFILL_CHUNK, Batch, Event, Prefill, Request, Scheduler, Sequence
from worker.strategies import BeamSearch, ContrastiveSearch, Sampling

log = logging.getLogger(__name__)

_DEFAULT = object()
# Decode forwards a step runs while nothing waits (off a GPU, and on one): a CPU's forward runs on the
# engine's thread, so host work saved there is a small part of a step; on a GPU it is most of one.
DECODE_STEPS = {False: 1, True: 4}
# Where a step's time goes (Engine.stats' step_phase_seconds): scheduling; the forwards and draws
# launched (on a CPU, computed); waiting for a GPU's draws to reach the host; taking tokens in
# (text, stops, finishes); the step's events collected and handed to the sink.
STEP_PHASES = ("schedule", "forward", "wait", "take_in", "events")
# What a step ran (Engine.stats' step_kinds): only decoding rows (one forward, or several back to back
# running ahead: `_forwards`); a forward that fed prompt tokens, alone or beside decoding rows; anything
# else (sequences admitted or started with no prompt token to feed).
STEP_KINDS = ("decode", "prompt", "other")


class RequestHandle:
    """The caller's side of a submitted job."""

    def __init__(self, job_id: str, cancel):
        self.job_id = job_id
        self._cancel = cancel
        self._done = threading.Event()
        self._result: dict | None = None
        self._error: EngineError | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Drop the job at the next step (a no-op once it has ended)."""
        self._cancel(self.job_id)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> dict:
        """The OpenAI completion object (`choices`, `usage`, ...); raises the job's EngineError
        (RequestCancelled when cancelled), or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn) -> None:
        """Call fn(handle) once the job has ended: at once if it has, else on the engine's thread
        as it ends (so fn must not block)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def end(self, result: dict | None = None, error: EngineError | None = None) -> None:
        """The engine's side: the job ended with its completion object or an error."""
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class Engine:
    def __init__(self, model, tokenizer, *, max_batch: int | None, max_len: int | None = None, event_sink=None,
                 prefill_chunk: int | None = None, eos_token_id=_DEFAULT, kv_memory_bytes: int | None = None,
                 compile: bool = False, compile_in_background: bool = False, prepack: bool = True,
                 cuda_graphs: bool | None = None, prefix_caching: bool = True, overlap: bool | None = None,
                 decode_steps: int | None = None, fused_kernels: bool = True):
        """model: a nanogpt GPT (on its device, in eval mode); tokenizer: models.tokenizer.Tokenizer.
        max_batch: most sequences at once (KV-cache slots; None: 32 on a CPU, on a GPU as many as
        its free memory holds, nanogpt/runtime/kv_cache.default_slots), fewer if `kv_memory_bytes`
        cannot hold that many slots of `max_len` positions (default: the model's context).
        prepack: on a CPU float32 or bfloat16 model, give each Linear the fastest matmul kernel this
        machine has for it (nanogpt/kernels/planner.py, in place on the model; a prepacked kernel holds as
        much memory again as those weights).
        compile: torch.compile the decode step (forward_decode), every graph of the engine's
        decode routes compiled here before the engine runs (worker/decode_routes.py: one per batch
        bucket, the batch padded up to one; on a CPU, graphs whose rows vary instead from two rows
        up, which also run steps that feed prompt tokens beside decoding rows).
        compile_in_background: compile those graphs on a thread of their own instead, the engine
        serving eagerly meanwhile and taking each graph from the step after it compiled (not with
        CUDA graphs, which record the compiled step before the engine runs).
        prefix_caching: reuse the keys and values a free slot holds of a prompt's prefix (worker/prefix_cache.py).
        cuda_graphs: replay the decode step (compiled or not) from CUDA graphs, one per batch and
        span bucket, and each batch's draws (worker/sampling.py GraphDraws), all recorded here
        before the engine runs (nanogpt/runtime/cuda_graphs.py); None: on a GPU. On a CPU (True) the graphs' bodies run
        eagerly: the same code as a GPU's graphs, which tests check there.
        overlap: run a step ahead of taking its tokens in (see the module docstring); by default on a GPU.
        decode_steps: the most decode forwards a step runs while nothing waits for a slot or a prefill
        (see the module docstring; with `overlap` only); None: DECODE_STEPS of the device.
        prefill_chunk: the most prompt tokens a step feeds (None: scheduler.PREFILL_CHUNK of the device).
        fused_kernels: on a GPU, pad the output layer, add the residual in the layer norms' pass,
        apply the activations in the matmuls' epilogues and run the linear layers of few rows by the
        project's matmul where it times faster than cuBLAS (docs/notes/gpu-step.md); off: the
        model's modules as loaded (what they gain is measured against it)."""
        config = model.config
        self.tokenizer = tokenizer
        self.max_len = min(max_len or config.block_size, config.block_size)
        self.vocab_size = tokenizer.vocab_size
        if self.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {self.vocab_size} tokens, the model only {config.vocab_size}")
        self.event_sink = event_sink
        self.device = model.device
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.runner = Runner(model, self.vocab_size, max_batch=max_batch, max_len=self.max_len,
                             kv_memory_bytes=kv_memory_bytes, compile=compile,
                             compile_in_background=compile_in_background, prepack=prepack,
                             cuda_graphs=cuda_graphs, fused_kernels=fused_kernels, grammars=self.grammars)
        gpu = self.device.type == "cuda"
        self.scheduler = Scheduler(self.runner.slots, prefill_chunk or PREFILL_CHUNK["cuda" if gpu else "cpu"],
                                   row_costs(model), prefix_caching, launch_bound=gpu)
        self.output = OutputProcessor(tokenizer, tokenizer.eos_token_id if eos_token_id is _DEFAULT else eos_token_id)
        self.strategies = tuple(kind(self.runner, self.output) for kind in (Sampling, BeamSearch, ContrastiveSearch))
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.decode_steps = DECODE_STEPS[self.device.type == "cuda"] if decode_steps is None else decode_steps
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, not {self.decode_steps}")
        self._ahead: list[Drawn] = []  # the step before's draws, not taken in yet
        self._steps = 0
        self._busy_s = 0.0  # time inside step(): against the wall clock, how much of it the engine worked
        # where that time went (STEP_PHASES), in seconds: what a profiler would say, at the cost of a
        # few clock reads a step, so that a worker's steps can be held against an engine's alone
        self._phase_s = dict.fromkeys(STEP_PHASES, 0.0)
        self._kinds = {kind: {"steps": 0, "forwards": 0, "seconds": 0.0} for kind in STEP_KINDS}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- the caller's side ----

    def submit(self, job: protocol.CompletionJob, resume: dict[int, list[int]] | None = None) -> RequestHandle:
        """Queue a job; bad requests fail their handle (and get an `error` event), never the engine."""
        handle = RequestHandle(job.id, self._cancel)
        try:
            params, resume = self._check(job, resume or {})
            request = Request(job, handle, params, resume, self.tokenizer, self.max_len)
            self.scheduler.inbox.append((request, handle, None))
        except EngineError as err:
            self.scheduler.inbox.append((None, handle, err))
        self._wake()
        return handle

    def generate(self, job: protocol.CompletionJob, resume: dict[int, list[int]] | None = None) -> dict:
        """Run a job to its end: through the engine thread if started, else by stepping here."""
        handle = self.submit(job, resume)
        while self._thread is None and not handle.done:
            self.step()
        return handle.result()

    @classmethod
    def launch(cls, load, tokenizer, **options) -> "Engine":
        """Start a thread that builds an engine around the model `load()` returns and steps it:
        the model's loading, packing, timing and compiling run on the thread that will run its
        forwards. A CPU forward on a thread other than the one whose OpenMP team loaded the model
        runs 12-20% slower (a second live team: docs/notes/engine-thread.md), so a worker's main thread runs
        no torch work. Returns once the engine is built; raises what building it raised."""
        built: queue.Queue = queue.Queue(maxsize=1)

        def serve():
            try:
                engine = cls(load(), tokenizer, **options)
            except BaseException as err:
                built.put(err)
                return
            engine._running = True
            built.put(engine)
            engine._loop()

        thread = threading.Thread(target=serve, name="nanoserve-engine", daemon=True)
        thread.start()
        engine = built.get()
        if isinstance(engine, BaseException):
            raise engine
        engine._thread = thread
        return engine

    def start(self) -> None:
        """Step this engine on a thread of its own (see `launch`, which a worker uses)."""
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        """Whether the engine thread runs (False before `start`, after `stop`, or once it died)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; jobs still in the engine fail with EngineFault (and can be retried)."""
        self.runner.routes.close()
        if self._thread is not None:
            self._running = False
            self._wake()
            self._thread.join(timeout)
            self._thread = None
        events: list[Event] = []
        self._ahead = []
        self.scheduler.stop(EngineFault("The worker stopped before the job finished."), events)
        self._emit(events)
        self.scheduler.settle()

    @property
    def slots(self) -> int:
        """Sequences the KV cache holds at once."""
        return self.runner.slots

    @property
    def warming(self) -> bool:
        """Whether the decode step's graphs are still compiling in the background (it serves meanwhile)."""
        return self.runner.routes.warming

    def stats(self) -> dict:
        """A snapshot for metrics (read from any thread)."""
        return {"device": str(self.device), **self.scheduler.stats(), **self.runner.stats(), "steps": self._steps,
                "busy_seconds": self._busy_s, "step_phase_seconds": dict(self._phase_s),
                "step_kinds": {kind: dict(counts) for kind, counts in self._kinds.items()}}

    def _cancel(self, job_id: str) -> None:
        self.scheduler.cancels.append(job_id)
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        while self._running:
            with self._cond:
                if not self.scheduler.has_work():
                    self._cond.wait(0.5)
            if self._running:
                self.step()

    # ---- validation (caller's thread; reads only constants) ----

    def _check(self, job: protocol.CompletionJob, resume: dict[int, list[int]]
               ) -> tuple[SamplingParams, dict[int, list[int]]]:
        """The job checked as the web tier checked its request (protocol.check_job, in the same
        words: a job may reach the queue another way), then against what only the engine knows: its
        slots, what a resumed job emitted. OpenAI's ranges and defaults are the request schema's."""
        V = self.vocab_size
        try:
            protocol.check_job(job, V, self.max_len)
        except protocol.APIError as err:
            raise EngineError(err.message, err.type, err.param, err.code) from None
        width = job.best_of or job.n
        if job.use_beam_search and width > self.runner.slots:
            raise EngineError(f"Beam search of width {width} needs as many KV-cache slots; this worker has "
                              f"{self.runner.slots}.", param="best_of" if job.best_of else "n")
        if job.penalty_alpha > 0 and (job.use_beam_search or width > 1):  # the web tier refuses these too
            raise EngineError("Contrastive search runs one sequence per prompt: n, best_of and use_beam_search "
                              "do not combine with it.", param="penalty_alpha")
        if job.penalty_alpha > 0 and job.top_k > self.runner.slots:
            raise EngineError(f"Contrastive search among top_k={job.top_k} candidates needs as many KV-cache "
                              f"slots; this worker has {self.runner.slots}.", param="top_k")
        if job.grammar is not None:
            if job.use_beam_search or job.penalty_alpha > 0:  # the web tier refuses these too
                raise EngineError("Structured output does not combine with use_beam_search or penalty_alpha.",
                                  param="structured_outputs")
            self.grammars.check(job.grammar)
        eos = self.output.eos_token_id
        # the one set of tokens that end a sequence: sampling, beam search and output all read it
        stop_ids = [*job.stop_token_ids, *([eos] if eos is not None and not job.ignore_eos else [])]
        params = SamplingParams(
            temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, min_p=job.min_p,
            presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
            repetition_penalty=job.repetition_penalty, seed=job.seed,
            logit_bias={t: min(100.0, max(-100.0, b)) for t, b in job.logit_bias.items()},
            allowed_token_ids=tuple(job.allowed_token_ids) if job.allowed_token_ids is not None else None,
            bad_words=tuple(tuple(w) for w in job.bad_words if w), stop_ids=tuple(dict.fromkeys(stop_ids)),
            min_tokens=job.min_tokens, no_repeat_ngram_size=job.no_repeat_ngram_size, grammar=job.grammar)
        if width > job.n or job.use_beam_search:
            return params, {}  # nothing of such a job is emitted before it ends: start over
        choices = len(job.prompts) * job.n
        for index, ids in resume.items():
            prompt = job.prompts[index // job.n] if 0 <= index < choices else None
            if prompt is None or (job.echo and ids[:len(prompt)] != prompt) or any(not 0 <= t < V for t in ids):
                raise EngineError(f"Cannot resume choice {index}: its emitted tokens do not fit this job.",
                                  "server_error")
        return params, resume

    # ---- one step ----

    def step(self) -> None:
        """One engine iteration: schedule -> execute -> sample -> update (see the module
        docstring). Never raises for a request's sake."""
        events: list[Event] = []
        started = time.perf_counter()
        phases = self._phase_s
        taken_in = [phases["take_in"] + phases["wait"]]  # at each mark: taking in is timed where it runs
        if self._ahead and not self._overlaps():  # a request needs its tokens on the host to schedule
            ahead, self._ahead = self._ahead, []
            try:
                for drawn in ahead:
                    self._take_in(drawn, ahead=True)
            except Exception:
                self._fault({s.request for d in ahead for s in d.rows
                             if self.scheduler.requests.get(s.request.job.id) is s.request}, events)
        taken_in.append(phases["take_in"] + phases["wait"])
        batch = self.scheduler.schedule(events)
        forwards = self._forwards(batch)
        kind = "prompt" if batch.chunks else "decode" if batch.decoding and not (batch.ready or batch.admitted) \
            else "other"
        launching = time.perf_counter()
        try:
            with torch.no_grad():
                if forwards:
                    prefilled = []
                    self._settle_draws(self._decode_ahead(batch.decoding, forwards), ahead=True)
                else:
                    rows, logits, prefilled = self._execute(batch)
                    self._sample(batch, rows, logits)
            self.scheduler.update(batch, prefilled)
        except Exception:
            self._ahead = []  # its requests are among the batch's
            self._fault(batch.requests, events)
        collecting = time.perf_counter()
        taken_in.append(phases["take_in"] + phases["wait"])
        for req, completion in self.output.collect(self.scheduler.requests.values(), events):
            self.scheduler.complete(req, completion)
        self._steps += max(forwards, 1)
        self.scheduler.cancels.extend(self._emit(events))
        self.scheduler.settle()  # after the events went to the sink: see Scheduler.settle
        ended = time.perf_counter()
        took = ended - started
        self._busy_s += took
        phases["schedule"] += launching - started - (taken_in[1] - taken_in[0])
        phases["forward"] += collecting - launching - (taken_in[2] - taken_in[1])
        phases["events"] += ended - collecting
        counts = self._kinds[kind]
        counts["steps"] += 1
        counts["forwards"] += max(forwards, 1)
        counts["seconds"] += took
        self.scheduler.timed(batch, took / max(forwards, 1))

    def _forwards(self, batch: Batch) -> int:
        """The decode forwards of a step that only decodes, every request running ahead (none needs
        its tokens on the host) and nothing waiting for a slot or a prefill: `decode_steps`, fewer
        where a sequence would reach its max_tokens. 0 for any other step (`_execute` runs it)."""
        if not self.overlap or not batch.decoding or batch.chunks or batch.ready or batch.admitted:
            return 0
        scheduler = self.scheduler
        if scheduler.inbox or scheduler.waiting or scheduler.prefilling or not self._overlaps():
            return 0
        return max(1, min(self.decode_steps, *(s.max_new - len(s.tokens) - s.pending for s in batch.decoding)))

    def _execute(self, batch: Batch) -> tuple[list[Sequence], torch.Tensor | None, list[Prefill]]:
        """The step's forwards (runner.py), then the start of the sequences whose prefill completed
        (output.py). Returns the rows that choose their token from logits (the decoding ones, then
        those that start and draw now), their logits (R, V), and the prefills completed."""
        self.runner.admit(batch.admitted)
        for unit in batch.ready:
            self.output.start(unit)
        rows, searching = [], []  # contrastive searches decode candidates, not rows of logits
        for s in batch.decoding:
            (rows if self._strategy(s).reads_logits else searching).append(s)
        decoded, prefilled = self.runner.forward(rows, searching, batch.chunks)
        pieces = [decoded] if decoded is not None else []
        for unit, last in prefilled:
            drawing = self._strategy(unit.seqs[0]).start(unit, self.output.start(unit))
            rows += drawing
            pieces += [last[None]] * len(drawing)
        logits = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)) if pieces else None  # cat copies even one
        return rows, logits, [unit for unit, _ in prefilled]

    def _sample(self, batch: Batch, rows: list[Sequence], logits: torch.Tensor | None) -> None:
        """Each strategy chooses the tokens of its rows: from their `logits` (those of `rows`), or,
        contrastive search, among its decoding sequences' candidates. Then the step before's draws
        are taken in, and this step's at once or, running ahead, in the next step."""
        drawn = None
        for strategy in self.strategies:
            if strategy.reads_logits:
                mine = [i for i, s in enumerate(rows) if strategy.takes(s.request)]
                if mine:  # no copy when every row is the strategy's
                    drawn = strategy.draw([rows[i] for i in mine], logits if len(mine) == len(rows) else logits[mine]) or drawn
            else:
                mine = [s for s in batch.decoding if strategy.takes(s.request)]
                if mine:
                    strategy.draw(mine, None)
        ahead = drawn is not None and self.overlap and all(s.request.overlaps for s in drawn.rows)
        if ahead:
            for s in drawn.rows:
                s.pending += 1
        self._settle_draws([drawn] if drawn is not None else [], ahead)

    def _decode_ahead(self, rows: list[Sequence], forwards: int) -> list[Drawn]:
        """`forwards` decode forwards of `rows`, each drawing from the last and fed its draws from the
        device: their draws, in order, none taken in. Rows that draw from their logits alone draw
        inside the decode's graphs (Runner.decode_in_graphs); others through the sampler."""
        drawn = self.runner.decode_in_graphs(rows, forwards)
        if drawn is not None:
            for s in rows:
                s.pending += forwards
            return drawn
        drawn = []
        for _ in range(forwards):  # each step's logits freed before the next forward allocates its own
            drawn.append(self.runner.sample(rows, [self.runner.forward(rows, [], [])[0]]))
            for s in rows:
                s.pending += 1
        return drawn

    def _settle_draws(self, drawn: list[Drawn], ahead: bool) -> None:
        """After a step's draws (`drawn`, in the order drawn) are launched: take the step before's in,
        then this step's at once or, `ahead`, in the next step (their rows count them pending)."""
        before, self._ahead = self._ahead, []
        for d in before:
            self._take_in(d, ahead=True)
        if ahead:
            self._ahead = drawn
        else:
            for d in drawn:
                self._take_in(d)

    def _fault(self, requests, events: list[Event]) -> None:
        """A fault (not a bad request: those were refused at submit). These jobs cannot be trusted to
        continue, but the engine goes on with the next ones."""
        log.exception("engine step failed")
        err = EngineFault()
        for req in requests:
            self.scheduler.drop(req, err, events)

    def _overlaps(self) -> bool:
        """Whether this step may run before the step before's tokens are taken in."""
        return self.overlap and all(req.overlaps for req in self.scheduler.requests.values())

    def _take_in(self, drawn: Drawn, ahead: bool = False) -> None:
        """Take in drawn tokens (output.py), except those of sequences that ended (or were dropped)
        since the draw, which only a step run `ahead` has; its sequences leave their pending count,
        and the scheduler takes back the slots of those that ended."""
        live = []
        waiting = time.perf_counter()
        draws = drawn.draws()  # a GPU's draws: waits for their copy to the host
        took_in = time.perf_counter()
        self._phase_s["wait"] += took_in - waiting
        for seq, draw in zip(drawn.rows, draws):
            seq.pending -= ahead
            if seq.finish_reason is None and self.scheduler.requests.get(seq.request.job.id) is seq.request:
                live.append((seq, draw))
        self.output.accept([seq for seq, _ in live], [draw for _, draw in live])
        if ahead:
            self.scheduler.retire(self.scheduler.decoding)
        self._phase_s["take_in"] += time.perf_counter() - took_in

    def _strategy(self, seq: Sequence):
        return next(strategy for strategy in self.strategies if strategy.takes(seq.request))

    def _emit(self, events: list[Event]) -> set[str]:
        if self.event_sink is None:
            return set()
        try:
            return set(self.event_sink(events) or ())
        except Exception:
            log.exception("event sink failed; %d events lost", len(events))
            return set()
