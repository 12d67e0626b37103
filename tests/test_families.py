"""GPT-Neo, GPT-J, OPT (350m's layout) and GPT-NeoX against transformers, each from a random-weight
checkpoint saved by transformers itself: the full forward and ragged-batch incremental decoding to
1e-5 in float32, and the engine (unchanged, through the serving contract) giving transformers'
greedy tokens and logprobs, with n, stop, echo, seeded sampling in a busy batch and a resumed stream."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from conftest import FAMILY_CONFIGS, make_family_checkpoint
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from nanogpt.kv_cache import KVCache
from test_engine import PROMPTS, Sink, job, make_engine, run_all
from test_model import cached_call, random_seq
from worker.protocol import CompletionJob

TOL = dict(rtol=1e-5, atol=1e-5)  # float32
CONTEXT = 128


@dataclass
class Family:
    name: str
    directory: object
    ours: torch.nn.Module
    hf: torch.nn.Module
    tok: object

    def reference(self, seq):
        """transformers' logits (len(seq), V) of one whole sequence."""
        with torch.no_grad():
            return self.hf(torch.tensor([seq])).logits[0]

    def greedy(self, prompt_ids, max_new):
        """transformers' greedy tokens over the tokenizer's vocabulary (GPT-J's padding rows are no
        tokens), and the log_softmax over that vocabulary of each step."""
        V, rows = self.tok.vocab_size, self.hf.config.vocab_size
        out = self.hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                               max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=self.tok.eos_token_id,
                               suppress_tokens=list(range(V, rows)) or None)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        return tokens, torch.log_softmax(torch.cat(out.logits).float()[:, :V], -1)


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request, tmp_path_factory) -> Family:
    import transformers

    directory = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = getattr(transformers, FAMILY_CONFIGS[request.param][1]).from_pretrained(directory).eval()
    return Family(request.param, directory, load_model(directory), hf, load_tokenizer(directory))


def test_the_family_module_builds_it(family):
    module = importlib.import_module(f"nanogpt.{family.name}")
    assert type(family.ours) is module.MODEL
    c = family.ours.config
    assert (c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd) == (CONTEXT, family.hf.config.vocab_size, 2, 2, 64)


def test_full_forward_matches_transformers(family):
    idx = torch.randint(0, family.tok.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = family.hf(idx).logits
    assert_close(family.ours(idx), ref, **TOL)


@pytest.mark.parametrize("slot_of", [dict(a=5, b=1, c=3), dict(a=1, b=2, c=3)], ids=["scattered", "consecutive"])
def test_ragged_batch_decoding_matches_transformers(family, slot_of):
    """Prefills of different lengths into different slots, decode steps, a sequence joining among
    the others' decode, a chunked continuation: every row's logits equal transformers' full
    forward at that position (past GPT-Neo's local window, and across rotary positions)."""
    cache = KVCache(family.ours.config, max_slots=6, max_len=CONTEXT)
    seqs = {name: random_seq(30, seed) for seed, name in enumerate("abc", start=1)}
    refs = {name: family.reference(seq) for name, seq in seqs.items()}
    done = {name: 0 for name in seqs}

    def step(plan):
        out = cached_call(family.ours, cache, [(slot_of[name], seqs[name], done[name], n) for name, n in plan])
        for i, (name, n) in enumerate(plan):
            assert_close(out[i], refs[name][done[name] + n - 1], **TOL)
            done[name] += n

    step([("a", 9), ("b", 3)])
    for _ in range(3):
        step([("a", 1), ("b", 1)])
    step([("a", 1), ("c", 6), ("b", 1)])
    for _ in range(3):
        step([("a", 1), ("b", 1), ("c", 1)])
    step([("b", 4), ("a", 1), ("c", 1)])


def test_engine_greedy_and_logprobs_match_transformers(family):
    engine, _ = make_engine(family.ours, family.tok, max_batch=3, prefill_chunk=4)
    results = run_all(engine, [job(family.tok, [p], max_tokens=8, logprobs=3) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        choice = result["choices"][0]
        want, lp = family.greedy(family.tok.encode(prompt), 8)
        assert choice["logprobs"]["tokens"] == [family.tok.token_string(t) for t in want]
        assert choice["text"] == family.tok.decode(want)
        assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), lp[torch.arange(8), torch.tensor(want)],
                     atol=1e-4, rtol=0)
        for step, top in enumerate(choice["logprobs"]["top_logprobs"]):
            values, ids = lp[step].topk(3)
            assert list(top) == [family.tok.token_string(i) for i in ids.tolist()]
            assert_close(torch.tensor(list(top.values())), values, atol=1e-4, rtol=0)
    assert engine.stats()["kv_slots_used"] == 0


def test_echo_logprobs_score_the_prompt_like_transformers(family):
    prompt = family.tok.encode(PROMPTS[3])
    engine, _ = make_engine(family.ours, family.tok, prefill_chunk=5)
    choice = engine.generate(job(family.tok, [prompt], echo=True, logprobs=1, max_tokens=3))["choices"][0]
    gen, _ = family.greedy(prompt, 3)
    full = torch.log_softmax(family.reference(prompt)[:, :family.tok.vocab_size], -1)
    assert choice["text"] == PROMPTS[3] + family.tok.decode(gen)  # OPT's BOS is no text of the prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [family.tok.token_string(t) for t in prompt + gen]
    assert lp["token_logprobs"][0] is None
    assert_close(torch.tensor(lp["token_logprobs"][1:len(prompt)]),
                 full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)


def test_n_stop_and_seeded_sampling_in_a_busy_batch(family):
    tok = family.tok
    sampled = lambda **kw: job(tok, [PROMPTS[1]], temperature=0.9, top_p=0.95, seed=7, max_tokens=12, **kw)  # noqa: E731
    alone = make_engine(family.ours, tok)[0].generate(sampled(n=2))["choices"]
    engine, _ = make_engine(family.ours, tok, max_batch=6, prefill_chunk=3)
    noise = [job(tok, [p], temperature=1.0, seed=s, max_tokens=4 + s) for s, p in enumerate(PROMPTS)]
    busy = run_all(engine, noise[:2] + [sampled(n=2)] + noise[2:])[2]["choices"]
    assert [c["text"] for c in busy] == [c["text"] for c in alone]
    assert [c["index"] for c in busy] == [0, 1]
    assert alone[0]["text"] != alone[1]["text"]  # two draws, not one copied

    greedy = engine.generate(job(tok, [PROMPTS[0]], max_tokens=10))["choices"][0]["text"]
    stop = greedy[3:6]
    stopped = engine.generate(job(tok, [PROMPTS[0]], max_tokens=10, stop=[stop]))["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == greedy[:greedy.index(stop)]


def test_a_crash_resumed_seeded_stream_continues_with_the_same_tokens(family):
    tok = family.tok
    first = job(tok, [PROMPTS[0], PROMPTS[3]], temperature=1.0, seed=5, max_tokens=8, echo=True, logprobs=1, n=2)
    engine, sink = make_engine(family.ours, tok)
    full = engine.generate(first)
    emitted = {}
    for _, d in sink.of(first.id, "delta")[:3 * 4]:  # as if the worker died after its 3rd step
        emitted.setdefault(d["index"], []).extend(d["token_ids"])
    resumed = make_engine(family.ours, tok)[0].generate(CompletionJob(**{**first.model_dump(), "id": "again"}),
                                                         resume=emitted)
    for a, b in zip(resumed["choices"], full["choices"], strict=True):
        assert (a["text"], a["logprobs"]["tokens"], a["finish_reason"]) == (b["text"], b["logprobs"]["tokens"],
                                                                             b["finish_reason"])
