"""Sampling pieces against direct reference computations."""
import math

import pytest
import torch

from nanogpt.kernels import extension
from worker.logprobs import TokenLogprob, fragment, score
from worker import sampling
from worker.sampling import (Sampler, SamplingParams, apply_penalties, draw_key,
                             draw_truncated, first_max, gumbel_noise, truncate_sorted)


@pytest.mark.parametrize("hashed", [False, True])  # a CPU's generator / any other device's
def test_draw_keys_and_noise_depend_on_seed_choice_and_step_only(hashed):
    keys = [draw_key(s, c, t) for s, c, t in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2**64 - 1, 7, 100), (-1, 7, 100)]]
    assert len(set(keys[:5])) == 5 and keys[4] == keys[5]  # seeds are taken modulo 2**64
    assert all(0 <= k < 2**63 for k in keys)
    alone = gumbel_noise([keys[2]], 1000, "cpu", hashed)
    batch = gumbel_noise(keys[:4], 1000, "cpu", hashed)
    assert torch.equal(batch[2], alone[0]) and not torch.equal(batch[1], batch[2])
    assert torch.isfinite(batch).all()
    # standard Gumbel: mean = Euler's constant, variance = pi^2 / 6
    assert abs(batch.mean().item() - 0.5772) < 0.05 and abs(batch.var().item() - math.pi ** 2 / 6) < 0.1


def test_hashed_noise_is_gumbel_and_uncorrelated():
    """The device generator's noise against the Gumbel CDF (Kolmogorov-Smirnov over 1.6M draws), and
    no correlation between neighbouring token ids or between the rows of consecutive steps."""
    keys = [draw_key(42, 0, t) for t in range(32)]
    g = gumbel_noise(keys, 50257, "cpu", hashed=True).double()
    x = g.flatten().sort().values
    cdf = torch.exp(-torch.exp(-x))
    n = len(x)
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max().item()
    assert ks < 1.63 / math.sqrt(n)  # the 1% critical value
    u = torch.exp(-torch.exp(-g))  # back to uniforms
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.005
    # every token wins as often: the argmax of pure noise is uniform over the ids
    wins = torch.bincount(gumbel_noise([draw_key(7, 0, t) for t in range(4000)], 8, "cpu", hashed=True).argmax(-1), minlength=8)
    assert wins.min() > 400 and wins.max() < 600


def test_penalties_follow_openais_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 6)
    counts = torch.tensor([[0, 1, 3, 0, 0, 2], [1, 0, 0, 0, 5, 0]], dtype=torch.float32)
    presence, frequency = torch.tensor([0.5, -1.0]), torch.tensor([0.25, 2.0])
    got = apply_penalties(logits, counts, presence, frequency)
    for b in range(2):
        for j in range(6):
            c = counts[b, j].item()
            want = logits[b, j].item() - c * frequency[b].item() - (1.0 if c > 0 else 0.0) * presence[b].item()
            assert got[b, j].item() == pytest.approx(want, abs=1e-6)


def test_truncate_sorted_top_k_then_top_p():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    got = truncate_sorted(p, torch.tensor([0, 2, 3]), torch.tensor([0.65, 1.0, 0.42]))
    # row 0: top_p 0.65 keeps 0.4 + 0.3 (0.4 alone is short of it)
    # row 1: top_k 2 keeps 0.4, 0.3; row 2: top_k 3, then top_p over (4, 3, 2)/9: 4/9 >= 0.42 alone
    want = torch.tensor([[0.4, 0.3, 0, 0], [0.4, 0.3, 0, 0], [0.4, 0, 0, 0]])
    assert torch.allclose(got, want, atol=1e-6)
    # given only the best tokens of a distribution, top_p still counts against the whole of it
    head = torch.tensor([[0.3, 0.2, 0.1]])
    assert torch.allclose(truncate_sorted(head, torch.tensor([0]), torch.tensor([0.55])), torch.tensor([[0.3, 0.2, 0.1]]))


def test_top_p_0_keeps_the_most_likely_token_alone():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    got = truncate_sorted(p, torch.tensor([0, 3]), torch.tensor([0.0, 0.0]))
    assert torch.equal(got, torch.tensor([[0.4, 0, 0, 0], [0.25, 0, 0, 0]]))
    # through the sampler, at temperature 1 and with seeds: the argmax of every row, even flat ones
    torch.manual_seed(5)
    R, V = 16, 500
    logits = torch.randn(R, V) * torch.tensor([0.01, 0.1, 1.0, 5.0]).repeat(R // 4)[:, None]
    sampler = Sampler(R, V)
    for slot in range(R):
        sampler.assign(slot, SamplingParams(temperature=1.0, top_p=0.0, seed=slot), choice=0)
    assert torch.equal(sampler.sample(logits, list(range(R))), logits.argmax(-1))


def test_truncated_draw_from_candidates_equals_a_full_sort():
    torch.manual_seed(4)
    V, R = 3000, 64
    scale = torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(R // 4)[:, None]  # flat to peaked rows
    probs = torch.softmax(torch.randn(R, V) * scale, -1)
    top_k = torch.tensor([0, 0, 5, 0, 300, 1000, 0, 40]).repeat(R // 8)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.8, 0.95, 0.3, 1.0]).repeat(R // 8)
    noise = gumbel_noise(list(range(R)), V, "cpu")
    p_sorted, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kept = torch.zeros(R, V, dtype=torch.bool).scatter(1, order, truncate_sorted(p_sorted, top_k, top_p) > 0)
    want = torch.where(kept, probs.log() + noise, -torch.inf).argmax(-1)
    assert torch.equal(draw_truncated(probs, top_k, top_p, noise), want)
    assert torch.equal(draw_truncated(probs, top_k, top_p, noise, full_sort=True), want)  # a GPU's way
    fits = torch.where(top_k > 0, top_k <= 256, p_sorted[:, :256].sum(-1) >= top_p)
    assert fits.any() and not fits.all()  # both ways were taken


def make_sampler(rows, V=8):
    s = Sampler(len(rows), V)
    for slot, params in enumerate(rows):
        s.assign(slot, params, choice=slot)
    return s


def test_greedy_takes_argmax_after_bias_and_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert make_sampler([SamplingParams(temperature=0)], 4).sample(logits, [0]).tolist() == [1]
    biased = make_sampler([SamplingParams(temperature=0, logit_bias={3: 10.0})], 4)
    assert biased.sample(logits, [0]).tolist() == [3]
    banned = make_sampler([SamplingParams(temperature=0, logit_bias={1: -100.0})], 4)
    assert banned.sample(logits, [0]).tolist() == [2]
    # frequency penalty 0.6: token 1 (3.0) keeps winning over token 2 (2.0) while used at most once
    s = make_sampler([SamplingParams(temperature=0, frequency_penalty=0.6)], 4)
    assert [s.sample(logits, [0]).item() for _ in range(3)] == [1, 1, 2]


def test_history_counts_for_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    s = Sampler(1, 4)
    s.assign(0, SamplingParams(temperature=0, frequency_penalty=0.6), choice=0, history=[1, 1])
    assert s.sample(logits, [0]).tolist() == [2]  # 3 - 1.2 = 1.8 < 2
    s.assign(0, SamplingParams(temperature=0, presence_penalty=1.5), choice=0, history=[1])
    assert s.sample(logits, [0]).tolist() == [2]  # 3 - 1.5 < 2
    assert s.sample(logits, [0]).tolist() == [1]  # 3 - 1.5 = 1.5 > 2 - 1.5
    assert s.counts[0, :3].tolist() == [0, 2, 1]  # history 1, then 2, then 1


def test_adjusted_logits_match_direct_computation():
    torch.manual_seed(1)
    V = 10
    logits = torch.randn(3, V)
    params = [SamplingParams(presence_penalty=0.3, frequency_penalty=0.7, logit_bias={2: 5.0, 9: -100.0}),
              SamplingParams(), SamplingParams(frequency_penalty=-0.5)]
    s = Sampler(3, V)
    history = [[2, 2, 4], [1], [9, 9, 9]]
    for slot, (p, h) in enumerate(zip(params, history)):
        s.assign(slot, p, choice=slot, history=h)
    got = s.adjusted_logits(logits, [0, 1, 2])
    want = logits.clone()
    for b, (p, h) in enumerate(zip(params, history)):
        for j in range(V):
            c = h.count(j)
            want[b, j] += p.logit_bias.get(j, 0.0) - c * p.frequency_penalty - (c > 0) * p.presence_penalty
    assert torch.allclose(got, want, atol=1e-5)


def test_logits_are_overwritten_only_when_the_caller_allows_it():
    """logit_bias adds into the raw logits only `in_place` (no row of the step reports logprobs,
    which are the raw model's); the tokens are the same either way."""
    torch.manual_seed(2)
    logits = torch.randn(4, 10)
    params = [SamplingParams(temperature=0, logit_bias={7: 50.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={3: -100.0, 5: 40.0}), SamplingParams(temperature=0.8, seed=1)]
    want = logits.clone()
    want[0, 7] += 50.0
    want[2, 3] -= 100.0
    want[2, 5] += 40.0
    kept = logits.clone()
    tokens = make_sampler(params, 10).sample(kept, [0, 1, 2, 3])
    assert torch.equal(kept, logits)  # untouched
    overwritten = logits.clone()
    assert torch.equal(make_sampler(params, 10).sample(overwritten, [0, 1, 2, 3], in_place=True), tokens)
    assert torch.equal(overwritten, want) and tokens[:3].tolist() == [7, int(logits[1].argmax()), 5]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=3),
                                    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
                                    SamplingParams(top_k=3, seed=3)])
def test_draws_follow_the_distribution(params):
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    n = 4000
    s = Sampler(n, 5)
    for slot in range(n):
        s.assign(slot, params, choice=slot)
    tokens = s.sample(logits.expand(n, 5).contiguous(), list(range(n)))
    freq = torch.bincount(tokens, minlength=5).double() / n
    p = torch.softmax(logits / params.temperature, -1).double()
    p_sorted, order = p.sort(descending=True)
    kept = truncate_sorted(p_sorted[None].float(), torch.tensor([params.top_k]), torch.tensor([params.top_p]))[0]
    want = torch.zeros(5, dtype=torch.float64)
    want[order] = kept.double() / kept.sum()
    assert (freq - want).abs().max() < 0.03
    assert freq[want == 0].sum() == 0


def test_draw_depends_only_on_the_row():
    torch.manual_seed(2)
    V = 50
    alone_logits = torch.randn(1, V) * 3
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = Sampler(1, V)
    alone.assign(0, p, choice=4)
    want = [alone.sample(alone_logits, [0]).item() for _ in range(20)]

    others = [SamplingParams(temperature=0), SamplingParams(seed=5), SamplingParams(top_k=2, seed=1, presence_penalty=1.0),
              SamplingParams(temperature=2.0, logit_bias={0: 50.0}, seed=0)]
    busy = Sampler(8, V)
    for slot, q in zip([0, 1, 5, 7], others):
        busy.assign(slot, q, choice=0)
    busy.assign(3, p, choice=4)
    got = []
    for _ in range(20):
        logits = torch.randn(5, V) * 3
        logits[2] = alone_logits[0]
        got.append(busy.sample(logits, [0, 1, 3, 5, 7])[2].item())
    assert got == want
    assert len(set(want)) > 1  # the step counter moves the draw


def test_score_is_log_softmax_of_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 30)
    tokens = torch.randint(0, 30, (2, 4))
    chosen, top_lp, top_ids = score(logits, tokens, 3)
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, lp.gather(-1, tokens[..., None])[..., 0])
    assert torch.equal(top_ids, lp.topk(3).indices) and torch.allclose(top_lp, lp.topk(3).values)
    assert score(logits, tokens, 0)[1].shape == (2, 4, 0)


def test_fragment_top_dicts_hold_top_n_plus_chosen():
    name = {1: "a", 2: "b", 3: "c"}.get
    entries = [TokenLogprob(3, -2.5, [(1, -0.1), (2, -1.0)], 7), TokenLogprob(1, -0.2, [(1, -0.2)], 8),
               TokenLogprob(2, None, None, 0), TokenLogprob(2, -float("inf"), [], 9)]
    f = fragment(entries, name)
    assert f == {"tokens": ["c", "a", "b", "b"], "token_logprobs": [-2.5, -0.2, None, -9999.0],
                 "top_logprobs": [{"a": -0.1, "b": -1.0, "c": -2.5}, {"a": -0.2}, None, {"b": -9999.0}],
                 "text_offset": [7, 8, 0, 9]}


# ---- the logits processors through the sampler, row by row against transformers ----

def test_processors_in_a_mixed_batch_match_transformers_row_by_row():
    from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                        NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor)
    V = 30
    prompt, output = [4, 5, 6, 4, 5], [7, 4, 5]
    rows = [
        (SamplingParams(temperature=0), []),
        (SamplingParams(temperature=0, repetition_penalty=1.7), [RepetitionPenaltyLogitsProcessor(1.7)]),
        (SamplingParams(temperature=0, no_repeat_ngram_size=2), [NoRepeatNGramLogitsProcessor(2)]),
        (SamplingParams(temperature=0, bad_words=((9,), (4, 5, 11), (5, 12)), stop_ids=(0,)),
         [NoBadWordsLogitsProcessor([[9], [4, 5, 11], [5, 12]], eos_token_id=0)]),
        (SamplingParams(temperature=0, stop_ids=(0, 3), min_tokens=5),
         [MinNewTokensLengthLogitsProcessor(len(prompt), 5, [0, 3])]),
        (SamplingParams(temperature=0, stop_ids=(0, 3), min_tokens=3),  # reached: nothing banned
         [MinNewTokensLengthLogitsProcessor(len(prompt), 3, [0, 3])]),
        (SamplingParams(temperature=0, repetition_penalty=0.8, no_repeat_ngram_size=3, bad_words=((2,),)),
         [NoBadWordsLogitsProcessor([[2]], eos_token_id=0), NoRepeatNGramLogitsProcessor(3),
          RepetitionPenaltyLogitsProcessor(0.8)]),
    ]
    sampler = Sampler(len(rows), V)
    for slot, (params, _) in enumerate(rows):
        sampler.assign(slot, params, choice=0, history=output, prompt=prompt)
    torch.manual_seed(0)
    logits = torch.randn(len(rows), V) * 3
    got = sampler.adjusted_logits(logits, list(range(len(rows))), [output] * len(rows))
    ids = torch.tensor([prompt + output])
    for b, (_, procs) in enumerate(rows):
        want = LogitsProcessorList(procs)(ids, logits[b:b + 1].clone())[0]
        assert torch.equal(got[b], want), b
    assert torch.isinf(got[3, [9, 11, 12]]).all() and torch.isfinite(got[3, 10])  # the output ends in 4 5
    assert torch.isinf(got[4, [0, 3]]).all() and torch.isfinite(got[5]).all()


def test_allowed_token_ids_and_the_counts_that_follow_draws():
    V = 12
    sampler = Sampler(2, V)
    sampler.assign(0, SamplingParams(temperature=1.0, seed=3, allowed_token_ids=(2, 7)), choice=0)
    sampler.assign(1, SamplingParams(temperature=0, repetition_penalty=2.0), choice=0, prompt=[1])
    seen = set()
    for _ in range(40):
        tokens = sampler.sample(torch.zeros(2, V), [0, 1], [[], []])
        seen.add(tokens[0].item())
    assert seen == {2, 7}
    # greedy row 1 with flat logits: repetition_penalty does not move zeros; it took token 0 each time
    assert sampler.seen[1].nonzero().flatten().tolist() == [0, 1] and sampler.step[1] == 40


def test_min_p_draws_only_likely_enough_tokens():
    V = 50
    logits = torch.linspace(0, -6, V)[None].repeat(200, 1)  # probabilities fall by e^-6 across the vocabulary
    sampler = Sampler(200, V)
    for slot in range(200):
        sampler.assign(slot, SamplingParams(temperature=1.0, min_p=0.2, seed=slot), choice=0)
    tokens = sampler.sample(logits, list(range(200)))
    kept = (torch.softmax(logits[0], -1) >= 0.2 * torch.softmax(logits[0], -1).max()).sum().item()
    assert tokens.max().item() < kept and len(set(tokens.tolist())) == kept  # all of them, none beyond


def test_fork_copies_a_slots_state_to_another():
    V = 10
    sampler = Sampler(3, V)
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, no_repeat_ngram_size=2)
    for slot in range(3):
        sampler.assign(slot, params, choice=0, prompt=[1, 2])
    sampler.sample(torch.eye(V)[[3, 4, 5]] * 5, [0, 1, 2], [[], [], []])
    sampler.fork([1, 2], [0, 0])  # beams 1 and 2 now continue beam 0 (token 3)
    assert torch.equal(sampler.seen[2], sampler.seen[0]) and torch.equal(sampler.counts[1], sampler.counts[0])
    sampler.ngrams[1].push(3)
    assert sampler.ngrams[0].tokens == [1, 2]  # copies, not shared


def test_first_max_is_argmax_ties_and_infinities_included():
    x = torch.randn(6, 50257)
    x[1, [3, 9000, 40000]] = x[1].max() + 1  # a tie: the first of them
    x[2] = -torch.inf                        # nothing allowed: index 0, as argmax says
    x[3, 100:] = -torch.inf
    x[4] = 0.5                               # all equal
    x[5, 50256] = torch.inf
    assert torch.equal(first_max(x), x.argmax(-1))
    assert first_max(x)[[1, 2, 4, 5]].tolist() == [3, 0, 0, 50256]


@pytest.mark.skipif(not extension.available(), reason="the project's kernels are not built here (no compiler or vector width)")
def test_the_own_first_max_kernel_gives_the_indices_torchs_max_gives():
    own = extension.extension()
    for width in (1, 5, 15, 16, 17, 31, 33, 50257):
        x = torch.randn(37, width)
        x[1] = 0.25                                    # all equal: the first
        x[2, -1] = 9.0                                 # the tail past the last whole vector
        x[3] = -torch.inf
        x[4, width // 2] = torch.nan                   # a NaN is the maximum, as torch's max says
        x[5, -1], x[5, 0] = torch.nan, torch.inf       # ... even after an infinity
        x[6, [width // 3, width - 1]] = 7.0            # a tie: the first of them
        x[7, [0, width // 2]] = torch.nan              # the first NaN
        x[8, :] = torch.inf
        apart = torch.randn(11, width + 7)[:, :width]  # rows that are not next to each other
        apart[2, width // 2] = 5.0
        for m in (x, apart):
            assert torch.equal(own.first_max(m), m.max(-1).indices), width
            assert torch.equal(first_max(m), m.max(-1).indices), width  # the sampler's, through the kernel
    assert own.first_max(torch.empty(0, 9)).shape == (0,)
    assert extension.loaded() is own


def test_what_a_slot_s_last_request_left_does_not_reach_the_next():
    """A slot's banned tokens, counts, seen tokens and stop tokens are written only for requests that
    use them; the next request of the slot, beside rows that use each, samples as on a fresh slot."""
    torch.manual_seed(2)
    V = 50
    logits = torch.randn(3, V)
    best = logits[0].argmax().item()
    old = SamplingParams(temperature=0, allowed_token_ids=((best + 1) % V,), repetition_penalty=1.5,
                         presence_penalty=2.0, frequency_penalty=1.0, min_tokens=3, stop_ids=(best,))
    others = [SamplingParams(temperature=0, bad_words=((best,),)),  # banned tokens applied to every row
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2, stop_ids=(1,))]
    used = Sampler(3, V)
    used.assign(0, old, choice=0, prompt=[best])
    for slot, params in enumerate(others, 1):
        used.assign(slot, params, choice=0, prompt=[2])
    for _ in range(2):
        used.sample(logits.clone(), [0, 1, 2])
    fresh = Sampler(3, V)
    for sampler in (used, fresh):
        sampler.assign(0, SamplingParams(temperature=0), choice=0, prompt=[best])
        for slot, params in enumerate(others, 1):
            sampler.assign(slot, params, choice=0, prompt=[2])
    got, want = used.sample(logits.clone(), [0, 1, 2]), fresh.sample(logits.clone(), [0, 1, 2])
    assert got[0].item() == best and torch.equal(got, want)
    assert torch.equal(used.adjusted_logits(logits.clone(), [0, 1, 2]), fresh.adjusted_logits(logits.clone(), [0, 1, 2]))


def test_draw_keys_of_a_batch_are_splitmix64_of_seed_choice_and_step():
    """The batch's keys, against splitmix64 written out in Python's integers."""
    import random

    mask = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    r = random.Random(0)
    rows = [(r.randrange(-2**63, 2**64), r.randrange(100), r.randrange(5000)) for _ in range(500)] + [(-1, 7, 100)]
    want = [mix((mix((mix(s & mask) + c) & mask) + t) & mask) >> 1 for s, c, t in rows]
    assert sampling.draw_keys(*map(list, zip(*rows))) == want
    assert draw_key(*rows[0]) == want[0]


def test_the_graphs_draws_take_nothing_from_the_host(monkeypatch):
    """Every kind of GraphDraws' draw, as a GPU records it in a CUDA graph (truncated rows fully
    sorted, as off a CPU), runs no operator that waits for the device or gives a shape that depends
    on the data (.item(), nonzero, masked_select, ...): either would break the graph's capture.
    Checked by the operators the bodies dispatch, on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    V, B = 300, 4
    sampler = Sampler(B + 1, V)
    for slot, params in enumerate([SamplingParams(temperature=0.0, logit_bias={3: 2.0}),
                                   SamplingParams(temperature=0.8, seed=1, allowed_token_ids=tuple(range(50))),
                                   SamplingParams(temperature=1.1, top_p=0.8, top_k=9, min_p=0.05, seed=2),
                                   SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2)]):
        sampler.assign(slot, params, 0, [5, 6], [7])
    draws = sampling.GraphDraws(B, sampler)
    draws.load(list(range(B)), B)
    truncated = sampling.draw_truncated
    monkeypatch.setattr(sampling, "draw_truncated", lambda *a: truncated(*a, full_sort=True))
    waits = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2",
             "item", "allclose", "index_select_backward", "repeat_interleave"}
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits, slots = torch.randn(B, V + 7), torch.arange(B)
    for kind, draw in draws.kinds().items():
        seen.clear()
        with Ops():
            tokens = draw(logits, slots)
        assert seen and not waits & set(seen), (kind, waits & set(seen))
        assert tokens.shape == (B,) and bool((tokens < V).all()), kind
