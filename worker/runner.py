"""The model side of a step: the forward passes over the KV cache and the drawing of tokens.

A step runs one forward for its decoding sequences (T = 1) and its plain prefill chunks together,
their tokens packed into one row so that the weights are read once for both; prefills that score
their context (echo with logprobs, or a resumed job's logprobs) run in a forward of their own, which
keeps every position's logits. Where nothing prefills, or the decode carries contrastive candidates,
the decode runs alone: compiled, when the engine compiles it, and on a GPU replayed from CUDA
graphs (nanogpt/cuda_graphs.py), the batch padded to a bucket size in both (on a CPU, batches from
the attention kernel's rows up run unpadded through the graph whose rows vary). A step that feeds
prompt chunks beside decoding rows runs them through the compiled graph too where the project's
attention kernel serves the cache (each prompt token a row of the decode step, `_run_mixed`),
else the packed forward eagerly. A completed
prefill's keys and values are copied from its leader's slot to those of the prompt's other copies
(`n`/`best_of` share one prefill). Every row that has logits then draws its token (sampling.py)
and is scored (logprobs.py), and all of it comes to the host in one `.tolist()`: the step's one
sync. Contrastive searches (contrastive.py) put their candidates in the decode forward, which then
also returns last hidden states (eagerly: the compiled decode has no hidden-state output), and
choose among them after it, with a sync of their own.

The model is used through its serving contract only: `config`, `device`, `dtype`, `forward_packed`
(decode and prefill together), `forward_cached` (either alone) and `forward_decode` (the padded decode).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

import torch

from nanogpt import decode_attention
from nanogpt.compile import compile_decode
from nanogpt.cuda_graphs import GraphedDecode
from nanogpt.kv_cache import KVCache, model_cache_dtype
from nanogpt.kernels import pack_linears
from worker import contrastive
from worker.beams import BeamGroup, advance
from worker.logprobs import score
from worker.sampling import Sampler
from worker.scheduler import Prefill, Sequence

log = logging.getLogger(__name__)

# compiled decode pads its batch to one of these sizes (then to multiples of the last), bounding
# recompilation to one graph per bucket
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The attention work (sum over a step's chunks of tokens x positions reached) up to which the
# compiled mixed step runs a step's prompt chunks: the kernel attends each prompt token on its own,
# rereading its slot's keys, where SDPA's blocks share them, so long chunks far into a context
# attend faster eagerly. int8 on the AVX2 EPYC, 4 decoding rows beside one chunk: compiled
# against eager 152 vs 189 ms at 128 tokens from position 0, 202 vs 235 from 300, 249 vs 240
# from 700; 256 tokens: 316 vs 345 from 0, 377 vs 375 from 300 (docs/notes/decode-routes.md#mixed).
MIXED_ATTENTION = 1 << 16
# The most rows a decode runs unpadded through the graph whose rows vary with inductor's attention
# (below the kernel's decode_attention.ROWS); more go padded to the kernel's. int8 GPT-2 small on
# the AVX2 EPYC, rows at position 230: 3 rows 11.7 ms unpadded against 13.8 padded to 4; 5 / 6 / 7
# rows 16.3 / 16.2 / 17.5 ms unpadded against 14.9 / 15.4 / 16.7 padded to 8 (docs/notes/decode-routes.md#small-rows).
SMALL_ROWS = 4


class Draw(NamedTuple):
    """A row's drawn token, its logprob (None when no row of the step needed scores) and the top
    logprobs its request asked for [(id, logprob)]."""
    token: int
    logprob: float | None
    top: list[tuple[int, float]]


class Runner:
    def __init__(self, model, vocab_size: int, *, max_batch: int, max_len: int, kv_memory_bytes: int | None = None,
                 compile: bool = False, prepack: bool = True, cuda_graphs: bool = True):
        """The KV cache holds `max_batch` slots of `max_len` positions, fewer if `kv_memory_bytes`
        cannot hold that many (`slots`). See Engine for `compile`, `prepack` and `cuda_graphs`."""
        self.model, self.vocab_size, self.device = model, vocab_size, model.device
        config, dtype = model.config, model_cache_dtype(model)
        slots = max_batch
        if kv_memory_bytes is not None:
            slots = min(slots, kv_memory_bytes // (KVCache.bytes_per_token(config, dtype) * max_len))
        if slots < 1:
            raise ValueError(f"KV-cache budget of {kv_memory_bytes} bytes holds no slot of {max_len} positions")
        self.slots = slots
        graphed = cuda_graphs and self.device.type == "cuda"
        self.padded = compile or graphed  # the decode batch padded to a bucket
        # when padded, one more slot than sequences: padding rows write their garbage there; and one
        # more position than they reach: no span is then the whole cache, whose slice would
        # specialize the compiled graph (a second compile of every bucket, for the last span)
        self.cache = KVCache(config, slots + self.padded, max_len + self.padded, self.device, dtype)
        self.sampler = Sampler(slots, vocab_size, self.device)
        self.prompt_tokens = self.tokens_generated = 0
        self.batch_sizes = Counter()  # decode forwards by batch size
        if prepack and self.device.type == "cpu":
            pack_linears(model)
        if self.device.type == "cuda":
            # cuDNN's attention (SDPA's first choice for bf16 / fp16 on a GPU) builds a plan for every
            # new shape, milliseconds of host time, and the eager steps' spans change every step
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.compiled, self.graphs = compile, None
        # steps that feed prompt tokens beside decoding rows run the compiled graph too where the
        # project's attention kernel serves the cache (on a CPU): its per-row attention is what
        # lets a chunk's tokens be rows of the decode step (`_run_mixed`)
        self.mixed = compile and self.cache.own_attention
        self._decode_step = model.forward_decode
        if compile:
            self._decode_step = compile_decode(model)
            for i in range(len(self.cache.k)):  # one graph serves every engine's slot count
                torch._dynamo.mark_dynamic(self.cache.k[i], 0)
                torch._dynamo.mark_dynamic(self.cache.v[i], 0)
            try:
                self._warm_up()
            except Exception:  # e.g. no C++ compiler for inductor's CPU kernels: serve uncompiled
                log.exception("compiling the decode step failed; the engine runs it uncompiled")
                self.compiled, self.mixed, self._decode_step = False, False, model.forward_decode
        if graphed:
            self._record_graphs(max_len)

    def stats(self) -> dict:
        return {"tokens_generated": self.tokens_generated, "prompt_tokens": self.prompt_tokens,
                "batch_size_counts": dict(self.batch_sizes)}

    def admit(self, seqs: list[Sequence]) -> None:
        """Sampling state for sequences given a slot: their request's parameters, and the tokens a
        resumed one already drew (penalties, draw counter)."""
        for s in seqs:
            self.sampler.assign(s.slot, s.request.params, s.candidate, s.history, s.prompt)
            if s.request.contrastive:
                s.search = contrastive.Search(s.request.job.penalty_alpha, [s.slot, *s.scratch],
                                              len(s.prompt) + s.max_new)

    def forward(self, rows: list[Sequence], searching: list[Sequence],
                chunks: list[tuple[Prefill, int]]) -> tuple[torch.Tensor | None, list[tuple[Prefill, torch.Tensor]]]:
        """This step's forwards: the logits (B, V) of the decoding `rows` (None when nothing decodes;
        the `searching` sequences' contrastive candidates go with them, see `contrast`), and the
        prefills the chunks completed (see `prefill`). The decoding rows and the plain prefill
        chunks share one forward where they can (nanogpt's `forward_packed`): its weight matmuls
        read the weights once for both, so a prompt prefilling beside running sequences costs
        them its own rows' work, not a second pass over the weights (measured under a serving load:
        better than a compiled decode beside a prefill forward of its own, docs/notes/compiled-decode.md)."""
        plain = [(unit, n) for unit, n in chunks if unit.score_from is None and unit.seqs[0].search is None]
        if not rows or searching or not plain:
            return (self.decode(rows, searching) if rows or searching else None), self.prefill(chunks)
        self.batch_sizes[len(rows)] += 1
        if self._mixes(plain):
            logits = self._run_mixed(rows, plain)
            decoded, last = logits[:len(rows)], logits[len(rows):]
        else:
            decoded, last = self.model.forward_packed([self._decode_batch(rows), self._prefill_batch(plain)], self.cache)
        done = self._fed(plain, last, all_logits=False)
        return decoded, self._completed(done + self._prefill_groups([c for c in chunks if c not in plain]))

    def decode(self, seqs: list[Sequence], searching: list[Sequence] = ()) -> torch.Tensor:
        """Logits (B, V) of one step of the decoding sequences; the candidates of the `searching`
        sequences' contrastive searches go through the same forward (see `contrast`)."""
        if searching:
            return self._decode_with_candidates(seqs, searching)
        self.batch_sizes[len(seqs)] += 1
        B = len(seqs)
        if self._rows_vary(B):
            return self._run_mixed(seqs, [])
        span = max(s.position for s in seqs) + 1
        if self.padded:
            pad = self._bucket(B) - B  # padding rows: token 0 at position 0 of the spare slot
            return self._run_padded([s.tokens[-1] for s in seqs] + [0] * pad, [s.slot for s in seqs] + [self.slots] * pad,
                                      [s.position for s in seqs] + [0] * pad, span)[:B]
        return self.model.forward_cached(*self._decode_batch(seqs)[:4], self.cache, span=span)

    def prefill(self, chunks: list[tuple[Prefill, int]]) -> list[tuple[Prefill, torch.Tensor]]:
        """Feed each prefill its next n context tokens; return the prefills completed, each with its
        last position's logits (V,) and its keys/values copied to its other sequences' slots. A
        contrastive search remembers the hidden states of its context and starts from those logits."""
        return self._completed(self._prefill_groups(chunks))

    def _prefill_groups(self, chunks: list[tuple[Prefill, int]]) -> list[tuple[Prefill, torch.Tensor]]:
        """The chunks' forwards, plain prefills in one, those scoring their context in another."""
        done = []
        for all_logits in (False, True):
            group = [(unit, n) for unit, n in chunks if (unit.score_from is not None) == all_logits]
            if not group:
                continue
            tokens, lengths, slots, start, span = self._prefill_batch(group)
            searches = [u.seqs[0].search for u, _ in group]
            wants_hidden = any(search is not None for search in searches)
            out = self.model.forward_cached(tokens, lengths, slots, start, self.cache, all_logits=all_logits,
                                            span=span, hidden=wants_hidden)
            out, hidden = out if wants_hidden else (out, None)
            for b, search in enumerate(searches):
                if search is not None:
                    search.remember(hidden[b, :group[b][1]])
            done += self._fed(group, out, all_logits)
        return done

    def _decode_batch(self, seqs: list[Sequence]) -> tuple:
        """The decoding sequences as forward_cached's (tokens (B, 1), lengths, slots, start_pos, span)."""
        tokens, slots, start = torch.tensor([[s.tokens[-1] for s in seqs], [s.slot for s in seqs],
                                             [s.position for s in seqs]], device=self.device)
        return tokens[:, None], torch.ones_like(slots), slots, start, max(s.position for s in seqs) + 1

    def _prefill_batch(self, group: list[tuple[Prefill, int]]) -> tuple:
        """The prefills' next chunks as forward_cached's (tokens (B, T), lengths, slots, start_pos, span)."""
        T = max(n for _, n in group)
        tokens = torch.tensor([u.context[u.fed:u.fed + n] + [0] * (T - n) for u, n in group], device=self.device)
        lengths, slots, start = torch.tensor([[n for _, n in group], [u.seqs[0].slot for u, _ in group],
                                              [u.fed for u, _ in group]], device=self.device)
        return tokens, lengths, slots, start, max(u.fed + n for u, n in group)

    def _fed(self, group: list[tuple[Prefill, int]], out: torch.Tensor, all_logits: bool) -> list[tuple[Prefill, torch.Tensor]]:
        """Take in a group's forward: its logits (B, V), or (B, T, V) with all_logits (scored);
        return the prefills it completed with their last position's logits."""
        done = []
        for b, (unit, n) in enumerate(group):
            if all_logits:
                self._score_context(unit, out[b, :n, :self.vocab_size])
            unit.fed += n
            self.prompt_tokens += n
            if unit.fed == len(unit.context):
                done.append((unit, out[b, n - 1] if all_logits else out[b]))
        return done

    def _completed(self, done: list[tuple[Prefill, torch.Tensor]]) -> list[tuple[Prefill, torch.Tensor]]:
        for unit, last in done:
            self._share_cache(unit)
            if unit.seqs[0].search is not None:
                unit.seqs[0].search.logits = last[:self.vocab_size]
        return done

    def sample(self, rows: list[Sequence], logits: list[torch.Tensor]) -> list[Draw]:
        """Draw a token for every row from its logits (pieces of (B, V), in row order) and score it
        as its request asks; one host sync for all of it."""
        if not rows:
            return []
        x = (logits[0] if len(logits) == 1 else torch.cat(logits))[:, :self.vocab_size]  # (B, V); nanoGPT pads V
        scored = any(s.request.needs_scores for s in rows)  # else the raw logits are read no more
        tokens = self.sampler.sample(x, [s.slot for s in rows], [s.tokens for s in rows], in_place=not scored)
        return self._draws(rows, x, tokens)

    def contrast(self, seqs: list[Sequence]) -> list[Draw]:
        """The token each contrastive search chooses among the candidates of this step's decode,
        scored as a greedy row's would be (the model's logprobs of the distribution it was chosen from)."""
        if not seqs:
            return []
        searches = [s.search for s in seqs]
        x = torch.stack([s.logits for s in searches])  # the distributions the candidates came from
        tokens = contrastive.choose(searches, self.cache)
        self.sampler.advance([s.slot for s in seqs], tokens)
        return self._draws(seqs, x, tokens)

    def _draws(self, rows: list[Sequence], x: torch.Tensor, tokens: torch.Tensor) -> list[Draw]:
        """The rows' tokens (B,) drawn from logits x (B, V), with the logprobs their requests ask for."""
        self.tokens_generated += len(rows)
        if not any(s.request.needs_scores for s in rows):
            return [Draw(t, None, []) for t in tokens.tolist()]
        k = max((s.request.job.logprobs or 0) for s in rows)
        chosen, top_lp, top_ids = score(x, tokens, k)
        packed = torch.cat([tokens[:, None].double(), chosen[:, None].double(), top_lp.double(),
                            top_ids.double()], 1).tolist()  # the step's one sync
        draws = []
        for s, row in zip(rows, packed):
            kk = s.request.job.logprobs or 0
            draws.append(Draw(int(row[0]), row[1], [(int(i), lp) for lp, i in zip(row[2:2 + kk], row[2 + k:2 + k + kk])]))
        return draws

    def step_beams(self, groups: list[tuple[BeamGroup, torch.Tensor]], tokenizer) -> None:
        """One beam-search step for each group, from the logits (R, V) of its running beams."""
        for group, logits in groups:
            self.tokens_generated += len(group.rows)
            advance(group, logits[:, :self.vocab_size], self.cache, self.sampler, tokenizer)

    def _decode_with_candidates(self, seqs: list[Sequence], searching: list[Sequence]) -> torch.Tensor:
        """One eager forward of the decoding sequences and the searches' candidates, rows in slot
        order (the cache is then read in place); the searches keep their candidates' outputs."""
        searches = [s.search for s in searching]
        candidates = contrastive.propose(searches, searching, self.sampler)
        cand_slots, cand_positions = contrastive.rows(searches)
        slots = [s.slot for s in seqs] + cand_slots
        positions = [s.position for s in seqs] + cand_positions
        self.batch_sizes[len(slots)] += 1
        tokens = torch.cat([torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long, device=self.device), candidates])
        order = sorted(range(len(slots)), key=slots.__getitem__)
        meta = torch.tensor([[slots[r] for r in order], [positions[r] for r in order], order], device=self.device)
        logits, hidden = self.model.forward_cached(tokens[meta[2], None], torch.ones_like(meta[0]), meta[0], meta[1],
                                                   self.cache, span=max(positions) + 1, hidden=True)
        back = torch.empty_like(meta[2])
        back[meta[2]] = torch.arange(len(order), device=self.device)  # each row's place in the sorted batch
        logits, hidden = logits[back], hidden[back, 0]
        B = len(seqs)
        contrastive.take(searches, logits[B:, :self.vocab_size], hidden[B:])
        return logits[:B]

    # ---- the padded decode: compiled, or replayed from CUDA graphs, or both ----

    def _run_padded(self, tokens: list[int], slots: list[int], positions: list[int], span: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(torch.tensor([tokens, slots, positions]), span)
        rows = torch.tensor([tokens, slots, positions], device=self.device)
        with torch.no_grad():
            return self._decode(rows[0], rows[1], rows[2], self.cache, torch.arange(max(span, 2), device=self.device))

    def _decode(self, tokens, slots, positions, cache, keys, out=None) -> torch.Tensor:
        """The decode step, compiled or not; the span (keys) is the compiled graph's one dynamic
        size (never 1, which would specialize; a longer span is masked). Marked `maybe`: a size
        that specializes anyway compiles a graph of its own rather than failing the step (the
        cache's spare position keeps the span from ever being the whole cache, which did). With
        `out` (`_run_mixed`) the rows and `out` are dynamic too: one graph for every step that
        feeds prompt tokens beside decoding rows and every decode of more than SMALL_ROWS rows,
        one for the decodes of two rows up to those."""
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(keys, 0)
            for row in (tokens, slots, positions):
                (torch._dynamo.mark_static if out is None else torch._dynamo.maybe_mark_dynamic)(row, 0)
            if out is not None:
                torch._dynamo.maybe_mark_dynamic(out, 0)
        return self._decode_step(tokens, slots, positions, cache, keys, out)

    # ---- the graph whose rows vary: decoding rows, and prompt tokens as rows beside them ----

    def _mixes(self, chunks: list[tuple[Prefill, int]]) -> bool:
        """Whether these chunks go beside the decoding rows through the compiled decode graph
        (`_run_mixed`) rather than the eager packed forward: where the project's attention kernel
        serves the cache, and while the chunks' attention work stays small enough for it."""
        return self.mixed and sum(n * (unit.fed + n) for unit, n in chunks) <= MIXED_ATTENTION

    def _run_mixed(self, rows: list[Sequence], chunks: list[tuple[Prefill, int]]) -> torch.Tensor:
        """One compiled forward of the decoding rows and the chunks' prompt tokens (with no
        chunks: a decode, `_rows_vary`), each token a row of the decode step at its own (slot,
        position): every row writes its keys and values before any attends, so a chunk's tokens
        see each other causally. Returns the logits of the decoding rows, then of each chunk's last
        token ((len(rows) + len(chunks), V))."""
        tokens = [s.tokens[-1] for s in rows] + [t for unit, n in chunks for t in unit.context[unit.fed:unit.fed + n]]
        slots = [s.slot for s in rows] + [unit.seqs[0].slot for unit, n in chunks for _ in range(n)]
        positions = [s.position for s in rows] + [p for unit, n in chunks for p in range(unit.fed, unit.fed + n)]
        ends = len(rows) - 1 + torch.tensor([n for _, n in chunks], dtype=torch.long).cumsum(0)  # each chunk's last token
        out = torch.cat([torch.arange(len(rows)), ends])
        span = max(positions) + 1
        # prompt tokens need the kernel's attention, and so as many rows as it takes: one graph for
        # every such step. A decode of up to half those rows runs the graph of inductor's attention
        # unpadded; from there, padded to the kernel's rows was the faster (docs/notes/decode-routes.md)
        pad = max(0, decode_attention.ROWS - len(tokens)) if chunks or len(tokens) > SMALL_ROWS else 0
        rows_ = torch.tensor([tokens + [0] * pad, slots + [self.slots] * pad, positions + [0] * pad], device=self.device)
        keys = torch.arange(max(span, 2), device=self.device)
        return self._decode(rows_[0], rows_[1], rows_[2], self.cache, keys, out.to(self.device))

    def _warm_up(self) -> None:
        """Compile the decode step for every batch bucket this engine can run whose rows are fixed,
        and the graphs whose rows vary (the kernel's ROWS up, and below), on padding rows only."""
        for bucket in self._buckets():
            if not self._rows_vary(bucket):
                self._run_padded([0] * bucket, [self.slots] * bucket, [0] * bucket, 2)
        if self.mixed:
            # (rows, outputs): a step with prompt tokens, whose outputs are fewer than its rows; a
            # decode of SMALL_ROWS or fewer, one output a row. The sizes that the graph's calls
            # differ in differ here too, else the graph would take them as one size
            for n, outputs in ((decode_attention.ROWS, 2), (SMALL_ROWS, SMALL_ROWS)):
                rows = torch.tensor([[0] * n, [self.slots] * n, [0] * n], device=self.device)
                with torch.no_grad():  # as the engine steps: grad mode is part of the graph's guards
                    self._decode(rows[0], rows[1], rows[2], self.cache, torch.arange(2, device=self.device),
                                 torch.arange(outputs, device=self.device))

    def _record_graphs(self, max_len: int) -> None:
        """The decode step's CUDA graphs, every batch and span bucket, recorded before serving:
        where recording fails, the engine serves without them."""
        graphs = GraphedDecode(self._decode, self.cache, spare_slot=self.slots, max_batch=self._bucket(self.slots),
                               max_span=max_len, vocab=self.model.config.vocab_size)
        try:
            graphs.record(self._buckets())
        except Exception:
            log.exception("recording the decode step's CUDA graphs failed; the engine launches its kernels one by one")
            return
        self.graphs = graphs

    def _rows_vary(self, B: int) -> bool:
        """Whether a decode of B rows runs a graph whose rows vary (`_run_mixed`, no chunks) rather
        than a padded bucket's: where the engine mixes, from two rows up; up to SMALL_ROWS the
        graph of inductor's attention, above them the kernel's (padded to its ROWS). At a bucket's
        size the graphs cost the same; between buckets the rows' own cost is paid, not the next
        bucket's (docs/notes/decode-routes.md). One row keeps its fixed graph."""
        return self.mixed and B >= 2

    def _buckets(self) -> list[int]:
        """The batch buckets up to this engine's slots."""
        return [b for b in BATCH_BUCKETS if b <= self._bucket(self.slots)]

    @staticmethod
    def _bucket(B: int) -> int:
        last = BATCH_BUCKETS[-1]
        return next((b for b in BATCH_BUCKETS if b >= B), -(-B // last) * last)

    # ---- prefill helpers ----

    def _score_context(self, unit: Prefill, logits: torch.Tensor) -> None:
        """Logprobs of the context tokens this chunk predicts: logits (n, V) of positions
        fed .. fed+n-1 score tokens fed+1 .. fed+n, those at or after score_from."""
        lo = max(unit.fed, unit.score_from - 1)
        hi = min(unit.fed + logits.shape[0], len(unit.context) - 1)
        if lo >= hi:
            return
        job = unit.seqs[0].request.job
        k = max(job.logprobs or 0, job.prompt_logprobs or 0)
        targets = torch.tensor(unit.context[lo + 1:hi + 1], device=logits.device)
        rows = logits[lo - unit.fed:hi - unit.fed]
        chosen, top_lp, top_ids = score(rows, targets, k)
        if job.prompt_logprobs is not None:  # vLLM's rank: 1 + the tokens more likely than it
            unit.ranks += (rows.float() > rows.float().gather(-1, targets[:, None])).sum(-1).add(1).tolist()
        for lp, tl, ti in zip(chosen.tolist(), top_lp.tolist(), top_ids.tolist()):
            unit.scores.append((lp, list(zip(ti, tl))))

    def _share_cache(self, unit: Prefill) -> None:
        """Copy the leader's prefilled keys/values to the other sequences of the prefill (and to the
        scratch slots of a contrastive search)."""
        others = [s.slot for s in unit.seqs[1:]] + [slot for s in unit.seqs for slot in s.scratch]
        if others:
            src, L = unit.seqs[0].slot, len(unit.context)
            dst = torch.tensor(others, device=self.device)
            for layer in self.cache.k + self.cache.v:
                layer[dst, :, :L] = layer[src, :, :L]
