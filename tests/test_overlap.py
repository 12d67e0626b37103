"""The engine running a step ahead (worker/engine.py `overlap`, a GPU's default) against the engine
taking each step's tokens in before the next: the same tokens, logprobs, texts, finishes and
events, whatever ends a sequence a step late, cancels, or needs its tokens on the host. Run here on
the CPU, where the same code runs as on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from test_engine import PROMPTS, Sink, job, model, tok  # noqa: F401 (fixtures)
from test_structured import grammar_of
from worker.engine import Engine
from worker.errors import RequestCancelled
from worker.protocol import CompletionJob


def engines(model, tok, **kw):
    """(engine running a step ahead, its sink), (engine a step at a time, its sink)."""
    out = []
    for overlap in (True, False):
        sink = Sink()
        out.append((Engine(model, tok, event_sink=sink, overlap=overlap, **{"max_batch": 8, **kw}), sink))
    return out


def run(engine, jobs, resume=None):
    handles = [engine.submit(CompletionJob(**j.model_dump()), (resume or {}).get(j.id)) for j in jobs]
    while not all(h.done for h in handles):
        engine.step()
    return [h.result() for h in handles]


def generated(sink, j, index=0) -> list[int]:
    """The token ids choice `index` of job `j` streamed."""
    return [t for _, d in sink.of(j.id, "delta") if d["index"] == index for t in d["token_ids"]]


def assert_same(ahead, sync):
    """Completions equal: texts, finishes, tokens and usage exactly, logprobs to rounding (a step ahead
    runs rows of ended sequences once more, so its batches' shapes differ). Not the cached tokens:
    the engines served different requests before."""
    for a, b in zip(ahead, sync, strict=True):
        assert {**a["usage"], "prompt_tokens_details": None} == {**b["usage"], "prompt_tokens_details": None}
        for x, y in zip(a["choices"], b["choices"], strict=True):
            assert {k: v for k, v in x.items() if k != "logprobs"} == {k: v for k, v in y.items() if k != "logprobs"}
            if y["logprobs"] is None:
                assert x["logprobs"] is None
                continue
            assert x["logprobs"]["tokens"] == y["logprobs"]["tokens"]
            assert x["logprobs"]["text_offset"] == y["logprobs"]["text_offset"]
            first = 1 if y["logprobs"]["token_logprobs"][:1] == [None] else 0  # an echoed prompt's first token
            assert_close(x["logprobs"]["token_logprobs"][first:], y["logprobs"]["token_logprobs"][first:], atol=1e-4, rtol=0)


def assert_streams_add_up(sink, jobs, results):
    """Each choice's deltas add up to its text and tokens, and it finishes once, as it ended."""
    for j, result in zip(jobs, results):
        for choice in result["choices"]:
            deltas = [d for _, d in sink.of(j.id, "delta") if d["index"] == choice["index"]]
            finishes = [d for _, d in sink.of(j.id, "finish") if d["index"] == choice["index"]]
            assert "".join(d["text"] for d in deltas) == choice["text"]
            if choice["logprobs"] is not None:
                assert [t for d in deltas for t in d["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
            assert [f["finish_reason"] for f in finishes] == [choice["finish_reason"]]


def test_a_step_ahead_takes_each_draw_in_during_the_next_step(model, tok):
    (ahead, ahead_sink), (sync, sync_sink) = engines(model, tok)
    for engine, sink, deltas_after in ((ahead, ahead_sink, [0, 1, 2]), (sync, sync_sink, [1, 2, 3])):
        j = job(tok, max_tokens=6)
        engine.submit(j)
        seen = []
        for _ in range(3):  # the prefill and its first draw, then two decode steps
            engine.step()
            seen.append(len(sink.of(j.id, "delta")))
        assert seen == deltas_after
        while engine.scheduler.has_work():
            engine.step()
        assert sum(len(d["token_ids"]) for _, d in sink.of(j.id, "delta")) == 6
        assert engine.stats()["kv_slots_used"] == 0


def test_a_step_ahead_gives_what_a_step_at_a_time_gives(model, tok):
    """Greedy and seeded sampling, n, logprobs, echo, penalties, logit_bias, stop strings and stop
    tokens found a step late, min_tokens, max_tokens: 3 slots, so sequences wait for the slots of
    those that end, and prompts are fed in chunks beside decoding rows."""
    (ahead, ahead_sink), (sync, sync_sink) = engines(model, tok, max_batch=3, prefill_chunk=4)
    free = sync.generate(greedy := job(tok, [PROMPTS[1]], max_tokens=12, logprobs=0))["choices"][0]
    pieces, ids = free["logprobs"]["tokens"], generated(sync_sink, greedy)
    stop = pieces[3][-2:] + pieces[4][:2]  # ends the choice inside its 5th token
    stop_token = ids[6]
    jobs = [job(tok, [PROMPTS[1]], max_tokens=12, stop=[stop], logprobs=2),
            job(tok, [PROMPTS[1]], max_tokens=12, stop_token_ids=[stop_token]),
            job(tok, [PROMPTS[1]], max_tokens=12, stop_token_ids=[stop_token], min_tokens=9),
            job(tok, [PROMPTS[1]], max_tokens=12, stop=[stop], include_stop_str_in_output=True),
            job(tok, PROMPTS[:2], temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=9, logprobs=3,
                presence_penalty=0.5, frequency_penalty=0.3),
            job(tok, [PROMPTS[3]], echo=True, logprobs=1, max_tokens=5, logit_bias={ids[2]: -100}),
            job(tok, [PROMPTS[2]], temperature=1.2, top_k=20, min_p=0.02, seed=3, max_tokens=1),
            job(tok, [PROMPTS[0]], max_tokens=15, repetition_penalty=1.3, logprobs=1),
            job(tok, [PROMPTS[1], PROMPTS[3]], max_tokens=12, stop=[stop], logprobs=1)]  # one choice ends early
    ahead_results, sync_results = run(ahead, jobs), run(sync, jobs)
    assert_same(ahead_results, sync_results)
    assert [r["choices"][0]["finish_reason"] for r in sync_results[:4]] == ["stop", "stop", "length", "stop"]
    assert sync_results[2]["usage"]["completion_tokens"] == 12  # the stop token banned before min_tokens
    assert [c["finish_reason"] for c in sync_results[-1]["choices"]] == ["stop", "length"]
    assert_streams_add_up(ahead_sink, jobs, ahead_results)
    assert ahead.stats()["kv_slots_used"] == 0


def test_a_prefix_left_by_a_sequence_that_ended_a_step_late_is_reused_whole(model, tok):
    """A sequence found to have stopped after its next step ran gives back a slot whose keys and
    values hold its prompt and every token it kept, and a prompt continuing its text reuses them."""
    (ahead, _), (sync, _) = engines(model, tok, max_batch=2)
    free = sync.generate(job(tok, [PROMPTS[3]], max_tokens=10, logprobs=0))["choices"][0]
    stop = free["logprobs"]["tokens"][6]
    first = job(tok, [PROMPTS[3]], max_tokens=10, stop=[stop])
    kept = ahead.generate(first)["choices"][0]["text"]
    follow = job(tok, [tok.encode(PROMPTS[3] + kept) + tok.encode(" and")], max_tokens=6, logprobs=2)
    reused, fresh = ahead.generate(follow), Engine(model, tok, max_batch=2, overlap=False).generate(follow)
    assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(tok.encode(PROMPTS[3] + kept)) - 1
    assert_same([reused], [fresh])


def test_cancelling_a_request_whose_draw_is_on_its_way(model, tok):
    (ahead, sink), (sync, _) = engines(model, tok)
    long, other = job(tok, [PROMPTS[1]], max_tokens=40), job(tok, [PROMPTS[3]], max_tokens=12, logprobs=1)
    alone = sync.generate(long)["choices"][0]["text"]
    handles = [ahead.submit(long), ahead.submit(other)]
    for _ in range(4):
        ahead.step()
    handles[0].cancel()
    while not handles[1].done:
        ahead.step()
    with pytest.raises(RequestCancelled):
        handles[0].result()
    assert sink.of(long.id)[-1] == ("cancelled", {})
    shown = "".join(d["text"] for _, d in sink.of(long.id, "delta"))
    assert shown and alone.startswith(shown)
    assert_same([handles[1].result()], [sync.generate(other)])
    assert ahead.stats()["kv_slots_used"] == 0


def test_requests_that_need_their_tokens_on_the_host_beside_requests_running_ahead(model, tok):
    """Beam search, a grammar, multi-token bad words and n-gram bans arrive while sampled requests run
    ahead; a resumed request too. Every request gives what it gives a step at a time."""
    (ahead, ahead_sink), (sync, sync_sink) = engines(model, tok, max_batch=12)
    sync.generate(greedy := job(tok, [PROMPTS[1]], max_tokens=8))
    ids = generated(sync_sink, greedy)
    running = [job(tok, [PROMPTS[0]], max_tokens=30, temperature=0.8, seed=1, logprobs=1),
               job(tok, [PROMPTS[2]], max_tokens=30)]
    arriving = [job(tok, [PROMPTS[1]], max_tokens=8, bad_words=[ids[2:4]]),
                job(tok, [PROMPTS[1]], max_tokens=8, no_repeat_ngram_size=2),
                job(tok, [PROMPTS[3]], max_tokens=6, use_beam_search=True, n=2, best_of=3),
                job(tok, max_tokens=40, grammar=grammar_of(structured_outputs={"choice": ["yes", "no", "maybe so"]})),
                job(tok, [PROMPTS[0]], max_tokens=10, temperature=1.0, seed=9, n=2)]
    original = arriving[-1]
    sync.generate(original)
    emitted = {index: generated(sync_sink, original, index)[:3] for index in (0, 1)}
    resumed = CompletionJob(**{**original.model_dump(), "id": "resumed"})
    arriving[-1] = resumed
    results = {}
    for engine in (ahead, sync):
        handles = [engine.submit(CompletionJob(**j.model_dump())) for j in running]
        for _ in range(3):
            engine.step()
        handles += [engine.submit(CompletionJob(**j.model_dump()), emitted if j is resumed else None) for j in arriving]
        while not all(h.done for h in handles):
            engine.step()
        results[engine.overlap] = [h.result() for h in handles]
    assert_same(results[True], results[False])
    grammar_text = results[False][5]["choices"][0]["text"]
    assert grammar_text in ("yes", "no", "maybe so")
    assert_streams_add_up(ahead_sink, running, results[True][:2])
    assert ahead.stats()["kv_slots_used"] == 0


def test_the_device_keeps_each_slot_s_last_draw(model, tok):
    """The token a step ahead feeds comes from the device's record of each slot's draw, which is
    the token the host then takes in."""
    engine = Engine(model, tok, max_batch=4, overlap=True, event_sink=(sink := Sink()))
    j = job(tok, PROMPTS[:2], max_tokens=5, temperature=1.0, seed=4)
    h = engine.submit(j)
    engine.step()  # both prefills and their first draws, not taken in
    seqs = engine.scheduler.decoding
    assert [s.pending for s in seqs] == [1, 1] and all(not s.tokens for s in seqs)
    on_device = engine.runner.last[torch.tensor([s.slot for s in seqs])].tolist()
    engine.step()
    assert [s.tokens[0] for s in seqs] == on_device
    while not h.done:
        engine.step()
    assert [generated(sink, j, index)[0] for index in (0, 1)] == on_device


@pytest.mark.parametrize("graphs", [None, True], ids=["eager", "graphed"])
def test_decode_steps_running_ahead_copy_nothing_to_the_device_while_their_rows_stay(model, tok, monkeypatch, graphs):
    """Decode steps whose rows draw a step ahead (greedy, EOS banned by logit_bias, as the
    benchmarks run) send the device nothing while the batch holds the same sequences: their slots
    and positions are the step before's, advanced on the device; their last tokens come from the
    device's record of their draws, and their biases from the step before's copy. The draws still
    equal those of a step at a time.
    Graphed (CUDA graphs' bodies, run eagerly on the CPU), the rows draw inside the graphs."""
    import worker.decode_routes
    import worker.runner
    import worker.sampling

    ahead = Engine(model, tok, max_batch=4, overlap=True, event_sink=Sink(), cuda_graphs=graphs)
    jobs = [job(tok, [prompt], max_tokens=12, temperature=0.0, logit_bias={tok.eos_token_id: -100.0})
            for prompt in PROMPTS[:3]]
    copies = []
    for module in (worker.runner, worker.sampling, worker.decode_routes):
        real = module.to_device
        monkeypatch.setattr(module, "to_device", lambda *a, real=real, **k: copies.append(a[0]) or real(*a, **k))
    handles = [ahead.submit(j) for j in jobs]
    for _ in range(3):  # the prefills, then steps with the new rows' first draws
        ahead.step()
    per_step = []
    while all(s.pending for s in ahead.scheduler.decoding) and len(per_step) < 5:
        copies.clear()
        ahead.step()
        per_step.append(len(copies))
    assert len(per_step) == 5 and per_step == [0] * 5, per_step
    where = ahead.runner._where[3]  # the last forward's, advanced on the device: each row a position before its next
    decoding = ahead.scheduler.decoding
    assert [p + 1 for p in where[1, :len(decoding)].tolist()] == [s.position for s in decoding]
    assert (ahead.runner.graphs is not None and sum(ahead.runner.graphs.draws.values()) >= 5) == bool(graphs)
    while not all(h.done for h in handles):
        ahead.step()
    monkeypatch.undo()
    sync = Engine(model, tok, max_batch=4, overlap=False)
    assert [h.result()["choices"][0]["text"] for h in handles] == [sync.generate(j)["choices"][0]["text"] for j in jobs]


# ---- through the whole stack: a worker running ahead (`processor.py --overlap`) ----

@pytest.mark.slow
def test_a_worker_running_ahead_through_the_openai_client(hf_checkpoint, tmp_path, model, tok):
    """`processor.py --overlap --decode-steps 4` on the CPU behind gunicorn and Redis: the `openai`
    client's sync and streamed completions (stop strings found steps late, n, logprobs, a seed) equal
    the engine's a step at a time, and a stream the client leaves is cancelled while its draws are on
    their way."""
    import openai

    from tests.stack import start_gunicorn, start_processor, write_models_toml
    from web.dev.local_redis import start_redis

    models = tmp_path / "models.toml"
    write_models_toml(models, {"tiny": hf_checkpoint}, device="cpu", max_batch=8)
    sync = Engine(model, tok, max_batch=8, overlap=False)
    probe = sync.generate(job(tok, [PROMPTS[1]], max_tokens=12, logprobs=0))["choices"][0]["logprobs"]["tokens"]
    stop = probe[3][-2:] + probe[4][:2]
    requests = [dict(prompt=PROMPTS[1], max_tokens=12, stop=[stop], logprobs=1, temperature=0),
                dict(prompt=[PROMPTS[0], PROMPTS[3]], max_tokens=10, n=2, temperature=0.9, seed=5),
                dict(prompt=PROMPTS[2], max_tokens=16, presence_penalty=0.4, logprobs=2, temperature=0)]
    server = start_redis()
    try:
        with start_processor(server.url, models, models=["tiny"], concurrency=8, compile=False, log_dir=tmp_path,
                             extra_args=["--overlap", "--decode-steps", "4"]) as worker, \
                start_gunicorn(server.url, models, env={"NANOSERVE_AUTH": "disabled"}, workers=1, threads=8,
                               log_dir=tmp_path) as web:
            client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0)
            for body in requests:
                prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
                fields = {k: v for k, v in body.items() if k != "prompt"}
                want = sync.generate(job(tok, prompts, **fields))["choices"]
                whole = client.completions.create(model="tiny", **body).choices
                texts: dict[int, str] = {}
                for chunk in client.completions.create(model="tiny", stream=True, **body):
                    texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
                for w, got in zip(want, sorted(whole, key=lambda c: c.index), strict=True):
                    assert (got.text, got.finish_reason) == (w["text"], w["finish_reason"])
                    assert texts[got.index] == w["text"]
                    if w["logprobs"] is not None:
                        assert got.logprobs.tokens == w["logprobs"]["tokens"]
                        assert_close(got.logprobs.token_logprobs, w["logprobs"]["token_logprobs"], atol=1e-4, rtol=0)
            stream = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=100, stream=True)
            next(iter(stream))
            stream.close()  # the web tier cancels the job; the worker takes its cancel between steps
            assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3).usage.completion_tokens == 3
            engine_ready = [line for line in worker.logs().splitlines() if '"engine ready"' in line]
    finally:
        server.stop()
    assert len(engine_ready) == 1 and '"overlap": true' in engine_ready[0] and '"decode_steps": 4' in engine_ready[0]


def test_a_fault_taking_in_the_step_before_fails_its_requests_not_the_engine(model, tok, monkeypatch):
    """A beam search arriving makes the engine take the step before's tokens in before it schedules;
    a fault there fails the requests those tokens belong to, as a faulted step does, and the engine
    serves the beam search and what comes next."""
    from worker.errors import EngineFault

    (ahead, sink), (sync, _) = engines(model, tok)
    running = ahead.submit(job(tok, [PROMPTS[0]], max_tokens=30))
    ahead.step()
    ahead.step()
    real, calls = ahead.output.accept, []

    def accept(rows, draws):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("host lost")
        return real(rows, draws)

    beams = job(tok, [PROMPTS[3]], max_tokens=6, use_beam_search=True, n=2, best_of=3)
    handle = ahead.submit(beams)
    ahead.step()  # the beam search is registered; the sampled request's draw is still on its way
    assert ahead._ahead
    monkeypatch.setattr(ahead.output, "accept", accept)
    while not handle.done:
        ahead.step()
    with pytest.raises(EngineFault):
        running.result()
    assert {t for t, _ in sink.of(running.job_id)} == {"delta"}  # no error event: a retry resumes it
    assert calls[0] == 1  # the fault came taking in the sampled request's draw
    assert_same([handle.result()], [sync.generate(beams)])
    assert_same([ahead.generate(job(tok, max_tokens=5))], [sync.generate(job(tok, max_tokens=5))])
    assert ahead.stats()["kv_slots_used"] == 0


# ---- several decode forwards a step (worker/engine.py `decode_steps`) ----

def steps_of(engine, jobs):
    """The completions of `jobs` submitted at once, and the engine's steps and decode forwards."""
    steps, forwards = 0, engine.stats()["steps"]
    handles = [engine.submit(CompletionJob(**j.model_dump())) for j in jobs]
    while not all(h.done for h in handles):
        engine.step()
        steps += 1
    return [h.result() for h in handles], steps, engine.stats()["steps"] - forwards


def test_several_decode_forwards_a_step_give_what_a_step_at_a_time_gives(model, tok):
    """Four decode forwards a step while nothing waits: greedy and seeded rows, n, logprobs,
    penalties, logit_bias, min_tokens, stop strings and stop tokens found inside a step's forwards
    (their later draws dropped) give what one forward a step taking each draw in at once gives,
    in fewer steps than forwards."""
    sync = Engine(model, tok, max_batch=8, overlap=False, event_sink=(sync_sink := Sink()))
    free = sync.generate(greedy := job(tok, [PROMPTS[1]], max_tokens=14, logprobs=0))["choices"][0]
    pieces, ids = free["logprobs"]["tokens"], generated(sync_sink, greedy)
    stop = pieces[5][-2:] + pieces[6][:2]  # ends the choice inside its 7th token, mid-way through a step
    late = max(i for i in range(len(ids)) if ids.index(ids[i]) == i)  # the token first drawn last
    jobs = [job(tok, [PROMPTS[1]], max_tokens=14, stop=[stop], logprobs=2),
            job(tok, PROMPTS[:2], temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=13, logprobs=3,
                presence_penalty=0.5, frequency_penalty=0.3),
            job(tok, [PROMPTS[3]], max_tokens=10, logit_bias={tok.eos_token_id: -100}, repetition_penalty=1.3),
            job(tok, [PROMPTS[2]], temperature=1.2, top_k=20, min_p=0.02, seed=3, max_tokens=11, min_tokens=6),
            job(tok, [PROMPTS[0]], max_tokens=9, stop=[stop], include_stop_str_in_output=True),
            job(tok, [PROMPTS[1]], max_tokens=14, stop_token_ids=[ids[late]])]
    several = Engine(model, tok, max_batch=8, overlap=True, decode_steps=4, event_sink=(sink := Sink()))
    got, steps, forwards = steps_of(several, jobs)
    want, _, _ = steps_of(sync, jobs)
    assert_same(got, want)
    assert got[0]["choices"][0]["finish_reason"] == "stop" and got[0]["usage"]["completion_tokens"] < 14
    assert steps < forwards  # some steps ran several forwards
    assert_streams_add_up(sink, jobs, got)
    assert got[-1]["choices"][0]["finish_reason"] == "stop" and got[-1]["usage"]["completion_tokens"] == late + 1
    assert several.stats()["kv_slots_used"] == 0


def test_no_sequence_draws_past_its_max_tokens(model, tok):
    """A step's forwards stop where the first of its sequences reaches its max_tokens: sequences
    that end by their length draw no token they do not keep."""
    several = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, event_sink=Sink())
    jobs = [job(tok, [PROMPTS[0]], max_tokens=6, logit_bias={tok.eos_token_id: -100}),
            job(tok, [PROMPTS[2]], max_tokens=11, logit_bias={tok.eos_token_id: -100})]
    got, steps, forwards = steps_of(several, jobs)
    assert [r["usage"]["completion_tokens"] for r in got] == [6, 11]
    assert several.runner.tokens_generated == 17  # every draw kept
    assert steps < forwards


def test_a_request_arriving_is_admitted_at_the_next_step(model, tok):
    """While sequences run several forwards a step, a new request makes the next step run one
    forward with its prefill, and a cancellation ends its request at the next step: neither waits
    longer than behind one step."""
    several = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, event_sink=(sink := Sink()))
    long = several.submit(job(tok, [PROMPTS[1]], max_tokens=60, logit_bias={tok.eos_token_id: -100}))
    for _ in range(3):
        several.step()
    forwards, kinds = several.stats()["steps"], several.stats()["step_kinds"]
    several.step()
    assert several.stats()["steps"] - forwards == 4  # only decoding: four forwards
    # counted as such by what the step ran (the metrics' step kinds)
    decode = several.stats()["step_kinds"]["decode"]
    assert (decode["steps"] - kinds["decode"]["steps"], decode["forwards"] - kinds["decode"]["forwards"]) == (1, 4)
    arriving = job(tok, [PROMPTS[3]], max_tokens=3)
    handle = several.submit(arriving)
    several.step()
    assert several.stats()["steps"] - forwards == 5  # its first prefill step: one forward
    prompt = several.stats()["step_kinds"]["prompt"]
    assert (prompt["steps"] - kinds["prompt"]["steps"], prompt["forwards"] - kinds["prompt"]["forwards"]) == (1, 1)
    scheduler = several.scheduler
    started = [u.seqs[0].request.job.id for u in scheduler.prefilling] + [s.request.job.id for s in scheduler.decoding]
    assert arriving.id in started  # its prefill began (a CPU may feed a prompt beside decoding rows in chunks)
    long.cancel()
    several.step()
    assert long.done  # taken at the next step
    while not handle.done:
        several.step()
    with pytest.raises(RequestCancelled):
        long.result()
    stats = several.stats()  # every step of one kind: the kinds add up to the forwards and busy time
    assert sum(k["forwards"] for k in stats["step_kinds"].values()) == stats["steps"]
    assert sum(k["seconds"] for k in stats["step_kinds"].values()) == pytest.approx(stats["busy_seconds"], rel=1e-9)
    sync = Engine(model, tok, max_batch=4, overlap=False)
    assert_same([handle.result()], [sync.generate(arriving)])


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_rows_draw_inside_the_graphs_what_the_sampler_draws(model, tok, decode_steps):
    """With the decode's graphs (their bodies run eagerly on the CPU, the same code as a GPU's), a
    batch whose rows draw from their logits alone draws inside them, step after step fed on the
    device: greedy rows with logit_bias, allowed_token_ids, banned tokens, stop strings and tokens,
    n and max_tokens, then seeded rows at a temperature beside them, then truncated ones (top_k,
    top_p, min_p), then penalized ones (presence, frequency, repetition), give what the sampler gives
    a step at a time with the same noise (a GPU's, `Sampler.hashed`), logprobs too. A row short of
    its min_tokens joining draws inside them too, its stop tokens banned until then, a step of the
    sampler's in between included, and the completions are still the same."""
    sync = Engine(model, tok, max_batch=8, overlap=False, cuda_graphs=False, event_sink=(sync_sink := Sink()))
    sync.runner.sampler.hashed = True
    free = sync.generate(greedy := job(tok, [PROMPTS[1]], max_tokens=14, logprobs=0))["choices"][0]
    pieces, ids = free["logprobs"]["tokens"], generated(sync_sink, greedy)
    stop = pieces[5][-2:] + pieces[6][:2]
    allowed = sorted(set(ids) | {ids[0] + 1, 11, 198})
    greedy_jobs = [job(tok, [PROMPTS[1]], max_tokens=14, stop=[stop], logprobs=2),
                   job(tok, PROMPTS[:2], n=2, max_tokens=11, logit_bias={tok.eos_token_id: -100, ids[3]: 5.0}),
                   job(tok, [PROMPTS[3]], max_tokens=9, allowed_token_ids=allowed),
                   job(tok, [PROMPTS[2]], max_tokens=10, bad_words=[[ids[1]]],
                       logit_bias={ids[2]: -100}, stop_token_ids=[ids[4]])]
    sampled_jobs = [*greedy_jobs[:2],
                    job(tok, PROMPTS[2:4], n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=1,
                        logit_bias={tok.eos_token_id: -100}),
                    job(tok, [PROMPTS[0]], temperature=1.3, seed=8, max_tokens=13, allowed_token_ids=allowed)]
    truncated_jobs = [*sampled_jobs,
                      job(tok, [PROMPTS[0]], max_tokens=12, temperature=0.8, top_p=0.9, seed=9),
                      job(tok, [PROMPTS[3]], max_tokens=10, temperature=1.1, top_k=5, min_p=0.05, seed=10)]
    penalized_jobs = [*truncated_jobs,
                      job(tok, [PROMPTS[1]], max_tokens=12, temperature=0.7, presence_penalty=0.5,
                          frequency_penalty=0.3, seed=11),
                      job(tok, [PROMPTS[2]], max_tokens=12, repetition_penalty=1.4)]
    early = job(tok, [PROMPTS[1]], max_tokens=18, temperature=0.7, min_tokens=15, seed=12)  # > 4 steps of 4
    graphed = Engine(model, tok, max_batch=8, overlap=True, decode_steps=decode_steps, cuda_graphs=True,
                     event_sink=(sink := Sink()))
    graphed.runner.sampler.hashed = True
    draws = graphed.runner.graphs.draws
    got, _, _ = steps_of(graphed, greedy_jobs)
    assert sum(n for (_, kind), n in draws.items() if kind == "greedy") > 0
    assert_streams_add_up(sink, greedy_jobs, got)
    assert_same(got, steps_of(sync, greedy_jobs)[0])
    got, _, _ = steps_of(graphed, sampled_jobs)
    assert sum(n for (_, kind), n in draws.items() if kind == "sampled") > 0
    assert_same(got, steps_of(sync, sampled_jobs)[0])
    got, _, _ = steps_of(graphed, truncated_jobs)
    assert sum(n for (_, kind), n in draws.items() if kind == "truncated") > 0
    assert_same(got, steps_of(sync, truncated_jobs)[0])
    got, _, _ = steps_of(graphed, penalized_jobs)
    assert sum(n for (_, kind), n in draws.items() if kind == "penalized") > 0
    assert_same(got, steps_of(sync, penalized_jobs)[0])
    # rows at a temperature most of whose draws would stop them: held off until their min_tokens,
    # then almost surely stopped at it
    stops = [t for t in range(tok.eos_token_id) if t % 16]
    early_jobs = [*sampled_jobs, early,
                  job(tok, [PROMPTS[1]], max_tokens=14, min_tokens=12, temperature=1.0, seed=13, stop_token_ids=stops),
                  job(tok, [PROMPTS[1]], max_tokens=14, min_tokens=9, temperature=1.0, seed=14, stop_token_ids=stops)]
    handles = [graphed.submit(CompletionJob(**j.model_dump())) for j in early_jobs]
    while not any(s.request.job.id == early.id for s in graphed.scheduler.decoding):
        graphed.step()
    penalized = lambda: sum(n for (_, kind), n in draws.items() if kind == "penalized")  # noqa: E731
    before = penalized()
    graphed.step()
    # one step drawn by the sampler (as a row whose draw needs more would send it): the graphs'
    # countdown to min_tokens then starts again from the sampler's count
    graphed.runner.decode_in_graphs = lambda rows, forwards: None
    graphed.step()
    del graphed.runner.decode_in_graphs
    while not all(h.done for h in handles):
        graphed.step()
    assert penalized() > before  # none of these rows is penalized: the early ones drew inside the graphs
    assert_same([h.result() for h in handles], steps_of(sync, early_jobs)[0])
    assert graphed.stats()["kv_slots_used"] == 0


def test_a_draw_of_the_samplers_between_the_graphs_draws_leaves_min_tokens_where_it_was(model, tok):
    """The graphs count each row's draws to its min_tokens on the device; a step drawn by the sampler
    in between (here forced; a row that needs more than its logits sends one) is counted there too:
    a row whose stop token comes at its min_tokens stops there, as a step at a time does."""
    sync = Engine(model, tok, max_batch=4, overlap=False, cuda_graphs=False, event_sink=Sink())
    sync.runner.sampler.hashed = True
    stops = [t for t in range(tok.eos_token_id) if t % 16]  # most draws would stop the row

    def rows(minimum, seed):
        return [job(tok, [PROMPTS[1]], max_tokens=16, min_tokens=minimum, temperature=1.0, seed=seed,
                    stop_token_ids=stops), job(tok, [PROMPTS[2]], max_tokens=16, temperature=0.9, seed=16)]

    # the first draw (the prompt's), 4 in the graphs, 4 by the sampler, then 4 in the graphs again:
    # a min_tokens among those last, where the row's first draw allowed to stop stops it
    minimum, seed = next((m, seed) for seed in range(15, 40) for m in (10, 11, 12)
                         if steps_of(sync, rows(m, seed))[0][0]["usage"]["completion_tokens"] == m + 1)
    graphed = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, cuda_graphs=True, event_sink=Sink())
    graphed.runner.sampler.hashed = True
    handles = [graphed.submit(j) for j in rows(minimum, seed)]
    while len(graphed.scheduler.decoding) < 2:
        graphed.step()
    drawn = sum(graphed.runner.graphs.draws.values())
    graphed.step()
    assert sum(graphed.runner.graphs.draws.values()) > drawn  # inside the graphs, before min_tokens
    graphed.runner.decode_in_graphs = lambda rows, forwards: None
    graphed.step()
    del graphed.runner.decode_in_graphs
    while not all(h.done for h in handles):
        graphed.step()
    assert_same([h.result() for h in handles], steps_of(sync, rows(minimum, seed))[0])


def test_draws_that_fail_to_record_leave_the_decode_graphed(model, tok, monkeypatch):
    """Where recording the draws' graphs fails, the decode's graphs still serve and the sampler
    draws every step's tokens: the same completions as a step at a time without graphs."""
    from nanogpt.runtime.cuda_graphs import GraphedDecode

    def fail(self, batches):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(GraphedDecode, "record_draws", fail)
    graphed = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, cuda_graphs=True, event_sink=Sink())
    graphs = graphed.runner.graphs
    assert graphs is not None and not graphs.draw_graphs
    jobs = [job(tok, PROMPTS[:2], max_tokens=9, logit_bias={tok.eos_token_id: -100}),
            job(tok, [PROMPTS[2]], temperature=0.9, seed=3, max_tokens=7)]
    got, _, _ = steps_of(graphed, jobs)
    assert sum(graphs.replays.values()) > 0 and not graphs.draws
    sync = Engine(model, tok, max_batch=4, overlap=False, cuda_graphs=False, event_sink=Sink())
    assert_same(got, steps_of(sync, jobs)[0])


def test_prompts_fed_as_rows_of_the_graphs_give_what_eager_prefills_give(model, tok, monkeypatch):
    """Where CUDA graphs take them (worker/decode_routes.py: BUCKET with prompt chunks riding), a
    step's prompts are fed as rows of the decode's graphs, alone or beside decoding rows, and no
    eager prefill forward runs: the same completions as an engine without graphs, greedy and
    seeded, `n` (one prefill shared), logprobs, a prompt arriving while others decode, prompts fed
    a few tokens a step. A prompt
    that scores its context (echo with logprobs) and a step of more prompt tokens than the graphs'
    rows are fed eagerly."""
    from worker import decode_routes
    from worker.decode_routes import Graph

    eager = []
    for name in ("forward_cached", "forward_packed"):  # the eager prefill's forwards
        monkeypatch.setattr(model, name,
                            lambda *a, _f=getattr(model, name), _n=name, **k: eager.append(_n) or _f(*a, **k))
    sync = Engine(model, tok, max_batch=4, overlap=False, cuda_graphs=False, event_sink=Sink())
    graphed = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, cuda_graphs=True, event_sink=Sink())
    for engine in (sync, graphed):
        engine.runner.sampler.hashed = True
    first = [job(tok, PROMPTS[:1], max_tokens=9, logprobs=2, logit_bias={tok.eos_token_id: -100}),
             job(tok, PROMPTS[1:2], n=2, temperature=0.8, seed=5, max_tokens=7)]
    later = job(tok, PROMPTS[3:4], max_tokens=6, temperature=0.9, seed=6, logprobs=1)

    def serve(engine):
        handles = [engine.submit(CompletionJob(**j.model_dump())) for j in first]
        while len(engine.scheduler.decoding) < 3:
            engine.step()
        handles.append(engine.submit(CompletionJob(**later.model_dump())))
        while not all(h.done for h in handles):
            engine.step()
        return [h.result() for h in handles]

    want = serve(sync)
    eager.clear()
    bucket = graphed.runner.routes_taken[Graph.BUCKET]
    assert_same(serve(graphed), want)
    assert eager == [] and graphed.runner.routes_taken[Graph.BUCKET] > bucket
    assert graphed.runner.prompt_tokens >= sum(len(tok.encode(p)) for p in PROMPTS[:2] + PROMPTS[3:4])
    # prompts fed 3 tokens a step: each later chunk's rows attend to the cache its earlier ones wrote
    chunked = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, cuda_graphs=True, prefill_chunk=3,
                     event_sink=Sink())
    chunked.runner.sampler.hashed = True
    assert_same(serve(chunked), want)
    assert eager == []
    scored = job(tok, PROMPTS[3:4], max_tokens=3, echo=True, logprobs=1)
    assert_same(steps_of(graphed, [scored])[0], steps_of(sync, [scored])[0])
    assert eager  # scoring its context: an eager forward of all its positions' logits

    monkeypatch.setattr(decode_routes, "GRAPHED_ROWS", 8)  # fewer rows than the prompts' tokens
    monkeypatch.setattr(decode_routes, "BATCH_BUCKETS", (1, 2, 4))
    small = Engine(model, tok, max_batch=4, overlap=True, decode_steps=4, cuda_graphs=True, event_sink=Sink())
    small.runner.sampler.hashed = True
    eager.clear()
    long = [job(tok, PROMPTS[1:2], max_tokens=5), job(tok, PROMPTS[3:4], max_tokens=5)]
    assert_same(steps_of(small, long)[0], steps_of(sync, long)[0])
    assert eager


def test_decode_steps_must_be_positive(model, tok):
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(model, tok, max_batch=2, decode_steps=0)
