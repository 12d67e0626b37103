"""How many prompt tokens one engine step may prefill: sized by what they cost, measured while the
engine runs, so that the sequences already decoding keep their pace while new prompts are fed.

A step that decodes D sequences and prefills P prompt tokens takes about decode(D) + P·c, with c
the cost of one prefill token. With `share` s, P is held to s·decode(D) / c, so the decoding
sequences' time per token grows by at most a factor 1 + s while a prompt is fed (a fixed chunk of
256 tokens made one step of GPT-2 small on two cores several times a decode step). With nothing
decoding, nobody waits on a step but the prompts themselves: they get `max_tokens` at once.

The costs are moving averages of the steps' wall times (each step ends in a host sync, so wall
time is device time too): a step without prefill measures decode(D); a step with prefill, less
that, its cost per prefill token. Until both are measured, a step prefills `max_tokens`.
"""
from __future__ import annotations


class PrefillBudget:
    def __init__(self, max_tokens: int, share: float = 0.5, min_tokens: int = 16, smoothing: float = 0.25):
        if share <= 0:
            raise ValueError("share must be positive")
        self.max_tokens = max(1, max_tokens)
        self.min_tokens = max(1, min(min_tokens, self.max_tokens))  # keeps a long prompt moving
        self.share, self.smoothing = share, smoothing
        self.decode_s: float | None = None  # a step of the running sequences alone
        self.token_s: float | None = None  # one prefill token, on top of that

    def tokens(self, decoding: int) -> int:
        """Prompt tokens the next step may feed while `decoding` sequences run."""
        if decoding == 0 or self.decode_s is None or self.token_s is None:
            return self.max_tokens
        allowed = int(self.share * self.decode_s / self.token_s)
        return max(self.min_tokens, min(self.max_tokens, allowed))

    def observe(self, decoding: int, prefilled: int, seconds: float) -> None:
        """A step that decoded `decoding` sequences and fed `prefilled` prompt tokens took `seconds`."""
        if prefilled == 0:
            if decoding:
                self.decode_s = self._average(self.decode_s, seconds)
            return
        rest = seconds - ((self.decode_s or 0.0) if decoding else 0.0)
        if rest > 0:
            self.token_s = self._average(self.token_s, rest / prefilled)

    def _average(self, current: float | None, value: float) -> float:
        return value if current is None else current + self.smoothing * (value - current)
