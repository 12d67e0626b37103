"""Structured output's cost: the engine's decode tokens/s with a JSON schema against the same requests
without one, same process, same run, medians of repeats (docs/performance.md, "Structured output").

    python -m bench.structured_bench                 # GPT-2 small's shape, 1 and 32 requests, this CPU
    python -m bench.structured_bench --device cuda

Every request decodes exactly `--new` tokens either way: the end of text is banned (logit_bias), and
the schema's one string must hold 4000 characters or more, so no constrained completion ends early.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import EOS, checkpoint, write_results
from bench.engine_bench import code_version

SCHEMA = {"type": "object", "required": ["story"], "additionalProperties": False,
          "properties": {"story": {"type": "string", "minLength": 4000}}}


def measure(engine, tokenizer, grammar: str | None, requests: int, new: int, prompt_len: int, seed: int) -> float:
    """Decode tokens/s of `requests` concurrent ones (the prefills are timed apart and left out)."""
    from worker.protocol import CompletionJob

    prompt = tokenizer.encode("Once upon a time " * prompt_len)[:prompt_len]
    jobs = [CompletionJob(id=f"b{seed}-{i}", model="m", prompts=[prompt], max_tokens=new, temperature=1.0,
                          seed=seed + i, logit_bias={EOS: -100.0}, grammar=grammar) for i in range(requests)]
    handles = [engine.submit(job) for job in jobs]
    while not all(len(s.tokens) >= 1 for r in engine.scheduler.requests.values() for s in r.seqs) or \
            len(engine.scheduler.requests) < requests:
        engine.step()  # the prefills and first tokens
    started = time.perf_counter()
    while not all(h.done for h in handles):
        engine.step()
    seconds = time.perf_counter() - started
    tokens = sum(c["usage"]["completion_tokens"] - 1 for c in (h.result() for h in handles))
    return tokens / seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gpt2-small")
    parser.add_argument("--checkpoint", help="a Hugging Face directory instead of --shape's random checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/.cache/structured_bench.json", help="the results as JSON")
    args = parser.parse_args(argv)

    from llguidance import LLMatcher

    from models.tokenizer import load_tokenizer
    from nanogpt.checkpoint import load_model
    from nanogpt.kernels.machine import cpu_name
    from web.api.structured import JSON_OPTIONS
    from worker.engine import Engine

    path = args.checkpoint or checkpoint(args.shape)
    tokenizer = load_tokenizer(path)
    engine = Engine(load_model(str(path), device=args.device), tokenizer, max_batch=max(args.requests))
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    measure(engine, tokenizer, grammar, 2, 8, args.prompt, 0)  # warm up both paths
    measure(engine, tokenizer, None, 2, 8, args.prompt, 0)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    rows = []
    for requests in args.requests:
        runs = {"plain": [], "json schema": []}
        for repeat in range(args.repeats):  # alternated, so a drift of the machine hits both alike
            for name, g in (("plain", None), ("json schema", grammar)):
                runs[name].append(measure(engine, tokenizer, g, requests, args.new, args.prompt, 100 * repeat))
        plain, constrained = statistics.median(runs["plain"]), statistics.median(runs["json schema"])
        rows.append({"requests": requests, "plain_tokens_per_s": round(plain, 1),
                     "json_schema_tokens_per_s": round(constrained, 1), "ratio": round(constrained / plain, 3),
                     "runs": runs})
    results = {"device": device, "shape": str(args.checkpoint or args.shape), "new_tokens": args.new, "repeats": args.repeats,
               "code": code_version(), "rows": rows}
    table = "\n".join([f"{results['shape']} on {device}; decode tokens/s, medians of {args.repeats}",
                       "| requests | without | with a JSON schema | ratio |", "| ---: | ---: | ---: | ---: |"] +
                      [f"| {row['requests']} | {row['plain_tokens_per_s']} | {row['json_schema_tokens_per_s']} | "
                       f"{row['ratio']} |" for row in rows])
    write_results(results, table, args.out)
    return results


if __name__ == "__main__":
    main()
