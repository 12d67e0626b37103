"""Decoding strategies: how the sequences of a request choose their tokens once the step's forwards
have run. The engine's step (engine.py) hands each strategy its own rows, in this order:

- `Sampling`: every row on its own, drawn from its logits by its request's parameters (sampling.py);
- `BeamSearch`: a prompt's beams together, from the logits of its running beams (beams.py);
- `ContrastiveSearch`: each sequence among the candidates it put in the decode forward
  (contrastive.py), which gave it no logits of its own.

A strategy decides which of a prefill's sequences draw from its last logits when they start
(`start`), and chooses its rows' tokens (`draw`). Sampling's draws go to the engine, which takes them
in (output.py) at once, or a step later where it runs a step ahead (engine.py); contrastive search
takes its tokens in at once, and beam search keeps its beams' until the search ends.
"""
from __future__ import annotations

import torch

from worker.beams import BeamGroup
from worker.runner import Drawn
from worker.scheduler import Prefill, Request, Sequence


class Strategy:
    """A decoding strategy: the engine hands it the rows of the requests it `takes`."""
    reads_logits = True  # whether its rows' tokens come from their logits in the step's forward

    def __init__(self, runner, output):
        self.runner, self.output = runner, output

    @staticmethod
    def takes(request: Request) -> bool:
        raise NotImplementedError

    def start(self, unit: Prefill, seqs: list[Sequence]) -> list[Sequence]:
        """Of a completed prefill's sequences that start, those that draw from its last logits now."""
        return seqs

    def draw(self, rows: list[Sequence], logits: torch.Tensor | None) -> Drawn | None:
        """Choose the tokens of `rows` (from `logits`, theirs, where the strategy reads logits):
        the drawn tokens for the engine to take in, or None where the strategy took them in."""
        raise NotImplementedError


class Sampling(Strategy):
    @staticmethod
    def takes(request: Request) -> bool:
        return not request.beam and not request.contrastive

    def draw(self, rows: list[Sequence], logits: torch.Tensor) -> Drawn:
        return self.runner.sample(rows, [logits])


class BeamSearch(Strategy):
    @staticmethod
    def takes(request: Request) -> bool:
        return request.beam

    def start(self, unit: Prefill, seqs: list[Sequence]) -> list[Sequence]:
        """A prompt's beams start as one group, the first step expanding the prompt alone."""
        if seqs:
            seqs[0].request.beams[unit.seqs[0].prompt_index] = BeamGroup(unit.seqs)
        return seqs

    def draw(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """One step of each beam group among `rows`, from the logits of its running beams."""
        where = {id(s): i for i, s in enumerate(rows)}
        groups = {id(g): g for s in rows for g in s.request.beams.values() if s in g.seqs}
        self.runner.step_beams([(g, logits[[where[id(s)] for s in g.rows]]) for g in groups.values()],
                               self.output.tokenizer)


class ContrastiveSearch(Strategy):
    reads_logits = False  # its candidates' logits are its search's (runner.py, contrastive.py)

    @staticmethod
    def takes(request: Request) -> bool:
        return request.contrastive

    def start(self, unit: Prefill, seqs: list[Sequence]) -> list[Sequence]:
        return []  # its first candidates go out with the next step's decode

    def draw(self, rows: list[Sequence], logits: None) -> None:
        self.output.accept(rows, self.runner.contrast(rows))
