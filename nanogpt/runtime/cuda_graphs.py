"""The decode step replayed from CUDA graphs on a GPU.

A decode step of a small model is a few hundred small kernels: launched one by one from Python, the
GPU waits on the host for most of the step. A CUDA graph records the step's kernels once and
launches them all with one call. A graph fixes every shape and address, so there is one per batch
bucket (the runner pads the batch) and per span bucket (the keys attended, rounded up to a multiple
of SPAN_QUANTUM: the keys past a row's position are masked, so a longer span gives the same
logits), all recorded before serving, in one memory pool. The step (eager or compiled
`forward_decode`) must not sync with the host, as DecodeWindow does not.

Beside each batch's steps, graphs of its draws (the worker's: worker/sampling.py `GraphDraws`),
their tokens written to the rows' slots of the runner's `last` and into the batch's rows as the
next step's input, one position on. A batch whose rows draw from their logits and sampling
settings alone then runs step after step from two replays each (worker/runner.py `decode_in_graphs`).

Every tensor a graph reads outside its pool stays alive, at its address, as long as the graph:
the cache and weights (the runner's), each batch's rows (shared by its graphs), the keys (each
step graph's own), the logits and draws buffers every graph of a kind writes, and the draws' own
buffers (so that a graph's pool memory is only its intermediates, which the graphs share: one
replays at a time). With `eager` the same bodies run as they are, no graph: how a CPU checks them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

# Longer spans cost each step a little attention over masked keys; shorter ones more graphs
# (one per bucket: 16 span buckets for a context of 1024).
SPAN_QUANTUM = 64


def span_bucket(span: int, max_span: int) -> int:
    """The keys a graph attends to for a step whose longest row reaches `span` (>= span, <= max_span)."""
    return min(-(-max(span, 2) // SPAN_QUANTUM) * SPAN_QUANTUM, max_span)


def span_buckets(max_span: int) -> list[int]:
    """Every span bucket of spans up to `max_span`: one graph each (per batch bucket)."""
    return sorted({span_bucket(span, max_span) for span in range(2, max_span + 1)})


def record(run, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `run()`, after a first run off the graph on a side stream (torch.compile
    compiles, cuBLAS picks its kernels, the allocator warms up). Returns the graph; what `run`
    writes at recording lies in the graph's pool (`pool`: shared with other graphs)."""
    device = torch.cuda.current_device()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        run()
    return graph


def replay_seconds(run, replays: int) -> list[float]:
    """Seconds of each of `replays` replays of a CUDA graph of `run()` (recorded as `record` does,
    on the current device), timed by CUDA events: what the GPU takes, not the host's launches."""
    graph = record(run)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


@dataclass
class _Graph:
    replay: Callable[[], None]  # a CUDA graph's replay, or (eager) the recorded body itself
    keys: torch.Tensor | None  # arange(span) of a step's graph, which reads it at its address


class GraphedDecode:
    def __init__(self, step, cache, *, spare_slot: int, max_batch: int, max_span: int, vocab: int,
                 last: torch.Tensor, draws: dict[str, Callable[..., torch.Tensor]], eager: bool = False):
        """step(tokens, slots, positions, cache, keys) -> float32 logits (B, vocab): the decode
        step, B at most `max_batch`; keys = arange(span), span at most `max_span`. Graphs are
        recorded on padding rows (position 0 of `spare_slot`, a slot no sequence holds), since
        recording runs the step once first. draws: each kind of draw recorded for every batch,
        (logits (B, vocab), slots (B,)) -> tokens (B,), without host syncs; last: each
        slot's last drawn token (the runner's), which a draw writes. eager: run the recorded
        bodies as they are, no CUDA graph (a CPU: the same code, checked there)."""
        self.step, self.cache, self.spare_slot = step, cache, spare_slot
        self.max_batch, self.max_span, self.eager = max_batch, max_span, eager
        self.device = cache.k[0].device
        self.pool = None if eager else torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.draw_graphs: dict[tuple[int, str], _Graph] = {}
        # each batch's rows, (3, B) long: tokens, slots, positions, shared by its span buckets' graphs
        self.rows: dict[int, torch.Tensor] = {}
        self.logits = torch.empty(max_batch, vocab, device=self.device)  # every graph's output
        self.last, self.draw_kinds = last, draws
        self.drawn = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # every draw's output
        self.replays = Counter()  # by (batch, span)
        self.draws = Counter()  # by (batch, kind)

    def record(self, batches: list[int], max_span: int | None = None) -> None:
        """A graph for every batch of `batches` and every span bucket (up to `max_span`'s)."""
        top = span_bucket(min(max_span or self.max_span, self.max_span), self.max_span)
        for batch in batches:
            for span in span_buckets(self.max_span):
                if span <= top:
                    self._record(batch, span)

    def has(self, batch: int, span: int) -> bool:
        """Whether a graph of `batch` rows attending to `span` keys was recorded."""
        return span <= self.max_span and (batch, span_bucket(span, self.max_span)) in self.graphs

    def record_draws(self, batches: list[int]) -> None:
        """Each batch's draws, of every kind."""
        for batch in batches:
            for kind in self.draw_kinds:
                self._record_draw(batch, kind)

    def drop_draws(self) -> None:
        """No draws in the graphs (recording them failed): the sampler draws every step's tokens."""
        self.draw_kinds, self.draw_graphs = {}, {}

    def __call__(self, tokens: torch.Tensor, where: torch.Tensor, span: int,
                 outputs: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, V) of the rows, or of the rows `outputs` (R,) only: tokens (B,) at their slots
        and positions (where: (2, B)), all on the device, copied into the graph's rows; attending
        to keys 0 .. span-1. A copy, since the next replay overwrites the buffer."""
        self.load(tokens, where)
        self.replay(len(tokens), span)
        return self.logits[:len(tokens)].clone() if outputs is None else self.logits[outputs]

    def replay(self, batch: int, span: int) -> None:
        """The step of the batch's rows as they are (`__call__` fills them; `draw` advances them),
        attending to keys 0 .. span-1: its logits in `logits[:batch]`."""
        key = (batch, span_bucket(span, self.max_span))
        entry = self.graphs.get(key) or self._record(*key)  # a batch the runner did not record
        entry.replay()
        self.replays[key] += 1

    def draw(self, batch: int, kind: str) -> torch.Tensor:
        """The batch's tokens (B,) drawn by `kind` from its last step's logits, each written to its
        slot of `last` and fed to the batch's next step, one position on: `replay` then runs that
        step with no input from the host. The draws' buffer: the next draw overwrites it."""
        (self.draw_graphs.get((batch, kind)) or self._record_draw(batch, kind)).replay()
        self.draws[batch, kind] += 1
        return self.drawn[:batch]

    def load(self, tokens: torch.Tensor, where: torch.Tensor) -> None:
        """Fill the batch's rows: tokens (B,) at their slots and positions (where: (2, B)), on the device."""
        rows = self._rows(len(tokens))
        rows[0].copy_(tokens)
        rows[1:].copy_(where)

    def _rows(self, batch: int) -> torch.Tensor:
        if batch not in self.rows:
            self.rows[batch] = torch.zeros(3, batch, dtype=torch.long, device=self.device)
            self.rows[batch][1] = self.spare_slot
        return self.rows[batch]

    def _record(self, batch: int, span: int) -> _Graph:
        rows, keys = self._rows(batch), torch.arange(span, device=self.device)

        def run():
            self.logits[:batch].copy_(self.step(rows[0], rows[1], rows[2], self.cache, keys))

        self.graphs[batch, span] = entry = _Graph(self._recorded(run), keys)
        return entry

    def _record_draw(self, batch: int, kind: str) -> _Graph:
        rows, draw = self._rows(batch), self.draw_kinds[kind]

        def run():
            tokens = draw(self.logits[:batch], rows[1])
            self.drawn[:batch].copy_(tokens)
            self.last.index_put_((rows[1],), tokens)
            rows[0].copy_(tokens)
            rows[2].add_(1)

        saved = rows.clone()
        self.draw_graphs[batch, kind] = entry = _Graph(self._recorded(run), None)
        rows.copy_(saved)  # recording ran it: the padding rows back at position 0
        return entry

    def _recorded(self, run) -> Callable[[], None]:
        if self.eager:
            with torch.no_grad():
                run()  # as recording a graph runs it once
            return run
        with torch.cuda.device(self.device):
            return record(run, self.pool).replay
