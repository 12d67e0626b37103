"""Prefix caching's gain, with it on against off, same machine, same run (docs/performance.md,
"Prefix caching"):

- `lm-eval`: lm-evaluation-harness's `local-completions` backend scores a synthetic multiple-choice
  task (each question's choices share its context, and every question starts with the same
  few-shot examples) through the whole stack (gunicorn, Redis, processor.py): wall time, and the
  loglikelihoods on and off compared;
- `ttft`: the engine's time to first token for prompts that share a 256-token prefix (each prompt
  sent once the one before it has its answer), medians.

    python -m bench.prefix_bench                      # both, GPT-2 small's shape, this CPU
    python -m bench.prefix_bench --only ttft --device cuda
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import checkpoint, write_results
from bench.engine_bench import code_version

WORDS = ("whale camel octopus river desert ocean mountain forest village harbour lantern winter summer "
         "market sailor merchant island storm bridge castle garden library kettle orchard").split()


def task(questions: int, choices: int, shots: int, seed: int = 0) -> list[tuple[str, str]]:
    """(context, continuation) pairs as a multiple-choice task hands them to the harness."""
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    fewshot = "".join(f"Question: {sentence(14)}?\nAnswer: {sentence(3)}\n\n" for _ in range(shots))
    pairs = []
    for _ in range(questions):
        context = f"{fewshot}Question: {sentence(16)}?\nAnswer:"
        pairs += [(context, " " + sentence(rng.randint(2, 6))) for _ in range(choices)]
    return pairs


def lm_eval_run(path: Path, pairs: list[tuple[str, str]], prefix_caching: bool, device: str, work: Path) -> dict:
    """lm-eval's loglikelihood of every pair through a fresh stack: wall seconds and the results."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tests.stack import start_gunicorn, start_processor, write_models_toml
    from web.dev.local_redis import start_redis

    models = write_models_toml(work / f"models-{prefix_caching}.toml", {"m": path}, device=device, max_batch=8,
                               prefix_caching=prefix_caching)
    server = start_redis()
    try:
        with start_processor(server.url, models, models=["m"], concurrency=8, log_dir=work), \
                start_gunicorn(server.url, models, env={"NANOSERVE_AUTH": "disabled"}, log_dir=work) as web:
            api = LocalCompletionsAPI(base_url=f"{web.url}/v1/completions", model="m", tokenizer=str(path),
                                      tokenizer_backend="huggingface", tokenized_requests=False, max_length=1024)
            requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
            api.loglikelihood(requests[:2])  # the first requests pay for warming up, either way
            started = time.perf_counter()
            results = api.loglikelihood(requests)
            seconds = time.perf_counter() - started
    finally:
        server.stop()
    return {"seconds": seconds, "loglikelihoods": [float(lp) for lp, _ in results],
            "greedy": [bool(g) for _, g in results]}


def ttft_run(engine, tokenizer, prefix: list[int], prompts: int, seed: int) -> list[float]:
    """Each prompt (the prefix, then 16 tokens of its own) sent once the one before it has its first
    token: seconds from submit to first token."""
    from worker.protocol import CompletionJob

    rng, times = random.Random(seed), []
    for i in range(prompts):
        own = tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(16)))[:16]
        job = CompletionJob(id=f"t{seed}-{i}", model="m", prompts=[prefix + own], max_tokens=1, seed=i)
        started = time.perf_counter()
        engine.generate(job)
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gpt2-small")
    parser.add_argument("--checkpoint", help="a Hugging Face directory instead of --shape's random checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=("lm-eval", "ttft"))
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=256, help="ttft: the shared prefix's tokens")
    parser.add_argument("--prompts", type=int, default=12, help="ttft: prompts per run")
    parser.add_argument("--repeats", type=int, default=3, help="ttft: runs on and off, alternated")
    parser.add_argument("--out", default="bench/.cache/prefix_bench.json", help="the results as JSON")
    args = parser.parse_args(argv)

    import torch

    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels.machine import cpu_name
    from worker.engine import Engine

    path = Path(args.checkpoint) if args.checkpoint else checkpoint(args.shape)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    results = {"device": device, "shape": str(args.checkpoint or args.shape), "code": code_version()}
    if args.only in (None, "lm-eval"):
        pairs = task(args.questions, args.choices, args.shots)
        with tempfile.TemporaryDirectory() as tmp:
            off = lm_eval_run(path, pairs, False, args.device, Path(tmp))
            on = lm_eval_run(path, pairs, True, args.device, Path(tmp))
        drift = max(abs(a - b) for a, b in zip(on["loglikelihoods"], off["loglikelihoods"]))
        results["lm_eval"] = {"requests": len(pairs), "questions": args.questions, "choices": args.choices,
                              "shots": args.shots, "seconds_off": round(off["seconds"], 2),
                              "seconds_on": round(on["seconds"], 2), "ratio": round(on["seconds"] / off["seconds"], 3),
                              "max_loglikelihood_difference": drift, "same_greedy": on["greedy"] == off["greedy"]}
        print(f"lm-eval loglikelihood, {len(pairs)} requests: {off['seconds']:.1f} s off, {on['seconds']:.1f} s on "
              f"({on['seconds'] / off['seconds']:.2f}x); largest loglikelihood difference {drift:.2e}")
    if args.only in (None, "ttft"):
        tokenizer = load_tokenizer(path)
        model = load_model(str(path), device=args.device)
        engines = {on: Engine(model, tokenizer, max_batch=8, prefix_caching=on) for on in (False, True)}
        rng = random.Random(1)
        prefix = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(args.prefix)))[:args.prefix]
        for engine in engines.values():
            ttft_run(engine, tokenizer, prefix, 2, seed=99)  # warm up
        times = {False: [], True: []}
        for repeat in range(args.repeats):
            for on, engine in engines.items():
                times[on] += ttft_run(engine, tokenizer, prefix, args.prompts, seed=repeat)
        off_p50, on_p50 = statistics.median(times[False]), statistics.median(times[True])
        results["ttft"] = {"prefix_tokens": len(prefix), "own_tokens": 16, "prompts": args.prompts * args.repeats,
                           "p50_ms_off": round(off_p50 * 1e3, 1), "p50_ms_on": round(on_p50 * 1e3, 1),
                           "ratio": round(on_p50 / off_p50, 3)}
        print(f"TTFT p50 with a shared {len(prefix)}-token prefix: {off_p50 * 1e3:.1f} ms off, {on_p50 * 1e3:.1f} ms on "
              f"({on_p50 / off_p50:.2f}x)")
    write_results(results, f"{results['shape']} on {device}", args.out)
    return results


if __name__ == "__main__":
    main()
