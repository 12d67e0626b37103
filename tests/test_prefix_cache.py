"""Automatic prefix caching (worker/prefix_cache.py): a prompt whose prefix a free slot still holds
starts its prefill after it, and gets the answer a fresh prefill gives (float32: the same greedy
tokens, logprobs within 1e-4), with the reused tokens in `usage.prompt_tokens_details`; scored
contexts (echo with logprobs, prompt_logprobs) reuse the scores recorded with them; cancelled and
faulted requests leave no wrong entry; eviction is least-recently-used; it can be turned off."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from test_engine import job, make_engine, model, tok  # noqa: F401 (fixtures)
from test_families import family, make_engine as family_engine  # noqa: F401 (fixtures)
from worker.errors import EngineFault, RequestCancelled

CONTEXT = ("Question: which of these animals lives in the sea, and which on land? Think of the whale, the "
           "camel and the octopus before you answer.")


def cached(result) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_same(got: dict, want: dict) -> None:
    """The same choices as a fresh prefill gives: text, tokens, logprobs within 1e-4."""
    for g, w in zip(got["choices"], want["choices"], strict=True):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])
        if w.get("logprobs"):
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            assert_close(torch.tensor([v or 0.0 for v in g["logprobs"]["token_logprobs"]]),
                         torch.tensor([v or 0.0 for v in w["logprobs"]["token_logprobs"]]), atol=1e-4, rtol=0)
            for gt, wt in zip(g["logprobs"]["top_logprobs"], w["logprobs"]["top_logprobs"]):
                assert (gt is None) == (wt is None)
                if gt is not None:
                    assert gt.keys() == wt.keys() and all(abs(gt[t] - wt[t]) < 1e-4 for t in wt)
        if w.get("prompt_logprobs"):
            for gp, wp in zip(g["prompt_logprobs"][1:], w["prompt_logprobs"][1:], strict=True):
                assert gp.keys() == wp.keys()
                assert all(gp[t]["rank"] == wp[t]["rank"] and abs(gp[t]["logprob"] - wp[t]["logprob"]) < 1e-4 for t in wp)


def fresh(model, tok, j) -> dict:
    return make_engine(model, tok, prefix_caching=False)[0].generate(j)


def test_a_shared_prefix_is_reused_and_gives_a_fresh_prefills_answer(model, tok):
    engine, _ = make_engine(model, tok, prefill_chunk=16)
    first = engine.generate(job(tok, [CONTEXT + " The whale"], max_tokens=6, logprobs=2))
    assert cached(first) == 0
    before = engine.stats()["prompt_tokens"]
    second = job(tok, [CONTEXT + " The camel lives"], max_tokens=6, logprobs=2)
    got = engine.generate(second)
    shared = len(tok.encode(CONTEXT + " The"))
    assert shared - 2 <= cached(got) <= len(second.prompts[0]) - 1
    assert engine.stats()["prompt_tokens"] - before == len(second.prompts[0]) - cached(got)
    assert engine.stats()["prefix_cache_hit_tokens"] == cached(got)
    assert_same(got, fresh(model, tok, second))


def test_loglikelihood_requests_reuse_the_context_and_its_scores(model, tok):
    """lm-evaluation-harness's loglikelihood requests: echo, logprobs, max_tokens 0, one per choice
    of a question, all starting with its context. The context's scores come from the cache."""
    engine, _ = make_engine(model, tok, prefill_chunk=16)
    choices = [" the whale", " the camel", " the octopus", " the whale and the octopus"]
    jobs = [job(tok, [CONTEXT + c], echo=True, logprobs=1, max_tokens=0) for c in choices]
    results = [engine.generate(j) for j in jobs]
    context_len = len(tok.encode(CONTEXT))
    assert cached(results[0]) == 0 and all(cached(r) >= context_len - 1 for r in results[1:])
    for j, got in zip(jobs, results):
        assert_same(got, fresh(model, tok, j))
    # the scores of a context scored with logprobs=1 serve a request that asks for 5 alternatives
    wide = job(tok, [CONTEXT + choices[1]], echo=True, logprobs=5, max_tokens=2)
    got = engine.generate(wide)
    assert cached(got) >= context_len and len(got["choices"][0]["logprobs"]["top_logprobs"][5]) >= 5
    assert_same(got, fresh(model, tok, wide))


def test_prompt_logprobs_reuse_only_scores_with_ranks(model, tok):
    engine, _ = make_engine(model, tok)
    engine.generate(job(tok, [CONTEXT + " A"], echo=True, logprobs=1, max_tokens=0))  # scores without ranks
    ranked = job(tok, [CONTEXT + " B"], prompt_logprobs=2, max_tokens=1)
    got = engine.generate(ranked)
    assert cached(got) == 0  # the record has no ranks: the context is scored again
    assert_same(got, fresh(model, tok, ranked))
    again = job(tok, [CONTEXT + " C"], prompt_logprobs=2, max_tokens=1)
    got = engine.generate(again)
    assert cached(got) >= len(tok.encode(CONTEXT)) - 1
    assert_same(got, fresh(model, tok, again))


def test_sampled_choices_beam_search_and_an_identical_prompt_reuse_it_too(model, tok):
    engine, _ = make_engine(model, tok)
    engine.generate(job(tok, [CONTEXT], max_tokens=4))
    for reuse in (job(tok, [CONTEXT], max_tokens=8, temperature=1.0, seed=3, n=3, logprobs=1),
                  job(tok, [CONTEXT + " Yes"], max_tokens=5, use_beam_search=True, n=2, best_of=3)):
        got = engine.generate(reuse)
        assert cached(got) > 0, reuse
        assert_same(got, fresh(model, tok, reuse))
    # contrastive search needs its context's hidden states, and a context scored needs its scores:
    # neither reuses what a plain request left
    for whole in (job(tok, [CONTEXT], max_tokens=5, penalty_alpha=0.6, top_k=3),
                  job(tok, [CONTEXT], max_tokens=5, echo=True, logprobs=2)):
        got = engine.generate(whole)
        assert cached(got) == 0
        assert_same(got, fresh(model, tok, whole))


def test_a_cancelled_prefill_leaves_what_it_wrote_and_a_fault_leaves_nothing(model, tok):
    engine, _ = make_engine(model, tok, prefill_chunk=8)
    long = job(tok, [CONTEXT], max_tokens=4)
    handle = engine.submit(long)
    engine.step()
    engine.step()  # two chunks of 8 fed
    engine._cancel(long.id)
    engine.step()
    with pytest.raises(RequestCancelled):
        handle.result(timeout=1)
    again = job(tok, [CONTEXT], max_tokens=4)
    got = engine.generate(again)
    assert cached(got) == 16  # what the cancelled prefill had fed, and no more
    assert_same(got, fresh(model, tok, again))

    engine, _ = make_engine(model, tok, prefill_chunk=8)
    engine.generate(job(tok, [CONTEXT], max_tokens=2))
    forward, failed = engine.runner.forward, []

    def fails_once(*args):
        if not failed:
            failed.append(True)
            raise RuntimeError("a step that fails halfway")
        return forward(*args)

    engine.runner.forward = fails_once
    with pytest.raises(EngineFault):
        engine.generate(job(tok, [CONTEXT + " Then"], max_tokens=2))
    got = engine.generate(job(tok, [CONTEXT + " Then"], max_tokens=2))
    assert cached(got) == 0  # the slot the faulted step used holds nothing the cache trusts


def test_the_slot_released_longest_ago_is_evicted_first(model, tok):
    engine, _ = make_engine(model, tok, max_batch=2)
    a, b, c = (CONTEXT + " A", "Once upon a time there was a camel in the desert, and it was", "Hello world, hello")
    for prompt in (a, b, c):  # c takes a's slot, released longest ago
        engine.generate(job(tok, [prompt], max_tokens=2))
    assert cached(engine.generate(job(tok, [b + " thirsty"], max_tokens=2))) > 0
    assert cached(engine.generate(job(tok, [a + "nd"], max_tokens=2))) == 0


def test_turned_off_nothing_is_reused(model, tok):
    engine, _ = make_engine(model, tok, prefix_caching=False)
    engine.generate(job(tok, [CONTEXT], max_tokens=2))
    assert cached(engine.generate(job(tok, [CONTEXT], max_tokens=2))) == 0
    assert engine.stats()["prefix_cache_queried_tokens"] == 0


def test_every_family_reuses_a_prefix_exactly(family):
    """GPT-Neo's local attention (a window shorter than the prefix), GPT-J's and GPT-NeoX's rotary
    positions, OPT's learned ones: a reused prefix gives the fresh prefill's greedy tokens and logprobs."""
    tok = family.tok
    prompt = tok.encode(CONTEXT)[:24]
    engine, _ = family_engine(family.ours, tok, max_batch=2, prefill_chunk=5)
    engine.generate(job(tok, [prompt], echo=True, logprobs=1, max_tokens=3))  # its context scored
    for reuse in (job(tok, [prompt + prompt[5:9]], echo=True, logprobs=1, max_tokens=2),
                  job(tok, [prompt + prompt[:4]], max_tokens=6, logprobs=2)):
        got = engine.generate(reuse)
        assert cached(got) >= 20
        want, _ = family_engine(family.ours, tok, max_batch=2, prefill_chunk=5, prefix_caching=False)
        assert_same(got, want.generate(reuse))


def test_a_prompt_finds_its_prefix_among_the_records_sharing_its_first_token():
    """Records are looked up by their first token; a slot taken and released again is found by what
    it holds now, never by what it held."""
    from worker.prefix_cache import PrefixCache

    cache = PrefixCache()
    for slot in range(200):
        cache.release(slot, [slot % 7, slot, slot + 1, 5])  # slot s holds [s % 7, s, s + 1, 5]
    assert cache.find([9, 10, 11, 5, 9], None, False) is None  # no record starts with 9
    match = cache.find([3, 101, 102, 5, 9], None, False)
    assert (match.slot, match.reused) == (101, 4)
    cache.take(101)
    assert cache.find([3, 101, 102, 5, 9], None, False).reused == 1  # another record starting with 3
    cache.release(101, [8, 1, 2])
    assert cache.find([3, 101, 102, 5, 9], None, False).slot != 101
    match = cache.find([8, 1, 2, 4], None, False)
    assert (match.slot, match.reused) == (101, 3)
    cache.release(101, [])  # released holding nothing
    assert cache.find([8, 1, 2, 4], None, False) is None
