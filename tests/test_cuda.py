"""The CUDA path, on a GPU, against the references of the CPU tests: nanoserve's model against
transformers' on the same GPU (float32 to 1e-4, bfloat16 within its rounding of the float32
logits), the full forward and ragged-batch decoding through the KV cache, for GPT-2 and GPT-NeoX;
the engine's greedy tokens and logprobs equal to transformers' generate; seeded sampling that does
not depend on its batch; the decode step replayed from CUDA graphs, eager and compiled; the bfloat16
engine; running a step ahead, and decode steps that never wait for the GPU; the decode attention's
Triton kernel against PyTorch's ops, launched and replayed from a CUDA graph; the fused layer norms
and epilogues, and the few-row matmul kernel and its timed choice against the plain model's logits; two replicas with
`processor.py --device all`; and `bench.engine_bench --device cuda`.

Every test is marked `cuda` and skipped, with the reason, where torch sees no GPU
(tests/conftest.py). On a GPU machine: `pytest -m cuda`.
"""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.testing import assert_close

import test_engine
from models.tokenizer import load_tokenizer
from nanogpt.checkpoint import load_model
from nanogpt.kernels import decode_attention
from nanogpt.runtime.kv_cache import DecodeWindow, KVCache
from test_engine import PROMPTS, hf_greedy, job, make_engine, run_all, tok  # noqa: F401  (tok: the fixture)
from test_families import CONTEXT, Family
from test_model import SHAPES, cached_call, make_pair, random_seq

pytestmark = pytest.mark.cuda

CUDA = "cuda"
FLOAT32 = dict(rtol=1e-4, atol=1e-4)
# bfloat16 keeps 8 significant bits (each rounding is off by up to 2^-9 of the value): through the
# embeddings, the blocks and the head, the logits of these models (within about +-18) drift from
# the float32 ones by a few hundredths (at most 0.045 and 0.063 for the two SHAPES, measured on a
# CPU's bf16); this bound leaves more than 3x room. Their top two logits lie 2.5 or more apart,
# far beyond the bound, so every argmax must stay the same.
BFLOAT16 = dict(rtol=0.02, atol=0.2)
TOLERANCE = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """float32 matmuls in float32, not TF32: PyTorch's default, which a training run in the same
    process (nanogpt/training/train.py) switches off."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- logits against transformers on the GPU ----

@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """Our model and transformers', both on the GPU in float32 (tests/test_model.py's Pair)."""
    return make_pair(request.param, tmp_path_factory, device=CUDA)


def ours_in(pair, dtype):
    return pair.ours if dtype == torch.float32 else load_model(str(pair.directory), device=CUDA, dtype=dtype)


def replay(model, cache, seqs, slot_of, plan, reference, tolerance):
    """Feed each step of `plan` (a list of (name, n): seqs[name]'s next n tokens into its slot;
    n = 0 is a padding row) through forward_cached, and hold every real row's logits against
    reference(seq) at that position. Checks that the slots of no real sequence stay untouched."""
    done = dict.fromkeys(seqs, 0)
    for step in plan:
        out = cached_call(model, cache, [(slot_of[name], seqs[name], done[name], n) for name, n in step])
        assert out.dtype == torch.float32 and out.device.type == "cuda" and out.shape == (len(step), model.config.vocab_size)
        for row, (name, n) in enumerate(step):
            if n:
                want = reference(seqs[name])[done[name] + n - 1]
                assert_close(out[row], want, **tolerance)
                assert out[row].argmax() == want.argmax()
                done[name] += n
    real = {slot_of[name] for name, n in done.items() if n}
    for layer in cache.k + cache.v:
        for slot in set(range(cache.max_slots)) - real:
            assert not layer[slot].any()


@DTYPES
def test_full_forward_matches_transformers(pair, dtype):
    model = ours_in(pair, dtype)
    idx = torch.randint(0, 50257, (3, pair.n_positions), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        logits, loss = model(idx[:, :-1], targets=idx[:, 1:])
        ref = pair.hf(idx, labels=idx)  # float32, on the GPU
    assert logits.device.type == "cuda" and logits.dtype == dtype
    assert_close(logits.float(), ref.logits[:, :-1], **TOLERANCE[dtype])
    assert torch.equal(logits.float().argmax(-1), ref.logits[:, :-1].argmax(-1))
    assert_close(loss, ref.loss, **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("slot_of", [dict(a=5, b=1, c=3, pad=0), dict(a=1, b=2, c=3, pad=0)],
                         ids=["scattered", "consecutive"])
def test_ragged_batch_decoding_matches_transformers(pair, dtype, slot_of):
    """Prefills of different lengths, decode steps with a padding row, a sequence joining among the
    others' decode and a chunked continuation, in the cache's dtype: every row's logits are
    transformers' float32 ones at that position, within the dtype's tolerance."""
    model = ours_in(pair, dtype)
    cache = KVCache(model.config, max_slots=6, max_len=pair.n_positions, device=CUDA, dtype=dtype)
    seqs = {name: random_seq(pair.n_positions, seed) for seed, name in enumerate("abc", start=1)}
    seqs["pad"] = []
    plan = ([[("a", 9), ("b", 3)]] + [[("a", 1), ("b", 1), ("pad", 0)]] * 3 + [[("a", 1), ("c", 6), ("b", 1)]]
            + [[("a", 1), ("b", 1), ("c", 1)]] * 3 + [[("b", 4), ("a", 1), ("c", 1)]])
    replay(model, cache, seqs, slot_of, plan, pair.reference, TOLERANCE[dtype])


@pytest.fixture(scope="module")
def neox(family_checkpoints) -> Family:
    """GPT-NeoX (partial rotary embeddings, parallel residual) on the GPU, ours and transformers'."""
    from transformers import GPTNeoXForCausalLM

    directory = family_checkpoints["gpt_neox"]
    hf = GPTNeoXForCausalLM.from_pretrained(directory).to(CUDA).eval()
    return Family("gpt_neox", directory, load_model(directory, device=CUDA), hf, load_tokenizer(directory))


def test_another_family_matches_transformers(neox):
    idx = torch.randint(0, neox.tok.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        ref = neox.hf(idx).logits
    assert_close(neox.ours(idx), ref, **FLOAT32)

    cache = KVCache(neox.ours.config, max_slots=4, max_len=CONTEXT, device=CUDA)
    seqs = {name: random_seq(30, seed) for seed, name in enumerate("ab", start=1)}
    plan = [[("a", 9), ("b", 4)]] + [[("b", 1), ("a", 1)]] * 3 + [[("a", 5), ("b", 1)]]
    replay(neox.ours, cache, seqs, dict(a=3, b=0), plan, neox.reference, FLOAT32)


# ---- the engine on the GPU ----

@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return load_model(str(hf_checkpoint), device=CUDA)


@pytest.fixture(scope="module")
def hf(hf_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(hf_checkpoint).to(CUDA).eval()


def test_engine_greedy_matches_transformers(model, tok, hf):
    """tests/test_engine.py's ragged batch (chunked prefills, waiting admissions, n) on the GPU:
    transformers' greedy tokens, and their logprobs and top logprobs to 1e-4."""
    assert model.device.type == "cuda" and next(hf.parameters()).device.type == "cuda"
    test_engine.test_greedy_ragged_batch_matches_transformers(model, tok, hf)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_seeded_request_is_independent_of_its_batch(model, tok, top_p):
    """A seeded request alone and among others (tests/test_engine.py's), its noise hashed on the GPU
    (worker/sampling.py hashed_gumbel): the same text; another seed gives another."""
    test_engine.test_seeded_request_is_independent_of_its_batch(model, tok, top_p)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_graphed_decode_gives_the_launched_tokens(model, tok, tmp_path, monkeypatch, compile):
    """The decode step replayed from CUDA graphs (the default on a GPU), eager or compiled, gives
    the tokens and logprobs of the step launched kernel by kernel: 3 rows padded to the graphs of 4,
    through two span buckets (nanogpt/runtime/cuda_graphs.py)."""
    from nanogpt.runtime import compile_cache
    from nanogpt.runtime.cuda_graphs import SPAN_QUANTUM
    from worker.decode_routes import GRAPHED_ROWS, bucket

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "compile-cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    new = SPAN_QUANTUM + 8  # every row crosses a span bucket
    # EOS banned, so that all 3 run every step
    jobs = lambda: [job(tok, [p], max_tokens=new, logprobs=0, logit_bias={tok.eos_token_id: -100.0})  # noqa: E731
                    for p in PROMPTS[:3]]
    launched, _ = make_engine(model, tok, cuda_graphs=False)
    assert launched.runner.graphs is None
    reference = run_all(launched, jobs())
    engine, _ = make_engine(model, tok, compile=compile)
    # a decode step that fails to compile is served eagerly (worker/runner.py), which would prove nothing here
    assert engine.runner.compiled == compile
    graphed = run_all(engine, jobs())
    assert engine.runner.batch_sizes[3] > 0  # decode steps of 3 rows ran
    graphs = engine.runner.graphs
    # recorded before serving: every batch bucket up to the 8 slots, and past them, for prompts
    # riding along, up to GRAPHED_ROWS where the step is not compiled (a compile a batch), every span
    # bucket of 128 positions
    rows = engine.runner.routes.buckets(None if compile else bucket(GRAPHED_ROWS))
    assert compile and rows == [1, 2, 4, 8] or {1, 2, 4, 8} < set(rows) and max(rows) >= GRAPHED_ROWS
    assert set(graphs.graphs) == {(b, s) for b in rows for s in (SPAN_QUANTUM, 2 * SPAN_QUANTUM)}
    assert graphs.replays[4, SPAN_QUANTUM] > 0 and graphs.replays[4, 2 * SPAN_QUANTUM] > 0, graphs.replays
    for a, b in zip(reference, graphed):
        a, b = a["choices"][0], b["choices"][0]
        assert len(b["logprobs"]["tokens"]) == new
        assert b["text"] == a["text"] and b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
        assert_close(torch.tensor(b["logprobs"]["token_logprobs"]), torch.tensor(a["logprobs"]["token_logprobs"]),
                     atol=1e-4, rtol=0)


def test_bfloat16_engine_on_the_gpu(hf_checkpoint, tok):
    """The bfloat16 engine, graphed and launched, gives the same greedy text, with cuDNN's attention
    off (it plans every new shape, milliseconds of host time a layer: worker/runner.py)."""
    bf16 = load_model(str(hf_checkpoint), device=CUDA, dtype=torch.bfloat16)
    jobs = lambda: [job(tok, [p], max_tokens=24) for p in PROMPTS[:3]]  # noqa: E731
    texts = []
    for graphs in (False, True):
        engine, _ = make_engine(bf16, tok, cuda_graphs=graphs)
        texts.append([r["choices"][0]["text"] for r in run_all(engine, jobs())])
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert texts[0] == texts[1] and all(texts[0])


def test_a_step_ahead_on_the_gpu_gives_what_a_step_at_a_time_gives(model, tok):
    """tests/test_overlap.py's mixed batch on the GPU, where running a step ahead is the default:
    the same completions as taking each step's tokens in before the next."""
    import test_overlap

    assert make_engine(model, tok)[0].overlap
    test_overlap.test_a_step_ahead_gives_what_a_step_at_a_time_gives(model, tok)


def test_several_decode_forwards_a_step_on_the_gpu_give_what_a_step_at_a_time_gives(model, tok):
    """tests/test_overlap.py's check of `decode_steps` on the GPU (replayed CUDA graphs, draws inside
    them)."""
    import test_overlap

    test_overlap.test_several_decode_forwards_a_step_give_what_a_step_at_a_time_gives(model, tok)


def test_rows_draw_inside_the_cuda_graphs_what_the_sampler_draws(model, tok):
    """tests/test_overlap.py's check of the draws recorded beside each batch's decode graphs
    (nanogpt/runtime/cuda_graphs.py, worker/sampling.py GraphDraws), replayed from CUDA graphs."""
    import test_overlap

    test_overlap.test_rows_draw_inside_the_graphs_what_the_sampler_draws(model, tok, 4)


def test_prompts_fed_as_rows_of_the_cuda_graphs_give_what_eager_prefills_give(model, tok, monkeypatch):
    """tests/test_overlap.py's check of prompts fed as rows of the decode's graphs, replayed from
    CUDA graphs: the Triton attention kernel reads a chunk's earlier keys from the step's own rows,
    whose programs write them to the cache at the same time."""
    import test_overlap

    test_overlap.test_prompts_fed_as_rows_of_the_graphs_give_what_eager_prefills_give(model, tok, monkeypatch)


def test_decode_steps_never_wait_for_the_gpu(model, tok):
    """A decode step (graphed forward, greedy, seeded top-p and penalized rows, a row short of its
    min_tokens, logprobs, the tokens to the host) queues its work without one synchronizing call: torch's sync debug mode raises on
    any (a copy from pageable memory, .item(), nonzero); the step before's tokens arrive by their
    copy's event alone."""
    engine, _ = make_engine(model, tok)
    sampled = [job(tok, [PROMPTS[0]], max_tokens=40, logprobs=2),
               job(tok, [PROMPTS[1]], max_tokens=40, temperature=0.8, top_p=0.9, seed=1),
               job(tok, [PROMPTS[3]], max_tokens=40, temperature=1.0, presence_penalty=0.5, seed=2)]
    # rows drawing from their logits alone draw inside the graphs (Runner.decode_in_graphs)
    greedy = [job(tok, [PROMPTS[0]], max_tokens=60, logit_bias={tok.eos_token_id: -100}),
              job(tok, [PROMPTS[1]], max_tokens=60, allowed_token_ids=list(range(200, 4000)))]
    truncated = [job(tok, [PROMPTS[0]], max_tokens=60, temperature=0.9, top_p=0.9, seed=3),
                 job(tok, [PROMPTS[1]], max_tokens=60, temperature=0.7, min_p=0.05, seed=4)]
    penalized = [job(tok, [PROMPTS[0]], max_tokens=60, temperature=0.9, presence_penalty=0.4, seed=5),
                 job(tok, [PROMPTS[1]], max_tokens=60, repetition_penalty=1.3)]
    early = [job(tok, [PROMPTS[0]], max_tokens=60, min_tokens=50, stop_token_ids=[11, 13]),
             job(tok, [PROMPTS[1]], max_tokens=60, temperature=0.8, seed=6)]
    for jobs in (sampled, greedy, truncated, penalized, early):
        handles = [engine.submit(j) for j in jobs]
        for _ in range(3):  # prefills, first draws
            engine.step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        while not all(h.done for h in handles):
            engine.step()
        assert all(len(h.result()["choices"][0]["text"]) for h in handles)
    kinds = {kind for (_, kind), n in engine.runner.graphs.draws.items() if n}
    assert {"greedy", "truncated", "penalized"} <= kinds


@DTYPES
def test_the_decode_attention_kernel_attends_as_pytorchs_ops_do(dtype):
    """The decode step's attention by the Triton kernel (nanogpt/kernels/triton_decode.py), which
    also writes the step's keys and values, against DecodeWindow's PyTorch ops: the same outputs and
    the same cache written; rows in any slot order, two padding rows sharing a slot and position, a
    local window, GPT-2's, GPT-2 XL's, Pythia's and GPT-J's head sizes; then from a CUDA graph
    recorded at other positions, as the engine replays it."""
    torch.manual_seed(0)
    tolerance = FLOAT32 if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for heads, hs in ((12, 64), (25, 64), (4, 80), (2, 256)):
        assert decode_attention.serves(CUDA, dtype, hs)
        cache = [torch.randn(40, heads, 300, hs, device=CUDA).to(dtype) for _ in range(2)]
        for rows in (1, 33):
            slots = torch.randperm(39, device=CUDA)[:rows]
            positions = torch.randint(0, 298, (rows,), device=CUDA)
            if rows > 1:
                slots[-2:], positions[-2:] = 39, 0
            span = 299
            q, k, v = (torch.randn(rows, heads, 1, hs, device=CUDA).to(dtype) for _ in range(3))
            k[-2:], v[-2:] = k[-1], v[-1]  # padding rows write the same key and value (token 0's)
            for local in (None, 7):
                want_k, want_v = (c.clone() for c in cache)
                want = DecodeWindow(slots, positions, torch.arange(span, device=CUDA)).attend(
                    q, k, v, want_k, want_v, local=local)
                got_k, got_v = (c.clone() for c in cache)
                own = DecodeWindow(slots, positions, torch.arange(span, device=CUDA), own_kernel=True)
                got = own.attend(q, k, v, got_k, got_v, local=local)
                assert_close(got.float(), want.float(), **tolerance)
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # replayed from a graph: the positions (and so each row's keys) are read at replay
    cache_k, cache_v = (c.clone() for c in cache)
    window = DecodeWindow(slots, positions, torch.arange(span, device=CUDA), own_kernel=True)
    window.attend(q, k, v, cache_k, cache_v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = window.attend(q, k, v, cache_k, cache_v)
    positions.copy_(torch.randint(0, 298, (rows,), device=CUDA))
    positions[-2:] = 0
    written_k, written_v = cache_k.clone(), cache_v.clone()
    want = DecodeWindow(slots, positions, torch.arange(span, device=CUDA)).attend(q, k, v, written_k, written_v)
    graph.replay()
    assert_close(out.float(), want.float(), **tolerance)
    assert torch.equal(cache_k, written_k) and torch.equal(cache_v, written_v)


def test_without_max_batch_the_kv_cache_takes_its_share_of_the_free_memory(model, tok):
    from nanogpt.runtime import kv_cache
    from worker.engine import Engine

    free, _ = torch.cuda.mem_get_info()
    engine = Engine(model, tok, max_batch=None)
    per_slot = KVCache.bytes_per_token(model.config, engine.runner.cache.k[0].dtype) * engine.max_len
    assert engine.runner.slots == min(kv_cache.GPU_SLOTS, int(free * kv_cache.GPU_MEMORY_SHARE) // per_slot)
    assert engine.runner.cache.nbytes() <= free * kv_cache.GPU_MEMORY_SHARE + 2 * per_slot  # the spare slot
    assert engine.generate(job(tok, max_tokens=4))["usage"]["completion_tokens"] == 4


# ---- two replicas, one per GPU ----

def tokens_by_device(metrics_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {sample.labels["device"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "nanoserve_worker_tokens_generated_total"}


def test_two_replicas_with_device_all(hf_checkpoint, tok, hf, tmp_path):
    """`processor.py --device all` on two or more GPUs: one engine per GPU, all fed from the model's
    queue; requests through gunicorn and the openai client reach every GPU and give transformers'
    greedy text."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"two replicas need two GPUs; torch.cuda.device_count() is {count}")
    import openai

    from stack import start_gunicorn, start_processor, write_models_toml
    from web.dev.local_redis import free_port, start_redis

    devices = [f"cuda:{i}" for i in range(count)]
    models = write_models_toml(tmp_path / "models.toml", {"tiny": hf_checkpoint}, max_batch=4)
    port = free_port()
    greedy = hf_greedy(hf, tok.encode(PROMPTS[1]), 24)[0]
    want = tok.decode(greedy[:greedy.index(tok.eos_token_id)] if tok.eos_token_id in greedy else greedy)  # EOS: a stop
    server = start_redis()
    try:
        with start_processor(server.url, models, device="all", concurrency=2, log_dir=tmp_path,
                             extra_args=["--metrics-port", str(port)]) as worker, \
                start_gunicorn(server.url, models, env={"NANOSERVE_AUTH": "disabled"}, workers=1, threads=16,
                               log_dir=tmp_path) as web:
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 180  # the metrics server starts once every engine is built
            while True:
                try:
                    assert sorted(tokens_by_device(metrics_url)) == devices
                    break
                except OSError:
                    assert worker.alive() and time.monotonic() < deadline, worker.logs()[-4000:]
                    time.sleep(0.5)
            records = [json.loads(line) for line in worker.logs().splitlines() if line.startswith("{")]
            ready = [r for r in records if r["msg"] == "engine ready"]
            assert sorted(r["device"] for r in ready) == devices and all(r["cuda_graphs"] > 0 for r in ready), ready

            client = openai.OpenAI(base_url=web.url + "/v1", api_key="unused", max_retries=0)
            with ThreadPoolExecutor(4 * len(devices)) as pool:  # more requests at once than one GPU's workers take
                texts = list(pool.map(lambda _: client.completions.create(
                    model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text,
                    range(8 * len(devices))))
            assert texts == [want] * len(texts)
            generated = tokens_by_device(metrics_url)
            assert sorted(generated) == devices and all(generated[d] > 0 for d in devices), generated
    finally:
        server.stop()


# ---- the engine benchmark on the GPU ----

def test_engine_bench_runs_on_cuda(hf_checkpoint, tmp_path):
    from bench import engine_bench

    # no engine-compile: the compiled step on a GPU is test_graphed_decode_gives_the_launched_tokens's,
    # and a compile of its own here costs the CUDA tests' time limit minutes on an empty cache
    systems = ["transformers", "engine", "serial", "engine-bf16", "engine-int8"]
    results = engine_bench.main([
        "--device", CUDA, "--checkpoint", str(hf_checkpoint), "--systems", ",".join(systems), "--repeats", "1",
        "--concurrency", "1,3", "--prompt-tokens", "8", "--new-tokens", "4", "--json", str(tmp_path / "bench.json"),
        "--quiet-wait", "0", "--max-foreign", "inf"])

    assert results["device"] == CUDA and results["limits"]["device"] == torch.cuda.get_device_name(CUDA)
    # int8 is a CPU mode, said so with the worker's reason; bfloat16 runs on any GPU
    assert list(results["unavailable"]) == ["engine-int8"] and "CPU only" in results["unavailable"]["engine-int8"]
    summary = results["summary"]
    assert set(summary["by_system"]) == set(systems) - {"engine-int8"}
    greedy = summary["greedy_equals_transformers"]
    assert all(greedy[name] for name in ("transformers", "engine", "serial")), greedy
    # ceilings of the GPU's float32 and bfloat16 F.linear; no fractions of the host CPU's limits
    assert list(results["limits"]["ceilings"]) == ["float32", "bfloat16"]
    for name, by_c in summary["by_system"].items():
        assert set(by_c) == {1, 3}
        for row in by_c.values():
            assert row["tokens_per_s"] > 0 and row["ceiling_fraction"] > 0
            assert "matmul_peak_fraction" not in row and "copy_bandwidth_fraction" not in row
    assert json.loads((tmp_path / "bench.json").read_text())["device"] == CUDA
    table = engine_bench.markdown(results)
    assert f"GPU: {results['limits']['device']} (cuda)" in table and "| 3 | engine-bf16 |" in table


@DTYPES
def test_layer_norms_that_add_the_residual_in_their_pass_give_the_plain_models_logits(pair, dtype):
    """A GPU engine's layer norms add the residual stream's pending sub-layer in their own pass
    (nanogpt/kernels/norms.py `fuse_layer_norms`, the Triton kernel of triton_norm.py), and its linear
    layers apply their GELU in the matmul's epilogue (epilogue.py): every norm of the model taken;
    the kernel's sums equal PyTorch's add and its norms F.layer_norm's; prefill and decode logits as
    the plain model's, eager and replayed from a CUDA graph."""
    from torch.nn import functional as F

    from nanogpt.kernels import epilogue, norms, triton_norm

    x, y = (torch.randn(5, 1, 1600, device=CUDA).to(dtype) for _ in range(2))
    weight, bias = (torch.randn(1600, device=CUDA).to(dtype) for _ in range(2))
    total, normed = triton_norm.add_layer_norm(x, y, weight, bias, 1e-5)
    assert torch.equal(total, x + y)  # rounded to nearest, as PyTorch's add
    assert_close(normed.float(), F.layer_norm(x + y, (1600,), weight, bias, 1e-5).float(), **TOLERANCE[dtype])

    plain, fused = (load_model(str(pair.directory), device=CUDA, dtype=dtype) for _ in range(2))
    assert norms.fuse_layer_norms(fused) == 2 * fused.config.n_layer + 1
    # and the MLPs' GELU in the matmul's epilogue, where its self-check found cuBLASLt's the tanh one
    assert epilogue.fuse_epilogues(fused) == (4 * fused.config.n_layer + 1 if epilogue.epilogues_work(
        torch.device(CUDA, torch.cuda.current_device()), dtype) else 0)
    seq = random_seq(20, 7)
    logits = []
    for model in (plain, fused):
        cache = KVCache(model.config, max_slots=2, max_len=CONTEXT, device=CUDA, dtype=dtype)
        first = cached_call(model, cache, [(1, seq, 0, 12)])
        tokens, slots, positions = (torch.tensor(v, device=CUDA) for v in ([seq[12]], [1], [12]))
        keys = torch.arange(16, device=CUDA)
        logits.append((first, model.forward_decode(tokens, slots, positions, cache, keys)))
        if model is fused:  # the same step replayed from a graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = model.forward_decode(tokens, slots, positions, cache, keys)
            graph.replay()
            assert_close(replayed, logits[-1][1], **TOLERANCE[dtype])
    for want, got in zip(*logits):
        assert_close(got, want, **TOLERANCE[dtype])


@DTYPES
def test_few_row_matmuls_give_the_plain_models_logits_whichever_kernel_wins(pair, dtype):
    """A GPU engine's linear layers take the project's few-row matmul (nanogpt/kernels/few_rows.py,
    the Triton kernel of triton_gemv.py) at the row counts where it timed faster than cuBLAS: the
    kernel gives F.linear's output with every block configuration, and the activations', at 1, 3
    and 8 rows;
    `fuse_few_rows` swaps only layers it found faster and names them; the model's decode logits, with
    every layer taking the kernel and with what the timing chose, eager and replayed from a CUDA
    graph, are the plain model's."""
    from torch.nn import functional as F

    from nanogpt.kernels import few_rows, triton_gemv
    from worker.runner import gpu_time

    weight, bias = torch.randn(200, 1600, device=CUDA).to(dtype), torch.randn(200, device=CUDA).to(dtype)
    for rows in (1, 3, triton_gemv.MAX_ROWS):  # each block configuration a compile: the activations on one
        x = torch.randn(rows, 1600, device=CUDA).to(dtype)
        plain = F.linear(x.float(), weight.float(), bias.float())
        for config in triton_gemv.configs(rows):
            assert_close(triton_gemv.linear(x, weight, bias, None, config).float(), plain, **TOLERANCE[dtype])
        for activation, want in (("gelu_tanh", F.gelu(plain, approximate="tanh")), ("gelu", F.gelu(plain)),
                                 ("relu", F.relu(plain))):
            got = triton_gemv.linear(x, weight, bias, activation, triton_gemv.configs(rows)[0])
            assert_close(got.float(), want, **TOLERANCE[dtype])

    plain, forced, timed = (load_model(str(pair.directory), device=CUDA, dtype=dtype) for _ in range(3))
    layers = [m for m in forced.modules() if isinstance(m, torch.nn.Linear)]
    for module in layers:
        module.__class__ = few_rows._few_rows(type(module))
        module.kernel_rows = {r: triton_gemv.configs(r)[0] for r in few_rows.ROW_COUNTS}
    chosen = few_rows.fuse_few_rows(timed, gpu_time)
    swapped = [m for m in timed.modules() if isinstance(m, few_rows.FewRows)]
    assert bool(chosen) == bool(swapped) == (few_rows.describe(timed) is not None)
    for module in swapped:
        assert set(module.kernel_rows) <= set(few_rows.ROW_COUNTS)
    assert_same_decode_logits(plain, forced, timed, dtype)


def assert_same_decode_logits(plain, forced, timed, dtype) -> None:
    """The decode logits of `forced` (every swapped layer taking its kernel) and `timed` (what the
    timing chose) are `plain`'s at 1, 3 and 8 rows; `forced`'s also replayed from a CUDA graph."""
    seq = random_seq(20, 7)
    for rows in (1, 3, 8):
        logits = []
        for model in (plain, forced, timed):
            cache = KVCache(model.config, max_slots=rows + 1, max_len=CONTEXT, device=CUDA, dtype=dtype)
            for slot in range(rows):
                cached_call(model, cache, [(slot, seq, 0, 12)])
            tokens = torch.tensor([seq[12]] * rows, device=CUDA)
            slots, positions = torch.arange(rows, device=CUDA), torch.full((rows,), 12, device=CUDA)
            keys = torch.arange(16, device=CUDA)
            logits.append(model.forward_decode(tokens, slots, positions, cache, keys))
            if model is forced:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    replayed = model.forward_decode(tokens, slots, positions, cache, keys)
                graph.replay()
                assert_close(replayed, logits[-1], **TOLERANCE[dtype])
        for got in logits[1:]:
            assert_close(got, logits[0], **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("name", ["gpt_neox", "gptj"])
def test_parallel_blocks_through_the_norm_fed_matmuls_give_the_plain_models_logits(family_checkpoints, name, dtype):
    """GPT-NeoX's parallel block (two norms) and GPT-J's (one norm feeding both matmuls), their
    norm-fed layers taking the kernel with its erf or tanh GELU (nanogpt/layers.py `parallel_block`),
    and with what the timing chose: the plain model's decode logits, eager and from a CUDA graph."""
    from nanogpt.kernels import few_rows, triton_gemv
    from nanogpt.layers import norm_project
    from worker.runner import gpu_time

    directory = family_checkpoints[name]
    plain, forced, timed = (load_model(str(directory), device=CUDA, dtype=dtype) for _ in range(3))
    fed = {id(layer): layer for block in forced.modules() for _, layer, _ in getattr(block, "norm_fed", lambda: ())()}
    assert len(fed) >= 2 * plain.config.n_layer
    for layer in fed.values():
        layer.__class__ = few_rows._few_rows(type(layer))
        layer.norm_rows = {r: triton_gemv.configs(r)[0] for r in few_rows.ROW_COUNTS}
    few_rows.fuse_few_rows(timed, gpu_time)
    few_rows.fuse_norm_linears(timed, gpu_time, norm_project)
    assert_same_decode_logits(plain, forced, timed, dtype)


@DTYPES
def test_norm_fed_matmuls_give_the_plain_models_logits_whichever_kernel_wins(pair, dtype):
    """A pre-norm block's q, k, v projection and MLP matmul may normalize their rows as they read them
    (triton_gemv.norm_linear, chosen by few_rows.fuse_norm_linears where timed faster than the norm
    and the layer as they are): the kernel gives the add, F.layer_norm and F.linear's outputs with
    every block configuration at 1, 3 and 8 rows; the model's decode logits, with every norm-fed layer
    taking it and with what the timing chose, eager and replayed from a CUDA graph, are the plain
    model's."""
    from torch.nn import functional as F

    from nanogpt.kernels import few_rows, triton_gemv
    from nanogpt.layers import norm_project
    from worker.runner import gpu_time

    width = 1600
    weight, bias = torch.randn(200, width, device=CUDA).to(dtype), torch.randn(200, device=CUDA).to(dtype)
    gamma, beta = torch.randn(width, device=CUDA).to(dtype), torch.randn(width, device=CUDA).to(dtype)
    for rows in (1, 3, triton_gemv.MAX_ROWS):
        x, y = (torch.randn(rows, width, device=CUDA) * 3 + 1).to(dtype), torch.randn(rows, width, device=CUDA).to(dtype)
        stream = x + y
        h = F.layer_norm(stream, (width,), gamma, beta, 1e-5)
        want = F.gelu(F.linear(h.float(), weight.float(), bias.float()), approximate="tanh")
        for config in triton_gemv.configs(rows):
            total, out = triton_gemv.norm_linear(x, y, gamma, beta, 1e-5, weight, bias, "gelu_tanh", config)
            assert torch.equal(total, stream)
            assert_close(out.float(), want, **TOLERANCE[dtype])

    plain, forced, timed = (load_model(str(pair.directory), device=CUDA, dtype=dtype) for _ in range(3))
    fed = [layer for block in forced.modules() for _, layer, _ in getattr(block, "norm_fed", lambda: ())()]
    assert fed
    for layer in fed:
        layer.__class__ = few_rows._few_rows(type(layer))
        layer.norm_rows = {r: triton_gemv.configs(r)[0] for r in few_rows.ROW_COUNTS}
    few_rows.fuse_few_rows(timed, gpu_time)
    chosen = few_rows.fuse_norm_linears(timed, gpu_time, norm_project)
    normed = [m for m in timed.modules() if isinstance(m, few_rows.FewRows) and m.norm_rows]
    assert bool(chosen) == bool(normed)
    assert_same_decode_logits(plain, forced, timed, dtype)
