"""Which forward a step's decoding rows take, and the compiled graphs behind them: a step's route
is read from one place, `DecodeRoutes.route(rows, chunks, candidates)`.

    eager engine                     EAGER: forward_cached, the rows as they are
                                     PACKED: with prompt chunks riding along, forward_packed
    compiled, or CUDA graphs         BUCKET: forward_decode, the batch padded to a bucket of
                                     BATCH_BUCKETS (a graph each; on a GPU replayed from CUDA
                                     graphs, one per bucket and span bucket: nanogpt/runtime/cuda_graphs.py);
                                     with CUDA graphs also with prompt chunks riding along, each
                                     prompt token a row, up to GRAPHED_ROWS rows and MIXED_ATTENTION
    compiled, the project's          SMALL: 2..SMALL_ROWS rows, unpadded, inductor's attention
    attention kernel on the cache    KERNEL: more rows, or any rows with prompt chunks riding along
    (a CPU: `mixed`)                 (each prompt token a row at its own slot and position), padded
                                     to the kernel's decode_attention.ROWS; one row stays BUCKET;
                                     chunks with more attention work than MIXED_ATTENTION go PACKED
    contrastive candidates           CANDIDATES: forward_cached with hidden states, always eager

Prompts that score their context, and prompts that no decoding row runs beside unless CUDA graphs
take them, are fed by the runner's eager prefill forwards, never here. Why each line:
docs/notes/decode-routes.md.

The compiled graphs are few (`planned`): one per bucket whose route is BUCKET, and where the
engine mixes, SMALL's and KERNEL's. Their one dynamic size is the span (the keys attended, never 1,
which would specialize); SMALL's and KERNEL's rows and outputs are dynamic too, BUCKET's rows fixed.
Padding rows are token 0 at position 0 of the spare slot (`slots`, one past the sequences'), which
the cache holds for them, with a spare position.

A route takes a compiled graph only once it is live: all of them before serving, or, compiled in
the background, each from the step after its compile finished; until then the step runs eager
(EAGER, PACKED), which gives the same tokens (docs/notes/background-compile.md). On a CPU a live
graph is then called without dynamo, as the code dynamo made for it (`_forward`,
nanogpt/runtime/compile.py DirectCall).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from itertools import accumulate
from typing import NamedTuple

import torch

from nanogpt.kernels import decode_attention
from nanogpt.runtime.compile import DirectCall, compile_decode
from nanogpt.runtime.cuda_graphs import GraphedDecode
from nanogpt.runtime.transfer import to_device

log = logging.getLogger(__name__)

# A BUCKET decode pads its batch to one of these sizes (then to multiples of the last): one graph each.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The most attention work (over a step's chunks: tokens x positions reached) that rides through
# KERNEL: the kernel attends each prompt token alone, so long chunks far into a context run faster
# eagerly (docs/notes/decode-routes.md#mixed).
MIXED_ATTENTION = 1 << 16
# The most rows of SMALL: below the kernel's rows inductor's attention is faster unpadded, up to
# about half of them (docs/notes/decode-routes.md#small-rows).
SMALL_ROWS = 4
# The most rows a step with prompt chunks replays from CUDA graphs (decoding rows and prompt
# tokens), and the longest span of the batches past the slots' that only prompts fill: an eager
# forward launches its few hundred kernels one by one, milliseconds on a GPU whatever its rows.
GRAPHED_ROWS = 256
GRAPHED_SPAN = 256


class Graph(enum.Enum):
    """The forward a route runs (see the module docstring); the last three are `DecodeRoutes.run`'s."""
    EAGER = "eager"
    PACKED = "packed"
    CANDIDATES = "candidates"
    BUCKET = "bucket"
    SMALL = "small"
    KERNEL = "kernel"


class Route(NamedTuple):
    """A step's decode forward: which `graph`, over how many `rows` (decoding rows, the prompt
    tokens riding along and the padding)."""
    graph: Graph
    rows: int


def bucket(rows: int) -> int:
    """The batch bucket a BUCKET decode of `rows` rows is padded to."""
    last = BATCH_BUCKETS[-1]
    return next((b for b in BATCH_BUCKETS if b >= rows), -(-rows // last) * last)


def graph_of(route: Route) -> tuple:
    """The compiled graph a route runs: BUCKET's one per batch size, SMALL's and KERNEL's one each."""
    return (route.graph, route.rows if route.graph is Graph.BUCKET else None)


def chunk_rows(rows: int, chunks: list[int]) -> list[int]:
    """The output rows of a KERNEL step of `rows` decoding rows and prompt chunks of `chunks`
    tokens after them: every decoding row, then each chunk's last token."""
    return list(range(rows)) + [rows - 1 + end for end in accumulate(chunks)]


class DecodeRoutes:
    def __init__(self, model, cache, slots: int, max_len: int, *, compile: bool, graphed: bool,
                 background: bool = False, last: torch.Tensor | None = None, draws: dict | None = None):
        """The routes of an engine over `cache`, whose sequences hold slots 0..slots-1 (and, where
        `pads`, the cache has the spare slot `slots`). compile: torch.compile forward_decode, every
        graph before serving, or with `background` on a thread of its own while the engine serves
        eagerly (not with CUDA graphs, which record the compiled step); the engine stays eager where
        compiling fails. graphed: replay the BUCKET decode from CUDA graphs, recorded here (launched
        kernel by kernel where recording fails; on a CPU their bodies run eagerly), and each batch's
        `draws` (kind -> logits -> tokens) into `last` (nanogpt/runtime/cuda_graphs.py)."""
        self.model, self.cache, self.slots, self.device = model, cache, slots, model.device
        self.pads = self.padded(compile, graphed)
        self.compiled, self.graphs = compile, None
        self.mixed = compile and cache.own_attention and self.device.type == "cpu"  # SMALL and KERNEL
        # the compiled graphs routes take (as `planned` names them); replaced, never changed in place, as
        # the engine's thread reads it while the compile's adds to it
        self.live: frozenset[Route] = frozenset()
        self.planned: list[tuple[Route, int | None]] = []
        self._step = model.forward_decode
        # on a CPU each compiled graph is called without dynamo (compile.DirectCall), by its route
        self._direct: dict[tuple, DirectCall] = {}
        self._compiling: threading.Thread | None = None
        self._closing = threading.Event()
        if compile:
            self._step = compile_decode(model)
            for i in range(len(cache.k)):  # one graph serves every engine's slot count
                torch._dynamo.mark_dynamic(cache.k[i], 0)
                torch._dynamo.mark_dynamic(cache.v[i], 0)
            self.planned = self._plan()
            if background and not graphed:
                self._compiling = threading.Thread(target=self._compile, name="nanoserve-compile", daemon=True)
                self._compiling.start()
            else:
                self._compile()
        if graphed:
            self._record_graphs(max_len, last, draws)

    @property
    def warming(self) -> bool:
        """Whether graphs are still compiling in the background (the engine serves meanwhile)."""
        return self._compiling is not None and self._compiling.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to end; whether it has."""
        if self._compiling is not None:
            self._compiling.join(timeout)
        return not self.warming

    def close(self) -> None:
        """Stop compiling after the graph in progress (an engine that stops)."""
        self._closing.set()

    @staticmethod
    def padded(compile: bool, graphed: bool) -> bool:
        """Whether an engine's decodes may be padded: its cache then needs a spare slot for the
        padding rows, and a spare position, so that no span is the whole cache (whose slice would
        specialize the compiled graph: a second compile of every bucket, for the last span)."""
        return compile or graphed

    def route(self, rows: int, chunks: list[tuple[int, int]] = (), candidates: int = 0, span: int = 0) -> Route:
        """The forward of a step's `rows` decoding rows: with `chunks` ((tokens fed before, tokens)
        of each prompt chunk that could ride along, those not scoring their context) and
        `candidates` (contrastive candidate rows, which go with the rows and no chunk); `span`:
        one past the decoding rows' last position."""
        if candidates:
            return Route(Graph.CANDIDATES, rows + candidates)
        kernel = self.mixed and Route(Graph.KERNEL, decode_attention.ROWS) in self.live
        if chunks:
            tokens = rows + sum(n for _, n in chunks)
            attention = sum(n * (fed + n) for fed, n in chunks)
            if kernel and attention <= MIXED_ATTENTION:
                return Route(Graph.KERNEL, max(tokens, decode_attention.ROWS))
            span = max([span, *(fed + n for fed, n in chunks)])
            if self.graphs is not None and attention <= MIXED_ATTENTION and self.graphs.has(bucket(tokens), span):
                return Route(Graph.BUCKET, bucket(tokens))
            return Route(Graph.PACKED, tokens)
        if self.mixed and rows >= 2:
            if rows <= SMALL_ROWS and Route(Graph.SMALL, SMALL_ROWS) in self.live:
                return Route(Graph.SMALL, rows)
            if kernel:
                return Route(Graph.KERNEL, max(rows, decode_attention.ROWS))
            return Route(Graph.EAGER, rows)
        if self.pads and (self.graphs is not None or Route(Graph.BUCKET, bucket(rows)) in self.live):
            return Route(Graph.BUCKET, bucket(rows))
        return Route(Graph.EAGER, rows)

    def where(self, route: Route, slots: list[int], positions: list[int]) -> torch.Tensor:
        """The rows' slots and positions (2, route.rows) on the device, in one copy, padded to the
        route's rows (padding rows: position 0 of the spare slot)."""
        pad = route.rows - len(positions)
        return to_device([slots + [self.slots] * pad, positions + [0] * pad], self.device)

    def run(self, route: Route, tokens: torch.Tensor, where: torch.Tensor, span: int,
            outputs: list[int] | None = None) -> torch.Tensor:
        """One forward_decode of a BUCKET, SMALL or KERNEL route, each row a token (`tokens`, on the
        device) at its (slot, position) (`where`, as `where()` gives them), attending to positions
        0..span-1: the logits (B, V) of every real row (BUCKET), or of the rows `outputs` (SMALL,
        KERNEL: the decoding rows, then each chunk's last token)."""
        real, pad = len(tokens), route.rows - len(tokens)
        tokens = torch.cat([tokens, tokens.new_zeros(pad)]) if pad else tokens
        if route.graph is Graph.BUCKET and self.graphs is not None:
            if outputs is not None:
                return self.graphs(tokens, where, span, to_device(outputs, self.device))
            return self.graphs(tokens, where, span)[:real]
        keys = torch.arange(max(span, 2), device=self.device)
        out = None if route.graph is Graph.BUCKET else to_device(outputs, self.device)
        with torch.no_grad():  # as the engine steps (and warms up): grad mode is one of the graph's guards
            logits = self._forward(route, tokens, where[0], where[1], keys, out)
        return logits[:real] if out is None else logits

    def _forward(self, route: Route, tokens, slots, positions, keys, out) -> torch.Tensor:
        """The route's graph: called directly where it can be (`_direct`), else through dynamo."""
        direct = self._direct.get(graph_of(route))
        logits = None if direct is None else direct(tokens, slots, positions, self.cache, keys, out)
        return self._call(tokens, slots, positions, self.cache, keys, out) if logits is None else logits

    def _call(self, tokens, slots, positions, cache, keys, out=None) -> torch.Tensor:
        """forward_decode, compiled or not, its sizes marked: the span always dynamic; the rows
        fixed in BUCKET's graphs (`out` None), dynamic in SMALL's and KERNEL's with `out`. Marked
        `maybe`: a size that specializes anyway compiles a graph of its own, not a failed step."""
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(keys, 0)
            mark = torch._dynamo.mark_static if out is None else torch._dynamo.maybe_mark_dynamic
            for tensor in (tokens, slots, positions) if out is None else (tokens, slots, positions, out):
                mark(tensor, 0)
        return self._step(tokens, slots, positions, cache, keys, out)

    def buckets(self, top: int | None = None) -> list[int]:
        """The batch buckets up to this engine's slots, or `top` (past the last of BATCH_BUCKETS, its multiples)."""
        top, last = top or bucket(self.slots), BATCH_BUCKETS[-1]
        return [b for b in BATCH_BUCKETS if b <= top] + list(range(2 * last, top + 1, last))

    def _plan(self) -> list[tuple[Route, int | None]]:
        """The graphs to compile, each a route run on padding rows with its outputs (None: BUCKET's,
        every row), the most used first: one row, then KERNEL (most rows, and prompts beside them),
        then SMALL. A graph is traced with equal sizes as one size (dynamo's duck sizing): SMALL's
        is traced with as many outputs as rows, as its decodes run; KERNEL's with fewer, as a step
        with chunks runs, which its decodes (as many outputs as rows, from the kernel's rows up)
        then also match."""
        graphs = [(Route(Graph.BUCKET, size), None) for size in self.buckets() if size == 1 or not self.mixed]
        if self.mixed:
            graphs += [(Route(Graph.KERNEL, decode_attention.ROWS), 2), (Route(Graph.SMALL, SMALL_ROWS), SMALL_ROWS)]
        return graphs

    def _compile(self) -> None:
        """Compile the planned graphs in turn, each live once its padding rows ran through it. Where
        one fails (e.g. no C++ compiler for inductor's CPU kernels), the engine stays eager."""
        background = threading.current_thread() is self._compiling
        log.info("compiling the decode step", extra={"graphs": len(self.planned), "background": background})
        started = time.monotonic()
        try:
            for route, outputs in self.planned:
                if self._closing.is_set():
                    return
                began = time.monotonic()
                tokens = torch.zeros(route.rows, dtype=torch.long, device=self.device)
                where = self.where(route, [self.slots] * route.rows, [0] * route.rows)
                outputs = None if outputs is None else list(range(outputs))
                self.run(route, tokens, where, 1, outputs)
                if self.device.type == "cpu":
                    self._call_directly(route, tokens, where, outputs)
                self.live = self.live | {route}  # the engine's next route() takes it
                log.info("decode graph live", extra={"graph": route.graph.name, "rows": route.rows,
                                                     "seconds": round(time.monotonic() - began, 2)})
        except Exception:
            log.exception("compiling the decode step failed; the engine runs it uncompiled")
            self.live, self.compiled, self.mixed, self._step = frozenset(), False, False, self.model.forward_decode
            self._direct = {}
            return
        log.info("decode step compiled", extra={"graphs": len(self.planned), "seconds": round(time.monotonic() - started, 2)})

    def _call_directly(self, route: Route, tokens: torch.Tensor, where: torch.Tensor, outputs: list[int] | None) -> None:
        """Call `route`'s compiled graph without dynamo from now on (`run` gave it these inputs);
        where it cannot be found the route goes on through dynamo."""
        out = None if outputs is None else to_device(outputs, self.device)
        args = (tokens, where[0], where[1], self.cache, torch.arange(2, device=self.device), out)
        try:
            with torch.no_grad():
                direct = DirectCall(self._step, args)
        except Exception:
            log.warning("a compiled decode graph is called through dynamo", exc_info=True,
                        extra={"graph": route.graph.name, "rows": route.rows})
            return
        self._direct = {**self._direct, graph_of(route): direct}  # replaced: the engine reads it

    def _record_graphs(self, max_len: int, last: torch.Tensor, draws: dict) -> None:
        """The BUCKET decode's CUDA graphs, every batch and span bucket, the batches past the
        slots' up to GRAPHED_ROWS (which only steps with prompt tokens riding along fill) up to
        GRAPHED_SPAN, and each decoding batch's draws, recorded before serving. A compiled step
        compiles each batch of its own: it records the slots' batches alone."""
        rows = bucket(self.slots if self.compiled else max(self.slots, GRAPHED_ROWS))
        graphs = GraphedDecode(self._call, self.cache, spare_slot=self.slots, max_batch=rows,
                               max_span=max_len, vocab=self.model.config.vocab_size, last=last, draws=draws,
                               eager=self.device.type != "cuda")
        started = time.monotonic()
        try:
            graphs.record(self.buckets())
            graphs.record([b for b in self.buckets(rows) if b > bucket(self.slots)], GRAPHED_SPAN)
            log.info("CUDA graphs recorded", extra={"graphs": len(graphs.graphs), "seconds": round(time.monotonic() - started, 2)})
        except Exception:
            log.exception("recording the decode step's CUDA graphs failed; the engine launches its kernels one by one")
            return
        self.graphs = graphs
        started = time.monotonic()
        try:  # the step's graphs serve without them
            graphs.record_draws(self.buckets())
            log.info("draws recorded in CUDA graphs", extra={"graphs": len(graphs.draw_graphs),
                                                             "seconds": round(time.monotonic() - started, 2)})
        except Exception:
            log.exception("recording the draws' CUDA graphs failed; the sampler draws every step's tokens")
            graphs.drop_draws()

