"""The continuous-batching engine: one per device, owning the model, a KV cache of sequence slots
and the thread that steps them.

Each step (`Engine.step`):
  1. take new requests and cancellations; admit waiting sequences into free KV-cache slots;
  2. one decode forward for every running sequence (T = 1), plus at most `prefill_chunk` prompt
     tokens of admitted prompts (chunked, so a long prompt delays running sequences by one chunk
     per step, never by its whole length); the `n`/`best_of` copies of a prompt share one prefill,
     whose keys/values are then copied to their slots;
  3. sample every row that has logits (sampling.py), score them (logprobs.py), and bring the
     results to the host with one `.tolist()`;
  4. decode text, match stops, finish sequences, free their slots; hand all of the step's events
     to `event_sink` at once, which answers with the job ids to cancel.

Events (worker/protocol.py) per job: `delta` {index, text, token_ids, logprobs} whenever a
choice has new tokens or text (with `echo`, a choice's first delta also carries the prompt: its
text, ids and logprobs), `finish` {index, finish_reason} once per choice, then `usage` and `done`
{completion}; or `error` (a bad request) / `cancelled`. A fault of the engine itself (EngineFault)
writes no event: the job's handle raises it, and a retry can resume the job. With best_of > n
nothing is streamed: the chosen choices come as one delta each when the request ends.

Resuming (a job retried after a crash): `resume[index]` is the concatenation of the `token_ids`
of the deltas already emitted for that choice. The choice is prefilled with them, replayed
through the same decoder, stop matcher and draw counter, and continues as if never interrupted;
only what is new is emitted (choices that had finished emit nothing more), while `done` holds
the full completion.

Seeded draws depend on (seed, choice index, step) only (sampling.draw_key), so a request gives
the same tokens whatever shares its batch: Gumbel-max draws make the ~1e-6 differences that batch
shapes cause in the model's logits matter only at a near-exact tie, as for greedy choices.
"""
from __future__ import annotations

import heapq
import logging
import threading
from collections import Counter, deque

import torch

from nanogpt.kv_cache import KVCache
from nanogpt.packed import pack_linears
from worker import protocol
from worker.logprobs import MAX_LOGPROBS, TokenLogprob, fragment, score
from worker.sampling import Sampler, SamplingParams
from worker.stops import StopMatcher

log = logging.getLogger(__name__)

SCORE_CHUNK = 128  # prompt tokens scored per step (echo + logprobs): their (T, V) logits are kept
# compiled decode pads its batch to one of these sizes (then to multiples of the last), bounding
# recompilation to one graph per bucket
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_DEFAULT = object()


def compile_decode(model):
    """torch.compile of model.forward_decode: on CPU with inductor's weight freezing (the weights
    become constants of the graph), which lets the matmuls use the prepacked weights of
    nanogpt/packed.py (or inductor packs them itself)."""
    # every batch bucket is a graph, and so is each model of the process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if model.device.type == "cpu":
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True
    return torch.compile(model.forward_decode)


def quantize_int8(model):
    """CPU only, opt-in: nn.Linear weights to int8, activations quantized on the fly
    (torch.ao.quantization.quantize_dynamic, in place). It changes numerics, so it is never a
    default; embeddings, LayerNorms and attention stay float32.

    Measured against float32 on a trained checkpoint (shakespeare-char config, 1500 iterations,
    validation loss 1.78): held-out loss 1.7407 -> 1.7424, |logprob change| of the true next
    token mean 0.038 (p99 0.22), KL 0.002 nats, the same argmax at 97.3% of positions; greedy,
    11 of 32 completions of 48 tokens identical, the first different token at a median of 31.5.
    Decode of one sequence (GPT-2 small shape, 2 threads): 1.7x float32 (docs/benchmarks.md)."""
    import warnings
    with warnings.catch_warnings():  # the deprecation notice points to torchao, not installed here
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


class EngineError(protocol.APIError):
    """A request the engine cannot run (OpenAI's error fields; answered as a 400 unless its type says
    otherwise)."""

    def __init__(self, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(protocol.STATUS_BY_TYPE.get(type_, 500), message, type_, param, code)


class EngineFault(EngineError):
    """The engine failed, not the request (a fault in a step, or the engine stopping). No `error`
    event is written for it, so the job can be retried and resume elsewhere."""

    def __init__(self, message: str = "The server had an error while processing your request."):
        super().__init__(message, "server_error")


class RequestCancelled(EngineError):
    def __init__(self, job_id: str):
        super().__init__(f"Job {job_id} was cancelled.", "cancelled")


class RequestHandle:
    """The caller's side of a submitted job."""

    def __init__(self, job_id: str, engine: Engine):
        self.job_id = job_id
        self._engine = engine
        self._done = threading.Event()
        self._result: dict | None = None
        self._error: EngineError | None = None

    def cancel(self) -> None:
        """Drop the job at the next step (a no-op once it has ended)."""
        self._engine._cancels.append(self.job_id)
        self._engine._wake()

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

    def _end(self, result: dict | None = None, error: EngineError | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()


class Request:
    """One job inside the engine: its parameters and its sequences, prompt-major
    (candidate prompt_index * best_of + k)."""

    def __init__(self, engine: Engine, job: protocol.CompletionJob, handle: RequestHandle,
                 params: SamplingParams, resume: dict[int, list[int]]):
        self.job, self.handle, self.params = job, handle, params
        self.n = job.n
        self.best_of = job.best_of or job.n
        self.streams = self.best_of == self.n  # best_of > n: choices are decided at the end
        self.wants_logprobs = job.logprobs is not None
        self.needs_scores = self.wants_logprobs or not self.streams  # best_of ranks by mean logprob
        self.prompt_texts = [engine.tokenizer.decode(p) for p in job.prompts]
        self.echo_entries: dict[int, list[TokenLogprob]] = {}  # prompt index -> prompt's logprobs
        self.seqs = []
        for p, prompt in enumerate(job.prompts):
            max_new = engine.max_len - len(prompt) if job.max_tokens is None else job.max_tokens
            for k in range(self.best_of):
                c = p * self.best_of + k
                self.seqs.append(Sequence(self, p, c, max_new, engine.tokenizer, resume.get(c)))


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
        self.tokens: list[int] = []  # generated so far (history included)
        self.entries: list[TokenLogprob] = []  # logprobs of the generated tokens
        self.logprob_sum = 0.0
        self.text = ""  # completion text released so far (stops applied)
        self.chars = 0  # characters decoded so far, where the next token's text starts
        self.text_base = len(request.prompt_texts[prompt_index])  # text_offset counts from the prompt's end
        self.decoder = tokenizer.incremental_decoder()
        self.stops = StopMatcher(job.stop)
        self.finish_reason: str | None = None
        self.finish_sent = False
        # what the next delta carries
        self.out_text, self.out_ids, self.out_entries = "", [], []

    @property
    def position(self) -> int:
        """Tokens in this sequence's cache slot = position of the next token fed."""
        return len(self.prompt) + len(self.tokens) - 1

    def mean_logprob(self) -> float:
        return self.logprob_sum / len(self.tokens) if self.tokens else 0.0


class Prefill:
    """Context to feed into the leader's slot (seqs[0]); the other seqs get a copy of its cache.
    `scores[i]` is (logprob, top) of context[score_from + i] when logprobs of the context are needed."""

    def __init__(self, seqs: list[Sequence], context: list[int], score_from: int | None):
        self.seqs, self.context, self.score_from = seqs, context, score_from
        self.fed = 0
        self.scores: list[tuple[float, list[tuple[int, float]]]] = []


class Engine:
    def __init__(self, model, tokenizer, *, max_batch: int, max_len: int | None = None, event_sink=None,
                 prefill_chunk: int = 256, eos_token_id=_DEFAULT, kv_memory_bytes: int | None = None,
                 compile: bool = False, prepack: bool = True):
        """model: a nanogpt GPT (on its device, in eval mode); tokenizer: models.tokenizer.Tokenizer.
        max_batch: most sequences at once (KV-cache slots), fewer if `kv_memory_bytes` cannot hold
        that many slots of `max_len` positions (default: the model's context).
        prepack: on a CPU float32 model, also hold the Linear weights in MKL's packed layout
        (nanogpt/packed.py, done in place on the model; as much memory again as those weights):
        decode steps of several sequences run about twice as fast.
        compile: torch.compile the decode step (GPT.forward_decode), one graph per batch size of
        BATCH_BUCKETS (the batch is padded up to one), all compiled here before the engine runs;
        on CPU with inductor's weight freezing."""
        config = model.config
        self.model, self.tokenizer = model, tokenizer
        self.max_len = min(max_len or config.block_size, config.block_size)
        self.vocab_size = tokenizer.vocab_size
        if self.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {self.vocab_size} tokens, the model only {config.vocab_size}")
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is _DEFAULT else eos_token_id
        self.event_sink = event_sink
        self.prefill_chunk = max(1, prefill_chunk)
        self.device, dtype = model.device, model.dtype
        slots = max_batch
        if kv_memory_bytes is not None:
            slots = min(slots, kv_memory_bytes // (KVCache.bytes_per_token(config, dtype) * self.max_len))
        if slots < 1:
            raise ValueError(f"KV-cache budget of {kv_memory_bytes} bytes holds no slot of {self.max_len} positions")
        # one more slot than sequences when compiled: padding rows write their garbage there
        self.cache = KVCache(config, slots + compile, self.max_len, self.device, dtype)
        self.sampler = Sampler(slots, self.vocab_size, self.device)
        # a heap: sequences take the lowest free slot, so the running ones tend to fill slots
        # 0..n-1 and, taken in slot order, read the KV cache in place (see _run_batch)
        self.free_slots = list(range(slots))
        self.slots = slots
        self.compiled = compile
        self._decode_forward = model.forward_cached
        if prepack and self.device.type == "cpu" and dtype == torch.float32:
            pack_linears(model)
        if compile:
            self._decode_compiled = compile_decode(model)
            for i in range(len(self.cache.k)):  # one graph serves every engine's slot count
                torch._dynamo.mark_dynamic(self.cache.k[i], 0)
                torch._dynamo.mark_dynamic(self.cache.v[i], 0)
            try:
                self._warm_up()
            except Exception:  # e.g. no C++ compiler for inductor's CPU kernels: serve uncompiled
                log.exception("compiling the decode step failed; the engine runs it uncompiled")
                self.compiled = False

        self.requests: dict[str, Request] = {}  # active jobs, in arrival order
        self.waiting: deque[Prefill] = deque()  # no slots yet
        self.prefilling: list[Prefill] = []  # slots held, context being fed
        self.decoding: list[Sequence] = []  # running: one token per step
        # filled by other threads, drained by step()
        self._inbox: deque[tuple[Request | None, RequestHandle, EngineError | None]] = deque()
        self._cancels: deque[str] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stats = Counter()
        self._batch_sizes = Counter()

    # ---- the caller's side ----

    def submit(self, job: protocol.CompletionJob, resume: dict[int, list[int]] | None = None) -> RequestHandle:
        """Queue a job; bad requests fail their handle (and get an `error` event), never the engine."""
        handle = RequestHandle(job.id, self)
        try:
            params, resume = self._check(job, resume or {})
            self._inbox.append((Request(self, job, handle, params, resume), handle, None))
        except EngineError as err:
            self._inbox.append((None, handle, err))
        self._wake()
        return handle

    def generate(self, job: protocol.CompletionJob, resume: dict[int, list[int]] | None = None) -> dict:
        """Run a job to its end: through the engine thread if started, else by stepping here."""
        handle = self.submit(job, resume)
        while self._thread is None and not handle.done:
            self.step()
        return handle.result()

    def start(self) -> None:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        """Whether the engine thread runs (False before `start`, after `stop`, or once it died)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; jobs still in the engine fail with EngineFault (and can be retried)."""
        if self._thread is not None:
            self._running = False
            self._wake()
            self._thread.join(timeout)
            self._thread = None
        events = []
        self._take_new(events)
        for req in list(self.requests.values()):
            self._drop(req, EngineFault("The worker stopped before the job finished."), events)
        self._emit(events)

    def stats(self) -> dict:
        """A snapshot for metrics (read from any thread)."""
        return {"device": str(self.device), "running": len(self.decoding) + sum(len(u.seqs) for u in self.prefilling),
                "waiting": len(self._inbox) + len({id(u.seqs[0].request) for u in list(self.waiting)}),
                "requests": len(self.requests), "kv_slots_used": self.slots - len(self.free_slots),
                "kv_slots_total": self.slots, "tokens_generated": self._stats["tokens_generated"],
                "prompt_tokens": self._stats["prompt_tokens"], "steps": self._stats["steps"],
                "batch_size_counts": dict(self._batch_sizes)}

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        while self._running:
            with self._cond:
                if not (self.requests or self._inbox or self._cancels):
                    self._cond.wait(0.5)
            if self._running:
                self.step()

    # ---- validation (caller's thread; reads only constants) ----

    def _check(self, job, resume) -> tuple[SamplingParams, dict[int, list[int]]]:
        V, ctx = self.vocab_size, self.max_len
        if not job.prompts:
            raise EngineError("The prompt list is empty.", param="prompt")
        if job.max_tokens is not None and job.max_tokens < 0:
            raise EngineError(f"{job.max_tokens} is less than the minimum of 0 - 'max_tokens'", param="max_tokens")
        for prompt in job.prompts:
            if not prompt:
                raise EngineError("A prompt has no tokens.", param="prompt")
            bad = next((t for t in prompt if not 0 <= t < V), None)
            if bad is not None:
                raise EngineError(f"Token id {bad} in the prompt is outside the vocabulary (0..{V - 1}).", param="prompt")
            if len(prompt) + (job.max_tokens or 0) > ctx:
                error = protocol.context_length_error(ctx, len(prompt), job.max_tokens)
                raise EngineError(error.message, error.type, error.param, error.code)
        if job.n < 1:
            raise EngineError(f"{job.n} is less than the minimum of 1 - 'n'", param="n")
        if job.best_of is not None and job.best_of < job.n:
            raise EngineError("best_of must be greater than or equal to n.", param="best_of")
        if job.logprobs is not None and not 0 <= job.logprobs <= MAX_LOGPROBS:
            raise EngineError(f"logprobs must be between 0 and {MAX_LOGPROBS}.", param="logprobs")
        if job.temperature < 0:
            raise EngineError("temperature must be at least 0.", param="temperature")
        if not 0 < job.top_p <= 1:
            raise EngineError("top_p must be in (0, 1].", param="top_p")
        if job.top_k < 0:
            raise EngineError("top_k must be at least 0.", param="top_k")
        bad = next((t for t in job.logit_bias if not 0 <= t < V), None)
        if bad is not None:
            raise EngineError(f"logit_bias token id {bad} is outside the vocabulary (0..{V - 1}).", param="logit_bias")
        params = SamplingParams(
            temperature=job.temperature, top_p=job.top_p, top_k=job.top_k, presence_penalty=job.presence_penalty,
            frequency_penalty=job.frequency_penalty, seed=job.seed,
            logit_bias={t: min(100.0, max(-100.0, b)) for t, b in job.logit_bias.items()})
        best_of = job.best_of or job.n
        if best_of > job.n:
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
        """One engine iteration (see the module docstring). Never raises for a request's sake."""
        events: list[tuple[str, str, dict]] = []
        self._take_new(events)
        self._take_cancels(events)
        self._admit()
        involved = {s.request for s in self.decoding} | {u.seqs[0].request for u in self.prefilling}
        try:
            with torch.no_grad():
                self._run_batch()
        except Exception:
            # A fault (not a bad request: those were refused at submit). The batch's jobs cannot
            # be trusted to continue, but the engine goes on with the next ones.
            log.exception("engine step failed")
            err = EngineFault()
            for req in involved:
                if req.job.id in self.requests:
                    self._drop(req, err, events)
        self._collect_events(events)
        self._stats["steps"] += 1
        self._cancels.extend(self._emit(events))

    def _emit(self, events) -> set[str]:
        if self.event_sink is None:
            return set()
        try:
            return set(self.event_sink(events) or ())
        except Exception:
            log.exception("event sink failed; %d events lost", len(events))
            return set()

    def _take_new(self, events) -> None:
        while self._inbox:
            req, handle, err = self._inbox.popleft()
            if err is not None:
                events.append((handle.job_id, "error", err.body()))
                handle._end(error=err)
                continue
            if handle.job_id in self.requests:
                handle._end(error=EngineFault(f"Job {handle.job_id} is already running."))
                continue
            self.requests[handle.job_id] = req
            self._queue(req)

    def _queue(self, req: Request) -> None:
        """Group the request's sequences into prefills: the fresh copies of a prompt share one,
        a resumed sequence feeds its own prompt + emitted tokens."""
        echo_scores = req.wants_logprobs and req.job.echo
        score_from = 1 if echo_scores else None  # logprobs of the prompt's tokens, from the second
        for p, prompt in enumerate(req.job.prompts):
            seqs = req.seqs[p * req.best_of:(p + 1) * req.best_of]
            fresh = [s for s in seqs if not s.history]
            if fresh and all(s.max_new == 0 for s in fresh) and score_from is None:
                for s in fresh:  # nothing to compute: the (echoed) prompt alone
                    self._start(s, None)
                    self._finish(s, "length")
            elif fresh:
                self.waiting.append(Prefill(fresh, prompt, score_from))
            for s in seqs:
                if s.history:  # its emitted tokens need their logprobs again for `done`
                    from_ = 1 if echo_scores else len(prompt) if req.wants_logprobs else None
                    self.waiting.append(Prefill([s], prompt + s.history, from_))

    def _take_cancels(self, events) -> None:
        while self._cancels:
            job_id = self._cancels.popleft()
            if job_id in self.requests:
                self._drop(self.requests[job_id], RequestCancelled(job_id), events)

    def _drop(self, req: Request, err: EngineError, events) -> None:
        """End a request early (cancelled or failed): free its slots, tell the caller."""
        del self.requests[req.job.id]
        self.waiting = deque(u for u in self.waiting if u.seqs[0].request is not req)
        self.prefilling = [u for u in self.prefilling if u.seqs[0].request is not req]
        self.decoding = [s for s in self.decoding if s.request is not req]
        for s in req.seqs:
            self._release(s)
        if isinstance(err, RequestCancelled):
            events.append((req.job.id, "cancelled", {}))
        elif not isinstance(err, EngineFault):
            events.append((req.job.id, "error", err.body()))
        req.handle._end(error=err)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = None

    def _admit(self) -> None:
        """Waiting prefills take free slots in arrival order; one too big for what is free is split
        (its remaining copies wait for slots and a prefill of their own)."""
        while self.waiting and self.free_slots:
            unit = self.waiting[0]
            if len(unit.seqs) > len(self.free_slots):
                take = len(self.free_slots)
                unit.seqs, admitted = unit.seqs[take:], Prefill(unit.seqs[:take], unit.context, unit.score_from)
            else:
                admitted = self.waiting.popleft()
            for s in admitted.seqs:
                s.slot = heapq.heappop(self.free_slots)
                self.sampler.assign(s.slot, s.request.params, s.candidate, s.history)
            self.prefilling.append(admitted)

    def _run_batch(self) -> None:
        """Forward the running sequences and a chunk of prefill, sample, and take the results."""
        rows: list[Sequence] = []  # sequences drawing a token this step, and their logits
        logits: list[torch.Tensor] = []
        if self.decoding:
            # rows in ascending slots read the KV cache in place (CacheWindow); in any other order
            # every layer copies their keys and values first (measured: 18% of the throughput at 32)
            self.decoding.sort(key=lambda s: s.slot)
            rows += self.decoding
            logits.append(self._decode(self.decoding))
            self._batch_sizes[len(self.decoding)] += 1
        for unit, last in self._prefill_chunk():
            self.prefilling.remove(unit)
            self._share_cache(unit)
            for s in unit.seqs:
                self._start(s, unit)
                if s.finish_reason is None:
                    rows.append(s)
                    logits.append(last[None])
        self.decoding = []
        if not rows:
            return
        x = (logits[0] if len(logits) == 1 else torch.cat(logits))[:, :self.vocab_size]  # (B, V); nanoGPT pads V
        tokens = self.sampler.sample(x, [s.slot for s in rows])
        k = max((s.request.job.logprobs or 0) for s in rows)
        if any(s.request.needs_scores for s in rows):
            chosen, top_lp, top_ids = score(x, tokens, k)
            packed = torch.cat([tokens[:, None].double(), chosen[:, None].double(), top_lp.double(),
                                top_ids.double()], 1).tolist()  # the step's one sync
        else:
            packed = [[t, None] for t in tokens.tolist()]
        for s, row in zip(rows, packed):
            kk = s.request.job.logprobs or 0
            top = [(int(i), lp) for lp, i in zip(row[2:2 + kk], row[2 + k:2 + k + kk])]
            self._accept(s, int(row[0]), row[1], top)
            if s.finish_reason is None:
                self.decoding.append(s)
        self._stats["tokens_generated"] += len(rows)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits (B, V) of one step of the decoding sequences."""
        B = len(seqs)
        span = max(s.position for s in seqs) + 1
        if self.compiled:
            pad = self._bucket(B) - B  # padding rows: token 0 at position 0 of the spare slot
            return self._run_compiled([s.tokens[-1] for s in seqs] + [0] * pad, [s.slot for s in seqs] + [self.slots] * pad,
                                      [s.position for s in seqs] + [0] * pad, span)[:B]
        tokens, slots, start = torch.tensor([[s.tokens[-1] for s in seqs], [s.slot for s in seqs],
                                             [s.position for s in seqs]], device=self.device)
        return self._decode_forward(tokens[:, None], torch.ones_like(slots), slots, start, self.cache, span=span)

    def _run_compiled(self, tokens: list[int], slots: list[int], positions: list[int], span: int) -> torch.Tensor:
        rows = torch.tensor([tokens, slots, positions], device=self.device)
        keys = torch.arange(max(span, 2), device=self.device)  # the span is the graph's one dynamic size (never 1,
        torch._dynamo.mark_dynamic(keys, 0)                    # which would specialize; a longer span is masked)
        for row in rows:
            torch._dynamo.mark_static(row, 0)
        with torch.no_grad():
            return self._decode_compiled(rows[0], rows[1], rows[2], self.cache, keys)

    def _warm_up(self) -> None:
        """Compile the decode step for every batch bucket this engine can run, on padding rows only."""
        for bucket in BATCH_BUCKETS:
            if bucket > self._bucket(self.slots):
                break
            self._run_compiled([0] * bucket, [self.slots] * bucket, [0] * bucket, 2)

    @staticmethod
    def _bucket(B: int) -> int:
        last = BATCH_BUCKETS[-1]
        return next((b for b in BATCH_BUCKETS if b >= B), -(-B // last) * last)

    def _prefill_chunk(self) -> list[tuple[Prefill, torch.Tensor]]:
        """Feed up to `prefill_chunk` context tokens (prefills in arrival order); return the
        prefills completed, each with its last position's logits (V,)."""
        budget, plain, scored = self.prefill_chunk, [], []
        for unit in self.prefilling:
            if budget <= 0:
                break
            cap = SCORE_CHUNK if unit.score_from is not None else budget
            n = min(len(unit.context) - unit.fed, budget, cap)
            (plain if unit.score_from is None else scored).append((unit, n))
            budget -= n
        done = []
        for group, all_logits in ((plain, False), (scored, True)):
            if not group:
                continue
            T = max(n for _, n in group)
            tokens = torch.tensor([u.context[u.fed:u.fed + n] + [0] * (T - n) for u, n in group], device=self.device)
            meta = torch.tensor([[n for _, n in group], [u.seqs[0].slot for u, _ in group],
                                 [u.fed for u, _ in group]], device=self.device)
            out = self.model.forward_cached(tokens, meta[0], meta[1], meta[2], self.cache, all_logits=all_logits)
            for b, (unit, n) in enumerate(group):
                if all_logits:
                    self._score_context(unit, out[b, :n, :self.vocab_size])
                unit.fed += n
                self._stats["prompt_tokens"] += n
                if unit.fed == len(unit.context):
                    done.append((unit, out[b, n - 1] if all_logits else out[b]))
        return done

    def _score_context(self, unit: Prefill, logits: torch.Tensor) -> None:
        """Logprobs of the context tokens this chunk predicts: logits (n, V) of positions
        fed .. fed+n-1 score tokens fed+1 .. fed+n, those at or after score_from."""
        lo = max(unit.fed, unit.score_from - 1)
        hi = min(unit.fed + logits.shape[0], len(unit.context) - 1)
        if lo >= hi:
            return
        k = unit.seqs[0].request.job.logprobs
        targets = torch.tensor(unit.context[lo + 1:hi + 1], device=logits.device)
        chosen, top_lp, top_ids = score(logits[lo - unit.fed:hi - unit.fed], targets, k)
        for lp, tl, ti in zip(chosen.tolist(), top_lp.tolist(), top_ids.tolist()):
            unit.scores.append((lp, list(zip(ti, tl))))

    def _share_cache(self, unit: Prefill) -> None:
        """Copy the leader's prefilled keys/values to the other sequences of the prefill."""
        if len(unit.seqs) > 1:
            src, L = unit.seqs[0].slot, len(unit.context)
            dst = torch.tensor([s.slot for s in unit.seqs[1:]], device=self.device)
            for layer in self.cache.k + self.cache.v:
                layer[dst, :, :L] = layer[src, :, :L]

    # ---- host side: tokens to text and events ----

    def _start(self, seq: Sequence, unit: Prefill | None) -> None:
        """A sequence whose context is in its cache: queue its echo, replay a resumed history."""
        req = seq.request
        scores = unit.scores if unit is not None else []
        echo = self._echo_entries(req, seq.prompt_index, scores) if req.job.echo and req.wants_logprobs else []
        if seq.echo_pending:
            seq.out_text, seq.out_ids, seq.out_entries = req.prompt_texts[seq.prompt_index], list(seq.prompt), list(echo)
        if seq.history:
            replay = scores[len(scores) - len(seq.history):] if req.wants_logprobs else [(None, [])] * len(seq.history)
            for token, (lp, top) in zip(seq.history, replay):
                self._accept(seq, token, lp, top)
                if seq.finish_reason is not None:
                    break
            seq.out_text, seq.out_ids, seq.out_entries = "", [], []  # emitted before the crash
            seq.finish_sent = seq.finish_reason is not None
        elif seq.max_new == 0 and unit is not None:
            self._finish(seq, "length")

    def _echo_entries(self, req: Request, p: int, scores) -> list[TokenLogprob]:
        """The prompt's logprob entries (first token: None), computed once per prompt."""
        if p not in req.echo_entries:
            prompt, decoder, chars = req.job.prompts[p], self.tokenizer.incremental_decoder(), 0
            entries = []
            for i, token in enumerate(prompt):
                lp, top = scores[i - 1] if i else (None, None)
                entries.append(TokenLogprob(token, lp, top, chars))
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
        if token == self.eos_token_id:
            self._finish(seq, "stop")
            return
        piece = seq.decoder.push(token)
        seq.chars += len(piece)
        self._release_text(seq, seq.stops.push(piece))
        if seq.stops.stopped:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.max_new:
            self._finish(seq, "length")

    def _release_text(self, seq: Sequence, text: str) -> None:
        seq.text += text
        seq.out_text += text

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.stops.stopped:  # EOS or length: what the decoder and the matcher hold is text
            self._release_text(seq, seq.stops.push(seq.decoder.flush()))
            if seq.stops.stopped:
                reason = "stop"
            else:
                self._release_text(seq, seq.stops.flush())
        seq.finish_reason = reason
        self._release(seq)

    def _collect_events(self, events) -> None:
        """This step's deltas and finishes, and the ends of finished requests."""
        for req in list(self.requests.values()):
            if req.streams:
                for s in req.seqs:
                    self._stream_events(s, events)
            if all(s.finish_reason is not None for s in req.seqs):
                self._complete(req, events)

    def _stream_events(self, seq: Sequence, events) -> None:
        job_id = seq.request.job.id
        if seq.out_ids or seq.out_text:
            frag = fragment(seq.out_entries, self.tokenizer.token_string) if seq.request.wants_logprobs else None
            events.append((job_id, "delta", {"index": seq.candidate, "text": seq.out_text,
                                             "token_ids": seq.out_ids, "logprobs": frag}))
            seq.out_text, seq.out_ids, seq.out_entries = "", [], []
        if seq.finish_reason is not None and not seq.finish_sent:
            events.append((job_id, "finish", {"index": seq.candidate, "finish_reason": seq.finish_reason}))
            seq.finish_sent = True

    def _complete(self, req: Request, events) -> None:
        job = req.job
        choices = []
        for p in range(len(job.prompts)):
            candidates = req.seqs[p * req.best_of:(p + 1) * req.best_of]
            if not req.streams:  # best_of: the n with the highest mean token logprob
                candidates = sorted(candidates, key=lambda s: -s.mean_logprob())[:req.n]
            for j, s in enumerate(candidates):
                echo = req.echo_entries.get(p, []) if job.echo else []
                choice = {"index": p * req.n + j,
                          "text": (req.prompt_texts[p] if job.echo else "") + s.text,
                          "logprobs": fragment(echo + s.entries, self.tokenizer.token_string)
                          if req.wants_logprobs else None,
                          "finish_reason": s.finish_reason}
                choices.append(choice)
                if not req.streams:
                    ids = (list(s.prompt) if job.echo else []) + s.tokens
                    events.append((job.id, "delta", {**choice, "token_ids": ids}))
                    events.append((job.id, "finish", {"index": choice["index"], "finish_reason": s.finish_reason}))
        prompt_tokens = sum(len(p) for p in job.prompts)
        completion_tokens = sum(len(s.tokens) for s in req.seqs)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        completion = protocol.completion_object(job, choices, usage)
        events.append((job.id, "usage", usage))
        events.append((job.id, "done", {"completion": completion}))
        del self.requests[job.id]
        req.handle._end(result=completion)
