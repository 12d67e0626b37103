"""The engine against transformers (greedy tokens, logprobs), against direct reference computations
(penalties, logit_bias, best_of), and its request semantics: stops, echo, n, cancellation, context end,
determinism under batching, resume."""
from __future__ import annotations

import itertools
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from conftest import make_hf_checkpoint
from models.tokenizer import load_tokenizer
from nanogpt.kernels import decode_attention, extension
from nanogpt.checkpoint import load_model
from nanogpt.kernels.quantize import quantize_int8
from worker.engine import Engine
from worker.errors import EngineError, EngineFault, RequestCancelled
from worker.protocol import CompletionJob
from worker.decode_routes import MIXED_ATTENTION, DecodeRoutes, Graph, Route, bucket, graph_of

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy", "A", "Once upon a time, in a land far away,"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return load_model(str(hf_checkpoint))


@pytest.fixture(scope="module")
def tok(hf_checkpoint):
    return load_tokenizer(hf_checkpoint)


@pytest.fixture(scope="module")
def hf(hf_checkpoint):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(hf_checkpoint).eval()


class Sink:
    """Records every step's events; answers with the job ids in `cancel`."""

    def __init__(self):
        self.steps: list[list] = []
        self.cancel: set[str] = set()

    def __call__(self, events):
        self.steps.append(list(events))
        return set(self.cancel)

    def of(self, job_id, kind=None):
        return [(t, d) for step in self.steps for j, t, d in step if j == job_id and kind in (None, t)]


def make_engine(model, tok, **kw):
    sink = Sink()
    kw.setdefault("max_batch", 8)
    return Engine(model, tok, event_sink=sink, **kw), sink


def job(tok, prompts=("Hello world",), **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("seed", 0)
    kw.setdefault("max_tokens", 8)
    ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
    return CompletionJob(id=f"job-{next(_ids)}", model="tiny", prompts=ids, **kw)


def run_all(engine, jobs):
    handles = [engine.submit(j) for j in jobs]
    while not all(h.done for h in handles):
        engine.step()
    return [h.result() for h in handles]


def hf_greedy(hf, prompt_ids, max_new):
    """transformers' greedy tokens and each step's log_softmax (on the CPU, whatever the model's device)."""
    ids = torch.tensor([prompt_ids], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                      max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=50256)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.log_softmax(torch.cat(out.logits).float(), -1).cpu()  # (steps, V)


# ---- numerics against transformers ----

def test_greedy_ragged_batch_matches_transformers(model, tok, hf):
    # 3 slots for 5 sequences and 4-token prefill chunks: admission waits, prefill is chunked
    # while other sequences decode, and every prompt length differs
    engine, _ = make_engine(model, tok, max_batch=3, prefill_chunk=4)
    jobs = [job(tok, [p], max_tokens=10, logprobs=5) for p in PROMPTS] + [job(tok, PROMPTS[:2], max_tokens=6, logprobs=5)]
    results = run_all(engine, jobs)
    cases = [(r["choices"][0], PROMPTS[i], 10) for i, r in enumerate(results[:4])]
    cases += [(c, PROMPTS[c["index"]], 6) for c in results[4]["choices"]]
    for choice, prompt, max_new in cases:
        want, lp = hf_greedy(hf, tok.encode(prompt), max_new)
        logprobs = choice["logprobs"]
        assert choice["text"] == tok.decode(want)
        assert logprobs["tokens"] == [tok.token_string(t) for t in want]
        assert_close(torch.tensor(logprobs["token_logprobs"]), lp[torch.arange(len(want)), torch.tensor(want)],
                     atol=1e-4, rtol=0)
        for step, top in enumerate(logprobs["top_logprobs"]):
            values, ids = lp[step].topk(5)
            expected = {tok.token_string(i): v for i, v in zip(ids.tolist(), values.tolist())}
            assert top.keys() == expected.keys()
            assert_close(torch.tensor(list(top.values())), torch.tensor(list(expected.values())), atol=1e-4, rtol=0)
        assert choice["finish_reason"] == "length"
    assert engine.stats()["kv_slots_used"] == 0


def test_echo_logprobs_score_the_prompt_like_transformers(model, tok, hf):
    prompt = tok.encode(PROMPTS[3])
    engine, _ = make_engine(model, tok, prefill_chunk=5)  # scoring spans several chunks
    result = engine.generate(job(tok, [prompt], echo=True, logprobs=2, max_tokens=3))
    choice = result["choices"][0]
    gen, gen_lp = hf_greedy(hf, prompt, 3)
    with torch.no_grad():
        full = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)  # (P, V)
    lp = choice["logprobs"]
    assert choice["text"] == PROMPTS[3] + tok.decode(gen)
    assert lp["tokens"] == [tok.token_string(t) for t in prompt + gen]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = torch.cat([full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                      gen_lp[torch.arange(3), torch.tensor(gen)]])
    assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4, rtol=0)
    assert all(len(t) in (2, 3) for t in lp["top_logprobs"][1:])
    # offsets index into the returned text
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
    assert result["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3,
                               "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_with_max_tokens_0_scores_a_prompt(model, tok, hf):
    prompt = tok.encode(PROMPTS[1])
    engine, sink = make_engine(model, tok)
    j = job(tok, [prompt], echo=True, logprobs=0, max_tokens=0)
    result = engine.generate(j)
    choice = result["choices"][0]
    with torch.no_grad():
        full = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    assert choice["text"] == PROMPTS[1] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][1:]),
                 full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)
    assert [len(t) for t in choice["logprobs"]["top_logprobs"][1:]] == [1] * (len(prompt) - 1)
    assert result["usage"]["completion_tokens"] == 0
    deltas = sink.of(j.id, "delta")
    assert [d["token_ids"] for _, d in deltas] == [prompt] and deltas[0][1]["text"] == PROMPTS[1]


def test_max_tokens_0_without_echo_is_empty(model, tok):
    engine, _ = make_engine(model, tok)
    choice = engine.generate(job(tok, max_tokens=0))["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == ("", "length", None)


def test_penalties_and_logit_bias_match_a_direct_computation(model, tok, hf):
    prompt = tok.encode(PROMPTS[0])
    bias = {tok.encode(" the")[0]: 4.0, tok.encode(" world")[0]: -3.0}
    kw = dict(frequency_penalty=1.2, presence_penalty=0.7, logit_bias=bias, max_tokens=12)
    engine, _ = make_engine(model, tok)
    got = engine.generate(job(tok, [prompt], logprobs=1, **kw))["choices"][0]
    seq, counts = list(prompt), torch.zeros(50257)
    want = []
    with torch.no_grad():
        for _ in range(12):
            logits = hf(torch.tensor([seq])).logits[0, -1]
            adjusted = logits - counts * 1.2 - (counts > 0).float() * 0.7
            for t, b in bias.items():
                adjusted[t] += b
            nxt = int(adjusted.argmax())
            want.append(nxt)
            counts[nxt] += 1
            seq.append(nxt)
    assert got["logprobs"]["tokens"] == [tok.token_string(t) for t in want]
    assert len(set(want)) > 1  # the penalties did change the (otherwise repetitive) output
    # logprobs stay those of the raw model
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([seq])).logits[0, len(prompt) - 1:-1], -1)
    assert_close(torch.tensor(got["logprobs"]["token_logprobs"]), raw[torch.arange(12), torch.tensor(want)],
                 atol=1e-4, rtol=0)


# ---- semantics ----

def test_eos_finishes_with_stop(model, tok):
    engine, _ = make_engine(model, tok)
    result = engine.generate(job(tok, logit_bias={tok.eos_token_id: 100.0}, logprobs=0))
    choice = result["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    assert choice["logprobs"]["tokens"] == ["<|endoftext|>"]
    assert result["usage"]["completion_tokens"] == 1


def test_stop_string_split_across_tokens(model, tok):
    engine, sink = make_engine(model, tok)
    free = engine.generate(job(tok, [PROMPTS[1]], max_tokens=12, logprobs=0))["choices"][0]
    pieces = free["logprobs"]["tokens"]
    assert all(len(p) >= 2 for p in pieces[3:5])
    stop = pieces[3][-2:] + pieces[4][:2]  # spans the boundary between the 4th and 5th tokens
    cut = free["text"].index(stop)
    j = job(tok, [PROMPTS[1]], max_tokens=12, stop=["zzzz", stop], logprobs=0)
    choice = engine.generate(j)["choices"][0]
    assert choice["text"] == free["text"][:cut]
    assert choice["finish_reason"] == "stop"
    streamed = [d["text"] for _, d in sink.of(j.id, "delta")]
    assert "".join(streamed) == choice["text"]  # nothing of the stop was ever shown
    assert sum(len(d["token_ids"]) for _, d in sink.of(j.id, "delta")) == len(choice["logprobs"]["tokens"]) <= 5


def test_context_end_and_too_long_requests(model, tok):
    engine, sink = make_engine(model, tok, max_len=16)
    prompt = tok.encode(PROMPTS[3])  # 11 tokens
    result = engine.generate(job(tok, [prompt], max_tokens=None))
    assert result["usage"]["completion_tokens"] == 16 - len(prompt)
    assert result["choices"][0]["finish_reason"] == "length"
    bad = job(tok, [prompt], max_tokens=6)
    with pytest.raises(EngineError, match="maximum context length is 16 tokens, however you requested 17 tokens"):
        engine.generate(bad)
    assert sink.of(bad.id) == [("error", {"error": {
        "message": "This model's maximum context length is 16 tokens, however you requested 17 tokens (11 in your "
                   "prompt; 6 for the completion). Please reduce your prompt; or completion length.",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}})]
    # what only the engine knows (OpenAI's ranges are the request schema's: tests/test_schemas.py)
    for kw, param in ((dict(prompts=[[50257]]), "prompt"), (dict(prompts=[[]]), "prompt"), (dict(prompts=[]), "prompt"),
                      (dict(logit_bias={50257: 1.0}), "logit_bias")):
        with pytest.raises(EngineError) as refused:
            engine.generate(job(tok, **kw))
        assert (refused.value.status, refused.value.param) == (400, param)
    # in the web tier's words (protocol.check_job): a job that reached the queue another way is
    # refused as its request would have been
    with pytest.raises(EngineError, match=r"^Token id 50257 in the prompt is out of vocabulary \(vocabulary size: 50257\)\.$"):
        engine.generate(job(tok, prompts=[[7], [50257]]))
    assert engine.generate(job(tok, max_tokens=2))["usage"]["completion_tokens"] == 2  # still serving


def test_n_choices_share_one_prefill_and_are_numbered_prompt_major(model, tok):
    engine, sink = make_engine(model, tok)
    j = job(tok, PROMPTS[:2], n=3, temperature=1.0, seed=7, max_tokens=6, echo=True)
    result = engine.generate(j)
    assert [c["index"] for c in result["choices"]] == list(range(6))
    for c in result["choices"]:
        assert c["text"].startswith(PROMPTS[c["index"] // 3])
    prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS[:2])
    assert engine.stats()["prompt_tokens"] == prompt_tokens  # each prompt was fed once
    assert result["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 36, "total_tokens": prompt_tokens + 36,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert len({c["text"] for c in result["choices"]}) > 2  # independent draws
    finishes = sink.of(j.id, "finish")
    assert sorted(d["index"] for _, d in finishes) == list(range(6))
    assert [t for step in sink.steps for _, t, _ in step][-2:] == ["usage", "done"]


def test_more_choices_than_slots_wait_for_slots_and_match(model, tok):
    j = lambda: job(tok, [PROMPTS[0]], n=5, temperature=1.0, seed=2, max_tokens=5, logprobs=0)  # noqa: E731
    roomy = make_engine(model, tok, max_batch=8)[0].generate(j())
    tight = make_engine(model, tok, max_batch=2)[0].generate(j())
    assert [c["text"] for c in tight["choices"]] == [c["text"] for c in roomy["choices"]]
    prompt_len = len(PROMPTS[0])
    for c in tight["choices"]:  # without echo, offsets continue after the prompt's text
        lp = c["logprobs"]
        assert lp["text_offset"][0] == prompt_len
        assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"] == sorted(lp["text_offset"])


def test_best_of_returns_the_highest_mean_logprob_and_streams_nothing_before(model, tok):
    engine, sink = make_engine(model, tok)
    kw = dict(temperature=1.5, seed=3, max_tokens=5, logprobs=0)
    every = engine.generate(job(tok, [PROMPTS[0]], n=4, **kw))["choices"]  # the same 4 candidates
    means = [sum(c["logprobs"]["token_logprobs"]) / 5 for c in every]
    j = job(tok, [PROMPTS[0]], n=2, best_of=4, **kw)
    result = engine.generate(j)
    ranked = sorted(range(4), key=lambda i: -means[i])[:2]
    assert [c["text"] for c in result["choices"]] == [every[i]["text"] for i in ranked]
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert result["usage"]["completion_tokens"] == 20  # every candidate is paid for
    steps_with_events = [step for step in sink.steps if any(jid == j.id for jid, _, _ in step)]
    assert len(steps_with_events) == 1  # deltas, finishes, usage and done together at the end
    assert [t for _, t, _ in steps_with_events[0]] == ["delta", "finish", "delta", "finish", "usage", "done"]


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_seeded_request_is_independent_of_its_batch(model, tok, top_p):
    j = lambda: job(tok, [PROMPTS[1]], temperature=0.9, top_p=top_p, seed=1234, max_tokens=16)  # noqa: E731
    alone = make_engine(model, tok)[0].generate(j())["choices"][0]["text"]

    engine, _ = make_engine(model, tok, max_batch=6, prefill_chunk=3)
    noise = [job(tok, [p], temperature=1.0, seed=s, max_tokens=4 + s, presence_penalty=0.5 * (s % 2))
             for s, p in enumerate(PROMPTS)]
    busy = run_all(engine, noise[:2] + [j()] + noise[2:])[2]["choices"][0]["text"]
    other_seed = engine.generate(job(tok, [PROMPTS[1]], temperature=0.9, top_p=top_p, seed=99, max_tokens=16))
    assert busy == alone
    assert other_seed["choices"][0]["text"] != alone


def test_top_p_0_keeps_only_the_most_likely_token(model, tok, hf):
    # as OpenAI's: whatever the temperature and seed, the greedy tokens
    prompt = tok.encode(PROMPTS[1])
    greedy = tok.decode(hf_greedy(hf, prompt, 12)[0])
    engine, _ = make_engine(model, tok)
    kw = dict(n=3, temperature=1.0, seed=11, max_tokens=12)
    truncated = engine.generate(job(tok, [prompt], top_p=0.0, **kw))["choices"]
    assert [c["text"] for c in truncated] == [greedy] * 3
    sampled = engine.generate(job(tok, [prompt], top_p=1.0, **kw))["choices"]  # the same draws, untruncated
    assert all(c["text"] != greedy for c in sampled)


def test_cancel_takes_effect_at_the_next_step(model, tok):
    engine, sink = make_engine(model, tok)
    h = engine.submit(job(tok, max_tokens=50))
    other = engine.submit(job(tok, [PROMPTS[2]], max_tokens=20))
    for _ in range(3):
        engine.step()
    h.cancel()
    engine.step()
    assert h.done
    with pytest.raises(RequestCancelled):
        h.result()
    assert sink.of(h.job_id)[-1] == ("cancelled", {})
    assert len(sink.of(h.job_id, "delta")) == 3
    assert engine.stats()["kv_slots_used"] == 1  # only `other` still runs
    # the sink's answer cancels too
    sink.cancel.add(other.job_id)
    engine.step()
    engine.step()
    with pytest.raises(RequestCancelled):
        other.result()
    assert engine.stats()["kv_slots_used"] == 0 and engine.stats()["running"] == 0


def test_a_caller_is_answered_after_its_job_s_last_events_are_written(model, tok):
    # The caller (the consumer) called back by its handle records the job as ended: its stream must then
    # hold the terminal event, whether the job finished, was cancelled or was refused.
    done_when_written = {}

    class Recording(Sink):
        def __call__(self, events):
            for job_id, kind, _ in events:
                if kind in ("done", "cancelled", "error"):
                    done_when_written[job_id] = handles[job_id].done
            return super().__call__(events)

    engine = Engine(model, tok, event_sink=Recording(), max_batch=8)
    handles = {}
    for j in (job(tok, max_tokens=3), job(tok, [PROMPTS[2]], max_tokens=50), job(tok, prompts=[[50257]])):
        handles[j.id] = engine.submit(j)
    finished, cancelled, refused = handles.values()
    for _ in range(3):
        engine.step()
    cancelled.cancel()
    while not all(h.done for h in handles.values()):
        engine.step()
    assert done_when_written == {finished.job_id: False, cancelled.job_id: False, refused.job_id: False}
    assert finished.result()["usage"]["completion_tokens"] == 3


def test_resume_continues_with_the_same_tokens(model, tok):
    kw = dict(prompts=[PROMPTS[0], PROMPTS[3]], temperature=1.0, seed=5, max_tokens=10, echo=True, logprobs=1,
              n=2, stop=["\n\n"])
    engine, sink = make_engine(model, tok)
    first = job(tok, **kw)
    full = engine.generate(first)
    deltas = sink.of(first.id, "delta")
    # as if the worker died after the 4th step: the consumer passes what each choice's deltas held
    cut = 4 * 4
    emitted = {}
    for _, d in deltas[:cut]:
        emitted.setdefault(d["index"], []).extend(d["token_ids"])
    again = CompletionJob(**{**first.model_dump(), "id": "resumed"})
    engine2, sink2 = make_engine(model, tok)
    resumed = engine2.generate(again, resume=emitted)
    for a, b in zip(resumed["choices"], full["choices"], strict=True):
        assert (a["index"], a["text"], a["finish_reason"]) == (b["index"], b["text"], b["finish_reason"])
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        # replayed tokens are scored by a prefill instead of decode steps: equal up to rounding
        assert_close(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:], atol=1e-4, rtol=0)
    new_text = {}
    for _, d in sink2.of("resumed", "delta"):
        new_text[d["index"]] = new_text.get(d["index"], "") + d["text"]
    for c in full["choices"]:
        shown = "".join(d["text"] for _, d in deltas[:cut] if d["index"] == c["index"])
        assert shown + new_text.get(c["index"], "") == c["text"]


def test_engine_thread_runs_concurrent_jobs(model, tok):
    engine, _ = make_engine(model, tok)
    engine.start()
    try:
        handles = [engine.submit(job(tok, [p], max_tokens=5)) for p in PROMPTS]
        texts = [h.result(timeout=30)["choices"][0]["text"] for h in handles]
        bad = engine.submit(job(tok, prompts=[[50257]]))
        with pytest.raises(EngineError):
            bad.result(timeout=30)
        assert engine.generate(job(tok, [PROMPTS[0]], max_tokens=5))["choices"][0]["text"] == texts[0]
    finally:
        engine.stop()
    stats = engine.stats()
    assert stats["tokens_generated"] == 25 and stats["kv_slots_used"] == 0 and sum(stats["batch_size_counts"].values()) > 0


def test_launch_loads_the_model_on_the_thread_that_steps_it(hf_checkpoint, tok):
    import threading

    from nanogpt.checkpoint import CheckpointError

    loaded_on, stepped_on = [], set()

    def load():
        loaded_on.append(threading.current_thread())
        return load_model(str(hf_checkpoint))

    def sink(events):
        if events:  # `stop` hands over the events of jobs it ends (none here) on the caller's thread
            stepped_on.add(threading.current_thread())

    engine = Engine.launch(load, tok, max_batch=2, event_sink=sink)
    try:
        assert engine.is_alive()
        text = engine.generate(job(tok, [PROMPTS[1]], max_tokens=5))["choices"][0]["text"]
        assert text and engine.runner.model.device.type == "cpu"
    finally:
        engine.stop()
    assert stepped_on == set(loaded_on) and loaded_on[0] is not threading.main_thread()

    def missing():
        raise CheckpointError("no checkpoint at /nowhere")
    before = threading.active_count()
    with pytest.raises(CheckpointError, match="/nowhere"):
        Engine.launch(missing, tok, max_batch=2)
    assert threading.active_count() == before  # the failed launch left no thread behind


def test_a_fault_fails_the_batch_without_events_and_the_engine_goes_on(model, tok, monkeypatch):
    engine, sink = make_engine(model, tok)
    h = engine.submit(job(tok, max_tokens=10))
    engine.step()
    engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")
    monkeypatch.setattr(model, "forward_cached", broken)
    engine.step()
    with pytest.raises(EngineFault):
        h.result(timeout=0)
    assert [t for t, _ in sink.of(h.job_id)] == ["delta", "delta"]  # no error event: a retry may resume
    assert engine.stats()["kv_slots_used"] == 0
    monkeypatch.undo()
    assert engine.generate(job(tok, max_tokens=3))["usage"]["completion_tokens"] == 3


def test_stop_fails_unfinished_jobs_as_faults(model, tok):
    engine, sink = make_engine(model, tok)
    running = engine.submit(job(tok, max_tokens=10))
    engine.step()
    queued = engine.submit(job(tok, max_tokens=10))
    engine.stop()
    for h in (running, queued):
        with pytest.raises(EngineFault):
            h.result(timeout=0)
    assert not sink.of(queued.job_id)


def test_int8_model_serves_close_to_float32(model, tok, hf_checkpoint):
    quantized = quantize_int8(load_model(str(hf_checkpoint)))
    assert type(quantized.lm_head) is not torch.nn.Linear
    jobs = lambda: [job(tok, [p], max_tokens=12, logprobs=0) for p in PROMPTS]  # noqa: E731
    exact = run_all(make_engine(model, tok)[0], jobs())
    approx = run_all(make_engine(quantized, tok)[0], jobs())
    for a, b in zip(exact, approx):
        a, b = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
        agree = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        assert agree >= 6
        assert_close(b["token_logprobs"][:agree], a["token_logprobs"][:agree], atol=0.2, rtol=0)


def test_int8_tokens_do_not_depend_on_the_int8_kernel(tok, hf_checkpoint, monkeypatch):
    """fbgemm's, oneDNN's and the project's int8 kernels (nanogpt/kernels/matmuls.py) sum the same int8
    products exactly: the engine's tokens and logprobs are the same whichever serves a step's rows
    (many prompts at once: decode steps of several rows, a packed prefill)."""
    from nanogpt.kernels.matmuls import available

    served = {}
    for kernel in available(torch.qint8):
        monkeypatch.setenv("NANOSERVE_KERNEL", kernel)  # the engine's own pack_linears then forces it
        quantized = quantize_int8(load_model(str(hf_checkpoint)))
        served[kernel] = run_all(make_engine(quantized, tok)[0], [job(tok, [p], max_tokens=10, logprobs=0)
                                                                    for p in PROMPTS * 2])
        assert {m._plan.describe() for m in quantized.modules() if hasattr(m, "_packs")} == {f"{kernel} at every row count (forced)"}
    for kernel, results in served.items():
        for a, b in zip(served["int8-dynamic"], results):
            a, b = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
            assert a["tokens"] == b["tokens"], kernel
            assert_close(b["token_logprobs"], a["token_logprobs"], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_span_buckets_cover_every_span_within_the_cache():
    """A CUDA graph attends to a span bucket's keys (nanogpt/runtime/cuda_graphs.py): never fewer than the
    step's span, never more than the cache holds, and few graphs for a long context."""
    from nanogpt.runtime.cuda_graphs import SPAN_QUANTUM, span_bucket, span_buckets

    for max_span in (2, 40, 128, 129, 1024, 2048):
        buckets = span_buckets(max_span)
        assert buckets[-1] == max_span and len(buckets) == -(-max_span // SPAN_QUANTUM)
        for span in range(2, max_span + 1):
            bucket = span_bucket(span, max_span)
            assert bucket in buckets and span <= bucket <= min(max_span, span + SPAN_QUANTUM - 1)


@pytest.fixture(scope="module")
def compiled(tok, tmp_path_factory):
    """A one-layer checkpoint's eager engine and compiled engine (every graph compiled at start), the
    compiled one with room for ten rows between buckets."""
    checkpoint = str(make_hf_checkpoint(tmp_path_factory.mktemp("compiled"), n_layer=1, n_embd=32,
                                        with_tokenizer=False))
    small = load_model(checkpoint)
    return SimpleNamespace(checkpoint=checkpoint, small=small, eager=make_engine(small, tok)[0],
                           engine=make_engine(small, tok, compile=True, max_batch=12)[0])


def texts(results) -> list[str]:
    return [r["choices"][0]["text"] for r in results]


def decode_rows(compiled, monkeypatch) -> list[int]:
    """The rows of every decode step the compiled engine runs from here on, as its graph gets them."""
    routes, rows = compiled.engine.runner.routes, []
    forward = routes._forward
    monkeypatch.setattr(routes, "_forward", lambda route, tokens, *args: rows.append(len(tokens)) or forward(route, tokens, *args))
    return rows


def test_the_compiled_engine_s_cache_and_attention(compiled):
    import torch._inductor.config as inductor

    eager, engine = compiled.eager, compiled.engine
    assert engine.runner.compiled and not inductor.freezing  # packed layers need no weight freezing
    # its attention by the project's kernel wherever that is built (nanogpt/kernels/decode_attention.py)
    assert engine.runner.cache.own_attention == extension.available()
    assert engine.runner.routes.mixed == engine.runner.cache.own_attention
    # the padded decode's spare slot, and a position past the context (so that no span is the whole
    # cache); neither where the decode is not padded (CUDA graphs pad it on a GPU only)
    assert eager.runner.graphs is None and engine.runner.graphs is None
    assert (eager.runner.cache.max_slots, eager.runner.cache.max_len) == (8, 128)
    assert (engine.runner.cache.max_slots, engine.runner.cache.max_len) == (13, 129)


def test_compiled_decode_of_three_rows_gives_the_eager_tokens(compiled, tok, monkeypatch):
    """Unpadded through the graph whose rows vary below the kernel's where the engine mixes, else
    padded to the 4-row bucket; compiled before it ran."""
    from torch._dynamo.utils import counters

    routes, rows = compiled.engine.runner.routes, decode_rows(compiled, monkeypatch)
    jobs = lambda: [job(tok, [p], max_tokens=4) for p in PROMPTS[:3]]  # noqa: E731
    assert routes.route(3) == (Route(Graph.SMALL, 3) if routes.mixed else Route(Graph.BUCKET, 4))
    graphs = counters["stats"]["unique_graphs"]
    assert texts(run_all(compiled.engine, jobs())) == texts(run_all(compiled.eager, jobs()))
    assert counters["stats"]["unique_graphs"] == graphs
    assert 3 in rows and max(rows) == (3 if routes.mixed else 4)


def test_compiled_decode_of_eight_rows_gives_the_eager_tokens(compiled, tok):
    """Eight rows: the bucket whose attention the project's kernel takes (decode_attention.ROWS)."""
    assert decode_attention.ROWS <= 8
    eight = lambda: [job(tok, [p], max_tokens=5) for p in PROMPTS * 2]  # noqa: E731
    assert texts(run_all(compiled.engine, eight())) == texts(run_all(compiled.eager, eight()))


def test_compiled_decode_of_ten_rows_gives_the_eager_tokens(compiled, tok, monkeypatch):
    """Ten rows, between buckets: unpadded through the kernel's graph whose rows vary where the
    engine mixes, else padded to the 16-row bucket; compiled before it ran."""
    from torch._dynamo.utils import counters

    routes, rows = compiled.engine.runner.routes, decode_rows(compiled, monkeypatch)
    assert routes.route(10) == (Route(Graph.KERNEL, 10) if routes.mixed else Route(Graph.BUCKET, 16))
    ten = lambda: [job(tok, [p], max_tokens=5) for p in (PROMPTS * 3)[:10]]  # noqa: E731
    graphs = counters["stats"]["unique_graphs"]
    assert texts(run_all(compiled.engine, ten())) == texts(run_all(make_engine(compiled.small, tok, max_batch=12)[0], ten()))
    assert counters["stats"]["unique_graphs"] == graphs
    assert 10 in rows and max(rows) == (10 if routes.mixed else 16)


def test_a_prompt_arriving_while_others_decode_is_fed_beside_them_compiled(compiled, tok, monkeypatch):
    """Its tokens as rows of the kernel's compiled graph where the project's kernel attends the
    cache (`mixed`), else in one eager packed forward; the decode-only steps around it run the
    compiled graph, all compiled before the engine ran."""
    from torch._dynamo.utils import counters

    def staggered(engine):
        first = [engine.submit(j) for j in [job(tok, [p], max_tokens=10) for p in PROMPTS[:2]]]
        for _ in range(3):
            engine.step()
        late = engine.submit(job(tok, [PROMPTS[3]], max_tokens=4))
        while not all(h.done for h in first + [late]):
            engine.step()
        return [h.result()["choices"][0]["text"] for h in first + [late]]

    engine = compiled.engine
    routes = engine.runner.routes
    expected = staggered(make_engine(load_model(compiled.checkpoint), tok)[0])
    # once first, untimed: the chunk a prompt is fed in beside decoding rows follows the pace the
    # engine measured (Scheduler._in_time), which an engine's first, cold steps would set
    assert staggered(engine) == expected
    calls = {"forward_packed": 0, "_forward": 0}  # packed forwards with decoding rows in them; compiled steps
    for target, name in ((compiled.small, "forward_packed"), (routes, "_forward")):
        def counted(*args, _run=getattr(target, name), _name=name, **kwargs):
            calls[_name] += _name != "forward_packed" or len(args[0]) > 1  # a prompt's own prefill packs one batch
            return _run(*args, **kwargs)
        monkeypatch.setattr(target, name, counted)
    graphs, taken = counters["stats"]["unique_graphs"], engine.runner.routes_taken.copy()
    assert staggered(engine) == expected
    assert counters["stats"]["unique_graphs"] == graphs  # no stall to compile
    taken = engine.runner.routes_taken - taken
    if routes.mixed:  # the decode-only steps of two rows too, through the graph of small rows
        assert taken[Graph.KERNEL] >= 1 and taken[Graph.SMALL] >= 3 and calls["forward_packed"] == 0
        assert calls["_forward"] == taken[Graph.KERNEL] + taken[Graph.SMALL] == taken.total()
    else:
        assert taken[Graph.PACKED] == calls["forward_packed"] >= 1
        assert calls["_forward"] == taken[Graph.BUCKET] >= 3


def test_the_compiled_graphs_are_called_without_dynamo(compiled, tok, monkeypatch):
    """On a CPU every graph compiled at start is then called directly (compile.DirectCall), not
    through dynamo's evaluation of the frame: serving calls dynamo's compiled step no more, and
    gives the eager engine's tokens and logprobs."""
    routes = compiled.engine.runner.routes
    assert set(map(graph_of, routes.live)) == set(routes._direct)
    through_dynamo = []
    step = routes._step
    monkeypatch.setattr(routes, "_step", lambda *args: through_dynamo.append(len(args[0])) or step(*args))
    jobs = lambda: [job(tok, [p], max_tokens=6, logprobs=2) for p in (PROMPTS * 3)[:n]]  # noqa: E731
    for n in (1, 3, 10):
        served, expected = run_all(compiled.engine, jobs()), run_all(compiled.eager, jobs())
        assert texts(served) == texts(expected)
        for got, want in zip(served, expected):
            assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert through_dynamo == []


def test_a_directly_called_graph_refuses_inputs_its_guards_refuse(compiled):
    """Called with inputs the graph was not compiled for, a direct call serves nothing (None), so
    that the step goes through dynamo, which compiles for them."""
    routes = compiled.engine.runner.routes
    one_row = routes._direct[graph_of(Route(Graph.BUCKET, 1))]
    keys = torch.arange(5)
    slot, position = torch.tensor([0]), torch.tensor([4])
    with torch.no_grad():  # as the engine calls it
        assert one_row(torch.tensor([7]), slot, position, routes.cache, keys) is not None
        assert one_row(torch.tensor([7, 8]), slot.repeat(2), position.repeat(2), routes.cache, keys) is None
        assert one_row(torch.tensor([7], dtype=torch.int32), slot, position, routes.cache, keys) is None


def test_chunks_whose_attention_costs_more_than_the_kernel_saves_go_through_the_eager_forward(compiled):
    routes = compiled.engine.runner.routes
    n = math.isqrt(MIXED_ATTENTION)  # a prompt's first n tokens attend to n * n keys at most: within the bound
    assert routes.route(2, [(0, n)]) == (Route(Graph.KERNEL, 2 + n) if routes.mixed else Route(Graph.PACKED, 2 + n))
    assert routes.route(2, [(n, n)]) == Route(Graph.PACKED, 2 + n)  # the next n tokens attend to twice as many


def background_engine(compiled, tok):
    """An engine of the compiled fixture's checkpoint whose graphs compile in the background."""
    return make_engine(load_model(compiled.checkpoint), tok, compile=True, compile_in_background=True, max_batch=12)[0]


def compile_gate(monkeypatch) -> threading.Event:
    """Background compiles wait for the event: a graph compiled already in this process (by the
    compiled fixture) may go live again within milliseconds, before a test has stepped eagerly."""
    gate = threading.Event()
    compile = DecodeRoutes._compile
    monkeypatch.setattr(DecodeRoutes, "_compile", lambda routes: gate.wait(600) and compile(routes))
    return gate


def test_a_long_generation_keeps_its_tokens_across_the_switch_to_compiled_graphs(compiled, tok, monkeypatch):
    """An engine compiling in the background serves at once, eagerly, and takes its compiled graphs
    between two steps: a long greedy generation across the switch gives the eager engine's tokens
    (and logprobs within 1e-4), and so does every request decoding beside it after the switch."""
    gate = compile_gate(monkeypatch)
    engine = background_engine(compiled, tok)
    routes, taken = engine.runner.routes, engine.runner.routes_taken
    assert engine.warming and engine.stats()["warming_up"] == 1 and engine.runner.compiled
    first = lambda: [job(tok, [PROMPTS[0]], max_tokens=100, ignore_eos=True, logprobs=1),  # noqa: E731
                     *[job(tok, [p], max_tokens=3) for p in PROMPTS[1:]]]
    after = lambda: [job(tok, [p], max_tokens=4) for p in PROMPTS[1:]]  # noqa: E731
    handles = [engine.submit(j) for j in first()]
    for _ in range(6):
        engine.step()
    assert set(taken) == {Graph.EAGER} and not handles[0].done  # 4 rows, then the long one alone
    gate.set()
    assert routes.wait_compiled(timeout=600)
    assert not engine.warming and engine.stats()["compiled_graphs_live"] == len(routes.planned) >= 1
    for _ in range(3):
        engine.step()
    handles += [engine.submit(j) for j in after()]  # prompts fed beside the long row, then 4 rows decode
    while not all(h.done for h in handles):
        engine.step()
    got = [h.result() for h in handles]
    expected = run_all(compiled.eager, first() + after())
    assert texts(got) == texts(expected) == texts(run_all(compiled.engine, first() + after()))
    assert_close(got[0]["choices"][0]["logprobs"]["token_logprobs"],
                 expected[0]["choices"][0]["logprobs"]["token_logprobs"], atol=1e-4, rtol=0)
    compiled_routes = {Graph.BUCKET, Graph.SMALL, Graph.KERNEL}
    assert sum(taken[graph] for graph in compiled_routes) >= 60  # the long row's steps after the switch
    if routes.mixed:
        assert taken[Graph.KERNEL] >= 1 and taken[Graph.SMALL] >= 1


def test_an_engine_serves_on_its_thread_while_its_graphs_compile(compiled, tok, monkeypatch):
    """The engine's thread steps while the compile's thread traces and runs its graphs: every wave
    of requests, before the compile, during it and after it, gets the eager engine's tokens."""
    jobs = lambda: [job(tok, [p], max_tokens=6) for p in PROMPTS]  # noqa: E731
    expected = texts(run_all(compiled.eager, jobs()))
    gate = compile_gate(monkeypatch)
    engine = background_engine(compiled, tok)
    engine.start()
    try:
        def wave():
            return [h.result(timeout=120)["choices"][0]["text"] for h in [engine.submit(j) for j in jobs()]]

        assert engine.warming and wave() == expected
        assert set(engine.runner.routes_taken) == {Graph.EAGER}
        gate.set()
        while engine.warming:
            assert wave() == expected
        assert wave() == expected
        taken = engine.runner.routes_taken
        assert taken[Graph.BUCKET] + taken[Graph.SMALL] + taken[Graph.KERNEL] >= 1  # the last wave's
    finally:
        engine.stop()


def test_a_failed_background_compile_leaves_the_engine_serving_eagerly(compiled, tok, monkeypatch, caplog):
    import worker.decode_routes

    def no_compiler(model):
        def step(*args):
            raise RuntimeError("inductor found no C++ compiler")
        return step

    monkeypatch.setattr(worker.decode_routes, "compile_decode", no_compiler)
    engine = background_engine(compiled, tok)
    assert engine.runner.routes.wait_compiled(timeout=60)
    assert not engine.runner.compiled and not engine.runner.routes.live and engine.stats()["warming_up"] == 0
    jobs = lambda: [job(tok, [p], max_tokens=5) for p in PROMPTS]  # noqa: E731
    assert texts(run_all(engine, jobs())) == texts(run_all(compiled.eager, jobs()))
    assert set(engine.runner.routes_taken) == {Graph.EAGER}
    assert "compiling the decode step failed" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
def test_compiled_decode_in_the_other_precisions_stays_close_to_eager(tok, tmp_path, mode):
    """bfloat16 (a CPU worker's default where bf16 is native, and emulated elsewhere) and int8
    (with --compile) through the compiled decode: the same first tokens as their eager engine,
    logprobs within their rounding."""
    checkpoint = str(make_hf_checkpoint(tmp_path, n_layer=1, n_embd=32, with_tokenizer=False))

    def load():
        if mode == "int8":
            return quantize_int8(load_model(checkpoint))
        return load_model(checkpoint, dtype=torch.bfloat16)

    jobs = lambda: [job(tok, [p], max_tokens=6, logprobs=0) for p in PROMPTS[:3]]  # noqa: E731
    eager = run_all(make_engine(load(), tok)[0], jobs())
    engine = make_engine(load(), tok, compile=True)[0]
    assert engine.runner.compiled
    compiled = run_all(engine, jobs())
    for a, b in zip(eager, compiled):
        a, b = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
        agree = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        assert agree >= 3
        assert_close(b["token_logprobs"][:agree], a["token_logprobs"][:agree], atol=0.05, rtol=0)


def test_prompts_beside_decoding_sequences_are_fed_in_chunks_sized_by_cost():
    """chunk_beside: from matmul timings that are flat up to 8 rows, then grow with the rows, the
    prompt tokens that keep a step within a ratio (STEP_RATIO by default) times its decode rows alone."""
    from worker.scheduler import BESIDE_CHUNK, MIN_CHUNK, STEP_RATIO, chunk_beside

    costs = {1: 1.0, 8: 1.0, 64: 4.0, 256: 16.0}  # rows -> seconds: flat to 8 rows, then linear
    assert chunk_beside(1, costs, 1.6) == 18  # 1.6 s reach 8 + 0.6 / 3 * 56 = 19.2 rows: 18 more than 1
    assert chunk_beside(8, costs, 1.6) == 19 - 8  # the same 1.6 s
    assert chunk_beside(64, costs, 1.6) == 38  # 6.4 s: 64 + 2.4 / 12 * 192 = 102.4 rows
    assert chunk_beside(512, costs, 1.6) == 819 - 512  # past the timings, in proportion: 51.2 s
    assert chunk_beside(1, costs, ratio=6.0) == 95  # 6 s reach 64 + 2 / 12 * 192 = 96 rows
    assert chunk_beside(8, costs) == chunk_beside(8, costs, STEP_RATIO)
    assert chunk_beside(8, {1: 1.0, 8: 0.9, 64: 100.0, 256: 400.0}, 1.6) == MIN_CHUNK  # noisy, steep: the floor
    assert chunk_beside(8, None) == BESIDE_CHUNK
    assert chunk_beside(8, None, ratio=2 * STEP_RATIO) == 2 * BESIDE_CHUNK


def test_step_cost_between_and_past_the_measured_rows():
    from worker.scheduler import step_cost

    costs = {1: 1.0, 8: 0.9, 64: 4.0, 256: 16.0}
    assert step_cost(1, costs) == step_cost(8, costs) == 1.0  # 8 rows never cost less than 1
    assert step_cost(36, costs) == 2.5  # half way from 8 to 64
    assert step_cost(512, costs) == 32.0  # past the timings, in proportion
    assert step_cost(3, None) == step_cost(300, None) == 1.0  # nothing measured: every step alike


def test_prompts_that_would_miss_their_deadline_get_larger_chunks(monkeypatch):
    """The ratio doubles, as far as prefill_chunk, while at the measured pace the prompts holding
    slots would not all be fed within PROMPT_DEADLINE of arriving; prompts queued behind count after the
    ones before them, those still waiting for a slot not at all."""
    from worker import scheduler
    from worker.scheduler import PROMPT_DEADLINE, Prefill, Scheduler, chunk_beside

    monkeypatch.setattr(scheduler, "STEP_RATIO", 1.6)  # the ratio the figures below are worked at
    costs = {1: 1.0, 8: 1.0, 64: 4.0, 256: 16.0}
    s = Scheduler(slots=8, prefill_chunk=256, row_costs=costs)
    s.decoding = [object()] * 2
    first = Prefill([], [0] * 200, None, time.monotonic())
    s.prefilling = [first]
    assert chunk_beside(2, costs, 1.6) == 17  # at 1.6: 17 tokens a step, 19 rows cost 1.589
    assert chunk_beside(2, costs, 3.2) == 47  # at 3.2: 49 rows cost 3.196
    assert s._chunks() == [(first, 17)]  # no step timed yet: in time
    # 200 tokens at 1.6 take 12 steps of 1.589 = 19.07 units, at 3.2 5 of 3.196 = 15.98: a pace
    # of deadline / 17 a unit misses the deadline at 1.6 and makes it at 3.2
    s.pace.append(PROMPT_DEADLINE / 17)
    assert s._chunks() == [(first, 47)]
    s.pace[0] = PROMPT_DEADLINE / 20  # 19.07 / 20 of the deadline: in time at 1.6
    assert s._chunks() == [(first, 17)]
    waiting = Prefill([], [0] * 100, None, time.monotonic() - 10 * PROMPT_DEADLINE)  # no slot: all taken
    s.waiting.append(waiting)
    assert s._chunks() == [(first, 17)]  # larger chunks would not give it a slot any sooner
    behind = Prefill([], [0] * 100, None, time.monotonic())  # holding a slot: 300 tokens to feed for it to start
    s.prefilling.append(behind)
    # 300 tokens: 18 steps at 1.6 (28.6 units) and 7 at 3.2 (22.4) miss; 3 of 6.375 at 6.4 make it
    assert chunk_beside(2, costs, 6.4) == 100
    assert s._chunks() == [(first, 100)]
    behind.queued -= PROMPT_DEADLINE  # it has waited its whole deadline: no ratio is in time
    assert chunk_beside(2, costs, 25.6) >= 256
    assert s._chunks() == [(first, 200), (behind, 56)]  # the ratio grew as far as prefill_chunk
    s.prefill_chunk = 64
    assert s._chunks() == [(first, 64)]  # prefill_chunk is the bound


def test_a_prompt_s_deadline_counts_from_the_gateway(model, tok):
    """A prompt's wait starts when the gateway took its request (`received`), so the time its job
    spent queued counts; a gateway clock ahead of this one's counts as no wait."""
    from worker.scheduler import arrival

    engine = Engine(model, tok, max_batch=4)
    queued = job(tok, ["Hello"], max_tokens=2)
    queued.received -= 30.0  # 30 s in the queue
    engine.submit(queued)
    engine.scheduler.schedule([])
    [unit] = engine.scheduler.prefilling
    assert 29.9 < time.monotonic() - unit.queued < 31.0
    ahead = job(tok, ["Hello"], max_tokens=2)
    ahead.received += 5.0
    before = time.monotonic()
    assert before <= arrival(ahead) <= time.monotonic()  # taken now


def test_a_long_prompt_beside_running_sequences_is_fed_in_short_chunks(model, tok, monkeypatch):
    """Beside decoding sequences a prompt goes in chunks of chunk_beside tokens, each in the same
    forward as their decode; a prompt that would miss PROMPT_DEADLINE at the pace the engine
    measured goes in larger chunks (here, one that missed it at once: whole chunks of prefill_chunk)."""
    from worker import scheduler

    BESIDE_CHUNK = 32
    monkeypatch.setattr(scheduler, "BESIDE_CHUNK", BESIDE_CHUNK)  # below prefill_chunk, to tell them apart
    monkeypatch.setattr(scheduler, "PROMPT_DEADLINE", 1e9)  # in time however slow this machine is now
    engine = Engine(model, tok, max_batch=4, prefill_chunk=64)
    engine.scheduler.row_costs = None  # the fixed size, whatever this machine measured
    fed = []
    forward_packed = model.forward_packed
    try:
        model.forward_packed = lambda batches, cache: fed.append([int(b[1].sum()) for b in batches]) or \
            forward_packed(batches, cache)
        running = engine.submit(job(tok, ["Hello"], max_tokens=20, n=2))
        engine.step()  # its prompt alone
        long = engine.submit(job(tok, [[464] * 100], max_tokens=2))
        while not long.done:
            engine.step()
        assert engine.scheduler.pace  # every step so far timed
        monkeypatch.setattr(scheduler, "PROMPT_DEADLINE", 1e-9)  # every prompt from here on is late
        late = engine.submit(job(tok, [[318] * 70], max_tokens=2))
        while not (running.done and late.done):
            engine.step()
    finally:
        del model.forward_packed
    beside = [[2, BESIDE_CHUNK]] * 3 + [[2, 100 - 3 * BESIDE_CHUNK]]
    fed = [tokens for tokens in fed if len(tokens) == 2]  # the forwards with decoding rows (a prompt alone packs one batch)
    assert fed[:5] == beside + [[2, 64]]  # the late prompt: whole chunks
    assert long.result()["usage"]["prompt_tokens"] == 100 and running.result()["usage"]["completion_tokens"] == 40


def test_where_a_step_costs_its_launches_a_burst_is_fed_at_once_and_prompts_ride_whole(model, tok):
    """A launch-bound engine (a GPU's) feeds a burst's prompts in one step, however many decode, and
    a prompt arriving beside decoding sequences rides along whole (up to prefill_chunk): the same
    completions as a CPU's schedule, in fewer forwards."""
    from worker.scheduler import PREFILL_CHUNK, SCORE_BUDGET, SCORE_CHUNK, Prefill, Scheduler

    s = Scheduler(slots=8, prefill_chunk=PREFILL_CHUNK["cuda"], launch_bound=True)
    s.decoding = [object()] * 8
    s.prefilling = [Prefill([], [0] * 3000, None, time.monotonic())]
    assert s._chunks() == [(s.prefilling[0], PREFILL_CHUNK["cuda"])]
    # prompts that score their context keep every position's logits: those stay within SCORE_BUDGET a step
    s.prefilling = [Prefill([], [0] * 300, 1, time.monotonic()) for _ in range(3)] + [Prefill([], [0] * 50, None, 0.0)]
    fed = [n for _, n in s._chunks()]
    assert sum(fed[:-1]) <= SCORE_BUDGET and max(fed[:-1]) <= SCORE_CHUNK and fed[-1] == 50

    prompts = [[464 + i] * (5 + 3 * i) for i in range(6)]  # ragged: packed, not padded to the longest

    def schedule(launch_bound):
        engine, _ = make_engine(model, tok, max_batch=8, prefill_chunk=PREFILL_CHUNK["cuda"] if launch_bound else 8)
        engine.scheduler.launch_bound = launch_bound
        chunks = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda events: chunks.append((b := schedule(events)).chunks) or b
        burst = [engine.submit(job(tok, [p], max_tokens=6)) for p in prompts[:4]]
        for _ in range(2):
            engine.step()
        late = [engine.submit(job(tok, [p], max_tokens=4)) for p in prompts[4:]]
        while not all(h.done for h in burst + late):
            engine.step()
        return texts(h.result() for h in burst + late), [sum(n for _, n in c) for c in chunks if c]

    gpu, cpu = schedule(True), schedule(False)
    assert gpu[0] == cpu[0]
    assert gpu[1] == [sum(map(len, prompts[:4])), sum(map(len, prompts[4:]))]  # two steps fed every prompt
    assert len(cpu[1]) > 2


def test_batch_buckets_reach_every_slot():
    """An engine's graphs cover every batch its slots allow: the buckets, then multiples of the last."""
    for slots in (3, 8, 64, 65, 200, 256):
        buckets = DecodeRoutes.buckets(SimpleNamespace(slots=slots))
        assert buckets == sorted(set(buckets)) and buckets[-1] == bucket(slots)
        assert all(bucket(rows) in buckets for rows in range(1, slots + 1))
