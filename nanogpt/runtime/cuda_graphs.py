"""The decode step replayed from CUDA graphs on a GPU.

A decode step of a small model is a few hundred small kernels: launched one by one from Python, the
GPU waits on the host for most of the step. A CUDA graph records the step's kernels once and
launches them all with one call. A graph fixes every shape and address, so there is one per batch
bucket (the runner pads the batch) and per span bucket (the keys attended, rounded up to a multiple
of SPAN_QUANTUM: the keys past a row's position are masked, so a longer span gives the same
logits), all recorded before serving, in one memory pool. The step (eager or compiled
`forward_decode`) must not sync with the host, as DecodeWindow does not.

Every tensor a graph reads outside its pool stays alive, at its address, as long as the graph:
the cache and weights (the runner's), the rows and keys (each graph's own) and the logits buffer
that every graph writes its output to (so that a graph's pool memory is only its intermediates,
which the graphs share: one replays at a time).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

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
    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor  # (3, B) long: tokens, slots, positions, copied in before each replay
    keys: torch.Tensor  # arange(span)


class GraphedDecode:
    def __init__(self, step, cache, *, spare_slot: int, max_batch: int, max_span: int, vocab: int):
        """step(tokens, slots, positions, cache, keys) -> float32 logits (B, vocab): the decode
        step, B at most `max_batch`; keys = arange(span), span at most `max_span`. Graphs are
        recorded on padding rows (position 0 of `spare_slot`, a slot no sequence holds), since
        recording runs the step once first."""
        self.step, self.cache, self.spare_slot = step, cache, spare_slot
        self.max_batch, self.max_span = max_batch, max_span
        self.device = cache.k[0].device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.logits = torch.empty(max_batch, vocab, device=self.device)  # every graph's output
        self.replays = Counter()  # by (batch, span)

    def record(self, batches: list[int]) -> None:
        """A graph for every batch of `batches` and every span bucket."""
        for batch in batches:
            for span in span_buckets(self.max_span):
                self._record(batch, span)

    def __call__(self, tokens: torch.Tensor, where: torch.Tensor, span: int) -> torch.Tensor:
        """Logits (B, V) of the rows: tokens (B,) at their slots and positions (where: (2, B)), all on
        the device, copied into the graph's rows; attending to keys 0 .. span-1. A copy, since the
        next replay overwrites the buffer."""
        key = (len(tokens), span_bucket(span, self.max_span))
        entry = self.graphs.get(key) or self._record(*key)  # a batch the runner did not record
        entry.rows[0].copy_(tokens)
        entry.rows[1:].copy_(where)
        entry.graph.replay()
        self.replays[key] += 1
        return self.logits[:key[0]].clone()

    def _record(self, batch: int, span: int) -> _Graph:
        rows = torch.zeros(3, batch, dtype=torch.long, device=self.device)
        rows[1] = self.spare_slot
        keys = torch.arange(span, device=self.device)

        def run():
            self.logits[:batch].copy_(self.step(rows[0], rows[1], rows[2], self.cache, keys))

        with torch.cuda.device(self.device):
            self.graphs[batch, span] = entry = _Graph(record(run, self.pool), rows, keys)
        return entry
