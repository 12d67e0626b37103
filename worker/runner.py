"""The model side of a step: the forward passes over the KV cache and the drawing of tokens.

A step's decoding rows run one forward, whose route (decode_routes.py) is eager, packed with the
step's plain prompt chunks (their tokens beside the decoding rows, the weights read once for both),
or a compiled graph, on a GPU replayed from CUDA graphs, which there also take a step's plain
prompt chunks as rows, with decoding rows or without. The chunks that do not ride along run
eager prefill forwards of their own: plain chunks in one, chunks that score their context (echo
with logprobs, or a resumed job's logprobs) in another, which keeps every position's logits. A
completed prefill's keys and values are copied from its leader's slot to those of the prompt's
other copies (`n`/`best_of` share one prefill). Every row that has logits then draws its token
(sampling.py) and is scored (logprobs.py) on the device, and all of it comes to the host in one
queued copy (`Drawn`), which the engine waits for once it has launched the next step where it runs
ahead (engine.py). The next step then feeds each sequence its slot's last draw from the device
(`last`). Contrastive searches (contrastive.py) put their candidates in the decode forward, which
then also returns last hidden states, and choose among them after it, with a sync of their own;
beam search (beams.py) advances a prompt's beams from their rows' logits.

The model is used through its serving contract only: `config`, `device`, `dtype`, `forward_packed`
(decode and prefill together), `forward_cached` (either alone), `forward_decode` (the compiled decode)
and, on a GPU, `align_head`.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from typing import NamedTuple

import torch

from nanogpt.kernels.epilogue import fuse_epilogues
from nanogpt.kernels.few_rows import fuse_few_rows, fuse_norm_linears
from nanogpt.kernels.norms import fuse_layer_norms
from nanogpt.kernels.planner import pack_linears
from nanogpt.layers import norm_project
from nanogpt.runtime.cuda_graphs import replay_seconds
from nanogpt.runtime.kv_cache import KVCache, default_slots
from nanogpt.runtime.precision import model_cache_dtype
from nanogpt.runtime.transfer import ToHost, to_device
from worker import contrastive
from worker.prefix_cache import MAX_TOP
from worker.beams import BeamGroup, advance
from worker.decode_routes import DecodeRoutes, Graph, Route, bucket, chunk_rows
from worker.logprobs import score
from worker.sampling import GraphDraws, Sampler, draw_keys
from worker.scheduler import Prefill, Sequence

log = logging.getLogger(__name__)


class Draw(NamedTuple):
    """A row's drawn token, its logprob (None when no row of the step needed scores) and the top
    logprobs its request asked for [(id, logprob)]."""
    token: int
    logprob: float | None
    top: list[tuple[int, float]]


class Drawn:
    """The tokens a step drew for `rows`, with their scores, on their way to the host in one copy:
    `draws()` waits for that copy alone, so the engine may launch its next step first."""

    def __init__(self, rows: list[Sequence], packed: torch.Tensor, k: int | None):
        """packed (B, 1) tokens, or with scores (k: the most top logprobs a row asked for) (B, 2 + 2k):
        token, its logprob, the top logprobs, their ids."""
        self.rows, self._k, self._host = rows, k, ToHost(packed)

    def draws(self) -> list[Draw]:
        values, k = self._host.tolist(), self._k
        if k is None:
            return [Draw(int(row[0]), None, []) for row in values]
        draws = []
        for s, row in zip(self.rows, values):
            kk = s.request.job.logprobs or 0
            draws.append(Draw(int(row[0]), row[1], [(int(i), lp) for lp, i in zip(row[2:2 + kk], row[2 + k:2 + k + kk])]))
        return draws


class Runner:
    def __init__(self, model, vocab_size: int, *, max_batch: int | None, max_len: int, kv_memory_bytes: int | None = None,
                 compile: bool = False, compile_in_background: bool = False, prepack: bool = True,
                 cuda_graphs: bool | None = None, fused_kernels: bool = True, grammars=None):
        """The KV cache holds `max_batch` slots of `max_len` positions (None: by the device,
        kv_cache.default_slots), fewer if `kv_memory_bytes` cannot hold that many (`slots`). See
        Engine for `compile`, `compile_in_background`, `prepack`, `cuda_graphs` and `fused_kernels`."""
        self.model, self.vocab_size, self.device = model, vocab_size, model.device
        config, dtype = model.config, model_cache_dtype(model)
        slots = default_slots(config, dtype, max_len, self.device) if max_batch is None else max_batch
        if kv_memory_bytes is not None:
            slots = min(slots, kv_memory_bytes // (KVCache.bytes_per_token(config, dtype) * max_len))
        if slots < 1:
            raise ValueError(f"KV-cache budget of {kv_memory_bytes} bytes holds no slot of {max_len} positions")
        self.slots = slots
        graphed = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        spare = DecodeRoutes.padded(compile, graphed)  # a slot for padding rows, a position past the context
        self.cache = KVCache(config, slots + spare, max_len + spare, self.device, dtype)
        self.sampler = Sampler(slots + spare, vocab_size, self.device, grammars)  # the spare: padding rows' draws
        # each slot's last drawn token, on the device: the next step's input before the host has it
        self.last = torch.zeros(slots + spare, dtype=torch.long, device=self.device)
        self._slots: tuple[list[int], torch.Tensor] | None = None  # the decoding rows' slots, host and device
        self._where: tuple[Route, list[int], list[int], torch.Tensor] | None = None  # the last decode's rows (`where`)
        self.prompt_tokens = self.tokens_generated = 0
        self.batch_sizes = Counter()  # decode forwards by batch size
        self.routes_taken = Counter()  # decode forwards by route (decode_routes.Graph)
        if prepack and self.device.type == "cpu":
            started = time.monotonic()
            pack_linears(model)  # times the kernels this CPU has for the model's matmuls
            log.info("matmul kernels chosen", extra={"seconds": round(time.monotonic() - started, 2)})
        if self.device.type == "cuda" and fused_kernels:
            fuse_gpu_kernels(model)
        if self.device.type == "cuda":
            # cuDNN's attention (SDPA's first choice for bf16 / fp16 on a GPU) builds a plan for every
            # new shape, milliseconds of host time, and the eager steps' spans change every step
            torch.backends.cuda.enable_cudnn_sdp(False)
        # what the graphs' draws read (their rows' bias, temperature, keys) and whose rows it holds
        self.draws = GraphDraws(bucket(slots), self.sampler) if graphed else None
        self._draws_for: tuple[list, list[int], int, list[int]] | None = None  # params, slots, rows, steps
        self.routes = DecodeRoutes(model, self.cache, slots, max_len, compile=compile, graphed=graphed,
                                   background=compile_in_background, last=self.last,
                                   draws=self.draws.kinds() if graphed else None)

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs compiled, or will once its graphs are live (False where
        compiling it failed)."""
        return self.routes.compiled

    @property
    def graphs(self):
        """The decode step's CUDA graphs (nanogpt/runtime/cuda_graphs.GraphedDecode), or None."""
        return self.routes.graphs

    def stats(self) -> dict:
        return {"tokens_generated": self.tokens_generated, "prompt_tokens": self.prompt_tokens,
                "batch_size_counts": dict(self.batch_sizes), "warming_up": int(self.routes.warming),
                "compiled_graphs_live": len(self.routes.live)}

    def admit(self, seqs: list[Sequence]) -> None:
        """Sampling state for sequences given a slot: their request's parameters, and the tokens a
        resumed one already drew (penalties, draw counter)."""
        for s in seqs:
            self.sampler.assign(s.slot, s.request.params, s.candidate, s.history, s.prompt)
            s.matcher = self.sampler.matchers[s.slot]
            if s.request.contrastive:
                s.search = contrastive.Search(s.request.job.penalty_alpha, [s.slot, *s.scratch],
                                              len(s.prompt) + s.max_new)

    def forward(self, rows: list[Sequence], searching: list[Sequence],
                chunks: list[tuple[Prefill, int]]) -> tuple[torch.Tensor | None, list[tuple[Prefill, torch.Tensor]]]:
        """This step's forwards: the logits (B, V) of the decoding `rows` (None when nothing decodes;
        the `searching` sequences' contrastive candidates go with them, see `contrast`), and the
        prefills the chunks completed, each with its last position's logits (V,) and its
        keys/values copied to its other sequences' slots. The plain chunks ride along with the
        decoding rows where their route takes them (PACKED, KERNEL, and where CUDA graphs take them
        BUCKET, which also takes them without decoding rows)."""
        plain = [(unit, n) for unit, n in chunks if unit.score_from is None and unit.seqs[0].search is None]
        if not rows and not searching:
            route = self.routes.route(0, [(unit.fed, n) for unit, n in plain]) if plain else None
            if route is None or route.graph is not Graph.BUCKET:
                return None, self._completed(self._prefill_groups(chunks))
            self.routes_taken[route.graph] += 1
            _, last = self._decode(route, [], [], plain)
            return None, self._completed(self._fed(plain, last, all_logits=False)
                                         + self._prefill_groups([c for c in chunks if c not in plain]))
        candidates = sum(s.search.k for s in searching)
        route = self.routes.route(len(rows), [(unit.fed, n) for unit, n in plain], candidates,
                                  max((s.position for s in rows), default=-1) + 1)
        self.batch_sizes[len(rows) + candidates] += 1
        self.routes_taken[route.graph] += 1
        riding = plain if route.graph in (Graph.PACKED, Graph.KERNEL, Graph.BUCKET) else []
        decoded, last = self._decode(route, rows, searching, riding)
        done = self._fed(riding, last, all_logits=False)
        return decoded, self._completed(done + self._prefill_groups([c for c in chunks if c not in riding]))

    def _decode(self, route: Route, rows: list[Sequence], searching: list[Sequence],
                riding: list[tuple[Prefill, int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of `route`: the logits of the decoding rows, and of each riding chunk's last
        token (None without chunks)."""
        if route.graph is Graph.CANDIDATES:
            return self._decode_with_candidates(rows, searching), None
        if route.graph is Graph.PACKED:
            decoded, last = self.model.forward_packed([self._decode_batch(rows), self._prefill_batch(riding)], self.cache)
            return decoded, last
        if route.graph is Graph.EAGER:
            tokens, lengths, slots, start, span = self._decode_batch(rows)
            return self.model.forward_cached(tokens, lengths, slots, start, self.cache, span=span), None
        # each row a token at its own (slot, position): the decoding rows', then the chunks' prompt tokens
        slots = [s.slot for s in rows] + [unit.seqs[0].slot for unit, n in riding for _ in range(n)]
        positions = [s.position for s in rows] + [p for unit, n in riding for p in range(unit.fed, unit.fed + n)]
        where = self.where(route, slots, positions) if not riding else self.routes.where(route, slots, positions)
        prompts = [t for unit, n in riding for t in unit.context[unit.fed:unit.fed + n]]
        tokens = to_device(prompts, self.device) if not rows else self._last_tokens(rows, where[0, :len(rows)])
        if riding and rows:
            tokens = torch.cat([tokens, to_device(prompts, self.device)])
        outputs = None if route.graph is Graph.BUCKET and not riding else chunk_rows(len(rows), [n for _, n in riding])
        logits = self.routes.run(route, tokens, where, max(positions) + 1, outputs)
        return (logits, None) if not riding else (logits[:len(rows)], logits[len(rows):])

    def _decode_with_candidates(self, seqs: list[Sequence], searching: list[Sequence]) -> torch.Tensor:
        """One eager forward of the decoding sequences and the searches' candidates, rows in slot
        order (the cache is then read in place); the searches keep their candidates' outputs."""
        searches = [s.search for s in searching]
        candidates = contrastive.propose(searches, searching, self.sampler)
        cand_slots, cand_positions = contrastive.rows(searches)
        slots = [s.slot for s in seqs] + cand_slots
        positions = [s.position for s in seqs] + cand_positions
        tokens = torch.cat([self._last_tokens(seqs), candidates])
        order = sorted(range(len(slots)), key=slots.__getitem__)
        meta = to_device([[slots[r] for r in order], [positions[r] for r in order], order], self.device)
        logits, hidden = self.model.forward_cached(tokens[meta[2], None], torch.ones_like(meta[0]), meta[0], meta[1],
                                                   self.cache, span=max(positions) + 1, hidden=True)
        back = torch.empty_like(meta[2])
        back[meta[2]] = torch.arange(len(order), device=self.device)  # each row's place in the sorted batch
        logits, hidden = logits[back], hidden[back, 0]
        B = len(seqs)
        contrastive.take(searches, logits[B:], hidden[B:])
        return logits[:B]

    def _prefill_groups(self, chunks: list[tuple[Prefill, int]]) -> list[tuple[Prefill, torch.Tensor]]:
        """The chunks' forwards, plain prefills in one, those scoring their context in another. A
        contrastive search remembers the hidden states of its context (and starts from its last
        logits, `_completed`). Plain chunks of different lengths are packed (forward_packed): their
        matmuls run over their real tokens, and their attention over chunks of like lengths
        (`_alike`), never one padded to more than twice its length."""
        done = []
        for all_logits in (False, True):
            group = [(unit, n) for unit, n in chunks if (unit.score_from is not None) == all_logits]
            if not group:
                continue
            searches = [u.seqs[0].search for u, _ in group]
            wants_hidden = any(search is not None for search in searches)
            if not all_logits and not wants_hidden and len({n for _, n in group}) > 1:
                parts = _alike(group)
                outs = self.model.forward_packed([self._prefill_batch(part) for part in parts], self.cache)
                done += [d for part, out in zip(parts, outs) for d in self._fed(part, out, all_logits)]
                continue
            tokens, lengths, slots, start, span = self._prefill_batch(group)
            out = self.model.forward_cached(tokens, lengths, slots, start, self.cache, all_logits=all_logits,
                                            span=span, hidden=wants_hidden)
            out, hidden = out if wants_hidden else (out, None)
            for b, search in enumerate(searches):
                if search is not None:
                    search.remember(hidden[b, :group[b][1]])
            done += self._fed(group, out, all_logits)
        return done

    def where(self, route: Route, slots: list[int], positions: list[int]) -> torch.Tensor:
        """The decoding rows' slots and positions on the device (DecodeRoutes.where): where the last
        decode ran the same route over the same slots a position earlier (a step's next forward, or
        the next step's while no sequence came or went), its tensor advanced in place on the device
        instead of a copy from the host."""
        last, self._where = self._where, None
        if last is not None and last[0] == route and last[1] == slots and \
                all(p == q + 1 for p, q in zip(positions, last[2])):
            where = last[3]
            where[1, :len(positions)] += 1
        else:
            where = self.routes.where(route, slots, positions)
        self._where = (route, slots, positions, where)
        return where

    def _decode_batch(self, seqs: list[Sequence]) -> tuple:
        """The decoding sequences as forward_cached's (tokens (B, 1), lengths, slots, start_pos, span)."""
        slots, start = self.where(Route(Graph.EAGER, len(seqs)), [s.slot for s in seqs], [s.position for s in seqs])
        return self._last_tokens(seqs, slots)[:, None], torch.ones_like(slots), slots, start, max(s.position for s in seqs) + 1

    def _last_tokens(self, seqs: list[Sequence], slots: torch.Tensor | None = None) -> torch.Tensor:
        """The sequences' last tokens (B,) on the device: from the host where it has them all, else
        from `last`, where a draw still on its way to the host already is. `slots`: the sequences'
        slots on the device, where the step has them, which its draws then index with too (`sample`)."""
        if slots is not None:
            self._slots = ([s.slot for s in seqs], slots)
        if any(s.pending for s in seqs):
            return self.last[slots if slots is not None else to_device([s.slot for s in seqs], self.device)]
        return to_device([s.tokens[-1] for s in seqs], self.device)

    def _prefill_batch(self, group: list[tuple[Prefill, int]]) -> tuple:
        """The prefills' next chunks as forward_cached's (tokens (B, T), lengths, slots, start_pos, span)."""
        T = max(n for _, n in group)
        tokens = to_device([u.context[u.fed:u.fed + n] + [0] * (T - n) for u, n in group], self.device)
        lengths, slots, start = to_device([[n for _, n in group], [u.seqs[0].slot for u, _ in group],
                                           [u.fed for u, _ in group]], self.device)
        return tokens, lengths, slots, start, max(u.fed + n for u, n in group)

    def _fed(self, group: list[tuple[Prefill, int]], out: torch.Tensor, all_logits: bool) -> list[tuple[Prefill, torch.Tensor]]:
        """Take in a group's forward: its logits (B, V), or (B, T, V) with all_logits (scored);
        return the prefills it completed with their last position's logits."""
        done = []
        for b, (unit, n) in enumerate(group):
            if all_logits:
                self._score_context(unit, out[b, :n])
            unit.fed += n
            self.prompt_tokens += n
            if unit.fed == len(unit.context):
                done.append((unit, out[b, n - 1] if all_logits else out[b]))
        return done

    def _completed(self, done: list[tuple[Prefill, torch.Tensor]]) -> list[tuple[Prefill, torch.Tensor]]:
        for unit, last in done:
            self._share_cache(unit)
            if unit.seqs[0].search is not None:
                unit.seqs[0].search.logits = last
        return done

    def sample(self, rows: list[Sequence], logits: list[torch.Tensor]) -> Drawn:
        """Draw a token for every row from its logits (pieces of (B, V), in row order) and score it
        as its request asks: on the device, each slot's token kept in `last`; to the host in one copy."""
        full = logits[0] if len(logits) == 1 else torch.cat(logits)  # (B, rows): every row of the head
        scored = any(s.request.needs_scores for s in rows)  # else the raw logits are read no more
        slots = [s.slot for s in rows]
        # the decoding rows' slots are on the device already, from the step's one copy of its rows
        idx = self._slots[1] if self._slots is not None and self._slots[0] == slots else to_device(slots, self.device)
        self._slots = None
        # drawn among the tokenizer's ids only (nanoGPT and GPT-J pad the head past them)
        tokens = self.sampler.sample(full[:, :self.vocab_size], slots, [s.tokens for s in rows], in_place=not scored,
                                     idx=idx)
        self.last[idx] = tokens
        return self._drawn(rows, full, tokens)

    def decode_in_graphs(self, rows: list[Sequence], forwards: int) -> list[Drawn] | None:
        """`forwards` decode forwards of `rows`, each drawing inside the decode's graphs
        (GraphedDecode.draw, sampling.GraphDraws) and fed the draws of the one before on the device:
        their draws, in order, none taken in. None where the rows cannot (no graphs, a batch past
        them, a row whose draw needs more than its logits, sampling settings, penalties and
        min_tokens: a grammar, multi-token bans). Logprobs are scored from the raw logits
        after each draw, as `sample` scores them."""
        graphs, route = self.routes.graphs, self.routes.route(len(rows))
        if graphs is None or route.graph is not Graph.BUCKET or not all(self._draws_in_graphs(s) for s in rows):
            return None
        params = [s.request.params for s in rows]
        slots = [s.slot for s in rows]
        steps = [self.sampler.step[s] for s in slots]
        kind = GraphDraws.kind(params, any(n < p.min_tokens for n, p in zip(steps, params)))
        if kind not in graphs.draw_kinds:  # recording the draws failed (DecodeRoutes._record_graphs)
            return None
        if kind != "greedy" and not self.sampler.hashed:
            return None  # the sampler's noise is another generator's: its draws would differ
        positions = [s.position for s in rows]
        where = self.where(route, slots, positions)
        tokens = self._last_tokens(rows, where[0, :len(rows)])
        self._slots = None  # the sampler draws none of these
        pad = route.rows - len(rows)
        graphs.load(torch.cat([tokens, tokens.new_zeros(pad)]) if pad else tokens, where)
        held = self._draws_for  # the rows' settings stay loaded while the rows and their draws are the same
        if held is None or held[2] != route.rows or held[1] != slots or held[3] != steps \
                or any(a is not b for a, b in zip(held[0], params)):
            self.draws.load(slots, route.rows)
        drawn = []
        for k in range(forwards):
            if kind != "greedy":  # each row's draw key of this step, as the sampler's (draw_keys)
                self.draws.keys[:len(rows)] = to_device(draw_keys(
                    [p.seed for p in params], [self.sampler.choice[s] for s in slots],
                    [self.sampler.step[s] + k for s in slots]), self.device)
            graphs.replay(route.rows, max(positions) + 1 + k)
            # scored from the raw logits before the next replay overwrites them (queued behind it)
            drawn.append(self._drawn(rows, graphs.logits[:len(rows)], graphs.draw(route.rows, kind)[:len(rows)].clone()))
        if forwards > 1:  # `where` as the rows now stand, for the next decode to advance (`where`)
            where[1, :len(rows)] += forwards - 1
            self._where = (route, slots, [p + forwards - 1 for p in positions], where)
        for slot in slots:
            self.sampler.step[slot] += forwards
        # a draw by the sampler in between leaves the steps otherwise: the next load counts from it
        self._draws_for = (params, slots, route.rows, [n + forwards for n in steps])
        self.batch_sizes[len(rows)] += forwards
        self.routes_taken[route.graph] += forwards
        return drawn

    def _draws_in_graphs(self, s: Sequence) -> bool:
        p = s.request.params
        return not p.sequence_bans and p.grammar is None

    def contrast(self, seqs: list[Sequence]) -> list[Draw]:
        """The token each contrastive search chooses among the candidates of this step's decode,
        scored as a greedy row's would be (the model's logprobs of the distribution it was chosen from)."""
        if not seqs:
            return []
        searches = [s.search for s in seqs]
        x = torch.stack([s.logits for s in searches])  # the distributions the candidates came from
        tokens = contrastive.choose(searches, self.cache)
        self.sampler.advance([s.slot for s in seqs], tokens)
        return self._drawn(seqs, x, tokens).draws()

    def _drawn(self, rows: list[Sequence], x: torch.Tensor, tokens: torch.Tensor) -> Drawn:
        """The rows' tokens (B,) drawn from logits x (B, rows), with the logprobs their requests ask for."""
        self.tokens_generated += len(rows)
        if not any(s.request.needs_scores for s in rows):
            return Drawn(rows, tokens[:, None], None)
        k = max((s.request.job.logprobs or 0) for s in rows)
        chosen, top_lp, top_ids = score(x, tokens, k, self.vocab_size)
        return Drawn(rows, torch.cat([tokens[:, None].double(), chosen[:, None].double(), top_lp.double(),
                                      top_ids.double()], 1), k)

    def step_beams(self, groups: list[tuple[BeamGroup, torch.Tensor]], tokenizer) -> None:
        """One beam-search step for each group, from the logits (R, V) of its running beams."""
        for group, logits in groups:
            self.tokens_generated += len(group.rows)
            advance(group, logits, self.cache, self.sampler, tokenizer)

    # ---- prefill helpers ----

    def _score_context(self, unit: Prefill, logits: torch.Tensor) -> None:
        """Logprobs of the context tokens this chunk predicts: logits (n, V) of positions
        fed .. fed+n-1 score tokens fed+1 .. fed+n, those at or after score_from."""
        lo = max(unit.fed, unit.score_from - 1)
        hi = min(unit.fed + logits.shape[0], len(unit.context) - 1)
        if lo >= hi:
            return
        job = unit.seqs[0].request.job
        k = MAX_TOP  # what any later request reusing this context may ask for (worker/prefix_cache.py)
        targets = to_device(unit.context[lo + 1:hi + 1], logits.device)
        rows = logits[lo - unit.fed:hi - unit.fed]
        chosen, top_lp, top_ids = score(rows, targets, k, self.vocab_size)
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
            dst = to_device(others, self.device)
            for layer in self.cache.k + self.cache.v:
                layer[dst, :, :L] = layer[src, :, :L]


def _alike(group: list[tuple[Prefill, int]]) -> list[list[tuple[Prefill, int]]]:
    """The chunks grouped by the power of two their length rounds up to, in their order within each
    group: a part's attention pads each of its chunks to less than twice its length."""
    parts: dict[int, list[tuple[Prefill, int]]] = {}
    for unit, n in group:
        parts.setdefault((n - 1).bit_length(), []).append((unit, n))
    return list(parts.values())


def fuse_gpu_kernels(model) -> dict:
    """What a GPU engine does to its model's layers before recording its graphs (nanogpt/kernels/,
    docs/notes/gpu-step.md), each said in the log: returns what each swap took and chose."""
    model.align_head()
    done = {"layer_norms": fuse_layer_norms(model), "epilogues": fuse_epilogues(model)}
    log.info("layer norms fused with the residual adds", extra={"layers": done["layer_norms"]})
    log.info("activations fused into the matmuls' epilogues", extra={"layers": done["epilogues"]})
    for name, fuse, what in (
            ("few_rows", fuse_few_rows, "few-row matmuls by the project's kernel where timed faster than cuBLAS"),
            ("norm_fed", lambda m, timer: fuse_norm_linears(m, timer, norm_project),
             "layer norms fed into the few-row matmuls after them where timed faster")):
        started = time.monotonic()
        done[name] = {"chosen": fuse(model, gpu_time), "seconds": round(time.monotonic() - started, 2)}
        log.info(what, extra=done[name])
    return done


def gpu_time(run) -> float:
    """Seconds of run() on the GPU: the median of five replays of a CUDA graph of it."""
    return statistics.median(replay_seconds(run, 5))
