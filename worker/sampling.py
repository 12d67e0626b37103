"""Choosing the next token for every row of a batch: logit_bias, presence/frequency penalties,
temperature, top_k, top_p, and seeded draws that do not depend on what else shares the batch.

Every per-sequence setting lives in per-slot tensors on the model's device (`Sampler`), so one
decode step samples the whole batch with a handful of tensor ops. Only row *groups* are chosen on
the host (greedy, plain sampling, filtered sampling), from each row's own parameters, so a row's
arithmetic never depends on its neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# ---- counter-based randomness: uniform = hash(seed, choice, step) ----
# splitmix64 (Steele et al.) on int64 tensors; torch's int64 arithmetic wraps like uint64 would.
_MASK64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GAMMA
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def seeded_uniform(seed: torch.Tensor, choice: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 each -> (B,) float64 uniforms in [0, 1), a pure function of (seed, choice, step)."""
    h = _mix(_mix(_mix(seed) + choice) + step)
    return _shr(h, 11).double() * 2.0 ** -53


def reference_uniform(seed: int, choice: int, step: int) -> float:
    """The same draw in plain Python (the specification seeded_uniform is tested against)."""
    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)
    h = mix((mix((mix(seed & _MASK64) + choice) & _MASK64) + step) & _MASK64)
    return (h >> 11) * 2.0 ** -53


# ---- the pieces, as pure functions over a batch ----

def apply_penalties(logits, counts, presence, frequency):
    """OpenAI's formula over generated tokens: logits[j] -= c[j]*frequency + (c[j] > 0)*presence.
    logits, counts (B, V); presence, frequency (B,)."""
    return logits - counts * frequency[:, None] - (counts > 0).to(logits.dtype) * presence[:, None]


def truncate_sorted(probs_sorted, top_k, top_p):
    """Zero the tail of each row of descending probabilities (R, K), the K best of a distribution
    over the whole vocabulary (K = V or fewer): keep the top_k first (0 = all), then, renormalised
    over those top_k, the smallest prefix whose mass reaches top_p."""
    rank = torch.arange(probs_sorted.shape[-1], device=probs_sorted.device)
    p = probs_sorted * ((rank < top_k[:, None]) | (top_k[:, None] == 0))
    mass = torch.where(top_k > 0, p.sum(-1), 1.0)  # without top_k: the whole distribution, summing to 1
    mass_before = (p.cumsum(-1) - p) / mass[:, None]  # mass of the strictly better-ranked tokens
    return p * (mass_before < top_p[:, None])  # the first token always stays (0 < top_p)


def inverse_cdf(probs, u):
    """Index drawn from each row of unnormalised probs (R, V) by the uniforms u (R,) float64."""
    cdf = probs.double().cumsum(-1)  # float64: in float32 the tail's tiny probabilities would round away
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u[:, None] * total, right=True)  # first index with cdf > u * total
    last = torch.searchsorted(cdf, total)  # the last token with probability > 0
    return torch.minimum(idx, last).squeeze(1)  # (rounding can put u * total at the total)


CANDIDATES = 256  # top_k/top_p rows sort only their best tokens when those hold the truncation


def draw_truncated(probs, top_k, top_p, u):
    """Draw from each row's descending-sorted probabilities (R, V) truncated by top_k and top_p.
    A full sort costs ~5 ms a row on a CPU, so rows sort only their CANDIDATES best tokens (topk)
    when those are known to hold the truncated set; the others sort fully. Which way a row goes
    depends on the row alone, so the draw stays independent of the batch."""
    K = min(CANDIDATES, probs.shape[-1])
    p_sorted, order = probs.topk(K, dim=-1)  # (R, K) descending
    fits = torch.where(top_k > 0, top_k <= K, p_sorted.sum(-1) >= top_p)
    wide = (~fits).nonzero().squeeze(1)
    if len(wide):
        # full sort; stable, so ties keep vocabulary order
        wide_sorted, wide_order = torch.sort(probs[wide], dim=-1, descending=True, stable=True)
        wide_tokens = wide_order.gather(1, inverse_cdf(truncate_sorted(wide_sorted, top_k[wide], top_p[wide]),
                                                       u[wide])[:, None])
    tokens = order.gather(1, inverse_cdf(truncate_sorted(p_sorted, top_k, top_p), u)[:, None]).squeeze(1)
    if len(wide):
        tokens[wide] = wide_tokens.squeeze(1)
    return tokens


def draw(logits, temperature, top_k, top_p, u, filtered: list[bool]):
    """Sample one token per row of (B, V) logits at the given temperatures (> 0).
    Rows with top_k/top_p (`filtered`) draw from their truncated distribution in probability order;
    the others from the plain softmax in vocabulary order (no sorting: the common case stays cheap)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    plain = [i for i, f in enumerate(filtered) if not f]
    if plain:
        rows = torch.tensor(plain, device=probs.device)
        out[rows] = inverse_cdf(probs[rows], u[rows])
    kept = [i for i, f in enumerate(filtered) if f]
    if kept:
        rows = torch.tensor(kept, device=probs.device)
        out[rows] = draw_truncated(probs[rows], top_k[rows], top_p[rows], u[rows])
    return out


# ---- per-request settings and the per-slot state ----

@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Sampling state of every KV-cache slot: parameters, per-token counts of generated tokens (for
    penalties), a dense logit_bias row, and the draw counter. Tensors (max_slots,) or (max_slots, V)."""

    def __init__(self, max_slots: int, vocab_size: int, device="cpu"):
        self.vocab_size = vocab_size
        self.params: list[SamplingParams | None] = [None] * max_slots
        f32 = dict(device=device, dtype=torch.float32)
        i64 = dict(device=device, dtype=torch.long)
        self.temperature = torch.ones(max_slots, **f32)
        self.top_p = torch.ones(max_slots, **f32)
        self.top_k = torch.zeros(max_slots, **i64)
        self.presence = torch.zeros(max_slots, **f32)
        self.frequency = torch.zeros(max_slots, **f32)
        self.seed = torch.zeros(max_slots, **i64)
        self.choice = torch.zeros(max_slots, **i64)
        self.step = torch.zeros(max_slots, **i64)  # tokens drawn so far = index of the next draw
        self.counts = torch.zeros(max_slots, vocab_size, **f32)
        self.bias = torch.zeros(max_slots, vocab_size, **f32)

    def assign(self, slot: int, params: SamplingParams, choice: int, history: list[int] = ()):
        """Give `slot` to choice `choice` of a request; `history` are tokens it already generated
        (a resumed job), which count for penalties and advance the draw counter."""
        self.params[slot] = params
        self.temperature[slot] = max(params.temperature, 1e-6)  # unused when greedy
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        self.seed[slot] = _signed64(params.seed)
        self.choice[slot] = choice
        self.step[slot] = len(history)
        self.counts[slot].zero_()
        if history:
            ids = torch.tensor(list(history), device=self.counts.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.bias[slot].zero_()
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=self.bias.device)
            self.bias[slot, ids] = torch.tensor(list(params.logit_bias.values()), device=self.bias.device)

    def adjusted_logits(self, logits: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]):
        """Raw (B, V) logits plus logit_bias, minus penalties (skipped when no row has any:
        adding zeros would change nothing)."""
        if any(p.logit_bias for p in params):
            logits = logits + self.bias[slots]
        if any(p.penalized for p in params):
            logits = apply_penalties(logits, self.counts[slots], self.presence[slots], self.frequency[slots])
        return logits

    def sample(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """One token per row of raw (B, V) float32 logits, row b belonging to slot slots[b]
        (distinct). Advances each slot's draw counter and token counts. Returns (B,) long, on device."""
        params = [self.params[s] for s in slots]
        idx = torch.tensor(slots, device=logits.device)
        x = self.adjusted_logits(logits, idx, params)
        random = [b for b, p in enumerate(params) if not p.greedy]
        # greedy rows: the first maximum, like transformers
        tokens = x.argmax(-1) if len(random) < len(params) else torch.empty_like(idx)
        if random:
            rows = torch.tensor(random, device=logits.device)
            s = idx[rows]
            u = seeded_uniform(self.seed[s], self.choice[s], self.step[s])
            tokens[rows] = draw(x[rows], self.temperature[s], self.top_k[s], self.top_p[s], u,
                                [params[b].filtered for b in random])
        self.step[idx] += 1
        if any(p.penalized for p in params):
            self.counts.index_put_((idx, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        return tokens
