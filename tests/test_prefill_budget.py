"""The prefill budget: how many prompt tokens a step feeds while other sequences decode, from the
costs it measured (worker/prefill_budget.py), alone and inside the engine."""
from __future__ import annotations

import pytest

from test_engine import PROMPTS, hf, hf_greedy, job, make_engine, model, tok  # noqa: F401 (fixtures)
from worker.prefill_budget import PrefillBudget


def test_unmeasured_or_idle_steps_feed_the_whole_chunk():
    budget = PrefillBudget(256)
    assert budget.tokens(decoding=4) == 256  # nothing measured yet
    budget.observe(decoding=4, prefilled=0, seconds=0.04)
    assert budget.tokens(decoding=4) == 256  # the prefill cost is not known yet
    budget.observe(decoding=0, prefilled=100, seconds=0.1)
    assert budget.tokens(decoding=0) == 256  # nobody decodes: nobody waits but the prompt


def test_the_budget_holds_prefill_to_a_share_of_the_decode_step():
    budget = PrefillBudget(256, share=0.5)
    budget.observe(decoding=4, prefilled=0, seconds=0.040)  # a decode step: 40 ms
    budget.observe(decoding=0, prefilled=100, seconds=0.100)  # 1 ms a prefill token
    assert budget.decode_s == pytest.approx(0.040) and budget.token_s == pytest.approx(0.001)
    assert budget.tokens(decoding=4) == 20  # 0.5 × 40 ms / 1 ms
    # a step of both: what is left after the decode step is the prefill's, per token
    budget.observe(decoding=4, prefilled=20, seconds=0.040 + 20 * 0.003)
    assert budget.token_s == pytest.approx(0.001 + 0.25 * (0.003 - 0.001))
    assert budget.tokens(decoding=4) == 16 > int(0.5 * 0.040 / budget.token_s)  # never below min_tokens
    budget.observe(decoding=8, prefilled=0, seconds=0.200)  # more sequences: a dearer decode step
    assert budget.decode_s == pytest.approx(0.040 + 0.25 * 0.160)
    assert budget.tokens(decoding=8) == int(0.5 * budget.decode_s / budget.token_s) == 26


def test_the_budget_stays_within_its_bounds():
    budget = PrefillBudget(64, share=0.5, min_tokens=16)
    budget.observe(decoding=1, prefilled=0, seconds=0.001)
    budget.observe(decoding=0, prefilled=10, seconds=1.0)  # prefill far dearer than a decode step
    assert budget.tokens(decoding=1) == 16  # a long prompt still moves
    budget = PrefillBudget(64, share=0.5)
    budget.observe(decoding=1, prefilled=0, seconds=10.0)
    budget.observe(decoding=0, prefilled=10, seconds=0.001)
    assert budget.tokens(decoding=1) == 64
    assert PrefillBudget(4).tokens(decoding=1) == 4 and PrefillBudget(4).min_tokens == 4
    with pytest.raises(ValueError):
        PrefillBudget(64, share=0)


def test_the_engine_feeds_a_long_prompt_within_its_budget_while_others_decode(model, tok, hf):
    """A request decodes; a long prompt arrives: once the costs are measured, each step feeds at most
    the budget's tokens, the running request never stops drawing, and both answers stay exact."""
    engine, _ = make_engine(model, tok, max_batch=4, prefill_chunk=64, prefill_share=0.25)
    fed, budget = [], engine.scheduler.budget
    prefill = engine.runner.prefill

    def recording(chunks):
        fed.append((sum(n for _, n in chunks), budget.tokens(len(engine.scheduler.decoding))))
        return prefill(chunks)

    engine.runner.prefill = recording
    running = engine.submit(job(tok, [PROMPTS[0]], max_tokens=40))
    for _ in range(6):
        engine.step()  # its prefill, then decode steps: both costs measured
    assert budget.decode_s > 0 and budget.token_s > 0
    long_prompt = tok.encode(" ".join(PROMPTS) * 3)[:100]
    late = engine.submit(job(tok, [long_prompt], max_tokens=4))
    while not (running.done and late.done):
        engine.step()
    during = [(n, allowed) for n, allowed in fed[6:] if n]
    assert len(during) > 1 and all(n <= allowed for n, allowed in during)  # in several chunks, each within budget
    assert sum(n for n, _ in during) == len(long_prompt)
    for handle, prompt, count in ((running, tok.encode(PROMPTS[0]), 40), (late, long_prompt, 4)):
        assert handle.result()["choices"][0]["text"] == tok.decode(hf_greedy(hf, prompt, count)[0])

