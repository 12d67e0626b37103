"""Contrastive search (penalty_alpha with top_k) in the engine against a direct implementation of the
paper's formula over transformers' models (transformers 5 no longer ships it): random-weight GPT-2
and other families' checkpoints in float32, alone and while other requests share the batch; the
serving forward's last hidden state against transformers' hidden_states[-1] for every family; and
the engine's handling of it (logprobs, end-of-text, cancellation, resume, too many candidates)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import FAMILY_CONFIGS
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from nanogpt.runtime.kv_cache import KVCache
from test_engine import Sink, hf, job, model, run_all, tok  # noqa: F401 (fixtures)
from worker.engine import Engine
from worker.errors import EngineError, RequestCancelled

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy", "Once upon a time, in a land far away,"]
SEARCHES = [(0.6, 4), (0.3, 2), (0.9, 3)]  # penalty_alpha, top_k


def reference(hf, prompt: list[int], alpha: float, k: int, max_new: int, vocab: int, eos: int | None = None):
    """Su et al.'s contrastive search, plainly: every step, the k likeliest next tokens v, each
    scored (1 - alpha) p(v) - alpha max_j cos(h_v, h_j) with full forwards of the context and of
    context + v, h the last layer's hidden state after the final norm (hidden_states[-1]).
    Returns the tokens and the log-softmax of the distribution each was chosen from."""
    tokens, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_new):
            context = hf(torch.tensor([tokens]), output_hidden_states=True)
            logits = context.logits[0, -1, :vocab].float()
            top_p, top_ids = torch.softmax(logits, -1).topk(k)
            earlier = context.hidden_states[-1][0]  # (len(tokens), width)
            scores = []
            for p, v in zip(top_p.tolist(), top_ids.tolist()):
                h = hf(torch.tensor([tokens + [v]]), output_hidden_states=True).hidden_states[-1][0, -1]
                scores.append((1 - alpha) * p - alpha * F.cosine_similarity(h[None], earlier, dim=-1).max().item())
            v = top_ids[max(range(k), key=scores.__getitem__)].item()
            tokens.append(v)
            out.append(v)
            logprobs.append(torch.log_softmax(logits, -1))
            if v == eos:
                break
    return out, logprobs


def token_ids(sink, job_id) -> list[int]:
    return [t for _, d in sink.of(job_id, "delta") for t in d["token_ids"]]


@pytest.fixture(scope="module")
def papers(tok, hf):
    """The paper's tokens for (prompt, penalty_alpha, top_k), 10 of them, each computed once."""
    cache = {}

    def tokens(p, a, k):
        if (p, a, k) not in cache:
            cache[p, a, k] = reference(hf, tok.encode(p), a, k, 10, tok.vocab_size)[0]
        return cache[p, a, k]
    return tokens


@pytest.mark.slow
def test_the_degeneration_penalty_changes_the_greedy_choices(papers):
    greedy = {p: papers(p, 0.0, 2) for p in PROMPTS}
    assert any(papers(p, a, k) != greedy[p] for p in PROMPTS for a, k in SEARCHES)


@pytest.mark.slow
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: f"alpha{s[0]}-k{s[1]}")
def test_contrastive_search_alone_equals_the_papers_formula(model, tok, papers, search):
    a, k = search
    for p in PROMPTS:
        j = job(tok, [p], penalty_alpha=a, top_k=k, max_tokens=10)
        result = Engine(model, tok, max_batch=8, event_sink=(sink := Sink())).generate(j)
        assert token_ids(sink, j.id) == papers(p, a, k), (p, a, k)
        assert result["choices"][0]["text"] == tok.decode(papers(p, a, k))


@pytest.mark.slow
def test_contrastive_search_in_a_busy_batch_equals_the_papers_formula(model, tok, papers):
    """Beside greedy, sampled and beam-search requests, with prompts fed in chunks over several
    steps; the others' tokens are those they get alone, and every slot is given back."""
    engine = Engine(model, tok, max_batch=24, event_sink=(sink := Sink()), prefill_chunk=5)
    searches = [job(tok, PROMPTS, penalty_alpha=a, top_k=k, max_tokens=10) for a, k in SEARCHES]
    others = [job(tok, [PROMPTS[1]], temperature=0.9, seed=7, n=2, max_tokens=12),
              job(tok, PROMPTS[:2], max_tokens=9, logprobs=2),
              job(tok, [PROMPTS[2]], use_beam_search=True, n=2, best_of=3, max_tokens=6)]
    alone = [Engine(model, tok, max_batch=8).generate(j) for j in others]
    results = run_all(engine, [searches[0], others[0], searches[1], others[1], others[2], searches[2]])
    for j, (a, k) in zip(searches, SEARCHES):
        for i, p in enumerate(PROMPTS):
            got = [t for _, d in sink.of(j.id, "delta") if d["index"] == i for t in d["token_ids"]]
            assert got == papers(p, a, k), (p, a, k)
    for result, want_alone in zip((results[1], results[3], results[4]), alone):  # their tokens are unchanged
        assert [(c["text"], c["finish_reason"]) for c in result["choices"]] == \
            [(c["text"], c["finish_reason"]) for c in want_alone["choices"]]
    assert sorted(engine.scheduler.free_slots) == list(range(engine.runner.slots))  # every slot given back


@pytest.mark.slow
@pytest.mark.parametrize("family", ["opt", "gpt_neox"])
def test_contrastive_search_equals_the_papers_formula_in_other_families(family, family_checkpoints):
    """OPT (350m's layout: the projection after the last block is part of the hidden state) and
    GPT-NeoX (rotary, parallel residual), alone and two at once in one batch."""
    import transformers

    directory = family_checkpoints[family]
    hf_model = getattr(transformers, FAMILY_CONFIGS[family][1]).from_pretrained(directory).eval()
    ours, family_tok = load_model(directory), load_tokenizer(directory)
    prompts = PROMPTS[:2]
    want = [reference(hf_model, family_tok.encode(p), 0.6, 4, 8, family_tok.vocab_size)[0] for p in prompts]
    engine = Engine(ours, family_tok, max_batch=12, event_sink=(sink := Sink()), prefill_chunk=4)
    together = job(family_tok, prompts, penalty_alpha=0.6, top_k=4, max_tokens=8)
    greedy = job(family_tok, prompts, max_tokens=8)
    run_all(engine, [together, greedy])
    for i, tokens in enumerate(want):
        assert [t for _, d in sink.of(together.id, "delta") if d["index"] == i for t in d["token_ids"]] == tokens


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_the_serving_forward_gives_transformers_last_hidden_state(family, family_checkpoints):
    """hidden_states[-1] (after the final norm, and OPT-350m's projection) of a ragged prefill and a
    decode step, for every family, with the logits unchanged."""
    import transformers

    directory = family_checkpoints[family]
    hf_model = getattr(transformers, FAMILY_CONFIGS[family][1]).from_pretrained(directory).eval()
    ours = load_model(directory)
    torch.manual_seed(0)
    seqs = [torch.randint(0, 1000, (n,)).tolist() for n in (7, 4)]
    cache = KVCache(ours.config, 2, 16)
    lengths = torch.tensor([6, 3])
    tokens = torch.tensor([s[:6] + [0] * (6 - len(s[:6])) for s in (seqs[0], seqs[1][:3])])
    plain = ours.forward_cached(tokens, lengths, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long),
                                KVCache(ours.config, 2, 16))
    logits, hidden = ours.forward_cached(tokens, lengths, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long),
                                         cache, hidden=True)
    assert_close(logits, plain, rtol=1e-6, atol=1e-6)  # a projection over more rows may round differently
    step_logits, step_hidden = ours.forward_cached(torch.tensor([[seqs[0][6]], [seqs[1][3]]]), torch.ones(2, dtype=torch.long),
                                                   torch.tensor([0, 1]), lengths, cache, hidden=True)
    with torch.no_grad():
        for b, seq in enumerate(seqs):
            want = hf_model(torch.tensor([seq]), output_hidden_states=True)
            n = int(lengths[b])
            assert_close(hidden[b, :n], want.hidden_states[-1][0, :n], rtol=1e-5, atol=1e-5)
            assert_close(step_hidden[b, 0], want.hidden_states[-1][0, n], rtol=1e-5, atol=1e-5)
            assert_close(step_logits[b], want.logits[0, n], rtol=1e-5, atol=1e-5)


def test_logprobs_are_the_models_and_end_of_text_finishes(model, tok, hf):
    prompt = tok.encode(PROMPTS[1])
    tokens, logprobs = reference(hf, prompt, 0.6, 4, 10, tok.vocab_size)
    eos = tokens[4]  # a token it generates, standing for end-of-text
    result = Engine(model, tok, max_batch=8, eos_token_id=eos).generate(
        job(tok, [PROMPTS[1]], penalty_alpha=0.6, top_k=4, max_tokens=10, logprobs=2))
    choice = result["choices"][0]
    n = tokens.index(eos) + 1
    assert choice["finish_reason"] == "stop" and result["usage"]["completion_tokens"] == n
    assert choice["text"] == tok.decode(tokens[:n - 1])
    want = torch.stack([lp[t] for lp, t in zip(logprobs[:n], tokens[:n])])
    assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), want, rtol=1e-4, atol=1e-4)
    best = [max(top.values()) for top in choice["logprobs"]["top_logprobs"]]
    assert_close(torch.tensor(best), torch.stack([lp.max() for lp in logprobs[:n]]), rtol=1e-4, atol=1e-4)


def test_cancel_frees_every_slot_and_the_batch_goes_on(model, tok):
    engine = Engine(model, tok, max_batch=8, event_sink=(sink := Sink()))
    search = job(tok, [PROMPTS[0]], penalty_alpha=0.6, top_k=4, max_tokens=30)
    other = job(tok, [PROMPTS[1]], max_tokens=12)
    handles = [engine.submit(search), engine.submit(other)]
    for _ in range(4):
        engine.step()
    assert engine.runner.slots - len(engine.scheduler.free_slots) == 5  # 4 candidates' slots, 1 for the other
    assert token_ids(sink, search.id)
    handles[0].cancel()
    while not handles[1].done:
        engine.step()
    with pytest.raises(RequestCancelled):
        handles[0].result()
    assert sink.of(search.id, "cancelled")
    alone = Engine(model, tok, max_batch=8).generate(other)
    assert handles[1].result()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert sorted(engine.scheduler.free_slots) == list(range(engine.runner.slots))


def test_resume_continues_the_search(model, tok):
    first = job(tok, [PROMPTS[2]], penalty_alpha=0.6, top_k=3, max_tokens=12)
    full = Engine(model, tok, max_batch=8, event_sink=(sink := Sink())).generate(first)
    ids = token_ids(sink, first.id)
    again = job(tok, [PROMPTS[2]], penalty_alpha=0.6, top_k=3, max_tokens=12)
    resumed = Engine(model, tok, max_batch=8, event_sink=(sink := Sink())).generate(again, resume={0: ids[:5]})
    assert ids[:5] + token_ids(sink, again.id) == ids  # only the tokens after the resumed ones are new
    assert resumed["choices"][0]["text"] == full["choices"][0]["text"]


def test_more_candidates_than_slots_is_refused(model, tok):
    with pytest.raises(EngineError) as err:
        Engine(model, tok, max_batch=3).generate(job(tok, [PROMPTS[0]], penalty_alpha=0.5, top_k=4))
    assert err.value.param == "top_k"


@pytest.mark.parametrize("extra", [{"n": 2}, {"best_of": 2}, {"use_beam_search": True, "n": 2}])
def test_several_sequences_per_prompt_are_refused_by_the_engine_too(model, tok, extra):
    """The web tier refuses these; a job that reaches the engine anyway fails alone, not its batch."""
    engine = Engine(model, tok, max_batch=8)
    with pytest.raises(EngineError) as err:
        engine.generate(job(tok, [PROMPTS[0]], penalty_alpha=0.5, top_k=3, **extra))
    assert err.value.param == "penalty_alpha"
    assert engine.generate(job(tok, [PROMPTS[0]], max_tokens=3))["choices"][0]["finish_reason"] == "length"
