"""Choosing the next token for every row of a batch: the logits processors (allowed_token_ids, bad
words, min_tokens, logit_bias, repetition and presence/frequency penalties, n-gram bans), then
temperature, min_p, top_k, top_p, and seeded draws that do not depend on what else shares the batch.

Every per-sequence setting lives in per-slot tensors on the model's device (`Sampler`), so one
decode step samples the whole batch with a handful of tensor ops. Only row *groups* are chosen on
the host (greedy, plain sampling, truncated sampling), from each row's own parameters, so a row's
arithmetic never depends on its neighbours.

Draws are Gumbel-max: token = argmax_j (logit_j / T + g_j), with one Gumbel variable g_j per
vocabulary entry from a generator seeded by hash(seed, choice, step). Unlike inverse-CDF sampling,
where a 1e-6 change of the logits (which a different batch shape gives the model's matmuls) moves
every cumulative sum and often the token drawn from the flat tail, this changes the token only
when the two best noisy scores lie within 1e-6 of each other: as rarely as a greedy choice flips.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from nanogpt.kernels import extension
from nanogpt.runtime.transfer import to_device
from worker.grammar import Grammars
from worker.logits_processors import (NGramBans, apply_bans, apply_min_p, apply_repetition_penalty,
                                      apply_token_mask, bad_word_bans, token_mask)

# ---- counter-based randomness: a generator seed = hash(seed, choice, step) ----
_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele et al.): a bijective scramble of 64 bits (uint64, wrapping)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_keys(seeds: list[int], choices: list[int], steps: list[int]) -> list[int]:
    """The generator seed of each draw, a pure function of its (request seed, choice index, step),
    for a batch of rows at once."""
    seeds = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
    mixed = _mix64(_mix64(_mix64(seeds) + np.array(choices, dtype=np.uint64)) + np.array(steps, dtype=np.uint64))
    return (mixed >> np.uint64(1)).tolist()  # < 2**63


def draw_key(seed: int, choice: int, step: int) -> int:
    """One draw's `draw_keys`."""
    return draw_keys([seed], [choice], [step])[0]


def gumbel_noise(keys: list[int], vocab_size: int, device, hashed: bool | None = None) -> torch.Tensor:
    """(R, V) standard Gumbel noise on `device`, row r a pure function of keys[r] alone: from
    numpy's generator on a CPU, from `hashed_gumbel` on any other device (or where `hashed`)."""
    if not (torch.device(device).type != "cpu" if hashed is None else hashed):
        # numpy's PCG64 with its ziggurat: ~5x faster than torch's CPU generator (mt19937)
        out = np.empty((len(keys), vocab_size), dtype=np.float32)
        for row, key in enumerate(keys):
            np.random.Generator(np.random.PCG64(key)).standard_exponential(out=out[row], dtype=np.float32)
        return torch.from_numpy(out).to(device).clamp_(min=1e-30).log_().neg_()  # E = 0 would win for sure
    return hashed_gumbel(to_device(keys, device), vocab_size)


_M32 = 0xFFFFFFFF


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 integer hash of 32-bit values held in int64 (products wrap, then masked)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hashed_gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, V) Gumbel noise from a counter-based hash of (keys[r], token id): a dozen elementwise
    kernels for the whole batch on the keys' device, no generator per row and nothing from the host
    but the keys. A 23-bit uniform u in (0, 1) per entry gives -log(-log(u))."""
    ids = torch.arange(vocab_size, device=keys.device, dtype=torch.long)
    lo, hi = (keys & _M32)[:, None], ((keys >> 32) & _M32)[:, None]
    x = _lowbias32((ids[None, :] * 0x9E3779B1 + lo) & _M32)
    x = _lowbias32(x ^ hi)
    u = ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))  # < 1 in float32: its log is never 0
    return u.log().neg().log().neg()


# ---- the pieces, as pure functions over a batch ----

def apply_penalties(logits, counts, presence, frequency):
    """OpenAI's formula over generated tokens: logits[j] -= c[j]*frequency + (c[j] > 0)*presence.
    logits, counts (B, V); presence, frequency (B,)."""
    return logits - counts * frequency[:, None] - (counts > 0).to(logits.dtype) * presence[:, None]


def logit_biases(biases: list[dict[int, float]], device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's {token: bias} as `apply_logit_bias` takes them: the (2, N) rows and token ids of
    the biased entries, and their N biases, on `device`."""
    rows = [b for b, bias in enumerate(biases) for _ in bias]
    ids = [t for bias in biases for t in bias]
    return (to_device([rows, ids], device),
            to_device([v for bias in biases for v in bias.values()], device, dtype))


def apply_logit_bias(logits, biases: tuple[torch.Tensor, torch.Tensor], in_place: bool = False):
    """logits (B, V) plus each row's biases (`logit_biases`): added at the biased entries alone
    (the same sums as adding a dense row of mostly zeros, without reading and adding B x V of them);
    into `logits` itself when `in_place` (a copy of GPT-2's 32 rows costs ~0.7 ms of a 20 ms step)."""
    index, values = biases
    add = logits.index_put_ if in_place else logits.index_put
    return add((index[0], index[1]), values.to(logits.dtype), accumulate=True)


def truncate_sorted(probs_sorted, top_k, top_p):
    """Zero the tail of each row of descending probabilities (R, K), the K best of a distribution
    over the whole vocabulary (K = V or fewer): keep the top_k first (0 = all), then, renormalised
    over those top_k, the smallest prefix whose mass reaches top_p, never less than the first token
    (top_p 0 keeps the most likely token alone, as OpenAI's does)."""
    rank = torch.arange(probs_sorted.shape[-1], device=probs_sorted.device)
    p = probs_sorted * ((rank < top_k[:, None]) | (top_k[:, None] == 0))
    mass = torch.where(top_k > 0, p.sum(-1), 1.0)  # without top_k: the whole distribution, summing to 1
    mass_before = (p.cumsum(-1) - p) / mass[:, None]  # mass of the strictly better-ranked tokens
    return p * ((mass_before < top_p[:, None]) | (rank == 0))


CANDIDATES = 256  # truncated rows sort only their best tokens when those hold the truncation


def first_max(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum, as argmax gives it: on a CPU the project's kernel
    (nanogpt/kernels/csrc/first_max.cpp) where it is loaded, else max(-1), which returns the same indices
    (documented: the first maximal value) 2.5-3x faster than argmax (GPT-2's 50257 logits: 25
    against 73 µs at 1 row, 0.43 against 1.17 ms at 32)."""
    own = extension.loaded() if x.device.type == "cpu" else None
    if own is not None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and x.stride(1) == 1:
        return own.first_max(x)
    return x.max(-1).indices


def draw_truncated(probs, top_k, top_p, noise, full_sort: bool | None = None):
    """Draw from each row of probs (R, V) truncated by top_k, then top_p (in probability order),
    by the Gumbel noise (R, V) of the kept tokens. A full sort costs ~5 ms a row on a CPU, so there
    a row sorts only its CANDIDATES best tokens (topk) when those are known to hold its kept set,
    and fully otherwise; which way a row goes depends on the row alone. A GPU sorts every row fully
    (`full_sort`, by default off a CPU): choosing rows would wait for the device."""
    if probs.device.type != "cpu" if full_sort is None else full_sort:
        p_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        return _draw_sorted(p_sorted, order, top_k, top_p, noise)
    K = min(CANDIDATES, probs.shape[-1])
    p_sorted, order = probs.topk(K, dim=-1)  # (R, K) descending
    fits = torch.where(top_k > 0, top_k <= K, p_sorted.sum(-1) >= top_p)
    tokens = _draw_sorted(p_sorted, order, top_k, top_p, noise)
    wide = (~fits).nonzero().squeeze(1)
    if len(wide):
        p_sorted, order = torch.sort(probs[wide], dim=-1, descending=True, stable=True)
        tokens[wide] = _draw_sorted(p_sorted, order, top_k[wide], top_p[wide], noise[wide])
    return tokens


def _draw_sorted(p_sorted, order, top_k, top_p, noise):
    kept = truncate_sorted(p_sorted, top_k, top_p) > 0
    scores = torch.where(kept, p_sorted.log() + noise.gather(1, order), -torch.inf)  # noise of each token id
    return order.gather(1, first_max(scores)[:, None]).squeeze(1)


def draw(logits, temperature, top_k, top_p, noise, truncated: list[bool], min_p=None):
    """Sample one token per row of (B, V) logits at the given temperatures (> 0) with the rows'
    Gumbel noise (B, V). min_p (B,) drops the tempered distribution's unlikely tokens first (vLLM's
    order: temperature, min_p, then top_k and top_p). Rows with top_k/top_p (`truncated`) draw from
    their truncated distribution; the others need no probabilities at all."""
    scaled = logits / temperature[:, None]
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    tokens = first_max(scaled + noise)
    rows = [i for i, t in enumerate(truncated) if t]
    if rows:
        rows = to_device(rows, logits.device)
        tokens[rows] = draw_truncated(torch.softmax(scaled[rows], dim=-1), top_k[rows], top_p[rows], noise[rows])
    return tokens


# ---- per-request settings and the per-slot state ----

@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int = 0
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token may not follow the rest
    stop_ids: tuple[int, ...] = ()  # tokens that end a sequence: none of them before min_tokens
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0  # 0: off
    grammar: str | None = None  # structured output (worker/grammar.py); None: off

    @cached_property  # read by every step's logits processors
    def banned_ids(self) -> frozenset[int] | None:
        """Tokens never drawn whatever came before (one-token bad words), or None."""
        single = frozenset(w[0] for w in self.bad_words if len(w) == 1)
        return single or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def masked(self) -> bool:
        """Whether some tokens are banned outright (allowed_token_ids, one-token bad words)."""
        return self.allowed_token_ids is not None or self.banned_ids is not None

    @property
    def sequence_bans(self) -> bool:
        """Whether bans depend on the tokens so far (multi-token bad words, n-gram bans)."""
        return self.no_repeat_ngram_size > 0 or any(len(w) > 1 for w in self.bad_words)


class Sampler:
    """Sampling state of every KV-cache slot: parameters (tensors (max_slots,), columns of one
    table), per-token counts of generated tokens for penalties, the tokens seen (prompt and output,
    for repetition_penalty), the banned and stop tokens (max_slots, V); on the host the choice index
    and draw counter that seed the slot's draws, and the n-gram bans of slots that ask for them.

    A slot's (V,) rows are written only for a request that reads them: each processor leaves the
    rows that do not use it unchanged whatever their table holds (a penalty of 0 or 1, min_tokens 0),
    except the banned tokens, applied to every row of a step where one row has some, which are
    cleared where an earlier request left some (`_banning`)."""

    def __init__(self, max_slots: int, vocab_size: int, device="cpu", grammars: Grammars | None = None):
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.matchers: list = [None] * max_slots  # each slot's structured-output matcher (worker/grammar.py)
        self.params: list[SamplingParams | None] = [None] * max_slots
        f32 = dict(device=device, dtype=torch.float32)
        flags = dict(device=device, dtype=torch.bool)
        # temperature, top_p, top_k, min_p, presence, frequency, repetition: one write a request
        self.settings = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]], **f32).repeat(max_slots, 1)
        (self.temperature, self.top_p, self.top_k, self.min_p, self.presence, self.frequency,
         self.repetition) = self.settings.unbind(1)  # views: top_k holds whole numbers, exact in float32
        self.choice = [0] * max_slots
        self.step = [0] * max_slots  # tokens drawn so far = index of the next draw
        self.counts = torch.zeros(max_slots, vocab_size, **f32)
        self.seen = torch.zeros(max_slots, vocab_size, **flags)
        self.banned = torch.zeros(max_slots, vocab_size, **flags)
        self.stops = torch.zeros(max_slots, vocab_size, **flags)
        self.ngrams: list[NGramBans | None] = [None] * max_slots
        self.prompt_len = [0] * max_slots  # tokens of the prompt in ngrams[slot]
        self._banning: set[int] = set()  # slots whose row of `banned` is not all False
        self._placed: tuple[list[SamplingParams], tuple] | None = None  # the last rows' logit_bias (`biases`)
        # Gumbel noise by `hashed_gumbel` (off a CPU; GraphDraws' too) rather than numpy's generator
        self.hashed = torch.device(device).type != "cpu"

    def assign(self, slot: int, params: SamplingParams, choice: int, history: list[int] = (), prompt: list[int] = ()):
        """Give `slot` to choice `choice` of a request with this `prompt`; `history` are tokens it
        already generated (a resumed job), which count for penalties and advance the draw counter."""
        self.params[slot] = params
        self.settings[slot] = to_device([max(params.temperature, 1e-6), params.top_p, params.top_k, params.min_p,
                                         params.presence_penalty, params.frequency_penalty,
                                         params.repetition_penalty], self.settings.device, torch.float32)
        self.choice[slot] = choice
        self.step[slot] = len(history)
        device = self.seen.device
        if params.penalized:
            self.counts[slot].zero_()
            if history:
                ids = to_device(list(history), device)
                self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if params.repetition_penalty != 1:
            self.seen[slot] = token_mask([*prompt, *history], self.vocab_size, device)
        if params.masked:
            banned = token_mask(params.banned_ids or (), self.vocab_size, device)
            if params.allowed_token_ids is not None:
                banned |= ~token_mask(params.allowed_token_ids, self.vocab_size, device)
            self.banned[slot] = banned
            self._banning.add(slot)
        elif slot in self._banning:
            self.banned[slot] = False
            self._banning.discard(slot)
        if params.min_tokens:
            self.stops[slot] = token_mask(params.stop_ids, self.vocab_size, device)
        size = params.no_repeat_ngram_size
        self.ngrams[slot] = NGramBans(size, [*prompt, *history]) if size else None
        self.prompt_len[slot] = len(prompt)
        self.matchers[slot] = self.grammars.matcher(params.grammar, history) if params.grammar else None

    def fork(self, slots: list[int], parents: list[int]) -> None:
        """Slot slots[i] takes over the state of slot parents[i] (beam search forks its beams)."""
        dst, src = to_device(slots, self.counts.device), to_device(parents, self.counts.device)
        for table in (self.counts, self.seen):
            table[dst] = table[src]
        ngrams, steps = [self.ngrams[p] for p in parents], [self.step[p] for p in parents]
        for slot, parent, gram, step in zip(slots, parents, ngrams, steps):
            self.ngrams[slot] = gram.copy() if gram is not None else None
            self.step[slot] = step
            self.prompt_len[slot] = self.prompt_len[parent]

    def adjusted_logits(self, logits: torch.Tensor, slots: list[int], outputs: list[list[int]] | None = None,
                        in_place: bool = False, idx: torch.Tensor | None = None):
        """Raw (B, V) logits (or log-probabilities: beam search) through the logits processors, in
        vLLM's order: the structured-output grammar's mask, banned tokens, bad words and n-gram
        bans, stop tokens before min_tokens, logit_bias, repetition penalty, presence/frequency
        penalties. Each is skipped when no row uses it. `outputs[b]`: the tokens row b generated so far, for bans that depend on them.
        `in_place`: the caller reads the raw logits no more, so they may be overwritten. `idx`: the
        slots on the device, where the caller has them."""
        params, raw = [self.params[s] for s in slots], logits
        idx = to_device(slots, logits.device) if idx is None else idx
        matchers = [self.matchers[s] for s in slots]
        if any(m is not None for m in matchers):
            logits = self.grammars.mask(logits if in_place else logits.clone(), matchers)
        if any(p.masked for p in params):
            logits = apply_token_mask(logits, self.banned[idx])
        if any(p.sequence_bans for p in params):
            logits = apply_bans(logits, self._sequence_bans(slots, params, outputs))
        early = [self.step[s] < p.min_tokens for s, p in zip(slots, params)]
        if any(early):
            logits = apply_token_mask(logits, self.stops[idx], to_device(early, logits.device, torch.bool))
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, self.biases(params, logits.device), in_place or logits is not raw)
        if any(p.repetition_penalty != 1 for p in params):
            logits = apply_repetition_penalty(logits, self.seen[idx], self.repetition[idx])
        if any(p.penalized for p in params):
            logits = apply_penalties(logits, self.counts[idx], self.presence[idx], self.frequency[idx])
        return logits

    def sample(self, logits: torch.Tensor, slots: list[int], outputs: list[list[int]] | None = None,
               in_place: bool = False, idx: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of raw (B, V) float32 logits, row b belonging to slot slots[b]
        (distinct). Advances each slot's draw counter and token counts. Returns (B,) long, on device.
        `in_place` and `idx`: as adjusted_logits takes them."""
        params = [self.params[s] for s in slots]
        idx = to_device(slots, logits.device) if idx is None else idx
        x = self.adjusted_logits(logits, slots, outputs, in_place, idx)
        random = [b for b, p in enumerate(params) if not p.greedy]
        # greedy rows: the first maximum, like transformers
        tokens = first_max(x) if len(random) < len(params) else torch.empty_like(idx)
        if random:
            rows = to_device(random, logits.device)
            s = idx[rows]
            keys = draw_keys([params[b].seed for b in random], [self.choice[slots[b]] for b in random],
                             [self.step[slots[b]] for b in random])
            noise = gumbel_noise(keys, x.shape[-1], x.device, self.hashed)
            min_p = self.min_p[s] if any(params[b].min_p > 0 for b in random) else None
            tokens[rows] = draw(x[rows], self.temperature[s], self.top_k[s], self.top_p[s], noise,
                                [params[b].truncated for b in random], min_p)
        self.advance(slots, tokens, idx)
        return tokens

    def advance(self, slots: list[int], tokens: torch.Tensor, idx: torch.Tensor | None = None) -> None:
        """Count the tokens the rows took (drawn here, or chosen by beam search)."""
        params = [self.params[s] for s in slots]
        idx = to_device(slots, tokens.device) if idx is None else idx
        for slot in slots:
            self.step[slot] += 1
        constrained = [(b, self.matchers[s]) for b, s in enumerate(slots) if self.matchers[s] is not None]
        if constrained:
            drawn = tokens.tolist()
            for b, matcher in constrained:
                matcher.consume_token(drawn[b])
        if any(p.penalized for p in params):
            self.counts.index_put_((idx, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        if any(p.repetition_penalty != 1 for p in params):
            self.seen[idx, tokens] = True

    def biases(self, params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' logit_bias on the device: copied when the rows' requests change, else the last
        step's (a decode step's rows stay the same requests between admissions)."""
        if self._placed is None or len(self._placed[0]) != len(params) or \
                any(a is not b for a, b in zip(self._placed[0], params)):
            self._placed = (params, logit_biases([p.logit_bias for p in params], device))
        return self._placed[1]

    def _sequence_bans(self, slots, params, outputs) -> list[tuple[int, int]]:
        if outputs is None:
            raise ValueError("bad words and n-gram bans need each row's output tokens")
        bans = []
        for b, (slot, p) in enumerate(zip(slots, params)):
            past = outputs[b]
            bans += [(b, t) for t in bad_word_bans(past, [w for w in p.bad_words if len(w) > 1])]
            ngrams = self.ngrams[slot]
            if ngrams is not None:
                for token in past[len(ngrams.tokens) - self.prompt_len[slot]:]:  # those not pushed yet
                    ngrams.push(token)
                bans += [(b, t) for t in ngrams.banned()]
        return bans


class GraphDraws:
    """The draws a GPU engine records beside its decode graphs (nanogpt/runtime/cuda_graphs.py):
    for rows whose token follows from their logits, logit_bias, banned tokens, penalties,
    temperature, min_p, top_k and top_p alone, the tokens `Sampler.sample` draws, from buffers of a
    batch bucket's rows (`load`) and the sampler's per-slot tables, instead of the sampler's
    per-step choices on the host. Gumbel noise by `hashed_gumbel`, as the sampler's where it
    hashes (`Sampler.hashed`): the same draws whichever of the two a step takes."""

    def __init__(self, max_batch: int, sampler: "Sampler"):
        """`sampler`'s tables hold a slot for the graphs' padding rows (their slots)."""
        self.sampler, self.vocab_size = sampler, sampler.vocab_size
        device = sampler.settings.device
        f32 = dict(device=device, dtype=torch.float32)
        flags = dict(device=device, dtype=torch.bool)
        self.bias = torch.zeros(max_batch, self.vocab_size, **f32)  # logit_bias; -inf where banned
        # temperature, top_p, top_k, min_p: as the sampler's settings; padding rows greedy
        self.settings = torch.tensor([[1.0, 1.0, 0.0, 0.0]], **f32).repeat(max_batch, 1)
        self.temperature, self.top_p, self.top_k, self.min_p = self.settings.unbind(1)
        self.greedy = torch.ones(max_batch, **flags)
        self.truncated = torch.zeros(max_batch, **flags)
        self.keys = torch.zeros(max_batch, device=device, dtype=torch.long)  # the step's draw keys
        # draws left before each row's min_tokens (its stop tokens banned while > 0), counted down by the draws
        self.left = torch.zeros(max_batch, device=device, dtype=torch.long)

    def kinds(self) -> dict:
        """Each kind of draw (logits (B, rows of the head), the rows' slots (B,) -> tokens (B,)),
        cheapest first: greedy rows alone; rows at a temperature; any of those, truncated (top_k,
        top_p) or with min_p (their probabilities sorted); and any of those, penalized or short of
        their min_tokens."""
        return {"greedy": self.greedy_draw, "sampled": self.sampled_draw, "truncated": self.truncated_draw,
                "penalized": self.penalized_draw}

    @staticmethod
    def kind(params: list[SamplingParams], early: bool = False) -> str:
        """The cheapest kind that draws every row of `params` (`early`: some row is short of its
        min_tokens)."""
        if early or any(p.penalized or p.repetition_penalty != 1 for p in params):
            return "penalized"
        if any(p.truncated or p.min_p > 0 for p in params):
            return "truncated"
        return "greedy" if all(p.greedy for p in params) else "sampled"

    def load(self, slots: list[int], batch: int) -> None:
        """Rows 0..len(slots)-1 take the settings of those slots (padding rows past them: none)."""
        sampler, device = self.sampler, self.bias.device
        params, idx, n = [sampler.params[s] for s in slots], to_device(slots, device), len(slots)
        self.bias[:batch].zero_()
        if any(p.logit_bias for p in params):
            apply_logit_bias(self.bias[:batch], sampler.biases(params, device), in_place=True)
        if any(p.masked for p in params):
            self.bias[:n].masked_fill_(sampler.banned[idx], float("-inf"))
        self.settings[:n] = sampler.settings[idx, :4]
        self.greedy[:batch] = True
        self.greedy[:n] = to_device([p.greedy for p in params], device, torch.bool)
        self.truncated[:n] = to_device([p.truncated for p in params], device, torch.bool)
        self.left[:batch] = 0
        self.left[:n] = to_device([p.min_tokens - sampler.step[s] for s, p in zip(slots, params)], device)

    def greedy_draw(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum, as the sampler's greedy rows."""
        return first_max(logits[:, :self.vocab_size] + self.bias[:len(logits)])

    def sampled_draw(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Greedy rows' first maximum, the others' Gumbel-max draw at their temperature (`draw`'s
        untruncated rows), by `keys`."""
        return self._draw(logits[:, :self.vocab_size] + self.bias[:len(logits)], truncated=False)

    def truncated_draw(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`sampled_draw`, min_p applied, and the truncated rows' draws from their truncated
        distribution (`draw`)."""
        return self._draw(logits[:, :self.vocab_size] + self.bias[:len(logits)], truncated=True)

    def penalized_draw(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`truncated_draw` with the stop tokens of rows short of their min_tokens banned, after the
        repetition, presence and frequency penalties of the rows' slots (identities where off), the
        draws then counted in those slots' tables (`advance`) and against min_tokens."""
        s, B = self.sampler, len(logits)
        x = logits[:, :self.vocab_size] + self.bias[:B]
        x = apply_token_mask(x, s.stops[slots], self.left[:B] > 0)
        x = apply_repetition_penalty(x, s.seen[slots], s.repetition[slots])
        tokens = self._draw(apply_penalties(x, s.counts[slots], s.presence[slots], s.frequency[slots]), truncated=True)
        s.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        s.seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))  # no host scalar in a graph
        self.left[:B] -= 1
        return tokens

    def _draw(self, x: torch.Tensor, truncated: bool) -> torch.Tensor:
        """The rows' tokens from their processed logits x (B, V), as `Sampler.sample` draws them:
        `draw` at each row's temperature (with min_p, top_k and top_p where `truncated`), greedy
        rows' first maximum."""
        B = len(x)
        scaled = x / self.temperature[:B, None]
        if truncated:
            scaled = apply_min_p(scaled, self.min_p[:B])
        noise = hashed_gumbel(self.keys[:B], self.vocab_size)
        drawn = first_max(scaled + noise)
        if truncated:
            cut = draw_truncated(torch.softmax(scaled, dim=-1), self.top_k[:B], self.top_p[:B], noise)
            drawn = torch.where(self.truncated[:B], cut, drawn)
        return torch.where(self.greedy[:B], first_max(x), drawn)
