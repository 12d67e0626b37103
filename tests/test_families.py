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
from nanogpt.runtime.kv_cache import KVCache
from test_engine import PROMPTS, job, make_engine, run_all
from test_model import cached_batch, cached_call, random_seq
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
            return self.hf(torch.tensor([seq], device=self.hf.device)).logits[0]

    def greedy(self, prompt_ids, max_new):
        """transformers' greedy tokens over the tokenizer's vocabulary (GPT-J's padding rows are no
        tokens), and each step's log_softmax over every row of the head, at the tokenizer's ids."""
        V, rows = self.tok.vocab_size, self.hf.config.vocab_size
        out = self.hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                               max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=self.tok.eos_token_id,
                               suppress_tokens=list(range(V, rows)) or None)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        return tokens, torch.log_softmax(torch.cat(out.logits).float(), -1)[:, :V]


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request, family_checkpoints) -> Family:
    import transformers

    directory = family_checkpoints[request.param]
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


def test_decode_rows_and_prefill_chunks_packed_in_one_forward_match_transformers(family):
    """forward_packed, as the engine runs a step in which some sequences decode while others
    prefill (ragged, padded chunks): every row's logits equal transformers' at that position, past
    GPT-Neo's local window and across rotary positions, and the cache then serves plain decode."""
    cache = KVCache(family.ours.config, max_slots=6, max_len=CONTEXT)
    slot_of = dict(a=4, b=0, c=2, d=5)
    seqs = {name: random_seq(40, seed) for seed, name in enumerate("abcd", start=1)}
    refs = {name: family.reference(seq) for name, seq in seqs.items()}
    done = dict.fromkeys(seqs, 0)

    def step(*parts):
        batches = [cached_batch([(slot_of[name], seqs[name], done[name], n) for name, n in part], "cpu")
                   for part in parts]
        outs = family.ours.forward_packed(batches, cache)
        for part, out in zip(parts, outs):
            for i, (name, n) in enumerate(part):
                assert_close(out[i], refs[name][done[name] + n - 1], **TOL)
                done[name] += n

    step([("a", 9), ("b", 4)])                    # one part: two prompts
    step([("a", 1), ("b", 1)], [("c", 7)])        # decoding beside a prompt
    for _ in range(2):
        step([("b", 1), ("a", 1), ("c", 1)], [("d", 10)])
    step([("a", 1), ("d", 1)], [("b", 18), ("c", 3)])  # a padded chunk
    out = cached_call(family.ours, cache, [(slot_of[name], seqs[name], done[name], 1) for name in "abcd"])
    for i, name in enumerate("abcd"):
        assert_close(out[i], refs[name][done[name]], **TOL)


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
    full = torch.log_softmax(family.reference(prompt).float(), -1)  # over every row of the head, as transformers
    assert choice["text"] == PROMPTS[3] + family.tok.decode(gen)  # OPT's BOS is no text of the prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [family.tok.token_string(t) for t in prompt + gen]
    assert lp["token_logprobs"][0] is None
    assert_close(torch.tensor(lp["token_logprobs"][1:len(prompt)]),
                 full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0)


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---- what one family has and the others do not ----

@pytest.fixture(scope="module")
def opt(family_checkpoints):
    directory = family_checkpoints["opt"]
    return directory, load_model(directory), load_tokenizer(directory)


def test_opt_text_prompts_start_with_bos_counted_in_usage(opt):
    """OPT was trained with `</s>` before every document: it starts every text prompt (as
    transformers' OPT tokenizer puts it), counts as a prompt token (as OPT's API servers count it),
    shows as no text and as `</s>` in logprobs."""
    from transformers import AutoTokenizer

    directory, model, tok = opt
    ids = tok.encode("Hello world")
    assert ids[0] == tok.prompt_bos == tok.eos_token_id == 2
    assert ids == AutoTokenizer.from_pretrained(directory)("Hello world").input_ids
    result = make_engine(model, tok)[0].generate(job(tok, ["Hello world"], echo=True, logprobs=0, max_tokens=2))
    assert result["usage"]["prompt_tokens"] == len(ids) == 3
    choice = result["choices"][0]
    assert choice["text"].startswith("Hello world")
    assert choice["logprobs"]["tokens"][:3] == ["</s>", "Hello", " world"]
    assert choice["logprobs"]["text_offset"][:3] == [0, 0, 5]


def test_gptj_padding_rows_are_never_sampled(tmp_path):
    """GPT-J's checkpoint has 50400 rows, its tokenizer 50257 tokens: even where the padding rows
    have the largest logits, greedy and sampled tokens are the tokenizer's; their logprobs are of the
    distribution over every row, as transformers reports them (here the padding rows hold its mass)."""
    directory = make_family_checkpoint(tmp_path, "gptj")
    model, tok = load_model(directory), load_tokenizer(directory)
    assert (model.config.vocab_size, tok.vocab_size) == (50400, 50257)
    with torch.no_grad():
        model.lm_head.bias[50257:] = 1e4  # a padding row would win every draw
    engine, sink = make_engine(model, tok)
    for temperature in (0.0, 1.0):
        j = job(tok, [PROMPTS[0]], temperature=temperature, max_tokens=6, logprobs=2)
        choice = engine.generate(j)["choices"][0]
        ids = [t for _, d in sink.of(j.id, "delta") for t in d["token_ids"]]
        assert len(ids) == 6 and max(ids) < 50257
        assert max(choice["logprobs"]["token_logprobs"]) < -1000


# ---- loading: shards, half precision, unsupported families ----

def test_sharded_checkpoints_load(tmp_path):
    """pytorch_model-0000x-of-0000y.bin with and without their index, and safetensors shards."""
    import json

    from safetensors.torch import load_file, save_file

    source = make_family_checkpoint(tmp_path / "one", "gpt_neox", with_tokenizer=False)
    state = load_file(source / "model.safetensors")
    names = sorted(state)
    parts = [names[i::3] for i in range(3)]
    reference = load_model(source)(torch.tensor([[1, 2, 3, 4]]))
    for layout in ("bin+index", "bin", "safetensors+index"):
        directory = tmp_path / layout
        directory.mkdir()
        (directory / "config.json").write_bytes((source / "config.json").read_bytes())
        ext = "safetensors" if layout.startswith("safetensors") else "bin"
        stem = "model" if ext == "safetensors" else "pytorch_model"
        weight_map = {}
        for i, keys in enumerate(parts, start=1):
            shard = f"{stem}-{i:05d}-of-00003.{ext}"
            tensors = {k: state[k].contiguous() for k in keys}
            save_file(tensors, directory / shard) if ext == "safetensors" else torch.save(tensors, directory / shard)
            weight_map.update(dict.fromkeys(keys, shard))
        if layout.endswith("index"):
            (directory / f"{stem}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert_close(load_model(directory)(torch.tensor([[1, 2, 3, 4]])), reference, rtol=0, atol=0)
    (tmp_path / "bin" / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(Exception, match=r"2 of the 3 bin shards are here"):
        load_model(tmp_path / "bin")


class Float32Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every float32 tensor of more than a few elements that an operation produces."""

    def __init__(self):
        super().__init__()
        self.produced = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta" and t.numel() > 64:
                self.produced.append(str(func))
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_without_a_float32_copy(tmp_path, dtype):
    directory = make_family_checkpoint(tmp_path, "opt", dtype=dtype, with_tokenizer=False)
    with Float32Watch() as watch:
        model = load_model(directory, dtype=dtype)
    assert not watch.produced
    assert model.dtype == dtype and {p.dtype for p in model.parameters()} == {dtype}
    assert model.lm_head.weight is model.embed_tokens.weight
    with Float32Watch() as watch:  # the watch sees a conversion when there is one
        exact = load_model(directory, dtype=torch.float32)
    assert watch.produced
    ids = torch.tensor([[2, 31414, 232, 328]])
    assert_close(model(ids), exact(ids), rtol=0.02, atol=0.1)


def test_an_unsupported_model_type_is_named(tmp_path):
    from nanogpt.checkpoint import CheckpointError

    (tmp_path / "config.json").write_text('{"model_type": "bloom", "n_layer": 2}')
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'config.json'}: model_type `bloom` is not supported "
                                              r"\(supported: gpt2, gpt_neo, gptj, opt, gpt_neox\)"):
        load_model(tmp_path)


# ---- the other paths of the serving contract: the decode step, half precision, int8 ----

def test_the_decode_step_matches_transformers(family):
    """forward_decode (what the engine compiles): rows in any slot order, each at its own position,
    past GPT-Neo's local window and through the rotary angles."""
    cache = KVCache(family.ours.config, max_slots=4, max_len=CONTEXT)
    seqs = [random_seq(24, seed) for seed in (11, 12, 13)]
    refs = [family.reference(seq) for seq in seqs]
    slots, prefilled = [3, 0, 2], [9, 4, 12]
    cached_call(family.ours, cache, [(slot, seq, 0, n) for slot, seq, n in zip(slots, seqs, prefilled)])
    for step in range(6):
        positions = [n + step for n in prefilled]
        logits = family.ours.forward_decode(torch.tensor([seq[p] for seq, p in zip(seqs, positions)]),
                                            torch.tensor(slots), torch.tensor(positions), cache,
                                            torch.arange(max(positions) + 1))
        for b, (ref, p) in enumerate(zip(refs, positions)):
            assert_close(logits[b], ref[p], **TOL)


def test_a_head_aligned_with_zero_rows_gives_the_same_logits(family):
    """align_head (what a GPU engine does to its model) pads the output layer to a multiple of 64
    rows: prefill, packed and decode forwards give as many logits as before, transformers' to 1e-5,
    and a tied embedding keeps its rows."""
    aligned = load_model(family.directory)
    aligned.align_head(64)
    V = family.ours.config.vocab_size
    assert aligned.output_layer.weight.shape[0] % 64 == 0 and aligned.token_embedding.weight.shape[0] == V
    cache = KVCache(aligned.config, max_slots=3, max_len=CONTEXT)
    seqs = [random_seq(12, seed) for seed in (21, 22)]
    refs = [family.reference(seq) for seq in seqs]
    prefill = cached_call(aligned, cache, [(0, seqs[0], 0, 7)])
    [packed] = aligned.forward_packed([cached_batch([(2, seqs[1], 0, 5)], "cpu")], cache)
    decoded = aligned.forward_decode(torch.tensor([seqs[0][7], seqs[1][5]]), torch.tensor([0, 2]),
                                     torch.tensor([7, 5]), cache, torch.arange(8))
    for logits, want in ((prefill[0], refs[0][6]), (packed[0], refs[1][4]), (decoded[0], refs[0][7]),
                         (decoded[1], refs[1][5])):
        assert logits.shape == (V,)
        assert_close(logits, want, **TOL)


def test_prompt_tokens_as_rows_of_the_decode_step_match_transformers(family):
    """The compiled engine's mixed step (worker/runner.py `_run_mixed`), uncompiled: decoding rows
    and prompt chunks' tokens side by side as rows of forward_decode, each token at its own slot and
    position, logits only for the decoding rows and each chunk's last token (`out`). Each chunk's
    tokens attend to each other causally, past GPT-Neo's local window and through the rotary
    angles, and the cache they wrote then serves plain decode. Attended by the project's kernel
    where it is built (eight rows or more), else by DecodeWindow's own ops."""
    cache = KVCache(family.ours.config, max_slots=5, max_len=CONTEXT)
    seqs = dict(zip("abcd", (random_seq(40, seed) for seed in (31, 32, 33, 34))))
    refs = {name: family.reference(seq) for name, seq in seqs.items()}
    slot_of = dict(a=3, b=0, c=1, d=4)
    done = dict(a=20, b=9, c=0, d=6)
    cached_call(family.ours, cache, [(slot_of[name], seqs[name], 0, done[name]) for name in "abd"])

    def step(*fed):
        """fed: (name, tokens), decoding rows first; returns nothing, checks every `out` row."""
        rows = [(name, p) for name, n in fed for p in range(done[name], done[name] + n)]
        ends = torch.tensor([n for _, n in fed]).cumsum(0) - 1
        logits = family.ours.forward_decode(torch.tensor([seqs[name][p] for name, p in rows]),
                                            torch.tensor([slot_of[name] for name, _ in rows]),
                                            torch.tensor([p for _, p in rows]), cache,
                                            torch.arange(max(p for _, p in rows) + 1), out=ends)
        assert logits.shape[0] == len(fed)
        for (name, n), got in zip(fed, logits):
            assert_close(got, refs[name][done[name] + n - 1], **TOL)
            done[name] += n

    step(("a", 1), ("b", 1), ("c", 7), ("d", 12))  # two prompts beside two decoding rows
    step(("b", 1), ("a", 1), ("d", 1), ("c", 13))  # a chunk past the local window
    for name in "abcd":
        step((name, 1))  # plain decode, one row (DecodeWindow's own ops)
    step(*((name, 1) for name in "dcab"))


def test_bfloat16_is_close(family):
    model = load_model(family.directory, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    seq = random_seq(16, 21)
    logits = model(torch.tensor([seq]))[0]
    ref = family.reference(seq)
    assert_close(logits, ref, rtol=0.05, atol=0.5)  # bfloat16 keeps ~3 significant digits
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.slow
def test_int8_serves_close_to_float32(family):
    """int8 linear layers (CPU): the engine scores the same text within 0.2 of float32's logprobs
    (scored, not generated: random weights have near ties that int8 may break either way)."""
    from nanogpt.kernels.quantize import quantize_int8

    quantized = quantize_int8(load_model(family.directory))
    assert type(quantized.blocks[0].mlp.c_fc) is not torch.nn.Linear
    scoring = lambda: [job(family.tok, [p], max_tokens=0, echo=True, logprobs=0) for p in PROMPTS]  # noqa: E731
    exact = run_all(make_engine(family.ours, family.tok)[0], scoring())
    approx = run_all(make_engine(quantized, family.tok)[0], scoring())
    for a, b in zip(exact, approx):
        a, b = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
        assert a["tokens"] == b["tokens"]
        assert_close(b["token_logprobs"][1:], a["token_logprobs"][1:], atol=0.2, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_neo", "gptj", "opt", "gpt_neox"])
def test_compiled_decode_gives_the_eager_tokens(family_checkpoints, name):
    """The compiled decode step, which a CPU worker runs by default, in every family: GPT-Neo's
    local mask, GPT-J's and GPT-NeoX's rotary angles, OPT's offset positions."""

    directory = family_checkpoints[name]
    tok = load_tokenizer(directory)
    jobs = lambda: [job(tok, [p], max_tokens=8) for p in PROMPTS[:3]]  # noqa: E731  3 rows: padded to 4
    eager = run_all(make_engine(load_model(directory), tok, max_batch=4)[0], jobs())
    engine = make_engine(load_model(directory), tok, max_batch=4, compile=True)[0]
    assert engine.runner.compiled
    compiled = run_all(engine, jobs())
    assert [r["choices"][0]["text"] for r in compiled] == [r["choices"][0]["text"] for r in eager]


@pytest.mark.parametrize("takes", ["every_layer", "the_attentions_only", "none"])
@pytest.mark.parametrize("name", ["gptj", "gpt_neox"])
def test_parallel_blocks_feed_each_norm_to_its_matmul_or_run_it_once(family_checkpoints, name, takes):
    """GPT-J's one norm and GPT-NeoX's two feed the attention's and the MLP's matmuls (nanogpt/layers.py
    `parallel_block`): where those layers take the norm in their own pass (a GPU's norm-fed kernel,
    PyTorch's ops standing in for it here) the block runs no norm module, and where one declines
    its norm runs once for it; transformers' logits either way."""
    import transformers
    from torch.nn import functional as F

    directory = family_checkpoints[name]
    hf = getattr(transformers, FAMILY_CONFIGS[name][1]).from_pretrained(directory).eval()
    ours = load_model(directory)
    taken, norms_run = [], []

    class NormFed(torch.nn.Linear):
        def norm_fused(self, x, y, norm, activation=None):
            if not self.takes:
                return None
            taken.append(self)
            x = x if y is None else x + y
            h = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            out = F.linear(h, self.weight, self.bias)
            return x, out if activation is None else activation(out)

    fed = [(norm, layer) for block in ours.blocks for norm, layer, _ in block.norm_fed()]
    assert len(fed) == 2 * len(ours.blocks)
    for norm, layer in fed:
        layer.__class__ = NormFed
        attention = layer.out_features == 3 * layer.in_features  # the q, k, v projection
        layer.takes = takes == "every_layer" or (takes == "the_attentions_only" and attention)
    for norm in {id(norm): norm for norm, _ in fed}.values():  # GPT-J's feeds two layers: hooked once
        norm.register_forward_hook(lambda module, args, out: norms_run.append(module))
    idx = torch.randint(0, load_tokenizer(directory).vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(ours(idx), hf(idx).logits, **TOL)
    norms = len({id(norm) for norm, _ in fed}) // len(ours.blocks)  # a block's: GPT-J's 1, GPT-NeoX's 2
    run = {"every_layer": 0, "the_attentions_only": 1, "none": norms}[takes]
    assert len(norms_run) == run * len(ours.blocks)
    assert len(taken) == {"every_layer": 2, "the_attentions_only": 1, "none": 0}[takes] * len(ours.blocks)
